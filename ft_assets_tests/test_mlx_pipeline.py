"""Mac first: one ``ft-assets run`` of all four planes with ``backend: mlx`` (mlx-cpu here; Metal on a Mac), a tiny
Qwen2.5 on the tool-call acknowledgements. The adapter mlx-lm trained is published as a PEFT adapter (mlx-lm's files
beside it) that transformers loads and whose merge beats the base on the held-out eval; the MLX export ships an mlx-lm
folder that mlx-lm answers with, scored beside the GGUF (which llama.cpp loads); everything is signed; MLflow and W&B
(offline) carry the run, W&B with the adapter's and the published model's URIs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from ft_assets.delivery import signing
from ft_assets.refs import read_ref
from ft_assets.storage import LocalStore
from ft_assets_tests.families import build_family
from ft_assets_tests.support import ANSWER, run_cli, run_config, wandb_run_data, write_dataset

pytest.importorskip("mlx.core", reason="the [mlx] extra (mlx, mlx-lm) is not installed")
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("with_mlx")]


def signing_key(folder: Path) -> Path:
    folder.mkdir(mode=0o700)
    key = folder / "signing.pem"
    key.write_bytes(ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))  # fmt: skip
    return key


def test_a_run_trained_with_mlx_is_published_with_a_peft_adapter_and_an_mlx_model(home, capsys, monkeypatch):
    from mlx_lm import generate, load
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv(signing.KEY_ENV, str(signing_key(home / "keys")))
    for name, value in {"WANDB_MODE": "offline", "WANDB_DIR": str(home), "WANDB_SILENT": "true"}.items():
        monkeypatch.setenv(name, value)
    settings = run_config(build_family("qwen2.5", home / "qwen"), steps=60, lr=0.01)
    settings["ops"]["lora_adapter"]["config"] |= {
        "backend": "mlx", "mlflow_tracking_uri": f"sqlite:///{home / 'mlflow.db'}", "wandb": {"enabled": True},
    }  # fmt: skip
    settings["ops"]["mlx_model"] = {"config": {"variants": ["bf16", "4bit"]}}
    (home / "run_config.yaml").write_text(yaml.safe_dump(settings))
    data = write_dataset(home / "data")
    code, summary, err = run_cli(capsys, "run", "--in-process", "--dataset", str(data), "--name", "acks", "--version",
                                 "v1", "--config", str(home / "run_config.yaml"), "--json")  # fmt: skip
    assert code == 0, err
    assert summary["finetuned_metric"] >= 0.5 > summary["base_metric"]  # the held-out eval's gate
    store = LocalStore(home / "home" / "store")
    adapter = read_ref(store, "acks@v1", "lora_adapter")
    assert adapter["stats"]["device"] == "mlx-cpu x1" and adapter["stats"]["resolved"]["backend"] == "mlx"
    assert summary["mlx_metric"] is not None and summary["mlx_drop"] <= 0.05 and summary["gguf_metric"] is not None

    published = Path(summary["published_uri"])
    assert (published / "adapter" / "mlx" / "adapters.safetensors").is_file()  # mlx-lm's original, beside PEFT's
    tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(published / "merged"), published / "adapter")
    assert tuned.peft_config["default"].r == 8
    shipped = published / "mlx" / summary["mlx_file"]
    model, tokenizer = load(str(shipped))  # mlx-lm answers with the published MLX model
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Request number 7: please acknowledge item 49."}], add_generation_prompt=True
    )
    assert generate(model, tokenizer, prompt, max_tokens=12).strip() == ANSWER
    signature = read_ref(store, "acks@v1", "published_model")["stats"]["signature"]
    assert signature["signed"] and signature["files"] >= 10

    run_id = adapter["stats"]["run_id"]
    assert adapter["stats"]["wandb_run_id"] == run_id and adapter["stats"]["mlflow_run_id"]
    tracked = wandb_run_data(home, run_id)
    assert tracked["config"]["backend"] == "mlx" and tracked["config"]["ft.backend"] == "mlx"
    assert [step for step, _ in tracked["history"]["loss"]] == list(range(10, 61, 10))
    assert tracked["history"]["exact_match"][-1] == (60, summary["finetuned_metric"])
    assert tracked["summary"]["ft.digest.lora_adapter"] == adapter["digest"]
    assert {"lora_adapter", "published_model"} <= {name.rsplit("-", 1)[0] for name in tracked["artifacts"]}
    lineage = json.loads((published / "lineage.json").read_text())
    assert lineage["exports"]["mlx"]["shipped"] == summary["mlx_file"]
