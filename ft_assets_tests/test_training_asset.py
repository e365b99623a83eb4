"""lora_adapter through Dagster: 2-process data parallel via accelerate + dagster-pipes, and preemption of a launched run."""

import json
import os
import signal
import threading

import dagster as dg
import pytest
import yaml

from ft_assets.cli import main
from ft_assets.storage import LocalStore
from ft_assets_tests.support import run_config, training_worker_pid, write_dataset

pytestmark = pytest.mark.integration


def test_two_processes_train_through_pipes_and_report_from_rank_0(home, capsys, tiny_model_dir):
    config = run_config(tiny_model_dir, steps=6, lr=0.01)
    config["ops"]["lora_adapter"]["config"].update(num_processes=2, save_steps=3)
    (home / "config.yaml").write_text(yaml.safe_dump(config))
    data = write_dataset(home / "data", rows=120)
    code = main(
        [
            "run",
            "--in-process",
            "--dataset",
            str(data),
            "--name",
            "acks",
            "--version",
            "ddp",
            "--until",
            "training",
            "--config",
            str(home / "config.yaml"),
            "--json",
        ]
    )
    out = capsys.readouterr()
    assert code == 0, out.err
    summary = json.loads(out.out.strip().splitlines()[-1])
    assert summary["steps"] == 6
    assert [c.rsplit("/", 1)[-1] for c in summary["checkpoints"]] == ["checkpoint-00000003", "checkpoint-00000006"]
    instance = dg.DagsterInstance.get()
    (run_id,) = summary["runs"]["training"]
    messages = [e.user_message for e in instance.all_logs(run_id)]
    # Rank 0's lines reach the Dagster run log through Pipes; exactly one process reports.
    assert sum(m.startswith("training lora on cpu") and " x2, run " in m for m in messages) == 1
    assert "[pipes] external process successfully opened dagster pipes." in messages


def test_sigterm_mid_training_is_a_retryable_preemption_and_the_retry_resumes(
    home, capsys, tiny_model_dir, monkeypatch
):
    """A spot notice to the run's worker process during training: checkpoint, fail as ft/preempted, retry, resume.

    ``ft-assets run`` launched the run through the instance (no daemon here), so it makes the retry the
    daemon's run retries would make: a re-execution linked to the preempted run, launched the same way.
    """
    config = run_config(tiny_model_dir, steps=40, lr=0.01)
    config["ops"]["lora_adapter"]["config"].update(save_steps=5, logging_steps=1)
    (home / "config.yaml").write_text(yaml.safe_dump(config))
    data = write_dataset(home / "data", rows=120)
    assert (
        main(
            [
                "run",
                "--in-process",
                "--dataset",
                str(data),
                "--name",
                "acks",
                "--version",
                "spot",
                "--until",
                "data",
                "--config",
                str(home / "config.yaml"),
            ]
        )
        == 0
    )
    capsys.readouterr()

    store = LocalStore(home / "home" / "store")
    fired, killed = threading.Event(), []

    def send_sigterm_after_first_checkpoint():
        instance = dg.DagsterInstance.get()
        while not fired.is_set():
            if any(k.endswith("manifest.json") and "/checkpoint-" in k for k in store.list("runs/acks/spot/train")):
                pid = training_worker_pid(instance)
                os.kill(pid, signal.SIGTERM)
                killed.append(pid)
                fired.set()
            fired.wait(0.05)

    watcher = threading.Thread(target=send_sigterm_after_first_checkpoint, daemon=True)
    watcher.start()
    code = main(
        [
            "run",
            "--dataset",
            str(data),
            "--name",
            "acks",
            "--version",
            "spot",
            "--until",
            "training",
            "--config",
            str(home / "config.yaml"),
            "--json",
        ]
    )
    fired.set()
    out = capsys.readouterr()
    assert code == 0, out.err
    assert killed and killed[0] != os.getpid()  # the run's own worker, not the command
    summary = json.loads(out.out.strip().splitlines()[-1])
    assert len(summary["runs"]["training"]) == 2, "the preempted run should have been retried once"
    assert summary["resumed_from_step"] >= 5
    assert summary["steps"] == 40
    instance = dg.DagsterInstance.get()
    first, retry = (instance.get_run_by_id(run_id) for run_id in summary["runs"]["training"])
    assert first.status == dg.DagsterRunStatus.FAILURE and first.tags["ft/preempted"] == "true"
    assert (
        retry.parent_run_id == first.run_id and retry.tags["dagster/retry_number"] == "1"
    )  # the UI shows it as the retry
    assert first.tags["dagster/auto_retry_run_id"] == retry.run_id  # a daemon started later does not retry it again
    assert "was preempted; retrying" in out.err
