"""The loss on packed rows: what training minimises and what every eval loss reports.

One definition for the recipe (its optimizer steps and its periodic and final evals) and for
delivery's base-vs-fine-tuned comparison (``ft_assets.delivery.evaluate.eval_loss``), so all of them
score the same tokens the same way: cross-entropy over the labels of ``PackedRows`` (the loss mask's
assistant tokens), shifted by one, with the block-diagonal attention of packed examples.

Losses are sums, not means: a row's share of learned tokens depends on what the packer put in it,
so the callers divide by the learned-token count of the whole step or eval set (over every process
under DDP) and get the true per-token mean.

Memory: the model's own loss materializes every token's logits in fp32 (bf16 logits, their fp32
upcast, the log-softmax kept for backward, its gradient: 16 bytes x vocabulary per token, 2.1 GB for
Llama-3's 128k vocabulary at 1k tokens) and keeps them alive through the whole backward pass. Here the
model returns its last hidden states only; lm_head + cross-entropy run in chunks of
``chunk_tokens(vocab)`` tokens whose logits are recomputed in backward (``torch.utils.checkpoint``),
so at most one chunk's logits (64 MiB in fp32) exist at a time. The price is one more lm_head matmul
per token in backward (0.6% of a Llama-2-7B step). On a 128k-vocabulary toy at 4k tokens, peak memory
of loss + backward drops from 5.9 GiB to 0.3 GiB, with the same loss and gradients to 1e-5
(``test_loss.py``).

On CUDA with ``liger-kernel`` installed (``pip install 'ft-assets[liger]'``), the chunks run through
Liger's fused linear cross-entropy instead (Triton; logits never leave on-chip memory, gradients
computed in the forward pass), when lm_head is a plain linear layer.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ft_assets.shards import IGNORE_INDEX, PackedRows

LOSS_CHUNK_BYTES = 64 * 2**20  # fp32 logits of one chunk: 524 tokens of a 32k vocabulary, 131 of a 128k one
FP32_BYTES = 4


def chunk_tokens(vocab: int) -> int:
    """Tokens per lm_head + cross-entropy chunk: as many as keep one chunk's fp32 logits in LOSS_CHUNK_BYTES."""
    return max(1, LOSS_CHUNK_BYTES // (FP32_BYTES * vocab))


def learned_tokens(batch: dict[str, torch.Tensor]) -> int:
    """How many labels the shifted loss counts (label i is predicted from token i-1)."""
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


def _chunk_loss(lm_head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(lm_head(hidden).float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_cross_entropy_sum(
    hidden: torch.Tensor, lm_head: torch.nn.Module, targets: torch.Tensor, chunk: int | None = None
) -> torch.Tensor:
    """Sum over tokens of cross-entropy(lm_head(hidden), targets), never holding more than one chunk's logits.

    ``hidden`` is (tokens, hidden) and ``targets`` (tokens,); targets equal to IGNORE_INDEX add 0. Under
    autograd each chunk is checkpointed: its logits are dropped after the forward, recomputed in backward.
    """
    chunk = chunk or chunk_tokens(lm_head.weight.shape[0])
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk):
        part, part_targets = hidden[start : start + chunk], targets[start : start + chunk]
        if torch.is_grad_enabled():
            total = total + checkpoint(_chunk_loss, lm_head, part, part_targets, use_reentrant=False)
        else:
            total = total + _chunk_loss(lm_head, part, part_targets)
    return total


def _fused_linear_cross_entropy(lm_head: torch.nn.Module, hidden: torch.Tensor):
    """Liger's fused kernel where it applies (CUDA, liger-kernel installed, lm_head a bias-free nn.Linear
    of the hidden states' dtype), else None."""
    plain = type(lm_head) is torch.nn.Linear and lm_head.bias is None and lm_head.weight.dtype == hidden.dtype
    if not (hidden.is_cuda and plain and importlib.util.find_spec("liger_kernel") is not None):
        return None
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    return LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction="sum")


def _unwrap(model):
    """The model under DDP / FSDP (``.module``), whose output embedding is lm_head."""
    while isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return model


def token_loss_sum(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Cross-entropy summed over the learned tokens of a batch (count them with ``learned_tokens``).

    No attention mask and no KV cache: the packed rows' position_ids give the block-diagonal mask.
    The forward goes through ``model`` itself (DDP's gradient hooks need that) and asks only for the
    hidden states and the last position's logits; lm_head + cross-entropy then run chunk by chunk over
    every position, unlearned labels (IGNORE_INDEX) adding 0. Selecting the learned positions first
    would skip their lm_head work but needs a host sync per micro-batch (a boolean index's size).
    """
    inputs = {name: value for name, value in batch.items() if name != "labels"}
    output = model(**inputs, use_cache=False, output_hidden_states=True, logits_to_keep=1)
    hidden = output.hidden_states[-1][:, :-1]  # the final norm's output: position i predicts label i + 1
    hidden = hidden.reshape(-1, hidden.shape[-1])
    targets = batch["labels"][:, 1:].reshape(-1)
    lm_head = _unwrap(model).get_output_embeddings()
    fused = _fused_linear_cross_entropy(lm_head, hidden)
    if fused is not None:
        return fused(lm_head.weight, hidden, targets)
    return chunked_cross_entropy_sum(hidden, lm_head, targets)


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
            batch = rows.batch(indices[start : start + batch_size], device)
            loss_sum += token_loss_sum(model, batch).item()
            count += learned_tokens(batch)
    model.train(was_training)
    return loss_sum, count
