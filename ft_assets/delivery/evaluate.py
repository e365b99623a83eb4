"""Base-vs-fine-tuned evaluation on the fixed eval split: loss, perplexity and a task metric.

Two measurements per model, both on data the model never trained on (the eval side of the stable
split, whose near-duplicate clusters never touch train):

- **eval loss / perplexity** over the assistant tokens of the packed eval shards (the same masking
  and block-diagonal attention as training), so base and fine-tuned are scored on identical tokens;
- **a task metric** on greedy generations: each eval conversation is cut before its last assistant
  reply, the model answers, and the answer is compared with the reference. ``exact_match`` (after
  stripping surrounding whitespace) is the default, ``token_f1`` (SQuAD-style, whitespace tokens)
  and ``rouge_l`` (LCS F-measure) are selectable.

Generation runs in left-padded batches (one forward per new token for the whole batch), which is
what makes a few hundred eval prompts affordable on a CPU.

A preference (DPO) run is judged on the held-out pairs of its eval shards instead, with no
generation: each model's **reward accuracy** (the fraction of pairs whose chosen reply it gives a
higher log-probability than the rejected one) and **reward margin** (the mean of beta x the
difference of those log-probabilities), base and tuned alike, and the DPO loss of the tuned model
against the base, the same loss as in training (``ft_assets.training.loss``). The tuned margin minus
the base's is the mean DPO implicit reward margin. Reward accuracy is the gate's metric, for the
shipped GGUF too: llama.cpp's logits give its log-probabilities of the same pairs (``gguf_pair_scores``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

METRICS = ("exact_match", "token_f1", "rouge_l")
PREFERENCE_METRIC = "reward_accuracy"  # the gate's metric for preference runs
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
                eos_token_id=tokenizer.eos_token_id,
            )
        new_tokens = output[:, batch["input_ids"].shape[1] :]
        answers.extend(tokenizer.batch_decode(new_tokens, skip_special_tokens=True))
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


def score_model(model, tokenizer, examples: list[EvalExample], shards_dir: Path, metric: str, max_new_tokens: int, log=print) -> ModelScore:
    import math

    if metric not in SCORERS:
        raise ValueError(f"unknown metric {metric!r}; choose one of {', '.join(METRICS)}")
    loss = eval_loss(model, shards_dir)
    answers = generate(model, tokenizer, [e.prompt for e in examples], max_new_tokens, log)
    return ModelScore(loss, math.exp(min(loss, 50.0)), task_metric(answers, examples, metric), answers)


def task_metric(answers: list[str], examples: list[EvalExample], metric: str) -> float:
    """The mean of ``metric`` over the answers, each against its example's reference.

    The same function scores the merged model (transformers) and the shipped GGUF (llama.cpp greedy chat
    answers to the same prompts, ``ft_assets.delivery.llamacpp.chat_answers``).
    """
    scorer = SCORERS[metric]
    return sum(scorer(a, e.reference) for a, e in zip(answers, examples, strict=True)) / max(len(examples), 1)


def gate(
    metric: str, base_metric: float, finetuned_metric: float, gguf_metric: float, min_improvement: float, max_gguf_drop: float
) -> dict:
    """The eval gate: the fine-tuned model beats its base by ``min_improvement``, and the shipped GGUF stays
    within ``max_gguf_drop`` of the fine-tuned model (same prompts, same metric); ``passed`` when both hold."""
    improvement = finetuned_metric - base_metric
    gguf_drop = finetuned_metric - gguf_metric
    return {
        "metric_name": metric,
        "base_metric": base_metric,
        "finetuned_metric": finetuned_metric,
        "gguf_metric": gguf_metric,
        "improvement": improvement,
        "min_improvement": min_improvement,
        "gguf_drop": gguf_drop,
        "max_gguf_drop": max_gguf_drop,
        "beats_base": improvement >= min_improvement,
        "gguf_within_drop": gguf_drop <= max_gguf_drop,
        "passed": improvement >= min_improvement and gguf_drop <= max_gguf_drop,
    }


def comparison_table(
    examples: list[EvalExample], base: ModelScore, tuned: ModelScore, gguf: list[str], gguf_label: str, n: int = 5, width: int = 90
) -> str:
    def cell(text: str) -> str:
        text = text.replace("|", "\\|").replace("\n", " ")
        return text[:width] + ("…" if len(text) > width else "")

    lines = [f"| prompt | reference | base | fine-tuned | {gguf_label} |", "| --- | --- | --- | --- | --- |"]
    for example, a, b, c in list(zip(examples, base.answers, tuned.answers, gguf))[:n]:
        prompt = next((m["content"] for m in reversed(example.prompt) if m["role"] == "user"), "")
        lines.append(f"| {cell(prompt)} | {cell(example.reference)} | {cell(a)} | {cell(b)} | {cell(c)} |")
    return "\n".join(lines)


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


def gguf_pair_scores(path: Path, rows):
    """The same log-probabilities as ``pair_scores``, of a GGUF file through llama.cpp: each sequence evaluated
    alone (its own positions, as in the packed rows), the log-softmax of its logits summed over the reply's tokens."""
    import numpy as np
    import torch

    from ft_assets.delivery import llamacpp
    from ft_assets.shards import IGNORE_INDEX
    from ft_assets.training.loss import PairLogps

    llm = llamacpp.load(path, logits_all=True, n_ctx=max(llamacpp.N_CTX, rows.seq_len))
    sums, tokens = torch.zeros(rows.pair_mask.shape + (2,)), torch.zeros(rows.pair_mask.shape + (2,))
    try:
        for row, k in zip(*rows.pair_mask.nonzero(as_tuple=True)):
            for side in (0, 1):
                where = rows.segment_ids[row] == 2 * k + side
                ids, labels = rows.input_ids[row][where].tolist(), rows.labels[row][where].numpy()
                logits = llamacpp.logits(llm, ids)[:-1].astype(np.float64)
                logps = logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)
                learned = np.flatnonzero(labels[1:] != IGNORE_INDEX)
                sums[row, k, side] = float(logps[learned, labels[1:][learned]].sum())
                tokens[row, k, side] = len(learned)
    finally:
        llm.close()
    return PairLogps(sums[..., 0], sums[..., 1], tokens[..., 0], tokens[..., 1])


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


def pair_table(tokenizer, rows, base, tuned, beta: float, n: int = 5, width: int = 70) -> str:
    """The first ``n`` eval pairs, decoded from the shards: both replies and each model's margin on them."""
    from ft_assets.shards import IGNORE_INDEX

    def cell(tokens) -> str:
        text = tokenizer.decode(tokens, skip_special_tokens=True).replace("|", "\\|").replace("\n", " ").strip()
        return text[:width] + ("…" if len(text) > width else "")

    lines = ["| chosen | rejected | base margin | fine-tuned margin |", "| --- | --- | --- | --- |"]
    for row, k in zip(*rows.pair_mask.nonzero(as_tuple=True)):
        if len(lines) - 2 >= n:
            break
        learned = rows.labels[row] != IGNORE_INDEX
        chosen, rejected = (rows.input_ids[row][learned & (rows.segment_ids[row] == 2 * k + side)] for side in (0, 1))
        margins = [beta * float(scores.chosen[row, k] - scores.rejected[row, k]) for scores in (base, tuned)]
        lines.append(f"| {cell(chosen)} | {cell(rejected)} | {margins[0]:+.3f} | {margins[1]:+.3f} |")
    return "\n".join(lines)
