"""The production profile: dagster.prod.yaml on a real PostgreSQL, and the cloud GPU launcher examples.

- ``dagster.prod.yaml`` is copied verbatim into a temp ``DAGSTER_HOME`` (settings come from the
  ``DAGSTER_PG_*`` variables, as in production). ``ft-assets run`` evaluates the sensor and
  materializes the data plane on it, with no daemon running: it launches the run itself through the
  instance's launcher, against the ``ft_assets`` code location. The runs, materializations and the
  dynamic partition are then read back from PostgreSQL itself.
- With a real ``dagster-daemon`` running, ``ft-assets run`` submits the training run to
  PoolRunCoordinator's queue; the daemon dequeues it and PoolRunLauncher hands it to the gpu pool's
  launcher. Another run goes in by ``dagster job launch`` and is handed to the cpu pool's launcher.
- ``deploy/launchers/{ecs,k8s}-gpu.yaml`` are validated against EcsRunLauncher's and K8sRunLauncher's
  own config schemas, then loaded into an instance as written and made to launch routed runs: ECS on
  moto (EC2/ECS control plane only), Kubernetes against a stub API server that records the Job it is
  sent. Only what cannot exist here is replaced: moto's subnet/security-group IDs, and an out-of-
  cluster kubeconfig instead of ``load_incluster_config``.
"""

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import dagster as dg
import pytest
import yaml
from dagster._config import process_config
from dagster._config.field_utils import convert_potential_field
from dagster._core.code_pointer import ModuleCodePointer
from dagster._core.launcher.base import LaunchRunContext
from dagster._core.origin import JobPythonOrigin, RepositoryPythonOrigin
from dagster._core.test_utils import create_run_for_test, create_test_daemon_workspace_context
from dagster._core.workspace.load_target import ModuleTarget
from dagster._daemon.run_coordinator.queued_run_coordinator_daemon import QueuedRunCoordinatorDaemon
from dagster_aws.ecs import EcsRunLauncher
from dagster_k8s import K8sRunLauncher

from ft_assets.cli import main
from ft_assets.cli.launch import CODE_LOCATION, QUEUE_DAEMON
from ft_assets.cli.run_config import select_ops
from ft_assets.control.launcher import POOL_TAG, PoolRunCoordinator, PoolRunLauncher
from ft_assets.definitions import defs
from ft_assets.refs import read_ref
from ft_assets.storage import open_store
from ft_assets_tests.support import dagster_daemon, run_cli

pytest_plugins = ["ft_assets_tests.pg"]  # the postgres_server fixture

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "samples" / "toolcalls" / "part-000.jsonl"
SAMPLE_LINES = 300  # enough dirt of every kind for the accounting, ~10 s per data-plane run
DATA_PLANE = defs.resolve_job_def("data_plane").asset_layer
DATA_ASSETS = sorted(key.to_user_string() for key in DATA_PLANE.selected_asset_keys)
DATA_CHECKS = sorted(key.name for key in DATA_PLANE.asset_graph.asset_check_keys)
DAEMON_TIMEOUT_S = 180.0
LAUNCHERS = {
    "ecs": (REPO / "deploy/launchers/ecs-gpu.yaml", EcsRunLauncher),
    "k8s": (REPO / "deploy/launchers/k8s-gpu.yaml", K8sRunLauncher),
}
IMAGE = "ghcr.io/example/ft-assets:test"


# --- dagster.prod.yaml on PostgreSQL --------------------------------------------------------------


@pytest.fixture(scope="module")
def prod(postgres_server, tmp_path_factory, tiny_model_dir):
    """A DAGSTER_HOME holding dagster.prod.yaml on a fresh database, with one data-plane run done by the CLI."""
    db = postgres_server.create_database()
    root = tmp_path_factory.mktemp("prod")
    home = root / "dagster_home"
    home.mkdir()
    shutil.copyfile(REPO / "dagster.prod.yaml", home / "dagster.yaml")
    data = root / "toolcalls.jsonl"
    data.write_text("".join(SAMPLE.read_text().splitlines(keepends=True)[:SAMPLE_LINES]))
    config = root / "run_config.yaml"  # the training settings too: the training run with the daemon is tiny
    training = {"max_steps": 2, "save_steps": 2, "per_device_batch_size": 2, "warmup_steps": 0}
    config.write_text(
        yaml.safe_dump(
            {"ops": {"base_model": {"config": {"source": str(tiny_model_dir)}}, "lora_adapter": {"config": training}}}
        )
    )
    with pytest.MonkeyPatch.context() as mp:
        for key, value in {**db.env, "FT_HOME": str(root / "ft"), "DAGSTER_HOME": str(home)}.items():
            mp.setenv(key, value)
        mp.delenv("FT_STORE", raising=False)
        out = root / "summary.json"
        with open(out, "w") as stdout, pytest.MonkeyPatch.context() as mp_out:
            mp_out.setattr(sys, "stdout", stdout)
            code = main(
                [
                    "run",
                    "--dataset",
                    str(data),
                    "--name",
                    "toolcalls",
                    "--version",
                    "prod1",
                    "--until",
                    "data",
                    "--config",
                    str(config),
                    "--json",
                ]
            )
        assert code == 0, "ft-assets run failed on the production instance; see the captured log"
        summary = json.loads(out.read_text().strip().splitlines()[-1])
        yield {"db": db, "home": home, "config": config, "data": data, "summary": summary}


@pytest.mark.integration
def test_prod_instance_keeps_runs_events_and_partitions_in_postgres(prod):
    db, summary = prod["db"], prod["summary"]
    key = summary["partition"]
    assert key == "toolcalls@prod1" and summary["accounting_invariant_holds"] is True

    with dg.DagsterInstance.get() as instance:
        assert type(instance.run_storage).__name__ == "PostgresRunStorage"
        assert type(instance.event_log_storage).__name__ == "PostgresEventLogStorage"
        assert type(instance.schedule_storage).__name__ == "PostgresScheduleStorage"
        coordinator = instance.run_coordinator
        assert isinstance(coordinator, PoolRunCoordinator)
        assert {
            "key": POOL_TAG,
            "value": "gpu",
            "limit": 2,
        } in coordinator.get_run_queue_config().tag_concurrency_limits
        assert isinstance(instance.run_launcher, PoolRunLauncher)
        assert instance.run_retries_enabled and instance.run_retries_max_retries == 0
        assert instance.run_retries_retry_on_asset_or_op_failure  # preemption surfaces as a step failure
        assert instance.run_monitoring_enabled

        [run_id] = summary["runs"]["data"]
        run = instance.get_run_by_id(run_id)
        assert run.status == dg.DagsterRunStatus.SUCCESS and run.job_name == "data_plane"
        assert run.tags["dagster/partition"] == key
        # Submitted against the code location, as the UI would: its job's runs list it, and it went through the launcher.
        assert run.remote_job_origin.location_name == CODE_LOCATION and run.remote_job_origin.job_name == "data_plane"
        assert run_id in {r.run_id for r in instance.get_runs(dg.RunsFilter(job_name="data_plane"))}
        assert run.tags[POOL_TAG] == "cpu"
        routed = [e.message for e in instance.all_logs(run_id) if "routed this run" in (e.message or "")]
        assert routed == ["[PoolRunLauncher] ft-assets routed this run to the cpu pool (DefaultRunLauncher)"]
        for asset in DATA_ASSETS:
            records = instance.fetch_materializations(
                dg.AssetRecordsFilter(asset_key=dg.AssetKey(asset), asset_partitions=[key]), limit=10
            ).records
            assert [r.run_id for r in records] == [run.run_id], asset
        shards = instance.fetch_materializations(dg.AssetKey("tokenized_shards"), limit=1).records[0]
        metadata = shards.asset_materialization.metadata
        assert metadata["packing_efficiency"].value == pytest.approx(summary["packing_efficiency"], abs=1e-5)

    # The same facts straight from PostgreSQL: nothing went to a SQLite file on the side.
    assert db.query("SELECT partitions_def_name, partition FROM dynamic_partitions") == [("dataset_version", key)]
    assert db.query("SELECT run_id, pipeline_name, status FROM runs") == [(run.run_id, "data_plane", "SUCCESS")]
    materialized = db.query(
        "SELECT asset_key, partition, count(*) FROM event_logs WHERE dagster_event_type = 'ASSET_MATERIALIZATION' "
        "GROUP BY asset_key, partition"
    )
    assert sorted(materialized) == sorted((json.dumps([a]), key, 1) for a in DATA_ASSETS)
    checks = db.query("SELECT check_name, execution_status FROM asset_check_executions WHERE run_id = %s", run.run_id)
    assert sorted(checks) == sorted((name, "SUCCEEDED") for name in DATA_CHECKS)
    assert not list(prod["home"].rglob("*.db")), "a SQLite database appeared next to the PostgreSQL instance"


@pytest.mark.integration
def test_the_clis_training_run_is_queued_and_launched_by_the_gpu_pools_launcher(prod, tmp_path, capsys):
    daemon_log = tmp_path / "daemon.log"
    with dg.DagsterInstance.get() as instance, dagster_daemon(daemon_log) as daemon:
        deadline = time.monotonic() + DAEMON_TIMEOUT_S
        while QUEUE_DAEMON not in instance.get_daemon_heartbeats():  # the command looks for this heartbeat
            assert daemon.poll() is None, f"dagster-daemon exited:\n{daemon_log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no queue daemon heartbeat after {DAEMON_TIMEOUT_S:.0f} s"
            time.sleep(1)
        code, summary, err = run_cli(capsys, "run", "--dataset", str(prod["data"]), "--name", "toolcalls", "--version", "prod1",
                                     "--until", "training", "--config", str(prod["config"]), "--json")  # fmt: skip
        assert code == 0, err[-3000:] + daemon_log.read_text()[-3000:]
        assert summary["skipped"] == ["data"] and summary["steps"] == 2
        [run_id] = summary["runs"]["training"]
        assert f"submitting training_plane run {run_id}" in err and "no dagster-daemon is running" not in err

        run = instance.get_run_by_id(run_id)
        assert run.status == dg.DagsterRunStatus.SUCCESS and run.remote_job_origin.location_name == CODE_LOCATION
        events = [r.event_log_entry.dagster_event_type for r in instance.get_records_for_run(run_id).records]
        # Queued first, then started: only the daemon takes a run off the queue.
        assert events.index(dg.DagsterEventType.RUN_ENQUEUED) < events.index(dg.DagsterEventType.RUN_STARTING)
        assert run.tags[POOL_TAG] == "gpu"
        routed = [e.message for e in instance.all_logs(run_id) if "routed this run" in (e.message or "")]
        assert routed == ["[PoolRunLauncher] ft-assets routed this run to the gpu pool (DefaultRunLauncher)"]
        assert prod["db"].query("SELECT value FROM run_tags WHERE run_id = %s AND key = %s", run_id, POOL_TAG) == [
            ("gpu",)
        ]


@pytest.mark.integration
def test_daemon_routes_a_queued_run_to_its_pool(prod, tmp_path):
    key = prod["summary"]["partition"]
    # Steps in one process: the queue and the launcher are under test here, not the executor (the
    # default multiprocess executor would start a Python per step: ~60 s instead of ~15 s).
    config = tmp_path / "run_config.yaml"
    data_config = select_ops(defs.resolve_job_def("data_plane"), yaml.safe_load(prod["config"].read_text()))
    config.write_text(yaml.safe_dump({**data_config, "execution": {"config": {"in_process": {}}}}))
    bin_dir = Path(sys.executable).parent
    launch = subprocess.run(
        [
            str(bin_dir / "dagster"),
            "job",
            "launch",
            "-w",
            "workspace.yaml",
            "-j",
            "data_plane",
            "-c",
            str(config),
            "--tags",
            json.dumps({"dagster/partition": key, "ft/dataset": key}),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert launch.returncode == 0, launch.stdout + launch.stderr

    with dg.DagsterInstance.get() as instance:
        queued = instance.get_runs(dg.RunsFilter(statuses=[dg.DagsterRunStatus.QUEUED]))
        assert len(queued) == 1, "dagster job launch should leave the run in PoolRunCoordinator's queue"
        run_id = queued[0].run_id
        assert queued[0].tags[POOL_TAG] == "cpu"
        assert prod["db"].query("SELECT value FROM run_tags WHERE run_id = %s AND key = %s", run_id, POOL_TAG) == [
            ("cpu",)
        ]

        daemon_log = tmp_path / "daemon.log"
        with dagster_daemon(daemon_log) as daemon:
            deadline = time.monotonic() + DAEMON_TIMEOUT_S
            while not instance.get_run_by_id(run_id).is_finished:
                assert daemon.poll() is None, f"dagster-daemon exited:\n{daemon_log.read_text()[-3000:]}"
                assert time.monotonic() < deadline, f"run {run_id} not finished after {DAEMON_TIMEOUT_S:.0f} s"
                time.sleep(1)

        run = instance.get_run_by_id(run_id)
        log = [e.message for e in instance.all_logs(run_id)]
        assert run.status == dg.DagsterRunStatus.SUCCESS, "\n".join(m for m in log if m)[-3000:]
        assert any("routed this run to the cpu pool (DefaultRunLauncher)" in (m or "") for m in log)
        records = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey("tokenized_shards"), asset_partitions=[key]), limit=10
        ).records
        assert {r.run_id for r in records} == {*prod["summary"]["runs"]["data"], run_id}


# --- deploy/launchers: ECS and Kubernetes GPU pools ----------------------------------------------


def launcher_block(name: str) -> dict:
    path, _ = LAUNCHERS[name]
    block = yaml.safe_load(path.read_text())["run_launcher"]
    assert (block["module"], block["class"]) == ("ft_assets.control.launcher", "PoolRunLauncher"), path
    return block


@pytest.mark.parametrize("name", sorted(LAUNCHERS))
def test_launcher_examples_match_the_launchers_own_schemas(name):
    path, launcher_class = LAUNCHERS[name]
    block = launcher_block(name)
    assert process_config(convert_potential_field(PoolRunLauncher.config_type()).config_type, block["config"]).success
    for pool in ("gpu", "cpu"):
        spec = block["config"]["pools"][pool]
        assert f"{spec['module']}.{spec['class']}".endswith(launcher_class.__name__), (path, pool)
        schema = convert_potential_field(launcher_class.config_type()).config_type
        result = process_config(schema, spec["config"])
        assert result.success, f"{path.name} pools.{pool}: {[e.message for e in result.errors]}"
        # The schema is strict where it matters: a misspelt key is an error, not a silent no-op.
        assert not process_config(schema, {**spec["config"], "gpus": 1}).success


def job_origin(job_name: str) -> JobPythonOrigin:
    pointer = ModuleCodePointer("ft_assets.definitions", "defs", str(REPO))
    return JobPythonOrigin(job_name, RepositoryPythonOrigin(sys.executable, pointer, container_image=IMAGE))


def launch(
    instance, job_name: str, tags: dict, asset: str | None = None, run_config: dict | None = None
) -> dg.DagsterRun:
    """Create a run like the queue daemon would hand it over and send it through PoolRunLauncher."""
    run = create_run_for_test(
        instance,
        job_name=job_name,
        job_code_origin=job_origin(job_name),
        tags=tags,
        asset_selection=frozenset({dg.AssetKey(asset)}) if asset else None,
        run_config=run_config,
    )
    instance.run_launcher.launch_run(LaunchRunContext(run, None))
    return instance.get_run_by_id(run.run_id)


@pytest.fixture
def aws(monkeypatch):
    from moto import mock_aws

    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    with mock_aws():
        yield


def ecs_account(block: dict) -> None:
    """What the ECS example expects to exist: cluster, capacity providers, the two task definitions, a GPU host."""
    import boto3

    ec2, ecs = boto3.client("ec2"), boto3.client("ecs")
    pools = block["config"]["pools"]
    gpu_provider = pools["gpu"]["config"]["run_task_kwargs"]["capacityProviderStrategy"][0]["capacityProvider"]
    ecs.create_capacity_provider(
        name=gpu_provider,
        autoScalingGroupProvider={
            "autoScalingGroupArn": "arn:aws:autoscaling:us-east-1:123456789012:autoScalingGroup:0:autoScalingGroupName/ft-gpu",
            "managedScaling": {"status": "ENABLED"},
        },
    )
    ecs.create_cluster(
        clusterName=pools["gpu"]["config"]["run_task_kwargs"]["cluster"],
        capacityProviders=["FARGATE", "FARGATE_SPOT", gpu_provider],
    )
    for instance_type in ("g5.xlarge", "g5.12xlarge"):  # 1 and 4 GPUs: the spot pool's instance types
        host = ec2.run_instances(ImageId="ami-0123456789abcdef0", MinCount=1, MaxCount=1, InstanceType=instance_type)[
            "Instances"
        ][0]
        ecs.register_container_instance(
            cluster="ft-assets", instanceIdentityDocument=json.dumps({"instanceId": host["InstanceId"]})
        )
    gpu_definition = json.loads((REPO / "deploy/launchers/ecs-gpu-task-definition.json").read_text())
    assert gpu_definition["family"] == pools["gpu"]["config"]["task_definition"]
    gpu_definition["containerDefinitions"][0]["memory"] = (
        4096  # moto's fake hosts register 7,482 MB, a g5.xlarge 16 GiB
    )
    ecs.register_task_definition(**gpu_definition)
    ecs.register_task_definition(
        family=pools["cpu"]["config"]["task_definition"],
        requiresCompatibilities=["FARGATE"],
        networkMode="awsvpc",
        cpu="2048",
        memory="8192",
        containerDefinitions=[{"name": "run", "image": IMAGE, "memory": 8192}],
    )
    vpc = ec2.create_vpc(CidrBlock="10.0.0.0/16")["Vpc"]["VpcId"]
    ec2.modify_vpc_attribute(VpcId=vpc, EnableDnsHostnames={"Value": True})  # awsvpc tasks get a private DNS name
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.0.1.0/24")["Subnet"]["SubnetId"]
    group = ec2.create_security_group(GroupName="ft-assets", Description="ft-assets runs", VpcId=vpc)["GroupId"]
    for pool in pools.values():  # placeholder IDs in the example → the ones that exist in this account
        network = pool["config"]["run_task_kwargs"].get("networkConfiguration")
        if network:
            network["awsvpcConfiguration"].update(subnets=[subnet], securityGroups=[group])


@pytest.mark.integration  # Dagster runs through the pool launcher
def test_ecs_example_sends_training_to_spot_gpu_and_the_rest_to_fargate(aws):
    import boto3

    block = launcher_block("ecs")
    ecs_account(block)
    ecs = boto3.client("ecs")
    with dg.instance_for_test(overrides={"run_launcher": block}) as instance:
        pool_launcher = instance.run_launcher
        assert isinstance(pool_launcher, PoolRunLauncher)
        assert pool_launcher.launcher("gpu").task_definition.endswith(":task-definition/ft-assets-gpu:1")

        training = launch(instance, "training_plane", {"dagster/partition": "toolcalls@v1"}, asset="lora_adapter")
        bigger = launch(
            instance,
            "training_plane",
            {
                "dagster/partition": "toolcalls@v1",
                "ecs/container_overrides": json.dumps({"resourceRequirements": [{"type": "GPU", "value": "4"}]}),
            },
            asset="lora_adapter",
        )
        data = launch(instance, "data_plane", {"dagster/partition": "toolcalls@v1", "ft/plane": "data"})

        def task(run):
            return ecs.describe_tasks(cluster="ft-assets", tasks=[run.tags["ecs/task_arn"]], include=["TAGS"])["tasks"][
                0
            ]

        for run in (training, bigger):
            assert run.tags[POOL_TAG] == "gpu"
            gpu_task = task(run)
            assert gpu_task["taskDefinitionArn"].endswith("task-definition/ft-assets-gpu:1")
            assert gpu_task["capacityProviderName"] == "ft-assets-gpu-spot"
            assert {"key": "ft/pool", "value": "gpu"} in gpu_task["tags"]
            assert {"key": "dagster/partition", "value": "toolcalls@v1"} in gpu_task["tags"]
        gpu_def = ecs.describe_task_definition(taskDefinition=task(training)["taskDefinitionArn"])["taskDefinition"]
        assert gpu_def["containerDefinitions"][0]["resourceRequirements"] == [{"type": "GPU", "value": "1"}]
        # SIGTERM, then ECS's longest wait before SIGKILL: time for the step-boundary checkpoint to upload
        assert gpu_def["containerDefinitions"][0]["stopTimeout"] == 120
        assert "resourceRequirements" not in task(training)["overrides"]["containerOverrides"][0]
        override = task(bigger)["overrides"]["containerOverrides"][0]
        assert override["name"] == "run" and override["resourceRequirements"] == [{"type": "GPU", "value": "4"}]
        assert "execute_run" in override["command"]

        assert data.tags[POOL_TAG] == "cpu"
        cpu_task = task(data)
        assert cpu_task["taskDefinitionArn"].endswith("task-definition/ft-assets-cpu:1")
        assert cpu_task["capacityProviderName"] == "FARGATE_SPOT"
        assert {"key": "ft/pool", "value": "cpu"} in cpu_task["tags"]


class _KubeApiStub(BaseHTTPRequestHandler):
    """Accepts Job creations like the API server and records their bodies (the kubernetes client's real wire format)."""

    created: list = []

    def do_POST(self):  # noqa: N802 (http.server's naming)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.created.append((self.path, body))
        reply = json.dumps(body).encode()
        self.send_response(201)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


@pytest.fixture
def kube_api(tmp_path):
    _KubeApiStub.created = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _KubeApiStub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    kubeconfig = tmp_path / "kubeconfig.yaml"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "stub",
                "clusters": [{"name": "stub", "cluster": {"server": f"http://127.0.0.1:{server.server_port}"}}],
                "users": [{"name": "stub", "user": {}}],
                "contexts": [{"name": "stub", "context": {"cluster": "stub", "user": "stub"}}],
            }
        )
    )
    try:
        yield kubeconfig, _KubeApiStub.created
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.integration  # Dagster runs through the pool launcher
def test_k8s_example_puts_training_on_a_spot_gpu_node(kube_api):
    kubeconfig, created = kube_api
    block = launcher_block("k8s")
    for pool in block["config"]["pools"].values():
        assert pool["config"]["load_incluster_config"] is True  # production: the daemon runs in the cluster
        pool["config"].update(load_incluster_config=False, kubeconfig_file=str(kubeconfig))
    with dg.instance_for_test(overrides={"run_launcher": block}) as instance:
        training = launch(instance, "training_plane", {"dagster/partition": "toolcalls@v1"}, asset="lora_adapter")
        four_gpus = {"nvidia.com/gpu": "4"}
        bigger = launch(
            instance,
            "training_plane",
            {
                "dagster/partition": "toolcalls@v1",
                "dagster-k8s/config": json.dumps(
                    {"container_config": {"resources": {"requests": four_gpus, "limits": four_gpus}}}
                ),
            },
            asset="lora_adapter",
        )
        data = launch(instance, "data_plane", {"dagster/partition": "toolcalls@v1", "ft/plane": "data"})
    assert [run.tags[POOL_TAG] for run in (training, bigger, data)] == ["gpu", "gpu", "cpu"]
    assert [path for path, _ in created] == ["/apis/batch/v1/namespaces/ft-assets/jobs"] * 3
    (_, gpu_job), (_, bigger_job), (_, cpu_job) = created

    gpu_pod = gpu_job["spec"]["template"]["spec"]
    container = gpu_pod["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert container["resources"]["requests"]["nvidia.com/gpu"] == "1"
    assert gpu_pod["nodeSelector"]["karpenter.sh/capacity-type"] == "spot"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in gpu_pod["tolerations"]
    assert {"key": "spot", "operator": "Equal", "value": "true", "effect": "NoSchedule"} in gpu_pod["tolerations"]
    assert gpu_pod["terminationGracePeriodSeconds"] == 120
    assert gpu_pod["serviceAccountName"] == "ft-assets-run"
    assert gpu_job["spec"]["backoffLimit"] == 0
    assert gpu_job["metadata"]["labels"]["ft/pool"] == "gpu"
    assert container["image"] == IMAGE  # the code location's own image wins over job_image
    password = [e for e in container["env"] if e["name"] == "DAGSTER_PG_PASSWORD"]
    assert password and password[0]["valueFrom"]["secretKeyRef"]["name"] == "ft-assets-postgresql"
    assert {"configMapRef": {"name": "ft-assets-env"}} in container["envFrom"]
    digest = [e["value"] for e in container["env"] if e["name"] == "FT_IMAGE_DIGEST"]  # worker_image.py reads it
    assert digest == [f"ghcr.io/example/ft-assets@sha256:{'0' * 64}"]

    bigger_resources = bigger_job["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert bigger_resources["limits"] == {"memory": "14Gi", "nvidia.com/gpu": "4"}
    assert bigger_resources["requests"]["nvidia.com/gpu"] == "4"

    cpu_pod = cpu_job["spec"]["template"]["spec"]
    assert "nvidia.com/gpu" not in json.dumps(cpu_pod["containers"][0]["resources"])
    assert "nodeSelector" not in cpu_pod and "tolerations" not in cpu_pod
    assert cpu_job["metadata"]["labels"]["ft/pool"] == "cpu"


def training_settings(**settings) -> dict:
    return {"ops": {"lora_adapter": {"config": settings}}}


@pytest.mark.integration  # Dagster runs through the pool launcher
def test_ecs_gpu_pool_asks_for_the_gpus_of_the_training_settings(aws):
    import boto3

    block = launcher_block("ecs")
    ecs_account(block)
    with dg.instance_for_test(overrides={"run_launcher": block}) as instance:
        run = launch(instance, "training_plane", {"dagster/partition": "toolcalls@v1"}, asset="lora_adapter",
                     run_config=training_settings(num_processes=4, parallelism="fsdp"))  # fmt: skip
    task = boto3.client("ecs").describe_tasks(cluster="ft-assets", tasks=[run.tags["ecs/task_arn"]])["tasks"][0]
    assert task["overrides"]["containerOverrides"][0]["resourceRequirements"] == [{"type": "GPU", "value": "4"}]


@pytest.mark.integration  # Dagster runs through the pool launcher
def test_k8s_gpu_pool_asks_for_the_settings_gpus_and_the_other_nodes_copy_the_run_pod(kube_api):
    """num_processes=4, num_nodes=2: the run's Job asks for 4 GPUs; lora_adapter's Job of node 1, rendered from that
    pod, asks for the same 4 and runs launch.node_command; every field is one the Kubernetes API knows (a round trip
    through the client's models loses nothing), and the API server takes it."""
    from kubernetes import client, config

    from ft_assets.training.config import TrainingConfig
    from ft_assets.training.launch import WorkerJob, node_command
    from ft_assets.training.nodes import peer_job

    kubeconfig, created = kube_api
    block = launcher_block("k8s")
    for pool in block["config"]["pools"].values():
        pool["config"].update(load_incluster_config=False, kubeconfig_file=str(kubeconfig))
    settings = dict(num_processes=4, num_nodes=2, parallelism="fsdp", method="lora")
    with dg.instance_for_test(overrides={"run_launcher": block}) as instance:
        launch(
            instance,
            "training_plane",
            {"dagster/partition": "toolcalls@v1"},
            asset="lora_adapter",
            run_config=training_settings(**settings),
        )
    ((_, run_job),) = created
    template = run_job["spec"]["template"]
    run_container = template["spec"]["containers"][0]
    assert (
        run_container["resources"]["limits"]["nvidia.com/gpu"]
        == "4"
        == run_container["resources"]["requests"]["nvidia.com/gpu"]
    )
    pod_ip = next(e for e in run_container["env"] if e["name"] == "FT_POD_IP")
    assert pod_ip["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}

    run_pod = {"metadata": {**template["metadata"], "name": "dagster-run-abc-x7k2p", "namespace": "ft-assets", "uid": "1234"},
               "spec": template["spec"]}  # fmt: skip
    job = WorkerJob(
        TrainingConfig(**settings),
        "s3://bucket/ft",
        "runs/t/v1/train/abc",
        "base/x/y",
        "runs/t/v1/data/shards",
        "sft",
        {},
    )
    manifest = peer_job(
        run_pod, "dagster-run-abc-x7k2p-nodes", node_command(job, "10.1.2.3:29400", "/tmp/ft-node"), nodes=2
    )
    api = client.ApiClient()
    model = api.deserialize(type("Response", (), {"data": json.dumps(manifest)})(), "V1Job")  # as if the server sent it
    assert api.sanitize_for_serialization(model) == manifest  # no field the API does not know, none of the wrong type
    spec, pod = manifest["spec"], manifest["spec"]["template"]["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"], spec["backoffLimit"]) == (
        "Indexed",
        1,
        1,
        0,
    )
    node = pod["containers"][0]
    assert node["resources"] == run_container["resources"] and node["image"] == run_container["image"] == IMAGE
    assert (
        node["command"][:3] == ["python", "-m", "ft_assets.training.launch"]
        and node["command"][-1] == "JOB_COMPLETION_INDEX"
    )
    assert WorkerJob.from_json(node["command"][node["command"].index("--job") + 1]) == job
    assert (
        node["envFrom"] == run_container["envFrom"] and node["env"] == run_container["env"]
    )  # store keys, Dagster settings
    assert (
        pod["tolerations"] == template["spec"]["tolerations"]
        and pod["nodeSelector"] == template["spec"]["nodeSelector"]
    )
    assert pod["terminationGracePeriodSeconds"] == 120 and pod["restartPolicy"] == "Never"
    assert manifest["metadata"]["ownerReferences"][0]["uid"] == "1234"  # deleted with the run's pod
    config.load_kube_config(str(kubeconfig))
    client.BatchV1Api().create_namespaced_job("ft-assets", manifest)
    assert created[-1] == ("/apis/batch/v1/namespaces/ft-assets/jobs", manifest)


@pytest.mark.integration
def test_a_training_run_started_as_the_launchpad_starts_it_plans_and_asks_for_its_own_settings(prod, kube_api):
    """The training_plane job with lora_r 64 and num_processes 2 set on lora_adapter only, launched with the GraphQL
    mutation the UI's launchpad sends: PoolRunCoordinator queues it, the queue daemon's iteration dequeues it,
    PoolRunLauncher hands it to the Kubernetes GPU pool with a 2-GPU override; the Job's container command then runs
    here, as the pod would. The partition's newest plan is of those settings, and lora_adapter trained against it."""
    from dagster_graphql.client.query import LAUNCH_PIPELINE_EXECUTION_MUTATION
    from dagster_graphql.test.utils import execute_dagster_graphql

    kubeconfig, created = kube_api
    block = launcher_block("k8s")
    for pool in block["config"]["pools"].values():
        pool["config"].update(load_incluster_config=False, kubeconfig_file=str(kubeconfig))
    coordinator = {
        "module": "ft_assets.control.launcher",
        "class": "PoolRunCoordinator",
        "config": {"max_concurrent_runs": 2},
    }
    key = prod["summary"]["partition"]
    settings = {
        **yaml.safe_load(prod["config"].read_text())["ops"]["lora_adapter"]["config"],
        "lora_r": 64,
        "num_processes": 2,
    }
    # the steps in one process: the queue, the launcher and the plan are under test here, not the executor
    run_config = {"ops": {"lora_adapter": {"config": settings}}, "execution": {"config": {"in_process": {}}}}
    target = ModuleTarget(
        module_name="ft_assets.definitions", attribute=None, working_directory=None, location_name=CODE_LOCATION
    )
    with dg.instance_for_test(overrides={"run_coordinator": coordinator, "run_launcher": block}) as instance:
        instance.add_dynamic_partitions("dataset_version", [key])
        with create_test_daemon_workspace_context(target, instance) as context:
            params = {
                "selector": {"repositoryLocationName": CODE_LOCATION, "repositoryName": "__repository__", "pipelineName": "training_plane"},
                "runConfigData": run_config, "executionMetadata": {"tags": [{"key": "dagster/partition", "value": key}]},
            }  # fmt: skip
            reply = execute_dagster_graphql(
                context.create_request_context(), LAUNCH_PIPELINE_EXECUTION_MUTATION, {"executionParams": params}
            )
            launch = reply.data["launchPipelineExecution"]
            assert launch["__typename"] == "LaunchRunSuccess", launch
            run_id = launch["run"]["runId"]
            assert instance.get_run_by_id(run_id).status == dg.DagsterRunStatus.QUEUED
            list(QueuedRunCoordinatorDaemon(interval_seconds=1).run_iteration(context))
        launched = instance.get_run_by_id(run_id)
        assert launched.tags[POOL_TAG] == "gpu"
        asked = json.loads(launched.tags["dagster-k8s/config"])["container_config"]["resources"]
        assert asked == {"requests": {"nvidia.com/gpu": "2"}, "limits": {"nvidia.com/gpu": "2"}}
        ((_, job),) = created
        container = job["spec"]["template"]["spec"]["containers"][0]
        assert (
            container["resources"]["limits"]["nvidia.com/gpu"]
            == "2"
            == container["resources"]["requests"]["nvidia.com/gpu"]
        )

        command = [*container.get("command", []), *container["args"]]  # the pod's: dagster api execute_run <run>
        assert command[:3] == ["dagster", "api", "execute_run"]
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        pod = subprocess.run([str(Path(sys.executable).parent / "dagster"), *command[1:]], env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
        log = "\n".join(e.message or "" for e in instance.all_logs(run_id))
        assert instance.get_run_by_id(run_id).status == dg.DagsterRunStatus.SUCCESS, (pod.stderr[-2000:], log[-3000:])

    store = open_store()
    plan, adapter = read_ref(store, key, "training_plan"), read_ref(store, key, "lora_adapter")
    stats = plan["stats"]
    assert (stats["training_config"]["lora_r"], stats["training_config"]["num_processes"], stats["gpus"]) == (64, 2, 2)
    assert stats["planned_for"] == f"lora_adapter of run {run_id}"
    assert adapter["training_config"]["lora_r"] == 64 and adapter["stats"]["device"] == "cpu x2"
    assert adapter["upstream"]["training_plan"]["digest"] == plan["digest"]  # what training_cost will price against
