"""Vision-language models: which base models have a vision tower, their processor files, and loading the processor.

A vision-language model (VLM) is a base whose ``config.json`` has a ``vision_config``: Qwen2.5-VL,
Qwen3-VL, Gemma 3 (``Gemma3ForConditionalGeneration``; the text-only Gemma 3 1B/270M have none),
Idefics3 and SmolVLM. Every plane asks the same questions of one: does it see images
(``is_vision_model``), which files beside the tokenizer's make its processor (``PROCESSOR_FILES``),
which token stands for an image patch in its sequences (``image_token_id``) and which of its modules
are the vision side (``VISION_MODULES``: frozen and kept out of 4-bit quantization by default).

``load_processor`` is ``AutoProcessor.from_pretrained`` that also works where torchvision is not
installed. transformers 5 builds a video sub-processor only with torchvision, yet insists on one for
every processor whose ``__init__`` names it (Qwen2.5-VL's, Qwen3-VL's, SmolVLM's), so without
torchvision those processors cannot be loaded at all even though images need no video processor (and
SmolVLM's refuses to start without ``num2words``, which it uses to spell out video frame counts). Loaded
here, they see no video sub-processor: images and text work, a video raises. Where torchvision is
installed nothing is changed.

Imports nothing heavy at module level: the data and control planes ask these questions without torch.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# What transformers saves of a processor beside the tokenizer's files (a tokenizer-only model has none of them)
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "chat_template.json")
# The vision side of each family, by the module names transformers 5 gives it: the tower (Qwen's ``visual``, Gemma 3's
# and LLaVA's ``vision_tower``, Idefics3's ``vision_model``) and the projector into the text model's width (Qwen's
# merger lives inside ``visual``; Gemma 3's ``multi_modal_projector``, Idefics3's ``connector``)
VISION_TOWERS = ("visual", "vision_tower", "vision_model")
PROJECTORS = ("multi_modal_projector", "connector", "merger")
VISION_MODULES = VISION_TOWERS + PROJECTORS
# Families whose processors work with these planes (the test matrix), by config.json's model_type
FAMILIES = ("qwen2_5_vl", "qwen3_vl", "gemma3", "idefics3", "smolvlm")


def read_config(model_dir: str | Path) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


def is_vision_model(config: dict) -> bool:
    """Whether a model's ``config.json`` (as a dict) describes a vision-language model."""
    return isinstance(config.get("vision_config"), dict)


def model_has_vision(model_dir: str | Path) -> bool:
    path = Path(model_dir) / "config.json"
    return path.is_file() and is_vision_model(read_config(model_dir))


def auto_class(model_dir: str | Path) -> type:
    """The transformers auto class a model loads with: ``AutoModelForImageTextToText`` for a vision-language model,
    else ``AutoModelForCausalLM``."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if model_has_vision(model_dir) else AutoModelForCausalLM


def image_token_id(config: dict) -> int:
    """The token id that stands for one image feature in the model's sequences (Qwen's ``<|image_pad|>``, Gemma 3's
    ``<image_soft_token>``, Idefics3's ``<image>``), as config.json names it."""
    for key in ("image_token_id", "image_token_index"):
        if isinstance(config.get(key), int):
            return config[key]
    raise ValueError(f"config.json of a {config.get('model_type')} model names no image_token_id")


def is_vision_module(name: str) -> bool:
    """Whether a parameter or module name (``model.visual.blocks.0.attn.qkv``) belongs to the vision side."""
    return any(part in VISION_MODULES for part in name.split("."))


@contextmanager
def without_video() -> Iterator[None]:
    """Processors of families with a video sub-processor, loaded without it (see the module docstring)."""
    from unittest import mock

    import transformers
    from transformers.processing_utils import ProcessorMixin

    if transformers.is_torchvision_available():
        yield
        return
    attributes = ProcessorMixin.get_attributes.__func__

    def image_only(cls):
        return [name for name in attributes(cls) if "video" not in name]

    def num2words(number, *args, **kwargs):
        raise ImportError("num2words is not installed: SmolVLM cannot describe videos")

    from transformers.models.smolvlm import processing_smolvlm

    with (
        mock.patch.object(ProcessorMixin, "get_attributes", classmethod(image_only)),
        mock.patch.object(processing_smolvlm, "num2words", processing_smolvlm.num2words or num2words),
    ):
        yield


class _NoVideoProcessor:
    """Stands in for the video processor transformers cannot build without torchvision (SmolVLM's chat template
    reads its frame settings): videos raise."""

    num_frames = fps = None

    def __call__(self, *args, **kwargs):
        raise ImportError("videos need torchvision, which is not installed")


def takes_video(processor_class: str) -> bool:
    """Whether a processor class wants a video processor that cannot be built here (no torchvision)."""
    return _takes_video(processor_class)


def _takes_video(processor_class: str) -> bool:
    import inspect

    import transformers

    if transformers.is_torchvision_available():
        return False
    cls = getattr(transformers, processor_class, None)
    return cls is not None and "video_processor" in inspect.signature(cls).parameters


def load_processor(model_dir: str | Path):
    """The model's processor (``AutoProcessor.from_pretrained``), also where torchvision is missing."""
    from transformers import AutoProcessor

    model_dir = Path(model_dir)
    saved = model_dir / "processor_config.json"
    processor_class = json.loads(saved.read_text()).get("processor_class", "") if saved.is_file() else ""
    no_video = _takes_video(processor_class)
    with without_video():
        processor = AutoProcessor.from_pretrained(
            model_dir, trust_remote_code=False, **({"video_processor": None} if no_video else {})
        )
    if no_video:
        processor.video_processor = _NoVideoProcessor()
    return processor


def save_processor(processor, out_dir: str | Path) -> None:
    """``processor.save_pretrained(out_dir)``, also for one ``load_processor`` loaded without its video processor."""
    if isinstance(getattr(processor, "video_processor", None), _NoVideoProcessor):
        processor.video_processor = None
    with without_video():
        processor.save_pretrained(out_dir)
