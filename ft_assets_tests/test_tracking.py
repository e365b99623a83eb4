"""MLflow tracking against a real tracking server on loopback (SQLite backend), read back with MlflowClient:
params, per-step metrics, eval figures and lineage tags of a DPO run; one MLflow run per training run and
per DDP group (rank 0 only); a tracker that does not answer, or dies mid-run, is a warning, never a failure."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import pytest

from ft_assets.objectives import DPO
from ft_assets.storage import LocalStore
from ft_assets.training.recipe import train
from ft_assets.training.tracking import lineage_tags
from ft_assets_tests.mlflowserver import MlflowServer
from ft_assets_tests.pg import free_port
from ft_assets_tests.support import DPO_RUN as RUN, ONE_THREAD, dpo_config, the_run

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_cpu_thread")]
DIGESTS = {"raw_dataset": "a" * 64, "tokenized_shards": "b" * 64, "base_model": "c" * 64}  # the refs' manifest digests


def test_a_dpo_run_is_logged_with_params_metrics_eval_figures_and_lineage(
    mlflow_server, pair_model, pair_shards, tmp_path
):
    experiment = f"dpo-{uuid.uuid4().hex[:8]}"
    cfg = dpo_config(mlflow_tracking_uri=mlflow_server.uri, mlflow_experiment=experiment, eval_steps=8)
    tags = lineage_tags("timers@v1", {name: {"digest": digest} for name, digest in DIGESTS.items()})
    lines = []
    result = train(
        cfg,
        pair_model,
        pair_shards,
        LocalStore(tmp_path / "store"),
        RUN,
        tmp_path / "w1",
        log=lines.append,
        tags=tags,
        objective=DPO,
    )
    client = mlflow_server.client()
    run = the_run(client, experiment)
    assert run.info.run_id == result.mlflow_run_id and run.info.run_name == "dpo" and run.info.status == "FINISHED"
    params = run.data.params
    assert (params["objective"], params["method"], params["dpo.beta"], params["dpo.loss"]) == (
        "dpo",
        "lora",
        "0.1",
        "sigmoid",
    )
    assert (params["learning_rate"], params["total_steps"], params["seed"]) == ("0.005", "16", "7")
    assert run.data.tags["ft.dataset_version"] == "timers@v1" and run.data.tags["ft.run_id"] == "dpo"
    assert {f"ft.digest.{name}": digest for name, digest in DIGESTS.items()}.items() <= run.data.tags.items()
    assert run.data.tags["ft.objective"] == "dpo"

    def history(key: str) -> list[tuple[int, float]]:
        return [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]

    for key in ("loss", "learning_rate", "tokens_per_second", "grad_norm", "epoch"):
        assert [step for step, _ in history(key)] == [4, 8, 12, 16], key
    windows = [result.loss_history[i : i + 4] for i in range(0, 16, 4)]
    assert [value for _, value in history("loss")] == pytest.approx([sum(v for _, v in w) / 4 for w in windows])
    assert all(value > 0 for _, value in history("grad_norm"))
    assert [step for step, _ in history("eval_loss")] == [8, 16]
    assert history("eval_reward_accuracy")[-1][1] == pytest.approx(result.eval_metrics["eval_reward_accuracy"])
    assert history("eval_reference_reward_accuracy")[-1][1] == pytest.approx(
        result.eval_metrics["eval_reference_reward_accuracy"]
    )

    # Another attempt of the same run continues its MLflow run.
    again = train(
        cfg,
        pair_model,
        pair_shards,
        LocalStore(tmp_path / "store"),
        RUN,
        tmp_path / "w2",
        log=lines.append,
        tags=tags,
        objective=DPO,
    )
    assert again.mlflow_run_id == run.info.run_id and the_run(client, experiment).info.status == "FINISHED"
    assert any("(resumed)" in line for line in lines)


def test_a_tracker_that_does_not_answer_is_a_warning(pair_model, pair_shards, tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    lines = []
    result = train(dpo_config(max_steps=4, mlflow_tracking_uri=dead), pair_model, pair_shards, LocalStore(tmp_path / "store"), RUN,
                   tmp_path / "work", log=lines.append, objective=DPO)  # fmt: skip
    assert result.steps == 4 and result.mlflow_run_id is None
    assert any(
        line.startswith(f"WARNING: MLflow at {dead} did not answer") and "training goes on" in line for line in lines
    )


def test_a_tracker_that_dies_mid_run_is_a_warning(pair_model, pair_shards, tmp_path):
    server = MlflowServer(tmp_path / "mlflow")
    (tmp_path / "mlflow").mkdir()
    server.start()
    try:
        lines = []

        def on_metrics(metrics: dict) -> None:
            if metrics["step"] == 8:
                server.stop()

        cfg = dpo_config(mlflow_tracking_uri=server.uri)
        result = train(
            cfg,
            pair_model,
            pair_shards,
            LocalStore(tmp_path / "store"),
            RUN,
            tmp_path / "work",
            log=lines.append,
            on_metrics=on_metrics,
            objective=DPO,
        )
    finally:
        server.stop()
    assert result.steps == 16 and result.mlflow_run_id is not None
    assert [line for line in lines if "MLflow" in line and "WARNING" in line][0].startswith(
        f"WARNING: MLflow at {server.uri} failed to log metrics"
    )
    assert sum("tracking is off" in line for line in lines) == 1  # one warning, then no more calls


def test_only_rank_0_of_a_data_parallel_run_tracks(mlflow_server, pair_model, pair_shards, tmp_path):
    experiment = f"ddp-{uuid.uuid4().hex[:8]}"
    cfg = dpo_config(num_processes=2, max_steps=4, logging_steps=2, per_device_batch_size=1, mlflow_tracking_uri=mlflow_server.uri,
                     mlflow_experiment=experiment)  # fmt: skip
    store_dir = tmp_path / "store"
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
               "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
               "-m", "ft_assets_tests.test_training", cfg.model_dump_json(), str(pair_model), str(pair_shards), str(store_dir),
               str(tmp_path / "work"), "dpo"]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, env=ONE_THREAD)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    client = mlflow_server.client()
    run = the_run(client, experiment)  # one run, not one a rank
    assert run.info.run_id == result["mlflow_run_id"] and result["device"] == "cpu x2"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [2, 4]  # logged once a step
