"""The run configs in ``examples/``: ``ft-assets run`` accepts each, ``ft-assets plan --config`` plans each with no
weights (the model's shipped config.json), the plan fits the card the example is for, and the peak, the dollars and
the tier its comment quotes are what the planner says now, so the comments cannot drift from the code.

After a change to the planner or the price list, rerun ``ft-assets plan --config examples/<name>.yaml`` and copy its
figures into the comment's ``Plan:`` line.
"""

from __future__ import annotations

import json
import re
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from ft_assets.cli import main
from ft_assets.cli.run import JOBS
from ft_assets.cli.run_config import config_mistakes, load_run_config
from ft_assets.control.cost_model import CostModel
from ft_assets.control.shipped_configs import FOLDER, shipped_config
from ft_assets.training.grpo import VLLM_MEMORY_FRACTION

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SBATCH = EXAMPLES / "slurm-pipeline.sbatch"

# example: (GiB of its card the training may take, GPUs): the card each example's comment names
CARDS = {
    "qwen2.5-7b-qlora-24gb.yaml": (24, 1),
    "qwen2.5-vl-7b-qlora-24gb.yaml": (24, 1),
    "llama3.1-8b-lora-48gb.yaml": (48, 1),
    "qwen3-14b-qlora.yaml": (24, 1),
    "gemma3-12b-lora.yaml": (40, 1),
    "mistral-nemo-12b-qlora.yaml": (24, 1),
    "llama3.1-8b-dpo-qlora.yaml": (24, 1),
    "qwen2.5-7b-grpo.yaml": (80 * (1 - VLLM_MEMORY_FRACTION), 1),  # the colocated vLLM engine takes its share
    "llama3.3-70b-qlora-80gb.yaml": (80, 1),
}  # fmt: skip
PLAN_LINE = re.compile(
    r"^# Plan: peak (?P<gib>\d+\.\d) GiB; ~\$(?P<usd>[\d,]+\.\d\d) for (?P<tokens>[\d,]+) trained tokens on "
    r"(?:(?P<gpus>\d+) x )?(?P<tier>\S+) (?P<mode>spot|on_demand)\b",
    re.MULTILINE,
)


def test_every_example_names_its_card():
    """A new example gets a row in CARDS, so its card is checked too."""
    assert sorted(path.name for path in EXAMPLES.glob("*.yaml")) == sorted(CARDS)


@pytest.fixture(scope="module")
def jobs():
    from ft_assets.definitions import defs

    return [defs.resolve_job_def(name) for name in JOBS.values()]


@pytest.mark.parametrize("name", sorted(CARDS))
def test_the_example_is_a_run_config_ft_assets_run_accepts(name, jobs):
    run_config = load_run_config(str(EXAMPLES / name))
    assert config_mistakes(jobs, run_config) == []
    assert shipped_config(run_config["ops"]["base_model"]["config"]["source"]) is not None


@pytest.mark.parametrize("name", sorted(CARDS))
def test_the_example_fits_its_card_and_its_comment_says_what_the_planner_says(name, capsys, monkeypatch):
    monkeypatch.delenv("FT_COST_MODEL", raising=False)  # the shipped price list, as the comment quotes it
    text = (EXAMPLES / name).read_text()
    said = PLAN_LINE.search(text)
    assert said, f"{name}: no '# Plan: peak X GiB; ~$Y for N trained tokens on TIER spot' line"
    tokens = said["tokens"].replace(",", "")
    assert main(["plan", "--config", str(EXAMPLES / name), "--tokens", tokens, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    card_gib, gpus = CARDS[name]
    assert plan["model"] == yaml.safe_load(text)["ops"]["base_model"]["config"]["source"]  # the shipped config.json
    assert plan["gpus"] == gpus and plan["total_gib"] <= card_gib * (1 - CostModel().vram_headroom)
    assert said["gib"] == f"{plan['total_gib']:.1f}", f"{name}: the comment's peak is not the planner's"
    assert said["usd"] == f"{plan['est_cost_usd']:,.2f}", f"{name}: the comment's cost is not the planner's"
    assert (said["tier"], int(said["gpus"] or 1), said["mode"]) == (plan["tier"], plan["gpus"], plan["rental_mode"])
    assert f"--config examples/{name}" in text.split("\nops:")[0]  # the comment says how to run it


def test_the_shipped_configs_are_package_data():
    """An installed ft-assets plans the examples too: its wheel holds the config.json files."""
    pyproject = tomllib.loads((EXAMPLES.parent / "pyproject.toml").read_text())
    assert f"{FOLDER.name}/*.json" in pyproject["tool"]["setuptools"]["package-data"]["ft_assets.control"]


def test_a_model_without_a_shipped_config_is_refused_saying_how_to_pass_one(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"ops": {"base_model": {"config": {"source": "acme/unknown-7b"}}}}))
    assert main(["plan", "--config", str(config)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "no config.json ships for 'acme/unknown-7b'" in line and "--model-config PATH" in line


def test_the_command_line_overrides_the_run_config(capsys):
    example = str(EXAMPLES / "qwen2.5-7b-qlora-24gb.yaml")
    argv = ["plan", "--config", example, "--method", "lora", "--seq-len", "1024", "--batch", "1",
            "--no-gradient-checkpointing", "--json"]  # fmt: skip
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (plan["method"], plan["seq_len"], plan["micro_batch"], plan["grad_checkpointing"]) == (
        "lora",
        1024,
        1,
        False,
    )


def test_the_sbatch_script_parses_and_runs_an_example_that_exists():
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)
    (config,) = re.findall(r"^CONFIG=\$\{CONFIG:-(\S+)\}$", SBATCH.read_text(), re.MULTILINE)
    assert (EXAMPLES.parent / config).is_file() and Path(config).name in CARDS
    assert re.search(r'^srun .* run --dataset "\$DATASET" --config "\$CONFIG"', SBATCH.read_text(), re.MULTILINE)


def test_the_docs_table_of_examples_quotes_each_examples_comment():
    """docs/get-started/first-rented-gpu.md lists every example with the peak and the dollars of its ``Plan:`` line."""
    page = (EXAMPLES.parent / "docs" / "get-started" / "first-rented-gpu.md").read_text()
    for name in CARDS:
        said = PLAN_LINE.search((EXAMPLES / name).read_text())
        row = next((line for line in page.splitlines() if line.startswith(f"| `{name}` |")), None)
        assert row, f"the docs' table of examples has no row for {name}"
        assert f"| {said['gib']} GiB" in row and f"| ${said['usd']} ({said['tier']}) |" in row, row
