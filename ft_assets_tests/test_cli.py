"""The command line itself: run-config mistakes as one-line user errors, a quiet run log, the packaged instance config.

- A run-config mistake at any depth (an asset name, a key inside an asset's or a resource's config,
  a value of the wrong type) is refused before anything is registered: exit 2, one line naming the
  asset or resource, the key path and the closest accepted key; with ``--json`` the failure object.
- ``ft-assets run`` prints its own lines only; ``--verbose`` keeps the libraries' progress bars and
  warnings (checked in a subprocess, as a user runs it: tqdm reads its switch when first imported).
- ``dagster.yaml`` ships in the package and is the only one (none at the top level, where ``dagster dev``
  would warn that it "will not be used").
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib.resources import files
from pathlib import Path

import pytest
import yaml

from ft_assets.cli.run import ensure_home
from ft_assets.cli.run_config import accepted_keys, config_mistakes, select_ops
from ft_assets.control.jobs import DATA_PLANE, TRAINING_PLANE
from ft_assets.definitions import defs
from ft_assets_tests.support import run_cli, run_config, write_dataset

REPO = Path(__file__).resolve().parents[1]

# (case, run config, what the one line must say); each is the only mistake in an otherwise valid config.
MISTAKES = [
    ("asset name", {"ops": {"lora_adaptr": {"config": {"max_steps": 3}}}},
     "no asset 'lora_adaptr'; did you mean 'lora_adapter'?"),
    ("key in lora_adapter", {"ops": {"lora_adapter": {"config": {"max_stepz": 3}}}},
     "asset lora_adapter: unknown key 'max_stepz' at ops.lora_adapter.config; did you mean 'max_steps'?"),
    ("moved objective setting", {"ops": {"lora_adapter": {"config": {"dpo_beta": 0.2}}}},
     "asset lora_adapter: dpo_beta is now dpo.beta (ops.lora_adapter.config.dpo.beta)"),
    ("key in an objective's settings", {"ops": {"lora_adapter": {"config": {"grpo": {"reward": ["m:f"]}}}}},
     "asset lora_adapter: unknown key 'reward' at ops.lora_adapter.config.grpo; did you mean 'rewards'?"),
    ("key in raw_dataset", {"ops": {"raw_dataset": {"config": {"column": {"prompt": "question"}}}}},
     "asset raw_dataset: unknown key 'column' at ops.raw_dataset.config; did you mean 'columns'? (accepted: columns, max_image_bytes, max_image_pixels, min_image_side)"),
    ("key above config", {"ops": {"eval_report": {"confg": {"max_examples": 3}}}},
     "asset eval_report: unknown key 'confg' at ops.eval_report; did you mean 'config'? (accepted: config)"),
    ("value type", {"ops": {"tokenized_shards": {"config": {"seq_len": "long"}}}},
     "asset tokenized_shards: ops.tokenized_shards.config.seq_len is 'long'; expected Int"),
    ("list item type", {"ops": {"gguf_model": {"config": {"qtypes": [8]}}}},
     "asset gguf_model: ops.gguf_model.config.qtypes[0] is 8; expected String"),
    ("a setting that moved", {"ops": {"eval_report": {"config": {"max_gguf_drop": 0.1}}}},
     "asset eval_report: unknown key 'max_gguf_drop' at ops.eval_report.config; it moved to ops.gguf_model.config.max_drop"),
    ("resource name", {"resources": {"data_executr": {"config": {"workers": 1}}}},
     "no resource 'data_executr'; did you mean 'data_executor'?"),
    ("key in a resource", {"resources": {"data_executor": {"config": {"workerz": 1}}}},
     "resource data_executor: unknown key 'workerz' at resources.data_executor.config; did you mean 'workers'?"),
    ("top-level key", {"op": {}}, "no top-level key 'op'; did you mean 'ops'? (accepted: execution, loggers, ops, resources)"),
]  # fmt: skip


@pytest.mark.parametrize("case, config, said", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_a_run_config_mistake_is_one_line_naming_the_closest_key(home, capsys, tiny_model_dir, case, config, said):
    whole = run_config(tiny_model_dir, steps=2, lr=0.01)
    for section, entries in config.items():
        merged = whole.setdefault(section, {})
        for name, value in entries.items():
            merged.setdefault(name, {}).update(value)
    path = home / "run_config.yaml"
    path.write_text(yaml.safe_dump(whole))
    data = write_dataset(home / "data", rows=3)
    code, failure, err = run_cli(capsys, "run", "--dataset", str(data), "--config", str(path), "--json")
    assert code == 2
    assert err.splitlines() == [f"ft-assets: error: {failure['error']}"]
    assert failure["error"].startswith(f"run config {path}: ") and said in failure["error"]
    assert failure == {"completed": [], "error": failure["error"], "failed_plane": None, "run_id": None}
    store = home / "home" / "store"
    assert not store.exists() or not [p for p in store.rglob("*") if p.is_file()]  # refused before registering


def test_every_mistake_of_a_config_is_named_in_the_one_line(home, capsys):
    path = home / "run_config.yaml"
    path.write_text(yaml.safe_dump({"ops": {"lora_adapter": {"config": {"max_stepz": 3, "lr": 0.1}}},
                                    "resources": {"store": {"config": {"uri": "s3://b"}}}}))  # fmt: skip
    code, _, err = run_cli(capsys, "run", "--dataset", str(home / "missing.jsonl"), "--config", str(path))
    assert code == 2 and len(err.splitlines()) == 1
    assert (
        "unknown key 'max_stepz' at ops.lora_adapter.config; did you mean 'max_steps'?" in err
        and "unknown key 'lr' at ops.lora_adapter.config (accepted:" in err
    )
    assert "resource store: unknown key 'uri' at resources.store.config; did you mean 'url'? (accepted: url)" in err


def test_each_plane_gets_its_own_part_and_the_training_settings_stay_lora_adapters():
    """The training settings are lora_adapter's alone: training_plan, in the same plane, takes only its own three;
    a training setting written under training_plan is a mistake named in one line."""
    data, training = defs.resolve_job_def(DATA_PLANE), defs.resolve_job_def(TRAINING_PLANE)
    assert accepted_keys(training, ["ops", "training_plan", "config"]) == ["cost_model_path", "data_region", "purpose"]
    whole = {"ops": {"lora_adapter": {"config": {"max_steps": 7, "lora_r": 4}}, "training_plan": {"config": {"purpose": "validation"}},
                     "raw_dataset": {"config": {}}}, "resources": {"store": {"config": {"url": "x"}}}}  # fmt: skip
    assert select_ops(data, whole) == {
        "ops": {"raw_dataset": {"config": {}}},
        "resources": {"store": {"config": {"url": "x"}}},
    }
    assert select_ops(training, whole)["ops"] == {k: whole["ops"][k] for k in ("lora_adapter", "training_plan")}
    (said,) = config_mistakes([data, training], {"ops": {"training_plan": {"config": {"lora_r": 64}}}})
    assert said.startswith("asset training_plan: unknown key 'lora_r' at ops.training_plan.config")


def test_the_instance_config_ships_in_the_package_and_the_top_level_one_links_to_it(home):
    packaged = files("ft_assets.control") / "dagster.yaml"
    # the design card's; `make ui` runs from $DAGSTER_HOME, where it does not warn about it
    top_level = REPO / "dagster.yaml"
    assert top_level.is_symlink() and top_level.resolve() == Path(str(packaged)).resolve()
    assert yaml.safe_load(packaged.read_text())["run_coordinator"]["class"] == "PoolRunCoordinator"
    dagster_home = ensure_home()
    assert dagster_home == home / "home" / "dagster_home"
    assert (dagster_home / "dagster.yaml").read_bytes() == packaged.read_bytes()


# --- the run log: the command's own lines, the libraries' with --verbose ---------------------------

OURS = ("[ft-assets] ", "ft-assets: error: ")
SENSOR = re.compile(r".* - dagster - INFO - new dataset version\(s\): acks@v1")  # dataset_version_sensor's own log line


def cli(home: Path, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "ft_assets.cli", *argv], env=env, capture_output=True, text=True, timeout=900
    )


@pytest.mark.integration
def test_the_run_log_holds_the_commands_lines_only_and_verbose_keeps_the_libraries(home, tiny_model_dir):
    """Through the instance (the default): the runs' messages come from the event log; the code server's and the
    runs' own output goes to a file, quiet too unless --verbose (the switches reach those processes). The run is the
    suite's one pipeline that the gate blocks (2 steps learn nothing): exit 2, the check's line, nothing published; each
    objective's scorer meeting a run that learned nothing: test_delivery.py."""
    config = home / "run_config.yaml"
    config.write_text(yaml.safe_dump(run_config(tiny_model_dir, steps=2, lr=1e-6)))
    data = write_dataset(home / "data", rows=60)
    argv = ["run", "--dataset", str(data), "--name", "acks", "--version", "v1", "--config", str(config)]
    runs_output = home / "home" / "dagster_home" / "logs" / "ft-assets-run.log"

    quiet = cli(home, *argv)  # every plane; the gate then fails (2 steps learn nothing), after every model load
    assert quiet.returncode == 2, quiet.stderr[-3000:]
    assert "blocking check finetuned_beats_base failed: exact_match: base" in quiet.stderr.splitlines()[-1]
    assert not (home / "home" / "store" / "registry").exists()  # the gate held: nothing published
    assert "eval_report: scoring the shipped" in quiet.stderr  # the GGUF was loaded back and run
    assert (
        "[ft-assets] training_plane: [PoolRunLauncher] ft-assets routed this run to the gpu pool (DefaultRunLauncher)"
        in quiet.stderr
    )
    foreign = [line for line in quiet.stderr.splitlines() if not line.startswith(OURS) and not SENSOR.fullmatch(line)]
    assert foreign == [], foreign
    quiet_output = runs_output.read_text()
    assert "eval_report: scoring the shipped" in quiet_output  # the worker's own copy of its log
    assert "it/s]" not in quiet_output and "FutureWarning" not in quiet_output

    verbose = cli(home, *argv, "--until", "training", "--force", "--verbose")
    assert verbose.returncode == 0, verbose.stderr[-3000:]
    assert "ENGINE_EVENT - [PoolRunLauncher] ft-assets routed this run to the gpu pool" in verbose.stderr
    verbose_output = runs_output.read_text()[len(quiet_output) :]
    assert "Loading weights" in verbose_output and "it/s]" in verbose_output  # transformers' bar
    assert "FutureWarning" in verbose_output
