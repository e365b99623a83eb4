"""``ft-assets plan``: peak VRAM, the GPU tier and the estimate for a model, before any data or run exists."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from ft_assets.cli.output import CliError, print_json
from ft_assets.control.cost_model import CostModelError, load_cost_model
from ft_assets.control.gpu_plan import NoGpuFits, TrainingPlan, plan_training
from ft_assets.control.planner import ModelShape, flops_per_token, throughput


def read_model_config(path: Path) -> dict:
    """A transformers config.json, given as the file or the model directory holding it."""
    file = path / "config.json" if path.is_dir() else path
    try:
        config = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CliError(f"cannot read the model config {file}: {exc}") from exc
    if not isinstance(config, dict):
        raise CliError(f"{file} is not a config.json object")
    return config


def execute(args: argparse.Namespace, partial: dict) -> dict:
    """The plan for ``--model-config`` with the given method, shape and token budget."""
    path = Path(args.model_config)
    try:
        shape = ModelShape.from_config(read_model_config(path), name=(path if path.is_dir() else path.parent).name)
        cost_model = load_cost_model(args.cost_model or os.environ.get("FT_COST_MODEL") or None)
        plan = plan_training(
            shape, args.method, args.seq_len, args.batch, args.gradient_checkpointing, train_tokens=args.tokens,
            cost_model=cost_model, purpose="experiment", attention=args.attn_implementation, gpus=args.gpus,
            parallelism=args.parallelism,
        )  # fmt: skip
        alternative = qlora_alternative(args, shape, cost_model, plan)
    except NoGpuFits as exc:
        raise CliError(str(exc)) from exc
    except (CostModelError, ValueError) as exc:
        raise CliError(f"plan: {exc}") from exc
    flops = flops_per_token(shape, args.method, args.seq_len, args.gradient_checkpointing)
    speed = throughput(plan.tokens_per_second, flops, cost_model.offering(plan.tier), plan.usd_per_hour, plan.gpus)
    return {
        "model": shape.name,
        "params": shape.params,
        **plan.vram.as_dict(),  # method, seq_len, micro_batch, attention, the *_gib parts and total_gib
        "breakdown": plan.vram.breakdown(),
        "tier": plan.tier,
        "gpu": plan.gpu,
        "gpus": plan.gpus,
        "nodes": plan.nodes,
        "parallelism": plan.parallelism,
        "describe": plan.describe(),
        "rental_mode": plan.mode,
        "usd_per_hour": plan.usd_per_hour,
        "flops_per_token": flops,
        **speed.as_dict(),
        "train_tokens": plan.total_tokens,
        "est_hours": plan.est_hours,
        "est_cost_usd": plan.est_cost_usd,
        "warnings": list(plan.warnings),
        "alternative": alternative,
    }


def qlora_alternative(args: argparse.Namespace, shape: ModelShape, cost_model, plan: TrainingPlan) -> dict | None:
    """Where the run needs several GPUs for lora or full: the cheapest QLoRA plan (often one GPU), to compare."""
    if plan.gpus == 1 or args.method == "qlora":
        return None
    try:
        qlora = plan_training(
            shape, "qlora", args.seq_len, args.batch, args.gradient_checkpointing, train_tokens=args.tokens,
            cost_model=cost_model, purpose="experiment", attention=args.attn_implementation, gpus=None,
        )  # fmt: skip
    except NoGpuFits:
        return None
    return {"method": "qlora", "describe": qlora.describe(), "gpus": qlora.gpus, "tier": qlora.tier,
            "vram_gib": qlora.vram.total_gib, "est_cost_usd": qlora.est_cost_usd}  # fmt: skip


def report(args: argparse.Namespace, plan: dict) -> int:
    print(
        f"{plan['model']} ({plan['params'] / 1e9:.2f}B params), {plan['method']} at {plan['seq_len']} x {plan['micro_batch']} "
        f"tokens, gradient checkpointing {'on' if plan['grad_checkpointing'] else 'off'}, attention {plan['attention']}\n"
        f"  needs {plan['breakdown']}{' per GPU' if plan['gpus'] > 1 else ''}\n"
        f"  tier {plan['describe']}, ${plan['usd_per_hour']:.2f}/h: "
        f"~{plan['tokens_per_second']:,.0f} tokens/s at MFU {plan['mfu']:.0%}, ${plan['usd_per_million_tokens']:.2f} per million tokens\n"
        f"  {plan['train_tokens']:,} tokens: ~{plan['est_hours']:.2f} h, ~${plan['est_cost_usd']:.2f}",
        flush=True,
    )
    if plan["alternative"]:
        other = plan["alternative"]
        print(f"  or qlora: {other['describe']}, {other['vram_gib']:.1f} GiB a GPU, ~${other['est_cost_usd']:.2f}", flush=True)
    for warning in plan["warnings"]:
        print(f"  warning: {warning}", flush=True)
    if args.json:
        print_json(plan)
    return 0
