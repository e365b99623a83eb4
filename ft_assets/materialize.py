"""The skeleton every artifact asset shares, and the metadata it shows in the UI.

An artifact asset opens the store, works in a scratch folder, fetches its input artifacts (sha256
verified), calls one plain function of its plane, publishes the output folder as an artifact
(manifest last) and returns its reference with metadata. ``Materialization`` is that skeleton, so an
asset body holds only what is its own::

    with Materialization(context, store, "clean", data_executor) as m:
        out = m.begin(layout.of(m.partition).data("cleaned"))
        stats = clean_dataset(m.input(raw_dataset), out, config.rules(), data_executor.executor)
        ref = m.publish(out, stats, upstream={"raw_dataset": raw_dataset})
    return m.output(ref, rows_kept=stats["rows_kept"])

A data asset's workers read and write the store themselves (``ft_assets.data.parts``): ``input`` names
the parts of an input artifact, ``begin`` clears the output's prefix for the parts the workers write,
and ``publish`` commits them from their descriptors, with whatever the driver wrote to ``out``. The
other planes' assets download their inputs (``fetch``) and publish the folder ``out``.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from pathlib import Path

import dagster as dg

from ft_assets import refs
from ft_assets.data.parts import Artifact
from ft_assets.manifests import begin_artifact, fetch_artifact
from ft_assets.storage import store_kind

STORE_KIND = store_kind()  # the asset kind of this deployment's store ("s3" or "file"), shown in the graph


def ref_metadata(ref: dict) -> dict:
    """The metadata every artifact materialization shows: where it is and what it holds."""
    return {
        "uri": dg.MetadataValue.path(ref["uri"]),
        "manifest_digest": ref["digest"],
        "bytes": dg.MetadataValue.int(ref["bytes"]),
        "files": dg.MetadataValue.int(len(ref["files"])),
    }


def op_config(context: dg.AssetExecutionContext) -> dict:
    """The asset's settings as this run resolved them (defaults filled in); {} for an asset without settings."""
    return context.op_execution_context.op_config or {}


def _column_type(values: list) -> str:
    present = [v for v in values if v is not None]
    if present and all(isinstance(v, bool) for v in present):
        return "bool"
    if present and all(isinstance(v, int) and not isinstance(v, bool) for v in present):
        return "int"
    if present and all(isinstance(v, int | float) and not isinstance(v, bool) for v in present):
        return "float"
    return "string"


def table(rows: list[dict], columns: list[str] | None = None) -> dg.MetadataValue:
    """Rows of plain values as Dagster table metadata (sortable in the UI), column types inferred."""
    columns = columns or list(dict.fromkeys(key for row in rows for key in row))
    types = {name: _column_type([row.get(name) for row in rows]) for name in columns}
    schema = dg.TableSchema(columns=[dg.TableColumn(name, types[name]) for name in columns])
    records = [
        dg.TableRecord({name: row.get(name) if types[name] != "string" else str(row.get(name, "")) for name in columns})
        for row in rows
    ]
    return dg.MetadataValue.table(records=records, schema=schema)


class Materialization:
    """One materialization of an artifact asset: store, scratch folder, fetched inputs, published output."""

    def __init__(self, context: dg.AssetExecutionContext, store, what: str, data_executor=None):
        self.context = context
        self.resource = store
        self.what = what
        self.executor = data_executor.executor if data_executor is not None else None  # where a data asset's shards run
        self.partition: str = context.partition_key
        self.asset: str = context.asset_key.path[-1]
        self._stack = ExitStack()

    def __enter__(self) -> Materialization:
        self.started = time.perf_counter()
        self.retried_before = self.executor.retried if self.executor is not None else 0
        self.store = self.resource.open()
        self.work: Path = self._stack.enter_context(self.resource.scratch(self.what))
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    @property
    def out(self) -> Path:
        """The folder that becomes the output artifact."""
        path = self.work / "out"
        path.mkdir(exist_ok=True)
        return path

    def fetch(self, ref: dict, name: str | None = None, include=None) -> Path:
        """Download (and sha256-verify) the artifact of an input reference into the scratch folder."""
        target = self.work / (name or ref["asset"])
        fetch_artifact(self.store, ref["prefix"], target, include=include)
        return target

    def input(self, ref: dict) -> Artifact:
        """The artifact of an input reference, for a data stage's workers to read from the store themselves."""
        return Artifact.committed(self.store, ref["prefix"])

    def begin(self, prefix: str) -> Artifact:
        """An empty artifact at ``prefix`` that a data stage's workers write their parts into (what an earlier
        attempt left there is deleted first, its manifest before anything); ``publish`` commits it."""
        begin_artifact(self.store, prefix)
        return Artifact(self.store.url, prefix)

    def publish(self, prefix: str | Artifact, stats: dict, upstream: dict[str, dict] | None = None, folder: Path | None = None, **extra) -> dict:
        """Publish ``folder`` (default: ``out``) at ``prefix`` and return the asset's reference; given an ``Artifact``
        (``begin``), its parts are committed with it, by their descriptors.

        The reference records the asset's resolved settings, so a rerun can tell whether it is current.
        """
        parts = prefix.files if isinstance(prefix, Artifact) else None
        prefix = prefix.prefix if isinstance(prefix, Artifact) else prefix
        return refs.publish(
            self.store, self.asset, self.partition, prefix, folder or self.out, stats, upstream, parts,
            config=op_config(self.context), **extra,
        )  # fmt: skip

    def output(self, ref: dict, **metadata) -> dg.Output:
        """The asset's return value: its reference, with the artifact's metadata, the given figures and the duration
        (and for a data asset, where its shards ran and how many ran again after a worker died)."""
        if self.executor is not None:
            metadata.update(executor=self.executor.describe(), shard_retries=self.executor.retried - self.retried_before)
        return dg.Output(
            ref, metadata={**ref_metadata(ref), **metadata, "duration_s": round(time.perf_counter() - self.started, 3)}
        )
