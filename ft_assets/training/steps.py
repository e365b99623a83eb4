"""What one optimizer step minimises and what the recipe's evals report, per objective.

The recipe (``ft_assets.training.recipe``) is the same loop for every objective: data order,
checkpoints, resume, SIGTERM and DDP are shared code. What differs is here, behind one interface
that the objective (``ft_assets.objectives``) carries, ``TrainingStep``:

- ``load_rows``: the shard reader (packed chat rows, packed preference pairs, or prompts);
- ``check_settings``: what the objective needs of the settings (GRPO: its reward functions), said by
  the plan before any GPU is rented;
- ``describe_rows``: what the run trains on, for its first log line;
- ``work``: what a run computes (rows, tokens, the reference's forward, generation), for the planner;
- ``for_run``: the ``StepRun`` one run uses (SFT and DPO are stateless: themselves; GRPO loads the
  tokenizer, the reward functions and the generator once);

and ``StepRun``, what the recipe calls at every step:

- ``rollout``: what the loss needs beyond the rows, from the model before the step's update (SFT
  and DPO: nothing; GRPO generates completions, scores them and packs them with their advantages);
- ``count``: what the step's loss is a mean over (learned tokens, pairs, completion tokens or
  completions) — the recipe sums it over the micro-batches and processes of a step, so the loss is
  the true mean whatever the packing put in each row;
- ``loss_sum``: the summed loss of a micro-batch;
- ``evaluate``: the eval figures, as sums to reduce over processes and a divisor (the headline first);
- ``figures``: the objective's own per-step figures since the last log line (GRPO: reward mean and
  std, KL, completion length), for the log, MLflow and the adapter's metadata.

DPO's reference policy is the base with the adapter disabled (peft's ``disable_adapter()``), so no
second copy of the model exists and the reference's log-probabilities are recomputed every step
(one forward without gradients, ~1/3 more compute) instead of precomputed and stored. GRPO's is the
same (``ft_assets.training.rollout``), once per rollout.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from ft_assets import rewards as rw
from ft_assets.delivery.evaluate import stop_tokens
from ft_assets.shards import IGNORE_INDEX, PackedRows, PromptRows, load_packed_rows, load_pair_rows, load_prompt_rows
from ft_assets.training import rollout as ro
from ft_assets.training.config import ResolvedTraining, TrainingConfig
from ft_assets.training.loss import (
    all_pair_logps,
    dpo_loss_sum,
    eval_loss_sum,
    grpo_loss_sum,
    learned_tokens,
    pair_count,
    pair_logps,
    preference_metrics,
    token_logps,
    token_loss_sum,
)

Reduce = Callable[[list[float]], torch.Tensor]  # figures -> a float32 tensor of their sums over the processes


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

    def rollout(self, unwrapped, batch: dict, seed: int, step: int) -> dict[str, torch.Tensor]: ...

    def count(self, batch: dict[str, torch.Tensor]) -> int: ...

    def loss_sum(self, model, unwrapped, batch: dict[str, torch.Tensor], config: TrainingConfig) -> torch.Tensor: ...

    def evaluate(
        self, unwrapped, rows: PackedRows, config: TrainingConfig, device: torch.device, rank: int, world: int, reduce: Reduce
    ) -> dict[str, float]: ...

    def figures(self) -> dict[str, float]: ...


class TrainingStep(Protocol):
    """The objective-specific part of the recipe, before a run starts."""

    def load_rows(self, shards_dir: Path, split: str, max_seq_len: int) -> PackedRows | PromptRows | None: ...

    def check_settings(self, config: TrainingConfig) -> None: ...

    def describe_rows(self, rows: PackedRows | PromptRows, config: TrainingConfig) -> str: ...

    def work(self, config: TrainingConfig, shards: dict, resolved: ResolvedTraining) -> StepWork: ...

    def for_run(self, config: TrainingConfig, base_model_dir: Path, model) -> StepRun: ...


class StatelessStep:
    """What SFT and DPO share: no settings of their own to check, no rollout, no figures beyond the loss."""

    reference_forward = False  # DPO: the base's forward beside the policy's

    def check_settings(self, config: TrainingConfig) -> None:
        pass

    def work(self, config: TrainingConfig, shards: dict, resolved: ResolvedTraining) -> StepWork:
        """Packed rows of the shards' seq_len, per_device_batch_size a forward."""
        seq_len = shards["seq_len"]
        tokens = resolved.total_steps * resolved.rows_per_step * seq_len
        return StepWork(seq_len, seq_len, config.per_device_batch_size, tokens, self.reference_forward, 0.0, 0)

    def for_run(self, config: TrainingConfig, base_model_dir: Path, model) -> StatelessStep:
        return self

    def rollout(self, unwrapped, batch: dict, seed: int, step: int) -> dict[str, torch.Tensor]:
        return batch

    def figures(self) -> dict[str, float]:
        return {}


class TokenLossStep(StatelessStep):
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


EVAL_PROMPTS = 16  # prompts per greedy generate() call of the eval
GRPO_EXAMPLE_REWARDS = "['ft_assets.rewards:tool_call_format', 'ft_assets.rewards:tool_call_json', 'ft_assets.rewards:tool_call_name']"


class GrpoStep:
    """GRPO on prompt shards: completions sampled per prompt, scored by the run's reward functions, the policy
    pushed toward the better ones of each group, held to the base (adapter disabled) by a KL penalty."""

    def load_rows(self, shards_dir: Path, split: str, max_seq_len: int) -> PromptRows | None:
        return load_prompt_rows(shards_dir, split, max_seq_len)

    def check_settings(self, config: TrainingConfig) -> None:
        """GRPO needs reward functions that load here (a ValueError says which does not and why)."""
        if not config.rewards:
            raise ValueError(f"a prompt version trains with GRPO, which needs reward functions: set rewards, e.g. {GRPO_EXAMPLE_REWARDS}")
        rw.load_rewards(config.rewards)
        if config.parallelism == "fsdp":  # each rank's rollouts end at their own length: sharded forwards would not meet
            raise ValueError("GRPO trains with parallelism 'ddp' (each process holds the model and samples its own prompts); set parallelism ddp")

    def describe_rows(self, rows: PromptRows, config: TrainingConfig) -> str:
        return (
            f" (prompts; {config.num_generations} completions each of up to {config.max_completion_length} tokens, "
            f"rewards {', '.join(config.rewards)}, beta {config.grpo_beta:g}, {config.grpo_loss} loss)"
        )

    def work(self, config: TrainingConfig, shards: dict, resolved: ResolvedTraining) -> StepWork:
        """Every prompt of a step and its num_generations completions (at most max_completion_length tokens, planned at
        that), one micro-batch's sequences packed in one row."""
        prompt = -(-shards["train_tokens"] // max(shards["train_rows"], 1))  # the mean prompt, in tokens
        sequence = prompt + config.max_completion_length
        group = config.per_device_batch_size * config.num_generations
        tokens = resolved.total_steps * resolved.rows_per_step * config.num_generations * sequence
        return StepWork(group * sequence, sequence, 1, tokens, config.grpo_beta > 0, config.max_completion_length / sequence, group)

    def for_run(self, config: TrainingConfig, base_model_dir: Path, model) -> GrpoRun:
        return GrpoRun(config, base_model_dir, model)


class GrpoRun:
    """One GRPO run's state: the tokenizer, the reward functions, the generator and the figures since the last log."""

    def __init__(self, config: TrainingConfig, base_model_dir: Path, model):
        from transformers import AutoTokenizer  # seconds to import; only the training process needs it

        self.tokenizer = AutoTokenizer.from_pretrained(base_model_dir)
        self.rewards = rw.load_rewards(config.rewards)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        # a completion ends at the tokenizer's eos or any end-of-turn id of the generation config, as eval answers do
        sampling = ro.Sampling(config.max_completion_length, config.temperature, stop_tokens(model, self.tokenizer), pad)
        device = next(model.parameters()).device
        self.generator = ro.make_generator(
            config.generation_backend, sampling, base_model_dir, config.max_seq_len, config.lora_r, device
        )  # fmt: skip
        self.config, self.window = config, ro.RolloutFigures()

    def rollout(self, unwrapped, batch: dict, seed: int, step: int) -> dict[str, torch.Tensor]:
        return ro.rollout(unwrapped, self.generator, self.tokenizer, self.rewards, batch, self.config, seed, step, self.window)

    def count(self, batch: dict[str, torch.Tensor]) -> int:
        return int(batch["items"])

    def loss_sum(self, model, unwrapped, batch: dict[str, torch.Tensor], config: TrainingConfig) -> torch.Tensor:
        logps = token_logps(model, batch, config.temperature)
        reference = batch.get("reference_logps")
        completion = batch["labels"][:, 1:] != IGNORE_INDEX
        if reference is not None:
            with torch.no_grad():
                difference = reference - logps
                self.window.kl_sum += float(((difference.exp() - difference - 1) * completion).sum())
            self.window.kl_tokens += int(completion.sum())
        return grpo_loss_sum(logps, reference, batch["advantages"][:, 1:], batch["weights"][:, 1:], config.grpo_beta)

    def evaluate(self, unwrapped, rows: PromptRows, config, device, rank, world, reduce) -> dict[str, float]:
        """The mean reward of greedy completions of every eval prompt (``eval_reward_mean``), and of the reference's
        (the base, adapter disabled), each process taking every world-th prompt."""
        prompts = rows.prompts[rank::world]
        sums = []
        for adapter in (True, False):
            total, count = 0.0, 0
            for start in range(0, len(prompts), EVAL_PROMPTS):
                part = prompts[start : start + EVAL_PROMPTS]
                with nullcontext() if adapter else unwrapped.disable_adapter():
                    completions = ro.TransformersGenerator(self.generator.sampling).generate(unwrapped, [p.input_ids for p in part], 1, None)
                _, rewards = ro.score_completions(self.tokenizer, self.rewards, part, completions, 1)
                scored = rewards[~rewards.isnan()]
                total, count = total + float(scored.sum()), count + len(scored)
            sums += [total, count]
        total = reduce(sums).tolist()
        return {"eval_reward_mean": total[0] / max(total[1], 1), "eval_reference_reward_mean": total[2] / max(total[3], 1)}

    def figures(self) -> dict[str, float]:
        """Reward mean and std, KL and completion length of the rollouts since the last call."""
        figures, self.window = self.window.summary(), ro.RolloutFigures()
        return figures
