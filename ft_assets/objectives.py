"""The objective of a dataset version: what its rows teach, chosen once from the data and recorded.

A version holds conversations (supervised fine-tuning, ``sft``), preference pairs (``dpo``) or prompts
(``grpo``). ``raw_dataset`` finds which from the rows (``ft_assets.data.kinds.dataset_kind``) and records
the objective's name in its stats; every asset after it reads that record (``of_stats``) instead of
looking again. Everything that differs between objectives hangs off one ``Objective``, so the data
assets, the recipe, the plan, ``eval_report`` and the CLI ask it and never branch on a name:

| | ``sft`` | ``dpo`` | ``grpo`` |
|---|---|---|---|
| rows (``data_kind``) | chat conversations | preference pairs | prompts (+ columns for the rewards) |
| cleaner | ``cleaning.clean_messages`` | ``preference.clean_pair`` | ``prompts.clean_prompt`` |
| pack kind | ``packing.EXAMPLES`` (examples packed in rows) | ``pair_packing.PAIRS`` (whole pairs) | ``prompt_packing.PROMPTS`` (one prompt a row) |
| training step | ``steps.TokenLossStep`` (token loss / learned tokens) | ``steps.DpoStep`` (DPO loss / pairs, reference = base with the adapter disabled) | ``steps.GrpoStep`` (sampled completions, rewards, group advantages; GRPO loss / completion tokens, same reference) |
| eval_report | ``scoring.ChatScorer`` (task metric on answers) | ``scoring.PairScorer`` (reward accuracy) | ``scoring.RewardScorer`` (mean reward) |
| learning rate (empty) | the method's | 5e-6 | 5e-6 |
| methods | lora, qlora, full | lora, qlora (the reference needs the adapter switch) | lora, qlora (same) |

A new objective is one more ``Objective`` here, with its pieces in the planes' own modules.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ft_assets.data.cleaning import CleaningRules, clean_messages
from ft_assets.data.packing import EXAMPLES, PackKind
from ft_assets.data.pair_packing import PAIRS
from ft_assets.data.kinds import CHAT, PREFERENCE, PROMPT
from ft_assets.data.preference import clean_pair
from ft_assets.data.prompt_packing import PROMPTS
from ft_assets.data.prompts import clean_prompt
from ft_assets.delivery.scoring import ChatScorer, PairScorer, RewardScorer, Scorer
from ft_assets.training.steps import DpoStep, GrpoStep, TokenLossStep, TrainingStep

DPO_LEARNING_RATE = 5e-6  # LoRA/QLoRA DPO recipes (alignment-handbook's zephyr-7b-dpo-qlora): 40x below SFT's
GRPO_LEARNING_RATE = 5e-6  # LoRA GRPO recipes (Unsloth's GRPO notebooks, TRL's GRPO + PEFT examples: 5e-6 to 1e-5)
REFERENCE_IS_THE_BASE = (
    "trains a LoRA or QLoRA adapter: its reference policy is the base model with the adapter disabled (no second copy of the "
    "model), which method 'full' does not have; set method lora or qlora"
)


@dataclass(frozen=True)
class Objective:
    name: str  # recorded in the stats of every asset from raw_dataset on, and in the run's MLflow tags
    data_kind: str  # what raw_dataset finds in the rows
    items: str  # what one training item is, in logs: "examples", "pairs", "prompts"
    clean_row: Callable[[list[dict], CleaningRules], list[dict]]  # cleaned_dataset's row cleaner
    pack_kind: PackKind  # how tokenized_shards tokenizes and packs the items
    step: TrainingStep  # the recipe's loader, loss and eval
    scorer: Callable[..., Scorer]  # eval_report's scorer: (metric, max_examples, max_new_tokens, training config)
    learning_rate: float | None = None  # the default learning rate; None: the method's
    full_refused: str | None = None  # why method 'full' cannot train this objective; None: it can


SFT = Objective("sft", CHAT, "examples", clean_messages, EXAMPLES, TokenLossStep(), ChatScorer)
DPO = Objective(
    "dpo", PREFERENCE, "pairs", clean_pair, PAIRS, DpoStep(), PairScorer,
    learning_rate=DPO_LEARNING_RATE,
    full_refused=f"DPO {REFERENCE_IS_THE_BASE}",
)  # fmt: skip
GRPO = Objective(
    "grpo", PROMPT, "prompts", clean_prompt, PROMPTS, GrpoStep(), RewardScorer,
    learning_rate=GRPO_LEARNING_RATE, full_refused=f"GRPO {REFERENCE_IS_THE_BASE}",
)  # fmt: skip
OBJECTIVES = {objective.name: objective for objective in (SFT, DPO, GRPO)}


def for_data_kind(kind: str) -> Objective:
    """The objective of a version whose rows are of ``kind`` (``dataset_kind``'s answer)."""
    return next(objective for objective in OBJECTIVES.values() if objective.data_kind == kind)


def named(name: str) -> Objective:
    try:
        return OBJECTIVES[name]
    except KeyError:
        raise ValueError(f"unknown objective {name!r}; one of {', '.join(OBJECTIVES)}") from None


def of_stats(stats: dict) -> Objective:
    """The objective a data asset recorded in its stats (``raw_dataset`` chose it)."""
    return named(stats["objective"])


def summary_figures(eval_stats: dict) -> dict:
    """The objective-specific keys of ``ft-assets run --json`` from eval_report's stats: the run's objective's
    filled in, every other objective's present as None, so the keys are the same whatever the objective."""
    own = of_stats(eval_stats).scorer.summary
    keys = {key for objective in OBJECTIVES.values() for key in objective.scorer.summary}
    return {key: eval_stats[own[key]] if key in own else None for key in sorted(keys)}
