"""The objective: chosen once from the data, recorded by name, and the one place SFT and DPO differ."""

import pytest

from ft_assets import objectives
from ft_assets.data.preference import CHAT, PREFERENCE
from ft_assets.objectives import DPO, SFT
from ft_assets.training.config import TrainingConfig

CASES = [  # objective, the data kind raw_dataset finds, items, the gate's metric, default lr (lora), full fine-tuning allowed
    (SFT, CHAT, "examples", "exact_match", 2e-4, True),
    (DPO, PREFERENCE, "pairs", "reward_accuracy", 5e-6, False),
]


@pytest.mark.parametrize("objective, kind, items, metric, learning_rate, full", CASES, ids=[c[0].name for c in CASES])
def test_each_objective_carries_what_differs(objective, kind, items, metric, learning_rate, full):
    assert objectives.for_data_kind(kind) is objective and objectives.named(objective.name) is objective
    assert objectives.of_stats({"objective": objective.name}) is objective
    assert objective.items == items
    assert objective.scorer("exact_match", 10, 8, {"dpo_beta": 0.1, "dpo_loss": "sigmoid"}).metric == metric
    assert TrainingConfig(method="lora").resolve(400, False, objective).learning_rate == learning_rate
    if full:
        assert TrainingConfig(method="full").resolve(400, False, objective).method == "full"
    else:
        with pytest.raises(ValueError, match="method 'full'"):
            TrainingConfig(method="full").resolve(400, False, objective)


def test_an_unknown_objective_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown objective 'ppo'; one of sft, dpo"):
        objectives.named("ppo")


def test_the_json_summary_has_the_same_keys_whatever_the_objective():
    stats = {"finetuned_metric": 0.9, "base_metric": 0.5, "finetuned_reward_margin": 0.4, "base_reward_margin": 0.0}
    dpo = objectives.summary_figures({**stats, "objective": "dpo"})
    sft = objectives.summary_figures({**stats, "objective": "sft"})
    assert dpo.keys() == sft.keys() and set(sft.values()) == {None}
    assert dpo == {"reward_accuracy": 0.9, "base_reward_accuracy": 0.5, "reward_margin": 0.4, "base_reward_margin": 0.0}
