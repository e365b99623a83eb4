"""An mlx-lm LoRA adapter as a PEFT adapter: what merge, GGUF, vLLM, eval and signing read, from what MLX trained.

mlx-lm writes its adapters in its own form, which PEFT, vLLM and llama.cpp do not read (a bridge was
proposed to mlx-lm and closed, mlx-lm#1119/#1120). The two are the same low-rank update written twice:

| mlx-lm (``adapters.safetensors``, ``adapter_config.json``)  | PEFT (``adapter_model.safetensors``, ``adapter_config.json``)     |
|------------------------------------------------------------|------------------------------------------------------------------|
| ``<module>.lora_a``, (in, r)                                | ``base_model.model.<module>.lora_A.weight`` = ``lora_a``ᵀ, (r, in) |
| ``<module>.lora_b``, (r, out)                               | ``base_model.model.<module>.lora_B.weight`` = ``lora_b``ᵀ, (out, r) |
| ``lora_parameters.scale`` (the update is ``scale · x A B``)  | ``lora_alpha`` = ``scale · r`` (PEFT scales by ``lora_alpha / r``)  |
| ``lora_parameters.rank``, ``dropout``                       | ``r``, ``lora_dropout``                                           |
| ``lora_parameters.keys`` on the last ``num_layers`` layers  | ``target_modules``: the leaf names (``q_proj``) when every layer of  |
|                                                            | the base has them adapted, else each module's full name             |

Every converted module is checked against the base before anything is written: its ``<module>.weight``
must be a tensor of the base's safetensors, of shape (out, in) matching the adapter's. So a module mlx-lm
names differently from transformers is refused with its name instead of becoming an adapter PEFT would
load and silently not apply. The config is written by peft's own ``LoraConfig``, so it is what the installed
peft (and vLLM) reads. Refused, in one line: DoRA (``fine_tune_type: dora``; PEFT's DoRA keeps another
magnitude vector), full fine-tunes (no adapter: they are saved as a model) and LoRA on embeddings.

On the five families of the parity test (Llama 3, Qwen2.5, Mistral, Gemma 3, Phi-3: ``test_mlx.py``) the
converted adapter in transformers gives the MLX model's logits with its adapter to a relative 1e-4.

Reads and writes with safetensors and peft; no mlx needed (a converted adapter can be checked anywhere).
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open

from ft_assets.training.mlx_model import ADAPTER_CONFIG, ADAPTER_WEIGHTS

PEFT_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."  # PEFT's name of the wrapped causal LM


class ConversionRefused(ValueError):
    """The mlx-lm adapter has no PEFT equivalent, or does not fit the base: one line saying which and why."""


def base_shapes(base_dir: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor of the base's safetensors files and its shape (headers only: nothing is loaded)."""
    shapes = {}
    for path in sorted(Path(base_dir).glob("*.safetensors")):
        with safe_open(path, "np") as handle:
            for name in handle.keys():
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    if not shapes:
        raise ConversionRefused(f"{base_dir} holds no safetensors weights to check the adapter against")
    return shapes


def _lora_config(mlx_dir: Path) -> dict:
    config = json.loads((mlx_dir / ADAPTER_CONFIG).read_text())
    kind = config.get("fine_tune_type", "lora")
    if kind != "lora":
        raise ConversionRefused(
            f"{mlx_dir / ADAPTER_CONFIG}: fine_tune_type {kind!r} has no PEFT LoRA equivalent (only 'lora' converts; "
            "a full fine-tune is saved as a model)"
        )
    return config["lora_parameters"]


def target_modules(modules: list[str], shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """PEFT's ``target_modules`` for exactly ``modules``: their leaf names when the base has no other module of
    those names (every layer adapted), else the full module names (PEFT matches a name or a dotted suffix)."""
    leaves = sorted({module.rsplit(".", 1)[-1] for module in modules})
    in_base = {name[: -len(".weight")] for name in shapes if name.endswith(".weight")}
    same_leaves = {module for module in in_base if module.rsplit(".", 1)[-1] in leaves}
    return leaves if same_leaves == set(modules) else sorted(modules)


def convert(mlx_dir: Path, base_dir: Path, out_dir: Path, base_model_name: str = "") -> dict:
    """Write the PEFT form of the mlx-lm adapter in ``mlx_dir`` (trained on ``base_dir``) to ``out_dir``; its summary."""
    import torch
    from peft import LoraConfig
    from safetensors.torch import load_file, save_file

    mlx_dir, out_dir = Path(mlx_dir), Path(out_dir)
    lora = _lora_config(mlx_dir)
    weights = load_file(mlx_dir / ADAPTER_WEIGHTS)
    shapes = base_shapes(base_dir)
    modules = sorted({name.rsplit(".", 1)[0] for name in weights})
    converted: dict[str, torch.Tensor] = {}
    for module in modules:
        a, b = weights.get(f"{module}.lora_a"), weights.get(f"{module}.lora_b")
        if a is None or b is None or a.dim() != 2 or b.dim() != 2:
            leaves = sorted(name.rsplit(".", 1)[-1] for name in weights if name.startswith(f"{module}."))
            raise ConversionRefused(
                f"{mlx_dir / ADAPTER_WEIGHTS}: {module} holds {leaves}, not a linear layer's lora_a and lora_b "
                "(LoRA on embeddings or experts does not convert)"
            )
        expected = (b.shape[1], a.shape[0])
        found = shapes.get(f"{module}.weight")
        if found != expected:
            where = f"has shape {found}" if found else "is not in the base"
            raise ConversionRefused(
                f"{mlx_dir / ADAPTER_WEIGHTS}: {module}.weight {where}, the adapter needs {expected} (out, in): mlx-lm "
                "names this module differently from the base's transformers checkpoint, or the adapter is of another base"
            )
        converted[f"{PREFIX}{module}.lora_A.weight"] = a.T.contiguous()
        converted[f"{PREFIX}{module}.lora_B.weight"] = b.T.contiguous()
    rank, scale = int(lora["rank"]), float(lora["scale"])
    alpha = scale * rank
    config = LoraConfig(
        r=rank,
        lora_alpha=int(alpha) if alpha.is_integer() else alpha,
        lora_dropout=float(lora.get("dropout", 0.0)),
        target_modules=target_modules(modules, shapes),
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model_name or None,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out_dir)
    save_file(converted, out_dir / PEFT_WEIGHTS, metadata={"format": "pt"})
    return {"modules": len(modules), "r": rank, "lora_alpha": alpha, "target_modules": sorted(config.target_modules)}
