"""What one optimizer step minimises and what the recipe's evals report, per objective.

The recipe (``ft_assets.training.recipe``) is the same loop for every objective: data order,
checkpoints, resume, SIGTERM and DDP are shared code. What differs is here, behind one interface
that the objective (``ft_assets.objectives``) names, ``TrainingStep``:

- ``load_rows``: the shard reader (packed chat rows, packed preference pairs, or prompts);
- ``describe_rows``: what the run trains on, for its first log line;
- ``work``: what a run computes (rows, tokens, the reference's forward, generation), for the planner;
- ``for_run``: the ``StepRun`` one run uses (SFT and DPO are stateless: themselves; GRPO loads the
  tokenizer, the reward functions and the generator once);

and ``StepRun``, what the recipe calls at every step:

- ``rollout``: what the loss needs beyond the rows, from the model before the step's update, given
  where the micro-batch is (step, rank, micro-batch) (SFT and DPO: nothing; GRPO generates completions
  seeded from where they are, scores them and packs them with their advantages);
- ``count``: what the step's loss is a mean over (learned tokens, pairs, completion tokens or
  completions) — the recipe sums it over the micro-batches and processes of a step, so the loss is
  the true mean whatever the packing put in each row;
- ``loss_sum``: the summed loss of a micro-batch;
- ``evaluate``: the eval figures, as sums to reduce over processes and a divisor (the headline first);
- ``figures``: the objective's own per-step figures since the last log line (GRPO: reward mean and
  std, KL, completion length), averaged over the processes with the recipe's ``mean``, for the log,
  MLflow and the adapter's metadata.

DPO's reference policy is the base with the adapter disabled (peft's ``disable_adapter()``), so no
second copy of the model exists and the reference's log-probabilities are recomputed every step
(one forward without gradients, ~1/3 more compute) instead of precomputed and stored. GRPO's is the
same, once per rollout; its step, run and rollouts are ``ft_assets.training.grpo``. Each step reads its
objective's own settings from the run's config (``config.dpo``: ``ft_assets.objectives.dpo.DpoSettings``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from ft_assets.shards import PackedRows, PromptRows, load_packed_rows, load_pair_rows
from ft_assets.training.config import ResolvedTraining, TrainingConfig
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
from ft_assets.training.vision import pixel_inputs
from ft_assets.vision import model_has_vision

Reduce = Callable[[list[float]], torch.Tensor]  # figures -> a float32 tensor of their sums over the processes
Prepare = Callable[[dict], dict]  # a host batch of rows -> the forward's inputs (a vision-language model's pixels)
Mean = Callable[[list[float]], list[float]]  # figures -> their means over the processes


@dataclass(frozen=True)
class StepWork:
    """What a run computes, for the planner (``ft_assets.control.planner.objective_cost``)."""

    seq_len: int  # tokens of one row a forward sees (GRPO: a micro-batch's sequences packed together)
    attention_len: int  # tokens a token attends over at most (a packed row; GRPO: one prompt + completion)
    micro_batch: int  # rows per forward
    tokens: int  # trained tokens of the whole run, every process
    reference_forward: bool  # the base (adapter disabled) also runs a forward over every trained token
    generated_share: float  # share of the trained tokens generated first (GRPO's completions); 0 for the others
    decode_batch: int  # sequences generated together (GRPO: prompts x num_generations of a micro-batch)


class StepRun(Protocol):
    """The objective-specific part of one run of the recipe."""

    def rollout(self, unwrapped, batch: dict, step: int, rank: int, micro: int) -> dict[str, torch.Tensor]: ...

    def count(self, batch: dict[str, torch.Tensor]) -> int: ...

    def loss_sum(self, model, unwrapped, batch: dict[str, torch.Tensor], config: TrainingConfig) -> torch.Tensor: ...

    def evaluate(
        self,
        unwrapped,
        rows: PackedRows,
        config: TrainingConfig,
        device: torch.device,
        rank: int,
        world: int,
        reduce: Reduce,
    ) -> dict[str, float]: ...

    def figures(self, mean: Mean) -> dict[str, float]: ...


class TrainingStep(Protocol):
    """The objective-specific part of the recipe, before a run starts."""

    def load_rows(self, shards_dir: Path, split: str, max_seq_len: int) -> PackedRows | PromptRows | None: ...

    def describe_rows(self, rows: PackedRows | PromptRows, config: TrainingConfig) -> str: ...

    def work(self, config: TrainingConfig, shards: dict, resolved: ResolvedTraining) -> StepWork: ...

    def for_run(self, config: TrainingConfig, base_model_dir: Path, model) -> StepRun: ...


def _unwrapped_config(model):
    """The transformers config of ``model`` under its PEFT / DDP wrappers."""
    while not hasattr(model, "config") or not hasattr(model.config, "model_type"):
        model = model.module if hasattr(model, "module") else model.base_model
    return model.config


class StatelessStep:
    """What SFT and DPO share: no rollout, no figures beyond the loss."""

    reference_forward = False  # DPO: the base's forward beside the policy's

    def work(self, config: TrainingConfig, shards: dict, resolved: ResolvedTraining) -> StepWork:
        """Packed rows of the shards' seq_len, per_device_batch_size a forward."""
        seq_len = shards["seq_len"]
        tokens = resolved.total_steps * resolved.rows_per_step * seq_len
        return StepWork(seq_len, seq_len, config.per_device_batch_size, tokens, self.reference_forward, 0.0, 0)

    def for_run(self, config: TrainingConfig, base_model_dir: Path, model) -> StatelessStep:
        return self

    def rollout(self, unwrapped, batch: dict, step: int, rank: int, micro: int) -> dict[str, torch.Tensor]:
        return batch

    def figures(self, mean: Mean) -> dict[str, float]:
        return {}


class TokenLossStep(StatelessStep):
    """Supervised fine-tuning: cross-entropy on the assistant tokens of packed chat rows (of a vision-language model,
    with the pixels of their images: ``VisionTokenLoss``)."""

    def __init__(self, prepare: Prepare | None = None):
        self.prepare = prepare  # a vision-language model's forward inputs beyond the rows (ft_assets.training.vision)

    def load_rows(self, shards_dir: Path, split: str, max_seq_len: int) -> PackedRows | None:
        return load_packed_rows(shards_dir, split, max_seq_len)

    def for_run(self, config: TrainingConfig, base_model_dir: Path, model) -> TokenLossStep:
        """Itself for a text model; for a vision-language one, the same step with its family's pixel inputs."""
        if not model_has_vision(base_model_dir):
            return self
        inputs = pixel_inputs(base_model_dir, _unwrapped_config(model))
        return TokenLossStep(lambda batch: inputs(model, batch))

    def rollout(self, unwrapped, batch: dict, step: int, rank: int, micro: int) -> dict[str, torch.Tensor]:
        return batch if self.prepare is None else self.prepare(batch)

    def count(self, batch: dict[str, torch.Tensor]) -> int:
        return learned_tokens(batch)

    def loss_sum(self, model, unwrapped, batch: dict[str, torch.Tensor], config: TrainingConfig) -> torch.Tensor:
        return token_loss_sum(model, batch, router_aux=True)

    def evaluate(self, unwrapped, rows, config, device, rank, world, reduce) -> dict[str, float]:
        """``eval_loss``: the mean token loss over every eval row, each process taking every world-th row."""
        loss_sum, count = eval_loss_sum(
            unwrapped, rows, config.per_device_batch_size, device, rank, world, prepare=self.prepare
        )
        total = reduce([loss_sum, count])
        return {"eval_loss": float(total[0] / max(total[1], 1))}

    def describe_rows(self, rows: PackedRows, config: TrainingConfig) -> str:
        return ""


class DpoStep(StatelessStep):
    """DPO on packed preference pairs against the base with the adapter disabled (``ft_assets.training.loss``)."""

    reference_forward = True

    def load_rows(self, shards_dir: Path, split: str, max_seq_len: int) -> PackedRows | None:
        return load_pair_rows(shards_dir, split, max_seq_len)

    def count(self, batch: dict[str, torch.Tensor]) -> int:
        return pair_count(batch)

    def loss_sum(self, model, unwrapped, batch: dict[str, torch.Tensor], config: TrainingConfig) -> torch.Tensor:
        policy = pair_logps(model, batch)
        with torch.no_grad(), unwrapped.disable_adapter():
            reference = pair_logps(unwrapped, batch)
        return dpo_loss_sum(policy, reference, batch["pair_mask"], config.dpo.beta, config.dpo.loss)

    def evaluate(self, unwrapped, rows, config, device, rank, world, reduce) -> dict[str, float]:
        """The mean DPO loss of the eval pairs (``eval_loss``) with the reward accuracy and margin of the model
        and of its reference (``ft_assets.training.loss.preference_metrics``)."""
        batch = config.per_device_batch_size
        policy, pair_mask = all_pair_logps(unwrapped, rows, batch, device, rank, world)
        with unwrapped.disable_adapter():
            reference, _ = all_pair_logps(unwrapped, rows, batch, device, rank, world)
        sums = preference_metrics(policy, reference, pair_mask, config.dpo.beta, config.dpo.loss)
        names = list(sums)
        total = dict(zip(names, reduce([sums[name] for name in names]).tolist()))
        pairs = max(total.pop("pairs"), 1)
        return {f"eval_{name}": value / pairs for name, value in total.items()}

    def describe_rows(self, rows, config: TrainingConfig) -> str:
        return f" ({rows.pairs} pairs; beta {config.dpo.beta:g}, {config.dpo.loss} loss)"
