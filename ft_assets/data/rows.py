"""Rows as the data-plane stages share them: the two errors, and chat rows and quarantine records as Parquet.

A bad *row* raises ``RowError(reason, detail)``, which every stage turns into a quarantine record
(``QUARANTINE_SCHEMA``), so no row is dropped unaccounted; a bad *file* raises ``DatasetFileError``,
which fails the dataset version, because rows that cannot be read cannot be counted.

Every part of a stage's output (``ft_assets.data.parts``) is written through ``ParquetSink``, in row
groups of exactly ``FLUSH_ROWS`` rows, so its bytes depend on its rows alone.

Converting rows between Arrow and Python dicts costs ~10 µs a chat row each way (pyarrow 26), so
stages that only drop or relabel rows (split, the last deduplication pass) never convert: they
filter Arrow batches and append them with ``ParquetSink.write_table``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

FLUSH_ROWS = 8192  # rows buffered per Parquet row group


class DatasetFileError(ValueError):
    """A whole input file (or dataset version) cannot be read; the message names the file and what to do."""


class RowError(ValueError):
    """One row cannot be used: ``reason`` is the quarantine's reason code, ``detail`` says what and where."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


# A turn: its role and text, and for a reply the reasoning before it when the row gives one (null otherwise; read back
# without the key: ``plain``). Chat templates render it where the model writes it (gpt-oss's analysis channel, Qwen3's
# <think> block) and the reply's loss mask covers it.
# A reply that calls tools holds them as ``tool_calls``, their JSON ([{"type": "function", "function": {"name",
# "arguments"}}], arguments an object), and each result comes back as a ``tool`` message.
# A user turn may hold images: their references in the store (``ft_assets.data.images``: ``<sha256>.<format>``), in
# order, each standing where its ``<image>`` marker is in the text.
MESSAGE = pa.struct(
    [("role", pa.string()), ("content", pa.string()), ("thinking", pa.string()), ("tool_calls", pa.string()),
     ("images", pa.list_(pa.string()))]
)  # fmt: skip
OPTIONAL_MESSAGE_FIELDS = ("thinking", "tool_calls", "images")
ROW_SCHEMA = pa.schema(
    [
        ("source", pa.string()),  # "<file>:<line>", unique within a dataset version
        ("cluster", pa.string()),  # near-duplicate cluster key (set by deduplication, "" before)
        ("messages", pa.list_(MESSAGE)),
    ]
)
QUARANTINE_SCHEMA = pa.schema(
    [
        ("source", pa.string()),
        ("stage", pa.string()),
        ("reason", pa.string()),
        ("detail", pa.string()),
        ("raw", pa.string()),
    ]
)
DUPLICATE_SCHEMA = pa.schema(
    [
        ("source", pa.string()),
        ("kind", pa.string()),  # "exact" | "near"
        ("duplicate_of", pa.string()),  # source of the row that was kept
    ]
)


class ParquetSink:
    """Writes rows (dicts, or Arrow tables already in the schema) to a Parquet file in row groups of
    exactly ``FLUSH_ROWS`` rows (the last one shorter). The row groups depend on the rows alone, not on
    how they arrived, so rows written one by one and the same rows written as the parts of a sharded
    stage give the same file, byte for byte."""

    def __init__(self, where: Path | pa.NativeFile, schema: pa.Schema):
        self.schema = schema
        self.buffer: list[dict] = []
        self.tables: list[pa.Table] = []  # Arrow rows not yet written: less than a row group, then one table
        self.pending = 0
        self.count = 0
        self.writer = pq.ParquetWriter(where, schema)

    def write(self, record: dict) -> None:
        self.buffer.append(record)
        self.count += 1
        if len(self.buffer) >= FLUSH_ROWS:
            self._convert()

    def _convert(self) -> None:
        if self.buffer:
            self._append(pa.Table.from_pylist(self.buffer, schema=self.schema))
            self.buffer = []

    def write_table(self, table: pa.Table | pa.RecordBatch) -> None:
        """Append rows that are already Arrow, after the buffered ones (same schema)."""
        self._convert()
        if isinstance(table, pa.RecordBatch):
            table = pa.Table.from_batches([table])
        self.count += table.num_rows
        self._append(table)

    def _append(self, table: pa.Table) -> None:
        self.tables.append(table)
        self.pending += table.num_rows
        if self.pending < FLUSH_ROWS:
            return
        joined = pa.concat_tables(self.tables)
        full = self.pending - self.pending % FLUSH_ROWS
        for start in range(0, full, FLUSH_ROWS):
            self._write_group(joined.slice(start, FLUSH_ROWS))
        self.tables, self.pending = [joined.slice(full)], self.pending - full

    def _write_group(self, table: pa.Table) -> None:
        # one contiguous chunk per column: the bytes written do not depend on how the rows were chunked
        self.writer.write_table(table.combine_chunks(), row_group_size=FLUSH_ROWS)

    def close(self) -> None:
        self._convert()
        if self.pending:
            self._write_group(pa.concat_tables(self.tables))
        self.writer.close()

    def __enter__(self) -> ParquetSink:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def iter_batches(path: Path, columns: list[str] | None = None) -> Iterator[pa.RecordBatch]:
    yield from pq.ParquetFile(path).iter_batches(batch_size=FLUSH_ROWS, columns=columns)


def plain(messages: list[dict]) -> list[dict]:
    """Messages as read from Parquet without the optional fields they do not have (Parquet stores them as null)."""
    return [
        {key: value for key, value in message.items() if value is not None or key not in OPTIONAL_MESSAGE_FIELDS}
        for message in messages
    ]


def plain_record(record: dict) -> dict:
    return {**record, "messages": plain(record["messages"])} if "messages" in record else record


def iter_records(path: Path, columns: list[str] | None = None) -> Iterator[dict]:
    for batch in iter_batches(path, columns):
        yield from map(plain_record, batch.to_pylist())


def sample_rows(records: Iterable[dict], n: int = 5, width: int = 200) -> list[dict]:
    """The first ``n`` rows as (source, conversation text) for the asset's UI metadata."""
    sample = []
    for record in records:
        if len(sample) >= n:
            break
        text = " / ".join(f"{m['role']}: {m['content']}" for m in record["messages"]).replace("\n", " ")
        sample.append({"source": record["source"], "messages": text[:width] + ("…" if len(text) > width else "")})
    return sample
