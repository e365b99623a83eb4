"""The automation chain on a real Dagster instance: a new version → data → training → delivery → registry.

Sensors and the schedule are evaluated the way the daemon evaluates them, and each requested run is
executed against the same instance; no step is triggered by hand.
"""

import dagster as dg
import pytest

from ft_assets.control.automation import CLI_TAGS, WINDOW_ENV, deliver_after_training, train_after_data, training_window
from ft_assets.control.sensors import dataset_version_sensor
from ft_assets.definitions import defs
from ft_assets.refs import read_ref
from ft_assets.resources import ObjectStoreResource
from ft_assets.storage import LocalStore
from ft_assets_tests.support import run_config, write_dataset

pytestmark = pytest.mark.integration


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("FT_STORE", str(tmp_path / "store"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv(WINDOW_ENV, raising=False)
    return LocalStore(tmp_path / "store")


def drop_version(store: LocalStore, tmp_path, name: str, version: str, rows: int) -> None:
    data = write_dataset(tmp_path / f"{name}-{version}", rows)
    store.put_file(f"datasets/{name}/{version}/part-0.jsonl", data / "part-0.jsonl")
    store.put_bytes(f"datasets/{name}/{version}/_SUCCESS", b"")


def execute(instance, request: dg.RunRequest, job_name: str, config: dict) -> dg.DagsterRun:
    job = defs.resolve_job_def(job_name)
    names = {node.name for node in job.graph.nodes}
    ops = {k: v for k, v in config["ops"].items() if k in names}
    result = job.execute_in_process(
        instance=instance, partition_key=request.partition_key, run_config={"ops": ops}, raise_on_error=False
    )
    assert result.success, f"{job_name} failed"
    return instance.get_run_by_id(result.run_id)


def on_success(sensor, instance, run: dg.DagsterRun):
    record = next(
        r
        for r in instance.get_records_for_run(run.run_id).records
        if r.event_log_entry.dagster_event_type == dg.DagsterEventType.RUN_SUCCESS
    )
    context = dg.build_run_status_sensor_context(
        sensor_name=sensor.name,
        dagster_event=record.event_log_entry.dagster_event,
        dagster_instance=instance,
        dagster_run=run,
    )
    return sensor(context)


def test_new_version_is_published_without_clicks(env, tmp_path, tiny_model_dir):
    config = run_config(tiny_model_dir, steps=60, lr=0.01)
    drop_version(env, tmp_path, "acks", "v1", rows=240)
    with dg.instance_for_test() as instance:
        tick = dataset_version_sensor(
            dg.build_sensor_context(instance=instance, resources={"store": ObjectStoreResource()})
        )
        for request in tick.dynamic_partitions_requests:
            instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
        (data_request,) = tick.run_requests
        data_run = execute(instance, data_request, "data_plane", config)

        training_request = on_success(train_after_data, instance, data_run)
        assert isinstance(training_request, dg.RunRequest) and training_request.partition_key == "acks@v1"
        training_run = execute(instance, training_request, "training_plane", config)
        assert training_run.tags["ft/pool"] == "gpu"  # the job's tags route it to the GPU pool

        delivery_request = on_success(deliver_after_training, instance, training_run)
        assert isinstance(delivery_request, dg.RunRequest) and delivery_request.partition_key == "acks@v1"
        execute(instance, delivery_request, "delivery_plane", config)

        published = read_ref(env, "acks@v1", "published_model")
        assert published["prefix"].startswith("registry/acks/v1/")
        cost = read_ref(env, "acks@v1", "training_cost")["stats"]
        assert cost["total_usd"] > 0 and cost["eth_usd_per_hour"] > 0
        for asset in (
            "raw_dataset",
            "tokenized_shards",
            "training_plan",
            "lora_adapter",
            "eval_report",
            "published_model",
        ):
            assert instance.get_latest_materialization_event(dg.AssetKey(asset)) is not None, asset


def test_cheap_window_holds_training_until_the_schedule(env, tmp_path, tiny_model_dir, monkeypatch):
    config = run_config(tiny_model_dir, steps=4, lr=0.01)
    drop_version(env, tmp_path, "acks", "night", rows=80)
    monkeypatch.setenv(WINDOW_ENV, "0 1 * * *")
    with dg.instance_for_test() as instance:
        tick = dataset_version_sensor(
            dg.build_sensor_context(instance=instance, resources={"store": ObjectStoreResource()})
        )
        for request in tick.dynamic_partitions_requests:
            instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
        data_run = execute(instance, tick.run_requests[0], "data_plane", config)

        held = on_success(train_after_data, instance, data_run)
        assert isinstance(held, dg.SkipReason) and "held for the cheap window" in held.skip_message
        instance.add_run_tags(data_run.run_id, CLI_TAGS)  # as if `ft-assets run` had started it: it trains next itself
        left = on_success(train_after_data, instance, instance.get_run_by_id(data_run.run_id))
        assert isinstance(left, dg.SkipReason) and "`ft-assets run` started run" in left.skip_message

        def tick():  # a schedule context with resources opens its own instance from the ref: closed by its `with`
            with dg.build_schedule_context(
                instance=instance, resources={"store": ObjectStoreResource()}, repository_def=defs.get_repository_def()
            ) as window:
                return training_window.evaluate_tick(window).run_requests

        requests = tick()
        assert [r.partition_key for r in requests] == ["acks@night"]
        execute(instance, requests[0], "training_plane", config)
        assert not tick()  # nothing left waiting once the adapter is newer than the shards
