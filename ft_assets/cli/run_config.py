"""The run config of ``ft-assets run``: one YAML for the whole pipeline, checked up front, split per plane.

A user writes one run config (``ops:`` keyed by asset name, ``resources:``, ...); each plane's job
accepts only its own assets, so ``select_ops`` hands each job its part. The training settings are
``lora_adapter``'s alone: ``training_plan`` runs in the same (training plane's) run and reads them from
there (``ft_assets.training.settings.run_training_config``). ``config_mistakes`` checks the whole config
against every plane's job before anything is registered or run, with Dagster's own validation
(``dagster.validate_run_config``) as the judge: a mistake at any depth is one line naming the asset or
resource, the key path, and the keys accepted there with the closest match (``difflib``). Without it, a
misspelled ``lora_adapter`` key surfaced minutes later as an "internal error" of a plane's job, and a
misspelled asset name under ``ops`` was silently ignored.

The lines are made from the structure of Dagster's errors and schema: ``DagsterInvalidConfigError``'s
``errors`` (reason, key path, offending field) and the job's ``run_config_schema`` (the keys accepted
at a path). Those attributes are not marked public (no private module is imported); Dagster is pinned
(1.13.27), and test_cli.py's table of mistakes fails if they change.
"""

from __future__ import annotations

import difflib
from pathlib import Path

import dagster as dg
import yaml

from ft_assets.cli.output import CliError
from ft_assets.layout import VERSION_ASSETS
from ft_assets.partitions import InvalidDatasetId, validate_part
from ft_assets.delivery.config import MOVED as MOVED_ASSET_KEYS  # (asset, key) -> the key's new path
from ft_assets.training.config import MOVED as MOVED_TRAINING_KEYS  # a flat training key -> its place in the config


def load_run_config(path: str | None) -> dict:
    if not path:
        return {}
    try:
        loaded = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise CliError(f"cannot read run config {path}: {exc}") from exc
    if not isinstance(loaded, dict) or not isinstance(loaded.get("ops") or {}, dict):
        raise CliError(
            f"run config {path} must be a mapping with an 'ops:' section mapping asset names to their settings"
        )
    return loaded


def set_data_executor(run_config: dict, workers: int | None, ray_address: str | None) -> None:
    """``--data-workers`` and ``--ray-address`` into the run config's ``data_executor`` resource, over the config file's."""
    settings = {
        name: value for name, value in (("workers", workers), ("ray_address", ray_address)) if value is not None
    }
    if settings:
        resource = run_config.setdefault("resources", {}).setdefault("data_executor", {})
        resource.setdefault("config", {}).update(settings)


def steps_in_one_process(run_config: dict) -> dict:
    """A submitted run's config: its steps one after another in its worker process, as ``--in-process`` runs them,
    unless the config file has an ``execution`` section.

    Dagster's default executor starts a process per step, and each imports torch, transformers and
    ft_assets (about 5 s of CPU): 7 processes for the data plane, whose steps wait
    for one another anyway (the data executor parallelizes inside a step).
    """
    return run_config if "execution" in run_config else {**run_config, "execution": {"config": {"in_process": {}}}}


def select_ops(job: dg.JobDefinition, run_config: dict) -> dict:
    """``run_config`` with only the ops ``job`` has (every other section as it is)."""
    config = {k: v for k, v in run_config.items() if k != "ops"}
    names = set(accepted_keys(job, ["ops"]))
    selected = {k: v for k, v in run_config.get("ops", {}).items() if k in names}
    if selected:
        config["ops"] = selected
    return config


def config_type_at(job: dg.JobDefinition, path: list[str]):
    """The config type of ``job``'s run config schema at ``path`` (``[i]`` steps into a list or map)."""
    config_type = job.run_config_schema.config_type
    for step in path:
        config_type = (
            config_type.fields[step].config_type if not step.startswith("[") else unwrap(config_type).inner_type
        )
        config_type = unwrap(config_type)
    return config_type


def unwrap(config_type):
    """The type inside ``Noneable`` (an optional setting)."""
    while config_type.kind.value == "NONEABLE":
        config_type = config_type.inner_type
    return config_type


def accepted_keys(job: dg.JobDefinition, path: list[str]) -> list[str]:
    return sorted(config_type_at(job, path).fields)


def stack_path(stack) -> list[str]:
    """A Dagster evaluation stack as a key path: field names, ``[i]`` for a list item or a map entry."""
    path = []
    for entry in stack.entries:
        if hasattr(entry, "field_name"):
            path.append(entry.field_name)
        elif hasattr(entry, "list_index"):
            path.append(f"[{entry.list_index}]")
        elif hasattr(entry, "map_key"):
            path.append(f"[{entry.map_key}]")
    return path


def dotted(path: list[str]) -> str:
    return ".".join(path).replace(".[", "[") or "the top level"


def subject(path: list[str]) -> str:
    """What a key path belongs to, in the user's words: ``asset lora_adapter``, ``resource store``, ..."""
    kinds = {"ops": "asset", "resources": "resource", "loggers": "logger"}
    if len(path) >= 2 and path[0] in kinds:
        return f"{kinds[path[0]]} {path[1]}"
    return path[0] if path else "run config"


def unknown_key(path: list[str], name: str, accepted: list[str]) -> str:
    new = MOVED_TRAINING_KEYS.get(name)
    if new and path[-1:] == ["config"] and new.split(".")[0] in accepted:
        return f"{subject(path)}: {name} is now {new} ({dotted([*path, *new.split('.')])})"
    kinds = {(): "top-level key", ("ops",): "asset", ("resources",): "resource", ("loggers",): "logger"}
    what = kinds.get(tuple(path))
    line = f"no {what} '{name}'" if what else f"{subject(path)}: unknown key '{name}' at {dotted(path)}"
    close = difflib.get_close_matches(name, accepted, n=1)
    moved = MOVED_ASSET_KEYS.get((path[1] if len(path) > 1 else "", name))
    if moved:
        line += f"; it moved to {moved}"
    elif close:
        line += f"; did you mean '{close[0]}'?"
    return f"{line} (accepted: {', '.join(accepted)})"


def expected_type(snap) -> str:
    """What Dagster expected where a value had the wrong type: ``Int``, ``a list``, ``a mapping``, ..."""
    kinds = {
        "ARRAY": "a list",
        "MAP": "a mapping",
        "STRICT_SHAPE": "a mapping",
        "PERMISSIVE_SHAPE": "a mapping",
        "SELECTOR": "a mapping",
    }
    if snap.kind.value == "ENUM":
        return f"one of {', '.join(v.config_value for v in snap.enum_values)}"
    return snap.given_name or kinds.get(snap.kind.value, snap.kind.value.lower())


def describe(job: dg.JobDefinition, error) -> list[str]:
    """One line per mistake in one of Dagster's evaluation errors."""
    path, reason, data = stack_path(error.stack), error.reason.value, error.error_data
    if reason in ("FIELD_NOT_DEFINED", "FIELDS_NOT_DEFINED"):
        names = [data.field_name] if reason == "FIELD_NOT_DEFINED" else data.field_names
        return [unknown_key(path, name, accepted_keys(job, path)) for name in names]
    if reason in ("MISSING_REQUIRED_FIELD", "MISSING_REQUIRED_FIELDS"):
        names = [data.field_name] if reason == "MISSING_REQUIRED_FIELD" else data.field_names
        return [f"{subject(path)}: missing required key {dotted([*path, name])}" for name in names]
    if reason == "RUNTIME_TYPE_MISMATCH":
        return [f"{subject(path)}: {dotted(path)} is {data.value_rep}; expected {expected_type(data.config_type_snap)}"]
    return [f"{subject(path)}: {error.message}"]


def config_mistakes(jobs: list[dg.JobDefinition], run_config: dict) -> list[str]:
    """Every mistake in a whole-pipeline run config, one line each; none when each plane accepts its part.

    An asset under ``ops`` is unknown only when no plane has it; every other key is judged by the plane
    that owns it, as the user wrote it.
    """
    assets = sorted({name for job in jobs for name in accepted_keys(job, ["ops"])})
    mistakes = [unknown_key(["ops"], name, assets) for name in run_config.get("ops", {}) if name not in assets]
    for job in jobs:
        try:
            dg.validate_run_config(job, select_ops(job, run_config))
        except dg.DagsterInvalidConfigError as exc:
            mistakes += [line for error in exc.errors for line in describe(job, error)]
    return list(dict.fromkeys(mistakes))  # the sections every plane shares (resources, loggers) fail in each


def split_variants(run_config: dict, where: str) -> tuple[dict, dict[str, dict]]:
    """The run config without its ``variants:`` section, and each variant's whole run config: the shared ``ops`` with
    the variant's own asset settings laid over them (``{variant: {asset: {config: {...}}}}``).

    A variant trains and delivers as its own run of the version; the data plane (its ``VERSION_ASSETS``) is the
    version's, so a variant that sets a data-plane asset is refused here, before anything runs."""
    variants = run_config.get("variants")
    base = {k: v for k, v in run_config.items() if k != "variants"}
    if variants is None:
        return base, {}
    if not isinstance(variants, dict) or not variants:
        raise CliError(f"{where}: variants must map each variant's name to its asset settings, e.g. variants: {{r16: "
                       "{lora_adapter: {config: {lora_r: 16}}}}")  # fmt: skip
    configs = {}
    for name, ops in variants.items():
        try:
            validate_part("variant", str(name))
        except InvalidDatasetId as exc:
            raise CliError(f"{where}: variants: {exc}") from exc
        if not isinstance(ops, dict):
            raise CliError(
                f"{where}: variants.{name} must map asset names to their settings ({{asset: {{config: ...}}}})"
            )
        shared = sorted(set(ops) & VERSION_ASSETS)
        if shared:
            raise CliError(
                f"{where}: variants.{name} sets {', '.join(shared)}, the data plane's, which every variant of a version "
                "shares (the same shards): set it under ops, or register another dataset version for it"
            )
        merged = {**base.get("ops", {})}
        for asset, settings in ops.items():
            config = {**(merged.get(asset) or {}).get("config", {}), **((settings or {}).get("config") or {})}
            merged[asset] = {**(merged.get(asset) or {}), **(settings or {}), "config": config}
        configs[str(name)] = {**base, "ops": merged}
    return base, configs
