"""Row files shared by the data-plane stages: chat rows and quarantine records as streamed Parquet.

Every stage reads its input row by row and writes its outputs through ``ParquetSink``, which
flushes every ``FLUSH_ROWS`` rows, so memory stays flat however large the dataset version is.

Converting rows between Arrow and Python dicts costs ~10 µs a chat row each way (pyarrow 26), so
stages that only drop or relabel rows (split, the last deduplication pass) never convert: they
filter Arrow batches and append them with ``ParquetSink.write_table``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

FLUSH_ROWS = 8192  # rows buffered per Parquet row group

MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])
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
    def __init__(self, path: Path, schema: pa.Schema):
        self.path, self.schema = path, schema
        self.buffer: list[dict] = []
        self.count = 0
        self.writer = pq.ParquetWriter(path, schema)

    def write(self, record: dict) -> None:
        self.buffer.append(record)
        self.count += 1
        if len(self.buffer) >= FLUSH_ROWS:
            self._flush()

    def _flush(self) -> None:
        if self.buffer:
            self.writer.write_table(pa.Table.from_pylist(self.buffer, schema=self.schema))
            self.buffer = []

    def write_table(self, table: pa.Table | pa.RecordBatch) -> None:
        """Append rows that are already Arrow, after the buffered ones (same schema)."""
        self._flush()
        if isinstance(table, pa.RecordBatch):
            table = pa.Table.from_batches([table])
        self.writer.write_table(table)
        self.count += table.num_rows

    def close(self) -> None:
        self._flush()
        self.writer.close()

    def __enter__(self) -> ParquetSink:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def iter_batches(path: Path, columns: list[str] | None = None) -> Iterator[pa.RecordBatch]:
    yield from pq.ParquetFile(path).iter_batches(batch_size=FLUSH_ROWS, columns=columns)


def iter_records(path: Path, columns: list[str] | None = None) -> Iterator[dict]:
    for batch in iter_batches(path, columns):
        yield from batch.to_pylist()


def sample_rows(path: Path, n: int = 5, width: int = 200) -> list[dict]:
    """The first ``n`` rows as (source, conversation text) for the asset's UI metadata."""
    sample = []
    for record in iter_records(path):
        if len(sample) >= n:
            break
        text = " / ".join(f"{m['role']}: {m['content']}" for m in record["messages"]).replace("\n", " ")
        sample.append({"source": record["source"], "messages": text[:width] + ("…" if len(text) > width else "")})
    return sample
