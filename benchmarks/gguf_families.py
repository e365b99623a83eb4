"""GGUF by family: each tiny family model of the test matrix through llama.cpp's converter, quantizer and runtime.

    python -m benchmarks.gguf_families

For every family of ``ft_assets_tests.families`` (2 layers, hidden 128, random weights of std 0.2):
F16 and Q8_0 written by llama.cpp's converter, Q4_0 and the three K-quants by its quantizer from the F16
file (as ``gguf_model`` makes them), each loaded in llama.cpp and checked against transformers with
``llamacpp.check_file``: token ids on the hard strings, relative logit error, top-1 agreement, greedy
continuations equal (and the ones that part at a near-tie of transformers' own top two logits); and the
F16 file through transformers' own GGUF reader, the second reader ``gguf_model`` records; and the Gemma 3
F16 file without the layer pattern ``converter.py`` writes. Writes
``benchmarks/results/gguf_families.json``; docs/validation/benchmarks.md's "GGUF by family" table quotes it, and
``ft_assets_tests/test_gguf_families.py`` holds F16, Q8_0 and Q4_K_M to the tolerances it set.
"""

from __future__ import annotations

import sys
import time

from benchmarks.common import cache_dir, table, write_result

CONVERTED = ("f16", "q8_0")
QUANTIZED = ("q4_0", "q4_k_m", "q5_k_m", "q6_k")


def without_layer_pattern(path, ref) -> dict:
    """llama.cpp's check of a Gemma 3 file with ``attention.sliding_window_pattern`` removed (converter.py's fix 3 undone)."""
    import os
    import subprocess

    from ft_assets.delivery import converter, llamacpp

    where, stripped = converter.location(), path.with_name("gemma3-f16-no-pattern.gguf")
    subprocess.run(
        [sys.executable, str(where / "gguf-py" / "gguf" / "scripts" / "gguf_new_metadata.py"), "--force",
         "--remove-metadata", "gemma3.attention.sliding_window_pattern", str(path), str(stripped)],
        env={**os.environ, "PYTHONPATH": str(where / "gguf-py")}, check=True, capture_output=True,
    )  # fmt: skip
    check = llamacpp.check_file(stripped, ref)
    return {k: check[k] for k in ("rel_error", "top1_agreement", "greedy_match")}


def main(argv: list[str] | None = None) -> dict:
    import llama_cpp

    from ft_assets.delivery import llamacpp
    from ft_assets.delivery.converter import convert_many
    from ft_assets.delivery.gguf_export import file_entry, tensor_types, verify_gguf
    from ft_assets_tests.families import FAMILIES, build_family

    argv = list(argv if argv is not None else sys.argv[1:])
    work = cache_dir() / "gguf_families"
    dirs = {family.name: build_family(family.name, work / family.name) for family in FAMILIES}
    started = time.perf_counter()
    convert_many([(dirs[f], "tiny", qtype, work / f"{f}-{qtype}.gguf") for f in dirs for qtype in CONVERTED])
    convert_s = time.perf_counter() - started
    results, rows = {}, []
    for family in FAMILIES:
        name = family.name
        files = {
            q: file_entry(work / f"{name}-{q}.gguf", q, tensor_types(work / f"{name}-{q}.gguf")) for q in CONVERTED
        }
        for qtype in QUANTIZED:
            files[qtype] = llamacpp.quantize(files["f16"]["path"], work / f"{name}-{qtype}.gguf", qtype)
        ref = llamacpp.reference(dirs[name])
        results[name] = {"features": family.features, "strings": len(ref.strings), "files": {}}
        for qtype, written in files.items():
            check = llamacpp.check_file(written["path"], ref)
            results[name]["files"][qtype] = {
                "bytes": written["bytes"], "tensor_types": written["tensor_types"],
                **{k: check[k] for k in ("tokens_match", "rel_error", "max_abs_diff", "top1_agreement", "kl_divergence",
                                         "greedy_match", "greedy_near_ties", "greedy_prompts")},
                "token_mismatches": len(check["token_mismatches"]),
            }  # fmt: skip
            print(f"{name} {qtype}: {results[name]['files'][qtype]}", file=sys.stderr, flush=True)
        try:  # the second reader gguf_model records: transformers' own GGUF loader, on the F16 file
            report = verify_gguf(dirs[name], files["f16"]["path"], "f16")
            results[name]["transformers_f16"] = {k: report[k] for k in ("rel_error", "tokens_match", "ok")}
        except (ValueError, KeyError, RuntimeError, NotImplementedError, OSError) as exc:
            results[name]["transformers_f16"] = {"error": " ".join(str(exc).split())[:200]}
        r = results[name]["files"]
        second = results[name]["transformers_f16"]
        rows.append(
            [name, f"{len(ref.strings) - r['f16']['token_mismatches']}/{len(ref.strings)}"]
            + [f"{r[q]['rel_error']:.1e}" for q in ("f16", "q8_0", "q6_k", "q5_k_m", "q4_k_m", "q4_0")]
            + [f"{r['f16']['greedy_match']}/{r['f16']['greedy_prompts']} (+{r['f16']['greedy_near_ties']} near-tie)"]
            + [str(all(f["tokens_match"] for f in r.values()))]
            + [f"{second['rel_error']:.1e}" if "rel_error" in second else "cannot load"]
        )
    results["gemma3"]["f16_without_layer_pattern"] = without_layer_pattern(
        work / "gemma3-f16.gguf", llamacpp.reference(dirs["gemma3"])
    )
    print(f"llama-cpp-python {llama_cpp.__version__}; converter for all families in one process: {convert_s:.1f} s")
    print(f"gemma3 F16 without its layer pattern: {results['gemma3']['f16_without_layer_pattern']}")
    print(
        table(
            [
                "family",
                "token ids equal (F16)",
                "F16",
                "Q8_0",
                "Q6_K",
                "Q5_K_M",
                "Q4_K_M",
                "Q4_0",
                "F16 greedy equal",
                "all types: ids equal",
                "transformers' reader, F16",
            ],
            rows,
        )
    )
    data = {"llama_cpp_python": llama_cpp.__version__, "convert_s": convert_s, "results": results}
    write_result("gguf_families", data, argv)
    return data


if __name__ == "__main__":
    main()
