"""Artifact references: what assets hand each other instead of data.

A reference names a published artifact (prefix, URI, manifest digest, bytes), carries the figures
of the stage that made it, and records the references it was built from, so the lineage of any
output can be walked back to the dataset version from the store alone. References are small JSON
objects stored at ``layout.of(partition).ref(asset)``: written by the IO manager after each
materialization, read through ``read_ref`` by everything else (the IO manager's inputs, the CLI,
the sensors, the control and delivery assets).
"""

from __future__ import annotations

import time
from pathlib import Path

from ft_assets import layout
from ft_assets.manifests import Manifest, publish_dir
from ft_assets.storage import ObjectStore, StoreError


class RefNotFound(StoreError):
    """An asset has no output (no reference) for a partition yet."""


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
    parts: dict[str, dict] | None = None,
    **extra,
) -> dict:
    """Publish ``local_dir`` (and ``parts``, files already written under ``prefix``) as an artifact at ``prefix``
    (manifest last) and return its reference."""
    manifest = publish_dir(store, prefix, local_dir, meta={"asset": asset, "partition": partition}, parts=parts)
    return make_ref(store, asset, partition, manifest, stats, upstream, **extra)


def write_ref(store: ObjectStore, partition: str, asset: str, ref: dict) -> None:
    store.put_json(layout.of(partition).ref(asset), ref)


def has_ref(store: ObjectStore, partition: str, asset: str) -> bool:
    return store.exists(layout.of(partition).ref(asset))


def read_ref(store: ObjectStore, partition: str, asset: str) -> dict:
    """The reference ``asset`` published for ``partition``; ``RefNotFound`` says what to materialize."""
    key = layout.of(partition).ref(asset)
    if not store.exists(key):
        raise RefNotFound(f"{asset} has no output for partition {partition} ({store.uri(key)}): materialize it first")
    return store.get_json(key)
