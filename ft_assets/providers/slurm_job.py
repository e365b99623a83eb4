"""The Slurm side of a training worker: which job runs it, what Slurm is doing when SIGTERM comes, its other nodes.

The batch script ``SlurmRunLauncher`` submits (``ft_assets.control.slurm``) exports two variables the
worker reads here:

- ``FT_SLURM_JOB_STARTED``: the Unix time the batch script started, i.e. when the allocation began
  to bill (Slurm 22.05 exports no start time to the job). ``billed_since`` turns it into the
  ``started_at`` the recipe measures wall time from, so a job's paid start-up (imports, the Dagster
  run worker, fetching the base model) is billed and its time in the queue is not.
- ``FT_SLURM_SIGNAL_FILE``: on SIGTERM the script's trap writes ``scontrol show job -o`` there before
  passing the signal on. The trap runs outside any container (Pyxis, Apptainer), where ``scontrol``
  exists; the worker reads the file once its checkpoint is in the store and ``stop_reason`` says why
  it was stopped, as the controller saw it at that moment (measured on Slurm 22.05):

  ==========================================  ==========================  =====================
  what happened                               ``scontrol`` at the trap    ``stop_reason``
  ==========================================  ==========================  =====================
  ``scontrol requeue``, preemption (REQUEUE)  ``Restarts`` one above the  ``REQUEUE``
  or a node failure with ``--requeue``        job's ``SLURM_RESTART_COUNT``
  ``--signal=B:TERM@grace`` (time limit near)  ``JobState=RUNNING``, or    ``TIME_LIMIT``
                                              ``SIGNALING`` while the
                                              signal is still pending
  the time limit itself                       ``COMPLETING``, run time     ``TIME_LIMIT``
                                              >= time limit
  ``scancel`` (or PreemptMode=CANCEL)         ``COMPLETING``              ``CANCEL``
  ==========================================  ==========================  =====================

  A requeued job keeps its job id, its place in the queue and its allocation request, so the run goes
  on in it: ``lora_adapter`` leaves the run unfinished and the requeued job resumes it (``dagster api
  resume_run``). A time limit ends the job for good: the run fails as preempted and Dagster's run
  retry resumes it in a new job. A cancel is someone's decision to stop: the run fails and is not
  retried. PreemptMode=CANCEL looks like a cancel from inside the job; preemptible partitions should
  requeue (the launcher submits with ``--requeue``).

Multi-node runs (``num_nodes`` M > 1, ``sbatch --nodes=M``): the batch script runs on the first node,
which is node 0 (``lora_adapter``, rank 0, the rendezvous); ``SlurmPeerNodes`` starts nodes 1..M-1 as
one ``srun`` step with a task per node that runs ``launch.node_command`` with the node rank
``SLURM_PROCID + 1``. Unit-tested; not yet run on more than one node.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import dagster as dg
from dagster._core.errors import DagsterExecutionInterruptedError
from dagster._core.storage.tags import RETRY_ON_ASSET_OR_OP_FAILURE_TAG

from ft_assets.training.launch import RDZV_PORT, WorkerJob, node_command
from ft_assets.training.preemption import Preempted

JOB_TAG = "ft/slurm-job-id"  # Dagster run tags: the job that runs the run, its nodes, its output file
NODES_TAG = "ft/slurm-nodes"
OUTPUT_TAG = "ft/slurm-output"
STARTED_ENV = "FT_SLURM_JOB_STARTED"
SIGNAL_FILE_ENV = "FT_SLURM_SIGNAL_FILE"
REQUEUE, TIME_LIMIT, CANCEL = "requeue", "time limit", "cancel"
# The job still runs when the trap asks: scontrol shows the SIGNALING flag in place of RUNNING until every node has
# taken the signal (slurmctld's agent clears it), so which of the two the trap sees is a race.
RUNNING_STATES = ("RUNNING", "SIGNALING", "TIMEOUT")
PEER_WORK_DIR = "/tmp/ft-node"  # each peer's scratch, as on Kubernetes (training/nodes.py)
PEER_STOP_S = 30  # srun passes SIGTERM to the peers' torchrun, which gives its ranks launch.SHUTDOWN_TIMEOUT_S

Log = Callable[[str], None]


def in_slurm_job(env: Mapping[str, str] = os.environ) -> bool:
    return bool(env.get("SLURM_JOB_ID"))


def job_tags(env: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The run tags naming the job and nodes this worker runs on; {} outside Slurm. A requeued job may land on
    other nodes, so the worker (not the launcher) writes the node list each time it starts."""
    if not in_slurm_job(env):
        return {}
    return {JOB_TAG: env["SLURM_JOB_ID"], NODES_TAG: env.get("SLURM_JOB_NODELIST", "")}


def restart_count(env: Mapping[str, str] = os.environ) -> int:
    """How many times Slurm has requeued this job before this start (0 on its first start)."""
    return int(env.get("SLURM_RESTART_COUNT") or 0)


def billed_since(monotonic_now: float, env: Mapping[str, str] = os.environ, wall_now: float | None = None) -> float:
    """``monotonic_now`` moved back to the start of this job's allocation (``FT_SLURM_JOB_STARTED``), on the same
    monotonic clock; ``monotonic_now`` itself outside a Slurm job."""
    started = env.get(STARTED_ENV)
    if not started:
        return monotonic_now
    waited = max(0.0, (time.time() if wall_now is None else wall_now) - float(started))
    return monotonic_now - waited


def parse_scontrol(text: str) -> dict[str, str]:
    """``scontrol show job -o`` (one line of Key=Value pairs) as a dict; values with spaces keep only their first
    word, which the fields read here never have."""
    fields = {}
    for word in text.split():
        key, sep, value = word.partition("=")
        if sep and key not in fields:
            fields[key] = value
    return fields


def duration_s(text: str) -> float | None:
    """Slurm's ``[days-]hours:minutes:seconds`` (also ``minutes:seconds``) in seconds; None for UNLIMITED and the
    like."""
    days, _, clock = text.rpartition("-")
    parts = clock.split(":")
    if not all(p.isdigit() for p in parts) or not 1 <= len(parts) <= 3 or (days and not days.isdigit()):
        return None
    seconds = 0
    for part in parts:
        seconds = seconds * 60 + int(part)
    return seconds + int(days or 0) * 86_400


def stop_reason(scontrol_text: str, restarts_at_start: int) -> str:
    """Why Slurm sent SIGTERM, from ``scontrol show job -o`` taken when it came (table in the module docstring)."""
    fields = parse_scontrol(scontrol_text)
    if int(fields.get("Restarts") or 0) > restarts_at_start:
        return REQUEUE
    if fields.get("JobState") in RUNNING_STATES:
        return TIME_LIMIT
    run, limit = duration_s(fields.get("RunTime", "")), duration_s(fields.get("TimeLimit", ""))
    if run is not None and limit is not None and run >= limit:
        return TIME_LIMIT
    return CANCEL


def signalled_stop(env: Mapping[str, str] = os.environ) -> tuple[str, str] | None:
    """(reason, job id) when the batch script's trap recorded a SIGTERM for this job; None outside Slurm or when
    the signal did not come through the script (someone signalled the worker directly: a plain preemption)."""
    path = env.get(SIGNAL_FILE_ENV)
    if not in_slurm_job(env) or not path or not Path(path).is_file():
        return None
    return stop_reason(Path(path).read_text(errors="replace"), restart_count(env)), env["SLURM_JOB_ID"]


def peer_srun_command(job: WorkerJob, endpoint: str, nodes: int) -> list[str]:
    """``srun`` of nodes 1..``nodes``-1 inside the job's allocation: one task per node, node rank SLURM_PROCID+1."""
    if nodes < 2:
        raise ValueError(f"a multi-node run has at least 2 nodes (got {nodes})")
    command = node_command(job, endpoint, PEER_WORK_DIR)
    rank = command.index("JOB_COMPLETION_INDEX")
    command[rank] = "SLURM_PROCID"
    return [
        "srun", "--relative=1", f"--nodes={nodes - 1}", f"--ntasks={nodes - 1}", "--ntasks-per-node=1",
        "--kill-on-bad-exit=1", *command,
    ]  # fmt: skip


def rendezvous_endpoint(env: Mapping[str, str] = os.environ) -> str:
    """Node 0's rendezvous host:port in a Slurm job: the node the batch script runs on."""
    return f"{env.get('SLURMD_NODENAME') or socket.gethostname()}:{RDZV_PORT}"


class SlurmPeerNodes:
    """Nodes 1..M-1 of this run as one ``srun`` step of the job's allocation; ``delete`` stops them."""

    def __init__(self, job: WorkerJob, endpoint: str, log: Log):
        command = peer_srun_command(job, endpoint, job.config.num_nodes)
        self.process = subprocess.Popen(command, start_new_session=True)
        log(f"started nodes 1..{job.config.num_nodes - 1} as a Slurm step of job {os.environ.get('SLURM_JOB_ID')}, "
            f"rendezvous at {endpoint}")  # fmt: skip

    def delete(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(PEER_STOP_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def act_on_signalled_stop(context, exc: Preempted, run_prefix: str, env: Mapping[str, str] = os.environ) -> None:
    """A SIGTERM that Slurm sent through the batch script (``signalled_stop``), in a Dagster step, checkpoint saved: a requeue
    leaves the run unfinished for the requeued job to resume; a cancel fails it for good. Returns for anything else
    (a time limit, a plain preemption): the caller fails the run as preempted and the run retry resumes it."""
    stop = signalled_stop(env)
    if stop is None or stop[0] == TIME_LIMIT:
        return
    reason, job = stop
    if reason == REQUEUE:
        context.log.info(f"Slurm is requeueing job {job}: {exc}; the requeued job resumes this run")
        raise DagsterExecutionInterruptedError(f"Slurm requeued job {job}")  # not a failure: the run will resume
    context.instance.add_run_tags(context.run.run_id, {RETRY_ON_ASSET_OR_OP_FAILURE_TAG: "false"})
    raise dg.Failure(
        description=f"Slurm job {job} was cancelled (scancel) at step {exc.step}; the run is not retried, its "
        f"checkpoints stay in {run_prefix}",
        metadata={"slurm_job_id": job, "run_prefix": run_prefix},
        allow_retries=False,
    ) from exc
