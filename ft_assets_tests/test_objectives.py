"""The objective: chosen once from the data, recorded by name, and the one place SFT, DPO and GRPO differ.

The checklist (``missing_pieces``) is what a new objective must bring: a data kind raw_dataset finds, a row
cleaner, a pack kind, a training step, a scorer, its settings (or none) nested in the training settings and
the launchpad, and its section of the training guide (docs/guides/training.md). It runs first on objectives built to lack each piece.
"""

from dataclasses import astuple, replace
from pathlib import Path

import pytest

from ft_assets import objectives
from ft_assets.data.kinds import CHAT, PREFERENCE, PROMPT, WHAT
from ft_assets.data.packing import PackKind
from ft_assets.objectives import DPO, GRPO, OBJECTIVES, SFT
from ft_assets.objectives.objective import Objective, ObjectiveSettings, Pieces
from ft_assets.training.config import TrainingConfig
from ft_assets.training.settings import TrainingSettings

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "guides" / "training.md"  # the objectives' guide
REWARDS = ["ft_assets.rewards:tool_call_json"]  # GRPO needs reward functions; the others ignore them
STEP_METHODS = ("load_rows", "describe_rows", "work", "for_run")  # training.steps.TrainingStep
SCORER_METHODS = ("load", "score", "score_export", "report")  # delivery.scoring.Scorer


def missing_pieces(objective: Objective, guide: str) -> list[str]:
    """What ``objective`` lacks of an objective's pieces, one line each (nothing when it is complete)."""
    missing = []
    if objective.data_kind not in WHAT:
        missing.append(f"data kind {objective.data_kind!r} is none that raw_dataset finds ({', '.join(WHAT)})")
    elif [o.name for o in objectives.REGISTERED if o.data_kind == objective.data_kind] != [objective.name]:
        missing.append(f"data kind {objective.data_kind!r} is not its own: raw_dataset could not choose it")
    found = {}
    for name in ("clean_row", "pack_kind", "step", "scorer"):
        try:
            found[name] = getattr(objective, name)
        except (ImportError, AttributeError, TypeError) as exc:
            missing.append(f"{name} {getattr(objective.pieces, name)!r} does not resolve ({exc})")
    if "clean_row" in found and not callable(found["clean_row"]):
        missing.append("clean_row is not a function")
    if "pack_kind" in found and not isinstance(found["pack_kind"], PackKind):
        missing.append("pack_kind is not a PackKind")
    for piece, methods in (("step", STEP_METHODS), ("scorer", SCORER_METHODS)):
        lacks = [m for m in methods if piece in found and not callable(getattr(found[piece], m, None))]
        if lacks:
            missing.append(f"{piece} lacks {', '.join(lacks)}")
    if "scorer" in found and not all(hasattr(found["scorer"], a) for a in ("unit", "summary")):
        missing.append("scorer lacks unit or summary")  # summary: its keys of --json (the gate's metric: per report)
    missing += missing_settings(objective, guide)
    if f"`ft_assets/objectives/{objective.name}.py`" not in guide:
        missing.append(f"the training guide does not name ft_assets/objectives/{objective.name}.py")
    return missing


def missing_settings(objective: Objective, guide: str) -> list[str]:
    """Its settings (if any): help texts, nested in TrainingConfig and the launchpad under its name, in the training guide."""
    settings, missing = objective.settings, []
    if settings is None:
        return []
    if not issubclass(settings, ObjectiveSettings):
        return ["settings are not ObjectiveSettings"]
    nested = TrainingConfig.model_fields.get(objective.name)
    if nested is None or nested.annotation is not settings:
        missing.append(f"settings are not TrainingConfig's {objective.name!r}")
    launchpad = TrainingSettings.model_fields.get(objective.name)
    shown = launchpad.annotation.model_fields if launchpad else {}
    for field, info in settings.model_fields.items():
        if not info.description:
            missing.append(f"setting {objective.name}.{field} has no help text")
        elif not (field in shown and shown[field].description == info.description):
            missing.append(f"setting {objective.name}.{field} is not in the launchpad with its help text")
        if f"`{objective.name}.{field}`" not in guide:
            missing.append(f"setting {objective.name}.{field} is not in the training guide")
    return missing


class Unhelpful(ObjectiveSettings):
    beta: float = 1.0  # no help text


UNKNOWN_CLEANER = Pieces("ft_assets.data.cleaning:no_cleaner", *astuple(DPO.pieces)[1:])
FAULTS = [  # DPO lacking one piece, what the checklist says of it
    ("kind", replace(DPO, data_kind="unpaired"), ["data kind 'unpaired' is none that raw_dataset finds"]),
    ("kind taken", replace(DPO, data_kind=CHAT), ["data kind 'chat' is not its own: raw_dataset could not choose it"]),
    ("cleaner", replace(DPO, pieces=UNKNOWN_CLEANER), ["clean_row 'ft_assets.data.cleaning:no_cleaner' does not resolve"]),
    ("pieces", replace(DPO, pieces=Pieces(*[DPO.pieces.clean_row] * 4)),
     ["step 'ft_assets.data.preference:clean_pair' does not resolve", "pack_kind is not a PackKind",
      "scorer lacks load, score, score_export, report", "scorer lacks unit or summary"]),
    ("settings", replace(DPO, settings=Unhelpful),
     ["settings are not TrainingConfig's 'dpo'", "setting dpo.beta has no help text"]),
    ("complete", DPO, []),
]  # fmt: skip


@pytest.mark.parametrize("objective, said", [case[1:] for case in FAULTS], ids=[case[0] for case in FAULTS])
def test_the_checklist_finds_each_missing_piece(objective, said):
    found = missing_pieces(objective, GUIDE.read_text())
    assert len(found) == len(said) and all(line.startswith(start) for line, start in zip(found, said)), found


def test_the_checklist_finds_undocumented_settings():
    guide = GUIDE.read_text()
    assert missing_pieces(DPO, guide.replace("`dpo.loss`", "loss")) == ["setting dpo.loss is not in the training guide"]
    assert missing_pieces(GRPO, guide.replace("`ft_assets/objectives/grpo.py`", "")) == [
        "the training guide does not name ft_assets/objectives/grpo.py"
    ]


@pytest.mark.parametrize("objective", objectives.REGISTERED, ids=lambda objective: objective.name)
def test_every_objective_has_every_piece(objective):
    assert missing_pieces(objective, GUIDE.read_text()) == []


CASES = [  # objective, the data kind raw_dataset finds, items, the gate's metric, default lr (lora), full fine-tuning allowed
    (SFT, CHAT, "examples", "exact_match", 2e-4, True),
    (DPO, PREFERENCE, "pairs", "reward_accuracy", 5e-6, False),
    (GRPO, PROMPT, "prompts", "reward_mean", 5e-6, False),
]


@pytest.mark.parametrize("objective, kind, items, metric, learning_rate, full", CASES, ids=[c[0].name for c in CASES])
def test_each_objective_carries_what_differs(objective, kind, items, metric, learning_rate, full):
    assert objectives.for_data_kind(kind) is objective and objectives.named(objective.name) is objective
    assert objectives.of_stats({"objective": objective.name}) is objective
    assert objective.items == items
    training = TrainingConfig(method="lora", grpo={"rewards": REWARDS})
    assert objective.scorer("exact_match", 10, 8, objective.settings_in(training)).metric == metric
    assert training.resolve(400, False, objective).learning_rate == learning_rate
    full_run = training.model_copy(update={"method": "full"})
    if full:
        assert full_run.resolve(400, False, objective).method == "full"
    else:
        with pytest.raises(ValueError, match="method 'full'"):
            full_run.resolve(400, False, objective)


def test_an_objectives_settings_sit_under_its_name_and_only_its_own_are_in_its_run_id():
    training = TrainingConfig(dpo={"beta": 0.3}, grpo={"rewards": REWARDS})
    assert DPO.settings_in(training).beta == 0.3 and SFT.settings_in(training) is None
    hashed = {objective.name: training.result_fields(False, objective) for objective in OBJECTIVES.values()}
    assert hashed["dpo"]["dpo"] == {"beta": 0.3, "loss": "sigmoid"} and "grpo" not in hashed["dpo"]
    assert hashed["grpo"]["grpo"]["rewards"] == REWARDS and "dpo" not in hashed["grpo"]
    assert not {"dpo", "grpo"} & set(hashed["sft"])


def test_an_unknown_objective_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown objective 'ppo'; one of sft, dpo, grpo"):
        objectives.named("ppo")


def test_the_json_summary_has_the_same_keys_whatever_the_objective():
    stats = {"finetuned_metric": 0.9, "base_metric": 0.5, "finetuned_reward_margin": 0.4, "base_reward_margin": 0.0}
    rewards = {
        "finetuned_reward_mean": 2.5,
        "base_reward_mean": 0.5,
    }  # GRPO's, and a chat run's scored by a reward function
    dpo = objectives.summary_figures({**stats, "objective": "dpo"})
    sft = objectives.summary_figures(
        {**stats, "objective": "sft", "finetuned_reward_mean": None, "base_reward_mean": None}
    )
    grpo = objectives.summary_figures({**stats, **rewards, "objective": "grpo"})
    assert dpo.keys() == sft.keys() == grpo.keys() and set(sft.values()) == {None}
    assert {key: value for key, value in dpo.items() if value is not None} == {
        "reward_accuracy": 0.9,
        "base_reward_accuracy": 0.5,
        "reward_margin": 0.4,
        "base_reward_margin": 0.0,
    }
    assert {key: value for key, value in grpo.items() if value is not None} == {
        "reward_mean": 2.5,
        "base_reward_mean": 0.5,
    }
    assert objectives.summary_figures({**stats, **rewards, "objective": "sft"})["reward_mean"] == 2.5
