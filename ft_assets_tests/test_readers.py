import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ft_assets.data.readers import DatasetFileError, Rejected, Row, RowError, iter_dataset_file, normalize_record, read_dataset
from ft_assets.data.rows import iter_records

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
        {"conversations": [{"from": "system", "value": "be nice"}, {"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
        [{"role": "system", "content": "be nice"}] + CHAT,
    ),
    ("alpaca-no-input", {"instruction": "hi", "output": "hello"}, CHAT),
    ("alpaca-empty-input", {"instruction": "hi", "input": "", "output": "hello"}, CHAT),
    (
        "alpaca-input",
        {"instruction": "Translate.", "input": "hi", "output": "hello"},
        [{"role": "system", "content": "Translate."}] + CHAT,
    ),
    ("sharegpt-unknown-role-kept", {"conversations": [{"from": "bot2", "value": "x"}]}, [{"role": "bot2", "content": "x"}]),
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
        b"\xef\xbb\xbf" + good.encode() + b"\r\n\r\n"
        + b"{not json\n"
        + b'{"a": 1, "a": 2}\n'
        + b"\xff\xfe bad utf8\n"
        + b"[" * 100_000 + b"\n"
        + good.encode()  # last line without newline
    )
    path = tmp_path / "d.jsonl"
    path.write_bytes(body)
    items = _lines(path, "d.jsonl")
    assert [type(i).__name__ if i is not None else None for i in items] == [
        "Row", None, "Rejected", "Rejected", "Rejected", "Rejected", "Row"
    ]
    reasons = [i.reason for i in items if isinstance(i, Rejected)]
    assert reasons == ["invalid_json", "duplicate_key", "invalid_utf8", "invalid_json"]
    assert items[0].messages == CHAT and items[0].source == "d.jsonl:1"
    assert items[2].source == "d.jsonl:3" and items[2].raw == "{not json"


def test_huge_line_is_quarantined_without_breaking_the_next_line(tmp_path, monkeypatch):
    import ft_assets.data.readers as readers

    monkeypatch.setattr(readers, "MAX_LINE_BYTES", 128)
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "x" * 500}]}) + "\n" + json.dumps({"messages": CHAT}) + "\n")
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
    path = tmp_path / "notes.csv"
    path.write_text("a,b\n")
    with pytest.raises(DatasetFileError, match=r"notes\.csv: unsupported file type"):
        _lines(path, "notes.csv")


def test_read_dataset_counts_every_row(tmp_path):
    a = tmp_path / "a.jsonl"
    a.write_text(json.dumps({"messages": CHAT}) + "\n\n" + "garbage\n" + json.dumps({"instruction": "q", "output": "a"}) + "\n")
    b = tmp_path / "b.parquet"
    pq.write_table(pa.table({"messages": [CHAT, CHAT]}), b)
    stats = read_dataset([("a.jsonl", a), ("b.parquet", b)], tmp_path / "out")
    assert stats == {
        "rows_in": 5,
        "rows_parsed": 4,
        "rows_quarantined": 1,
        "quarantine_reasons": {"invalid_json": 1},
        "blank_lines": 1,
        "rows_per_file": {"a.jsonl": 3, "b.parquet": 2},
    }
    sources = [r["source"] for r in iter_records(tmp_path / "out" / "rows.parquet")]
    assert sources == ["a.jsonl:1", "a.jsonl:4", "b.parquet#1", "b.parquet#2"]
    quarantined = list(iter_records(tmp_path / "out" / "quarantine.parquet"))
    assert [(q["source"], q["stage"], q["reason"]) for q in quarantined] == [("a.jsonl:3", "raw", "invalid_json")]
