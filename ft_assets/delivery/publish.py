"""Publishing: the optional Hugging Face Hub push of a published run.

A published run lives at ``registry/<name>/<version>/<run>/`` and is never overwritten: the run id
is a hash of the data, base model and training config, so the same id always means the same model,
and a second publish of it is a no-op. Its ``lineage.json`` is built and verified in
``ft_assets.delivery.lineage``.
"""

from __future__ import annotations

from pathlib import Path


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
