"""The lineage manifest of a published model: built by ``published_model``, verified by ``ft-assets lineage``.

``lineage.json`` names every artifact the model came from — dataset version (and its origin), each
data-plane artifact, base model, checkpoint, adapter, merged weights, each export (GGUF files) — with its
manifest digest, plus the training config, eval figures, what each export shipped (or why it shipped
nothing, in one line) and the code version. Artifacts are named by
store-relative keys, never URIs, so a store copied to another path or bucket verifies the same.

Verifying walks the chain from the store alone (no Dagster instance): each link must still have the
manifest digest the lineage recorded and, unless ``rehash`` is off, every file its manifest lists is
re-hashed in the store, so one flipped byte anywhere is named. Re-hashing reads every byte of the
chain, GGUF files and merged weights included; comparing manifests alone (``rehash=False``) reads one
small JSON file per link (12), but cannot see a file changed under an intact manifest.
"""

from __future__ import annotations

import subprocess
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path

from ft_assets.delivery.exports import EXPORTS
from ft_assets.manifests import changed_files, read_manifest
from ft_assets.refs import ArtifactRef
from ft_assets.delivery.signing import lineage_check
from ft_assets.storage import ObjectStore, StoreError, join_key

LINEAGE_FILE = "lineage.json"
LINEAGE_CHAIN = (
    "raw_dataset",
    "cleaned_dataset",
    "deduplicated_dataset",
    "train_eval_split",
    "tokenized_shards",
    "base_model",
    "lora_adapter",
    "merged_model",
    *(export.asset for export in EXPORTS),
    "general_eval",
    "eval_report",
)
REPO_ROOT = Path(__file__).resolve().parents[2]
# eval_report's figures a lineage keeps: the gate's inputs, each export's verdict (its shipped file's score) among them.
EVAL_FIGURES = (
    "metric_name", "base_metric", "finetuned_metric", "base_eval_loss", "finetuned_eval_loss", "improvement", "exports",
    "general",
)  # fmt: skip
OK = "ok"  # the status of a link that verifies


def code_version() -> str:
    """The git commit of this checkout (with '-dirty' if it has local changes), else the package version."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return f"ft-assets {version('ft-assets')}"


def build_lineage(partition: str, refs: dict[str, ArtifactRef], published_key: str, images: dict | None = None) -> dict:
    """The lineage manifest from the references of every asset of the partition; ``images``: a vision-language model's
    shards' pictures (their ``IMAGES_FILE``), listed by content hash under ``images``."""
    missing = [name for name in LINEAGE_CHAIN if name not in refs]
    if missing:
        raise ValueError(f"cannot build lineage for {partition}: no reference for {', '.join(missing)}")
    adapter, base, evaluation = refs["lora_adapter"], refs["base_model"], refs["eval_report"]
    return {
        "partition": partition,
        "dataset_source": refs["raw_dataset"]["stats"].get("source"),  # Hub commit, S3 prefix, mixture components
        "published_key": published_key,
        "code_version": code_version(),
        "base_model": {
            "model_id": base["stats"]["model_id"],
            "source": base["stats"]["source"],
            "source_sha256": base["stats"]["source_sha256"],
            "chat_template": base["stats"].get(
                "chat_template"
            ),  # the base's own, or base_model.chat_template's (named / file)
            "digest": base["digest"],
        },
        "training": {
            "run_id": adapter["stats"]["run_id"],
            "method": adapter["stats"]["method"],
            "config": adapter["training_config"],
            "checkpoint": adapter["checkpoint"],  # {"key", "digest"} of the checkpoint the adapter was exported from
            "steps": adapter["stats"]["steps"],
            "resumed_from_step": adapter["stats"]["resumed_from_step"],
            "image": adapter["stats"].get("worker_image"),  # the worker image's digest and build file (worker_image.py)
        },
        **({"images": images} if images else {}),
        "eval": {k: evaluation["stats"][k] for k in EVAL_FIGURES},
        "exports": exports_shipped(refs, evaluation["stats"]["exports"]),
        "artifacts": [
            {
                "asset": name,
                "key": refs[name]["prefix"],
                "digest": refs[name]["digest"],
                "created_at": refs[name]["created_at"],
                "upstream": {k: v["digest"] for k, v in refs[name].get("upstream", {}).items()},
            }
            for name in LINEAGE_CHAIN
        ],
    }


def exports_shipped(refs: dict[str, ArtifactRef], verdicts: dict[str, dict]) -> dict[str, dict]:
    """Per export: the file that ships (the one eval_report scored) and every file of it the registry holds, or none
    and why (``reason``: turned off, refused by its converter or runtime); ``companions``, the files that ship with it
    (a VLM GGUF's projector), where it has any."""
    return {
        export.name: {
            "asset": export.asset,
            "shipped": verdicts[export.name]["file"],
            "files": refs[export.asset]["stats"]["files"] if verdicts[export.name]["file"] else {},
            "reason": verdicts[export.name]["reason"],
            **(
                {"companions": refs[export.asset]["stats"]["companions"]}
                if verdicts[export.name]["file"] and refs[export.asset]["stats"].get("companions")
                else {}
            ),
        }
        for export in EXPORTS
    }


def exports_of(lineage: dict) -> dict[str, dict]:
    """The exports of a lineage.json; one written before exports were one mechanism (``gguf``, ``gguf_reason``) reads the
    same, since a published model is never rewritten."""
    if "exports" in lineage:
        return lineage["exports"]
    files = lineage.get("gguf", {})
    return {"gguf": {"asset": "gguf_model", "shipped": lineage["eval"].get("gguf_file"), "files": files,
                     "reason": lineage.get("gguf_reason")}}  # fmt: skip


def check_link(
    store: ObjectStore, asset: str, prefix: str, digest: str, created_at: float | None, rehash: bool
) -> dict:
    """One link of the chain: ``ok``, ``DIGEST MISMATCH``, ``missing from the store`` or ``CHANGED: <keys>``."""
    try:
        manifest = read_manifest(store, prefix)
        status = OK if manifest.digest == digest else "DIGEST MISMATCH"
        changed = changed_files(store, manifest) if rehash and status == OK else []
    except StoreError:  # ArtifactNotFound, an unreadable manifest, an object gone mid-read
        status, changed = "missing from the store", []
    if changed:
        status = "CHANGED: " + ", ".join(join_key(prefix, rel) for rel in changed)
    when = datetime.fromtimestamp(created_at, UTC).isoformat(timespec="seconds") if created_at else ""
    return {
        "asset": asset,
        "digest": digest,
        "created_at": when,
        "key": prefix,
        "uri": store.uri(prefix),
        "status": status,
    }


def check_images(store: ObjectStore, images: dict, rehash: bool) -> dict:
    """The pictures a VLM trained and was evaluated on: each still in the store and (``rehash``) hashing to the name
    it is stored by (``<sha256>.<format>``), else the link names the ones that are not."""
    refs = sorted({*images["train"], *images["eval"]})
    listed = {key.rsplit("/", 1)[-1] for key in store.list(images["prefix"])}
    bad = [ref for ref in refs if ref not in listed]
    if rehash:
        bad += [
            ref for ref in refs if ref in listed and store.sha256(join_key(images["prefix"], ref)) != ref.split(".")[0]
        ]
    status = OK if not bad else f"CHANGED: {len(bad)} of {len(refs)} images, e.g. " + ", ".join(sorted(bad)[:3])
    return {"asset": "images", "digest": f"{len(refs)} images", "created_at": "", "key": images["prefix"],
            "uri": store.uri(images["prefix"]), "status": status}  # fmt: skip


def verify_lineage(store: ObjectStore, key: str, rehash: bool = True, public_key: str | None = None) -> dict:
    """The chain behind the published model at ``key``, every link checked (``check_link``), and its signature
    (``signing.lineage_check``: with ``public_key``, else ``FT_SIGNING_PUBLIC_KEY``); ``verified`` is true when all
    links are ``ok`` and the signature, if checked, verifies. Raises ``ArtifactNotFound`` when nothing is published there."""
    published = read_manifest(store, key)
    signature = lineage_check(store, key, public_key)
    lineage = store.get_json(join_key(key, LINEAGE_FILE))
    checkpoint = lineage["training"]["checkpoint"]
    chain = [check_link(store, "published_model", key, published.digest, published.created_at, rehash)]
    chain += [
        check_link(store, a["asset"], a["key"], a["digest"], a["created_at"], rehash) for a in lineage["artifacts"]
    ]
    chain.append(check_link(store, "checkpoint", checkpoint["key"], checkpoint["digest"], None, rehash))
    if lineage.get("images"):
        chain.append(check_images(store, lineage["images"], rehash))
    return {
        "published_uri": store.uri(lineage["published_key"]),
        "dataset_version": lineage["partition"],
        "dataset_source": lineage.get("dataset_source"),
        "base_model": lineage["base_model"],
        "checkpoint": store.uri(checkpoint["key"]),
        "training": {
            k: lineage["training"].get(k) for k in ("run_id", "method", "steps", "resumed_from_step", "image")
        },
        "exports": exports_of(lineage),
        "eval": lineage["eval"],
        "code_version": lineage["code_version"],
        "chain": chain,
        "files_rehashed": rehash,
        "signature": signature,
        "verified": all(link["status"] == OK for link in chain) and signature["verified"],
    }
