"""The SkyPilot gpu pool on a Dagster instance with its daemon, at SkyPilot's SDK boundary (``fake_skypilot.py``).

One instance (SQLite, PoolRunCoordinator's queue, PoolRunLauncher with ``SkyPilotRunLauncher`` as the gpu pool,
run monitoring on) and one ``dagster-daemon`` serve every test here; the store is a real S3 server (SeaweedFS),
whose keys reach the managed job only as SkyPilot secrets (the fake runs each attempt without them in its
environment). The data plane runs once, in process, for one dataset version; then:

- a training run (submitted as ``ft-assets run`` does) goes through the queue to the gpu pool, is planned at launch and submitted as a managed spot
  job; its first attempt is killed (SIGKILL of its process group, as a reclaimed spot instance) after it
  checkpointed, and SkyPilot's recovery runs the same command again in a fresh scratch directory on another
  region: ``sky_attempt`` resumes the run, whose lora_adapter resumes from the checkpoint in the store;
  the run's tags and bill show both attempts, and ETH prices them;
- a run whose job waits for capacity is cancelled (``sky.jobs.cancel``);
- with no cloud enabled, the launch meets SkyPilot's own optimizer and the run fails with its one-line
  ``NoCloudAccessError``.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import pytest
import yaml

from ft_assets import layout
from ft_assets.cli import main
from ft_assets.cli.launch import code_location, create_run, daemon_running, start
from ft_assets.control.assets import measurements
from ft_assets.control.eth import compute_eth
from ft_assets.control.sky_bill import ATTEMPTS_TAG, JOB_TAG, adapter_bill
from ft_assets.control.skypilot import CLOUD_TAG, INSTANCE_TAG, RECOVERIES_TAG, REGION_TAG
from ft_assets.definitions import defs
from ft_assets.manifests import MANIFEST
from ft_assets.providers.ec2_metadata import WORKER_TAG
from ft_assets.refs import read_ref
from ft_assets.storage import open_store
from ft_assets.training.checkpoints import checkpoint_steps
from ft_assets_tests import fake_skypilot
from ft_assets_tests.support import write_dataset

pytest_plugins = ["ft_assets_tests.skypilot_env"]

REPO = Path(__file__).resolve().parents[1]
IMAGE = "ghcr.io/example/ft-assets-worker:1"
KEY = "acks@v1"
TIMEOUT_S = 300.0
STEP_DELAY_S = (
    0.25  # each training step of an attempt (slowed_steps/sitecustomize.py): 10 s to train, > monitoring's poll
)
TRAINING = {"max_steps": 40, "save_steps": 5, "per_device_batch_size": 2, "warmup_steps": 0, "lora_r": 8,
            "lora_alpha": 16, "learning_rate": 1e-3}  # fmt: skip


def dagster_yaml(python: str, store_env: dict) -> dict:
    gpu = {
        "module": "ft_assets.control.skypilot",
        "class": "SkyPilotRunLauncher",
        "config": {
            "image": IMAGE,
            "infra": ["runpod/CA", "runpod/US", "aws/us-east-1"],  # the data is in us-east-1: AWS goes first
            "disk_size": 100,
            "job_recovery": {"strategy": "EAGER_NEXT_REGION", "max_restarts_on_errors": 1},
            "env": {
                **{k: v for k, v in store_env.items() if not k.endswith(("_KEY_ID", "_ACCESS_KEY"))},
                "PYTHONPATH": f"{REPO / 'ft_assets_tests' / 'slowed_steps'}:{REPO}",
                "FT_TEST_STEP_DELAY_S": str(STEP_DELAY_S),
            },
            "secrets": ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"],
            "python": python,
            "worker_python": sys.executable,
        },
    }
    local = {"module": "dagster._core.launcher.default_run_launcher", "class": "DefaultRunLauncher"}
    return {
        "telemetry": {"enabled": False},
        "run_coordinator": {
            "module": "ft_assets.control.launcher",
            "class": "PoolRunCoordinator",
            "config": {"max_concurrent_runs": 2, "dequeue_interval_seconds": 1},
        },  # fmt: skip
        "run_launcher": {
            "module": "ft_assets.control.launcher",
            "class": "PoolRunLauncher",
            "config": {"pools": {"gpu": gpu, "cpu": local}},
        },  # fmt: skip
        "run_monitoring": {"enabled": True, "poll_interval_seconds": 5, "start_timeout_seconds": 240},
    }


@pytest.fixture(scope="module")
def pool(sky_env, seaweedfs, tiny_model_dir, tmp_path_factory):
    """DAGSTER_HOME with the SkyPilot pool, a data plane run for KEY, and a running dagster-daemon."""
    root = tmp_path_factory.mktemp("pool")
    bucket = f"ft-sky-{os.getpid()}"
    seaweedfs.client().create_bucket(Bucket=bucket)
    store_url = f"s3://{bucket}/ft"
    env = {**seaweedfs.env(), "FT_STORE": store_url}
    home = root / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text(yaml.safe_dump(dagster_yaml(sky_env["python"], {**env})))
    config = root / "run_config.yaml"
    config.write_text(yaml.safe_dump({"ops": {"base_model": {"config": {"source": str(tiny_model_dir)}},
                                              "tokenized_shards": {"config": {"seq_len": 128}}}}))  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        for name, value in {**env, "DAGSTER_HOME": str(home), "FT_HOME": str(root / "ft"), "OMP_NUM_THREADS": "1",
                            "PYTHONPATH": str(REPO)}.items():  # fmt: skip
            mp.setenv(name, value)
        mp.delenv("AWS_PROFILE", raising=False)
        name, version = KEY.split("@")
        data = write_dataset(root / "acks")
        assert main(["run", "--dataset", str(data), "--name", name, "--version", version, "--until", "data",
                     "--in-process", "--config", str(config)]) == 0  # fmt: skip
        log_path = root / "daemon.log"
        with open(log_path, "w") as log:
            daemon = subprocess.Popen([str(Path(sys.executable).parent / "dagster-daemon"), "run", "-w", "workspace.yaml"],
                                      cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        try:
            with dg.DagsterInstance.get() as instance, code_location(instance) as code:
                deadline = time.monotonic() + TIMEOUT_S
                while not daemon_running(instance):  # else start() would launch directly, past the queue
                    assert daemon.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
                    time.sleep(0.5)
                yield {"instance": instance, "code": code, "store": open_store(store_url), "root": root,
                       "state": sky_env["state"], "log": log_path, "daemon": daemon}  # fmt: skip
        finally:
            os.killpg(daemon.pid, 9)
            daemon.wait(timeout=30)


def submit(pool) -> str:
    """The training plane for KEY through the queue, as ``ft-assets run`` submits it (the code location's job)."""
    config = {"ops": {"lora_adapter": {"config": TRAINING}}, "execution": {"config": {"in_process": {}}}}
    run = create_run(pool["instance"], pool["code"], defs.resolve_job_def("training_plane"), KEY, config)
    start(pool["instance"], pool["code"], run, "training")
    return run.run_id


def wait(pool, predicate, what: str, timeout_s: float = TIMEOUT_S):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert pool["daemon"].poll() is None, f"dagster-daemon exited:\n{pool['log'].read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}\n{pool['log'].read_text()[-3000:]}"
        time.sleep(0.2)
    return value


def seen_attempts(instance, run_id: str) -> list[dict]:
    """The attempts of the run's managed job as run monitoring has recorded them (its run tag)."""
    return json.loads(instance.get_run_by_id(run_id).tags.get(ATTEMPTS_TAG, "[]"))


def sky_state(pool) -> dict:
    with fake_skypilot.state_file(str(pool["state"])) as state:
        return json.loads(json.dumps(state))


def command(pool, job_id: int, what: str) -> None:
    with fake_skypilot.state_file(str(pool["state"])) as state:
        state["jobs"][str(job_id)]["commands"].append(what)


def messages(pool, run_id: str) -> list[str]:
    return [e.message or "" for e in pool["instance"].all_logs(run_id)]


@pytest.mark.integration
def test_a_preempted_managed_job_recovers_and_resumes_from_the_store(pool):
    instance, store = pool["instance"], pool["store"]
    with fake_skypilot.state_file(str(pool["state"])) as state:
        state.update(clouds=["runpod", "aws"], hold=False,
                     placements=[["RunPod", "CA", "CA-MTL-1"], ["RunPod", "US", "US-GA-1"]])  # fmt: skip
    run_id = submit(pool)
    job_id = int(wait(pool, lambda: instance.get_run_by_id(run_id).tags.get(JOB_TAG), "the managed job"))

    [launch] = sky_state(pool)["launches"]
    resources = launch["task"]["resources"]
    assert [entry["infra"] for entry in resources["ordered"]] == ["aws/us-east-1", "runpod/CA", "runpod/US"]
    for entry in resources["ordered"]:  # what SkyPilot made of the task: every option rents the planned GPU
        assert entry["accelerators"] == {"RTX4090": 1} and entry["use_spot"] is True
        assert entry["disk_size"] == 100 and entry["job_recovery"]["strategy"] == "EAGER_NEXT_REGION"
        assert set(entry["image_id"].values() if isinstance(entry["image_id"], dict) else [entry["image_id"]]) == {
            f"docker:{IMAGE}"
        }
    assert launch["secrets"] == ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"]
    assert not {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} & set(launch["envs"])
    assert launch["envs"]["FT_GPU_TIER"] == "rtx4090-24gb" and launch["envs"]["FT_RENTAL_MODE"] == "spot"
    assert "sky_attempt" in launch["task"]["run"] and "execute_run" not in launch["task"]["run"]

    # Run monitoring has seen attempt 0 placed (it polls every 5 s; an attempt it never sees is billed at the plan's
    # rate), then the attempt checkpointed: it is preempted at once, with most of its slowed steps still to train
    # (unslowed, the 20-step run had finished by the time monitoring had seen it).
    wait(
        pool, lambda: [a for a in seen_attempts(instance, run_id) if a["region"]], "run monitoring's view of attempt 0"
    )
    manifest = "/" + MANIFEST
    checkpointed = wait(pool, lambda: [k for k in store.list(layout.of(KEY).runs)
                                       if "/checkpoint-" in k and k.endswith(manifest)],
                        "the first checkpoint of attempt 0")  # fmt: skip
    command(pool, job_id, "preempt")  # the spot instance is reclaimed: every process of the attempt is gone at once
    run = wait(pool, lambda: (r := instance.get_run_by_id(run_id)).is_finished and r, "the recovered run")
    log = "\n".join(m for m in messages(pool, run_id) if m)
    assert run.status == dg.DagsterRunStatus.SUCCESS, log[-4000:]

    job = wait(
        pool, lambda: (j := sky_state(pool)["jobs"][str(job_id)])["status"] == "SUCCEEDED" and j, "the job's end"
    )
    assert [a["region"] for a in job["attempts"]] == ["CA", "US"]
    scratch = pool["state"].parent / f"job-{job_id}"
    assert "dagster api execute_run" in (scratch / "attempt-0" / "run.log").read_text()
    resumed_log = (scratch / "attempt-1" / "run.log").read_text()
    assert "dagster api resume_run" in resumed_log, (
        f"attempt 1 did not resume the run (did attempt 0 finish before its preemption?): {resumed_log[-500:]}"
    )  # a fresh disk: no attempt-0 files
    assert sorted(p.name for p in (scratch / "attempt-1").iterdir() if not p.name.startswith(("ft-", "tmp"))) == [
        "run.log"
    ]

    adapter = [r for r in instance.fetch_materializations(dg.AssetKey("lora_adapter"), limit=1).records][0]
    assert adapter.run_id == run_id
    resumed = adapter.asset_materialization.metadata["resumed_from_step"].value
    assert resumed >= 5, f"the recovered attempt started over (resumed_from_step={resumed})"
    assert max(checkpoint_steps(store, checkpointed[0].rsplit("/checkpoint-", 1)[0])) == TRAINING["max_steps"]

    tags = run.tags
    assert (tags[CLOUD_TAG], tags[REGION_TAG], tags[RECOVERIES_TAG]) == ("RunPod", "US", "1")
    assert tags[INSTANCE_TAG] == "1x RunPod(gpus=RTX4090:1)"
    assert tags[WORKER_TAG] == f"sky:{launch['name']}-{job_id}"  # the worker's own tag (SKYPILOT_CLUSTER_INFO) agrees
    seen = seen_attempts(instance, run_id)  # by run monitoring, which stops when the run ends (before the job)
    assert [(a["region"], a["usd_per_hour"]) for a in seen] == [("CA", 0.29), ("US", 0.34)] and seen[0]["ended"]

    # training_cost's bill: those attempts with SkyPilot's last record of the job; ETH prices each where it ran
    bill = adapter_bill(instance, KEY, read_ref(store, KEY, "training_plan")["stats"])
    attempts = bill["attempts"]
    assert [(a["region"], a["usd_per_hour"], a["ended"]) for a in attempts] == [("CA", 0.29, True), ("US", 0.34, True)]
    assert all(a["seconds"] > 0 for a in attempts) and attempts[1]["gap_seconds"] >= fake_skypilot.RECOVERY_S
    assert bill["recoveries"] == 1 and bill["attempts_outside_data_region"] == 2  # the data is in us-east-1
    measured, notes = measurements(
        read_ref(store, KEY, "lora_adapter"), read_ref(store, KEY, "training_plan"), store, 7.0, bill
    )
    report = compute_eth(measured)
    assert report.compute_usd == pytest.approx(
        sum(
            0.29 * a["paid_seconds"] / 3600 if a["region"] == "CA" else 0.34 * a["paid_seconds"] / 3600
            for a in attempts
        )
    )
    assert report.restarts == 1 and measured.wall_seconds == bill["paid_seconds"]
    assert measured.egress_bytes == 2 * read_ref(store, KEY, "lora_adapter")["upstream_bytes"]  # each attempt downloads
    assert notes[-1] == f"SkyPilot managed job {job_id} (SUCCEEDED): every attempt as SkyPilot's queue reports it"
    submitted = f"[SkyPilotRunLauncher] SkyPilot managed job {job_id} (ft-{run_id[:8]}) submitted: {{'RTX4090': 1}} x 1 node(s), spot"
    assert any(m.startswith(submitted)
               for m in messages(pool, run_id))  # fmt: skip


@pytest.mark.integration
def test_cancel_a_managed_job_waiting_for_capacity(pool):
    instance = pool["instance"]
    with fake_skypilot.state_file(str(pool["state"])) as state:
        state.update(clouds=["runpod"], hold=True)
    run_id = submit(pool)
    job_id = int(wait(pool, lambda: instance.get_run_by_id(run_id).tags.get(JOB_TAG), "the managed job"))
    assert sky_state(pool)["jobs"][str(job_id)]["status"] == "PENDING"
    assert instance.run_launcher.terminate(run_id)  # what the UI's Terminate does: sky.jobs.cancel
    run = instance.get_run_by_id(run_id)
    assert run.status == dg.DagsterRunStatus.CANCELED
    assert sky_state(pool)["jobs"][str(job_id)]["status"] == "CANCELLED" and sky_state(pool)["cancels"][-1] == job_id
    assert f"SkyPilot managed job {job_id} cancelled (sky.jobs.cancel)" in messages(pool, run_id)


@pytest.mark.integration
def test_with_no_cloud_enabled_the_run_fails_with_skypilots_reason(pool):
    instance = pool["instance"]
    with fake_skypilot.state_file(str(pool["state"])) as state:
        state.update(clouds=[], hold=False)  # SkyPilot's optimizer decides, with no cloud enabled
    launches = len(sky_state(pool)["launches"])
    run_id = submit(pool)
    run = wait(pool, lambda: (r := instance.get_run_by_id(run_id)).is_finished and r, "the refused run")
    assert run.status == dg.DagsterRunStatus.FAILURE and JOB_TAG not in run.tags
    reason = "SkyPilot refused the managed job: NoCloudAccessError: Cloud access is not set up. Run: sky check"
    assert reason in messages(pool, run_id)
    assert len(sky_state(pool)["launches"]) == launches  # no job: SkyPilot's optimizer itself refused
