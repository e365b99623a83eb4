"""The general-ability gate: did the fine-tuned model, or a shipped file, fall on a general task by more than allowed?

``general_eval`` scores each task of its suite (``delivery/harness.py``, lm-eval) on the base, the merged model
and every shipped export; ``judge`` compares each against the base. A model **regressed** on a task when its
drop (base minus it, in the task's better direction) exceeds the task's ``max_drop`` by more than the noise
lm-eval reports for the two means: ``drop - z * sqrt(stderr_base² + stderr_model²) > max_drop``. So a drop
is only held against the model when it is larger than the allowance and than ``z`` standard errors of the
difference, and a small ``limit`` cannot block a model on chance alone.

With numbers: 30 items of a metric near 0.5 have a stderr of ~0.09 each, ~0.13 for the difference; at
``z`` = 1 and ``max_drop`` = 0.05 a drop must exceed 0.18 to count. 300 items bring that to ~0.09. The
stderr is unpaired (lm-eval reports each mean's), which overstates the noise of a paired difference on the
same items: erring towards letting a model through, never towards blocking one on noise. A drop beyond
``max_drop`` but within the noise is reported (``within_noise``) so a user can raise the limit to tell.

``on_regression`` says what a regression does: ``block`` (nothing is published; ``published_model`` names the
task) or ``warn`` (published, but never promoted to ``champion``: ``model_registry.choose_alias``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

BLOCK, WARN = "block", "warn"
FINETUNED = "finetuned"  # the merged model's key among the scored models; "base" is the reference


@dataclass(frozen=True)
class Score:
    """One model on one task: lm-eval's headline metric and its stderr, or why it did not run."""

    value: float | None
    stderr: float | None = None
    refused: str | None = None


@dataclass(frozen=True)
class ModelJudgement:
    """One model against the base on one task."""

    value: float | None
    drop: float | None  # base minus model in the better direction (positive: worse); None when not scored
    noise: float | None  # z standard errors of the difference
    regressed: bool  # drop - noise > max_drop
    within_noise: bool  # drop > max_drop, but not by more than the noise
    refused: str | None = None


@dataclass(frozen=True)
class TaskVerdict:
    task: str
    metric: str
    higher_is_better: bool
    base: float | None
    base_stderr: float | None
    max_drop: float
    models: dict[str, ModelJudgement]  # "finetuned" and each export's name

    @property
    def regressed(self) -> list[str]:
        return [name for name, judged in self.models.items() if judged.regressed]


@dataclass(frozen=True)
class GeneralVerdict:
    """The suite's verdict: per task, each model against the base; what a regression does; what it cost."""

    tasks: dict[str, TaskVerdict]
    on_regression: str  # block | warn
    stderr_z: float
    items: int  # documents scored over every task and model
    seconds: float  # lm-eval's time over every task and model (model loading and servers not counted)
    reason: str | None = None  # why no task ran (none chosen); None when the check ran
    lines: list[str] = field(default_factory=list)  # one per regression, as the gate and the registry say it

    @property
    def regressed(self) -> bool:
        return bool(self.lines)

    @property
    def blocks(self) -> bool:
        return self.regressed and self.on_regression == BLOCK

    def as_dict(self) -> dict:
        return {**asdict(self), "regressed": self.regressed, "blocks": self.blocks}

    @classmethod
    def of(cls, stats: dict) -> GeneralVerdict:
        """The verdict of its ``as_dict`` (eval_report's and general_eval's stats)."""
        tasks = {
            name: TaskVerdict(
                **{k: v for k, v in task.items() if k != "models"},
                models={m: ModelJudgement(**j) for m, j in task["models"].items()},
            )
            for name, task in stats["tasks"].items()
        }
        fields = {k: stats[k] for k in ("on_regression", "stderr_z", "items", "seconds", "reason", "lines")}
        return cls(tasks=tasks, **fields)

    def chains(self, titles: dict[str, str]) -> dict[str, str]:
        """Each task's figures in one line, the base first: 'names_answer: base 0.833 → fine-tuned 0.792 → shipped GGUF
        0.792' (``titles``: how to name each scored model; 'refused' where one could not run the task)."""
        lines = {}
        for name, task in self.tasks.items():
            base = "n/a" if task.base is None else f"{task.base:.3f}"
            models = [
                f"{titles.get(key, key)} {'refused' if j.value is None else f'{j.value:.3f}'}"
                for key, j in task.models.items()
            ]
            lines[name] = f"{task.metric.partition(',')[0]}: {' → '.join([f'base {base}', *models])}"
        return lines

    def flat(self) -> dict:
        """One level of keys for the MLflow registry's tags: ``general.regressed``, ``general.<task>.finetuned``, …"""
        flat = {"general.regressed": self.regressed, "general.on_regression": self.on_regression}
        for name, task in self.tasks.items():
            flat[f"general.{name}.base"] = task.base
            for model, judged in task.models.items():
                flat[f"general.{name}.{model}"] = judged.value if judged.refused is None else "refused"
                if judged.drop is not None:
                    flat[f"general.{name}.{model}.drop"] = round(judged.drop, 4)
        return flat


def off(reason: str, on_regression: str = WARN) -> GeneralVerdict:
    """The verdict of a check that ran nothing (no task chosen): it never blocks."""
    return GeneralVerdict({}, on_regression, 0.0, 0, 0.0, reason)


def judge_model(base: Score, model: Score, higher_is_better: bool, max_drop: float, z: float) -> ModelJudgement:
    """One model against the base: its drop, the noise allowed for it, and whether it regressed."""
    if model.refused is not None or model.value is None or base.value is None:
        return ModelJudgement(model.value, None, None, False, False, model.refused)
    drop = (base.value - model.value) if higher_is_better else (model.value - base.value)
    noise = z * math.sqrt((base.stderr or 0.0) ** 2 + (model.stderr or 0.0) ** 2)
    regressed = drop - noise > max_drop
    return ModelJudgement(model.value, drop, noise, regressed, drop > max_drop and not regressed)


def judge(
    scores: dict[str, dict[str, Score]],
    metrics: dict[str, tuple[str, bool]],
    max_drop: float,
    max_drop_per_task: dict[str, float],
    z: float,
    on_regression: str,
    items: int,
    seconds: float,
    titles: dict[str, str] | None = None,
) -> GeneralVerdict:
    """Every model of ``scores`` (model -> task -> Score; "base" the reference) judged on every task.

    ``metrics``: task -> (lm-eval's headline metric, higher is better); ``titles``: how a line names a model
    ("fine-tuned", "shipped GGUF q8_0")."""
    if on_regression not in (BLOCK, WARN):
        raise ValueError(f"general_eval.on_regression={on_regression!r}: choose {BLOCK} or {WARN}")
    titles = titles or {}
    tasks, lines = {}, []
    for task, (metric, higher) in metrics.items():
        base = scores["base"][task]
        allowed = max_drop_per_task.get(task, max_drop)
        judged = {
            model: judge_model(base, by_task[task], higher, allowed, z)
            for model, by_task in scores.items()
            if model != "base"
        }
        tasks[task] = TaskVerdict(task, metric, higher, base.value, base.stderr, allowed, judged)
        for model, j in judged.items():
            if j.regressed:
                lines.append(
                    f"{task} {metric.partition(',')[0]}: base {base.value:.3f} → {titles.get(model, model)} {j.value:.3f}, "
                    f"a drop of {j.drop:.3f} (at most {allowed:.3f} + {j.noise:.3f} noise, {z:g} stderr)"
                )
    return GeneralVerdict(tasks, on_regression, z, items, round(seconds, 1), None, lines)
