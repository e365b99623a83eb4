"""Supervised fine-tuning (``sft``): conversations, a token loss on the assistant's replies.

No settings of its own: the shared training settings (method, LoRA, learning rate, steps) are all it
reads. The cleaner drops rows without a reply, the rows are packed several examples a row, the loss
is the cross-entropy of the assistant tokens, and ``eval_report`` scores greedy answers to the eval
conversations with the task metric (exact match, token F1, ROUGE-L or a reward function).
"""

from __future__ import annotations

from ft_assets.objectives.objective import Objective, Pieces

SFT = Objective(
    "sft", "chat", "examples",
    Pieces(
        clean_row="ft_assets.data.cleaning:clean_messages",
        pack_kind="ft_assets.data.packing:EXAMPLES",
        step="ft_assets.training.steps:TokenLossStep",
        scorer="ft_assets.delivery.scoring:ChatScorer",
    ),
)  # fmt: skip
