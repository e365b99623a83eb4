"""An export its runtime refuses never strands the run: one Dagster run of all four planes, through ``ft-assets run``.

The issue's case: a tiny Phi-3 (fused ``qkv_proj``/``gate_up_proj``) whose tokenizer is a GPT-2-style byte-level BPE,
the combination Phi-4-mini ships, in a dataset named after Phi-3. It trains and converts, and llama.cpp refuses the file
("error loading model vocabulary: unordered_map::at": it gives a ``general.name`` holding "phi3" Phi-3's token
attributes and looks up ``</s>``). ``converter.general_name`` now writes such a name so that the file loads
(``test_exports.py``, ``test_gguf_families.py``); here that fix is undone, so the run meets llama.cpp's real refusal.

``gguf_model`` materializes with no files and the reason, ``eval_report`` scores the base and the merged model only
(the GGUF check passes vacuously), ``published_model`` publishes merged weights, adapter, eval and lineage without a
GGUF, ``serving_smoke`` says there is nothing to serve, and ``--json``, the metadata and ``lineage.json`` carry the
reason. Then the same version with ``gguf_model.config.required: true``: only the delivery plane reruns, and fails with
that line. (``qtypes: []`` ends like the refusal, with its own reason: ``test_exports.py``.)
"""

import json
from pathlib import Path

import dagster as dg
import pytest
import yaml

from ft_assets.delivery import converter
from ft_assets.manifests import read_manifest
from ft_assets.refs import read_ref
from ft_assets.storage import LocalStore
from ft_assets_tests.families import build_family
from ft_assets_tests.support import run_cli, run_config, write_dataset

pytestmark = pytest.mark.integration

REFUSED = "llama.cpp refuses phi3-acks-v1-f16.gguf: llama.cpp cannot load phi3-acks-v1-f16.gguf: llama_model_load: error loading model: error loading model vocabulary: unordered_map::at"  # fmt: skip


def test_a_refused_gguf_is_dropped_with_its_reason_and_the_model_published(home, capsys, monkeypatch):
    monkeypatch.setattr(converter, "general_name", lambda name, model_dir: name)  # the file as it was written before
    settings = run_config(build_family("phi3", home / "phi3"), steps=60, lr=0.01)
    settings["ops"]["gguf_model"] = {"config": {"qtypes": ["f16"], "verify": False}}
    config = home / "run_config.yaml"
    config.write_text(yaml.safe_dump(settings))
    data = write_dataset(home / "data")
    argv = [
        "run",
        "--in-process",
        "--dataset",
        str(data),
        "--name",
        "phi3-acks",
        "--version",
        "v1",
        "--config",
        str(config),
    ]
    code, summary, err = run_cli(capsys, *argv, "--json")
    assert code == 0, err
    assert summary["finetuned_metric"] >= 0.5 > summary["base_metric"]  # scored and gated on the merged model alone
    keys = ("gguf_file", "gguf_qtype", "gguf_metric", "gguf_drop", "gguf_uri")
    assert {k: summary[k] for k in keys} == dict.fromkeys(keys) and summary["gguf_reason"] == REFUSED

    store = LocalStore(home / "home" / "store")
    gguf = read_ref(store, "phi3-acks@v1", "gguf_model")["stats"]
    assert (gguf["files"], gguf["shipped"], gguf["reason"]) == ({}, None, REFUSED)
    registry = Path(summary["published_uri"]).relative_to(store.root).as_posix()
    files = set(read_manifest(store, registry).files)
    assert {
        "lineage.json",
        "merged/model.safetensors",
        "adapter/adapter_model.safetensors",
        "eval/report.json",
    } <= files
    assert not [name for name in files if name.startswith("gguf/")]
    lineage = json.loads(store.get_bytes(f"{registry}/lineage.json"))
    assert lineage["exports"]["gguf"] == {"asset": "gguf_model", "shipped": None, "files": {}, "reason": REFUSED}
    assert lineage["eval"]["exports"]["gguf"]["reason"] == REFUSED
    smoke = read_ref(store, "phi3-acks@v1", "serving_smoke")["stats"]
    assert (smoke["file"], smoke["answers"], smoke["reason"]) == (None, [], f"no GGUF to serve: {REFUSED}")
    # The asset pages say so: gguf_model and published_model name the reason; eval_report has no GGUF figure.
    with dg.DagsterInstance.get() as instance:
        made, published, evaluated = (instance.get_latest_materialization_event(dg.AssetKey(a)).asset_materialization.metadata
                                      for a in ("gguf_model", "published_model", "eval_report"))  # fmt: skip
        shipped_check = instance.get_latest_asset_check_evaluation_record(
            dg.AssetCheckKey(dg.AssetKey("eval_report"), "shipped_gguf_keeps_the_metric")
        ).event.asset_check_evaluation  # fmt: skip
    assert (made["shipped"].value, made["reason"].value) == ("none", REFUSED)
    assert published["shipped_gguf"].value == f"none: {REFUSED}" and "gguf_metric" not in published
    assert published["result"].value.endswith("(no GGUF shipped) (no MLX shipped)")  # FT_MLX=0: the MLX export is off
    assert "gguf_metric" not in evaluated and evaluated["gguf_file"].value == f"none: {REFUSED}"
    assert shipped_check.passed and shipped_check.description == f"no GGUF ships ({REFUSED}): nothing to compare"
    code, chain, err = run_cli(capsys, "lineage", summary["published_uri"], "--json")
    assert code == 0 and chain["verified"] and chain["exports"]["gguf"]["reason"] == REFUSED, err

    # The same version, the GGUF now required: only the delivery plane reruns (its settings changed), and fails with the line.
    settings["ops"]["gguf_model"]["config"]["required"] = True
    config.write_text(yaml.safe_dump(settings))
    code, failure, err = run_cli(capsys, *argv, "--json")
    assert code == 2 and failure["completed"] == ["data", "training"] and failure["failed_plane"] == "delivery"
    assert failure["error"].endswith(f"GGUF is required (gguf_model config required: true) and was refused: {REFUSED}")
    assert "\n" not in failure["error"]
