"""What an objective is: its settings, the data it trains on, and where the planes keep its pieces.

An objective's pieces belong to the planes that run them: the row cleaner and the pack kind to the
data plane, the training step to the training plane (torch), the scorer to the delivery plane. The
objective names each as ``module:name`` (``Pieces``) and imports it the first time it is asked for, so
``ft_assets.objectives`` imports no plane: every plane imports it downward, and the data and control
planes load without torch: ``import ft_assets.data.assets, ft_assets.control.assets`` peaks at 136 MB,
against 321 MB when this module imported the steps (``/usr/bin/time``). ``test_objectives.py``'s checklist resolves every piece of every objective,
so a misspelled or moved name fails there rather than in a run.

Its settings are a pydantic model (``ObjectiveSettings``) nested in the training settings under the
objective's name (``lora_adapter: config: {dpo: {beta: 0.2}}``); the run id hashes only the settings of
the run's own objective (``TrainingConfig.result_fields``), so adding an objective changes no other
objective's run ids.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import cache
from typing import Any

from pydantic import BaseModel, ConfigDict

REFERENCE_IS_THE_BASE = (
    "trains a LoRA or QLoRA adapter: its reference policy is the base model with the adapter disabled (no second copy of the "
    "model), which method 'full' does not have; set method lora or qlora"
)


class ObjectiveSettings(BaseModel):
    """An objective's own training settings: every field with a type, a default and a help text (the launchpad's)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    def check(self, training: Any) -> None:
        """What the objective needs of the whole run beyond its own fields (a ValueError says what and how to fix
        it); called when the run is resolved, so the plan says it before any GPU is rented. Nothing by default."""


@dataclass(frozen=True)
class Pieces:
    """Where the planes keep an objective's pieces, each as ``module:name`` (imported when first used)."""

    clean_row: str  # data plane: cleaned_dataset's row cleaner, (rows, CleaningRules) -> rows
    pack_kind: str  # data plane: tokenized_shards' PackKind (how the items are tokenized and packed)
    step: str  # training plane: the recipe's TrainingStep class (loader, loss, eval)
    scorer: str  # delivery plane: eval_report's Scorer class (eval set, each model's score, the report)


@cache
def piece(reference: str) -> Any:
    """The object ``module:name`` names (imported once)."""
    module, _, name = reference.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class Objective:
    name: str  # recorded in the stats of every asset from raw_dataset on; its settings' key in the training settings
    data_kind: str  # what raw_dataset finds in the rows (ft_assets.data.kinds)
    items: str  # what one training item is, in logs: "examples", "pairs", "prompts"
    pieces: Pieces
    settings: type[ObjectiveSettings] | None = None  # its own settings; None: it has none
    learning_rate: float | None = None  # the default learning rate; None: the method's
    full_refused: str | None = None  # why method 'full' cannot train this objective; None: it can

    @property
    def clean_row(self):
        return piece(self.pieces.clean_row)

    @property
    def pack_kind(self):
        return piece(self.pieces.pack_kind)

    @property
    def step(self):
        return piece(self.pieces.step)()

    @property
    def scorer(self):
        """eval_report's scorer class: ``(metric, max_examples, max_new_tokens, this objective's settings)``."""
        return piece(self.pieces.scorer)

    def settings_in(self, training: Any) -> ObjectiveSettings | None:
        """This objective's settings in a ``TrainingConfig`` (``training.dpo``); None when it has none."""
        return getattr(training, self.name) if self.settings is not None else None
