"""The model a run trains: the base from safetensors, the attention backend, LoRA/QLoRA wrapping, the scheduler.

Everything here is loading, not training: ``load_model`` returns the model ready for the chosen
method (a 4-bit NF4 base with LoRA for qlora, a full-precision base with LoRA for lora, every weight
trainable for full), ``trainable_parameters`` is what the optimizer and the checkpoints hold, and
``load_trainable`` puts a checkpoint's weights back. Only safetensors are loaded (no pickle, no
remote code): ``base_model`` converted the source once.

Both choices that depend on the family are read from the model, not from a list of names kept here:

- the attention backend: transformers says per architecture which ones it accepts (its
  ``_supports_sdpa`` / ``_supports_flex_attn`` / ``_supports_flash_attn`` flags). Gemma 2 refuses
  sdpa (its attention logits are soft-capped, which sdpa cannot do), so ``auto`` gives it eager on
  a CPU and flex_attention (or flash-attn) on CUDA; the other seven families of the test matrix
  (Llama 3, Qwen2.5, Qwen3, Mistral, Gemma 3, Phi-3) accept all four.
- the LoRA targets: empty ``target_modules`` adapts every linear layer of the model but its output
  head, found in the loaded model: q/k/v/o_proj and gate/up/down_proj for Llama, Qwen, Mistral and
  Gemma, qkv_proj, o_proj, gate_up_proj and down_proj for Phi-3 (fused). An explicit list is checked
  against the same layers; a name the model lacks is refused, naming those it has.
- a mixture of experts' experts: transformers 5 holds them as fused 3-D parameters
  (``mlp.experts.gate_up_proj``, ``down_proj``), not linear layers, so LoRA on the projections alone
  would train the attention only. ``expert_parameters`` finds them in the loaded model and PEFT's
  ``target_parameters`` adapts each expert (``lora_experts``); the router (``router_modules``) is
  frozen unless ``train_router``, and its load-balancing loss joins the loss at ``router_aux_loss_coef``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path

import torch

from ft_assets.training.config import ResolvedTraining, TrainingConfig, experts_of
from ft_assets.training.loss import is_router
from ft_assets.vision import PROJECTORS, VISION_MODULES, VISION_TOWERS, auto_class, is_vision_module, model_has_vision

FLEX_ATTENTION_TORCH = (2, 5)  # torch.nn.attention.flex_attention with a document mask from transformers
BACKENDS = ("flash_attention_2", "flex_attention", "sdpa", "eager")  # auto's order of preference
# The class attributes by which transformers says that an architecture accepts a backend (4.x spelled flash "_2").
SUPPORT_FLAGS = {
    "flash_attention_2": ("_supports_flash_attn", "_supports_flash_attn_2"),
    "flex_attention": ("_supports_flex_attn",),
    "sdpa": ("_supports_sdpa",),
    "eager": (),
}


def causal_lm_class(model_dir: Path) -> type:
    """The transformers class the model in ``model_dir`` trains as (config only, no weights): ``AutoModelForCausalLM``'s,
    or ``AutoModelForImageTextToText``'s for a vision-language model."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING, AutoConfig

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=False)
    if model_has_vision(model_dir):
        return MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(config)]
    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]


# Vision-language families whose packed rows get dense masks built by the trainer (``training.vision``): Gemma 3
DENSE_MASKS = frozenset({"Gemma3ForConditionalGeneration"})


def supported_attention(model_class: type | None) -> tuple[str, ...]:
    """The attention backends transformers accepts for ``model_class`` (eager always; every one when it is not known);
    sdpa and eager only for a family whose masks the trainer builds (``DENSE_MASKS``)."""
    if model_class is None:
        return BACKENDS
    return tuple(
        backend
        for backend, flags in SUPPORT_FLAGS.items()
        if (not flags or any(getattr(model_class, flag, False) for flag in flags))
        and (model_class.__name__ not in DENSE_MASKS or backend in ("sdpa", "eager"))
    )


def flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def resolve_attention(requested: str, device: torch.device, model_class: type | None = None) -> str:
    """The attention backend a run uses; ``auto`` picks the fastest that this device has and the model accepts.

    Every backend keeps packed examples apart through the position_ids that restart at 0 (transformers
    5.x): flash_attention_2 turns them into variable-length sequences (cu_seqlens) and flex_attention
    into a document mask, neither builds a dense score matrix; sdpa and eager get a dense block-diagonal
    mask and keep per-head T x T scores. On CPU, FlexAttention runs forward only (torch 2.13: "does not
    support backward on CPU"; and its first call after a change of sequence length returns wrong values)
    and flash-attn does not exist, so ``auto`` is sdpa there, or eager for a model that refuses sdpa
    (Gemma 2). ``model_class`` is the transformers class of the base (``causal_lm_class``).
    """
    cuda = device.type == "cuda"
    torch_version = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    usable = {
        "flash_attention_2": cuda and flash_attn_installed(),
        "flex_attention": cuda and torch_version >= FLEX_ATTENTION_TORCH,
        "sdpa": True,
        "eager": True,
    }
    supported = supported_attention(model_class)
    if requested == "auto":
        return next(backend for backend in BACKENDS if usable[backend] and backend in supported)
    if requested not in supported:
        raise ValueError(
            f"attn_implementation {requested!r}: transformers does not support it for {model_class.__name__} (it takes "
            f"{', '.join(supported)}); use 'auto'"
        )
    if requested == "flash_attention_2" and not usable[requested]:
        raise ValueError(
            "attn_implementation 'flash_attention_2' needs a CUDA GPU and the flash-attn package; use 'auto'"
        )
    if requested == "flex_attention" and not usable[requested]:
        raise ValueError(
            f"attn_implementation 'flex_attention' trains on CUDA with torch >= 2.5 only (FlexAttention has no backward "
            f"on {device.type}, torch {torch.__version__}); use 'auto'"
        )
    return requested


def linear_layers(model, vision: bool = False) -> list[str]:
    """Full names of the model's linear layers, its output head (lm_head) excepted; of a vision-language model, its
    language model's only unless ``vision`` (``ft_assets.vision.is_vision_module``)."""
    head = model.get_output_embeddings()
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and module is not head and (vision or not is_vision_module(name))
    ]


def projection_names(model, vision: bool = False) -> list[str]:
    """The distinct last names of ``linear_layers``, in module order: what LoRA adapts by default (a layer of a
    ``Sequential``, named by its index, by its parent's name too: ``mlp.0``)."""
    names = (name.split(".") for name in linear_layers(model, vision))
    return list(dict.fromkeys(".".join(parts[-2:]) if parts[-1].isdigit() else parts[-1] for parts in names))


def vision_lora(model, config: TrainingConfig) -> tuple[str | None, list[str]]:
    """A vision-language model's share of the LoRA config: (PEFT's ``exclude_modules``: the vision side, kept out of the
    adapter but for the tower under ``train_vision: all``; the projectors trained in full beside it, PEFT's
    ``modules_to_save``, from ``train_vision: projector`` on). (None, []) for a text model."""
    if not model_has_vision_modules(model):
        return None, []
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    projectors = [name for name in PROJECTORS if name in present] if config.train_vision != "none" else []
    frozen = PROJECTORS + (() if config.train_vision == "all" else VISION_TOWERS)
    return rf"(.*\.)?({'|'.join(frozen)})(\..*)?", projectors  # the projectors' own layers: in modules_to_save


def model_has_vision_modules(model) -> bool:
    return any(is_vision_module(name) for name, _ in model.named_modules())


def freeze_vision(model, config: TrainingConfig) -> None:
    """Full fine-tuning of a vision-language model: its vision tower and projector frozen, as ``train_vision`` says."""
    trained = {"none": (), "projector": PROJECTORS, "all": VISION_MODULES}[config.train_vision]
    for name, param in model.named_parameters():
        parts = name.split(".")
        if is_vision_module(name) and not any(part in trained for part in parts):
            param.requires_grad_(False)


def expert_parameters(model) -> list[str]:
    """The suffixes (``mlp.experts.gate_up_proj``) of a mixture's fused 3-D expert weights, as PEFT's
    ``target_parameters`` matches them; empty for a dense model. Biases (2-D) are left out."""
    found = [
        name.split(".layers.", 1)[-1].split(".", 1)[-1]
        for name, param in model.named_parameters()
        if param.ndim == 3 and ".experts." in name and ".layers." in name
    ]
    return list(dict.fromkeys(found))


def router_modules(model) -> list[str]:
    """The last names of a mixture's routers (``gate`` for Qwen3-MoE and Mixtral, ``router`` for gpt-oss)."""
    return list(dict.fromkeys(name.rsplit(".", 1)[-1] for name, module in model.named_modules() if is_router(module)))


def experts_line(model_config) -> str:
    """What the log says of a mixture's experts: how they run (transformers 5's ``grouped_mm``: one grouped GEMM over
    every expert's tokens; ``eager`` would loop over the experts in Python) and the router loss's weight."""
    experts = experts_of(model_config.to_dict())
    if not experts:
        return ""
    return (
        f", {experts} experts (top {model_config.num_experts_per_tok}) run {model_config._experts_implementation}, "
        f"router loss weight {model_config.router_aux_loss_coef:g}"
    )


def router_aux_loss_coef(config: TrainingConfig, model_config) -> float:
    """The load-balancing loss's weight: the setting, else the model's own when the router trains, else 0."""
    if config.router_aux_loss_coef is not None:
        return config.router_aux_loss_coef
    return float(getattr(model_config, "router_aux_loss_coef", 0.0) or 0.0) if config.train_router else 0.0


def lora_target_modules(model, requested: Sequence[str], vision: bool = False) -> list[str]:
    """The modules LoRA adapts: ``requested`` (names or dotted suffixes, as peft matches them), or every projection when
    empty (of a vision-language model, its language model's, and its vision tower's too with ``vision``)."""
    if not requested:
        return projection_names(model, vision)
    linear = linear_layers(model, vision)
    unknown = [
        target for target in requested if not any(name == target or name.endswith("." + target) for name in linear)
    ]
    if unknown:
        raise ValueError(
            f"target_modules {unknown}: {type(model).__name__} has no such projection; its projections are "
            f"{', '.join(projection_names(model))}. List some of those, or leave target_modules empty to adapt all of them"
        )
    return list(requested)


def load_model(config: TrainingConfig, method: str, base_model_dir: Path, device: torch.device):
    """The base model from safetensors (no pickle, no remote code), wrapped for the chosen method."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig

    if not any(base_model_dir.glob("*.safetensors")):
        raise FileNotFoundError(
            f"{base_model_dir} holds no *.safetensors weights; the recipe loads safetensors only (no pickled "
            ".bin), convert the base model with save_pretrained(safe_serialization=True)"
        )
    compute_dtype = torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    kwargs = {
        "use_safetensors": True,
        "trust_remote_code": False,
        "attn_implementation": resolve_attention(config.attn_implementation, device, causal_lm_class(base_model_dir)),
    }
    vision = model_has_vision(base_model_dir)
    if method == "qlora":
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=compute_dtype,
            # a vision tower stays in the compute dtype: small beside the language model, and its features feed every
            # image token (bitsandbytes' default skips only the output head)
            llm_int8_skip_modules=["lm_head", *(rf"(.*\.)?{name}" for name in VISION_MODULES)] if vision else None,
        )
        kwargs["device_map"] = {"": device}
    kwargs["dtype"] = compute_dtype if method in ("lora", "qlora") else torch.float32  # full: fp32 master weights
    model = auto_class(base_model_dir).from_pretrained(base_model_dir, **kwargs)

    gc_kwargs = {"use_reentrant": False}  # the non-reentrant variant works with frozen inputs and DDP
    if method == "qlora":
        model = prepare_model_for_kbit_training(
            model,
            use_gradient_checkpointing=config.gradient_checkpointing,
            gradient_checkpointing_kwargs=gc_kwargs,
        )
        if vision:  # the preparation upcast every weight it did not quantize to fp32: a frozen tower computes in bf16
            for name, param in model.named_parameters():
                if is_vision_module(name) and param.dtype == torch.float32:
                    param.data = param.data.to(compute_dtype)
    elif config.gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=gc_kwargs)
        if method == "lora":
            model.enable_input_require_grads()
    experts = expert_parameters(model)
    if experts:
        coef = router_aux_loss_coef(config, model.config)
        model.config.router_aux_loss_coef = coef  # loss.token_loss_sum adds the load-balancing loss at this weight
    if method in ("lora", "qlora"):
        exclude, projectors = vision_lora(model, config)
        saved = (router_modules(model) if experts and config.train_router else []) + projectors
        lora = LoraConfig(
            r=config.lora_r,
            lora_alpha=config.lora_alpha,
            lora_dropout=0.0 if experts and config.lora_experts else config.lora_dropout,  # as for_base says
            target_modules=lora_target_modules(model, config.target_modules, config.train_vision == "all"),
            target_parameters=experts if config.lora_experts else None,
            modules_to_save=saved or None,
            exclude_modules=exclude,
            bias="none",
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, lora)
        for param in model.parameters():  # a trained projector's copy (modules_to_save) keeps fp32 master weights
            if param.requires_grad and param.dtype != torch.float32:
                param.data = param.data.float()
    elif vision:
        freeze_vision(model, config)
    if method == "full" and experts and not config.train_router:  # full: every weight but the router's
        for name in router_modules(model):
            for module_name, module in model.named_modules():
                if module_name.endswith("." + name):
                    module.requires_grad_(False)
    return model


def trainable_parameters(model) -> dict[str, torch.nn.Parameter]:
    """Name -> parameter of what the optimizer updates (tied weights appear once)."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def load_trainable(model, weights: dict[str, torch.Tensor], source: str) -> None:
    params = trainable_parameters(model)
    missing, unexpected = sorted(set(params) - set(weights)), sorted(set(weights) - set(params))
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {source} does not match this model (missing {missing[:3]}, unexpected {unexpected[:3]}); "
            "it was written by a different method or target_modules, delete it or change the run"
        )
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(weights[name])


def make_scheduler(config: TrainingConfig, optimizer, resolved: ResolvedTraining):
    from transformers import get_scheduler

    name = "constant_with_warmup" if config.lr_scheduler == "constant" else config.lr_scheduler
    return get_scheduler(
        name, optimizer, num_warmup_steps=resolved.warmup_steps, num_training_steps=resolved.total_steps
    )
