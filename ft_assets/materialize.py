"""The skeleton every artifact asset shares, and the metadata it shows in the UI.

The metadata leads with numbers a person reads at a glance (``figures``: 4 significant digits, sizes
in MB, nothing for a figure that does not exist), Dagster's own table entries on the datasets
(``dataset_metadata``: the asset page's "Row count" and "Columns"), and tables where a dict would
otherwise show as a JSON blob (``table``, ``settings_table``).

An artifact asset opens the store, works in a scratch folder, fetches its input artifacts (sha256
verified), calls one plain function of its plane, publishes the output folder as an artifact
(manifest last) and returns its reference with metadata. ``Materialization`` is that skeleton, so an
asset body holds only what is its own::

    with Materialization(context, store, "clean", data_executor) as m:
        out = Artifact.begin(m.store, layout.of(m.partition).data("cleaned"))
        rows = Artifact.committed(m.store, raw_dataset["prefix"])
        stats = clean_dataset(rows, out, config.rules(), data_executor.executor, objective.clean_row)
        ref = m.publish(out, stats, upstream={"raw_dataset": raw_dataset})
    return m.output(ref, rows_kept=stats["rows_kept"])

A data asset's workers read and write the store themselves (``ft_assets.data.parts``: ``Artifact``
names the parts of an input artifact, ``Artifact.begin`` clears the output's prefix for the parts the
workers write), and ``publish``, given that artifact, commits its parts from their descriptors with
whatever the driver wrote to ``out``. The other planes' assets download their inputs (``fetch``) and
publish the folder ``out``. This module imports no plane: every plane's assets import it.
"""

from __future__ import annotations

import json
import math
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Protocol

import dagster as dg
import pyarrow as pa

from ft_assets import refs
from ft_assets.manifests import fetch_artifact
from ft_assets.shards import fetch_images
from ft_assets.storage import store_kind

STORE_KIND = store_kind()  # the asset kind of this deployment's store ("s3" or "file"), shown in the graph


def ref_metadata(ref: dict) -> dict:
    """The metadata every artifact materialization shows: where it is and what it holds."""
    return {
        "uri": dg.MetadataValue.path(ref["uri"]),
        "manifest_digest": ref["digest"],
        "size_mb": dg.MetadataValue.float(megabytes(ref["bytes"])),
        "files": dg.MetadataValue.int(len(ref["files"])),
    }


def megabytes(size: int) -> float:
    """A size in bytes as MB (10^6 bytes), as a person reads it: 771636891 -> 771.6."""
    return rounded(size / 1e6)


def rounded(value: float | None, digits: int = 4) -> float | None:
    """``value`` to ``digits`` significant digits (0.6666666666666666 -> 0.6667, 1234.5678 -> 1235.0); None stays None."""
    if value is None or value == 0 or not math.isfinite(value):
        return value
    return round(value, digits - 1 - math.floor(math.log10(abs(value))))


def figures(**values: float | int | None) -> dict:
    """Headline numbers as metadata: ints as they are, floats to 4 significant digits; a figure that does not
    exist (None, NaN) is left out rather than shown as an empty cell or NaN."""
    shown = {}
    for name, value in values.items():
        if value is None or (isinstance(value, float) and not math.isfinite(value)):
            continue
        is_int = isinstance(value, int) and not isinstance(value, bool)
        shown[name] = dg.MetadataValue.int(value) if is_int else dg.MetadataValue.float(rounded(float(value)))
    return shown


def arrow_columns(schema: pa.Schema) -> dg.TableSchema:
    """The columns of an Arrow schema (what a dataset's Parquet parts are written with) and their types, for the
    asset page's "Columns" section."""
    types = {field.name: str(field.type).replace("element: ", "").replace("item: ", "") for field in schema}
    return dg.TableSchema(
        columns=[dg.TableColumn(name, kind) for name, kind in types.items()]
    )  # list<element: int32> -> list<int32>


def dataset_metadata(row_count: int, schema: pa.Schema) -> dict:
    """Dagster's standard table metadata of a dataset asset: its row count and the columns of ``schema``.

    (Written as the keys, because dagster 1.13 does not export ``TableMetadataSet`` at the top level.)"""
    return {
        "dagster/row_count": dg.MetadataValue.int(row_count),
        "dagster/column_schema": dg.MetadataValue.table_schema(arrow_columns(schema)),
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


def settings_table(settings: dict, key: str = "setting") -> dg.MetadataValue:
    """A flat dict (settings, a run's figures) as a two-column table: one row per key, nested values as compact JSON."""

    def shown(value) -> str:
        if value is None:
            return "none"
        if isinstance(value, float):
            return str(rounded(value))
        return json.dumps(value, default=str) if isinstance(value, dict | list | tuple) else str(value)

    return table([{key: name, "value": shown(value)} for name, value in settings.items()], columns=[key, "value"])


class PartsArtifact(Protocol):
    """What ``publish`` reads of a data stage's artifact (``ft_assets.data.parts.Artifact``)."""

    prefix: str
    files: dict[str, dict]  # part name -> its manifest entry


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
        """Download (and sha256-verify) the artifact of an input reference into the scratch folder; for shards that
        hold images (a vision-language model's: their stats name ``images_prefix``), the images of the shards fetched
        too, beside them (``shards.fetch_images``: only those ``include`` let through name)."""
        target = self.work / (name or ref["asset"])
        fetch_artifact(self.store, ref["prefix"], target, include=include)
        images = fetch_images(self.store, ref.get("stats", {}).get("images_prefix", ""), target)
        if images:
            self.context.log.info(f"fetched the {images} images of the shards")
        return target

    def publish(
        self,
        prefix: str | PartsArtifact,
        stats: dict,
        upstream: dict[str, dict] | None = None,
        folder: Path | None = None,
        **extra,
    ) -> dict:
        """Publish ``folder`` (default: ``out``) at ``prefix`` and return the asset's reference; given a data stage's
        ``Artifact`` (``Artifact.begin``), its parts are committed with it, by their descriptors.

        The reference records the asset's resolved settings, so a rerun can tell whether it is current.
        """
        parts = None if isinstance(prefix, str) else prefix.files
        prefix = prefix if isinstance(prefix, str) else prefix.prefix
        return refs.publish(
            self.store, self.asset, self.partition, prefix, folder or self.out, stats, upstream, parts,
            config=op_config(self.context), **extra,
        )  # fmt: skip

    def output(self, ref: dict, **metadata) -> dg.Output:
        """The asset's return value: its reference, with the given figures, the artifact's metadata and the duration
        (and for a data asset, where its shards ran and how many ran again after a worker died)."""
        if self.executor is not None:
            metadata.update(
                executor=self.executor.describe(), shard_retries=self.executor.retried - self.retried_before
            )
        shown = dict(metadata)  # the asset's own figures first: the page lists entries in this order
        for name, value in ref_metadata(ref).items():
            shown.setdefault(name, value)  # a figure of the asset's own under the same name wins
        return dg.Output(ref, metadata={**shown, "duration_s": round(time.perf_counter() - self.started, 3)})
