"""All four planes end to end with the tiny model: data → training → delivery → registry, via ft-assets run.

The dataset is one a 2-layer model can learn in a few dozen LoRA steps (every request is answered
with the same short tool call), so the eval gate has something real to measure: the random-init
base never produces the answer, the fine-tuned model does.
"""

import contextlib
import io
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from peft import PeftModel
from transformers import AutoModelForCausalLM

from ft_assets.cli import main
from ft_assets.delivery.lineage import LINEAGE_CHAIN
from ft_assets.manifests import read_manifest
from ft_assets.refs import STATS, RefOutdated, read_ref, stats_of
from ft_assets.storage import LocalStore
from ft_assets_tests.support import run_cli, run_config, write_dataset

pytestmark = pytest.mark.integration


@dataclass
class Published:
    """One run of all four planes on the tiny model, shared by this module's tests."""

    home: Path
    store: LocalStore
    data: Path
    config: Path
    summary: dict
    registry: str  # the published model's key in the store


def cli(*argv) -> tuple[int, dict | None, str]:
    """``ft-assets ARGV`` in-process outside a test's capsys: exit code, the JSON line of stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    lines = out.getvalue().strip().splitlines()
    return code, (json.loads(lines[-1]) if lines and lines[-1].startswith("{") else None), err.getvalue()


@pytest.fixture(scope="module")
def published(tmp_path_factory, tiny_model_dir):
    """A new dataset version through data → training → delivery → registry with ``ft-assets run --json``, once."""
    home = tmp_path_factory.mktemp("pipeline")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("FT_HOME", str(home / "home"))
        env.setenv("DAGSTER_HOME", str(home / "home" / "dagster_home"))
        env.setenv("OMP_NUM_THREADS", "1")
        env.delenv("FT_STORE", raising=False)
        config = home / "run_config.yaml"
        config.write_text(yaml.safe_dump(run_config(tiny_model_dir, steps=60, lr=0.01)))
        data = write_dataset(home / "data")
        code, summary, err = cli("run", "--in-process", "--dataset", str(data), "--name", "acks", "--version", "v1", "--config", str(config), "--json")
        assert code == 0, err
        store = LocalStore(home / "home" / "store")
        registry = Path(summary["published_uri"]).relative_to(store.root).as_posix()
        yield Published(home, store, data, config, summary, registry)


def test_the_fine_tuned_model_learns_and_beats_the_base(published):
    summary = published.summary
    assert summary["steps"] == 60 and summary["train_loss"] < 0.5  # the random base: ~7.5
    assert summary["tokens_per_second"] > 0 and summary["mfu"] is None and summary["usd_per_million_tokens"] > 0  # CPU: no peak
    assert summary["base_metric"] == 0.0
    assert summary["finetuned_metric"] >= 0.5, summary
    assert summary["finetuned_eval_loss"] < summary["base_eval_loss"]
    assert summary["published_uri"].endswith(f"registry/acks/v1/{summary['run_id']}")
    assert summary["gguf_uri"].endswith(".gguf") and Path(summary["gguf_uri"]).is_file()
    assert summary["gguf_qtype"] == "f16" and summary["gguf_drop"] == summary["finetuned_metric"] - summary["gguf_metric"] <= 0.05


def test_the_registry_holds_the_merged_model_the_adapter_the_gguf_and_lineage(published, tiny_model_dir):
    store, registry = published.store, published.registry
    manifest = read_manifest(store, registry)
    assert "adapter/adapter_model.safetensors" in manifest.files  # the adapter alone, for multi-LoRA servers
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with_adapter = PeftModel.from_pretrained(base, store.root / registry / "adapter")  # PEFT loads it onto the base
    merged = AutoModelForCausalLM.from_pretrained(store.root / registry / "merged")
    ids = torch.tensor([[3, 17, 42, 99, 5]])
    with torch.no_grad():
        assert torch.allclose(with_adapter(ids).logits, merged(ids).logits, atol=1e-4)
    assert {"lineage.json", "merged/model.safetensors", "gguf/Modelfile"} <= set(manifest.files)
    lineage = json.loads(store.get_bytes(f"{registry}/lineage.json"))
    assert [a["asset"] for a in lineage["artifacts"]] == list(LINEAGE_CHAIN)
    for artifact in lineage["artifacts"]:  # every hash in the lineage is the digest of a published artifact
        assert read_manifest(store, artifact["key"]).digest == artifact["digest"], artifact["asset"]
    assert lineage["partition"] == "acks@v1" and str(store.root) not in json.dumps(lineage)  # keys, no local paths
    smoke = read_ref(store, "acks@v1", "serving_smoke")["stats"]  # the published file, served over HTTP
    assert smoke["file"] == Path(published.summary["gguf_uri"]).name and len(smoke["answers"]) == 2


def test_lineage_verifies_from_the_store_alone(published, monkeypatch):
    monkeypatch.delenv("DAGSTER_HOME")  # no Dagster instance: the store is enough
    code, chain, err = cli("lineage", published.summary["published_uri"], "--json")
    assert code == 0, err
    assert chain["verified"] and chain["files_rehashed"] and chain["dataset_version"] == "acks@v1"
    assert [link["asset"] for link in chain["chain"]] == ["published_model", *LINEAGE_CHAIN, "checkpoint"]
    assert chain["checkpoint"].endswith("checkpoint-00000060")


def test_one_flipped_byte_in_any_artifact_is_named(published, monkeypatch):
    """Comparing manifests alone (--fast) cannot see it; re-hashing every file does."""
    monkeypatch.delenv("DAGSTER_HOME")
    store, uri = published.store, published.summary["published_uri"]
    _, chain, _ = cli("lineage", uri, "--json")
    for link in chain["chain"]:
        manifest = read_manifest(store, link["key"])
        rel = max(manifest.files, key=lambda name: manifest.files[name]["size"])
        path = store.root / link["key"] / rel
        original = path.read_bytes()
        middle = len(original) // 2
        path.write_bytes(original[:middle] + bytes([original[middle] ^ 1]) + original[middle + 1 :])
        try:
            code, broken, _ = cli("lineage", uri, "--json")
            assert code == 1 and not broken["verified"], link["asset"]
            assert [entry["status"] for entry in broken["chain"] if entry["status"] != "ok"] == [f"CHANGED: {link['key']}/{rel}"]
            code, fast, _ = cli("lineage", uri, "--json", "--fast")
            assert code == 0 and fast["verified"] and not fast["files_rehashed"]
        finally:
            path.write_bytes(original)


def test_a_copied_store_verifies_at_its_new_path_and_a_missing_link_is_named(published, monkeypatch, tmp_path):
    """Lineage holds store-relative keys, so a copy verifies where it lies; a link whose manifest is gone fails."""
    monkeypatch.delenv("DAGSTER_HOME")
    moved = tmp_path / "moved-store"
    shutil.copytree(published.store.root, moved)
    code, there, err = cli("lineage", str(moved / published.registry), "--json")
    assert code == 0 and there["verified"], err
    assert all(link["uri"].startswith(str(moved)) for link in there["chain"])
    (moved / there["chain"][2]["key"] / "manifest.json").unlink()
    code, chain, _ = cli("lineage", str(moved / published.registry), "--json")
    assert code == 1 and chain["chain"][2]["status"] == "missing from the store" and not chain["verified"]


def test_a_rerun_skips_every_plane_and_a_forced_one_does_not_republish(published):
    store, registry, summary = published.store, published.registry, published.summary
    args = ("run", "--in-process", "--dataset", str(published.data), "--name", "acks", "--version", "v1", "--config", str(published.config), "--json")
    before = store.get_bytes(f"{registry}/manifest.json")
    code, again, err = cli(*args)
    assert code == 0, err
    assert again["skipped"] == ["data", "training", "delivery"] and again["runs"] == {}
    assert again["published_uri"] == summary["published_uri"] and again["finetuned_metric"] == summary["finetuned_metric"]
    code, forced, err = cli(*args, "--until", "delivery", "--force")
    assert code == 0, err
    assert forced["skipped"] == [] and forced["published_uri"] == summary["published_uri"]
    assert store.get_bytes(f"{registry}/manifest.json") == before
    assert "already published" in err


def test_eval_gate_blocks_a_model_that_is_not_better(home, capsys, tiny_model_dir):
    config = home / "run_config.yaml"
    config.write_text(yaml.safe_dump(run_config(tiny_model_dir, steps=2, lr=1e-6)))
    data = write_dataset(home / "data", rows=120)
    code, _, err = run_cli(capsys, "run", "--in-process", "--dataset", str(data), "--name", "acks", "--version", "weak", "--config", str(config))
    assert code == 2
    assert "blocking check finetuned_beats_base failed" in err
    assert not (home / "home" / "store" / "registry").exists()


def test_every_asset_writes_the_stats_other_modules_read(published):
    for asset, kind in STATS.items():  # the CLI, the control plane and delivery read these fields of other assets
        ref = read_ref(published.store, "acks@v1", asset)
        assert stats_of(ref, kind) is ref["stats"], asset
    adapter = read_ref(published.store, "acks@v1", "lora_adapter")
    del adapter["stats"]["run_id"], adapter["stats"]["steps"]  # as a reference written by an older ft-assets
    with pytest.raises(RefOutdated, match=r"lora_adapter of acks@v1 \(.+\) has no run_id, steps in its stats: .+ materialize lora_adapter again"):
        stats_of(adapter, STATS["lora_adapter"])
