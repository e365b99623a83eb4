"""Runs of one dataset version side by side (issue 35): variants, each its own run, compared in one table.

The table's pieces at the function level (``delivery/comparison.py``), then one pipeline run of two variants of
one version through ``ft-assets run``.
"""

from __future__ import annotations

import json

import pytest

from ft_assets.delivery import comparison
from ft_assets.delivery.comparison import RunFigures
from ft_assets.delivery.regression import WARN, Score, judge


def _run(variant: str, metric: float, finished_at: float, passed: bool = True, regressed: bool = False,
         published: bool = True, **settings) -> RunFigures:  # fmt: skip
    general = judge(
        {"base": {"km": Score(1.0, 0.0)}, "finetuned": {"km": Score(0.0 if regressed else 1.0, 0.0)}},
        {"km": ("exact_match,none", True)}, 0.05, {}, 1.0, WARN, 60, 5.0,
    )  # fmt: skip
    gate = {"passed": passed, "general.regressed": general.regressed}
    return RunFigures(
        variant, f"run-{variant}", {"lora_r": 8, "learning_rate": 0.001, **settings}, "exact_match", 0.0, metric,
        {"GGUF": metric}, gate, general, 1000, 12.5, 0.01, 0.4, published, finished_at,
    )  # fmt: skip


def test_only_the_settings_that_differ_are_shown():
    changed = comparison.differing(
        {"a": {"lora_r": 8, "learning_rate": 1e-3, "seed": 1}, "b": {"lora_r": 16, "learning_rate": 1e-3, "seed": 1}}
    )
    assert changed == {"a": {"lora_r": 8}, "b": {"lora_r": 16}}
    assert comparison.differing({"a": {"x": [1]}, "b": {"x": [1]}}) == {"a": {}, "b": {}}


PROMOTIONS = [  # (case, runs, the promoted variant)
    ("the best metric", [_run("a", 0.5, 1), _run("b", 0.7, 2)], "b"),
    ("a tie keeps the earlier", [_run("a", 0.7, 1), _run("b", 0.7, 2)], "a"),
    ("a failed gate is never promoted", [_run("a", 0.5, 1), _run("b", 0.9, 2, passed=False)], "a"),
    ("a general regression is never promoted (even when it only warned)", [_run("a", 0.5, 1), _run("b", 0.9, 2, regressed=True)], "a"),
    ("an unpublished run is never promoted", [_run("a", 0.5, 1), _run("b", 0.9, 2, published=False)], "a"),
    ("none may be", [_run("a", 0.9, 1, passed=False)], None),
]  # fmt: skip


@pytest.mark.parametrize("case, runs, champion", PROMOTIONS, ids=[c[0] for c in PROMOTIONS])
def test_the_promoted_run_follows_the_registry_rule(case, runs, champion):
    assert comparison.promoted(runs)[0] == champion


def test_the_table_reads_at_a_glance():
    runs = [_run("", 0.5, 1), _run("r16", 0.7, 2, lora_r=16, regressed=True)]
    rows = comparison.table(runs, comparison.promoted(runs)[0])
    assert [row["variant"] for row in rows] == ["(default)", "r16"]
    assert rows[0]["settings that differ"] == "lora_r=8" and rows[1]["settings that differ"] == "lora_r=16"
    assert rows[1]["exact_match"] == "0.000 → 0.700 → 0.700"
    assert rows[1]["general (base → tuned → shipped)"] == "km 1.000 → 0.000 ✗"
    assert rows[1]["verdict"].startswith("published, not promotable: it regressed")
    assert [row["promoted"] for row in rows] == [True, False]


def test_a_variant_is_a_partition_of_its_version():
    from ft_assets.partitions import DatasetVersion, InvalidDatasetId

    variant = DatasetVersion.from_key("acks@v1~r16")
    assert (variant.name, variant.version, variant.variant, variant.version_key) == ("acks", "v1", "r16", "acks@v1")
    assert variant.key == "acks@v1~r16" and DatasetVersion.from_key("acks@v1").with_variant("r16") == variant
    with pytest.raises(InvalidDatasetId, match="invalid dataset variant"):
        DatasetVersion.from_key("acks@v1~../x")


def test_a_variant_reads_its_versions_data_and_writes_its_own_references(tmp_path):
    import dagster as dg

    from ft_assets import layout
    from ft_assets.definitions import defs
    from ft_assets.resources import variant_refusal
    from ft_assets.storage import LocalStore

    version, variant = layout.of("acks@v1"), layout.of("acks@v1~r16")
    assert (
        variant.ref("tokenized_shards") == version.ref("tokenized_shards") == "runs/acks/v1/refs/tokenized_shards.json"
    )
    assert variant.ref("lora_adapter") == "runs/acks/v1/variants/r16/refs/lora_adapter.json"
    assert variant.control("plan") == "runs/acks/v1/variants/r16/control/plan" != version.control("plan")
    assert variant.train("abc") == version.train("abc") and variant.lease != version.lease
    data_plane = defs.resolve_job_def("data_plane").asset_layer.executable_asset_keys
    assert layout.VERSION_ASSETS == {key.to_user_string() for key in data_plane}  # what every variant shares
    store = LocalStore(tmp_path)
    store.put_json(variant.ref("lora_adapter"), {})
    assert version.variant_keys(store) == ["acks@v1~r16"] and layout.partitions_with_runs(store) == [
        "acks@v1",
        "acks@v1~r16",
    ]
    assert variant_refusal("acks@v1~r16", ["tokenized_shards"]) == (
        "tokenized_shards of acks@v1~r16: the variants of a version share its data plane; materialize it for acks@v1 "
        "(a variant trains and delivers only)"
    )
    assert (
        dg.AssetKey("version_comparison")
        not in defs.resolve_job_def("delivery_plane").asset_layer.executable_asset_keys
    )


def test_the_run_configs_variants_lay_their_settings_over_the_shared_ones():
    from ft_assets.cli.output import CliError
    from ft_assets.cli.run_config import split_variants

    shared = {"ops": {"lora_adapter": {"config": {"max_steps": 40, "lora_r": 8}}}, "loggers": {}}
    base, variants = split_variants(
        {**shared, "variants": {"r16": {"lora_adapter": {"config": {"lora_r": 16}}}, "same": {}}}, "x.yaml"
    )
    assert base == shared and set(variants) == {"r16", "same"}
    assert variants["r16"]["ops"]["lora_adapter"]["config"] == {"max_steps": 40, "lora_r": 16}
    assert variants["same"]["ops"] == shared["ops"] and variants["r16"]["loggers"] == {}
    assert split_variants(shared, "x.yaml") == (shared, {})
    for variants, message in [
        ({"r16": {"base_model": {"config": {"source": "other"}}}}, "variants.r16 sets base_model, the data plane's"),
        ({"bad/name": {}}, "invalid dataset variant 'bad/name'"),
        ([], "variants must map each variant's name"),
    ]:
        with pytest.raises(CliError, match=message):
            split_variants({**shared, "variants": variants}, "x.yaml")


@pytest.fixture(scope="module")
def km_base(tmp_path_factory, one_cpu_thread):
    """tiny.py's Llama taught the 30-item km task (exact match 1.0): a base with a general ability to lose."""
    from ft_assets_tests.support import ANSWER, KM_ITEMS, km_conversations, teach
    from ft_assets_tests.tiny import build_tiny_model

    words = [f"{q} {a}" for q, a in KM_ITEMS[:5]] + [f"Request number 3: please acknowledge item 21. {ANSWER}"]
    return teach(build_tiny_model(tmp_path_factory.mktemp("km-base"), extra_text=words), km_conversations(), 100)


@pytest.mark.integration
def test_two_variants_of_one_version_train_deliver_and_are_compared(home, capsys, km_base):
    """One `ft-assets run` (through the instance: each variant's runs submitted together) of a version with two variants,
    each trained and delivered as its own run: the gentle one (25 steps at 5e-3) learns the task and keeps the general
    one, is published and promoted; the harsh one (60 steps at 3e-2) learns the task and forgets the general one, in
    the merged model and the shipped GGUF alike, and the gate blocks it. The table shows both with their figures."""
    import yaml

    from ft_assets.refs import read_ref
    from ft_assets.storage import open_store
    from ft_assets_tests.support import KM_TASK, run_cli, run_config, write_dataset, write_general_tasks

    tasks = write_general_tasks(home / "tasks")
    config = run_config(km_base, steps=25, lr=0.005)
    config["ops"]["general_eval"] = {"config": {"tasks": [str(tasks[KM_TASK])], "limit": 30}}
    config["variants"] = {"gentle": {}, "harsh": {"lora_adapter": {"config": {"learning_rate": 0.03, "max_steps": 60}}}}
    (home / "run.yaml").write_text(yaml.safe_dump(config))
    code, summary, err = run_cli(
        capsys, "run", "--dataset", str(write_dataset(home / "acks")), "--name", "acks", "--version", "v1",
        "--config", str(home / "run.yaml"), "--json",
    )  # fmt: skip
    assert code == 2 and summary["failed_plane"] == "delivery", err[-3000:]
    assert summary["error"].startswith("1 of 2 variants failed: variant harsh: delivery_plane failed for acks@v1~harsh")
    assert "blocking check keeps_general_ability failed: km_to_m exact_match: base 1.000 → fine-tuned 0.000" in err
    gentle, harsh = summary["variants"]["gentle"], summary["variants"]["harsh"]
    assert gentle["partition"] == "acks@v1~gentle" and gentle["completed"] == ["training", "delivery"]
    assert gentle["finetuned_metric"] >= 0.5 + gentle["base_metric"]
    assert gentle["general"][KM_TASK]["base"] == 1.0 and gentle["general"][KM_TASK]["finetuned"] >= 0.9
    assert not gentle["general_regressed"] and gentle["published_uri"].endswith(gentle["run_id"])
    assert harsh["completed"] == ["training"] and "published_uri" not in harsh
    rows = {row["variant"]: row for row in summary["comparison"]}
    assert set(rows) == {"gentle", "harsh"} and summary["promoted"] == "gentle"
    assert rows["gentle"]["settings that differ"] == "learning_rate=0.005, max_steps=25"
    assert rows["harsh"]["settings that differ"] == "learning_rate=0.03, max_steps=60"
    assert rows["harsh"]["general (base → tuned → shipped)"] == f"{KM_TASK} 1.000 → 0.000 ✗ → 0.000 ✗"
    assert rows["harsh"]["verdict"].startswith("not published: it forgot general abilities")
    assert rows["gentle"]["verdict"] == "published" and rows["gentle"]["promoted"]
    # More steps, more tokens; each run billed. Dollars come from each run's wall clock, which the suite's other
    # worker slows by its own amount, so their order is not the steps' (it was equal at $0.0007 under load once).
    assert rows["harsh"]["tokens"] > rows["gentle"]["tokens"] and rows["harsh"]["usd"] > 0 and rows["gentle"]["usd"] > 0
    store = open_store()
    harsh_general = read_ref(store, "acks@v1~harsh", "general_eval")  # the figures behind the block, in the store
    stored = json.loads(store.get_bytes(f"{harsh_general['prefix']}/general.json"))
    assert stored["verdict"]["regressed"] and stored["verdict"] == harsh_general["stats"]
    assert len(stored["answers"]["finetuned"][KM_TASK]) == 30
    assert read_ref(store, "acks@v1~gentle", "tokenized_shards") == read_ref(store, "acks@v1", "tokenized_shards")
    assert (
        read_ref(store, "acks@v1~gentle", "lora_adapter")["stats"]["run_id"]
        != (read_ref(store, "acks@v1~harsh", "lora_adapter")["stats"]["run_id"])
    )
