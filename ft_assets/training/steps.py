"""What one optimizer step minimises and what the recipe's evals report, per objective.

The recipe (``ft_assets.training.recipe``) is the same loop for every objective: data order,
checkpoints, resume, SIGTERM and DDP are shared code. What differs is here, behind one interface
(``TrainingStep``) that the objective (``ft_assets.objectives``) carries:

- ``load_rows``: the shard reader (packed chat rows, or packed preference pairs);
- ``count``: what the step's loss is a mean over (learned tokens, or pairs) — the recipe sums it over
  the micro-batches and processes of a step, so the loss is the true mean whatever the packing put
  in each row;
- ``loss_sum``: the summed loss of a micro-batch;
- ``evaluate``: the eval figures, as sums to reduce over processes and a divisor.

DPO's reference policy is the base with the adapter disabled (peft's ``disable_adapter()``), so no
second copy of the model exists and the reference's log-probabilities are recomputed every step
(one forward without gradients, ~1/3 more compute) instead of precomputed and stored.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch

from ft_assets.shards import PackedRows, load_packed_rows, load_pair_rows
from ft_assets.training.config import TrainingConfig
from ft_assets.training.loss import (
    all_pair_logps,
    dpo_loss_sum,
    eval_loss_sum,
    learned_tokens,
    pair_count,
    pair_logps,
    preference_metrics,
    token_loss_sum,
)

Reduce = Callable[[list[float]], torch.Tensor]  # figures -> a float32 tensor of their sums over the processes


class TrainingStep(Protocol):
    """The objective-specific part of the recipe."""

    def load_rows(self, shards_dir: Path, split: str, max_seq_len: int) -> PackedRows | None: ...

    def count(self, batch: dict[str, torch.Tensor]) -> int: ...

    def loss_sum(self, model, unwrapped, batch: dict[str, torch.Tensor], config: TrainingConfig) -> torch.Tensor: ...

    def evaluate(
        self, unwrapped, rows: PackedRows, config: TrainingConfig, device: torch.device, rank: int, world: int, reduce: Reduce
    ) -> dict[str, float]: ...

    def describe_rows(self, rows: PackedRows, config: TrainingConfig) -> str: ...


class TokenLossStep:
    """Supervised fine-tuning: cross-entropy on the assistant tokens of packed chat rows."""

    def load_rows(self, shards_dir: Path, split: str, max_seq_len: int) -> PackedRows | None:
        return load_packed_rows(shards_dir, split, max_seq_len)

    def count(self, batch: dict[str, torch.Tensor]) -> int:
        return learned_tokens(batch)

    def loss_sum(self, model, unwrapped, batch: dict[str, torch.Tensor], config: TrainingConfig) -> torch.Tensor:
        return token_loss_sum(model, batch)

    def evaluate(self, unwrapped, rows, config, device, rank, world, reduce) -> dict[str, float]:
        """``eval_loss``: the mean token loss over every eval row, each process taking every world-th row."""
        loss_sum, count = eval_loss_sum(unwrapped, rows, config.per_device_batch_size, device, rank, world)
        total = reduce([loss_sum, count])
        return {"eval_loss": float(total[0] / max(total[1], 1))}

    def describe_rows(self, rows: PackedRows, config: TrainingConfig) -> str:
        return ""


class DpoStep:
    """DPO on packed preference pairs against the base with the adapter disabled (``ft_assets.training.loss``)."""

    def load_rows(self, shards_dir: Path, split: str, max_seq_len: int) -> PackedRows | None:
        return load_pair_rows(shards_dir, split, max_seq_len)

    def count(self, batch: dict[str, torch.Tensor]) -> int:
        return pair_count(batch)

    def loss_sum(self, model, unwrapped, batch: dict[str, torch.Tensor], config: TrainingConfig) -> torch.Tensor:
        policy = pair_logps(model, batch)
        with torch.no_grad(), unwrapped.disable_adapter():
            reference = pair_logps(unwrapped, batch)
        return dpo_loss_sum(policy, reference, batch["pair_mask"], config.dpo_beta, config.dpo_loss)

    def evaluate(self, unwrapped, rows, config, device, rank, world, reduce) -> dict[str, float]:
        """The mean DPO loss of the eval pairs (``eval_loss``) with the reward accuracy and margin of the model
        and of its reference (``ft_assets.training.loss.preference_metrics``)."""
        batch = config.per_device_batch_size
        policy, pair_mask = all_pair_logps(unwrapped, rows, batch, device, rank, world)
        with unwrapped.disable_adapter():
            reference, _ = all_pair_logps(unwrapped, rows, batch, device, rank, world)
        sums = preference_metrics(policy, reference, pair_mask, config.dpo_beta, config.dpo_loss)
        names = list(sums)
        total = dict(zip(names, reduce([sums[name] for name in names]).tolist()))
        pairs = max(total.pop("pairs"), 1)
        return {f"eval_{name}": value / pairs for name, value in total.items()}

    def describe_rows(self, rows, config: TrainingConfig) -> str:
        return f" ({rows.pairs} pairs; beta {config.dpo_beta:g}, {config.dpo_loss} loss)"
