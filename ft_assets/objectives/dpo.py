"""Direct preference optimisation (``dpo``): preference pairs, the policy pushed toward the chosen reply.

Settings (``lora_adapter: config: {dpo: {beta: 0.1, loss: sigmoid}}``): how strongly the policy is held
to its reference and which DPO loss. The reference is the base with the adapter disabled (one copy of
the model), so method ``full`` is refused. Empty ``learning_rate`` is 5e-6, 40x below SFT's, as LoRA /
QLoRA DPO recipes for 7B models use (alignment-handbook's zephyr-7b-dpo-qlora).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ft_assets.objectives.objective import REFERENCE_IS_THE_BASE, Objective, ObjectiveSettings, Pieces

DPO_LEARNING_RATE = 5e-6  # LoRA/QLoRA DPO recipes (alignment-handbook's zephyr-7b-dpo-qlora): 40x below SFT's


class DpoSettings(ObjectiveSettings):
    """DPO (preference versions only): beta and the loss variant."""

    beta: float = Field(
        default=0.1,
        gt=0,
        description="How strongly the policy is held to the reference (the base with the adapter disabled); lower "
        "lets it move further. 0.1 is the usual value (DPO paper, TRL).",
    )
    loss: Literal["sigmoid", "ipo", "hinge"] = Field(
        default="sigmoid",
        description="DPO loss variant: 'sigmoid' (the DPO paper's), 'ipo' (IPO's squared loss on length-normalised "
        "log-ratios, less prone to overfit near-deterministic preferences) or 'hinge' (SLiC's hinge on the reward margin).",
    )


DPO = Objective(
    "dpo", "preference", "pairs",
    Pieces(
        clean_row="ft_assets.data.preference:clean_pair",
        pack_kind="ft_assets.data.pair_packing:PAIRS",
        step="ft_assets.training.steps:DpoStep",
        scorer="ft_assets.delivery.scoring:PairScorer",
    ),
    settings=DpoSettings, learning_rate=DPO_LEARNING_RATE, full_refused=f"DPO {REFERENCE_IS_THE_BASE}",
)  # fmt: skip
