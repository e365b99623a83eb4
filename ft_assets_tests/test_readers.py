import csv
import gzip
import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ft_assets.data import decoding, formats
from ft_assets.data.formats import Rejected, Row, iter_dataset_file
from ft_assets.data.layouts import ColumnMapping, normalize_record
from ft_assets.data.parts import Artifact
from ft_assets.data.readers import read_dataset
from ft_assets.data.rows import DatasetFileError, RowError

CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]

NORMALIZE_CASES = [
    ("chat", {"messages": CHAT}, CHAT),
    (
        "sharegpt",
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
        CHAT,
    ),
    (
        "sharegpt-system",
        {
            "conversations": [
                {"from": "system", "value": "be nice"},
                {"from": "human", "value": "hi"},
                {"from": "gpt", "value": "hello"},
            ]
        },
        [{"role": "system", "content": "be nice"}] + CHAT,
    ),
    ("alpaca-no-input", {"instruction": "hi", "output": "hello"}, CHAT),
    ("alpaca-empty-input", {"instruction": "hi", "input": "", "output": "hello"}, CHAT),
    (
        "alpaca-input",
        {"instruction": "Translate.", "input": "hi", "output": "hello"},
        [{"role": "system", "content": "Translate."}] + CHAT,
    ),
    (
        "sharegpt-unknown-role-kept",
        {"conversations": [{"from": "bot2", "value": "x"}]},
        [{"role": "bot2", "content": "x"}],
    ),
]


@pytest.mark.parametrize("name,record,expected", NORMALIZE_CASES, ids=[c[0] for c in NORMALIZE_CASES])
def test_normalize_record(name, record, expected):
    assert normalize_record(record) == expected


BAD_RECORDS = [
    ("list", [1, 2], "not_an_object"),
    ("number", 3, "not_an_object"),
    ("unknown-keys", {"prompt": "x", "completion": "y"}, "unknown_format"),
    ("messages-not-list", {"messages": "hi"}, "wrong_type"),
    ("message-not-object", {"messages": ["hi"]}, "wrong_type"),
    ("content-not-string", {"messages": [{"role": "user", "content": 5}]}, "wrong_type"),
    ("missing-content", {"messages": [{"role": "user"}]}, "wrong_type"),
    ("output-not-string", {"instruction": "x", "output": ["y"]}, "wrong_type"),
]


@pytest.mark.parametrize("name,record,reason", BAD_RECORDS, ids=[c[0] for c in BAD_RECORDS])
def test_normalize_record_rejects(name, record, reason):
    with pytest.raises(RowError) as err:
        normalize_record(record)
    assert err.value.reason == reason


def _lines(path, name):
    return list(iter_dataset_file(path, name))


def test_jsonl_tolerates_bom_crlf_blank_lines_and_quarantines_bad_lines(tmp_path):
    good = json.dumps({"messages": CHAT})
    body = (
        b"\xef\xbb\xbf"
        + good.encode()
        + b"\r\n\r\n"
        + b"{not json\n"
        + b'{"a": 1, "a": 2}\n'
        + b"\xff\xfe bad utf8\n"
        + b"[" * 100_000
        + b"\n"
        + good.encode()  # last line without newline
    )
    path = tmp_path / "d.jsonl"
    path.write_bytes(body)
    items = _lines(path, "d.jsonl")
    assert [type(i).__name__ if i is not None else None for i in items] == [
        "Row",
        None,
        "Rejected",
        "Rejected",
        "Rejected",
        "Rejected",
        "Row",
    ]
    reasons = [i.reason for i in items if isinstance(i, Rejected)]
    assert reasons == ["invalid_json", "duplicate_key", "invalid_utf8", "invalid_json"]
    assert items[0].messages == CHAT and items[0].source == "d.jsonl:1"
    assert items[2].source == "d.jsonl:3" and items[2].raw == "{not json"


def test_huge_line_is_quarantined_without_breaking_the_next_line(tmp_path, monkeypatch):
    monkeypatch.setattr(formats, "MAX_LINE_BYTES", 128)
    path = tmp_path / "d.jsonl"
    path.write_text(
        json.dumps({"messages": [{"role": "user", "content": "x" * 500}]})
        + "\n"
        + json.dumps({"messages": CHAT})
        + "\n"
    )
    items = _lines(path, "d.jsonl")
    assert isinstance(items[0], Rejected) and items[0].reason == "line_too_long"
    assert isinstance(items[1], Row) and items[1].source == "d.jsonl:2"


def test_gzip_reads_and_truncated_gzip_names_the_file(tmp_path):
    data = gzip.compress(("\n".join(json.dumps({"messages": CHAT}) for _ in range(200)) + "\n").encode())
    ok = tmp_path / "ok.jsonl.gz"
    ok.write_bytes(data)
    assert sum(isinstance(i, Row) for i in _lines(ok, "ok.jsonl.gz")) == 200
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(DatasetFileError, match=r"cut\.jsonl\.gz: the gzip stream is truncated"):
        _lines(cut, "cut.jsonl.gz")
    fake = tmp_path / "fake.jsonl.gz"
    fake.write_bytes(b"this is not gzip\n")
    with pytest.raises(DatasetFileError, match=r"fake\.jsonl\.gz: not a valid gzip file"):
        _lines(fake, "fake.jsonl.gz")


def test_parquet_formats_and_wrong_schema(tmp_path):
    good = tmp_path / "good.parquet"
    pq.write_table(pa.table({"instruction": ["hi", "x"], "input": [None, ""], "output": ["hello", None]}), good)
    items = _lines(good, "good.parquet")
    assert isinstance(items[0], Row) and items[0].messages == CHAT and items[0].source == "good.parquet#1"
    assert isinstance(items[1], Rejected) and items[1].reason == "unknown_format"
    wrong = tmp_path / "wrong.parquet"
    pq.write_table(pa.table({"text": ["a"], "label": [1]}), wrong)
    with pytest.raises(DatasetFileError, match=r"wrong\.parquet: Parquet schema .* columns found: label, text"):
        _lines(wrong, "wrong.parquet")
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1 definitely not parquet")
    with pytest.raises(DatasetFileError, match=r"broken\.parquet: not a readable Parquet file"):
        _lines(broken, "broken.parquet")


def test_unsupported_file_type_is_a_clear_error(tmp_path):
    path = tmp_path / "notes.xlsx"
    path.write_text("a,b\n")
    with pytest.raises(DatasetFileError, match=r"notes\.xlsx: unsupported file type; use one of .jsonl, .*\.csv"):
        _lines(path, "notes.xlsx")


def test_read_dataset_counts_every_row(tmp_path):
    a = tmp_path / "a.jsonl"
    a.write_text(
        json.dumps({"messages": CHAT}) + "\n\n" + "garbage\n" + json.dumps({"instruction": "q", "output": "a"}) + "\n"
    )
    b = tmp_path / "b.parquet"
    pq.write_table(pa.table({"messages": [CHAT, CHAT]}), b)
    stats = read_dataset([("a.jsonl", a), ("b.parquet", b)], out := Artifact.folder(tmp_path / "out"))
    assert stats == {
        "rows_in": 5,
        "rows_parsed": 4,
        "rows_quarantined": 1,
        "quarantine_reasons": {"invalid_json": 1},
        "blank_lines": 1,
        "image_rows": 0,
        "images": 0,
        "rows_per_file": {"a.jsonl": 3, "b.parquet": 2},
        "data_kind": "chat",
    }
    sources = [r["source"] for r in out.records("rows")]
    assert sources == ["a.jsonl:1", "a.jsonl:4", "b.parquet#1", "b.parquet#2"]
    quarantined = list(out.records("quarantine"))
    assert [(q["source"], q["stage"], q["reason"]) for q in quarantined] == [("a.jsonl:3", "raw", "invalid_json")]


# --- JSON arrays, CSV/TSV, Arrow --------------------------------------------------------------------

ALPACA = [
    {"instruction": "Say hi.", "input": "", "output": "hi"},
    {"instruction": "Translate.", "input": "hi", "output": "hola", "id": 12345678901234567890},
    7,
    {"instruction": "x", "output": ["y"]},
    {"instruction": "Add.", "input": "1 + 1", "output": "2", "system": "Be brief.", "history": [["Hello", "Hi!"]]},
]
ALPACA_EXPECTED = [
    ("Row", "a.json#1", None),
    ("Row", "a.json#2", None),
    ("Rejected", "a.json#3", "not_an_object"),
    ("Rejected", "a.json#4", "wrong_type"),
    ("Row", "a.json#5", None),
]


def _summary(items):
    return [(type(i).__name__, i.source, getattr(i, "reason", None)) for i in items if i is not None]


@pytest.mark.parametrize("chunk", [1 << 20, 5], ids=["one-chunk", "5-byte-chunks"])
def test_json_array_streams_element_by_element(tmp_path, monkeypatch, chunk):
    """alpaca_data.json's layout (an indented array); 5-byte chunks cut every element, string and number."""
    monkeypatch.setattr(decoding, "JSON_CHUNK_BYTES", chunk)
    path = tmp_path / "a.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(ALPACA, indent=4).encode())
    items = _lines(path, "a.json")
    assert _summary(items) == ALPACA_EXPECTED
    assert items[0].messages == [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]
    assert items[4].messages == [  # LLaMA-Factory's system and history
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi!"},
        {"role": "user", "content": "Add.\n\n1 + 1"},
        {"role": "assistant", "content": "2"},
    ]


def test_json_array_quarantines_bad_elements_and_keeps_reading(tmp_path):
    body = (
        b'[{"instruction": "caf\xe9", "output": "ok"},\n'
        b' {"instruction": "a", "output": "b", "output": "c"},\n'
        b' {"instruction": "a", "output": "b", "n": ' + b"9" * 5000 + b"},\n"
        b' {"messages": [{"role": "user", "content": "x\\ud800"}]},\n'
        b' {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}], "system": "be nice"}]\n'
    )
    path = tmp_path / "bad.json.gz"
    path.write_bytes(gzip.compress(body))
    items = _lines(path, "bad.json.gz")
    assert [(i.source, getattr(i, "reason", None)) for i in items] == [
        ("bad.json.gz#1", "invalid_utf8"),
        ("bad.json.gz#2", "duplicate_key"),
        ("bad.json.gz#3", "invalid_json"),
        ("bad.json.gz#4", "invalid_utf8"),
        ("bad.json.gz#5", None),
    ]
    assert items[4].messages == [{"role": "system", "content": "be nice"}] + CHAT


BROKEN_ARRAYS = [
    (
        "missing-comma",
        b'[{"instruction": "a", "output": "b"}\n {"instruction": "c", "output": "d"}]',
        r"expected ',' or '\]' .* at line 2",
    ),
    (
        "cut-mid-element",
        b'[{"instruction": "a", "output": "b"},\n {"instruction": "c", "outp',
        r"invalid JSON .* at line 2",
    ),
    ("no-closing-bracket", b'[{"instruction": "a", "output": "b"}\n', r"the file ends inside the array"),
    ("data-after-array", b'[{"instruction": "a", "output": "b"}] []', r"data after the array's closing"),
]


@pytest.mark.parametrize("name,body,error", BROKEN_ARRAYS, ids=[c[0] for c in BROKEN_ARRAYS])
def test_a_broken_json_array_fails_naming_file_and_line(tmp_path, name, body, error):
    path = tmp_path / "broken.json"
    path.write_bytes(body)
    with pytest.raises(DatasetFileError, match=rf"^broken\.json: {error}"):
        _lines(path, "broken.json")


def test_json_lines_under_a_json_name(tmp_path):
    path = tmp_path / "lines.json"
    path.write_text(json.dumps({"messages": CHAT}) + "\n\n" + "{oops\n")
    assert _summary(_lines(path, "lines.json")) == [
        ("Row", "lines.json:1", None),
        ("Rejected", "lines.json:3", "invalid_json"),
    ]


def test_csv_and_tsv_records_with_line_numbers(tmp_path):
    csv_path = tmp_path / "d.csv"
    csv_path.write_bytes(
        b'\xef\xbb\xbfinstruction,input,output\r\n"Say\nhi",,hi\r\n\r\nonly,two\r\n"caf\xe9",,x\r\nTranslate.,hi,hello\r\n'
    )
    items = _lines(csv_path, "d.csv")
    assert items[1] is None  # a blank line
    assert _summary(items) == [
        ("Row", "d.csv:2", None),
        ("Rejected", "d.csv:5", "wrong_field_count"),
        ("Rejected", "d.csv:6", "invalid_utf8"),
        ("Row", "d.csv:7", None),
    ]
    assert items[0].messages == [{"role": "user", "content": "Say\nhi"}, {"role": "assistant", "content": "hi"}]
    tsv = tmp_path / "d.tsv.gz"
    text = io.StringIO()
    csv.writer(text, delimiter="\t").writerows(
        [["messages"], [json.dumps(CHAT)], ["[not json"]]
    )  # the JSON cell is quoted
    tsv.write_bytes(gzip.compress(text.getvalue().encode()))
    items = _lines(tsv, "d.tsv.gz")
    assert _summary(items) == [("Row", "d.tsv.gz:2", None), ("Rejected", "d.tsv.gz:3", "invalid_json")]
    assert items[0].messages == CHAT


def _arrow(path, table, stream):
    with pa.OSFile(str(path), "wb") as sink:
        with (pa.ipc.new_stream if stream else pa.ipc.new_file)(sink, table.schema) as writer:
            writer.write_table(table)


@pytest.mark.parametrize("stream", [True, False], ids=["stream-format", "file-format"])
def test_arrow_files(tmp_path, stream):
    path = tmp_path / "d.arrow"
    _arrow(path, pa.table({"instruction": ["hi", "x"], "output": ["hello", None]}), stream)
    assert _summary(_lines(path, "d.arrow")) == [
        ("Row", "d.arrow#1", None),
        ("Rejected", "d.arrow#2", "unknown_format"),
    ]
    bad = tmp_path / "bad.arrow"
    bad.write_bytes(b"not arrow at all")
    with pytest.raises(DatasetFileError, match=r"^bad\.arrow: not a readable Arrow file"):
        _lines(bad, "bad.arrow")


# --- column mapping ---------------------------------------------------------------------------------

MAPPING_CASES = [
    ("question-answer", {"prompt": "question", "response": "answer"}, {"question": "hi", "answer": "hello"}, CHAT),
    (
        "prompt-completion",
        {"prompt": "prompt", "response": "completion"},
        {"prompt": "hi", "completion": "hello"},
        CHAT,
    ),
    ("input-output", {"prompt": "input", "response": "output"}, {"input": "hi", "output": "hello"}, CHAT),
    (
        "with-system-and-input",
        {"prompt": "q", "input": "ctx", "response": "a", "system": "sys"},
        {"q": "Translate.", "ctx": "hi", "a": "hola", "sys": "be nice"},
        [
            {"role": "system", "content": "be nice"},
            {"role": "user", "content": "Translate.\n\nhi"},
            {"role": "assistant", "content": "hola"},
        ],
    ),
    (
        "conversations-from-value",
        {"messages": "dialog", "role": "from", "content": "value"},
        {"dialog": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
        CHAT,
    ),
    (
        "turns-speaker-text",
        {"messages": "turns", "role": "speaker", "content": "text"},
        {"turns": [{"speaker": "user", "text": "hi"}, {"speaker": "assistant", "text": "hello"}]},
        CHAT,
    ),
]


@pytest.mark.parametrize("name,columns,record,expected", MAPPING_CASES, ids=[c[0] for c in MAPPING_CASES])
def test_column_mapping(name, columns, record, expected):
    assert normalize_record(record, ColumnMapping.of(columns)) == expected


BAD_MAPPINGS = [
    ({"prompt": "q"}, "both 'prompt' and 'response'"),
    ({"question": "q", "response": "a"}, "unknown key"),
    ({"messages": "m", "prompt": "q"}, "not both"),
    ({"prompt": "q", "response": "a", "role": "r"}, "'role' and 'content' name the keys"),
    ({"prompt": "", "response": "a"}, "must be a column name"),
]


@pytest.mark.parametrize("columns,error", BAD_MAPPINGS, ids=[str(c[0]) for c in BAD_MAPPINGS])
def test_column_mapping_config_errors(columns, error):
    with pytest.raises(ValueError, match=error):
        ColumnMapping.of(columns)


def test_unmatched_columns_are_listed_and_a_mapping_reads_them(tmp_path):
    table = tmp_path / "qa.parquet"
    pq.write_table(pa.table({"question": ["hi", "x"], "answer": ["hello", None], "id": [1, 2]}), table)
    with pytest.raises(
        DatasetFileError, match=r"^qa\.parquet: .*columns found: answer, id, question; map your columns"
    ):
        _lines(table, "qa.parquet")
    mapping = ColumnMapping.of({"prompt": "question", "response": "answer"})
    items = list(iter_dataset_file(table, "qa.parquet", mapping))
    assert _summary(items) == [("Row", "qa.parquet#1", None), ("Rejected", "qa.parquet#2", "unknown_format")]
    with pytest.raises(
        DatasetFileError,
        match=r"^qa\.parquet: .* lacks the mapped column\(s\) prompt .* columns found: answer, id, question",
    ):
        list(iter_dataset_file(table, "qa.parquet", ColumnMapping.of({"prompt": "prompt", "response": "answer"})))
    lines = tmp_path / "qa.jsonl"
    lines.write_text(json.dumps({"question": "hi", "answer": "hello"}) + "\n" + json.dumps({"question": "x"}) + "\n")
    with pytest.raises(
        DatasetFileError,
        match=r"^qa\.jsonl: no row has an accepted layout \(qa\.jsonl:1: .*found keys: answer, question\)",
    ):
        read_dataset([("qa.jsonl", lines)], Artifact.folder(tmp_path / "out"))
    stats = read_dataset([("qa.jsonl", lines)], Artifact.folder(tmp_path / "mapped"), mapping)
    assert (stats["rows_parsed"], stats["quarantine_reasons"]) == (1, {"unknown_format": 1})
