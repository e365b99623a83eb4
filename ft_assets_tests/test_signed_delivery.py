"""Signed delivery end to end: the session's published run (``published.py``: one ``ft-assets run`` with
``FT_SIGNING_KEY`` set) holds ``model.sig``, which ``model_signing verify`` (the library's own CLI) accepts;
serving_smoke verified it before serving; the run is a model version in MLflow's registry (champion) with its
signature digest; one flipped byte (in a copy of the run) makes both that CLI and ``ft-assets lineage --public-key``
refuse, naming the file; rewritten with a matching manifest, serving_smoke refuses it."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest

from ft_assets.delivery import model_registry, signing
from ft_assets.delivery.assets import serving_smoke
from ft_assets.delivery.config import ServingConfig
from ft_assets.manifests import publish_dir, read_manifest
from ft_assets.refs import read_ref
from ft_assets.resources import ObjectStoreResource
from ft_assets_tests.support import run_cli

pytestmark = pytest.mark.integration
CLI = str(Path(sys.executable).parent / "model_signing")


def model_signing_verify(directory: Path, public: Path) -> subprocess.CompletedProcess:
    signature = directory / signing.SIGNATURE_FILE
    command = [CLI, "verify", "key", str(directory), "--signature", str(signature), "--public_key", str(public),
               "--ignore-paths", str(signature)]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def test_a_signed_run_is_verified_by_model_signing_and_lineage_and_registered(
    published_run, capsys, monkeypatch, tmp_path
):
    store, summary, public = published_run.store, published_run.summary, published_run.public_key
    published = Path(summary["published_uri"])
    prefix = published.relative_to(store.root).as_posix()
    signature_sha256 = hashlib.sha256((published / "model.sig").read_bytes()).hexdigest()
    assert read_manifest(store, prefix).files["model.sig"]["sha256"] == signature_sha256
    stats = read_ref(store, "acks@v1", "published_model")["stats"]["signature"]
    assert stats["signed"] and stats["method"] == "key" and stats["sha256"] == signature_sha256
    assert stats["files"] == len(read_manifest(store, prefix).files) - 1  # every published file but model.sig itself
    assert read_ref(store, "acks@v1", "serving_smoke")["stats"]["signature"].startswith("signed (key sha256:")
    result = model_signing_verify(published, public)
    assert result.returncode == 0 and "Verification succeeded" in result.stdout, result.stderr

    monkeypatch.delenv("DAGSTER_HOME", raising=False)  # lineage reads the store alone
    code, chain, err = run_cli(capsys, "lineage", str(published), "--json", "--public-key", str(public))
    assert code == 0 and chain["verified"] and chain["signature"]["status"].startswith("ok, signed (key"), err
    code, chain, _ = run_cli(capsys, "lineage", str(published), "--json")
    assert code == 0 and chain["signature"]["status"].startswith("signed; not checked")

    version = model_registry_champion(published_run.tracking_uri)
    assert version.source == str(published) and version.tags["ft.signature.sha256"] == signature_sha256
    assert version.tags["ft.digest.published_model"] == read_manifest(store, prefix).digest
    assert version.tags["ft.dataset_version"] == "acks@v1" and version.tags["ft.gate.passed"] == "True"

    # One flipped byte in the shipped GGUF of a copy of the run: both verifiers refuse, ours naming the file.
    run = published_run.copy(tmp_path / "copy")
    store, published = run.store, Path(run.summary["published_uri"])
    gguf = published / "gguf" / Path(run.summary["gguf_uri"]).name
    original = gguf.read_bytes()
    gguf.write_bytes(original[:1000] + bytes([original[1000] ^ 1]) + original[1001:])
    result = model_signing_verify(published, public)
    assert result.returncode == 1 and "Verification failed" in result.stderr
    code, chain, _ = run_cli(capsys, "lineage", str(published), "--json", "--public-key", str(public))
    assert code == 1 and not chain["verified"]
    assert (
        chain["signature"]["status"].startswith("REFUSED:")
        and f"(changed: gguf/{gguf.name})" in chain["signature"]["status"]
    )

    # Whoever can write the bucket rewrites the manifest to match: lineage's digests change, the signature still refuses,
    # and serving_smoke will not serve it.
    rewritten = tmp_path / "rewritten"
    shutil.copytree(published, rewritten)
    publish_dir(store, prefix, rewritten)
    run.env(monkeypatch)  # the copy's FT_HOME: serving_smoke reads its store
    monkeypatch.setenv(signing.PUBLIC_KEY_ENV, str(public))  # and verifies with the public key
    refs = {name: read_ref(store, "acks@v1", name) for name in ("published_model", "lora_adapter")}
    changed = r"not serving .*: .*\(changed: gguf/" + gguf.name.replace(".", r"\.") + r"\)"
    with dg.build_asset_context(partition_key="acks@v1") as context, pytest.raises(dg.Failure, match=changed):
        serving_smoke(context, ServingConfig(), ObjectStoreResource(), refs["published_model"], refs["lora_adapter"])


def model_registry_champion(tracking: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=tracking).get_model_version_by_alias("acks", model_registry.CHAMPION)
