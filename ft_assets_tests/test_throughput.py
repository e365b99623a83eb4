"""Throughput figures (tokens/s, MFU, $ per million tokens) and ``ft-assets plan``, the planner before any run."""

from __future__ import annotations

import json

import pytest

from ft_assets.cli import main
from ft_assets.cli.plan import plan_request
from ft_assets.control.assets import measured_throughput
from ft_assets.control.cost_model import CostModel
from ft_assets.control.planner import ModelShape, estimate_vram, throughput
from ft_assets.training.config import TrainingConfig
from ft_assets_tests.reference_models import REFERENCE_CONFIGS

H100 = CostModel().offering("h100-80gb")  # 989 bf16 TFLOPS, $3.50/h on demand, $1.75 spot


def test_mfu_and_price_per_million_tokens_by_hand():
    figures = throughput(5000.0, 40e9, H100, 3.5)
    assert figures.mfu == pytest.approx(5000 * 40e9 / 989e12)
    assert figures.usd_per_million_tokens == pytest.approx(3.5 / (5000 * 3600) * 1e6)
    assert throughput(5000.0, 40e9, None, None).as_dict() == {
        "tokens_per_second": 5000.0,
        "mfu": None,
        "usd_per_million_tokens": None,
    }
    assert throughput(0.0, 40e9, H100, 3.5).usd_per_million_tokens is None


@pytest.mark.parametrize(
    "device, declared, mfu", [("cpu x1", None, None), ("cuda x1", "h100-80gb", 800 * 1e10 / 989e12)]
)
def test_measured_throughput_uses_the_tier_the_worker_is_billed_as(device, declared, mfu, monkeypatch):
    """A CPU run has no MFU (its peak is unknown); a GPU run is measured against its tier's bf16 peak."""
    if declared:
        monkeypatch.setenv("FT_GPU_TIER", declared)
    else:
        monkeypatch.delenv("FT_GPU_TIER", raising=False)
    monkeypatch.delenv("FT_RENTAL_MODE", raising=False)
    adapter = {"stats": {"device": device, "tokens_per_second": 800.0}}
    plan = {"stats": {"gpu_tier": "a10g-24gb", "rental_mode": "spot", "flops_per_token": 1e10}}
    figures = measured_throughput(adapter, plan, CostModel())
    assert figures.mfu == (None if mfu is None else pytest.approx(mfu))
    price = 1.75 if declared else 0.6  # spot price of the declared tier, else of the plan's
    assert figures.usd_per_million_tokens == pytest.approx(price / (800 * 3600) * 1e6)


def test_a_slurm_worker_is_priced_at_the_slurm_rate_it_recorded(monkeypatch):
    """lora_adapter records what its worker declared (``billed_as``); a Slurm job's mode is slurm: $2.00/GPU-h on H100."""
    monkeypatch.delenv("FT_GPU_TIER", raising=False)
    monkeypatch.delenv("FT_RENTAL_MODE", raising=False)
    adapter = {"stats": {"device": "cuda x1", "tokens_per_second": 800.0,
                         "billed_as": {"FT_GPU_TIER": "h100-80gb", "FT_RENTAL_MODE": "slurm"}}}  # fmt: skip
    plan = {"stats": {"gpu_tier": "a10g-24gb", "rental_mode": "spot", "flops_per_token": 1e10}}
    figures = measured_throughput(adapter, plan, CostModel())
    assert figures.usd_per_million_tokens == pytest.approx(2.00 / (800 * 3600) * 1e6)


@pytest.fixture
def llama7b_dir(tmp_path):
    (tmp_path / "llama2-7b").mkdir()
    (tmp_path / "llama2-7b" / "config.json").write_text(json.dumps(REFERENCE_CONFIGS["Llama-2-7B"]))
    return tmp_path / "llama2-7b"


@pytest.mark.parametrize("attention", ["auto", "sdpa"])
def test_plan_command_prints_the_breakdown_tier_and_estimate(llama7b_dir, capsys, attention, monkeypatch):
    monkeypatch.delenv("FT_COST_MODEL", raising=False)
    argv = ["plan", "--model-config", str(llama7b_dir), "--method", "qlora", "--seq-len", "4096", "--batch", "2",
            "--gradient-checkpointing", "--attn-implementation", attention, "--json"]  # fmt: skip
    assert main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    plan = json.loads(lines[-1])
    shape = ModelShape.from_config(REFERENCE_CONFIGS["Llama-2-7B"])
    settings = TrainingConfig(per_device_batch_size=2, gradient_checkpointing=True, attn_implementation=attention)
    expected = estimate_vram(plan_request(shape, "qlora", 4096, 1, settings))
    assert plan["total_gib"] == pytest.approx(expected.total_gib) and plan["model"] == "llama2-7b"
    assert (plan["attention_gib"] > 0) == (attention == "sdpa")
    assert plan["tier"] and plan["tokens_per_second"] > 0 and 0 < plan["mfu"] < 1 and plan["usd_per_million_tokens"] > 0
    assert lines[1].strip().startswith(f"needs {expected.total_gib:.1f} GiB (weights")
    assert plan["tier"] in lines[2]


def test_plan_command_reads_a_config_file_and_says_what_is_wrong(llama7b_dir, tmp_path, capsys):
    assert (
        main(["plan", "--model-config", str(llama7b_dir / "config.json"), "--method", "lora", "--seq-len", "512"]) == 0
    )
    assert "needs" in capsys.readouterr().out
    assert main(["plan", "--model-config", str(tmp_path / "missing.json"), "--method", "lora", "--seq-len", "512"]) == 2
    assert "cannot read the model config" in capsys.readouterr().err
    huge = tmp_path / "huge.json"
    huge.write_text(json.dumps({**REFERENCE_CONFIGS["Llama-2-13B"], "num_hidden_layers": 400}))
    assert main(["plan", "--model-config", str(huge), "--method", "full", "--seq-len", "512"]) == 2
    assert "no GPU offering fits full" in capsys.readouterr().err


@pytest.fixture
def llama70b_dir(tmp_path):
    (tmp_path / "llama2-70b").mkdir()
    (tmp_path / "llama2-70b" / "config.json").write_text(json.dumps(REFERENCE_CONFIGS["Llama-2-70B"]))
    return tmp_path / "llama2-70b"


@pytest.mark.parametrize(
    "gpus, parallelism, chosen, shown",
    [
        ("auto", [], 4, "4 x h100-80gb (NVIDIA H100 80GB SXM), fsdp, spot"),  # 70B LoRA: 141 GiB on one GPU
        ("8", ["--parallelism", "fsdp"], 8, "8 x h100-80gb (NVIDIA H100 80GB SXM), fsdp, spot"),
    ],
)
def test_plan_command_plans_several_gpus_and_shows_the_qlora_alternative(
    llama70b_dir, capsys, monkeypatch, gpus, parallelism, chosen, shown
):
    monkeypatch.delenv("FT_COST_MODEL", raising=False)
    argv = ["plan", "--model-config", str(llama70b_dir), "--method", "lora", "--seq-len", "2048", "--gradient-checkpointing",
            "--gpus", gpus, *parallelism, "--json"]  # fmt: skip
    assert main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    plan = json.loads(lines[-1])
    shape = ModelShape.from_config(REFERENCE_CONFIGS["Llama-2-70B"])
    settings = TrainingConfig(per_device_batch_size=1, gradient_checkpointing=True)
    per_gpu = estimate_vram(plan_request(shape, "lora", 2048, 1, settings), chosen, "fsdp")
    assert (plan["gpus"], plan["nodes"], plan["parallelism"]) == (chosen, 1, "fsdp")
    assert plan["total_gib"] == pytest.approx(per_gpu.total_gib) and lines[1].rstrip().endswith("per GPU")
    assert lines[2].strip().startswith(f"tier {shown}, ${chosen * 1.75:.2f}/h")  # N GPUs at $1.75 each
    assert plan["mfu"] == pytest.approx(plan["tokens_per_second"] * plan["flops_per_token"] / (chosen * 989e12))
    assert (
        plan["alternative"]["describe"] == "h100-80gb (NVIDIA H100 80GB SXM), spot" and plan["alternative"]["gpus"] == 1
    )
    assert lines[4].strip().startswith("or qlora: h100-80gb")


def test_plan_command_refuses_a_bad_gpu_count(llama7b_dir, capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--model-config", str(llama7b_dir), "--method", "lora", "--seq-len", "512", "--gpus", "0"])
    assert "--gpus takes a count >= 1 or 'auto', not '0'" in capsys.readouterr().err
