"""Row cleaning: unicode normalization, control-character and whitespace cleanup, filters, role order.

``clean_messages`` either returns the cleaned messages or raises ``RowError(reason, detail)``; the
stage turns every raise into a quarantine record, so no row is ever silently dropped. Each worker
writes the kept rows and the quarantine of the parts it cleans (``ft_assets.data.parts``).

Normalization is NFC by default, not NFKC: NFKC folds "²" to "2" and full-width forms to ASCII,
which changes the meaning of math and code. Control characters (Unicode category Cc, except tab and
newline) and zero-width characters are removed, exotic spaces become ' ', CRLF becomes LF, trailing
whitespace is stripped per line and runs of 3+ newlines collapse to 2. Indentation is kept (code).

Role order: an optional leading system message, then user/assistant strictly alternating, starting
with user and ending with assistant. Prompts (``ft_assets.data.prompts``) follow the same order, ending
with the user turn whose reply the model is to write.
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import pyarrow as pa

from ft_assets.data.layouts import COLUMNS
from ft_assets.data.parallel import Executor, InProcess
from ft_assets.data.parts import Artifact, Part, Target, Written, part_name, read_part, runs
from ft_assets.data.rows import QUARANTINE_SCHEMA, ROW_SCHEMA, RowError, plain

ROLES = ("system", "user", "assistant", "tool")
ZERO_WIDTH = dict.fromkeys(map(ord, "\u200b\u200c\u200d\u2060\ufeff"))
_CONTROL = {c: None for c in range(0x20) if chr(c) not in "\t\n"} | {0x7F: None} | {c: None for c in range(0x80, 0xA0)}
_DELETE = ZERO_WIDTH | _CONTROL  # both tables only delete, so one pass equals the two in a row
_ASCII_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")  # the part of _CONTROL an ASCII text can hold
_SPACES = re.compile(r"[\u00a0\u1680\u2000-\u200a\u202f\u205f\u3000]")
_TRAILING = re.compile(r"[ \t]+\n")
_BLANK_RUNS = re.compile(r"\n{3,}")


@dataclass(frozen=True)
class CleaningRules:
    unicode_form: str = "NFC"
    min_chars: int = 1  # per user/assistant message, after cleanup
    max_chars: int = 32_000  # whole conversation; longer rows rarely fit a training sequence anyway
    min_response_chars: int = 1  # an assistant reply shorter than this teaches nothing


def clean_text(text: str, unicode_form: str = "NFC") -> str:
    """Line ends, control/zero-width characters, Unicode form, exotic spaces, blank runs, in that order.

    Each step runs only when the text can hold what it fixes: an ASCII string (90% of the messages
    of the benchmark corpus; CPython knows it without a scan) is its own normal form in every form
    and holds no zero-width character or exotic space, and the regexes run only when their pattern
    can match. The result is the same as running every step, in 7 µs a message of the benchmark
    corpus instead of 30 µs (``make bench``).
    """
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    if not text.isascii():
        # Deleted first: a zero-width character between a letter and its accent would keep them apart.
        text = unicodedata.normalize(unicode_form, text.translate(_DELETE))
        text = _SPACES.sub(" ", text)
    elif _ASCII_CONTROL.search(text):
        text = text.translate(_DELETE)
    if " \n" in text or "\t\n" in text:
        text = _TRAILING.sub("\n", text)
    if "\n\n\n" in text:
        text = _BLANK_RUNS.sub("\n\n", text)
    return text.strip()


CALLS = "assistant+tool_calls"  # an assistant reply that calls tools, in check_role_order's roles


def roles_of(messages: list[dict]) -> list[str]:
    return [CALLS if m["role"] == "assistant" and m.get("tool_calls") else m["role"] for m in messages]


def check_role_order(roles: list[str]) -> None:
    """user, assistant, user, ... after an optional system turn, ending with an assistant reply; a reply that calls
    tools (``CALLS``) is followed by one or more tool results, then by the assistant again."""
    for i, role in enumerate(roles):
        if role not in (*ROLES, CALLS):
            raise RowError("unknown_role", f"message {i} has role {role!r}; expected one of {', '.join(ROLES)}")
    turns = roles[1:] if roles and roles[0] == "system" else roles
    if not turns:
        raise RowError("no_assistant_reply", "the conversation has no user/assistant turns")
    after = {None: ("user",), "user": ("assistant", CALLS), "assistant": ("user",), CALLS: ("tool",),
             "tool": ("tool", "assistant", CALLS)}  # fmt: skip
    previous = None
    for i, role in enumerate(turns):
        if role not in after[previous]:
            where = i + (len(roles) - len(turns))
            expected = " or ".join(repr(r.split("+")[0]) for r in dict.fromkeys(after[previous]))
            raise RowError("bad_role_order", f"message {where} is {role.split('+')[0]!r} where {expected} was expected")
        previous = role
    if turns[-1] != "assistant":
        raise RowError("no_assistant_reply", "the conversation does not end with an assistant reply")


def clean_turns(messages: list[dict], rules: CleaningRules) -> list[dict]:
    """Each turn's role lowercased and its text cleaned (``clean_text``); empty system prompts dropped."""
    cleaned = []
    for message in messages:
        role = message["role"].strip().lower()
        content = clean_text(message["content"], rules.unicode_form)
        if role == "system" and not content:
            continue  # an empty system prompt carries nothing; the row itself is fine
        thinking = clean_text(message["thinking"], rules.unicode_form) if message.get("thinking") else ""
        extra = {"thinking": thinking} if thinking else {}
        if message.get("tool_calls"):
            extra["tool_calls"] = message["tool_calls"]
        if message.get("images"):  # stored references, each standing at an <image> marker the cleanup keeps
            extra["images"] = message["images"]
        cleaned.append({"role": role, "content": content, **extra})
    return cleaned


def check_lengths(cleaned: list[dict], rules: CleaningRules) -> None:
    """The length rules: every reply and user turn long enough, the whole conversation short enough."""
    for i, message in enumerate(cleaned):
        if message["role"] == "assistant" and message.get("tool_calls"):
            continue  # a call may come without text
        if message["role"] == "assistant" and len(message["content"]) < max(rules.min_response_chars, 1):
            reason = "empty_answer" if not message["content"] else "too_short"
            raise RowError(reason, f"assistant message {i} has {len(message['content'])} characters")
        if message["role"] == "user" and len(message["content"]) < max(rules.min_chars, 1):
            reason = "empty_message" if not message["content"] else "too_short"
            raise RowError(reason, f"user message {i} has {len(message['content'])} characters")
    total = sum(len(m["content"]) for m in cleaned)
    if total > rules.max_chars:
        raise RowError("too_long", f"{total} characters in total, limit is {rules.max_chars}")


def clean_messages(messages: list[dict], rules: CleaningRules) -> list[dict]:
    if messages and messages[-1]["role"] == COLUMNS:  # a prompt with extra columns, among conversations: no reply
        raise RowError("no_assistant_reply", "the conversation does not end with an assistant reply")
    cleaned = clean_turns(messages, rules)
    check_role_order(roles_of(cleaned))
    check_lengths(cleaned, rules)
    return cleaned


@dataclass(frozen=True)
class CleanedPart:
    """What cleaning made of one part: the parts written (kept rows, quarantined rows) and its counts."""

    rows: Written
    quarantine: Written
    reasons: dict[str, int]
    changed: int  # rows that cleanup modified


def clean_part(rules: CleaningRules, clean: Callable, part: Part, target: Target) -> CleanedPart:
    """One part of raw rows through ``clean``; its kept and its quarantined rows written as part files of their own."""
    kept, quarantined, reasons, changed = [], [], Counter(), 0
    table = read_part(part)
    for source, original in zip(table.column("source").to_pylist(), map(plain, table.column("messages").to_pylist())):
        try:
            messages = clean(original, rules)
        except RowError as exc:
            reasons[exc.reason] += 1
            raw = json.dumps(original, ensure_ascii=False)[:2000]
            quarantined.append(
                {"source": source, "stage": "clean", "reason": exc.reason, "detail": exc.detail, "raw": raw}
            )
            continue
        changed += messages != original
        kept.append({"source": source, "cluster": "", "messages": messages})
    quarantine = pa.Table.from_pylist(quarantined, schema=QUARANTINE_SCHEMA)
    return CleanedPart(
        target.put_table(part_name("rows", part.index), pa.Table.from_pylist(kept, schema=ROW_SCHEMA), ROW_SCHEMA),
        target.put_table(part_name("quarantine", part.index), quarantine, QUARANTINE_SCHEMA),
        dict(reasons),
        changed,
    )


def clean_run(settings: tuple[CleaningRules, Callable, Target], run: list[Part]) -> list[CleanedPart]:
    """A run of parts through ``clean_part`` (a data-plane task, ``fn(common, shard)``)."""
    rules, clean, target = settings
    return [clean_part(rules, clean, part, target) for part in run]


def clean_dataset(
    raw: Artifact,
    out: Artifact,
    rules: CleaningRules,
    executor: Executor | None = None,
    clean: Callable = clean_messages,
) -> dict:
    """The ``rows`` parts of ``raw`` through ``clean`` (``clean_messages``, or ``preference.clean_pair`` for a
    version of preference pairs, ``prompts.clean_prompt`` for one of prompts) into the ``rows`` and ``quarantine`` parts of ``out``, a run of parts a task on
    ``executor`` (default: this process); rows keep their order."""
    executor = executor or InProcess()
    reasons: Counter[str] = Counter()
    kept = quarantined = changed = 0
    tasks = list(runs(raw.parts("rows", executor), lambda part: part.rows, executor.shard_rows))
    for run in executor.map(clean_run, tasks, (rules, clean, out.target(executor))):
        for part in run:
            out.add(part.rows, part.quarantine)
            kept, quarantined, changed = (
                kept + part.rows.rows,
                quarantined + part.quarantine.rows,
                changed + part.changed,
            )
            reasons.update(part.reasons)
    return {
        "rows_kept": kept,
        "rows_quarantined": quarantined,
        "quarantine_reasons": dict(reasons),
        "rows_modified": changed,
    }
