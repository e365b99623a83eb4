"""Dataset readers: JSONL, JSON arrays, CSV/TSV, Parquet and Arrow, normalized to one chat schema.

Files (each text format also gzipped, ``.jsonl.gz``, ``.json.gz``, ``.csv.gz``, ``.tsv.gz``):

- ``.jsonl``: one row a line.
- ``.json``: a JSON array of rows (the classic ``alpaca_data.json``, LLaMA-Factory's data files),
  or JSON Lines under a ``.json`` name (what ``datasets``' JSON loader also accepts).
- ``.csv`` / ``.tsv``: a header line, then one row a record; a cell of a turn-list column (a
  ``messages`` or ``conversations`` column, or the one mapped to ``messages``) holds JSON.
- ``.parquet``, ``.arrow``: tables (Arrow IPC file or stream format; ``datasets``' ``save_to_disk``
  writes the stream format).

Row layouts, all mapped to ``messages: [{role, content}]``:

- chat:     ``{"messages": [{"role": "user", "content": "..."}, ...]}``
- ShareGPT: ``{"conversations": [{"from": "human", "value": "..."}, ...], "system": "..." (optional)}``
- alpaca:   ``{"instruction": "...", "input": "..." (optional), "output": "...", "system": "...",
  "history": [["earlier request", "earlier reply"], ...] (both optional, as LLaMA-Factory writes them)}``
- any other column names through a ``ColumnMapping`` (``raw_dataset`` config ``columns``), e.g.
  ``{prompt: question, response: answer}``.
- preference pairs: a row with ``chosen`` and ``rejected`` (``ft_assets.data.preference``, which
  lists their layouts) becomes the prompt's turns followed by the two replies.

The reader never crashes on a bad *row*: each one becomes a ``Rejected`` with a reason and the raw
text (truncated), so every input row is accounted for. A bad *file* (truncated gzip, unreadable
Parquet or Arrow, a JSON array broken mid-way, a table with none of the accepted columns, a file
in which no row has an accepted layout) fails the dataset version with a ``DatasetFileError`` that
names the file, because rows that cannot be read cannot be counted.

Every reader streams: JSONL and CSV a record at a time, JSON arrays an element at a time (a
``raw_decode`` over a growing buffer, never the whole file), Parquet and Arrow a batch at a time
(Arrow memory-mapped). ``datasets``' own readers would load a JSON array whole and fail a whole
CSV file on one bad record, so these formats are read here; ``datasets`` resolves the non-file
sources (``ft_assets.data.sources``).

Tolerated: a UTF-8 BOM, CRLF line ends, blank lines (counted, not rows). Lines longer than
``MAX_LINE_BYTES`` are quarantined without being held in memory whole.
"""

from __future__ import annotations

import codecs
import csv
import gzip
import io
import json
import re
import zlib
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ft_assets.data.parallel import Executor, FileRef, InProcess, arrow_file, open_file, read_range

MAX_LINE_BYTES = 4 * 1024 * 1024  # 4 MiB: far above any chat row; keeps a runaway line off the heap
RAW_PREVIEW_CHARS = 2000  # how much of a rejected line the quarantine keeps for a human to read
TABLE_BATCH_ROWS = 4096
JSON_CHUNK_BYTES = 1 << 20  # JSON arrays are decoded 1 MiB at a time (more while one element is longer)
LINE_SCAN_BYTES = 1 << 24  # JSONL files are scanned for line ranges 16 MiB at a time
MAX_INT_DIGITS = 4300  # Python's int() limit (sys.get_int_max_str_digits): longer literals are quarantined

SUPPORTED_SUFFIXES = (
    ".jsonl", ".jsonl.gz", ".json", ".json.gz", ".csv", ".csv.gz", ".tsv", ".tsv.gz", ".parquet", ".arrow",
)  # fmt: skip
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "system": "system",
}
LAYOUTS = "a 'messages' column, a 'conversations' column, 'instruction' + 'output', or 'chosen' + 'rejected' (preference pairs)"
MAPPING_HINT = (
    "map your columns with the raw_dataset config 'columns', e.g. {prompt: question, response: answer} "
    "or {messages: dialog, role: speaker, content: text}"
)


class DatasetFileError(ValueError):
    """A whole input file cannot be read; the message names the file and what to do."""


class RowError(ValueError):
    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Row:
    source: str  # "<file>:<line>" (1-based) for line formats, "<file>#<row>" for arrays and tables
    messages: list[dict]


@dataclass(frozen=True)
class Rejected:
    source: str
    reason: str
    detail: str
    raw: str


# --- rows ------------------------------------------------------------------------------------------


def _text(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise RowError("wrong_type", f"{where} must be a string, got {type(value).__name__}")
    return value


def _message_list(value: object, field: str, role_key: str, text_key: str, role_map: dict | None) -> list[dict]:
    if not isinstance(value, list):
        raise RowError("wrong_type", f"'{field}' must be a list, got {type(value).__name__}")
    messages = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise RowError("wrong_type", f"'{field}[{i}]' must be an object, got {type(item).__name__}")
        if role_key not in item or text_key not in item:
            raise RowError("wrong_type", f"'{field}[{i}]' needs '{role_key}' and '{text_key}'")
        role = _text(item[role_key], f"'{field}[{i}].{role_key}'")
        if role_map is not None:
            role = role_map.get(role.strip().lower(), role)
        messages.append({"role": role, "content": _text(item[text_key], f"'{field}[{i}].{text_key}'")})
    return messages


def _optional_text(obj: dict, key: str | None) -> str:
    value = obj.get(key) if key else None
    return "" if value is None else _text(value, f"'{key}'")


def _history(value: object) -> list[dict]:
    """LLaMA-Factory's ``history``: earlier [request, reply] pairs, oldest first."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise RowError("wrong_type", f"'history' must be a list of [request, reply] pairs, got {type(value).__name__}")
    turns = []
    for i, pair in enumerate(value):
        if not (isinstance(pair, list) and len(pair) == 2):
            raise RowError("wrong_type", f"'history[{i}]' must be a [request, reply] pair")
        turns += [{"role": "user", "content": _text(pair[0], f"'history[{i}][0]'")},
                  {"role": "assistant", "content": _text(pair[1], f"'history[{i}][1]'")}]  # fmt: skip
    return turns


def _instruction_turns(instruction: str, extra: str, output: str, system: str, history: list[dict]) -> list[dict]:
    """Alpaca-style fields as turns. Without a system prompt, a non-empty input is the request and the
    instruction becomes the system turn; with one, the instruction and the input make the request."""
    if system.strip():
        request = f"{instruction}\n\n{extra}" if extra.strip() else instruction
        head = [{"role": "system", "content": system}]
    elif extra.strip():
        request, head = extra, [{"role": "system", "content": instruction}]
    else:
        request, head = instruction, []
    return head + history + [{"role": "user", "content": request}, {"role": "assistant", "content": output}]


def _with_system(obj: dict, messages: list[dict]) -> list[dict]:
    system = _optional_text(obj, "system")
    if system.strip() and not (messages and messages[0]["role"] == "system"):
        return [{"role": "system", "content": system}] + messages
    return messages


@dataclass(frozen=True)
class ColumnMapping:
    """Which column holds what, for tables whose columns have other names (``raw_dataset`` config ``columns``).

    Either ``messages`` (a column holding a list of turns, whose keys are ``role`` and ``content``;
    ShareGPT role names such as human/gpt are understood) or ``prompt`` + ``response`` (with
    optional ``input`` and ``system``; the same rules as alpaca's instruction/input/output).
    """

    messages: str | None = None
    role: str = "role"
    content: str = "content"
    prompt: str | None = None
    input: str | None = None
    response: str | None = None
    system: str | None = None

    FIELDS = ("messages", "role", "content", "prompt", "input", "response", "system")

    @classmethod
    def of(cls, columns: dict[str, str]) -> ColumnMapping | None:
        """The mapping for a config's ``columns`` (None when empty); ``ValueError`` says what is wrong."""
        if not columns:
            return None
        unknown = sorted(set(columns) - set(cls.FIELDS))
        if unknown:
            raise ValueError(f"columns: unknown key(s) {unknown}; use {', '.join(cls.FIELDS)}")
        if not all(isinstance(value, str) and value for value in columns.values()):
            raise ValueError("columns: every value must be a column name")
        turns = {"prompt", "input", "response", "system"} & set(columns)
        if "messages" in columns and turns:
            raise ValueError(f"columns: map 'messages' (a list of turns) or prompt/response, not both (got {sorted(columns)})")
        if "messages" not in columns and not {"prompt", "response"} <= set(columns):
            raise ValueError(f"columns: map 'messages', or both 'prompt' and 'response' (got {sorted(columns)})")
        if "messages" not in columns and {"role", "content"} & set(columns):
            raise ValueError("columns: 'role' and 'content' name the keys inside the turns of a 'messages' column")
        return cls(**columns)

    @property
    def required(self) -> list[str]:
        return [self.messages] if self.messages else [self.prompt, self.response]

    def describe(self) -> str:
        fields = ("messages", "role", "content") if self.messages else ("prompt", "input", "response", "system")
        return ", ".join(f"{field}: {getattr(self, field)}" for field in fields if getattr(self, field))

    def record(self, obj: dict) -> list[dict]:
        missing = [column for column in self.required if column not in obj]
        if missing:
            keys = ", ".join(sorted(map(str, obj))[:8]) or "none"
            raise RowError("unknown_format", f"expected {', '.join(missing)} (raw_dataset config columns); found keys: {keys}")
        if self.messages:
            return _message_list(obj[self.messages], self.messages, self.role, self.content, SHAREGPT_ROLES)
        return _instruction_turns(
            _text(obj[self.prompt], f"'{self.prompt}'"),
            _optional_text(obj, self.input),
            _text(obj[self.response], f"'{self.response}'"),
            _optional_text(obj, self.system),
            [],
        )


def normalize_record(obj: object, mapping: ColumnMapping | None = None) -> list[dict]:
    """One parsed row in any accepted layout -> chat messages; raises RowError(reason, detail)."""
    if not isinstance(obj, dict):
        raise RowError("not_an_object", f"a row must be a JSON object, got {type(obj).__name__}")
    if mapping is not None:
        return mapping.record(obj)
    if "chosen" in obj and "rejected" in obj:
        from ft_assets.data.preference import pair_messages

        return pair_messages(obj)
    if "messages" in obj:
        return _message_list(obj["messages"], "messages", "role", "content", None)
    if "conversations" in obj:
        return _with_system(obj, _message_list(obj["conversations"], "conversations", "from", "value", SHAREGPT_ROLES))
    if "instruction" in obj and "output" in obj:
        return _instruction_turns(
            _text(obj["instruction"], "'instruction'"),
            _optional_text(obj, "input"),
            _text(obj["output"], "'output'"),
            _optional_text(obj, "system"),
            _history(obj.get("history")),
        )
    keys = ", ".join(sorted(map(str, obj))[:8]) or "none"
    raise RowError("unknown_format", f"expected 'messages', 'conversations', 'instruction'+'output' or 'chosen'+'rejected'; found keys: {keys}")


def check_columns(name: str, columns: list[str], mapping: ColumnMapping | None, what: str) -> None:
    """A table (Parquet/Arrow schema, CSV header) must hold an accepted layout; else name what it holds."""
    found = ", ".join(sorted(columns)) or "none"
    if mapping is not None:
        missing = [column for column in mapping.required if column not in columns]
        if missing:
            raise DatasetFileError(
                f"{name}: {what} lacks the mapped column(s) {', '.join(missing)} ({mapping.describe()}); columns found: {found}"
            )
        return
    present = set(columns)
    layouts = ({"messages"}, {"conversations"}, {"instruction", "output"}, {"chosen", "rejected"})
    if not any(layout <= present for layout in layouts):
        raise DatasetFileError(f"{name}: {what} has none of the accepted layouts ({LAYOUTS}); columns found: {found}; {MAPPING_HINT}")


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    obj = dict(pairs)
    if len(obj) < len(pairs):  # a key repeats: name its first repetition
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise RowError("duplicate_key", f"key {key!r} appears more than once in one object")
            seen.add(key)
    return obj


# One decoder for every line: json.loads(text, object_pairs_hook=…) builds a new JSONDecoder per call,
# which doubled the parse time of a chat row (25 µs -> 12 µs on the benchmark corpus).
_DECODER = json.JSONDecoder(object_pairs_hook=_no_duplicate_keys)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\udc80-\udcff]")  # what errors="surrogateescape" makes of a byte that is not UTF-8


def _check_encodable(messages: list[dict]) -> None:
    """JSON may escape half a surrogate pair (``"\\ud800"``): a str that UTF-8 cannot hold."""
    for i, message in enumerate(messages):
        for field, value in message.items():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise RowError(
                    "invalid_utf8", f"message {i} {field} holds a lone surrogate escape (\\u{ord(value[exc.start]):04x})"
                ) from exc


def parse_line(raw: bytes, mapping: ColumnMapping | None = None) -> list[dict]:
    """Decode and parse one JSONL line; raises RowError."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RowError("invalid_utf8", f"byte {exc.start} is not valid UTF-8") from exc
    try:
        obj = _DECODER.decode(text)
    except RecursionError as exc:
        raise RowError("invalid_json", "nesting too deep") from exc
    except json.JSONDecodeError as exc:
        raise RowError("invalid_json", f"{exc.msg} at column {exc.colno}") from exc
    except RowError:  # a duplicate key, from the object hook
        raise
    except ValueError as exc:  # int() of a literal over sys.get_int_max_str_digits() digits
        raise RowError("invalid_json", str(exc).split(";")[0]) from exc
    messages = normalize_record(obj, mapping)
    if _SURROGATE_ESCAPE.search(raw):
        _check_encodable(messages)
    return messages


def _preview(raw: bytes) -> str:
    return raw[:RAW_PREVIEW_CHARS * 4].decode("utf-8", errors="replace")[:RAW_PREVIEW_CHARS]


# --- files -----------------------------------------------------------------------------------------


@contextmanager
def _opened(path: FileRef, name: str):
    """The file's bytes, gunzipped for a ``.gz`` name; gzip damage becomes a DatasetFileError naming it."""
    try:
        with open_file(path) as raw, (gzip.GzipFile(fileobj=raw) if name.endswith(".gz") else raw) as handle:
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


def _json_lines(handle, name: str, mapping: ColumnMapping | None, first: int = 1) -> Iterator[Row | Rejected | None]:
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
        yield from _json_lines(handle, name, mapping)


class _ArrayElements:
    """The elements of a JSON array, decoded one at a time from a growing text buffer.

    ``raw_decode`` is retried with more text when an element runs past the buffer. Duplicate keys and
    over-long integer literals are recorded (not raised) while decoding, so that the element is still
    read to its end and the next one can be found; invalid UTF-8 is decoded to surrogate escapes and
    quarantined with its element.
    """

    def __init__(self, handle, name: str):
        self.handle, self.name = handle, name
        self.text = codecs.getincrementaldecoder("utf-8")(errors="surrogateescape")
        self.buffer, self.pos, self.line, self.eof = "", 0, 1, False
        self.problems: list[RowError] = []
        self.decoder = json.JSONDecoder(object_pairs_hook=self._object, parse_int=self._int)

    def _object(self, pairs: list[tuple[str, object]]) -> dict:
        try:
            return _no_duplicate_keys(pairs)
        except RowError as exc:
            self.problems.append(exc)
            return dict(pairs)

    def _int(self, literal: str) -> int | None:
        if len(literal.lstrip("-")) > MAX_INT_DIGITS:
            self.problems.append(RowError("invalid_json", f"an integer literal of {len(literal)} digits"))
            return None
        return int(literal)

    def _more(self) -> bool:
        if self.eof:
            return False
        chunk = self.handle.read(max(JSON_CHUNK_BYTES, len(self.buffer) - self.pos))
        self.eof = not chunk
        self.line += self.buffer.count("\n", 0, self.pos)
        self.buffer = self.buffer[self.pos :] + self.text.decode(chunk, final=self.eof)
        self.pos = 0
        return True

    def _skip_space(self) -> str:
        """The next non-whitespace character ('' at the end of the file), without consuming it."""
        while True:
            while self.pos < len(self.buffer) and self.buffer[self.pos] in " \t\r\n":
                self.pos += 1
            if self.pos < len(self.buffer) or not self._more():
                return self.buffer[self.pos : self.pos + 1]

    def _where(self) -> str:
        line = self.line + self.buffer.count("\n", 0, self.pos)
        return f"line {line}"

    def _fail(self, what: str) -> DatasetFileError:
        return DatasetFileError(f"{self.name}: {what} at {self._where()}; the array cannot be read past it — fix the file")

    def __iter__(self) -> Iterator[tuple[object, str, list[RowError]]]:
        """(element, its text, problems met while decoding it)."""
        if self._skip_space() == "\ufeff":
            self.pos += 1
        if self._skip_space() != "[":
            raise self._fail("expected '[' (a JSON array of rows)")
        self.pos += 1
        first = True
        while True:
            head = self._skip_space()
            if head == "]":
                self.pos += 1
                if self._skip_space():
                    raise self._fail("data after the array's closing ']'")
                return
            if not first:
                if head != ",":
                    raise self._fail("expected ',' or ']' between elements" if head else "the file ends inside the array")
                self.pos += 1
                self._skip_space()
            first = False
            yield self._element()

    def _element(self) -> tuple[object, str, list[RowError]]:
        while True:
            self.problems = []
            try:
                value, end = self.decoder.raw_decode(self.buffer, self.pos)
            except RecursionError:
                raise self._fail("an element nested too deep") from None
            except json.JSONDecodeError as exc:
                if self._more():
                    continue
                raise self._fail(f"invalid JSON ({exc.msg})") from exc
            if end == len(self.buffer) and self._more():  # a number may go on past the buffer
                continue
            text, self.pos = self.buffer[self.pos : end], end
            return value, text, self.problems


def _json_array(handle, name: str, mapping: ColumnMapping | None) -> Iterator[Row | Rejected]:
    for index, (value, text, problems) in enumerate(_ArrayElements(handle, name), start=1):
        source = f"{name}#{index}"
        try:
            if problems:
                raise problems[0]
            if escaped := _SURROGATE.search(text):  # a byte that is not UTF-8, decoded as a surrogate escape
                raise RowError("invalid_utf8", f"byte 0x{ord(escaped.group()) - 0xDC00:02x} is not valid UTF-8")
            messages = normalize_record(value, mapping)
            if "\\u" in text:
                _check_encodable(messages)
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
            yield from _json_lines(handle, name, mapping)


def _cell_json(value: str, column: str) -> object:
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise RowError("invalid_json", f"column '{column}' holds no JSON list of turns ({exc.msg} at column {exc.colno})") from exc


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
                if escaped := next(filter(None, map(_SURROGATE.search, record)), None):
                    raise RowError("invalid_utf8", f"byte 0x{ord(escaped.group()) - 0xDC00:02x} is not valid UTF-8")
                row = {key: _cell_json(value, key) if key in turn_lists else value for key, value in zip(header, record)}
                messages = normalize_record(row, mapping)
                if any("\\u" in record[header.index(key)] for key in turn_lists if key in header):
                    _check_encodable(messages)
                yield Row(source, messages)
            except RowError as exc:
                yield Rejected(source, exc.reason, exc.detail, raw)


def _table_rows(name: str, kind: str, batches, mapping: ColumnMapping | None, index: int = 0) -> Iterator[Row | Rejected]:
    """Rows of record batches; ``index``: the rows of the table before the first batch."""
    import pyarrow as pa

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


def _parquet_file(path: FileRef, name: str):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(arrow_file(path))
    except (pa.ArrowException, OSError) as exc:
        raise DatasetFileError(f"{name}: not a readable Parquet file ({exc})") from exc


def iter_parquet(
    path: FileRef, name: str, mapping: ColumnMapping | None = None, row_groups: range | None = None, first_row: int = 0
) -> Iterator[Row | Rejected]:
    """Rows of a Parquet file, or of ``row_groups`` of it (whose first row is row ``first_row`` of the file)."""
    parquet = _parquet_file(path, name)
    check_columns(name, parquet.schema_arrow.names, mapping, "Parquet schema")
    groups = None if row_groups is None else list(row_groups)
    batches = parquet.iter_batches(batch_size=TABLE_BATCH_ROWS, row_groups=groups)
    yield from _table_rows(name, "Parquet", batches, mapping, first_row)


def iter_arrow(path: FileRef, name: str, mapping: ColumnMapping | None = None) -> Iterator[Row | Rejected]:
    """Rows of an Arrow IPC file, memory-mapped: the file format (magic ``ARROW1``) or the stream format."""
    import pyarrow as pa

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


def iter_dataset_file(path: FileRef, name: str, mapping: ColumnMapping | None = None) -> Iterator[Row | Rejected | None]:
    suffix = suffix_of(name)
    if suffix is None:
        raise DatasetFileError(f"{name}: unsupported file type; use one of {', '.join(SUPPORTED_SUFFIXES)}")
    yield from READERS[suffix.removesuffix(".gz")](path, name, mapping)


def is_data_file(name: str) -> bool:
    base = name.rsplit("/", 1)[-1]
    return not base.startswith(("_", ".")) and suffix_of(base) is not None


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

    One pass over the file counting newlines, as ``readline`` does (a line over ``MAX_LINE_BYTES`` is
    still one line), 16 MiB at a time: ~0.1 s for the 113 MB benchmark corpus.
    """
    import numpy as np

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
            metadata = _parquet_file(path, name).metadata
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
    return _json_lines(io.BytesIO(read_range(shard.file, shard.start, shard.stop)), shard.name, mapping, shard.first)


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
    import pyarrow as pa

    from ft_assets.data.rows import QUARANTINE_SCHEMA, ROW_SCHEMA, FLUSH_ROWS

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
    from ft_assets.data.rows import QUARANTINE_SCHEMA, ROW_SCHEMA, ParquetSink

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
