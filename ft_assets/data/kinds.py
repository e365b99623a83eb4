"""The kind of a dataset version: conversations, preference pairs or prompts, found once from its rows.

``raw_dataset`` parses every row into the one chat schema (``ft_assets.data.layouts``) and then asks
``dataset_kind`` what the version holds; the objective follows from the answer
(``ft_assets.objectives``: chat -> SFT, preference -> DPO, prompt -> GRPO). A row's kind is read from
its last turn alone:

| last turn | row kind |
|---|---|
| ``rejected`` | a preference pair (``ft_assets.data.preference``) |
| ``user``, or the ``columns`` turn of a prompt's extra columns | a prompt (``ft_assets.data.prompts``) |
| anything else (an assistant reply) | a conversation |

A file's kind: pairs only -> ``PREFERENCE``; any conversation -> ``CHAT`` (its rows that end in a
user turn are conversations that lost their reply, quarantined by cleaning as ``no_assistant_reply``,
as they always were: the shipped sample has ten); prompts only -> ``PROMPT``. A file that holds pairs
and other rows, or a version whose files are of two kinds, is refused with a ``DatasetFileError``
naming a row (or file) of each: the stages after this one could not treat the rows alike, and
silently dropping one kind would hide data.

The workers that parse the rows (``ft_assets.data.readers``, ``ft_assets.data.mixture``) find the first row
of each kind in every part they write (``first_of_each_kind``): one pass over the ``messages`` column
in Arrow (the last role of each row from the list offsets), without converting rows to Python, ~0.1 s
per million rows. The driver only adds up those few sources a part and decides (``dataset_kind``).
"""

from __future__ import annotations

import re

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ft_assets.data.layouts import COLUMNS, REJECTED
from ft_assets.data.rows import DatasetFileError

CHAT, PREFERENCE, PROMPT = "chat", "preference", "prompt"  # the kinds of dataset version
WHAT = {
    CHAT: "chat rows",
    PREFERENCE: "preference pairs with 'chosen' and 'rejected'",
    PROMPT: "prompts (rows that end in a user turn)",
}
_ROW_NUMBER = re.compile(r"[:#]\d+$")  # a row source is "<file>:<line>" or "<file>#<row>"


def row_kinds(messages) -> np.ndarray:
    """Each row's kind (``CHAT``, ``PREFERENCE``, ``PROMPT``) from its last turn's role, read from the Arrow
    ``messages`` column without converting rows to Python; a row without turns is a (broken) conversation."""
    messages = messages.combine_chunks() if isinstance(messages, pa.ChunkedArray) else messages
    offsets = messages.offsets.to_numpy()
    roles = messages.values.field("role")
    pair = pc.equal(roles, REJECTED).to_numpy(zero_copy_only=False)
    prompt = pc.is_in(roles, value_set=pa.array(["user", COLUMNS])).to_numpy(zero_copy_only=False)
    ends = offsets[1:]
    filled = ends > offsets[:-1]
    last = ends[filled] - 1
    kinds = np.full(len(ends), CHAT, dtype=object)
    kinds[filled] = np.where(pair[last], PREFERENCE, np.where(prompt[last], PROMPT, CHAT))
    return kinds


def first_of_each_kind(table: pa.Table) -> dict[str, str]:
    """The source of the first row of each kind among ``table``'s rows (``source`` and ``messages`` columns):
    {kind: source}, at most three entries. A data-plane task computes it for the rows of one part of an input
    file (``ft_assets.data.readers``) or of a mixture (``ft_assets.data.mixture``); the driver adds them up."""
    if not table.num_rows:
        return {}
    kinds = row_kinds(table.column("messages"))
    found = {}
    for kind in (CHAT, PREFERENCE, PROMPT):
        rows = kinds == kind
        if rows.any():
            found[kind] = table.column("source")[int(np.argmax(rows))].as_py()
    return found


def source_file(source: str) -> str:
    """The file of a row's source (``<file>:<line>`` or ``<file>#<row>``)."""
    return _ROW_NUMBER.sub("", source)


def _file_kind(file: str, seen: dict[str, str]) -> str:
    """The kind of one file from the first row of each kind it holds; refuses pairs mixed with other rows."""
    if PREFERENCE in seen and len(seen) > 1:
        other = CHAT if CHAT in seen else PROMPT
        raise DatasetFileError(
            f"{file} mixes {WHAT[other]} ({seen[other]}) and {WHAT[PREFERENCE]} ({seen[PREFERENCE]}); a dataset version "
            "holds one kind: put them in two files and register two versions"
        )
    return next(kind for kind in (PREFERENCE, CHAT, PROMPT) if kind in seen)


def dataset_kind(first_rows: dict[str, dict[str, str]]) -> str:
    """``PREFERENCE``, ``PROMPT`` or ``CHAT``: what a version's parsed rows are, from the first row of each kind of
    every file ({file: {kind: source}}, ``first_of_each_kind``; the module docstring has the rules). A file, or a
    version, that mixes kinds is refused with a ``DatasetFileError`` naming a row (or file) of each."""
    files: dict[str, str] = {}  # file kind -> its first file
    for file, seen in first_rows.items():
        if seen:
            files.setdefault(_file_kind(file, seen), file)
    if len(files) == 2:
        (a, file_a), (b, file_b) = sorted(files.items(), key=lambda item: (CHAT, PREFERENCE, PROMPT).index(item[0]))
        raise DatasetFileError(
            f"the version mixes {a} files ({file_a}) and {b} files ({file_b}); "
            "a dataset version holds one kind: register them as two versions"
        )
    if len(files) == 3:
        raise DatasetFileError(
            f"the version mixes chat, preference and prompt files ({', '.join(files.values())}); register one version per kind"
        )
    return next(iter(files), CHAT)
