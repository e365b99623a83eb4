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
from ft_assets.data.images import IMAGE_MARKER
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


def eval_examples(rows: list[dict], limit: int, images_dir: Path | None = None) -> list[EvalExample]:
    """The first ``limit`` eval rows (file order is fixed by the split), cut before the last reply; a turn that holds
    images (a vision-language model's rows) as content parts, each image part naming its file in ``images_dir``
    (``with_image_files``)."""
    examples = []
    for row in rows[:limit]:
        messages = row["messages"]
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        prompt = [with_image_files(m, images_dir) if m.get("images") else m for m in messages[:last]]
        examples.append(EvalExample(row["source"], prompt, messages[last]["content"]))
    return examples


def with_image_files(message: dict, images_dir: Path | None) -> dict:
    """A stored turn with images (``<image>`` markers in its text, its ``images`` references) as the content parts every
    runtime takes: ``{"type": "text", "text": ...}`` and ``{"type": "image", "image": "<local file>"}`` in order."""
    from ft_assets.data.chat_encoding import image_parts

    if images_dir is None:
        raise ValueError("the eval rows hold images, but the eval shards have none (a text model's shards?)")
    files = iter(message["images"])
    parts = [{**part, "image": str(images_dir / next(files))} if part["type"] == "image" else part
             for part in image_parts(message)]  # fmt: skip
    return {k: v for k, v in message.items() if k != "images"} | {"content": parts}


def has_images(prompts: list[list[dict]]) -> bool:
    return any(isinstance(m["content"], list) for p in prompts for m in p)


def image_files(prompt: list[dict]) -> list[str]:
    """A prompt's image files, in order."""
    return [part["image"] for m in prompt if isinstance(m["content"], list) for part in m["content"]
            if part["type"] == "image"]  # fmt: skip


def generate(model, tokenizer, prompts: list[list[dict]], max_new_tokens: int, log=print) -> list[str]:
    """Greedy answers for chat prompts, in left-padded batches."""

    def inputs_of(batch: list[list[dict]]) -> dict:
        texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in batch]
        return tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)

    return _greedy(model, tokenizer, prompts, inputs_of, max_new_tokens, log)


def generate_with_images(model, processor, prompts: list[list[dict]], max_new_tokens: int, log=print) -> list[str]:
    """Greedy answers of a vision-language model to chat prompts whose turns hold images (``with_image_files``), through
    its processor (the resize rules and image tokens it trained with), in left-padded batches."""
    from PIL import Image

    def inputs_of(batch: list[list[dict]]) -> dict:
        texts = [processor.apply_chat_template(_rendered(p), tokenize=False, add_generation_prompt=True) for p in batch]
        pictures = [[Image.open(path).convert("RGB") for path in image_files(p)] for p in batch]
        return processor(text=texts, images=pictures if any(pictures) else None, padding=True, return_tensors="pt")

    return _greedy(model, processor.tokenizer, prompts, inputs_of, max_new_tokens, log)


def _greedy(model, tokenizer, prompts: list[list[dict]], inputs_of, max_new_tokens: int, log) -> list[str]:
    """The answers of ``generate`` and ``generate_with_images``: ``inputs_of`` turns a batch of prompts into the model's
    inputs (padded on the left, which ``tokenizer`` is set to), one ``generate`` call per batch."""
    import torch

    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    answers: list[str] = []
    model.eval()
    for start in range(0, len(prompts), GENERATION_BATCH):
        inputs = inputs_of(prompts[start : start + GENERATION_BATCH]).to(model.device)
        with torch.no_grad():
            output = model.generate(
                **inputs,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=stop_tokens(model, tokenizer),
            )
        new_tokens = output[:, inputs["input_ids"].shape[1] :]
        answers.extend(
            tokenizer.decode(answer_ids(tokenizer, row), skip_special_tokens=True) for row in new_tokens.tolist()
        )
        log(f"generated {len(answers)}/{len(prompts)} answers")
    return answers


def _rendered(prompt: list[dict]) -> list[dict]:
    """A prompt as chat templates render it: image parts without their files (the processor takes the pictures)."""
    return [{**m, "content": [{"type": "image"} if part["type"] == "image" else part for part in m["content"]]}
            if isinstance(m["content"], list) else m for m in prompt]  # fmt: skip


def eval_loss(model, shards_dir: Path, batch_size: int = 4, prepare=None) -> float:
    """Mean loss per assistant token over the packed eval shards, computed exactly as in training (``prepare``: a
    vision-language model's pixel inputs of a batch, ``ft_assets.training.vision``)."""
    from ft_assets.shards import load_packed_rows
    from ft_assets.training.loss import eval_loss_sum

    rows = load_packed_rows(shards_dir, "eval", max_seq_len=1 << 30)
    if rows is None:
        raise FileNotFoundError(f"no eval-*.parquet shards in {shards_dir}")
    loss_sum, count = eval_loss_sum(model, rows, batch_size, model.device, prepare=prepare)
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
    model,
    tokenizer,
    examples: list[EvalExample],
    shards_dir: Path,
    metric: str,
    max_new_tokens: int,
    log=print,
    model_dir: Path | None = None,
) -> ModelScore:
    """Eval loss and the task metric of ``model``; a vision-language one (``model_dir`` has a vision tower) sees the
    pictures: its pixel inputs in the loss, its processor for the answers."""
    import math

    from ft_assets.vision import load_processor, model_has_vision

    check_metric(metric)
    prompts = [e.prompt for e in examples]
    if model_dir is not None and model_has_vision(model_dir):
        from ft_assets.training.vision import pixel_inputs

        inputs = pixel_inputs(model_dir, model.config)
        loss = eval_loss(model, shards_dir, prepare=lambda batch: inputs(model, batch))
        answers = generate_with_images(model, load_processor(model_dir), prompts, max_new_tokens, log)
    else:
        loss = eval_loss(model, shards_dir)
        answers = generate(model, tokenizer, prompts, max_new_tokens, log)
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
    content = next((m["content"] for m in reversed(prompt) if m["role"] == "user"), "")
    if isinstance(content, list):  # a turn with images: each image as the marker it stood for
        return "".join(part["text"] if part["type"] == "text" else IMAGE_MARKER for part in content)
    return content


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
