"""A delivery plane that never strands a trained model: ``gguf_model`` with ``qtypes: []``, through ``ft-assets run``.

One Dagster run of all four planes on the tiny model. GGUF is off, so ``gguf_model`` materializes with no
files and its reason, ``eval_report`` scores the base and the merged model only (its GGUF check passes
vacuously), ``published_model`` publishes merged weights, adapter, eval and lineage without a GGUF, and
``serving_smoke`` says in one line that there is nothing to serve. (An architecture llama.cpp cannot
take ends the same way, with its own one-line reason: ``test_gguf_export.test_refusals_are_one_line``.)
"""

import json
from pathlib import Path

import dagster as dg
import pytest
import yaml

from ft_assets.cli import main
from ft_assets.delivery.assets import GGUF_OFF
from ft_assets.manifests import read_manifest
from ft_assets.refs import read_ref
from ft_assets.storage import LocalStore
from ft_assets_tests.support import run_cli, run_config, write_dataset

pytestmark = pytest.mark.integration


def test_gguf_off_publishes_the_model_without_one(home, capsys, tiny_model_dir):
    settings = run_config(tiny_model_dir, steps=60, lr=0.01)
    settings["ops"]["gguf_model"] = {"config": {"qtypes": []}}
    config = home / "run_config.yaml"
    config.write_text(yaml.safe_dump(settings))
    data = write_dataset(home / "data")
    code, summary, err = run_cli(capsys, "run", "--in-process", "--dataset", str(data), "--name", "acks", "--version", "v1", "--config", str(config), "--json")
    assert code == 0, err
    assert summary["finetuned_metric"] >= 0.5 > summary["base_metric"]  # scored and gated on the merged model alone
    assert {k: summary[k] for k in ("gguf_file", "gguf_qtype", "gguf_metric", "gguf_drop", "gguf_uri")} == dict.fromkeys(
        ("gguf_file", "gguf_qtype", "gguf_metric", "gguf_drop", "gguf_uri")
    )
    assert summary["gguf_reason"] == GGUF_OFF

    store = LocalStore(home / "home" / "store")
    gguf = read_ref(store, "acks@v1", "gguf_model")["stats"]
    assert (gguf["files"], gguf["shipped"], gguf["reason"]) == ({}, None, GGUF_OFF)
    registry = Path(summary["published_uri"]).relative_to(store.root).as_posix()
    files = set(read_manifest(store, registry).files)
    assert {"lineage.json", "merged/model.safetensors", "adapter/adapter_model.safetensors", "eval/report.json"} <= files
    assert not [name for name in files if name.startswith("gguf/")]
    lineage = json.loads(store.get_bytes(f"{registry}/lineage.json"))
    assert (lineage["gguf"], lineage["gguf_reason"], lineage["eval"]["gguf_file"]) == ({}, GGUF_OFF, None)
    smoke = read_ref(store, "acks@v1", "serving_smoke")["stats"]
    assert (smoke["file"], smoke["answers"], smoke["reason"]) == (None, [], f"no GGUF to serve: {GGUF_OFF}")
    # The asset pages say so: published_model names no file but the reason; eval_report has no GGUF figure.
    with dg.DagsterInstance.get() as instance:
        published, evaluated = (instance.get_latest_materialization_event(dg.AssetKey(a)).asset_materialization.metadata
                                for a in ("published_model", "eval_report"))  # fmt: skip
    assert published["shipped_gguf"].value == f"none: {GGUF_OFF}" and "shipped_metric" not in published
    assert published["result"].value.endswith("(no GGUF shipped)") and published["finetuned_metric"].value == pytest.approx(summary["finetuned_metric"], rel=1e-3)
    assert "gguf_metric" not in evaluated and evaluated["gguf_file"].value == "none shipped"

    # The same version again: nothing reruns (no Dagster run), and the summary says why there is no GGUF.
    assert main(["run", "--in-process", "--dataset", str(data), "--name", "acks", "--version", "v1", "--config", str(config)]) == 0
    assert f"GGUF: none ({GGUF_OFF})" in capsys.readouterr().out
