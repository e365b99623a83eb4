"""Artifacts: a prefix of files plus a ``manifest.json`` that lists every file with its size and sha256.

The manifest is written last and is the commit point of the whole artifact: a reader trusts nothing
under a prefix that has no manifest, which gives atomic publish on both storage backends (S3 makes
single PUTs atomic, the local backend writes to a temporary name and renames). ``publish_dir`` uploads
a local folder and writes the manifest, listing as well the files that workers wrote to the prefix
themselves since ``begin_artifact`` cleared it (a data artifact's parts); ``fetch_artifact`` downloads one and checks every file's
sha256; ``verify_artifact`` is the cheap check (presence and size) for a reader that will not read
the files.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path

from ft_assets.storage import ObjectNotFound, ObjectStore, StoreError, check_key, join_key, sha256_file

MANIFEST = "manifest.json"


class ArtifactNotFound(StoreError):
    """No complete artifact (no manifest) exists at a prefix."""


class ArtifactCorrupt(StoreError):
    """An artifact's files do not match its manifest (missing file, size or sha256 mismatch)."""


@dataclass(frozen=True)
class Manifest:
    prefix: str
    files: dict[str, dict]  # relative path -> {"size": int, "sha256": str} (+ "rows" for a data artifact's part)
    meta: dict
    created_at: float

    @property
    def total_bytes(self) -> int:
        return sum(f["size"] for f in self.files.values())

    @property
    def digest(self) -> str:
        """One hash for the whole artifact: sha256 over the sorted (path, sha256) pairs."""
        lines = "".join(f"{path}\t{info['sha256']}\n" for path, info in sorted(self.files.items()))
        return hashlib.sha256(lines.encode()).hexdigest()

    def to_json(self) -> dict:
        return {
            "prefix": self.prefix,
            "files": self.files,
            "meta": self.meta,
            "created_at": self.created_at,
            "digest": self.digest,
        }


def begin_artifact(store: ObjectStore, prefix: str) -> None:
    """Clear ``prefix`` for an artifact whose files are written one by one (by the data plane's workers): the old
    manifest goes first, so no reader takes what is left for an artifact, then every file under the prefix."""
    store.delete(join_key(prefix, MANIFEST))
    store.delete_prefix(prefix)


def publish_dir(
    store: ObjectStore,
    prefix: str,
    local_dir: str | Path,
    meta: dict | None = None,
    parts: dict[str, dict] | None = None,
) -> Manifest:
    """Upload every file under ``local_dir`` to ``prefix``, then write the manifest last.

    ``parts`` are files already in the store under ``prefix`` (written there by the data plane's workers,
    ``ft_assets.data.parts``): the manifest lists them with the size and sha256 (and rows) their writers
    computed, so committing them costs no byte of them. Files already published at this prefix by an
    earlier attempt are overwritten; a reader never sees them as an artifact until the new manifest
    lands (the old manifest is removed first).
    """
    store.delete(join_key(prefix, MANIFEST))
    return write_manifest(store, prefix, {**(parts or {}), **upload_files(store, prefix, local_dir)}, meta)


def upload_files(store: ObjectStore, prefix: str, local_dir: str | Path) -> dict[str, dict]:
    """Upload every file under ``local_dir`` to ``prefix`` (no manifest); their manifest entries by relative path."""
    local_dir = Path(local_dir)
    files = {}
    for path in sorted(p for p in local_dir.rglob("*") if p.is_file()):
        rel = path.relative_to(local_dir).as_posix()
        if rel == MANIFEST:
            continue
        files[rel] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
        store.put_file(join_key(prefix, rel), path)
    return files


def write_manifest(store: ObjectStore, prefix: str, files: dict[str, dict], meta: dict | None = None) -> Manifest:
    """Commit the artifact at ``prefix``: the manifest of ``files`` (already in the store), written last."""
    manifest = Manifest(prefix=prefix, files=files, meta=meta or {}, created_at=time.time())
    store.put_json(join_key(prefix, MANIFEST), manifest.to_json())
    return manifest


def read_manifest(store: ObjectStore, prefix: str) -> Manifest:
    key = join_key(prefix, MANIFEST)
    if not store.exists(key):
        raise ArtifactNotFound(f"no complete artifact at {store.uri(prefix)} (no {MANIFEST})")
    try:
        raw = store.get_json(key)
        return Manifest(
            prefix=raw["prefix"], files=raw["files"], meta=raw.get("meta", {}), created_at=raw["created_at"]
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise ArtifactCorrupt(f"unreadable manifest {store.uri(key)}: {exc}") from exc


def changed_files(store: ObjectStore, manifest: Manifest) -> list[str]:
    """Files of the artifact whose bytes no longer match the manifest (re-hashed in the store), or are gone."""
    changed = []
    for rel, info in sorted(manifest.files.items()):
        try:
            if store.sha256(join_key(manifest.prefix, rel)) != info["sha256"]:
                changed.append(rel)
        except ObjectNotFound:
            changed.append(rel)
    return changed


def verify_artifact(store: ObjectStore, manifest: Manifest) -> None:
    """Cheap check (presence and size of every file); ``fetch_artifact`` also checks sha256."""
    for rel, info in manifest.files.items():
        key = join_key(manifest.prefix, rel)
        if not store.exists(key):
            raise ArtifactCorrupt(f"artifact {store.uri(manifest.prefix)} lacks {rel} listed in its manifest")
        if store.size(key) != info["size"]:
            raise ArtifactCorrupt(f"artifact {store.uri(manifest.prefix)}: {rel} has the wrong size")


def fetch_artifact(store: ObjectStore, prefix: str, dest: str | Path, include=None) -> Manifest:
    """Download a complete artifact to ``dest``, verifying every file's sha256 against the manifest.

    ``include`` (a predicate on the relative path) limits the download, e.g. to a model's tokenizer.
    Files already present with the right sha256 are not downloaded again.
    """
    manifest = read_manifest(store, prefix)
    dest = Path(dest)
    for rel, info in manifest.files.items():
        if include is not None and not include(rel):
            continue
        target = dest / check_key(rel)  # an absolute path in a manifest would escape dest
        if target.is_file() and target.stat().st_size == info["size"] and sha256_file(target) == info["sha256"]:
            continue
        key = join_key(prefix, rel)
        try:
            store.get_file(key, target)
        except ObjectNotFound as exc:
            raise ArtifactCorrupt(
                f"artifact {store.uri(prefix)} lacks {rel} listed in its manifest; the artifact is corrupt, rebuild it"
            ) from exc
        if sha256_file(target) != info["sha256"]:
            raise ArtifactCorrupt(
                f"artifact {store.uri(prefix)}: {rel} does not match the sha256 in its manifest; "
                "the artifact is corrupt, rebuild it"
            )
    return manifest
