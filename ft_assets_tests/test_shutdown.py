import logging
from datetime import datetime, timedelta, timezone

import boto3
import dagster as dg
import pytest
from botocore.stub import Stubber
from dagster._core.remote_origin import InProcessCodeLocationOrigin, RemoteJobOrigin, RemoteRepositoryOrigin
from dagster._core.test_utils import create_run_for_test, freeze_time
from dagster._core.types.loadable_target_origin import LoadableTargetOrigin
from moto import mock_aws

from ft_assets.control import shutdown
from ft_assets.control.cost_model import CostModel
from ft_assets.control.idle_backends.ec2 import HEARTBEAT_TAG, ROLE_TAG_KEY, ROLE_TAG_VALUE, as_worker
from ft_assets.control.rented_workers import RentedWorkersResource, find_idle
from ft_assets.control.shutdown import Ec2WorkersResource, WorkerRun, find_idle_slurm_jobs, idle_gpu_worker_sensor
from ft_assets.providers.ec2_metadata import WORKER_TAG
from ft_assets.providers.slurm_cli import JobState

S = dg.DagsterRunStatus
NOW = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)
THRESHOLD = timedelta(minutes=30)
WORKER = {ROLE_TAG_KEY: ROLE_TAG_VALUE}


def minutes_ago(minutes: float) -> datetime:
    return NOW - timedelta(minutes=minutes)


def ec2_instance(tags=WORKER, launched=180, instance_type="g5.xlarge", spot=False) -> dict:
    """An EC2 DescribeInstances entry of a running instance, as boto3 returns it."""
    return {
        "InstanceId": "i-0abc",
        "InstanceType": instance_type,
        "LaunchTime": minutes_ago(launched),
        "State": {"Name": "running"},
        "Tags": [{"Key": key, "Value": value} for key, value in tags.items()],
        **({"InstanceLifecycle": "spot"} if spot else {}),
    }


def ended(minutes: float, run_id="r1", status=S.SUCCESS) -> WorkerRun:
    return WorkerRun(run_id, status, minutes_ago(minutes))


def busy(status: S, run_id="r1") -> WorkerRun:
    return WorkerRun(run_id, status, None)


# EC2's view of its workers under the providers' rules (rented_workers.find_idle): which running role-tagged instances
# are idle. (case, instance, runs tied to it, expected: None = untouched, else (idle minutes, what it was idle since))
CASES = [
    ("idle since launch", ec2_instance(), [], (180, "start")),
    ("idle since its last run ended", ec2_instance(), [ended(60)], (60, "run r1 ended")),
    ("a failed run counts like a successful one", ec2_instance(), [ended(45, status=S.FAILURE)], (45, "run r1 ended")),
    ("the latest run end counts", ec2_instance(), [ended(120, "old"), ended(50, "new")], (50, "run new ended")),
    ("suspended run holds no worker", ec2_instance(), [ended(90, status=S.SUSPENDED)], (90, "run r1 ended")),
    ("run in progress", ec2_instance(launched=600), [busy(S.STARTED)], None),
    ("run starting", ec2_instance(launched=600), [busy(S.STARTING)], None),
    ("run canceling", ec2_instance(launched=600), [busy(S.CANCELING)], None),
    ("run queued for this worker", ec2_instance(launched=600), [busy(S.QUEUED)], None),
    ("busy run next to old finished ones", ec2_instance(launched=600), [ended(300, "a"), busy(S.STARTED, "b")], None),
    ("run finished recently", ec2_instance(), [ended(10)], None),
    ("recent run among old ones", ec2_instance(), [ended(120, "a"), ended(10, "b")], None),
    ("launched recently", ec2_instance(launched=5), [], None),
    ("heartbeat recent", ec2_instance({**WORKER, HEARTBEAT_TAG: minutes_ago(5).isoformat()}), [], None),
    (
        "heartbeat old",
        ec2_instance({**WORKER, HEARTBEAT_TAG: "2026-01-01T11:15Z"}),
        [ended(100)],
        (45, "heartbeat"),
    ),
    ("heartbeat without zone is UTC", ec2_instance({**WORKER, HEARTBEAT_TAG: "2026-01-01T11:50:00"}), [], None),
    ("heartbeat unreadable: kept", ec2_instance({**WORKER, HEARTBEAT_TAG: "yesterday"}, launched=6000), [], None),
    ("exactly at the threshold", ec2_instance(launched=30), [], None),
    ("one second past the threshold", ec2_instance(launched=30 + 1 / 60), [], (30, "start")),
]


@pytest.mark.parametrize("case, instance, runs, expected", CASES, ids=[case[0] for case in CASES])
def test_idle_ec2_workers(case, instance, runs, expected):
    idle = find_idle([as_worker(instance)], {"i-0abc": runs}, NOW, THRESHOLD)
    if expected is None:
        assert idle == []
    else:
        found = [(w.worker.worker_id, int(w.idle_for.total_seconds() // 60), w.last_activity) for w in idle]
        assert found == [("i-0abc", *expected)]


@pytest.mark.parametrize(
    "instance_type, spot, offering, gpus",
    [
        ("g5.xlarge", False, "a10g-24gb", 1),
        ("g5.12xlarge", False, "a10g-24gb", 4),
        ("g6.xlarge", True, "l4-24gb", 1),
        ("p4d.24xlarge", True, "a100-40gb", 8),
        ("p5.48xlarge", False, "h100-80gb", 8),
        ("m5.large", False, None, 0),
    ],
)
def test_hourly_price_saved(instance_type, spot, offering, gpus):
    worker = as_worker(ec2_instance(instance_type=instance_type, spot=spot))
    assert (worker.spot, worker.what) == (spot, instance_type)
    if offering is None:
        assert (worker.usd_per_hour, worker.priced_by) == (None, "")
    else:
        per_gpu = CostModel().offering(offering).usd_per_hour("spot" if spot else "on_demand")
        assert worker.usd_per_hour == pytest.approx(gpus * per_gpu)
        assert worker.priced_by == f"{gpus} x {offering}, cost model"


# --- EC2 (moto) and the sensor on a real Dagster instance -------------------------------------------

A10G = CostModel().offering("a10g-24gb").on_demand_usd_per_h  # g5.xlarge: one A10G
A100 = CostModel().offering("a100-40gb").on_demand_usd_per_h  # p4d.24xlarge: eight A100 40GB


@pytest.fixture(scope="module")
def aws():
    """One moto EC2 for the module: a botocore session loads the EC2 model once (0.6 s) instead of per test."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("AWS_DEFAULT_REGION", "us-east-1")
        env.setenv("AWS_ACCESS_KEY_ID", "testing")
        env.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        env.setenv("MOTO_EC2_LOAD_DEFAULT_AMIS", "false")  # 0.5 s per reset otherwise; any AMI id launches
        for name in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_EC2"):
            env.delenv(name, raising=False)
        with mock_aws():
            yield


@pytest.fixture
def ec2(aws):
    """The EC2 client; every instance a test launched is terminated afterwards, out of the next test's way."""
    client = boto3.client("ec2")
    yield client
    pages = client.get_paginator("describe_instances").paginate()
    instances = [i for page in pages for r in page["Reservations"] for i in r["Instances"]]
    ids = [i["InstanceId"] for i in instances if i["State"]["Name"] != "terminated"]
    if ids:
        client.terminate_instances(InstanceIds=ids)


def launch(ec2, tags=WORKER, instance_type="g5.xlarge") -> str:
    spec = [{"ResourceType": "instance", "Tags": [{"Key": k, "Value": v} for k, v in tags.items()]}] if tags else []
    reply = ec2.run_instances(
        ImageId="ami-12c6146b", MinCount=1, MaxCount=1, InstanceType=instance_type, TagSpecifications=spec
    )
    return reply["Instances"][0]["InstanceId"]


def state(ec2, instance_id) -> str:
    return ec2.describe_instances(InstanceIds=[instance_id])["Reservations"][0]["Instances"][0]["State"]["Name"]


@pytest.fixture
def two_hours_later(monkeypatch):
    """The sensor's clock, two hours after the instances were launched."""
    later = datetime.now(timezone.utc).replace(microsecond=0) + timedelta(hours=2)
    monkeypatch.setattr(shutdown, "utc_now", lambda: later)
    return later


@pytest.fixture(scope="module")
def dagster_instance():
    """One Dagster instance for the sensor tests (1-2 s each to create); moto gives every test fresh instance ids."""
    with dg.instance_for_test() as instance:
        yield instance


# A queued run needs a code-location origin; this one points at this file and is never loaded.
QUEUED_ORIGIN = RemoteJobOrigin(
    RemoteRepositoryOrigin(InProcessCodeLocationOrigin(LoadableTargetOrigin(python_file=__file__)), "repo"), "train"
)


class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def tick(instance, **config) -> tuple[str, list[str]]:
    """One sensor evaluation: its skip message and what it logged."""
    log = Lines()
    resources = {"ec2_workers": Ec2WorkersResource(**config), "rented_workers": RentedWorkersResource()}
    with dg.build_sensor_context(instance=instance, resources=resources) as context:
        context.log.addHandler(log)
        return idle_gpu_worker_sensor(context).skip_message, log.lines


def test_sensor_stops_only_the_idle_worker(ec2, two_hours_later, dagster_instance):
    instance = dagster_instance
    idle = launch(ec2)
    running_job = launch(ec2)
    queued_for = launch(ec2)
    just_finished = launch(ec2)
    not_a_worker = launch(ec2, tags={"Name": "jupyter"})
    other_role = launch(ec2, tags={ROLE_TAG_KEY: "database"})
    stopped = launch(ec2)
    ec2.stop_instances(InstanceIds=[stopped])
    create_run_for_test(instance, status=S.STARTED, tags={WORKER_TAG: running_job, "ft/pool": "gpu"})
    create_run_for_test(instance, status=S.QUEUED, tags={WORKER_TAG: queued_for}, remote_job_origin=QUEUED_ORIGIN)
    finished_long_ago = create_run_for_test(instance, status=S.STARTED, tags={WORKER_TAG: idle})
    finished = create_run_for_test(instance, status=S.STARTED, tags={WORKER_TAG: just_finished})
    with freeze_time(two_hours_later - timedelta(minutes=45)):
        instance.report_run_canceled(finished_long_ago)
    with freeze_time(two_hours_later - timedelta(minutes=10)):
        instance.report_run_failed(finished)

    summary, lines = tick(instance)

    assert {i: state(ec2, i) for i in (idle, running_job, queued_for, just_finished, not_a_worker, other_role)} == {
        idle: "stopped",
        running_job: "running",
        queued_for: "running",
        just_finished: "running",
        not_a_worker: "running",
        other_role: "running",
    }
    assert summary == f"ec2: 4 worker(s), stop 1 idle ({idle}; ~${A10G:.2f}/h)"  # neither other role nor stopped
    [line] = lines
    ended_at = two_hours_later - timedelta(minutes=45)
    assert line == (
        f"stopped ec2 {idle} (g5.xlarge), idle 45 min since {ended_at:%Y-%m-%d %H:%M} UTC "
        f"(run {finished_long_ago.run_id} ended); saves ~${A10G:.2f}/h (1 x a10g-24gb, cost model)"
    )

    assert tick(instance) == ("ec2: 3 worker(s), none idle for more than 30 min", [])


def test_a_long_run_is_seen_behind_many_newer_ones(ec2, two_hours_later, dagster_instance, monkeypatch):
    monkeypatch.setattr(shutdown, "RECENT_RUNS_PER_WORKER", 1)  # the long run falls out of the recent window
    worker = launch(ec2)
    create_run_for_test(dagster_instance, status=S.STARTED, tags={WORKER_TAG: worker})
    newer = create_run_for_test(dagster_instance, status=S.STARTED, tags={WORKER_TAG: worker})
    with freeze_time(two_hours_later - timedelta(minutes=90)):
        dagster_instance.report_run_failed(newer)
    assert tick(dagster_instance)[0] == "ec2: 1 worker(s), none idle for more than 30 min"
    assert state(ec2, worker) == "running"


def test_sensor_terminate_mode_terminates(ec2, two_hours_later, dagster_instance):
    worker = launch(ec2, instance_type="p4d.24xlarge")
    summary, lines = tick(dagster_instance, action="terminate")
    assert summary == f"ec2: 1 worker(s), terminate 1 idle ({worker}; ~${8 * A100:.2f}/h)"
    assert lines[0].startswith(f"terminated ec2 {worker} (p4d.24xlarge), idle ")
    assert state(ec2, worker) == "terminated"


def test_sensor_dry_run_changes_nothing(ec2, two_hours_later, dagster_instance):
    worker = launch(ec2)
    summary, lines = tick(dagster_instance, dry_run=True)
    assert summary == f"ec2: 1 worker(s), would stop 1 idle ({worker}; ~${A10G:.2f}/h)"
    assert lines[0].startswith(f"dry run: would stop ec2 {worker} (g5.xlarge), idle ")
    assert state(ec2, worker) == "running"


def test_sensor_respects_idle_minutes(ec2, two_hours_later, dagster_instance):
    worker = launch(ec2)
    assert tick(dagster_instance, idle_minutes=180)[0] == "ec2: 1 worker(s), none idle for more than 180 min"
    assert state(ec2, worker) == "running"


def test_sensor_waits_while_a_gpu_run_has_no_worker_tag(ec2, two_hours_later, dagster_instance):
    worker = launch(ec2)
    run = create_run_for_test(dagster_instance, status=S.STARTED, tags={"ft/pool": "gpu"})
    create_run_for_test(dagster_instance, status=S.STARTED, tags={"ft/pool": "cpu"})  # cpu runs hold no GPU worker
    try:
        assert tick(dagster_instance)[0].startswith(f"gpu run(s) {run.run_id} started without a {WORKER_TAG} tag")
        assert state(ec2, worker) == "running"
    finally:
        dagster_instance.report_run_canceled(run)  # settled: it must not hold off the other tests


def test_sensor_skips_the_tick_on_an_ec2_error(aws, dagster_instance, monkeypatch):
    client = boto3.client("ec2")
    stubber = Stubber(client)
    stubber.add_client_error("describe_instances", "RequestLimitExceeded", "Request limit exceeded.", 503)
    monkeypatch.setattr(Ec2WorkersResource, "client", lambda self: client)
    with stubber:
        summary, lines = tick(dagster_instance)
    assert summary.startswith("ec2: listing failed (An error occurred (RequestLimitExceeded)")
    assert lines[0].startswith("could not list ec2 workers, trying again next tick")


def test_sensor_with_no_workers(ec2, dagster_instance):
    launch(ec2, tags={})
    assert tick(dagster_instance)[0] == "ec2: 0 worker(s), none idle for more than 30 min"


def test_ec2_is_watched_only_with_a_region(aws, dagster_instance, monkeypatch):
    monkeypatch.delenv("AWS_DEFAULT_REGION")
    assert tick(dagster_instance) == ("ec2: no region set, not watched", [])


def test_sensor_warns_about_an_unreadable_heartbeat(ec2, two_hours_later, dagster_instance):
    worker = launch(ec2, tags={**WORKER, HEARTBEAT_TAG: "soon"})
    summary, lines = tick(dagster_instance)
    assert summary == "ec2: 1 worker(s), none idle for more than 30 min"
    assert lines == [
        f"ec2 {worker}: instance tag {HEARTBEAT_TAG}='soon' is not an ISO 8601 timestamp; write e.g. "
        "'2026-01-31T14:05:00Z'; it stays up"
    ]
    assert state(ec2, worker) == "running"


def test_one_refusal_does_not_block_the_others_and_a_dry_run_asks_ec2(aws, dagster_instance, monkeypatch):
    """One StopInstances call per worker: EC2 refusing one (a one-time spot instance) leaves the others to stop. A dry
    run sends the call with DryRun=True: EC2's DryRunOperation answer means it would work."""
    client = boto3.client("ec2")
    stubber = Stubber(client)
    spot = {**ec2_instance(), "InstanceId": "i-1", "InstanceLifecycle": "spot"}
    listing = {"Reservations": [{"Instances": [spot, {**ec2_instance(), "InstanceId": "i-2"}]}]}
    stubber.add_response("describe_instances", listing)
    stubber.add_client_error("stop_instances", "UnsupportedOperation", "You can't stop the Spot Instance 'i-1'.")
    stubber.add_response("stop_instances", {"StoppingInstances": []}, {"InstanceIds": ["i-2"], "DryRun": False})
    stubber.add_response("describe_instances", listing)
    for instance_id in ("i-1", "i-2"):
        stubber.add_client_error(
            "stop_instances", "DryRunOperation", "Request would have succeeded.", 412,
            expected_params={"InstanceIds": [instance_id], "DryRun": True},
        )  # fmt: skip
    monkeypatch.setattr(Ec2WorkersResource, "client", lambda self: client)
    monkeypatch.setattr(shutdown, "utc_now", lambda: NOW)
    with stubber:
        summary, lines = tick(dagster_instance)
        assert summary == f"ec2: 2 worker(s), stop 1 idle (i-2; ~${A10G:.2f}/h), 1 refused (see the log)"
        assert lines[0].startswith("could not stop ec2 i-1 (g5.xlarge, spot), idle 180 min")
        assert lines[0].endswith(": UnsupportedOperation: You can't stop the Spot Instance 'i-1'.")
        summary, _ = tick(dagster_instance, dry_run=True)
        assert summary.startswith("ec2: 2 worker(s), would stop 2 idle (i-1, i-2; ")
    stubber.assert_no_pending_responses()


# A Slurm gpu pool's jobs: (case, job state, whether it started, the run it names, expected: None = left alone)
SLURM_CASES = [
    ("queued for a run that ended an hour ago", "PENDING", False, ended(60), "its run r1 ended SUCCESS 60 min ago"),
    ("running after its run failed", "RUNNING", True, ended(45, status=S.FAILURE), "its run r1 ended FAILURE 45 min ago"),
    ("a run canceled in the UI", "PENDING", False, ended(31, status=S.CANCELED), "its run r1 ended CANCELED 31 min ago"),
    ("its run ended within the threshold", "RUNNING", True, ended(5), None),
    ("its run is still going", "RUNNING", True, busy(S.STARTED), None),
    ("requeued, its run waits for it", "PENDING", False, busy(S.STARTED), None),
    ("finishing", "COMPLETING", True, ended(60), None),
    ("already over", "COMPLETED", True, ended(60), None),
    ("a run this instance does not know (another deployment's)", "RUNNING", True, None, None),
]  # fmt: skip


@pytest.mark.parametrize(("case", "state", "started", "run", "expected"), SLURM_CASES, ids=[c[0] for c in SLURM_CASES])
def test_idle_slurm_jobs_are_those_no_unfinished_run_needs(case, state, started, run, expected):
    job = JobState("42", state, start=minutes_ago(90) if started else None)
    idle = find_idle_slurm_jobs([("r1", job)], {"r1": run} if run else {}, NOW, THRESHOLD)
    assert [j.why for j in idle] == ([] if expected is None else [expected])
    if idle:
        said = idle[0].describe(NOW)
        assert (
            said.startswith("Slurm job 42 (") and ("90 min on its allocation" if started else "not billed yet") in said
        )
