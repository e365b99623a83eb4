"""Mixtures: the spec, the draw (shares within ±1% of the weights, the same rows for the same seed), and a
mixture of a registered version, a CSV file and a Hub dataset through ``ft-assets run`` and the lineage."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import yaml

from ft_assets.cli import main
from ft_assets.data.mixture import Component, MixtureError, draw_counts, mix_dataset, parse_spec
from ft_assets.data.parts import Artifact
from ft_assets.data.registration import register_dataset
from ft_assets.data.sources import describe_source
from ft_assets.manifests import publish_dir
from ft_assets.refs import read_ref
from ft_assets.storage import LocalStore
from ft_assets_tests.support import MAIN

SPEC_ERRORS = [
    ("not-a-mixture", {"components": []}, "one mapping 'mixture:'"),
    ("no-components", {"mixture": {"components": []}}, "non-empty list"),
    (
        "weights-and-counts",
        {"mixture": {"components": [{"dataset": "a@v1", "weight": 1}, {"dataset": "b@v1", "count": 3}]}},
        "every component a 'weight', or every",
    ),
    (
        "zero-weight",
        {"mixture": {"components": [{"dataset": "a@v1", "weight": 0}]}},
        "'weight' must be a positive number",
    ),
    (
        "rows-with-counts",
        {"mixture": {"rows": 10, "components": [{"dataset": "a@v1", "count": 3}]}},
        "only goes with weights",
    ),
    (
        "dataset-and-source",
        {"mixture": {"components": [{"dataset": "a@v1", "source": "x.jsonl", "weight": 1}]}},
        "give one of 'dataset'",
    ),
    ("bad-version", {"mixture": {"components": [{"dataset": "a", "weight": 1}]}}, "expected '<name>@<version>'"),
    (
        "same-name",
        {"mixture": {"components": [{"dataset": "a@v1", "weight": 1}, {"dataset": "a@v2", "weight": 1}]}},
        "a second component named 'a'",
    ),
    (
        "bad-columns",
        {"mixture": {"components": [{"source": "x.csv", "weight": 1, "columns": {"prompt": "q"}}]}},
        "both 'prompt' and 'response'",
    ),
    (
        "unknown-key",
        {"mixture": {"components": [{"dataset": "a@v1", "weight": 1, "weigth": 2}]}},
        r"unknown key\(s\) \['weigth'\]",
    ),
]


@pytest.mark.parametrize("name,spec,error", SPEC_ERRORS, ids=[c[0] for c in SPEC_ERRORS])
def test_mixture_spec_errors(name, spec, error):
    with pytest.raises(MixtureError, match=error):
        parse_spec(yaml.safe_dump(spec), "mix.yaml")


DRAWS = [
    # (available, weights, counts, rows, drawn)
    ([1000, 1000, 1000], [0.5, 0.3, 0.2], None, None, [1000, 600, 400]),  # the first component limits the total
    (
        [1000, 100, 1000],
        [0.5, 0.3, 0.2],
        None,
        None,
        [166, 100, 67],
    ),  # 333 rows: 166.5 / 99.9 / 66.6, largest remainders
    ([1000, 1000, 1000], [5, 3, 2], None, 101, [51, 30, 20]),
    ([50, 60], None, [50, 0], None, [50, 0]),
    ([400, 300, 30], [0.6, 0.3, 0.1], None, None, [180, 90, 30]),  # shares that do not sum to 1.0 in floating point
]


@pytest.mark.parametrize("available,weights,counts,rows,drawn", DRAWS)
def test_draw_counts(available, weights, counts, rows, drawn):
    names = [f"c{i}" for i in range(len(available))]
    assert draw_counts(names, available, weights, counts, rows) == drawn


def test_draw_counts_never_draw_a_row_twice():
    with pytest.raises(
        MixtureError, match=r"mixture component c1: 100 usable rows, but its weight of 1000 rows, 300 are asked"
    ):
        draw_counts(["c0", "c1"], [1000, 100], [0.7, 0.3], None, 1000)
    with pytest.raises(MixtureError, match=r"mixture component c0: 50 usable rows, but count 60 are asked"):
        draw_counts(["c0"], [50], None, [60], None)
    with pytest.raises(MixtureError, match=r"component\(s\) c1 have no usable rows"):
        draw_counts(["c0", "c1"], [50, 0], [1, 1], None, None)


def write_jsonl(path: Path, prefix: str, n: int) -> Path:
    rows = [{"instruction": f"{prefix} request number {i}", "output": f"{prefix} answer {i}"} for i in range(n)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows) + "not json\n")
    return path


def components(tmp_path: Path, weights: dict[str, float]) -> list[Component]:
    sizes = {"alpha": 3000, "beta": 1200, "gamma": 800}
    return [
        Component(
            {"name": name, "weight": weight},
            [(f"{name}/rows.jsonl", write_jsonl(tmp_path / f"{name}.jsonl", name, sizes[name]))],
            None,
        )
        for name, weight in weights.items()
    ]


def drawn_sources(out: Artifact) -> list[str]:
    return [r["source"] for r in out.records("rows")]


def test_mixture_shares_are_the_weights_and_the_seed_fixes_the_rows(tmp_path):
    weights = {"alpha": 0.5, "beta": 0.3, "gamma": 0.2}
    parts = components(tmp_path, weights)
    stats = mix_dataset(parts, tmp_path / "w1", out1 := Artifact.folder(tmp_path / "out1"), seed=7, rows=2000)
    sources = drawn_sources(out1)
    shares = Counter(source.split("/")[0] for source in sources)
    assert stats["rows_in"] == len(sources) == 2000
    for name, weight in weights.items():
        assert abs(shares[name] / 2000 - weight) <= 0.01
    records = {c["name"]: c for c in stats["source"]["components"]}
    assert records["beta"]["rows_drawn"] == 600 and records["beta"]["rows_available"] == 1200
    assert records["beta"]["rows_quarantined"] == 1 and records["beta"]["quarantine_reasons"] == {"invalid_json": 1}
    assert len({c["digest"] for c in records.values()}) == 3
    quarantined = [q["source"] for q in out1.records("components_quarantine")]
    assert quarantined == ["alpha/rows.jsonl:3001", "beta/rows.jsonl:1201", "gamma/rows.jsonl:801"]

    mix_dataset(parts, tmp_path / "w2", out2 := Artifact.folder(tmp_path / "out2"), seed=7, rows=2000)
    assert drawn_sources(out2) == sources  # same seed, same rows in the same order
    mix_dataset(parts, tmp_path / "w3", out3 := Artifact.folder(tmp_path / "out3"), seed=8, rows=2000)
    other = drawn_sources(out3)
    assert other != sources and Counter(s.split("/")[0] for s in other) == shares
    # Another component changes nothing in the draws of the others (each is seeded by the seed and its name).
    more = components(tmp_path, {"alpha": 0.5, "beta": 0.3, "gamma": 0.2})
    mix_dataset(more[:2], tmp_path / "w4", out4 := Artifact.folder(tmp_path / "out4"), seed=7, rows=1600)
    assert [s for s in drawn_sources(out4) if s.startswith("alpha/")] == [s for s in sources if s.startswith("alpha/")]


@pytest.fixture
def project(home, tiny_model_dir):
    config = home / "run_config.yaml"
    config.write_text(yaml.safe_dump({"ops": {"base_model": {"config": {"source": str(tiny_model_dir)}}}}))
    return home, config


@pytest.mark.integration
def test_mixture_of_a_version_a_csv_file_and_a_hub_dataset(project, hub_cache, capsys):  # noqa: F811 - the fixture
    home, config = project
    store = LocalStore(home / "home" / "store")
    first, _ = register_dataset(store, str(write_jsonl(home / "chats.jsonl", "chat", 400)), None, "v1")
    questions = home / "questions.csv"
    questions.write_text("question,answer\n" + "".join(f"What is {i} plus one?,It is {i + 1}.\n" for i in range(300)))
    mix = home / "mix.yaml"
    mix.write_text(yaml.safe_dump({"mixture": {"seed": 3, "components": [
        {"dataset": first, "weight": 0.6},
        {"source": "questions.csv", "weight": 0.3, "columns": {"prompt": "question", "response": "answer"}},
        {"source": "hf://acme/qa@main", "name": "hub", "weight": 0.1, "columns": {"prompt": "question", "response": "answer"}},
    ]}}))  # fmt: skip
    assert (
        main(["run", "--in-process", "--dataset", str(mix), "--until", "data", "--config", str(config), "--json"]) == 0
    )
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["partition"].startswith("mix@v-")
    # 30 Hub rows at weight 0.1 limit the mixture to 300 rows: 180 + 90 + 30.
    raw = read_ref(store, summary["partition"], "raw_dataset")
    source = raw["stats"]["source"]
    assert [(c["name"], c["rows_drawn"]) for c in source["components"]] == [
        ("chats", 180),
        ("questions", 90),
        ("hub", 30),
    ]
    assert (
        summary["rows_in"]
        == 300
        == summary["rows_kept"] + summary["rows_quarantined"] + summary["exact_duplicates"] + summary["near_duplicates"]
    )
    chats, csv_part, hub = source["components"]
    assert chats["dataset"] == first and chats["rows_quarantined"] == 1 and len(chats["digest"]) == 64
    assert csv_part["source"] == {"kind": "files", "uri": "questions.csv"} and csv_part["files"] == ["questions.csv"]
    assert hub["source"]["commit"] == MAIN and hub["source"]["repo"] == "acme/qa"
    sources = [r["source"] for r in Artifact.committed(store, raw["prefix"]).records("rows")]
    assert {s.split("/")[0] for s in sources} == {"chats", "questions", "hub"}
    assert sources[0].startswith("chats/chats.jsonl:") and any(s.startswith("hub/data/train-") for s in sources)

    # The lineage of a model trained on it lists the components (published_model's lineage.json carries the source).
    lines = describe_source(source)
    assert lines[0] == "  mixture, seed 3:"
    assert lines[3].startswith(f"    hub: hf://acme/qa@main → commit {MAIN} (weight 0.1, 30 rows drawn, digest ")
    checkpoint = home / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "weights.safetensors").write_bytes(b"weights")
    registry = home / "registry-entry"
    registry.mkdir()
    digest = publish_dir(store, "runs/mix/v1/train/run/checkpoint-00000001", checkpoint).digest
    lineage = minimal_lineage(
        summary["partition"], source, {"key": "runs/mix/v1/train/run/checkpoint-00000001", "digest": digest}
    )
    (registry / "lineage.json").write_text(json.dumps(lineage))
    publish_dir(store, "registry/mix/v1/run", registry)
    assert main(["lineage", str(store.root / "registry/mix/v1/run")]) == 0
    printed = capsys.readouterr().out
    assert "\n".join(lines) in printed


def minimal_lineage(partition: str, source: dict, checkpoint: dict) -> dict:
    """A lineage.json with what ``ft-assets lineage`` prints and no artifact chain (the pipeline test checks that)."""
    return {
        "partition": partition,
        "dataset_source": source,
        "published_key": "registry/mix/v1/run",
        "base_model": {"model_id": "tiny", "source_sha256": "0" * 64},
        "training": {
            "checkpoint": checkpoint,
            "run_id": "run",
            "method": "lora",
            "steps": 1,
            "resumed_from_step": None,
        },
        "exports": {},
        "eval": {"metric_name": "exact_match", "base_metric": 0.0, "finetuned_metric": 1.0},
        "code_version": "test",
        "artifacts": [],
    }


def test_the_lineage_manifest_carries_the_dataset_source():
    from ft_assets.delivery.lineage import build_lineage
    from ft_assets_tests.support import lineage_refs

    refs = lineage_refs()
    source = {
        "kind": "hub",
        "uri": "hf://acme/qa@main",
        "repo": "acme/qa",
        "revision": "main",
        "commit": MAIN,
        "split": "train",
        "files": [],
    }
    refs["raw_dataset"]["stats"] = {"source": source}
    assert build_lineage("qa@v1", refs, "/store/registry/qa/v1/r1")["dataset_source"] == source
