"""Prompts tokenized for GRPO: each one rendered up to the model's turn, one shard row a prompt, with its texts.

A prompt is rendered like a chat example (``ChatEncoder``: the base model's chat template, the fast
tokenizer), its turns then the generation prompt, and tokenized; nothing carries loss, since the
model learns from the replies it generates in training. Prompts are not packed: generation needs
each one on its own, so a shard row (``prompts-<split>-NNNNN.parquet``, schema in ``ft_assets.shards``)
is one prompt, its token ids beside its source, its turns and its other columns as JSON (what the
reward functions read). The shared pipeline (``pack_splits``) still runs it: the encode task keeps
each prompt's texts beside its tokens (``EncodedShard.texts``) and the "pack" task writes one row
per prompt, in row order, so the shards are the same whatever the executor.

A prompt longer than ``seq_len`` tokens is quarantined (``too_long_tokens``): ``seq_len`` bounds the
prompt, and training bounds prompt + reply by ``max_seq_len``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from ft_assets.data.packing import (
    PACK_WINDOW,
    TOKENIZE_BATCH,
    ChatEncoder,
    EncodedShard,
    Example,
    PackKind,
    PackStats,
    Window,
    encoded_shard,
    shard_input,
    tokenize_and_pack,
)
from ft_assets.data.prompts import split_prompt
from ft_assets.data.rows import RowError
from ft_assets.shards import PROMPT_SCHEMA, ROWS_PER_SHARD, prompt_split


def encode_prompt_shard(settings: tuple, item: tuple) -> EncodedShard:
    """Tokenize one shard of prompts (``encode_shard``'s contract): each kept prompt's tokens, and its source,
    turns and columns as one JSON text. A data-plane task."""
    encoder, seq_len, split, rows, pad_id = shard_input(settings, item)
    kept: list[Example] = []
    texts: list[str] = []
    rejected: list[tuple[str, str, str]] = []
    for start in range(0, len(rows), TOKENIZE_BATCH):
        batch = [(row_id, *split_prompt(messages)) for row_id, messages in rows[start : start + TOKENIZE_BATCH]]
        for (row_id, turns, columns), result in zip(batch, encoder.encode_prompts([turns for _, turns, _ in batch])):
            if isinstance(result, RowError):
                rejected.append((row_id, result.reason, result.detail))
            elif len(result) > seq_len:
                rejected.append((row_id, "too_long_tokens", f"{len(result)} prompt tokens > seq_len {seq_len}"))
            else:
                kept.append(Example(result, np.zeros(len(result), dtype=np.int8)))
                texts.append(json.dumps([row_id, turns, columns], ensure_ascii=False))
    return encoded_shard(split, kept, rejected, pad_id, tuple(texts))


def pack_prompt_window(seq_len: int, window: Window) -> tuple[str, list[dict]]:
    """One shard row per prompt of the window, in order (``PROMPT_SCHEMA`` columns): a data-plane task."""
    rows = []
    for example, text in zip(window.examples(), window.texts, strict=True):
        source, turns, columns = json.loads(text)
        rows.append({"input_ids": example.input_ids, "source": source, "messages": json.dumps(turns, ensure_ascii=False),
                     "columns": json.dumps(columns, ensure_ascii=False, sort_keys=True)})  # fmt: skip
    return window.split, rows


PROMPTS = PackKind(encode_prompt_shard, pack_prompt_window, 1, PROMPT_SCHEMA, prompt_split)


def tokenize_prompts(
    rows: Iterable[tuple[str, list[dict]]],
    encoder: ChatEncoder,
    seq_len: int,
    out_dir: Path,
    split: str,
    window: int = PACK_WINDOW,
    rows_per_shard: int = ROWS_PER_SHARD,
) -> PackStats:
    """Encode (row id, prompt row) items and write ``prompts-<split>-NNNNN.parquet`` to ``out_dir``, in this process
    (the data plane shards them: ``tokenize_splits(..., kind=PROMPTS)``)."""
    return tokenize_and_pack(rows, encoder, seq_len, out_dir, split, window, rows_per_shard, kind=PROMPTS)
