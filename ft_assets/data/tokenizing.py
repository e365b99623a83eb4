"""The tokenize pipeline of ``tokenized_shards``: a version's split rows encoded and packed into shards on the executor.

Two kinds of task, pipelined on the data executor (``ft_assets.data.parallel``): an encode task per
run of parts of a split (``encode_run``) renders and tokenizes its rows with the pack kind's encoder
and writes the part's sequences to the store (``ft_assets.data.sequences``: 5 bytes a token) and the
rows it refused as quarantine parts; a pack task per window of ``PACK_WINDOW`` items (``pack_window``)
reads its slices of those sequences, packs them with the kind's packer and writes one shard
(``ft_assets.shards``). The driver only cuts windows, in row order, from the parts' sequence counts
(``_Windows``), so the shards are the same whatever the executor and its shard size. Each task gets
its share of the stage's settings once, named (``EncodeSettings``, ``PackSettings``). The window
bounds memory (a window's sequences, ~2,000 rows of 1,024 tokens on the benchmark corpus) and costs
at most ~1 partly filled row per window.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from ft_assets.data.chat_encoding import ChatEncoder, TokenizerFiles
from ft_assets.data.images import ImagePool
from ft_assets.data.packing import EXAMPLES, PackKind
from ft_assets.data.parallel import DEFAULT_SHARD_ROWS, Executor, InProcess, store_at
from ft_assets.data.parts import Artifact, Part, Target, Written, part_bytes, part_name, read_part, runs, table_bytes
from ft_assets.data.rows import QUARANTINE_SCHEMA, RowError, plain
from ft_assets.data.sequences import encoded_bytes, sequences_of
from ft_assets.shards import packed_table, shard_name
from ft_assets.storage import join_key

PACK_WINDOW = 16_384  # examples per packing window: bounds memory; costs at most ~1 partly filled row per window
ENCODED = "_encoded"  # where, under the artifact's prefix, the encoded sequences wait for their windows (deleted after)


@dataclass
class PackStats:
    examples: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    rows: int = 0
    slots: int = 0
    images: int = 0  # image references the examples hold (a vision-language model's)
    image_tokens: int = 0  # the tokens that stand for them
    image_refs: set[str] = field(default_factory=set)  # the stored images they name (``<sha256>.<format>``)
    pad_id: int | None = None  # the token the rows are padded with (the tokenizer's pad, else its end of sequence)
    files: list[str] = field(default_factory=list)
    rejected: list[tuple[str, RowError]] = field(default_factory=list)  # (row id, error)

    @property
    def packing_efficiency(self) -> float:
        return self.tokens / self.slots if self.slots else 0.0


@dataclass(frozen=True)
class EncodeSettings:
    """What every encode task of one ``pack_splits`` shares (``encode_run``'s first argument, sent to each worker)."""

    tokenizer: ChatEncoder | TokenizerFiles  # a ChatEncoder in this process; the files a worker builds its own from
    seq_len: int  # tokens a shard row holds: a longer item is refused (too_long_tokens)
    kind: PackKind  # how the rows become sequences (``PackKind.encode``)
    encoded: Target  # where the parts' encoded sequences go (``ENCODED`` under the output's prefix)
    out: Target  # the output artifact, where the rows the tokenizer refused go (``quarantine-<split>-NNNNN``)
    images: ImagePool | None = None  # where the rows' images are read (a vision-language model's data)


@dataclass(frozen=True)
class PackSettings:
    """What every pack task of one ``pack_splits`` shares (``pack_window``'s first argument, sent to each worker)."""

    kind: PackKind  # how a window's sequences become shard rows (``PackKind.pack``), their schema and file names
    seq_len: int  # tokens a shard row holds
    out: Target  # the output artifact, where the shards go


@dataclass(frozen=True)
class EncodedPart:
    """One part of a split, encoded: its sequences written (``ENCODED/<split>-NNNNN``) and its figures."""

    split: str
    written: Written  # rows: the sequences it holds
    tokens: int
    loss_tokens: int
    rejected: list[tuple[str, str, str]]  # (row id, reason, detail)
    pad_id: int
    quarantine: Written | None  # the rejected rows, as the artifact's part ``quarantine-<split>-NNNNN``; None: none
    images: int = 0  # image references of the kept sequences
    image_tokens: int = 0
    image_refs: tuple[str, ...] = ()  # the stored images they name, each once


def encode_run(settings: EncodeSettings, item: tuple[str, list]) -> list[EncodedPart]:
    """Tokenize a run of parts of one split, each (a ``Part``, or (row id, messages) rows; its number) into its encoded
    sequences, written for the packing tasks, and the rows it rejected, written as the output's quarantine part
    (a data-plane task)."""
    tokenizer = settings.tokenizer
    encoder = tokenizer if isinstance(tokenizer, ChatEncoder) else tokenizer.encoder(settings.images)
    if settings.images is not None:
        encoder.images = settings.images
    pad_id = (
        encoder.tokenizer.pad_token_id if encoder.tokenizer.pad_token_id is not None else encoder.tokenizer.eos_token_id
    )
    split, run = item
    done = []
    for rows, index in run:
        if isinstance(rows, Part):
            table = read_part(rows, ["source", "messages"])
            rows = list(zip(table.column("source").to_pylist(), map(plain, table.column("messages").to_pylist())))
        kept, rejected = settings.kind.encode(encoder, rows, settings.seq_len)
        written = settings.encoded.put(part_name(split, index), encoded_bytes(kept), len(kept))
        tokens, loss_tokens = sum(len(e.input_ids) for e in kept), sum(int(e.loss_mask.sum()) for e in kept)
        quarantine = quarantine_part(settings.out, split, index, rejected)
        images = image_tokens = 0
        refs: tuple[str, ...] = ()
        if encoder.image_token_id is not None:
            images = sum(len(e.text.split("\n")) for e in kept if e.text)
            image_tokens = sum(int((e.input_ids == encoder.image_token_id).sum()) for e in kept)
            refs = tuple(sorted({ref for e in kept if e.text for ref in e.text.split("\n")}))
        done.append(
            EncodedPart(split, written, tokens, loss_tokens, rejected, pad_id, quarantine, images, image_tokens, refs)
        )
    return done


def quarantine_part(out: Target, split: str, index: int, rejected: list[tuple[str, str, str]]) -> Written | None:
    """The rows the tokenizer refused in part ``index`` of ``split``, as the part ``quarantine-<split>-NNNNN``."""
    if not rejected:
        return None
    rows = [
        {"source": row_id, "stage": "tokenize", "reason": reason, "detail": detail, "raw": ""}
        for row_id, reason, detail in rejected
    ]
    return out.put_table(
        part_name(f"quarantine-{split}", index), pa.Table.from_pylist(rows, schema=QUARANTINE_SCHEMA), QUARANTINE_SCHEMA
    )


@dataclass(frozen=True)
class Window:
    """``PACK_WINDOW`` items of a split (fewer at its end), cut in row order from its encoded parts (``slices``:
    (part, first sequence, sequence after the last)), packed by one task into shard ``index``."""

    split: str
    index: int
    slices: list[tuple[Part, int, int]]
    pad_id: int


def pack_window(settings: PackSettings, window: Window) -> tuple[str, Written]:
    """Pack one window's sequences and write them as the shard ``<split>-<index>.parquet`` (a data-plane task)."""
    kind = settings.kind
    sequences = [
        sequence
        for part, start, stop in window.slices
        for sequence in sequences_of(part_bytes(part), part.rows, start, stop)
    ]
    rows = list(kind.pack(sequences, settings.seq_len, window.pad_id))
    table = packed_table(rows, kind.schema)
    return window.split, settings.out.put(
        shard_name(kind.file_split(window.split), window.index), table_bytes(table, kind.schema), len(rows)
    )


class _Windows:
    """Cuts the encoded parts of each split, as they come back in row order, into windows of ``size`` sequences (a
    whole number of items: a window never cuts a pair apart), and adds up each split's figures."""

    def __init__(self, encoded: Artifact, executor: Executor, size: int, stats: dict[str, PackStats], sequences: int):
        self.encoded, self.executor, self.size, self.stats, self.sequences = encoded, executor, size, stats, sequences
        self.pending: list[tuple[Part, int]] = []  # (encoded part, its first sequence not in a window yet)
        self.quarantined: list[Written] = []  # the output's quarantine parts the encode tasks wrote
        self.split, self.count, self.pad_id = None, 0, 0

    def cut(self, parts: Iterable[list[EncodedPart]]) -> Iterator[Window]:
        for run in parts:
            for part in run:
                if part.split != self.split:
                    yield from self.flush(final=True)
                    self.split, self.count = part.split, 0
                self.add(part)
                yield from self.flush(final=False)
        yield from self.flush(final=True)

    def add(self, part: EncodedPart) -> None:
        self.encoded.add(part.written)
        counted = self.stats[part.split]
        counted.pad_id = self.pad_id = part.pad_id
        counted.examples += part.written.rows // self.sequences
        counted.tokens += part.tokens
        counted.loss_tokens += part.loss_tokens
        counted.images += part.images
        counted.image_tokens += part.image_tokens
        counted.image_refs.update(part.image_refs)
        counted.rejected += [(row_id, RowError(reason, detail)) for row_id, reason, detail in part.rejected]
        if part.quarantine is not None:
            self.quarantined.append(part.quarantine)
        if part.written.rows:
            self.pending.append((self.encoded.part(part.written.name, self.executor), 0))

    def flush(self, final: bool) -> Iterator[Window]:
        while self.pending and (final or sum(part.rows - at for part, at in self.pending) >= self.size):
            slices, room = [], self.size
            while self.pending and room:
                part, at = self.pending[0]
                take = min(room, part.rows - at)
                slices.append((part, at, at + take))
                room -= take
                if at + take == part.rows:
                    self.pending.pop(0)
                else:
                    self.pending[0] = (part, at + take)
            yield Window(self.split, self.count, slices, self.pad_id)
            self.count += 1


def pack_splits(
    tasks: Iterable[tuple[str, list]],
    splits: tuple[str, ...],
    encoder: ChatEncoder | TokenizerFiles,
    seq_len: int,
    out: Artifact,
    window: int = PACK_WINDOW,
    executor: Executor | None = None,
    kind: PackKind = EXAMPLES,
    images: ImagePool | None = None,
) -> dict[str, PackStats]:
    """Encode ``tasks`` ((split, [(part or rows, number)]), in row order) and write packed shards ``<split>-NNNNN.parquet``,
    one a window, to ``out``.

    Two kinds of task on ``executor`` (default: this process), pipelined: ``encode_run`` per task, whose workers write
    their parts' encoded sequences under ``out``'s prefix (``ENCODED``) and the rows the tokenizer refused (``out``'s parts
    ``quarantine-<split>-NNNNN``), and ``pack_window`` per ``window`` items of a
    split, cut from the encoded parts in row order as one process would cut them, whose workers read those
    sequences and write the shard. The driver only cuts windows from the parts' sequence counts. So the packed rows
    and shard files are the same whatever the executor and the tasks. ``kind``: ``EXAMPLES`` (chat examples),
    ``pair_packing.PAIRS`` (``pairs-<split>-NNNNN.parquet``) or ``prompt_packing.PROMPTS`` (``prompts-…``, one
    row a prompt, with its texts). The encoded sequences are deleted at the end.
    """
    executor = executor or InProcess()
    stats = {split: PackStats() for split in splits}
    encoded = Artifact(out.url, join_key(out.prefix, ENCODED))
    windows = _Windows(encoded, executor, window * kind.sequences, stats, kind.sequences)
    parts = executor.map(
        encode_run,
        tasks,
        EncodeSettings(encoder, seq_len, kind, encoded.target(executor), out.target(executor), images),
    )
    for split, written in executor.map(
        pack_window, windows.cut(parts), PackSettings(kind, seq_len, out.target(executor))
    ):
        out.add(written)
        stats[split].rows += written.rows
        stats[split].slots += written.rows * seq_len
        stats[split].files.append(written.name)
    out.add(*windows.quarantined)
    store = store_at(encoded.url)
    for name in encoded.files:
        store.delete(join_key(encoded.prefix, name))
    return stats


def tokenize_and_pack(
    rows: Iterable[tuple[str, list[dict]]],
    encoder: ChatEncoder,
    seq_len: int,
    out_dir: Path,
    split: str,
    window: int = PACK_WINDOW,
    kind: PackKind = EXAMPLES,
) -> PackStats:
    """Encode (row id, messages) items and write packed shards ``<split>-NNNNN.parquet`` (one a window of ``window``
    items) to the folder ``out_dir``, in this process."""
    rows = iter(rows)
    batches = iter(lambda: list(itertools.islice(rows, DEFAULT_SHARD_ROWS)), [])
    tasks = ((split, [(batch, index)]) for index, batch in enumerate(batches))
    return pack_splits(tasks, (split,), encoder, seq_len, Artifact.folder(out_dir), window, kind=kind)[split]


def tokenize_splits(
    split: Artifact,
    splits: tuple[str, ...],
    encoder: TokenizerFiles,
    seq_len: int,
    out: Artifact,
    window: int = PACK_WINDOW,
    executor: Executor | None = None,
    kind: PackKind = EXAMPLES,
    images: ImagePool | None = None,
) -> dict[str, PackStats]:
    """``pack_splits`` of the parts of each split of ``split``, a run of parts of at most ``executor.shard_rows`` rows
    a task."""
    executor = executor or InProcess()
    tasks = [
        (name, [(part, part.index) for part in run])
        for name in splits
        for run in runs(split.parts(name, executor), lambda part: part.rows, executor.shard_rows)
    ]
    return pack_splits(tasks, splits, encoder, seq_len, out, window, executor=executor, kind=kind, images=images)
