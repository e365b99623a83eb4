"""Merge a LoRA/QLoRA adapter into a full-precision copy of the base model.

The merge always loads the base in fp32 (or bf16 when asked), never in 4-bit, even when the adapter
was trained with QLoRA: folding the low-rank update into NF4-quantized weights re-quantizes them
and loses quality (the adapter was trained against the dequantized weights, so fp32 + adapter is the
closest model to what was trained). Weights are read and written as safetensors only.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from ft_assets.training.base_model import TOKENIZER_FILES
from ft_assets.vision import auto_class

DTYPES = ("float32", "bfloat16", "float16")


def load_full_precision(model_dir: Path, dtype: str = "float32"):
    """The model in ``model_dir`` at ``dtype`` (a vision-language model as one: ``vision.auto_class``)."""
    import torch

    if dtype not in DTYPES:
        raise ValueError(f"merge dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    return auto_class(model_dir).from_pretrained(
        model_dir, dtype=getattr(torch, dtype), use_safetensors=True, trust_remote_code=False
    )


def merge_adapter(base_dir: Path, adapter_dir: Path, out_dir: Path, dtype: str = "float32") -> dict:
    """Write base + adapter as one safetensors checkpoint (+ tokenizer) to ``out_dir``."""
    from peft import PeftModel

    base = load_full_precision(base_dir, dtype)
    model = PeftModel.from_pretrained(base, adapter_dir, is_trainable=False)
    merged = model.merge_and_unload()
    out_dir.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(out_dir, safe_serialization=True)
    copy_tokenizer(base_dir, out_dir)
    return {"dtype": dtype, "parameters": sum(p.numel() for p in merged.parameters())}


def copy_tokenizer(src: Path, dst: Path) -> None:
    for name in TOKENIZER_FILES + ("generation_config.json",):
        if (src / name).is_file() and not (dst / name).exists():
            shutil.copyfile(src / name, dst / name)
