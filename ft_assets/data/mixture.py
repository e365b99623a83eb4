"""Mixtures: one dataset version drawn from several, in given proportions, the same rows for the same seed.

A mixture spec is YAML; ``ft-assets run --dataset mix.yaml`` registers it as a version of its own::

    mixture:
      seed: 7
      rows: 10000                        # optional, with weights: rows drawn in all (default: as many
      components:                        #   as the weights allow without running out of any component)
        - dataset: toolcalls@sample-v1   # a registered dataset version
          weight: 0.7
        - source: hf://acme/chat@v1.0    # anything `--dataset` accepts but a mixture; paths relative to the spec
          split: train                   # optional: a split of a Hub repo or a save_to_disk DatasetDict
          columns: {prompt: question, response: answer}   # optional: raw_dataset's column mapping, for this one
          name: chat                     # optional: the component's name (default: from its dataset or source)
          weight: 0.3

``count: N`` on every component instead of ``weight``: exactly N rows of each.

Registration (``stage_mixture``) checks the spec and that every ``dataset:`` exists, stages each
``source:`` like any input (a Hub revision is pinned to its commit then) under ``<name>/`` in the
mixture's own folder, and records the spec in ``_source.json``. ``raw_dataset`` then calls
``mix_dataset``: every component is read under the usual quarantine rules, and rows are drawn
without replacement from the rows each one parsed — exactly ``round(weight × rows)`` of each (largest
remainders), so the shares miss the weights by less than one row, far inside ±1%. Which rows is a
seeded choice per component (seeded by the mixture's seed and the component's name, so adding a
component leaves the draws of the others alone); drawn rows keep their file order, component after
component, and their sources (``<name>/<file>:<line>``): each part of a component becomes a part of the
mixture, written by the worker that draws from it. A component's quarantined rows are kept in the
parts ``components_quarantine-NNNNN.parquet`` and counted per component; the rows it had but that were not drawn
are counted too (``rows_available - rows_drawn``). Never drawing a row twice keeps repeats out of
the mix: a repeat would only be removed again as an exact duplicate.

The lineage lists each component with the digest of the files it was read from (sha256 over each
file's sha256, as a manifest digest), its Hub commit when it came from the Hub, and its counts.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import yaml

from ft_assets import layout
from ft_assets.data.kinds import dataset_kind, first_of_each_kind, source_file
from ft_assets.data.layouts import ColumnMapping
from ft_assets.data.parallel import Executor, InProcess
from ft_assets.data.parts import Artifact, Part, Target, Written, part_name, read_part, runs
from ft_assets.data.readers import read_dataset
from ft_assets.data.rows import QUARANTINE_SCHEMA, ROW_SCHEMA, DatasetFileError
from ft_assets.data.staging import MIXTURE_SUFFIXES, Staged, dataset_name, stage_source
from ft_assets.partitions import DatasetVersion, InvalidDatasetId, validate_part
from ft_assets.storage import join_key, sha256_file

COMPONENT_KEYS = {"dataset", "source", "weight", "count", "columns", "split", "name"}


class MixtureError(ValueError):
    """A mixture spec that cannot be registered or drawn; the message names the spec or component."""


def parse_spec(text: str, where: str) -> dict:
    """The mixture spec in ``text`` checked and normalized: seed, rows, components (each with a name)."""
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise MixtureError(f"{where}: not valid YAML ({exc})") from exc
    if not isinstance(loaded, dict) or set(loaded) != {"mixture"} or not isinstance(loaded["mixture"], dict):
        raise MixtureError(f"{where}: a mixture spec is one mapping 'mixture:' with 'components:' (and 'seed', 'rows')")
    spec = loaded["mixture"]
    unknown = set(spec) - {"components", "seed", "rows"}
    if unknown:
        raise MixtureError(f"{where}: unknown key(s) {sorted(unknown)} under 'mixture'; use components, seed, rows")
    components = spec.get("components")
    if not isinstance(components, list) or not components or not all(isinstance(c, dict) for c in components):
        raise MixtureError(f"{where}: 'components' must be a non-empty list of mappings")
    seed, rows = spec.get("seed", 0), spec.get("rows")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise MixtureError(f"{where}: 'seed' must be a non-negative integer")
    weighted = ["weight" in c for c in components]
    if any("weight" in c and "count" in c for c in components) or len(set(weighted)) != 1:
        raise MixtureError(f"{where}: give every component a 'weight', or every component a 'count'")
    if rows is not None and (not weighted[0] or not isinstance(rows, int) or isinstance(rows, bool) or rows < 1):
        raise MixtureError(f"{where}: 'rows' is a positive integer, and only goes with weights")
    checked, names = [], set()
    for i, component in enumerate(components):
        here = f"{where}: component {i + 1}"
        unknown = set(component) - COMPONENT_KEYS
        if unknown:
            raise MixtureError(f"{here}: unknown key(s) {sorted(unknown)}; use {', '.join(sorted(COMPONENT_KEYS))}")
        if ("dataset" in component) == ("source" in component):
            raise MixtureError(
                f"{here}: give one of 'dataset' (a registered <name>@<version>) or 'source' (a file, hf://, s3://)"
            )
        share = component.get("weight", component.get("count"))
        if weighted[0] and not (isinstance(share, int | float) and not isinstance(share, bool) and share > 0):
            raise MixtureError(f"{here}: 'weight' must be a positive number")
        if not weighted[0] and not (isinstance(share, int) and not isinstance(share, bool) and share >= 0):
            raise MixtureError(f"{here}: 'count' must be a non-negative integer")
        if "dataset" in component and "split" in component:
            raise MixtureError(f"{here}: 'split' goes with a 'source', not a registered dataset")
        try:
            ColumnMapping.of(component.get("columns") or {})
            if "dataset" in component:
                DatasetVersion.from_key(str(component["dataset"]))
            name = validate_part("component name", component.get("name") or _default_name(component))
        except (ValueError, InvalidDatasetId) as exc:
            raise MixtureError(f"{here}: {exc}") from exc
        if name in names:
            raise MixtureError(f"{here}: a second component named {name!r}; give each a distinct 'name'")
        names.add(name)
        checked.append({**component, "name": name})
    return {"seed": seed, "rows": rows, "components": checked}


def _default_name(component: dict) -> str:
    """The dataset's name, or the last part of the source's path, URI or repo id without its extension or revision."""
    if "dataset" in component:
        return str(component["dataset"]).split("@", 1)[0]
    return dataset_name(str(component["source"]).rstrip("/").split("@", 1)[0].rsplit("/", 1)[-1])


def stage_mixture(path: Path, work: Path, store) -> Staged:
    """Check a mixture spec and stage its components: ``source:`` files under ``<name>/``, ``dataset:`` as references."""
    try:
        spec = parse_spec(path.read_text(), str(path))
    except OSError as exc:
        raise DatasetFileError(f"{path}: {exc}") from exc
    except MixtureError as exc:
        raise DatasetFileError(str(exc)) from exc
    files: list[tuple[str, Path]] = []
    components = []
    for component in spec["components"]:
        share = {"weight": component["weight"]} if "weight" in component else {"count": component["count"]}
        record = {"name": component["name"], **share}
        if component.get("columns"):
            record["columns"] = component["columns"]
        if "dataset" in component:
            keys = layout.of(component["dataset"])
            if store is None or not store.exists(keys.success_marker):
                raise DatasetFileError(
                    f"{path}: component {component['name']}: no complete dataset version {component['dataset']} in the store"
                )
            if store.exists(keys.source) and store.get_json(keys.source)["kind"] == "mixture":
                raise DatasetFileError(
                    f"{path}: component {component['name']}: {component['dataset']} is a mixture; list its components instead"
                )
            record["dataset"] = component["dataset"]
        else:
            origin = str(component["source"])
            relative = path.parent / Path(origin).expanduser()  # paths in a spec are relative to the spec
            where = str(relative) if "://" not in origin and relative.exists() else origin
            if where.endswith(MIXTURE_SUFFIXES):
                raise DatasetFileError(
                    f"{path}: component {component['name']}: a mixture cannot be a component; list its components instead"
                )
            staged = stage_source(where, work / component["name"], component.get("split"))
            files += [(join_key(component["name"], rel), local_file) for rel, local_file in staged.files]
            record["source"] = staged.source or {"kind": "files", "uri": origin}
            record["files"] = [rel for rel, _ in staged.files]
        components.append(record)
    source = {"kind": "mixture", "seed": spec["seed"], "rows": spec["rows"], "components": components}
    return Staged(dataset_name(path.name), files, source)


def draw_counts(
    names: list[str], available: list[int], weights: list[float] | None, counts: list[int] | None, rows: int | None
) -> list[int]:
    """Rows to draw from each component: the counts, or the weights' shares of ``rows`` (default: the
    most rows the weights allow) rounded by largest remainders."""
    if counts is not None:
        wanted = counts
    else:
        total_weight = sum(weights)
        shares = [w / total_weight for w in weights]
        if rows is None:  # (the tolerance: 30 rows at a share of 0.1 are 300 rows, not 299.99999999999994)
            rows = min(int(a / s + 1e-6) for a, s in zip(available, shares))
            if rows == 0:
                empty = [n for n, a in zip(names, available) if a == 0]
                raise MixtureError(f"mixture component(s) {', '.join(empty)} have no usable rows")
        exact = [round(s * rows, 6) for s in shares]
        wanted = [int(e) for e in exact]
        by_remainder = sorted(range(len(exact)), key=lambda i: (wanted[i] - exact[i], i))
        for i in by_remainder[: rows - sum(wanted)]:
            wanted[i] += 1
    for name, want, have in zip(names, wanted, available):
        if want > have:
            asked = f"count {want}" if counts is not None else f"its weight of {rows} rows, {want}"
            raise MixtureError(
                f"mixture component {name}: {have} usable rows, but {asked} are asked; lower "
                f"{'the count' if counts is not None else 'rows or the weight'} (rows are never drawn twice)"
            )
    return wanted


def _seed_of(seed: int, name: str) -> np.random.SeedSequence:
    return np.random.SeedSequence(
        [seed, int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")]
    )


def files_digest(files: list[tuple[str, Path]]) -> str:
    """sha256 over the sorted (name, sha256) pairs of a component's files: the digest a manifest would have."""
    lines = "".join(f"{name}\t{sha256_file(path)}\n" for name, path in sorted(files))
    return hashlib.sha256(lines.encode()).hexdigest()


@dataclass(frozen=True)
class Component:
    """One component of a mixture, fetched: its ``_source.json`` record and its files (display names)."""

    record: dict
    files: list[tuple[str, Path]]
    mapping: ColumnMapping | None


@dataclass(frozen=True)
class Draw:
    """One part of a component, and which of its rows the mixture draws: output part ``index``."""

    rows: Part
    quarantine: Part
    picked: np.ndarray  # bool, one a row of the part
    index: int


def draw_run(target: Target, run: list[Draw]) -> list[tuple[Written, Written, dict[str, str]]]:
    """Each draw of a run: its drawn rows and its component's quarantine written as parts of the mixture, with the first
    row of each kind among the drawn rows (a data-plane task)."""
    done = []
    for draw in run:
        drawn = read_part(draw.rows).filter(pa.array(draw.picked))
        quarantine = read_part(draw.quarantine)
        done.append((
            target.put_table(part_name("rows", draw.index), drawn, ROW_SCHEMA),
            target.put_table(part_name("components_quarantine", draw.index), quarantine, QUARANTINE_SCHEMA),
            first_of_each_kind(drawn),
        ))  # fmt: skip
    return done


def _draws(read: list[Artifact], picks: list[np.ndarray], executor: Executor) -> list[Draw]:
    """Every part of every component with the rows drawn from it, numbered in component order."""
    draws = []
    for artifact, picked in zip(read, picks):
        for rows, quarantine in zip(artifact.parts("rows", executor), artifact.parts("quarantine", executor)):
            draws.append(Draw(rows, quarantine, picked[rows.start : rows.start + rows.rows], len(draws)))
    return draws


def mix_dataset(
    components: list[Component],
    work: Path,
    out: Artifact,
    seed: int,
    rows: int | None,
    executor: Executor | None = None,
) -> dict:
    """Read every component into ``work`` (in parts on ``executor``), draw the mixture's rows into the parts ``rows``
    (and the components' quarantine into ``components_quarantine``) of ``out``; returns ``read_dataset``'s counts for
    the drawn rows, plus ``source``: the records with each component's figures and digest."""
    executor = executor or InProcess()
    read, stats = [], []
    for component in components:
        read.append(Artifact.folder(work / component.record["name"]))
        stats.append(read_dataset(component.files, read[-1], component.mapping, executor))
    names = [c.record["name"] for c in components]
    weighted = "weight" in components[0].record
    drawn = draw_counts(
        names,
        [s["rows_parsed"] for s in stats],
        [c.record["weight"] for c in components] if weighted else None,
        None if weighted else [c.record["count"] for c in components],
        rows,
    )
    picks = []
    for name, counted, count in zip(names, stats, drawn):
        picks.append(np.zeros(counted["rows_parsed"], dtype=bool))
        picks[-1][
            np.random.default_rng(_seed_of(seed, name)).choice(counted["rows_parsed"], size=count, replace=False)
        ] = True
    kinds: dict[str, dict[str, str]] = {}
    tasks = list(runs(_draws(read, picks, executor), lambda draw: draw.rows.rows, executor.shard_rows))
    for run in executor.map(draw_run, tasks, out.target(executor)):
        for rows_part, quarantine_part, first in run:
            out.add(rows_part, quarantine_part)
            for kind, source in first.items():
                kinds.setdefault(source_file(source), {}).setdefault(kind, source)
    records = [
        {**component.record, "digest": files_digest(component.files), "rows_in": counted["rows_in"],
         "rows_quarantined": counted["rows_quarantined"], "quarantine_reasons": counted["quarantine_reasons"],
         "rows_available": counted["rows_parsed"], "rows_drawn": count}
        for component, counted, count in zip(components, stats, drawn)
    ]  # fmt: skip
    total = sum(drawn)
    return {
        "rows_in": total,
        "rows_parsed": total,
        "rows_quarantined": 0,
        "quarantine_reasons": {},
        "blank_lines": 0,
        "rows_per_file": dict(zip(names, drawn)),
        "data_kind": dataset_kind(kinds),
        "source": {"kind": "mixture", "seed": seed, "rows": total, "components": records},
    }
