"""Published files that every runtime reads the same: transformers 4.x and 5.x, PEFT, vLLM, llama.cpp.

transformers 5 writes files that older readers misread without an error. Measured with
``ft_assets_tests/test_portable.py`` (transformers 4.57.6 beside 5.x, the 8 tiny families of
``families.py``), before these rules:

- ``config.json`` holds RoPE only as ``rope_parameters``. transformers 4.57 does not know that key
  and falls back to ``rope_theta`` = 10,000: SmolLM2 (100,000), Qwen (1,000,000) and Llama 3
  (500,000 + ``llama3`` scaling) load without an error and answer with the wrong positions (relative
  logit error 0.41-0.75 on the tiny llama3, qwen2.5, qwen3 and mistral). So the 4.x keys are written
  beside it: ``rope_theta``, ``rope_scaling`` for a non-default type, and Gemma 3's
  ``rope_local_base_freq`` (its per-layer-type form). transformers 5 reads ``rope_parameters`` first
  and takes the 4.x keys as the same values; with them the 4.x logits equal 5.x's (< 1e-5).
- A mixture of experts' count is written as ``num_local_experts`` only; 4.x's Qwen3-MoE reads
  ``num_experts`` and builds its default 128 experts without it (it then refuses the weights). So
  ``num_experts`` is written beside it.
- ``tokenizer_config.json`` names ``TokenizersBackend``, a class 4.x does not have (it refuses to load
  the tokenizer); ``PreTrainedTokenizerFast`` is the same tokenizer.json-backed class in both. And
  transformers 5 rebuilds some families' tokenizers from their class rather than from ``tokenizer.json``
  (a ``qwen2`` model gets Qwen2's digit-splitting pre-tokenizer and NFC whatever the file says): the tiny
  Qwen2.5's ids then differ between 4.x and 5.x on "12 minutes". So the tokenizer is first saved back
  as transformers 5 runs it, and ``tokenizer.json`` holds what the trainer tokenized with.
- ``adapter_config.json`` names the trainer's scratch folder as its base, which nobody else has: it
  names the base by its Hub id when the base came from the Hub unchanged, else by its key in the store.
- ``generation_config.json`` without sampling settings leaves a server's defaults (vLLM: temperature 1).
  Where the base has none, the file says greedy as top-1 sampling, ``do_sample: true, top_k: 1``: vLLM
  reads ``top_k`` (never ``do_sample``), and it is the one greedy form transformers accepts on save —
  ``do_sample: false`` with ``temperature: 0`` makes transformers 4.57 refuse ``save_pretrained`` of
  the loaded model. The base's own settings, when it has any, are kept as they are.

A vision-language model's files (measured on the 6 tiny families of ``vlm_families.py``, one picture prompt):

- transformers 5 writes ``extra_special_tokens`` as a list, which stops 4.57's tokenizer from loading (every family
  but the two Qwen-VL ones, which 4.x loads through its own tokenizer class), and a model's named tokens
  (``image_token``, Gemma 3's ``boi_token``) as ``model_specific_special_tokens``, which 4.x's processors do not
  read. Both are written in the form the Hub's 4.x files have: ``extra_special_tokens`` as the named tokens'
  dict, the list as ``additional_special_tokens``; transformers 5 reads that form to the same ids.
- The text model's RoPE sits in ``text_config.rope_parameters``, where 4.x does not look: Idefics3's Llama runs
  with theta 10,000 for 100,000 (silently), Qwen3-VL does not build without ``rope_scaling.mrope_section`` and
  Qwen2.5-VL fails on its first forward. So ``text_config`` gets the 4.x keys too, M-RoPE's sections in
  ``rope_scaling`` as the released configs have them.
- ``tie_word_embeddings`` is written at the top level only; 4.x's Qwen-VL reads the text config's (False) and
  leaves ``lm_head`` random. It is copied into ``text_config`` where that has none.

With them 4.57's tokenizer, image processor, processor and model make the 5.x inputs and logits of a picture prompt
(< 1e-5), except: 4.57's Qwen-VL and SmolVLM processors want torchvision for their video part (a 4.x user with
torchvision has it; SmolVLM's parts are checked one by one), and 4.55-4.57 compute Idefics3's and SmolVLM's vision
position ids one bucket off in float32 (transformers#41190, fixed in 5.x), so their answers after a picture differ
from 5.x's in any case (relative logit error 0.37 on the tiny Idefics3); their text answers do not.

Not fixable in the files: transformers 4.57 runs Gemma 2 with SDPA unless told otherwise, which drops
its attention soft-capping (relative logit error 2.8e-3 on the tiny gemma2 against 5.x, 0 with
``attn_implementation="eager"``), and it ignores ``attn_implementation`` in ``config.json``.

One function per file; ``make_portable`` applies the three model-folder rules where a model is written
(``base_model``'s conversion, the merge), ``make_adapter_portable`` where the trainer's output is published.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

FIVE_ONLY_TOKENIZER_CLASSES = frozenset({"TokenizersBackend"})  # transformers 5 names, absent from 4.x
PORTABLE_TOKENIZER_CLASS = "PreTrainedTokenizerFast"  # tokenizer.json-backed in 4.x and 5.x alike
SAMPLING_KEYS = ("do_sample", "temperature", "top_p", "top_k", "min_p", "typical_p", "repetition_penalty")
GREEDY = {"do_sample": True, "top_k": 1}  # top-1 sampling: greedy in transformers and vLLM, valid in both on save
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
GEMMA3_LAYER_TYPES = ("full_attention", "sliding_attention")  # rope_theta, rope_local_base_freq in 4.x


def legacy_rope(config: dict) -> dict:
    """The transformers 4.x RoPE keys equal to ``config["rope_parameters"]`` (empty when it has none).

    A flat ``rope_parameters`` gives ``rope_theta`` (+ ``rope_scaling`` without the theta when its type is
    not ``default``); one nested by layer type (Gemma 3) gives the full-attention theta as ``rope_theta``,
    the sliding one as ``rope_local_base_freq`` and the full-attention scaling as ``rope_scaling``.
    """
    rope = config.get("rope_parameters")
    if not isinstance(rope, dict) or not rope:
        return {}
    if all(key in rope for key in GEMMA3_LAYER_TYPES):
        full, sliding = rope["full_attention"], rope["sliding_attention"]
        legacy = {"rope_theta": full["rope_theta"], "rope_local_base_freq": sliding["rope_theta"]}
        return legacy | _scaling(full)
    if "rope_theta" not in rope:
        raise ValueError(
            f"config.json rope_parameters {rope} has no rope_theta and is not nested by {GEMMA3_LAYER_TYPES}: "
            "this layout is not known to ft_assets.portable; add its 4.x form there"
        )
    return {"rope_theta": rope["rope_theta"]} | _scaling(rope)


def _scaling(rope: dict) -> dict:
    if rope.get("rope_type", "default") == "default":
        # Qwen-VL's M-RoPE: 4.x reads its sections from rope_scaling, whatever the type (Qwen3-VL fails to build without)
        mrope = {key: value for key, value in rope.items() if key.startswith("mrope")}
        return {"rope_scaling": {"rope_type": "default"} | mrope} if mrope else {}
    return {"rope_scaling": {key: value for key, value in rope.items() if key != "rope_theta"}}


def legacy_experts(config: dict) -> dict:
    """The 4.x name of the expert count: transformers 5 writes every family's as ``num_local_experts``, where 4.x's
    Qwen2-MoE, Qwen3-MoE and OLMoE configs read ``num_experts`` (and take 60-128 experts by default without it)."""
    experts = config.get("num_local_experts")
    if experts and not config.get("num_experts"):
        return {"num_experts": experts}
    return {}


def portable_config(config: dict) -> dict:
    """``config.json`` with the 4.x RoPE keys beside transformers 5's ``rope_parameters``, and the 4.x expert count; in a
    vision-language model's ``text_config`` too, with the model's ``tie_word_embeddings`` (``portable_text_config``)."""
    config = config | legacy_rope(config) | legacy_experts(config)
    if isinstance(config.get("text_config"), dict):
        config = config | {"text_config": portable_text_config(config["text_config"], config)}
    return config


def portable_text_config(text_config: dict, config: dict) -> dict:
    """A VLM's ``text_config`` as transformers 4.x reads it: its RoPE and expert keys (4.x takes the text model's RoPE
    from here only, else its class default: Idefics3's Llama gets 10,000 for 100,000), and the top level's
    ``tie_word_embeddings`` where it has none (4.x's Qwen-VL reads the text config's, False, and leaves lm_head random)."""
    tied = {"tie_word_embeddings": config["tie_word_embeddings"]} if "tie_word_embeddings" in config else {}
    return tied | text_config | legacy_rope(text_config) | legacy_experts(text_config)


def portable_tokenizer_config(tokenizer_config: dict) -> dict:
    """``tokenizer_config.json`` naming a tokenizer class transformers 4.x and 5.x both have, and its special tokens in
    the form both read (``legacy_special_tokens``)."""
    if tokenizer_config.get("tokenizer_class") in FIVE_ONLY_TOKENIZER_CLASSES:
        tokenizer_config = tokenizer_config | {"tokenizer_class": PORTABLE_TOKENIZER_CLASS}
    return tokenizer_config | legacy_special_tokens(tokenizer_config)


def legacy_special_tokens(tokenizer_config: dict) -> dict:
    """transformers 5 writes ``extra_special_tokens`` as a list and a model's named tokens (a VLM's ``image_token``,
    ``boi_token``) as ``model_specific_special_tokens``; 4.x reads ``extra_special_tokens`` as a dict of named tokens
    (a list stops its tokenizer from loading) and the list as ``additional_special_tokens``. Both read that form."""
    extra = tokenizer_config.get("extra_special_tokens")
    if not isinstance(extra, list):
        return {}
    named = dict(tokenizer_config.get("model_specific_special_tokens") or {})
    legacy = {"extra_special_tokens": named}
    additional = [token for token in extra if token not in named.values()]
    if additional and "additional_special_tokens" not in tokenizer_config:
        legacy["additional_special_tokens"] = additional
    return legacy


def portable_generation_config(generation_config: dict) -> dict:
    """``generation_config.json`` with the base's sampling settings, or greedy when it has none."""
    if any(key in generation_config for key in SAMPLING_KEYS):
        return generation_config
    return generation_config | GREEDY


def make_portable(model_dir: str | Path) -> list[str]:
    """Rewrite a saved model folder's config, tokenizer and generation config in place; the JSON files it changed
    (the tokenizer is saved back as transformers 5 loads it first, which rewrites its files in any case)."""
    model_dir = Path(model_dir)
    if (model_dir / "tokenizer.json").is_file():
        resave_tokenizer(model_dir)
    rules = (
        ("config.json", portable_config),
        ("tokenizer_config.json", portable_tokenizer_config),
        ("generation_config.json", portable_generation_config),
    )
    changed = []
    for name, rule in rules:
        path = model_dir / name
        if name == "generation_config.json" and not path.is_file() and (model_dir / "config.json").is_file():
            path.write_text("{}")  # a model saved without one gets the greedy default too
        if not path.is_file():
            continue
        before = json.loads(path.read_text())
        after = rule(before)
        if after != before:
            path.write_text(json.dumps(after, indent=2, sort_keys=True) + "\n")
            changed.append(name)
    return changed


def resave_tokenizer(model_dir: Path) -> None:
    """Save the tokenizer of ``model_dir`` back as transformers 5 loads it (its class may rebuild parts of tokenizer.json)."""
    from transformers import AutoTokenizer  # the trainer's transformers; imported only where a model folder is written

    AutoTokenizer.from_pretrained(model_dir).save_pretrained(model_dir)


def adapter_base_name(base_ref: dict) -> str:
    """What ``adapter_config.json`` names as the base: the Hub id of a base taken unchanged from the Hub, else its
    key in the store (``models/<slug>/<sha256[:16]>``), from ``base_model``'s reference."""
    stats = base_ref["stats"]
    # base_model.resolve_source's "hub" kind
    if HUB_ID.fullmatch(stats["source"]) and stats["model_id"] == stats["source"]:
        return stats["source"]
    return base_ref["prefix"]


def make_adapter_portable(trained_dir: str | Path, base_ref: dict) -> str:
    """The trainer's output before it is published: ``adapter_config.json`` names the base (``adapter_base_name``) and
    the files of ``make_portable`` follow its rules (a full fine-tune's config, the tokenizer). Returns the base's name."""
    trained_dir = Path(trained_dir)
    path = trained_dir / "adapter_config.json"
    name = adapter_base_name(base_ref)
    if path.is_file():
        config = json.loads(path.read_text())
        path.write_text(json.dumps(config | {"base_model_name_or_path": name}, indent=2, sort_keys=True) + "\n")
    make_portable(trained_dir)
    return name
