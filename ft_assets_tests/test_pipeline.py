"""All four planes end to end with the tiny model: data → training → delivery → registry, via ft-assets run.

The dataset is one a 2-layer model can learn in a few dozen LoRA steps (every request is answered
with the same short tool call), so the eval gate has something real to measure: the random-init
base never produces the answer, the fine-tuned model does. The run is the session's (``published.py``), which
test_signed_delivery.py reads too; the gate blocking a weak model: test_cli.py (through the instance) and
test_delivery.py (each objective's scorer).
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from ft_assets.cli.summaries import general_line
from ft_assets.delivery.assets import general_summary
from ft_assets.delivery.exports import EXPORTS
from ft_assets.delivery.harness import DEFAULT_TASK
from ft_assets.delivery.lineage import LINEAGE_CHAIN
from ft_assets.delivery.regression import GeneralVerdict
from ft_assets.manifests import read_manifest
from ft_assets.refs import STATS, ExportStats, RefOutdated, read_ref, stats_of
from ft_assets_tests.published import Published, run_argv
from ft_assets_tests.support import run_cli_quiet as cli

pytestmark = pytest.mark.integration


@pytest.fixture
def published(published_run, monkeypatch) -> Published:
    """The session's run of all four planes (``conftest.published_run``), with the environment it ran in."""
    published_run.env(monkeypatch)
    return published_run


def test_the_fine_tuned_model_learns_and_beats_the_base(published):
    summary = published.summary
    assert summary["steps"] == 60 and summary["train_loss"] < 0.5  # the random base: ~7.5
    assert (
        summary["tokens_per_second"] > 0 and summary["mfu"] is None and summary["usd_per_million_tokens"] > 0
    )  # CPU: no peak
    assert summary["base_metric"] == 0.0
    assert summary["finetuned_metric"] >= 0.5, summary
    assert summary["finetuned_eval_loss"] < summary["base_eval_loss"]
    assert summary["published_uri"].endswith(f"registry/acks/v1/{summary['run_id']}")
    assert summary["gguf_uri"].endswith(".gguf") and Path(summary["gguf_uri"]).is_file()
    assert (
        summary["gguf_qtype"] == "f16"
        and summary["gguf_drop"] == summary["finetuned_metric"] - summary["gguf_metric"] <= 0.05
    )


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
    shipped = Path(published.summary["gguf_uri"]).name  # the file eval_report scored, listed with every file published
    assert lineage["exports"]["gguf"]["shipped"] == shipped and f"gguf/{shipped}" in manifest.files
    assert {f"gguf/{name}" for name in lineage["exports"]["gguf"]["files"]} <= set(manifest.files)
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
    files = {link["asset"]: read_manifest(store, link["key"]).files for link in chain["chain"]}
    assert [asset for asset, listed in files.items() if not listed] == ["mlx_model"]  # an export that is off: no file
    for link in (link for link in chain["chain"] if files[link["asset"]]):
        manifest = read_manifest(store, link["key"])
        rel = max(manifest.files, key=lambda name: manifest.files[name]["size"])
        path = store.root / link["key"] / rel
        original = path.read_bytes()
        middle = len(original) // 2
        path.write_bytes(original[:middle] + bytes([original[middle] ^ 1]) + original[middle + 1 :])
        try:
            code, broken, _ = cli("lineage", uri, "--json")
            assert code == 1 and not broken["verified"], link["asset"]
            assert [entry["status"] for entry in broken["chain"] if entry["status"] != "ok"] == [
                f"CHANGED: {link['key']}/{rel}"
            ]
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


def test_a_rerun_skips_every_plane_and_a_forced_one_does_not_republish(published, monkeypatch, tmp_path):
    run = published.copy(tmp_path / "copy")  # the forced rerun writes new eval and serving artifacts over the old ones
    run.env(monkeypatch)
    store, registry, summary = run.store, run.registry, run.summary
    args = run_argv(run.data, run.config)
    before = store.get_bytes(f"{registry}/manifest.json")
    code, again, err = cli(*args)
    assert code == 0, err
    assert again["skipped"] == ["data", "training", "delivery"] and again["runs"] == {}
    # nothing ran: the references, copied, still name where the run was published
    assert again["published_uri"] == published.summary["published_uri"]
    assert again["finetuned_metric"] == summary["finetuned_metric"]
    code, forced, err = cli(*args, "--until", "delivery", "--force")
    assert code == 0, err
    assert forced["skipped"] == [] and forced["published_uri"] == summary["published_uri"]  # the same run, here
    assert store.get_bytes(f"{registry}/manifest.json") == before
    assert "already published" in err


def test_every_asset_writes_the_stats_other_modules_read(published):
    kinds = {**STATS, **{export.asset: ExportStats for export in EXPORTS}}
    for asset, kind in kinds.items():  # the CLI, the control plane and delivery read these fields of other assets
        ref = read_ref(published.store, "acks@v1", asset)
        assert stats_of(ref, kind) is ref["stats"], asset
    adapter = read_ref(published.store, "acks@v1", "lora_adapter")
    del adapter["stats"]["run_id"], adapter["stats"]["steps"]  # as a reference written by an older ft-assets
    with pytest.raises(
        RefOutdated,
        match=r"lora_adapter of acks@v1 \(.+\) has no run_id, steps in its stats: .+ materialize lora_adapter again",
    ):
        stats_of(adapter, STATS["lora_adapter"])


def test_the_default_general_check_scores_the_shipped_task_on_every_model(published):
    """general_eval's default: ft-general-mini, shipped with the package, on the base, the merged model and the shipped
    GGUF (in llama.cpp's server); the run's summary line and eval_report's page name each model's figure."""
    summary = published.summary
    task = summary["general"][DEFAULT_TASK]
    assert task["metric"] == "names_answer,none" and {"base", "finetuned", "gguf"} <= set(task), task
    assert summary["general_items"] == 3 * 24 and not summary["general_regressed"]  # 24 items on each of 3 models
    line = general_line(summary)
    assert line.startswith(f"  general (lm-eval): {DEFAULT_TASK} names_answer: base {task['base']:.3f} → fine-tuned ")
    assert f"→ shipped GGUF {task['gguf']:.3f}; kept (72 items, " in line
    general = GeneralVerdict.of(read_ref(published.store, "acks@v1", "eval_report")["stats"]["general"])
    assert general_summary(general)["general_figures"] == line.split(": ", 1)[1].split("; kept")[0]
