"""Reward functions: what a GRPO run maximises and what ``eval_report`` scores replies with.

A reward function has TRL's signature, so functions written for TRL's ``GRPOTrainer`` work unchanged::

    def reward(prompts: list[list[dict]], completions: list[list[dict]], **columns) -> list[float | None]

- ``prompts``: each completion's prompt, as chat turns (``[{"role": "user", "content": ...}, ...]``);
- ``completions``: each completion as TRL's conversational format, ``[{"role": "assistant", "content": text}]``;
- ``columns``: the prompt rows' other columns (``answer``, a reference tool call, …), one list per
  column name, aligned with the completions (None where a row lacks that column);
- returns one float per completion, or None where the function does not apply to it (TRL's
  convention: a completion no function applies to gets no advantage).

Functions are named in the ``rewards`` training setting as ``module:function`` (importable where the
worker runs) or ``path/to/file.py:function``; a run's reward is their sum, as in TRL. ``load_rewards``
resolves them once and refuses an unknown module, file or function with what to write instead.

Built in, for the tool-call case (``ft_assets.rewards:<name>``): the reference is the row's ``answer``
column, a tool call ``{"name": ..., "arguments": {...}}`` as an object or as its JSON text.

| function | reward of a reply |
|---|---|
| ``tool_call_json`` | 1 if the reply is one JSON object with a string ``name`` and an object ``arguments``, else 0 |
| ``tool_call_name`` | 1 if its ``name`` is the reference's, else 0 |
| ``tool_call_arguments`` | the share of arguments it gets right: equal (key, value) pairs over the larger of the two argument counts |
| ``tool_call_format`` | partial credit, 0.2 each: starts with ``{``, ends with ``}``, mentions ``"name"``, mentions ``"arguments"``, no longer than twice the reference |

``tool_call_format`` is what a model far from the task can climb first (each check is a few tokens),
and the others then reward the call itself. A reply is stripped of surrounding whitespace first.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

RewardFn = Callable[..., list]
REFERENCE_COLUMN = "answer"  # where the built-in tool-call rewards find the reference call
FORMAT_CHECKS = 5  # tool_call_format's checks, 1 / 5 of the reward each


@dataclass(frozen=True)
class Reward:
    name: str  # as written in the settings: "module:function" or "path/to/file.py:function"
    fn: RewardFn


def load_reward(spec: str) -> Reward:
    """The function ``spec`` names (``module:function`` or ``path/to/file.py:function``); ValueError says what is wrong."""
    target, _, name = spec.rpartition(":")
    if not target or not name:
        raise ValueError(f"rewards: {spec!r} is not 'module:function' or 'path/to/file.py:function'")
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise ValueError(
                f"rewards: {spec!r}: no file {path.resolve()}; give a path that exists where the run executes"
            )
        module_spec = importlib.util.spec_from_file_location(f"ft_rewards_{path.stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise ValueError(
                f"rewards: {spec!r}: cannot import {target!r} ({exc}); install it, or name a file as path/to/file.py:function"
            ) from exc
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"rewards: {spec!r}: {target} has no function {name!r}")
    return Reward(spec, fn)


def load_rewards(specs: list[str]) -> list[Reward]:
    return [load_reward(spec) for spec in specs]


def score(
    rewards: list[Reward], prompts: list[list[dict]], replies: list[str], columns: list[dict]
) -> list[list[float]]:
    """Each reward function's reward of each reply (NaN where it returned None), one list per function.

    ``prompts`` and ``columns`` are each reply's prompt turns and its row's other columns, aligned with ``replies``.
    """
    completions = [[{"role": "assistant", "content": reply}] for reply in replies]
    names = sorted({name for row in columns for name in row})
    kwargs = {name: [row.get(name) for row in columns] for name in names}
    scored = []
    for reward in rewards:
        values = reward.fn(prompts=prompts, completions=completions, **kwargs)
        if not isinstance(values, list | tuple) or len(values) != len(replies):
            got = f"{len(values)} values" if isinstance(values, list | tuple) else type(values).__name__
            raise ValueError(
                f"reward {reward.name} returned {got} for {len(replies)} completions; return one float (or None) each"
            )
        try:
            scored.append([math.nan if value is None else float(value) for value in values])
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"reward {reward.name} returned a non-number ({exc}); return one float (or None) each"
            ) from exc
    return scored


def totals(scored: list[list[float]]) -> list[float]:
    """Each reply's reward: the sum over the functions that applied to it (NaN when none did), as TRL sums them."""
    out = []
    for values in zip(*scored):
        applied = [value for value in values if not math.isnan(value)]
        out.append(sum(applied) if applied else math.nan)
    return out


# --- built-in rewards for tool calls ---------------------------------------------------------------


def _text(completion) -> str:
    """A completion's text, in TRL's conversational format or as a plain string."""
    return (completion[0]["content"] if isinstance(completion, list) else completion).strip()


def parse_call(text) -> dict | None:
    """A tool call ``{"name": str, "arguments": {...}}`` from an object or its JSON text; None if it is not one."""
    if isinstance(text, str):
        try:
            text = json.loads(text)
        except json.JSONDecodeError:
            return None
    if isinstance(text, dict) and isinstance(text.get("name"), str) and isinstance(text.get("arguments"), dict):
        return text
    return None


def _calls(completions, answer) -> list[tuple[dict | None, dict | None]]:
    references = answer if answer is not None else [None] * len(completions)
    return [
        (parse_call(_text(c)), parse_call(ref) if ref is not None else None) for c, ref in zip(completions, references)
    ]


def tool_call_json(prompts, completions, **columns) -> list[float]:
    """1 if the reply is one JSON tool call (an object with a string ``name`` and an object ``arguments``), else 0."""
    return [float(parse_call(_text(c)) is not None) for c in completions]


def tool_call_name(prompts, completions, answer=None, **columns) -> list[float | None]:
    """1 if the reply calls the reference's function, else 0; None for a row without a reference."""
    return [
        None if ref is None else float(call is not None and call["name"] == ref["name"])
        for call, ref in _calls(completions, answer)
    ]


def tool_call_arguments(prompts, completions, answer=None, **columns) -> list[float | None]:
    """The share of the reference's arguments the reply gets right: equal (key, value) pairs over the larger of the
    two argument counts (a missing or an extra argument costs alike); None for a row without a reference."""
    out: list[float | None] = []
    for call, ref in _calls(completions, answer):
        if ref is None:
            out.append(None)
        elif call is None:
            out.append(0.0)
        else:
            expected, given = ref["arguments"], call["arguments"]
            right = sum(1 for key, value in expected.items() if key in given and given[key] == value)
            out.append(right / max(len(expected), len(given)) if expected or given else 1.0)
    return out


def tool_call_format(prompts, completions, answer=None, **columns) -> list[float]:
    """Partial credit for the shape of a tool call, 1/5 each: starts with ``{``, ends with ``}``, mentions ``"name"``,
    mentions ``"arguments"``, and is no longer than twice the reference (than 200 characters without one)."""
    references = answer if answer is not None else [None] * len(completions)
    out = []
    for completion, ref in zip(completions, references):
        text = _text(completion)
        limit = 2 * len(ref if isinstance(ref, str) else json.dumps(ref)) if ref is not None else 200
        checks = (
            text.startswith("{"),
            text.endswith("}"),
            '"name"' in text,
            '"arguments"' in text,
            0 < len(text) <= limit,
        )
        out.append(sum(checks) / FORMAT_CHECKS)
    return out
