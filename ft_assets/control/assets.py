"""Control-plane assets: the GPU plan of a training run, the cost after it.

- ``training_plan`` (group ``training``) plans the run it is part of: the training plane's job
  materializes it first, then ``lora_adapter``, and it reads the settings of that run's lora_adapter
  (``run_training_config``), so the VRAM estimate, GPU tier and count, rental mode, hours and dollars
  are those of the run that trains, however it was started (launchpad, sensor, schedule, CLI); it
  takes milliseconds on the worker. ``ft-assets run`` makes the same plan (``plan_run``) before it
  submits the training plane and refuses a run no GPU fits before anything is rented. Materialized
  alone it is a preview of lora_adapter's defaults, and its metadata says so (``planned_for``);
  lora_adapter refuses to train against a plan made for other settings.
- ``training_cost`` prices what the training worker really did (wall time over every restart, time
  in optimizer steps, checkpoint storage, egress) in dollars per *effective training hour* (ETH).
- ``cost_report`` sums every priced run in the store, across dataset versions: estimate vs actual,
  ETH and idle share.

The worker declares what it is billed as with ``FT_GPU_TIER`` (an offering name of the cost model)
and ``FT_RENTAL_MODE`` (spot / on_demand / slurm), set in the gpu pool's launcher config; lora_adapter
records them with the adapter (``billed_as``; a Slurm job is ``slurm`` unless it says otherwise). A
worker that declares nothing (a laptop, the CPU demo) is priced at the plan's tier, and the metadata says so.

$ per million tokens has two definitions, each under its own name in the metadata:
``usd_per_mtok_planned`` (training_plan, repeated by training_cost) is the tier's price over the planned
throughput; ``usd_per_mtok_actual`` (training_cost, cost_report) is the actual dollars over the tokens
trained, idle time, storage and egress included. On the CPU demo they differ by tens of percent.
"""

import json
import os
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import dagster as dg
from pydantic import Field

from ft_assets import layout, objectives
from ft_assets.control.cost_model import CostModelError, load_cost_model
from ft_assets.control.cost_report import CostRecord, aggregate_cost_report
from ft_assets.control.eth import RunMeasurements, compute_eth
from ft_assets.control.gpu_plan import NoGpuFits, TrainingPlan, plan_training
from ft_assets.control.planner import ImageLoad, ModelShape, PlanRequest, Throughput, throughput
from ft_assets.control.sky_bill import adapter_bill
from ft_assets.manifests import read_manifest
from ft_assets.materialize import STORE_KIND, Materialization, figures, rounded, settings_table, table
from ft_assets.partitions import dataset_version
from ft_assets.plots import bar_chart
from ft_assets.targets import TARGET_TAG, TargetError, parse_target, processes_on, worker_has_cuda
from ft_assets.refs import BaseModelStats, ShardStats, has_ref, read_ref, stats_of
from ft_assets.resources import ObjectStoreResource
from ft_assets.training.settings import TRAINING_ASSET, run_training_config

if TYPE_CHECKING:  # names for annotations only: the training modules import torch
    from ft_assets.training.config import ResolvedTraining, TrainingConfig
    from ft_assets.training.steps import StepWork

CONTROL = dict(partitions_def=dataset_version, group_name="control", io_manager_key="refs")


class PlanConfig(dg.Config):
    """The plan's own settings: why and where the run rents. The training settings it plans for are lora_adapter's."""

    purpose: str = Field(
        default="experiment",
        description="experiment (spot, resumes from checkpoints), validation (on-demand) or delivery (no GPU).",
    )
    data_region: str = Field(
        default="",
        description="Region of the object store holding the shards (empty: $AWS_DEFAULT_REGION, else unknown).",
    )
    cost_model_path: str = Field(
        default="",
        description="YAML file overriding the cost model's offerings and prices (empty: $FT_COST_MODEL, else the defaults).",
    )


@dataclass(frozen=True)
class PlannedRun:
    """The plan of one training run, with what it was made from."""

    training: "TrainingConfig"  # the settings planned for (lora_adapter's)
    resolved: "ResolvedTraining"  # the settings with every default filled in
    work: "StepWork"  # what the objective computes: rows, trained tokens, the reference's forward, generation
    plan: TrainingPlan
    region: str | None  # where the shards are stored (None: unknown)
    accelerator: str = ""  # SkyPilot's name of the plan's card (the offering's ``accelerator``; "" for none)
    params: dict = field(default_factory=dict)  # the base's total and active parameters (a mixture's differ)

    def stats(self, planned_for: str) -> dict:
        """What training_plan publishes (``refs.PlanStats``); ``planned_for`` says whose settings these are."""
        plan = self.plan
        return {
            "gpu_tier": plan.tier, "rental_mode": plan.mode, "accelerator": self.accelerator, "method": plan.method, "vram_gib": plan.vram.total_gib,
            "est_hours": plan.est_hours, "estimated_cost_usd": plan.est_cost_usd, "usd_per_hour": plan.usd_per_hour,
            "total_tokens": plan.total_tokens, "trained_tokens": self.work.tokens, "work_factor": plan.work_factor,
            "warnings": list(plan.warnings), "data_region": self.region,
            "resolved": self.resolved.as_dict(), "training_config": self.training.model_dump(),
            "planned_for": planned_for, "flops_per_token": plan.flops_per_token,
            "throughput": plan.throughput.as_dict() if plan.throughput else None,
            "gpus": plan.gpus, "nodes": plan.nodes, "parallelism": plan.parallelism,
            "prices": plan.prices, "prices_fetched_at": plan.prices_fetched_at, "params": self.params,
        }  # fmt: skip


def plan_run(
    training: "TrainingConfig", config: PlanConfig, tokenized_shards: dict, base_model: dict, cuda: bool,
    target: str | None = None,
) -> PlannedRun:  # fmt: skip
    """The plan of a training run of these settings on these shards and this base model (their references), on the
    run's GPU ``target`` (its card and price where the target names one: ``Target.pinned_gpu``).

    training_plan's, and ``ft-assets run``'s before it submits the training plane. Raises ``NoGpuFits`` when no
    offering fits, a ValueError (a ``CostModelError`` and a ``TargetError`` too) for settings the objective, the
    planner or the target refuse.
    """
    base = stats_of(base_model, BaseModelStats)
    shape = ModelShape.from_config(base_model["model_config"], name=base["model_id"], params=base.get("parameters"))
    training = training.for_base(shape.experts)  # a mixture: lora unless set, qlora refused
    where = parse_target(target)
    training = processes_on(where, training)  # the target's gpus=N: N processes, N cards planned and billed
    shards = stats_of(tokenized_shards, ShardStats)
    region = config.data_region or os.environ.get("AWS_DEFAULT_REGION") or None
    cost_model = load_cost_model(config.cost_model_path or os.environ.get("FT_COST_MODEL") or None)
    objective = objectives.of_stats(shards)
    resolved = training.resolve(shards["train_packed_rows"], cuda, objective)
    work = objective.step.work(training, shards, resolved)
    request = PlanRequest(shape, training, resolved.method, work, images=ImageLoad.of_shards(shards))
    try:
        pinned = where.pinned_gpu if where else None
        if where and pinned is None:  # a host that says which card it has (nvidia-smi over ssh)
            card = where.card()
            pinned = (cost_model.offering_for_card(*card).name, where.rental) if card else None
        plan = plan_training(request, cost_model, config.purpose, region, pinned=pinned)
    except KeyError as exc:  # the target's gpu= names no offering, or its card is none
        raise ValueError(f"GPU target {target}: {exc.args[0]}") from None
    except TargetError as exc:  # the host did not answer which card it has
        raise TargetError(
            f"{exc}; the plan asks the host's nvidia-smi which card it has: name it with gpu=<offering> to plan "
            "without reaching the host"
        ) from None
    accelerator = cost_model.offering(plan.tier).accelerator if plan.tier else ""
    return PlannedRun(training, resolved, work, plan, region, accelerator, shape.counts())


def planned_for(selected: Collection[dg.AssetKey], run_id: str) -> str:
    """Whose settings training_plan plans in run ``run_id`` of the ``selected`` assets: those of the lora_adapter the
    run materializes, or (training_plan alone, a preview) lora_adapter's defaults."""
    if dg.AssetKey(TRAINING_ASSET) in selected:
        return f"{TRAINING_ASSET} of run {run_id}"
    return (
        f"{TRAINING_ASSET}'s defaults: a preview ({TRAINING_ASSET} is not in run {run_id}); the training_plane job "
        f"plans the settings its {TRAINING_ASSET} trains with"
    )


@dg.asset(
    partitions_def=dataset_version,
    group_name="training",  # it runs first in the training plane's run, which it plans
    io_manager_key="refs",
    kinds={"python", "json", STORE_KIND},
    tags={"ft/pool": "any"},
)
def training_plan(
    context: dg.AssetExecutionContext,
    config: PlanConfig,
    store: ObjectStoreResource,
    tokenized_shards: dict,
    base_model: dict,
) -> dg.Output[dict]:
    """Peak VRAM, cheapest fitting GPU tier, rental mode, hours and dollars of the training run it is part of: the
    settings of that run's lora_adapter (lora_adapter's defaults when materialized alone)."""
    import torch

    whose = planned_for(context.job_def.asset_layer.selected_asset_keys, context.run.run_id)
    try:
        training = run_training_config(context.run.run_config)
        target = context.run.tags.get(TARGET_TAG)
        cuda = worker_has_cuda(target, torch.cuda.is_available())
        run = plan_run(training, config, tokenized_shards, base_model, cuda, target)
    except NoGpuFits as exc:
        raise dg.Failure(str(exc), metadata={"vram": exc.vram.breakdown()}) from exc
    except ValueError as exc:
        raise dg.Failure(f"training_plan for {context.partition_key}: {exc}") from exc
    resolved, work, plan, planned = run.resolved, run.work, run.plan, run.plan.throughput
    for warning in plan.warnings:
        context.log.warning(warning)
    context.log.info(
        f"plan for {resolved.describe()} of {run.params['describe']} ({whose}) at {work.seq_len} tokens a row: {work.tokens:,} trained tokens x "
        f"{plan.work_factor:.2f} (the objective's extra work) needs {plan.vram.total_gib:.1f} GiB"
        f"{' per GPU' if plan.gpus > 1 else ''} → {plan.describe()}, ~{plan.est_hours:.2f} h, ~${plan.est_cost_usd:.2f}"
    )
    with Materialization(context, store, "plan") as m:
        (m.out / "plan.json").write_text(json.dumps(plan.as_dict(), indent=2, default=str))
        ref = m.publish(
            layout.of(m.partition).control("plan"),
            run.stats(whose),
            {"tokenized_shards": tokenized_shards, "base_model": base_model},
        )
    return m.output(
        ref,
        gpu_tier=str(plan.tier),
        rental_mode=plan.mode,
        planned_for=whose,
        parameters=run.params["describe"],  # a mixture: total (its memory) and active (its FLOPs)
        prices=plan.prices,  # the shipped list, or SkyPilot's catalog and how old it is
        **figures(
            estimated_cost_usd=plan.est_cost_usd,
            estimated_hours=plan.est_hours,
            vram_gib=plan.vram.total_gib,
            gpus=plan.gpus,
            trained_tokens=work.tokens,
            tokens_per_second=planned.tokens_per_second if planned else None,
            mfu=planned.mfu if planned else None,
            usd_per_mtok_planned=planned.usd_per_million_tokens if planned else None,
        ),  # fmt: skip
        vram=vram_table(plan.vram),
        planned_run=settings_table(resolved.as_dict()),
        training_settings=settings_table(changed_settings(training)),
        candidates=candidates_table(plan.candidate_rows()),
        warnings=dg.MetadataValue.md("\n".join(f"- {w}" for w in plan.warnings) or "none"),
    )


# The candidates' columns as the page heads them: short names with spaces, so a header wraps instead of widening the table
# past the panel (which clips it: 11 columns of snake_case ran ~250 px off a 1800 px wide window).
CANDIDATE_COLUMNS = {"tier": "tier", "gpus": "GPUs", "region": "region", "usable_gib": "usable GiB",
                     "usd_per_hour": "$ per h", "tokens_per_second": "tokens per s", "hours": "hours", "cost_usd": "$",
                     "note": "note"}  # fmt: skip


def candidates_table(rows: list[dict]) -> dg.MetadataValue:
    """The GPU offerings the plan priced (``TrainingPlan.candidate_rows``), headed to fit the page; the GPU's model is
    in the tier's name, and ``fits`` in the note."""
    return table([{shown: row[key] for key, shown in CANDIDATE_COLUMNS.items()} for row in rows])


def vram_table(vram) -> dg.MetadataValue:
    """The VRAM estimate by part (``planner.VramEstimate``), one row each and the total: a table wraps on the page where
    the one-line breakdown ran past the panel."""
    rows = [{"part": part, "GiB": round(getattr(vram, f"{part}_gib"), 1)} for part in vram.PARTS]
    return table([row for row in rows if row["GiB"] >= 0.05] + [{"part": "total", "GiB": round(vram.total_gib, 1)}])


def changed_settings(training: "TrainingConfig") -> dict:
    """The training settings that differ from their defaults (what the plan was made for, in the user's words)."""
    return training.model_dump(exclude_defaults=True) or {"every setting": "its default"}


def plan_of_the_run(lora_adapter: dict, training_plan: dict) -> str | None:
    """Why ``training_plan`` (the partition's newest) is not the plan lora_adapter trained with; None when it is.

    training_cost prices the run against the plan made for it: a plan made since (a preview, other settings)
    would compare its estimate with another run's."""
    used = (lora_adapter.get("upstream") or {}).get("training_plan")
    if used is None:
        return (
            f"lora_adapter of {lora_adapter['partition']} (run {lora_adapter['stats']['run_id']}) records no training "
            "plan (written by an older ft-assets): run the training_plane job again"
        )
    if used["digest"] != training_plan["digest"]:
        return (
            f"the newest training_plan of {training_plan['partition']} ({training_plan['stats'].get('planned_for')}) is "
            f"not the plan lora_adapter run {lora_adapter['stats']['run_id']} trained with ({used['uri']}, digest "
            f"{used['digest'][:12]}): run the training_plane job again, so the run and its plan are made together"
        )
    return None


def _cost_model(path: str):
    try:
        return load_cost_model(path or os.environ.get("FT_COST_MODEL") or None)
    except CostModelError as exc:
        raise dg.Failure(str(exc)) from exc


def mfu_metadata(mfu: float | None, device: str) -> dict:
    """The measured MFU, or why there is none: a device whose bf16 peak the cost model does not know (a CPU).
    ``device`` is a TrainingResult's ('cpu x1', 'cuda x4')."""
    if mfu is not None:
        return figures(mfu=mfu)
    return {"mfu": f"n/a: trained on {device.split()[0]}, whose peak FLOP/s the cost model does not list"}


class CostConfig(dg.Config):
    checkpoint_retention_days: float = Field(
        default=7.0, description="How long checkpoints stay in the store (storage is billed for this long)."
    )
    cost_model_path: str = Field(
        default="", description="YAML file overriding the cost model (empty: $FT_COST_MODEL, else the defaults)."
    )


def billed_tier(plan: dict, adapter: dict) -> tuple[str, str]:
    """The (tier, rental mode) the training worker is billed as: what it declared (recorded with the adapter: its
    FT_GPU_TIER / FT_RENTAL_MODE, ``slurm`` in a Slurm job), else this process's variables, else the plan's."""
    declared = adapter["stats"].get("billed_as") or {}
    tier = declared.get("FT_GPU_TIER") or os.environ.get("FT_GPU_TIER") or plan["stats"]["gpu_tier"]
    return tier, declared.get("FT_RENTAL_MODE") or os.environ.get("FT_RENTAL_MODE") or plan["stats"]["rental_mode"]


def measured_throughput(adapter: dict, plan: dict, cost_model) -> Throughput:
    """The training run's tokens/s (its last attempt's step time), MFU on the tier's bf16 peak (None off
    CUDA) and the tier's price per million tokens at that speed."""
    tier, mode = billed_tier(plan, adapter)
    offering = cost_model.offering(tier) if tier else None
    device = adapter["stats"]["device"]
    on_gpu, gpus = device.startswith("cuda"), processes(device)
    price = offering.usd_per_hour(mode) * gpus if offering and offering.usd_per_hour(mode) is not None else None
    return throughput(
        adapter["stats"]["tokens_per_second"],
        plan["stats"]["flops_per_token"],
        offering if on_gpu else None,
        price,
        gpus,
    )


def measurements(
    adapter: dict, plan: dict, store, retention_days: float, bill: dict | None = None
) -> tuple[RunMeasurements, list[str]]:
    """What the training plane measured, as the cost model's input; plus notes on how it was priced. ``bill``: the
    SkyPilot pool's (``skypilot.adapter_bill``): every attempt's paid time at the price where it ran, and the egress of
    each attempt outside the data's region (each one downloads the base model and shards again)."""
    stats, notes = adapter["stats"], []
    tier, mode = billed_tier(plan, adapter)
    if not ((stats.get("billed_as") or {}).get("FT_GPU_TIER") or os.environ.get("FT_GPU_TIER")):
        notes.append(
            f"the worker declared no FT_GPU_TIER; its measured time is priced as the planned tier {tier} ({mode})"
        )
    attempts = stats.get("restarts") or []
    wall = stats["wall_seconds"] + sum(a.get("wall_seconds", 0.0) for a in attempts)
    steps = stats["step_seconds"] + sum(a.get("step_seconds", 0.0) for a in attempts)
    checkpoint_bytes = 0
    for uri in stats["checkpoints"]:
        step = int(layout.CHECKPOINT_RE.match(uri.rstrip("/").rsplit("/", 1)[-1]).group(1))
        checkpoint_bytes += read_manifest(store, layout.checkpoint(adapter["run_prefix"], step)).total_bytes
    cross_region = any("region" in w for w in plan["stats"]["warnings"])
    egress = adapter["upstream_bytes"] if cross_region else 0
    restarts = len(attempts)
    on_target = stats.get("attempts") or []  # a GPU target's worker attempts (ft_assets.targets.session)
    if on_target:
        wall = sum(a.get("paid_seconds", a["seconds"]) for a in on_target)
        restarts = sum(a.get("starts", 1) for a in on_target) - 1
        notes.append(
            f"billed from the GPU target's {len(on_target)} attempt(s), {restarts} restart(s) in all: each from its "
            "worker's first start to its end, a killed attempt's time after its last checkpoint included"
        )
    if bill is not None:
        wall, restarts = bill["paid_seconds"], bill["recoveries"]
        egress = adapter["upstream_bytes"] * bill["attempts_outside_data_region"]
        notes.append(bill["note"])
    measured = RunMeasurements(
        gpu_tier=tier, rental_mode=mode, wall_seconds=wall, step_seconds=min(steps, wall), restarts=restarts,
        tokens_trained=stats["tokens_seen"], checkpoint_bytes=checkpoint_bytes,
        checkpoint_retention_hours=retention_days * 24, egress_bytes=egress, gpu_utilization=stats.get("gpu_utilization"),
        gpus=processes(stats["device"]) if stats["device"].startswith("cuda") else 1,
        billed_compute_usd=bill["compute_usd"] if bill else None,
    )  # fmt: skip
    return measured, notes


def processes(device: str) -> int:
    """The training processes (one GPU each, over all nodes) of a TrainingResult's device: 'cuda x4' -> 4."""
    return int(device.rsplit("x", 1)[-1])


@dg.asset(**CONTROL, kinds={"python", "json", STORE_KIND}, tags={"ft/pool": "cpu"})
def training_cost(
    context: dg.AssetExecutionContext,
    config: CostConfig,
    store: ObjectStoreResource,
    lora_adapter: dict,
    training_plan: dict,
) -> dg.Output[dict]:
    """Actual cost of the training run and its price per effective training hour (ETH)."""
    mismatch = plan_of_the_run(lora_adapter, training_plan)
    if mismatch:
        raise dg.Failure(f"training_cost for {context.partition_key}: {mismatch}")
    with Materialization(context, store, "cost") as m:
        bill = adapter_bill(context.instance, context.partition_key, training_plan["stats"])
        measured, notes = measurements(lora_adapter, training_plan, m.store, config.checkpoint_retention_days, bill)
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
            "attempts": bill["attempts"] if bill else [],  # the SkyPilot pool's: where each ran, its hours and price
        }
        eth = "n/a" if report.eth_usd_per_hour is None else f"${report.eth_usd_per_hour:.2f}"
        context.log.info(
            f"actual ${report.total_usd:.4f} (estimate ${stats['estimated_cost_usd']:.4f}); ETH {eth} per effective hour"
        )
        (m.out / "cost.json").write_text(json.dumps({"measured": measured.model_dump(), "report": stats}, indent=2))
        ref = m.publish(
            layout.of(m.partition).control("cost", stats["run_id"]),
            stats,
            {"lora_adapter": lora_adapter, "training_plan": training_plan},
        )
    device = lora_adapter["stats"]["device"]
    on = f"{device.split()[0]} as if on " if not device.startswith("cuda") else ""
    breakdown = [
        {"item": f"compute ({report.wall_hours:.3f} h × ${report.usd_per_hour:.2f}/h, {on}{report.gpu_tier} {report.rental_mode})", "usd": rounded(report.compute_usd)},
        *attempt_rows(stats["attempts"]),
        {"item": "checkpoint storage", "usd": rounded(report.storage_usd)},
        {"item": "egress", "usd": rounded(report.egress_usd)},
        {"item": "total", "usd": rounded(report.total_usd)},
    ]  # fmt: skip
    chart = bar_chart(
        {"cost": {"compute": report.compute_usd, "storage": report.storage_usd, "egress": report.egress_usd}},
        "training run cost, USD",
    )
    planned = training_plan["stats"]["throughput"] or {}
    return m.output(
        ref,
        pricing=pricing_line(
            device, report.gpu_tier, report.rental_mode, report.usd_per_hour, bool(os.environ.get("FT_GPU_TIER"))
        ),
        **figures(
            actual_cost_usd=report.total_usd,
            estimated_cost_usd=stats["estimated_cost_usd"],
            usd_per_mtok_actual=report.usd_per_million_tokens,
            usd_per_mtok_planned=planned.get("usd_per_million_tokens"),
            eth_usd_per_hour=report.eth_usd_per_hour,
            effective_hours=report.effective_hours,
            idle_share=report.idle_share,
            tokens_per_second=speed.tokens_per_second,
            restarts=report.restarts,
        ),  # fmt: skip
        **mfu_metadata(speed.mfu, lora_adapter["stats"]["device"]),
        chart=dg.MetadataValue.md(chart),
        breakdown=table(breakdown),
        utilization=dg.MetadataValue.md(f"{report.utilization:.1%} ({report.utilization_source})"),
    )


def pricing_line(device: str, tier: str, mode: str, usd_per_hour: float, declared: bool) -> str:
    """What training_cost's dollars are, in one line: the tier the worker declared, or the plan's tier a run that
    declared none is priced as; for a run that trained on a CPU, that the dollars are that wall time at a GPU's
    rate (the cost model prices no CPU), not what the CPU cost and not what the GPU would have cost (it is faster:
    ``usd_per_mtok_planned`` is the planned GPU's price per million tokens)."""
    rate = f"{tier} ({mode}) at ${usd_per_hour:.2f}/h"
    if declared:
        return f"billed as {rate}, the tier the worker declared (FT_GPU_TIER)"
    if not device.startswith("cuda"):
        return (
            f"trained on {device.split()[0]}, priced as if on {rate}, the plan's tier: the cost model has no CPU price, so "
            "these dollars are this run's wall time at that GPU's rate; on that GPU it would train faster "
            "(usd_per_mtok_planned is its planned price per million tokens)"
        )
    return f"priced as {rate}, the plan's tier: the worker declared no FT_GPU_TIER"


def attempt_rows(attempts: list[dict]) -> list[dict]:
    """The compute line split by SkyPilot attempt: where it ran, its paid hours (the gap before it included), price."""
    return [
        {"item": f"  attempt {a['attempt']}: {a['cloud'] or 'unseen'} {a['region'] or ''}, {a['paid_seconds'] / 3600:.3f} h "
                 f"(incl. {a['gap_seconds'] / 3600:.3f} h {'provisioning' if a['attempt'] == 0 else 'recovery'}) × "
                 f"${a['usd_per_hour_all_nodes']:.2f}/h", "usd": rounded(a["usd"])}
        for a in attempts
    ]  # fmt: skip


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
                records.append(
                    CostRecord(
                        partition,
                        stats["run_id"],
                        _eth_report(stats),
                        stats["estimated_cost_usd"],
                        stats["estimated_hours"],
                    )
                )
        report = aggregate_cost_report(records)
        totals = report.total.as_dict()
        (m.out / "cost_report.json").write_text(
            json.dumps({"rows": [r.as_dict() for r in report.rows], "total": totals}, indent=2, default=str)
        )
        ref = m.publish(
            layout.of(m.partition).control("cost_report"),
            {"runs": len(records), "total": totals, "generated_at": time.time()},
        )
    return m.output(
        ref,
        runs=len(records),
        **figures(
            actual_usd=report.total.actual_usd,
            estimated_usd=report.total.estimated_usd,
            usd_per_mtok_actual=report.total.usd_per_mtok_actual,
        ),
        chart=dg.MetadataValue.md(
            bar_chart(
                {r.dataset_version: {"estimate": r.estimated_usd or 0.0, "actual": r.actual_usd} for r in report.rows},
                "estimate vs actual, USD",
            )
        ),
        report=table(report.table_rows()),
    )
