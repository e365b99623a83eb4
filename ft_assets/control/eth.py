"""Effective-training-hour (ETH) accounting: what one training run cost, and the price of its useful hours.

After training, ``compute_eth`` turns what the training plane measured (``RunMeasurements``) into
dollars with the cost model (``cost_model.py``) and into the price of one *effective* training hour.
The bill is not the GPU's speed but the time it sits idle (data not ready, model loading, restarts
after a preemption, uploads), so the headline number divides the whole bill by the useful hours::

    compute $   = rate($/h of the tier in the rental mode used) x wall hours (summed over restarts),
                  or the launcher's bill when it priced every attempt where it ran (a SkyPilot managed
                  job: each attempt's hours, and the gap before it, at its cloud/region's catalog price)
    storage $   = checkpoint GB x retention hours / 730 h per month x $/GB-month
    egress $    = egress GB x $/GB
    utilization = mean NVML GPU utilization over the wall time when measured, else
                  seconds inside optimizer steps / wall seconds
    effective h = wall hours x utilization
    ETH $/h     = (compute $ + storage $ + egress $) / effective h
    idle share  = 1 - step seconds / wall seconds

Worked example (the defaults; checked in ``test_cost.py``): an A10G on spot at $0.60/h runs 2.5 h of
wall time over one preemption restart, 2.0 h of it inside optimizer steps; it keeps 10 GB of
checkpoints for 73 h and sends 5 GB out of the region. Compute is 0.60 x 2.5 = $1.50, storage
10 x 73 / 730 x 0.023 = $0.023, egress 5 x 0.09 = $0.45, total $1.973. Without NVML the utilization
is 2.0 / 2.5 = 0.8, so 2.0 effective hours and ETH = $0.9865/h: 64% above the $0.60 sticker price,
because a fifth of the paid time was idle and 24% of the bill was not compute.

Runs are summed across dataset versions by ``cost_report.aggregate_cost_report``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ft_assets.control.cost_model import GB, CostModel, GpuOffering, RentalMode

HOURS_PER_MONTH = 730.0  # 8760 h / 12: the month AWS, GCP and Azure prorate GB-month storage over


class RunMeasurements(BaseModel):
    """What the training plane measured for one training run (all attempts of it together)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    gpu_tier: str = Field(description="Name of the GPU offering the run rented (a cost-model offering name).")
    rental_mode: RentalMode = Field(
        description="'spot', 'on_demand' or 'slurm' (a Slurm allocation's GPU-hours): how the worker was rented."
    )
    wall_seconds: float = Field(
        ge=0, description="Paid worker time: from the worker's start to its end, summed over every restart."
    )
    step_seconds: float = Field(
        ge=0, description="Time inside forward + backward + optimizer step, summed over restarts (same clock)."
    )
    restarts: int = Field(default=0, ge=0, description="Restarts after a preemption or crash (0: one attempt).")
    tokens_trained: int = Field(default=0, ge=0, description="Tokens that went through optimizer steps.")
    checkpoint_bytes: int = Field(default=0, ge=0, description="Bytes of checkpoints the run kept in the store.")
    checkpoint_retention_hours: float = Field(
        default=0.0, ge=0, description="How long those checkpoints are kept (planned or observed), hours."
    )
    egress_bytes: int = Field(default=0, ge=0, description="Bytes billed as egress (cross-region or internet).")
    gpu_utilization: float | None = Field(
        default=None,
        ge=0,
        le=1,
        description="Mean NVML GPU utilization over the whole wall time, idle periods included (0-1); empty "
        "when no NVML / torch.cuda was available.",
    )
    gpus: int = Field(
        default=1, ge=1, description="GPUs the run rented at once, over all nodes: each is billed the tier's rate."
    )
    billed_compute_usd: float | None = Field(
        default=None,
        ge=0,
        description="Compute as the launcher billed it, every attempt at the price where it ran (SkyPilot's "
        "ft/sky-attempts); empty: wall_seconds at the offering's rate.",
    )

    @model_validator(mode="after")
    def _steps_inside_wall(self) -> RunMeasurements:
        if self.step_seconds > self.wall_seconds:
            raise ValueError(
                f"step_seconds ({self.step_seconds}) exceeds wall_seconds ({self.wall_seconds}): optimizer steps "
                "happen inside the worker's wall time; measure both with one monotonic clock"
            )
        return self


@dataclass(frozen=True)
class EthReport:
    """Cost of one training run and the price of its effective training hours."""

    gpu_tier: str
    rental_mode: RentalMode
    usd_per_hour: float  # the rate billed for the tier in that mode, times the run's GPUs
    wall_hours: float
    step_hours: float
    restarts: int
    tokens_trained: int
    compute_usd: float
    storage_usd: float
    egress_usd: float
    utilization: float  # 0-1, see utilization_source
    utilization_source: Literal["nvml", "step_time"]
    effective_hours: float  # wall_hours x utilization
    eth_usd_per_hour: float | None  # None when nothing useful ran (no effective hours)
    idle_share: float  # 1 - step time / wall time; 0 for an empty run

    @property
    def total_usd(self) -> float:
        return self.compute_usd + self.storage_usd + self.egress_usd

    @property
    def usd_per_million_tokens(self) -> float | None:
        return self.total_usd / self.tokens_trained * 1e6 if self.tokens_trained else None

    def as_dict(self) -> dict[str, Any]:
        """Flat, JSON-ready (asset metadata, run records)."""
        return {**asdict(self), "total_usd": self.total_usd, "usd_per_million_tokens": self.usd_per_million_tokens}


def compute_eth(
    measured: RunMeasurements,
    offering: GpuOffering | None = None,
    mode: RentalMode | None = None,
    cost_model: CostModel | None = None,
) -> EthReport:
    """Cost breakdown and ETH of one run (formulas and a worked example in the module docstring).

    ``offering`` and ``mode`` default to the tier and mode recorded in ``measured``, looked up in
    ``cost_model`` (the defaults when None); when given they must agree with the measurement.
    """
    cost_model = cost_model or CostModel()
    offering = offering or cost_model.offering(measured.gpu_tier)
    mode = mode or measured.rental_mode
    if offering.name != measured.gpu_tier or mode != measured.rental_mode:
        raise ValueError(
            f"the run was measured on {measured.gpu_tier} ({measured.rental_mode}) but priced as "
            f"{offering.name} ({mode}); price it with the tier and mode it ran on"
        )
    wall_hours = measured.wall_seconds / 3600
    rate = offering.usd_per_hour(mode)
    if measured.billed_compute_usd is not None:  # the attempts' own prices: the rate is their blend
        rate = measured.billed_compute_usd / wall_hours if wall_hours else (rate or 0.0) * measured.gpus
    elif rate is None:
        field = "on_demand_usd_per_h" if mode == "on_demand" else f"{mode}_usd_per_h"
        raise ValueError(f"offering {offering.name} has no {mode} price; add {field} to the cost model (FT_COST_MODEL)")
    else:
        rate *= measured.gpus

    step_fraction = measured.step_seconds / measured.wall_seconds if measured.wall_seconds else 0.0
    if measured.gpu_utilization is not None:
        utilization, source = measured.gpu_utilization, "nvml"
    else:
        utilization, source = step_fraction, "step_time"
    effective_hours = wall_hours * utilization
    compute_usd = measured.billed_compute_usd if measured.billed_compute_usd is not None else rate * wall_hours
    storage_usd = (
        measured.checkpoint_bytes / GB * measured.checkpoint_retention_hours / HOURS_PER_MONTH
    ) * cost_model.storage_usd_per_gb_month
    egress_usd = measured.egress_bytes / GB * cost_model.egress_usd_per_gb
    total = compute_usd + storage_usd + egress_usd
    return EthReport(
        gpu_tier=offering.name,
        rental_mode=mode,
        usd_per_hour=rate,
        wall_hours=wall_hours,
        step_hours=measured.step_seconds / 3600,
        restarts=measured.restarts,
        tokens_trained=measured.tokens_trained,
        compute_usd=compute_usd,
        storage_usd=storage_usd,
        egress_usd=egress_usd,
        utilization=utilization,
        utilization_source=source,
        effective_hours=effective_hours,
        eth_usd_per_hour=total / effective_hours if effective_hours > 0 else None,
        idle_share=1.0 - step_fraction if measured.wall_seconds else 0.0,
    )
