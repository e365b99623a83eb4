"""The cost model: what GPUs, object storage and egress cost, and what the planner assumes about them.

Before training, the planner (``planner.py``) asks it what can be rented: GPU offerings (VRAM,
on-demand and spot $/h, region, dense bf16 TFLOPS for the throughput estimate), what object storage
and egress cost, and the MFU, headroom and start-up assumptions it prices a run with. After
training, ``eth.compute_eth`` prices what the worker really did with the same model.

The default offerings are a price list shipped with the package, ``gpu_offerings.yaml`` next to this
file (read with ``importlib.resources``, so it works from a wheel); the other settings' defaults are
the fields of ``CostModel`` below, each with its source. Prices are list prices seen in 2024-2025
and drift: each offering's ``note`` says where it comes from. Override them with your own YAML file,
given to ``load_cost_model`` (the assets read it from their ``cost_model_path`` config, else from
``$FT_COST_MODEL``), rather than by editing the packaged one::

    # cost.yaml: every key optional; an offering entry overrides fields of the default with that
    # name, a new name defines a new offering (all fields), null removes a default offering.
    egress_usd_per_gb: 0.0            # e.g. an object store with free egress
    offerings:
      a10g-24gb: {on_demand_usd_per_h: 1.21, spot_usd_per_h: 0.45}
      l40s-48gb: {gpu: NVIDIA L40S, vram_gib: 48, on_demand_usd_per_h: 1.0, spot_usd_per_h: 0.5,
                  region: us-east-1, bf16_tflops: 362}
      h100-80gb: null

An invalid file fails with every problem at once, each as ``file:line: dotted.key: what is wrong``.

Units: VRAM is in GiB (2**30 bytes, the unit GPU memory is sold and reported in); storage and egress
in GB (10**9 bytes; providers differ, the two are 7% apart and 10**9 errs on the expensive side).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ft_assets.control.market import MarketError, market_offerings

RentalMode = Literal["spot", "on_demand", "slurm"]  # slurm: an HPC allocation, billed per GPU-hour used

GB = 10**9  # storage and egress are billed per GB; see the module docstring on units
GIB = 2**30  # GPU memory


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
    slurm_usd_per_h: float | None = Field(
        default=None,
        ge=0,
        description="This GPU's price on a Slurm cluster's allocation, $/GPU-hour: what the HPC center charges per "
        "GPU-hour (empty: not priced). Billed for the allocation's time only, from the job's start (a queued job costs "
        "nothing). The planner never rents it: a worker in a Slurm job declares it (FT_RENTAL_MODE=slurm, the default "
        "there).",
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
    max_gpus: int = Field(
        default=1,
        ge=1,
        description="The most GPUs of this offering one run may rent: GPUs a host x hosts linked by a fast fabric "
        "(NVLink within a host, InfiniBand/EFA between hosts). 1: single-GPU runs only.",
    )
    memory_share: float = Field(
        default=1.0,
        gt=0,
        le=1,
        description="Share of ``vram_gib`` the GPU may use: 1 for a GPU's own memory; a Mac's unified memory is shared "
        "with macOS, and Metal lets the GPU wire about 3/4 of it by default.",
    )
    unified_memory: bool = Field(
        default=False,
        description="A Mac (Apple silicon): memory shared by CPU and GPU, trained with the MLX backend; owned, so "
        "never preempted (no spot restarts) and priced at the amortized rate you set (mac_usd_per_h).",
    )
    note: str = Field(default="", description="Where the numbers come from; shown next to the plan.")
    accelerator: str = Field(
        default="",
        description="The card's name in SkyPilot's catalog (e.g. 'A10G', 'A100-80GB'): what the SkyPilot gpu pool "
        "rents for this offering. Empty: not rentable through SkyPilot.",
    )

    def usd_per_hour(self, mode: RentalMode) -> float | None:
        """The hourly price in a rental mode; None when the offering has no price in that mode."""
        return {"on_demand": self.on_demand_usd_per_h, "spot": self.spot_usd_per_h, "slurm": self.slurm_usd_per_h}[mode]


def _packaged(section: str, prefix: str = "") -> tuple[GpuOffering, ...]:
    """The offerings of a section of the price list shipped next to this module (``gpu_offerings.yaml``), in order."""
    text = (resources.files(__package__) / "gpu_offerings.yaml").read_text(encoding="utf-8")
    return tuple(GpuOffering(name=prefix + name, **fields) for name, fields in yaml.safe_load(text)[section].items())


DEFAULT_OFFERINGS: tuple[GpuOffering, ...] = _packaged("offerings")
MAC_PREFIX = "mac-"  # a Mac's offering name: mac-<tier>
MACS: dict[str, GpuOffering] = {o.name.removeprefix(MAC_PREFIX): o for o in _packaged("macs", MAC_PREFIX)}


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
    prices: str = Field(
        default="gpu_offerings.yaml: list prices seen in 2024-2025, shipped with ft-assets",
        description="Where the offerings' prices come from; the plan repeats it.",
    )
    prices_fetched_at: float | None = Field(
        default=None,
        description="When those prices were fetched (Unix time; the oldest catalog file). Empty: a fixed list.",
    )
    mac: str | None = Field(
        default=None,
        description=f"Your Mac, by its unified-memory tier ({', '.join(MACS)}): planned beside the rented GPUs as the "
        f"offering {MAC_PREFIX}<tier>, so a plan says whether the run fits on it or must rent. Empty: no Mac.",
    )
    mac_usd_per_h: float = Field(
        default=0.0, ge=0, description="What an hour of your Mac costs you, amortized (0: it is paid for)."
    )

    @model_validator(mode="before")
    @classmethod
    def _with_the_mac(cls, data: Any) -> Any:
        """The named Mac as one more offering, at ``mac_usd_per_h`` in both rental modes (it is never preempted)."""
        if not isinstance(data, dict) or not data.get("mac"):
            return data
        tier = data["mac"]
        if tier not in MACS:
            raise ValueError(f"mac {tier!r} is not a Mac tier of gpu_offerings.yaml; choose one of {', '.join(MACS)}")
        rate = data.get("mac_usd_per_h", 0.0)
        mac = MACS[tier].model_copy(update={"on_demand_usd_per_h": rate, "spot_usd_per_h": rate})
        offerings = [o for o in data.get("offerings", DEFAULT_OFFERINGS) if _name(o) != mac.name]
        return {**data, "offerings": (*offerings, mac)}

    @model_validator(mode="after")
    def _unique_offerings(self) -> CostModel:
        if not self.offerings:
            raise ValueError("the cost model has no GPU offerings; keep or define at least one")
        names = [o.name for o in self.offerings]
        duplicated = sorted({n for n in names if names.count(n) > 1})
        if duplicated:
            raise ValueError(f"offering names must be unique; duplicated: {duplicated}")
        return self

    def with_mac(self, tier: str | None, usd_per_h: float = 0.0) -> CostModel:
        """This cost model with your Mac (``tier`` of ``MACS``) among the offerings, or none (``tier`` None)."""
        rented = [o for o in self.offerings if not o.unified_memory]
        return CostModel.model_validate({**dict(self), "offerings": rented, "mac": tier, "mac_usd_per_h": usd_per_h})

    def offering(self, name: str) -> GpuOffering:
        for candidate in self.offerings:
            if candidate.name == name:
                return candidate
        known = ", ".join(o.name for o in self.offerings)
        raise KeyError(f"no GPU offering named {name!r} in the cost model; known: {known}")

    def offering_for_card(self, name: str, mib: int) -> GpuOffering:
        """The offering of a card as ``nvidia-smi`` names it, with its memory in MiB (``NVIDIA A100-SXM4-80GB``, 81920:
        ``a100-80gb``): the same model (RTX 4090, A100, H100, L4, ...) and memory within 15%; a KeyError says why none."""
        model, gib = card_model(name), mib / 1024
        fits = [o for o in self.offerings if not o.unified_memory and model and card_model(o.gpu) == model
                and abs(o.vram_gib - gib) <= 0.15 * o.vram_gib]  # fmt: skip
        if not fits:
            raise KeyError(
                f"the host's card {name} ({gib:.0f} GiB) is no GPU offering of the cost model: add one (FT_COST_MODEL) "
                "or name the offering to plan and bill it as with gpu="
            )
        return min(fits, key=lambda o: abs(o.vram_gib - gib))

    def mfu(self, method: str) -> float:
        """Assumed hardware FLOPs utilization of a fine-tuning method ('full', 'lora' or 'qlora')."""
        try:
            return {"full": self.mfu_full, "lora": self.mfu_lora, "qlora": self.mfu_qlora}[method]
        except KeyError:
            raise ValueError(f"unknown method {method!r}: use 'full', 'lora' or 'qlora'") from None


CARD_MODEL = re.compile(r"\b(RTX\s*(?:PRO\s*)?\d{4}\w*|[A-Z]{1,2}\d{1,4}[A-Z]?)\b", re.IGNORECASE)


def card_model(name: str) -> str:
    """A card's model in its name, whoever wrote it: ``NVIDIA GeForce RTX 4090`` and ``RTX 4090``: RTX4090;
    ``NVIDIA A100-SXM4-80GB`` and ``NVIDIA A100 80GB``: A100; "" when there is none."""
    cleaned = re.sub(r"\b(NVIDIA|GeForce|Tesla|Quadro)\b", " ", name, flags=re.IGNORECASE)
    found = CARD_MODEL.search(cleaned)
    return re.sub(r"\s+", "", found.group(1)).upper() if found else ""


def _name(offering: GpuOffering | dict) -> str:
    return offering.name if isinstance(offering, GpuOffering) else offering.get("name", "")


class CostModelError(ValueError):
    """A cost-model YAML file is unreadable or invalid; the message names the file, line and key."""


OFFERING_FIELDS = tuple(GpuOffering.model_fields)
TOP_LEVEL_FIELDS = (*CostModel.model_fields, "market")  # market: ft_assets.control.market's settings


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
    base = DEFAULT_OFFERINGS
    market = values.pop("market", None)
    if market is not None:  # offerings priced from SkyPilot's catalog instead of the shipped list
        try:
            offerings, source = market_offerings(market, DEFAULT_OFFERINGS)
            base = tuple(GpuOffering(**fields) for fields in offerings)
            values = {**source, **values}
        except MarketError as exc:
            problem(("market", *exc.key), str(exc))
    offering_names: list[str] = []
    if "offerings" in values or base is not DEFAULT_OFFERINGS:
        merged = _merge_offerings(values.get("offerings") or {}, problem, base)
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


def _merge_offerings(raw: Any, problem, base: tuple[GpuOffering, ...] = DEFAULT_OFFERINGS) -> list[dict]:
    """``base`` offerings (the defaults) as dicts, with the YAML mapping name -> fields | null applied in order."""
    if not isinstance(raw, dict):
        problem(("offerings",), f"expected a mapping of offering name to fields (or null), got {_kind(raw)}")
        return []
    merged = {o.name: o.model_dump() for o in base}
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
