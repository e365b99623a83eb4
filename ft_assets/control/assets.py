"""Control-plane assets (group ``control``): the GPU plan before training, the cost after it.

- ``training_plan`` runs with the data plane (CPU), so the VRAM estimate, the chosen GPU tier, the
  rental mode and the estimated hours and dollars are in the UI before anyone launches training.
- ``training_cost`` prices what the training worker really did (wall time over every restart, time
  in optimizer steps, checkpoint storage, egress) in dollars per *effective training hour* (ETH).
- ``cost_report`` sums every priced run in the store, across dataset versions: estimate vs actual,
  ETH and idle share.

The worker declares what it is billed as with ``FT_GPU_TIER`` (an offering name of the cost model)
and ``FT_RENTAL_MODE`` (spot / on_demand), set in the gpu pool's launcher config. A worker that
declares nothing (a laptop, the CPU demo) is priced at the plan's tier, and the metadata says so.

$ per million tokens has two definitions, each under its own name in the metadata:
``usd_per_mtok_planned`` (training_plan, repeated by training_cost) is the tier's price over the planned
throughput; ``usd_per_mtok_actual`` (training_cost, cost_report) is the actual dollars over the tokens
trained, idle time, storage and egress included. On the CPU demo they differ by tens of percent.
"""

import json
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import dagster as dg
from pydantic import Field

from ft_assets import layout, objectives
from ft_assets.control.cost_model import CostModelError, load_cost_model
from ft_assets.control.cost_report import CostRecord, aggregate_cost_report
from ft_assets.control.eth import RunMeasurements, compute_eth
from ft_assets.control.gpu_plan import NoGpuFits, TrainingPlan, plan_training
from ft_assets.control.planner import ModelShape, Throughput, objective_cost, throughput
from ft_assets.manifests import read_manifest
from ft_assets.materialize import STORE_KIND, Materialization, figures, settings_table, table
from ft_assets.partitions import dataset_version
from ft_assets.plots import bar_chart
from ft_assets.refs import BaseModelStats, ShardStats, has_ref, read_ref, stats_of
from ft_assets.resources import ObjectStoreResource
from ft_assets.training.settings import TrainingSettings, training_config

if TYPE_CHECKING:  # names for annotations only: the training modules import torch
    from ft_assets.training.config import ResolvedTraining, TrainingConfig
    from ft_assets.training.steps import StepWork

CONTROL = dict(partitions_def=dataset_version, group_name="control", io_manager_key="refs")
class PlanConfig(TrainingSettings):
    """The training settings the plan is for (the same fields as lora_adapter's), and where the run rents."""

    purpose: str = Field(default="experiment", description="experiment (spot, resumes from checkpoints), validation (on-demand) or delivery (no GPU).")
    data_region: str = Field(default="", description="Region of the object store holding the shards (empty: $AWS_DEFAULT_REGION, else unknown).")
    cost_model_path: str = Field(default="", description="YAML file overriding the cost model's offerings and prices (empty: $FT_COST_MODEL, else the defaults).")


def _cost_model(path: str):
    try:
        return load_cost_model(path or os.environ.get("FT_COST_MODEL") or None)
    except CostModelError as exc:
        raise dg.Failure(str(exc)) from exc


@dataclass(frozen=True)
class PlannedRun:
    resolved: "ResolvedTraining"  # the settings with every default filled in
    work: "StepWork"  # what the objective computes: rows, trained tokens, the reference's forward, generation
    flops: float  # hardware FLOPs a trained token
    factor: float  # training-equivalent tokens a trained token (the objective's extra work)
    plan: TrainingPlan
    planned: Throughput | None  # the tier's tokens/s, MFU and $ per million tokens; None: delivery rents no GPU


def plan_run(
    training: "TrainingConfig", shape: ModelShape, shards: ShardStats, purpose: str, region: str | None, cost_model, cuda: bool
) -> PlannedRun:
    """The plan of a training run of these settings on these shards; ``NoGpuFits`` or a ValueError says why none."""
    objective = objectives.of_stats(shards)
    resolved = training.resolve(shards["train_packed_rows"], cuda, objective)
    work = objective.step.work(training, shards, resolved)
    flops, factor = objective_cost(
        shape, resolved.method, work.attention_len, training.gradient_checkpointing, work.reference_forward, work.generated_share,
        work.decode_batch, cost_model.mfu(resolved.method),
    )  # fmt: skip
    plan = plan_training(
        shape, resolved.method, work.seq_len, work.micro_batch, training.gradient_checkpointing, train_tokens=round(work.tokens * factor),
        cost_model=cost_model, purpose=purpose, data_region=region,
        lora_r=training.lora_r, lora_targets=training.target_modules, lora_dropout=training.lora_dropout,
        attention=training.attn_implementation, gpus=training.world_size, parallelism=training.parallelism,
    )  # fmt: skip
    planned = None
    if plan.tier is not None:  # the plan's tokens/s is of training-equivalent tokens: trained tokens go factor times slower
        planned = throughput(plan.tokens_per_second / factor, flops, cost_model.offering(plan.tier), plan.usd_per_hour, plan.gpus)
    return PlannedRun(resolved, work, flops, factor, plan, planned)


@dg.asset(**CONTROL, kinds={"python", "json", STORE_KIND}, tags={"ft/pool": "any"})
def training_plan(
    context: dg.AssetExecutionContext, config: PlanConfig, store: ObjectStoreResource, tokenized_shards: dict, base_model: dict
) -> dg.Output[dict]:
    """Peak VRAM, cheapest fitting GPU tier, rental mode, hours and dollars for this version's training run."""
    import torch

    training = training_config(config, "training_plan")
    base = stats_of(base_model, BaseModelStats)
    shape = ModelShape.from_config(base_model["model_config"], name=base["model_id"], params=base.get("parameters"))
    region = config.data_region or os.environ.get("AWS_DEFAULT_REGION") or None
    try:
        run = plan_run(training, shape, stats_of(tokenized_shards, ShardStats), config.purpose, region,
                       _cost_model(config.cost_model_path), torch.cuda.is_available())  # fmt: skip
    except NoGpuFits as exc:
        raise dg.Failure(str(exc), metadata={"vram": exc.vram.breakdown()}) from exc
    except ValueError as exc:
        raise dg.Failure(f"training_plan for {context.partition_key}: {exc}") from exc
    resolved, work, flops, factor, plan, planned = run.resolved, run.work, run.flops, run.factor, run.plan, run.planned
    for warning in plan.warnings:
        context.log.warning(warning)
    context.log.info(
        f"plan for {resolved.describe()} at {work.seq_len} tokens a row: {work.tokens:,} trained tokens x {factor:.2f} "
        f"(the objective's extra work) needs {plan.vram.total_gib:.1f} GiB{' per GPU' if plan.gpus > 1 else ''} → {plan.describe()}, "
        f"~{plan.est_hours:.2f} h, ~${plan.est_cost_usd:.2f}"
    )
    with Materialization(context, store, "plan") as m:
        (m.out / "plan.json").write_text(json.dumps(plan.as_dict(), indent=2, default=str))
        stats = {
            "gpu_tier": plan.tier, "rental_mode": plan.mode, "method": plan.method, "vram_gib": plan.vram.total_gib,
            "est_hours": plan.est_hours, "estimated_cost_usd": plan.est_cost_usd, "usd_per_hour": plan.usd_per_hour,
            "total_tokens": plan.total_tokens, "trained_tokens": work.tokens, "work_factor": factor, "warnings": list(plan.warnings),
            "data_region": region,
            "resolved": resolved.as_dict(), "training_config": training.model_dump(), "flops_per_token": flops,
            "throughput": planned.as_dict() if planned else None,
            "gpus": plan.gpus, "nodes": plan.nodes, "parallelism": plan.parallelism,
        }  # fmt: skip
        ref = m.publish(layout.of(m.partition).control("plan"), stats, {"tokenized_shards": tokenized_shards, "base_model": base_model})
    return m.output(
        ref,
        gpu_tier=str(plan.tier),
        rental_mode=plan.mode,
        **figures(
            estimated_cost_usd=plan.est_cost_usd, estimated_hours=plan.est_hours, vram_gib=plan.vram.total_gib,
            trained_tokens=work.tokens, tokens_per_second=planned.tokens_per_second if planned else None,
            mfu=planned.mfu if planned else None, usd_per_mtok_planned=planned.usd_per_million_tokens if planned else None,
        ),  # fmt: skip
        vram_breakdown=dg.MetadataValue.md(f"needs {plan.vram.breakdown()}"),
        planned_run=settings_table(resolved.as_dict()),
        candidates=table(plan.candidate_rows()),
        warnings=dg.MetadataValue.md("\n".join(f"- {w}" for w in plan.warnings) or "none"),
    )


def mfu_metadata(mfu: float | None, device: str) -> dict:
    """The measured MFU, or why there is none: a device whose bf16 peak the cost model does not know (a CPU).
    ``device`` is a TrainingResult's ('cpu x1', 'cuda x4')."""
    if mfu is not None:
        return figures(mfu=mfu)
    return {"mfu": f"n/a: trained on {device.split()[0]}, whose peak FLOP/s the cost model does not list"}


class CostConfig(dg.Config):
    checkpoint_retention_days: float = Field(default=7.0, description="How long checkpoints stay in the store (storage is billed for this long).")
    cost_model_path: str = Field(default="", description="YAML file overriding the cost model (empty: $FT_COST_MODEL, else the defaults).")


def billed_tier(plan: dict) -> tuple[str, str]:
    """The (tier, rental mode) the training worker is billed as: what it declares, else the plan's."""
    tier = os.environ.get("FT_GPU_TIER") or plan["stats"]["gpu_tier"]
    return tier, os.environ.get("FT_RENTAL_MODE") or plan["stats"]["rental_mode"]


def measured_throughput(adapter: dict, plan: dict, cost_model) -> Throughput:
    """The training run's tokens/s (its last attempt's step time), MFU on the tier's bf16 peak (None off
    CUDA) and the tier's price per million tokens at that speed."""
    tier, mode = billed_tier(plan)
    offering = cost_model.offering(tier) if tier else None
    device = adapter["stats"]["device"]
    on_gpu, gpus = device.startswith("cuda"), processes(device)
    price = offering.usd_per_hour(mode) * gpus if offering and offering.usd_per_hour(mode) is not None else None
    return throughput(adapter["stats"]["tokens_per_second"], plan["stats"]["flops_per_token"], offering if on_gpu else None, price, gpus)


def measurements(adapter: dict, plan: dict, store, retention_days: float) -> tuple[RunMeasurements, list[str]]:
    """What the training plane measured, as the cost model's input; plus notes on how it was priced."""
    stats, notes = adapter["stats"], []
    tier, mode = billed_tier(plan)
    if not os.environ.get("FT_GPU_TIER"):
        notes.append(f"the worker declared no FT_GPU_TIER; its measured time is priced as the planned tier {tier} ({mode})")
    attempts = stats.get("restarts") or []
    wall = stats["wall_seconds"] + sum(a.get("wall_seconds", 0.0) for a in attempts)
    steps = stats["step_seconds"] + sum(a.get("step_seconds", 0.0) for a in attempts)
    checkpoint_bytes = 0
    for uri in stats["checkpoints"]:
        step = int(layout.CHECKPOINT_RE.match(uri.rstrip("/").rsplit("/", 1)[-1]).group(1))
        checkpoint_bytes += read_manifest(store, layout.checkpoint(adapter["run_prefix"], step)).total_bytes
    cross_region = any("region" in w for w in plan["stats"]["warnings"])
    egress = adapter["upstream_bytes"] if cross_region else 0
    measured = RunMeasurements(
        gpu_tier=tier, rental_mode=mode, wall_seconds=wall, step_seconds=min(steps, wall), restarts=len(attempts),
        tokens_trained=stats["tokens_seen"], checkpoint_bytes=checkpoint_bytes,
        checkpoint_retention_hours=retention_days * 24, egress_bytes=egress, gpu_utilization=stats.get("gpu_utilization"),
        gpus=processes(stats["device"]) if stats["device"].startswith("cuda") else 1,
    )  # fmt: skip
    return measured, notes


def processes(device: str) -> int:
    """The training processes (one GPU each, over all nodes) of a TrainingResult's device: 'cuda x4' -> 4."""
    return int(device.rsplit("x", 1)[-1])


@dg.asset(**CONTROL, kinds={"python", "json", STORE_KIND}, tags={"ft/pool": "cpu"})
def training_cost(
    context: dg.AssetExecutionContext, config: CostConfig, store: ObjectStoreResource, lora_adapter: dict, training_plan: dict
) -> dg.Output[dict]:
    """Actual cost of the training run and its price per effective training hour (ETH)."""
    with Materialization(context, store, "cost") as m:
        measured, notes = measurements(lora_adapter, training_plan, m.store, config.checkpoint_retention_days)
        for note in notes:
            context.log.info(note)
        cost_model = _cost_model(config.cost_model_path)
        try:
            report = compute_eth(measured, cost_model=cost_model)
            speed = measured_throughput(lora_adapter, training_plan, cost_model)
        except (KeyError, ValueError) as exc:
            raise dg.Failure(f"training_cost: {exc}") from exc
        stats = {
            **report.as_dict(),
            "throughput": speed.as_dict(),
            "estimated_cost_usd": training_plan["stats"]["estimated_cost_usd"],
            "estimated_hours": training_plan["stats"]["est_hours"],
            "run_id": lora_adapter["stats"]["run_id"],
            "notes": notes,
        }
        eth = "n/a" if report.eth_usd_per_hour is None else f"${report.eth_usd_per_hour:.2f}"
        context.log.info(f"actual ${report.total_usd:.4f} (estimate ${stats['estimated_cost_usd']:.4f}); ETH {eth} per effective hour")
        (m.out / "cost.json").write_text(json.dumps({"measured": measured.model_dump(), "report": stats}, indent=2))
        ref = m.publish(
            layout.of(m.partition).control("cost", stats["run_id"]), stats, {"lora_adapter": lora_adapter, "training_plan": training_plan}
        )
    breakdown = [
        {"item": f"compute ({report.wall_hours:.3f} h × ${report.usd_per_hour:.2f}/h, {report.gpu_tier} {report.rental_mode})", "usd": round(report.compute_usd, 4)},
        {"item": "checkpoint storage", "usd": round(report.storage_usd, 6)},
        {"item": "egress", "usd": round(report.egress_usd, 6)},
        {"item": "total", "usd": round(report.total_usd, 4)},
    ]  # fmt: skip
    chart = bar_chart({"cost": {"compute": report.compute_usd, "storage": report.storage_usd, "egress": report.egress_usd}}, "training run cost, USD")
    planned = training_plan["stats"]["throughput"] or {}
    return m.output(
        ref,
        **figures(
            actual_cost_usd=report.total_usd, estimated_cost_usd=stats["estimated_cost_usd"], usd_per_mtok_actual=report.usd_per_million_tokens,
            usd_per_mtok_planned=planned.get("usd_per_million_tokens"), eth_usd_per_hour=report.eth_usd_per_hour,
            effective_hours=report.effective_hours, idle_share=report.idle_share, tokens_per_second=speed.tokens_per_second,
            restarts=report.restarts,
        ),  # fmt: skip
        **mfu_metadata(speed.mfu, lora_adapter["stats"]["device"]),
        chart=dg.MetadataValue.md(chart),
        breakdown=table(breakdown),
        utilization=dg.MetadataValue.md(f"{report.utilization:.1%} ({report.utilization_source})"),
    )


def _eth_report(stats: dict):
    from ft_assets.control.eth import EthReport

    fields = {k: stats[k] for k in EthReport.__dataclass_fields__}
    return EthReport(**fields)


@dg.asset(**CONTROL, kinds={"python", "json", STORE_KIND}, tags={"ft/pool": "cpu"}, deps=["training_cost"])
def cost_report(context: dg.AssetExecutionContext, store: ObjectStoreResource) -> dg.Output[dict]:
    """Every priced training run in the store, by dataset version: estimate vs actual, ETH, idle share."""
    with Materialization(context, store, "cost-report") as m:
        records = []
        for partition in layout.partitions_with_runs(m.store):
            if has_ref(m.store, partition, "training_cost"):
                stats = read_ref(m.store, partition, "training_cost")["stats"]
                records.append(CostRecord(partition, stats["run_id"], _eth_report(stats), stats["estimated_cost_usd"], stats["estimated_hours"]))
        report = aggregate_cost_report(records)
        totals = report.total.as_dict()
        (m.out / "cost_report.json").write_text(json.dumps({"rows": [r.as_dict() for r in report.rows], "total": totals}, indent=2, default=str))
        ref = m.publish(layout.of(m.partition).control("cost_report"), {"runs": len(records), "total": totals, "generated_at": time.time()})
    return m.output(
        ref,
        runs=len(records),
        **figures(actual_usd=report.total.actual_usd, estimated_usd=report.total.estimated_usd, usd_per_mtok_actual=report.total.usd_per_mtok_actual),
        chart=dg.MetadataValue.md(
            bar_chart({r.dataset_version: {"estimate": r.estimated_usd or 0.0, "actual": r.actual_usd} for r in report.rows}, "estimate vs actual, USD")
        ),
        report=table(report.table_rows()),
    )
