"""The SkyPilot gpu pool: its task through SkyPilot's own classes, the bill of a recovered job, the managed-job command.

- ``task_config`` for RunPod, Vast.ai, Lambda, AWS spot and Kubernetes goes through ``sky.Task.from_yaml_config``,
  ``Task.validate()`` (every ``sky.Resources`` against the catalog written by ``skypilot_env``) and a YAML round
  trip, in SkyPilot's venv (``sky_task_check.py``); a region SkyPilot does not know is refused by SkyPilot.
- ``update_attempts`` / ``attempts_bill`` split SkyPilot's queue records into attempts and price them; ETH
  counts that bill.
- ``sky_attempt``: which Dagster command an attempt runs for each run status.
"""

import json
import subprocess
from pathlib import Path

import dagster as dg
import pytest
import yaml
from dagster._core.remote_origin import InProcessCodeLocationOrigin, RemoteJobOrigin, RemoteRepositoryOrigin
from dagster._core.types.loadable_target_origin import LoadableTargetOrigin

from ft_assets.control.eth import RunMeasurements, compute_eth
from ft_assets.control.sky_bill import attempts_bill, update_attempts
from ft_assets.targets import GpuRequest, WorkerLaunch, parse_target
from ft_assets.providers.sky_attempt import attempt_command
from ft_assets.targets.skypilot import ordered_infra, task_config

pytest_plugins = ["ft_assets_tests.skypilot_env"]

HERE = Path(__file__).resolve().parent
RECOVERY = {"strategy": "EAGER_NEXT_REGION", "max_restarts_on_errors": 1}


def a_task(accelerator: str, infra: list[str], spot: bool, **changes) -> dict:
    fields = dict(
        name="ft-1a2b3c4d", command="python -m ft_assets.providers.sky_attempt 'ARGS'", image="ghcr.io/example/ft-worker:1",
        accelerator=accelerator, gpus_per_node=1, nodes=1, spot=spot, infra=infra, disk_size=100, job_recovery=RECOVERY,
        autostop_minutes=30, envs={"FT_STORE": "s3://bucket/ft", "FT_GPU_TIER": "rtx4090-24gb", "FT_RENTAL_MODE": "spot"},
        secrets={"AWS_SECRET_ACCESS_KEY": "s3cr3t", "DAGSTER_PG_PASSWORD": "pw"},
    )  # fmt: skip
    return task_config(**(fields | changes))


VARIANTS = {
    "runpod spot": a_task("RTX4090", ["runpod/CA", "runpod"], True),
    "vast": a_task("RTX4090", ["vast"], False),
    "lambda": a_task("H100", ["lambda/us-east-1"], False),
    "aws spot": a_task("A10G", ["aws/us-east-1"], True),
    "kubernetes": a_task("H100", ["kubernetes"], False, gpus_per_node=2),
    "unknown region": a_task("RTX4090", ["runpod/Mars"], True),
    "target": parse_target("skypilot:runpod/CA,vast?image=pytorch/pytorch:2.9.1-cuda12.8-cudnn9-runtime&disk=80").task(
        WorkerLaunch(
            "run1-1-abc123",
            "ft_assets.training.remote",
            ("--store", "s3://b/ft", "--job", "k/job.json"),
            {"AWS_DEFAULT_REGION": "us-east-1"},
            {"AWS_SECRET_ACCESS_KEY": "s3cr3t"},
            GpuRequest("rtx4090-24gb", "RTX4090", 1, "spot"),
        )
    ),
}


@pytest.fixture(scope="module")
def checked(sky_env, tmp_path_factory):
    """Every variant through SkyPilot's classes, in one process of its venv."""
    out = tmp_path_factory.mktemp("sky-check") / "results.json"
    done = subprocess.run([sky_env["real_python"], str(HERE / "sky_task_check.py"), str(out)],
                          input=json.dumps(list(VARIANTS.values())), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.exists(), done.stdout[-2000:] + done.stderr[-2000:]
    return dict(zip(VARIANTS, json.loads(out.read_text())))


EXPECTED = {  # name -> (cloud and region of each entry, in order, accelerators, spot)
    "runpod spot": ([("RunPod", "CA"), ("RunPod", None)], {"RTX4090": 1}, True),
    "vast": ([("Vast", None)], {"RTX4090": 1}, False),
    "lambda": ([("Lambda", "us-east-1")], {"H100": 1}, False),
    "aws spot": ([("AWS", "us-east-1")], {"A10G": 1}, True),
    "kubernetes": ([("Kubernetes", None)], {"H100": 2}, False),
}


@pytest.mark.integration
@pytest.mark.parametrize("variant", sorted(EXPECTED))
def test_the_task_is_a_valid_skypilot_task(checked, variant):
    assert "ok" in checked[variant], checked[variant]
    task = checked[variant]["ok"]
    places, accelerators, spot = EXPECTED[variant]
    assert [(r["cloud"], r["region"]) for r in task["resources"]] == places
    assert task["ordered"] and task["round_trip"]
    for resources in task["resources"]:
        assert resources["accelerators"] == accelerators and resources["use_spot"] is spot
        assert resources["disk_size"] == 100 and resources["job_recovery"] == RECOVERY
        assert resources["autostop"] == [30, True]
        image = resources["image_id"]  # SkyPilot keys a regional image by its region
        assert set(image.values() if isinstance(image, dict) else [image]) == {"docker:ghcr.io/example/ft-worker:1"}
    assert task["secrets"] == {"AWS_SECRET_ACCESS_KEY": "s3cr3t", "DAGSTER_PG_PASSWORD": "pw"}
    assert not set(task["secrets"]) & set(task["envs"])  # credentials only as SkyPilot secrets
    assert task["num_nodes"] == 1 and task["name"] == "ft-1a2b3c4d"


@pytest.mark.integration
def test_the_skypilot_targets_job_is_a_valid_skypilot_task(checked):
    """``--gpu skypilot:runpod/CA,vast``: the plan's card, spot, the worker's command, the keys as secrets only."""
    task = checked["target"]["ok"]
    assert [(r["cloud"], r["region"]) for r in task["resources"]] == [("RunPod", "CA"), ("Vast", None)]
    for resources in task["resources"]:
        assert resources["accelerators"] == {"RTX4090": 1} and resources["use_spot"] is True
        assert resources["disk_size"] == 80
        assert resources["job_recovery"] == {"strategy": "EAGER_NEXT_REGION", "max_restarts_on_errors": 0}
    assert task["run"] == "python3 -m ft_assets.training.remote --store s3://b/ft --job k/job.json"
    assert task["envs"] == {"AWS_DEFAULT_REGION": "us-east-1"} and task["secrets"] == {
        "AWS_SECRET_ACCESS_KEY": "s3cr3t"
    }
    assert task["round_trip"] and task["name"] == "run1-1-abc123"


@pytest.mark.integration
def test_skypilot_refuses_a_region_it_does_not_know(checked):
    error = checked["unknown region"]["error"]
    assert error == "ValueError: Invalid region 'Mars' List of supported runpod regions: 'ca, us'"


def test_a_multi_node_plan_is_refused_before_anything_is_rented():
    from types import SimpleNamespace

    from ft_assets.control.skypilot import SkyPilotRunLauncher

    plan = SimpleNamespace(
        tier="h100-80gb",
        nodes=2,
        purpose="experiment",
        describe=lambda: "16 x h100-80gb (NVIDIA H100 80GB SXM), fsdp over 2 nodes, spot",
    )
    with pytest.raises(ValueError, match=r"planned on 2 nodes \(16 x h100-80gb .*set num_nodes 1"):
        SkyPilotRunLauncher(image="ghcr.io/example/ft-worker:1").task_for(
            SimpleNamespace(run_id="r1"), SimpleNamespace(plan=plan)
        )


def test_the_datas_region_goes_first():
    infra = ["runpod", "aws/us-west-2", "aws/us-east-1/us-east-1a", "lambda/us-east-1"]
    assert ordered_infra(infra, "us-east-1") == [
        "aws/us-east-1/us-east-1a",
        "lambda/us-east-1",
        "runpod",
        "aws/us-west-2",
    ]
    assert ordered_infra(infra, None) == infra


# --- attempts and their bill ---------------------------------------------------------------------

CA = {
    "cloud": "RunPod",
    "region": "CA",
    "zone": "CA-MTL-1",
    "cluster_resources": "1x RunPod(gpus=RTX4090:1)",
    "usd_per_hour": 0.29,
}
US = {
    "cloud": "RunPod",
    "region": "US",
    "zone": "US-GA-1",
    "cluster_resources": "1x RunPod(gpus=RTX4090:1)",
    "usd_per_hour": 0.34,
}
RECORDS = {  # SkyPilot's queue at each check: submitted at 1000, attempt 0 from 1100 (CA), lost at 2000, attempt 1 from 2060 (US)
    "pending": (1050, {"status": "PENDING", "recovery_count": 0, "submitted_at": 1000, "last_recovered_at": -1, "job_duration": 0}),
    "running 0": (1700, {"status": "RUNNING", "recovery_count": 0, "submitted_at": 1000, "last_recovered_at": 1100, "job_duration": 600, **CA}),
    "recovering": (2030, {"status": "RECOVERING", "recovery_count": 0, "submitted_at": 1000, "last_recovered_at": 1100, "job_duration": 900, **CA}),
    "running 1": (2360, {"status": "RUNNING", "recovery_count": 1, "submitted_at": 1000, "last_recovered_at": 2060, "job_duration": 1200, **US}),
    "succeeded": (9999, {"status": "SUCCEEDED", "recovery_count": 1, "submitted_at": 1000, "last_recovered_at": 2060, "end_at": 2660, "job_duration": 1500, **US}),
}  # fmt: skip
# The same attempts, whichever checks saw them: seconds running, the gap before, where, ended.
FINAL = [(900.0, 100.0, "CA", True), (600.0, 60.0, "US", True)]


@pytest.mark.parametrize(
    "seen",
    [list(RECORDS), ["running 0", "running 1", "succeeded"], ["pending", "running 0", "recovering", "succeeded"]],
    ids=["every state", "the recovery between two checks", "the new attempt unseen until the end"],
)
def test_attempts_from_the_queue(seen):
    attempts = []
    for name in seen:
        now, record = RECORDS[name]
        attempts = update_attempts(attempts, record, now)
    got = [(a["seconds"], a["gap_seconds"], a["region"], a["ended"]) for a in attempts]
    assert got == FINAL


def test_an_attempt_never_seen_running_is_priced_at_the_plans_rate():
    attempts = update_attempts([], RECORDS["running 0"][1], 1700)
    attempts = update_attempts(attempts, {**RECORDS["succeeded"][1], "recovery_count": 2}, 9999)  # two recoveries
    bill = attempts_bill(attempts, nodes=1, fallback_usd_per_hour=0.35)
    assert [a["region"] for a in bill["attempts"]] == ["CA", None, "US"]
    assert bill["attempts"][1]["usd_per_hour_all_nodes"] == 0.35 and bill["recoveries"] == 2


def test_the_bill_of_a_recovered_job_is_its_eth():
    attempts = []
    for name in RECORDS:
        attempts = update_attempts(attempts, RECORDS[name][1], RECORDS[name][0])
    bill = attempts_bill(attempts, nodes=1, fallback_usd_per_hour=0.35, data_region="CA")
    assert bill["paid_seconds"] == 1660 and bill["recoveries"] == 1 and bill["attempts_outside_data_region"] == 1
    assert bill["compute_usd"] == pytest.approx(0.29 * 1000 / 3600 + 0.34 * 660 / 3600)
    measured = RunMeasurements(gpu_tier="rtx4090-24gb", rental_mode="spot", wall_seconds=bill["paid_seconds"],
                               step_seconds=1200, restarts=bill["recoveries"], billed_compute_usd=bill["compute_usd"])  # fmt: skip
    report = compute_eth(measured)
    assert report.compute_usd == pytest.approx(bill["compute_usd"])  # not 1660 s at the plan's $0.35/h
    assert report.usd_per_hour == pytest.approx(bill["compute_usd"] / (1660 / 3600))
    assert report.eth_usd_per_hour == pytest.approx(bill["compute_usd"] / (1200 / 3600))  # idle time is paid for
    assert report.restarts == 1


# --- the managed job's command -------------------------------------------------------------------

ORIGIN = RemoteJobOrigin(
    RemoteRepositoryOrigin(InProcessCodeLocationOrigin(LoadableTargetOrigin(python_file=__file__)), "repo"), "train"
)


@pytest.mark.parametrize(
    "status, verb",
    [(dg.DagsterRunStatus.NOT_STARTED, "execute_run"), (dg.DagsterRunStatus.STARTING, "execute_run"),
     (dg.DagsterRunStatus.STARTED, "resume_run"), (dg.DagsterRunStatus.SUCCESS, None),
     (dg.DagsterRunStatus.FAILURE, None), (dg.DagsterRunStatus.CANCELING, None)],
)  # fmt: skip
def test_a_recovered_attempt_resumes_the_run(status, verb):
    from dagster._core.code_pointer import ModuleCodePointer
    from dagster._core.origin import JobPythonOrigin, RepositoryPythonOrigin
    from dagster._grpc.types import ExecuteRunArgs, ResumeRunArgs
    from dagster._serdes import deserialize_value

    origin = JobPythonOrigin(
        "training_plane", RepositoryPythonOrigin("python", ModuleCodePointer("ft_assets.definitions", "defs", ""))
    )
    args = ExecuteRunArgs(origin, "run-1", None, True)
    command = attempt_command(args, status, python="/opt/venv/bin/python")
    if verb is None:
        assert command is None
        return
    assert command[:5] == ["/opt/venv/bin/python", "-m", "dagster", "api", verb]
    sent = deserialize_value(command[5], ResumeRunArgs if verb == "resume_run" else ExecuteRunArgs)
    assert (sent.run_id, sent.job_origin, sent.set_exit_code_on_failure) == ("run-1", origin, True)


# --- the deploy example --------------------------------------------------------------------------

EXAMPLE = HERE.parent / "deploy" / "launchers" / "skypilot-gpu.yaml"


def test_the_deploy_example_fits_both_launchers_and_the_instance_builds_it():
    from dagster._config import process_config
    from dagster._config.field_utils import convert_potential_field

    from ft_assets.control.launcher import PoolRunLauncher
    from ft_assets.control.skypilot import SkyPilotRunLauncher

    example = yaml.safe_load(EXAMPLE.read_text())
    block = example["run_launcher"]
    assert process_config(convert_potential_field(PoolRunLauncher.config_type()).config_type, block["config"]).success
    gpu = block["config"]["pools"]["gpu"]
    schema = convert_potential_field(SkyPilotRunLauncher.config_type()).config_type
    assert process_config(schema, gpu["config"]).success
    assert not process_config(schema, {**gpu["config"], "gpus": 1}).success  # a misspelt key is an error
    with dg.instance_for_test(
        overrides={"run_launcher": block, "run_monitoring": example["run_monitoring"]}
    ) as instance:
        pool = instance.run_launcher.launcher("gpu")
        assert isinstance(pool, SkyPilotRunLauncher) and instance.run_launcher.supports_check_run_worker_health
        assert (pool.infra, pool.job_recovery["strategy"], pool.secrets[-1]) == (
            ["aws/us-east-1", "runpod", "vast", "lambda"],
            "EAGER_NEXT_REGION",
            "DAGSTER_PG_PASSWORD",
        )
        assert instance.run_monitoring_start_timeout_seconds == 3600
