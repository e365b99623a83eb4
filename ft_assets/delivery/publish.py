"""Publishing: the registry layout, the lineage manifest, and the optional Hugging Face Hub push.

A published run lives at ``registry/<name>/<version>/<run>/`` and is never overwritten: the run id
is a hash of the data, base model and training config, so the same id always means the same model,
and a second publish of it is a no-op. ``lineage.json`` names every artifact the model came from —
dataset version, each data-plane artifact, base model, checkpoint, adapter, merged weights, GGUF
files (or, in ``gguf_reason``, why there are none) — with its manifest digest, plus the training
config, eval figures and the code version, so the chain can be checked from the store alone
(``ft-assets lineage``).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

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
    "gguf_model",
    "eval_report",
)
REPO_ROOT = Path(__file__).resolve().parents[2]
# eval_report's figures a lineage keeps: the gate's inputs, the shipped GGUF's score among them.
EVAL_FIGURES = (
    "metric_name", "base_metric", "finetuned_metric", "base_eval_loss", "finetuned_eval_loss", "improvement",
    "gguf_file", "gguf_qtype", "gguf_metric", "gguf_drop",
)  # fmt: skip


def code_version() -> str:
    """The git commit of this checkout (with '-dirty' if it has local changes), else the package version."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        from importlib.metadata import version

        return f"ft-assets {version('ft-assets')}"


def build_lineage(partition: str, refs: dict[str, dict], published_key: str) -> dict:
    """The lineage manifest from the references of every asset of the partition.

    Every artifact is named by its store-relative key, never by a URI: a store copied to another
    path or bucket verifies the same (``ft-assets lineage`` renders the keys as URIs of the store in use).
    """
    missing = [name for name in LINEAGE_CHAIN if name not in refs]
    if missing:
        raise ValueError(f"cannot build lineage for {partition}: no reference for {', '.join(missing)}")
    adapter, base, evaluation, gguf = refs["lora_adapter"], refs["base_model"], refs["eval_report"], refs["gguf_model"]
    return {
        "partition": partition,
        "dataset_source": refs["raw_dataset"]["stats"].get("source"),  # Hub commit, S3 prefix, mixture components
        "published_key": published_key,
        "code_version": code_version(),
        "base_model": {
            "model_id": base["stats"]["model_id"],
            "source": base["stats"]["source"],
            "source_sha256": base["stats"]["source_sha256"],
            "digest": base["digest"],
        },
        "training": {
            "run_id": adapter["stats"]["run_id"],
            "method": adapter["stats"]["method"],
            "config": adapter["training_config"],
            "checkpoint": adapter["checkpoint"],  # {"key", "digest"} of the checkpoint the adapter was exported from
            "steps": adapter["stats"]["steps"],
            "resumed_from_step": adapter["stats"]["resumed_from_step"],
        },
        "eval": {k: evaluation["stats"][k] for k in EVAL_FIGURES},
        "gguf": gguf["stats"]["files"],  # {} when none was made
        "gguf_reason": gguf["stats"].get("reason"),  # why not, in one line (qtypes: [], a model llama.cpp cannot take)
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


def hub_upload_plan(folder: Path) -> list[str]:
    """Relative paths that a Hub push of ``folder`` uploads (the dry run prints these)."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def push_to_hub(folder: Path, repo_id: str, token: str | None, dry_run: bool, log=print) -> list[str]:
    """Upload a published run to the Hugging Face Hub; with ``dry_run`` only list what would go."""
    files = hub_upload_plan(folder)
    if dry_run:
        for name in files:
            log(f"[dry run] would upload {name} to hf://{repo_id}")
        return files
    if not token:
        raise ValueError("pushing to the Hugging Face Hub needs a token in HF_TOKEN")
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    api.create_repo(repo_id, exist_ok=True, private=True)
    api.upload_folder(folder_path=str(folder), repo_id=repo_id, commit_message="ft-assets publish")
    log(f"uploaded {len(files)} files to https://huggingface.co/{repo_id}")
    return files
