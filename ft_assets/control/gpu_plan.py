"""training_plan's choice: which GPU offering, how many of them, spot or on-demand, how long and what it costs.

``plan_training`` takes one ``PlanRequest`` (``ft_assets.control.planner``: the model, the run's
``TrainingConfig``, its method and the objective's ``StepWork``), the run's memory per GPU from it
(``estimate_vram``), and prices every offering of the cost model that fits:

- on the GPUs the settings ask for: ``num_processes`` x ``num_nodes`` (1 by default), with their
  ``parallelism`` (DDP or FSDP; DDP does not lower the memory a GPU needs, it only adds speed);
- or, with ``fewest_gpus`` (``ft-assets plan --gpus auto``), on the fewest of 1, 2, 4, 8, 16, 32 or 64
  GPUs of each offering that fit (FSDP above one; more than 8 are whole 8-GPU nodes), e.g. Llama-2-13B
  full fine-tuning (203.8 GiB on one GPU) on 4 x A100 80 GB.

Cost: hours = startup + training-equivalent tokens / tokens/s of all N GPUs (x 1.1 on spot for
restarts); cost = N x $/h x hours. Your Mac (the cost model's ``mac``: an Apple silicon tier, unified memory) is one
more offering: one process, its memory as the MLX backend spends it (``mlx_request``: sdpa, full logits) within the
share Metal lets the GPU wire, never preempted, at the amortized rate you set ($0 by default), so a run that fits
on it is planned there, and the plan's candidates show what renting would cost instead (``ft-assets plan --mac``). N GPUs are never cheaper than one that fits (the same GPU-hours,
less the scaling loss), so more GPUs are chosen only where fewer do not fit. Rental mode follows the
purpose: experiments run on spot (every run resumes from its checkpoints), validation runs on-demand,
delivery rents no GPU (merge and export run on CPU). When nothing fits, ``NoGpuFits`` says what would:
gradient checkpointing, micro batch 1, QLoRA, and FSDP over several of the largest GPUs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

from ft_assets.control.cost_model import CostModel, GpuOffering, RentalMode
from ft_assets.control.planner import (
    GPUS_PER_NODE,
    PlanRequest,
    Throughput,
    VramEstimate,
    estimate_vram,
    objective_cost,
    throughput,
    tokens_per_second,
)
from ft_assets.training.config import Method, Parallelism

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
    total_tokens: int  # training-equivalent tokens: the run's trained tokens x work_factor
    tokens_per_second: float | None  # all GPUs, of training-equivalent tokens
    est_hours: float
    est_cost_usd: float
    usd_per_hour: float | None  # all GPUs
    flops_per_token: float  # hardware FLOPs a trained token costs (objective_cost): what measured MFU is against
    work_factor: float  # training-equivalent tokens a trained token (the objective's extra work)
    warnings: tuple[str, ...] = ()
    candidates: tuple[TierCandidate, ...] = ()
    gpus: int = 1
    parallelism: Parallelism = "ddp"
    throughput: Throughput | None = None  # trained tokens/s, MFU and $ per million tokens on the tier; None: no GPU
    prices: str = ""  # where the offerings' prices come from (CostModel.prices: the shipped list, SkyPilot's catalog)
    prices_fetched_at: float | None = None  # when the catalog was fetched (Unix time); None: a fixed list

    @property
    def nodes(self) -> int:
        """Machines of up to ``GPUS_PER_NODE`` GPUs: the settings' num_nodes (num_processes = gpus / nodes)."""
        return -(-self.gpus // GPUS_PER_NODE)

    def describe(self) -> str:
        """'2 x h100-80gb (NVIDIA H100 80GB), fsdp, spot' or 'a10g-24gb (NVIDIA A10G), spot'."""
        count = f"{self.gpus} x " if self.gpus > 1 else ""
        spread = (
            f", {self.parallelism} over {self.nodes} nodes"
            if self.nodes > 1
            else (f", {self.parallelism}" if self.gpus > 1 else "")
        )
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
                "hours": float(f"{c.hours:.4g}"),  # 4 significant digits, as the page's figures
                "cost_usd": None if c.cost_usd is None else float(f"{c.cost_usd:.4g}"),
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


def rental_mode_for(purpose: Purpose) -> tuple[RentalMode | Literal["none"], list[str]]:
    """Spot for experiments (every run resumes from its checkpoints), on-demand for validation, none for delivery."""
    if purpose == "delivery":
        return "none", []
    if purpose == "validation":
        return "on_demand", []
    if purpose != "experiment":
        raise ValueError(f"unknown purpose {purpose!r}: use 'experiment', 'validation' or 'delivery'")
    return "spot", []


def plan_training(
    request: PlanRequest,
    cost_model: CostModel,
    purpose: Purpose,
    data_region: str | None,
    *,
    fewest_gpus: bool = False,
    pinned: tuple[str, RentalMode] | None = None,
) -> TrainingPlan:
    """Cheapest fitting GPU offering for the run ``request`` describes, its rental mode, hours and cost.

    ``pinned`` (offering name, rental mode): the card a GPU target has (``ft_assets.targets``: a Slurm partition's, an
    ssh host's), planned at that mode's price; a name the cost model lacks is a KeyError, a card that does not fit
    NoGpuFits, as for any other plan.

    The run's GPUs are its settings' ``num_processes`` x ``num_nodes`` with their ``parallelism``; with
    ``fewest_gpus`` (``ft-assets plan --gpus auto``) the fewest of ``GPU_COUNTS`` that fit, FSDP above one.
    What it prices is the objective's work: its trained tokens times the extra work of the objective
    (``objective_cost``), at the planned tokens/s. ``data_region`` is where the shards are stored. Raises
    NoGpuFits, with what would fit instead, when no offering has enough memory.
    """
    shape, method, work, settings = request.shape, request.method, request.work, request.settings
    if work.tokens < 1:
        raise ValueError(f"the run trains no tokens (got {work.tokens}): nothing to plan")
    counts = GPU_COUNTS if fewest_gpus else (settings.world_size,)
    estimates = {
        n: estimate_vram(request, n, ("fsdp" if n > 1 else "ddp") if fewest_gpus else settings.parallelism)
        for n in counts
    }
    images = request.planned_images()
    flops, factor = objective_cost(
        shape, method, work.attention_len, settings.gradient_checkpointing, work.reference_forward, work.generated_share,
        work.decode_batch, cost_model.mfu(method), images, settings.train_vision,
    )  # fmt: skip
    total_tokens = round(work.tokens * factor)
    mode, warnings = rental_mode_for(purpose)
    if pinned is not None and mode != "none":
        name, mode = pinned
        cost_model = cost_model.model_copy(update={"offerings": (cost_model.offering(name),)})
    if mode == "none":
        vram = estimates[counts[0]]
        return TrainingPlan(purpose, method, "none", None, None, None, vram, total_tokens, None, 0.0, 0.0, None, flops, factor,
                            gpus=vram.gpus, parallelism=vram.parallelism, prices=cost_model.prices,
                            prices_fetched_at=cost_model.prices_fetched_at)  # fmt: skip

    on_a_mac = {1: estimate_vram(mlx_request(request), 1, "ddp")}  # one process, mlx-lm's attention and loss

    def price_all(rental_mode: RentalMode) -> tuple[TierCandidate, ...]:
        return tuple(
            _fewest_that_fit(o, rental_mode, on_a_mac if o.unified_memory else estimates, request, total_tokens, cost_model)
            for o in cost_model.offerings
        )  # fmt: skip

    candidates = price_all(mode)
    if not any(c.fits for c in candidates):
        raise NoGpuFits(
            _no_fit_message(request, estimates[counts[0]], candidates, cost_model), estimates[counts[0]], candidates
        )
    eligible = [c for c in candidates if not c.reason]
    if not eligible and pinned is not None:
        raise ValueError(f"the target's GPU {pinned[0]} has no {pinned[1]} price in the cost model (FT_COST_MODEL)")
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
    if images is not None and request.images is None:
        warnings.append(f"images: {images.source}; a dataset's training plan counts its own")
    if request.shape.experts:
        warnings.append(
            f"a mixture of experts is timed from its active parameters ({request.shape.describe_params()}) at a dense "
            "model's MFU: routing and grouped expert GEMMs usually run below it, so take the hours and dollars as a "
            "lower bound (benchmarks/gpu_step.py --shape gpt-oss-20b measures it)"
        )
    # the plan's tokens/s is of training-equivalent tokens: trained tokens go factor times slower
    planned = throughput(
        chosen.tokens_per_second / factor, flops, cost_model.offering(chosen.name), chosen.usd_per_hour, chosen.gpus
    )
    return TrainingPlan(
        purpose=purpose,
        method=method,
        mode=mode,
        tier=chosen.name,
        gpu=chosen.gpu,
        region=chosen.region,
        vram=on_a_mac[1] if cost_model.offering(chosen.name).unified_memory else estimates[chosen.gpus],
        total_tokens=total_tokens,
        tokens_per_second=chosen.tokens_per_second,
        est_hours=chosen.hours,
        est_cost_usd=chosen.cost_usd,
        usd_per_hour=chosen.usd_per_hour,
        warnings=tuple(warnings),
        candidates=candidates,
        gpus=chosen.gpus,
        parallelism=chosen.parallelism,
        flops_per_token=flops,
        work_factor=factor,
        throughput=planned,
        prices=cost_model.prices,
        prices_fetched_at=cost_model.prices_fetched_at,
    )


def mlx_request(request: PlanRequest) -> PlanRequest:
    """The run as the MLX backend does it on a Mac: one process, sdpa attention (score matrices counted, as mlx's
    attention gradient keeps them) and every forward's logits held (mlx_recipe has no chunked loss)."""
    settings = request.settings.model_copy(update={"attn_implementation": "sdpa", "num_processes": 1, "num_nodes": 1})
    return replace(request, settings=settings, loss="full")


def _fewest_that_fit(
    offering: GpuOffering,
    mode: RentalMode,
    estimates: dict[int, VramEstimate],
    run: PlanRequest,
    total_tokens: int,
    cost_model: CostModel,
) -> TierCandidate:
    """``offering`` on the fewest of the GPU counts in ``estimates`` (up to its ``max_gpus``) that fit; on the first
    count if none does."""
    usable = offering.vram_gib * offering.memory_share * (1 - cost_model.vram_headroom)
    counts = [n for n in estimates if n <= offering.max_gpus] or [next(iter(estimates))]
    gpus = next((n for n in counts if estimates[n].total_gib <= usable), counts[0])
    vram = estimates[gpus]
    fits = vram.total_gib <= usable and gpus <= offering.max_gpus
    rate = offering.usd_per_hour(mode)
    speed = tokens_per_second(
        run.shape, run.method, run.work.seq_len, run.settings.gradient_checkpointing, offering, cost_model, gpus,
        run.planned_images(), run.settings.train_vision,
    )  # fmt: skip
    restarts = cost_model.spot_restart_overhead if mode == "spot" and not offering.unified_memory else 0  # a Mac: owned
    train_hours = total_tokens / speed / 3600 * (1 + restarts)
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


def _no_fit_message(
    run: PlanRequest, vram: VramEstimate, candidates: tuple[TierCandidate, ...], cost_model: CostModel
) -> str:
    largest = max(candidates, key=lambda c: c.usable_gib)
    shape = run.shape
    what = f"{vram.method} of {shape.name or 'the model'} ({shape.describe_params()})"
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
    if method != "qlora" and not shape.experts:  # bitsandbytes leaves a mixture's experts unquantized
        method = "qlora"
        options.append(("method qlora", method, checkpointing, batch))
    for number, (label, method, checkpointing, batch) in enumerate(options):
        estimate = estimate_vram(run.variant(method, checkpointing, batch), vram.gpus, vram.parallelism)
        fitting = [c.name for c in candidates if estimate.total_gib <= c.usable_gib]
        verdict = f"fits {', '.join(fitting)}" if fitting else "still too big"
        per_gpu = f" per GPU on {vram.gpus}" if vram.gpus > 1 else ""
        lines.append(f"  - {'+ ' if number else ''}{label}: ~{estimate.total_gib:.1f} GiB{per_gpu}, {verdict}")
    most = cost_model.offering(largest.name).max_gpus
    counts = [n for n in GPU_COUNTS if vram.gpus < n <= most]
    sharded = next(
        ((n, e) for n in counts if (e := estimate_vram(run, n, "fsdp")).total_gib <= largest.usable_gib), None
    )
    if sharded is not None:
        lines.append(
            f"  - or {vram.method} as it is, parallelism fsdp on {sharded[0]} x {largest.name}: ~{sharded[1].total_gib:.1f} GiB per GPU"
        )
    lines.append("  - add a larger offering to the cost model")
    return "\n".join(lines)
