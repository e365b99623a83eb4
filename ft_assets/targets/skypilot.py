"""The ``skypilot:<infra>[,<infra>...]`` target: each attempt of a training worker is one SkyPilot managed job.

``skypilot:runpod``, ``skypilot:vast``, ``skypilot:lambda,aws/us-east-1`` (SkyPilot's ``infra``: ``cloud[/region]``
in order of preference; ``skypilot:`` alone lets SkyPilot choose among the clouds it has credentials for). The job
rents the card the run's plan chose (``training_plan``: the offering's ``accelerator``, its GPU count, spot or
on-demand) and runs ``python -m ft_assets.training.remote``, the same worker as every target: Pipes messages through
the store, no database and no ``DAGSTER_HOME`` on the rented machine. The store's keys go in the task's ``secrets``,
which SkyPilot keeps out of its logs, dashboard and job queue; its endpoint and region go in ``envs``.

Settings (query): ``gpus`` (the cards the job rents, ``accelerators: NAME:N``, up to 8 on its one machine: the worker
trains on all of them, one process each, torchrun on the machine; default the training settings' ``num_processes``,
``ft_assets.targets.processes_on``), ``image`` (the worker image, SkyPilot's ``image_id: docker:<image>``; default PyTorch's CUDA
runtime image, ``code.DEFAULT_IMAGE``), ``python`` (the image's Python, default ``python3``), ``code`` (``wheel``, the
default: the worker installs the control host's ft-assets from the store first, ``ft_assets.targets.code``;
``installed``: the image has ft-assets, e.g. one built from ``deploy/image``), ``disk`` (GB),
``recovery`` (SkyPilot's ``job_recovery`` strategy, default ``EAGER_NEXT_REGION``), ``restarts``
(``max_restarts_on_errors``, default 0: a worker that fails is not run again by SkyPilot), ``poll`` (seconds between
looks at SkyPilot's job queue, default 30: each is a process start of SkyPilot's venv) and ``sky_python``
(the python of the SkyPilot venv; default ``$FT_SKYPILOT_PYTHON``, else this checkout's ``.venv-skypilot``).

SkyPilot recovers a preempted spot job itself: it rents another machine (the next region with
``EAGER_NEXT_REGION``) and runs the same command again. That new start of the worker claims the next message folder
of the attempt (``remote.claim_life``), resumes from the newest complete checkpoint in the store, and the attempt
counts its ``starts``; the session starts a new attempt (a new managed job) only when the job ends without
finishing: its controller lost, or the worker stopped after a SIGTERM (exit 75, reported before it exits).
Verified at SkyPilot's SDK boundary (``ft_assets_tests/fake_skypilot.py``: the task through SkyPilot's own
``sky.Task``, the job's attempts as real processes); not yet launched on a real cloud.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ft_assets.providers import sdk_venv
from ft_assets.targets import WHEEL, Target, TargetError, WorkerLaunch, WorkerState, query_of
from ft_assets.targets.code import DEFAULT_IMAGE, code_setting

EXAMPLE = "skypilot:runpod,vast"
DEFAULT_RECOVERY = {"strategy": "EAGER_NEXT_REGION", "max_restarts_on_errors": 1}  # the execute_run pool's
DEFAULT_AUTOSTOP_MINUTES = 30  # the idle sensor's threshold
MAX_GPUS_PER_NODE = 8
SETTINGS = ("image", "python", "code", "disk", "recovery", "restarts", "poll", "sky_python", "gpus")
DEFAULT_POLL_S = 30  # each look at SkyPilot's queue is a process start and ``import sky`` (3-11 s of a core)
# ManagedJobStatus values (sky.jobs.state) of a job that is not over: its worker runs, or is being (re)started
RUNNING = frozenset({"PENDING", "SUBMITTED", "STARTING", "RUNNING", "RECOVERING", "WINDING_DOWN", "CANCELLING"})
LOST = frozenset({"FAILED_CONTROLLER"})  # the jobs controller died: nothing says what became of the worker


# --- the task ------------------------------------------------------------------------------------


def ordered_infra(infra: Sequence[str], data_region: str | None) -> list[str]:
    """``infra`` (``cloud[/region[/zone]]``) with the entries in the data's region first, otherwise in order."""
    first = [i for i in infra if data_region and i.split("/")[1:2] == [data_region]]
    return first + [i for i in infra if i not in first]


def task_config(
    *,
    name: str,
    command: str,
    image: str | None,
    accelerator: str,
    gpus_per_node: int,
    nodes: int,
    spot: bool,
    infra: Sequence[str],
    disk_size: int | None,
    job_recovery: Mapping[str, Any],
    autostop_minutes: int,
    envs: Mapping[str, str],
    secrets: Mapping[str, str],
) -> dict[str, Any]:
    """A managed job's task, in SkyPilot's YAML schema (``sky.Task.from_yaml_config`` reads it)."""
    resources: dict[str, Any] = {
        "accelerators": {accelerator: gpus_per_node},
        "use_spot": spot,
        "job_recovery": dict(job_recovery),
        "autostop": {"idle_minutes": autostop_minutes, "down": True},
    }
    if image:
        resources["image_id"] = f"docker:{image}"
    if disk_size is not None:
        resources["disk_size"] = disk_size
    if infra:
        resources["ordered"] = [{"infra": entry} for entry in infra]
    return {
        "name": name,
        "num_nodes": nodes,
        "resources": resources,
        "envs": dict(envs),
        "secrets": dict(secrets),
        "run": command,
    }


def secret_values(names: Sequence[str], env: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The control host's values of the secret variables ``names``; a ValueError names the ones not set."""
    missing = [name for name in names if not env.get(name)]
    if missing:
        raise ValueError(
            f"secrets {missing} are not set on the control host (dagster-daemon's environment); the managed job "
            "gets them from there as SkyPilot secrets"
        )
    return {name: env[name] for name in names}


# --- the target ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SkyPilotTarget(Target):
    infra: tuple[str, ...] = ()
    image: str = DEFAULT_IMAGE
    python: str = "python3"
    code: str = WHEEL  # wheel: install the control host's ft-assets first; installed: the image has it
    disk: int | None = None
    recovery: str = DEFAULT_RECOVERY["strategy"]
    restarts: int = 0
    sky_python: str | None = None
    poll_s: float = DEFAULT_POLL_S  # how often the session asks whether the job still runs
    gpus: int | None = None  # cards of the job, one training process each; None: the training settings' num_processes

    scheme = "skypilot"

    def describe(self) -> str:
        return f"skypilot:{','.join(self.infra)}" if self.infra else "skypilot: (any enabled cloud)"

    def task(self, launch: WorkerLaunch) -> dict[str, Any]:
        """The managed job of one attempt: the plan's card, the worker's command, its settings and secrets."""
        gpu = launch.gpu
        if gpu is None:
            raise TargetError(f"{self.describe()}: the run's plan rents no GPU; SkyPilot rents the card the plan names")
        if not gpu.accelerator:
            raise TargetError(
                f"{self.describe()}: offering {gpu.tier} has no accelerator (SkyPilot's name for its card): add "
                "`accelerator:` to it in the cost model (FT_COST_MODEL)"
            )
        if gpu.count > MAX_GPUS_PER_NODE:
            raise TargetError(f"{self.describe()}: {gpu.count} GPUs; a worker runs on one machine (up to 8 GPUs)")
        worker = shlex.join(launch.argv(self.python))
        return task_config(
            name=launch.name,
            command=worker,
            image=self.image,
            accelerator=gpu.accelerator,
            gpus_per_node=gpu.count,  # the plan's: its num_processes (the worker's launch.gpus)
            nodes=1,
            spot=gpu.mode == "spot",
            infra=self.infra,
            disk_size=self.disk,
            job_recovery={"strategy": self.recovery, "max_restarts_on_errors": self.restarts},
            autostop_minutes=DEFAULT_AUTOSTOP_MINUTES,
            envs=launch.env,
            secrets=launch.secrets,
        )

    def _call(self, verb: str, request: dict) -> Any:
        try:
            return sdk_venv.call(verb, request, python=self.sky_python)
        except sdk_venv.SdkError as exc:
            raise TargetError(f"{self.describe()}: SkyPilot: {exc}") from None

    def launch(self, launch: WorkerLaunch) -> dict:
        task = self.task(launch)
        job = self._call("sky.launch", {"task": task, "name": task["name"]})
        return {"job_id": int(job["job_id"]), "name": task["name"], "spot": task["resources"]["use_spot"]}

    def poll(self, handle: Mapping) -> WorkerState:
        records = self._call("sky.queue", {"job_ids": [handle["job_id"]], "use_spot": handle.get("spot", False)})
        if not records:
            return WorkerState(running=False, detail=f"managed job {handle['job_id']} is not in SkyPilot's queue")
        record = records[0]
        status = record.get("status")
        if status in RUNNING:
            return WorkerState(running=True)
        if status == "SUCCEEDED":
            return WorkerState(running=False, exit_code=0)
        reason = record.get("failure_reason") or record.get("details") or ""
        detail = f"managed job {handle['job_id']} is {status}" + (f": {reason}" if reason else "")
        if status in LOST:
            return WorkerState(running=False, detail=detail)
        if status == "CANCELLED":
            detail += " (cancelled outside this run: sky jobs cancel)"
        return WorkerState(running=False, exit_code=1, detail=detail)

    def cancel(self, handle: Mapping) -> None:
        self._call("sky.cancel", {"job_ids": [handle["job_id"]]})


def parse(text: str) -> SkyPilotTarget:
    """``skypilot:<infra>[,<infra>...][?image=IMAGE&python=PATH&disk=GB&recovery=STRATEGY&restarts=N&sky_python=PATH]``."""
    body = text.split(":", 1)[1] if ":" in text else ""
    body = body[2:] if body.startswith("//") else body
    where, _, query_text = body.partition("?")
    query = query_of(text, query_text, SETTINGS)
    one, count = query.one, query.count

    infra = tuple(entry.strip() for entry in where.split(",") if entry.strip())
    bad = [entry for entry in infra if not all(entry.split("/"))]
    if bad:
        raise TargetError(f"GPU target {text!r}: {bad[0]!r} is not SkyPilot infra (cloud[/region[/zone]])")
    return SkyPilotTarget(
        infra=infra,
        image=one("image") or DEFAULT_IMAGE,
        python=one("python") or "python3",
        disk=count("disk", None, 1),
        recovery=one("recovery") or DEFAULT_RECOVERY["strategy"],
        restarts=count("restarts", 0, 0) or 0,
        sky_python=one("sky_python"),
        code=code_setting(text, one("code")),
        poll_s=count("poll", DEFAULT_POLL_S, 1),
        gpus=count("gpus", None, 1),
    )
