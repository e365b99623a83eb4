"""Reading a dataset version: its files cut into shards, each shard parsed on the executor, in file order.

``read_dataset`` turns the files of a version into ``rows.parquet`` (chat rows) and
``quarantine.parquet`` (every row that could not be read, with its reason), and counts them. Each
file is cut into shards that workers can read independently (``file_shards``):

- JSONL in ranges of ``shard_rows`` lines, found by one pass over the file counting newlines, so
  that a worker reads only its byte range;
- Parquet in runs of row groups of at least ``shard_rows`` rows (a bigger row group is one shard);
- any other file whole: a gzip stream, a CSV file with quoted line breaks or a JSON array cannot be
  cut without reading it.

A shard is parsed by its format's streamer (``ft_assets.data.formats``) into Arrow tables
(``read_shard``), and the driver appends the parts in file order, so the output does not depend on
the executor or the shard size. A file in which no row has an accepted layout fails the version
with a ``DatasetFileError`` (its rows are not bad, the layout is unknown: the ``columns`` config
maps it), and so does a file a shard could not read, in file order.
"""

from __future__ import annotations

import io
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from ft_assets.data.formats import Rejected, Row, iter_dataset_file, iter_parquet, json_lines, parquet_file, suffix_of
from ft_assets.data.layouts import MAPPING_HINT, ColumnMapping
from ft_assets.data.parallel import Executor, FileRef, InProcess, read_range
from ft_assets.data.rows import FLUSH_ROWS, QUARANTINE_SCHEMA, ROW_SCHEMA, DatasetFileError, ParquetSink

LINE_SCAN_BYTES = 1 << 24  # JSONL files are scanned for line ranges 16 MiB at a time


@dataclass(frozen=True)
class FileShard:
    """The part of an input file one task reads: a line range of a JSONL file, a run of row groups of a
    Parquet file, or (``stop`` None) the whole file."""

    name: str  # the file's display name
    file: FileRef
    start: int = 0  # JSONL: the range's first byte; Parquet: its first row group
    stop: int | None = None  # JSONL: the byte after its last line; Parquet: the row group after its last
    first: int = 1  # JSONL: the number of its first line; Parquet: the rows of the file before it


def _line_ranges(path: Path, lines: int) -> list[tuple[int, int, int]]:
    """(first byte, byte after the last line, number of the first line) of every ``lines`` lines of a file.

    One pass over the file counting newlines, as ``readline`` does (a line over ``formats.MAX_LINE_BYTES`` is
    still one line), 16 MiB at a time: ~0.1 s for the 113 MB benchmark corpus.
    """
    cuts, seen, offset = [0], 0, 0
    with open(path, "rb") as handle:
        while chunk := handle.read(LINE_SCAN_BYTES):
            ends = np.flatnonzero(np.frombuffer(chunk, dtype=np.uint8) == ord("\n"))
            for number in range(seen + lines - seen % lines, seen + len(ends) + 1, lines):
                cuts.append(offset + int(ends[number - seen - 1]) + 1)
            seen += len(ends)
            offset += len(chunk)
    if cuts[-1] < offset or offset == 0:
        cuts.append(offset)
    return [(start, stop, 1 + i * lines) for i, (start, stop) in enumerate(zip(cuts, cuts[1:]))]


def file_shards(name: str, path: Path, file: FileRef, shard_rows: int) -> list[FileShard]:
    """How ``read_dataset`` reads one input file: JSONL in ranges of ``shard_rows`` lines, Parquet in runs of
    row groups of at least ``shard_rows`` rows (a bigger row group is one shard), any other file whole
    (a gzip stream, a CSV file with quoted line breaks or a JSON array cannot be cut without reading it)."""
    suffix = suffix_of(name)
    if suffix == ".jsonl":
        return [FileShard(name, file, start, stop, first) for start, stop, first in _line_ranges(path, shard_rows)]
    if suffix == ".parquet":
        try:
            metadata = parquet_file(path, name).metadata
        except DatasetFileError:
            return [FileShard(name, file)]  # the task reports it, after the files before this one
        shards, start, first, rows = [], 0, 0, 0
        for group in range(metadata.num_row_groups):
            rows += metadata.row_group(group).num_rows
            if rows - first >= shard_rows or group == metadata.num_row_groups - 1:
                shards.append(FileShard(name, file, start, group + 1, first))
                start, first = group + 1, rows
        return shards or [FileShard(name, file)]
    return [FileShard(name, file)]


def _shard_items(shard: FileShard, mapping: ColumnMapping | None) -> Iterator[Row | Rejected | None]:
    if shard.stop is None:
        return iter_dataset_file(shard.file, shard.name, mapping)
    if suffix_of(shard.name) == ".parquet":
        return iter_parquet(shard.file, shard.name, mapping, range(shard.start, shard.stop), shard.first)
    return json_lines(io.BytesIO(read_range(shard.file, shard.start, shard.stop)), shard.name, mapping, shard.first)


@dataclass(frozen=True)
class ReadPart:
    """What one ``FileShard`` holds: its rows and rejected rows as Arrow tables, and its counts."""

    name: str
    rows: object  # pa.Table, ROW_SCHEMA
    quarantine: object  # pa.Table, QUARANTINE_SCHEMA
    blank_lines: int
    reasons: dict[str, int]
    unknown: int  # rows rejected as unknown_format
    first_unknown: tuple[str, str] | None  # (source, detail) of the first of them
    error: str | None  # the DatasetFileError that stops the whole file, raised by the driver in file order


def read_shard(mapping: ColumnMapping | None, shard: FileShard) -> ReadPart:
    """Parse one shard of an input file (a data-plane task: runs in a worker, see ``ft_assets.data.parallel``)."""
    rows, quarantine, tables = [], [], {"rows": [], "quarantine": []}
    blank_lines, unknown, first_unknown, error = 0, 0, None, None
    reasons: Counter[str] = Counter()

    def convert(final: bool = False) -> None:
        for name, buffer, schema in (("rows", rows, ROW_SCHEMA), ("quarantine", quarantine, QUARANTINE_SCHEMA)):
            if buffer and (final or len(buffer) >= FLUSH_ROWS):
                tables[name].append(pa.Table.from_pylist(buffer, schema=schema))
                buffer.clear()

    try:
        for item in _shard_items(shard, mapping):
            if item is None:
                blank_lines += 1
            elif isinstance(item, Row):
                rows.append({"source": item.source, "cluster": "", "messages": item.messages})
            else:
                reasons[item.reason] += 1
                if item.reason == "unknown_format":
                    unknown += 1
                    first_unknown = first_unknown or (item.source, item.detail)
                quarantine.append({"source": item.source, "stage": "raw", "reason": item.reason, "detail": item.detail, "raw": item.raw})
            convert()
    except DatasetFileError as exc:
        error = str(exc)
    convert(final=True)
    joined = {name: pa.concat_tables(parts) if parts else schema.empty_table()
              for (name, parts), schema in zip(tables.items(), (ROW_SCHEMA, QUARANTINE_SCHEMA))}  # fmt: skip
    return ReadPart(shard.name, joined["rows"], joined["quarantine"], blank_lines, dict(reasons), unknown, first_unknown, error)


def read_dataset(
    files: list[tuple[str, Path]], out_dir: Path, mapping: ColumnMapping | None = None, executor: Executor | None = None
) -> dict:
    """Normalize every input file into ``rows.parquet`` + ``quarantine.parquet``; returns counts.

    ``files`` are (display name, local path) pairs; the display name (the object key) is what row
    sources and error messages show. A file in which no row has an accepted layout fails the version
    (its rows are not bad, the layout is unknown: ``columns`` config maps it). The files are read in
    shards (``file_shards``) on ``executor`` (default: this process); rows keep their file order.
    """
    executor = executor or InProcess()
    out_dir.mkdir(parents=True, exist_ok=True)
    reasons: Counter[str] = Counter()
    per_file: dict[str, int] = {}
    blank_lines = 0
    shards = (shard for name, path in files for shard in file_shards(name, path, executor.share(path), executor.shard_rows))
    with ParquetSink(out_dir / "rows.parquet", ROW_SCHEMA) as rows, ParquetSink(
        out_dir / "quarantine.parquet", QUARANTINE_SCHEMA
    ) as quarantine:
        current: dict = {}  # the file being read: name, rows before it, its unknown-format rows, the first one

        def finish() -> None:
            if not current:
                return
            name = current["name"]
            per_file[name] = rows.count + quarantine.count - current["before"]
            if rows.count == current["parsed"] and current["unknown"] and current["unknown"] == per_file[name]:
                source, detail = current["first_unknown"]
                raise DatasetFileError(f"{name}: no row has an accepted layout ({source}: {detail}); {MAPPING_HINT}")

        for part in executor.map(read_shard, shards, mapping):
            if current.get("name") != part.name:
                finish()
                current = {"name": part.name, "before": rows.count + quarantine.count, "parsed": rows.count, "unknown": 0, "first_unknown": None}
            rows.write_table(part.rows)
            quarantine.write_table(part.quarantine)
            blank_lines += part.blank_lines
            reasons.update(part.reasons)
            current["unknown"] += part.unknown
            current["first_unknown"] = current["first_unknown"] or part.first_unknown
            if part.error is not None:
                raise DatasetFileError(part.error)
        finish()
    return {
        "rows_in": rows.count + quarantine.count,
        "rows_parsed": rows.count,
        "rows_quarantined": quarantine.count,
        "quarantine_reasons": dict(reasons),
        "blank_lines": blank_lines,
        "rows_per_file": per_file,
    }
