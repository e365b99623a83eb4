"""How many tokens one chunk of the chunked loss holds: the loss computes with it, the planner sizes memory with it.

The loss (``ft_assets.training.loss``) never materializes every token's logits: lm_head + cross-entropy
run ``chunk_tokens(vocab)`` tokens at a time, 64 MiB of fp32 logits a chunk (524 tokens of a 32k
vocabulary, 130 of a 128k one). The planner (``ft_assets.control.planner``) counts one chunk's logits
in a step's memory. This module imports no torch, so the control plane reads the same number without
loading it.
"""

from __future__ import annotations

LOSS_CHUNK_BYTES = 64 * 2**20  # fp32 logits of one chunk: 524 tokens of a 32k vocabulary, 130 of Llama 3's 128,256
FP32_BYTES = 4


def chunk_tokens(vocab: int) -> int:
    """Tokens per lm_head + cross-entropy chunk: as many as keep one chunk's fp32 logits in LOSS_CHUNK_BYTES."""
    return max(1, LOSS_CHUNK_BYTES // (FP32_BYTES * vocab))
