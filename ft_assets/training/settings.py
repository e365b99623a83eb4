"""The training settings as Dagster config: TrainingConfig's fields, shown in the launchpad.

``TrainingConfig`` (``ft_assets.training.config``) is the one model of every training setting; the
recipe reads it and imports no Dagster, so it runs on a bare GPU worker. ``TrainingSettings`` is the
same set of fields as a ``dagster.Config``, derived from it (same names, defaults and help texts), so
the launchpad of ``lora_adapter`` — and of ``training_plan``, which plans for the run those settings
describe — can never drift from what the recipe accepts. Dagster config has no ``Literal``, so
choices appear as strings and ``TrainingConfig`` validates them.
"""

from __future__ import annotations

from types import UnionType
from typing import Literal, Optional, Union, get_args, get_origin

import dagster as dg
from pydantic import Field, ValidationError, create_model

from ft_assets.training.config import TrainingConfig


def _launchpad_type(annotation):
    if get_origin(annotation) is Literal:
        return str
    args = [a for a in get_args(annotation) if a is not type(None)]
    if get_origin(annotation) in (Union, UnionType) and len(args) == 1:
        return Optional[_launchpad_type(args[0])]
    return annotation


TrainingSettings = create_model(
    "TrainingSettings",
    __base__=dg.Config,
    __doc__="How to fine-tune the base model on this dataset version's shards (every field of TrainingConfig).",
    **{
        name: (
            _launchpad_type(field.annotation),
            Field(default=field.get_default(call_default_factory=True), description=field.description),
        )
        for name, field in TrainingConfig.model_fields.items()
    },
)


def training_config(settings: dg.Config, asset: str) -> TrainingConfig:
    """The validated TrainingConfig of an asset's settings (extra, non-training fields ignored)."""
    try:
        return TrainingConfig(**settings.model_dump(include=set(TrainingConfig.model_fields)))
    except ValidationError as exc:
        raise dg.Failure(f"{asset} config: {exc}") from exc
