"""Slurm's commands as ft-assets uses them: what a job asks for (``JobRequest``), ``sbatch``/``squeue``/``sacct``/``scancel``
here or on a login node through ssh (``SlurmCli``), and what they answer (``JobState``).

Shared by the two ways a training run meets Slurm: the ``slurm://`` GPU target (``ft_assets.targets.slurm``: one job
per attempt of a training worker) and the ``SlurmRunLauncher`` gpu pool (``ft_assets.control.slurm``: the whole
Dagster run as a job).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone

from ft_assets.targets.ssh import SshClient

JOB_NAME_PREFIX = "ft-assets-"  # + the run id: how the idle check finds this launcher's jobs
DEFAULT_GRACE_S = 120  # SIGTERM this long before the time limit: a 7B LoRA checkpoint uploads in well under a minute
COMMAND_TIMEOUT_S = 60  # one sbatch/squeue/sacct/scancel call, ssh included
SQUEUE_FORMAT = "%i|%T|%r|%N|%S|%e"  # id, state, reason, nodes, start, end
SACCT_FIELDS = "JobID,State,Reason,NodeList,Start,End"
ACTIVE_STATES = frozenset({
    "PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "RESIZING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD",
    "SPECIAL_EXIT", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT", "RESV_DEL_HOLD",
})  # fmt: skip
ENDED = {  # a final state -> what it means, in a sentence about the job
    "COMPLETED": "ended",
    "FAILED": "failed",
    "CANCELLED": "was cancelled (scancel)",
    "TIMEOUT": "reached its time limit",
    "NODE_FAIL": "lost its node (NODE_FAIL)",
    "OUT_OF_MEMORY": "ran out of memory (OUT_OF_MEMORY)",
    "PREEMPTED": "was preempted and not requeued",
    "BOOT_FAIL": "could not boot its node (BOOT_FAIL)",
    "DEADLINE": "missed its deadline",
    "REVOKED": "was revoked by a sibling cluster",
}


class SlurmError(RuntimeError):
    """A Slurm command failed or answered something unreadable; the message is one line."""


@dataclass(frozen=True)
class JobRequest:
    """One sbatch job: its resources and the Slurm options around them."""

    name: str
    work_dir: str
    gpus_per_node: int = 1
    nodes: int = 1
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time_limit: str | None = None  # Slurm's [days-]hours:minutes:seconds, or minutes
    signal_grace_s: int = DEFAULT_GRACE_S
    requeue: bool = True
    extra: tuple[str, ...] = ()  # more sbatch options, e.g. "--mem=64G", "--constraint=a100"

    @property
    def output(self) -> str:
        """The job's output file as Slurm names it (``%j``: the job id)."""
        return f"{self.work_dir}/{self.name}-%j.out"

    def output_of(self, job_id: str) -> str:
        return self.output.replace("%j", job_id)

    def options(self) -> list[str]:
        """The ``#SBATCH`` options, in the order sbatch --help lists them."""
        options = [f"--job-name={self.name}", f"--output={self.output}", "--open-mode=append",
                   f"--chdir={self.work_dir}", f"--nodes={self.nodes}", "--ntasks-per-node=1"]  # fmt: skip
        if self.gpus_per_node:
            options.append(f"--gres=gpu:{self.gpus_per_node}")
        for flag, value in (("partition", self.partition), ("account", self.account), ("qos", self.qos),
                            ("time", self.time_limit)):  # fmt: skip
            if value:
                options.append(f"--{flag}={value}")
        options.append("--requeue" if self.requeue else "--no-requeue")
        if self.signal_grace_s:
            options.append(f"--signal=B:TERM@{self.signal_grace_s}")
        return options + list(self.extra)


def parse_job_id(sbatch_stdout: str) -> str:
    """The job id from ``sbatch --parsable`` (``42`` or ``42;cluster``)."""
    first = sbatch_stdout.strip().splitlines()[-1] if sbatch_stdout.strip() else ""
    job_id = first.split(";")[0].strip()
    if not job_id.isdigit():
        raise SlurmError(f"sbatch --parsable answered {sbatch_stdout.strip()[:200]!r}, not a job id")
    return job_id


# --- what Slurm says about a job ------------------------------------------------------------------


@dataclass(frozen=True)
class JobState:
    """A job as squeue or sacct reports it."""

    job_id: str
    state: str  # the base state, e.g. RUNNING, CANCELLED (sacct's "CANCELLED by 0" -> CANCELLED)
    reason: str = ""
    nodes: str = ""
    start: datetime | None = None
    end: datetime | None = None
    source: str = "squeue"

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES

    @property
    def started(self) -> bool:
        return self.start is not None

    def describe(self) -> str:
        """One line: what became of the job."""
        said = ENDED.get(self.state, f"is {self.state}")
        where = f" on {self.nodes}" if self.nodes and self.nodes not in ("None", "(null)") else ""
        took = ""
        if self.start is not None and self.end is not None:
            took = f" after {int((self.end - self.start).total_seconds())} s"
        why = f" ({self.reason})" if self.reason and self.reason not in ("None", "(null)", "NonZeroExitCode") else ""
        return f"Slurm job {self.job_id} {said}{where}{took}{why} ({self.source})"

    def billed_seconds(self, now: datetime) -> float:
        """Allocation time so far: 0 while queued, from its start while running, start to end once ended."""
        if self.start is None:
            return 0.0
        end = self.end if (self.end is not None and not self.active) else now
        return max(0.0, (end - self.start).total_seconds())


def _time(text: str) -> datetime | None:
    """Slurm's local ISO time (``2026-12-01T22:53:58``); None for N/A, Unknown, None or empty."""
    try:
        return datetime.fromisoformat(text.strip()).astimezone(timezone.utc)
    except ValueError:
        return None


def _records(stdout: str, program: str, expected: str) -> Iterator[list[str]]:
    """The 6 ``|``-separated fields of each non-blank line ``program`` printed, stripped; a line of another shape is a
    ``SlurmError`` saying what was ``expected``."""
    for line in stdout.splitlines():
        if not line.strip():
            continue
        parts = line.split("|")
        if len(parts) != 6:
            raise SlurmError(f"{program} printed {line[:200]!r}; expected {expected}")
        yield [part.strip() for part in parts]


def parse_squeue(stdout: str) -> list[JobState]:
    """``squeue -h -o '%i|%T|%r|%N|%S|%e'`` lines (``SQUEUE_FORMAT``)."""
    jobs = []
    for job_id, state, reason, nodes, start, end in _records(
        stdout, "squeue", f"{SQUEUE_FORMAT.count('|') + 1} fields"
    ):
        # A pending job's %S is its expected start: only a job past PENDING has really started.
        begun = _time(start) if state not in ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED") else None
        jobs.append(JobState(job_id, state, reason, nodes, begun, _time(end) if begun else None))
    return jobs


def parse_sacct(stdout: str) -> list[JobState]:
    """``sacct -X -n -P -o JobID,State,Reason,NodeList,Start,End`` lines (``SACCT_FIELDS``)."""
    jobs = []
    for job_id, state, reason, nodes, start, end in _records(stdout, "sacct", f"the fields {SACCT_FIELDS}"):
        jobs.append(JobState(job_id, state.split()[0] if state else "", reason, nodes, _time(start), _time(end),
                             source="sacct"))  # fmt: skip
    return jobs


@dataclass(frozen=True)
class SlurmCli:
    """Runs Slurm's commands here, or on the login node through ssh."""

    ssh: SshClient | None = None
    timeout_s: float = COMMAND_TIMEOUT_S

    def run(
        self, argv: Sequence[str], stdin: str | None = None, check_exit: bool = True
    ) -> subprocess.CompletedProcess:
        command = self.ssh.argv(argv) if self.ssh else list(argv)
        where = f" on {self.ssh.host}" if self.ssh else ""
        try:
            done = subprocess.run(command, input=stdin, capture_output=True, text=True, timeout=self.timeout_s)
        except FileNotFoundError as exc:
            raise SlurmError(f"{command[0]} is not installed{where}: {exc.strerror}") from exc
        except subprocess.TimeoutExpired as exc:
            raise SlurmError(f"{argv[0]}{where} did not answer within {self.timeout_s:g} s") from exc
        if check_exit and done.returncode != 0:
            said = (done.stderr.strip() or done.stdout.strip()).splitlines()
            raise SlurmError(f"{argv[0]}{where} exited {done.returncode}: {said[-1] if said else 'no output'}")
        return done

    def submit(self, script: str, work_dir: str) -> str:
        self.run(["mkdir", "-p", work_dir])
        return parse_job_id(self.run(["sbatch", "--parsable"], stdin=script).stdout)

    def job(self, job_id: str) -> JobState | None:
        """The job as the controller knows it, else as accounting does; None when neither has it."""
        queued = self.run(["squeue", "--states=all", "-h", "-j", job_id, "-o", SQUEUE_FORMAT], check_exit=False)
        found = [job for job in parse_squeue(queued.stdout) if job.job_id == job_id] if queued.returncode == 0 else []
        if found:
            return found[0]
        accounted = self.run(["sacct", "-X", "-n", "-P", "-j", job_id, "-o", SACCT_FIELDS], check_exit=False)
        if accounted.returncode != 0:  # no slurmdbd: accounting is off, the controller has forgotten the job
            return None
        found = [job for job in parse_sacct(accounted.stdout) if job.job_id == job_id]
        return found[-1] if found else None

    def jobs(self) -> list[tuple[str, JobState]]:
        """(run id, job) of each of this launcher's jobs the controller knows (named ``JOB_NAME_PREFIX`` + run id)."""
        listed = self.run(["squeue", "-h", "--me", "-o", f"%j|{SQUEUE_FORMAT}"])
        jobs = []
        for line in listed.stdout.splitlines():
            name, _, rest = line.partition("|")
            if name.startswith(JOB_NAME_PREFIX):
                jobs += [(name.removeprefix(JOB_NAME_PREFIX), job) for job in parse_squeue(rest)]
        return jobs

    def cancel(self, job_id: str) -> None:
        self.run(["scancel", job_id])

    def tail(self, path: str, lines: int = 20) -> str:
        done = self.run(["tail", "-n", str(lines), path], check_exit=False)
        return done.stdout if done.returncode == 0 else ""
