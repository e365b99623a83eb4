"""The objective of a dataset version: what its rows teach, chosen once from the data and recorded.

A version holds conversations (supervised fine-tuning, ``sft``), preference pairs (``dpo``) or prompts
(``grpo``). ``raw_dataset`` finds which from the rows (``ft_assets.data.kinds.dataset_kind``) and records
the objective's name in its stats; every asset after it reads that record (``of_stats``) instead of
looking again. Everything that differs between objectives hangs off one ``Objective``
(``ft_assets.objectives.objective``), so the data assets, the recipe, the plan, ``eval_report`` and the
CLI ask it and never branch on a name:

| | ``sft`` | ``dpo`` | ``grpo`` |
|---|---|---|---|
| rows (``data_kind``) | chat conversations | preference pairs | prompts (+ columns for the rewards) |
| settings (``lora_adapter`` config) | none | ``dpo``: ``beta``, ``loss`` | ``grpo``: ``rewards``, ``num_generations``, ``max_completion_length``, ``temperature``, ``beta``, ``loss``, ``generation_backend`` |
| cleaner | ``cleaning.clean_messages`` | ``preference.clean_pair`` | ``prompts.clean_prompt`` |
| pack kind | ``packing.EXAMPLES`` (examples packed in rows) | ``pair_packing.PAIRS`` (whole pairs) | ``prompt_packing.PROMPTS`` (one prompt a row) |
| training step | ``steps.TokenLossStep`` (token loss / learned tokens) | ``steps.DpoStep`` (DPO loss / pairs, reference = base with the adapter disabled) | ``grpo.GrpoStep`` (sampled completions, rewards, group advantages; GRPO loss / completion tokens, same reference) |
| eval_report | ``scoring.ChatScorer`` (task metric on answers) | ``scoring.PairScorer`` (reward accuracy) | ``scoring.RewardScorer`` (mean reward) |
| learning rate (empty) | the method's | 5e-6 | 5e-6 |
| methods | lora, qlora, full | lora, qlora (the reference needs the adapter switch) | lora, qlora (same) |

A new objective is one module here (its settings and its ``Objective``, naming its pieces in the
planes) and one entry in ``REGISTERED``; the training settings, the launchpad, the run id and the
checklist in ``test_objectives.py`` take it from there.
"""

from __future__ import annotations

from ft_assets.objectives import dpo, grpo, sft
from ft_assets.objectives.objective import Objective

REGISTERED = (sft.SFT, dpo.DPO, grpo.GRPO)  # every objective; its data kind is what makes raw_dataset choose it
OBJECTIVES = {objective.name: objective for objective in REGISTERED}
SFT, DPO, GRPO = sft.SFT, dpo.DPO, grpo.GRPO


def for_data_kind(kind: str) -> Objective:
    """The objective of a version whose rows are of ``kind`` (``dataset_kind``'s answer)."""
    return next(objective for objective in REGISTERED if objective.data_kind == kind)


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
    keys = {key for objective in REGISTERED for key in objective.scorer.summary}
    return {key: eval_stats[own[key]] if key in own else None for key in sorted(keys)}
