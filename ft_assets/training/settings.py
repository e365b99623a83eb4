"""The training settings as Dagster config: TrainingConfig's fields, shown in the launchpad.

``TrainingConfig`` (``ft_assets.training.config``) is the one model of every training setting; the
recipe reads it and imports no Dagster, so it runs on a bare GPU worker. ``TrainingSettings`` is the
same set of fields as a ``dagster.Config``, derived from it (same names, defaults and help texts), so
the launchpad of ``lora_adapter`` can never drift from what the recipe accepts. Users set them there
only: ``run_training_config`` reads them from a run's config for everything else that needs them
(``training_plan``, the pool launcher's GPU request, ``ft-assets run``'s plan). Each objective's
settings, a nested model in ``TrainingConfig``, are a nested ``dagster.Config`` here (``dpo: {beta: 0.2}``
in the launchpad, every field with its help text). Dagster config has no ``Literal`` and no bounds, so
choices appear as strings and ``TrainingConfig`` validates them and the ranges, in one line (``validated``).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import UnionType
from typing import Any, Literal, Optional, Union, get_args, get_origin

import dagster as dg
from pydantic import BaseModel, Field, create_model

from ft_assets.training.config import TrainingConfig, validated


def _launchpad_type(annotation):
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return launchpad_config(annotation)
    if get_origin(annotation) is Literal:
        return str
    args = [a for a in get_args(annotation) if a is not type(None)]
    if get_origin(annotation) in (Union, UnionType) and len(args) == 1:
        return Optional[_launchpad_type(args[0])]
    return annotation


def launchpad_config(model: type[BaseModel], name: str | None = None, doc: str | None = None) -> type[dg.Config]:
    """``model``'s fields as a ``dagster.Config`` (same names, defaults and help texts; nested models nested)."""
    fields = {}
    for field_name, field in model.model_fields.items():
        kind = _launchpad_type(field.annotation)
        default = field.get_default(call_default_factory=True)
        if isinstance(default, BaseModel):
            default = kind(**default.model_dump())
        fields[field_name] = (kind, Field(default=default, description=field.description))
    return create_model(name or model.__name__, __base__=dg.Config, __doc__=doc or model.__doc__, **fields)


TrainingSettings = launchpad_config(
    TrainingConfig,
    "TrainingSettings",
    "How to fine-tune the base model on this dataset version's shards (every field of TrainingConfig).",
)


def training_config(settings: dg.Config, asset: str) -> TrainingConfig:
    """The validated TrainingConfig of an asset's settings (extra, non-training fields ignored)."""
    try:
        return validated(settings.model_dump(include=set(TrainingConfig.model_fields)))
    except ValueError as exc:
        raise dg.Failure(f"{asset} config: {exc}") from exc


TRAINING_ASSET = "lora_adapter"  # the asset whose config holds a run's training settings


def run_training_config(run_config: Mapping[str, Any]) -> TrainingConfig:
    """The training settings a run trains with: its run config's ``ops.lora_adapter.config`` as a TrainingConfig,
    the defaults for what it leaves out (all of them in a run without lora_adapter).

    The one reader of them outside lora_adapter itself: ``training_plan`` (which plans the run it is part of), the
    pool launcher's GPU request and ``ft-assets run``'s plan before it submits training all call it. A ValueError
    names each setting that is wrong, on one line.
    """
    settings = ((run_config.get("ops") or {}).get(TRAINING_ASSET) or {}).get("config") or {}
    try:
        return validated(settings)
    except ValueError as exc:
        raise ValueError(f"ops.{TRAINING_ASSET}.config: {exc}") from None
