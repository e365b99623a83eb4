"""Running the planes on the Dagster instance: the sensor once, the partition's lease, a plane in this process.

The command line evaluates ``dataset_version_sensor`` once (which adds the partition) and waits while
another live run holds the partition's lease. ``run_plane`` executes a plane's job in this process
(``ft-assets run --in-process``; the default submits it through the instance, ``launch.py``) and
reruns a preempted training run as the daemon's run retries would (it resumes from its checkpoint).
Either way a failed run becomes one line (``failure_reason``): the failed blocking check's own
explanation, else the innermost cause of the first failed step.
"""

from __future__ import annotations

import time

import dagster as dg

from ft_assets import locks
from ft_assets.cli.output import CliError, PlaneFailed, log
from ft_assets.control.sensors import dataset_version_sensor
from ft_assets.storage import ObjectStore
from ft_assets.control.automation import CLI_TAGS
from ft_assets.training.assets import PREEMPTED_TAG


def add_partitions(instance: dg.DagsterInstance, partitions_def_name: str, keys: list[str], attempts: int = 3) -> None:
    """Add dynamic partitions, tolerating another ``ft-assets run`` adding the same ones at the same moment.

    Two runs started together both see every new version and both insert them; the instance checks for
    existing keys before inserting, so the slower one can hit a unique-constraint error. What matters is
    that the keys exist afterwards.
    """
    for attempt in range(1, attempts + 1):
        try:
            instance.add_dynamic_partitions(partitions_def_name, keys)
            return
        except Exception:  # the storage's own IntegrityError (SQLite, PostgreSQL): look before judging
            missing = set(keys) - set(instance.get_dynamic_partitions(partitions_def_name))
            if not missing:
                return
            if attempt == attempts:
                raise
            keys = sorted(missing)


def run_sensor(instance: dg.DagsterInstance, defs: dg.Definitions, partition_key: str) -> list[str]:
    """Evaluate the dataset sensor once, apply its partition requests; returns the keys it requested runs for."""
    context = dg.build_sensor_context(
        instance=instance,
        definitions=defs,
        sensor_name=dataset_version_sensor.name,
        resources={"store": defs.resources["store"]},
    )
    result = dataset_version_sensor(context)
    for request in result.dynamic_partitions_requests or []:
        add_partitions(instance, request.partitions_def_name, list(request.partition_keys))
    requested = [r.partition_key for r in result.run_requests or []]
    if partition_key not in instance.get_dynamic_partitions("dataset_version"):
        raise CliError(f"the sensor did not register {partition_key}")
    return requested


def error_line(error) -> str:
    """One line for a Dagster error: the innermost cause, a ``Failure``'s own text without its class name."""
    while error.cause is not None and error.cls_name not in ("Failure", "CliError"):
        error = error.cause
    message = error.message.strip()
    if error.cls_name == "Failure":
        message = message.split(": ", 1)[-1]
    return message


def failure_reason(events: list[dg.DagsterEvent], run_id: str) -> str:
    """The most useful line of a failed run: a failed blocking check's description, else the first failure."""
    for event in events:
        if event.event_type_value == "ASSET_CHECK_EVALUATION":
            evaluation = event.event_specific_data
            if not evaluation.passed and evaluation.severity == dg.AssetCheckSeverity.ERROR:  # a warning blocks nothing
                return f"blocking check {evaluation.check_name} failed: {evaluation.description}"
    for event in events:
        if event.is_step_failure:
            error = event.step_failure_data.error
            return f"{event.step_key}: {error_line(error) if error else event.message}"
    said = None  # the last thing the instance said about the run: a refusal, a worker that died
    for event in events:  # failed before any step (a resource that could not start: a Ray address), or outside one
        if event.event_type_value == "ENGINE_EVENT" and event.message:
            said = event.message
        if event.is_run_failure:
            error = getattr(event.event_specific_data, "error", None)
            if error is not None:
                return error_line(error)
            if said is not None:
                return said
    return f"see run {run_id} in the Dagster UI (make ui)"


def wait_for_partition(store: ObjectStore, instance: dg.DagsterInstance, key: str, poll_seconds: float = 2.0) -> None:
    """Wait while another live run holds the partition's lease, saying why, up to the takeover time.

    A lease whose holder is known dead (its run failed or was canceled, or its process is gone from
    this host) is free at once; ``locks`` then lets this run take it over.
    """

    def run_status(run_id: str) -> str | None:
        record = instance.get_run_by_id(run_id)
        return None if record is None else record.status.value

    said = None
    deadline = time.monotonic() + locks.EXPIRY_SECONDS + 2 * poll_seconds
    while (state := locks.read_lease(store, key)) is not None and (
        busy := locks.busy_reason(state, run_status, time.time())
    ):
        left = deadline - time.monotonic()
        if left <= 0:
            raise CliError(
                f"{busy.message}; it is still renewing its lease, so it is alive: wait for it, or stop it first"
            )
        if (state.generation, state.owner["run_id"]) != said:
            log(f"{busy.message}; waiting up to {min(busy.frees_in, left):.0f} s for it to free")
            said = (state.generation, state.owner["run_id"])
        time.sleep(poll_seconds)


def run_plane(
    instance: dg.DagsterInstance,
    job: dg.JobDefinition,
    plane: str,
    key: str,
    run_config: dict,
    tags: dict | None = None,
) -> list[str]:
    """Execute one plane's job for a partition (``tags`` besides ft-assets' own: the training plane's GPU target);
    like the daemon's run retries, a preempted run is rerun.

    Returns the run ids (more than one when a preempted run was retried and resumed).
    """
    retries = int(job.tags.get("dagster/max_retries", 0))
    run_ids = []
    while True:
        log(f"running {job.name} for {key} ...")
        result = job.execute_in_process(
            instance=instance,
            partition_key=key,
            run_config=run_config,
            tags={"ft/dataset": key, **CLI_TAGS, **(tags or {})},
            raise_on_error=False,
        )
        run_ids.append(result.run_id)
        if result.success:
            return run_ids
        preempted = instance.get_run_by_id(result.run_id).tags.get(PREEMPTED_TAG) == "true"
        if preempted and len(run_ids) <= retries:
            log(
                f"{job.name} run {result.run_id} was preempted; retrying ({len(run_ids)}/{retries}), it resumes from its checkpoint"
            )
            continue
        raise PlaneFailed(
            f"{job.name} failed for {key} (run {result.run_id}): {failure_reason(result.all_events, result.run_id)}",
            plane,
            result.run_id,
        )
