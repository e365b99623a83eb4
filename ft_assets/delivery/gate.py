"""The eval gate: the fine-tuned model beats its base, every export that ships keeps the merged model's score, and
neither forgot a general-ability task (``general_eval``, ``delivery/regression.py``) where that blocks.

``eval_report`` scores the base, the merged model and each export's shipped file (in the export's own
runtime) on the same eval set and metric, and records the verdict in its stats; the blocking checks
(``finetuned_beats_base``, one ``shipped_<export>_keeps_the_metric`` per export), ``published_model``,
the lineage, the MLflow registry's tags and the command line read it back with ``Gate.of``.

An export that ships nothing (turned off, or refused by its runtime: ``reason``) passes its part
vacuously: a refused format never holds back the model, only a shipped file that scores worse than its
``max_drop`` allows does. A general-ability regression fails the gate when ``general_eval.on_regression`` is
``block``; with ``warn`` the gate passes and the verdict still says ``regressed``, which keeps the model from
``champion`` (``model_registry.not_promotable``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ft_assets.delivery.regression import GeneralVerdict


@dataclass(frozen=True)
class ExportVerdict:
    """One export's part of the gate: its shipped file's score against the merged model's, or why it ships nothing."""

    file: str | None  # the shipped file scored; None: nothing ships (``reason``)
    variant: str | None  # what kind of file it is (GGUF: its qtype)
    metric: float | None  # its score on the eval set, answering in its own runtime
    drop: float | None  # the merged model's score minus its own
    max_drop: float  # what the export's settings allow
    within_drop: bool  # vacuously true when nothing ships
    reason: str | None  # why nothing ships, in one line (off, refused by its runtime); None when it ships


@dataclass(frozen=True)
class Gate:
    """The eval gate's verdict; ``passed`` when the fine-tuned model beats its base by ``min_improvement`` and every
    shipped export is within its drop. Its fields are eval_report's stats (``exports`` by export name)."""

    metric_name: str
    base_metric: float
    finetuned_metric: float
    improvement: float
    min_improvement: float
    beats_base: bool
    exports: dict[str, ExportVerdict]
    passed: bool
    general: GeneralVerdict | None = None  # general_eval's verdict; None: a report from before general_eval

    @classmethod
    def of(cls, stats: dict) -> Gate:
        """The gate's fields of an eval_report's stats."""
        fields = {name: stats[name] for name in cls.__dataclass_fields__ if name != "general"}
        general = GeneralVerdict.of(stats["general"]) if stats.get("general") else None
        exports = {name: ExportVerdict(**v) for name, v in stats["exports"].items()}
        return cls(**{**fields, "exports": exports, "general": general})

    def as_dict(self) -> dict:
        return {**asdict(self), "general": self.general.as_dict() if self.general else None}

    def flat(self) -> dict:
        """The verdict as one level of keys (``gguf.metric``, ``gguf.reason``, ``general.regressed``,
        ``general.<task>.finetuned``): the MLflow registry's ``ft.gate.*`` tags."""
        flat = {name: value for name, value in self.as_dict().items() if name not in ("exports", "general")}
        for name, verdict in self.exports.items():
            flat |= {f"{name}.{key}": value for key, value in asdict(verdict).items()}
        return flat | (self.general.flat() if self.general else {})


def shipped(file: str, variant: str | None, metric: float, finetuned_metric: float, max_drop: float) -> ExportVerdict:
    """The verdict on a shipped file that scored ``metric`` where the merged model scored ``finetuned_metric``."""
    drop = finetuned_metric - metric
    return ExportVerdict(file, variant, metric, drop, max_drop, drop <= max_drop, None)


def dropped(reason: str, max_drop: float) -> ExportVerdict:
    """The verdict on an export that ships nothing, and why."""
    return ExportVerdict(None, None, None, None, max_drop, True, reason)


def gate(
    metric: str,
    base_metric: float,
    finetuned_metric: float,
    min_improvement: float,
    exports: dict[str, ExportVerdict],
    general: GeneralVerdict | None = None,
) -> Gate:
    """Judge the fine-tuned model against its base, with each export's verdict against the fine-tuned model and the
    general-ability verdict (a regression fails the gate only where it blocks)."""
    improvement = finetuned_metric - base_metric
    beats_base = improvement >= min_improvement
    passed = beats_base and all(v.within_drop for v in exports.values()) and not (general and general.blocks)
    return Gate(
        metric, base_metric, finetuned_metric, improvement, min_improvement, beats_base, exports, passed, general
    )
