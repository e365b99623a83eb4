"""Security: secrets never leak, names cannot escape their prefix, no code runs from a model or checkpoint.

The leak test is also the pipeline's S3 end-to-end run: with ``FT_STORE=s3://…`` on SeaweedFS,
``ft-assets run`` evaluates the sensor and runs the data, training and delivery planes with the tiny
model, while ``AWS_SECRET_ACCESS_KEY`` (the server's real secret), ``HF_TOKEN`` and
``DAGSTER_PG_PASSWORD`` hold recognizable values. Then every place an output can land is searched for
them (raw, base64 and hex): captured stdout/stderr of the process and its children, the Dagster event
log of every run (materialization metadata included), run tags and run config, every file under the
Dagster home (SQLite databases, compute logs), the project and scratch folders, and every object in the
bucket (manifests, references, lineage.json, safetensors headers, GGUF metadata).
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import re
import shutil
import uuid
from collections import Counter
from pathlib import Path

import dagster as dg
import pytest
import torch
import yaml
from dagster._serdes import serialize_value

from ft_assets.cli import main
from ft_assets import layout
from ft_assets.partitions import DatasetVersion, InvalidDatasetId
from ft_assets.refs import read_ref
from ft_assets.manifests import MANIFEST, fetch_artifact, read_manifest
from ft_assets.storage import LocalStore, StoreError, join_key, open_store, sha256_file
from ft_assets.training import base_model as bm
from ft_assets.training.checkpoints import UntrustedCheckpoint
from ft_assets.training.model import load_model
from ft_assets.training.recipe import train
from ft_assets_tests.support import RUN, record_figures, run_config, write_dataset
from ft_assets_tests.support import training_config as config

REPO = Path(__file__).resolve().parents[1]


# --- secrets: one S3 end-to-end run, then every output searched --------------------------------------


def encodings(secret: str) -> dict[str, bytes]:
    raw = secret.encode()
    return {
        "raw": raw,
        "base64": base64.b64encode(raw).rstrip(b"="),
        "base64url": base64.urlsafe_b64encode(raw).rstrip(b"="),
        "hex": raw.hex().encode(),
    }


def find_leaks(where: str, data: bytes, secrets: dict[str, str]) -> list[str]:
    return [
        f"{name} ({form}) in {where}"
        for name, secret in secrets.items()
        for form, needle in encodings(secret).items()
        if needle in data
    ]


@pytest.mark.integration
def test_pipeline_on_s3_end_to_end_leaks_no_secret(s3_env, seaweedfs, tmp_path, monkeypatch, capfd, tiny_model_dir):
    secrets = {
        "AWS_SECRET_ACCESS_KEY": os.environ["AWS_SECRET_ACCESS_KEY"],  # what SeaweedFS checks signatures with
        "HF_TOKEN": f"hf_CANARY{uuid.uuid4().hex}",
        "DAGSTER_PG_PASSWORD": f"pg-CANARY-{uuid.uuid4().hex}",
    }
    for name, value in secrets.items():
        monkeypatch.setenv(name, value)
    home = tmp_path / "home"
    monkeypatch.setenv("FT_STORE", s3_env)
    monkeypatch.setenv("FT_HOME", str(home))
    monkeypatch.setenv("DAGSTER_HOME", str(home / "dagster_home"))
    monkeypatch.setenv("FT_SCRATCH", str(tmp_path / "scratch"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    (tmp_path / "run_config.yaml").write_text(yaml.safe_dump(run_config(tiny_model_dir, steps=60, lr=0.01)))
    data = write_dataset(tmp_path / "data")

    code = main(
        [
            "run",
            "--dataset",
            str(data),
            "--name",
            "acks",
            "--version",
            "s3e2e",
            "--config",
            str(tmp_path / "run_config.yaml"),
            "--json",
        ]
    )
    captured = capfd.readouterr()
    assert code == 0, captured.err[-5000:]
    summary = json.loads(captured.out.strip().splitlines()[-1])

    # The end-to-end part: the sensor registered the version, each plane ran, the model is published on S3.
    assert summary["partition"] == "acks@s3e2e" and summary["store"] == s3_env
    assert set(summary["runs"]) == {"data", "training", "delivery"}
    assert summary["accounting_invariant_holds"] and summary["steps"] == 60
    assert summary["published_uri"].startswith(f"{s3_env}/registry/acks/s3e2e/")
    store = open_store(s3_env)
    registry = summary["published_uri"][len(s3_env) + 1 :]
    assert {"lineage.json", "merged/model.safetensors"} <= set(read_manifest(store, registry).files)
    lineage = store.get_json(join_key(registry, "lineage.json"))
    assert all(read_manifest(store, artifact["key"]).digest == artifact["digest"] for artifact in lineage["artifacts"])
    assert read_ref(store, "acks@s3e2e", "lora_adapter")["uri"].startswith(s3_env)
    assert main(["lineage", summary["published_uri"], "--json"]) == 0  # every file re-hashed, streamed from S3
    lineage_report = capfd.readouterr()
    assert json.loads(lineage_report.out.strip().splitlines()[-1])["verified"]

    leaks, searched = [], Counter()
    leaks += find_leaks("captured stdout", captured.out.encode(), secrets)
    leaks += find_leaks("captured stderr", captured.err.encode(), secrets)
    leaks += find_leaks("lineage output", (lineage_report.out + lineage_report.err).encode(), secrets)
    searched["captured streams"] += 2

    instance = dg.DagsterInstance.get()
    runs = instance.get_runs()
    assert len(runs) >= 3
    for run in runs:
        leaks += find_leaks(f"run {run.run_id} tags", json.dumps(run.tags).encode(), secrets)
        leaks += find_leaks(f"run {run.run_id} config", json.dumps(run.run_config, default=str).encode(), secrets)
        for entry in instance.all_logs(run.run_id):  # messages and every event, materialization metadata included
            leaks += find_leaks(f"event log of run {run.run_id}", serialize_value(entry).encode(), secrets)
            searched["event log entries"] += 1
    for folder in (home, tmp_path / "scratch"):  # Dagster's SQLite databases and compute logs are under home
        for path in (p for p in folder.rglob("*") if p.is_file()):
            leaks += find_leaks(str(path), path.read_bytes(), secrets)
            searched["local files"] += 1
            searched["compute log files"] += "compute_logs" in path.parts
    client = seaweedfs.client()
    bucket = s3_env.removeprefix("s3://").split("/")[0]
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for obj in page.get("Contents", []):
            body = client.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
            leaks += find_leaks(f"s3://{bucket}/{obj['Key']}", body, secrets)
            searched["bucket objects"] += 1
            searched["GGUF files"] += obj["Key"].endswith(".gguf")
            searched["safetensors files"] += obj["Key"].endswith(".safetensors")
    record_figures(
        "secrets", secrets=sorted(secrets), encodings=sorted(encodings("x")), searched=dict(searched), leaks=len(leaks)
    )
    assert leaks == [], leaks
    assert searched["bucket objects"] > 30 and searched["GGUF files"] >= 1 and searched["safetensors files"] >= 3, (
        searched
    )
    assert searched["event log entries"] > 100 and searched["compute log files"] >= 3, searched


def test_credentials_come_from_the_environment_only():
    from ft_assets.definitions import defs

    secretish = re.compile(r"secret|password|token|credential|access_key", re.I)
    for key, resource in defs.resources.items():
        fields = type(resource).model_fields if hasattr(type(resource), "model_fields") else {}
        assert not [name for name in fields if secretish.search(name)], f"resource {key} takes a credential as config"
    prod = yaml.safe_load((REPO / "dagster.prod.yaml").read_text())
    postgres = prod["storage"]["postgres"]["postgres_db"]
    assert postgres["password"] == {"env": "DAGSTER_PG_PASSWORD"}  # a Dagster EnvVar, never a literal
    canary = f"CANARY{uuid.uuid4().hex}"
    with pytest.raises(StoreError, match="must not carry credentials") as info:
        open_store(f"s3://AKIAEXAMPLE:{canary}@my-bucket/store")
    assert canary not in str(info.value)


# --- names, versions and object keys cannot escape their prefix ---------------------------------------

TRAVERSALS = [
    # (what, the hostile value, the call that must refuse it given a store root, the error)
    ("dataset name", "../../etc", lambda v, root: DatasetVersion(v, "v1"), InvalidDatasetId),
    ("dataset version", "..", lambda v, root: DatasetVersion("acks", v), InvalidDatasetId),
    ("version with a slash", "v1/../../x", lambda v, root: DatasetVersion("acks", v), InvalidDatasetId),
    ("partition key", "../x@v1", lambda v, root: DatasetVersion.from_key(v), InvalidDatasetId),
    ("object key", "runs/../../outside.txt", lambda v, root: LocalStore(root).put_bytes(v, b"x"), StoreError),
    ("absolute object key", "/etc/passwd", lambda v, root: LocalStore(root).get_bytes(v), StoreError),
    ("lease of a partition", "acks@../../x", lambda v, root: layout.of(v).lease, InvalidDatasetId),
    ("reference key", "..@v1", lambda v, root: layout.of(v).ref("raw_dataset"), InvalidDatasetId),
]


@pytest.mark.parametrize("what,value,call,error", TRAVERSALS, ids=[t[0] for t in TRAVERSALS])
def test_path_traversal_is_refused(tmp_path, what, value, call, error):
    with pytest.raises(error):
        call(value, tmp_path / "store")
    assert not (tmp_path / "outside.txt").exists()


def test_a_manifest_path_with_dot_dot_is_refused(tmp_path):
    store = LocalStore(tmp_path / "store")
    store.put_json(
        join_key("runs/evil", MANIFEST),
        {"prefix": "runs/evil", "files": {"../../../planted.txt": {"size": 1, "sha256": "0"}}, "created_at": 0},
    )
    with pytest.raises(StoreError, match="invalid object key"):
        fetch_artifact(store, "runs/evil", tmp_path / "dest" / "a" / "b")
    assert not list(tmp_path.rglob("planted.txt"))


@pytest.mark.parametrize("argv,message", [
    (["run", "--dataset", "<data>", "--name", "../evil"], "invalid dataset name '../evil'"),
    (["run", "--dataset", "<data>", "--version", "v1/../../x"], "invalid dataset version"),
    (["lineage", "<store>/registry/../../etc"], "invalid object key"),
])  # fmt: skip
def test_the_command_line_refuses_traversal_with_exit_code_2(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.setenv("FT_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home" / "dagster_home"))
    monkeypatch.delenv("FT_STORE", raising=False)
    data = write_dataset(tmp_path / "data", rows=3)
    store = tmp_path / "home" / "store"
    argv = [a.replace("<data>", str(data)).replace("<store>", str(store)) for a in argv]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert not store.exists() or not [p for p in store.rglob("*") if p.is_file()]


# --- no code from a model or a checkpoint runs unless you say so ---------------------------------------


class Payload:
    """Unpickling this creates ``marker``: the proof that a loader ran code from a file."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_the_payload_runs_code_when_unpickled(tmp_path):
    """Without this the tests below could pass because the payload is inert."""
    pickle.loads(pickle.dumps(Payload(tmp_path / "ran"))).close()
    assert (tmp_path / "ran").exists()


REMOTE_CODE = """from pathlib import Path
Path({marker!r}).write_text("remote code ran")
from transformers import LlamaConfig
class EvilConfig(LlamaConfig):
    model_type = "llama"
"""


def model_dir_with(
    tiny_model_dir: Path,
    folder: Path,
    *,
    remote_code: Path | None = None,
    pickle_marker: Path | None = None,
    safetensors=True,
) -> Path:
    shutil.copytree(tiny_model_dir, folder)
    if remote_code is not None:
        (folder / "configuration_evil.py").write_text(REMOTE_CODE.format(marker=str(remote_code)))
        config = json.loads((folder / "config.json").read_text())
        config["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig"}
        (folder / "config.json").write_text(json.dumps(config))
    if pickle_marker is not None:
        torch.save({"model.embed_tokens.weight": Payload(pickle_marker)}, folder / "pytorch_model.bin")
    if not safetensors:
        for path in folder.glob("*.safetensors"):
            path.unlink()
    return folder


def test_model_code_from_the_source_is_refused_unless_trusted(tiny_model_dir, tmp_path):
    marker = tmp_path / "remote-code-ran"
    source = bm.resolve_source(str(model_dir_with(tiny_model_dir, tmp_path / "model", remote_code=marker)))
    with pytest.raises(
        bm.BaseModelError,
        match=r"ships its own model code \(auto_map \['AutoConfig'\], configuration_evil.py\).*trust_remote_code=true",
    ):
        bm.materialize_source(source, tmp_path / "out", allow_pickle_weights=False)
    assert not (tmp_path / "out").exists() and not marker.exists()
    bm.materialize_source(
        source, tmp_path / "trusted", allow_pickle_weights=False, trust_remote_code=True
    )  # explicit opt-in
    assert (tmp_path / "trusted" / "configuration_evil.py").is_file() and not marker.exists()  # copied, never imported


def test_trust_remote_code_and_pickle_weights_are_off_by_default():
    from ft_assets.training.assets import BaseModelConfig

    defaults = BaseModelConfig()
    assert defaults.trust_remote_code is False and defaults.allow_pickle_weights is False


def test_pickle_only_weights_are_refused_with_a_clear_message(tiny_model_dir, tmp_path):
    marker = tmp_path / "pickle-ran"
    folder = model_dir_with(tiny_model_dir, tmp_path / "model", pickle_marker=marker, safetensors=False)
    with pytest.raises(
        bm.BaseModelError, match=r"only pickle-based weights \(pytorch_model.bin\); loading them can run arbitrary code"
    ):
        bm.materialize_source(bm.resolve_source(str(folder)), tmp_path / "out", allow_pickle_weights=False)
    with pytest.raises(FileNotFoundError, match="loads safetensors only"):
        load_model(config(), "lora", folder, torch.device("cpu"))
    assert not marker.exists()


def test_weights_load_from_safetensors_even_next_to_a_pickle(tiny_model_dir, tmp_path):
    markers = tmp_path / "pickle-ran", tmp_path / "remote-code-ran"
    folder = model_dir_with(tiny_model_dir, tmp_path / "model", pickle_marker=markers[0], remote_code=markers[1])
    model = load_model(config(), "lora", folder, torch.device("cpu"))
    assert sum(p.numel() for p in model.parameters()) > 0
    assert not any(marker.exists() for marker in markers)


@pytest.mark.integration
def test_a_pickled_payload_in_a_checkpoint_is_refused_with_a_clear_message(tiny_model, shards, tmp_path):
    store = LocalStore(tmp_path / "store")
    cfg = config(max_steps=4, save_steps=2)
    train(cfg, tiny_model, shards, store, RUN, tmp_path / "w1", log=lambda line: None)
    # An attacker with write access replaces the optimizer state of the newest checkpoint and fixes up
    # its manifest, so the sha256 check passes: only the loader stands between the file and the code.
    marker = tmp_path / "pickle-ran"
    prefix = layout.checkpoint(RUN, 4)
    payload = tmp_path / "optimizer.pt"
    torch.save({"state": Payload(marker), "param_groups": []}, payload)
    store.put_file(join_key(prefix, "optimizer.pt"), payload)
    manifest = store.get_json(join_key(prefix, MANIFEST))
    manifest["files"]["optimizer.pt"] = {"size": payload.stat().st_size, "sha256": sha256_file(payload)}
    store.put_json(join_key(prefix, MANIFEST), manifest)

    with pytest.raises(
        UntrustedCheckpoint,
        match=r"refusing to load .*checkpoint-00000004/optimizer.pt: it holds pickled objects other than tensors",
    ):
        train(
            cfg.model_copy(update={"max_steps": 6}),
            tiny_model,
            shards,
            store,
            RUN,
            tmp_path / "w2",
            log=lambda line: None,
        )
    assert not marker.exists()
