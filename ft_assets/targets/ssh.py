"""The ``ssh://[user@]host[:port]?python=PATH&workdir=DIR`` target: a training worker on any host you can ssh into.

A pod started by hand, a lab workstation, a Lambda instance: OpenSSH's own client runs every command, so the
user's ``~/.ssh/config``, agent and ``known_hosts`` apply (``identity=PATH`` and ``option=Key=Value`` add to them).
``python`` needs torch; with ``code=wheel`` (the default) the worker first installs the control host's ft-assets from
the store (``ft_assets.targets.code``), with ``code=installed`` it runs the ft-assets ``python`` has.
``gpu=`` names the host's card as a cost-model offering: the plan is made, and the run billed, for that card at its
on-demand price; without it the plan asks the host's ``nvidia-smi`` for its card (``card``) and takes that card's offering,
and on a host without one the cheapest offering that fits, as for a cloud.
``gpus=N``: the host has N GPUs and the worker trains on all of them, one process each (torchrun on the host; the
training settings' ``num_processes``, ``ft_assets.targets.processes_on``); the plan and the bill count N cards.
Each attempt gets its folder ``<workdir>/<attempt name>`` on the host:

- ``env`` (mode 0600): the worker's secrets, written through ssh's stdin by ``umask 077; cat > env``; the wrapper
  reads it and deletes it before the worker starts, so the secrets live only in the worker's environment;
- ``output.log``: the worker's stdout and stderr (its Dagster messages go through the store);
- ``wrapper.pid`` / ``worker.pid``: the detached ``sh`` that waits for the worker, and the worker;
- ``exit.code``: written by the wrapper when the worker ends (137 after a ``kill -9`` of the worker).

A worker with no ``exit.code`` whose wrapper is gone was lost with its host (or the wrapper was killed): the
session starts a new attempt. ``cancel`` sends SIGTERM to the worker (it checkpoints at the step boundary and
exits), waits ``CANCEL_GRACE_S``, then kills the wrapper's whole process group.
"""

from __future__ import annotations

import shlex
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from ft_assets.targets import WHEEL, Target, TargetError, WorkerLaunch, WorkerState, query_of
from ft_assets.targets.code import code_setting

EXAMPLE = "ssh://me@gpu-box:22?python=/opt/venv/bin/python"  # docs/deploy/ssh.md's and the registry checklist's
DEFAULT_WORKDIR = "ft-assets-worker"  # relative: under the login's home
CONNECT_TIMEOUT_S = 15  # ssh's own: a host that does not answer is reported before SSH_TIMEOUT_S
SSH_TIMEOUT_S = 60  # one ssh command (connect + run); a host that takes longer is reported unreachable
CANCEL_GRACE_S = 120.0  # SIGTERM to SIGKILL: the step-boundary checkpoint of every rank, after torchrun's own
# grace for its ranks (training.launch.SHUTDOWN_TIMEOUT_S, 110 s); a worker that ends sooner is not waited for
LOG_TAIL_LINES = 30  # of the worker's output, in the error of a worker that failed
NVIDIA_SMI = "nvidia-smi --query-gpu=name,memory.total --format=csv,noheader,nounits"  # the host's cards, one a line
SETTINGS = ("python", "code", "workdir", "identity", "option", "gpu", "gpus")

# The detached wrapper: sources and deletes the secrets, runs the worker, records its pid and exit code, and passes
# a SIGTERM on to it (a trap, not ``trap '' TERM``: an ignored signal would be inherited by the worker).
WRAPPER = r"""
echo $$ > wrapper.pid
set -a; . ./env; set +a; rm -f ./env
"$@" &
child=$!
echo $child > worker.pid
trap 'kill -TERM $child 2>/dev/null' TERM INT HUP
while :; do
  wait $child; status=$?
  kill -0 $child 2>/dev/null || break
done
echo $status > exit.code.tmp && mv exit.code.tmp exit.code
"""


@dataclass(frozen=True)
class SshClient:
    """A host reached with OpenSSH's ``ssh`` (key auth; ``BatchMode`` so a missing key fails instead of prompting):
    the ssh target's host, and a Slurm login node (``slurm_cli.SlurmCli``)."""

    host: str
    user: str | None = None
    port: int | None = None
    identity_file: str | None = None
    options: tuple[str, ...] = ()  # more ``-o`` options, e.g. "StrictHostKeyChecking=accept-new"

    def argv(self, remote: Sequence[str]) -> list[str]:
        argv = ["ssh", "-o", "BatchMode=yes"]
        if self.port:
            argv += ["-p", str(self.port)]
        if self.identity_file:
            argv += ["-i", self.identity_file, "-o", "IdentitiesOnly=yes"]
        for option in self.options:
            argv += ["-o", option]
        return [*argv, f"{self.user}@{self.host}" if self.user else self.host, "--", shlex.join(remote)]


@dataclass(frozen=True)
class SshTarget(Target):
    host: str
    user: str | None = None
    port: int | None = None
    python: str = "python3"
    workdir: str = DEFAULT_WORKDIR
    identity: str | None = None
    options: tuple[str, ...] = ()
    gpu: str | None = None  # the host's card as a cost-model offering (gpu=a100-80gb): planned and billed at its price
    gpus: int | None = None  # GPUs the worker trains on, one process each; None: the training settings' num_processes
    code: str = WHEEL  # wheel: install the control host's ft-assets first; installed: ``python`` has it

    scheme = "ssh"

    def describe(self) -> str:
        where = f"{self.user}@{self.host}" if self.user else self.host
        return f"ssh://{where}{f':{self.port}' if self.port else ''}"

    def ssh(
        self, command: str, stdin: str | None = None, timeout: float = SSH_TIMEOUT_S
    ) -> subprocess.CompletedProcess:
        """``command`` (one shell line) on the host; its stdin from ``stdin``. The command line holds no secret."""
        client = SshClient(
            self.host, self.user, self.port, self.identity, (f"ConnectTimeout={CONNECT_TIMEOUT_S}", *self.options)
        )
        argv = client.argv(["sh", "-c", command])
        try:
            done = subprocess.run(argv, input=stdin or "", capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise TargetError(f"{self.describe()}: no answer within {timeout:.0f} s") from None
        if done.returncode == 255:  # ssh's own failure: the host, the key or the network
            said = (done.stderr.strip().splitlines() or ["no message"])[-1]
            raise TargetError(f"{self.describe()}: ssh failed: {said}")
        return done

    def card(self) -> tuple[str, int] | None:
        """The host's first GPU as ``nvidia-smi`` names it, with its memory in MiB; None on a host without one."""
        answer = self.ssh(f"{NVIDIA_SMI} 2>/dev/null")
        return first_card(answer.stdout) if answer.returncode == 0 else None

    def folder(self, name: str) -> str:
        return f"{self.workdir.rstrip('/')}/{name}"

    def launch(self, launch: WorkerLaunch) -> dict:
        folder = self.folder(launch.name)
        env = "".join(f"{key}={shlex.quote(value)}\n" for key, value in {**launch.env, **launch.secrets}.items())
        made = self.ssh(f"umask 077 && mkdir -p {shlex.quote(folder)} && cat > {shlex.quote(folder)}/env", stdin=env)
        if made.returncode != 0:
            raise TargetError(f"{self.describe()}: cannot write {folder}: {made.stderr.strip()}")
        worker = shlex.join(launch.argv(self.python))
        started = self.ssh(
            f"cd {shlex.quote(folder)} && (setsid sh -c {shlex.quote(WRAPPER)} sh {worker} "
            "> output.log 2>&1 < /dev/null &) && sleep 0.2 && cat wrapper.pid"
        )
        if started.returncode != 0 or not started.stdout.strip().isdigit():
            raise TargetError(f"{self.describe()}: the worker did not start in {folder}: {started.stderr.strip()}")
        return {"folder": folder, "wrapper_pid": int(started.stdout.strip())}

    def poll(self, handle: Mapping) -> WorkerState:
        folder = shlex.quote(handle["folder"])
        answer = self.ssh(
            f"cd {folder} 2>/dev/null || {{ echo gone; exit 0; }}; "
            f"if [ -f exit.code ]; then echo exit $(cat exit.code); "
            f"elif kill -0 {int(handle['wrapper_pid'])} 2>/dev/null; then echo running; else echo gone; fi"
        ).stdout.split()
        if answer[:1] == ["running"]:
            return WorkerState(running=True)
        code = int(answer[1]) if answer[:1] == ["exit"] and len(answer) > 1 and answer[1].isdigit() else None
        return WorkerState(running=False, exit_code=code, detail=self.tail(handle))

    def tail(self, handle: Mapping) -> str:
        out = self.ssh(f"tail -n {LOG_TAIL_LINES} {shlex.quote(handle['folder'])}/output.log 2>/dev/null")
        return out.stdout.strip()

    def cancel(self, handle: Mapping) -> None:
        folder, wrapper = shlex.quote(handle["folder"]), int(handle["wrapper_pid"])
        self.ssh(f"kill -TERM $(cat {folder}/worker.pid 2>/dev/null) 2>/dev/null; true")
        deadline = time.monotonic() + CANCEL_GRACE_S
        while time.monotonic() < deadline and self.poll(handle).running:
            time.sleep(1.0)
        self.ssh(f"kill -KILL -- -{wrapper} 2>/dev/null; true")  # the wrapper leads its session's process group


def first_card(csv: str) -> tuple[str, int] | None:
    """(name, MiB) of the first GPU in ``NVIDIA_SMI``'s answer (``NVIDIA A100-SXM4-80GB, 81920`` a line)."""
    for line in csv.splitlines():
        name, _, mib = line.rpartition(",")
        if name.strip() and mib.strip().isdigit():
            return name.strip(), int(mib)
    return None


def parse(text: str) -> SshTarget:
    """``ssh://[user@]host[:port]?python=PATH&workdir=DIR&identity=PATH&option=Key=Value``."""
    parts = urlsplit(text)
    if parts.scheme != "ssh" or not parts.hostname:
        raise TargetError(f"GPU target {text!r}: write ssh://[user@]host[:port][?python=PATH&workdir=DIR]")
    query = query_of(text, parts.query, SETTINGS)
    if parts.password:
        raise TargetError(f"GPU target {parts.hostname!r}: no password in the URL; ssh uses your keys and agent")
    try:
        port = parts.port
    except ValueError:
        raise TargetError(f"GPU target {text!r}: the port is not a number") from None

    return SshTarget(
        host=parts.hostname,
        user=unquote(parts.username) if parts.username else None,
        port=port,
        python=query.one("python", "python3"),
        workdir=query.one("workdir", DEFAULT_WORKDIR),
        identity=query.one("identity"),
        options=query.every("option"),
        gpu=query.one("gpu"),
        gpus=query.count("gpus", None, 1),
        code=code_setting(text, query.one("code")),
    )
