"""Preference pairs tokenized and packed: whole pairs back to back in fixed-length rows.

Each side of a pair is rendered like a chat example (``ChatEncoder``: the base model's chat template,
the fast tokenizer): the prompt's turns, then the chosen (or rejected) reply as the assistant's. The
loss mask covers that final reply and its end-of-turn marker only; earlier assistant turns of a
multi-turn prompt are context, as in TRL. A pair is packed as one item, its chosen sequence then its
rejected one, so both sides always land in the same row and the same micro-batch, and rows are
filled by the chat packer's own bin completion (``pack_bins``) over pair lengths. Position ids
restart at every sequence, so no sequence attends to another (the block-diagonal mask of packed
chat rows), and ``segment_ids`` say which pair and side every token belongs to (``ft_assets.shards``
owns the schema: ``pairs-<split>-NNNNN.parquet``).

Packed, not padded: 400 pairs made of the shipped sample's conversations (each reply preferred over
the next conversation's; 296 tokens a pair with the test tokenizer) fill 99.8% of the slots of
1,024-token rows packed, 70.7% padded to the longest sequence of each batch of 8 pairs (TRL's
collator) and 14.5% padded to the row length (``test_packing_pairs_fills_the_rows`` in
``test_preference.py``, ``pytest -s`` prints them). The price is that a pair (both sides) must fit
one row: a longer pair is quarantined (``too_long_tokens``); raise ``tokenized_shards``' ``seq_len``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ft_assets.data.bins import pack_bins
from ft_assets.data.chat_encoding import TOKENIZE_BATCH, ChatEncoder
from ft_assets.data.packing import PackKind
from ft_assets.data.preference import split_pair
from ft_assets.data.rows import RowError
from ft_assets.data.sequences import Example
from ft_assets.data.tokenizing import PACK_WINDOW, PackStats, tokenize_and_pack
from ft_assets.shards import PAIR_SCHEMA, pair_split


@dataclass(frozen=True)
class Pair:
    chosen: Example  # prompt + chosen reply, loss mask on the reply
    rejected: Example

    def __len__(self) -> int:
        return len(self.chosen.input_ids) + len(self.rejected.input_ids)


def final_reply_only(example: Example) -> Example:
    """The example with its loss mask on the last assistant reply only (the last run of masked tokens)."""
    mask = example.loss_mask.copy()
    masked = np.flatnonzero(mask)
    if len(masked):
        unmasked = np.flatnonzero(mask[: masked[-1]] == 0)
        mask[: unmasked[-1] + 1 if len(unmasked) else 0] = 0
    return Example(example.input_ids, mask)


def encode_pairs(encoder: ChatEncoder, batch: list[list[dict]]) -> list[Pair | RowError]:
    """Each pair's row -> its two encoded sequences, or the RowError of the side that failed."""
    conversations = []
    for messages in batch:
        prompt, chosen, rejected = split_pair(messages)
        conversations += [prompt + [{"role": "assistant", "content": reply}] for reply in (chosen, rejected)]
    encoded = encoder.encode_batch(conversations)
    pairs: list[Pair | RowError] = []
    for chosen, rejected in zip(encoded[0::2], encoded[1::2]):
        error = next((side for side in (chosen, rejected) if isinstance(side, RowError)), None)
        pairs.append(error or Pair(final_reply_only(chosen), final_reply_only(rejected)))
    return pairs


def pack_pair_rows(pairs: list[Pair], seq_len: int, pad_id: int) -> Iterator[dict]:
    """Packed rows (dicts of numpy arrays, ``PAIR_SCHEMA`` columns) from one window of pairs."""
    for members in pack_bins([len(pair) for pair in pairs], seq_len):
        input_ids = np.full(seq_len, pad_id, dtype=np.int32)
        loss_mask = np.zeros(seq_len, dtype=np.int8)
        position_ids = np.zeros(seq_len, dtype=np.int32)
        segment_ids = np.full(seq_len, -1, dtype=np.int32)
        offset, seq_lens = 0, []
        for k, i in enumerate(members):
            for side, example in enumerate((pairs[i].chosen, pairs[i].rejected)):
                n = len(example.input_ids)
                input_ids[offset : offset + n] = example.input_ids
                loss_mask[offset : offset + n] = example.loss_mask
                position_ids[offset : offset + n] = np.arange(n, dtype=np.int32)
                segment_ids[offset : offset + n] = 2 * k + side
                offset += n
                seq_lens.append(n)
        position_ids[offset:] = np.arange(seq_len - offset, dtype=np.int32)
        yield {"input_ids": input_ids, "loss_mask": loss_mask, "position_ids": position_ids, "seq_lens": seq_lens,
               "segment_ids": segment_ids}  # fmt: skip


def encode_pair_rows(
    encoder: ChatEncoder, rows: list[tuple[str, list[dict]]], seq_len: int
) -> tuple[list[Example], list]:
    """(kept sequences, rejected rows) of (row id, pair row) rows (``encode_rows``' contract): each kept pair is its chosen
    then its rejected sequence, back to back; a pair with a failed side, longer than a row or with nothing to learn is
    rejected whole."""
    kept: list[Example] = []
    rejected: list[tuple[str, str, str]] = []
    for start in range(0, len(rows), TOKENIZE_BATCH // 2):  # two sequences a pair
        batch = rows[start : start + TOKENIZE_BATCH // 2]
        for (row_id, _), result in zip(batch, encode_pairs(encoder, [messages for _, messages in batch])):
            if isinstance(result, RowError):
                rejected.append((row_id, result.reason, result.detail))
            elif len(result) > seq_len:
                rejected.append(
                    (row_id, "too_long_tokens", f"{len(result)} tokens (both sides of the pair) > seq_len {seq_len}")
                )
            elif not (result.chosen.loss_mask.any() and result.rejected.loss_mask.any()):
                rejected.append((row_id, "no_loss_tokens", "a reply has no token left after templating"))
            else:
                kept += [result.chosen, result.rejected]
    return kept, rejected


def pack_pair_sequences(sequences: list[Example], seq_len: int, pad_id: int) -> Iterator[dict]:
    """The packed rows of one window of pairs' sequences (chosen, rejected, chosen, ...)."""
    return pack_pair_rows(
        [Pair(chosen, rejected) for chosen, rejected in zip(sequences[0::2], sequences[1::2])], seq_len, pad_id
    )


PAIRS = PackKind(encode_pair_rows, pack_pair_sequences, 2, PAIR_SCHEMA, pair_split)


def tokenize_and_pack_pairs(
    rows: Iterable[tuple[str, list[dict]]],
    encoder: ChatEncoder,
    seq_len: int,
    out_dir: Path,
    split: str,
    window: int = PACK_WINDOW,
) -> PackStats:
    """Encode (row id, pair row) items and write ``pairs-<split>-NNNNN.parquet`` (one a window of ``window`` pairs) to
    ``out_dir``, in this process; ``examples`` counts pairs. (The data plane shards them: ``tokenize_splits(..., kind=PAIRS)``.)"""
    return tokenize_and_pack(rows, encoder, seq_len, out_dir, split, window, kind=PAIRS)
