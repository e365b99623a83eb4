"""The config.json of the models the examples fine-tune, shipped so that ``ft-assets plan`` sizes them with no download.

``model_configs/<owner>--<name>.json`` holds the config.json of the Hugging Face hub id ``<owner>/<name>``, a few
kilobytes of public metadata: the plan of ``examples/gemma3-12b-lora.yaml`` needs neither the 24 GB of weights nor a
hub token. Each file is the hub's config.json as published; what one leaves out (``google/gemma-3-12b-it``'s
``text_config`` has no ``vocab_size``, ``head_dim`` or ``tie_word_embeddings``) ``ModelShape.from_config`` takes
from the transformers class, as the model is built. The parameter count each gives equals the published one (7.62B
for Qwen2.5-7B-Instruct, 8.03B for Llama-3.1-8B-Instruct, 70.55B for Llama-3.3-70B-Instruct, 8.29B for
Qwen2.5-VL-7B-Instruct with its vision tower).

A vision-language model also ships its ``preprocessor_config.json`` as ``<owner>--<name>.preprocessor_config.json``:
before any data exists, the planner sizes a row's images from the processor's own limits (Qwen's ``max_pixels``).

Another model is planned from its own config.json (``ft-assets plan --model-config``).
"""

from __future__ import annotations

import json
from pathlib import Path

FOLDER = Path(__file__).with_name("model_configs")
PREPROCESSOR = ".preprocessor_config"  # the suffix of a shipped preprocessor_config.json (``<owner>--<name>.preprocessor_config.json``)


def file_of(model_id: str) -> Path:
    """Where the config of hub id ``owner/name`` is shipped (whether or not it is)."""
    return FOLDER / f"{model_id.replace('/', '--')}.json"


def shipped_ids() -> list[str]:
    """The hub ids whose config.json ships with ft-assets."""
    return sorted(
        path.stem.replace("--", "/", 1) for path in FOLDER.glob("*.json") if not path.stem.endswith(PREPROCESSOR)
    )


def shipped_config(model_id: str) -> dict | None:
    """The config.json of hub id ``model_id`` as shipped; None when it is not."""
    path = file_of(model_id)
    return json.loads(path.read_text()) if "/" in model_id and path.is_file() else None


def shipped_preprocessor(model_id: str) -> dict | None:
    """The preprocessor_config.json of hub id ``model_id`` (a vision-language model) as shipped; None when it is not."""
    return shipped_config(model_id + PREPROCESSOR) if not model_id.endswith(PREPROCESSOR) else None
