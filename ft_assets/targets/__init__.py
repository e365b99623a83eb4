"""Where a training run's GPU work goes: the targets of ``--gpu TARGET`` and of the gpu pool's ``target`` setting.

(A *pool* is something else: the gpu and cpu run launchers of ``ft_assets.control.launcher``; a pool's runs may go
to a target.)

A run's Dagster process always stays on the control host. With the target ``local`` (the default) it trains in
that process, on this machine's GPU or CPU. Any other target starts the training worker on another machine and
talks to it through Dagster Pipes, its messages carried by the object store (``ft_assets.targets.session``): the
worker gets the code, the store and its run's settings, never the instance (no ``DAGSTER_HOME``, no database).

Each target is one module here and one ``register`` line (its text's form and a few words for ``--gpu``'s help):
it turns its URL into a ``Target``, which can start a worker (``launch``), tell whether it still runs (``poll``) and stop it (``cancel``), and gives an ``EXAMPLE`` of
its URL (the target's page under docs/deploy/ shows it; a checklist test parses it). ``parse_target`` is the one
reader of a target's text; an unknown scheme is refused in one line that lists the known ones.

| target | module | the worker runs |
|---|---|---|
| ``local`` | (none) | in the run's own process, as without a target |
| ``ssh://[user@]host[:port]?python=PATH&workdir=DIR`` | ``ft_assets.targets.ssh`` | on any host you can ssh into |
| ``slurm://[user@]login-host/partition?python=PATH`` | ``ft_assets.targets.slurm`` | as an ``sbatch`` job per attempt |
| ``skypilot:<infra>[,<infra>...]?image=IMAGE`` | ``ft_assets.targets.skypilot`` | as a SkyPilot managed job per attempt |

Every target takes ``gpus=N``: the worker's machine has N GPUs, and the worker runs one training process on each
(torchrun on that machine: ``ft_assets.targets.ranks``); it is the training settings' ``num_processes``, which may say it
instead (``processes_on``), so the plan and the bill count N cards either way.

Beside them, what a target's worker needs: ``session`` (the control host's side of its Pipes session: attempts,
cancel, the bill), ``code`` and ``bootstrap`` (the worker's ft-assets, from a wheel), ``ranks`` (torchrun of a
worker's processes, each rank's end in its exit code), and its store keys: ``credentials`` (which keys a worker gets)
and ``renewal`` (renewed while it runs). What each provider's machines, SDKs and CLIs are (shared with the run
launcher pools of ``ft_assets.control``) is in ``ft_assets.providers``.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar
from urllib.parse import parse_qs

BOOTSTRAP_LINE = 'import os; exec(os.environ.pop("FT_BOOTSTRAP"))'  # ``python -c`` of a worker with code=wheel
TARGET_TAG = "ft/gpu-target"  # the run tag that names a training run's target (``ft-assets run --gpu``, the pool)
LOCAL = "local"
WHEEL, INSTALLED = "wheel", "installed"  # a target's ``code`` setting (``ft_assets.targets.code``)


class TargetError(ValueError):
    """A target that cannot be used as written, or a worker that cannot be reached; the message is one line."""


@dataclass(frozen=True)
class GpuRequest:
    """The GPU the run's plan chose (``training_plan``): what a target that rents by the card (SkyPilot) asks for."""

    tier: str  # the cost model's offering, e.g. rtx4090-24gb
    accelerator: str  # SkyPilot's name of its card ("" when the offering has none)
    count: int  # GPUs on the worker
    mode: str  # spot | on_demand | slurm


@dataclass(frozen=True)
class WorkerLaunch:
    """One attempt of a training worker, in terms every target understands."""

    name: str  # unique per attempt: names the worker's folder, job or cluster
    module: str  # ``python -m <module> <args>``
    args: tuple[str, ...]  # nothing secret: they show in ``ps`` and in the job's script
    env: Mapping[str, str] = field(default_factory=dict)  # plain settings (the store's endpoint and region)
    secrets: Mapping[str, str] = field(default_factory=dict)  # reach the worker as the target's secrets only
    gpu: GpuRequest | None = None  # the plan's card; None when the run was planned on no GPU (a CPU run)
    gpus: int = 1  # GPUs the worker's machine needs: one for each of its training processes (``num_processes``)
    bootstrap: bool = False  # install the control host's wheel first (``code=wheel``: ``ft_assets.targets.code``)

    def argv(self, python: str) -> list[str]:
        """The worker's command with ``python``: ``python -m MODULE ARGS``, or, with ``bootstrap``, the same through
        ``bootstrap.py`` (its source in the worker's environment, ``FT_BOOTSTRAP``)."""
        if self.bootstrap:
            return [python, "-c", BOOTSTRAP_LINE, self.module, *self.args]
        return [python, "-m", self.module, *self.args]


@dataclass(frozen=True)
class WorkerState:
    """What ``poll`` saw: still running, ended with an exit code, or gone without one (its machine lost)."""

    running: bool
    exit_code: int | None = None  # None with running False: the worker vanished (kill of its host, lost node)
    detail: str = ""  # the end of the worker's output, when the target can read it

    @property
    def lost(self) -> bool:
        return not self.running and self.exit_code is None


class Target(ABC):
    """A place a training worker can run; each target subclasses this (a frozen dataclass of its URL's settings).

    ``launch`` returns a handle (plain JSON) that ``poll`` and ``cancel`` take, also in a later process: the handle is
    kept in the store, so a restarted control host finds the worker. The other members have defaults a target
    overrides where it knows better (a dataclass field of the same name does)."""

    scheme: ClassVar[str]  # the registry's key: ``ssh``, ``slurm``, ``skypilot``
    code: str = WHEEL  # wheel: the worker installs the control host's ft-assets first; installed: its python has it
    gpus: int | None = None  # the worker's GPUs, one training process each (``processes_on``); None: the settings'
    poll_s: float | None = None  # how often ``poll`` may be called; None: the session's own pace
    gpu: str | None = None  # the machine's card as a cost-model offering (``gpu=``), where the target can name it
    rental: ClassVar[str] = "on_demand"  # the rental mode its card is billed at (a Slurm partition's: slurm)

    @property
    def pinned_gpu(self) -> tuple[str, str] | None:
        """(offering, rental mode) the plan is made for, when the target names its card (``gpu=``); None: the plan
        chooses, from ``card()`` where the target can say which card its machine has."""
        return (self.gpu, self.rental) if self.gpu else None

    def card(self) -> tuple[str, int] | None:
        """The machine's first GPU (its name as ``nvidia-smi`` gives it, its memory in MiB), asked before anything is
        started; None where the target cannot know it before it rents (a cloud, a Slurm partition) or has none."""
        return None

    @abstractmethod
    def launch(self, launch: WorkerLaunch) -> dict: ...

    @abstractmethod
    def poll(self, handle: Mapping) -> WorkerState: ...

    @abstractmethod
    def cancel(self, handle: Mapping) -> None: ...

    @abstractmethod
    def describe(self) -> str: ...


@dataclass(frozen=True)
class TargetKind:
    """A registered kind of target: how its text is read, and how ``--gpu``'s help shows it."""

    scheme: str
    parser: str  # "package.module:function" that turns the target's text into its ``Target``
    usage: str  # the text's form, e.g. ``ssh://[user@]host[:port]?python=PATH&workdir=DIR``
    summary: str  # where the worker runs, in a few words

    @property
    def short(self) -> str:
        """``ssh://...``, ``skypilot:...``: the kind in a one-line error."""
        return f"{self.scheme}://..." if self.usage.startswith(f"{self.scheme}://") else f"{self.scheme}:..."


TARGETS: dict[str, TargetKind] = {}  # scheme -> its kind, in the order registered (``--gpu``'s help shows that order)
SKYPILOT_CLOUDS = ("runpod", "vast", "lambda", "aws", "gcp", "azure", "nebius", "kubernetes", "oci", "paperspace")


def register(scheme: str, parser: str, usage: str, summary: str) -> None:
    """Make ``scheme://...`` (or ``scheme:...``, as ``usage`` writes it) a target, parsed by ``parser``
    ("package.module:function"); ``usage`` and ``summary`` are its entry in ``--gpu``'s help."""
    TARGETS[scheme] = TargetKind(scheme, parser, usage, summary)


register("ssh", "ft_assets.targets.ssh:parse", "ssh://[user@]host[:port]?python=PATH&workdir=DIR",
         "a worker on a host you can ssh into")  # fmt: skip
register("skypilot", "ft_assets.targets.skypilot:parse", "skypilot:<infra>[,<infra>...]",
         "a SkyPilot managed job, e.g. skypilot:runpod,vast")  # fmt: skip
register("slurm", "ft_assets.targets.slurm:parse", "slurm://[user@]login-host/partition?python=PATH",
         "an sbatch job per attempt")  # fmt: skip


def gpu_help() -> str:
    """``--gpu``'s help: ``local`` and every registered kind, from the registry."""
    kinds = [f"{kind.usage} ({kind.summary})" for kind in TARGETS.values()]
    listed = ", ".join(kinds[:-1]) + f", or {kinds[-1]}" if len(kinds) > 1 else "".join(kinds)
    return f"where the training plane's GPU work runs: local (default: this machine), or {listed}; the run itself stays here"


@dataclass(frozen=True)
class TargetQuery:
    """A target's settings: its URL's query (``?python=...&gpu=...``), checked against the names the target knows by
    ``query_of``; a setting given twice takes its last value."""

    text: str  # the whole target, for the errors
    values: Mapping[str, list[str]]

    def one(self, name: str, default: str | None = None) -> str | None:
        return self.values[name][-1] if self.values.get(name) else default

    def every(self, name: str) -> tuple[str, ...]:
        """A repeatable setting's values (``option=``, ``sbatch=``), in order."""
        return tuple(self.values.get(name, ()))

    def count(self, name: str, default: int | None, least: int) -> int | None:
        """A whole number of at least ``least``; ``default`` when not given."""
        value = self.one(name)
        if value is None:
            return default
        if not value.isdigit() or int(value) < least:
            raise TargetError(f"GPU target {self.text!r}: {name}={value} is not a whole number >= {least}")
        return int(value)


def query_of(text: str, query: str, known: tuple[str, ...]) -> TargetQuery:
    """The settings in ``query`` (of the target ``text``); an unknown one is refused in one line that lists ``known``."""
    values = parse_qs(query, keep_blank_values=True)
    unknown = set(values) - set(known)
    if unknown:
        raise TargetError(
            f"GPU target {text!r}: unknown setting(s) {', '.join(sorted(unknown))}; known: {', '.join(known)}"
        )
    return TargetQuery(text, values)


def is_local(target: str | None) -> bool:
    """Whether ``target`` (a run's ``ft/gpu-target``) trains in the run's own process: ``local``, or nothing."""
    return (target or "").strip() in ("", LOCAL)


def worker_has_cuda(target: str | None, here: bool) -> bool:
    """Whether a run's training worker trains on CUDA: on a GPU target, yes (the machine is there for its GPU; what the
    run resolves on it, qlora for an unset ``method``, is planned and pinned on the control host); locally, ``here``."""
    return here or not is_local(target)


def processes_on(target: Target | None, training):
    """``training`` (a ``TrainingConfig``) as it runs on ``target``: ``num_processes`` is the target's ``gpus=N`` where
    the settings leave it at 1, so the plan (and with it the bill and the run's id) counts the N processes the worker
    runs. The settings and the target naming two different numbers, or more than one node, are refused in one line."""
    if target is None:
        return training
    gpus = target.gpus
    if training.num_nodes > 1:
        raise TargetError(
            f"GPU target {target.describe()}: num_nodes {training.num_nodes}; a target's worker is one machine (up to "
            "8 GPUs: set gpus=N on the target, or num_processes): use num_nodes 1"
        )
    if gpus is None or gpus == training.num_processes:
        return training
    if training.num_processes != 1:
        raise TargetError(
            f"GPU target {target.describe()}: gpus={gpus} on the target but num_processes {training.num_processes} in "
            "the training settings; the worker runs one process per GPU: give one of them, or the same number in both"
        )
    return training.model_copy(update={"num_processes": gpus})


def scheme_of(text: str) -> str:
    return text.split("://", 1)[0] if "://" in text else text.split(":", 1)[0]


def parse_target(text: str | None) -> Target | None:
    """The target ``text`` names; None for ``local`` (or nothing): train in the run's own process."""
    if is_local(text):
        return None
    text = text.strip()
    scheme = scheme_of(text)
    if scheme not in TARGETS:
        known = ", ".join([LOCAL, *sorted(kind.short for kind in TARGETS.values())])
        hint = f"; for that cloud through SkyPilot write skypilot:{text}" if scheme in SKYPILOT_CLOUDS else ""
        raise TargetError(f"GPU target {text!r}: unknown kind {scheme!r}; use one of {known}{hint}")
    module, _, function = TARGETS[scheme].parser.partition(":")
    parser: Callable[[str], Target] = getattr(importlib.import_module(module), function)
    return parser(text)
