"""The base model in MLX (mlx-lm): loaded from the base_model folder, LoRA layers from mlx-lm, the files mlx-lm reads.

The MLX backend (``ft_assets.training.mlx_recipe``) trains the same safetensors folder the torch recipe does,
loaded by mlx-lm's own ``load_model``; LoRA is mlx-lm's ``LoRALinear`` (``y = W x + scale · (x A) B``, ``A``
(in, r), ``B`` (r, out)) with ``scale = lora_alpha / lora_r``, PEFT's scaling, so the same settings give the
same update in both backends and ``mlx_peft`` converts one into the other.

mlx-lm 0.32 misreads two things transformers 5 writes into ``config.json``, silently: RoPE only as
``rope_parameters`` (it falls back to theta 10,000 and no ``llama3`` scaling: max logit error 14 on the tiny
Llama 3 and 13 on Mistral of ``families.py``, against 3e-5 with the keys below), and Gemma 3's
``layer_types`` (it reads ``sliding_window_pattern``, default 6, and fails on a 2-layer model). So the model
is built with transformers 4's RoPE keys (``portable.legacy_rope``) and Gemma 3's pattern read from its
layer types; the logits then equal transformers' within 4e-5 (Llama 3, Qwen2.5, Qwen3, Mistral, Phi-3) and
1e-3 of 24 (Gemma 3). Gemma 2 is refused past its sliding window: mlx-lm's gemma2 attends over the whole row
(max logit error 5.8 at 40 tokens with a 16-token window), which would train another model than the one
transformers, vLLM and llama.cpp run.

LoRA targets: every linear layer of every decoder layer (the projections the torch backend adapts by
default: q/k/v/o_proj, gate/up/down_proj; Phi-3's fused qkv_proj and gate_up_proj), or those whose names end
with one of ``target_modules``; a name the model lacks is refused, naming those it has.

mlx is imported by the functions that use it: this module loads without it (the planner and the tests that
check the refusals import it on any machine).
"""

from __future__ import annotations

import json
from pathlib import Path

from ft_assets.portable import legacy_rope

ADAPTER_WEIGHTS = "adapters.safetensors"  # mlx-lm's names: what `mlx_lm generate --adapter-path` and its fuse read
ADAPTER_CONFIG = "adapter_config.json"
LORA_LEAVES = ("lora_a", "lora_b")


class MlxModelError(ValueError):
    """The base cannot be trained with MLX as it is: one line saying why and what to do."""


def mlx_config(config: dict) -> dict:
    """What mlx-lm must be told beyond ``config.json`` to build the model transformers builds (see the docstring)."""
    overrides = legacy_rope(config)
    layer_types = config.get("layer_types")
    if config.get("model_type") == "gemma3_text" and layer_types and "full_attention" in layer_types:
        overrides["sliding_window_pattern"] = layer_types.index("full_attention") + 1
    return overrides


def check_trainable(config: dict, seq_len: int) -> None:
    """Refuse a base mlx-lm would run differently from transformers at this row length (Gemma 2's sliding window)."""
    window = config.get("sliding_window")
    if config.get("model_type") == "gemma2" and window and seq_len > window:
        raise MlxModelError(
            f"backend mlx: mlx-lm's gemma2 attends over whole rows, but this Gemma 2 attends over a sliding window of "
            f"{window} tokens and the shards are packed at {seq_len}: set backend: torch, or repack at seq_len <= {window}"
        )


def load_base(model_dir: Path, seq_len: int):
    """The base of ``model_dir`` (a HF safetensors folder) as an mlx-lm model, every weight frozen."""
    from mlx_lm.utils import load_model

    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    check_trainable(config, seq_len)
    try:
        model, _ = load_model(model_dir, model_config=mlx_config(config))
    except ValueError as exc:
        raise MlxModelError(f"backend mlx: mlx-lm cannot build {model_dir.name}: {exc}; set backend: torch") from exc
    model.freeze()
    return model


QLORA_BITS, QLORA_GROUP = 4, 64  # mlx-lm's QLoRA base: affine 4-bit in groups of 64 (what mlx_lm.convert -q writes)


def quantize_base(model) -> None:
    """The base's linear layers (and embedding) in mlx's affine 4-bit, as mlx-lm's QLoRA trains over them; layers
    whose width is no multiple of the group stay in full precision."""
    import mlx.nn as nn

    nn.quantize(model, group_size=QLORA_GROUP, bits=QLORA_BITS,
                class_predicate=lambda _, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % QLORA_GROUP == 0)  # fmt: skip
    model.freeze()


def projection_keys(model) -> list[str]:
    """The linear layers of a decoder layer, by their path inside it (``self_attn.q_proj``), in module order."""
    import mlx.nn as nn

    keys: list[str] = []
    for layer in model.layers:
        for path, module in layer.named_modules():
            if isinstance(module, nn.Linear | nn.QuantizedLinear) and path not in keys:
                keys.append(path)
    return keys


def lora_keys(model, requested: list[str]) -> list[str]:
    """The paths LoRA adapts in every decoder layer: all projections, or those ending with a requested name."""
    keys = projection_keys(model)
    if not requested:
        return keys
    missing = [name for name in requested if not any(key == name or key.endswith(f".{name}") for key in keys)]
    if missing:
        names = sorted({key.rsplit(".", 1)[-1] for key in keys})
        raise MlxModelError(f"target_modules {missing} are not linear layers of this model; it has {names}")
    return [key for key in keys if any(key == name or key.endswith(f".{name}") for name in requested)]


def lora_parameters(rank: int, alpha: float, dropout: float, keys: list[str]) -> dict:
    """mlx-lm's ``lora_parameters``: its ``scale`` is PEFT's ``lora_alpha / r``."""
    return {"rank": rank, "scale": alpha / rank, "dropout": dropout, "keys": keys}


def add_lora(model, parameters: dict) -> None:
    """mlx-lm's LoRA layers on ``parameters['keys']`` of every decoder layer; only they are trainable."""
    from mlx_lm.tuner.utils import linear_to_lora_layers

    linear_to_lora_layers(model, len(model.layers), parameters)


def adapter_config(parameters: dict, layers: int) -> dict:
    """The ``adapter_config.json`` mlx-lm's ``load_adapters`` reads (``mlx_lm generate --adapter-path``)."""
    return {"fine_tune_type": "lora", "num_layers": layers, "lora_parameters": parameters}


def write_adapter(model, parameters: dict, out_dir: Path) -> Path:
    """The model's LoRA weights and config as mlx-lm writes them (``adapters.safetensors`` + ``adapter_config.json``)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    out_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out_dir / ADAPTER_WEIGHTS), dict(tree_flatten(model.trainable_parameters())))
    (out_dir / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(parameters, len(model.layers)), indent=2))
    return out_dir
