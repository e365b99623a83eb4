"""One run of all four planes on the tiny model, published once for the whole session (``conftest.published_run``).

The run ``test_pipeline.py`` (lineage, the registry's files, reruns) and ``test_signed_delivery.py`` (model.sig,
``model_signing verify``, the MLflow registry) check: ``ft-assets run --in-process`` on the 240-row dataset, 60 LoRA
steps, general_eval's default (the shipped ft-general-mini on the base, the merged model and the GGUF), signed with an EC P-256 key (``FT_SIGNING_KEY``, ``serving_smoke`` verifying with ``FT_SIGNING_PUBLIC_KEY``)
and tracked in a local MLflow registry (SQLite). Built twice before, once per module (~1 min each on 2 idle cores).
A test that changes files works on ``copy()``, never on the shared run.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from ft_assets.delivery import signing
from ft_assets.storage import LocalStore
from ft_assets_tests.support import run_cli_quiet, run_config, write_dataset

NAME, VERSION = "acks", "v1"


@dataclass(frozen=True)
class Published:
    """The published run: its project folder (FT_HOME is ``home / "home"``), store, inputs and ``--json`` summary."""

    home: Path
    store: LocalStore
    data: Path
    config: Path
    summary: dict
    registry: str  # the published model's key in the store
    private_key: Path  # what it was signed with
    public_key: Path

    @property
    def tracking_uri(self) -> str:
        """The MLflow registry it was registered in, for a client anywhere."""
        return f"sqlite:///{self.home / 'mlflow.db'}"

    def env(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """The environment the run had: its folder as the working directory (the run config's MLflow registry is
        ``sqlite:///mlflow.db`` there), its FT_HOME and Dagster instance, one torch thread, its signing key (a rerun
        signs as it did). Its public key is left out: ``ft-assets lineage`` would then check the signature."""
        monkeypatch.chdir(self.home)
        monkeypatch.setenv("FT_HOME", str(self.home / "home"))
        monkeypatch.setenv("DAGSTER_HOME", str(self.home / "home" / "dagster_home"))
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        monkeypatch.delenv("FT_STORE", raising=False)
        monkeypatch.setenv(signing.KEY_ENV, str(self.private_key))
        monkeypatch.delenv(signing.PUBLIC_KEY_ENV, raising=False)

    def copy(self, dest: Path) -> Published:
        """The whole project folder copied to ``dest`` (store, instance, keys, MLflow registry), the summary's paths
        moved with it; the run config is the same file (a rerun there tracks into the copy's registry: ``env``)."""
        shutil.copytree(self.home, dest)
        moved = json.loads(json.dumps(self.summary).replace(str(self.home), str(dest)))
        return replace(
            self, home=dest, store=LocalStore(dest / "home" / "store"), data=dest / self.data.relative_to(self.home),
            config=dest / self.config.relative_to(self.home), summary=moved,
            private_key=dest / self.private_key.relative_to(self.home), public_key=dest / self.public_key.relative_to(self.home),
        )  # fmt: skip


def key_pair(folder: Path) -> tuple[Path, Path]:
    """An EC P-256 signing key pair in PEM files (private key mode 600), as ``model_signing`` takes them."""
    key = ec.generate_private_key(ec.SECP256R1())
    folder.mkdir(mode=0o700)
    private, public = folder / "signing.pem", folder / "signing.pub"
    private.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    private.chmod(0o600)
    public.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return private, public


def run_argv(data: Path, config: Path) -> list[str]:
    return ["run", "--in-process", "--dataset", str(data), "--name", NAME, "--version", VERSION, "--config", str(config),
            "--json"]  # fmt: skip


def publish(home: Path, tiny_model_dir: Path) -> Published:
    """``ft-assets run`` of a new dataset version through data → training → delivery → registry, signed and tracked."""
    private, public = key_pair(home / "keys")
    settings = run_config(tiny_model_dir, steps=60, lr=0.01)
    del settings["ops"]["general_eval"]  # the default general check (the shipped task): the suite's one full run of it
    # A local registry (MLflow's server takes no local store path as a source), relative to the run's folder: a copy of
    # the folder reruns with the same settings, tracking into its own registry.
    settings["ops"]["lora_adapter"]["config"]["mlflow_tracking_uri"] = "sqlite:///mlflow.db"
    config = home / "run_config.yaml"
    config.write_text(yaml.safe_dump(settings))
    data = write_dataset(home / "data")
    run = Published(home, LocalStore(home / "home" / "store"), data, config, {}, "", private, public)
    with pytest.MonkeyPatch.context() as env:
        run.env(env)
        env.setenv(signing.PUBLIC_KEY_ENV, str(public))  # serving_smoke verifies before it serves
        code, summary, err = run_cli_quiet(*run_argv(data, config))
    assert code == 0, err
    registry = Path(summary["published_uri"]).relative_to(run.store.root).as_posix()
    return replace(run, summary=summary, registry=registry)
