"""GGUF in the runtime users run: each exported file loaded in llama.cpp, checked and timed.

    python -m benchmarks.gguf_runtime           # SmolLM2-135M-Instruct: f16, q8_0 and the three K-quants
    python -m benchmarks.gguf_runtime --quick   # tiny.py's model (hidden 256, so the K-quants hold K blocks)

For every file: size, load time, prompt token ids equal to the HF tokenizer's on the hard strings of
``ft_assets.delivery.llamacpp`` (and the chat-rendered prompts), relative logit error / top-1 / KL
against the merged model under transformers, greedy continuations equal token for token, and speed
(prompt and generation tokens/s, all cores, best of 5 runs). The f16 and q8_0 files come from
``export_gguf`` (llama.cpp's converter), the K-quants from llama.cpp's quantizer on the f16 file,
exactly as ``gguf_model`` makes them. Writes
``benchmarks/results/gguf_runtime.json``; docs/validation/benchmarks.md's tested-runtimes table quotes it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from benchmarks.common import cache_dir, fmt, smollm2_dir, table, tiny_model_dir, write_result

QTYPES = ("f16", "q8_0", "q4_k_m", "q5_k_m", "q6_k")
PROMPT_TOKENS = 512  # a long chat prompt: prompt processing runs in batches of this size
GENERATED_TOKENS = 128
QUICK_TOKENS = (64, 16)  # --quick: prompt and generated tokens, enough to exercise the timing path
REPEATS = 5  # timed runs per file; the best counts


def speed(path, n_threads: int, prompt_tokens: int, generated_tokens: int, repeats: int) -> dict:
    """Prompt processing and greedy generation speed of one file (tokens/s, wall clock), best of ``repeats``.

    The best run, not the mean: on a machine shared with other jobs the slower runs measure the
    neighbours (the spread between runs reached 5x while these figures were taken).
    """
    from ft_assets.delivery import llamacpp

    llm = llamacpp.load(path, n_ctx=prompt_tokens + generated_tokens + 64, n_threads=n_threads)
    text = " ".join(llamacpp.HARD_STRINGS) * 20
    ids = llamacpp.tokenize(llm, text)[:prompt_tokens]
    prompt_s, generation_s = [], []
    for _ in range(repeats):
        llm.reset()
        started = time.perf_counter()
        llm.eval(ids)
        prompt_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        generated = llamacpp.greedy(
            llm, ids, generated_tokens
        )  # reuses the evaluated prompt (llama-cpp-python's prefix match)
        generation_s.append(time.perf_counter() - started)
    llm.close()
    return {
        "prompt_tokens": len(ids),
        "prompt_tokens_per_s": len(ids) / min(prompt_s),
        "generated_tokens": len(generated),
        "generation_tokens_per_s": len(generated) / min(generation_s),
        "repeats": repeats,
    }


def main(argv: list[str] | None = None) -> dict:
    from ft_assets.delivery import llamacpp
    from ft_assets.delivery.gguf_export import export_gguf

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the tiny test model instead of SmolLM2-135M-Instruct")
    args = parser.parse_args(argv)
    argv = list(argv if argv is not None else sys.argv[1:])
    if args.quick:
        model_dir, model_name = tiny_model_dir(hidden=256), "tiny.py's model (hidden 256)"
    else:
        model_dir, model_name = smollm2_dir(), "SmolLM2-135M-Instruct"
    threads = len(os.sched_getaffinity(0))
    work = cache_dir() / "gguf_runtime" / model_dir.name
    work.mkdir(parents=True, exist_ok=True)

    ref = llamacpp.reference(model_dir)
    rows, results = [], {}
    for qtype in QTYPES:
        path = work / f"{model_dir.name}-{qtype}.gguf"
        started = time.perf_counter()
        if qtype in llamacpp.K_QUANTS:
            written = llamacpp.quantize(work / f"{model_dir.name}-f16.gguf", path, qtype)
        else:
            written = export_gguf(model_dir, path, qtype)
        made_s = time.perf_counter() - started
        started = time.perf_counter()
        llamacpp.load(path).close()
        load_s = time.perf_counter() - started
        check = llamacpp.check_file(path, ref)
        results[qtype] = {
            "bytes": written["bytes"],
            "tensor_types": written["tensor_types"],
            "made_s": made_s,
            "load_s": load_s,
            "strings": len(ref.strings),
            "strings_equal": len(ref.strings) - len(check["token_mismatches"]),
            **{
                k: check[k]
                for k in (
                    "rel_error",
                    "max_abs_diff",
                    "top1_agreement",
                    "kl_divergence",
                    "greedy_match",
                    "greedy_prompts",
                )
            },
            **speed(
                path, threads, *(QUICK_TOKENS + (1,) if args.quick else (PROMPT_TOKENS, GENERATED_TOKENS, REPEATS))
            ),
        }
        r = results[qtype]
        rows.append(
            [qtype, f"{r['bytes'] / 1e6:,.1f}", f"{r['load_s']:.2f}", f"{r['strings_equal']}/{r['strings']}", f"{r['rel_error']:.2e}",
             f"{r['top1_agreement']:.1%}", f"{r['kl_divergence']:.1e}", f"{r['greedy_match']}/{r['greedy_prompts']}",
             fmt(r["prompt_tokens_per_s"]), fmt(r["generation_tokens_per_s"])]
        )  # fmt: skip
        print(f"{qtype}: {r}", file=sys.stderr, flush=True)
    import llama_cpp

    print(f"{model_name}, llama-cpp-python {llama_cpp.__version__}, {threads} threads")
    print(
        table(
            [
                "type",
                "MB",
                "load s",
                "token ids equal",
                "rel. logit error",
                "top-1",
                "KL",
                "greedy equal",
                "prompt tok/s",
                "gen tok/s",
            ],
            rows,
        )
    )
    data = {"model": model_name, "llama_cpp_python": llama_cpp.__version__, "threads": threads, "results": results}
    write_result("gguf_runtime", data, argv)
    return data


if __name__ == "__main__":
    main()
