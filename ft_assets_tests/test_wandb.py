"""W&B tracking beside MLflow: one training run logged to both (MLflow in a SQLite store, W&B in offline mode), read
back with MlflowClient and with wandb's own protobuf records of the offline run (``support.wandb_run_data``): the same
params/config, the same metrics at the same steps, the same lineage tags; then what the assets add afterwards
(``record_run``: the adapter's digest, the eval figures, the adapter's and published model's URIs)."""

from __future__ import annotations

import pytest

from ft_assets.storage import LocalStore
from ft_assets.training.recipe import train
from ft_assets.training.tracking import lineage_tags, record_run
from ft_assets_tests.support import RUN, training_config, wandb_run_data

pytest.importorskip("wandb", reason="the [wandb] extra is not installed")
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_cpu_thread")]
DIGESTS = {"raw_dataset": "a" * 64, "tokenized_shards": "b" * 64, "base_model": "c" * 64}


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_PROJECT", "from-the-environment")
    return tmp_path


def test_a_run_logged_to_wandb_and_mlflow_carries_the_same_figures(tiny_model, shards, tmp_path, offline_wandb):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = training_config(max_steps=8, eval_steps=4, mlflow_tracking_uri=uri, wandb={"enabled": True})
    tags = lineage_tags("timers@v1", {name: {"digest": digest} for name, digest in DIGESTS.items()})
    lines: list[str] = []
    result = train(config, tiny_model, shards, LocalStore(tmp_path / "store"), RUN, tmp_path / "work", lines.append,
                   tags=tags)  # fmt: skip
    assert result.wandb_run_id == "test" and result.mlflow_run_id  # W&B's run id is the run id (RUN's last part)
    assert any(line.startswith("tracking in W&B: project 'from-the-environment', run test (offline)") for line in lines)

    client = MlflowClient(uri)
    mlflow_run = client.get_run(result.mlflow_run_id)
    wandb_run = wandb_run_data(offline_wandb, "test")
    logged_config = {key: str(value) for key, value in wandb_run["config"].items() if key != "_wandb"}
    mlflow_tags = {key: value for key, value in mlflow_run.data.tags.items() if not key.startswith("mlflow.")}
    assert logged_config == {**mlflow_run.data.params, **mlflow_tags}  # MLflow keeps params as strings
    metrics = ("loss", "learning_rate", "tokens_per_second", "grad_norm", "epoch", "eta_seconds", "eval_loss")
    for key in metrics:
        logged = [(m.step, m.value) for m in client.get_metric_history(mlflow_run.info.run_id, key)]
        steps, values = zip(*wandb_run["history"][key])
        assert logged and list(steps) == [step for step, _ in logged], key
        assert list(values) == pytest.approx([value for _, value in logged], rel=1e-12), key

    stats = {"mlflow_run_id": result.mlflow_run_id, "wandb_run_id": result.wandb_run_id}
    adapter = tmp_path / "store" / RUN / "checkpoint-00000008"  # a folder in the store, as lora_adapter's URI is
    settings = config.model_dump()
    record_run(settings, stats, lines.append, tags={"ft.digest.lora_adapter": "d" * 64},
               artifacts={"lora_adapter": str(adapter)})  # fmt: skip
    record_run(settings, stats, lines.append, metrics={"exact_match": 0.75}, step=8,
               artifacts={"published_model": "s3://bucket/registry/timers/v1/test"})  # fmt: skip
    assert not [line for line in lines if line.startswith(("WARNING: W&B", "WARNING: MLflow"))], lines
    wandb_run = wandb_run_data(offline_wandb, "test")
    assert wandb_run["summary"]["ft.digest.lora_adapter"] == "d" * 64
    assert wandb_run["history"]["exact_match"] == [(8, 0.75)]
    assert wandb_run["artifacts"]["published_model-test"] == ["s3://bucket/registry/timers/v1/test"]
    referenced = wandb_run["artifacts"]["lora_adapter-test"]  # a local folder: W&B references each of its files
    assert sorted(referenced) == sorted(f"file://{path}" for path in adapter.iterdir())
    mlflow_run = client.get_run(result.mlflow_run_id)
    assert mlflow_run.data.tags["ft.digest.lora_adapter"] == "d" * 64 and mlflow_run.data.metrics["exact_match"] == 0.75
