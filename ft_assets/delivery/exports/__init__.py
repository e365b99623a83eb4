"""The formats a run ships besides the merged model and the adapter: one module per export, registered here.

Each export (``protocol.Export``) says how to export the merged model, how to answer the eval prompts
with its own runtime, and what its gate allows. Everything else iterates over ``EXPORTS``: the delivery
plane makes one asset per export (``gguf_model``) and one blocking check (``shipped_gguf_keeps_the_metric``),
``eval_report`` scores each shipped file beside the merged model, ``published_model`` copies each into
the registry folder of its name (``gguf/``), where the signature covers it, and lineage.json, the MLflow
registry's tags and ``ft-assets run``'s summary (``gguf_file``, ``gguf_metric``, ``gguf_reason``, ...)
name each, shipped or refused with its reason.

Adding an export: its module here (the ``Export``, its settings, ``make``, ``runtime``) and its entry in
``EXPORTS``.
"""

from __future__ import annotations

from ft_assets.delivery.exports import gguf, mlx
from ft_assets.delivery.exports.protocol import Export

EXPORTS: tuple[Export, ...] = (gguf.GGUF, mlx.MLX)  # the registration line: one entry per export


def named(name: str) -> Export | None:
    """The registered export called ``name`` (None: one this version does not have, e.g. in an older lineage)."""
    return next((export for export in EXPORTS if export.name == name), None)
