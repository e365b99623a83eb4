"""Mixtures of experts end to end: gpt-oss as it is released (MXFP4 experts, harmony chat format, attention sinks,
alternating sliding-window layers) through all four planes in one ``ft-assets run``, and its MXFP4 checkpoint stored
dequantized. The function-level matrix (planner counts, LoRA on the experts, packing, merge) is in
``test_families.py`` for Qwen3-MoE, Mixtral and gpt-oss; their GGUF in llama.cpp is in ``test_gguf_families.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open

from ft_assets.delivery.exports.protocol import ExportRefused
from ft_assets.refs import read_ref
from ft_assets.storage import LocalStore
from ft_assets.training.base_model import ModelSource, describe, materialize_source
from ft_assets_tests.families import build_family, exact_weights, write_mxfp4
from ft_assets_tests.support import run_cli, run_config, write_dataset


def test_an_mxfp4_checkpoint_is_stored_as_the_weights_it_stands_for(tmp_path):
    mxfp4 = write_mxfp4(build_family("gpt-oss", tmp_path / "gpt-oss"), tmp_path / "gpt-oss-mxfp4")
    lines = []
    materialize_source(ModelSource("dir", str(mxfp4), "gpt-oss-tiny"), tmp_path / "stored", False, log=lines.append)
    stored = tmp_path / "stored"
    assert "quantization_config" not in json.loads((stored / "config.json").read_text())
    assert any("dequantizing MXFP4" in line for line in lines)
    exact = exact_weights(mxfp4)
    with safe_open(stored / "model.safetensors", "pt") as weights:
        assert set(weights.keys()) == set(exact)  # no blocks or scales left, every expert a float tensor
        for name, value in exact.items():
            assert torch.equal(weights.get_tensor(name), value.to(weights.get_tensor(name).dtype)), name
    assert describe(stored)["parameters"] == describe(tmp_path / "gpt-oss")["parameters"]  # what the plan counts


@pytest.mark.integration
def test_gpt_oss_as_released_trains_its_experts_and_ships_a_gguf_that_llamacpp_runs(home, capsys):
    """MXFP4 experts stored dequantized; harmony rows learn the channel header and <|return|> (test_families.py);
    the gate reads the final channel's answer in transformers and llama.cpp."""
    base = write_mxfp4(build_family("gpt-oss", home / "gpt-oss"), home / "gpt-oss-mxfp4")
    settings = run_config(base, steps=60, lr=0.01)
    settings["ops"]["eval_report"]["config"]["max_new_tokens"] = 16  # harmony's "<|channel|>final<|message|>" first
    (home / "run_config.yaml").write_text(yaml.safe_dump(settings))
    code, summary, err = run_cli(capsys, "run", "--in-process", "--dataset", str(write_dataset(home / "data")),
                                 "--name", "acks", "--version", "v1", "--config", str(home / "run_config.yaml"), "--json")  # fmt: skip
    assert code == 0, err
    assert summary["finetuned_metric"] >= 0.5 > summary["base_metric"]  # the held-out eval's gate
    assert summary["gguf_metric"] >= 0.5  # the GGUF in llama.cpp: its answer is the final channel's message
    store = LocalStore(home / "home" / "store")
    plan = read_ref(store, "acks@v1", "training_plan")["stats"]
    assert plan["params"]["experts"] == 4 and plan["params"]["active"] < plan["params"]["total"]
    adapter = read_ref(store, "acks@v1", "lora_adapter")["stats"]
    assert adapter["resolved"]["method"] == "lora"  # a mixture's default
    published = Path(summary["published_uri"])
    config = json.loads((published / "adapter" / "adapter_config.json").read_text())
    assert sorted(config["target_parameters"]) == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    with safe_open(published / "adapter" / "adapter_model.safetensors", "pt") as weights:
        experts = [key for key in weights.keys() if ".experts." in key]
        assert experts and all(weights.get_tensor(key).abs().sum() > 0 for key in experts)


@pytest.mark.parametrize("name, tolerance", [("qwen3-moe", 1e-5), ("mixtral", 1e-5), ("gpt-oss", 5e-2)])
def test_mlx_lm_answers_with_each_mixtures_export_as_transformers_does(name, tolerance, tmp_path):
    """In float32 (what mlx's CPU build runs experts in) mlx-lm's logits are transformers' (gpt-oss: 5e-3 to 2.1e-2
    measured, from mlx-lm's YaRN, growing with the prompt, whose harmony header carries today's date); then the 8-bit export the asset makes, checked by mlx-lm itself (a mis-laid expert would land near 1)."""
    pytest.importorskip("mlx.core", reason="the [mlx] extra (mlx, mlx-lm) is not installed")
    import contextlib
    import io
    import logging

    import mlx.core as mx
    import numpy as np
    from mlx_lm import convert, load

    from ft_assets import portable
    from ft_assets.delivery import llamacpp
    from ft_assets.delivery.exports import mlx
    from ft_assets.delivery.gguf_export import logit_agreement

    merged = build_family(name, tmp_path / name)
    portable.make_portable(merged)  # as the merge writes it
    reference = llamacpp.reference(merged)
    source = mlx.experts_as_mlx_reads_them(merged, tmp_path / "source")
    with contextlib.redirect_stdout(io.StringIO()):
        convert(str(source), str(tmp_path / "fp32"), dtype="float32")
    model, _ = load(str(tmp_path / "fp32"))
    pairs = [(expected, np.asarray(model(mx.array([ids]))[0].astype(mx.float32)))
             for ids, expected in zip(reference.prompt_ids, reference.logits)]  # fmt: skip
    assert logit_agreement(pairs)["rel_error"] <= tolerance
    made = mlx.make(
        merged, tmp_path / "out", tmp_path / "work", name, mlx.MlxSettings(variants=["8bit"]), logging.getLogger()
    )
    assert made.files[f"{name}-mlx-8bit"]["mlx"]["rel_error"] <= 0.2  # routing flips under 8 bits (test_gguf_families)
    with pytest.raises(ExportRefused, match="mlx's CPU build runs a mixture's experts in float32 only"):
        mlx.make(
            merged, tmp_path / "out", tmp_path / "work", name, mlx.MlxSettings(variants=["bf16"]), logging.getLogger()
        )


GPT_OSS_20B = dict(hidden_size=2880, num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                   intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4, vocab_size=201088,
                   tie_word_embeddings=False)  # fmt: skip


def test_ft_assets_plan_of_gpt_oss_20b_counts_all_experts_in_memory_and_the_active_ones_in_time(tmp_path, capsys):
    import transformers

    (tmp_path / "config.json").write_text(json.dumps(transformers.GptOssConfig(**GPT_OSS_20B).to_dict()))
    args = [
        "plan",
        "--model-config",
        str(tmp_path),
        "--seq-len",
        "2048",
        "--gradient-checkpointing",
        "--tokens",
        "10000000",
    ]
    code, plan, err = run_cli(capsys, *args, "--method", "lora", "--json")
    assert code == 0, err
    assert (plan["params"], plan["active_params"], plan["experts"], plan["experts_per_token"]) == (
        20_914_757_184, 3_608_307_264, 32, 4)  # fmt: skip
    assert 20.9e9 * 2 / 2**30 < plan["weights_gib"] < 21e9 * 2 / 2**30  # every expert in bf16: ~39 GiB
    assert plan["tier"] == "h100-80gb"  # 39 GiB of weights need more than a 48 GB card with its headroom
    assert plan["flops_per_token"] < 8 * 3.61e9 < 6 * 20.9e9  # matmuls of the active parameters (x6 with recompute)
    assert plan["describe_params"] == "20.91B params, 3.61B active (4 of 32 experts)"
    assert any("lower bound" in warning for warning in plan["warnings"])
    code, _, err = run_cli(capsys, *args, "--method", "qlora")
    assert code != 0 and "method 'qlora' on a mixture of 32 experts: bitsandbytes quantizes linear layers only" in err
