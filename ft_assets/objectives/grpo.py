"""Group relative policy optimisation (``grpo``): prompts, completions sampled and scored by reward functions.

Settings (``lora_adapter: config: {grpo: {rewards: [...], num_generations: 8, ...}}``): the reward
functions, the group size, the longest completion, the sampling temperature, the KL weight, the loss
normalisation and what generates the completions. A run needs reward functions that load where it runs
and DDP (each rank's rollouts end at their own length, so FSDP's sharded forwards would not meet);
``check`` says so when the run is resolved, before a GPU is rented. Like DPO its reference is the base
with the adapter disabled, so method ``full`` is refused. Empty ``learning_rate`` is 5e-6 (Unsloth's GRPO
notebooks, TRL's GRPO + PEFT examples: 5e-6 to 1e-5).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from ft_assets import rewards as rw
from ft_assets.objectives.objective import REFERENCE_IS_THE_BASE, Objective, ObjectiveSettings, Pieces

GRPO_LEARNING_RATE = 5e-6  # LoRA GRPO recipes (Unsloth's GRPO notebooks, TRL's GRPO + PEFT examples: 5e-6 to 1e-5)
EXAMPLE_REWARDS = (
    "['ft_assets.rewards:tool_call_format', 'ft_assets.rewards:tool_call_json', 'ft_assets.rewards:tool_call_name']"
)


class GrpoSettings(ObjectiveSettings):
    """GRPO (prompt versions only): reward functions, group size, completion length, temperature, KL, loss, generator."""

    rewards: list[str] = Field(
        default_factory=list,
        description="Reward functions as 'module:function' or 'path/to/file.py:function', TRL's signature (prompts, "
        "completions, **columns) -> list of floats; a completion's reward is their sum. Built in for tool calls (the "
        "row's 'answer' column is the reference): ft_assets.rewards:tool_call_json, tool_call_name, "
        "tool_call_arguments, tool_call_format.",
    )
    num_generations: int = Field(
        default=8,
        description="Completions sampled per prompt (the group whose mean reward is each one's baseline); a "
        "micro-batch is per_device_batch_size prompts x this many completions.",
    )
    max_completion_length: int = Field(
        default=256, ge=1, description="Longest completion generated, in tokens (prompt + completion <= max_seq_len)."
    )
    temperature: float = Field(
        default=1.0, gt=0, description="Sampling temperature of the completions (their log-probabilities use the same)."
    )
    beta: float = Field(
        default=0.04,
        ge=0,
        description="Weight of the KL penalty to the reference (the base with the adapter disabled); 0 skips the "
        "reference forward. 0.04 as in DeepSeekMath's GRPO.",
    )
    loss: Literal["dapo", "grpo"] = Field(
        default="dapo",
        description="Loss normalisation: 'dapo' (TRL's default: a mean over every completion token of the step) or "
        "'grpo' (each completion's token mean, then the mean over completions: the paper's, biased to short replies).",
    )
    generation_backend: Literal["auto", "transformers", "vllm"] = Field(
        default="auto",
        description="What generates the completions: 'vllm' (colocated on the training GPU; needs vllm installed), "
        "'transformers' (model.generate), or 'auto' (vllm on CUDA when installed, else transformers).",
    )

    @field_validator("rewards")
    @classmethod
    def _reward_specs(cls, value: list[str]) -> list[str]:
        bad = [spec for spec in value if not spec.rpartition(":")[0] or not spec.rpartition(":")[2]]
        if bad:
            raise ValueError(f"name each as 'module:function' or 'path/to/file.py:function', not {bad}")
        return value

    @field_validator("num_generations")
    @classmethod
    def _a_group(cls, value: int) -> int:
        if value < 2:
            raise ValueError("must be >= 2: a group of one has no baseline")
        return value

    def check(self, training: Any) -> None:
        """Reward functions that load here, and DDP (a ValueError says which and why)."""
        if not self.rewards:
            raise ValueError(
                f"a prompt version trains with GRPO, which needs reward functions: set grpo.rewards, e.g. {EXAMPLE_REWARDS}"
            )
        rw.load_rewards(self.rewards)
        # each rank's rollouts end at their own length: sharded forwards would not meet
        if training.parallelism == "fsdp":
            raise ValueError(
                "GRPO trains with parallelism 'ddp' (each process holds the model and samples its own prompts); set parallelism ddp"
            )


GRPO = Objective(
    "grpo", "prompt", "prompts",
    Pieces(
        clean_row="ft_assets.data.prompts:clean_prompt",
        pack_kind="ft_assets.data.prompt_packing:PROMPTS",
        step="ft_assets.training.grpo:GrpoStep",
        scorer="ft_assets.delivery.scoring:RewardScorer",
    ),
    settings=GrpoSettings, learning_rate=GRPO_LEARNING_RATE, full_refused=f"GRPO {REFERENCE_IS_THE_BASE}",
)  # fmt: skip
