"""Cost model and effective-training-hour (ETH) accounting for rented GPUs.

Two halves. Before training, the cost model says what can be rented: GPU offerings (VRAM, on-demand
and spot $/h, region, dense bf16 TFLOPS for the throughput estimate) and what object storage and
egress cost. It has documented defaults and can be overridden by a YAML file (``load_cost_model``).
After training, ``compute_eth`` turns what the training plane measured into dollars and into the
price of one *effective* training hour, and ``aggregate_cost_report`` sums runs per dataset version.

The bill is not the GPU's speed but the time it sits idle (data not ready, model loading, restarts
after a preemption, uploads), so the headline number divides the whole bill by the useful hours::

    compute $   = rate($/h of the tier in the rental mode used) x wall hours (summed over restarts)
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

Units: VRAM is in GiB (2**30 bytes, the unit GPU memory is sold and reported in); storage and egress
in GB (10**9 bytes; providers differ, the two are 7% apart and 10**9 errs on the expensive side).
Prices are list prices seen in 2024-2025 and drift: each offering's ``note`` says where it comes
from. Edit them in YAML rather than in code::

    # cost.yaml: every key optional; an offering entry overrides fields of the default with that
    # name, a new name defines a new offering (all fields), null removes a default offering.
    egress_usd_per_gb: 0.0            # e.g. an object store with free egress
    offerings:
      a10g-24gb: {on_demand_usd_per_h: 1.21, spot_usd_per_h: 0.45}
      l40s-48gb: {gpu: NVIDIA L40S, vram_gib: 48, on_demand_usd_per_h: 1.0, spot_usd_per_h: 0.5,
                  region: us-east-1, bf16_tflops: 362}
      h100-80gb: null
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

RentalMode = Literal["spot", "on_demand"]

GB = 10**9  # storage and egress are billed per GB; see the module docstring on units
GIB = 2**30  # GPU memory
HOURS_PER_MONTH = 730.0  # 8760 h / 12: the month AWS, GCP and Azure prorate GB-month storage over


class GpuOffering(BaseModel):
    """One GPU you can rent: one card of this model in one region, priced per hour."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="Short id used in plans and run records, e.g. 'a10g-24gb'.")
    gpu: str = Field(description="GPU model as the provider names it, e.g. 'NVIDIA A10G'.")
    vram_gib: float = Field(gt=0, description="GPU memory in GiB as sold (24 for a '24 GB' card).")
    on_demand_usd_per_h: float = Field(ge=0, description="On-demand price of one such GPU, $/hour.")
    spot_usd_per_h: float | None = Field(
        default=None, ge=0, description="Spot/preemptible price, $/hour; empty if the provider has no spot."
    )
    region: str = Field(min_length=1, description="Where the worker runs, e.g. 'us-east-1'.")
    bf16_tflops: float = Field(gt=0, description="Dense (non-sparse) bf16 tensor-core TFLOPS from the datasheet.")
    mfu_scale: float = Field(
        default=1.0,
        gt=0,
        le=2,
        description="Multiplies the cost model's per-method MFU for this card: below 1 for cards that cannot "
        "sustain their datasheet TFLOPS (power- or bandwidth-limited), from measured throughput.",
    )
    note: str = Field(default="", description="Where the numbers come from; shown next to the plan.")

    def usd_per_hour(self, mode: RentalMode) -> float | None:
        """The hourly price in a rental mode; None when the offering has no spot price."""
        return self.on_demand_usd_per_h if mode == "on_demand" else self.spot_usd_per_h


# Defaults. Prices are per GPU-hour, list prices seen in 2024-2025; spot prices float by the hour, and
# where no quote was at hand spot is taken as half of on-demand (an assumption, marked as such).
# TFLOPS are dense bf16 tensor-core peaks from NVIDIA datasheets (sparsity halved away).
DEFAULT_OFFERINGS: tuple[GpuOffering, ...] = (
    GpuOffering(
        name="rtx4090-24gb",
        gpu="NVIDIA GeForce RTX 4090",
        vram_gib=24,
        on_demand_usd_per_h=0.69,
        spot_usd_per_h=0.35,
        region="us-east-1",
        bf16_tflops=165.2,
        note="Community GPU clouds list ~$0.35-0.70/h (interruptible at the low end). 165.2 TFLOPS: Ada "
        "whitepaper, bf16 with fp32 accumulate, dense.",
    ),
    GpuOffering(
        name="l4-24gb",
        gpu="NVIDIA L4",
        vram_gib=24,
        on_demand_usd_per_h=0.80,
        spot_usd_per_h=0.40,
        region="us-east-1",
        bf16_tflops=121,
        mfu_scale=0.6,
        note="AWS g6.xlarge lists $0.805/h (us-east-1); spot assumed half. 121 TFLOPS: L4 datasheet "
        "(242 with sparsity); mfu_scale 0.6 is an assumption for its 72 W / 300 GB/s limits.",
    ),
    GpuOffering(
        name="a10g-24gb",
        gpu="NVIDIA A10G",
        vram_gib=24,
        on_demand_usd_per_h=1.50,
        spot_usd_per_h=0.60,
        region="us-east-1",
        bf16_tflops=70,
        note="Seed quotes: A10G $1.5-2.5/h on-demand, A10 spot ~$0.6/h (AWS g5.xlarge lists $1.006/h, "
        "bigger g5 hosts more). 70 TFLOPS: A10G bf16 tensor peak as compared by Baseten (the A10 has 125; "
        "both 24 GB at 600 GB/s).",
    ),
    GpuOffering(
        name="a100-40gb",
        gpu="NVIDIA A100 40GB",
        vram_gib=40,
        on_demand_usd_per_h=1.80,
        spot_usd_per_h=0.90,
        region="us-east-1",
        bf16_tflops=312,
        note="GPU clouds list $1.29-1.80/h for one A100 40GB, hyperscalers ~$3-4; spot assumed half. "
        "312 TFLOPS: A100 datasheet.",
    ),
    GpuOffering(
        name="a100-80gb",
        gpu="NVIDIA A100 80GB",
        vram_gib=80,
        on_demand_usd_per_h=2.50,
        spot_usd_per_h=1.25,
        region="us-east-1",
        bf16_tflops=312,
        note="Seed quote: A100 on-demand ~$2.5/h; spot assumed half. 312 TFLOPS: A100 datasheet.",
    ),
    GpuOffering(
        name="h100-80gb",
        gpu="NVIDIA H100 80GB SXM",
        vram_gib=80,
        on_demand_usd_per_h=3.50,
        spot_usd_per_h=1.75,
        region="us-east-1",
        bf16_tflops=989,
        mfu_scale=0.7,
        note="GPU clouds list $2.5-3.5/h for one H100 SXM, hyperscalers more; spot assumed half. 989 "
        "TFLOPS: H100 SXM datasheet; mfu_scale 0.7 assumes single-GPU bf16 fine-tuning leaves Hopper's "
        "tensor cores idler than an A100's.",
    ),
)


class CostModel(BaseModel):
    """What GPUs, storage and egress cost, and the throughput assumptions the planner prices with."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    offerings: tuple[GpuOffering, ...] = Field(
        default=DEFAULT_OFFERINGS, description="GPUs that may be rented, one entry per card model and region."
    )
    storage_usd_per_gb_month: float = Field(
        default=0.023, ge=0, description="Object storage, $/GB-month (AWS S3 Standard, first 50 TB, us-east-1)."
    )
    egress_usd_per_gb: float = Field(
        default=0.09, ge=0, description="Data transfer out of the storage region, $/GB (AWS, first 10 TB/month)."
    )
    mfu_full: float = Field(
        default=0.35,
        gt=0,
        le=1,
        description="Share of the GPU's bf16 peak that full fine-tuning sustains (hardware FLOPs, recompute "
        "counted). Below LoRA's: the AdamW step over every weight is memory-bound and does no matmuls.",
    )
    mfu_lora: float = Field(
        default=0.40,
        gt=0,
        le=1,
        description="Same for LoRA on a bf16 base. Qwen's README measures Qwen-7B LoRA at 2048 tokens on an A100 "
        "at ~3,150 tokens/s, i.e. 0.45 by the planner's FLOP count; 0.40 leaves room for shorter rows.",
    )
    mfu_qlora: float = Field(
        default=0.30,
        gt=0,
        le=1,
        description="Same for QLoRA: every matmul first dequantizes its 4-bit weight; Qwen's README measures "
        "Qwen-7B Q-LoRA 26% slower than LoRA at 2048 tokens.",
    )
    vram_headroom: float = Field(
        default=0.10,
        ge=0,
        lt=0.9,
        description="Share of each GPU's memory the planner keeps free: driver/ECC reservations (an A10G shows "
        "22.5 of 24 GiB), allocator fragmentation and the estimate's error (~10% against measurements).",
    )
    startup_minutes: float = Field(
        default=10.0,
        ge=0,
        description="Paid minutes per run before the first step: boot, image pull, base-model download and load.",
    )
    spot_restart_overhead: float = Field(
        default=0.10,
        ge=0,
        description="Extra wall time on spot, as a share of training time: restarts after preemption and the "
        "steps lost since the last checkpoint. An assumption; compare with cost_report's actual idle share.",
    )

    @model_validator(mode="after")
    def _unique_offerings(self) -> CostModel:
        if not self.offerings:
            raise ValueError("the cost model has no GPU offerings; keep or define at least one")
        names = [o.name for o in self.offerings]
        duplicated = sorted({n for n in names if names.count(n) > 1})
        if duplicated:
            raise ValueError(f"offering names must be unique; duplicated: {duplicated}")
        return self

    def offering(self, name: str) -> GpuOffering:
        for candidate in self.offerings:
            if candidate.name == name:
                return candidate
        known = ", ".join(o.name for o in self.offerings)
        raise KeyError(f"no GPU offering named {name!r} in the cost model; known: {known}")

    def mfu(self, method: str) -> float:
        """Assumed hardware FLOPs utilization of a fine-tuning method ('full', 'lora' or 'qlora')."""
        try:
            return {"full": self.mfu_full, "lora": self.mfu_lora, "qlora": self.mfu_qlora}[method]
        except KeyError:
            raise ValueError(f"unknown method {method!r}: use 'full', 'lora' or 'qlora'") from None


class CostModelError(ValueError):
    """A cost-model YAML file is unreadable or invalid; the message names the file, line and key."""


OFFERING_FIELDS = tuple(GpuOffering.model_fields)
TOP_LEVEL_FIELDS = tuple(CostModel.model_fields)


def load_cost_model(path: str | Path | None = None) -> CostModel:
    """The default cost model, with the overrides of the YAML file at ``path`` applied (see module doc).

    Raises CostModelError naming the file, the line and the dotted key of every problem found.
    """
    if path is None:
        return CostModel()
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise CostModelError(f"{path}: cannot read the cost model file: {exc.strerror or exc}") from exc
    try:
        data = yaml.safe_load(text)
        lines = _key_lines(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise CostModelError(f"{where}: not valid YAML: {getattr(exc, 'problem', None) or exc}") from exc
    if data is None:
        return CostModel()
    if not isinstance(data, dict):
        raise CostModelError(f"{path}: expected a mapping of keys ({', '.join(TOP_LEVEL_FIELDS)}), got {_kind(data)}")

    problems: list[str] = []

    def problem(key_path: tuple, message: str) -> None:
        problems.append(f"{path}:{_line_of(lines, key_path)}: {'.'.join(map(str, key_path))}: {message}")

    for key in data:
        if key not in TOP_LEVEL_FIELDS:
            problem((key,), f"unknown key; known keys: {', '.join(TOP_LEVEL_FIELDS)}")
    values = {key: value for key, value in data.items() if key in TOP_LEVEL_FIELDS}
    offering_names: list[str] = []
    if "offerings" in values:
        merged = _merge_offerings(values["offerings"], problem)
        offering_names = [entry.get("name", "?") for entry in merged]
        values["offerings"] = merged
    if problems:
        raise CostModelError("invalid cost model:\n  " + "\n  ".join(problems))
    try:
        return CostModel.model_validate(values)
    except ValidationError as exc:
        for error in exc.errors():
            loc = list(error["loc"])
            if len(loc) >= 2 and loc[0] == "offerings" and isinstance(loc[1], int):
                loc[1] = offering_names[loc[1]]
            problem(tuple(loc) or ("offerings",), _describe(error))  # model-level checks are about offerings
        raise CostModelError("invalid cost model:\n  " + "\n  ".join(problems)) from None


def _merge_offerings(raw: Any, problem) -> list[dict]:
    """Default offerings as dicts, with the YAML mapping name -> fields | null applied in order."""
    if not isinstance(raw, dict):
        problem(("offerings",), f"expected a mapping of offering name to fields (or null), got {_kind(raw)}")
        return []
    merged = {o.name: o.model_dump() for o in DEFAULT_OFFERINGS}
    for name, fields in raw.items():
        name = str(name)
        if fields is None:
            merged.pop(name, None)
            continue
        if not isinstance(fields, dict):
            problem(("offerings", name), f"expected a mapping of fields or null, got {_kind(fields)}")
            continue
        if "name" in fields and fields["name"] != name:
            problem(("offerings", name, "name"), "the mapping key is the offering's name; remove 'name'")
            continue
        base = merged.get(name)
        if base is None:
            required = [f for f, info in GpuOffering.model_fields.items() if info.is_required() and f != "name"]
            missing = [f for f in required if f not in fields]
            if missing:
                problem(
                    ("offerings", name),
                    f"new offering misses {', '.join(missing)} (a new name needs {', '.join(required)}; "
                    f"defaults that can be overridden field by field: {', '.join(merged)})",
                )
                continue
            base = {}
        merged[name] = {**base, **fields, "name": name}
    return list(merged.values())


def _key_lines(text: str) -> dict[tuple[str, ...], int]:
    """1-based line of every mapping key in a YAML text, by its path of keys."""
    lines: dict[tuple[str, ...], int] = {}

    def walk(node, prefix: tuple[str, ...]) -> None:
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                key = prefix + (str(key_node.value),)
                lines[key] = key_node.start_mark.line + 1
                walk(value_node, key)

    walk(yaml.compose(text, Loader=yaml.SafeLoader), ())
    return lines


def _line_of(lines: Mapping[tuple[str, ...], int], key_path: tuple) -> int | str:
    key = tuple(str(part) for part in key_path)
    while key:
        if key in lines:
            return lines[key]
        key = key[:-1]
    return 1


def _describe(error: Mapping[str, Any]) -> str:
    if error["type"] == "extra_forbidden":
        if "offerings" in error["loc"]:
            return f"unknown key; an offering has: {', '.join(OFFERING_FIELDS)}"
        return f"unknown key; known keys: {', '.join(TOP_LEVEL_FIELDS)}"
    if error["type"] == "missing":
        return "required"
    shown = error.get("input")
    return f"{error['msg']} (got {shown!r})" if not isinstance(shown, dict | list) else error["msg"]


def _kind(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"[:80]


class RunMeasurements(BaseModel):
    """What the training plane measured for one training run (all attempts of it together)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    gpu_tier: str = Field(description="Name of the GPU offering the run rented (a cost-model offering name).")
    rental_mode: RentalMode = Field(description="'spot' or 'on_demand': how the worker was rented.")
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
    usd_per_hour: float  # the rate billed for the tier in that mode
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
    rate = offering.usd_per_hour(mode)
    if rate is None:
        raise ValueError(f"offering {offering.name} has no spot price; add spot_usd_per_h to the cost model")

    wall_hours = measured.wall_seconds / 3600
    step_fraction = measured.step_seconds / measured.wall_seconds if measured.wall_seconds else 0.0
    if measured.gpu_utilization is not None:
        utilization, source = measured.gpu_utilization, "nvml"
    else:
        utilization, source = step_fraction, "step_time"
    effective_hours = wall_hours * utilization
    compute_usd = rate * wall_hours
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


@dataclass(frozen=True)
class CostRecord:
    """One finished training run for the cost report: what was planned and what it cost."""

    dataset_version: str  # partition key, e.g. 'support-chats@2026-11-02'
    run_id: str
    report: EthReport
    estimated_usd: float | None = None  # the training plan's estimate, None if the run had no plan
    estimated_hours: float | None = None


@dataclass(frozen=True)
class CostReportRow:
    """Runs of one dataset version (or of all versions, in CostReport.total) summed."""

    dataset_version: str
    runs: int
    restarts: int
    wall_hours: float
    step_hours: float
    effective_hours: float
    tokens_trained: int
    compute_usd: float
    storage_usd: float
    egress_usd: float
    estimated_usd: float | None  # sum over the runs that had an estimate; None if none had
    estimated_hours: float | None
    actual_vs_estimate: float | None  # actual $ / estimated $ over the runs that had an estimate

    @property
    def actual_usd(self) -> float:
        return self.compute_usd + self.storage_usd + self.egress_usd

    @property
    def eth_usd_per_hour(self) -> float | None:
        """Hour-weighted: all dollars over all effective hours (not a mean of per-run ETHs)."""
        return self.actual_usd / self.effective_hours if self.effective_hours > 0 else None

    @property
    def idle_share(self) -> float:
        return 1.0 - self.step_hours / self.wall_hours if self.wall_hours > 0 else 0.0

    @property
    def usd_per_million_tokens(self) -> float | None:
        return self.actual_usd / self.tokens_trained * 1e6 if self.tokens_trained else None

    def as_dict(self) -> dict[str, Any]:
        extra = {
            "actual_usd": self.actual_usd,
            "eth_usd_per_hour": self.eth_usd_per_hour,
            "idle_share": self.idle_share,
            "usd_per_million_tokens": self.usd_per_million_tokens,
        }
        return {**asdict(self), **extra}


@dataclass(frozen=True)
class CostReport:
    """cost_report: one row per dataset version (sorted by key) and the total over all of them."""

    rows: tuple[CostReportRow, ...]
    total: CostReportRow

    def to_markdown(self) -> str:
        """A table for asset metadata (MetadataValue.md)."""
        header = "| dataset version | runs | restarts | estimate $ | actual $ | actual/est | ETH $/h | idle | $/M tok |"
        lines = [header, "|" + "---|" * 9]
        for row in (*self.rows, self.total):
            lines.append(
                f"| {row.dataset_version} | {row.runs} | {row.restarts} | {_money(row.estimated_usd)} | "
                f"{_money(row.actual_usd)} | {_ratio(row.actual_vs_estimate)} | {_money(row.eth_usd_per_hour)} | "
                f"{row.idle_share:.0%} | {_money(row.usd_per_million_tokens)} |"
            )
        return "\n".join(lines)


def aggregate_cost_report(records: Iterable[CostRecord]) -> CostReport:
    """Sum runs per dataset version: estimate vs actual, hour-weighted ETH and idle share."""
    records = list(records)
    by_version: dict[str, list[CostRecord]] = {}
    for record in records:
        by_version.setdefault(record.dataset_version, []).append(record)
    rows = tuple(_sum_records(version, by_version[version]) for version in sorted(by_version))
    return CostReport(rows=rows, total=_sum_records("(all)", records))


def _sum_records(label: str, records: list[CostRecord]) -> CostReportRow:
    estimated = [r for r in records if r.estimated_usd is not None]
    estimated_usd = sum(r.estimated_usd for r in estimated) if estimated else None
    hours = [r.estimated_hours for r in records if r.estimated_hours is not None]
    actual_of_estimated = sum(r.report.total_usd for r in estimated)
    return CostReportRow(
        dataset_version=label,
        runs=len(records),
        restarts=sum(r.report.restarts for r in records),
        wall_hours=sum(r.report.wall_hours for r in records),
        step_hours=sum(r.report.step_hours for r in records),
        effective_hours=sum(r.report.effective_hours for r in records),
        tokens_trained=sum(r.report.tokens_trained for r in records),
        compute_usd=sum(r.report.compute_usd for r in records),
        storage_usd=sum(r.report.storage_usd for r in records),
        egress_usd=sum(r.report.egress_usd for r in records),
        estimated_usd=estimated_usd,
        estimated_hours=sum(hours) if hours else None,
        actual_vs_estimate=actual_of_estimated / estimated_usd if estimated_usd else None,
    )


def _money(value: float | None) -> str:
    return "-" if value is None else f"{value:,.2f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"
