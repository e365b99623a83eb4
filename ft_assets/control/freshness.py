"""Whether a plane is current for a dataset version: every output there, made with these settings from today's inputs.

``ft-assets run`` skips a current plane (``--force`` reruns it), so a rerun after a crash redoes only
what is missing. The answer comes from our own records and Dagster's public API: each reference
records the asset's resolved settings and the digests of the references it was built from;
``dagster.validate_run_config`` fills in the defaults of the settings this run would use and lists
the job's ops; ``Definitions.resolve_all_asset_specs`` gives each asset's parents. Cost: a few small
JSON reads per asset (a plane has at most 7), against minutes to hours to rerun the plane.
"""

from __future__ import annotations

import dagster as dg

from ft_assets.refs import has_ref, read_ref
from ft_assets.storage import ObjectStore


def asset_parents(defs: dg.Definitions) -> dict[str, list[str]]:
    """Each asset's parents in the asset graph, by name."""
    return {
        spec.key.to_user_string(): [dep.asset_key.to_user_string() for dep in spec.deps]
        for spec in defs.resolve_all_asset_specs()
    }


def asset_settings(job: dg.JobDefinition, parents: dict[str, list[str]], run_config: dict) -> dict[str, dict]:
    """The settings of each asset of ``job`` that ``run_config`` gives, Dagster's defaults filled in ({} for none).

    Dagster lists every op of the job; those that are not assets (the asset checks) are left out.
    """
    resolved = dg.validate_run_config(job, run_config)
    return {name: (op.get("config") or {}) for name, op in resolved["ops"].items() if name in parents}


def plane_is_current(
    store: ObjectStore, job: dg.JobDefinition, parents: dict[str, list[str]], key: str, run_config: dict
) -> bool:
    """Whether every asset of the plane has an output for ``key`` made with these settings from today's inputs.

    The plane is current when each reference's recorded settings equal those this run would use
    (defaults filled in), its recorded upstream digests equal the outputs in the store now, and no
    parent asset in the graph was materialized after it.
    """
    for asset, settings in asset_settings(job, parents, run_config).items():
        if not has_ref(store, key, asset):
            return False
        ref = read_ref(store, key, asset)
        if (ref.get("config") or {}) != settings:
            return False
        for name, upstream in ref.get("upstream", {}).items():
            if not has_ref(store, key, name) or read_ref(store, key, name)["digest"] != upstream["digest"]:
                return False
        for name in parents[asset]:
            if has_ref(store, key, name) and read_ref(store, key, name)["created_at"] > ref["created_at"]:
                return False
    return True
