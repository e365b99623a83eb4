"""GGUF export through llama.cpp's converter: round trip through transformers' GGUF loader, metadata, Modelfile, refusals."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from ft_assets.delivery import gguf_export
from ft_assets.delivery.converter import (
    LLAMA3_REGEX,
    QWEN2_REGEX,
    GgufUnsupported,
    general_name,
    has_phi3_attributes,
    pre_tokenizer_name,
)
from ft_assets.delivery.gguf_export import (
    SUPPORTED_QTYPES,
    GgufExportError,
    export_gguf,
    export_ggufs,
    verify_gguf,
    write_modelfile,
)
from ft_assets_tests.tiny import CHATML_TEMPLATE, build_tiny_model

# qtype -> tensor types the converter writes for the tiny model (2 layers: 14 matrices + token_embd, 5 norms).
ROUND_TRIP_CASES = [
    ("f32", {"F32": 20}),
    ("f16", {"F16": 15, "F32": 5}),
    ("q8_0", {"Q8_0": 15, "F32": 5}),
]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """tiny.py's Llama at hidden 32 with Llama's own init (std 0.02): the tolerances were set on it."""
    return build_tiny_model(tmp_path_factory.mktemp("gguf-tiny"), hidden=32, init_std=0.02)


@pytest.fixture(scope="module")
def written(tiny_model_dir, tmp_path_factory) -> dict[str, dict]:
    """Every type the converter writes, in one converter process (it takes ~10 s to start)."""
    out = tmp_path_factory.mktemp("gguf-written")
    return export_ggufs(
        tiny_model_dir, {qtype: out / f"tiny-{qtype}.gguf" for qtype in SUPPORTED_QTYPES}, name="tiny-chat"
    )


def _fields(path) -> dict:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    return {name: field.contents() for name, field in reader.fields.items()} | {
        "_tensors": {t.name: t.tensor_type.name for t in reader.tensors}
    }


@pytest.mark.integration  # llama.cpp's converter process
@pytest.mark.parametrize("qtype, tensor_types", ROUND_TRIP_CASES)
def test_round_trip_within_tolerance(tiny_model_dir, written, qtype, tensor_types):
    entry = written[qtype]
    path = entry["path"]
    assert entry["tensor_types"] == tensor_types
    assert entry["tensor_count"] == sum(tensor_types.values())
    assert entry["bytes"] == Path(path).stat().st_size
    assert entry["sha256"] == hashlib.sha256(Path(path).read_bytes()).hexdigest()
    assert not list(Path(path).parent.glob("*.tmp"))
    report = verify_gguf(tiny_model_dir, path, qtype)
    assert report["tokens_match"], report["token_mismatches"]
    assert report["chat_template_match"]
    assert report["rel_error"] <= report["tolerance"], report
    assert report["ok"]


@pytest.mark.integration  # llama.cpp's converter process
def test_verification_catches_mislaid_weights(tiny_model_dir, written, tmp_path):
    """A file that loads but holds two same-shape matrices swapped gives a wrong model: f32 must notice."""
    from gguf import GGUFReader

    path = tmp_path / "swapped.gguf"
    shutil.copy(written["f32"]["path"], path)
    tensors = {t.name: t for t in GGUFReader(path, "r+").tensors}
    q, out = tensors["blk.0.attn_q.weight"].data, tensors["blk.0.attn_output.weight"].data
    q_copy = np.array(q)
    q[...] = out
    out[...] = q_copy
    report = verify_gguf(tiny_model_dir, path, "f32")
    assert report["tokens_match"] and not report["logits_ok"] and not report["ok"]


@pytest.mark.integration  # llama.cpp's converter process
def test_metadata_architecture_tokenizer_and_chat_template(tiny_model_dir, written):
    fields = _fields(written["q8_0"]["path"])
    config = json.loads((tiny_model_dir / "config.json").read_text())
    vocab = json.loads((tiny_model_dir / "tokenizer.json").read_text())["model"]["vocab"]

    expected = {
        "general.architecture": "llama",
        "general.name": "tiny-chat",
        "general.file_type": 7,  # MOSTLY_Q8_0
        "llama.context_length": 512,
        "llama.embedding_length": 32,
        "llama.block_count": 2,
        "llama.feed_forward_length": 64,
        "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2,
        "llama.rope.dimension_count": 8,
        "llama.rope.freq_base": pytest.approx(10000.0),
        "llama.attention.layer_norm_rms_epsilon": pytest.approx(1e-6),
        "llama.vocab_size": config["vocab_size"],
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",  # not in the converter's hash list: named from the tokenizer's shape (converter.py)
        "tokenizer.ggml.bos_token_id": 1,  # <|im_start|>
        "tokenizer.ggml.eos_token_id": 2,  # <|im_end|>
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.chat_template": CHATML_TEMPLATE,
    }
    assert {key: fields.get(key) for key in expected} == expected
    tokens, types = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == config["vocab_size"]
    assert tokens[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] and types[:3] == [3, 3, 3]  # CONTROL
    assert all(tokens[index] == token for token, index in vocab.items())
    assert len(fields["tokenizer.ggml.merges"]) > 0
    assert "output.weight" not in fields["_tensors"]  # tied: llama.cpp reuses token_embd
    assert fields["_tensors"]["blk.0.attn_norm.weight"] == "F32"


@pytest.mark.parametrize("system", [None, "You answer with one JSON tool call."])
def test_modelfile(tmp_path, system):
    write_modelfile("tiny-q8_0.gguf", tmp_path / "Modelfile", CHATML_TEMPLATE, system=system)
    text = (tmp_path / "Modelfile").read_text()

    assert text.startswith("FROM ./tiny-q8_0.gguf\n")
    assert 'TEMPLATE """' in text
    assert "<|im_start|>user\n{{ .Content }}<|im_end|>\n<|im_start|>assistant\n" in text
    assert "<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}" in text  # no system prompt of its own
    assert 'PARAMETER stop "<|im_end|>"' in text
    assert ('SYSTEM """You answer with one JSON tool call."""' in text) == (system is not None)


# SmolLM2-135M-Instruct's chat template: ChatML that adds its own system prompt when there is none.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + "
    "message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3_TEMPLATE = (
    "{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] "
    "+ '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


def test_ollama_template_keeps_the_default_system_prompt_of_the_chat_template():
    template = gguf_export.ollama_template(SMOLLM2_TEMPLATE)
    assert (
        "{{ if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ else }}<|im_start|>system\n"
        "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n{{ end }}"
    ) in template
    assert "{{ else }}" not in gguf_export.ollama_template(CHATML_TEMPLATE).split("{{ range")[0]


@pytest.mark.parametrize("template", [LLAMA3_TEMPLATE, None], ids=["llama3", "none"])
def test_ollama_template_refuses_what_it_cannot_translate(template):
    with pytest.raises(GgufExportError, match="chat template"):
        gguf_export.ollama_template(template)


def test_modelfile_of_a_template_that_is_not_chatml_leaves_the_template_to_ollama(tmp_path):
    """Llama 3, Gemma, Mistral, Phi: no TEMPLATE (Ollama reads the file's tokenizer.chat_template), never a wrong one."""
    write_modelfile("m-f16.gguf", tmp_path / "Modelfile", LLAMA3_TEMPLATE)
    lines = (tmp_path / "Modelfile").read_text().splitlines()
    assert lines[0] == "FROM ./m-f16.gguf"
    assert lines[1].startswith("# no TEMPLATE: Ollama takes it from the file's tokenizer.chat_template (")
    assert not any(line.startswith(("TEMPLATE", "PARAMETER")) for line in lines)


def _with_config(tiny_model_dir, tmp_path, **changes):
    model_dir = tmp_path / "changed"
    shutil.copytree(tiny_model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text()) | changes
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


def _whitespace_pre_tokenizer(model_dir):
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    tokenizer["pre_tokenizer"] = {"type": "Whitespace"}
    (model_dir / "tokenizer.json").write_text(json.dumps(tokenizer))


# What the converter cannot take, in one line: GgufUnsupported (the model ships without a GGUF); the rest GgufExportError.
REFUSAL_CASES = [
    ("architecture", {"architectures": ["FooForCausalLM"]}, None, GgufUnsupported,
     "llama.cpp 0.3.36's converter has no GGUF layout for architecture FooForCausalLM"),
    ("unknown tokenizer", {}, _whitespace_pre_tokenizer, GgufUnsupported,
     'pre-tokenizer {"type": "Whitespace"} is none of gpt-2, smollm, llama-bpe, qwen2'),
]  # fmt: skip


@pytest.mark.integration  # llama.cpp's converter process
@pytest.mark.parametrize("case, changes, change, error, message", REFUSAL_CASES, ids=[c[0] for c in REFUSAL_CASES])
def test_refusals_are_one_line(tiny_model_dir, tmp_path, case, changes, change, error, message):
    model_dir = _with_config(tiny_model_dir, tmp_path, **changes)
    if change:
        change(model_dir)
    with pytest.raises(error, match=re.escape(message)) as refused:
        export_gguf(model_dir, tmp_path / "out.gguf", "f16")
    assert "\n" not in str(refused.value)
    assert not list(tmp_path.glob("out.gguf*"))


def test_types_the_converter_does_not_write_are_refused_before_it_runs(tiny_model_dir, tmp_path):
    with pytest.raises(GgufExportError, match="q4_k_m is not written by the converter; choose one of f32, f16, q8_0"):
        export_gguf(tiny_model_dir, tmp_path / "out.gguf", "q4_k_m")
    with pytest.raises(GgufExportError, match="config.json not found"):
        export_gguf(tmp_path, tmp_path / "out.gguf", "f16")


GPT2 = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
BYTES_ONLY = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}


def _split(regex: str) -> dict:
    return {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}, BYTES_ONLY]}  # fmt: skip


def _tokenizer(pre=GPT2, **changes) -> dict:
    """A serialized HF tokenizer pipeline (as backend_tokenizer.to_str() gives it) with ``changes`` over a plain GPT-2 BPE."""
    base = {"normalizer": None, "pre_tokenizer": pre, "decoder": {"type": "ByteLevel"}, "added_tokens": [],
            "model": {"type": "BPE", "byte_fallback": False, "ignore_merges": False}}  # fmt: skip
    for path, value in changes.items():
        *parents, key = path.split("__")
        node = base
        for parent in parents:
            node = node[parent]
        node[key] = value
    return base


# tokenizer pipeline -> llama.cpp's pre-tokenizer name, or the refusal (checked against src/llama-vocab.cpp; converter.py).
PRE_TOKENIZER_CASES = [
    ("gpt-2", _tokenizer(), "gpt-2"),
    (
        "smollm",
        _tokenizer({"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, GPT2]}),
        "smollm",
    ),
    ("llama-bpe", _tokenizer(_split(LLAMA3_REGEX), model__ignore_merges=True), "llama-bpe"),
    ("qwen2, NFC", _tokenizer(_split(QWEN2_REGEX), normalizer={"type": "NFC"}), "qwen2"),
    ("llama-bpe without ignore_merges", _tokenizer(_split(LLAMA3_REGEX)), "differs from llama.cpp's 'llama-bpe'"),
    ("gpt-2 with ignore_merges", _tokenizer(model__ignore_merges=True), "model.ignore_merges = True differs"),
    ("prefix space", _tokenizer(dict(GPT2, add_prefix_space=True)), "is none of gpt-2, smollm, llama-bpe, qwen2"),
    ("metaspace", _tokenizer({"type": "Metaspace", "replacement": "▁"}), "is none of gpt-2"),
    ("none", _tokenizer(None), "pre-tokenizer null is none of"),
    ("normalizer", _tokenizer(normalizer={"type": "Lowercase"}), "a normalizer (Lowercase)"),
    ("byte fallback", _tokenizer(model__byte_fallback=True), "is not a byte-level BPE"),
    ("subword prefix", _tokenizer(model__continuing_subword_prefix="##"), "model.continuing_subword_prefix = '##'"),
    ("decoder", _tokenizer(decoder={"type": "Metaspace"}), "decoder Metaspace is not ByteLevel"),
    (
        "lstrip",
        _tokenizer(added_tokens=[{"id": 1, "content": "<|im_start|>", "lstrip": True}]),
        "'<|im_start|>' strips spaces (lstrip)",
    ),
]


@pytest.mark.parametrize("case, tokenizer, expected", PRE_TOKENIZER_CASES, ids=[c[0] for c in PRE_TOKENIZER_CASES])
def test_pre_tokenizer_name_of_an_unlisted_tokenizer(case, tokenizer, expected):
    if expected in ("gpt-2", "smollm", "llama-bpe", "qwen2"):
        assert pre_tokenizer_name(tokenizer) == expected
    else:
        with pytest.raises(GgufUnsupported, match=re.escape(expected)) as refused:
            pre_tokenizer_name(tokenizer)
        assert "Keep the base model's tokenizer" in str(refused.value)


def test_supported_qtypes_have_tolerances():
    assert set(SUPPORTED_QTYPES) == set(gguf_export.TOLERANCES)


def _tokens(*added: tuple[str, bool], vocab=("a", "b")) -> dict:
    return {"model": {"type": "BPE", "vocab": {piece: i for i, piece in enumerate(vocab)}},
            "added_tokens": [{"content": content, "rstrip": rstrip, "special": True} for content, rstrip in added]}  # fmt: skip


PHI3_SPM = _tokens(
    ("<unk>", False), ("<s>", False), ("</s>", True), ("<|endoftext|>", False), ("<|end|>", True), ("<|user|>", True)
)
PHI4_BPE = _tokens(
    ("<|endoftext|>", False), ("<|end|>", False), ("<|user|>", False)
)  # GPT-2-style: no </s>, nothing strips
# name, tokenizer.json -> general.name written (llama.cpp gives a name holding "phi3"/"phi-3" Phi-3's token attributes)
GENERAL_NAME_CASES = [
    ("phi3-toolcalls-v1", PHI4_BPE, "phi 3-toolcalls-v1"),
    ("My-Phi-3-Run", PHI4_BPE, "My-Phi 3-Run"),
    ("PHI3 and phi-3", PHI4_BPE, "PHI 3 and phi 3"),
    ("phi3-toolcalls-v1", PHI3_SPM, "phi3-toolcalls-v1"),  # Phi-3-mini's own attributes: llama.cpp's rule is right
    ("phi3-v1", _tokens(("<unk>", False), ("<s>", False), ("</s>", True), ("<|endoftext|>", False), ("<|end|>", False)),
     "phi 3-v1"),  # all four tokens, but <|end|> does not strip: the rule would tokenize differently
    ("phi-4-mini-v1", PHI4_BPE, "phi-4-mini-v1"),  # not a name llama.cpp matches
    ("toolcalls-v1", PHI4_BPE, "toolcalls-v1"),
    ("phi3-v1", None, "phi3-v1"),  # no tokenizer.json (a SentencePiece model alone): left to llama.cpp
]  # fmt: skip


@pytest.mark.parametrize("name, tokenizer, written", GENERAL_NAME_CASES)
def test_general_name_keeps_phi3_token_attributes_to_tokenizers_they_describe(tmp_path, name, tokenizer, written):
    if tokenizer is not None:
        (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer))
    assert general_name(name, tmp_path) == written
    assert has_phi3_attributes(PHI3_SPM) and not has_phi3_attributes(PHI4_BPE)
