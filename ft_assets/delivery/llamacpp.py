"""llama.cpp, the runtime users run (Ollama is built on it), driven through llama-cpp-python.

Everything the delivery plane asks of the real runtime lives here: load a GGUF, tokenize, greedy
generation, logits, K-quants made by llama.cpp's own quantizer, greedy chat answers through the chat
template embedded in the file, and an OpenAI-compatible server (``llama_cpp.server``) on loopback.
``reference`` computes once what the merged model gives under transformers (token ids of a table of
hard strings, logits and greedy continuations of chat prompts) and ``check_file`` compares one GGUF
file with it, through llama.cpp: a wrong ``tokenizer.ggml.pre``, a missing key or a mis-laid tensor
shows up here even when transformers' own GGUF reader, which ignores those keys, loads the file fine.

Q4_0 and the K-quants (Q4_K_M, Q5_K_M, Q6_K) are written by ``llama_model_quantize`` from the f16 file
(which llama.cpp's converter writes, ``ft_assets.delivery.converter``), with
``llama_model_quantize_default_params()``, as ``llama-quantize`` does. Their 256-value super-blocks
need rows whose length is a multiple of 256: for a tensor whose rows are not, llama.cpp falls back per
tensor (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0; ``tensor_type_fallback`` in its
``src/llama-quant.cpp``), so a model of hidden size 64 gets a "Q4_K_M" file without a single K block.
``quantize`` returns the tensor types it actually wrote, so the metadata says so.

Measured with ``python -m benchmarks.gguf_runtime`` on SmolLM2-135M-Instruct (the "Tested runtimes" table
of docs/guides/exports.md; llama-cpp-python 0.3.36, llama.cpp built from source for the CPU): every file
(F16, Q8_0, Q4_K_M, Q5_K_M, Q6_K) loads and gives the HF tokenizer's ids on all 15 strings; F16's logits
are within 1.9e-3 (relative) of transformers' and its greedy output equal on 5 of 5 prompts, Q8_0's
within 4.8e-2 (3 of 5 equal, the others parting at near-ties); the K-quants of this model, mostly
fallbacks (rows of 576), 0.07-0.27. Per family (``python -m benchmarks.gguf_families``): "GGUF by family" in
docs/guides/exports.md.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import logging
import os
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ft_assets.delivery import servers
from ft_assets.delivery.gguf_export import VERIFY_PROMPTS, file_entry, logit_agreement, tensor_types
from ft_assets.generation import answer_text
from ft_assets.vision import auto_class

# qtype -> llama_ftype of llama.cpp's quantizer (LLAMA_FTYPE_MOSTLY_* in llama-cpp-python's llama_cpp.py).
K_QUANTS = {"q4_k_m": 15, "q5_k_m": 17, "q6_k": 18}
QUANTIZED = {
    "q4_0": 2,
    **K_QUANTS,
}  # every type made from the f16 file by the quantizer (the converter writes f32/f16/q8_0)

INSTALL_HINT = "install the llamacpp extra: pip install 'ft-assets[llamacpp]' (llama-cpp-python, built from source)"
SERVER_MODULES = ("fastapi", "uvicorn", "sse_starlette", "starlette_context", "pydantic_settings")
CHAT_FORMAT = "chat_template.default"  # the tokenizer.chat_template in the file, never a built-in look-alike
N_CTX = 4096  # context of the eval/serving runtime: eval conversations fit; a 7B model's KV cache is 2 GiB at f16
GREEDY_TOKENS = 16  # tokens compared per prompt: enough to leave the prompt's echo, few enough to stay off near-ties

# Prompts whose greedy continuations are compared token for token (chat-rendered, like the logits).
GREEDY_PROMPTS = (*VERIFY_PROMPTS, "Write one line of Python that prints 7 * 6.", "List three prime numbers: 2, 3,")

# Strings whose token ids llama.cpp must give exactly as the HF tokenizer does. The last one is the text
# llama.cpp's converter tokenizes to recognise a pre-tokenizer (chktxt in convert_hf_to_gguf.py).
HARD_STRINGS = (
    "3 33 333 3333 33333 333333 1234567890 3.14159 -42 1e-5 0x1F 2026-11-30 $19.99 50%",
    "a  b   c\t\td\n\n\ne \n \n  \n   end   ",
    "    indented\n\tcode\r\nwindows line\u00a0nbsp\u2003em space",
    "🚀 🦙🦙 😶‍🌫️ ✅ 👍🏽 café naïve Ünïcödé — “quotes” … 我想在apple工作1314151天～ нещо на Български",
    'def f(x):\n    return {"a": [1, 2, 3], "b": None}  # comment\n\nif (a != b && c <= d) { x->y = z; }',
    "I've been 'told he's there, 'RE you sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more<|im_end|><|im_end|> <|im_start|>",
    '{"name": "set_timer", "arguments": {"minutes": 12}}',
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ 🦙🦙 3 33 333 "
    "3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ ------======= "
    "нещо на Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE you sure? 'M not "
    "sure I'll make it, 'D you like some tea? We'Ve a'lL",
)


class LlamaCppError(RuntimeError):
    """llama.cpp refused a file or a request (what, which file, what to do)."""


def require():
    """The ``llama_cpp`` module, or an error that says how to install it."""
    try:
        import llama_cpp
    except ImportError as exc:
        raise LlamaCppError(f"llama.cpp is needed here: {INSTALL_HINT}") from exc
    return llama_cpp


def load(
    path: str | Path,
    *,
    vocab_only: bool = False,
    logits_all: bool = False,
    n_ctx: int = N_CTX,
    n_threads: int | None = None,
):
    """Load a GGUF file in llama.cpp (quietly); a file it refuses raises ``LlamaCppError`` with its reason."""
    llama_cpp = require()
    # verbose while loading, into a captured stderr: a quiet Llama discards the reason a file is refused.
    with captured_stderr() as stderr:
        try:
            llm = llama_cpp.Llama(
                model_path=str(path), vocab_only=vocab_only, logits_all=logits_all, n_ctx=n_ctx, n_batch=min(n_ctx, 512),
                n_threads=n_threads, chat_format=CHAT_FORMAT, verbose=True,
            )  # fmt: skip
        except ValueError as exc:
            reasons = [line.strip() for line in stderr().splitlines() if "error" in line.lower()]
            raise LlamaCppError(f"llama.cpp cannot load {path}: {'; '.join(reasons) or exc}") from exc
    llm.verbose = False
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # libllama's log level after the load
    return llm


def tokenize(llm, text: str, add_bos: bool = True) -> list[int]:
    """Token ids as llama.cpp makes them: special tokens parsed; with ``add_bos``, BOS as the file's add_bos_token
    says (a plain string). A chat-rendered prompt carries its template's own BOS: ``add_bos=False``, as transformers'
    ``apply_chat_template`` and the data plane tokenize it (``add_special_tokens=False``)."""
    return llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=True)


def logits(llm, ids: list[int]) -> np.ndarray:
    """Logits of every position of ``ids`` ([len(ids), vocab]); ``llm`` must be loaded with ``logits_all``."""
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype=np.float32)


def greedy(llm, ids: list[int], max_new_tokens: int) -> list[int]:
    """llama.cpp's greedy continuation of ``ids`` (its own sampler at temperature 0), ``max_new_tokens`` long."""
    out: list[int] = []
    for token in llm.generate(ids, temp=0.0, reset=True):
        out.append(token)
        if len(out) == max_new_tokens:
            return out
    return out


def cut_at(tokens: list[int], stop_id: int | None) -> list[int]:
    """``tokens`` up to and including the first ``stop_id`` (where transformers' generate stops)."""
    return tokens[: tokens.index(stop_id) + 1] if stop_id in tokens else tokens


@dataclass
class Reference:
    """What the merged model gives under transformers, computed once and compared with every GGUF file."""

    strings: list[str]  # HARD_STRINGS + the chat-rendered GREEDY_PROMPTS
    # per string: a plain string (the tokenizer adds its special tokens), else a rendered chat (it does not)
    plain: list[bool]
    token_ids: list[list[int]]  # the HF tokenizer's ids of each string
    prompt_ids: list[list[int]]  # the chat-rendered prompts, tokenized
    logits: list[np.ndarray]  # transformers' logits over each prompt
    continuations: list[list[int]]  # transformers' greedy continuation of each prompt (generate, stops at EOS)
    margins: list[list[float]]  # transformers' top-1 minus top-2 logit at each step of each continuation
    eos_token_id: int | None
    chat_template: str | None  # the template export_gguf embeds (tokenizer.chat_template)


def reference(
    model_dir: str | Path, prompts: tuple[str, ...] = GREEDY_PROMPTS, max_new_tokens: int = GREEDY_TOKENS
) -> Reference:
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = auto_class(model_dir).from_pretrained(
        model_dir, dtype=torch.float32
    )  # a VLM's language model: text prompts
    model.eval()
    rendered = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        if tokenizer.chat_template
        else p
        for p in prompts
    ]
    strings = [*HARD_STRINGS, *rendered]
    plain = [True] * len(HARD_STRINGS) + [not tokenizer.chat_template] * len(rendered)
    prompt_ids = [tokenizer(text, add_special_tokens=not tokenizer.chat_template).input_ids for text in rendered]
    all_logits, continuations, margins = [], [], []
    with torch.inference_mode():
        for ids in prompt_ids:
            batch = torch.tensor([ids])
            all_logits.append(model(input_ids=batch).logits[0].numpy())
            generated = model.generate(
                batch, attention_mask=torch.ones_like(batch), max_new_tokens=max_new_tokens, do_sample=False,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
                output_logits=True, return_dict_in_generate=True,
            )  # fmt: skip
            continuations.append(generated.sequences[0, len(ids) :].tolist())
            top2 = [step[0].topk(2).values for step in generated.logits]
            margins.append([float(values[0] - values[1]) for values in top2])
    return Reference(
        strings=strings,
        plain=plain,
        token_ids=[tokenizer(text, add_special_tokens=special).input_ids for text, special in zip(strings, plain)],
        prompt_ids=prompt_ids,
        logits=all_logits,
        continuations=continuations,
        margins=margins,
        eos_token_id=tokenizer.eos_token_id,
        chat_template=tokenizer.chat_template,
    )


def check_file(path: str | Path, ref: Reference) -> dict:
    """Load ``path`` in llama.cpp and compare it with the merged model: token ids, logits, greedy output.

    ``tokens_match`` (and ``token_mismatches``) over ``ref.strings``; ``rel_error``, ``max_abs_diff``,
    ``top1_agreement`` and ``kl_divergence`` of llama.cpp's logits against transformers' on the same ids
    (``gguf_export.logit_agreement``); ``greedy_match`` = prompts whose greedy continuation equals
    transformers' token for token, of ``greedy_prompts``; ``greedy_near_ties`` = the others that part where
    transformers' top two logits were within twice this file's ``max_abs_diff`` (a near-tie that any
    rounding may flip; a random tiny model has such steps), so the rest part for a reason.
    """
    longest = max(len(ids) for ids in ref.prompt_ids) + max(len(c) for c in ref.continuations) + 8
    llm = load(path, logits_all=True, n_ctx=max(longest, 256))
    try:
        mismatches = [
            text for text, bos, ids in zip(ref.strings, ref.plain, ref.token_ids) if tokenize(llm, text, bos) != ids
        ]
        agreement = logit_agreement([(expected, logits(llm, ids)) for ids, expected in zip(ref.prompt_ids, ref.logits)])
        parted_at = [
            parting_step(cut_at(greedy(llm, ids, len(expected) or 1), ref.eos_token_id), expected)
            for ids, expected in zip(ref.prompt_ids, ref.continuations)
        ]
    finally:
        llm.close()
    near_tie = 2 * agreement["max_abs_diff"]
    return {
        "tokens_match": not mismatches,
        "token_mismatches": mismatches,
        **agreement,
        "greedy_match": parted_at.count(None),
        "greedy_near_ties": sum(
            step is not None and step < len(margins) and margins[step] <= near_tie
            for step, margins in zip(parted_at, ref.margins)
        ),
        "greedy_prompts": len(ref.prompt_ids),
    }


def parting_step(got: list[int], expected: list[int]) -> int | None:
    """The first step where ``got`` leaves ``expected`` (None when equal)."""
    if got == expected:
        return None
    return next((step for step, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))


def choose_shipped(files: dict[str, dict], ship: str, max_rel_error: float) -> str:
    """The name of the file that ships, of ``files`` (name -> ``{"qtype", "bytes", "llamacpp": check_file(...)}``).

    ``ship`` names a qtype, or is ``"auto"``: the smallest file whose relative logit error through llama.cpp
    (``shipped_error``) is within ``max_rel_error``, else the most accurate one. Smallest-within-tolerance, not a fixed type,
    because which quantization a model tolerates depends on the model: a model whose rows are not multiples
    of 256 gets K-quant files that are mostly Q5_0/Q5_1/Q8_0 fallbacks, and SmolLM2-135M, rebuilt from a
    4-bit GGUF, loses more to its K-quants (rel. error 0.07-0.27) than to Q8_0 (0.05): with the default
    bound (0.08, what a Q8_0 file is held to) the demo ships Q8_0, which scores what the merged model scores.
    """
    if ship != "auto":
        named = [name for name, entry in files.items() if entry["qtype"] == ship]
        if not named:
            raise ValueError(
                f"ship={ship!r} is not among the exported types {sorted(e['qtype'] for e in files.values())}"
            )
        return named[0]
    within = [name for name, entry in files.items() if shipped_error(entry) <= max_rel_error]
    if within:
        return min(within, key=lambda name: files[name]["bytes"])
    return min(files, key=lambda name: shipped_error(files[name]))


def shipped_error(entry: dict) -> float:
    """A file's relative logit error through llama.cpp, as ``choose_shipped`` weighs it: on text prompts, and for a
    vision-language model's file the larger of that and its error on picture prompts (``entry["mtmd"]``)."""
    return max(entry["llamacpp"]["rel_error"], entry.get("mtmd", {}).get("rel_error", 0.0))


def quantize(f16_path: str | Path, out_path: str | Path, qtype: str) -> dict:
    """Make ``qtype`` (Q4_0 or a K-quant) of ``f16_path`` with llama.cpp's quantizer; return what it wrote (as ``export_gguf`` does).

    ``tensor_types`` counts the GGML types llama.cpp chose per tensor, fallbacks included.
    """
    if qtype not in QUANTIZED:
        raise LlamaCppError(
            f"qtype {qtype!r} is not made by llama.cpp's quantizer here; choose one of {', '.join(QUANTIZED)}"
        )
    llama_cpp = require()
    out_path = Path(out_path)
    tmp_path = out_path.with_name(out_path.name + ".tmp")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = QUANTIZED[qtype]
    try:
        with captured_stderr() as stderr:
            status = llama_cpp.llama_model_quantize(
                str(f16_path).encode(), str(tmp_path).encode(), ctypes.byref(params)
            )
        if status != 0:
            raise LlamaCppError(
                f"llama.cpp could not quantize {f16_path} to {qtype} (status {status}): {stderr()[-2000:]}"
            )
        os.replace(tmp_path, out_path)
    finally:
        tmp_path.unlink(missing_ok=True)
    return file_entry(out_path, qtype, tensor_types(out_path))


def chat_answers(
    path: str | Path, conversations: list[list[dict]], max_new_tokens: int, log: Callable[[str], None] = print
) -> list[str]:
    """Greedy chat completions of a GGUF file through llama.cpp: the file's own chat template, stop at end of turn.

    Text only: a conversation holding pictures is refused (a VLM's GGUF answers them with its projector, through
    libmtmd: ``ft_assets.delivery.mtmd.chat_answers``)."""
    with_pictures = sum(
        any(
            isinstance(m["content"], list) and any(part.get("type") == "image" for part in m["content"])
            for m in messages
        )
        for messages in conversations
    )
    if with_pictures:
        raise LlamaCppError(
            f"{Path(path).name} answers text only, and {with_pictures} of {len(conversations)} conversations hold pictures: "
            "a vision-language model's GGUF answers them with its projector (mmproj) beside it"
        )
    llm = load(path)
    answers = []
    try:
        for number, messages in enumerate(conversations, 1):
            reply = llm.create_chat_completion(messages=messages, max_tokens=max_new_tokens, temperature=0.0)
            answers.append(answer_text(reply["choices"][0]["message"]["content"] or ""))
            if number % 16 == 0 or number == len(conversations):
                log(f"llama.cpp answered {number}/{len(conversations)}")
    finally:
        llm.close()
    return answers


@contextmanager
def serve(path: str | Path, *, n_ctx: int = N_CTX, start_timeout_s: float = 120.0) -> Iterator[str]:
    """Run llama-cpp-python's OpenAI-compatible server on ``path`` on a free loopback port (``servers.serve``: stopped
    when the block ends); yield its base URL."""
    require()
    missing = [name for name in SERVER_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        raise LlamaCppError(f"llama_cpp.server needs {', '.join(missing)}: {INSTALL_HINT}")

    def command(port: int) -> list[str]:
        return [
            sys.executable, "-m", "llama_cpp.server", "--model", str(path), "--host", "127.0.0.1", "--port", str(port),
            "--n_ctx", str(n_ctx), "--chat_format", CHAT_FORMAT, "--verbose", "false",
        ]  # fmt: skip

    try:
        with servers.serve(command, "llama_cpp.server", str(path), start_timeout_s) as url:
            yield url
    except servers.ServerError as exc:
        raise LlamaCppError(str(exc)) from None


def chat_completion(url: str, messages: list[dict], max_tokens: int, timeout_s: float = 120.0) -> dict:
    """One POST /v1/chat/completions (greedy) to an OpenAI-compatible server; the parsed JSON reply."""
    body = json.dumps({"messages": messages, "max_tokens": max_tokens, "temperature": 0.0}).encode()
    request = urllib.request.Request(
        f"{url}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise LlamaCppError(f"{url}/v1/chat/completions answered {exc.code}: {exc.read()[:1000]!r}") from exc


def serving_smoke(path: str | Path, prompts: list[str], max_tokens: int) -> list[dict]:
    """Start the server on ``path``, ask one chat completion per prompt over HTTP, stop it; the answers."""
    results = []
    with serve(path) as url:
        for prompt in prompts:
            started = time.perf_counter()
            reply = chat_completion(url, [{"role": "user", "content": prompt}], max_tokens)
            choice = reply["choices"][0]
            results.append(
                {
                    "prompt": prompt,
                    "answer": choice["message"]["content"] or "",
                    "finish_reason": choice["finish_reason"],
                    "completion_tokens": reply["usage"]["completion_tokens"],
                    "seconds": round(time.perf_counter() - started, 3),
                }
            )
    return results


@contextmanager
def captured_stderr() -> Iterator[Callable[[], str]]:
    """Redirect file descriptor 2 (where libllama logs) to a temporary file; yield a reader of it."""
    sys.stderr.flush()
    saved_fd, saved_stream = os.dup(2), sys.stderr
    with tempfile.TemporaryFile() as captured, open(captured.fileno(), "w", encoding="utf-8", closefd=False) as text:
        os.dup2(captured.fileno(), 2)
        sys.stderr = text  # llama-cpp-python's log callback prints to sys.stderr, which pytest replaces

        def read() -> str:
            text.flush()
            captured.seek(0)
            return captured.read().decode("utf-8", "replace")

        try:
            yield read
        finally:
            text.flush()
            sys.stderr = saved_stream
            os.dup2(saved_fd, 2)
            os.close(saved_fd)
