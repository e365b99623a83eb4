"""Row layouts: every accepted shape of a row, parsed into one chat schema, ``messages: [{role, content}]``.

- chat:     ``{"messages": [{"role": "user", "content": "..."}, ...]}``
- ShareGPT: ``{"conversations": [{"from": "human", "value": "..."}, ...], "system": "..." (optional)}``
- alpaca:   ``{"instruction": "...", "input": "..." (optional), "output": "...", "system": "...",
  "history": [["earlier request", "earlier reply"], ...] (both optional, as LLaMA-Factory writes them)}``
- any other column names through a ``ColumnMapping`` (``raw_dataset`` config ``columns``), e.g.
  ``{prompt: question, response: answer}``.
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
        message = {"role": role, "content": _text(item[text_key], f"'{field}[{i}].{text_key}'")}
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
    optional ``input`` and ``system``; the same rules as alpaca's instruction/input/output).
    """

    messages: str | None = None
    role: str = "role"
    content: str = "content"
    prompt: str | None = None
    input: str | None = None
    response: str | None = None
    system: str | None = None

    FIELDS = ("messages", "role", "content", "prompt", "input", "response", "system")

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
        return ", ".join(f"{field}: {getattr(self, field)}" for field in fields if getattr(self, field))

    def record(self, obj: dict) -> list[dict]:
        missing = [column for column in self.required if column not in obj]
        if missing:
            keys = ", ".join(sorted(map(str, obj))[:8]) or "none"
            raise RowError(
                "unknown_format", f"expected {', '.join(missing)} (raw_dataset config columns); found keys: {keys}"
            )
        if self.messages:
            return _message_list(obj[self.messages], self.messages, self.role, self.content, SHAREGPT_ROLES)
        return _instruction_turns(
            _text(obj[self.prompt], f"'{self.prompt}'"),
            _optional_text(obj, self.input),
            _text(obj[self.response], f"'{self.response}'"),
            _optional_text(obj, self.system),
            [],
        )


# --- any row ---------------------------------------------------------------------------------------


def normalize_record(obj: object, mapping: ColumnMapping | None = None) -> list[dict]:
    """One parsed row in any accepted layout -> chat messages; raises RowError(reason, detail)."""
    if not isinstance(obj, dict):
        raise RowError("not_an_object", f"a row must be a JSON object, got {type(obj).__name__}")
    if mapping is not None:
        return mapping.record(obj)
    if "chosen" in obj and "rejected" in obj:
        return pair_messages(obj)
    if "messages" in obj:
        messages = _message_list(obj["messages"], "messages", "role", "content", None)
        if messages and messages[-1]["role"] == "user":  # a prompt: its other columns are for the reward functions
            return _with_columns(messages, obj, ("messages",))
        return messages
    if "conversations" in obj:
        return _with_system(obj, _message_list(obj["conversations"], "conversations", "from", "value", SHAREGPT_ROLES))
    if "instruction" in obj and "output" in obj:
        return _instruction_turns(
            _text(obj["instruction"], "'instruction'"),
            _optional_text(obj, "input"),
            _text(obj["output"], "'output'"),
            _optional_text(obj, "system"),
            _history(obj.get("history")),
        )
    if "prompt" in obj and "completion" not in obj:  # prompt + completion is a supervised row (TRL), not a prompt
        return prompt_messages(obj)
    keys = ", ".join(sorted(map(str, obj))[:8]) or "none"
    raise RowError(
        "unknown_format",
        f"expected 'messages', 'conversations', 'instruction'+'output' or 'chosen'+'rejected'; found keys: {keys}",
    )


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
