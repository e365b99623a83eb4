"""Prices from SkyPilot's catalog (market.py): offerings per cloud and card, and a cost model that says where they
came from. The catalog is SkyPilot's own reader (``sky.catalog.list_accelerators``) over the files
``skypilot_env`` writes; the planner then plans on those offerings."""

import math
import time

import pytest

from ft_assets.control.cost_model import DEFAULT_OFFERINGS, CostModelError, GpuOffering, load_cost_model
from ft_assets.control.market import Market, describe_source, offerings_from_catalog
from ft_assets_tests.support import run_cli

pytest_plugins = ["ft_assets_tests.skypilot_env"]


def row(cloud, instance, name, count, price, spot, region, memory=24.0):
    return {"cloud": cloud, "instance_type": instance, "accelerator_name": name, "accelerator_count": count,
            "cpu_count": 8.0, "device_memory": memory, "memory": 32.0, "price": price, "spot_price": spot, "region": region}  # fmt: skip


ROWS = [
    row("RunPod", "1x_RTX4090_SECURE", "RTX4090", 1.0, 0.59, 0.29, "CA"),
    row("RunPod", "1x_RTX4090_SECURE", "RTX4090", 1.0, 0.69, 0.34, "US"),
    row("RunPod", "2x_RTX4090_SECURE", "RTX4090", 2.0, 1.10, 0.50, "US"),  # 0.55 a GPU: the cheapest
    row("Lambda", "gpu_1x_h100_pcie", "H100", 1.0, 2.49, math.nan, "us-east-1", 80.0),  # no spot on Lambda
    row("AWS", "g4dn.xlarge", "T4", 1.0, 0.526, 0.21, "us-east-1", 16.0),  # no bf16 tensor cores: left out
    row("AWS", "g5.xlarge", "A10G", 1.0, 1.006, 0.40, "us-east-1"),
    row("AWS", "g5.xlarge", "A10G", 1.0, 1.212, 0.45, "us-west-2"),
]


def offerings(rows, regions={}):
    found, skipped = offerings_from_catalog(rows, DEFAULT_OFFERINGS, regions)
    return [GpuOffering(**fields) for fields in found], skipped  # each a valid offering of the cost model


def test_one_offering_per_cloud_and_card_at_its_cheapest_per_gpu():
    found, skipped = offerings(ROWS)
    by_name = {o.name: o for o in found}
    assert sorted(by_name) == ["a10g@aws", "h100@lambda", "rtx4090@runpod"] and skipped == ("T4",)
    rtx = by_name["rtx4090@runpod"]
    assert (rtx.on_demand_usd_per_h, rtx.spot_usd_per_h, rtx.region, rtx.max_gpus) == (0.55, 0.25, "US", 2)
    assert (rtx.accelerator, rtx.vram_gib, rtx.bf16_tflops) == ("RTX4090", 24, 165.2)  # TFLOPS: the shipped card's
    assert rtx.note == "SkyPilot catalog, runpod: cheapest of 2 region(s) (US, 2x_RTX4090_SECURE), spot cheapest in US"
    h100 = by_name["h100@lambda"]
    assert h100.spot_usd_per_h is None and h100.mfu_scale == 0.7 and h100.note.endswith(", no spot")


def test_the_shipped_list_stays_the_offline_default():
    model = load_cost_model(None)
    assert model.prices == "gpu_offerings.yaml: list prices seen in 2024-2025, shipped with ft-assets"
    assert model.prices_fetched_at is None and {o.accelerator for o in model.offerings} >= {"A10G", "RTX4090", "H100"}


def test_regions_limit_a_cloud():
    found, _ = offerings(ROWS, {"aws": ("us-west-2",)})
    a10g = next(o for o in found if o.name == "a10g@aws")
    assert (a10g.on_demand_usd_per_h, a10g.region) == (1.212, "us-west-2")


def test_the_source_says_how_old_the_prices_are():
    market = Market(("runpod", "aws"))
    said = describe_source("v8", market, 1_796_000_000.0, ("T4",), now=1_796_000_000.0 + 5 * 3600)
    assert (
        said
        == "SkyPilot catalog v8 (runpod, aws), fetched 2026-11-30 00:53 UTC, 5.0 h old; left out (no bf16 TFLOPS on record): T4"
    )


@pytest.mark.parametrize(
    "text, message",
    [
        ("market: [runpod]\n", "market: expected a mapping with clouds"),
        ("market:\n  clouds: runpod\n", "2: market.clouds: a list of SkyPilot cloud names"),
        ("market:\n  clouds: [runpod]\n  regions: {aws: [us-east-1]}\n", "3: market.regions: regions of ['aws']"),
        ("market:\n  clouds: [runpod]\n  zones: [a]\n", "3: market.zones: unknown key"),
    ],
)
def test_wrong_market_settings_name_the_line(tmp_path, text, message):
    path = tmp_path / "cost.yaml"
    path.write_text(text)
    with pytest.raises(CostModelError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_cost_model(path)


@pytest.mark.integration
def test_a_cost_model_priced_from_skypilots_catalog(sky_env, tmp_path, tiny_model_dir, capsys):
    path = tmp_path / "cost.yaml"
    path.write_text(
        "market:\n  clouds: [runpod, lambda, aws]\n"
        "offerings:\n  rtx4090@runpod: {mfu_scale: 0.9}\n  h100@lambda: null\n"
    )
    started = time.time()
    model = load_cost_model(path)
    assert [o.name for o in model.offerings] == ["a10g@aws", "h100@runpod", "rtx4090@runpod"]  # h100@lambda removed
    rtx = model.offering("rtx4090@runpod")
    assert (rtx.on_demand_usd_per_h, rtx.spot_usd_per_h, rtx.region, rtx.mfu_scale, rtx.max_gpus) == (
        0.59,
        0.29,
        "CA",
        0.9,
        2,
    )
    assert model.prices.startswith("SkyPilot catalog v8 (runpod, lambda, aws), fetched ")
    assert model.prices.endswith("; left out (no bf16 TFLOPS on record): T4")
    assert started - 60 < model.prices_fetched_at <= time.time()  # the catalog files skypilot_env wrote

    # the planner on those offerings: the plan rents the catalog's cheapest fitting card and says where its prices came from
    code, plan, err = run_cli(capsys, "plan", "--model-config", str(tiny_model_dir), "--method", "lora", "--seq-len", "128",
                              "--cost-model", str(path), "--json")  # fmt: skip
    assert code == 0, err
    assert (plan["tier"], plan["rental_mode"], plan["usd_per_hour"]) == ("rtx4090@runpod", "spot", 0.29)
    assert plan["prices"].startswith("SkyPilot catalog v8 (runpod, lambda, aws), fetched ")


@pytest.mark.integration
def test_without_skypilot_the_market_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("FT_SKYPILOT_PYTHON", str(tmp_path / "no-such-python"))
    path = tmp_path / "cost.yaml"
    path.write_text("market:\n  clouds: [runpod]\n")
    with pytest.raises(
        CostModelError, match=r"cost.yaml:1: market: cannot read SkyPilot's catalog: SkyPilotNotInstalled"
    ):
        load_cost_model(path)
