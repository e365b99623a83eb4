"""``idle_gpu_worker_sensor``: stops (or terminates) rented GPU workers that have been idle too long.

A GPU worker bills by the hour whether it trains or not. With the defaults (30 min threshold, a tick
every 5 min) a forgotten worker is stopped at most 35 min after its last activity: $0.88 at the cost
model's A10G price of $1.50/h, against $72 for one left running over a weekend (48 h).

Which machines: running EC2 instances tagged ``ft-assets:role = gpu-worker`` (``ROLE_TAG_KEY`` /
``ROLE_TAG_VALUE``; put the tag in the worker's launch template). Nothing else is ever touched. RunPod pods,
Vast.ai instances and SkyPilot clusters follow the same rules when ``rented_workers.providers`` lists them
(``ft_assets.control.rented_workers``).

When a worker was last active: the latest of

- its ``LaunchTime`` (EC2 resets it on every start, so a restarted worker gets a fresh allowance);
- the end of the last Dagster run that ran on it. Runs are tied to a worker by the run tag
  ``ft/worker-instance-id = <EC2 instance id>`` (``WORKER_TAG``). The run launcher cannot know on
  which instance the gpu pool places a run, so the worker sets it itself when the run starts::

      context.instance.add_run_tags(context.run_id, worker_instance_tag())  # {} when not on EC2

  (``ft_assets.pools.ec2_metadata.worker_instance_tag`` reads the instance id from the EC2
  instance metadata service, IMDSv2);
- the instance tag ``ft-assets:last-active`` (``HEARTBEAT_TAG``), an ISO 8601 timestamp a worker may
  refresh while it does work Dagster does not see (needs ``ec2:CreateTags`` on itself).

Never touched: a worker with a run tied to it that is not finished (queued for it, starting, started,
canceling; a suspended run holds no worker, as in Dagster), a worker whose heartbeat tag cannot be
read, and every worker while a gpu-pool run (``ft/pool = gpu``) is starting or started without a
worker tag: it runs on one of them and nobody can say which.

A Slurm gpu pool (``SlurmRunLauncher``) has no machines to stop: Slurm frees a job's allocation when
it ends. What can sit idle there is a job no run needs any more (its run ended or was canceled while
the job waits in the queue, or hangs after its run finished): with such a pool the sensor lists the
launcher's jobs (named ``ft-assets-<run id>``) and ``scancel``s the ones whose run has been settled
for longer than the threshold. A job whose run this instance does not know is left alone (another
deployment may share the account).

Stop or terminate: ``stop`` (the default) keeps the root volume, so a restarted worker finds its
downloaded base model again, and bills only that disk (gp3: $0.08/GB-month). ``terminate`` frees
everything and is the only choice for one-time spot instances, which EC2 refuses to stop (the
refusal is logged; the sensor does not terminate instead on its own).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from functools import partial
from typing import Any, Literal

import boto3
import dagster as dg
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError
from dagster import DagsterRunStatus
from dagster._core.storage.dagster_run import RunRecord
from pydantic import Field

from ft_assets.control.cost_model import CostModel
from ft_assets.control.launcher import GPU, POOL_TAG, PoolRunLauncher
from ft_assets.control.rented_workers import RentedWorkersResource, rented_tick
from ft_assets.control.slurm import SlurmRunLauncher
from ft_assets.pools.ec2_metadata import WORKER_TAG
from ft_assets.pools.slurm_cli import JobState, SlurmError

ROLE_TAG_KEY = "ft-assets:role"  # EC2 instance tag that marks a machine as ours to stop
ROLE_TAG_VALUE = "gpu-worker"
HEARTBEAT_TAG = "ft-assets:last-active"  # optional EC2 instance tag, ISO 8601, refreshed by the worker

DEFAULT_IDLE_MINUTES = 30.0  # covers a base-model download and the gap between two queued runs
SENSOR_INTERVAL_S = 300  # one DescribeInstances every 5 min; adds at most 5 min to the idle time
RECENT_RUNS_PER_WORKER = 25  # runs read per worker for its last end time (newest first)

# A run in one of these statuses holds no worker; any other status (queued for the worker, starting,
# running, canceling, or a status Dagster adds later) keeps its worker up.
SETTLED_STATUSES = frozenset(
    {DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED, DagsterRunStatus.SUSPENDED}
)
BUSY_STATUSES = tuple(status for status in DagsterRunStatus if status not in SETTLED_STATUSES)
# Launched, so running on some worker, whether or not it has said which yet.
PLACED_STATUSES = (DagsterRunStatus.STARTING, DagsterRunStatus.STARTED, DagsterRunStatus.CANCELING)

# EC2 GPU instance types -> (default cost-model offering, GPUs per instance), to log the $/h a stop saves.
# The price is the cost model's per-GPU price, not the EC2 list price (g5.xlarge lists $1.006/h).
EC2_GPUS: dict[str, tuple[str, int]] = {
    **{f"g5.{size}": ("a10g-24gb", 1) for size in ("xlarge", "2xlarge", "4xlarge", "8xlarge", "16xlarge")},
    **{f"g5.{size}": ("a10g-24gb", 4) for size in ("12xlarge", "24xlarge")},
    "g5.48xlarge": ("a10g-24gb", 8),
    **{f"g6.{size}": ("l4-24gb", 1) for size in ("xlarge", "2xlarge", "4xlarge", "8xlarge", "16xlarge")},
    **{f"g6.{size}": ("l4-24gb", 4) for size in ("12xlarge", "24xlarge")},
    "g6.48xlarge": ("l4-24gb", 8),
    "p4d.24xlarge": ("a100-40gb", 8),
    "p4de.24xlarge": ("a100-80gb", 8),
    "p5.48xlarge": ("h100-80gb", 8),
}

Action = Literal["stop", "terminate"]


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


@dataclass(frozen=True)
class IdleWorker:
    instance_id: str
    instance_type: str
    spot: bool
    idle_since: datetime
    last_activity: str  # what idle_since is: "launch", "run <id> ended" or "heartbeat tag"
    idle_for: timedelta

    @property
    def idle_minutes(self) -> int:
        return int(self.idle_for.total_seconds() // 60)

    @property
    def usd_per_hour(self) -> float | None:
        """What the worker costs per hour by the cost model's default offering; None for unknown types."""
        if self.instance_type not in EC2_GPUS:
            return None
        name, gpus = EC2_GPUS[self.instance_type]
        per_gpu = CostModel().offering(name).usd_per_hour("spot" if self.spot else "on_demand")
        return None if per_gpu is None else per_gpu * gpus


def instance_tags(instance: Mapping[str, Any]) -> dict[str, str]:
    return {tag["Key"]: tag["Value"] for tag in instance.get("Tags", [])}


def read_heartbeat(tags: Mapping[str, str]) -> datetime | None:
    """The ``ft-assets:last-active`` tag as an aware datetime (naive = UTC); None when absent."""
    value = tags.get(HEARTBEAT_TAG)
    if value is None:
        return None
    try:
        return _aware(datetime.fromisoformat(value.strip()))
    except ValueError:
        raise ValueError(
            f"instance tag {HEARTBEAT_TAG}={value!r} is not an ISO 8601 timestamp; write e.g. "
            f"'2026-01-31T14:05:00Z' (the worker stays up until it is fixed)"
        ) from None


def is_worker(instance: Mapping[str, Any], role_tag: tuple[str, str] = (ROLE_TAG_KEY, ROLE_TAG_VALUE)) -> bool:
    key, value = role_tag
    return instance.get("State", {}).get("Name") == "running" and instance_tags(instance).get(key) == value


def find_idle_workers(
    instances: Iterable[Mapping[str, Any]],
    runs_by_instance: Mapping[str, Sequence[WorkerRun]],
    now: datetime,
    threshold: timedelta,
    role_tag: tuple[str, str] = (ROLE_TAG_KEY, ROLE_TAG_VALUE),
) -> list[IdleWorker]:
    """Running, role-tagged instances (EC2 DescribeInstances dicts) idle for longer than ``threshold``.

    Idle since = the latest of LaunchTime, the end of each settled run in ``runs_by_instance`` and the
    heartbeat tag. An instance with a busy run or an unreadable heartbeat tag is never returned.
    """
    idle = []
    for instance in instances:
        if not is_worker(instance, role_tag):
            continue
        instance_id = instance["InstanceId"]
        runs = runs_by_instance.get(instance_id, ())
        if any(run.status not in SETTLED_STATUSES for run in runs):
            continue
        try:
            heartbeat = read_heartbeat(instance_tags(instance))
        except ValueError:
            continue
        signals = [(_aware(instance["LaunchTime"]), "launch")]
        signals += [(run.ended_at, f"run {run.run_id} ended") for run in runs if run.ended_at is not None]
        if heartbeat is not None:
            signals.append((heartbeat, "heartbeat tag"))
        since, what = max(signals, key=lambda signal: signal[0])
        if now - since > threshold:
            idle.append(
                IdleWorker(
                    instance_id=instance_id,
                    instance_type=instance.get("InstanceType", "?"),
                    spot=instance.get("InstanceLifecycle") == "spot",
                    idle_since=since,
                    last_activity=what,
                    idle_for=now - since,
                )
            )
    return idle


@dataclass(frozen=True)
class ShutdownAction:
    """What ``stop_idle_workers`` did to one worker."""

    worker: IdleWorker
    action: Action
    dry_run: bool
    error: str | None = None  # the EC2 error when the call was refused

    @property
    def ok(self) -> bool:
        return self.error is None

    def describe(self) -> str:
        w = self.worker
        what = f"{w.instance_id} ({w.instance_type}{', spot' if w.spot else ''})"
        idle = f"idle {w.idle_minutes} min since {w.idle_since:%Y-%m-%d %H:%M} UTC ({w.last_activity})"
        if not self.ok:
            return f"could not {self.action} {what}, {idle}: {self.error}"
        price = w.usd_per_hour
        saved = f"; saves ~${price:.2f}/h ({_gpus(w.instance_type)}, cost model)" if price is not None else ""
        if self.dry_run:
            return f"dry run: would {self.action} {what}, {idle}{saved} (EC2 accepted the dry-run call)"
        verb = "stopped" if self.action == "stop" else "terminated"
        return f"{verb} {what}, {idle}{saved}"


def stop_idle_workers(ec2_client, idle: Iterable[IdleWorker], action: Action, dry_run: bool) -> list[ShutdownAction]:
    """Stop or terminate each worker, one EC2 call per instance so one refusal does not block the rest.

    ``dry_run`` sends the same calls with ``DryRun=True``: nothing changes, but EC2 still checks the
    IAM permission, so a dry run that reports no error will also work for real.
    """
    if action not in ("stop", "terminate"):
        raise ValueError(f"action must be 'stop' or 'terminate', got {action!r}")
    call = ec2_client.stop_instances if action == "stop" else ec2_client.terminate_instances
    done = []
    for worker in idle:
        error = None
        try:
            call(InstanceIds=[worker.instance_id], DryRun=dry_run)
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            if not (dry_run and code == "DryRunOperation"):
                error = f"{code}: {exc.response.get('Error', {}).get('Message', exc)}"
        except BotoCoreError as exc:
            error = str(exc)
        done.append(ShutdownAction(worker, action, dry_run, error))
    return done


def list_workers(ec2_client, role_tag: tuple[str, str] = (ROLE_TAG_KEY, ROLE_TAG_VALUE)) -> list[dict]:
    """Running instances carrying the role tag (EC2 DescribeInstances dicts)."""
    key, value = role_tag
    filters = [{"Name": f"tag:{key}", "Values": [value]}, {"Name": "instance-state-name", "Values": ["running"]}]
    pages = ec2_client.get_paginator("describe_instances").paginate(Filters=filters)
    return [instance for page in pages for reservation in page["Reservations"] for instance in reservation["Instances"]]


def runs_by_instance(instance: dg.DagsterInstance, instance_ids: Sequence[str]) -> dict[str, list[WorkerRun]]:
    """Each worker's busy runs and its most recent runs, from the ``ft/worker-instance-id`` run tag."""
    records = {}
    if instance_ids:
        busy = dg.RunsFilter(tags={WORKER_TAG: list(instance_ids)}, statuses=list(BUSY_STATUSES))
        records = {record.dagster_run.run_id: record for record in instance.get_run_records(busy)}
    for instance_id in instance_ids:
        recent = instance.get_run_records(dg.RunsFilter(tags={WORKER_TAG: instance_id}), limit=RECENT_RUNS_PER_WORKER)
        records.update({record.dagster_run.run_id: record for record in recent})
    grouped: dict[str, list[WorkerRun]] = {instance_id: [] for instance_id in instance_ids}
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
    """The EC2 GPU workers the idle sensor may stop, and what it does to them.

    Credentials are never configured here: boto3 reads the AWS_* environment variables or the
    instance/task role. The role needs ec2:DescribeInstances and ec2:StopInstances (or TerminateInstances).
    """

    region: str = Field(default="", description="AWS region of the workers. Empty: $AWS_DEFAULT_REGION.")
    idle_minutes: float = Field(
        default=DEFAULT_IDLE_MINUTES,
        gt=0,
        description="Minutes a worker may sit without a run (or heartbeat) before it is stopped.",
    )
    action: Action = Field(
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

    def client(self):
        region = self.region or os.environ.get("AWS_DEFAULT_REGION")
        if not region:
            raise ValueError("Ec2WorkersResource needs a region: set its 'region' or the AWS_DEFAULT_REGION variable")
        retries = Config(connect_timeout=5, read_timeout=15, retries={"max_attempts": 3, "mode": "standard"})
        return boto3.client("ec2", region_name=region, config=retries)


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
    slurm = slurm_gpu_pool(context.instance)
    if slurm is not None:  # a Slurm gpu pool: its jobs, not machines (idle_minutes and dry_run apply)
        threshold = timedelta(minutes=ec2_workers.idle_minutes)
        return dg.SkipReason(cancel_idle_slurm_jobs(context, slurm, threshold, ec2_workers.dry_run, now))
    if not rented_workers.providers:
        return dg.SkipReason(ec2_tick(context, ec2_workers, now))
    unplaced = unplaced_gpu_runs(context.instance)
    if unplaced:
        return dg.SkipReason(unplaced_message(unplaced))
    watched = ec2_workers.region or os.environ.get("AWS_DEFAULT_REGION")
    parts = [f"EC2: {ec2_tick(context, ec2_workers, now)}" if watched else "EC2: no region set, not watched"]
    threshold = timedelta(minutes=ec2_workers.idle_minutes)
    parts += rented_tick(context, rented_workers, now, threshold, partial(runs_by_instance, context.instance))
    return dg.SkipReason("; ".join(parts))


def ec2_tick(context: dg.SensorEvaluationContext, ec2_workers: Ec2WorkersResource, now: datetime) -> str:
    """The EC2 part of a tick: what it did, in one line."""
    ec2 = ec2_workers.client()
    try:
        workers = list_workers(ec2, ec2_workers.role_tag)
    except (BotoCoreError, ClientError) as exc:
        context.log.warning(f"could not list GPU workers, trying again next tick: {exc}")
        return f"EC2 DescribeInstances failed: {exc}"
    key, value = ec2_workers.role_tag
    if not workers:
        return f"no running EC2 instance tagged {key}={value}"

    unplaced = unplaced_gpu_runs(context.instance)
    if unplaced:
        return unplaced_message(unplaced)
    for worker in workers:
        try:
            read_heartbeat(instance_tags(worker))
        except ValueError as exc:
            context.log.warning(f"{worker['InstanceId']}: {exc}")

    runs = runs_by_instance(context.instance, [worker["InstanceId"] for worker in workers])
    threshold = timedelta(minutes=ec2_workers.idle_minutes)
    idle = find_idle_workers(workers, runs, now, threshold, ec2_workers.role_tag)
    if not idle:
        return f"{len(workers)} GPU worker(s) running, none idle for more than {ec2_workers.idle_minutes:g} min"

    actions = stop_idle_workers(ec2, idle, ec2_workers.action, ec2_workers.dry_run)
    for action in actions:
        (context.log.info if action.ok else context.log.warning)(action.describe())
    done = [a for a in actions if a.ok]
    saved = sum(a.worker.usd_per_hour or 0.0 for a in done)
    if ec2_workers.dry_run:
        summary = f"dry run: would {ec2_workers.action} {len(done)} idle GPU worker(s)"
    else:
        summary = f"{'stopped' if ec2_workers.action == 'stop' else 'terminated'} {len(done)} idle GPU worker(s)"
    if done:
        summary += f" ({', '.join(a.worker.instance_id for a in done)}; ~${saved:.2f}/h)"
    if len(done) < len(actions):
        summary += f"; {len(actions) - len(done)} refused by EC2, see the log"
    return summary


def unplaced_message(unplaced: Sequence[str]) -> str:
    return (
        f"gpu run(s) {', '.join(unplaced)} started without a {WORKER_TAG} tag, so any worker may be busy; "
        f"stopping nothing (the worker should tag its run, see {__name__})"
    )


def _gpus(instance_type: str) -> str:
    name, count = EC2_GPUS[instance_type]
    return f"{count} x {name}"


def _aware(moment: datetime) -> datetime:
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=timezone.utc)
