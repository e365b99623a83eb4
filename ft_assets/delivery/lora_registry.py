"""Multi-LoRA by the registry: several published adapters of one base behind one vLLM server.

A published run keeps its adapter alone under ``registry/<name>/<version>/<run>/adapter/`` and names its
base there (``adapter_config.json``: a Hub id, or the base's key in the store, ``models/<slug>/<sha>``).
``resolve`` takes registry keys or URIs (``registry/acks/v1/<run>``, ``s3://bucket/prefix/registry/...``),
downloads each adapter (sha256-verified against its manifest) and the base when it lives in the store, and
refuses adapters of different bases: one vLLM server holds one base. ``command`` is then the
``vllm serve BASE --enable-lora --lora-modules name=path ...`` a server needs; each version answers under
``<name>-<version>`` (or the name given as ``NAME=KEY``).

    python -m ft_assets.delivery.lora_registry --store s3://bucket/ft registry/acks/v1/<run> registry/acks/v2/<run>
    python -m ft_assets.delivery.lora_registry --serve registry/acks/v1/<run> registry/acks/v2/<run>

The first prints that ``vllm serve`` command (the adapters land in ``--dest``; ``--args-file`` also writes
its arguments to a file); ``--serve`` also starts the server from the serving venv (``ft_assets.delivery.vllm``)
until Ctrl-C. ``--k8s deploy/vllm/deployment.yaml`` renders the Kubernetes recipe for the runs instead,
downloading nothing: its init container runs this module in the cluster. Adapters cost a vLLM server
little: the tiny test's two adapters add ~20 KB each to a base that stays loaded once.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from ft_assets import layout
from ft_assets.delivery import vllm
from ft_assets.delivery.vllm import lora_rank
from ft_assets.manifests import ArtifactNotFound, fetch_artifact, read_manifest
from ft_assets.storage import ObjectStore, open_store

ADAPTER = "adapter"  # the adapter's folder inside a published run (published_model)
MODULE_NAME = re.compile(r"[A-Za-z0-9][\w.-]*")


class RegistryError(ValueError):
    """A registry key that cannot be served (what, which key, what to do)."""


@dataclass(frozen=True)
class LoraSet:
    """What one vLLM server needs: the base (a local folder, or a Hub id) and the adapters by served name."""

    base: str
    adapters: dict[str, Path]

    def command(self) -> list[str]:
        """``vllm serve`` with the base and every adapter (``--max-lora-rank`` holds the largest rank)."""
        modules = [f"{name}={path}" for name, path in self.adapters.items()]
        return [
            "vllm", "serve", self.base, "--enable-lora", "--max-loras", str(len(modules)),
            "--max-lora-rank", str(lora_rank(list(self.adapters.values()))), "--lora-modules", *modules,
        ]  # fmt: skip


def split_name(entry: str) -> tuple[str | None, str]:
    """``NAME=KEY`` → (NAME, KEY); a bare key → (None, KEY)."""
    name, sep, key = entry.partition("=")
    if sep and "/" not in name and "://" not in name:
        if not MODULE_NAME.fullmatch(name):
            raise RegistryError(f"{entry}: a LoRA module name is letters, digits, '.', '_' or '-'")
        return name, key
    return None, entry


def served_name(key: str) -> str:
    """``registry/<name>/<version>/<run>`` → ``<name>-<version>``, the name the adapter answers to."""
    parts = key.split("/")
    if len(parts) != 4 or parts[0] != layout.REGISTRY:
        raise RegistryError(f"{key} is not a published run: expected {layout.REGISTRY}/<name>/<version>/<run>")
    return f"{parts[1]}-{parts[2]}"


def resolve(store: ObjectStore, entries: list[str], dest: Path) -> LoraSet:
    """Download the adapters of ``entries`` (registry keys or URIs of ``store``, optionally ``NAME=KEY``) and their
    common base into ``dest``; refuses an entry without an adapter and adapters of different bases."""
    if not entries:
        raise RegistryError("name at least one published run (registry/<name>/<version>/<run>)")
    adapters: dict[str, Path] = {}
    bases: dict[str, str] = {}
    for entry in entries:
        name, uri = split_name(entry)
        _, key = layout.registry_key(uri)
        name = name or served_name(key)
        if name in adapters:
            raise RegistryError(f"{entry}: the name {name!r} is taken by another adapter; give one as NAME={uri}")
        try:
            manifest = read_manifest(store, key)
        except ArtifactNotFound as exc:
            raise RegistryError(
                f"{store.uri(key)} is not published (no manifest): check the key with `ft-assets lineage`"
            ) from exc
        if f"{ADAPTER}/adapter_config.json" not in manifest.files:
            raise RegistryError(
                f"{store.uri(key)} has no adapter (a full fine-tune): serve its merged/ folder as a model instead"
            )
        fetch_artifact(store, key, dest / name, include=lambda rel: rel.startswith(f"{ADAPTER}/"))
        adapters[name] = dest / name / ADAPTER
        bases[name] = json.loads((adapters[name] / "adapter_config.json").read_text())["base_model_name_or_path"]
    if len(set(bases.values())) > 1:
        listed = ", ".join(f"{name}: {base}" for name, base in bases.items())
        raise RegistryError(
            f"these adapters have different bases ({listed}); one vLLM server serves adapters of one base"
        )
    return LoraSet(_fetch_base(store, next(iter(bases.values())), dest), adapters)


def _fetch_base(store: ObjectStore, base: str, dest: Path) -> str:
    """A base named by its store key is downloaded next to the adapters; a Hub id is left for vLLM to fetch."""
    if not base.startswith(f"{layout.MODELS}/"):
        return base
    try:
        fetch_artifact(store, base, dest / "base")
    except ArtifactNotFound as exc:
        raise RegistryError(
            f"the adapters' base {store.uri(base)} is not in this store: use the store they were published to"
        ) from exc
    return str(dest / "base")


def render_deployment(template: str, runs: list[str]) -> list[dict]:
    """The documents of a Kubernetes recipe (``deploy/vllm/deployment.yaml``) with ``runs`` as the arguments of its
    ``fetch-adapters`` init container; each run is checked to be a registry key first (nothing is downloaded)."""
    for entry in runs:
        served_name(layout.registry_key(split_name(entry)[1])[1])
    documents = [document for document in yaml.safe_load_all(template) if document]
    init = [
        container for document in documents if document.get("kind") == "Deployment"
        for container in document["spec"]["template"]["spec"].get("initContainers", []) if container["name"] == "fetch-adapters"
    ]  # fmt: skip
    if len(init) != 1:
        raise RegistryError(
            "the template needs one Deployment with one init container named fetch-adapters (see deploy/vllm/deployment.yaml)"
        )
    init[0]["args"] = list(runs)
    return documents


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ft_assets.delivery.lora_registry", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "runs", nargs="+", help="published runs: registry/<name>/<version>/<run> or its URI, optionally NAME=KEY"
    )
    parser.add_argument(
        "--store", default=None, help="the store (default: the runs' URIs' store, else FT_STORE, else $FT_HOME/store)"
    )
    parser.add_argument(
        "--dest", type=Path, default=Path("var/lora"), help="where the adapters and base are downloaded"
    )
    parser.add_argument(
        "--serve", action="store_true", help="start vLLM's OpenAI-compatible server with them until Ctrl-C"
    )
    parser.add_argument("--args-file", type=Path, help="also write the arguments of `vllm serve` to this file")
    parser.add_argument(
        "--k8s",
        type=Path,
        metavar="TEMPLATE",
        help="print TEMPLATE (deploy/vllm/deployment.yaml) rendered for the runs",
    )
    args = parser.parse_args(argv)
    if args.k8s:
        try:
            print(yaml.safe_dump_all(render_deployment(args.k8s.read_text(), args.runs), sort_keys=False), end="")
        except (RegistryError, ValueError, OSError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return 0
    try:
        stores = {layout.registry_key(split_name(entry)[1])[0] for entry in args.runs} - {""}
        if args.store is None and len(stores) > 1:
            raise RegistryError(
                f"the runs name {len(stores)} stores ({', '.join(sorted(stores))}); serve adapters of one store"
            )
        loras = resolve(open_store(args.store or next(iter(stores), None)), args.runs, args.dest.resolve())
    except (RegistryError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.args_file:
        args.args_file.write_text(shlex.join(loras.command()[2:]) + "\n")
    if not args.serve:
        print(shlex.join(loras.command()))
        return 0
    with vllm.serve(loras.base, loras.adapters) as server:
        print(f"serving {', '.join(server.models)} at {server.url}/v1 (Ctrl-C stops it)", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
