"""Prompts: a request (or a chat history that ends in the user's turn) for the model to answer, for GRPO.

``raw_dataset`` recognises a prompt by its shape (``ft_assets.data.layouts``: a ``prompt`` row, or a
chat row that ends in a user turn; ``ft_assets.data.kinds`` decides a version's kind). Nothing is
learned from a reference reply: the model writes its own and the run's reward functions judge them
(``ft_assets.rewards``), with the row's other columns (an ``answer``, a reference tool call) as their
evidence.

A prompt travels through the data plane as a chat row: its turns, then, when the row had other
columns, one turn of role ``columns`` holding them as a JSON object. The shared stages need no prompt
code that way: deduplication keys a row by all of its turns (the same request with another reference
is another row; shingles ignore roles), the split is the chat rows'. Cleaning (``clean_prompt``) and
tokenization (``ft_assets.data.prompt_packing``) are the two stages that read a prompt as a prompt;
the columns are never cleaned: a reward compares against them as they were written.

Bad prompts are quarantined with a reason like any row: turns out of order (``bad_role_order``: a
prompt is a conversation waiting for its reply, so after an optional system turn it alternates user
and assistant and ends with the user), ``empty_message`` / ``too_short`` / ``too_long`` as for chat.
"""

from __future__ import annotations

import json

from ft_assets.data.cleaning import CleaningRules, check_lengths, check_role_order, clean_turns, roles_of
from ft_assets.data.layouts import COLUMNS


def split_prompt(messages: list[dict]) -> tuple[list[dict], dict]:
    """A prompt's row -> (its turns, its other columns)."""
    if messages and messages[-1]["role"] == COLUMNS:
        return messages[:-1], json.loads(messages[-1]["content"])
    return messages, {}


def clean_prompt(messages: list[dict], rules: CleaningRules) -> list[dict]:
    """Clean a prompt's row: its turns under the chat rules, ending in the user turn to answer; the columns
    turn kept as it came. Raises ``RowError``."""
    turns = messages[:-1] if messages and messages[-1]["role"] == COLUMNS else messages
    cleaned = clean_turns(turns, rules)
    check_role_order(roles_of(cleaned) + ["assistant"])  # with the reply to come, a whole conversation
    check_lengths(cleaned, rules)
    return cleaned + messages[len(turns) :]
