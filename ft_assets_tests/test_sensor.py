import dagster as dg
import pytest

from ft_assets.control.sensors import dataset_version_sensor, scan_datasets
from ft_assets.layout import PartitionLayout
from ft_assets.partitions import DatasetVersion, InvalidDatasetId
from ft_assets.resources import ObjectStoreResource
from ft_assets.storage import LocalStore


@pytest.fixture
def store_url(tmp_path):
    return str(tmp_path / "store")


def drop(store_url, name, version, complete=True):
    store = LocalStore(store_url)
    store.put_bytes(f"datasets/{name}/{version}/part-0.jsonl", b'{"messages": []}\n')
    if complete:
        store.put_bytes(f"datasets/{name}/{version}/_SUCCESS", b"")


def tick(instance, store_url):
    context = dg.build_sensor_context(instance=instance, resources={"store": ObjectStoreResource(url=store_url)})
    result = dataset_version_sensor(context)
    for request in result.dynamic_partitions_requests or []:
        instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
    return result


def test_new_incomplete_and_repeated_versions(store_url):
    with dg.instance_for_test() as instance:
        drop(store_url, "toolcalls", "v1")
        drop(store_url, "toolcalls", "v2", complete=False)
        first = tick(instance, store_url)
        assert [(r.partition_key, r.run_key) for r in first.run_requests] == [("toolcalls@v1", "toolcalls@v1")]
        assert instance.get_dynamic_partitions("dataset_version") == ["toolcalls@v1"]

        second = tick(instance, store_url)  # same version again: nothing new to launch
        assert second.run_requests == [] or second.run_requests is None
        assert instance.get_dynamic_partitions("dataset_version") == ["toolcalls@v1"]

        LocalStore(store_url).put_bytes("datasets/toolcalls/v2/_SUCCESS", b"")  # the upload completes
        third = tick(instance, store_url)
        assert [r.partition_key for r in third.run_requests] == ["toolcalls@v2"]
        assert sorted(instance.get_dynamic_partitions("dataset_version")) == ["toolcalls@v1", "toolcalls@v2"]


def test_invalid_names_are_skipped_not_fatal(store_url):
    with dg.instance_for_test() as instance:
        drop(store_url, "bad name", "v1")
        drop(store_url, "ok", "v 1")
        drop(store_url, "ok", "v1")
        result = tick(instance, store_url)
        assert [r.partition_key for r in result.run_requests] == ["ok@v1"]
    scan = scan_datasets(LocalStore(store_url))
    assert len(scan.invalid) == 2 and all("invalid dataset" in reason for reason in scan.invalid)


INVALID = ["", "..", "a/b", "a..b", "-lead", "with space", "tab\t", "ctl\x01", "new\nline", "x" * 129, "é"]


@pytest.mark.parametrize("value", INVALID)
def test_dataset_ids_are_validated(value):
    with pytest.raises(InvalidDatasetId, match="invalid dataset name"):
        DatasetVersion(value, "v1")
    with pytest.raises(InvalidDatasetId, match="invalid dataset version"):
        DatasetVersion("ok", value)


def test_partition_key_round_trip():
    version = DatasetVersion("toolcalls", "2026-11-30.1")
    assert version.key == "toolcalls@2026-11-30.1"
    assert DatasetVersion.from_key(version.key) == version
    assert PartitionLayout(version).inputs == "datasets/toolcalls/2026-11-30.1"
    with pytest.raises(InvalidDatasetId, match="expected '<name>@<version>'"):
        DatasetVersion.from_key("no-at-sign")
