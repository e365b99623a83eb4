import numpy as np
import pyarrow.parquet as pq
import pytest

from ft_assets.data.bins import pack_bins
from ft_assets.data.chat_encoding import ChatEncoder
from ft_assets.data.packing import pack_rows
from ft_assets.data.rows import RowError, iter_records
from ft_assets.data.sequences import Example, encoded_bytes, sequences_of
from ft_assets.data.tokenizing import tokenize_and_pack
from ft_assets_tests.tiny import build_tokenizer

PACK_CASES = [
    ("exact-fit", [5, 5, 5, 5], 10, [[0, 1], [2, 3]]),
    ("completes-rows", [6, 5, 4, 4], 10, [[0, 2], [1, 3]]),
    ("beats-best-fit-decreasing", [4, 4, 3, 3, 3, 3], 10, [[0, 2, 3], [1, 4, 5]]),  # BFD needs 3 rows
    ("prefers-long-fillers", [6, 4, 3, 3, 2, 2], 10, [[0, 1], [2, 3, 4, 5]]),
    ("decreasing-order", [1, 9, 2, 8], 10, [[1, 0], [3, 2]]),
    ("fills-smallest-gap", [7, 6, 3, 4], 10, [[0, 2], [1, 3]]),
    ("full-rows", [10, 10], 10, [[0], [1]]),
    ("ties-stable", [3, 3, 3], 9, [[0, 1, 2]]),
    ("empty", [], 8, []),
]


@pytest.mark.parametrize("name,lengths,capacity,expected", PACK_CASES, ids=[c[0] for c in PACK_CASES])
def test_pack_bins(name, lengths, capacity, expected):
    assert pack_bins(lengths, capacity) == expected


def test_pack_bins_rejects_oversized():
    with pytest.raises(ValueError, match="more than the row capacity"):
        pack_bins([3, 11], 10)


def test_pack_rows_layout():
    examples = [
        Example(np.array([1, 2, 3], dtype=np.int32), np.array([0, 1, 1], dtype=np.int8)),
        Example(np.array([4, 5], dtype=np.int32), np.array([0, 1], dtype=np.int8)),
    ]
    (row,) = list(pack_rows(examples, seq_len=7, pad_id=0))
    assert row["input_ids"].tolist() == [1, 2, 3, 4, 5, 0, 0]
    assert row["loss_mask"].tolist() == [0, 1, 1, 0, 1, 0, 0]
    assert row["position_ids"].tolist() == [0, 1, 2, 0, 1, 0, 1]
    assert row["seq_lens"] == [3, 2]


SEQUENCE_CASES = [  # (name, sequences as (ids, mask, text), the slice [start, stop) read back)
    ("chat examples, whole part", [([1, 2, 3], [0, 1, 1], ""), ([7], [1], "")], 0, 2),
    ("a slice inside the part", [([1], [0], ""), ([2, 3], [1, 1], ""), ([4, 5, 6], [0, 0, 1], "")], 1, 2),
    ("prompts keep their texts", [([9, 8], [0, 0], '["r0", [], {}]'), ([5], [0], "café ☕ \u0000")], 0, 2),
    ("a text after an empty one", [([1], [0], ""), ([2], [0], "ü")], 1, 2),
    ("nothing", [], 0, 0),
]


@pytest.mark.parametrize("name,sequences,start,stop", SEQUENCE_CASES, ids=[c[0] for c in SEQUENCE_CASES])
def test_encoded_sequences_read_back_as_written(name, sequences, start, stop):
    examples = [Example(np.array(i, np.int32), np.array(m, np.int8), t) for i, m, t in sequences]
    data = encoded_bytes(examples)
    tokens = sum(len(ids) for ids, _, _ in sequences)
    assert len(data) == 5 * tokens + 16 * len(sequences) + sum(len(t.encode()) for _, _, t in sequences)
    read = sequences_of(data, len(examples), start, stop)
    assert [(e.input_ids.tolist(), e.loss_mask.tolist(), e.text) for e in read] == [
        (ids, mask, text) for ids, mask, text in sequences[start:stop]
    ]
    assert all(e.input_ids.dtype == np.int32 and e.loss_mask.dtype == np.int8 for e in read)


@pytest.fixture(scope="module")
def encoder():
    return ChatEncoder(build_tokenizer())


def conv(user, answer, system=None):
    return ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": user},
        {"role": "assistant", "content": answer},
    ]


MASK_CASES = [
    ("single-turn", conv("Set a timer for 12 minutes.", '{"name": "set_timer"}'), ['{"name": "set_timer"}<|im_end|>']),
    ("with-system", conv("hi", "hello", system="Reply with one JSON tool call."), ["hello<|im_end|>"]),
    ("answer-repeats-user-text", conv("hello", "hello"), ["hello<|im_end|>"]),
    (
        "multi-turn",
        conv("a", "b") + [{"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}],
        ["b<|im_end|>", "d<|im_end|>"],
    ),
]


@pytest.mark.parametrize("name,messages,trained", MASK_CASES, ids=[c[0] for c in MASK_CASES])
def test_loss_mask_covers_exactly_the_assistant_replies(encoder, name, messages, trained):
    (example,) = encoder.encode_batch([messages])
    ids, mask = example.input_ids.tolist(), example.loss_mask.tolist()
    spans, current = [], []
    for token, flag in zip(ids, mask):
        if flag:
            current.append(token)
        elif current:
            spans.append(current)
            current = []
    if current:
        spans.append(current)
    assert [encoder.tokenizer.decode(s) for s in spans] == trained
    full = encoder.tokenizer.apply_chat_template(messages, tokenize=False)
    assert encoder.tokenizer.decode(ids) == full


def test_special_tokens_in_content_are_rejected(encoder):
    (result,) = encoder.encode_batch([conv("ignore <|im_end|> this", "ok")])
    assert isinstance(result, RowError) and result.reason == "special_token_in_content"


def test_tokenize_and_pack_efficiency_and_rejections(encoder, tmp_path):
    rows = [(f"f:{i}", conv(f"Convert {i} km to m." * (1 + i % 3), f"{i * 1000} m")) for i in range(300)]
    rows.append(("f:long", conv("x " * 400, "y")))
    stats = tokenize_and_pack(iter(rows), encoder, seq_len=256, out_dir=tmp_path, split="train", window=128)
    assert stats.examples == 300
    assert [(source, err.reason) for source, err in stats.rejected] == [("f:long", "too_long_tokens")]
    windows = 3  # 301 rows in windows of 128: each window may leave one partly filled row
    assert stats.rows <= -(-stats.tokens // 256) + windows
    assert stats.packing_efficiency >= 0.95
    assert stats.files == [f"train-{i:05d}.parquet" for i in range(windows)]  # a shard a window
    quarantined = pq.read_table(tmp_path / "quarantine-train-00000.parquet").to_pylist()  # written by the encode task
    assert [(q["source"], q["stage"], q["reason"]) for q in quarantined] == [("f:long", "tokenize", "too_long_tokens")]
    packed = [r for f in stats.files for r in iter_records(tmp_path / f)]
    assert len(packed) == stats.rows
    assert sum(len(r["seq_lens"]) for r in packed) == 300
    assert sum(sum(r["seq_lens"]) for r in packed) == stats.tokens
    for r in packed:
        assert len(r["input_ids"]) == len(r["loss_mask"]) == len(r["position_ids"]) == 256
        starts = np.cumsum([0] + r["seq_lens"][:-1])
        assert all(r["position_ids"][s] == 0 for s in starts)


def test_one_window_packs_into_the_fewest_rows_possible(encoder, tmp_path):
    rows = [(f"f:{i}", conv(f"Convert {i} km to m." * (1 + i % 3), f"{i * 1000} m")) for i in range(300)]
    stats = tokenize_and_pack(iter(rows), encoder, seq_len=256, out_dir=tmp_path, split="train")
    assert stats.rows == -(-stats.tokens // 256)  # the lower bound: ceil(tokens / seq_len)
