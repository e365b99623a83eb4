"""Chat examples packed: whole examples into fixed-length rows, and the pack kinds' contract (``PackKind``).

Packing puts whole examples into fixed-length rows of ``seq_len`` tokens by bin completion
(``ft_assets.data.bins``: the longest remaining example, then the subset of the others that fills the
row best) over windows of examples: memory stays bounded however large the corpus, and on the sample
99.7% of slots hold real tokens (best-fit decreasing: 97.4%). Each row carries ``position_ids`` that
restart at every example and the example lengths (``seq_lens``), so training builds a block-diagonal
causal mask and no example attends to its neighbour. Padding to the longest example instead of
packing wastes most slots on short chat data (see ``make bench``). ``ft_assets.shards`` owns the
rows' schema and file names.

A ``PackKind`` is what the tokenize pipeline (``ft_assets.data.tokenizing``) runs for one kind of
item: how rows become sequences, how a window of sequences becomes shard rows, and the shards'
schema and names. Each kind lives beside its packer: ``EXAMPLES`` here (chat examples, SFT),
``pair_packing.PAIRS`` (preference pairs, DPO), ``prompt_packing.PROMPTS`` (prompts, GRPO).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from ft_assets.data.bins import pack_bins
from ft_assets.data.chat_encoding import TOKENIZE_BATCH, ChatEncoder
from ft_assets.data.rows import RowError
from ft_assets.data.sequences import Example
from ft_assets.shards import IMAGE_SCHEMA, SCHEMA


@dataclass(frozen=True)
class PackKind:
    """What ``pack_splits`` packs: how rows become sequences, how a window of sequences becomes packed rows, how many
    sequences make one item, and its shards."""

    # (encoder, rows, seq_len) -> (sequences, rejected)
    encode: Callable[[ChatEncoder, list, int], tuple[list[Example], list]]
    pack: Callable[[list[Example], int, int], Iterator[dict]]  # (a window's sequences, seq_len, pad id) -> packed rows
    sequences: int  # sequences an item (an example: 1; a preference pair: 2), never cut apart by a window
    schema: pa.Schema
    file_split: Callable[[str], str]  # split -> the split name in its shard files


def encode_rows(
    encoder: ChatEncoder, rows: list[tuple[str, list[dict]]], seq_len: int
) -> tuple[list[Example], list[tuple[str, str, str]]]:
    """(kept examples, rejected rows as (row id, reason, detail)) of (row id, messages) rows."""
    kept: list[Example] = []
    rejected: list[tuple[str, str, str]] = []
    for start in range(0, len(rows), TOKENIZE_BATCH):
        batch = rows[start : start + TOKENIZE_BATCH]
        for (row_id, _), result in zip(batch, encoder.encode_batch([messages for _, messages in batch])):
            if isinstance(result, RowError):
                rejected.append((row_id, result.reason, result.detail))
            elif len(result.input_ids) > seq_len:
                rejected.append((row_id, "too_long_tokens", f"{len(result.input_ids)} tokens > seq_len {seq_len}"))
            elif not result.loss_mask.any():
                rejected.append((row_id, "no_loss_tokens", "no assistant token survived templating"))
            else:
                kept.append(result)
    return kept, rejected


def pack_rows(examples: list[Example], seq_len: int, pad_id: int, images: bool = False) -> Iterator[dict]:
    """Packed rows (dicts of numpy arrays) from one window of examples; with ``images``, each row's image references
    too (an example keeps them in its ``text``, one a line: ``ft_assets.data.vision_encoding``)."""
    for members in pack_bins([len(e.input_ids) for e in examples], seq_len):
        input_ids = np.full(seq_len, pad_id, dtype=np.int32)
        loss_mask = np.zeros(seq_len, dtype=np.int8)
        position_ids = np.zeros(seq_len, dtype=np.int32)
        offset, seq_lens = 0, []
        for i in members:
            n = len(examples[i].input_ids)
            input_ids[offset : offset + n] = examples[i].input_ids
            loss_mask[offset : offset + n] = examples[i].loss_mask
            position_ids[offset : offset + n] = np.arange(n, dtype=np.int32)
            offset += n
            seq_lens.append(n)
        position_ids[offset:] = np.arange(seq_len - offset, dtype=np.int32)
        row = {"input_ids": input_ids, "loss_mask": loss_mask, "position_ids": position_ids, "seq_lens": seq_lens}
        if images:
            row["images"] = [ref for i in members for ref in examples[i].text.split("\n") if ref]
        yield row


def pack_image_rows(examples: list[Example], seq_len: int, pad_id: int) -> Iterator[dict]:
    return pack_rows(examples, seq_len, pad_id, images=True)


EXAMPLES = PackKind(encode_rows, pack_rows, 1, SCHEMA, str)
IMAGE_EXAMPLES = PackKind(encode_rows, pack_image_rows, 1, IMAGE_SCHEMA, str)  # a vision-language model's examples


def for_vision(kind: PackKind) -> PackKind:
    """The pack kind of ``kind``'s items for a vision-language base (its rows may hold images); ``ValueError`` for a
    kind that trains text models only (preference pairs, prompts)."""
    if kind is EXAMPLES:
        return IMAGE_EXAMPLES
    raise ValueError(
        "a vision-language base model trains on conversations (SFT); preference pairs (DPO) and prompts (GRPO) "
        "train text models: use a text base model for them"
    )
