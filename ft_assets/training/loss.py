"""The loss on packed rows: what training minimises and what every eval loss reports.

One definition for the recipe (its optimizer steps and its periodic and final evals) and for
delivery's base-vs-fine-tuned comparison (``ft_assets.delivery.evaluate.eval_loss``), so all of them
score the same tokens the same way: cross-entropy over the labels of ``PackedRows`` (the loss mask's
assistant tokens), shifted by one, with the block-diagonal attention of packed examples.

Losses are sums, not means: a row's share of learned tokens depends on what the packer put in it,
so the callers divide by the learned-token count of the whole step or eval set (over every process
under DDP) and get the true per-token mean.
"""

from __future__ import annotations

import numpy as np
import torch

from ft_assets.shards import IGNORE_INDEX, PackedRows


def learned_tokens(batch: dict[str, torch.Tensor]) -> int:
    """How many labels the shifted loss counts (label i is predicted from token i-1)."""
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


def token_loss_sum(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Cross-entropy summed over the learned tokens of a batch, and their count.

    No attention mask and no KV cache: the packed rows' position_ids give the block-diagonal mask.
    """
    # num_items_in_batch=1 turns the HF loss into a plain sum (it divides the summed loss by it).
    return model(**batch, use_cache=False, num_items_in_batch=1).loss, learned_tokens(batch)


def eval_loss_sum(
    model, rows: PackedRows, batch_size: int, device: torch.device, rank: int = 0, world_size: int = 1
) -> tuple[float, int]:
    """Summed token loss and learned-token count over the rows ``rank``, ``rank + world_size``, … of ``rows``.

    The model runs in eval mode without gradients and is left in the mode it came in. Divide the sum
    by the count (after summing both over the processes under DDP) for the mean loss per token.
    """
    was_training = model.training
    model.eval()
    indices = np.arange(rank, len(rows), world_size)
    loss_sum, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(indices), batch_size):
            batch_loss, batch_count = token_loss_sum(model, rows.batch(indices[start : start + batch_size], device))
            loss_sum += batch_loss.item()
            count += batch_count
    model.train(was_training)
    return loss_sum, count
