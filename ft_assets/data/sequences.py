"""Encoded sequences: what the tokenizer makes of an item, and the bytes the encode tasks hand the pack tasks.

An ``Example`` is one tokenized sequence (token ids, loss mask, and for prompts the texts kept beside
them). The encode tasks of ``tokenized_shards`` (``ft_assets.data.tokenizing``) write each part's
sequences to the store as flat arrays (``encoded_bytes``: 5 bytes a token, an int32 id and an int8
mask value, plus 16 bytes a sequence and its text), and a pack task reads any slice of a part back as
numpy views of those bytes (``sequences_of``), with no per-row decoding. The trade-off: the bytes
do not say how many sequences they hold; the reader takes the count from the part's ``Written``
descriptor. It is a scratch format, deleted once the shards are written; the shards' own schema is
``ft_assets.shards``'.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Example:
    input_ids: np.ndarray  # int32
    loss_mask: np.ndarray  # int8, 1 = assistant token the model learns to produce
    text: str = ""  # what a kind keeps beside the tokens (a prompt's source, turns and columns); chat, pairs: none


def encoded_bytes(sequences: list[Example]) -> bytes:
    """Sequences back to back: their lengths (int64), then every token id (int32), then every loss-mask value (int8),
    then the byte length of each one's text (int64) and the texts in UTF-8 (none for chat and pairs: 8 bytes a
    sequence)."""
    lengths = np.array([len(sequence.input_ids) for sequence in sequences], dtype=np.int64)
    ids = np.concatenate([s.input_ids for s in sequences]) if sequences else np.empty(0, np.int32)
    mask = np.concatenate([s.loss_mask for s in sequences]) if sequences else np.empty(0, np.int8)
    texts = [sequence.text.encode() for sequence in sequences]
    text_lengths = np.array([len(text) for text in texts], dtype=np.int64)
    return b"".join(
        [
            lengths.tobytes(),
            ids.astype(np.int32).tobytes(),
            mask.astype(np.int8).tobytes(),
            text_lengths.tobytes(),
            *texts,
        ]
    )


def sequences_of(data, count: int, start: int, stop: int) -> list[Example]:
    """Sequences ``[start, stop)`` of the ``count`` that ``encoded_bytes`` wrote."""
    lengths = np.frombuffer(data, dtype=np.int64, count=count)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    total, at = int(offsets[-1]), 8 * count
    ids = np.frombuffer(data, dtype=np.int32, count=total, offset=at)
    mask = np.frombuffer(data, dtype=np.int8, count=total, offset=at + 4 * total)
    text_lengths = np.frombuffer(data, dtype=np.int64, count=count, offset=at + 5 * total)
    text_offsets = (at + 5 * total + 8 * count + np.concatenate([[0], np.cumsum(text_lengths)])).tolist()
    texts = [str(memoryview(data)[text_offsets[i] : text_offsets[i + 1]], "utf-8") for i in range(start, stop)]
    return [
        Example(ids[offsets[i] : offsets[i + 1]], mask[offsets[i] : offsets[i + 1]], text)
        for i, text in zip(range(start, stop), texts)
    ]
