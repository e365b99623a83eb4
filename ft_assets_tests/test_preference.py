"""Preference pairs through the data plane's own functions: layouts, bad pairs, one kind per version,
deduplication (a pair is one row), the accounting invariant, and pairs tokenized and packed whole."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ft_assets.data.chat_encoding import ChatEncoder
from ft_assets.data.cleaning import CleaningRules, clean_dataset
from ft_assets.data.decoding import parse_line
from ft_assets.data.dedup import DedupRules, deduplicate_dataset
from ft_assets.data.kinds import CHAT, PREFERENCE, dataset_kind
from ft_assets.data.pair_packing import encode_pairs, tokenize_and_pack_pairs
from ft_assets.data.parts import PART_ROWS, Artifact
from ft_assets.data.preference import clean_pair
from ft_assets.data.readers import read_dataset
from ft_assets.data.rows import DatasetFileError
from ft_assets.data.split import split_dataset
from ft_assets.shards import IGNORE_INDEX, load_pair_rows, pair_split, shard_files
from ft_assets_tests.support import PAIR_SEQ_LEN, timer_pairs, write_jsonl


def turn(role: str, content: str) -> dict:
    return {"role": role, "content": content}


PAIR = [turn("chosen", "Hello!"), turn("rejected", "Go away.")]

LAYOUT_CASES = [
    ("strings", {"prompt": "Hi?", "chosen": "Hello!", "rejected": "Go away."}, [turn("user", "Hi?")] + PAIR),
    ("strings-with-system", {"prompt": "Hi?", "chosen": "Hello!", "rejected": "Go away.", "system": "Be kind."},
     [turn("system", "Be kind."), turn("user", "Hi?")] + PAIR),
    ("trl-conversational", {"prompt": [turn("system", "Be kind."), turn("user", "Hi?")], "chosen": [turn("assistant", "Hello!")],
                            "rejected": [turn("assistant", "Go away.")]}, [turn("system", "Be kind."), turn("user", "Hi?")] + PAIR),
    ("hh-implicit-prompt", {"chosen": [turn("user", "Hi?"), turn("assistant", "Hey."), turn("user", "How are you?"), turn("assistant", "Hello!")],
                            "rejected": [turn("user", "Hi?"), turn("assistant", "Hey."), turn("user", "How are you?"), turn("assistant", "Go away.")]},
     [turn("user", "Hi?"), turn("assistant", "Hey."), turn("user", "How are you?")] + PAIR),
    ("llama-factory-sharegpt", {"conversations": [{"from": "human", "value": "Hi?"}], "chosen": {"from": "gpt", "value": "Hello!"},
                                "rejected": {"from": "gpt", "value": "Go away."}}, [turn("user", "Hi?")] + PAIR),
    ("llama-factory-alpaca", {"instruction": "Greet me.", "input": "Hi?", "chosen": "Hello!", "rejected": "Go away."},
     [turn("system", "Greet me."), turn("user", "Hi?")] + PAIR),
]  # fmt: skip


@pytest.mark.parametrize("name,row,messages", LAYOUT_CASES, ids=[c[0] for c in LAYOUT_CASES])
def test_preference_layouts_become_one_row(name, row, messages):
    assert parse_line(json.dumps(row).encode()) == messages


BAD_PAIRS = [
    ("identical-after-cleanup", {"prompt": "Hi?", "chosen": "Hello!", "rejected": " Hello!\n"}, "identical_answers", "same after cleanup"),
    ("empty-chosen", {"prompt": "Hi?", "chosen": " ", "rejected": "Go away."}, "empty_answer", "assistant message 1 has 0"),
    ("empty-rejected", {"prompt": "Hi?", "chosen": "Hello!", "rejected": ""}, "empty_answer", "rejected reply: assistant message 1"),
    ("empty-prompt", {"prompt": "", "chosen": "Hello!", "rejected": "Go away."}, "empty_message", "user message 0"),
    ("reply-by-the-user", {"prompt": "Hi?", "chosen": [turn("user", "Hello!")], "rejected": [turn("assistant", "x")]},
     "bad_role_order", "chosen reply has role 'user'"),
    ("prompt-ends-with-the-assistant", {"prompt": [turn("user", "Hi?"), turn("assistant", "Hey.")], "chosen": "Hello!", "rejected": "x"},
     "bad_role_order", "message 2 is 'assistant' where 'user' was expected"),
    ("conversations-of-other-shapes", {"chosen": [turn("user", "Hi?"), turn("assistant", "a"), turn("user", "b"), turn("assistant", "c")],
                                       "rejected": [turn("user", "Hi?"), turn("assistant", "d")]}, "bad_role_order", "share 1 turns"),
    ("two-replies", {"prompt": "Hi?", "chosen": [turn("assistant", "a"), turn("assistant", "b")], "rejected": "x"}, "wrong_type", "one assistant reply"),
    ("reply-not-text", {"prompt": "Hi?", "chosen": 5, "rejected": "x"}, "wrong_type", "'chosen' must be a string"),
]  # fmt: skip


@pytest.mark.parametrize("name,row,reason,detail", BAD_PAIRS, ids=[c[0] for c in BAD_PAIRS])
def test_bad_pairs_are_quarantined_with_a_reason(name, row, reason, detail, tmp_path):
    good = {"prompt": "Hi?", "chosen": "Hello!", "rejected": "Go away."}
    raw = read_dataset(
        [("pairs.jsonl", write_jsonl(tmp_path / "pairs.jsonl", [good, row]))],
        raw_rows := Artifact.folder(tmp_path / "raw"),
    )
    cleaned = clean_dataset(
        raw_rows, clean_rows := Artifact.folder(tmp_path / "clean"), CleaningRules(), clean=clean_pair
    )
    quarantined = [*raw_rows.records("quarantine"), *clean_rows.records("quarantine")]
    assert [(q["source"], q["reason"]) for q in quarantined] == [("pairs.jsonl:2", reason)]
    assert detail in quarantined[0]["detail"]
    assert (
        cleaned["rows_kept"] == 1
        and raw["rows_in"] == cleaned["rows_kept"] + raw["rows_quarantined"] + cleaned["rows_quarantined"]
    )


def test_a_file_mixing_chat_rows_and_pairs_is_refused_naming_a_row_of_each(tmp_path):
    chat = {"messages": [turn("user", "Hi?"), turn("assistant", "Hello!")]}
    pair = {"prompt": "Hi?", "chosen": "Hello!", "rejected": "Go away."}
    with pytest.raises(
        DatasetFileError,
        match=r"mixed.jsonl mixes chat rows \(mixed.jsonl:1\) and preference pairs .*\(mixed.jsonl:3\)",
    ):
        read_dataset(
            [("mixed.jsonl", write_jsonl(tmp_path / "mixed.jsonl", [chat, chat, pair]))],
            Artifact.folder(tmp_path / "raw"),
        )


def test_a_version_of_chat_files_and_pair_files_is_refused(tmp_path):
    files = [("chats.jsonl", write_jsonl(tmp_path / "chats.jsonl", [{"instruction": "Hi?", "output": "Hello!"}])),
             ("pairs.jsonl", write_jsonl(tmp_path / "pairs.jsonl", timer_pairs(2)))]  # fmt: skip
    with pytest.raises(
        DatasetFileError, match=r"mixes chat files \(chats.jsonl\) and preference files \(pairs.jsonl\)"
    ):
        read_dataset(files, Artifact.folder(tmp_path / "raw"))


def test_the_kind_is_read_from_the_rows_of_any_table_format(tmp_path):
    rows = timer_pairs(3)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "pairs.parquet")
    with open(tmp_path / "pairs.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    for name in ("pairs.parquet", "pairs.csv"):
        stats = read_dataset([(name, tmp_path / name)], Artifact.folder(tmp_path / name.replace(".", "-")))
        assert stats["rows_parsed"] == 3, name
        assert stats["data_kind"] == PREFERENCE
    chats = [("chats.jsonl", write_jsonl(tmp_path / "chats.jsonl", [{"instruction": "Hi?", "output": "Hello!"}]))]
    assert read_dataset(chats, Artifact.folder(tmp_path / "chat"))["data_kind"] == CHAT
    assert dataset_kind({"a.jsonl": {CHAT: "a.jsonl:1"}, "b.jsonl": {CHAT: "b.jsonl:4"}}) == CHAT


def test_a_pair_is_one_row_in_deduplication(tmp_path):
    base = {"prompt": "Which tool sets a timer for the kitchen oven tonight?", "chosen": "The set_timer tool does that for you.",
            "rejected": "Nobody knows which tool it could be."}  # fmt: skip
    rows = [
        base,
        {
            **base,
            "prompt": base["prompt"].upper(),
            "chosen": base["chosen"].replace(".", "!"),
        },  # the same pair: exact duplicate
        {
            **base,
            "rejected": "The weather tool says it is sunny in Paris today.",
        },  # another rejected reply: another pair
        {**base, "prompt": "Which tool sets an alarm for the morning train tomorrow?"},  # another prompt: another pair
        # The preference the other way round contradicts the first; shingles ignore roles, so it is its near duplicate.
        {**base, "chosen": base["rejected"], "rejected": base["chosen"]},
    ]
    read_dataset(
        [("pairs.jsonl", write_jsonl(tmp_path / "pairs.jsonl", rows))], raw := Artifact.folder(tmp_path / "raw")
    )
    clean_dataset(raw, clean := Artifact.folder(tmp_path / "clean"), CleaningRules(), clean=clean_pair)
    stats = deduplicate_dataset(clean, dedup := Artifact.folder(tmp_path / "dedup"), DedupRules())
    assert (stats["rows_kept"], stats["exact_duplicates"], stats["near_duplicates"]) == (3, 1, 1)
    duplicates = list(dedup.records("duplicates"))
    assert [(d["source"], d["kind"], d["duplicate_of"]) for d in duplicates] == [
        ("pairs.jsonl:2", "exact", "pairs.jsonl:1"), ("pairs.jsonl:5", "near", "pairs.jsonl:1")]  # fmt: skip


@pytest.fixture(scope="module")
def encoder(tiny_model_dir) -> ChatEncoder:
    from transformers import AutoTokenizer

    return ChatEncoder(AutoTokenizer.from_pretrained(tiny_model_dir))


def plane(
    rows: list[dict], encoder: ChatEncoder, root: Path, seq_len: int = PAIR_SEQ_LEN, part_rows: int = PART_ROWS
) -> dict:
    """The data plane's functions in the assets' order on one JSONL file of pairs (in parts of ``part_rows`` rows);
    every stage's figures."""
    stage = {name: Artifact.folder(root / name) for name in ("raw", "clean", "dedup", "split")}
    stats = {
        "raw": read_dataset(
            [("pairs.jsonl", write_jsonl(root / "in" / "pairs.jsonl", rows))], stage["raw"], part_rows=part_rows
        )
    }
    stats["kind"] = stats["raw"]["data_kind"]
    stats["clean"] = clean_dataset(stage["raw"], stage["clean"], CleaningRules(), clean=clean_pair)
    stats["dedup"] = deduplicate_dataset(stage["clean"], stage["dedup"], DedupRules())
    stats["split"] = split_dataset(stage["dedup"], stage["split"], 0.2)
    (root / "shards").mkdir()
    for split in ("train", "eval"):
        items = ((r["source"], r["messages"]) for r in stage["split"].records(split))
        stats[split] = tokenize_and_pack_pairs(items, encoder, seq_len, root / "shards", split)
    stats["split_rows"] = stage["split"]
    return stats


def test_pairs_flow_through_the_plane_with_every_row_accounted_for(encoder, tmp_path):
    rows = timer_pairs(60)
    rows += [
        rows[0],
        {**rows[1], "rejected": rows[1]["chosen"]},
        {"prompt": "Hi?", "chosen": "x" * 3000, "rejected": "No."},
        "not a row",
    ]
    stats = plane(rows, encoder, tmp_path)
    assert stats["kind"] == PREFERENCE
    tokenize_rejects = [err.reason for split in ("train", "eval") for _, err in stats[split].rejected]
    assert (stats["raw"]["quarantine_reasons"], stats["clean"]["quarantine_reasons"], tokenize_rejects) == (
        {"not_an_object": 1}, {"identical_answers": 1}, ["too_long_tokens"])  # fmt: skip
    kept = stats["train"].examples + stats["eval"].examples
    quarantined = stats["raw"]["rows_quarantined"] + stats["clean"]["rows_quarantined"] + len(tokenize_rejects)
    duplicates = stats["dedup"]["exact_duplicates"] + stats["dedup"]["near_duplicates"]
    assert (kept, quarantined, duplicates) == (60, 3, 1)
    assert stats["raw"]["rows_in"] == kept + quarantined + duplicates == 64
    assert shard_files(tmp_path / "shards", pair_split("train")) and not shard_files(
        tmp_path / "shards", "train"
    )  # no packed chat shards


def test_pair_rows_learn_only_the_final_replies_and_keep_sequences_apart(encoder, tmp_path):
    history = [
        turn("user", "Set a timer for 5 minutes."),
        turn("assistant", "Done."),
        turn("user", "Set a timer for 7 minutes."),
    ]
    rows = [
        [*history, turn("chosen", '{"name": "set_timer", "arguments": {"minutes": 7}}'), turn("rejected", "I cannot.")]
    ]
    rows += [parse_line(json.dumps(row).encode()) for row in timer_pairs(3)]
    stats = tokenize_and_pack_pairs(
        ((f"r{i}", m) for i, m in enumerate(rows)), encoder, PAIR_SEQ_LEN, tmp_path, "train"
    )
    assert stats.examples == 4 and not stats.rejected
    pairs = load_pair_rows(tmp_path, "train", PAIR_SEQ_LEN)
    assert pairs.pairs == 4 and (pairs.pair_mask.sum(dim=1) == (pairs.segment_ids.max(dim=1).values + 1) // 2).all()
    tokenizer = encoder.tokenizer
    replies = []
    for row in range(len(pairs)):
        segments = pairs.segment_ids[row]
        for segment in range(2 * int(pairs.pair_mask[row].sum())):
            where = np.flatnonzero((segments == segment).numpy())
            assert (
                pairs.position_ids[row][where].numpy() == np.arange(len(where))
            ).all()  # positions restart per sequence
            learned = pairs.labels[row][where]
            learned = learned[learned != IGNORE_INDEX]
            replies.append(tokenizer.decode(learned))
        assert (pairs.labels[row][segments == -1] == IGNORE_INDEX).all()
    first = replies.index(
        '{"name": "set_timer", "arguments": {"minutes": 7}}<|im_end|>'
    )  # segment 2k: chosen, 2k + 1: rejected
    assert first % 2 == 0 and replies[first + 1] == "I cannot.<|im_end|>" and len(replies) == 8
    assert "Done." not in "".join(replies)  # the history's assistant turn is context, not learned


def test_a_pair_longer_than_a_row_is_quarantined(encoder, tmp_path):
    long = {"prompt": "Hi?", "chosen": "word " * 200, "rejected": "No."}
    stats = tokenize_and_pack_pairs([("r0", parse_line(json.dumps(long).encode()))], encoder, 128, tmp_path, "train")
    assert stats.examples == 0 and [err.reason for _, err in stats.rejected] == ["too_long_tokens"]


def padded_efficiency(lengths: list[tuple[int, int]], pairs_per_batch: int) -> float:
    """Real tokens / slots when each batch of pairs pads every sequence to the batch's longest (TRL's collator)."""
    real = sum(a + b for a, b in lengths)
    slots = sum(2 * max(max(pair) for pair in lengths[i : i + pairs_per_batch]) * len(lengths[i : i + pairs_per_batch])
                for i in range(0, len(lengths), pairs_per_batch))  # fmt: skip
    return real / slots


def sample_pairs(root: Path, count: int) -> list[list[dict]]:
    """Pairs of the shipped sample's conversations (cleaned): each reply preferred over the next conversation's."""
    sample = Path(__file__).resolve().parents[1] / "samples" / "toolcalls" / "part-000.jsonl"
    read_dataset([("part-000.jsonl", sample)], raw := Artifact.folder(root / "raw"))
    clean_dataset(raw, clean := Artifact.folder(root / "clean"), CleaningRules())
    chats = [record["messages"] for _, record in zip(range(count + 1), clean.records("rows"))]
    return [
        chat[:-1] + [turn("chosen", chat[-1]["content"]), turn("rejected", other[-1]["content"])]
        for chat, other in zip(chats, chats[1:])
    ]


def test_packing_pairs_fills_the_rows(encoder, tmp_path):
    """The figures of pair_packing's docstring (pytest -s prints them): 400 pairs of the shipped sample at 1,024 tokens."""
    rows = sample_pairs(tmp_path, 400)
    (tmp_path / "shards").mkdir()
    stats = tokenize_and_pack_pairs(
        ((f"r{i}", m) for i, m in enumerate(rows)), encoder, 1024, tmp_path / "shards", "train"
    )
    lengths = [(len(p.chosen.input_ids), len(p.rejected.input_ids)) for p in encode_pairs(encoder, rows)]
    to_seq_len = sum(a + b for a, b in lengths) / (2 * 1024 * len(lengths))
    batch_of_8 = padded_efficiency(lengths, 8)
    print(f"mean pair {np.mean([a + b for a, b in lengths]):.0f} tokens: packed {stats.packing_efficiency:.3f}, "
          f"padded to the longest of 8 pairs {batch_of_8:.3f}, padded to seq_len {to_seq_len:.3f}")  # fmt: skip
    assert stats.examples == 400 and stats.packing_efficiency > 0.95 > batch_of_8 > to_seq_len


@pytest.mark.integration  # 2 worker processes
def test_pairs_shard_on_worker_processes_with_the_same_bytes(encoder, tiny_model_dir, tmp_path):
    """The data plane's pair tokenizing on 2 worker processes, a part of 16 rows a task and windows of 8 pairs,
    writes the same files as one process that packs every part in one task: a window never cuts a pair apart."""
    import hashlib

    from ft_assets.data.chat_encoding import TokenizerFiles
    from ft_assets.data.pair_packing import PAIRS
    from ft_assets.data.parallel import InProcess, ProcessPool
    from ft_assets.data.tokenizing import tokenize_splits

    rows = timer_pairs(90) + [{"prompt": "Hi?", "chosen": "x" * 3000, "rejected": "No."}]
    stats = plane(rows, encoder, tmp_path / "one", seq_len=PAIR_SEQ_LEN, part_rows=16)
    tokenizer = TokenizerFiles.from_dir(tiny_model_dir)
    with InProcess(1, 1_000_000) as executor:
        expected = tokenize_splits(stats["split_rows"], ("train", "eval"), tokenizer, PAIR_SEQ_LEN, Artifact.folder(tmp_path / "one" / "windowed"),
                                   8, executor, kind=PAIRS)  # fmt: skip
    with ProcessPool(2, 16) as executor:
        packed = tokenize_splits(stats["split_rows"], ("train", "eval"), tokenizer, PAIR_SEQ_LEN, Artifact.folder(tmp_path / "two"), 8,
                                 executor, kind=PAIRS)  # fmt: skip
        assert sum(usage.shards for usage in executor.usage.values()) > 4  # really sharded

    def digests(folder: Path) -> dict[str, str]:
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("pairs-*.parquet"))}

    assert len(digests(tmp_path / "two")) > 2 and digests(tmp_path / "two") == digests(
        tmp_path / "one" / "windowed"
    )  # one a window
    for packed_rows in (
        pq.read_table(path).column("segment_ids").to_pylist()
        for path in sorted((tmp_path / "two").glob("pairs-*.parquet"))
    ):
        for segments in packed_rows:  # every pair whole in its row: its chosen (2k) and its rejected (2k + 1) sequence
            assert {s // 2 for s in segments if s >= 0 and s % 2 == 0} == {
                s // 2 for s in segments if s >= 0 and s % 2 == 1
            }
    for split in ("train", "eval"):
        assert (packed[split].examples, packed[split].tokens, packed[split].rows) == (
            expected[split].examples, expected[split].tokens, expected[split].rows)  # fmt: skip
        assert [(row, err.reason) for row, err in packed[split].rejected] == [
            (row, err.reason) for row, err in expected[split].rejected
        ]
    assert stats["train"].examples + stats["eval"].examples == 90
