"""Automation: a new dataset version flows data → training → delivery without clicks.

``dataset_version_sensor`` starts the data plane. When a data-plane run of a partition succeeds,
``train_after_data`` requests that partition's training run (which the launcher sends to the GPU
pool); when training succeeds, ``deliver_after_training`` requests the delivery run. Each plane is
its own run, so no GPU is held while data is cleaned or a model is evaluated. ``ft-assets run``
drives its planes itself: its runs (tagged ``CLI_TAGS``) do not make these sensors request the next
plane, which would run twice.

Cheap window (optional): set ``FT_TRAINING_WINDOW_CRON`` (e.g. ``0 1 * * *`` for 01:00, when spot
capacity is cheap and plentiful). Then ``train_after_data`` holds training instead of launching it,
and ``training_window`` launches every partition whose shards are newer than its adapter at the
window's start. Without the variable, training starts as soon as the data is ready.
"""

import os

import dagster as dg

from ft_assets.control.jobs import data_plane, delivery_plane, training_plane
from ft_assets.partitions import dataset_version
from ft_assets.refs import has_ref, read_ref
from ft_assets.resources import ObjectStoreResource

WINDOW_ENV = "FT_TRAINING_WINDOW_CRON"
DEFAULT_WINDOW = "0 1 * * *"  # 01:00 daily in the instance's timezone
CLI_TAGS = {"ft/launched-by": "ft-assets-cli"}  # on the runs of `ft-assets run`, which starts their next plane itself


def training_window_cron() -> str | None:
    return os.environ.get(WINDOW_ENV) or None


def _partition(context: dg.RunStatusSensorContext) -> str | None:
    return context.dagster_run.tags.get("dagster/partition")


def _driven_by_cli(context: dg.RunStatusSensorContext) -> bool:
    return all(context.dagster_run.tags.get(key) == value for key, value in CLI_TAGS.items())


@dg.run_status_sensor(
    run_status=dg.DagsterRunStatus.SUCCESS,
    monitored_jobs=[data_plane],
    request_job=training_plane,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Requests the training run of a dataset version once its data plane succeeded (held if a cheap window is set).",
)
def train_after_data(context: dg.RunStatusSensorContext):
    partition = _partition(context)
    if partition is None:
        return dg.SkipReason(f"run {context.dagster_run.run_id} has no partition")
    if _driven_by_cli(context):
        return dg.SkipReason(
            f"{partition}: `ft-assets run` started run {context.dagster_run.run_id} and runs the next plane itself"
        )
    if training_window_cron():
        return dg.SkipReason(
            f"{partition}: training held for the cheap window ({WINDOW_ENV}={training_window_cron()!r})"
        )
    context.log.info(f"{partition}: data plane done, requesting training")
    return dg.RunRequest(run_key=f"training:{partition}:{context.dagster_run.run_id}", partition_key=partition)


@dg.run_status_sensor(
    run_status=dg.DagsterRunStatus.SUCCESS,
    monitored_jobs=[training_plane],
    request_job=delivery_plane,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Requests the delivery run (cost, merge, GGUF, eval gate, publish) once training succeeded.",
)
def deliver_after_training(context: dg.RunStatusSensorContext):
    partition = _partition(context)
    if partition is None:
        return dg.SkipReason(f"run {context.dagster_run.run_id} has no partition")
    if _driven_by_cli(context):
        return dg.SkipReason(
            f"{partition}: `ft-assets run` started run {context.dagster_run.run_id} and runs the next plane itself"
        )
    context.log.info(f"{partition}: training done, requesting delivery")
    return dg.RunRequest(run_key=f"delivery:{partition}:{context.dagster_run.run_id}", partition_key=partition)


def pending_training(store, partitions: list[str]) -> list[tuple[str, float]]:
    """Partitions whose shards are newer than their adapter (or that have none), with the shards' time."""
    pending = []
    for partition in partitions:
        if not has_ref(store, partition, "tokenized_shards"):
            continue
        shards_at = read_ref(store, partition, "tokenized_shards")["created_at"]
        if (
            not has_ref(store, partition, "lora_adapter")
            or read_ref(store, partition, "lora_adapter")["created_at"] < shards_at
        ):
            pending.append((partition, shards_at))
    return pending


@dg.schedule(
    cron_schedule=training_window_cron() or DEFAULT_WINDOW,
    job=training_plane,
    default_status=dg.DefaultScheduleStatus.RUNNING if training_window_cron() else dg.DefaultScheduleStatus.STOPPED,
    description=f"Launches held training runs in the cheap window (on when {WINDOW_ENV} is set).",
)
def training_window(context: dg.ScheduleEvaluationContext, store: ObjectStoreResource):
    partitions = context.instance.get_dynamic_partitions(dataset_version.name)
    pending = pending_training(store.open(), partitions)
    if not pending:
        return dg.SkipReason("no dataset version is waiting for training")
    return [
        dg.RunRequest(
            run_key=f"window:{partition}:{shards_at}", partition_key=partition, tags={"ft/trigger": "training-window"}
        )
        for partition, shards_at in pending
    ]
