"""Prompts tokenized for GRPO: each one rendered up to the model's turn, one shard row a prompt, with its texts.

A prompt is rendered like a chat example (``ChatEncoder``: the base model's chat template, the fast
tokenizer), its turns then the generation prompt, and tokenized; nothing carries loss, since the
model learns from the replies it generates in training. Prompts are not packed: generation needs
each one on its own, so a shard row (``prompts-<split>-NNNNN.parquet``, schema in ``ft_assets.shards``)
is one prompt, its token ids beside its source, its turns and its other columns as JSON (what the
reward functions read). The shared pipeline (``pack_splits``) still runs it: the encode task keeps
each prompt's texts beside its tokens (``Example.text``, written with the encoded sequences under the
artifact) and the "pack" task writes one row per prompt of its window, in row order, so the shards are
the same whatever the executor (one shard a window of 16,384 prompts).

A prompt longer than ``seq_len`` tokens is quarantined (``too_long_tokens``): ``seq_len`` bounds the
prompt, and training bounds prompt + reply by ``max_seq_len``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from ft_assets.data.chat_encoding import TOKENIZE_BATCH, ChatEncoder
from ft_assets.data.packing import PackKind
from ft_assets.data.prompts import split_prompt
from ft_assets.data.rows import RowError
from ft_assets.data.sequences import Example
from ft_assets.data.tokenizing import PACK_WINDOW, PackStats, tokenize_and_pack
from ft_assets.shards import PROMPT_SCHEMA, prompt_split


def encode_prompt_rows(
    encoder: ChatEncoder, rows: list[tuple[str, list[dict]]], seq_len: int
) -> tuple[list[Example], list]:
    """(kept prompts, rejected rows) of (row id, prompt row) rows (``encode_rows``' contract): each kept prompt's tokens,
    and its source, turns and columns as one JSON text."""
    kept: list[Example] = []
    rejected: list[tuple[str, str, str]] = []
    for start in range(0, len(rows), TOKENIZE_BATCH):
        batch = [(row_id, *split_prompt(messages)) for row_id, messages in rows[start : start + TOKENIZE_BATCH]]
        for (row_id, turns, columns), result in zip(batch, encoder.encode_prompts([turns for _, turns, _ in batch])):
            if isinstance(result, RowError):
                rejected.append((row_id, result.reason, result.detail))
            elif len(result) > seq_len:
                rejected.append((row_id, "too_long_tokens", f"{len(result)} prompt tokens > seq_len {seq_len}"))
            else:
                kept.append(
                    Example(
                        result,
                        np.zeros(len(result), dtype=np.int8),
                        json.dumps([row_id, turns, columns], ensure_ascii=False),
                    )
                )
    return kept, rejected


def prompt_rows(prompts: list[Example], seq_len: int, pad_id: int) -> Iterator[dict]:
    """One shard row per prompt of a window, in order (``PROMPT_SCHEMA`` columns): nothing is packed or padded."""
    for prompt in prompts:
        source, turns, columns = json.loads(prompt.text)
        yield {"input_ids": prompt.input_ids, "source": source, "messages": json.dumps(turns, ensure_ascii=False),
               "columns": json.dumps(columns, ensure_ascii=False, sort_keys=True)}  # fmt: skip


PROMPTS = PackKind(encode_prompt_rows, prompt_rows, 1, PROMPT_SCHEMA, prompt_split)


def tokenize_prompts(
    rows: Iterable[tuple[str, list[dict]]],
    encoder: ChatEncoder,
    seq_len: int,
    out_dir: Path,
    split: str,
    window: int = PACK_WINDOW,
) -> PackStats:
    """Encode (row id, prompt row) items and write ``prompts-<split>-NNNNN.parquet`` (one a window of ``window`` prompts)
    to ``out_dir``, in this process (the data plane shards them: ``tokenize_splits(..., kind=PROMPTS)``)."""
    return tokenize_and_pack(rows, encoder, seq_len, out_dir, split, window, kind=PROMPTS)
