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
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

METRICS = ("exact_match", "token_f1", "rouge_l")
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
