"""Preference pairs: a prompt (or a chat history), a chosen and a rejected reply, for DPO.

``raw_dataset`` recognises a pair by its keys (a row with both ``chosen`` and ``rejected``;
``ft_assets.data.layouts`` lists the accepted layouts and parses them).

A pair travels through the data plane as a chat row: the prompt's turns, then the chosen reply
(role ``chosen``), then the rejected one (role ``rejected``). The shared stages need no preference
code that way: deduplication keys and shingles a row by all of its turns, so a pair is one row (the
prompt and both replies make its key: the same prompt with other replies is another pair), and the
split keeps a pair and its near-duplicates on one side. Shingles ignore roles, so a pair and the
same pair with its replies swapped (a contradicting preference) are near duplicates: the first is kept. Cleaning (``clean_pair``) and tokenization
(``ft_assets.data.pair_packing``) are the two stages that read a pair as a pair.

A dataset version holds chat rows or pairs, never both: ``ft_assets.data.kinds.dataset_kind`` refuses a
file, or a version, that mixes them, naming a row of each kind (the stages after it could not treat the
rows alike, and silently dropping one kind would hide data).

Bad pairs are quarantined with a reason like any row: a reply that is not the assistant's or a
prompt whose turns are out of order (``bad_role_order``), an empty side (``empty_answer``, the
detail says which), ``identical_answers`` (the same reply on both sides after cleanup: nothing to
prefer), plus the chat rules (``too_long``, ``too_short``, …) applied to prompt + each reply.
"""

from __future__ import annotations

from ft_assets.data.cleaning import CleaningRules, clean_messages
from ft_assets.data.layouts import CHOSEN, REJECTED
from ft_assets.data.rows import RowError

# --- a pair's row ------------------------------------------------------------------------------------


def split_pair(messages: list[dict]) -> tuple[list[dict], str, str]:
    """A pair's row -> (prompt turns, chosen reply, rejected reply)."""
    return messages[:-2], messages[-2]["content"], messages[-1]["content"]


def is_pair(messages: list[dict]) -> bool:
    return len(messages) >= 2 and messages[-1]["role"] == REJECTED and messages[-2]["role"] == CHOSEN


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
        raise RowError(
            "identical_answers", "the chosen and the rejected reply are the same after cleanup: nothing to prefer"
        )
    return kept[:-1] + [
        {"role": CHOSEN, "content": kept[-1]["content"]},
        {"role": REJECTED, "content": other[-1]["content"]},
    ]
