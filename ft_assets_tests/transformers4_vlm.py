"""Run under transformers 4.x (``PYTHONPATH=.venv-transformers4``): load each vision-language model folder of a job file.

``python ft_assets_tests/transformers4_vlm.py JOB.json`` reads a list of jobs (``dir``: the model folder, ``conversation``:
one chat turn with image parts, ``text_conversation``: one without, ``image``: the picture as a PNG file, ``inputs``: an ``.npz`` of the processor's
tensors as transformers 5 made them, ``out``: where to write) and writes, per job, ``OUT.logits.npy`` (the model's
logits on the 5.x inputs), ``OUT.npz`` (what 4.x's own tokenizer, image processor and processor make of the prompt)
and ``OUT.json`` (the classes loaded, the text model's RoPE theta, or the error that stopped a load). Imports nothing
of ft_assets: this process has another transformers than the package.
"""

import inspect
import json
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from PIL import Image
from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer


def load_processor(model_dir: str):
    """``AutoProcessor``; where it wants a video processor, which 4.x cannot build without torchvision, its class
    without that part (the image path is the same)."""
    try:
        return AutoProcessor.from_pretrained(model_dir), ""
    except Exception as exc:  # the Qwen-VL processors build their video processor first
        config = json.loads((Path(model_dir) / "processor_config.json").read_text())
        try:
            cls = getattr(transformers, config["processor_class"])
        except Exception as missing:  # 4.57's SmolVLM processor module imports torchvision
            return None, f"{type(missing).__name__}: {missing} ({missing.__cause__})"[:300]
        if "video_processor" not in cls.attributes:
            return None, f"{type(exc).__name__}: {exc}"[:300]
        image_only = type(cls.__name__, (cls,), {"attributes": [a for a in cls.attributes if "video" not in a]})
        return image_only.from_pretrained(model_dir), "without its video processor (needs torchvision)"


def probe(job: dict) -> dict:
    out = Path(job["out"])
    try:
        tokenizer = AutoTokenizer.from_pretrained(job["dir"])
    except Exception as exc:  # the test reads the reason
        return {"error": f"tokenizer: {type(exc).__name__}: {exc}"[:500]}
    try:
        model = AutoModelForImageTextToText.from_pretrained(
            job["dir"], torch_dtype=torch.float32, attn_implementation="eager"
        ).eval()
    except Exception as exc:
        return {"error": f"model: {type(exc).__name__}: {exc}"[:500]}
    given = dict(np.load(job["inputs"]))
    takes = inspect.signature(model.forward).parameters
    try:
        with torch.no_grad():
            logits = model(**{k: torch.from_numpy(v) for k, v in given.items() if k in takes}).logits[0]
    except Exception as exc:  # a config read otherwise (Qwen2.5-VL without its M-RoPE sections) fails only here
        return {"error": f"forward: {type(exc).__name__}: {exc}"[:500]}
    np.save(out.with_suffix(".logits.npy"), logits.numpy())
    image = Image.open(job["image"]).convert("RGB")
    arrays = {"text_ids": np.array(tokenizer(tokenizer.apply_chat_template(
        job["conversation"], tokenize=False, add_generation_prompt=True), add_special_tokens=False).input_ids)}  # fmt: skip
    # a prompt without pictures: the text model alone
    text_only = tokenizer.apply_chat_template(job["text_conversation"], tokenize=False, add_generation_prompt=True)
    arrays["text_only_ids"] = np.array(tokenizer(text_only, add_special_tokens=False).input_ids)
    with torch.no_grad():
        arrays["text_only_logits"] = model(input_ids=torch.from_numpy(arrays["text_only_ids"][None])).logits[0].numpy()
    image_processor = AutoImageProcessor.from_pretrained(job["dir"], use_fast=False)
    for key, value in image_processor(images=[image], return_tensors="np").items():
        arrays[f"image_{key}"] = np.asarray(value)
    processor, note = load_processor(job["dir"])
    if processor is not None:
        rendered = processor.apply_chat_template(job["conversation"], tokenize=False, add_generation_prompt=True)
        for key, value in processor(text=[rendered], images=[[image]], return_tensors="np").items():
            arrays[f"processor_{key}"] = np.asarray(value)
    np.savez(out.with_suffix(".npz"), **arrays)
    return {
        "tokenizer_class": type(tokenizer).__name__,
        "model_class": type(model).__name__,
        "processor": type(processor).__name__ if processor is not None else None,
        "processor_note": note,
        "rope_theta": getattr(model.config.get_text_config(), "rope_theta", None),
        "ignored_inputs": sorted(k for k in given if k not in takes),
        "model_inputs": sorted(takes),
    }


if __name__ == "__main__":
    torch.set_num_threads(1)
    jobs = json.loads(Path(sys.argv[1]).read_text())
    for job in jobs:
        result = {"transformers": transformers.__version__} | probe(job)
        Path(job["out"]).with_suffix(".json").write_text(json.dumps(result, indent=2))
