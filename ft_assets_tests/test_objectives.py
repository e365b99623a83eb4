"""The objective: chosen once from the data, recorded by name, and the one place SFT, DPO and GRPO differ."""

import pytest

from ft_assets import objectives
from ft_assets.data.kinds import CHAT, PREFERENCE, PROMPT
from ft_assets.objectives import DPO, GRPO, SFT
from ft_assets.training.config import TrainingConfig

CASES = [  # objective, the data kind raw_dataset finds, items, the gate's metric, default lr (lora), full fine-tuning allowed
    (SFT, CHAT, "examples", "exact_match", 2e-4, True),
    (DPO, PREFERENCE, "pairs", "reward_accuracy", 5e-6, False),
    (GRPO, PROMPT, "prompts", "reward_mean", 5e-6, False),
]
REWARDS = ["ft_assets.rewards:tool_call_json"]  # GRPO needs reward functions; the others ignore them


@pytest.mark.parametrize("objective, kind, items, metric, learning_rate, full", CASES, ids=[c[0].name for c in CASES])
def test_each_objective_carries_what_differs(objective, kind, items, metric, learning_rate, full):
    assert objectives.for_data_kind(kind) is objective and objectives.named(objective.name) is objective
    assert objectives.of_stats({"objective": objective.name}) is objective
    assert objective.items == items
    assert objective.scorer("exact_match", 10, 8, {"dpo_beta": 0.1, "dpo_loss": "sigmoid", "rewards": REWARDS}).metric == metric
    assert TrainingConfig(method="lora", rewards=REWARDS).resolve(400, False, objective).learning_rate == learning_rate
    if full:
        assert TrainingConfig(method="full", rewards=REWARDS).resolve(400, False, objective).method == "full"
    else:
        with pytest.raises(ValueError, match="method 'full'"):
            TrainingConfig(method="full", rewards=REWARDS).resolve(400, False, objective)


def test_an_unknown_objective_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown objective 'ppo'; one of sft, dpo, grpo"):
        objectives.named("ppo")


def test_the_json_summary_has_the_same_keys_whatever_the_objective():
    stats = {"finetuned_metric": 0.9, "base_metric": 0.5, "finetuned_reward_margin": 0.4, "base_reward_margin": 0.0}
    rewards = {"finetuned_reward_mean": 2.5, "base_reward_mean": 0.5}  # GRPO's, and a chat run's scored by a reward function
    dpo = objectives.summary_figures({**stats, "objective": "dpo"})
    sft = objectives.summary_figures({**stats, "objective": "sft", "finetuned_reward_mean": None, "base_reward_mean": None})
    grpo = objectives.summary_figures({**stats, **rewards, "objective": "grpo"})
    assert dpo.keys() == sft.keys() == grpo.keys() and set(sft.values()) == {None}
    assert {key: value for key, value in dpo.items() if value is not None} == {
        "reward_accuracy": 0.9, "base_reward_accuracy": 0.5, "reward_margin": 0.4, "base_reward_margin": 0.0}
    assert {key: value for key, value in grpo.items() if value is not None} == {"reward_mean": 2.5, "base_reward_mean": 0.5}
    assert objectives.summary_figures({**stats, **rewards, "objective": "sft"})["reward_mean"] == 2.5
