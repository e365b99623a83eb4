"""GGUF for every family of the matrix, in llama.cpp itself: one table, one test body.

Each family of ``ft_assets_tests.families`` (Llama 3 untied and tied with llama3 RoPE, Qwen2.5, Qwen3,
Mistral, Gemma 2, Gemma 3, Phi-3, and the mixtures of experts Qwen3-MoE, Mixtral and gpt-oss) is written as F16 and Q8_0 by llama.cpp's converter
(``ft_assets.delivery.converter``; one child process for all of them, ~10 s to import torch there)
and as Q4_K_M by llama.cpp's quantizer on the F16 file, as ``gguf_model`` makes them. Every file is
then loaded in llama.cpp (llama-cpp-python) and must give the HF tokenizer's token ids on the hard
strings (digits, whitespace runs, emoji, code, special tokens, chat-rendered prompts), logits within
``LLAMACPP_TOLERANCES`` of transformers', and (F16) greedy continuations equal token for token except
where transformers' own top two logits were a near-tie (``llamacpp.check_file``; Gemma 2's random tiny model
repeats one token whatever its seed or init, so there the logits over every position are what counts). The tiny models have
hidden 128 and feed-forward 256: only ``ffn_down`` (rows of 256) can hold K blocks, so Q4_K_M holds real
Q4_K/Q6_K blocks there and llama.cpp's fallbacks (Q5_0, Q8_0) elsewhere; the test asserts the K blocks.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ft_assets.delivery import converter, llamacpp
from ft_assets.delivery.converter import convert_many
from ft_assets.delivery.gguf_export import file_entry, tensor_types
from ft_assets_tests.families import FAMILIES, MOE, build_family

CONVERTED = ("f16", "q8_0")
K_QUANT = "q4_k_m"
QTYPES = (*CONVERTED, K_QUANT)
# Bound on llama.cpp's relative logit error against transformers, per type, on these tiny models (random weights of
# std 0.2: sharp logits that magnify rounding). Measured maxima over the 8 families (python -m benchmarks.gguf_families):
# F16 2.8e-3 (it also carries llama.cpp's F16 KV cache), Q8_0 5.5e-2, Q4_K_M 0.36 (mostly Q5_0 fallbacks, rows of 128).
# F16 and Q8_0 are held to what gguf_model holds them to (gguf_export.TOLERANCES); a mis-laid tensor lands near 1.
LLAMACPP_TOLERANCES = {"f16": 5e-3, "q8_0": 8e-2, "q4_k_m": 0.5}
# A mixture of experts routes each token to its top 2 of 4 experts: quantization error that flips a near-tied router
# choice sends the token through another expert, so the quantized files part more (measured: Q8_0 0.10-0.12, Q4_K_M
# 0.32-0.53), and gpt-oss's F16 carries llama.cpp's YaRN, which rounds the correction range that gpt-oss's
# "truncate": false keeps fractional (7.4e-3 to 7.8e-3; 3.5e-3 with plain RoPE). Even F16 can flip a router choice that
# is tied to within rounding: the same wheel, model and seed gave gpt-oss 1.97e-2 (max |diff| 2.37 at one position,
# tokens and greedy replies still equal) on another x86-64 host, 7.4e-3 on this one. A mis-laid expert tensor still
# lands near 1.
MOE_TOLERANCES = {"f16": 3e-2, "q8_0": 0.2, "q4_k_m": 0.8}
NAME = "tiny"
# A name llama.cpp gives Phi-3's SentencePiece token attributes for (converter.general_name), on Phi-3 with a byte-level BPE.
PHI3_NAME = "phi3-toolcalls-v1"


pytestmark = pytest.mark.integration  # llama.cpp's converter and llama.cpp on every family


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, dict]:
    """family -> {"dir": model dir, "files": qtype -> file_entry}, every family converted in one child process."""
    root = tmp_path_factory.mktemp("gguf-families")
    dirs = {family.name: build_family(family.name, root / family.name) for family in FAMILIES}
    jobs = [(dirs[f], NAME, qtype, root / f"{f}-{qtype}.gguf") for f in dirs for qtype in CONVERTED]
    convert_many([*jobs, (dirs["phi3"], PHI3_NAME, "f16", root / "phi3-named-f16.gguf")])
    result = {}
    for name, model_dir in dirs.items():
        files = {
            qtype: file_entry(root / f"{name}-{qtype}.gguf", qtype, tensor_types(root / f"{name}-{qtype}.gguf"))
            for qtype in CONVERTED
        }
        files[K_QUANT] = llamacpp.quantize(files["f16"]["path"], root / f"{name}-{K_QUANT}.gguf", K_QUANT)
        result[name] = {"dir": model_dir, "files": files}
    result["phi3"]["named"] = root / "phi3-named-f16.gguf"
    return result


@pytest.mark.parametrize("family", [f.name for f in FAMILIES])
def test_family_gguf_loads_in_llamacpp_and_answers_like_transformers(exported, family):
    ref = llamacpp.reference(exported[family]["dir"])
    files = exported[family]["files"]
    checks = {qtype: llamacpp.check_file(files[qtype]["path"], ref) for qtype in QTYPES}
    tolerances = MOE_TOLERANCES if family in MOE else LLAMACPP_TOLERANCES
    for qtype, check in checks.items():
        assert check["tokens_match"], (qtype, check["token_mismatches"])
        assert check["rel_error"] <= tolerances[qtype], (qtype, check)
    assert [checks[q]["rel_error"] for q in QTYPES] == sorted(
        checks[q]["rel_error"] for q in QTYPES
    )  # fewer bits, more error
    f16 = checks["f16"]
    assert f16["top1_agreement"] >= 0.95, f16
    assert f16["greedy_match"] + f16["greedy_near_ties"] == f16["greedy_prompts"], f16  # any parting is at a near-tie
    assert f16["greedy_match"] >= f16["greedy_prompts"] - (2 if family in MOE else 1), f16  # gpt-oss: YaRN, above
    k_types = files[K_QUANT]["tensor_types"]
    assert k_types.get("Q4_K", 0) + k_types.get("Q6_K", 0) == 2, k_types  # ffn_down of both layers
    assert files[K_QUANT]["bytes"] < files["q8_0"]["bytes"] < files["f16"]["bytes"]


def test_gemma3_is_wrong_in_llamacpp_without_its_layer_pattern(exported, tmp_path):
    """Fix 3 of converter.py, shown: without ``attention.sliding_window_pattern`` llama.cpp assumes Gemma 3's 1 global
    layer in 6, so the tiny model's second (global) layer attends through the 16-token window and the logits part."""
    where = converter.location()
    source = exported["gemma3"]["files"]["f16"]["path"]
    stripped = tmp_path / "gemma3-no-pattern.gguf"
    subprocess.run(
        [sys.executable, str(where / "gguf-py" / "gguf" / "scripts" / "gguf_new_metadata.py"), "--force",
         "--remove-metadata", "gemma3.attention.sliding_window_pattern", source, str(stripped)],
        env={**os.environ, "PYTHONPATH": str(where / "gguf-py")}, check=True, capture_output=True,
    )  # fmt: skip
    ref = llamacpp.reference(exported["gemma3"]["dir"])
    assert llamacpp.check_file(source, ref)["rel_error"] <= LLAMACPP_TOLERANCES["f16"]
    assert llamacpp.check_file(stripped, ref)["rel_error"] > 20 * LLAMACPP_TOLERANCES["f16"]


def test_phi3_with_a_byte_level_bpe_named_after_phi3_loads_in_llamacpp(exported, tmp_path):
    """Phi-4-mini's combination (Phi-3's architecture, a GPT-2-style BPE) in a run named after Phi-3: llama.cpp gives a
    file whose general.name holds "phi3" Phi-3's token attributes and looks up </s>, which this vocabulary lacks
    ("unordered_map::at"). The converter writes the name as "phi 3", and the file loads and tokenizes like HF."""
    from gguf import GGUFReader

    named = exported["phi3"]["named"]
    assert GGUFReader(named).fields["general.name"].contents() == "phi 3-toolcalls-v1"
    check = llamacpp.check_file(named, llamacpp.reference(exported["phi3"]["dir"]))  # llama_cpp.Llama loads it
    assert check["tokens_match"] and check["rel_error"] <= LLAMACPP_TOLERANCES["f16"], check
    as_named = tmp_path / "phi3-as-named.gguf"  # the same file with the name as the run gave it: llama.cpp refuses it
    where = converter.location()
    subprocess.run(
        [sys.executable, str(where / "gguf-py" / "gguf" / "scripts" / "gguf_new_metadata.py"), "--force",
         "--general-name", PHI3_NAME, str(named), str(as_named)],
        env={**os.environ, "PYTHONPATH": str(where / "gguf-py")}, check=True, capture_output=True,
    )  # fmt: skip
    with pytest.raises(llamacpp.LlamaCppError, match="error loading model vocabulary: unordered_map::at"):
        llamacpp.load(as_named, vocab_only=True)
