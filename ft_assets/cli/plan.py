"""``ft-assets plan``: peak VRAM, the GPU tier and the estimate for a model, before any data or run exists.

``--config`` plans a run config as ``ft-assets run --config`` would train it, without its data or weights: the base
model (``base_model``'s ``source``), the row length (``tokenized_shards``' ``seq_len``) and the training settings
(``run_training_config``: method, batch, gradient checkpointing, GPUs, parallelism, the objective's settings), each
read by the class the run reads it with. The model's shape comes from ``--model-config``, else from the config.json
ft-assets ships for the examples' hub ids (``ft_assets.control.shipped_configs``); an option given on the command
line overrides the run config. Without a run config the options stand for the training settings alone (batch 1,
every other setting at its default, LoRA r=16 on every projection, and on every expert of a mixture).

The objective is what the data will decide (``ft_assets.objectives``): the plan takes the one whose settings the run
config sets (``dpo:``, ``grpo:``), else supervised fine-tuning, or ``--objective``; its rows are ``seq_len`` tokens
packed full (a GRPO prompt of ``seq_len`` tokens and its completions), ``--tokens`` trained tokens in all.

With ``--mac TIER`` (and ``--mac-usd-per-hour``) your Mac is one more offering: the plan says whether the run fits on
it, and the cheapest rented plan beside it, in one call. It goes through the planner's one entry point, as
``training_plan`` does.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace
from pathlib import Path

from pydantic import ValidationError

from ft_assets import objectives
from ft_assets.cli.output import CliError, print_json
from ft_assets.control.cost_model import CostModelError, load_cost_model
from ft_assets.control.gpu_plan import NoGpuFits, TrainingPlan, plan_training
from ft_assets.control.planner import ModelShape, PlanRequest
from ft_assets.control.shipped_configs import shipped_config, shipped_ids
from ft_assets.objectives.objective import Objective
from ft_assets.training.config import Method, TrainingConfig, validated


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


def plan_request(
    shape: ModelShape,
    method: Method,
    seq_len: int,
    tokens: int,
    settings: TrainingConfig,
    objective: Objective = objectives.SFT,
) -> PlanRequest:
    """The planner's request for a run of ``objective`` without data yet: rows of ``seq_len`` tokens packed full (GRPO:
    prompts of ``seq_len`` tokens), ``settings.per_device_batch_size`` a forward, ``tokens`` trained tokens in all (what
    ``ft-assets plan`` prices). The settings are resolved as a run on a GPU resolves them, so what the objective
    refuses (GRPO without reward functions or on FSDP, DPO and GRPO with method full) is refused here too."""
    settings = settings.model_copy(update={"method": method})
    rows = settings.rows_per_step()  # one optimizer step an epoch: the work of a step is what the plan needs
    resolved = settings.resolve(rows, True, objective)
    shards = {"seq_len": seq_len, "train_rows": rows, "train_tokens": rows * seq_len}
    work = replace(objective.step.work(settings, shards, resolved), tokens=tokens)
    return PlanRequest(shape, settings, method, work)


def read_run_config(path: str) -> tuple[str, int, TrainingConfig]:
    """The base model's source, the row length and the training settings of a run config, each read as the run reads
    it: ``base_model``'s and ``tokenized_shards``' config classes, and ``run_training_config``."""
    from ft_assets.cli.run_config import load_run_config  # Dagster's config classes: imported for --config only
    from ft_assets.data.config import TokenizeConfig
    from ft_assets.training.assets import BaseModelConfig
    from ft_assets.training.settings import run_training_config

    run_config = load_run_config(path)
    ops = run_config.get("ops") or {}
    try:
        source = BaseModelConfig(**((ops.get("base_model") or {}).get("config") or {})).source
        seq_len = TokenizeConfig(**((ops.get("tokenized_shards") or {}).get("config") or {})).seq_len
        return source, seq_len, run_training_config(run_config)
    except (ValidationError, ValueError) as exc:
        raise CliError(f"run config {path}: {exc}") from exc


def model_config_of(model_config: str | None, source: str | None, run_config: str | None) -> tuple[dict, str]:
    """The config.json to plan and the model's name: ``--model-config`` (a file, a model directory, or a hub id whose
    config ships with ft-assets), else the shipped config of the run config's base model."""
    if model_config:
        shipped = shipped_config(model_config)
        if shipped is not None and not Path(model_config).exists():
            return shipped, model_config
        path = Path(model_config)
        return read_model_config(path), (path if path.is_dir() else path.parent).name
    if source is None:
        raise CliError(
            "plan needs the model: --config RUN_CONFIG (its base_model) or --model-config PATH (a config.json)"
        )
    shipped = shipped_config(source)
    if shipped is None:
        raise CliError(
            f"plan: no config.json ships for {source!r}, the base model of {run_config} (shipped: "
            f"{', '.join(shipped_ids())}); pass its config with --model-config PATH (the model's config.json, or the "
            "directory holding it)"
        )
    return shipped, source


def settings_of(args: argparse.Namespace, configured: TrainingConfig | None) -> TrainingConfig:
    """The training settings the plan is for: the run config's, each option given on the command line over them;
    without a run config the options alone (batch 1, every other setting at its default)."""
    given = {"method": args.method, "per_device_batch_size": args.batch, "gradient_checkpointing": args.gradient_checkpointing,
             "attn_implementation": args.attn_implementation, "parallelism": args.parallelism}  # fmt: skip
    given = {name: value for name, value in given.items() if value is not None}
    fields = configured.model_dump(exclude_unset=True) if configured is not None else {"per_device_batch_size": 1}
    if isinstance(args.gpus, int):
        given.update(num_processes=args.gpus, num_nodes=1)
        if args.gpus > 1 and "parallelism" not in {**fields, **given}:
            given["parallelism"] = "fsdp"  # FSDP above one GPU unless asked otherwise
    return validated({**fields, **given})


def objective_of(args: argparse.Namespace, settings: TrainingConfig) -> Objective:
    """``--objective``, else the one whose settings the run config sets (the data will decide: a run config made for
    preference pairs sets ``dpo:``), else supervised fine-tuning."""
    if args.objective:
        return objectives.named(args.objective)
    chosen = [o for o in objectives.REGISTERED if o.settings is not None and o.name in settings.model_fields_set]
    if len(chosen) > 1:
        raise CliError(
            f"plan: the run config sets the settings of {' and '.join(o.name for o in chosen)}; its data trains one: "
            "name it with --objective"
        )
    return chosen[0] if chosen else objectives.SFT


def execute(args: argparse.Namespace, partial: dict) -> dict:
    """The plan of ``--config``'s run, or of ``--model-config`` with the given method, shape and token budget."""
    source, seq_len, configured = read_run_config(args.config) if args.config else (None, None, None)
    seq_len = args.seq_len or seq_len
    if seq_len is None:
        raise CliError("plan needs the row length: --seq-len N, or --config RUN_CONFIG (its tokenized_shards.seq_len)")
    config, name = model_config_of(args.model_config, source, args.config)
    fewest_gpus = args.gpus == "auto"
    try:
        shape = ModelShape.from_config(config, name=name)
        cost_model = load_cost_model(args.cost_model or os.environ.get("FT_COST_MODEL") or None)
        if args.mac:
            cost_model = cost_model.with_mac(args.mac, args.mac_usd_per_hour)
        settings = settings_of(args, configured).for_base(shape.experts)  # a mixture refuses qlora in one line
        objective = objective_of(args, settings)
        method = settings.resolved_method(True)  # an unset method: qlora, as on a CUDA GPU
        request = plan_request(shape, method, seq_len, args.tokens, settings, objective)
        plan = plan_training(request, cost_model, "experiment", None, fewest_gpus=fewest_gpus)
        alternative = qlora_alternative(request, cost_model, plan)
        mac, rented = mac_verdict(request, cost_model, plan, fewest_gpus)
    except NoGpuFits as exc:
        raise CliError(str(exc)) from exc
    except ValidationError as exc:  # an option out of range, in TrainingConfig's words
        raise CliError(f"plan: {'; '.join(error['msg'] for error in exc.errors())}") from exc
    except (CostModelError, ValueError) as exc:
        raise CliError(f"plan: {exc}") from exc
    counts = shape.counts()
    return {
        "model": shape.name,
        "objective": objective.name,
        "trained_tokens": args.tokens,
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
        f"{plan['model']} ({plan['describe_params']}), {plan['objective']} with {plan['method']} at {plan['seq_len']} x {plan['micro_batch']} "
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
