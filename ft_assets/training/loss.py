"""The loss on packed rows: what training minimises and what every eval loss reports.

One definition for the recipe (its optimizer steps and its periodic and final evals) and for
delivery's base-vs-fine-tuned comparison (``ft_assets.delivery.evaluate.eval_loss``), so all of them
score the same tokens the same way: cross-entropy over the labels of ``PackedRows`` (the loss mask's
assistant tokens), shifted by one, with the block-diagonal attention of packed examples.

Packed rows carry several examples each, and attention must not cross their boundaries:
transformers (5.x) builds a block-diagonal causal mask from ``position_ids`` (they restart at 0 at
every example) when ``attention_mask`` is None AND no KV cache exists. Llama's config says
``use_cache=True``, which silently creates a cache in training and turns the packing detection off,
so every forward (``token_loss_sum``) passes ``use_cache=False`` (the tests pin both facts). How the
mask is applied is the attention backend's (``training.model.resolve_attention``): varlen
FlashAttention or a FlexAttention document mask on a GPU; on CPU a dense block mask with sdpa, or
with eager for a model that refuses sdpa or needs eager for its soft-capped scores (Gemma 2).

Losses are sums, not means: a row's share of learned tokens depends on what the packer put in it,
so the callers divide by the learned-token count of the whole step or eval set (over every process
under DDP) and get the true per-token mean.

Memory: the model's own loss materializes every token's logits in fp32 (bf16 logits, their fp32
upcast, the log-softmax kept for backward, its gradient: 16 bytes x vocabulary per token, 2.1 GB for
Llama-3's 128k vocabulary at 1k tokens) and keeps them alive through the whole backward pass. Here the
model returns its last hidden states only; lm_head + cross-entropy run in chunks of
``chunk_tokens(vocab)`` tokens (``ft_assets.training.chunking``) whose logits are recomputed in backward (``torch.utils.checkpoint``),
so at most one chunk's logits (64 MiB in fp32) exist at a time. The price is one more lm_head matmul
per token in backward (0.6% of a Llama-2-7B step). On a 128k-vocabulary toy at 4k tokens, peak memory
of loss + backward drops from 5.9 GiB to 0.3 GiB, with the same loss and gradients to 1e-5
(``test_loss.py``).

On CUDA with ``liger-kernel`` installed (``pip install 'ft-assets[liger]'``), the chunks run through
Liger's fused linear cross-entropy instead (Triton; logits never leave on-chip memory, gradients
computed in the forward pass), when lm_head is a plain linear layer.

Logits are the model's own: where the config soft-caps them (Gemma 2's ``final_logit_softcapping``,
cap x tanh(logits / cap)) the chunks cap them too (``output_head``), so the loss equals the model's
own loss for every family of the test matrix (``test_families.py``).

Preference pairs (DPO). ``pair_logps`` scores every sequence of packed pair rows in one forward:
the summed log-probability of its learned tokens (the final reply), from the same chunked lm_head,
per segment id. ``dpo_losses`` is the DPO objective on those sums, written out here because TRL
(1.16) has it only inside ``DPOTrainer._compute_loss``, which needs its own model wrapper and
trainer state; ``test_dpo.py`` checks it equals TRL's on random inputs for every variant. With
h = beta * ((log pi(chosen) - log ref(chosen)) - (log pi(rejected) - log ref(rejected))):

- ``sigmoid`` (DPO, Rafailov et al. 2023): -log sigmoid(h)
- ``hinge`` (SLiC, Zhao et al. 2023): max(0, 1 - h)
- ``ipo`` (Azar et al. 2023): (d - 1 / (2 beta))^2, d the same difference of log-ratios with each
  side divided by its token count (TRL's length normalization, confirmed with the IPO authors)

The reference is the base with the adapter disabled (the caller's ``disable_adapter()`` context),
so no second copy of the model exists. Reward accuracy and margin (``preference_metrics``) score a
model alone: the fraction of pairs whose chosen reply it finds likelier than the rejected one, and
the mean beta * (log pi(chosen) - log pi(rejected)); a tuned model's margin minus its base's is the
mean DPO implicit reward margin, so base and tuned are measured by one yardstick.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ft_assets.shards import IGNORE_INDEX, PackedRows, PairRows
from ft_assets.training.chunking import chunk_tokens
from ft_assets.training.config import experts_of

DPO_LOSSES = ("sigmoid", "ipo", "hinge")


def to_device(batch: dict, device: torch.device) -> dict:
    """A batch's tensors on ``device``, those inside a dict too (Gemma 3's per-layer-type masks)."""
    return {
        name: to_device(value, device) if isinstance(value, dict) else value.to(device) for name, value in batch.items()
    }


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


class SoftCappedHead(torch.nn.Module):
    """lm_head, then the final-logit soft-capping cap x tanh(logits / cap) that Gemma 2's own forward applies."""

    def __init__(self, head: torch.nn.Module, cap: float):
        super().__init__()
        self.head, self.cap = head, cap

    @property
    def weight(self) -> torch.Tensor:
        return self.head.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.head(hidden) / self.cap) * self.cap


def output_head(model) -> torch.nn.Module:
    """What turns the model's last hidden states into its logits: lm_head, soft-capped where the config says so
    (Gemma 2's final_logit_softcapping; without it the loss would train logits the model never outputs)."""
    model = _unwrap(model)
    head = model.get_output_embeddings()
    cap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)
    return SoftCappedHead(head, cap) if cap else head


# Families whose transformers 5 model builds its attention masks without the position_ids (GptOssModel, 5.24): on a
# packed row every document would attend to the ones before it (eager, sdpa and flex attention alike). Their masks
# are built here, from the position_ids that restart at 0, and handed to the model as it takes them from generate.
POSITION_BLIND_MASKS = frozenset({"gpt_oss"})


def packed_inputs(model, inputs: dict[str, torch.Tensor]) -> dict:
    """``inputs`` for the forward of a packed batch; for a ``POSITION_BLIND_MASKS`` family, with the per-layer-type
    block-diagonal masks its forward would otherwise build without the documents' boundaries."""
    base = _unwrap(model)
    config = base.config
    if getattr(config, "model_type", None) not in POSITION_BLIND_MASKS or "position_ids" not in inputs:
        return inputs
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    ids = inputs["input_ids"]
    dtype = base.get_input_embeddings().weight.dtype
    shape_only = torch.empty(*ids.shape, 1, dtype=dtype, device=ids.device)  # the mask reads its shape, dtype, device
    kwargs = {"config": config, "inputs_embeds": shape_only, "attention_mask": None, "cache": None,
              "position_ids": inputs["position_ids"]}  # fmt: skip
    masks = {
        "full_attention": create_causal_mask(**kwargs),
        "sliding_attention": create_sliding_window_causal_mask(**kwargs),
    }
    return {**inputs, "attention_mask": masks}


def token_loss_sum(model, batch: dict[str, torch.Tensor], router_aux: bool = False) -> torch.Tensor:
    """Cross-entropy summed over the learned tokens of a batch (count them with ``learned_tokens``), and with
    ``router_aux`` a mixture's load-balancing loss at its ``router_aux_loss_coef`` (``training.model.load_model`` sets it
    from the settings; 0 by default) per learned token. The routers' logits are taken with hooks and the family's own
    loss function run on them here: the model's forward would weigh them by ``attention_mask``, which for gpt-oss's
    packed rows is a mask per layer type (``packed_inputs``).

    No attention mask and no KV cache: the packed rows' position_ids give the block-diagonal mask.
    The forward goes through ``model`` itself (DDP's gradient hooks need that) and asks only for the
    hidden states and the last position's logits; lm_head + cross-entropy then run chunk by chunk over
    every position, unlearned labels (IGNORE_INDEX) adding 0. Selecting the learned positions first
    would skip their lm_head work but needs a host sync per micro-batch (a boolean index's size).
    """
    inputs = packed_inputs(model, {name: value for name, value in batch.items() if name != "labels"})
    coef = getattr(_unwrap(model).config, "router_aux_loss_coef", 0.0) if router_aux else 0.0
    with captured_router_logits(model, bool(coef)) as logits_of_routers:
        output = model(**inputs, use_cache=False, output_hidden_states=True, logits_to_keep=1)
    hidden = output.hidden_states[-1][:, :-1]  # the final norm's output: position i predicts label i + 1
    hidden = hidden.reshape(-1, hidden.shape[-1])
    targets = batch["labels"][:, 1:].reshape(-1)
    lm_head = output_head(model)
    fused = _fused_linear_cross_entropy(lm_head, hidden)
    if fused is not None:
        loss = fused(lm_head.weight, hidden, targets)
    else:
        loss = chunked_cross_entropy_sum(hidden, lm_head, targets)
    if logits_of_routers:
        aux = balancing_loss(model, tuple(logits_of_routers))
        loss = loss + coef * aux.to(loss.dtype) * learned_tokens(batch)
    return loss


def is_router(module: torch.nn.Module) -> bool:
    """A mixture's router: transformers 5 names every family's ``*Router`` (Qwen3-MoE's and Mixtral's ``gate``,
    gpt-oss's ``router``)."""
    return type(module).__name__.endswith("Router")


@contextmanager
def captured_router_logits(model, on: bool) -> Iterator[list[torch.Tensor]]:
    """Each router's logits (its output's first element) of the forward run inside, when ``on``: a mixture's routers
    (the modules named ``*Router`` in transformers 5), for the load-balancing loss."""
    logits: list[torch.Tensor] = []
    hooks = []
    if on:
        for module in model.modules():
            if is_router(module):
                hooks.append(
                    module.register_forward_hook(
                        lambda m, i, out: logits.append(out[0] if isinstance(out, tuple) else out)
                    )
                )
    try:
        yield logits
    finally:
        for hook in hooks:
            hook.remove()


def balancing_loss(model, logits: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The family's own load-balancing loss (its modeling module's ``load_balancing_loss_func``) over every token."""
    base = _unwrap(model)
    base = base.get_base_model() if hasattr(base, "get_base_model") else base
    config = base.config
    loss_func = sys.modules[type(base).__module__].load_balancing_loss_func
    return loss_func(logits, experts_of(config.to_dict()), config.num_experts_per_tok, None)


def eval_loss_sum(
    model, rows: PackedRows, batch_size: int, device: torch.device, rank: int = 0, world_size: int = 1, prepare=None
) -> tuple[float, int]:
    """Summed token loss and learned-token count over the rows ``rank``, ``rank + world_size``, … of ``rows``.

    The model runs in eval mode without gradients and is left in the mode it came in. Divide the sum
    by the count (after summing both over the processes under DDP) for the mean loss per token.
    ``prepare``: what turns a host batch into the forward's inputs (a vision-language model's pixels).
    """
    was_training = model.training
    model.eval()
    indices = np.arange(rank, len(rows), world_size)
    loss_sum, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(indices), batch_size):
            batch = rows.batch(indices[start : start + batch_size], torch.device("cpu") if prepare else device)
            if prepare is not None:
                batch = to_device(prepare(batch), device)
            loss_sum += token_loss_sum(model, batch).item()
            count += learned_tokens(batch)
    model.train(was_training)
    return loss_sum, count


# --- preference pairs ------------------------------------------------------------------------------


class PairLogps(NamedTuple):
    """Per pair slot of packed pair rows, (rows, pairs_per_row) each; slots without a pair hold zeros."""

    chosen: torch.Tensor  # summed log-probability of the chosen reply's tokens
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor  # how many tokens each sum covers
    rejected_tokens: torch.Tensor


def pair_count(batch: dict[str, torch.Tensor]) -> int:
    """How many pairs a batch of pair rows holds (the DPO loss is a mean over them)."""
    return int(batch["pair_mask"].sum())


def _chunk_logps(
    lm_head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, slots: torch.Tensor, size: int
) -> torch.Tensor:
    logps = -F.cross_entropy(lm_head(hidden).float(), targets, ignore_index=IGNORE_INDEX, reduction="none")
    return logps.new_zeros(size).index_add(0, slots, logps)


def pair_logps(model, batch: dict[str, torch.Tensor]) -> PairLogps:
    """Summed log-probability of the learned tokens of every sequence in a batch of pair rows.

    One forward of the packed rows (no attention mask, no KV cache: the position ids keep sequences
    apart), then lm_head + log-softmax chunk by chunk as in ``token_loss_sum``, each token's
    log-probability added to its sequence's slot (its row x its segment id); unlearned labels add 0.
    """
    inputs = packed_inputs(model, {name: batch[name] for name in ("input_ids", "position_ids")})
    output = model(**inputs, use_cache=False, output_hidden_states=True, logits_to_keep=1)
    hidden = output.hidden_states[-1][:, :-1]
    rows, sequences = batch["pair_mask"].shape[0], 2 * batch["pair_mask"].shape[1]
    hidden = hidden.reshape(-1, hidden.shape[-1])
    targets = batch["labels"][:, 1:].reshape(-1)
    # label i + 1 belongs to the segment of token i + 1; padding (-1) carries no label, so slot 0 gets 0 from it
    row_base = torch.arange(rows, device=targets.device)[:, None] * sequences
    slots = (batch["segment_ids"][:, 1:].clamp(min=0) + row_base).reshape(-1)
    size = rows * sequences
    lm_head = output_head(model)
    chunk = chunk_tokens(lm_head.weight.shape[0])
    logps = hidden.new_zeros(size, dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk):
        part = (
            lm_head,
            hidden[start : start + chunk],
            targets[start : start + chunk],
            slots[start : start + chunk],
            size,
        )
        logps = logps + (
            checkpoint(_chunk_logps, *part, use_reentrant=False) if torch.is_grad_enabled() else _chunk_logps(*part)
        )
    tokens = logps.new_zeros(size).index_add(0, slots, (targets != IGNORE_INDEX).float())
    logps, tokens = logps.view(rows, -1, 2), tokens.view(rows, -1, 2)
    return PairLogps(logps[..., 0], logps[..., 1], tokens[..., 0], tokens[..., 1])


def dpo_losses(policy: PairLogps, reference: PairLogps, beta: float, loss_type: str) -> torch.Tensor:
    """The DPO loss of every pair slot (the module docstring has the formulas); mask out empty slots before summing."""
    chosen_ratio, rejected_ratio = policy.chosen - reference.chosen, policy.rejected - reference.rejected
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * (chosen_ratio - rejected_ratio))
    if loss_type == "hinge":
        return torch.relu(1 - beta * (chosen_ratio - rejected_ratio))
    if loss_type == "ipo":
        normalized = chosen_ratio / policy.chosen_tokens.clamp(min=1) - rejected_ratio / policy.rejected_tokens.clamp(
            min=1
        )
        return (normalized - 1 / (2 * beta)) ** 2
    raise ValueError(f"unknown DPO loss {loss_type!r}; use one of {', '.join(DPO_LOSSES)}")


def dpo_loss_sum(
    policy: PairLogps, reference: PairLogps, pair_mask: torch.Tensor, beta: float, loss_type: str
) -> torch.Tensor:
    """The DPO loss summed over the pairs of a batch (divide by ``pair_count`` over the step for the mean)."""
    return (dpo_losses(policy, reference, beta, loss_type) * pair_mask).sum()


def all_pair_logps(
    model, rows: PairRows, batch_size: int, device: torch.device, rank: int = 0, world_size: int = 1
) -> tuple[PairLogps, torch.Tensor]:
    """``pair_logps`` of the rows ``rank``, ``rank + world_size``, … of ``rows`` (on the CPU) and their pair mask.

    The model runs in eval mode without gradients and is left in the mode it came in.
    """
    was_training = model.training
    model.eval()
    indices = np.arange(rank, len(rows), world_size)
    parts: list[PairLogps] = []
    with torch.no_grad():
        for start in range(0, len(indices), batch_size):
            parts.append(
                PairLogps(
                    *(part.cpu() for part in pair_logps(model, rows.batch(indices[start : start + batch_size], device)))
                )
            )
    model.train(was_training)
    if not parts:
        empty = torch.zeros(0, rows.pair_mask.shape[1])
        return PairLogps(empty, empty, empty, empty), rows.pair_mask[indices]
    return PairLogps(*(torch.cat(columns) for columns in zip(*parts))), rows.pair_mask[indices]


def preference_metrics(
    policy: PairLogps, reference: PairLogps, pair_mask: torch.Tensor, beta: float, loss_type: str
) -> dict[str, float]:
    """Sums over the pairs (divide by ``pairs`` after summing over processes): the DPO loss of the policy
    against the reference and of the reference against itself, and each model's reward accuracy and margin."""
    mask = pair_mask.float()

    def rewards(model: PairLogps) -> tuple[float, float]:
        accuracy = ((model.chosen > model.rejected).float() * mask).sum()
        margin = (beta * (model.chosen - model.rejected) * mask).sum()
        return float(accuracy), float(margin)

    accuracy, margin = rewards(policy)
    reference_accuracy, reference_margin = rewards(reference)
    return {
        "pairs": float(mask.sum()),
        "loss": float(dpo_loss_sum(policy, reference, mask, beta, loss_type)),
        "reference_loss": float(dpo_loss_sum(reference, reference, mask, beta, loss_type)),
        "reward_accuracy": accuracy,
        "reward_margin": margin,
        "reference_reward_accuracy": reference_accuracy,
        "reference_reward_margin": reference_margin,
    }


# --- GRPO ------------------------------------------------------------------------------------------

GROUP_STD_EPSILON = 1e-4  # TRL's: keeps a group whose rewards barely differ from dividing by ~0


def group_advantages(rewards: torch.Tensor, group: int) -> torch.Tensor:
    """Group-relative advantages of ``rewards`` (consecutive groups of ``group`` completions of one prompt), as TRL
    1.16 computes them (``scale_rewards="group"``): (reward - the group's mean) / (the group's std + 1e-4), the
    std with Bessel's correction. NaN rewards (no function applied) are left out of their group's mean and std
    and get advantage 0."""
    grouped = rewards.view(-1, group)
    mean = torch.nanmean(grouped, dim=1, keepdim=True)
    count = (~grouped.isnan()).sum(dim=1, keepdim=True)
    variance = torch.nanmean((grouped - mean) ** 2, dim=1, keepdim=True) * count / (count - 1)
    std = torch.where(count > 1, variance, torch.full_like(variance, float("nan"))).sqrt()
    return torch.nan_to_num((grouped - mean) / (std + GROUP_STD_EPSILON), nan=0.0).view(-1)


def _chunk_token_logps(
    lm_head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float
) -> torch.Tensor:
    return -F.cross_entropy(lm_head(hidden).float() / temperature, targets, ignore_index=IGNORE_INDEX, reduction="none")


def token_logps(model, batch: dict[str, torch.Tensor], temperature: float = 1.0) -> torch.Tensor:
    """The log-probability of every label of a packed batch (``input_ids``, ``position_ids``, ``labels``) under
    the model's logits divided by ``temperature`` (the distribution the completions were sampled from); 0 where
    the label is IGNORE_INDEX. Shape (rows, seq_len - 1): position i holds label i + 1.

    One forward without attention mask or KV cache (the position ids keep sequences apart), then the output
    head (``output_head``: Gemma 2's soft-capping included) + log-softmax chunk by chunk as in
    ``token_loss_sum``, recomputed in backward.
    """
    inputs = packed_inputs(model, {name: batch[name] for name in ("input_ids", "position_ids")})
    output = model(**inputs, use_cache=False, output_hidden_states=True, logits_to_keep=1)
    hidden = output.hidden_states[-1][:, :-1]
    shape = hidden.shape[:2]
    hidden = hidden.reshape(-1, hidden.shape[-1])
    targets = batch["labels"][:, 1:].reshape(-1)
    lm_head = output_head(model)
    chunk = chunk_tokens(lm_head.weight.shape[0])
    parts = []
    for start in range(0, hidden.shape[0], chunk):
        part = (lm_head, hidden[start : start + chunk], targets[start : start + chunk], temperature)
        parts.append(
            checkpoint(_chunk_token_logps, *part, use_reentrant=False)
            if torch.is_grad_enabled()
            else _chunk_token_logps(*part)
        )
    return torch.cat(parts).view(shape)


def grpo_token_losses(
    logps: torch.Tensor, reference: torch.Tensor | None, advantages: torch.Tensor, beta: float
) -> torch.Tensor:
    """GRPO's loss of every completion token: -exp(log pi - sg(log pi)) x A + beta x KL, with A the advantage of
    the token's completion and KL TRL's (Schulman's k3) estimate exp(ref - log pi) - (ref - log pi) - 1.

    On-policy (one optimisation step per generation, as here) the ratio is 1 in value and its gradient is that
    of log pi, so PPO's clipping (TRL's epsilon 0.2) never binds and is left out: the value and the gradient are
    TRL's ``_compute_loss`` (``test_grpo.py`` checks both).
    """
    losses = -torch.exp(logps - logps.detach()) * advantages
    if beta:
        difference = reference - logps
        losses = losses + beta * (torch.exp(difference) - difference - 1)
    return losses


def grpo_loss_sum(
    logps: torch.Tensor, reference: torch.Tensor | None, advantages: torch.Tensor, weights: torch.Tensor, beta: float
) -> torch.Tensor:
    """GRPO's loss summed over the completion tokens, each weighted by ``weights`` (0 off the completions; 'dapo': 1,
    for a mean over the step's tokens; 'grpo': 1 / its completion's length, for a mean over its completions)."""
    return (grpo_token_losses(logps, reference, advantages, beta) * weights).sum()
