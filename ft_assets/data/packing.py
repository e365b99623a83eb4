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
example instead of packing wastes most slots on short chat data (see ``make bench``). Each window's
rows go to one Parquet shard (``ft_assets.shards`` owns their schema and file names), written by the
worker that packed them. The encoding workers leave each part's sequences in the store (~5 bytes a
token) for the packing workers to read: the driver only cuts windows, in row order, from counts.

Throughput: the Rust tokenizer is the floor, so everything around it is kept small. Chat templates
that insert contents verbatim (ChatML and most others) are rendered once per conversation shape and
filled in per row (``ChatEncoder``); texts go to the backend tokenizer in batches without the Python
wrapper; rows are completed by a bitset subset sum (``ft_assets.data.bins``) and shards are written from
flat arrays. On the 200k-row benchmark corpus (SmolLM2 tokenizer, 1,024-token rows) tokenizing and
packing takes 133 s of CPU instead of 232 s, of which ~100 s is the tokenizer itself; output unchanged.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import re
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from ft_assets.data.bins import pack_bins
from ft_assets.data.parallel import DEFAULT_SHARD_ROWS, Executor, InProcess, store_at
from ft_assets.data.parts import Artifact, Part, Target, Written, part_bytes, part_name, read_part, runs, table_bytes
from ft_assets.data.rows import QUARANTINE_SCHEMA, RowError
from ft_assets.shards import SCHEMA, packed_table, shard_name
from ft_assets.storage import join_key

PACK_WINDOW = 16_384  # examples per packing window: bounds memory; costs at most ~1 partly filled row per window
TOKENIZE_BATCH = 512  # rows per call into the Rust tokenizer
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack")  # never shipped with a tokenizer


@dataclass(frozen=True)
class Example:
    input_ids: np.ndarray  # int32
    loss_mask: np.ndarray  # int8, 1 = assistant token the model learns to produce
    text: str = ""  # what a kind keeps beside the tokens (a prompt's source, turns and columns); chat, pairs: none


_PLACEHOLDER = re.compile("\ue000(\\d+)\ue001")  # private-use marks: content i is rendered as \ue000i\ue001
_CAPTURING = ("FilterBlock", "AssignBlock", "Macro", "CallBlock")  # blocks whose output a template can rework
# Contents that a template which trims, escapes, quotes or tests its input renders differently.
_PROBE_CONTENTS = ("  Quoted \"text\" with \\ and\n{{ braces }} <b>&amp;</b> {% raw %}  ", "x", "\n")


def template_inserts_content_verbatim(template: str) -> bool:
    """Whether a chat template only ever writes a message's content as is, into its output.

    True when every read of ``content`` (``message['content']`` or ``message.content``) sits in an
    output expression, possibly inside ``+``/``~`` concatenations, outside any block that captures or
    filters output, and the template does not read the clock. Such a template renders a conversation
    as fixed text around the contents, so the text can be filled in per row instead of rendered.
    ChatML (SmolLM2, Qwen2.5) qualifies; Llama 3 (``| trim``, the date) does not.
    """
    from jinja2 import nodes  # here, not at the top: only tokenization reads chat templates (~0.15 s to import)
    from jinja2.exceptions import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if "strftime_now" in template:
        return False
    try:
        tree = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except TemplateSyntaxError:
        return False
    parents: dict[int, nodes.Node] = {}
    stack = [tree]
    while stack:
        node = stack.pop()
        for child in node.iter_child_nodes():
            parents[id(child)] = node
            stack.append(child)
    for node in tree.find_all((nodes.Getattr, nodes.Getitem, nodes.Const)):
        if isinstance(node, nodes.Const):
            parent = parents.get(id(node))
            if node.value == "content" and not (isinstance(parent, nodes.Getitem) and parent.arg is node):
                return False  # e.g. message.get('content')
            continue
        if getattr(node, "attr", None) != "content" and not (
            isinstance(getattr(node, "arg", None), nodes.Const) and node.arg.value == "content"
        ):
            continue
        parent = parents.get(id(node))
        while isinstance(parent, (nodes.Add, nodes.Concat)):
            parent = parents.get(id(parent))
        if not isinstance(parent, nodes.Output):
            return False
        while parent is not None:
            if type(parent).__name__ in _CAPTURING:
                return False
            parent = parents.get(id(parent))
    return True


@dataclass(frozen=True)
class _Layout:
    """A rendered conversation shape: ``pieces[0] + content[slots[0]] + pieces[1] + …``."""

    pieces: tuple[str, ...]
    slots: tuple[int, ...]

    def fill(self, contents: list[str]) -> str:
        parts = [self.pieces[0]]
        for slot, piece in zip(self.slots, self.pieces[1:]):
            parts.append(contents[slot])
            parts.append(piece)
        return "".join(parts)


class ChatEncoder:
    """Renders conversations with a tokenizer's chat template and masks the loss to assistant turns.

    Rendering is exact either way. A template that inserts contents verbatim
    (``template_inserts_content_verbatim``) is rendered through jinja once per conversation shape
    (the roles, and whether the generation prompt follows) with placeholders, checked against jinja
    on probe contents, and then filled in per row: 1 µs instead of ~300 µs a render through
    ``apply_chat_template``, of which a row needs one plus one per reply. Other templates go
    through ``apply_chat_template`` every time.
    """

    def __init__(self, tokenizer):
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError("tokenized_shards needs a fast (Rust) tokenizer with offset mappings")
        if not tokenizer.chat_template:
            raise ValueError(
                "the base model's tokenizer has no chat template (a pretrained, non-instruct base?): set base_model's "
                "chat_template to a named template (chatml, llama3, gemma, mistral, phi3) or the path of a Jinja file"
            )
        self.tokenizer = tokenizer
        # bos/eos/pad/… and every added token marked special (Llama 3's header tokens, Phi-3's role tokens): text
        # holding one would be encoded as that token, forging a turn
        added = [str(t) for t in tokenizer.added_tokens_decoder.values() if t.special]
        self.special = sorted({t for t in [*tokenizer.all_special_tokens, *added] if t})
        self._special_starts = {t[0] for t in self.special}  # a text holding none of these holds no special token
        self._verbatim = template_inserts_content_verbatim(tokenizer.chat_template)
        self._layouts: dict[tuple[tuple[str, ...], bool], _Layout | None] = {}
        self.end_of_turn = self._probe_end_of_turn()

    def _probe_end_of_turn(self) -> str:
        """What the template writes after every reply: the text that follows both a last reply and one followed
        by another turn, cut before any special token it would split, stripped. (Phi-3 ends a conversation
        with ``<|end|>\n`` + eos, a middle reply with ``<|end|>\n<|user|>``: the marker is ``<|end|>``.)"""
        reply, user = "PROBE-REPLY-7f3a", {"role": "user", "content": "probe"}
        last = self._apply([user, {"role": "assistant", "content": reply}], False)
        followed = self._apply([user, {"role": "assistant", "content": reply}, {"role": "user", "content": "PROBE-NEXT"}], False)
        tails = [text[text.index(reply) + len(reply) :] for text in (last, followed)]
        common = os.path.commonprefix(tails)
        for tail, token in itertools.product(tails, self.special):
            start = tail.find(token) if token else -1
            while 0 <= start < len(common):
                if start + len(token) > len(common):
                    common = common[:start]
                start = tail.find(token, start + 1)
        return common.rstrip()

    def _apply(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def _layout(self, roles: tuple[str, ...], generation_prompt: bool) -> _Layout | None:
        """The layout of this conversation shape; None when the template must render it itself."""
        key = (roles, generation_prompt)
        if key not in self._layouts:
            self._layouts[key] = None
            if self._verbatim:
                marked = self._apply([{"role": r, "content": f"\ue000{i}\ue001"} for i, r in enumerate(roles)], generation_prompt)
                parts = _PLACEHOLDER.split(marked)
                layout = _Layout(tuple(parts[0::2]), tuple(int(i) for i in parts[1::2]))
                probes = [[_PROBE_CONTENTS[(i + k) % len(_PROBE_CONTENTS)] for i in range(len(roles))] for k in range(len(_PROBE_CONTENTS))]
                if all(
                    layout.fill(contents) == self._apply([{"role": r, "content": c} for r, c in zip(roles, contents)], generation_prompt)
                    for contents in probes
                ):
                    self._layouts[key] = layout
        return self._layouts[key]

    def _render(self, messages: list[dict], roles: tuple[str, ...], contents: list[str], generation_prompt: bool) -> str:
        layout = self._layout(roles, generation_prompt)
        return self._apply(messages, generation_prompt) if layout is None else layout.fill(contents)

    def _check_special_tokens(self, messages: list[dict]) -> None:
        for message in messages:
            if any(first in message["content"] for first in self._special_starts):
                for token in self.special:
                    if token in message["content"]:
                        raise RowError("special_token_in_content", f"{message['role']} text contains {token!r}")

    def render(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and the [start, end) character spans that carry loss."""
        self._check_special_tokens(messages)
        roles = tuple(m["role"] for m in messages)
        contents = [m["content"] for m in messages]
        text = self._render(messages, roles, contents, False)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            # Where reply i starts: the rendering of the turns before it plus the generation prompt.
            prefix = self._render(messages[:i], roles[:i], contents[:i], True)
            if not text.startswith(prefix) or not text.startswith(message["content"], len(prefix)):
                raise RowError("template_mismatch", f"the chat template does not render reply {i} after its prompt")
            end = len(prefix) + len(message["content"])
            if text.startswith(self.end_of_turn, end):
                end += len(self.end_of_turn)
            spans.append((len(prefix), end))
        return text, spans

    def encode_prompts(self, batch: list[list[dict]]) -> list[np.ndarray | RowError]:
        """Each prompt's turns rendered up to the model's turn (the generation prompt), as int32 token ids."""
        rendered: list[str | RowError] = []
        for messages in batch:
            try:
                self._check_special_tokens(messages)
                rendered.append(self._render(messages, tuple(m["role"] for m in messages), [m["content"] for m in messages], True))
            except RowError as exc:
                rendered.append(exc)
        texts = [text for text in rendered if isinstance(text, str)]
        encodings = iter(self._encode_texts(texts) if texts else [])
        return [item if isinstance(item, RowError) else np.array(next(encodings).ids, dtype=np.int32) for item in rendered]

    def _encode_texts(self, texts: list[str]) -> list:
        """``tokenizer(texts, add_special_tokens=False)`` without the Python wrapper: the same backend
        settings (no truncation or padding, special tokens in text kept whole), then the Rust call."""
        backend = self.tokenizer.backend_tokenizer
        if backend.truncation is not None:
            backend.no_truncation()
        if backend.padding is not None:
            backend.no_padding()
        if backend.encode_special_tokens != bool(self.tokenizer.split_special_tokens):
            backend.encode_special_tokens = bool(self.tokenizer.split_special_tokens)
        return backend.encode_batch(texts, add_special_tokens=False)

    def encode_batch(self, batch: list[list[dict]]) -> list[Example | RowError]:
        rendered: list[tuple[str, list] | RowError] = []
        for messages in batch:
            try:
                rendered.append(self.render(messages))
            except RowError as exc:
                rendered.append(exc)
        texts = [r[0] for r in rendered if not isinstance(r, RowError)]
        encodings = iter(self._encode_texts(texts) if texts else [])
        out: list[Example | RowError] = []
        for item in rendered:
            if isinstance(item, RowError):
                out.append(item)
                continue
            encoding = next(encodings)
            ids = np.array(encoding.ids, dtype=np.int32)
            offsets = np.array(encoding.offsets, dtype=np.int64).reshape(-1, 2)
            mask = np.zeros(len(ids), dtype=np.int8)
            for start, end in item[1]:
                mask[(offsets[:, 1] > start) & (offsets[:, 0] < end)] = 1
            out.append(Example(ids, mask))
        return out


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
    pad_id: int | None = None  # the token the rows are padded with (the tokenizer's pad, else its end of sequence)
    files: list[str] = field(default_factory=list)
    rejected: list[tuple[str, RowError]] = field(default_factory=list)  # (row id, error)

    @property
    def packing_efficiency(self) -> float:
        return self.tokens / self.slots if self.slots else 0.0


@dataclass(frozen=True)
class TokenizerFiles:
    """A tokenizer as its files (no weights): what workers get instead of the tokenizer itself, so the
    driver never loads one and each worker builds its ``ChatEncoder`` once (``encoder``)."""

    files: tuple[tuple[str, bytes], ...]

    @classmethod
    def from_dir(cls, directory: Path) -> TokenizerFiles:
        """Every file of a model directory but its weights."""
        files = sorted(p for p in Path(directory).iterdir() if p.is_file() and not p.name.endswith(WEIGHT_SUFFIXES))
        return cls(tuple((path.name, path.read_bytes()) for path in files))

    def encoder(self) -> ChatEncoder:
        from transformers import AutoTokenizer  # here, not at the top: seconds to import, and only workers need it

        key = hashlib.sha256(b"".join(name.encode() + b"\0" + data for name, data in self.files)).hexdigest()
        if key not in _ENCODERS:
            _ENCODERS.clear()
            with tempfile.TemporaryDirectory(prefix="ft-tokenizer-") as folder:
                for name, data in self.files:
                    (Path(folder) / name).write_bytes(data)
                _ENCODERS[key] = ChatEncoder(AutoTokenizer.from_pretrained(folder, trust_remote_code=False))
        return _ENCODERS[key]


_ENCODERS: dict[str, ChatEncoder] = {}  # per process: the encoder of the last TokenizerFiles asked for


def encode_rows(encoder: ChatEncoder, rows: list[tuple[str, list[dict]]], seq_len: int) -> tuple[list[Example], list[tuple[str, str, str]]]:
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


@dataclass(frozen=True)
class PackKind:
    """What ``pack_splits`` packs: how rows become sequences, how a window of sequences becomes packed rows, how many
    sequences make one item, and its shards."""

    encode: Callable[[ChatEncoder, list, int], tuple[list[Example], list]]  # (encoder, rows, seq_len) -> (sequences, rejected)
    pack: Callable[[list[Example], int, int], Iterator[dict]]  # (a window's sequences, seq_len, pad id) -> packed rows
    sequences: int  # sequences an item (an example: 1; a preference pair: 2), never cut apart by a window
    schema: pa.Schema
    file_split: Callable[[str], str]  # split -> the split name in its shard files


EXAMPLES = PackKind(encode_rows, pack_rows, 1, SCHEMA, str)


ENCODED = "_encoded"  # where, under the artifact's prefix, the encoded sequences wait for their windows (deleted after)


def encoded_bytes(sequences: list[Example]) -> bytes:
    """Sequences back to back: their lengths (int64), then every token id (int32), then every loss-mask value (int8),
    then the byte length of each one's text (int64) and the texts in UTF-8 (none for chat and pairs: 8 bytes a
    sequence)."""
    lengths = np.array([len(sequence.input_ids) for sequence in sequences], dtype=np.int64)
    ids = np.concatenate([s.input_ids for s in sequences]) if sequences else np.empty(0, np.int32)
    mask = np.concatenate([s.loss_mask for s in sequences]) if sequences else np.empty(0, np.int8)
    texts = [sequence.text.encode() for sequence in sequences]
    text_lengths = np.array([len(text) for text in texts], dtype=np.int64)
    return b"".join([lengths.tobytes(), ids.astype(np.int32).tobytes(), mask.astype(np.int8).tobytes(), text_lengths.tobytes(), *texts])


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
    return [Example(ids[offsets[i] : offsets[i + 1]], mask[offsets[i] : offsets[i + 1]], text) for i, text in zip(range(start, stop), texts)]


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


def encode_run(
    settings: tuple[ChatEncoder | TokenizerFiles, int, PackKind, Target, Target], item: tuple[str, list]
) -> list[EncodedPart]:
    """Tokenize a run of parts of one split, each (a ``Part``, or (row id, messages) rows; its number) into its encoded
    sequences, written for the packing tasks, and the rows it rejected, written as the output's quarantine part
    (a data-plane task)."""
    source, seq_len, kind, target, out = settings
    encoder = source if isinstance(source, ChatEncoder) else source.encoder()
    pad_id = encoder.tokenizer.pad_token_id if encoder.tokenizer.pad_token_id is not None else encoder.tokenizer.eos_token_id
    split, run = item
    done = []
    for rows, index in run:
        if isinstance(rows, Part):
            table = read_part(rows, ["source", "messages"])
            rows = list(zip(table.column("source").to_pylist(), table.column("messages").to_pylist()))
        kept, rejected = kind.encode(encoder, rows, seq_len)
        written = target.put(part_name(split, index), encoded_bytes(kept), len(kept))
        tokens, loss_tokens = sum(len(e.input_ids) for e in kept), sum(int(e.loss_mask.sum()) for e in kept)
        done.append(EncodedPart(split, written, tokens, loss_tokens, rejected, pad_id, quarantine_part(out, split, index, rejected)))
    return done


def quarantine_part(out: Target, split: str, index: int, rejected: list[tuple[str, str, str]]) -> Written | None:
    """The rows the tokenizer refused in part ``index`` of ``split``, as the part ``quarantine-<split>-NNNNN``."""
    if not rejected:
        return None
    rows = [{"source": row_id, "stage": "tokenize", "reason": reason, "detail": detail, "raw": ""} for row_id, reason, detail in rejected]
    return out.put_table(part_name(f"quarantine-{split}", index), pa.Table.from_pylist(rows, schema=QUARANTINE_SCHEMA), QUARANTINE_SCHEMA)


@dataclass(frozen=True)
class Window:
    """``PACK_WINDOW`` items of a split (fewer at its end), cut in row order from its encoded parts (``slices``:
    (part, first sequence, sequence after the last)), packed by one task into shard ``index``."""

    split: str
    index: int
    slices: list[tuple[Part, int, int]]
    pad_id: int


def pack_window(settings: tuple[PackKind, int, Target], window: Window) -> tuple[str, Written]:
    """Pack one window's sequences and write them as the shard ``<split>-<index>.parquet`` (a data-plane task)."""
    kind, seq_len, target = settings
    sequences = [sequence for part, start, stop in window.slices for sequence in sequences_of(part_bytes(part), part.rows, start, stop)]
    rows = list(kind.pack(sequences, seq_len, window.pad_id))
    table = packed_table(rows, kind.schema)
    return window.split, target.put(shard_name(kind.file_split(window.split), window.index), table_bytes(table, kind.schema), len(rows))


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
    parts = executor.map(encode_run, tasks, (encoder, seq_len, kind, encoded.target(executor), out.target(executor)))
    for split, written in executor.map(pack_window, windows.cut(parts), (kind, seq_len, out.target(executor))):
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
) -> dict[str, PackStats]:
    """``pack_splits`` of the parts of each split of ``split``, a run of parts of at most ``executor.shard_rows`` rows
    a task."""
    executor = executor or InProcess()
    tasks = [
        (name, [(part, part.index) for part in run])
        for name in splits
        for run in runs(split.parts(name, executor), lambda part: part.rows, executor.shard_rows)
    ]
    return pack_splits(tasks, splits, encoder, seq_len, out, window, executor=executor, kind=kind)
