"""File formats: JSONL, JSON, CSV/TSV, Parquet and Arrow files streamed as rows, each a ``Row`` or a ``Rejected``.

Files (each text format also gzipped, ``.jsonl.gz``, ``.json.gz``, ``.csv.gz``, ``.tsv.gz``):

- ``.jsonl``: one row a line.
- ``.json``: a JSON array of rows (the classic ``alpaca_data.json``, LLaMA-Factory's data files),
  or JSON Lines under a ``.json`` name (what ``datasets``' JSON loader also accepts).
- ``.csv`` / ``.tsv``: a header line, then one row a record; a cell of a turn-list column (a
  ``messages`` or ``conversations`` column, or the one mapped to ``messages``) holds JSON.
- ``.parquet``, ``.arrow``: tables (Arrow IPC file or stream format; ``datasets``' ``save_to_disk``
  writes the stream format).

Each row is parsed by ``ft_assets.data.layouts`` (chat, ShareGPT, alpaca, preference pairs, mapped
columns). A streamer never crashes on a bad *row*: each one becomes a ``Rejected`` with a reason and
the raw text (truncated), so every input row is accounted for. A bad *file* (truncated gzip,
unreadable Parquet or Arrow, a JSON array broken mid-way, a table with none of the accepted columns)
raises a ``DatasetFileError`` that names the file, because rows that cannot be read cannot be counted.

Every streamer streams: JSONL and CSV a record at a time, JSON arrays an element at a time
(``ft_assets.data.decoding``), Parquet and Arrow a batch at a time (Arrow memory-mapped).
``datasets``' own readers would load a JSON array whole and fail a whole CSV file on one bad record,
so these formats are read here; ``datasets`` resolves the non-file sources (``ft_assets.data.sources``).
Cutting a file into shards for parallel reading is ``ft_assets.data.readers``.

Tolerated: a UTF-8 BOM, CRLF line ends, blank lines (yielded as ``None``: counted, not rows). Lines
longer than ``MAX_LINE_BYTES`` are quarantined without being held in memory whole.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from ft_assets.data.decoding import ArrayElements, check_decoded, check_encodable, parse_line
from ft_assets.data.layouts import ColumnMapping, check_columns, normalize_record
from ft_assets.data.parallel import FileRef, arrow_file, open_file
from ft_assets.data.rows import DatasetFileError, RowError

MAX_LINE_BYTES = 4 * 1024 * 1024  # 4 MiB: far above any chat row; keeps a runaway line off the heap
RAW_PREVIEW_CHARS = 2000  # how much of a rejected line the quarantine keeps for a human to read
TABLE_BATCH_ROWS = 4096

SUPPORTED_SUFFIXES = (
    ".jsonl", ".jsonl.gz", ".json", ".json.gz", ".csv", ".csv.gz", ".tsv", ".tsv.gz", ".parquet", ".arrow",
)  # fmt: skip


@dataclass(frozen=True)
class Row:
    """A row read and parsed: where it came from and its messages."""

    source: str  # "<file>:<line>" (1-based) for line formats, "<file>#<row>" for arrays and tables
    messages: list[dict]


@dataclass(frozen=True)
class Rejected:
    """A row that could not be read or parsed: the quarantine's record of it (raw text truncated)."""

    source: str
    reason: str
    detail: str
    raw: str


def _preview(raw: bytes) -> str:
    return raw[: RAW_PREVIEW_CHARS * 4].decode("utf-8", errors="replace")[:RAW_PREVIEW_CHARS]


@contextmanager
def _opened(path: FileRef, name: str):
    """The file's bytes, gunzipped for a ``.gz`` name; gzip damage becomes a DatasetFileError naming it."""
    try:
        with open_file(path) as raw, gzip.GzipFile(fileobj=raw) if name.endswith(".gz") else raw as handle:
            yield handle
    except EOFError as exc:
        raise DatasetFileError(
            f"{name}: the gzip stream is truncated (the file ends before its end marker); "
            "rows after the cut cannot be counted — re-upload the complete file"
        ) from exc
    except (gzip.BadGzipFile, zlib.error) as exc:
        raise DatasetFileError(f"{name}: not a valid gzip file ({exc}); re-upload it or drop the .gz suffix") from exc


def _lines(handle, first: int = 1) -> Iterator[tuple[int, bytes | None]]:
    """(line number, bytes without EOL) — bytes is None for a line over MAX_LINE_BYTES; ``first``: the first line's number."""
    number = first - 1
    while True:
        line = handle.readline(MAX_LINE_BYTES + 1)
        if not line:
            return
        number += 1
        if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
            while (rest := handle.readline(MAX_LINE_BYTES)) and not rest.endswith(b"\n"):
                pass
            yield number, None
            continue
        if number == 1 and line.startswith(b"\xef\xbb\xbf"):
            line = line[3:]
        yield number, line.rstrip(b"\r\n")


def json_lines(handle, name: str, mapping: ColumnMapping | None, first: int = 1) -> Iterator[Row | Rejected | None]:
    """Rows of JSON Lines from an open binary ``handle`` (a file, or the byte range of a shard whose first line is ``first``)."""
    for number, raw in _lines(handle, first):
        source = f"{name}:{number}"
        if raw is None:
            yield Rejected(source, "line_too_long", f"longer than {MAX_LINE_BYTES} bytes", "")
            continue
        if not raw.strip():
            yield None
            continue
        try:
            yield Row(source, parse_line(raw, mapping))
        except RowError as exc:
            yield Rejected(source, exc.reason, exc.detail, _preview(raw))


def iter_jsonl(path: FileRef, name: str, mapping: ColumnMapping | None = None) -> Iterator[Row | Rejected | None]:
    """Rows of a .jsonl / .jsonl.gz file; yields None for each blank line (counted, not a row)."""
    with _opened(path, name) as handle:
        yield from json_lines(handle, name, mapping)


def _json_array(handle, name: str, mapping: ColumnMapping | None) -> Iterator[Row | Rejected]:
    for index, (value, text, problems) in enumerate(ArrayElements(handle, name), start=1):
        source = f"{name}#{index}"
        try:
            if problems:
                raise problems[0]
            check_decoded(text)
            messages = normalize_record(value, mapping)
            if "\\u" in text:
                check_encodable(messages)
            yield Row(source, messages)
        except RowError as exc:
            preview = text[:RAW_PREVIEW_CHARS].encode("utf-8", errors="replace").decode("utf-8", errors="replace")
            yield Rejected(source, exc.reason, exc.detail, preview)


def iter_json(path: FileRef, name: str, mapping: ColumnMapping | None = None) -> Iterator[Row | Rejected | None]:
    """Rows of a .json file: a JSON array (``file#<element>`` sources) or JSON Lines (``file:<line>``)."""
    with _opened(path, name) as handle:
        head = handle.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
        while not head and (more := handle.read(4096)):
            head = more.lstrip(b" \t\r\n")
    with _opened(path, name) as handle:
        if head.startswith(b"["):
            yield from _json_array(handle, name, mapping)
        else:
            yield from json_lines(handle, name, mapping)


def _cell_json(value: str, column: str) -> object:
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise RowError(
            "invalid_json", f"column '{column}' holds no JSON list of turns ({exc.msg} at column {exc.colno})"
        ) from exc


def iter_csv(path: FileRef, name: str, mapping: ColumnMapping | None = None) -> Iterator[Row | Rejected | None]:
    """Rows of a .csv / .tsv file (header first); an empty record is a blank line."""
    csv.field_size_limit(MAX_LINE_BYTES)  # process-wide; the default (128 KiB) is below our line limit
    delimiter = "\t" if name.removesuffix(".gz").endswith(".tsv") else ","
    with _opened(path, name) as handle:
        text = io.TextIOWrapper(handle, encoding="utf-8-sig", errors="surrogateescape", newline="")
        reader = csv.reader(text, delimiter=delimiter)
        try:
            header = next(reader, None)
        except csv.Error as exc:
            raise DatasetFileError(f"{name}: unreadable header line ({exc})") from exc
        if header is None:
            return
        if len(set(header)) < len(header):
            raise DatasetFileError(f"{name}: the header names a column twice ({', '.join(header)})")
        check_columns(name, header, mapping, "the header")
        turn_lists = {mapping.messages} if mapping else {"messages", "conversations"}
        while True:
            start = reader.line_num + 1
            try:
                record = next(reader)
            except StopIteration:
                return
            except csv.Error as exc:
                reason = "line_too_long" if "field limit" in str(exc) else "invalid_csv"
                yield Rejected(f"{name}:{start}", reason, str(exc), "")
                continue
            source = f"{name}:{start}"
            if not record:
                yield None
                continue
            raw = delimiter.join(record)[:RAW_PREVIEW_CHARS].encode("utf-8", errors="replace").decode()
            try:
                if len(record) != len(header):
                    raise RowError("wrong_field_count", f"{len(record)} fields, the header has {len(header)}")
                for cell in record:
                    check_decoded(cell)
                row = {
                    key: _cell_json(value, key) if key in turn_lists else value for key, value in zip(header, record)
                }
                messages = normalize_record(row, mapping)
                if any("\\u" in record[header.index(key)] for key in turn_lists if key in header):
                    check_encodable(messages)
                yield Row(source, messages)
            except RowError as exc:
                yield Rejected(source, exc.reason, exc.detail, raw)


def _table_rows(
    name: str, kind: str, batches, mapping: ColumnMapping | None, index: int = 0
) -> Iterator[Row | Rejected]:
    """Rows of record batches; ``index``: the rows of the table before the first batch."""
    try:
        for batch in batches:
            for record in batch.to_pylist():
                index += 1
                source = f"{name}#{index}"
                record = {k: v for k, v in record.items() if v is not None}
                try:
                    yield Row(source, normalize_record(record, mapping))
                except RowError as exc:
                    yield Rejected(source, exc.reason, exc.detail, json.dumps(record, default=str)[:RAW_PREVIEW_CHARS])
    except (pa.ArrowException, OSError) as exc:
        raise DatasetFileError(f"{name}: {kind} data unreadable after row {index} ({exc})") from exc


def parquet_file(path: FileRef, name: str) -> pq.ParquetFile:
    """The Parquet file opened (its metadata read), or a ``DatasetFileError`` naming it."""
    try:
        return pq.ParquetFile(arrow_file(path))
    except (pa.ArrowException, OSError) as exc:
        raise DatasetFileError(f"{name}: not a readable Parquet file ({exc})") from exc


def iter_parquet(
    path: FileRef, name: str, mapping: ColumnMapping | None = None, row_groups: range | None = None, first_row: int = 0
) -> Iterator[Row | Rejected]:
    """Rows of a Parquet file, or of ``row_groups`` of it (whose first row is row ``first_row`` of the file)."""
    parquet = parquet_file(path, name)
    check_columns(name, parquet.schema_arrow.names, mapping, "Parquet schema")
    groups = None if row_groups is None else list(row_groups)
    batches = parquet.iter_batches(batch_size=TABLE_BATCH_ROWS, row_groups=groups)
    yield from _table_rows(name, "Parquet", batches, mapping, first_row)


def iter_arrow(path: FileRef, name: str, mapping: ColumnMapping | None = None) -> Iterator[Row | Rejected]:
    """Rows of an Arrow IPC file, memory-mapped: the file format (magic ``ARROW1``) or the stream format."""
    try:
        source = arrow_file(path)
        if source.read(6) == b"ARROW1":
            source.seek(0)
            reader = pa.ipc.open_file(source)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        else:
            source.seek(0)
            reader = batches = pa.ipc.open_stream(source)
    except (pa.ArrowException, OSError) as exc:
        raise DatasetFileError(f"{name}: not a readable Arrow file ({exc})") from exc
    check_columns(name, reader.schema.names, mapping, "Arrow schema")
    yield from _table_rows(name, "Arrow", batches, mapping)


READERS = {
    ".jsonl": iter_jsonl, ".json": iter_json, ".csv": iter_csv, ".tsv": iter_csv, ".parquet": iter_parquet, ".arrow": iter_arrow,
}  # fmt: skip


def suffix_of(name: str) -> str | None:
    """The accepted suffix ``name`` ends with (``.jsonl.gz`` before ``.gz``-less ones), or None."""
    return next((s for s in sorted(SUPPORTED_SUFFIXES, key=len, reverse=True) if name.endswith(s)), None)


def iter_dataset_file(
    path: FileRef, name: str, mapping: ColumnMapping | None = None
) -> Iterator[Row | Rejected | None]:
    suffix = suffix_of(name)
    if suffix is None:
        raise DatasetFileError(f"{name}: unsupported file type; use one of {', '.join(SUPPORTED_SUFFIXES)}")
    yield from READERS[suffix.removesuffix(".gz")](path, name, mapping)


def is_data_file(name: str) -> bool:
    base = name.rsplit("/", 1)[-1]
    return not base.startswith(("_", ".")) and suffix_of(base) is not None
