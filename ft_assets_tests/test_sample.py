"""The shipped sample: deterministic, canonical targets, dirt exactly as reported, files not hand-edited.

The census below reads the files with its own small reader (not the data plane's), so the counts
``write_sample`` reports are checked against what is really on disk.
"""

from __future__ import annotations

import gzip
import itertools
import json
import unicodedata
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from scripts.make_sample import (
    FILES,
    SEED,
    SYSTEM_PROMPT,
    TOOLS,
    canonical_call,
    dedup_key,
    generate_toolcall_rows,
    write_sample,
)

SHIPPED = Path(__file__).resolve().parents[1] / "samples" / "toolcalls"
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}
NEAR_THRESHOLD = 0.8  # word 5-gram Jaccard at which a deduplicator should call two requests the same


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("sample")
    return out, write_sample(out)


@pytest.fixture(scope="module")
def on_disk(written):
    return census(written[0])


def read_text(path: Path) -> str:
    data = path.read_bytes()
    return (gzip.decompress(data) if path.suffix == ".gz" else data).decode("utf-8")


def classify(line: str) -> tuple[str, list[tuple[str, str]]]:
    """(kind, turns) of one line: blank, malformed, wrong_roles, empty_answers or ok."""
    if not line.strip():
        return "blank_lines", []
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return "malformed", []
    if not isinstance(record, dict):
        return "malformed", []
    if "messages" in record:
        turns = [(m["role"], m["content"]) for m in record["messages"]]
    elif "conversations" in record:
        turns = [(SHAREGPT_ROLES.get(m["from"], m["from"]), m["value"]) for m in record["conversations"]]
    elif record.get("input"):
        turns = [("system", record["instruction"]), ("user", record["input"])]
        turns.append(("assistant", record["output"]))
    else:
        turns = [("user", record["instruction"]), ("assistant", record["output"])]
    if [role for role, _ in turns] not in (["system", "user", "assistant"], ["user", "assistant"]):
        return "wrong_roles", turns
    if not turns[-1][1].strip():
        return "empty_answers", turns
    return "ok", turns


def clean(text: str) -> str:
    text = text.replace("\u00a0", " ")
    return "".join(ch for ch in text if unicodedata.category(ch) != "Cc" or ch in "\t\n").strip()


def shingles(text: str) -> set[tuple[str, ...]]:
    words = text.casefold().split()
    return {tuple(words[i : i + 5]) for i in range(max(1, len(words) - 4))}


def jaccard_pairs(requests: list[str], at_least: float) -> list[tuple[float, int, int]]:
    """Every pair of requests with word 5-gram Jaccard ≥ at_least (exact, via an inverted index)."""
    sets = [shingles(r) for r in requests]
    index = defaultdict(list)
    for i, grams in enumerate(sets):
        for gram in grams:
            index[gram].append(i)
    candidates = {pair for rows in index.values() for pair in itertools.combinations(rows, 2)}
    scored = ((len(sets[a] & sets[b]) / len(sets[a] | sets[b]), a, b) for a, b in candidates)
    return sorted((s for s in scored if s[0] >= at_least), reverse=True)


def census(out_dir: Path) -> tuple[Counter[str], list[dict[str, str]], list[tuple[float, int, int]]]:
    """Count every kind of line as a cleaner + exact dedup + near dedup sees them.

    Also returns the rows kept after cleaning and exact dedup, as {role: content}, and every pair of
    them whose requests score a word 5-gram Jaccard of at least 0.7.
    """
    counts: Counter[str] = Counter()
    kept: dict[tuple, list[tuple[str, str]]] = {}
    for file in FILES:
        for line in read_text(out_dir / file).removeprefix("\ufeff").split("\n")[:-1]:
            kind, turns = classify(line.removesuffix("\r"))
            counts[kind] += 1
            if kind != "ok":
                continue
            cleaned = [(role, clean(content)) for role, content in turns]
            counts["needs_normalizing"] += cleaned != turns
            key = tuple((role, dedup_key(content)) for role, content in cleaned)
            counts["exact_duplicates"] += key in kept
            kept.setdefault(key, cleaned)
    rows = [dict(turns) for turns in kept.values()]
    similar = jaccard_pairs([row["user"] for row in rows], 0.7)
    counts["near_duplicates"] = sum(score >= NEAR_THRESHOLD for score, _, _ in similar)
    counts["unique_examples"] = len(kept) - counts["near_duplicates"]
    return counts, rows, similar


@pytest.mark.parametrize(
    "kind",
    [
        "unique_examples",
        "exact_duplicates",
        "near_duplicates",
        "malformed",
        "wrong_roles",
        "empty_answers",
        "blank_lines",
        "needs_normalizing",
    ],
)
def test_dirt_on_disk_matches_the_report(written, on_disk, kind):
    counts, _, _ = on_disk
    assert counts[kind] == written[1][kind]


def test_line_counts_add_up(written):
    out_dir, report = written
    on_disk = {file: len(read_text(out_dir / file).split("\n")) - 1 for file in FILES}
    assert on_disk == {file: report[file] for file in FILES}
    dropped = [k for k in report if k not in FILES and k != "needs_normalizing"]
    assert sum(on_disk.values()) == sum(report[k] for k in dropped)


@pytest.mark.parametrize(
    "file, check",
    [
        ("part-000.jsonl", lambda raw: raw[0] == "\ufeff" and classify(raw[1:].split("\n")[0])[0] == "ok"),
        ("part-000.jsonl", lambda raw: "\r" not in raw),
        ("part-001.jsonl.gz", lambda raw: not raw.startswith("\ufeff") and "\r" not in raw),
        ("part-002.jsonl", lambda raw: raw.count("\r\n") == raw.count("\n") and not raw.startswith("\ufeff")),
    ],
    ids=["bom-then-good-row", "lf", "gz-plain", "crlf"],
)
def test_file_level_dirt(written, file, check):
    out_dir, _ = written
    assert check(read_text(out_dir / file))


def test_near_duplicates_are_separable_from_distinct_requests(written, on_disk):
    """Injected pairs score ≥ 0.85, all other pairs < 0.7: a MinHash at 0.8 has room on both sides."""
    _, rows, similar = on_disk
    assert len(similar) == written[1]["near_duplicates"]
    assert min(score for score, _, _ in similar) >= 0.85
    convert_rows = [row["user"] for row in rows if row["user"].startswith("Convert ")]
    assert sum(len(r.split()) <= 6 for r in convert_rows) > 50  # short look-alikes exist and are kept


def test_cleaning_and_dedup_leave_exactly_the_clean_examples(on_disk):
    """The longer request of each near pair is the edited copy; without them, the n examples remain."""
    _, rows, similar = on_disk
    edited = {max(rows[a]["user"], rows[b]["user"], key=len) for _, a, b in similar}
    survivors = {(dedup_key(row["user"]), row["assistant"]) for row in rows if row["user"] not in edited}
    assert survivors == {(dedup_key(ex.request), ex.target) for ex in generate_toolcall_rows(3000, SEED)}


def test_write_sample_is_deterministic(written, tmp_path):
    out_dir, report = written
    assert write_sample(tmp_path) == report
    for file in FILES:
        assert (tmp_path / file).read_bytes() == (out_dir / file).read_bytes(), file


@pytest.mark.parametrize("file", FILES)
def test_shipped_files_equal_a_fresh_generation(written, file):
    """Nobody edits samples/ by hand: regenerate with `python -m scripts.make_sample samples/toolcalls`.

    The .gz is compared decompressed: another zlib build may compress the same bytes differently.
    """
    out_dir, _ = written
    assert read_text(SHIPPED / file) == read_text(out_dir / file)


def test_generation_depends_only_on_the_seed():
    assert generate_toolcall_rows(50, 7) == generate_toolcall_rows(50, 7)
    assert generate_toolcall_rows(50, 7) != generate_toolcall_rows(50, 8)


@pytest.mark.parametrize(
    "name, arguments, expected",
    [
        (
            "get_weather",
            {"city": "Paris", "unit": "celsius"},
            '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
        ),
        ("set_timer", {"minutes": 12}, '{"name": "set_timer", "arguments": {"minutes": 12}}'),
        (
            "convert_units",
            {"to_unit": "m", "value": 2.5, "from_unit": "km"},  # any input order, canonical output order
            '{"name": "convert_units", "arguments": {"value": 2.5, "from_unit": "km", "to_unit": "m"}}',
        ),
        (
            "search_flights",
            {"origin": "New York", "destination": "Lima", "date": "2026-03-04"},
            '{"name": "search_flights", "arguments": '
            '{"origin": "New York", "destination": "Lima", "date": "2026-03-04"}}',
        ),
    ],
)
def test_canonical_call_round_trips(name, arguments, expected):
    assert canonical_call(name, arguments) == expected
    assert json.loads(expected) == {"name": name, "arguments": arguments}


@pytest.mark.parametrize(
    "name, arguments, message",
    [
        ("get_time", {}, "unknown tool 'get_time'"),
        ("set_timer", {"seconds": 30}, "set_timer takes arguments ('minutes',)"),
    ],
)
def test_canonical_call_rejects_what_no_tool_takes(name, arguments, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        canonical_call(name, arguments)


COPIED_FROM_REQUEST = {  # tool → arguments whose value the request spells out (case aside)
    "get_weather": ("city",),
    "set_timer": ("minutes",),
    "convert_units": ("value",),
    "send_email": ("to", "subject"),
    "create_reminder": ("text",),
    "search_flights": ("origin", "destination"),
}


def test_every_clean_target_is_a_canonical_call_of_a_known_tool():
    examples = generate_toolcall_rows(3000, SEED)
    assert len({dedup_key(ex.request) for ex in examples}) == len(examples)
    assert set(Counter(ex.tool for ex in examples)) == set(TOOLS)
    for ex in examples:
        call = json.loads(ex.target)
        assert call["name"] == ex.tool and list(call["arguments"]) == list(TOOLS[ex.tool])
        assert canonical_call(call["name"], call["arguments"]) == ex.target
        for argument in COPIED_FROM_REQUEST[ex.tool]:
            assert str(call["arguments"][argument]).casefold() in ex.request.casefold(), (argument, ex)
        assert SYSTEM_PROMPT not in ex.request
