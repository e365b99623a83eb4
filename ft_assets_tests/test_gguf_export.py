"""GGUF export: round trip through transformers' GGUF loader, metadata, fallbacks, Modelfile, errors."""

from __future__ import annotations

import hashlib
import json
import re
import shutil

import pytest

from ft_assets.delivery import gguf_export
from ft_assets.delivery.gguf_export import (
    SUPPORTED_QTYPES,
    GgufExportError,
    export_gguf,
    pre_tokenizer_name,
    verify_gguf,
    write_modelfile,
)
from ft_assets_tests.tiny import CHATML_TEMPLATE, build_tiny_model

# qtype -> tensor types written for the tiny model (2 layers: 14 matrices + token_embd, 5 norms).
ROUND_TRIP_CASES = [
    ("f32", {"F32": 20}),
    ("f16", {"F16": 15, "F32": 5}),
    ("q8_0", {"Q8_0": 15, "F32": 5}),
    ("q4_0", {"Q4_0": 14, "Q8_0": 1, "F32": 5}),  # token_embd (the tied output head) stays Q8_0
]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """tiny.py's Llama at hidden 32 with Llama's own init (std 0.02): the tolerances were set on it."""
    return build_tiny_model(tmp_path_factory.mktemp("gguf-tiny"), hidden=32, init_std=0.02)


def _fields(path) -> dict:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    return {name: field.contents() for name, field in reader.fields.items()} | {
        "_tensors": {t.name: t.tensor_type.name for t in reader.tensors}
    }


@pytest.mark.parametrize("qtype, tensor_types", ROUND_TRIP_CASES)
def test_round_trip_within_tolerance(tiny_model_dir, tmp_path, qtype, tensor_types):
    written = export_gguf(tiny_model_dir, tmp_path / f"tiny-{qtype}.gguf", qtype)

    assert written["tensor_types"] == tensor_types
    assert written["tensor_count"] == sum(tensor_types.values())
    assert written["bytes"] == (tmp_path / f"tiny-{qtype}.gguf").stat().st_size
    assert written["sha256"] == hashlib.sha256((tmp_path / f"tiny-{qtype}.gguf").read_bytes()).hexdigest()
    assert not list(tmp_path.glob("*.tmp"))
    report = verify_gguf(tiny_model_dir, written["path"], qtype)
    assert report["tokens_match"], report["token_mismatches"]
    assert report["chat_template_match"]
    assert report["rel_error"] <= report["tolerance"], report
    assert report["ok"]


def test_verification_catches_unpermuted_qk(tiny_model_dir, tmp_path, monkeypatch):
    """Without llama.cpp's Q/K permutation the file loads fine but the model is wrong: f32 must notice."""
    monkeypatch.setattr(gguf_export, "_permute", lambda weights, n_head: weights)
    written = export_gguf(tiny_model_dir, tmp_path / "unpermuted.gguf", "f32")

    report = verify_gguf(tiny_model_dir, written["path"], "f32")
    assert report["tokens_match"] and not report["logits_ok"] and not report["ok"]


def test_metadata_architecture_tokenizer_and_chat_template(tiny_model_dir, tmp_path):
    export_gguf(tiny_model_dir, tmp_path / "tiny.gguf", "q8_0", name="tiny-chat")
    fields = _fields(tmp_path / "tiny.gguf")
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
        "llama.attention.key_length": 8,  # config.json has head_dim: written, as llama.cpp's converter does
        "llama.attention.value_length": 8,
        "llama.rope.freq_base": pytest.approx(10000.0),
        "llama.attention.layer_norm_rms_epsilon": pytest.approx(1e-6),
        "llama.vocab_size": config["vocab_size"],
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",  # llama.cpp's name (src/llama-vocab.cpp); it refuses "gpt2"
        "tokenizer.ggml.bos_token_id": 1,  # <|im_start|>
        "tokenizer.ggml.eos_token_id": 2,  # <|im_end|>
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_bos_token": False,
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


def test_rows_off_the_block_size_fall_back_to_f16(tmp_path):
    """Hidden 48 is no multiple of the 32-wide Q8_0 block: those matrices are written F16 and still load."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from ft_assets_tests.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model_dir = tmp_path / "odd"
    LlamaForCausalLM(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)

    written = export_gguf(model_dir, tmp_path / "odd.gguf", "q8_0")
    tensors = _fields(tmp_path / "odd.gguf")["_tensors"]

    assert tensors["blk.0.ffn_down.weight"] == "Q8_0"  # rows of intermediate_size 64
    assert tensors["blk.0.attn_q.weight"] == tensors["token_embd.weight"] == "F16"  # rows of 48
    assert written["tensor_types"] == {"F16": 7, "Q8_0": 1, "F32": 3}
    assert verify_gguf(model_dir, written["path"], "q8_0")["ok"]


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


def _with_config(tiny_model_dir, tmp_path, **changes):
    model_dir = tmp_path / "changed"
    shutil.copytree(tiny_model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text()) | changes
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


ERROR_CASES = [
    ("qtype", {}, "q4_k_m", "not supported; choose one of f32, f16, q8_0, q4_0"),
    ("architecture", {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}, "f16", "'qwen2'"),
    ("scaled rope", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}, "f16", "rope_type 'llama3'"),
    ("vocab too small", {"vocab_size": 100}, "f16", "beyond config.json vocab_size 100"),
]


@pytest.mark.parametrize("case, changes, qtype, message", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_clear_errors(tiny_model_dir, tmp_path, case, changes, qtype, message):
    model_dir = _with_config(tiny_model_dir, tmp_path, **changes)
    with pytest.raises(GgufExportError, match=re.escape(message)):
        export_gguf(model_dir, tmp_path / "out.gguf", qtype)
    assert not (tmp_path / "out.gguf").exists()


def _added_token_strips(tokenizer: dict) -> None:
    tokenizer["added_tokens"][1]["lstrip"] = True


def _set(path: str, value):
    def change(tokenizer: dict) -> None:
        *parents, key = path.split(".")
        node = tokenizer
        for parent in parents:
            node = node[parent]
        node[key] = value

    return change


# tokenizer.json changes llama.cpp cannot reproduce -> the refusal names what and where.
TOKENIZER_ERROR_CASES = [
    ("normalizer", _set("normalizer", {"type": "NFC"}), "a normalizer is set"),
    ("byte fallback", _set("model.byte_fallback", True), "is not a byte-level BPE"),
    ("ignore_merges", _set("model.ignore_merges", True), "model.ignore_merges = True"),
    ("subword prefix", _set("model.continuing_subword_prefix", "##"), "model.continuing_subword_prefix = '##'"),
    ("decoder", _set("decoder", {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True}), "is not ByteLevel"),
    ("lstrip", _added_token_strips, "added token '<|im_start|>' (id 1) sets lstrip"),
    ("pre-tokenizer", _set("pre_tokenizer", {"type": "Whitespace"}), "find its name in llama.cpp's src/llama-vocab.cpp"),
]


@pytest.mark.parametrize("case, change, message", TOKENIZER_ERROR_CASES, ids=[c[0] for c in TOKENIZER_ERROR_CASES])
def test_tokenizers_llamacpp_cannot_represent_are_refused(tiny_model_dir, tmp_path, case, change, message):
    model_dir = tmp_path / "changed"
    shutil.copytree(tiny_model_dir, model_dir)
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    change(tokenizer)
    (model_dir / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(GgufExportError, match=re.escape(message)) as refused:
        export_gguf(model_dir, tmp_path / "out.gguf", "f16")
    assert str(model_dir / "tokenizer.json") in str(refused.value) or case == "pre-tokenizer"
    assert not (tmp_path / "out.gguf").exists()


def test_added_tokens_that_look_special_are_control_tokens(tiny_model_dir, tmp_path):
    """As llama.cpp's converter: <|...|> tokens are CONTROL even when not marked special, others USER_DEFINED."""
    model_dir = tmp_path / "added"
    shutil.copytree(tiny_model_dir, model_dir)
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    tokenizer["added_tokens"][1]["special"] = False  # <|im_start|>
    tokenizer["added_tokens"].append(dict(tokenizer["added_tokens"][0], id=300, content="<tool>", special=False))
    (model_dir / "tokenizer.json").write_text(json.dumps(tokenizer))
    export_gguf(model_dir, tmp_path / "out.gguf", "f16")
    types = _fields(tmp_path / "out.gguf")["tokenizer.ggml.token_type"]
    assert types[1] == 3 and types[300] == 4  # CONTROL, USER_DEFINED


PRE_TOKENIZER_CASES = [
    ({"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}, "gpt-2"),
    ({"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}, None),
    (
        {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Digits", "individual_digits": True},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
            ],
        },
        "smollm",
    ),
    ({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first"}, None),
    (None, None),
]


@pytest.mark.parametrize("pre_tokenizer, name", PRE_TOKENIZER_CASES)
def test_pre_tokenizer_name(pre_tokenizer, name):
    if name is None:
        with pytest.raises(GgufExportError, match="pre_tokenizer"):
            pre_tokenizer_name(pre_tokenizer)
    else:
        assert pre_tokenizer_name(pre_tokenizer) == name


def test_supported_qtypes_have_tolerances():
    assert set(SUPPORTED_QTYPES) == set(gguf_export.TOLERANCES)
