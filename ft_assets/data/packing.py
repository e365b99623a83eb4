"""Chat tokenization with assistant-only loss masks, and best-fit-decreasing sequence packing.

Tokenization renders each conversation with the base model's own chat template, tokenizes the text
in batches with the fast (Rust) tokenizer and marks as trainable exactly the characters of every
assistant reply plus the end-of-turn marker the template writes after it (so the model learns to
stop). A reply starts where the rendering of the turns before it plus the generation prompt ends
(exact for ChatML, Llama-3 and similar templates, checked per row); the end-of-turn marker is found
once by rendering a probe conversation.

Packing puts whole examples into fixed-length rows of ``seq_len`` tokens by bin completion (the
longest remaining example, then the subset of the others that fills the row best) over windows of
``window`` examples: memory stays bounded however large the corpus, and on the sample 99.7% of
slots hold real tokens (best-fit decreasing: 97.4%). Each row carries
``position_ids`` that restart at every example and the example lengths (``seq_lens``), so training
builds a block-diagonal causal mask and no example attends to its neighbour. Padding to the longest
example instead of packing wastes most slots on short chat data (see ``make bench``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ft_assets.data.readers import RowError

PACK_WINDOW = 16_384  # examples per packing window: bounds memory; costs at most ~1 partly filled row per window
ROWS_PER_SHARD = 4096  # packed rows per Parquet shard (8 MiB of int32 at seq_len 512)
TOKENIZE_BATCH = 512  # rows per call into the Rust tokenizer


@dataclass(frozen=True)
class Example:
    input_ids: np.ndarray  # int32
    loss_mask: np.ndarray  # int8, 1 = assistant token the model learns to produce


class ChatEncoder:
    """Renders conversations with a tokenizer's chat template and masks the loss to assistant turns."""

    def __init__(self, tokenizer):
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError("tokenized_shards needs a fast (Rust) tokenizer with offset mappings")
        if not tokenizer.chat_template:
            raise ValueError(
                "the base model's tokenizer has no chat template; set one in its tokenizer_config.json"
            )
        self.tokenizer = tokenizer
        self.special = [t for t in tokenizer.all_special_tokens if t]
        self.end_of_turn = self._probe_end_of_turn()

    def _probe_end_of_turn(self) -> str:
        reply = "PROBE-REPLY-7f3a"
        text = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": "probe"}, {"role": "assistant", "content": reply}], tokenize=False
        )
        tail = text[text.index(reply) + len(reply) :]
        return tail.rstrip()

    def render(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and the [start, end) character spans that carry loss."""
        for message in messages:
            for token in self.special:
                if token in message["content"]:
                    raise RowError("special_token_in_content", f"{message['role']} text contains {token!r}")
        text = self.tokenizer.apply_chat_template(messages, tokenize=False)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            # Where reply i starts: the rendering of the turns before it plus the generation prompt.
            prefix = self.tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
            if not text.startswith(prefix) or not text.startswith(message["content"], len(prefix)):
                raise RowError("template_mismatch", f"the chat template does not render reply {i} after its prompt")
            end = len(prefix) + len(message["content"])
            if text.startswith(self.end_of_turn, end):
                end += len(self.end_of_turn)
            spans.append((len(prefix), end))
        return text, spans

    def encode_batch(self, batch: list[list[dict]]) -> list[Example | RowError]:
        rendered: list[tuple[str, list] | RowError] = []
        for messages in batch:
            try:
                rendered.append(self.render(messages))
            except RowError as exc:
                rendered.append(exc)
        texts = [r[0] for r in rendered if not isinstance(r, RowError)]
        encoded = self.tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True) if texts else None
        out: list[Example | RowError] = []
        k = 0
        for item in rendered:
            if isinstance(item, RowError):
                out.append(item)
                continue
            ids = np.asarray(encoded["input_ids"][k], dtype=np.int32)
            offsets = np.asarray(encoded["offset_mapping"][k], dtype=np.int64).reshape(-1, 2)
            k += 1
            mask = np.zeros(len(ids), dtype=np.int8)
            for start, end in item[1]:
                mask[(offsets[:, 1] > start) & (offsets[:, 0] < end)] = 1
            out.append(Example(ids, mask))
        return out


def _best_subset(room: int, counts: dict[int, int]) -> tuple[tuple[int, int], ...]:
    """(length, how many) pairs from ``counts`` whose total is the largest ≤ ``room`` (a bounded
    subset sum over distinct lengths, longest first, stopping at the first exact fill)."""
    reach: dict[int, tuple[tuple[int, int], ...]] = {0: ()}
    for size in sorted(counts, reverse=True):
        if size > room:
            continue
        grown = dict(reach)
        for total, chosen in reach.items():
            for k in range(1, counts[size] + 1):
                filled = total + k * size
                if filled > room:
                    break
                grown.setdefault(filled, chosen + ((size, k),))
        reach = grown
        if room in reach:
            break
    return reach[max(reach)]


def pack_bins(lengths: list[int], capacity: int) -> list[list[int]]:
    """Rows of example indices whose lengths sum to ≤ capacity; deterministic.

    Bin completion: each row takes the longest remaining example, then the subset of the remaining
    ones that fills it best. Plain best-fit decreasing leaves, in most rows, a gap shorter than any
    example left (0.974 of slots used on the sample at 512 tokens); completing rows by subset sum
    closes them (0.997, one row above the lower bound). Cost: ~0.2 ms per example in a 16k window.
    """
    queues: dict[int, deque[int]] = {}
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        if lengths[i] > capacity:
            raise ValueError(f"example {i} has {lengths[i]} tokens, more than the row capacity {capacity}")
        queues.setdefault(lengths[i], deque()).append(i)

    def take(size: int) -> int:
        index = queues[size].popleft()
        if not queues[size]:
            del queues[size]
        return index

    bins = []
    while queues:
        longest = max(queues)
        row = [take(longest)]
        room = capacity - longest
        for size, k in _best_subset(room, {s: len(q) for s, q in queues.items() if s <= room}):
            row.extend(take(size) for _ in range(k))
        bins.append(row)
    return bins


def pack_rows(examples: list[Example], seq_len: int, pad_id: int) -> Iterator[dict]:
    """Packed rows (dicts of numpy arrays) from one window of examples."""
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
        yield {"input_ids": input_ids, "loss_mask": loss_mask, "position_ids": position_ids, "seq_lens": seq_lens}


@dataclass
class PackStats:
    examples: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    rows: int = 0
    slots: int = 0
    files: list[str] = field(default_factory=list)
    rejected: list[tuple[str, RowError]] = field(default_factory=list)  # (row id, error)

    @property
    def packing_efficiency(self) -> float:
        return self.tokens / self.slots if self.slots else 0.0


class ShardWriter:
    """Writes packed rows to ``<prefix>-00000.parquet``, ``-00001``… rotating every ``rows_per_shard``."""

    def __init__(self, out_dir: Path, prefix: str, rows_per_shard: int = ROWS_PER_SHARD):
        import pyarrow as pa

        self.out_dir, self.prefix, self.rows_per_shard = out_dir, prefix, rows_per_shard
        self.schema = pa.schema(
            [
                ("input_ids", pa.list_(pa.int32())),
                ("loss_mask", pa.list_(pa.int8())),
                ("position_ids", pa.list_(pa.int32())),
                ("seq_lens", pa.list_(pa.int32())),
            ]
        )
        self.buffer: list[dict] = []
        self.files: list[str] = []

    def add(self, row: dict) -> None:
        self.buffer.append(row)
        if len(self.buffer) >= self.rows_per_shard:
            self.flush()

    def flush(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        if not self.buffer:
            return
        name = f"{self.prefix}-{len(self.files):05d}.parquet"
        table = pa.table({col: [row[col] for row in self.buffer] for col in self.schema.names}, schema=self.schema)
        pq.write_table(table, self.out_dir / name)
        self.files.append(name)
        self.buffer = []


def tokenize_and_pack(
    rows: Iterable[tuple[str, list[dict]]],
    encoder: ChatEncoder,
    seq_len: int,
    out_dir: Path,
    split: str,
    window: int = PACK_WINDOW,
) -> PackStats:
    """Encode (row id, messages) pairs and write packed shards ``<split>-NNNNN.parquet`` to ``out_dir``."""
    pad_id = encoder.tokenizer.pad_token_id
    if pad_id is None:
        pad_id = encoder.tokenizer.eos_token_id
    writer = ShardWriter(out_dir, split)
    stats = PackStats()
    pending: list[Example] = []

    def drain() -> None:
        for row in pack_rows(pending, seq_len, pad_id):
            writer.add(row)
            stats.rows += 1
            stats.slots += seq_len
        pending.clear()

    batch: list[tuple[str, list[dict]]] = []

    def encode(batch: list[tuple[str, list[dict]]]) -> None:
        for (row_id, _), result in zip(batch, encoder.encode_batch([m for _, m in batch])):
            if isinstance(result, RowError):
                stats.rejected.append((row_id, result))
            elif len(result.input_ids) > seq_len:
                stats.rejected.append(
                    (row_id, RowError("too_long_tokens", f"{len(result.input_ids)} tokens > seq_len {seq_len}"))
                )
            elif not result.loss_mask.any():
                stats.rejected.append((row_id, RowError("no_loss_tokens", "no assistant token survived templating")))
            else:
                pending.append(result)
                stats.examples += 1
                stats.tokens += len(result.input_ids)
                stats.loss_tokens += int(result.loss_mask.sum())
                if len(pending) >= window:
                    drain()

    for item in rows:
        batch.append(item)
        if len(batch) >= TOKENIZE_BATCH:
            encode(batch)
            batch = []
    encode(batch)
    drain()
    writer.flush()
    stats.files = writer.files
    return stats
