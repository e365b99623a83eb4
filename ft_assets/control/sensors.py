"""``dataset_version_sensor``: turns a completed upload under ``datasets/<name>/<version>/`` into a run.

A version counts once its ``_SUCCESS`` marker exists; uploaders write it last, so a version still
being uploaded is never picked up half-way. For each new complete version the sensor adds the
``<name>@<version>`` partition and requests a data-plane run with ``run_key`` = the partition key,
and only for partitions it has not added before, so a version is launched exactly once however
often the sensor ticks. Names that would be unsafe
as object keys or partition keys are skipped with a logged reason instead of failing the sensor
(one bad upload must not stop the others).
"""

from dataclasses import dataclass, field

import dagster as dg

from ft_assets import layout
from ft_assets.control.jobs import DATA_PLANE
from ft_assets.layout import SUCCESS_MARKER
from ft_assets.partitions import DatasetVersion, InvalidDatasetId, dataset_version
from ft_assets.resources import ObjectStoreResource
from ft_assets.storage import ObjectStore

SENSOR_INTERVAL_S = 30  # listing a bucket twice a minute costs cents a month and feels immediate


@dataclass
class Scan:
    complete: list[DatasetVersion] = field(default_factory=list)
    incomplete: list[str] = field(default_factory=list)
    invalid: list[str] = field(default_factory=list)


def scan_datasets(store: ObjectStore) -> Scan:
    scan = Scan()
    for name, version in layout.dataset_folders(store):
        try:
            found = DatasetVersion(name, version)
        except InvalidDatasetId as exc:
            scan.invalid.append(str(exc))
            continue
        if store.exists(layout.PartitionLayout(found).success_marker):
            scan.complete.append(found)
        else:
            scan.incomplete.append(found.key)
    return scan


@dg.sensor(
    job_name=DATA_PLANE,
    minimum_interval_seconds=SENSOR_INTERVAL_S,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Adds a dataset_version partition and runs the data plane for each complete upload (_SUCCESS written).",
)
def dataset_version_sensor(context: dg.SensorEvaluationContext, store: ObjectStoreResource) -> dg.SensorResult:
    scan = scan_datasets(store.open())
    for reason in scan.invalid:
        context.log.warning(f"skipping dataset folder: {reason}")
    if scan.incomplete:
        context.log.info(f"waiting for {SUCCESS_MARKER} in: {', '.join(scan.incomplete)}")
    known = set(context.instance.get_dynamic_partitions(dataset_version.name))
    new = [v.key for v in scan.complete if v.key not in known]
    if not new:
        return dg.SensorResult(skip_reason=f"no new complete dataset version ({len(scan.complete)} known)")
    context.log.info(f"new dataset version(s): {', '.join(new)}")
    return dg.SensorResult(
        run_requests=[dg.RunRequest(run_key=key, partition_key=key, tags={"ft/dataset": key}) for key in new],
        dynamic_partitions_requests=[dataset_version.build_add_request(new)],
    )
