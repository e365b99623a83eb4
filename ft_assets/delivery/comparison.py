"""Runs of one dataset version side by side: which variant is best, and at what cost.

A version trains under several configurations (``variants`` in the run config: a rank, a learning rate, LoRA
vs QLoRA; or the same settings again), each its own training and delivery run (``ft_assets.partitions``:
partition ``<name>@<version>~<variant>``). ``version_comparison`` reads every run's references and puts
them in one table (``table``): the settings that differ between the runs and nothing else, the task metric
base → tuned → shipped, the general-ability figures (``general_eval``), tokens, wall time, ETH and dollars,
whether the gate passed, and which run the registry's rule promotes (``promoted``: the same rule as
``model_registry.choose_alias``, applied to the runs in the order they finished).

Plain functions of the runs' figures; the asset reads them from the store.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from ft_assets.delivery.model_registry import not_promotable
from ft_assets.delivery.regression import GeneralVerdict

DEFAULT = "(default)"  # how the table names the version's own run, trained without a variant


@dataclass(frozen=True)
class RunFigures:
    """One run of the version, as its references say: what it was trained with, how it scored, what it cost."""

    variant: str  # "" for the version's own run
    run_id: str
    settings: Mapping  # the training settings it resolved (lora_adapter's training_config)
    metric_name: str
    base_metric: float
    finetuned_metric: float
    shipped: Mapping[str, float | None]  # export title ("GGUF") -> the shipped file's metric (None: none shipped)
    gate: Mapping  # eval_report's verdict, flat (``Gate.flat``): passed, general.regressed, ...
    general: GeneralVerdict | None
    tokens: int
    wall_seconds: float
    usd: float | None  # training_cost's actual dollars; None: not priced yet
    eth_usd_per_hour: float | None
    published: bool
    finished_at: float  # when its eval_report was written: the order the registry saw the runs in
    why_not_published: str | None = None
    extra: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.variant or DEFAULT


def differing(settings: Mapping[str, Mapping]) -> dict[str, dict]:
    """Per run, only the settings whose values differ between the runs (all of them the same: none)."""
    keys = sorted({key for values in settings.values() for key in values})
    varied = [
        key for key in keys if len({json.dumps(values.get(key), sort_keys=True) for values in settings.values()}) > 1
    ]
    return {run: {key: values.get(key) for key in varied} for run, values in settings.items()}


def promoted(runs: list[RunFigures]) -> tuple[str | None, str]:
    """The run the registry's rule makes ``champion`` among these (published, gate passed, no general regression,
    the best task metric; a tie keeps the earlier), and why; (None, why) when none may be."""
    champion: RunFigures | None = None
    for run in sorted(runs, key=lambda r: r.finished_at):
        if not run.published or not_promotable(run.gate):
            continue
        if champion is None or (
            run.metric_name == champion.metric_name and run.finetuned_metric > champion.finetuned_metric
        ):
            champion = run
    if champion is None:
        return None, "no run may be champion: each failed its gate, regressed on a general task or was not published"
    return champion.name, f"the best {champion.metric_name} ({champion.finetuned_metric:.3f}) of the promotable runs"


def _general_cell(general: GeneralVerdict | None) -> str:
    """Each general task as base → tuned (→ each shipped file), the regressions marked."""
    if general is None:
        return "not measured"
    if general.reason:
        return general.reason
    cells = []
    for name, task in general.tasks.items():
        chain = " → ".join(
            "refused" if j.refused else f"{j.value:.3f}{' ✗' if j.regressed else ''}" for j in task.models.values()
        )
        cells.append(f"{name} {task.base:.3f} → {chain}")
    return "; ".join(cells)


def _verdict(run: RunFigures) -> str:
    if not run.published:
        return f"not published: {run.why_not_published}" if run.why_not_published else "not published"
    refused = not_promotable(run.gate)
    return f"published, not promotable: {refused}" if refused else "published"


def table(runs: list[RunFigures], champion: str | None) -> list[dict]:
    """One row per run, the promoted one marked; settings that differ as ``key=value`` pairs."""
    changed = differing({run.name: run.settings for run in runs})
    rows = []
    for run in runs:
        shipped = "".join(f" → {v:.3f}" if v is not None else f" → no {title}" for title, v in run.shipped.items())
        rows.append(
            {
                "variant": run.name,
                "settings that differ": ", ".join(f"{k}={v}" for k, v in changed[run.name].items()) or "none",
                run.metric_name: f"{run.base_metric:.3f} → {run.finetuned_metric:.3f}{shipped}",
                "general (base → tuned → shipped)": _general_cell(run.general),
                "tokens": run.tokens,
                "wall_s": round(run.wall_seconds, 1),
                "usd": None if run.usd is None else round(run.usd, 4),
                "eth_usd_per_h": None if run.eth_usd_per_hour is None else round(run.eth_usd_per_hour, 3),
                "verdict": _verdict(run),
                "promoted": run.name == champion,
                "run_id": run.run_id,
            }
        )
    return rows
