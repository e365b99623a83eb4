"""Idle shutdown of RunPod pods, Vast.ai instances and SkyPilot clusters (rented_workers, idle_backends; EC2's
module is tested against moto in ``test_shutdown.py``).

The registry is checked piece by piece, the rules are table-tested as plain functions; the sensor then makes the real SDK calls (runpod 1.12 in
this venv, vastai 1.9 in SkyPilot's) against both marketplaces' APIs on loopback (``marketplaces.py``),
and SkyPilot's at its SDK boundary (``fake_skypilot.py``: ``sky.status``/``stop``/``down`` answered from
its state with SkyPilot's own ``StatusResponse``).
"""

import json
import logging
import typing
from dataclasses import replace
from datetime import datetime, timedelta, timezone

import dagster as dg
import pytest
from dagster._core.test_utils import create_run_for_test, freeze_time

from ft_assets.control import rented_workers, shutdown
from ft_assets.control.idle_backends import Provider, RentedWorker
from ft_assets.control.rented_workers import PROVIDERS, RentedWorkersResource, find_idle
from ft_assets.control.shutdown import Ec2WorkersResource, WorkerRun, idle_gpu_worker_sensor
from ft_assets.providers.ec2_metadata import WORKER_TAG
from ft_assets.providers.worker_identity import worker_tag
from ft_assets_tests import fake_skypilot
from ft_assets_tests.marketplaces import RUNPOD_KEY, VAST_KEY, Marketplaces

pytest_plugins = ["ft_assets_tests.skypilot_env"]

S = dg.DagsterRunStatus
NOW = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)
THRESHOLD = timedelta(minutes=30)
ROLE = "FT_ASSETS_ROLE=gpu-worker"


def ago(minutes: float) -> datetime:
    return NOW - timedelta(minutes=minutes)


def test_every_provider_has_its_pieces():
    """The checklist of the registration line: each module of PROVIDERS lists its machines, names its action and shuts
    one down, and has its row in rented_workers' table; every one but EC2 (set up in ec2_workers) can be listed in
    rented_workers.providers and has its action field there."""
    assert set(PROVIDERS) == set(typing.get_args(Provider))
    for name, module in PROVIDERS.items():
        assert all(callable(getattr(module, piece, None)) for piece in ("list_workers", "action", "shut_down")), name
        assert f"| ``{name}`` (" in rented_workers.__doc__, name
    rented = RentedWorkersResource(providers=[name for name in PROVIDERS if name != "ec2"])
    assert {name: PROVIDERS[name].action(settings) for name, settings in rented.watched().items()} == {
        "runpod": "stop", "vast": "stop", "skypilot": "stop"
    }  # fmt: skip
    assert PROVIDERS["ec2"].action(Ec2WorkersResource(action="terminate")) == "terminate"
    with pytest.raises(ValueError, match=r"unknown \['ec2'\].*EC2 is watched through ec2_workers"):
        RentedWorkersResource(providers=["ec2"]).watched()


def worker(started=ago(180), tag="runpod:p1") -> RentedWorker:
    return RentedWorker("runpod", tag.split(":")[1], tag, "1 x RTX 4090", False, started, 0.69)


# (case, worker, runs tied to it, expected: None = untouched, else (idle minutes, what it was idle since))
CASES = [
    ("idle since its start", worker(), [], (180, "start")),
    ("idle since its last run ended", worker(), [WorkerRun("r1", S.SUCCESS, ago(60))], (60, "run r1 ended")),
    ("a failed run counts like a successful one", worker(), [WorkerRun("r1", S.FAILURE, ago(45))], (45, "run r1 ended")),
    ("run in progress", worker(ago(600)), [WorkerRun("r1", S.STARTED, None)], None),
    ("run starting", worker(ago(600)), [WorkerRun("r1", S.STARTING, None)], None),
    ("run canceling", worker(ago(600)), [WorkerRun("r1", S.CANCELING, None)], None),
    ("busy run next to an old finished one", worker(ago(600)), [WorkerRun("a", S.SUCCESS, ago(300)), WorkerRun("b", S.STARTED, None)], None),
    ("run finished recently", worker(), [WorkerRun("r1", S.SUCCESS, ago(10))], None),
    ("started recently", worker(ago(5)), [], None),
    ("start time unreadable: kept", worker(None), [], None),
    ("a heartbeat after the start counts", replace(worker(), last_active=ago(40)), [], (40, "heartbeat")),
    ("the latest of heartbeat and run end counts", replace(worker(), last_active=ago(90)), [WorkerRun("r1", S.SUCCESS, ago(60))], (60, "run r1 ended")),
    ("a recent heartbeat keeps it up", replace(worker(), last_active=ago(5)), [], None),
    ("heartbeat unreadable: kept", replace(worker(ago(600)), unreadable="bad tag"), [], None),
]  # fmt: skip


@pytest.mark.parametrize("case, rented, runs, expected", CASES, ids=[c[0] for c in CASES])
def test_find_idle(case, rented, runs, expected):
    idle = find_idle([rented], {rented.tag: runs}, NOW, THRESHOLD)
    if expected is None:
        assert idle == []
    else:
        [found] = idle
        assert (int(found.idle_for.total_seconds() // 60), found.last_activity) == expected


@pytest.mark.parametrize(
    "env, tag",
    [
        ({"SKYPILOT_CLUSTER_INFO": json.dumps({"cluster_name": "ft-1a2b3c4d-7", "cloud": "RunPod"}), "RUNPOD_POD_ID": "p9"},
         "sky:ft-1a2b3c4d-7"),  # a SkyPilot cluster on RunPod: the cluster is what the sensor stops
        ({"RUNPOD_POD_ID": "abc123xyz"}, "runpod:abc123xyz"),
        ({"CONTAINER_ID": "4242"}, "vast:4242"),
        ({"SKYPILOT_CLUSTER_INFO": "not json", "CONTAINER_ID": "7"}, "vast:7"),
    ],
)  # fmt: skip
def test_the_worker_tags_its_run_with_its_provider(env, tag):
    assert worker_tag(env) == {WORKER_TAG: tag}


def test_off_every_provider_the_worker_tags_nothing(monkeypatch):
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    assert worker_tag({}) == {}


# --- the sensor against the marketplaces' APIs ------------------------------------------------------


@pytest.fixture(scope="module")
def instance():
    with dg.instance_for_test() as instance:
        yield instance


@pytest.fixture
def markets(monkeypatch, sky_env):
    market = Marketplaces()
    monkeypatch.setenv("RUNPOD_API_BASE_URL", market.url)
    monkeypatch.setenv("RUNPOD_API_KEY", RUNPOD_KEY)
    monkeypatch.setenv("VAST_API_KEY", VAST_KEY)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    monkeypatch.setattr(shutdown, "utc_now", lambda: NOW)
    yield market
    market.close()


def pod(pod_id: str, uptime_min: float | None, env=(ROLE,), status="RUNNING", pod_type="RESERVED") -> dict:
    """A pod as RunPod's GraphQL API answers ``myself { pods }`` (the fields runpod 1.12's QUERY_POD asks for)."""
    return {
        "id": pod_id, "containerDiskInGb": 20, "costPerHr": 0.69, "desiredStatus": status, "dockerArgs": "",
        "dockerId": None, "env": list(env), "gpuCount": 1, "imageName": "ghcr.io/example/ft-assets-worker:1",
        "lastStatusChange": "Rented by User: Thu Jan 01 2026 09:00:00 GMT+0000 (Coordinated Universal Time)",
        "machineId": "m1", "memoryInGb": 41, "name": f"ft-{pod_id}", "podType": pod_type, "port": None, "ports": "",
        "uptimeSeconds": None if uptime_min is None else int(uptime_min * 60), "vcpuCount": 6, "volumeInGb": 50,
        "volumeMountPath": "/workspace", "runtime": {"ports": []}, "machine": {"gpuDisplayName": "RTX 4090"},
    }  # fmt: skip


def vast_instance(instance_id: int, started_min: float, env=None, is_bid=False) -> dict:
    """An instance as Vast.ai's ``/api/v1/instances/`` answers (``extra_env`` a dict here, pairs on the wire)."""
    return {
        "id": instance_id, "machine_id": 7, "actual_status": "running", "intended_status": "running", "num_gpus": 1,
        "gpu_name": "RTX 4090", "dph_total": 0.41, "start_date": ago(started_min).timestamp(), "is_bid": is_bid,
        "label": None, "extra_env": {"FT_ASSETS_ROLE": "gpu-worker"} if env is None else env, "image_uuid": "x",
    }  # fmt: skip


class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def tick(instance, markets: Marketplaces, **config) -> tuple[str, list[str]]:
    rented = RentedWorkersResource(**{"vast_url": markets.url, **config})
    resources = {"ec2_workers": Ec2WorkersResource(), "rented_workers": rented}
    log = Lines()
    with dg.build_sensor_context(instance=instance, resources=resources) as context:
        context.log.addHandler(log)
        return idle_gpu_worker_sensor(context).skip_message, log.lines


def tied(instance, tag: str, status=S.STARTED, ended_min: float | None = None):
    run = create_run_for_test(instance, status=S.STARTED, tags={WORKER_TAG: tag, "ft/pool": "gpu"})
    if ended_min is not None:
        with freeze_time(ago(ended_min)):
            instance.report_run_failed(run)
    return run


@pytest.mark.integration
def test_sensor_stops_only_the_idle_marketplace_workers(markets, instance, sky_env):
    markets.pods = [
        pod("idle", 180), pod("busy", 300), pod("recent", 300), pod("notours", 300, env=("OTHER=1",)),
        pod("unreadable", None), pod("volume", 240, pod_type="INTERRUPTABLE"), pod("exited", 300, status="EXITED"),
    ]  # fmt: skip
    markets.refuse_stop["volume"] = "Pods with network volumes attached cannot be stopped, only terminated."
    markets.instances = [vast_instance(101, 120), vast_instance(102, 500), vast_instance(103, 500, env={})]
    busy = tied(instance, "runpod:busy")
    tied(instance, "runpod:recent", ended_min=10)
    vast_busy = tied(instance, "vast:102")
    try:
        summary, lines = tick(instance, markets, providers=["runpod", "vast"], python=sky_env["real_python"])
    finally:
        for run in (busy, vast_busy):
            instance.report_run_canceled(run)

    assert markets.calls == [("runpod", "podStop", "idle"), ("vast", "state=stopped", "101")]
    assert summary == (
        "ec2: no region set, not watched; runpod: 5 worker(s), stop 1 idle (idle; ~$0.69/h), 1 refused (see the log); "
        "vast: 2 worker(s), stop 1 idle (101; ~$0.41/h)"
    )
    assert "runpod unreadable: its start time cannot be read; it stays up" in lines
    assert (
        "stopped runpod idle (1 x RTX 4090), idle 180 min since 2026-01-01 09:00 UTC (start); saves ~$0.69/h (runpod's price)"
        in lines
    )
    refused = [line for line in lines if line.startswith("could not stop runpod volume")]
    assert refused == [
        "could not stop runpod volume (1 x RTX 4090, spot), idle 240 min since 2026-01-01 08:00 UTC (start); saves "
        "~$0.69/h (runpod's price): QueryError: Pods with network volumes attached cannot be stopped, only terminated."
    ]  # logged and left up: never terminated instead
    assert (
        "stopped vast 101 (1 x RTX 4090), idle 120 min since 2026-01-01 10:00 UTC (start); saves ~$0.41/h (vast's price)"
        in lines
    )
    assert json.loads(markets.queries[0]["select_filters"]) == {}  # the SDK's own request: every instance of the key


@pytest.mark.integration
def test_remove_actions_and_a_dry_run(markets, instance, sky_env):
    markets.pods = [pod("idle", 180)]
    markets.instances = [vast_instance(101, 120)]
    summary, _ = tick(instance, markets, providers=["runpod", "vast"], dry_run=True, python=sky_env["real_python"])
    assert markets.calls == [] and "runpod: 1 worker(s), would stop 1 idle (idle; ~$0.69/h)" in summary
    tick(
        instance,
        markets,
        providers=["runpod", "vast"],
        runpod_action="terminate",
        vast_action="destroy",
        python=sky_env["real_python"],
    )
    assert markets.calls == [("runpod", "podTerminate", "idle"), ("vast", "destroy", "101")]


@pytest.mark.integration
def test_a_wrong_api_key_skips_only_that_provider(markets, instance, monkeypatch, sky_env):
    markets.instances = [vast_instance(101, 120)]
    monkeypatch.setenv("RUNPOD_API_KEY", "wrong")
    summary, lines = tick(instance, markets, providers=["runpod", "vast"], python=sky_env["real_python"])
    assert "runpod: listing failed (Unauthorized request, please check your API key.)" in summary
    assert markets.calls == [("vast", "state=stopped", "101")]
    assert lines[0].startswith("could not list runpod workers, trying again next tick")


@pytest.mark.integration
def test_sensor_stops_or_downs_idle_skypilot_clusters(markets, instance, sky_env):
    def cluster(name, launched_min, status="UP", resources="1x RunPod(1x_RTX4090_SECURE, {'RTX4090': 1})"):
        return {"name": name, "launched_at": int(ago(launched_min).timestamp()), "status": status, "autostop": -1,
                "to_down": False, "cluster_hash": name, "cluster_ever_up": True, "user_hash": "u", "user_name": "me",
                "workspace": "default", "is_managed": False, "nodes": 1, "resources_str": resources,
                "cloud": "RunPod", "region": "CA"}  # fmt: skip

    with fake_skypilot.state_file(str(sky_env["state"])) as state:
        state["clusters"] = [
            cluster("ft-idle", 180), cluster("ft-busy", 300), cluster("dev-box", 600), cluster("ft-stopped", 900, "STOPPED"),
            cluster("ft-spot", 200, resources="1x AWS(g5.xlarge, {'A10G': 1}, [Spot])"),
        ]  # fmt: skip
        state["cluster_calls"] = []
    busy = tied(instance, "sky:ft-busy")
    try:
        summary, lines = tick(instance, markets, providers=["skypilot"], python=sky_env["python"])
    finally:
        instance.report_run_canceled(busy)
    with fake_skypilot.state_file(str(sky_env["state"])) as state:
        assert state["cluster_calls"] == [["stop", "ft-idle"], ["stop", "ft-spot"]]
    assert summary.endswith("skypilot: 3 worker(s), stop 1 idle (ft-idle), 1 refused (see the log)")
    assert any(l.startswith("could not stop skypilot ft-spot") and "NotSupportedError" in l for l in lines), lines

    tick(instance, markets, providers=["skypilot"], skypilot_action="down", python=sky_env["python"])
    with fake_skypilot.state_file(str(sky_env["state"])) as state:
        assert state["cluster_calls"][2:] == [["down", "ft-spot"]]
