"""Chat encoding: conversations rendered with the base model's chat template, tokenized, and the loss masked to replies.

``ChatEncoder`` renders each conversation with the base model's own chat template, tokenizes the
text in batches with the fast (Rust) tokenizer and marks as trainable exactly the characters of
every assistant reply plus the end-of-turn marker the template writes after it (so the model learns
to stop), with what the template writes between the model's turn and the reply's text: a channel
header (gpt-oss's harmony), the reply's reasoning when the row gives one (``thinking``: gpt-oss's
analysis channel, Qwen3's ``<think>`` block, passed to templates as ``thinking`` and
``reasoning_content``). A reply starts where the rendering of the turns before it plus the generation prompt ends
(exact for ChatML, Llama-3 and similar templates, checked per row); the end-of-turn marker is found
once by rendering a probe conversation. Every pack kind (``ft_assets.data.packing``, ``pair_packing``,
``prompt_packing``) encodes its rows through it.

Throughput: the Rust tokenizer is the floor, so everything around it is kept small. Chat templates
that insert contents verbatim (ChatML and most others, ``template_inserts_content_verbatim``) are
rendered once per conversation shape and filled in per row: 1 µs instead of ~300 µs a render; texts
go to the backend tokenizer in batches of ``TOKENIZE_BATCH`` without the Python wrapper. On the
200k-row benchmark corpus (SmolLM2 tokenizer, 1,024-token rows) tokenizing and packing takes 133 s of
CPU instead of 232 s, of which ~100 s is the tokenizer itself; output unchanged. Workers get the
tokenizer as its files (``TokenizerFiles``, no weights) and build their encoder once.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import itertools
import json
import os
import re
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ft_assets.data.images import IMAGE_MARKER, ImagePool
from ft_assets.data.rows import RowError
from ft_assets.data.sequences import Example
from ft_assets.vision import image_token_id, is_vision_model, load_processor

TOKENIZE_BATCH = 512  # rows per call into the Rust tokenizer
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack")  # never shipped with a tokenizer


_PLACEHOLDER = re.compile("\ue000(\\d+)\ue001")  # private-use marks: content i is rendered as \ue000i\ue001
_CAPTURING = ("FilterBlock", "AssignBlock", "Macro", "CallBlock")  # blocks whose output a template can rework
# Contents that a template which trims, escapes, quotes or tests its input renders differently.
_PROBE_CONTENTS = ('  Quoted "text" with \\ and\n{{ braces }} <b>&amp;</b> {% raw %}  ', "x", "\n")


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


def image_parts(message: dict) -> list[dict]:
    """A turn that holds images as the content parts chat templates render: its text cut at each ``<image>`` marker,
    an ``{"type": "image"}`` part in each cut, in order."""
    parts = []
    for i, piece in enumerate(message["content"].split(IMAGE_MARKER)):
        if i:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts


def for_template(message: dict) -> dict:
    """A stored message as chat templates read it: its reasoning under both names they use (gpt-oss's ``thinking``,
    Qwen3's ``reasoning_content``), its tool calls as a list, its images as content parts."""
    if not (message.get("thinking") or message.get("tool_calls") or message.get("images")):
        return message
    message = dict(message)
    if message.get("images"):
        message["content"] = image_parts(message)
        del message["images"]
    if message.get("thinking"):
        message["reasoning_content"] = message["thinking"]
    if message.get("tool_calls"):
        message["tool_calls"] = json.loads(message["tool_calls"])
    return message


# What a template's ``strftime_now`` returns while the data plane renders (gpt-oss's harmony system message carries the
# current date): a fixed day, so that a dataset version tokenizes to the same shards whenever it is tokenized.
TEMPLATE_DATE = datetime.datetime(2025, 8, 5)


@contextmanager
def fixed_template_date() -> Iterator[None]:
    """transformers' ``strftime_now`` (a jinja global it defines over its module's ``datetime``) at ``TEMPLATE_DATE``;
    a value passed to ``apply_chat_template`` cannot stand in for it (transformers passes callables as strings)."""
    from transformers.utils import chat_template_utils

    real = chat_template_utils.datetime
    chat_template_utils.datetime = _at_template_date(real)
    try:
        yield
    finally:
        chat_template_utils.datetime = real


@functools.cache
def _at_template_date(real: type) -> type:
    """``real`` (the ``datetime`` class) whose ``now()`` is ``TEMPLATE_DATE``: made once, not on every render."""

    class Fixed(real):
        @classmethod
        def now(cls, tz=None):
            return TEMPLATE_DATE

    return Fixed


class ChatEncoder:
    """Renders conversations with a tokenizer's chat template and masks the loss to assistant turns.

    Rendering is exact either way. A template that inserts contents verbatim
    (``template_inserts_content_verbatim``) is rendered through jinja once per conversation shape
    (the roles, and whether the generation prompt follows) with placeholders, checked against jinja
    on probe contents, and then filled in per row: 1 µs instead of ~300 µs a render through
    ``apply_chat_template``, of which a row needs one plus one per reply. Other templates go
    through ``apply_chat_template`` every time.
    """

    def __init__(self, tokenizer, processor=None, images: ImagePool | None = None, image_token_id: int | None = None):
        # a vision-language model's processor, where its rows' images are read, and the id of its image tokens
        self.processor, self.images, self.image_token_id = processor, images, image_token_id
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
        self.end_of_turn, self.end_of_last, self.end_of_middle = self._probe_end_of_turn()

    def _probe_end_of_turn(self) -> tuple[str, str, str]:
        """What the template writes after a reply: (the marker after every reply, or "" when the last reply of a
        conversation ends otherwise than one followed by another turn; then the special token that ends the last
        reply, and the one that ends a reply in the middle).

        The marker is the text that follows both a last reply and one followed by another turn, cut before any special
        token it would split, stripped. (Phi-3 ends a conversation with ``<|end|>\n`` + eos, a middle reply with
        ``<|end|>\n<|user|>``: the marker is ``<|end|>``.) gpt-oss's harmony ends the last reply with ``<|return|>``,
        what generation stops at, and a reply in the history with ``<|end|>``: no common marker, one of each."""
        reply, user = "PROBE-REPLY-7f3a", {"role": "user", "content": "probe"}
        last = self._apply([user, {"role": "assistant", "content": reply}], False)
        followed = self._apply(
            [user, {"role": "assistant", "content": reply}, {"role": "user", "content": "PROBE-NEXT"}], False
        )
        tails = [text[text.index(reply) + len(reply) :] for text in (last, followed)]
        common = os.path.commonprefix(tails)
        for tail, token in itertools.product(tails, self.special):
            start = tail.find(token) if token else -1
            while 0 <= start < len(common):
                if start + len(token) > len(common):
                    common = common[:start]
                start = tail.find(token, start + 1)
        if common.strip():
            return common.rstrip(), "", ""
        leading = [max((t for t in self.special if tail.startswith(t)), key=len, default="") for tail in tails]
        return "", leading[0], leading[1]

    def _end_marker(self, last: bool) -> str:
        return self.end_of_turn or (self.end_of_last if last else self.end_of_middle)

    def _apply(self, messages: list[dict], generation_prompt: bool) -> str:
        # a reply's reasoning under each name templates read it by: gpt-oss's "thinking", Qwen3's "reasoning_content"
        messages = [for_template(m) for m in messages]
        with fixed_template_date():
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def _layout(self, roles: tuple[str, ...], generation_prompt: bool) -> _Layout | None:
        """The layout of this conversation shape; None when the template must render it itself."""
        key = (roles, generation_prompt)
        if key not in self._layouts:
            self._layouts[key] = None
            if self._verbatim:
                marked = self._apply(
                    [{"role": r, "content": f"\ue000{i}\ue001"} for i, r in enumerate(roles)], generation_prompt
                )
                parts = _PLACEHOLDER.split(marked)
                layout = _Layout(tuple(parts[0::2]), tuple(int(i) for i in parts[1::2]))
                probes = [
                    [_PROBE_CONTENTS[(i + k) % len(_PROBE_CONTENTS)] for i in range(len(roles))]
                    for k in range(len(_PROBE_CONTENTS))
                ]
                if all(
                    layout.fill(contents)
                    == self._apply([{"role": r, "content": c} for r, c in zip(roles, contents)], generation_prompt)
                    for contents in probes
                ):
                    self._layouts[key] = layout
        return self._layouts[key]

    def _render(
        self, messages: list[dict], roles: tuple[str, ...], contents: list[str], generation_prompt: bool
    ) -> str:
        # the layouts are of contents alone
        extras = any(m.get("thinking") or m.get("tool_calls") or m.get("images") for m in messages)
        layout = None if extras else self._layout(roles, generation_prompt)
        return self._apply(messages, generation_prompt) if layout is None else layout.fill(contents)

    def _check_special_tokens(self, messages: list[dict]) -> None:
        for message in messages:
            content = message["content"].replace(IMAGE_MARKER, "") if message.get("images") else message["content"]
            for text in (content, message.get("thinking") or "", message.get("tool_calls") or ""):
                if any(first in text for first in self._special_starts):
                    for token in self.special:
                        if token in text:
                            raise RowError("special_token_in_content", f"{message['role']} text contains {token!r}")

    def _check_images(self, messages: list[dict]) -> None:
        """A text model has no eye for a row's images: the row is refused, not trained on its text alone."""
        held = sum(len(m.get("images") or ()) for m in messages)
        if held and self.processor is None:
            raise RowError(
                "image_without_vision",
                f"the row holds {held} image(s) but the base model has no vision tower; use a vision-language base "
                "model (Qwen2.5-VL, Qwen3-VL, Gemma 3, SmolVLM) to train on images",
            )

    def render(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and the [start, end) character spans that carry loss."""
        self._check_images(messages)
        self._check_special_tokens(messages)
        roles = tuple(m["role"] for m in messages)
        contents = [m["content"] for m in messages]
        text = self._render(messages, roles, contents, False)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            # Where reply i starts: the rendering of the turns before it plus the generation prompt. What the template
            # writes between that and the reply's text (harmony's "<|channel|>final<|message|>", a reasoning channel
            # before it) is the model's to write too, so it is learned with the reply.
            prefix = self._render(messages[:i], roles[:i], contents[:i], True)
            start = text.find(message["content"], len(prefix)) if text.startswith(prefix) else -1
            if start < 0:
                raise RowError("template_mismatch", f"the chat template does not render reply {i} after its prompt")
            end = start + len(message["content"])
            marker = self._end_marker(last=i == len(messages) - 1)
            if message.get("tool_calls"):  # the call is the reply: up to where the conversation so far ends
                through = self._render(messages[: i + 1], roles[: i + 1], contents[: i + 1], False).rstrip()
                if not text.startswith(through) or len(through) <= len(prefix):
                    raise RowError("template_mismatch", f"the chat template does not render the tool call of reply {i}")
                end = len(through)
            elif marker and text.startswith(marker, end):
                end += len(marker)
            spans.append((len(prefix), end))
        return text, spans

    def encode_prompts(self, batch: list[list[dict]]) -> list[np.ndarray | RowError]:
        """Each prompt's turns rendered up to the model's turn (the generation prompt), as int32 token ids."""
        rendered: list[str | RowError] = []
        for messages in batch:
            try:
                self._check_special_tokens(messages)
                rendered.append(
                    self._render(messages, tuple(m["role"] for m in messages), [m["content"] for m in messages], True)
                )
            except RowError as exc:
                rendered.append(exc)
        texts = [text for text in rendered if isinstance(text, str)]
        encodings = iter(self._encode_texts(texts) if texts else [])
        return [
            item if isinstance(item, RowError) else np.array(next(encodings).ids, dtype=np.int32) for item in rendered
        ]

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
        """Each conversation as token ids and loss mask; a row with images through ``encode_with_images``."""
        if self.processor is not None and any(m.get("images") for messages in batch for m in messages):
            return [self._encode_one(messages) for messages in batch]
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

    def _encode_one(self, messages: list[dict]) -> Example | RowError:
        try:
            if any(m.get("images") for m in messages):
                return self.encode_with_images(messages)
        except RowError as exc:
            return exc
        return self.encode_batch([[{k: v for k, v in m.items() if k != "images"} for m in messages]])[0]

    def encode_with_images(self, messages: list[dict]) -> Example:
        """A conversation that holds images, as the model's processor expands them: each image's placeholder becomes
        the tokens the processor cuts it into at its own resize rules (Qwen's patches, Gemma 3's soft tokens,
        Idefics3's tiles), which is exactly what the model reads at inference; the loss mask is the replies', carried
        from the rendered text to the expanded one by the processor's own replacement offsets. The example's ``text``
        holds its image references, one a line, for the packer."""
        text, spans = self.render(messages)
        refs = [ref for m in messages for ref in m.get("images") or ()]
        placeholder = self.processor.image_token
        if text.count(placeholder) != len(refs):
            raise RowError(
                "template_mismatch",
                f"the chat template wrote {text.count(placeholder)} image placeholder(s) {placeholder!r} for {len(refs)} image(s)",
            )
        pictures = [self.images.open(ref) for ref in refs]
        try:
            encoded = self.processor(text=[text], images=[pictures], add_special_tokens=False,
                                     return_text_replacement_offsets=True, return_offsets_mapping=True)  # fmt: skip
        except (ValueError, TypeError, OSError) as exc:  # the processor's own refusal (an extreme aspect ratio, ...)
            raise RowError("image_processor", f"the processor refused the row's images: {' '.join(str(exc).split())}")
        ids = np.array(encoded["input_ids"][0], dtype=np.int32)
        offsets = np.array(encoded["offset_mapping"][0], dtype=np.int64).reshape(-1, 2)
        replaced = [(r["span"], r["new_span"]) for r in encoded["text_replacement_offsets"][0]]

        def expanded(at: int) -> int:  # a position of the rendered text in the expanded one (never inside an image)
            return at + sum((new[1] - new[0]) - (old[1] - old[0]) for old, new in replaced if old[1] <= at)

        mask = np.zeros(len(ids), dtype=np.int8)
        for start, end in spans:
            mask[(offsets[:, 1] > expanded(start)) & (offsets[:, 0] < expanded(end))] = 1
        return Example(ids, mask, "\n".join(refs))


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

    def encoder(self, images: ImagePool | None = None) -> ChatEncoder:
        """The encoder of these files, built once per process: a vision-language model's (its config.json has a
        vision tower) with its processor, reading its rows' images from ``images``."""
        from transformers import AutoTokenizer  # here, not at the top: seconds to import, and only workers need it

        key = hashlib.sha256(b"".join(name.encode() + b"\0" + data for name, data in self.files)).hexdigest()
        if key not in _ENCODERS:
            _ENCODERS.clear()
            with tempfile.TemporaryDirectory(prefix="ft-tokenizer-") as folder:
                for name, data in self.files:
                    (Path(folder) / name).write_bytes(data)
                config = json.loads(dict(self.files).get("config.json", b"{}"))
                if is_vision_model(config):
                    processor = load_processor(folder)
                    _ENCODERS[key] = ChatEncoder(processor.tokenizer, processor, image_token_id=image_token_id(config))
                else:
                    _ENCODERS[key] = ChatEncoder(AutoTokenizer.from_pretrained(folder, trust_remote_code=False))
        _ENCODERS[key].images = images
        return _ENCODERS[key]


_ENCODERS: dict[str, ChatEncoder] = {}  # per process: the encoder of the last TokenizerFiles asked for
