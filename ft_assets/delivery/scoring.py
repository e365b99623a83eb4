"""How ``eval_report`` scores one objective's models: the eval set, each model's figures, the report.

``eval_report`` is one body for every objective: load the eval set, score the base, the fine-tuned
model and each export's shipped file (in its own runtime: llama.cpp for GGUF) on it, gate, publish. What differs is a ``Scorer``,
which the objective carries (``ft_assets.objectives``):

- ``ChatScorer`` (SFT): the task metric (exact match, token F1 or ROUGE-L) on greedy answers to the
  eval conversations cut before their last reply, plus eval loss and perplexity on the packed eval
  shards (``ft_assets.delivery.evaluate``);
  The metric may be a reward function (``module:function``): its mean is then ``reward_mean``;
- ``PairScorer`` (DPO): reward accuracy and margin on the held-out pairs, no generation, and the DPO
  loss of the tuned model against the base with the run's beta and loss variant (``DpoSettings``);
- ``RewardScorer`` (GRPO): the mean reward (``reward_mean``) of greedy replies to the eval prompts, by
  the run's own reward functions (summed, as in training), with each function's mean beside it; an
  export's replies come from its runtime's chat completion of the same prompts. No eval loss: a prompt
  has no reference reply to score.

A scorer is made for one report (``Objective.scorer(eval config, the run's objective settings)``: the
typed settings the run trained with, ``DpoSettings``, ``GrpoSettings``, None for SFT), loads the eval
set once, scores each model to a ``Scored`` (an export's through its ``Runtime``) and turns them into a ``Report``: the stats to publish
beside the gate's, the comparison and samples tables, and the figures logged to MLflow.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ft_assets import rewards as rw
from ft_assets.data.parts import check_layout, part_paths
from ft_assets.data.rows import iter_records
from ft_assets.delivery import evaluate as ev
from ft_assets.delivery.exports.protocol import Runtime
from ft_assets.delivery.merge import load_full_precision
from ft_assets.objectives.dpo import DpoSettings
from ft_assets.objectives.grpo import GrpoSettings
from ft_assets.shards import IMAGES_DIR, Prompt, image_shards, load_prompt_rows

REWARD_SUMMARY = {
    "reward_mean": "finetuned_reward_mean",
    "base_reward_mean": "base_reward_mean",
}  # --json keys -> eval stats
Fetch = Callable[..., Path]  # Materialization.fetch: (ref, name, include=None) -> local folder
Log = Callable[[str], None]


@dataclass
class Scored:
    """One model's figures on the eval set."""

    metric: float  # the gate's metric
    figures: dict[str, float] = field(default_factory=dict)  # the objective's other figures (perplexity, reward margin)
    answers: list[str] = field(default_factory=list)  # generated answers (chat), in eval-set order
    detail: Any = None  # what the report needs beyond figures (pairs: the log-probabilities)


@dataclass
class Shipped:
    """An export's shipped file, scored: a column of the report."""

    name: str  # the export's name ("gguf"): its figures are logged as <name>_<metric>
    label: str  # its column, "GGUF f16 (llama.cpp)"
    scored: Scored


@dataclass
class Report:
    """What the objective adds to the gate's stats, and how the asset shows it."""

    stats: dict  # published in eval_report's stats beside the gate's figures (base/finetuned_eval_loss included)
    comparison: list[dict]  # rows of the base / fine-tuned / each shipped export comparison table
    samples: list[dict]  # rows of the answers (or pairs) table
    tracked: dict[str, float]  # figures logged to the training run's MLflow run
    summary: str  # the log line's tail after the metric
    pictures: list[str | None] = field(default_factory=list)  # each sample's first picture file (a VLM's), by index


class Scorer(Protocol):
    metric: str  # the gate's metric
    unit: str  # what the eval set holds, for logs: "eval conversations", "eval pairs"
    summary: dict[str, str]  # the objective's own keys of `ft-assets run --json` -> the eval_report stat they show

    def load(self, fetch: Fetch, train_eval_split: dict, tokenized_shards: dict) -> int: ...

    def score(self, model_dir: Path, log: Log) -> Scored: ...

    def score_export(self, runtime: Runtime, log: Log) -> Scored: ...

    def report(self, base: Scored, tuned: Scored, shipped: list[Shipped]) -> Report: ...


def _tokenizer(model_dir: Path):
    from transformers import AutoTokenizer  # seconds to import; only eval_report's process needs it

    return AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)


class ChatScorer:
    """SFT: the task metric on greedy answers, eval loss and perplexity on the packed eval shards."""

    unit = "eval conversations"
    summary = REWARD_SUMMARY  # filled when the metric is a reward function; the gate's keys say the rest

    def __init__(self, metric: str, max_examples: int, max_new_tokens: int, settings: None):
        try:
            ev.check_metric(metric)
        except ValueError as exc:
            raise ValueError(f"eval_report config metric={metric!r}: {exc}") from exc
        self.scored_by, self.max_examples, self.max_new_tokens = metric, max_examples, max_new_tokens
        self.metric = metric if metric in ev.METRICS else ev.REWARD_METRIC  # a reward function's mean: reward_mean

    def load(self, fetch: Fetch, train_eval_split: dict, tokenized_shards: dict) -> int:
        check_layout(train_eval_split["files"], train_eval_split["uri"])
        split_dir = fetch(train_eval_split, "split", include=lambda rel: rel.startswith("eval-"))
        self.shards_dir = fetch(tokenized_shards, "shards", include=lambda rel: rel.startswith("eval-"))
        records = (record for path in part_paths(split_dir, "eval") for record in iter_records(path))
        images = self.shards_dir / IMAGES_DIR if image_shards(self.shards_dir, "eval") else None
        examples = ev.eval_examples(list(records), self.max_examples, images)
        # a row whose shards refused it (longer than seq_len) has no images beside them, and no eval loss either
        self.examples = [e for e in examples if all(Path(f).is_file() for f in ev.image_files(e.prompt))]
        if not self.examples:
            raise ValueError("the eval split is empty; raise train_eval_split.eval_fraction")
        return len(self.examples)

    def score(self, model_dir: Path, log: Log) -> Scored:
        model = load_full_precision(model_dir)
        score = ev.score_model(
            model, _tokenizer(model_dir), self.examples, self.shards_dir, self.scored_by, self.max_new_tokens, log,
            model_dir=model_dir,
        )  # fmt: skip
        return Scored(score.metric, {"eval_loss": score.eval_loss, "perplexity": score.perplexity}, score.answers)

    def score_export(self, runtime: Runtime, log: Log) -> Scored:
        answers = runtime.chat_answers([e.prompt for e in self.examples], self.max_new_tokens, log)
        return Scored(ev.task_metric(answers, self.examples, self.scored_by), answers=answers)

    def report(self, base: Scored, tuned: Scored, shipped: list[Shipped]) -> Report:
        b, t = base.figures, tuned.figures
        comparison = [
            {"": self.metric, "base": round(base.metric, 3), "fine-tuned": round(tuned.metric, 3),
             **{s.label: round(s.scored.metric, 3) for s in shipped}},
            {"": "eval loss", "base": _sig(b["eval_loss"]), "fine-tuned": _sig(t["eval_loss"]), **dict.fromkeys(s.label for s in shipped)},
            {"": "perplexity", "base": _sig(b["perplexity"]), "fine-tuned": _sig(t["perplexity"]), **dict.fromkeys(s.label for s in shipped)},
        ]  # fmt: skip
        scores = ev.answer_scores(tuned.answers, self.examples, self.scored_by)
        # a reward scores it: correct is the reference's answer, not full marks
        rewarded = self.metric == ev.REWARD_METRIC
        samples = [
            {"prompt": ev.last_user_turn(e.prompt), "reference": e.reference, "base": a, "fine-tuned": b_,
             "correct": same_answer(b_, e.reference) if rewarded else score >= 1.0,
             **{s.label: s.scored.answers[i] for s in shipped}, self.metric: round(score, 3), "source": e.source}
            for i, (e, a, b_, score) in enumerate(zip(self.examples, base.answers, tuned.answers, scores))
        ]  # fmt: skip
        tracked = {self.metric: tuned.metric, f"base_{self.metric}": base.metric}
        tracked |= {f"{s.name}_{self.metric}": s.scored.metric for s in shipped}
        stats = {
            "base_eval_loss": b["eval_loss"], "finetuned_eval_loss": t["eval_loss"],
            "base_perplexity": b["perplexity"], "finetuned_perplexity": t["perplexity"],
        }  # fmt: skip
        stats.update(reward_functions=[self.scored_by] if rewarded else None, finetuned_reward_mean=tuned.metric if rewarded else None,
                     base_reward_mean=base.metric if rewarded else None)  # fmt: skip
        pictures = [next(iter(ev.image_files(e.prompt)), None) for e in self.examples]
        summary = f"eval loss {b['eval_loss']:.4f} → {t['eval_loss']:.4f}"
        return Report(stats, comparison, samples, tracked, summary, pictures if any(pictures) else [])


class PairScorer:
    """DPO: reward accuracy and margin on the held-out pairs; the DPO loss against the base, as in training."""

    metric = ev.PREFERENCE_METRIC
    unit = "eval pairs"
    summary = {
        "reward_accuracy": "finetuned_metric", "reward_margin": "finetuned_reward_margin",
        "base_reward_accuracy": "base_metric", "base_reward_margin": "base_reward_margin",
    }  # fmt: skip

    def __init__(self, metric: str, max_examples: int, max_new_tokens: int, settings: DpoSettings):
        self.max_examples = max_examples
        self.beta, self.loss_type = settings.beta, settings.loss

    def load(self, fetch: Fetch, train_eval_split: dict, tokenized_shards: dict) -> int:
        shards_dir = fetch(tokenized_shards, "shards", include=lambda rel: rel.startswith("pairs-eval-"))
        try:
            self.rows = ev.eval_pairs(shards_dir, self.max_examples)
        except FileNotFoundError as exc:
            raise ValueError("the eval split holds no pairs; raise train_eval_split.eval_fraction") from exc
        return self.rows.pairs

    def score(self, model_dir: Path, log: Log) -> Scored:
        self.tokenizer = _tokenizer(model_dir)  # decodes the pairs table
        return self._scored(ev.pair_scores(load_full_precision(model_dir), self.rows))

    def score_export(self, runtime: Runtime, log: Log) -> Scored:
        return self._scored(runtime.pair_logps(self.rows))

    def _scored(self, logps) -> Scored:
        """A model's own reward accuracy and margin (its DPO loss needs the base: ``report``)."""
        alone = ev.preference_scores(logps, logps, self.rows, self.beta, self.loss_type)
        return Scored(
            alone["finetuned_reward_accuracy"], {"reward_margin": alone["finetuned_reward_margin"]}, detail=logps
        )

    def report(self, base: Scored, tuned: Scored, shipped: list[Shipped]) -> Report:
        against_base = ev.preference_scores(tuned.detail, base.detail, self.rows, self.beta, self.loss_type)
        losses = {"base": against_base["base_eval_loss"], "fine-tuned": against_base["finetuned_eval_loss"]}
        margins = {"base": base.figures["reward_margin"], "fine-tuned": tuned.figures["reward_margin"]}
        comparison = [
            {"": "reward accuracy", "base": round(base.metric, 3), "fine-tuned": round(tuned.metric, 3),
             **{s.label: round(s.scored.metric, 3) for s in shipped}},
            {"": "reward margin", "base": round(margins["base"], 4), "fine-tuned": round(margins["fine-tuned"], 4),
             **{s.label: round(s.scored.figures["reward_margin"], 4) for s in shipped}},
            {"": f"DPO loss ({self.loss_type})", "base": round(losses["base"], 4), "fine-tuned": round(losses["fine-tuned"], 4),
             **dict.fromkeys(s.label for s in shipped)},
        ]  # fmt: skip
        samples = ev.pair_rows(self.tokenizer, self.rows, base.detail, tuned.detail, self.beta)
        tracked = {
            "reward_accuracy": tuned.metric, "reward_margin": margins["fine-tuned"],
            "base_reward_accuracy": base.metric, "base_reward_margin": margins["base"],
        }  # fmt: skip
        tracked |= {f"{s.name}_reward_accuracy": s.scored.metric for s in shipped}
        stats = {
            "base_eval_loss": losses["base"], "finetuned_eval_loss": losses["fine-tuned"],
            "base_reward_margin": margins["base"], "finetuned_reward_margin": margins["fine-tuned"],
            "dpo_beta": self.beta, "dpo_loss": self.loss_type,
        }  # fmt: skip
        return Report(
            stats, comparison, samples, tracked, f"reward margin {margins['base']:+.3f} → {margins['fine-tuned']:+.3f}"
        )


class RewardScorer:
    """GRPO: the mean reward of greedy replies to the eval prompts, by the run's reward functions."""

    metric = ev.REWARD_METRIC
    unit = "eval prompts"
    summary = REWARD_SUMMARY

    def __init__(self, metric: str, max_examples: int, max_new_tokens: int, settings: GrpoSettings):
        self.rewards = rw.load_rewards(settings.rewards)
        self.max_examples, self.max_new_tokens = max_examples, max_new_tokens

    def load(self, fetch: Fetch, train_eval_split: dict, tokenized_shards: dict) -> int:
        shards_dir = fetch(tokenized_shards, "shards", include=lambda rel: rel.startswith("prompts-eval-"))
        rows = load_prompt_rows(shards_dir, "eval", max_seq_len=1 << 30)
        if rows is None:
            raise ValueError("the eval split holds no prompts; raise train_eval_split.eval_fraction")
        self.prompts: list[Prompt] = rows.prompts[: self.max_examples]
        return len(self.prompts)

    def score(self, model_dir: Path, log: Log) -> Scored:
        model = load_full_precision(model_dir)
        return self._scored(
            ev.generate(model, _tokenizer(model_dir), [p.messages for p in self.prompts], self.max_new_tokens, log)
        )

    def score_export(self, runtime: Runtime, log: Log) -> Scored:
        return self._scored(runtime.chat_answers([p.messages for p in self.prompts], self.max_new_tokens, log))

    def _scored(self, answers: list[str]) -> Scored:
        """The mean total reward of ``answers``, and each function's mean (NaN: where a function applied to none)."""
        scored = rw.score(self.rewards, [p.messages for p in self.prompts], answers, [p.columns for p in self.prompts])
        return Scored(
            _mean(rw.totals(scored)),
            {reward.name: _mean(values) for reward, values in zip(self.rewards, scored)},
            answers,
            scored,
        )

    def report(self, base: Scored, tuned: Scored, shipped: list[Shipped]) -> Report:
        comparison = [{"": "reward (sum)", "base": round(base.metric, 4), "fine-tuned": round(tuned.metric, 4),
                       **{s.label: round(s.scored.metric, 4) for s in shipped}}]  # fmt: skip
        comparison += [
            {"": name, "base": round(base.figures[name], 4), "fine-tuned": round(tuned.figures[name], 4),
             **{s.label: round(s.scored.figures[name], 4) for s in shipped}}
            for name in tuned.figures
        ]  # fmt: skip
        totals = rw.totals(tuned.detail)
        samples = []
        for i, (p, a, b, r) in enumerate(zip(self.prompts, base.answers, tuned.answers, totals)):
            reference = json.dumps(p.columns.get(rw.REFERENCE_COLUMN))
            samples.append({"prompt": ev.last_user_turn(p.messages), "reference": reference, "base": a, "fine-tuned": b,
                            "correct": same_answer(b, reference), **{s.label: s.scored.answers[i] for s in shipped},
                            "reward": round(r, 3), "source": p.source})  # fmt: skip
        tracked = {"reward_mean": tuned.metric, "base_reward_mean": base.metric}
        tracked |= {f"{s.name}_reward_mean": s.scored.metric for s in shipped}
        stats = {
            "base_eval_loss": None, "finetuned_eval_loss": None, "reward_functions": [r.name for r in self.rewards],
            "finetuned_reward_mean": tuned.metric, "base_reward_mean": base.metric,
            "base_rewards": base.figures, "finetuned_rewards": tuned.figures,
        }  # fmt: skip
        return Report(stats, comparison, samples, tracked, f"reward {base.metric:.3f} → {tuned.metric:.3f}")


def same_answer(reply: str, reference: str | None) -> bool | None:
    """A reply is the reference: the same tool call when the reference is one (JSON, as the reward rows hold it), else
    the same text (surrounding whitespace aside); None for a prompt without a reference (not known)."""
    try:
        expected = json.loads(reference)
    except (TypeError, ValueError):
        expected = reference
    if expected is None:
        return None
    call = rw.parse_call(expected)
    if call is not None:
        return rw.parse_call(reply.strip()) == call
    return reply.strip() == str(expected).strip()


def _sig(value: float) -> float:
    """A loss or perplexity to 4 significant digits, as the page's figures and the command line show it."""
    return float(f"{value:.4g}")


def _mean(values: list[float]) -> float:
    """The mean of the values that are not NaN (NaN when none is)."""
    kept = [value for value in values if value == value]
    return sum(kept) / len(kept) if kept else float("nan")
