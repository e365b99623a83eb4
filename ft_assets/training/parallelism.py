"""How the model is spread over the processes: DDP (a whole copy on each) or FSDP2 (a shard on each).

The recipe has one loop for both (``ft_assets.training.recipe``); ``start_processes`` joins this attempt's
processes (accelerate, checked against ``num_processes`` x ``num_nodes``), ``for_config`` gives it the strategy
that holds the parts that differ: wrapping the model, clipping the gradient norm, which eval rows a
rank runs, writing and loading checkpoints, and the consolidated weights the run exports.

- ``DataParallel`` (``parallelism: ddp``): accelerate's DDP. Every GPU holds the weights, gradients and
  AdamW state of the whole model; rank 0 writes checkpoints (``checkpoints.write_checkpoint``).
- ``FullySharded`` (``parallelism: fsdp``): ``torch.distributed.fsdp.fully_shard`` (FSDP2) on every
  decoder layer and on the root, so each of W GPUs keeps 1/W of the parameters, gradients and
  optimizer state and gathers one layer's weights at a time. Full fine-tuning of an 8B model needs
  16 B a parameter, 128 GB: no single 80 GB GPU, 2 x 80 GB under FSDP (the planner's
  ``estimate_vram(..., gpus=W, parallelism="fsdp")``). Checkpoints are ``torch.distributed.checkpoint``
  folders of the trainable weights and AdamW state, every rank writing its own shard; DCP reshards
  on load, so a checkpoint of 2 processes resumes on 1 (and 4 on 2). The frozen base never goes into
  a checkpoint (a LoRA checkpoint of a 70B model stays a few hundred MB).

FSDP2 directly, not accelerate's FSDP plugin: accelerate 1.15 applies the plugin to GPU processes
only (CPU processes are always MULTI_CPU there), so the plugin path could not run in CPU tests;
``fully_shard`` runs the same on gloo and NCCL. QLoRA shards too (bitsandbytes 0.50 re-attaches a
4-bit weight's quantization state after FSDP gathers it: ``fix_4bit_weight_quant_state_from_module``);
the forward of a sharded 4-bit model equals the unsharded one on CPU (``test_fsdp.py``).

Under FSDP every forward gathers weights from all ranks, so all ranks must run the same forwards: at
evaluation each rank runs every eval row (eval takes as long as on one GPU) instead of 1/W of them.
Each rank loads the whole base model into host memory before sharding it (a 70B model in bf16:
140 GB of RAM a process); loading on rank 0 only and broadcasting the shards is not done.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed.checkpoint as dcp
from accelerate import Accelerator
from accelerate.utils import DistributedType, broadcast_object_list
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from ft_assets.training.config import TrainingConfig


def start_processes(config: TrainingConfig, trackers_dir: Path) -> Accelerator:
    """This attempt's processes as accelerate joins them, checked against the settings: accelerate's own FSDP
    plugin refused (sharding is ``FullySharded``'s), and as many processes as num_processes x num_nodes."""
    cuda = torch.cuda.is_available()
    accelerator = Accelerator(
        # cpu=True is what makes several processes without a GPU join one gloo group (MULTI_CPU);
        # without it each torchrun/`accelerate launch --multi_gpu` process would train alone.
        cpu=not cuda and not torch.backends.mps.is_available(),
        mixed_precision="bf16" if cuda and torch.cuda.is_bf16_supported() else "no",
        log_with=config.report_to or None,
        project_dir=trackers_dir,
    )
    if accelerator.distributed_type == DistributedType.FSDP:
        # accelerate's own FSDP plugin would wrap the model behind the recipe's back: sharding is the recipe's.
        raise ValueError(
            "accelerate's FSDP plugin is not used: launch without --use_fsdp (and without ACCELERATE_USE_FSDP) "
            "and set the training setting parallelism: fsdp, which shards with FSDP2 and writes sharded checkpoints"
        )
    if accelerator.num_processes != config.world_size:
        raise ValueError(
            f"config.num_processes={config.num_processes} x num_nodes={config.num_nodes} but {accelerator.num_processes} "
            f"process(es) were started; launch with `torchrun --nproc_per_node {config.num_processes} --nnodes "
            f"{config.num_nodes} -m ft_assets.training.worker ...` or set num_processes and num_nodes to match"
        )
    return accelerator


def attempt_id(world: int) -> str:
    """One id for this attempt on every rank (rank 0's): the shard receipts of an earlier attempt at the same step
    are not ours."""
    attempt = [uuid.uuid4().hex]
    if world > 1:
        broadcast_object_list(attempt)
    return attempt[0]


class Parallel(Protocol):
    name: str
    lockstep_eval: bool  # every rank must run the same forwards (each one gathers the sharded weights)

    def wrap(self, model, accelerator): ...

    def clip_grad_norm(self, accelerator, params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor: ...


class DataParallel:
    """accelerate's DDP: the whole model on every process; gradients all-reduced."""

    name = "ddp"
    lockstep_eval = False

    def wrap(self, model, accelerator):
        return accelerator.prepare_model(model)

    def clip_grad_norm(self, accelerator, params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        return accelerator.clip_grad_norm_(params, max_norm)


class FullySharded:
    """FSDP2: weights, gradients and optimizer state sharded over ``world`` processes (module docstring).

    One process shards nothing (the model is prepared as under DDP) but keeps the sharded checkpoint format,
    so it resumes, and is resumed from, runs of any number of processes.
    """

    name = "fsdp"

    def __init__(self, world: int, device: torch.device):
        self.world, self.device = world, device
        self.lockstep_eval = world > 1

    def wrap(self, model, accelerator):
        if self.world == 1:
            return accelerator.prepare_model(model)
        mesh = init_device_mesh(self.device.type, (self.world,))
        bf16 = self.device.type == "cuda" and torch.cuda.is_bf16_supported()
        # bf16 compute as accelerate's autocast does under DDP; gradients reduced and AdamW stepped in fp32
        policy = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if bf16
            else MixedPrecisionPolicy()
        )
        for module in model.modules():
            if hasattr(module, "support_avx512bf16_for_cpu"):
                # bitsandbytes repacks a 4-bit weight in place for its CPU inference kernel at the first eval forward:
                # under FSDP that rewrites the gathered copy and corrupts the next steps (loss 7.46 instead of 5.94)
                module.support_avx512bf16_for_cpu = False
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        return model

    def clip_grad_norm(self, accelerator, params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        """The global gradient norm over every rank's shards (one all-reduce), then clipping by it, as torchtitan does."""
        grads = [p.grad for p in params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        if isinstance(norm, DTensor):  # a partial norm on each rank until reduced
            norm = norm.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
        return norm


def for_config(config: TrainingConfig, world: int, device: torch.device) -> Parallel:
    return FullySharded(world, device) if config.parallelism == "fsdp" else DataParallel()


def decoder_layers(model) -> list[torch.nn.Module]:
    """The transformer blocks FSDP shards one by one: transformers' ``_no_split_modules`` classes (LlamaDecoderLayer, …)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or ())
    layers = [module for module in base.modules() if type(module).__name__ in names]
    if not layers:
        raise ValueError(
            f"parallelism fsdp: cannot find the decoder layers of {type(base).__name__} (its _no_split_modules is "
            f"{sorted(names) or 'empty'}); use parallelism ddp for this model"
        )
    return layers


# --- checkpoints: torch.distributed.checkpoint of the trainable weights and optimizer state ----------


def _trainable_state(model, optimizer, names: set[str]) -> dict:
    model_state, optimizer_state = get_state_dict(model, optimizer)
    # ignore_frozen_params would keep a tied lm_head (it is not a parameter of its own): filter by name instead
    return {
        "model": {name: value for name, value in model_state.items() if name in names},
        "optimizer": optimizer_state,
    }


def save_shards(model, optimizer, names: set[str], folder) -> None:
    """Collective: every rank writes its shard of the trainable weights and AdamW state to its local ``folder``."""
    dcp.save(_trainable_state(model, optimizer, names), storage_writer=dcp.FileSystemWriter(str(folder)))


def load_shards(model, optimizer, names: set[str], folder) -> None:
    """Collective: load a sharded checkpoint written by any number of processes into this run's shards."""
    state = _trainable_state(model, optimizer, names)
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(folder)))
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=StateDictOptions(strict=False),
    )


def consolidated_state(model, names: set[str] | None) -> dict[str, torch.Tensor]:
    """Collective: the whole (unsharded) weights on rank 0's CPU, ``names`` only if given; other ranks get {}.

    Without ``names``: every parameter and buffer once, so a tied lm_head is not saved as a copy of the embedding
    (the state dict names both; ``named_parameters`` one).
    """
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    keep = names or {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()}
    return {name: value for name, value in full.items() if name in keep}
