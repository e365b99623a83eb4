"""A first run with the default training settings learns a small task (issue: defaults that learn).

240 one-line requests, each answered with the same short tool call, pack into 30 rows: 7 optimizer
steps an epoch at the default batch of 4. The old defaults (1 epoch, a fixed 10-step warmup that the
run never finishes) left the tiny model's exact match at 0; the current ones (3 epochs but at least
200 steps, 3% warmup, lr 2e-4 for LoRA) make it answer the held-out prompts.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from ft_assets.data.chat_encoding import ChatEncoder
from ft_assets.data.tokenizing import tokenize_and_pack
from ft_assets.delivery import evaluate as ev
from ft_assets.delivery.merge import load_full_precision, merge_adapter
from ft_assets.objectives import SFT
from ft_assets.storage import LocalStore
from ft_assets.training.config import TrainingConfig
from ft_assets.training.recipe import train

pytestmark = pytest.mark.integration
ANSWER = '{"name": "ok"}'
OLD_DEFAULTS = {"epochs": 1, "min_steps": 0, "warmup_steps": 10, "learning_rate": 2e-4}


def conversation(i: int) -> list[dict]:
    return [
        {"role": "user", "content": f"Request number {i}: please acknowledge item {i * 7 % 1000}."},
        {"role": "assistant", "content": ANSWER},
    ]


@pytest.fixture(scope="module")
def small_task(tmp_path_factory):
    from ft_assets_tests.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("small-task")
    model_dir = build_tiny_model(root / "tiny")
    encoder = ChatEncoder(AutoTokenizer.from_pretrained(model_dir))
    shards = root / "shards"
    shards.mkdir()
    train_rows = tokenize_and_pack(((f"r{i}", conversation(i)) for i in range(240)), encoder, 512, shards, "train")
    tokenize_and_pack(((f"e{i}", conversation(10_000 + i)) for i in range(12)), encoder, 512, shards, "eval")
    examples = ev.eval_examples([{"source": f"e{i}", "messages": conversation(10_000 + i)} for i in range(12)], 12)
    return root, model_dir, shards, train_rows.rows, examples


def exact_match_after_training(small_task, name: str, settings: TrainingConfig) -> tuple[float, float, int]:
    root, model_dir, shards, _, examples = small_task
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = train(
            settings,
            model_dir,
            shards,
            LocalStore(root / name / "store"),
            "runs/t/v/train/r",
            root / name / "work",
            log=print,
        )
        merge_adapter(model_dir, result.output_dir, root / name / "merged")
        scores = {}
        for label, directory in (("base", model_dir), ("tuned", root / name / "merged")):
            tokenizer = AutoTokenizer.from_pretrained(directory)
            scores[label] = ev.score_model(
                load_full_precision(directory), tokenizer, examples, shards, "exact_match", 12, log=lambda _: None
            )
    finally:
        torch.set_num_threads(threads)
    return scores["base"].metric, scores["tuned"].metric, result.steps


def test_the_defaults_resolve_to_a_run_long_enough_for_a_small_dataset(small_task):
    _, _, _, packed_rows, _ = small_task
    resolved = TrainingConfig().resolve(packed_rows, False, SFT)
    assert resolved.steps_per_epoch == packed_rows // 4
    assert resolved.total_steps == 200 and resolved.epochs > 3  # min_steps outweighs 3 epochs of a small set
    assert (resolved.method, resolved.learning_rate, resolved.warmup_steps) == ("lora", 2e-4, 6)
    assert TrainingConfig(method="full").resolve(packed_rows, False, SFT).learning_rate == 2e-5
    assert TrainingConfig(max_steps=10).resolve(packed_rows, False, SFT).total_steps == 10
    old = TrainingConfig(**OLD_DEFAULTS).resolve(packed_rows, False, SFT)
    assert old.total_steps == packed_rows // 4 and old.warmup_steps == old.total_steps  # never leaves warmup


def test_default_settings_beat_the_base_where_the_old_defaults_did_not(small_task):
    base, tuned, steps = exact_match_after_training(small_task, "defaults", TrainingConfig(method="lora"))
    assert steps == 200
    assert base == 0.0 and tuned >= 0.75, (base, tuned)
    base, old, _ = exact_match_after_training(small_task, "old", TrainingConfig(method="lora", **OLD_DEFAULTS))
    assert old == 0.0  # what a first run got before: the delivery gate rightly blocked it
