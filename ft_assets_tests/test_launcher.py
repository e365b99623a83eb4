"""Run routing on a real DagsterInstance with the run queue: training → gpu pool, everything else → cpu.

The instance is configured like dagster.yaml (PoolRunCoordinator + PoolRunLauncher); the pools wrap
Dagster's own test launcher, which records launches instead of starting processes, and the queue is
drained by one iteration of Dagster's queued-run daemon.
"""

import dagster as dg
import pytest
from dagster._core.test_utils import create_test_daemon_workspace_context
from dagster._core.workspace.load_target import ModuleTarget
from dagster._daemon.run_coordinator.queued_run_coordinator_daemon import QueuedRunCoordinatorDaemon

from ft_assets.control.launcher import GPU, POOL_TAG, MixedPoolRun, pool_for_run
from ft_assets_tests.support import MOCK, launched, submit

pytestmark = pytest.mark.integration

OVERRIDES = {
    "run_coordinator": {
        "module": "ft_assets.control.launcher",
        "class": "PoolRunCoordinator",
        "config": {"max_concurrent_runs": 10, "tag_concurrency_limits": [{"key": POOL_TAG, "value": GPU, "limit": 1}]},
    },
    "run_launcher": {
        "module": "ft_assets.control.launcher",
        "class": "PoolRunLauncher",
        "config": {"pools": {"gpu": MOCK, "cpu": MOCK}},
    },
}

ROUTING = [
    ("training-job-tag", {"ft/plane": "training"}, None, "gpu"),
    ("data-job-tag", {"ft/plane": "data"}, None, "cpu"),
    ("ad-hoc-training-asset", {}, ["lora_adapter"], "gpu"),
    ("ad-hoc-training-with-base-model", {}, ["lora_adapter", "base_model"], "gpu"),
    ("ad-hoc-data-assets", {}, ["cleaned_dataset", "raw_dataset"], "cpu"),
    ("base-model-alone", {}, ["base_model"], "cpu"),
    ("explicit-tag-wins", {"ft/pool": "gpu"}, ["raw_dataset"], "gpu"),
    ("nothing-known", {}, None, "cpu"),
]


@pytest.mark.parametrize("name,tags,assets,pool", ROUTING, ids=[r[0] for r in ROUTING])
def test_pool_for_run(name, tags, assets, pool):
    assert pool_for_run(tags, assets) == pool


def test_mixed_run_is_refused_with_a_clear_message():
    with pytest.raises(
        MixedPoolRun, match=r"GPU assets \(lora_adapter\) together with CPU assets \(tokenized_shards\)"
    ):
        pool_for_run({}, ["tokenized_shards", "lora_adapter"])


def test_queue_routes_runs_and_limits_gpu_slots():
    with dg.instance_for_test(overrides=OVERRIDES) as instance:
        target = ModuleTarget(
            module_name="ft_assets.definitions", attribute=None, working_directory=None, location_name="ft_assets"
        )
        with create_test_daemon_workspace_context(target, instance) as context:
            workspace = context.create_request_context()
            location = workspace.get_code_location("ft_assets")
            repository = next(iter(location.get_repositories().values()))
            implicit = repository.get_full_job("__ASSET_JOB")
            from ft_assets.definitions import defs

            implicit_def = defs.resolve_implicit_global_asset_job_def()

            ad_hoc_training = submit(instance, workspace, implicit, implicit_def, ["lora_adapter"])
            second_training = submit(instance, workspace, implicit, implicit_def, ["lora_adapter"])
            data = submit(instance, workspace, implicit, implicit_def, ["raw_dataset", "cleaned_dataset"])
            mixed = submit(instance, workspace, implicit, implicit_def, ["tokenized_shards", "lora_adapter"])

            assert ad_hoc_training.tags[POOL_TAG] == "gpu" and data.tags[POOL_TAG] == "cpu"
            assert mixed.status == dg.DagsterRunStatus.FAILURE
            refusal = [e.message for e in instance.all_logs(mixed.run_id) if "refused this run" in (e.message or "")]
            assert refusal and "materialize them in separate runs" in refusal[0]

            list(QueuedRunCoordinatorDaemon(interval_seconds=1).run_iteration(context))

            gpu, cpu = launched(instance, "gpu"), launched(instance, "cpu")
            assert data.run_id in cpu and data.run_id not in gpu
            # One GPU slot: exactly one of the two training runs launched, on the gpu pool; the other waits.
            assert len(gpu & {ad_hoc_training.run_id, second_training.run_id}) == 1
            waiting = ({ad_hoc_training.run_id, second_training.run_id} - gpu).pop()
            assert instance.get_run_by_id(waiting).status == dg.DagsterRunStatus.QUEUED
            routed = [e.message for e in instance.all_logs(next(iter(gpu))) if "routed this run" in (e.message or "")]
            assert routed == ["[PoolRunLauncher] ft-assets routed this run to the gpu pool (MockedRunLauncher)"]


def test_project_dagster_yaml_builds_the_pool_launcher(tmp_path):
    import shutil
    from pathlib import Path

    from ft_assets.control.launcher import PoolRunCoordinator, PoolRunLauncher

    shutil.copyfile(Path(__file__).resolve().parents[1] / "ft_assets/control/dagster.yaml", tmp_path / "dagster.yaml")
    with dg.DagsterInstance.from_config(str(tmp_path)) as instance:
        assert isinstance(instance.run_coordinator, PoolRunCoordinator)
        assert isinstance(instance.run_launcher, PoolRunLauncher)
        assert type(instance.run_launcher.launcher("gpu")).__name__ == "DefaultRunLauncher"
        assert instance.run_retries_enabled
