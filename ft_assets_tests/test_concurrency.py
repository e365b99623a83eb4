"""Concurrency: one run per partition at a time, several partitions side by side.

Two layers keep two runs of one dataset version from interleaving their outputs: the run queue
(``dagster/partition`` limited to 1 per value in dagster.yaml: the second run waits) and, for runs that
never meet the queue (``ft-assets run`` executes in-process), the partition lease in the store
(``ft_assets/locks.py``: the second run fails at start, naming the first). Different partitions only
share the GPU pool's slots.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import dagster as dg
import pytest
import yaml
from dagster._core.test_utils import create_test_daemon_workspace_context
from dagster._core.workspace.load_target import ModuleTarget
from dagster._daemon.run_coordinator.queued_run_coordinator_daemon import QueuedRunCoordinatorDaemon

from ft_assets import locks
from ft_assets.manifests import read_manifest
from ft_assets.refs import read_ref
from ft_assets.storage import LocalStore
from ft_assets_tests.support import MOCK, launched, run_config, submit, wait_until, write_dataset

REPO = Path(__file__).resolve().parents[1]
PARTITION = "acks@v1"


# --- the lease ---------------------------------------------------------------------------------------


def statuses(**known):
    return lambda run_id: known.get(run_id)


def test_a_second_run_of_the_partition_is_refused_naming_the_first(store):
    first = locks.acquire(store, PARTITION, "run-a", statuses(**{"run-a": "STARTED"}))
    with pytest.raises(
        locks.PartitionBusy,
        match=r"partition acks@v1 is being materialized by run run-a \(started, last heartbeat \d+ s ago\); retry when it finishes",
    ):
        locks.acquire(store, PARTITION, "run-b", statuses(**{"run-a": "STARTED"}))
    other = locks.acquire(store, "acks@v2", "run-b", statuses())  # another partition is free
    joined = locks.acquire(store, PARTITION, "run-a", statuses())  # another process of the same run
    assert joined.generation == first.generation and first.held() and joined.held()
    for lease in (first, other, joined):
        lease.release()


TAKEOVERS = [
    # (name, the owner's status in this instance, its heartbeat released?, seconds since the heartbeat, free?)
    ("owner-finished", "SUCCESS", False, 0, True),
    ("owner-failed", "FAILURE", False, 0, True),
    ("owner-running", "STARTED", False, 0, False),
    ("owner-between-steps", "STARTED", True, 0, False),  # the multiprocess executor: one step done, the next not up
    ("owner-killed", "STARTED", False, locks.EXPIRY_SECONDS + 1, True),  # kill -9: the instance never heard
    ("unknown-owner-released", None, True, 0, True),  # an ephemeral or other Dagster instance, done
    ("unknown-owner-alive", None, False, 0, False),
    ("unknown-owner-silent", None, False, locks.EXPIRY_SECONDS + 1, True),
]


@pytest.mark.parametrize("name,status,released,age,free", TAKEOVERS, ids=[t[0] for t in TAKEOVERS])
def test_when_a_lease_can_be_taken_over(store, name, status, released, age, free):
    first = locks.acquire(store, PARTITION, "run-a", statuses())  # renews every 10 s: not within this test
    if released:
        first.release()
    later = lambda: time.time() + age  # noqa: E731 - the clock of the run that comes second
    try:
        if not free:
            with pytest.raises(locks.PartitionBusy, match="run run-a"):
                locks.acquire(store, PARTITION, "run-b", statuses(**{"run-a": status}), now=later)
            return
        second = locks.acquire(store, PARTITION, "run-b", statuses(**{"run-a": status}), now=later)
        assert second.generation == first.generation + 1 and second.held() and not first.held()
        assert all("/00000001/" not in key for key in store.list("leases")), "the old generation was not cleaned up"
        second.release()
    finally:
        first.release()


def test_racing_runs_get_the_lease_exactly_once(store):
    winners, refused, barrier = [], [], threading.Barrier(8)

    def contend(run_id: str) -> None:
        barrier.wait()
        try:
            winners.append(locks.acquire(store, PARTITION, run_id, statuses()))
        except locks.PartitionBusy as exc:
            refused.append(str(exc))

    threads = [threading.Thread(target=contend, args=(f"run-{i}",)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(winners) == 1 and len(refused) == 7
    assert all(f"by run {winners[0].run_id} " in message for message in refused)
    winners[0].release()


def test_the_heartbeat_keeps_a_long_run_alive(store, monkeypatch):
    monkeypatch.setattr(locks, "RENEW_SECONDS", 0.05)
    lease = locks.acquire(store, PARTITION, "run-a", statuses())
    first = locks.read_lease(store, PARTITION).heartbeats[0]["renewed_at"]
    time.sleep(0.3)  # six renewal periods
    renewed = locks.read_lease(store, PARTITION).heartbeats[0]
    assert renewed["renewed_at"] > first and not renewed["released"]  # the thread renewed it, not release()
    lease.release()
    state = locks.read_lease(store, PARTITION)
    assert state.heartbeats[0]["released"] and state.heartbeats[0]["renewed_at"] >= renewed["renewed_at"]


# --- the queue: the project's own dagster.yaml files, the queued-run daemon, launchers that record ----


def instance_overrides(profile: str) -> dict:
    coordinator = yaml.safe_load((REPO / profile).read_text())["run_coordinator"]
    launcher = {
        "module": "ft_assets.control.launcher",
        "class": "PoolRunLauncher",
        "config": {"pools": {"gpu": MOCK, "cpu": MOCK}},
    }
    return {"run_coordinator": coordinator, "run_launcher": launcher}


PARTITION_LIMIT = {"key": "dagster/partition", "value": {"applyLimitPerUniqueValue": True}, "limit": 1}


@pytest.mark.parametrize("profile", ["ft_assets/control/dagster.yaml", "dagster.prod.yaml"])
def test_both_profiles_queue_one_run_per_partition(profile, tmp_path):
    assert PARTITION_LIMIT in instance_overrides(profile)["run_coordinator"]["config"]["tag_concurrency_limits"]
    shutil.copyfile(REPO / profile, tmp_path / "dagster.yaml")
    if profile == "dagster.prod.yaml":  # its storage is PostgreSQL; the queue part is what is checked here
        config = yaml.safe_load((tmp_path / "dagster.yaml").read_text())
        del config["storage"]
        (tmp_path / "dagster.yaml").write_text(yaml.safe_dump(config))
    with dg.DagsterInstance.from_config(str(tmp_path)) as instance:  # Dagster accepts the config
        limits = instance.run_coordinator.get_run_queue_config().tag_concurrency_limits
        assert PARTITION_LIMIT in limits


@pytest.mark.integration
def test_the_queue_runs_one_run_per_partition_and_trains_within_the_gpu_slots():
    """The production profile (2 GPU slots); dagster.yaml's single slot is tested in test_launcher.py."""
    with dg.instance_for_test(overrides=instance_overrides("dagster.prod.yaml")) as instance:
        target = ModuleTarget(
            module_name="ft_assets.definitions", attribute=None, working_directory=None, location_name="ft_assets"
        )
        with create_test_daemon_workspace_context(target, instance) as context:
            workspace = context.create_request_context()
            repository = next(iter(workspace.get_code_location("ft_assets").get_repositories().values()))
            from ft_assets.definitions import defs

            def queue(job_name: str, partition: str) -> str:
                job = defs.resolve_job_def(job_name)
                tags = {**job.tags, "dagster/partition": partition}
                return submit(instance, workspace, repository.get_full_job(job_name), job, tags=tags).run_id

            same = [queue("data_plane", "acks@v1"), queue("data_plane", "acks@v1")]
            other = queue("data_plane", "acks@v2")
            # three variants of one version (issue 35's runs side by side): each its own partition, so they
            # train at once up to the GPU pool's slots while their version's data plane waits its turn
            training = [queue("training_plane", f"acks@v1~r{i}") for i in range(3)]
            list(QueuedRunCoordinatorDaemon(interval_seconds=1).run_iteration(context))

            cpu, gpu = launched(instance, "cpu"), launched(instance, "gpu")
            assert len(cpu & set(same)) == 1 and other in cpu  # one run per partition; other partitions go ahead
            waiting = (set(same) - cpu).pop()
            assert instance.get_run_by_id(waiting).status == dg.DagsterRunStatus.QUEUED
            assert len(gpu & set(training)) == 2  # the variants train side by side, up to the 2 slots
            assert gpu <= set(training) and not cpu & set(training)


# --- in-process runs (`ft-assets run`), which never meet the queue -----------------------------------


GATES = {"reading": ("ft_assets.data.assets", "read_dataset"), "training": ("ft_assets.training.recipe", "train")}


def cli_worker(
    argv: list[str], env: dict[str, str], log_path: str, gate: tuple[str, str | None, list[str]] | None
) -> None:
    """Child process: ``ft-assets ARGV`` with its output in a file.

    ``gate`` = (where, a file to create on arriving there, files to wait for): the run stops at
    ``where`` until the files exist, so the test decides what overlaps, whatever the machine's speed.
    """
    os.environ.update(env)
    sys.stdout = sys.stderr = open(log_path, "a", buffering=1)
    import torch

    torch.set_num_threads(1)
    from ft_assets.cli import main

    if gate is not None:
        where, arrived, wait_for = gate
        module = importlib.import_module(GATES[where][0])
        original = getattr(module, GATES[where][1])

        def gated(*args, **kwargs):
            if arrived:
                Path(arrived).touch()
            deadline = time.monotonic() + 120
            while not all(Path(f).exists() for f in wait_for) and time.monotonic() < deadline:
                time.sleep(0.05)
            return original(*args, **kwargs)

        setattr(module, GATES[where][1], gated)
    sys.exit(main(argv))


@pytest.fixture
def project(tmp_path, tiny_model_dir) -> tuple[dict, Path]:
    env = {
        "FT_HOME": str(tmp_path / "home"),
        "DAGSTER_HOME": str(tmp_path / "home" / "dagster_home"),
        "FT_STORE": str(tmp_path / "home" / "store"),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
    }
    config = run_config(tiny_model_dir, steps=6, lr=0.01)
    config["ops"]["lora_adapter"]["config"].update(save_steps=3)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    (tmp_path / "home" / "dagster_home").mkdir(parents=True)
    shutil.copyfile(REPO / "ft_assets/control/dagster.yaml", tmp_path / "home" / "dagster_home" / "dagster.yaml")
    with dg.DagsterInstance.from_config(env["DAGSTER_HOME"]):  # create the SQLite schema before two processes race to
        pass
    return env, tmp_path


def start_cli(forkserver, env, tmp_path: Path, name: str, version: str, until: str, gate=None):
    data = write_dataset(tmp_path / f"data-{version}", rows=60)
    argv = ["run", "--in-process", "--dataset", str(data), "--name", name, "--version", version, "--until", until,
            "--config", str(tmp_path / "config.yaml"), "--json"]  # fmt: skip
    log = tmp_path / f"{version}-{len(list(tmp_path.glob(f'{version}-*.log')))}.log"
    worker = forkserver.Process(target=cli_worker, args=(argv, env, str(log), gate))
    worker.start()
    return worker, log


def finish(worker, timeout: float = 240) -> int:
    worker.join(timeout)
    assert not worker.is_alive(), "the run did not finish"
    return worker.exitcode


@pytest.mark.integration
def test_two_in_process_runs_of_one_partition_never_interleave(forkserver, project):
    env, tmp_path = project
    store = LocalStore(tmp_path / "home" / "store")
    go = tmp_path / "go"
    first, first_log = start_cli(forkserver, env, tmp_path, "acks", "v1", "data", gate=("reading", None, [str(go)]))
    wait_until(lambda: locks.read_lease(store, PARTITION) is not None, first, "the first run's lease", first_log)
    holder = locks.read_lease(store, PARTITION).owner["run_id"]

    second, second_log = start_cli(forkserver, env, tmp_path, "acks", "v1", "data")
    assert finish(second) == 2, second_log.read_text()[-3000:]
    assert f"partition acks@v1 is being materialized by run {holder} (started" in second_log.read_text()
    go.touch()
    assert finish(first) == 0, first_log.read_text()[-3000:]

    # Everything the partition holds was written by the first run alone: each reference matches its
    # artifact's manifest, and each artifact's upstream is the reference actually stored.
    assets = [
        "base_model",
        "raw_dataset",
        "cleaned_dataset",
        "deduplicated_dataset",
        "train_eval_split",
        "tokenized_shards",
    ]
    refs = {asset: read_ref(store, PARTITION, asset) for asset in assets}
    for asset, ref in refs.items():
        assert read_manifest(store, ref["prefix"]).digest == ref["digest"], asset
        for name, upstream in ref["upstream"].items():
            assert upstream["digest"] == refs[name]["digest"], (asset, name)
    runs = dg.DagsterInstance.from_config(env["DAGSTER_HOME"]).get_runs()
    assert {r.run_id for r in runs if r.status == dg.DagsterRunStatus.SUCCESS} == {holder}

    third, third_log = start_cli(forkserver, env, tmp_path, "acks", "v1", "data")  # once the first is done
    assert finish(third) == 0, third_log.read_text()[-3000:]


@pytest.mark.integration
def test_two_partitions_train_side_by_side(forkserver, project):
    env, tmp_path = project
    store = LocalStore(tmp_path / "home" / "store")
    arrived = {version: str(tmp_path / f"training-{version}") for version in ("p1", "p2")}
    # Each training waits until the other has started too: they surely run side by side.
    workers = [start_cli(forkserver, env, tmp_path, "acks", version, "training", gate=("training", arrived[version], list(arrived.values())))
               for version in ("p1", "p2")]  # fmt: skip
    for worker, log in workers:
        assert finish(worker) == 0, log.read_text()[-3000:]
    summaries = [json.loads(log.read_text().strip().splitlines()[-1]) for _, log in workers]
    assert [s["steps"] for s in summaries] == [6, 6]
    assert summaries[0]["adapter_uri"] != summaries[1]["adapter_uri"]
    instance = dg.DagsterInstance.from_config(env["DAGSTER_HOME"])
    windows = []
    for summary in summaries:
        (run_id,) = summary["runs"]["training"]
        record = instance.get_run_record_by_id(run_id)
        windows.append((record.start_time, record.end_time))
    (start_1, end_1), (start_2, end_2) = windows
    assert start_1 < end_2 and start_2 < end_1, f"the two trainings did not overlap: {windows}"
    for version in ("p1", "p2"):
        assert locks.read_lease(store, f"acks@{version}").owner["run_id"] in [
            s["runs"]["training"][0] for s in summaries
        ]


def test_a_partition_added_by_a_concurrent_run_is_not_an_error():
    """Two ``ft-assets run``s see the same new versions; the slower insert hits the unique constraint."""
    from ft_assets.cli.planes import add_partitions

    with dg.instance_for_test() as instance:
        real_add = instance.add_dynamic_partitions

        def add_after_the_other_run(name, keys):
            real_add(name, keys)  # the other run's insert lands between our check and our insert
            raise RuntimeError("UNIQUE constraint failed: dynamic_partitions.partition")

        instance.add_dynamic_partitions = add_after_the_other_run
        add_partitions(instance, "dataset_version", ["acks@p1", "acks@p2"])
        assert set(instance.get_dynamic_partitions("dataset_version")) == {"acks@p1", "acks@p2"}

        def always_fails(name, keys):
            raise RuntimeError("database is locked")

        instance.add_dynamic_partitions = always_fails
        with pytest.raises(RuntimeError, match="database is locked"):
            add_partitions(instance, "dataset_version", ["acks@p3"])
