"""Base-vs-fine-tuned evaluation on the fixed eval split: loss, perplexity and a task metric.

Two measurements per model, both on data the model never trained on (the eval side of the stable
split, whose near-duplicate clusters never touch train):

- **eval loss / perplexity** over the assistant tokens of the packed eval shards (the same masking
  and block-diagonal attention as training), so base and fine-tuned are scored on identical tokens;
- **a task metric** on greedy generations: each eval conversation is cut before its last assistant
  reply, the model answers, and the answer is compared with the reference. ``exact_match`` (after
  stripping surrounding whitespace) is the default, ``token_f1`` (SQuAD-style, whitespace tokens)
  and ``rouge_l`` (LCS F-measure) are selectable, and so is a reward function (``module:function``,
  ``ft_assets.rewards``), the reference handed to it as the ``answer`` column: a team scores a chat
  run with the verifier it would train GRPO with.

Generation runs in left-padded batches (one forward per new token for the whole batch), which is
what makes a few hundred eval prompts affordable on a CPU.

A preference (DPO) run is judged on the held-out pairs of its eval shards instead, with no
generation: each model's **reward accuracy** (the fraction of pairs whose chosen reply it gives a
higher log-probability than the rejected one) and **reward margin** (the mean of beta x the
difference of those log-probabilities), base and tuned alike, and the DPO loss of the tuned model
against the base, the same loss as in training (``ft_assets.training.loss``). The tuned margin minus
the base's is the mean DPO implicit reward margin. Reward accuracy is the gate's metric, for each
export's shipped file too: its runtime gives its log-probabilities of the same pairs
(``ft_assets.delivery.exports``; llama.cpp's logits for GGUF).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ft_assets import rewards as rw
from ft_assets.generation import answer_ids, stop_tokens

METRICS = ("exact_match", "token_f1", "rouge_l")
PREFERENCE_METRIC = "reward_accuracy"  # the gate's metric for preference runs
REWARD_METRIC = "reward_mean"  # the gate's metric for GRPO runs, and for chat runs scored by a reward function
GENERATION_BATCH = 16  # prompts per generate() call: large enough to amortize, small enough for CPU RAM


def exact_match(prediction: str, reference: str) -> float:
    return float(prediction.strip() == reference.strip())


def token_f1(prediction: str, reference: str) -> float:
    pred, ref = prediction.split(), reference.split()
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def rouge_l(prediction: str, reference: str) -> float:
    pred, ref = prediction.split(), reference.split()
    if not pred or not ref:
        return float(pred == ref)
    previous = [0] * (len(ref) + 1)
    for p in pred:
        current = [0]
        for j, r in enumerate(ref):
            current.append(previous[j] + 1 if p == r else max(previous[j + 1], current[j]))
        previous = current
    lcs = previous[-1]
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(pred), lcs / len(ref)
    return 2 * precision * recall / (precision + recall)


SCORERS: dict[str, Callable[[str, str], float]] = {"exact_match": exact_match, "token_f1": token_f1, "rouge_l": rouge_l}


@dataclass(frozen=True)
class EvalExample:
    source: str
    prompt: list[dict]  # the conversation up to (not including) the last assistant reply
    reference: str


def eval_examples(rows: list[dict], limit: int) -> list[EvalExample]:
    """The first ``limit`` eval rows (file order is fixed by the split), cut before the last reply."""
    examples = []
    for row in rows[:limit]:
        messages = row["messages"]
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        examples.append(EvalExample(row["source"], messages[:last], messages[last]["content"]))
    return examples


def generate(model, tokenizer, prompts: list[list[dict]], max_new_tokens: int, log=print) -> list[str]:
    """Greedy answers for chat prompts, in left-padded batches."""
    import torch

    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    answers: list[str] = []
    model.eval()
    for start in range(0, len(prompts), GENERATION_BATCH):
        texts = [
            tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
            for p in prompts[start : start + GENERATION_BATCH]
        ]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
        with torch.no_grad():
            output = model.generate(
                **batch,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=stop_tokens(model, tokenizer),
            )
        new_tokens = output[:, batch["input_ids"].shape[1] :]
        answers.extend(
            tokenizer.decode(answer_ids(tokenizer, row), skip_special_tokens=True) for row in new_tokens.tolist()
        )
        log(f"generated {len(answers)}/{len(prompts)} answers")
    return answers


def eval_loss(model, shards_dir: Path, batch_size: int = 4) -> float:
    """Mean loss per assistant token over the packed eval shards, computed exactly as in training."""
    from ft_assets.shards import load_packed_rows
    from ft_assets.training.loss import eval_loss_sum

    rows = load_packed_rows(shards_dir, "eval", max_seq_len=1 << 30)
    if rows is None:
        raise FileNotFoundError(f"no eval-*.parquet shards in {shards_dir}")
    loss_sum, count = eval_loss_sum(model, rows, batch_size, model.device)
    return loss_sum / max(count, 1)


@dataclass
class ModelScore:
    eval_loss: float
    perplexity: float
    metric: float
    answers: list[str] = field(default_factory=list)


def check_metric(metric: str) -> None:
    """A metric is one of ``METRICS`` or a reward function that loads (``module:function``); ValueError says what to write."""
    if metric in SCORERS:
        return
    if ":" not in metric:
        raise ValueError(
            f"unknown metric {metric!r}; choose one of {', '.join(METRICS)}, or a reward function as module:function"
        )
    rw.load_reward(metric)


def score_model(
    model, tokenizer, examples: list[EvalExample], shards_dir: Path, metric: str, max_new_tokens: int, log=print
) -> ModelScore:
    import math

    check_metric(metric)
    loss = eval_loss(model, shards_dir)
    answers = generate(model, tokenizer, [e.prompt for e in examples], max_new_tokens, log)
    return ModelScore(loss, math.exp(min(loss, 50.0)), task_metric(answers, examples, metric), answers)


def answer_scores(answers: list[str], examples: list[EvalExample], metric: str) -> list[float]:
    """Each answer's score: ``metric`` against its example's reference, or a reward function's reward (``module:function``,
    given the prompt, with the reference as the ``answer`` column; NaN where it does not apply)."""
    if metric in SCORERS:
        return [SCORERS[metric](a, e.reference) for a, e in zip(answers, examples, strict=True)]
    scored = rw.score(
        [rw.load_reward(metric)],
        [e.prompt for e in examples],
        answers,
        [{rw.REFERENCE_COLUMN: e.reference} for e in examples],
    )
    return scored[0]


def task_metric(answers: list[str], examples: list[EvalExample], metric: str) -> float:
    """The mean of ``metric`` over the answers (``answer_scores``; rewards that do not apply left out).

    The same function scores the merged model (transformers) and each export's shipped file (its runtime's greedy
    chat answers to the same prompts: llama.cpp's for GGUF, ``ft_assets.delivery.exports``).
    """
    scores = [score for score in answer_scores(answers, examples, metric) if score == score]
    return sum(scores) / max(len(scores), 1)


def last_user_turn(prompt: list[dict]) -> str:
    """The last user message of a prompt: what a table of answers shows as the question."""
    return next((m["content"] for m in reversed(prompt) if m["role"] == "user"), "")


# --- preference pairs --------------------------------------------------------------------------------


def eval_pairs(shards_dir: Path, limit: int):
    """The first ``limit`` packed eval pairs (``pairs-eval-*.parquet``, row by row): every model is scored on these."""
    from dataclasses import replace

    from ft_assets.shards import load_pair_rows

    rows = load_pair_rows(shards_dir, "eval", max_seq_len=1 << 30)
    if rows is None:
        raise FileNotFoundError(f"no pairs-eval-*.parquet shards in {shards_dir}")
    kept = rows.pair_mask & (rows.pair_mask.flatten().cumsum(0).view_as(rows.pair_mask) <= limit)
    used = kept.any(dim=1)
    return replace(
        rows, input_ids=rows.input_ids[used], labels=rows.labels[used], position_ids=rows.position_ids[used],
        segment_ids=rows.segment_ids[used], pair_mask=kept[used],
    )  # fmt: skip


def pair_scores(model, rows, batch_size: int = 4):
    """The model's summed log-probabilities of every eval pair's chosen and rejected reply (``PairLogps``)."""
    from ft_assets.training.loss import all_pair_logps

    return all_pair_logps(model, rows, batch_size, model.device)[0]


def preference_scores(tuned, base, rows, beta: float, loss_type: str) -> dict:
    """Reward accuracy and margin of base and tuned, and the DPO loss of each against the base, per eval pair."""
    from ft_assets.training.loss import preference_metrics

    sums = preference_metrics(tuned, base, rows.pair_mask, beta, loss_type)
    pairs = max(sums["pairs"], 1)
    return {
        "pairs": int(sums["pairs"]),
        "base_reward_accuracy": sums["reference_reward_accuracy"] / pairs,
        "finetuned_reward_accuracy": sums["reward_accuracy"] / pairs,
        "base_reward_margin": sums["reference_reward_margin"] / pairs,
        "finetuned_reward_margin": sums["reward_margin"] / pairs,
        "base_eval_loss": sums["reference_loss"] / pairs,
        "finetuned_eval_loss": sums["loss"] / pairs,
    }


def pair_rows(tokenizer, rows, base, tuned, beta: float, n: int = 10) -> list[dict]:
    """The first ``n`` eval pairs, decoded from the shards: both replies and each model's margin on them."""
    from ft_assets.shards import IGNORE_INDEX

    table = []
    for row, k in zip(*rows.pair_mask.nonzero(as_tuple=True)):
        if len(table) >= n:
            break
        learned = rows.labels[row] != IGNORE_INDEX
        chosen, rejected = (rows.input_ids[row][learned & (rows.segment_ids[row] == 2 * k + side)] for side in (0, 1))
        margins = [beta * float(scores.chosen[row, k] - scores.rejected[row, k]) for scores in (base, tuned)]
        table.append({
            "chosen": tokenizer.decode(chosen, skip_special_tokens=True).strip(),
            "rejected": tokenizer.decode(rejected, skip_special_tokens=True).strip(),
            "base margin": round(margins[0], 4),
            "fine-tuned margin": round(margins[1], 4),
            "correct": margins[1] > 0,  # the fine-tuned model prefers the chosen reply
        })  # fmt: skip
    return table
