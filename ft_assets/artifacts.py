"""Artifact references: what assets hand each other instead of data.

A reference names a published artifact (prefix, URI, manifest digest, bytes), carries the figures
of the stage that made it, and records the references it was built from, so the lineage of any
output can be walked back to the dataset version from the store alone.
"""

from __future__ import annotations

import time
from pathlib import Path

import dagster as dg

from ft_assets.storage import Manifest, ObjectStore, publish_dir


def make_ref(
    store: ObjectStore,
    asset: str,
    partition: str,
    manifest: Manifest,
    stats: dict,
    upstream: dict[str, dict] | None = None,
    **extra,
) -> dict:
    return {
        "asset": asset,
        "partition": partition,
        "prefix": manifest.prefix,
        "uri": store.uri(manifest.prefix),
        "digest": manifest.digest,
        "bytes": manifest.total_bytes,
        "files": sorted(manifest.files),
        "stats": stats,
        "upstream": {
            name: {"asset": ref["asset"], "uri": ref["uri"], "digest": ref["digest"]} for name, ref in (upstream or {}).items()
        },
        "created_at": time.time(),
        **extra,
    }


def publish(
    store: ObjectStore,
    asset: str,
    partition: str,
    prefix: str,
    local_dir: Path,
    stats: dict,
    upstream: dict[str, dict] | None = None,
    **extra,
) -> dict:
    manifest = publish_dir(store, prefix, local_dir, meta={"asset": asset, "partition": partition})
    return make_ref(store, asset, partition, manifest, stats, upstream, **extra)


def ref_metadata(ref: dict) -> dict:
    """The metadata every artifact materialization shows in the UI."""
    return {
        "uri": dg.MetadataValue.path(ref["uri"]),
        "manifest_digest": ref["digest"],
        "bytes": dg.MetadataValue.int(ref["bytes"]),
        "files": dg.MetadataValue.int(len(ref["files"])),
    }
