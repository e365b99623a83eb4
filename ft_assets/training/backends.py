"""Which framework trains a run: the ``backend`` setting (``torch``, ``mlx`` or ``auto``) resolved on this machine.

- ``torch``: ``recipe.py`` (transformers + peft + accelerate): CUDA, MPS or CPU, every objective and method,
  several processes and nodes.
- ``mlx``: ``mlx_recipe.py`` (mlx-lm): Apple silicon's GPU through Metal (or mlx's CPU build, as on this
  project's Linux machines and CI), SFT with LoRA, QLoRA (mlx's 4-bit) or full fine-tuning on one process; its adapter is converted to
  PEFT's form, so the delivery plane cannot tell the two apart. Install with ``pip install 'ft-assets[mlx]'``.
- ``auto``: mlx on Apple silicon (macOS on arm64) when mlx and mlx-lm are installed, else torch. A run that mlx
  cannot do (``refusal``) is said in one line by the plan and by ``lora_adapter``, naming ``backend: torch``.

``FT_MLX=0`` hides an installed mlx from ft-assets (``auto`` trains with torch, the MLX export is off): the test
suite sets it, so that only the tests of the MLX backend and export pay for them (~20 s a delivery run).

The backend changes the trained weights (another framework's kernels and RNG), so a resolved ``mlx`` is part of
the run id (``TrainingConfig.result_fields``); torch runs keep the ids they had. Nothing here imports torch or
mlx: the planner and the control plane resolve the backend without either.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import sys

BACKENDS = ("auto", "torch", "mlx")
MLX_PACKAGES = ("mlx", "mlx_lm")
INSTALL = "pip install 'ft-assets[mlx]'"


def apple_silicon() -> bool:
    return sys.platform == "darwin" and platform.machine() == "arm64"


def mlx_installed() -> bool:
    """mlx and mlx-lm are importable, and ``FT_MLX`` is not ``0`` (which hides them: torch only, no MLX export)."""
    if os.environ.get("FT_MLX") == "0":
        return False
    return all(importlib.util.find_spec(name) is not None for name in MLX_PACKAGES)


def resolve(backend: str, objective: str, method: str, world_size: int) -> str:
    """``torch`` or ``mlx`` for a run of ``objective`` / ``method`` on ``world_size`` processes: ``auto`` is mlx on Apple
    silicon with mlx installed when mlx can do the run, else torch; ``mlx`` for a run it cannot do is refused (one
    line). Whether mlx is installed is the worker's check (``require_mlx``): the plan may be made on another host."""
    reason = refusal(objective, method, world_size)
    if backend == "auto":
        return "mlx" if apple_silicon() and mlx_installed() and reason is None else "torch"
    if backend == "mlx" and reason:
        raise ValueError(reason)
    return backend


def require_mlx() -> None:
    """On the worker that trains with mlx: its packages are there, or one line saying how to get them."""
    if not mlx_installed():
        raise ValueError(f"backend mlx needs mlx and mlx-lm on the worker: {INSTALL} (or set backend: torch)")


def refusal(objective: str, method: str, world_size: int) -> str | None:
    """Why the MLX backend cannot run this, in one line naming what to change (None: it can)."""
    if objective != "sft":
        return (
            f"backend mlx trains supervised fine-tuning only; this version's objective is {objective} (its loss and "
            "reference model are the torch recipe's): set backend: torch"
        )
    if world_size > 1:
        return f"backend mlx trains on one process (num_processes x num_nodes = {world_size}): set them to 1, or backend: torch"
    return None
