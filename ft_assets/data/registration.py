"""Registering a dataset version: the input's files uploaded under ``datasets/<name>/<version>/``, marker last.

``register_dataset`` does what an uploader does for ``dataset_version_sensor``: it stages what the
user named (``ft_assets.data.sources``: files, a Hub revision, an S3 prefix, a mixture), uploads the
files and, for a non-file input, ``_source.json``, then ``_SUCCESS`` last, so the sensor never sees a
half-written version. The default version id is content-addressed (``content_version``: ``v-`` + 12
hex of the sha256 over every path and its bytes; 48 bits: even odds of a collision only after ~20
million versions of one dataset), which makes registering the same data again a no-op and a
re-used version with other content an error rather than a silent overwrite. The comparison with what
is already registered reads every object back (sizes first, then bytes): exact, at the cost of one
download of the version, which only happens when it is registered again.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path

from ft_assets.data.sources import stage
from ft_assets.layout import SOURCE_FILE, PartitionLayout
from ft_assets.partitions import DatasetVersion, InvalidDatasetId
from ft_assets.storage import CHUNK, ObjectStore, join_key


class RegistrationError(ValueError):
    """A version that cannot be registered: an invalid name or version, or one that exists with other content."""


def content_version(files: list[tuple[str, Path]]) -> str:
    """``v-`` + 12 hex of the sha256 over every (path under the version, content), read in 8 MiB chunks."""
    digest = hashlib.sha256()
    for rel, path in files:
        digest.update(rel.encode())
        with open(path, "rb") as handle:
            while chunk := handle.read(CHUNK):
                digest.update(chunk)
    return "v-" + digest.hexdigest()[:12]


def same_content(store: ObjectStore, keys: PartitionLayout, uploads: dict[str, Path]) -> bool:
    """Whether the registered version holds exactly ``uploads`` (the same keys, sizes and bytes)."""
    existing = {k for k in store.list(keys.inputs) if k != keys.success_marker}
    return existing == set(uploads) and all(
        store.size(k) == f.stat().st_size and store.get_bytes(k) == f.read_bytes() for k, f in uploads.items()
    )


def register_dataset(store: ObjectStore, spec: str, name: str | None, version: str | None) -> tuple[str, bool]:
    """Stage the input and upload it as a dataset version, ``_source.json`` (for a non-file source) before
    ``_SUCCESS``, which goes last; returns (partition key, newly registered).

    Raises ``RegistrationError`` for an invalid name or version, or a version registered with other content.
    """
    with tempfile.TemporaryDirectory(prefix="ft-assets-stage-") as work:
        staged = stage(spec, Path(work), store)
        files = list(staged.files)
        if staged.source is not None:
            record = Path(work) / SOURCE_FILE
            record.write_text(json.dumps(staged.source, indent=2, sort_keys=True))
            files.append((SOURCE_FILE, record))
        try:
            target = DatasetVersion(name or staged.name, version or content_version(files))
        except InvalidDatasetId as exc:
            raise RegistrationError(str(exc)) from exc
        keys = PartitionLayout(target)
        uploads = {join_key(keys.inputs, rel): path for rel, path in files}
        if store.exists(keys.success_marker):
            if not same_content(store, keys, uploads):
                raise RegistrationError(
                    f"dataset version {target.key} already exists in {store.uri(keys.inputs)} with different "
                    "content; pass a new --version"
                )
            return target.key, False
        for key, local in uploads.items():
            store.put_file(key, local)
        store.put_bytes(keys.success_marker, b"")
    return target.key, True
