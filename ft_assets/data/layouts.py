"""Row layouts: every accepted shape of a row, parsed into one chat schema, ``messages: [{role, content}]``.

- chat:     ``{"messages": [{"role": "user", "content": "..."}, ...]}``
- ShareGPT: ``{"conversations": [{"from": "human", "value": "..."}, ...], "system": "..." (optional)}``
- alpaca:   ``{"instruction": "...", "input": "..." (optional), "output": "...", "system": "...",
  "history": [["earlier request", "earlier reply"], ...] (both optional, as LLaMA-Factory writes them)}``
- any other column names through a ``ColumnMapping`` (``raw_dataset`` config ``columns``), e.g.
  ``{prompt: question, response: answer}``.
- images, in conversations only: a turn's content may be a list of parts, ``[{"type": "image",
  "image": "photos/1.png"}, {"type": "text", "text": "..."}]`` (an image part may name its image by
  ``image``, ``path``, ``url``, ``bytes`` or OpenAI's ``image_url``, or name none and take the next of the
  row's ``images`` column: TRL's form), or a string with ``<image>`` markers that take the row's
  ``images`` column in order (LLaVA / LLaMA-Factory ShareGPT). A turn then holds its text with one
  ``<image>`` marker where each image stands, and its images (``ft_assets.data.images`` reads and
  stores them); only user turns hold images.
- preference pairs: a row with both ``chosen`` and ``rejected`` (``pair_messages``) becomes the
  prompt's turns, then the chosen reply (role ``chosen``), then the rejected one (role ``rejected``):

  - strings:            ``{"prompt": "...", "chosen": "...", "rejected": "...", "system": "..." (optional)}``
  - conversational (TRL): ``{"prompt": [{"role": "user", "content": "..."}, ...],
    "chosen": [{"role": "assistant", "content": "..."}], "rejected": [{"role": "assistant", ...}]}``
  - implicit prompt (Anthropic HH as TRL ships it): ``{"chosen": [whole conversation], "rejected":
    [whole conversation]}``: the prompt is the turns both share, then each side has one assistant reply
  - LLaMA-Factory: ``{"conversations": [{"from": "human", "value": "..."}], "chosen": {"from": "gpt",
    "value": "..."}, "rejected": {...}, "system": "..." (optional)}`` and ``{"instruction": "...",
    "input": "..." (optional), "chosen": "...", "rejected": "..."}``

The layout is recognised from the keys of each row, so one file may mix chat, ShareGPT and alpaca
rows. Parsing is pure: a row (a dict, already decoded by ``ft_assets.data.decoding`` or read from
a table by ``ft_assets.data.formats``) goes in, messages or a ``RowError`` come out. What the turns
say is not judged here (roles in order, empty replies): that is ``ft_assets.data.cleaning``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ft_assets.data.images import IMAGE_MARKER, count_markers
from ft_assets.data.rows import DatasetFileError, RowError

SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "system": "system",
}
CHOSEN, REJECTED = "chosen", "rejected"  # roles of the two replies in a pair's row
COLUMNS = "columns"  # role of a prompt row's last turn: its other columns as a JSON object, for the reward functions
LAYOUTS = (
    "a 'messages' column, a 'conversations' column, 'instruction' + 'output', 'chosen' + 'rejected' (preference pairs) "
    "or 'prompt' (prompts)"
)
MAPPING_HINT = (
    "map your columns with the raw_dataset config 'columns', e.g. {prompt: question, response: answer} "
    "or {messages: dialog, role: speaker, content: text}"
)


# --- chat layouts ----------------------------------------------------------------------------------


REASONING_KEYS = ("thinking", "reasoning_content", "reasoning")  # a reply's reasoning, as datasets name it


def _text(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise RowError("wrong_type", f"{where} must be a string, got {type(value).__name__}")
    return value


# --- images ---------------------------------------------------------------------------------------

_PENDING = object()  # an image part that names no image: the next one of the row's ``images`` column
IMAGE_COLUMNS = ("images", "image")  # a row's images, taken in order by its image parts or <image> markers
IMAGE_KEYS = ("image", "path", "url", "bytes")  # where an image part names its image (HF processors, TRL, datasets)


def _image_of(part: dict, where: str) -> object:
    """What an image part names: a path, bytes, a data URI, a datasets ``Image`` dict; ``_PENDING`` when none."""
    if part.get("type") == "image_url":  # OpenAI's form
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        if not isinstance(url, str):
            raise RowError("wrong_type", f"{where}.image_url needs a 'url'")
        return url
    named = next((part[key] for key in IMAGE_KEYS if part.get(key) is not None), _PENDING)
    return named


def _content(value: object, where: str) -> tuple[str, list]:
    """A turn's content: a string, or a list of text and image parts -> (text with an ``IMAGE_MARKER`` where each
    image stands, the images in order)."""
    if isinstance(value, str):
        return value, []
    if not isinstance(value, list):
        raise RowError("wrong_type", f"{where} must be a string or a list of parts, got {type(value).__name__}")
    text, images = [], []
    for i, part in enumerate(value):
        if isinstance(part, str):
            part = {"type": "text", "text": part}
        if not isinstance(part, dict) or part.get("type") not in ("text", "image", "image_url"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise RowError("wrong_type", f"{where}[{i}] is a {kind!r} part; parts are 'text' or 'image'")
        if part["type"] == "text":
            piece = _text(part.get("text"), f"{where}[{i}].text")
            if count_markers(piece):
                raise RowError(
                    "image_marker", f"{where}[{i}].text holds {IMAGE_MARKER!r}; give the image as a part of its own"
                )
            text.append(piece)
        else:
            text.append(IMAGE_MARKER)
            images.append(_image_of(part, f"{where}[{i}]"))
    return "".join(text), images


def _column_images(obj: dict) -> list:
    """The row's ``images`` (or ``image``) column as a list; empty when it has none."""
    for column in IMAGE_COLUMNS:
        value = obj.get(column)
        if value is None or (isinstance(value, list) and not value):
            continue
        return value if isinstance(value, list) else [value]
    return []


def with_images(messages: list[dict], obj: dict) -> list[dict]:
    """``messages`` with the row's images in their turns: image parts that name none, and the ``<image>`` markers of
    string contents, take the row's ``images`` column in order; a column with no part or marker to take it goes to
    the start of the first user turn. Images only in user turns; a count that does not match is refused."""
    column = _column_images(obj)
    slots = sum(
        sum(image is _PENDING for image in m.get("images", ())) if m.get("images") else count_markers(m["content"])
        for m in messages
    )
    if column and slots == 0:
        first = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
        if first is None:
            raise RowError("image_in_reply", "the row has images but no user turn to hold them")
        head = messages[first]
        messages = [*messages[:first], {**head, "content": IMAGE_MARKER * len(column) + head["content"],
                    "images": list(column) + list(head.get("images", []))}, *messages[first + 1:]]  # fmt: skip
        slots = len(column)
    elif column and slots != len(column):
        raise RowError(
            "image_count", f"the row's '{IMAGE_COLUMNS[0]}' column has {len(column)} image(s) for {slots} image slot(s)"
        )
    taken = iter(column)
    out = []
    for i, message in enumerate(messages):
        images = message.get("images")
        if images:
            images = [next(taken, _PENDING) if image is _PENDING else image for image in images]
        elif column and count_markers(message["content"]):
            images = [next(taken) for _ in range(count_markers(message["content"]))]
        if images:
            if any(image is _PENDING for image in images):
                raise RowError(
                    "image_missing", f"turn {i} has an image part that names no image, and no 'images' column"
                )
            if message["role"] != "user":
                raise RowError(
                    "image_in_reply", f"turn {i} ({message['role']}) holds an image; images go in user turns"
                )
            message = {**message, "images": images}
        out.append(message)
    return out


def has_images(messages: list[dict]) -> bool:
    return any(m.get("images") for m in messages)


def _message_list(value: object, field: str, role_key: str, text_key: str, role_map: dict | None) -> list[dict]:
    if not isinstance(value, list):
        raise RowError("wrong_type", f"'{field}' must be a list, got {type(value).__name__}")
    messages = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise RowError("wrong_type", f"'{field}[{i}]' must be an object, got {type(item).__name__}")
        if role_key not in item or text_key not in item:
            raise RowError("wrong_type", f"'{field}[{i}]' needs '{role_key}' and '{text_key}'")
        role = _text(item[role_key], f"'{field}[{i}].{role_key}'")
        if role_map is not None:
            role = role_map.get(role.strip().lower(), role)
        content, images = _content(item[text_key], f"'{field}[{i}].{text_key}'")
        message = {"role": role, "content": content}
        if images:
            message["images"] = images
        reasoning = next((key for key in REASONING_KEYS if item.get(key) is not None), None)
        if reasoning is not None:
            message["thinking"] = _text(item[reasoning], f"'{field}[{i}].{reasoning}'")
        if item.get("tool_calls"):
            message["tool_calls"] = _tool_calls(item["tool_calls"], f"'{field}[{i}].tool_calls'")
        messages.append(message)
    return messages


def _tool_calls(value: object, where: str) -> str:
    """A reply's tool calls as the JSON the rows store: OpenAI's form, each function's arguments an object (a JSON
    string of one is parsed: templates write arguments with ``tojson`` and would quote a string twice)."""
    if not isinstance(value, list):
        raise RowError("wrong_type", f"{where} must be a list, got {type(value).__name__}")
    calls = []
    for i, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RowError(
                "wrong_type", f"{where}[{i}] needs a function with a name: {{'function': {{'name', 'arguments'}}}}"
            )
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as exc:
                raise RowError("bad_tool_call", f"{where}[{i}].function.arguments is not JSON: {exc}") from None
        calls.append({"type": "function", "function": {"name": function["name"], "arguments": arguments}})
    return json.dumps(calls, ensure_ascii=False, sort_keys=True)


def _optional_text(obj: dict, key: str | None) -> str:
    value = obj.get(key) if key else None
    return "" if value is None else _text(value, f"'{key}'")


def _history(value: object) -> list[dict]:
    """LLaMA-Factory's ``history``: earlier [request, reply] pairs, oldest first."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise RowError("wrong_type", f"'history' must be a list of [request, reply] pairs, got {type(value).__name__}")
    turns = []
    for i, pair in enumerate(value):
        if not (isinstance(pair, list) and len(pair) == 2):
            raise RowError("wrong_type", f"'history[{i}]' must be a [request, reply] pair")
        turns += [{"role": "user", "content": _text(pair[0], f"'history[{i}][0]'")},
                  {"role": "assistant", "content": _text(pair[1], f"'history[{i}][1]'")}]  # fmt: skip
    return turns


def _instruction_turns(instruction: str, extra: str, output: str, system: str, history: list[dict]) -> list[dict]:
    """Alpaca-style fields as turns. Without a system prompt, a non-empty input is the request and the
    instruction becomes the system turn; with one, the instruction and the input make the request."""
    if system.strip():
        request = f"{instruction}\n\n{extra}" if extra.strip() else instruction
        head = [{"role": "system", "content": system}]
    elif extra.strip():
        request, head = extra, [{"role": "system", "content": instruction}]
    else:
        request, head = instruction, []
    return head + history + [{"role": "user", "content": request}, {"role": "assistant", "content": output}]


def _with_system(obj: dict, messages: list[dict]) -> list[dict]:
    system = _optional_text(obj, "system")
    if system.strip() and not (messages and messages[0]["role"] == "system"):
        return [{"role": "system", "content": system}] + messages
    return messages


# --- preference pairs ------------------------------------------------------------------------------


def _reply(value: object, side: str) -> str:
    """One side of a pair: a string, one message (``{role, content}`` or ``{from, value}``) or a list of one."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list):
        raise RowError("wrong_type", f"'{side}' must be a string or an assistant message, got {type(value).__name__}")
    keys = ("from", "value") if value and isinstance(value[0], dict) and "from" in value[0] else ("role", "content")
    messages = _message_list(value, side, *keys, SHAREGPT_ROLES)
    if len(messages) != 1:
        raise RowError("wrong_type", f"'{side}' must be one assistant reply, got {len(messages)} messages")
    if messages[0]["role"] != "assistant":
        raise RowError(
            "bad_role_order", f"the {side} reply has role {messages[0]['role']!r}; a reply is the assistant's"
        )
    return messages[0]["content"]


def _implicit_prompt(chosen: object, rejected: object) -> tuple[list[dict], str, str]:
    """Two whole conversations: the turns they share are the prompt, the one reply after it each side's answer."""
    sides = [
        _message_list(value, side, "role", "content", None) for value, side in ((chosen, CHOSEN), (rejected, REJECTED))
    ]
    shared = 0
    while shared < min(map(len, sides)) - 1 and sides[0][shared] == sides[1][shared]:
        shared += 1
    tails = [side[shared:] for side in sides]
    if any(len(tail) != 1 for tail in tails):
        raise RowError(
            "bad_role_order",
            f"the chosen and rejected conversations share {shared} turns, then have {len(tails[0])} and "
            f"{len(tails[1])}; each must end in one assistant reply after the shared prompt",
        )
    replies = [_reply(tail, side) for tail, side in zip(tails, (CHOSEN, REJECTED))]
    return sides[0][:shared], replies[0], replies[1]


def _prompt(obj: dict) -> list[dict]:
    system = _optional_text(obj, "system")
    # alpaca: the same rules as for chat rows
    if "instruction" in obj and "prompt" not in obj and "conversations" not in obj:
        return _instruction_turns(
            _text(obj["instruction"], "'instruction'"), _optional_text(obj, "input"), "", system, []
        )[:-1]
    if "conversations" in obj:
        turns = _message_list(obj["conversations"], "conversations", "from", "value", SHAREGPT_ROLES)
    elif isinstance(obj["prompt"], str):
        turns = [{"role": "user", "content": obj["prompt"]}]
    else:
        turns = _message_list(obj["prompt"], "prompt", "role", "content", None)
    if system.strip() and not (turns and turns[0]["role"] == "system"):
        turns = [{"role": "system", "content": system}] + turns
    return turns


def pair_messages(obj: dict) -> list[dict]:
    """One pair in any accepted layout -> its chat row (prompt turns, chosen, rejected); raises RowError."""
    if any(key in obj for key in ("prompt", "conversations", "instruction")):
        prompt, chosen, rejected = _prompt(obj), _reply(obj[CHOSEN], CHOSEN), _reply(obj[REJECTED], REJECTED)
    elif isinstance(obj[CHOSEN], list) and isinstance(obj[REJECTED], list):
        prompt, chosen, rejected = _implicit_prompt(obj[CHOSEN], obj[REJECTED])
    else:
        keys = ", ".join(sorted(map(str, obj))[:8])
        raise RowError(
            "unknown_format",
            f"a pair needs a 'prompt' (or two whole conversations as chosen/rejected); found keys: {keys}",
        )
    return prompt + [{"role": CHOSEN, "content": chosen}, {"role": REJECTED, "content": rejected}]


# --- prompts --------------------------------------------------------------------------------------


def _with_columns(turns: list[dict], obj: dict, used: tuple[str, ...]) -> list[dict]:
    """A prompt's turns, then its other columns (those not in ``used``) as a ``columns`` turn, if it has any."""
    columns = {key: value for key, value in obj.items() if key not in used}
    if not columns:
        return turns
    return turns + [{"role": COLUMNS, "content": json.dumps(columns, ensure_ascii=False, sort_keys=True, default=str)}]


def prompt_messages(obj: dict) -> list[dict]:
    """A prompt row (``{"prompt": ..., **columns}``) -> its turns, then its other columns; raises RowError."""
    return _with_columns(_prompt(obj), obj, ("prompt", "system"))


# --- other column names ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ColumnMapping:
    """Which column holds what, for tables whose columns have other names (``raw_dataset`` config ``columns``).

    Either ``messages`` (a column holding a list of turns, whose keys are ``role`` and ``content``;
    ShareGPT role names such as human/gpt are understood) or ``prompt`` + ``response`` (with
    optional ``input`` and ``system``; the same rules as alpaca's instruction/input/output). ``images``
    names a column of images (one, or a list) that go where the turns' ``<image>`` markers are, else at
    the start of the first user turn.
    """

    messages: str | None = None
    role: str = "role"
    content: str = "content"
    prompt: str | None = None
    input: str | None = None
    response: str | None = None
    system: str | None = None
    images: str | None = None

    FIELDS = ("messages", "role", "content", "prompt", "input", "response", "system", "images")

    @classmethod
    def of(cls, columns: dict[str, str]) -> ColumnMapping | None:
        """The mapping for a config's ``columns`` (None when empty); ``ValueError`` says what is wrong."""
        if not columns:
            return None
        unknown = sorted(set(columns) - set(cls.FIELDS))
        if unknown:
            raise ValueError(f"columns: unknown key(s) {unknown}; use {', '.join(cls.FIELDS)}")
        if not all(isinstance(value, str) and value for value in columns.values()):
            raise ValueError("columns: every value must be a column name")
        turns = {"prompt", "input", "response", "system"} & set(columns)
        if "messages" in columns and turns:
            raise ValueError(
                f"columns: map 'messages' (a list of turns) or prompt/response, not both (got {sorted(columns)})"
            )
        if "messages" not in columns and not {"prompt", "response"} <= set(columns):
            raise ValueError(f"columns: map 'messages', or both 'prompt' and 'response' (got {sorted(columns)})")
        if "messages" not in columns and {"role", "content"} & set(columns):
            raise ValueError("columns: 'role' and 'content' name the keys inside the turns of a 'messages' column")
        return cls(**columns)

    @property
    def required(self) -> list[str]:
        return [self.messages] if self.messages else [self.prompt, self.response]

    def describe(self) -> str:
        fields = ("messages", "role", "content") if self.messages else ("prompt", "input", "response", "system")
        fields += ("images",)
        return ", ".join(f"{field}: {getattr(self, field)}" for field in fields if getattr(self, field))

    def record(self, obj: dict) -> list[dict]:
        missing = [column for column in self.required if column not in obj]
        if missing:
            keys = ", ".join(sorted(map(str, obj))[:8]) or "none"
            raise RowError(
                "unknown_format", f"expected {', '.join(missing)} (raw_dataset config columns); found keys: {keys}"
            )
        images = {IMAGE_COLUMNS[0]: obj[self.images]} if self.images and obj.get(self.images) is not None else {}
        if self.messages:
            messages = _message_list(obj[self.messages], self.messages, self.role, self.content, SHAREGPT_ROLES)
        else:
            messages = _instruction_turns(
                _text(obj[self.prompt], f"'{self.prompt}'"),
                _optional_text(obj, self.input),
                _text(obj[self.response], f"'{self.response}'"),
                _optional_text(obj, self.system),
                [],
            )
        return with_images(messages, images)


# --- any row ---------------------------------------------------------------------------------------


def normalize_record(obj: object, mapping: ColumnMapping | None = None) -> list[dict]:
    """One parsed row in any accepted layout -> chat messages; raises RowError(reason, detail)."""
    if not isinstance(obj, dict):
        raise RowError("not_an_object", f"a row must be a JSON object, got {type(obj).__name__}")
    if mapping is not None:
        return mapping.record(obj)
    if "chosen" in obj and "rejected" in obj:
        return _text_only(pair_messages(obj), obj, "preference pairs")
    if "messages" in obj:
        messages = with_images(_message_list(obj["messages"], "messages", "role", "content", None), obj)
        if messages and messages[-1]["role"] == "user":  # a prompt: its other columns are for the reward functions
            return _with_columns(_text_only(messages, obj, "prompts"), obj, ("messages",))
        return messages
    if "conversations" in obj:
        turns = _message_list(obj["conversations"], "conversations", "from", "value", SHAREGPT_ROLES)
        return with_images(_with_system(obj, turns), obj)
    if "instruction" in obj and "output" in obj:
        return _instruction_turns(
            _text(obj["instruction"], "'instruction'"),
            _optional_text(obj, "input"),
            _text(obj["output"], "'output'"),
            _optional_text(obj, "system"),
            _history(obj.get("history")),
        )
    if "prompt" in obj and "completion" not in obj:  # prompt + completion is a supervised row (TRL), not a prompt
        return _text_only(prompt_messages(obj), obj, "prompts")
    keys = ", ".join(sorted(map(str, obj))[:8]) or "none"
    raise RowError(
        "unknown_format",
        f"expected 'messages', 'conversations', 'instruction'+'output' or 'chosen'+'rejected'; found keys: {keys}",
    )


def _text_only(messages: list[dict], obj: dict, kind: str) -> list[dict]:
    """``messages`` of a row kind that trains on text alone; a ``RowError`` when the row holds an image."""
    if has_images(messages) or _column_images(obj):
        raise RowError("images_unsupported", f"images train in conversations (SFT) only, not in {kind}")
    return messages


def check_columns(name: str, columns: list[str], mapping: ColumnMapping | None, what: str) -> None:
    """A table (Parquet/Arrow schema, CSV header) must hold an accepted layout; else name what it holds."""
    found = ", ".join(sorted(columns)) or "none"
    if mapping is not None:
        missing = [column for column in mapping.required if column not in columns]
        if missing:
            raise DatasetFileError(
                f"{name}: {what} lacks the mapped column(s) {', '.join(missing)} ({mapping.describe()}); columns found: {found}"
            )
        return
    present = set(columns)
    layouts = ({"messages"}, {"conversations"}, {"instruction", "output"}, {"chosen", "rejected"}, {"prompt"})
    if not any(layout <= present for layout in layouts):
        raise DatasetFileError(
            f"{name}: {what} has none of the accepted layouts ({LAYOUTS}); columns found: {found}; {MAPPING_HINT}"
        )
