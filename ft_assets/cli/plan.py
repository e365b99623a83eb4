"""``ft-assets plan``: peak VRAM, the GPU tier and the estimate for a model, before any data or run exists.

With ``--mac TIER`` (and ``--mac-usd-per-hour``) your Mac is one more offering: the plan says whether the run fits on
it, and the cheapest rented plan beside it, in one call. It goes through the planner's one entry point, as
``training_plan`` does: its options become the training
settings they stand for (``TrainingConfig``: every other setting at its default, LoRA r=16 on every
projection, and on every expert of a mixture) and supervised rows of ``--seq-len`` tokens, ``--batch`` a forward, ``--tokens`` in all.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace
from pathlib import Path

from pydantic import ValidationError

from ft_assets.cli.output import CliError, print_json
from ft_assets.control.cost_model import CostModelError, load_cost_model
from ft_assets.control.gpu_plan import NoGpuFits, TrainingPlan, plan_training
from ft_assets.control.planner import ModelShape, PlanRequest
from ft_assets.training.config import Method, TrainingConfig
from ft_assets.training.steps import StepWork


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


def plan_request(shape: ModelShape, method: Method, seq_len: int, tokens: int, settings: TrainingConfig) -> PlanRequest:
    """The planner's request for a run without data yet: supervised rows of ``seq_len`` tokens packed full,
    ``settings.per_device_batch_size`` a forward, ``tokens`` trained tokens in all (what ``ft-assets plan`` prices)."""
    work = StepWork(seq_len, seq_len, settings.per_device_batch_size, tokens, False, 0.0, 0)
    return PlanRequest(shape, settings.model_copy(update={"method": method}), method, work)


def settings_of(args: argparse.Namespace) -> TrainingConfig:
    """The command line's options as the training settings they stand for (every other one at its default)."""
    gpus = args.gpus or 1
    parallelism = args.parallelism or ("fsdp" if gpus > 1 else "ddp")  # FSDP above one GPU unless asked otherwise
    return TrainingConfig(method=args.method, per_device_batch_size=args.batch, num_processes=gpus, parallelism=parallelism,
                          gradient_checkpointing=args.gradient_checkpointing, attn_implementation=args.attn_implementation)  # fmt: skip


def execute(args: argparse.Namespace, partial: dict) -> dict:
    """The plan for ``--model-config`` with the given method, shape and token budget."""
    path = Path(args.model_config)
    try:
        shape = ModelShape.from_config(read_model_config(path), name=(path if path.is_dir() else path.parent).name)
        cost_model = load_cost_model(args.cost_model or os.environ.get("FT_COST_MODEL") or None)
        if args.mac:
            cost_model = cost_model.with_mac(args.mac, args.mac_usd_per_hour)
        settings = settings_of(args).for_base(shape.experts)  # a mixture refuses qlora in one line
        request = plan_request(shape, args.method, args.seq_len, args.tokens, settings)
        plan = plan_training(request, cost_model, "experiment", None, fewest_gpus=args.gpus is None)
        alternative = qlora_alternative(request, cost_model, plan)
        mac, rented = mac_verdict(request, cost_model, plan, args.gpus is None)
    except NoGpuFits as exc:
        raise CliError(str(exc)) from exc
    except ValidationError as exc:  # an option out of range, in TrainingConfig's words
        raise CliError(f"plan: {'; '.join(error['msg'] for error in exc.errors())}") from exc
    except (CostModelError, ValueError) as exc:
        raise CliError(f"plan: {exc}") from exc
    counts = shape.counts()
    return {
        "model": shape.name,
        "params": counts["total"],
        "active_params": counts["active"],
        "experts": counts["experts"],
        "experts_per_token": counts["experts_per_token"],
        "describe_params": counts["describe"],
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
        "flops_per_token": plan.flops_per_token,
        **plan.throughput.as_dict(),
        "train_tokens": plan.total_tokens,
        "est_hours": plan.est_hours,
        "est_cost_usd": plan.est_cost_usd,
        "warnings": list(plan.warnings),
        "prices": plan.prices,
        "alternative": alternative,
        "mac": mac,
        "rented": rented,
    }


def mac_verdict(
    request: PlanRequest, cost_model, plan: TrainingPlan, fewest_gpus: bool
) -> tuple[dict | None, dict | None]:
    """With a Mac in the cost model: whether the run fits on it (its candidate in the plan) and the cheapest rented
    plan beside it (None when nothing rented fits)."""
    macs = [c for c in plan.candidates if cost_model.offering(c.name).unified_memory]
    if not macs:
        return None, None
    mac = macs[0]
    verdict = {"tier": mac.name, "gpu": mac.gpu, "fits": mac.fits, "needs_gib": mac.needs_gib, "usable_gib": mac.usable_gib,
               "tokens_per_second": mac.tokens_per_second, "hours": mac.hours, "usd_per_hour": mac.usd_per_hour,
               "cost_usd": mac.cost_usd}  # fmt: skip
    try:
        other = plan_training(request, cost_model.with_mac(None), "experiment", None, fewest_gpus=fewest_gpus)
    except NoGpuFits:
        return verdict, None
    return verdict, {"describe": other.describe(), "tier": other.tier, "gpus": other.gpus, "est_hours": other.est_hours,
                     "est_cost_usd": other.est_cost_usd, "vram_gib": other.vram.total_gib}  # fmt: skip


def qlora_alternative(request: PlanRequest, cost_model, plan: TrainingPlan) -> dict | None:
    """Where the run needs several GPUs for lora or full: the cheapest QLoRA plan (often one GPU), to compare."""
    if plan.gpus == 1 or request.method == "qlora" or request.shape.experts:  # a mixture: no qlora (for_base)
        return None
    qlora = replace(request, method="qlora", settings=request.settings.model_copy(update={"method": "qlora"}))
    try:
        other = plan_training(qlora, cost_model, "experiment", None, fewest_gpus=True)
    except NoGpuFits:
        return None
    return {"method": "qlora", "describe": other.describe(), "gpus": other.gpus, "tier": other.tier,
            "vram_gib": other.vram.total_gib, "est_cost_usd": other.est_cost_usd}  # fmt: skip


def report(args: argparse.Namespace, plan: dict) -> int:
    print(
        f"{plan['model']} ({plan['describe_params']}), {plan['method']} at {plan['seq_len']} x {plan['micro_batch']} "
        f"tokens, gradient checkpointing {'on' if plan['grad_checkpointing'] else 'off'}, attention {plan['attention']}\n"
        f"  needs {plan['breakdown']}{' per GPU' if plan['gpus'] > 1 else ''}\n"
        f"  tier {plan['describe']}, ${plan['usd_per_hour']:.2f}/h: "
        f"~{plan['tokens_per_second']:,.0f} tokens/s at MFU {plan['mfu']:.0%}, ${plan['usd_per_million_tokens']:.2f} per million tokens\n"
        f"  {plan['train_tokens']:,} tokens: ~{plan['est_hours']:.2f} h, ~${plan['est_cost_usd']:.2f}",
        flush=True,
    )
    if plan["alternative"]:
        other = plan["alternative"]
        print(
            f"  or qlora: {other['describe']}, {other['vram_gib']:.1f} GiB a GPU, ~${other['est_cost_usd']:.2f}",
            flush=True,
        )
    if plan["mac"]:
        mac, rented = plan["mac"], plan["rented"]
        verdict = (
            f"fits: needs ~{mac['needs_gib']:.1f} of {mac['usable_gib']:.1f} GiB usable, ~{mac['tokens_per_second']:,.0f} "
            f"tokens/s, ~{mac['hours']:.2f} h, ~${mac['cost_usd']:.2f}"
            if mac["fits"]
            else f"does not fit: needs ~{mac['needs_gib']:.1f} GiB, {mac['usable_gib']:.1f} GiB usable"
        )
        print(f"  your Mac, {mac['tier']} ({mac['gpu']}): {verdict}", flush=True)
        if rented:
            print(
                f"  rented instead: {rented['describe']}, ~{rented['est_hours']:.2f} h, ~${rented['est_cost_usd']:.2f}",
                flush=True,
            )
    for warning in plan["warnings"]:
        print(f"  warning: {warning}", flush=True)
    print(f"  prices: {plan['prices']}", flush=True)
    if args.json:
        print_json(plan)
    return 0
