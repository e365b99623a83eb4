"""``idle_gpu_worker_sensor``: stops (or terminates) rented GPU workers that have been idle too long.

A GPU worker bills by the hour whether it trains or not. With the defaults (30 min threshold, a tick
every 5 min) a forgotten worker is stopped at most 35 min after its last activity: $0.88 at the cost
model's A10G price of $1.50/h, against $72 for one left running over a weekend (48 h).

Which machines: EC2 instances tagged ``ft-assets:role = gpu-worker`` when ``ec2_workers`` has a region, and
the RunPod pods, Vast.ai instances and SkyPilot clusters that ``rented_workers.providers`` lists; each is
one provider module under one set of rules (``ft_assets.control.rented_workers``). Nothing else is ever
touched. A run is tied to its worker by the run tag ``ft/worker-instance-id``, which only the worker can
set (the launcher cannot know where the gpu pool places a run): the training asset sets it when it starts
(``ft_assets.providers.worker_identity.worker_tag``). So while a gpu-pool run (``ft/pool = gpu``) is starting
or started without that tag, the sensor stops nothing: it runs on one of the workers and nobody can say
which.

A Slurm gpu pool (``SlurmRunLauncher``) has no machines to stop: Slurm frees a job's allocation when
it ends. What can sit idle there is a job no run needs any more (its run ended or was canceled while
the job waits in the queue, or hangs after its run finished): with such a pool the sensor lists the
launcher's jobs (named ``ft-assets-<run id>``) and ``scancel``s the ones whose run has been settled
for longer than the threshold. A job whose run this instance does not know is left alone (another
deployment may share the account).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from functools import partial
from typing import Literal

import boto3
import dagster as dg
from botocore.config import Config
from dagster import DagsterRunStatus
from dagster._core.storage.dagster_run import RunRecord
from pydantic import Field

from ft_assets.control.idle_backends.ec2 import ROLE_TAG_KEY, ROLE_TAG_VALUE
from ft_assets.control.launcher import GPU, POOL_TAG, PoolRunLauncher
from ft_assets.control.rented_workers import RentedWorkersResource, rented_tick
from ft_assets.control.slurm import SlurmRunLauncher
from ft_assets.providers.ec2_metadata import WORKER_TAG
from ft_assets.providers.slurm_cli import JobState, SlurmError

DEFAULT_IDLE_MINUTES = 30.0  # covers a base-model download and the gap between two queued runs
SENSOR_INTERVAL_S = 300  # one listing per provider every 5 min; adds at most 5 min to the idle time
RECENT_RUNS_PER_WORKER = 25  # runs read per worker for its last end time (newest first)

# A run in one of these statuses holds no worker; any other status (queued for the worker, starting,
# running, canceling, or a status Dagster adds later) keeps its worker up.
SETTLED_STATUSES = frozenset(
    {DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED, DagsterRunStatus.SUSPENDED}
)
BUSY_STATUSES = tuple(status for status in DagsterRunStatus if status not in SETTLED_STATUSES)
# Launched, so running on some worker, whether or not it has said which yet.
PLACED_STATUSES = (DagsterRunStatus.STARTING, DagsterRunStatus.STARTED, DagsterRunStatus.CANCELING)


def utc_now() -> datetime:
    """The sensor reads the clock once per tick, here (tests replace it)."""
    return datetime.now(timezone.utc)


@dataclass(frozen=True)
class WorkerRun:
    """A Dagster run tied to a worker by its ``ft/worker-instance-id`` tag."""

    run_id: str
    status: DagsterRunStatus
    ended_at: datetime | None  # when a settled run ended (or last changed status); None while busy


def worker_run(record: RunRecord) -> WorkerRun:
    status = record.dagster_run.status
    if status not in SETTLED_STATUSES:
        return WorkerRun(record.dagster_run.run_id, status, None)
    if record.end_time is not None:
        ended = datetime.fromtimestamp(record.end_time, timezone.utc)
    else:  # suspended, or canceled before it started: its last status change
        ended = _aware(record.update_timestamp)
    return WorkerRun(record.dagster_run.run_id, status, ended)


def runs_by_worker(instance: dg.DagsterInstance, worker_tags: Sequence[str]) -> dict[str, list[WorkerRun]]:
    """Each worker's busy runs and its most recent runs, from the ``ft/worker-instance-id`` run tag."""
    records = {}
    if worker_tags:
        busy = dg.RunsFilter(tags={WORKER_TAG: list(worker_tags)}, statuses=list(BUSY_STATUSES))
        records = {record.dagster_run.run_id: record for record in instance.get_run_records(busy)}
    for tag in worker_tags:
        recent = instance.get_run_records(dg.RunsFilter(tags={WORKER_TAG: tag}), limit=RECENT_RUNS_PER_WORKER)
        records.update({record.dagster_run.run_id: record for record in recent})
    grouped: dict[str, list[WorkerRun]] = {tag: [] for tag in worker_tags}
    for record in records.values():
        grouped.setdefault(record.dagster_run.tags[WORKER_TAG], []).append(worker_run(record))
    return grouped


def unplaced_gpu_runs(instance: dg.DagsterInstance) -> list[str]:
    """Ids of gpu-pool runs that are starting or running but have not said on which worker."""
    records = instance.get_run_records(dg.RunsFilter(tags={POOL_TAG: GPU}, statuses=list(PLACED_STATUSES)))
    return [record.dagster_run.run_id for record in records if WORKER_TAG not in record.dagster_run.tags]


@dataclass(frozen=True)
class IdleSlurmJob:
    """A Slurm job of the gpu pool that no unfinished run needs."""

    run_id: str
    job: JobState
    why: str

    def describe(self, now: datetime) -> str:
        billed = self.job.billed_seconds(now) / 60
        held = f"running {billed:.0f} min on its allocation" if self.job.started else "queued, not billed yet"
        return f"Slurm job {self.job.job_id} ({self.job.state}, {held}): {self.why}"


def find_idle_slurm_jobs(
    jobs: Iterable[tuple[str, JobState]], runs: Mapping[str, WorkerRun], now: datetime, threshold: timedelta
) -> list[IdleSlurmJob]:
    """The queued or running jobs (run id, job) whose run in ``runs`` settled longer than ``threshold`` ago."""
    idle = []
    for run_id, job in jobs:
        run = runs.get(run_id)
        if not job.active or job.state == "COMPLETING" or run is None or run.status not in SETTLED_STATUSES:
            continue
        if run.ended_at is not None and now - run.ended_at <= threshold:
            continue
        ago = f" {int((now - run.ended_at).total_seconds() // 60)} min ago" if run.ended_at is not None else ""
        idle.append(IdleSlurmJob(run_id, job, f"its run {run_id} ended {run.status.value}{ago}"))
    return idle


def slurm_gpu_pool(instance: dg.DagsterInstance) -> SlurmRunLauncher | None:
    """The gpu pool's SlurmRunLauncher, when the instance's launcher has one."""
    launcher = instance.run_launcher
    if isinstance(launcher, PoolRunLauncher) and isinstance(launcher.launcher(GPU), SlurmRunLauncher):
        return launcher.launcher(GPU)
    return None


def cancel_idle_slurm_jobs(context, slurm: SlurmRunLauncher, threshold: timedelta, dry_run: bool, now: datetime) -> str:
    """``scancel`` each idle job of the Slurm gpu pool (``find_idle_slurm_jobs``); what was done, in one line."""
    try:
        jobs = slurm.cli.jobs()
    except SlurmError as exc:
        context.log.warning(f"could not list the Slurm jobs, trying again next tick: {exc}")
        return f"squeue failed: {exc}"
    records = context.instance.get_run_records(dg.RunsFilter(run_ids=[run_id for run_id, _ in jobs])) if jobs else []
    idle = find_idle_slurm_jobs(jobs, {r.dagster_run.run_id: worker_run(r) for r in records}, now, threshold)
    for job in idle:
        if not dry_run:
            slurm.cli.cancel(job.job.job_id)
        context.log.info(f"{'dry run: would scancel' if dry_run else 'scancel'} {job.describe(now)}")
    if not idle:
        return (
            f"{len(jobs)} Slurm job(s) of the gpu pool, none idle for more than {threshold.total_seconds() / 60:g} min"
        )
    verb = "dry run: would cancel" if dry_run else "cancelled"
    return f"{verb} {len(idle)} idle Slurm job(s) ({', '.join(job.job.job_id for job in idle)})"


class Ec2WorkersResource(dg.ConfigurableResource):
    """The EC2 GPU workers the idle sensor may stop, and what it does to them; ``idle_minutes`` and ``dry_run`` also
    apply to a Slurm gpu pool's jobs, and ``idle_minutes`` to every provider of ``rented_workers``.

    Credentials are never configured here: boto3 reads the AWS_* environment variables or the
    instance/task role. The role needs ec2:DescribeInstances and ec2:StopInstances (or TerminateInstances).
    """

    region: str = Field(default="", description="AWS region of the workers. Empty: $AWS_DEFAULT_REGION.")
    idle_minutes: float = Field(
        default=DEFAULT_IDLE_MINUTES,
        gt=0,
        description="Minutes a worker may sit without a run (or heartbeat) before it is stopped.",
    )
    action: Literal["stop", "terminate"] = Field(
        default="stop",
        description="'stop' keeps the root volume (restart later, disk still billed); 'terminate' deletes the "
        "instance (required for one-time spot instances).",
    )
    dry_run: bool = Field(
        default=False, description="Only log what would be done; EC2 still checks the permission (DryRun=True)."
    )
    role_tag_key: str = Field(default=ROLE_TAG_KEY, description="EC2 tag key that marks an instance as a GPU worker.")
    role_tag_value: str = Field(default=ROLE_TAG_VALUE, description="Value of that tag on GPU workers.")

    @property
    def role_tag(self) -> tuple[str, str]:
        return (self.role_tag_key, self.role_tag_value)

    @property
    def region_name(self) -> str:
        """The workers' region; empty when neither ``region`` nor $AWS_DEFAULT_REGION is set (EC2 is not watched)."""
        return self.region or os.environ.get("AWS_DEFAULT_REGION", "")

    def client(self):
        retries = Config(connect_timeout=5, read_timeout=15, retries={"max_attempts": 3, "mode": "standard"})
        return boto3.client("ec2", region_name=self.region_name, config=retries)


@dg.sensor(
    minimum_interval_seconds=SENSOR_INTERVAL_S,
    default_status=dg.DefaultSensorStatus.STOPPED,
    description="Stops (or terminates) EC2 GPU workers tagged ft-assets:role=gpu-worker, and the RunPod, Vast.ai and "
    "SkyPilot workers of rented_workers.providers, that have had no run for longer than the idle threshold; with a "
    "Slurm gpu pool, cancels its jobs whose run has ended. Off by default: turn it on once the worker tags are in place.",
)
def idle_gpu_worker_sensor(
    context: dg.SensorEvaluationContext, ec2_workers: Ec2WorkersResource, rented_workers: RentedWorkersResource
) -> dg.SkipReason:
    now = utc_now()
    threshold = timedelta(minutes=ec2_workers.idle_minutes)
    slurm = slurm_gpu_pool(context.instance)
    if slurm is not None:  # a Slurm gpu pool: its jobs, not machines (idle_minutes and dry_run apply)
        return dg.SkipReason(cancel_idle_slurm_jobs(context, slurm, threshold, ec2_workers.dry_run, now))
    unplaced = unplaced_gpu_runs(context.instance)
    if unplaced:
        return dg.SkipReason(unplaced_message(unplaced))
    watched = {"ec2": ec2_workers} if ec2_workers.region_name else {}
    parts = [] if watched else ["ec2: no region set, not watched"]
    watched |= rented_workers.watched()
    parts += rented_tick(context, watched, now, threshold, partial(runs_by_worker, context.instance))
    return dg.SkipReason("; ".join(parts))


def unplaced_message(unplaced: Sequence[str]) -> str:
    return (
        f"gpu run(s) {', '.join(unplaced)} started without a {WORKER_TAG} tag, so any worker may be busy; "
        f"stopping nothing (the worker should tag its run, see {__name__})"
    )


def _aware(moment: datetime) -> datetime:
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=timezone.utc)
