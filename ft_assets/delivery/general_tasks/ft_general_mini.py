"""ft-general-mini's dataset and scorer, which its task file names (``!function ft_general_mini.load``, ``.score``).

The items ship beside this file, so the task runs offline from wherever the package is installed (a task file's
``dataset_kwargs.data_files`` would be read relative to the working directory). A reply scores when it names an
accepted answer as whole words: a small chat model answers "The capital of France is Paris", not "Paris" (exact
match: none of SmolLM2-135M-Instruct's 24 replies is a bare answer). A reply that lists guesses could score too;
the task stops each reply at its first sentence's end (12 tokens at most), which keeps that rare and each reply cheap.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

ITEMS = Path(__file__).with_name("ft_general_mini.jsonl")


def load(**_settings):
    """The items as lm-eval's dataset: one ``test`` split (lm-eval passes the task's metadata, unused here)."""
    import datasets

    rows = [json.loads(line) for line in ITEMS.read_text().splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def words(text: str) -> str:
    """Lowercase words and numbers, one space apart, padded: ' the capital of france is paris '."""
    return f" {' '.join(re.findall(r'[a-z0-9]+', text.lower()))} "


def score(doc: dict, results: list[str]) -> dict[str, float]:
    """1.0 when the reply names one of the item's accepted answers, else 0.0."""
    reply = words(results[0])
    return {"names_answer": float(any(words(answer) in reply for answer in doc["answers"]))}
