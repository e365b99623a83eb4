"""A first run as a user meets it: one-line errors, JSON on failure, and a rerun right after a crash.

- An empty or fully quarantined input fails in ``raw_dataset`` naming the file, in one line without a
  stack trace; ``--json`` answers with what failed, where and what completed.
- The worker of the training run that ``ft-assets run`` launched killed with SIGKILL (out of memory, a
  lost machine): the run fails with one line naming the signal, and a rerun at once skips the data
  plane, already materialized from the same inputs, takes the dead run's lease over at once (its
  process is gone from this host), and resumes training from its checkpoint.
- A lease held by a live run makes the command wait, saying why, instead of failing.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from ft_assets import locks
from ft_assets.storage import LocalStore
from ft_assets_tests.support import run_cli, run_config, training_worker_pid, write_dataset

REPO = Path(__file__).resolve().parents[1]


def config_file(home: Path, tiny_model_dir, **training) -> Path:
    config = run_config(tiny_model_dir, steps=training.pop("steps", 20), lr=0.01)
    config["ops"]["lora_adapter"]["config"].update(training)
    path = home / "run_config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.integration
@pytest.mark.parametrize(
    "content, named",
    [
        ("", "empty.jsonl holds no rows"),
        (
            'not json\n{"prompt": "p", "completion": "c"}\n',
            "empty.jsonl: 2 row(s), all quarantined; invalid_json x1 (first at empty.jsonl:1), unknown_format x1",
        ),
    ],
    ids=["empty", "all-quarantined"],
)
def test_unusable_input_fails_in_raw_dataset_with_one_line_and_json(home, capsys, tiny_model_dir, content, named):
    data = home / "empty.jsonl"
    data.write_text(content)
    config = config_file(home, tiny_model_dir)
    code, failure, err = run_cli(capsys, "run", "--dataset", str(data), "--config", str(config), "--json")
    assert code == 2
    errors = [line for line in err.splitlines() if line.startswith("ft-assets: error:")]
    assert len(errors) == 1 and "raw_dataset: dataset version empty@" in errors[0] and named in errors[0]
    assert "Traceback" not in err and "Stack Trace" not in err and "dagster._core" not in err
    assert failure["failed_plane"] == "data" and failure["completed"] == [] and failure["error"] in errors[0]
    assert failure["run_id"] and failure["partition"].startswith("empty@")


@pytest.mark.integration
def test_json_answers_for_an_error_before_any_run(home, capsys):
    code, failure, err = run_cli(capsys, "run", "--dataset", str(home / "missing.jsonl"), "--json")
    assert code == 2 and err.strip() == f"ft-assets: error: dataset path {home / 'missing.jsonl'} does not exist"
    assert failure == {
        "completed": [],
        "error": f"dataset path {home / 'missing.jsonl'} does not exist",
        "failed_plane": None,
        "run_id": None,
    }


@pytest.mark.integration
def test_a_rerun_right_after_a_sigkilled_worker_skips_the_data_plane_and_takes_the_dead_lease_over(
    home, capsys, tiny_model_dir
):
    import dagster as dg

    config = config_file(home, tiny_model_dir, steps=60, save_steps=10, per_device_batch_size=1)
    data = write_dataset(home / "data", rows=120)
    argv = [
        "run",
        "--dataset",
        str(data),
        "--name",
        "acks",
        "--version",
        "v1",
        "--config",
        str(config),
        "--until",
        "training",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    store = LocalStore(home / "home" / "store")
    with open(home / "first.log", "w") as log:
        first = subprocess.Popen(
            [sys.executable, "-m", "ft_assets.cli", *argv], env=env, stdout=log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + 300
        while not [k for k in store.list("runs/acks/v1/train") if k.endswith("/manifest.json") and "/checkpoint-" in k]:
            assert first.poll() is None, (home / "first.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint after 300 s"
            time.sleep(0.05)
        worker = training_worker_pid(dg.DagsterInstance.get())
        assert worker not in (None, first.pid)
        os.kill(worker, signal.SIGKILL)
        assert first.wait(timeout=120) == 2
    said = (home / "first.log").read_text().splitlines()[-1]
    assert said.startswith("ft-assets: error: training_plane failed for acks@v1") and "signal 9" in said, said
    assert locks.read_lease(store, "acks@v1") is not None  # the dead run left its lease behind

    code, summary, err = run_cli(capsys, *argv, "--json")
    assert code == 0, err
    assert summary["skipped"] == ["data"] and list(summary["runs"]) == ["training"]
    assert summary["resumed_from_step"] >= 10 and summary["steps"] == 60
    assert "waiting up to" not in err  # taken over at once: a live or unknown holder would have been waited for


def test_a_live_holder_makes_the_cli_wait_and_say_why(home, monkeypatch, capsys):
    import dagster as dg

    from ft_assets.cli.planes import wait_for_partition

    store = LocalStore(home / "store")
    lease = locks.acquire(store, "acks@v1", "run-a", lambda run_id: None)
    monkeypatch.setattr(locks, "EXPIRY_SECONDS", 30.0)
    with dg.instance_for_test() as instance:
        threading.Timer(1.5, lease.release).start()  # the live run finishes
        started = time.monotonic()
        wait_for_partition(store, instance, "acks@v1", poll_seconds=0.2)
    assert 1.0 < time.monotonic() - started < 10
    err = capsys.readouterr().err
    said = r"partition acks@v1 is being materialized by run run-a \(unknown to this Dagster instance, last heartbeat \d+ s ago\); waiting up to \d+ s for it to free"
    assert len(re.findall(said, err)) == 1, err  # said once, not at every poll


@pytest.mark.integration  # a process that has exited
def test_a_holder_gone_from_this_host_frees_the_lease_at_once(tmp_path):
    store = LocalStore(tmp_path / "store")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    identity = {**locks.process_identity(), "pid": gone.pid, "pid_started": "1"}
    assert locks.gone_from_this_host(identity)
    assert not locks.gone_from_this_host(locks.process_identity())
    assert not locks.gone_from_this_host({**identity, "host": "another-host"})  # only this host's processes are known
    state = locks.LeaseState(1, {"run_id": "r", "partition": "acks@v1", "created_at": time.time(), **identity}, [])
    assert locks.busy_reason(state, lambda run_id: "STARTED", time.time()) is None
    alive = locks.LeaseState(
        1, {"run_id": "r", "partition": "acks@v1", "created_at": time.time(), **locks.process_identity()}, []
    )
    assert locks.busy_reason(alive, lambda run_id: "STARTED", time.time()) is not None
    assert store.list("") == []
