"""Prices from the market: SkyPilot's catalog as the cost model's GPU offerings (on-demand and spot, per cloud).

The shipped ``gpu_offerings.yaml`` is list prices seen in 2024-2025: the planner's "cheapest fitting
tier" is only as good as that guess. SkyPilot keeps a catalog of every offering it can launch (an
instance type, its accelerators, region, on-demand and spot $/h), refreshed from its hosted copy every
few hours (RunPod's every 7 h, AWS's every 7 h) and cached under ``~/.sky/catalogs/``. A cost-model file
with a ``market`` key takes the offerings from it instead::

    # cost.yaml (FT_COST_MODEL or the assets' cost_model_path)
    market:
      clouds: [runpod, vast, lambda, aws]      # SkyPilot's cloud names
      regions: {aws: [us-east-1, us-west-2]}    # optional: only these regions of a cloud
    offerings:                                  # optional: overrides on top, as on the shipped list
      a100-80gb@runpod: {mfu_scale: 0.9}

Each (cloud, accelerator) becomes one offering, ``<accelerator>@<cloud>`` (``a100-80gb@runpod``): its
cheapest region's on-demand price per GPU (an instance's price over its GPU count), the cheapest spot
price of those regions, the card's memory from the catalog and ``max_gpus`` the most GPUs one of its
instances has. The catalog has no FLOPS: the dense bf16 peak (and ``mfu_scale``) comes from the shipped
offering of the same card, else from ``BF16_TFLOPS`` (datasheets); a card with neither (T4 and V100 have
no bf16 tensor cores) is left out, and the plan's price source says which. The plan records the source
and the catalog files' age (``prices``, ``prices_fetched_at`` on the cost model), so an estimate made
from a week-old catalog says so.

The catalog is read through SkyPilot's own ``sky.catalog.list_accelerators`` in its venv
(``sdk_venv``): one process a cost-model load, 8-11 s on this loaded machine. Without SkyPilot's venv, or
offline with no cached catalog, the file fails to load with that reason; the shipped list needs neither.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from ft_assets.providers import sdk_venv

# Dense bf16 tensor TFLOPS (sparsity halved away) of cards the shipped list does not carry, from NVIDIA's
# datasheets; keyed by SkyPilot's accelerator names.
BF16_TFLOPS: dict[str, float] = {
    "A10": 125.0,  # A10 datasheet: 250 with sparsity
    "A40": 149.7,  # A40 datasheet: 299.4 with sparsity
    "A6000": 154.8,  # RTX A6000 datasheet: 309.7 with sparsity
    "L40": 181.0,  # L40 datasheet: 362 with sparsity
    "L40S": 362.0,  # L40S datasheet: 733 with sparsity
    "RTX3090": 71.0,  # GA102 whitepaper: bf16 with fp32 accumulate, dense
    "RTX6000-Ada": 364.2,  # RTX 6000 Ada datasheet: 728.5 with sparsity
    "H100-SXM": 989.0,  # H100 SXM datasheet
    "H200": 989.0,  # H200 datasheet: the H100's tensor cores, more and faster memory
    "B200": 2250.0,  # B200 datasheet: 4.5 PFLOPS with sparsity
}


class MarketError(ValueError):
    """The ``market`` settings are wrong or the catalog cannot be read; ``key`` is where under ``market``."""

    def __init__(self, message: str, key: tuple[str, ...] = ()):
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class Market:
    """Which part of SkyPilot's catalog the planner may rent from."""

    clouds: tuple[str, ...]
    regions: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # cloud -> allowed regions; absent: all
    python: str | None = None  # the SDKs' python; None: $FT_SKYPILOT_PYTHON

    @classmethod
    def parse(cls, raw: Any) -> Market:
        if not isinstance(raw, Mapping):
            raise MarketError(f"expected a mapping with clouds (and regions, python), got {type(raw).__name__}")
        unknown = set(raw) - {"clouds", "regions", "python"}
        if unknown:
            raise MarketError("unknown key; market has clouds, regions, python", (sorted(unknown)[0],))
        clouds = raw.get("clouds")
        if not clouds or not isinstance(clouds, list) or not all(isinstance(c, str) for c in clouds):
            raise MarketError("a list of SkyPilot cloud names, e.g. [runpod, vast, lambda, aws]", ("clouds",))
        regions = raw.get("regions") or {}
        if not isinstance(regions, Mapping) or not all(isinstance(v, list) for v in regions.values()):
            raise MarketError("a mapping of cloud to a list of its regions, e.g. {aws: [us-east-1]}", ("regions",))
        stray = set(regions) - set(clouds)
        if stray:
            raise MarketError(f"regions of {sorted(stray)}, which are not in clouds", ("regions",))
        return cls(
            tuple(c.lower() for c in clouds), {c.lower(): tuple(r) for c, r in regions.items()}, raw.get("python")
        )


def market_offerings(
    raw: Any, shipped: Iterable[Any], now: float | None = None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The catalog's offerings for the ``market`` settings ``raw`` (``GpuOffering`` fields; ``shipped``: the packaged
    offerings, whose cards lend their bf16 TFLOPS), and the cost model's ``prices`` / ``prices_fetched_at`` saying
    where they come from; raises ``MarketError``."""
    market = Market.parse(raw)
    try:
        catalog = sdk_venv.call("sky.catalog", {"clouds": list(market.clouds)}, python=market.python)
    except sdk_venv.SdkError as exc:
        raise MarketError(f"cannot read SkyPilot's catalog: {exc}") from None
    offerings, skipped = offerings_from_catalog(catalog["rows"], shipped, market.regions)
    if not offerings:
        raise MarketError(f"SkyPilot's catalog has no priced GPU of {', '.join(market.clouds)}", ("clouds",))
    fetched = [t for t in catalog["fetched_at"].values() if t is not None]
    oldest = min(fetched) if fetched else None
    return offerings, {
        "prices": describe_source(catalog["schema"], market, oldest, skipped, now),
        "prices_fetched_at": oldest,
    }


def offerings_from_catalog(
    rows: Iterable[Mapping[str, Any]], shipped: Iterable[Any], regions: Mapping[str, tuple[str, ...]] = {}
) -> tuple[list[dict[str, Any]], tuple[str, ...]]:
    """One offering (``GpuOffering``'s fields) per (cloud, accelerator) of the catalog's rows (``InstanceTypeInfo``
    fields), and the accelerators left out for want of a bf16 figure. ``shipped``: offerings whose card's TFLOPS,
    ``mfu_scale`` and name carry over."""
    shipped = {o.accelerator: o for o in shipped if o.accelerator}
    groups: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for row in rows:
        cloud = str(row["cloud"]).lower()
        allowed = regions.get(cloud)
        if allowed and row["region"] not in allowed:
            continue
        if _number(row.get("accelerator_count")) and _number(row.get("price")):
            groups.setdefault((cloud, row["accelerator_name"]), []).append(row)
    offerings, skipped = [], set()
    for (cloud, accelerator), group in sorted(groups.items()):
        known = shipped.get(accelerator)
        tflops = known.bf16_tflops if known else BF16_TFLOPS.get(accelerator)
        memory = next((_number(r.get("device_memory")) for r in group if _number(r.get("device_memory"))), None)
        if tflops is None or memory is None:
            skipped.add(accelerator)
            continue
        cheapest = min(group, key=lambda r: r["price"] / r["accelerator_count"])
        spots = [r["spot_price"] / r["accelerator_count"] for r in group if _number(r.get("spot_price"))]
        spot_region = min(group, key=lambda r: _per_gpu(r, "spot_price"))["region"] if spots else None
        region_count = len({r["region"] for r in group})
        offerings.append(
            dict(
                name=f"{accelerator.lower()}@{cloud}",
                gpu=known.gpu if known else accelerator,
                vram_gib=round(memory),
                on_demand_usd_per_h=round(cheapest["price"] / cheapest["accelerator_count"], 4),
                spot_usd_per_h=round(min(spots), 4) if spots else None,
                region=str(cheapest["region"]),
                bf16_tflops=tflops,
                mfu_scale=known.mfu_scale if known else 1.0,
                max_gpus=int(max(r["accelerator_count"] for r in group)),
                accelerator=accelerator,
                note=f"SkyPilot catalog, {cloud}: cheapest of {region_count} region(s) ({cheapest['region']}, "
                f"{cheapest['instance_type']})"
                + (f", spot cheapest in {spot_region}" if spots else ", no spot")
                + ("" if known else f"; {tflops:g} TFLOPS: ft-assets' datasheet table"),
            )
        )
    return offerings, tuple(sorted(skipped))


def describe_source(
    schema: str, market: Market, fetched_at: float | None, skipped: tuple[str, ...], now: float | None = None
) -> str:
    """'SkyPilot catalog v8 (runpod, vast), fetched 2026-11-30 10:00 UTC, 3.2 h old; left out (no bf16 TFLOPS): T4'."""
    when = "fetch time unknown"
    if fetched_at is not None:
        hours = ((now or time.time()) - fetched_at) / 3600
        when = f"fetched {datetime.fromtimestamp(fetched_at, timezone.utc):%Y-%m-%d %H:%M} UTC, {hours:.1f} h old"
    out = f"SkyPilot catalog {schema} ({', '.join(market.clouds)}), {when}"
    return out + (f"; left out (no bf16 TFLOPS on record): {', '.join(skipped)}" if skipped else "")


def _per_gpu(row: Mapping[str, Any], column: str) -> float:
    value = _number(row.get(column))
    return value / row["accelerator_count"] if value is not None else math.inf


def _number(value: Any) -> float | None:
    """A catalog cell as a number; None for empty or NaN (pandas' missing value)."""
    if value is None or isinstance(value, str):
        return None
    return None if math.isnan(float(value)) else float(value)
