"""training_plan's choice: which GPU offering, how many of them, spot or on-demand, how long and what it costs.

``plan_training`` takes the run's memory per GPU (``ft_assets.control.planner.estimate_vram``) and
prices every offering of the cost model that fits:

- on one GPU (``gpus=1``, the default: the run as its settings describe it when they ask for one);
- on ``gpus=N`` GPUs (DDP or FSDP, ``parallelism``; FSDP by default above one GPU: DDP does not
  lower the memory a GPU needs, it only adds speed);
- or, with ``gpus=None``, on the fewest of 1, 2, 4, 8, 16, 32 or 64 GPUs of each offering that fit
  (FSDP above one; more than 8 are whole 8-GPU nodes), e.g. Llama-2-13B full fine-tuning
  (203.8 GiB on one GPU) on 4 x A100 80 GB.

Cost: hours = startup + tokens x epochs / tokens/s of all N GPUs (x 1.1 on spot for restarts); cost =
N x $/h x hours. N GPUs are never cheaper than one that fits (the same GPU-hours, less the scaling
loss), so more GPUs are chosen only where fewer do not fit. Rental mode follows the purpose:
experiments that checkpoint run on spot, validation runs on-demand, delivery rents no GPU (merge and
export run on CPU). When nothing fits, ``NoGpuFits`` says what would: gradient checkpointing, micro
batch 1, QLoRA, and FSDP over several of the largest GPUs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

from ft_assets.control.cost_model import CostModel, GpuOffering, RentalMode
from ft_assets.control.model_shape import ModelShape
from ft_assets.control.planner import GPUS_PER_NODE, LossPath, VramEstimate, estimate_vram, tokens_per_second
from ft_assets.training.config import AttentionImplementation, Method, Parallelism

Purpose = Literal["experiment", "validation", "delivery"]
GPU_COUNTS = (1, 2, 4, 8, 16, 32, 64)  # what gpus=None tries: powers of two up to 8 nodes of 8


@dataclass(frozen=True)
class TierCandidate:
    """One offering considered by the planner on ``gpus`` GPUs, fitting or not, priced in the plan's rental mode."""

    name: str
    gpu: str
    region: str
    vram_gib: float
    usable_gib: float  # vram x (1 - headroom), per GPU
    fits: bool
    usd_per_hour: float | None  # all ``gpus`` GPUs; None: no price in this rental mode
    tokens_per_second: float  # all ``gpus`` GPUs
    hours: float
    cost_usd: float | None
    reason: str = ""  # why it cannot be chosen; empty when it can
    gpus: int = 1
    parallelism: Parallelism = "ddp"
    needs_gib: float = 0.0  # per GPU, on this many GPUs

    @property
    def label(self) -> str:
        """'h100-80gb' on one GPU, '4 x h100-80gb fsdp' on several."""
        return self.name if self.gpus == 1 else f"{self.gpus} x {self.name} {self.parallelism}"


@dataclass(frozen=True)
class TrainingPlan:
    """training_plan of one dataset version: where and how the run rents its GPUs, and what it costs."""

    purpose: Purpose
    method: Method
    mode: RentalMode | Literal["none"]
    tier: str | None  # offering name; None when no GPU is rented (delivery)
    gpu: str | None
    region: str | None
    vram: VramEstimate  # per GPU, on ``gpus`` GPUs
    total_tokens: int  # train tokens x epochs
    tokens_per_second: float | None  # all GPUs
    est_hours: float
    est_cost_usd: float
    usd_per_hour: float | None  # all GPUs
    warnings: tuple[str, ...] = ()
    candidates: tuple[TierCandidate, ...] = ()
    gpus: int = 1
    parallelism: Parallelism = "ddp"

    @property
    def nodes(self) -> int:
        """Machines of up to ``GPUS_PER_NODE`` GPUs: the settings' num_nodes (num_processes = gpus / nodes)."""
        return -(-self.gpus // GPUS_PER_NODE)

    def describe(self) -> str:
        """'2 x h100-80gb (NVIDIA H100 80GB), fsdp, spot' or 'a10g-24gb (NVIDIA A10G), spot'."""
        count = f"{self.gpus} x " if self.gpus > 1 else ""
        spread = f", {self.parallelism} over {self.nodes} nodes" if self.nodes > 1 else (f", {self.parallelism}" if self.gpus > 1 else "")
        return f"{count}{self.tier} ({self.gpu}){spread}, {self.mode}"

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (asset metadata); the VRAM breakdown and candidates nested."""
        data = asdict(self)
        data["vram"] = self.vram.as_dict()
        data["nodes"] = self.nodes
        return data

    def candidate_rows(self) -> list[dict[str, Any]]:
        """Every offering considered, cheapest first, with the chosen one marked (for the UI's table)."""
        return [
            {
                "tier": c.name,
                "gpus": c.gpus,
                "gpu": c.gpu,
                "region": c.region,
                "usable_gib": round(c.usable_gib, 1),
                "fits": c.fits,
                "usd_per_hour": c.usd_per_hour,
                "tokens_per_second": round(c.tokens_per_second),
                "hours": round(c.hours, 2),
                "cost_usd": None if c.cost_usd is None else round(c.cost_usd, 2),
                "note": "chosen" if (c.name, c.gpus) == (self.tier, self.gpus) else c.reason,
            }
            for c in sorted(self.candidates, key=lambda c: (c.cost_usd is None, c.cost_usd or 0.0, c.name))
        ]


class NoGpuFits(ValueError):
    """No offering of the cost model has the VRAM the run needs; the message says what would fit."""

    def __init__(self, message: str, vram: VramEstimate, candidates: tuple[TierCandidate, ...]):
        super().__init__(message)
        self.vram = vram
        self.candidates = candidates


def rental_mode_for(purpose: Purpose, resumable: bool) -> tuple[RentalMode | Literal["none"], list[str]]:
    """Spot for experiments that resume from checkpoints, on-demand for validation, none for delivery."""
    if purpose == "delivery":
        return "none", []
    if purpose == "validation":
        return "on_demand", []
    if purpose != "experiment":
        raise ValueError(f"unknown purpose {purpose!r}: use 'experiment', 'validation' or 'delivery'")
    if resumable:
        return "spot", []
    return "on_demand", [
        "experiment does not resume from checkpoints: renting on-demand, since a spot preemption would "
        "lose all progress"
    ]


@dataclass(frozen=True)
class RunShape:
    """What the run computes, for pricing it on any offering and GPU count."""

    shape: ModelShape
    method: Method
    seq_len: int
    micro_batch: int
    grad_checkpointing: bool
    lora_r: int = 16
    lora_targets: Sequence[str] = ()  # (): every projection the model has (model_shape.lora_targets_of)
    lora_dropout: float = 0.05
    attention: AttentionImplementation = "auto"
    loss: LossPath = "chunked"

    def vram(self, gpus: int = 1, parallelism: Parallelism = "ddp", **changes) -> VramEstimate:
        """Memory per GPU on ``gpus`` GPUs, with ``changes`` to the run (method, micro_batch, grad_checkpointing)."""
        run = replace(self, **changes)
        return estimate_vram(
            run.shape, run.method, run.seq_len, run.micro_batch, run.grad_checkpointing, run.lora_r, run.lora_targets,
            run.lora_dropout, run.attention, run.loss, gpus=gpus, parallelism=parallelism,
        )  # fmt: skip


def plan_training(
    shape: ModelShape,
    method: Method,
    seq_len: int,
    micro_batch: int,
    grad_checkpointing: bool,
    train_tokens: int,
    epochs: float = 1,
    cost_model: CostModel | None = None,
    purpose: Purpose = "experiment",
    data_region: str | None = None,
    *,
    lora_r: int = 16,
    lora_targets: Sequence[str] = (),
    lora_dropout: float = 0.05,
    resumable: bool = True,
    attention: AttentionImplementation = "auto",
    loss: LossPath = "chunked",
    gpus: int | None = 1,
    parallelism: Parallelism | None = None,
) -> TrainingPlan:
    """Cheapest fitting GPU offering (and count: ``gpus``, None for the fewest that fit), rental mode, hours and cost.

    ``train_tokens`` is the token count of the train shards (one epoch); ``data_region`` where they are
    stored; ``parallelism`` defaults to ddp on one GPU and fsdp on several. Raises NoGpuFits, with what
    would fit instead, when no offering has enough memory.
    """
    cost_model = cost_model or CostModel()
    if train_tokens < 1 or epochs <= 0:
        raise ValueError(f"train_tokens must be >= 1 and epochs > 0 (got {train_tokens}, {epochs})")
    if gpus is not None and gpus < 1:
        raise ValueError(f"gpus must be >= 1 or None for the fewest that fit (got {gpus})")
    run = RunShape(shape, method, seq_len, micro_batch, grad_checkpointing, lora_r, tuple(lora_targets), lora_dropout, attention, loss)
    counts = GPU_COUNTS if gpus is None else (gpus,)
    estimates = {n: run.vram(n, parallelism or ("fsdp" if n > 1 else "ddp")) for n in counts}
    total_tokens = round(train_tokens * epochs)
    mode, warnings = rental_mode_for(purpose, resumable)
    if mode == "none":
        return TrainingPlan(purpose, method, "none", None, None, None, estimates[counts[0]], total_tokens, None, 0.0, 0.0, None)

    def price_all(rental_mode: RentalMode) -> tuple[TierCandidate, ...]:
        return tuple(_fewest_that_fit(o, rental_mode, estimates, run, total_tokens, cost_model) for o in cost_model.offerings)

    candidates = price_all(mode)
    if not any(c.fits for c in candidates):
        raise NoGpuFits(_no_fit_message(run, estimates[counts[0]], candidates, cost_model), estimates[counts[0]], candidates)
    eligible = [c for c in candidates if not c.reason]
    if not eligible:  # only possible on spot: nothing that fits has a spot price
        warnings.append("no offering that fits has a spot price: falling back to on-demand")
        mode = "on_demand"
        candidates = price_all(mode)
        eligible = [c for c in candidates if not c.reason]
    chosen = min(eligible, key=lambda c: (c.cost_usd, c.gpus, c.region != data_region, c.name))
    if data_region is not None and chosen.region != data_region:
        warnings.append(
            f"data is in {data_region} but the worker ({chosen.name}) runs in {chosen.region}: every shard "
            f"download and checkpoint upload crosses regions, billed as egress at ${cost_model.egress_usd_per_gb}/GB "
            f"and slower; store the data in {chosen.region} or add an offering in {data_region}"
        )
    return TrainingPlan(
        purpose=purpose,
        method=method,
        mode=mode,
        tier=chosen.name,
        gpu=chosen.gpu,
        region=chosen.region,
        vram=estimates[chosen.gpus],
        total_tokens=total_tokens,
        tokens_per_second=chosen.tokens_per_second,
        est_hours=chosen.hours,
        est_cost_usd=chosen.cost_usd,
        usd_per_hour=chosen.usd_per_hour,
        warnings=tuple(warnings),
        candidates=candidates,
        gpus=chosen.gpus,
        parallelism=chosen.parallelism,
    )


def _fewest_that_fit(
    offering: GpuOffering, mode: RentalMode, estimates: dict[int, VramEstimate], run: RunShape, total_tokens: int, cost_model: CostModel
) -> TierCandidate:
    """``offering`` on the fewest of the GPU counts in ``estimates`` (up to its ``max_gpus``) that fit; on the first
    count if none does."""
    usable = offering.vram_gib * (1 - cost_model.vram_headroom)
    counts = [n for n in estimates if n <= offering.max_gpus] or [next(iter(estimates))]
    gpus = next((n for n in counts if estimates[n].total_gib <= usable), counts[0])
    vram = estimates[gpus]
    fits = vram.total_gib <= usable and gpus <= offering.max_gpus
    rate = offering.usd_per_hour(mode)
    speed = tokens_per_second(run.shape, run.method, run.seq_len, run.grad_checkpointing, offering, cost_model, gpus)
    train_hours = total_tokens / speed / 3600 * (1 + (cost_model.spot_restart_overhead if mode == "spot" else 0))
    hours = cost_model.startup_minutes / 60 + train_hours
    if gpus > offering.max_gpus:
        reason = f"rents at most {offering.max_gpus} GPU(s) a run"
    elif not fits:
        reason = f"needs {vram.total_gib:.1f} GiB" + (f" per GPU on {gpus}" if gpus > 1 else "")
    elif rate is None:
        reason = "no spot price"
    else:
        reason = ""
    return TierCandidate(
        name=offering.name,
        gpu=offering.gpu,
        region=offering.region,
        vram_gib=offering.vram_gib,
        usable_gib=usable,
        fits=fits,
        usd_per_hour=None if rate is None else rate * gpus,
        tokens_per_second=speed,
        hours=hours,
        cost_usd=None if rate is None else rate * gpus * hours,
        reason=reason,
        gpus=gpus,
        parallelism=vram.parallelism,
        needs_gib=vram.total_gib,
    )


def _no_fit_message(run: RunShape, vram: VramEstimate, candidates: tuple[TierCandidate, ...], cost_model: CostModel) -> str:
    largest = max(candidates, key=lambda c: c.usable_gib)
    shape = run.shape
    what = f"{vram.method} of {shape.name or 'the model'} ({shape.params / 1e9:.2f}B params)"
    on = f" per GPU on {vram.gpus} ({vram.parallelism})" if vram.gpus > 1 else ""
    lines = [
        f"no GPU offering fits {what} at seq {vram.seq_len} x batch {vram.micro_batch}: it needs ~{vram.breakdown()}{on}; the "
        f"largest, {largest.name}, has {largest.usable_gib:.1f} GiB usable ({largest.vram_gib:g} GiB less "
        f"{cost_model.vram_headroom:.0%} headroom). Options:"
    ]
    # Each option adds to the ones above it: first those that keep the math, then 4-bit quantization.
    method, checkpointing, batch = vram.method, vram.grad_checkpointing, vram.micro_batch
    options = []
    if not checkpointing:
        checkpointing = True
        options.append(("gradient checkpointing", method, checkpointing, batch))
    if batch > 1:
        batch = 1
        options.append(("micro batch 1 (same global batch via gradient accumulation)", method, checkpointing, batch))
    if method != "qlora":
        method = "qlora"
        options.append(("method qlora", method, checkpointing, batch))
    for number, (label, method, checkpointing, batch) in enumerate(options):
        estimate = run.vram(vram.gpus, vram.parallelism, method=method, grad_checkpointing=checkpointing, micro_batch=batch)
        fitting = [c.name for c in candidates if estimate.total_gib <= c.usable_gib]
        verdict = f"fits {', '.join(fitting)}" if fitting else "still too big"
        per_gpu = f" per GPU on {vram.gpus}" if vram.gpus > 1 else ""
        lines.append(f"  - {'+ ' if number else ''}{label}: ~{estimate.total_gib:.1f} GiB{per_gpu}, {verdict}")
    most = cost_model.offering(largest.name).max_gpus
    counts = [n for n in GPU_COUNTS if vram.gpus < n <= most]
    sharded = next(((n, e) for n in counts if (e := run.vram(n, "fsdp")).total_gib <= largest.usable_gib), None)
    if sharded is not None:
        lines.append(f"  - or {vram.method} as it is, parallelism fsdp on {sharded[0]} x {largest.name}: ~{sharded[1].total_gib:.1f} GiB per GPU")
    lines.append("  - add a larger offering to the cost model")
    return "\n".join(lines)
