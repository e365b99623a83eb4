"""The ``slurm://[user@]login-host[:port]/partition`` target: each attempt of a training worker is one ``sbatch`` job.

``sbatch``, ``squeue`` and ``scancel`` run on the login node through OpenSSH (``ft_assets.providers.slurm_cli.SlurmCli``),
or on this machine when the host is ``localhost``. The job runs ``python -m ft_assets.training.remote`` (the same
worker as every target: Pipes messages through the store), so the compute node needs the store, not the Dagster
instance: no database reachable from the cluster, no ``DAGSTER_HOME`` there. It is submitted with ``--export=NONE``:
nothing of the submitting shell's environment (the control host's database settings among it) reaches the job.

Settings (query): ``code`` (``wheel``, the default: the job installs the control host's ft-assets from the store
first, ``ft_assets.targets.code``; ``installed``: ``python`` has ft-assets), ``gpu`` (the partition's card as a cost-model offering, e.g. ``a100-80gb``: the plan is made for
it and the run billed at its ``slurm_usd_per_h``), ``python`` (the cluster's Python with ft-assets, default ``python3``), ``workdir`` (on the shared
filesystem, default ``~/ft-assets-worker``: the job's output file, its ``env`` and ``exit.code``), ``gpus`` (the job's
GPUs, ``--gpus-per-node``: the worker trains on all of them, one process each, torchrun on the node; default the
training settings' ``num_processes``, 1 unless set, ``ft_assets.targets.processes_on``), ``time``, ``account``, ``qos`` (optional, as the cluster requires), ``sbatch`` (more options,
repeatable: ``sbatch=--mem=64G``), and ``identity`` / ``option`` for ssh.

Attempts are the session's (``ft_assets.targets.session``), not Slurm's: the job is ``--no-requeue``, and a job that
Slurm preempts, that loses its node or that reaches its time limit (``--signal=B:TERM@120``: the worker checkpoints
and exits 75) is followed by a new job that resumes from the newest checkpoint. ``scancel`` of the job by someone
else fails the step (someone decided to stop it); a terminated run ``scancel``s its job.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from ft_assets.targets import WHEEL, Target, TargetError, WorkerLaunch, WorkerState, query_of
from ft_assets.targets.code import code_setting
from ft_assets.providers.slurm_cli import DEFAULT_GRACE_S, JobRequest, SlurmCli, SlurmError
from ft_assets.targets.ssh import SshClient as LoginNode

EXAMPLE = "slurm://me@login.hpc.example.edu/gpu?gpu=a100-80gb&python=/shared/venv/bin/python&time=08:00:00"
DEFAULT_WORKDIR = "ft-assets-worker"  # relative: under the cluster account's home, on the shared filesystem
JOB_PREFIX = "ft-worker-"  # not slurm_cli.JOB_NAME_PREFIX: the idle check reads those names as Dagster run ids
LOCAL_HOSTS = ("localhost", "127.0.0.1")  # sbatch on this machine
PATH = "/usr/local/bin:/usr/bin:/bin"  # --export=NONE leaves the job no PATH of the submitter's
LOG_TAIL_LINES = 30
SETTINGS = ("python", "code", "workdir", "gpu", "gpus", "time", "account", "qos", "sbatch", "identity", "option")

# The batch script's body after its #SBATCH lines: the secrets sourced and deleted, the worker in a process group of
# its own (setsid) with SIGTERM passed on to it (a time limit's --signal=B:TERM reaches the batch shell only), its
# exit code kept for poll.
BODY = """
set -u
export PATH={path}
cd {folder}
set -a; . ./env; set +a; rm -f ./env
setsid {worker} &
worker=$!
echo $worker > worker.pid
trap 'kill -TERM -- -$worker 2>/dev/null' TERM
while :; do
  wait $worker; code=$?
  kill -0 $worker 2>/dev/null || break
done
echo $code > exit.code.tmp && mv exit.code.tmp exit.code
exit $code
"""


@dataclass(frozen=True)
class SlurmTarget(Target):
    partition: str
    login: LoginNode | None = None  # None: sbatch on this machine
    python: str = "python3"
    workdir: str = DEFAULT_WORKDIR
    gpus: int | None = None  # GPUs of the job, one training process each; None: the training settings' num_processes
    time: str | None = None
    account: str | None = None
    qos: str | None = None
    sbatch: tuple[str, ...] = ()
    gpu: str | None = None  # the partition's card as a cost-model offering: planned and billed at its slurm_usd_per_h
    code: str = WHEEL  # wheel: install the control host's ft-assets first; installed: ``python`` has it

    scheme = "slurm"
    rental = "slurm"  # its card planned and billed at its price per allocated GPU-hour

    def describe(self) -> str:
        where = (
            "localhost" if self.login is None else (f"{self.login.user}@" if self.login.user else "") + self.login.host
        )
        return f"slurm://{where}/{self.partition}"

    @property
    def cli(self) -> SlurmCli:
        return SlurmCli(ssh=self.login)

    def run(self, script: str, stdin: str | None = None, check: bool = True):
        try:
            return self.cli.run(["sh", "-c", script], stdin=stdin, check_exit=check)
        except SlurmError as exc:
            raise TargetError(f"{self.describe()}: {exc}") from None

    def folder(self, name: str) -> str:
        if self.workdir.startswith("/"):
            return f"{self.workdir.rstrip('/')}/{name}"
        home = self.run("echo $HOME").stdout.strip()  # the cluster account's, for --chdir and --output
        return f"{home}/{self.workdir.strip('/')}/{name}"

    def launch(self, launch: WorkerLaunch) -> dict:
        folder = self.folder(launch.name)
        env = "".join(f"{key}={shlex.quote(value)}\n" for key, value in {**launch.env, **launch.secrets}.items())
        self.run(f"umask 077 && mkdir -p {shlex.quote(folder)} && cat > {shlex.quote(folder)}/env", stdin=env)
        request = JobRequest(
            name=f"{JOB_PREFIX}{launch.name}", work_dir=folder, gpus_per_node=launch.gpus, partition=self.partition,
            account=self.account, qos=self.qos, time_limit=self.time, signal_grace_s=DEFAULT_GRACE_S, requeue=False,
            extra=("--export=NONE", *self.sbatch),
        )  # fmt: skip
        worker = shlex.join(launch.argv(self.python))
        script = "#!/bin/bash\n" + "".join(f"#SBATCH {option}\n" for option in request.options())
        script += BODY.format(path=PATH, folder=shlex.quote(folder), worker=worker)
        try:
            job_id = self.cli.submit(script, folder)
        except SlurmError as exc:
            raise TargetError(f"{self.describe()}: {exc}") from None
        return {"folder": folder, "job_id": job_id, "output": request.output_of(job_id)}

    def poll(self, handle: Mapping) -> WorkerState:
        try:
            job = self.cli.job(handle["job_id"])
        except SlurmError as exc:
            raise TargetError(f"{self.describe()}: {exc}") from None
        if job is not None and job.active:
            return WorkerState(running=True)
        code = self.run(f"cat {shlex.quote(handle['folder'])}/exit.code 2>/dev/null", check=False).stdout.strip()
        tail = self.cli.tail(handle["output"], LOG_TAIL_LINES).strip()
        said = job.describe() if job is not None else f"Slurm job {handle['job_id']} is gone from the queue"
        if code.isdigit():
            return WorkerState(running=False, exit_code=int(code), detail=f"{said}\n{tail}")
        if job is not None and job.state == "CANCELLED":  # by someone else: ours ends the wait before it polls again
            return WorkerState(running=False, exit_code=1, detail=f"{said}\n{tail}")
        return WorkerState(running=False, exit_code=None, detail=f"{said}\n{tail}")  # lost: node, preemption, limit

    def cancel(self, handle: Mapping) -> None:
        try:
            self.cli.cancel(handle["job_id"])
        except SlurmError as exc:
            raise TargetError(f"{self.describe()}: {exc}") from None


def parse(text: str) -> SlurmTarget:
    """``slurm://[user@]login-host[:port]/partition?python=PATH&workdir=DIR&gpus=N&time=T&account=A&qos=Q``."""
    parts = urlsplit(text)
    partition = parts.path.strip("/")
    if parts.scheme != "slurm" or not parts.hostname or not partition or "/" in partition:
        raise TargetError(
            f"GPU target {text!r}: write slurm://[user@]login-host[:port]/partition[?python=PATH&workdir=DIR] "
            "(login-host localhost: sbatch on this machine)"
        )
    query = query_of(text, parts.query, SETTINGS)
    if parts.password:
        raise TargetError(f"GPU target {parts.hostname!r}: no password in the URL; ssh uses your keys and agent")
    one = query.one
    try:
        port = parts.port
    except ValueError:
        raise TargetError(f"GPU target {text!r}: the port is not a number") from None
    login = None
    if parts.hostname not in LOCAL_HOSTS:
        login = LoginNode(
            host=parts.hostname, user=unquote(parts.username) if parts.username else None, port=port,
            identity_file=one("identity"), options=query.every("option"),
        )  # fmt: skip
    return SlurmTarget(
        partition=partition, login=login, python=one("python", "python3"), workdir=one("workdir", DEFAULT_WORKDIR),
        gpus=query.count("gpus", None, 1), time=one("time"), account=one("account"), qos=one("qos"), sbatch=query.every("sbatch"),
        gpu=one("gpu"), code=code_setting(text, one("code")),
    )  # fmt: skip
