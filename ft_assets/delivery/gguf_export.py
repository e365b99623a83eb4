"""Export a merged model to GGUF for llama.cpp / Ollama with llama.cpp's own converter, and prove it still works.

``export_ggufs`` writes F32, F16 and Q8_0 files of a Hugging Face directory (safetensors + config.json +
tokenizer + chat template) with ``convert_hf_to_gguf.py`` of the llama.cpp that the installed
llama-cpp-python vendors (``ft_assets.delivery.converter``: what it is, how ``make install`` installs
it, what it adds for an unknown tokenizer, a SentencePiece-less Gemma 2 / Phi-3, the Gemma layer
pattern). Q4_0 and the K-quants are made from the F16 file by llama.cpp's quantizer
(``ft_assets.delivery.llamacpp.quantize``). One converter for every family llama.cpp runs, rather
than a writer of our own per family: ours wrote Llama only, and each family has its own tensor
layout (Q/K permutation for Llama, fused QKV for Phi-3, norm offsets and embedding scale for Gemma)
that llama.cpp's converter already gets right for the runtime of the same release. A model it cannot
take raises ``GgufUnsupported`` with one line, so the delivery plane publishes it without a GGUF.

``verify_gguf`` loads a file back with transformers (model and tokenizer from the GGUF alone, in a
directory holding nothing else) and compares it with the source: token ids of raw and chat-rendered
prompts, the chat template and its rendering, and the next-token logits on the chat-rendered prompts.
The logit error is ``rel_error = ||gguf - source|| / ||source||`` over every position and vocabulary
entry; ``TOLERANCES`` bounds it per type. It is a second reader; llama.cpp itself
(``llamacpp.check_file``) is the one that counts. ``write_modelfile`` writes the Ollama Modelfile.

``python -m ft_assets.delivery.gguf_export MODEL_DIR OUT_DIR`` exports and verifies every type (transformers'
reader); ``test_gguf_export.py`` holds the tiny Llama of ``ft_assets_tests.tiny`` to ``TOLERANCES`` that way.
transformers' reader does not read every family as llama.cpp does (Llama 3's RoPE scaling, Gemma 2/3, Qwen3:
"GGUF by family" in docs/guides/exports.md, ``python -m benchmarks.gguf_families``), so llama.cpp's check is the gate.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np

from ft_assets.delivery import converter
from ft_assets.delivery.converter import MMPROJ_OUTTYPE, GgufExportError
from ft_assets.storage import sha256_file

SUPPORTED_QTYPES = ("f32", "f16", "q8_0")  # what llama.cpp's converter writes here; Q4_0 and K-quants: its quantizer

# Bound on rel_error = ||logits_gguf - logits_source|| / ||logits_source|| that verify_gguf accepts (transformers
# reading the file back): f32 is lossless up to summation order; f16 rounds each weight to 11 significant bits
# (measured 7e-4 on SmolLM2-135M); q8_0 keeps 8 bits plus an f16 scale per 32 weights (2.9e-2 on SmolLM2). A
# wrong tensor layout lands near 1.
TOLERANCES = {"f32": 1e-5, "f16": 5e-3, "q8_0": 8e-2}

# A few prompts that touch digits, JSON, punctuation and non-ASCII bytes, as the fine-tuned tool-call
# model will see them.
VERIFY_PROMPTS = (
    "What is the weather in Paris in celsius?",
    'Set a timer for 12 minutes. {"name": "set_timer", "arguments": {"minutes": 12}}',
    "Convert 19 km to m, then say café twice!",
)


def export_ggufs(model_dir: str | Path, outputs: dict[str, str | Path], name: str | None = None) -> dict[str, dict]:
    """Write ``model_dir`` (a HF directory) as one GGUF file per ``outputs`` entry (qtype -> path); what was written.

    A vision-language model's projector is the entry ``MMPROJ_OUTTYPE`` ("mmproj-f16"), written first.

    One converter process writes them all (it costs ~10 s to start). Each file appears atomically
    (written under a temporary name, then renamed). ``name`` becomes ``general.name`` (default: the
    directory's name). Returns, per qtype, ``file_entry``: ``path``, ``qtype``, ``bytes``,
    ``tensor_count``, ``tensor_types`` (count per GGML type) and ``sha256``.
    """
    model_dir = Path(model_dir)
    unknown = sorted(set(outputs) - {*SUPPORTED_QTYPES, MMPROJ_OUTTYPE})
    if unknown:
        raise GgufExportError(
            f"qtype {', '.join(unknown)} is not written by the converter; choose one of {', '.join(SUPPORTED_QTYPES)} "
            "(Q4_0 and K-quants are made from the f16 file by llama.cpp's quantizer: ft_assets.delivery.llamacpp.quantize)"
        )
    if not (model_dir / "config.json").is_file():
        raise GgufExportError(
            f"{model_dir / 'config.json'} not found; export_gguf needs a Hugging Face model directory"
        )
    # the projector first: a vision tower the converter refuses stops the run before the language model is written
    finals = {qtype: Path(outputs[qtype]) for qtype in sorted(outputs, key=lambda qtype: qtype != MMPROJ_OUTTYPE)}
    temps = {qtype: path.with_name(path.name + ".tmp") for qtype, path in finals.items()}
    for path in finals.values():
        path.parent.mkdir(parents=True, exist_ok=True)
    try:
        converter.convert(model_dir, temps, name or model_dir.name)
        for qtype, tmp in temps.items():
            os.replace(tmp, finals[qtype])
    finally:
        for tmp in temps.values():
            tmp.unlink(missing_ok=True)
    return {qtype: file_entry(path, qtype, tensor_types(path)) for qtype, path in finals.items()}


def export_gguf(model_dir: str | Path, out_path: str | Path, qtype: str = "f16", name: str | None = None) -> dict:
    """One file of ``export_ggufs``."""
    return export_ggufs(model_dir, {qtype: out_path}, name)[qtype]


def tensor_types(path: str | Path) -> Counter[str]:
    """How many tensors of each GGML type a GGUF file holds."""
    from gguf import GGUFReader

    return Counter(tensor.tensor_type.name for tensor in GGUFReader(path).tensors)


def file_entry(path: Path, qtype: str, types: Counter[str]) -> dict:
    """What ``gguf_model`` records of one written GGUF file (whoever wrote it: the converter or llama.cpp's quantizer)."""
    return {
        "path": str(path),
        "qtype": qtype,
        "bytes": path.stat().st_size,
        "tensor_count": sum(types.values()),
        "tensor_types": dict(types),
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

    if qtype not in TOLERANCES:
        raise GgufExportError(f"verify_gguf checks {', '.join(TOLERANCES)} files, not {qtype!r}")
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
    alone = render_chat(chat_template, [{"role": "user", "content": "Q"}])
    prefix = alone[: -len(turn)] if alone.endswith(turn) else None
    default = re.fullmatch(r"<\|im_start\|>system\n(.*)<\|im_end\|>\n", prefix or "", re.DOTALL)
    conversation = [
        {"role": "system", "content": "S"}, {"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"},
        {"role": "user", "content": "Q"},
    ]  # fmt: skip
    chatml = "<|im_start|>system\nS<|im_end|>\n" + turn + "A<|im_end|>\n" + turn
    if prefix is None or (prefix and not default) or render_chat(chat_template, conversation) != chatml:
        raise GgufExportError(
            "the chat template does not render ChatML (<|im_start|>role ... <|im_end|>), the only one translated to an "
            f"Ollama TEMPLATE here; it renders {alone!r} for one user turn. Write the Modelfile's TEMPLATE by hand"
        )
    system = default.group(1) if default else ""
    if "{{" in system or '"""' in system:
        raise GgufExportError(
            f"the chat template's default system prompt {system!r} cannot be written into a Modelfile TEMPLATE"
        )
    return _ollama_chatml(system)


def render_chat(chat_template: str, messages: list[dict], bos_token: str = "", eos_token: str = "") -> str:
    """Render a chat template as transformers and llama-cpp-python do (sandboxed Jinja, generation prompt on)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise GgufExportError(f"the chat template refused a probe conversation: {message}")

    def strftime_now(format: str) -> str:  # gpt-oss's harmony template writes the date
        return datetime.datetime.now().strftime(format)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return environment.from_string(chat_template).render(
        messages=messages, add_generation_prompt=True, raise_exception=raise_exception, bos_token=bos_token, eos_token=eos_token,
        strftime_now=strftime_now,
    )  # fmt: skip


def write_modelfile(
    gguf_filename: str,
    out_path: str | Path,
    chat_template: str | None,
    system: str | None = None,
    projector: str | None = None,
) -> None:
    """Write an Ollama Modelfile next to the GGUF: ``ollama create NAME -f Modelfile`` in that directory.

    ``FROM`` is the GGUF file (the one that ships), ``TEMPLATE`` renders what its embedded chat template
    renders (``ollama_template``). A template that is not ChatML (Llama 3, Gemma, Mistral, Phi) is not
    translated: the Modelfile then has no TEMPLATE, and ``ollama create`` takes the template from the
    file's ``tokenizer.chat_template`` (Ollama matches it against the templates it knows); a comment says so.
    A vision-language model's ``projector`` is not named: the Modelfile is text-only (a comment says where the
    pictures go instead), since Ollama's import of a separate llama.cpp projector is not something checked here.
    """
    if "/" in gguf_filename or "\\" in gguf_filename:
        raise ValueError(f"gguf_filename must be a bare file name next to the Modelfile, got {gguf_filename!r}")
    if system is not None and '"""' in system:
        raise ValueError('the system prompt cannot contain """ (it ends the Modelfile block); rephrase it')
    try:
        template = [f'TEMPLATE """{ollama_template(chat_template)}"""', 'PARAMETER stop "<|im_end|>"']
    except GgufExportError as exc:
        template = [
            f"# no TEMPLATE: Ollama takes it from the file's tokenizer.chat_template ({' '.join(str(exc).split())[:200]})"
        ]
    lines = [f"FROM ./{gguf_filename}", *template]
    if projector:
        lines.append(
            f"# text only: the vision projector {projector} runs with llama.cpp "
            f"(llama-mtmd-cli -m {gguf_filename} --mmproj {projector} --image PICTURE; llama-server --mmproj)"
        )
    if system:
        lines.append(f'SYSTEM """{system}"""')
    Path(out_path).write_text("\n".join(lines) + "\n", encoding="utf-8")


def modelfile_gguf(modelfile: str | Path) -> str:
    """The GGUF file name a Modelfile written by ``write_modelfile`` names in ``FROM ./<file>``."""
    for line in Path(modelfile).read_text(encoding="utf-8").splitlines():
        if line.startswith("FROM ./"):
            return line.removeprefix("FROM ./").strip()
    raise GgufExportError(f"{modelfile} has no 'FROM ./<file>.gguf' line")


def _main() -> None:
    """Export and verify every supported type: the command behind the table in the module docstring."""
    import argparse

    parser = argparse.ArgumentParser(description=_main.__doc__)
    parser.add_argument("model_dir", help="Hugging Face model directory (safetensors + tokenizer)")
    parser.add_argument("out_dir", help="where the .gguf files go")
    parser.add_argument("--qtypes", nargs="+", default=list(SUPPORTED_QTYPES), choices=SUPPORTED_QTYPES)
    args = parser.parse_args()
    outputs = {qtype: Path(args.out_dir) / f"{Path(args.model_dir).name}-{qtype}.gguf" for qtype in args.qtypes}
    for qtype, written in export_ggufs(args.model_dir, outputs).items():
        report = verify_gguf(args.model_dir, written["path"], qtype)
        print(json.dumps({**written, **report}), flush=True)


if __name__ == "__main__":
    _main()
