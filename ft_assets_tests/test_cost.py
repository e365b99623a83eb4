"""Cost model: defaults, YAML overrides and their errors, ETH arithmetic, cost_report aggregation."""

import tomllib
from importlib import resources
from pathlib import Path

import pytest
from pydantic import ValidationError

from ft_assets.control.cost_model import (
    DEFAULT_OFFERINGS,
    CostModel,
    CostModelError,
    load_cost_model,
)
from ft_assets.control.cost_report import CostRecord, aggregate_cost_report
from ft_assets.control.eth import RunMeasurements, compute_eth

GB = 10**9
ROOT = Path(__file__).resolve().parents[1]
PRICE_LIST = resources.files("ft_assets.control") / "gpu_offerings.yaml"


def test_defaults_cover_24_40_80_gb_tiers_with_sources():
    model = load_cost_model(None)
    assert {o.vram_gib for o in model.offerings} == {24, 40, 80}
    assert {"a10g-24gb", "l4-24gb", "rtx4090-24gb", "a100-40gb", "a100-80gb", "h100-80gb"} == {
        o.name for o in model.offerings
    }
    assert all(o.note and o.spot_usd_per_h < o.on_demand_usd_per_h for o in DEFAULT_OFFERINGS)
    a10g = model.offering("a10g-24gb")
    assert (a10g.spot_usd_per_h, a10g.on_demand_usd_per_h) == (0.60, 1.50)  # seed quotes
    assert model.offering("a100-80gb").on_demand_usd_per_h == 2.50
    assert (model.storage_usd_per_gb_month, model.egress_usd_per_gb) == (0.023, 0.09)
    with pytest.raises(KeyError, match="no GPU offering named 'v100'.*known: rtx4090-24gb"):
        model.offering("v100")
    with pytest.raises(ValueError, match="unknown method 'dora'"):
        model.mfu("dora")


def test_price_list_ships_in_the_wheel():
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert PRICE_LIST.name in package_data["ft_assets.control"]


def test_the_cost_pages_offerings_table_is_the_price_list():
    header = "| offering | VRAM GiB | on-demand $/h | spot $/h | Slurm $/GPU-h |\n|---|---|---|---|---|\n"
    parts = (ROOT / "docs" / "deploy" / "cost.md").read_text().split(header)
    assert len(parts) == 2, "docs/deploy/cost.md has no offerings table"
    table = parts[1].split("\n\n")[0].splitlines()
    expected = [
        f"| {o.name} | {o.vram_gib:g} | {o.on_demand_usd_per_h:.2f} | {o.spot_usd_per_h:.2f} | "
        f"{'–' if o.slurm_usd_per_h is None else f'{o.slurm_usd_per_h:.2f}'} |"
        for o in DEFAULT_OFFERINGS
    ]
    assert table == expected


def test_override_example_in_the_price_list_header_loads(tmp_path):
    example = [line.removeprefix("#   ") for line in PRICE_LIST.read_text().splitlines() if line.startswith("#   ")]
    model = load_cost_model(write(tmp_path, "\n".join(example)))
    assert model.egress_usd_per_gb == 0.0 and model.offering("a10g-24gb").spot_usd_per_h == 0.45
    kept = [o.name for o in DEFAULT_OFFERINGS if o.name != "h100-80gb"]
    assert [o.name for o in model.offerings] == kept + ["l40s-48gb"]


# --- ETH arithmetic ------------------------------------------------------------------------------

# eth.py's docstring example: A10G spot, 2.5 h wall over one restart, 2.0 h in optimizer steps,
# 10 GB of checkpoints kept 73 h (a tenth of a 730-hour month), 5 GB egress, 30M tokens.
EXAMPLE = RunMeasurements(
    gpu_tier="a10g-24gb",
    rental_mode="spot",
    wall_seconds=9000,
    step_seconds=7200,
    restarts=1,
    tokens_trained=30_000_000,
    checkpoint_bytes=10 * GB,
    checkpoint_retention_hours=73,
    egress_bytes=5 * GB,
)


def test_eth_from_step_time_when_no_nvml():
    report = compute_eth(EXAMPLE)
    assert report.compute_usd == pytest.approx(0.60 * 2.5)  # 1.50
    assert report.storage_usd == pytest.approx(10 * 0.1 * 0.023)  # 0.023
    assert report.egress_usd == pytest.approx(5 * 0.09)  # 0.45
    assert report.total_usd == pytest.approx(1.973)
    assert (report.utilization, report.utilization_source) == (pytest.approx(0.8), "step_time")
    assert report.effective_hours == pytest.approx(2.0)
    assert report.eth_usd_per_hour == pytest.approx(0.9865)  # 1.973 / 2.0
    assert report.idle_share == pytest.approx(0.2)
    assert report.usd_per_million_tokens == pytest.approx(1.973 / 30)
    assert (report.restarts, report.wall_hours, report.step_hours) == (1, 2.5, 2.0)


def test_eth_uses_nvml_utilization_when_measured():
    report = compute_eth(EXAMPLE.model_copy(update={"gpu_utilization": 0.5}))
    assert (report.utilization, report.utilization_source) == (0.5, "nvml")
    assert report.effective_hours == pytest.approx(1.25)  # 2.5 h x 0.5
    assert report.eth_usd_per_hour == pytest.approx(1.973 / 1.25)  # 1.5784
    assert report.idle_share == pytest.approx(0.2)  # idle share stays time-based


def test_eth_on_demand_rate_and_explicit_offering():
    on_demand = EXAMPLE.model_copy(update={"rental_mode": "on_demand", "egress_bytes": 0, "checkpoint_bytes": 0})
    model = CostModel()
    report = compute_eth(on_demand, model.offering("a10g-24gb"), "on_demand", model)
    assert (report.usd_per_hour, report.total_usd) == (1.50, pytest.approx(3.75))
    assert report.eth_usd_per_hour == pytest.approx(3.75 / 2.0)


def test_a_slurm_allocation_bills_its_gpu_hours_at_the_slurm_rate():
    """Two A100 80GB GPUs of a Slurm job for 1.5 h (from the job's start; its queue time is not measured) at the
    packaged $1.00/GPU-h; an offering without a Slurm rate refuses to price it, naming the key."""
    slurm = RunMeasurements(gpu_tier="a100-80gb", rental_mode="slurm", wall_seconds=5400, step_seconds=4320, gpus=2)
    report = compute_eth(slurm)
    assert (report.usd_per_hour, report.compute_usd, report.rental_mode) == (2.00, pytest.approx(3.00), "slurm")
    assert report.eth_usd_per_hour == pytest.approx(3.00 / 1.2)  # 1.5 h x 0.8 in steps
    with pytest.raises(ValueError, match="a10g-24gb has no slurm price; add slurm_usd_per_h to the cost model"):
        compute_eth(slurm.model_copy(update={"gpu_tier": "a10g-24gb"}))


def test_eth_refuses_pricing_a_run_as_another_tier_or_without_spot_price():
    model = CostModel()
    with pytest.raises(ValueError, match="measured on a10g-24gb \\(spot\\) but priced as l4-24gb \\(spot\\)"):
        compute_eth(EXAMPLE, model.offering("l4-24gb"), "spot", model)
    no_spot = model.model_copy(
        update={"offerings": (model.offering("a10g-24gb").model_copy(update={"spot_usd_per_h": None}),)}
    )
    with pytest.raises(ValueError, match="a10g-24gb has no spot price"):
        compute_eth(EXAMPLE, cost_model=no_spot)


def test_eth_of_a_run_that_never_stepped():
    died = RunMeasurements(gpu_tier="a100-80gb", rental_mode="spot", wall_seconds=600, step_seconds=0)
    report = compute_eth(died)
    assert report.total_usd == pytest.approx(1.25 / 6) and report.eth_usd_per_hour is None
    assert report.idle_share == 1.0 and report.usd_per_million_tokens is None
    empty = compute_eth(RunMeasurements(gpu_tier="a100-80gb", rental_mode="spot", wall_seconds=0, step_seconds=0))
    assert (empty.total_usd, empty.idle_share, empty.eth_usd_per_hour) == (0, 0.0, None)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"step_seconds": 9001}, "step_seconds \\(9001.0\\) exceeds wall_seconds \\(9000.0\\)"),
        ({"gpu_utilization": 1.5}, "gpu_utilization"),
        ({"rental_mode": "reserved"}, "rental_mode"),
        ({"restarts": -1}, "restarts"),
    ],
)
def test_measurements_are_validated(fields, message):
    with pytest.raises(ValidationError, match=message):
        RunMeasurements.model_validate({**EXAMPLE.model_dump(), **fields})


# --- cost_report -----------------------------------------------------------------------------------


def run(version, run_id, wall_h, step_h, estimated_usd=None, tier="a10g-24gb", mode="spot", **extra):
    measured = RunMeasurements(
        gpu_tier=tier, rental_mode=mode, wall_seconds=wall_h * 3600, step_seconds=step_h * 3600, **extra
    )
    return CostRecord(version, run_id, compute_eth(measured), estimated_usd, None if estimated_usd is None else wall_h)


def test_cost_report_aggregates_per_dataset_version():
    records = [
        run("chats@v2", "r3", 1.0, 1.0, estimated_usd=0.50, tokens_trained=1_000_000),  # $0.60, no idle
        run("chats@v1", "r1", 2.0, 1.0, estimated_usd=1.00, restarts=2),  # $1.20, half idle
        run("chats@v1", "r2", 2.0, 1.5, egress_bytes=10 * GB),  # $1.20 + $0.90 egress, no estimate
    ]
    report = aggregate_cost_report(records)
    v1, v2 = report.rows
    assert (v1.dataset_version, v1.runs, v1.restarts) == ("chats@v1", 2, 2)
    assert v1.actual_usd == pytest.approx(1.20 + 1.20 + 0.90)
    assert v1.estimated_usd == 1.00 and v1.estimated_hours == 2.0
    assert v1.actual_vs_estimate == pytest.approx(1.20 / 1.00)  # only the run that had an estimate
    assert v1.effective_hours == pytest.approx(2.5)
    assert v1.eth_usd_per_hour == pytest.approx(3.30 / 2.5)  # hour-weighted, not the mean of 1.2 and 1.4
    assert v1.idle_share == pytest.approx(1 - 2.5 / 4.0)
    assert v2.actual_vs_estimate == pytest.approx(0.60 / 0.50) and v2.usd_per_mtok_actual == pytest.approx(0.60)

    total = report.total
    assert (total.runs, total.restarts, total.wall_hours, total.step_hours) == (3, 2, 5.0, 3.5)
    assert total.actual_usd == pytest.approx(3.90) and total.estimated_usd == pytest.approx(1.50)
    assert total.actual_vs_estimate == pytest.approx(1.80 / 1.50)
    assert total.eth_usd_per_hour == pytest.approx(3.90 / 3.5) and total.idle_share == pytest.approx(0.3)

    rows = report.table_rows()
    assert rows[0] == {
        "dataset_version": "chats@v1", "runs": 2, "restarts": 2, "estimate_usd": 1.0, "actual_usd": 3.3, "actual_vs_estimate": 1.2,
        "eth_usd_per_hour": 1.32, "idle_share": 0.375, "usd_per_mtok_actual": None,
    }  # fmt: skip
    assert [rows[-1][k] for k in ("dataset_version", "runs", "restarts", "estimate_usd", "actual_usd")] == [
        "(all)",
        3,
        2,
        1.5,
        3.9,
    ]
    assert v1.as_dict()["eth_usd_per_hour"] == pytest.approx(1.32)


def test_cost_report_of_no_estimates_and_no_runs():
    report = aggregate_cost_report([run("x@1", "r", 1.0, 0.5)])
    assert report.total.estimated_usd is None and report.total.actual_vs_estimate is None
    empty = aggregate_cost_report([])
    assert empty.rows == () and empty.total.runs == 0 and empty.total.eth_usd_per_hour is None


# --- YAML overrides ----------------------------------------------------------------------------------


def write(tmp_path, text):
    path = tmp_path / "cost.yaml"
    path.write_text(text)
    return path


def test_yaml_overrides_prices_adds_and_removes_offerings(tmp_path):
    path = write(
        tmp_path,
        """
egress_usd_per_gb: 0.0
mfu_lora: 0.3
offerings:
  a10g-24gb: {on_demand_usd_per_h: 1.21, spot_usd_per_h: null}
  l40s-48gb:
    gpu: NVIDIA L40S
    vram_gib: 48
    on_demand_usd_per_h: 1.0
    region: eu-west-1
    bf16_tflops: 362
  h100-80gb: null
""",
    )
    model = load_cost_model(path)
    assert (model.egress_usd_per_gb, model.mfu("lora"), model.storage_usd_per_gb_month) == (0.0, 0.3, 0.023)
    a10g = model.offering("a10g-24gb")
    assert (a10g.on_demand_usd_per_h, a10g.spot_usd_per_h, a10g.vram_gib) == (1.21, None, 24)
    l40s = model.offering("l40s-48gb")
    assert (l40s.vram_gib, l40s.spot_usd_per_h, l40s.mfu_scale, l40s.region) == (48, None, 1.0, "eu-west-1")
    assert "h100-80gb" not in {o.name for o in model.offerings} and len(model.offerings) == 6
    assert load_cost_model(write(tmp_path, "# nothing overridden\n")) == CostModel()


@pytest.mark.parametrize(
    "text, message",
    [
        ("storage_usd_per_gb: 0.02\n", r"cost.yaml:1: storage_usd_per_gb: unknown key; known keys: offerings, "),
        (
            "egress_usd_per_gb: 0.01\nmfu_qlora: lots\n",
            r"cost.yaml:2: mfu_qlora: Input should be a valid number.*\(got 'lots'\)",
        ),
        ("mfu_full: 1.5\n", r"cost.yaml:1: mfu_full: Input should be less than or equal to 1"),
        (
            "offerings:\n  a10g-24gb:\n    vram_gib: -24\n",
            r"cost.yaml:3: offerings.a10g-24gb.vram_gib: Input should be greater than 0 \(got -24\)",
        ),
        (
            "offerings:\n  a10g-24gb:\n    price: 1.0\n",
            r"cost.yaml:3: offerings.a10g-24gb.price: unknown key; an offering has: name, gpu, vram_gib",
        ),
        (
            "offerings:\n  l40s-48gb: {gpu: L40S, vram_gib: 48}\n",
            r"cost.yaml:2: offerings.l40s-48gb: new offering misses on_demand_usd_per_h, region, bf16_tflops",
        ),
        ("offerings:\n  a10g-24gb: 1.5\n", r"cost.yaml:2: offerings.a10g-24gb: expected a mapping of fields or null"),
        ("offerings:\n  - a10g-24gb\n", r"cost.yaml:1: offerings: expected a mapping of offering name to fields"),
        (
            "offerings:\n" + "".join(f"  {o.name}: null\n" for o in DEFAULT_OFFERINGS),
            r"cost.yaml:1: offerings: .*no GPU offerings",
        ),
        ("- 1\n- 2\n", r"cost.yaml: expected a mapping of keys"),
        ("egress_usd_per_gb: [0.09\n", r"cost.yaml:2: not valid YAML"),
    ],
)
def test_yaml_errors_name_the_file_line_and_key(tmp_path, text, message):
    with pytest.raises(CostModelError, match=message):
        load_cost_model(write(tmp_path, text))


def test_yaml_reports_every_problem_at_once(tmp_path):
    path = write(tmp_path, "egress: 1\noffering: {}\n")
    with pytest.raises(CostModelError) as caught:
        load_cost_model(path)
    assert "cost.yaml:1: egress: unknown key" in str(caught.value)
    assert "cost.yaml:2: offering: unknown key" in str(caught.value)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(CostModelError, match=r"nope.yaml: cannot read the cost model file"):
        load_cost_model(tmp_path / "nope.yaml")
