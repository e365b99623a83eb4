"""Preference pairs: a prompt (or a chat history), a chosen and a rejected reply, for DPO.

Row layouts, recognised by ``raw_dataset`` from the keys of each row (a row with both ``chosen`` and
``rejected`` is a pair; ``pair_messages`` normalizes it):

- strings:            ``{"prompt": "...", "chosen": "...", "rejected": "...", "system": "..." (optional)}``
- conversational (TRL): ``{"prompt": [{"role": "user", "content": "..."}, ...],
  "chosen": [{"role": "assistant", "content": "..."}], "rejected": [{"role": "assistant", ...}]}``
- implicit prompt (Anthropic HH as TRL ships it): ``{"chosen": [whole conversation], "rejected":
  [whole conversation]}``: the prompt is the turns both share, then each side has one assistant reply
- LLaMA-Factory: ``{"conversations": [{"from": "human", "value": "..."}], "chosen": {"from": "gpt",
  "value": "..."}, "rejected": {...}, "system": "..." (optional)}`` and ``{"instruction": "...",
  "input": "..." (optional), "chosen": "...", "rejected": "..."}``

A pair travels through the data plane as a chat row: the prompt's turns, then the chosen reply
(role ``chosen``), then the rejected one (role ``rejected``). The shared stages need no preference
code that way: deduplication keys and shingles a row by all of its turns, so a pair is one row (the
prompt and both replies make its key: the same prompt with other replies is another pair), and the
split keeps a pair and its near-duplicates on one side. Shingles ignore roles, so a pair and the
same pair with its replies swapped (a contradicting preference) are near duplicates: the first is kept. Cleaning (``clean_pair``) and tokenization
(``ft_assets.data.pair_packing``) are the two stages that read a pair as a pair.

A dataset version holds chat rows or pairs, never both: ``dataset_kind`` refuses a file, or a
version, that mixes them, naming a row of each kind (the stages after it could not treat the rows
alike, and silently dropping one kind would hide data).

Bad pairs are quarantined with a reason like any row: a reply that is not the assistant's or a
prompt whose turns are out of order (``bad_role_order``), an empty side (``empty_answer``, the
detail says which), ``identical_answers`` (the same reply on both sides after cleanup: nothing to
prefer), plus the chat rules (``too_long``, ``too_short``, …) applied to prompt + each reply.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from ft_assets.data.cleaning import CleaningRules, clean_messages
from ft_assets.data.readers import (
    SHAREGPT_ROLES,
    DatasetFileError,
    RowError,
    _instruction_turns,
    _message_list,
    _optional_text,
    _text,
)

CHAT, PREFERENCE = "chat", "preference"  # the two kinds of dataset version
CHOSEN, REJECTED = "chosen", "rejected"  # roles of the two replies in a pair's row
_ROW_NUMBER = re.compile(r"[:#]\d+$")  # a row source is "<file>:<line>" or "<file>#<row>"


# --- layouts -> one row ----------------------------------------------------------------------------


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
        raise RowError("bad_role_order", f"the {side} reply has role {messages[0]['role']!r}; a reply is the assistant's")
    return messages[0]["content"]


def _implicit_prompt(chosen: object, rejected: object) -> tuple[list[dict], str, str]:
    """Two whole conversations: the turns they share are the prompt, the one reply after it each side's answer."""
    sides = [_message_list(value, side, "role", "content", None) for value, side in ((chosen, CHOSEN), (rejected, REJECTED))]
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
    if "instruction" in obj and "prompt" not in obj and "conversations" not in obj:  # alpaca: the same rules as for chat rows
        return _instruction_turns(_text(obj["instruction"], "'instruction'"), _optional_text(obj, "input"), "", system, [])[:-1]
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
        raise RowError("unknown_format", f"a pair needs a 'prompt' (or two whole conversations as chosen/rejected); found keys: {keys}")
    return prompt + [{"role": CHOSEN, "content": chosen}, {"role": REJECTED, "content": rejected}]


def split_pair(messages: list[dict]) -> tuple[list[dict], str, str]:
    """A pair's row -> (prompt turns, chosen reply, rejected reply)."""
    return messages[:-2], messages[-2]["content"], messages[-1]["content"]


def is_pair(messages: list[dict]) -> bool:
    return len(messages) >= 2 and messages[-1]["role"] == REJECTED and messages[-2]["role"] == CHOSEN


# --- which kind a version is -----------------------------------------------------------------------


def _ends_in_rejected(messages) -> np.ndarray:
    """Whether each row's last turn is a rejected reply, from the Arrow column without converting rows to Python."""
    import pyarrow.compute as pc

    offsets = messages.offsets.to_numpy()
    rejected = pc.equal(messages.values.field("role"), REJECTED).to_numpy(zero_copy_only=False)
    ends = offsets[1:]
    found = np.zeros(len(ends), dtype=bool)
    filled = ends > offsets[:-1]
    found[filled] = rejected[ends[filled] - 1]
    return found


def dataset_kind(rows_path: Path) -> str:
    """``PREFERENCE`` when the parsed rows are pairs, ``CHAT`` when they are conversations.

    A file that holds both, or a version whose files are of both kinds, is refused with a
    ``DatasetFileError`` naming a row of each kind.
    """
    from ft_assets.data.rows import iter_batches

    first: dict[str, dict[str, str]] = {}  # file -> kind -> its first row's source
    for batch in iter_batches(rows_path, columns=["source", "messages"]):
        kinds = np.where(_ends_in_rejected(batch.column("messages")), PREFERENCE, CHAT)
        for source, kind in zip(batch.column("source").to_pylist(), kinds.tolist()):
            first.setdefault(_ROW_NUMBER.sub("", source), {}).setdefault(kind, source)
    for file, seen in first.items():
        if len(seen) == 2:
            raise DatasetFileError(
                f"{file} mixes chat rows ({seen[CHAT]}) and preference pairs with 'chosen' and 'rejected' "
                f"({seen[PREFERENCE]}); a dataset version holds one kind: put them in two files and register two versions"
            )
    kinds = {kind: file for file, seen in first.items() for kind in seen}
    if len(kinds) == 2:
        raise DatasetFileError(
            f"the version mixes chat files ({kinds[CHAT]}) and preference files ({kinds[PREFERENCE]}); "
            "a dataset version holds one kind: register them as two versions"
        )
    return PREFERENCE if PREFERENCE in kinds else CHAT


# --- cleaning ----------------------------------------------------------------------------------------


def clean_pair(messages: list[dict], rules: CleaningRules) -> list[dict]:
    """Clean a pair's row: prompt + each reply under the chat rules (``clean_messages``), then the pair's own.

    Raises ``RowError``; a problem of the rejected side says so in its detail.
    """
    prompt, chosen, rejected = split_pair(messages)
    kept = clean_messages(prompt + [{"role": "assistant", "content": chosen}], rules)
    try:
        other = clean_messages(prompt + [{"role": "assistant", "content": rejected}], rules)
    except RowError as exc:
        raise RowError(exc.reason, f"rejected reply: {exc.detail}") from exc
    if kept[-1]["content"] == other[-1]["content"]:
        raise RowError("identical_answers", "the chosen and the rejected reply are the same after cleanup: nothing to prefer")
    return kept[:-1] + [{"role": CHOSEN, "content": kept[-1]["content"]}, {"role": REJECTED, "content": other[-1]["content"]}]
