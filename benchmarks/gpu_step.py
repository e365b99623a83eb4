"""GPU step throughput and memory: the recipe's own step on a small and a 7B-shaped model, beside the planner.

Prepared for a session that has a CUDA GPU; one command measures everything in under 5 minutes:

    python -m benchmarks.gpu_step --shape smollm2,llama2-7b   # both suites (~1.5 + ~3 min on an H200)
    python -m benchmarks.gpu_step --shape gpt-oss-20b         # the mixture of experts (4 of its 24 layers)
    python -m benchmarks.gpu_step --shape qwen2.5-vl-7b       # a vision-language model, a 1024 x 1024 picture a row
    python -m benchmarks.gpu_step                             # SmolLM2-135M-Instruct only
    python -m benchmarks.gpu_step --cpu-smoke                 # a few tiny steps on CPU: checks the script, no figures

Every step is the recipe's: ``load_model`` (bf16 on GPUs that have it; QLoRA: NF4 + double
quantization), ``token_loss_sum`` (hidden states + chunked cross-entropy), AdamW (fused on CUDA),
under bf16 autocast. ``WARMUP`` steps, then ``--steps`` timed ones, CUDA synchronized around each.

**smollm2** (the data plane's rows of the shipped sample, 512 tokens):

- ``packed``: ``BATCH`` packed rows a step, position_ids restarting per example, no attention mask.
- ``padded``: the HF tutorials' baseline at the *same real-token budget*: as many examples a step as
  the packed rows hold on average, each batch padded to its longest example with an attention mask.
  (At an equal *example* count, padded batches are simply smaller: the 10.5x "packed vs padded" seen
  on 2026-11-30 at 8 examples a step was that batch-size effect, not packing's speedup.)
- ``attention``: packed LoRA through every attention backend the device has, side by side.

**llama2-7b** (Llama-2-7B's shape with random weights, built on the GPU and saved once: speed and
memory do not depend on the values): LoRA and QLoRA, r=16 on all 7 projections, gradient
checkpointing, 1 x 2048 packed tokens (4 documents), with the planner's ``estimate_vram`` for the
same path next to the measured peak (torch reserved + CUDA context), then LoRA on 1 x 4096 tokens
(8 documents) through each attention backend.

**gpt-oss-20b** (gpt-oss-20b's shape, ``MOE_LAYERS`` of its 24 layers, random bf16 weights: every
expert tensor, router, sink and the 201k vocabulary as released, fewer layers so that it builds and
saves in a minute): LoRA r=16 on the attention and every expert (PEFT ``target_parameters``),
gradient checkpointing, 1 x 2048 packed tokens (4 documents), the experts as transformers runs them
(``grouped_mm``: one grouped GEMM per projection; its name is recorded), beside the planner's
``estimate_vram`` of the same shape and its FLOPs from the *active* parameters (4 of 32 experts).
``--cpu-smoke`` runs the same code on a 2-layer, hidden-128 version of that shape.

**qwen2.5-vl-7b** (Qwen2.5-VL-7B-Instruct's shape from the config.json and preprocessor_config.json the
planner ships, random bf16 weights built on the GPU and saved once, the tests' byte-level BPE with Qwen's special
tokens in place of its 152k vocabulary, whose ids it keeps): QLoRA r=16 on the language model, the vision tower
frozen in bf16, gradient checkpointing, one row of ``VLM_SEQ_LEN`` tokens a step holding one ``VLM_PICTURE`` px
picture (1,369 image tokens at the released processor's resize rules) and a question and answer, through the data
plane's encoder and the trainer's pixel inputs (``benchmarks/vlm_step.py``'s ``measure``: images/s, tokens/s and
the host's share for the pixels), beside the planner's ``estimate_vram`` and FLOPs for the same images.
``--cpu-smoke`` runs the same code on that shape at hidden 128 (2 text layers, 4 vision blocks) and a 112 px picture.

Figures: real (non-padding) tokens/s, MFU (model FLOPs from the planner's ``flops_per_token`` over
the GPU's dense bf16 peak, ``--peak-tflops`` or the datasheet value of H100/H200/A100/L4/A10G) and peak
memory. Writes ``benchmarks/results/gpu_step.json`` (``--cpu-smoke``: ``gpu_step_cpu_smoke.json``,
marked as not a measurement).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import shutil
import sys
import time
from pathlib import Path

from benchmarks.common import ROOT, cache_dir, fmt, smollm2_dir, table, tiny_model_dir, write_result

SEQ_LEN = 512
BATCH = 8  # packed rows per optimizer step (the padded baseline gets the same real-token budget)
WARMUP = 3
STEPS = 20
SMOKE_RECORDS = 64  # --cpu-smoke: sample rows to tokenize
LLAMA2_7B = dict(
    hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
    vocab_size=32000, max_position_embeddings=4096, tie_word_embeddings=False,
)  # fmt: skip
GPT_OSS_20B = dict(
    hidden_size=2880, intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
    num_local_experts=32, num_experts_per_tok=4, vocab_size=201088, sliding_window=128, tie_word_embeddings=False,
    max_position_embeddings=131072,
    rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 4096, "rope_theta": 150000.0},
)  # fmt: skip
MOE_LAYERS = 4
GPT_OSS_SMOKE = dict(GPT_OSS_20B, hidden_size=128, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=32, num_local_experts=4, num_experts_per_tok=2, vocab_size=512)  # fmt: skip
QWEN2_5_VL_7B = "Qwen/Qwen2.5-VL-7B-Instruct"  # its config.json and preprocessor_config.json ship with the planner
VLM_PICTURE = 1024  # px a side; resized to 1036 (a multiple of 28) by the released processor: 37 x 37 = 1,369 tokens
VLM_SEQ_LEN = 2048  # one picture and its conversation a row
VLM_ROWS = 8  # rows of the shards: each step takes another
VLM_SMOKE_TEXT = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_window_layers=2, vocab_size=512,
                      rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]})  # fmt: skip  # released 16/24/24 at head dim 32
VLM_SMOKE_VISION = dict(depth=4, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128,
                        fullatt_block_indexes=[1, 3])  # fmt: skip
VLM_SMOKE_PICTURE, VLM_SMOKE_SEQ_LEN = 112, 256
SEVEN_B_STEPS, SEVEN_B_WARMUP = 6, 2  # a 7B step is ~0.4-1 s: enough to average, short enough for the 5 minutes
SUITES = ("smollm2", "llama2-7b", "gpt-oss-20b", "qwen2.5-vl-7b")
DATASHEET_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L4": 121.0, "A10G": 70.0}  # dense, no sparsity


def prepare_examples(model_dir: Path, work: Path, seq_len: int, limit: int | None = None) -> tuple:
    """(packed rows of the sample, real tokens of each packed row, the same examples unpacked, pad id)."""
    import numpy as np
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from ft_assets.data.chat_encoding import ChatEncoder
    from ft_assets.data.cleaning import CleaningRules, clean_dataset
    from ft_assets.data.formats import is_data_file
    from ft_assets.data.parts import Artifact
    from ft_assets.data.readers import read_dataset
    from ft_assets.data.sequences import Example
    from ft_assets.data.tokenizing import tokenize_and_pack
    from ft_assets.shards import load_packed_rows, shard_files

    shutil.rmtree(work, ignore_errors=True)
    sample = ROOT / "samples" / "toolcalls"
    read_dataset(
        [(p.name, p) for p in sorted(sample.iterdir()) if is_data_file(p.name)], raw := Artifact.folder(work / "raw")
    )
    clean_dataset(raw, cleaned := Artifact.folder(work / "cleaned"), CleaningRules())
    encoder = ChatEncoder(AutoTokenizer.from_pretrained(model_dir))
    records = [(r["source"], r["messages"]) for r in cleaned.records("rows")][:limit]
    (work / "shards").mkdir()
    tokenize_and_pack(iter(records), encoder, seq_len, work / "shards", "train")
    examples = [
        e
        for e in encoder.encode_batch([m for _, m in records])
        if isinstance(e, Example) and len(e.input_ids) <= seq_len
    ]
    pad_id = (
        encoder.tokenizer.pad_token_id if encoder.tokenizer.pad_token_id is not None else encoder.tokenizer.eos_token_id
    )
    files = shard_files(work / "shards", "train")  # the order load_packed_rows reads them in
    row_tokens = np.array(
        [sum(n) for f in files for n in pq.read_table(f, columns=["seq_lens"]).column("seq_lens").to_pylist()]
    )
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


def device_peak_tflops(device, override: float | None) -> float | None:
    """The GPU's dense bf16 peak for MFU: ``--peak-tflops``, else the datasheet value by name, else None."""
    import torch

    if override:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tflops for key, tflops in DATASHEET_BF16_TFLOPS.items() if key in name), None)


def cuda_context_gib(device) -> float | None:
    """GPU memory in use that torch did not reserve (the CUDA context), from NVML; None without NVML."""
    import torch

    try:
        import pynvml

        pynvml.nvmlInit()
        used = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)).used
    except Exception:  # noqa: BLE001 - no NVML: report torch's figures alone
        return None
    return (used - torch.cuda.memory_reserved(device)) / 2**30


def free_memory(device) -> None:
    """Drop everything of the previous configuration before the next one measures its peak."""
    import torch

    gc.collect()  # models hold reference cycles; bitsandbytes' autograd nodes keep NF4 weights alive
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def timed_steps(model, optimizer, make_batch, device, steps: int, warmup: int) -> tuple[float, int, int, float]:
    """(seconds, real tokens, token slots) over the timed steps, and the last step's loss per learned token."""
    import torch

    from ft_assets.training.loss import learned_tokens, token_loss_sum

    cuda = device.type == "cuda"
    elapsed, real, slots = 0.0, 0, 0
    for step in range(warmup + steps):
        inputs, step_real = make_batch(step)
        count = max(learned_tokens(inputs), 1)
        if cuda:
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda and torch.cuda.is_bf16_supported()):
            loss = token_loss_sum(model, inputs) / count
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(device)
        if step >= warmup:
            elapsed += time.perf_counter() - started
            real += step_real
            slots += inputs["input_ids"].numel()
    return elapsed, real, slots, float(loss.detach())


def load(method: str, model_dir: Path, device, attention: str, max_seq_len: int, checkpointing: bool = False):
    from ft_assets.training.config import TrainingConfig

    config = TrainingConfig(
        method=method, max_seq_len=max_seq_len, attn_implementation=attention, gradient_checkpointing=checkpointing
    )
    return load_configured(config, model_dir, device)


def load_configured(config, model_dir: Path, device):
    """The model ``config`` (a ``TrainingConfig``) trains, on ``device`` in train mode, and its AdamW optimizer."""
    import torch

    from ft_assets.training.model import load_model, trainable_parameters

    method = config.method
    model = load_model(config, method, model_dir, device)
    if method != "qlora":  # qlora's loader places the quantized weights itself
        model.to(device)
    model.train()
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(trainable_parameters(model).values(), lr=1e-4, fused=True if fused else None)
    return model, optimizer


def figures(
    name: dict, elapsed: float, real: int, slots: int, steps: int, flops: float, peak_tflops, device, context, loss
) -> dict:
    import torch

    cuda = device.type == "cuda"
    tokens_per_s = real / elapsed
    reserved = torch.cuda.max_memory_reserved(device) / 2**30 if cuda else None
    return {
        **name,
        "steps": steps,
        "seconds_per_step": elapsed / steps,
        "real_tokens_per_s": tokens_per_s,
        "slots_per_s": slots / elapsed,
        "real_token_share": real / slots,
        "mfu": tokens_per_s * flops / (peak_tflops * 1e12) if peak_tflops else None,
        "peak_memory_mib": torch.cuda.max_memory_allocated(device) / 2**20 if cuda else None,
        "peak_reserved_gib": reserved,
        "peak_with_context_gib": reserved + context if reserved is not None and context is not None else None,
        "final_loss": loss,
    }


def measure(method: str, layout: str, model_dir: Path, data: tuple, device, batch: int, steps: int, warmup: int,
            attention: str, flops: float, peak_tflops, context) -> dict:  # fmt: skip
    """One SmolLM2 configuration: packed rows, or padded examples at the same real-token budget."""
    packed, row_tokens, examples, pad_id = data
    free_memory(device)
    model, optimizer = load(method, model_dir, device, attention, SEQ_LEN)
    rng = random.Random(0)
    order = list(range(len(packed) if layout == "packed" else len(examples)))
    rng.shuffle(order)
    per_step = batch
    if layout == "padded":  # as many examples as `batch` packed rows hold on average
        per_step = max(1, round(batch * row_tokens.mean() / (sum(len(e.input_ids) for e in examples) / len(examples))))

    def make_batch(step: int):
        pick = [order[(step * per_step + i) % len(order)] for i in range(per_step)]
        if layout == "packed":
            return packed.batch(pick, device), int(row_tokens[pick].sum())
        inputs = padded_batch([examples[i] for i in pick], pad_id, device)
        return inputs, int(inputs["attention_mask"].sum())

    elapsed, real, slots, loss = timed_steps(model, optimizer, make_batch, device, steps, warmup)
    name = {"method": method, "layout": layout, "attention": model.config._attn_implementation, "batch": per_step}
    result = figures(name, elapsed, real, slots, steps, flops, peak_tflops, device, context, loss)
    del model, optimizer
    return result


def smollm2_suite(args, device, peak_tflops, context) -> dict:
    """Packed vs padded at an equal token budget, LoRA and QLoRA; then packed LoRA per attention backend."""
    from ft_assets.control.planner import ModelShape, flops_per_token

    if args.cpu_smoke:
        batch, steps, warmup, model_dir = 2, args.steps or 2, 1, args.model or tiny_model_dir()
    else:
        batch, steps, warmup, model_dir = BATCH, args.steps or STEPS, WARMUP, args.model or smollm2_dir()
    data = prepare_examples(
        model_dir, cache_dir() / "work" / "gpu-step-data", SEQ_LEN, SMOKE_RECORDS if args.cpu_smoke else None
    )
    shape = ModelShape.from_config(json.loads((model_dir / "config.json").read_text()))

    def run(method: str, layout: str, attention: str) -> dict:
        flops = flops_per_token(shape, method, SEQ_LEN, False)
        return measure(
            method, layout, model_dir, data, device, batch, steps, warmup, attention, flops, peak_tflops, context
        )

    results = [run(method, layout, "auto") for method in args.methods.split(",") for layout in ("packed", "padded")]
    attention = [run("lora", "packed", backend) for backend in backends(device)]
    print(table(
        ["method", "layout", "attention", "rows/examples", "s/step", "real tokens/s", "MFU", "peak MiB"],
        [[r["method"], r["layout"], r["attention"], r["batch"], f"{r['seconds_per_step']:.3f}", fmt(r["real_tokens_per_s"]),
          "-" if r["mfu"] is None else f"{r['mfu']:.1%}", "-" if r["peak_memory_mib"] is None else fmt(r["peak_memory_mib"])]
         for r in results + attention],
    ))  # fmt: skip
    return {"model": str(model_dir), "seq_len": SEQ_LEN, "batch": batch, "results": results, "attention": attention}


def backends(device) -> list[str]:
    """Attention backends this device can train with: flash-attn if installed, flex on CUDA, sdpa, eager."""
    import importlib.util

    if device.type != "cuda":
        return ["sdpa", "eager"]  # FlexAttention has no backward on CPU
    found = ["flash_attention_2"] if importlib.util.find_spec("flash_attn") else []
    return found + ["flex_attention", "sdpa", "eager"]


def build_llama2_7b(directory: Path, device) -> float:
    """Random Llama-2-7B-shaped weights, built on the GPU in bf16 and saved once; returns the seconds spent."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    started = time.perf_counter()
    if not any(directory.glob("*.safetensors")):
        with torch.device(device):
            torch.manual_seed(0)
            model = LlamaForCausalLM(LlamaConfig(**LLAMA2_7B)).to(torch.bfloat16)
        model.save_pretrained(directory, safe_serialization=True, max_shard_size="20GB")
        del model
        free_memory(device)
    return time.perf_counter() - started


def llama2_7b_suite(args, device, peak_tflops, context) -> dict:
    """LoRA and QLoRA at 1 x 2048 (planner beside the measured peak), then LoRA at 1 x 4096 per attention backend."""
    import torch

    from ft_assets.cli.plan import plan_request
    from ft_assets.control.planner import ModelShape, estimate_vram, flops_per_token
    from ft_assets.training.config import TrainingConfig

    if device.type != "cuda":
        raise SystemExit("--shape llama2-7b needs a CUDA GPU (~20 GiB)")
    directory = cache_dir() / "models" / "llama2-7b-random"
    build_seconds = build_llama2_7b(directory, device)
    shape = ModelShape.from_config(LLAMA2_7B, "llama2-7b-shape")
    steps, warmup = args.steps or SEVEN_B_STEPS, SEVEN_B_WARMUP

    def run(model, optimizer, method: str, seq_len: int, documents: int) -> dict:
        free_memory(device)  # the peak from here on: the loaded model plus this configuration's steps
        used = model.config._attn_implementation
        name = {"method": method, "seq_len": seq_len, "documents": documents, "attention": used}
        try:
            ids = torch.randint(0, shape.vocab, (1, seq_len), generator=torch.Generator().manual_seed(0)).to(device)
            position_ids = torch.cat([torch.arange(seq_len // documents)] * documents).unsqueeze(0).to(device)
            batch = {"input_ids": ids, "labels": ids, "position_ids": position_ids}
            elapsed, real, slots, loss = timed_steps(
                model, optimizer, lambda step: (batch, seq_len), device, steps, warmup
            )
        except torch.OutOfMemoryError as exc:
            optimizer.zero_grad(set_to_none=True)
            return {**name, "error": f"out of memory: {str(exc)[:200]}"}
        result = figures(
            name,
            elapsed,
            real,
            slots,
            steps,
            flops_per_token(shape, method, seq_len, True),
            peak_tflops,
            device,
            context,
            loss,
        )
        settings = TrainingConfig(per_device_batch_size=1, gradient_checkpointing=True, attn_implementation=used)
        planned = estimate_vram(plan_request(shape, method, seq_len, seq_len, settings))
        result["planner_total_gib"] = planned.total_gib
        result["planner"] = planned.as_dict()
        return result

    results, attention = [], []
    for method in ("lora", "qlora"):
        free_memory(device)
        model, optimizer = load(method, directory, device, "auto", 4096, checkpointing=True)
        results.append(run(model, optimizer, method, 2048, 4))
        if method == "lora":  # the same loaded model through each backend (transformers switches in place)
            for backend in backends(device):
                model.set_attn_implementation(backend)
                attention.append(run(model, optimizer, method, 4096, 8))
        del model, optimizer
    print(table(
        ["method", "tokens", "attention", "s/step", "tokens/s", "MFU", "peak GiB (+context)", "planner GiB"],
        [[r["method"], r["seq_len"], r["attention"], *(["out of memory", "", "", "", ""] if "error" in r else [
          f"{r['seconds_per_step']:.3f}", fmt(r["real_tokens_per_s"]), "-" if r["mfu"] is None else f"{r['mfu']:.1%}",
          "-" if r["peak_with_context_gib"] is None else f"{r['peak_with_context_gib']:.1f}", f"{r['planner_total_gib']:.1f}"])]
         for r in results + attention],
    ))  # fmt: skip
    return {"build_seconds": round(build_seconds, 1), "results": results, "attention": attention}


def build_gpt_oss(directory: Path, device, shape: dict, layers: int) -> float:
    """Random gpt-oss-shaped weights with ``layers`` layers (alternating sliding and full attention), saved once."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    started = time.perf_counter()
    if not any(directory.glob("*.safetensors")):
        types = ["sliding_attention", "full_attention"] * (layers // 2) + ["sliding_attention"] * (layers % 2)
        config = GptOssConfig(**shape, num_hidden_layers=layers, layer_types=types)
        with torch.device(device):
            torch.manual_seed(0)
            model = GptOssForCausalLM(config).to(torch.bfloat16 if device.type == "cuda" else torch.float32)
        model.save_pretrained(directory, safe_serialization=True, max_shard_size="20GB")
        del model
        free_memory(device)
    return time.perf_counter() - started


def moe_suite(args, device, peak_tflops, context) -> dict:
    """LoRA on the attention and every expert of gpt-oss-20b's shape (``MOE_LAYERS`` layers), 1 x 2048 packed tokens."""
    import torch

    from ft_assets.cli.plan import plan_request
    from ft_assets.control.planner import ModelShape, estimate_vram, flops_per_token
    from ft_assets.training.config import TrainingConfig

    smoke = device.type != "cuda"
    shape_config, seq_len = (GPT_OSS_SMOKE, 64) if smoke else (GPT_OSS_20B, 2048)
    directory = cache_dir() / "models" / ("gpt-oss-smoke" if smoke else f"gpt-oss-20b-{MOE_LAYERS}-layers-random")
    build_seconds = build_gpt_oss(directory, device, shape_config, MOE_LAYERS)
    config = json.loads((directory / "config.json").read_text())
    shape = ModelShape.from_config(config, "gpt-oss-20b-shape")
    steps, warmup = (2, 1) if smoke else (args.steps or SEVEN_B_STEPS, SEVEN_B_WARMUP)
    free_memory(device)
    model, optimizer = load("lora", directory, device, "auto", seq_len, checkpointing=True)
    documents = 4
    ids = torch.randint(0, shape.vocab, (1, seq_len), generator=torch.Generator().manual_seed(0)).to(device)
    position_ids = torch.cat([torch.arange(seq_len // documents)] * documents).unsqueeze(0).to(device)
    batch = {"input_ids": ids, "labels": ids, "position_ids": position_ids}
    used = model.config._attn_implementation
    experts = model.config._experts_implementation
    free_memory(device)
    elapsed, real, slots, loss = timed_steps(model, optimizer, lambda step: (batch, seq_len), device, steps, warmup)
    name = {"method": "lora", "seq_len": seq_len, "documents": documents, "attention": used, "experts": experts}
    result = figures(name, elapsed, real, slots, steps, flops_per_token(shape, "lora", seq_len, True), peak_tflops,
                     device, context, loss)  # fmt: skip
    settings = TrainingConfig(per_device_batch_size=1, gradient_checkpointing=True, attn_implementation=used)
    planned = estimate_vram(plan_request(shape, "lora", seq_len, seq_len, settings.for_base(shape.experts)))
    result.update(planner_total_gib=planned.total_gib, planner=planned.as_dict(), params=shape.describe_params(),
                  layers=MOE_LAYERS, trainable=sum(p.numel() for p in model.parameters() if p.requires_grad))  # fmt: skip
    del model, optimizer
    print(table(
        ["shape", "experts run", "s/step", "tokens/s", "MFU (active)", "peak GiB (+context)", "planner GiB"],
        [[result["params"], experts, f"{result['seconds_per_step']:.3f}", fmt(result["real_tokens_per_s"]),
          "-" if result["mfu"] is None else f"{result['mfu']:.1%}",
          "-" if result["peak_with_context_gib"] is None else f"{result['peak_with_context_gib']:.1f}",
          f"{result['planner_total_gib']:.1f}"]],
    ))  # fmt: skip
    return {"build_seconds": round(build_seconds, 1), "result": result}


def qwen_image_processor():
    """Qwen2.5-VL-7B-Instruct's image processor, from its preprocessor_config.json as the planner ships it."""
    from transformers import Qwen2VLImageProcessorPil

    from ft_assets.control.shipped_configs import shipped_preprocessor

    rules = shipped_preprocessor(QWEN2_5_VL_7B)
    return Qwen2VLImageProcessorPil(
        **{k: v for k, v in rules.items() if k not in ("image_processor_type", "processor_class")}
    )


def build_qwen2_5_vl(directory: Path, device, smoke: bool) -> float:
    """Random Qwen2.5-VL-7B-shaped weights (``smoke``: shrunk) with a processor of the released image rules and the
    tests' Qwen tokenizer, built on ``device`` in bf16 and saved once; returns the seconds spent."""
    import torch
    import transformers
    from transformers import AutoModelForImageTextToText, Qwen2_5_VLConfig

    from ft_assets.control.shipped_configs import shipped_config
    from ft_assets.vision import save_processor, takes_video, without_video
    from ft_assets_tests.vlm_families import QWEN_TOKENS, build_vlm_tokenizer

    started = time.perf_counter()
    if any(directory.glob("*.safetensors")):
        return time.perf_counter() - started
    tokenizer = build_vlm_tokenizer(QWEN_TOKENS)
    config = shipped_config(QWEN2_5_VL_7B)
    config.update(
        {key: tokenizer.convert_tokens_to_ids(token) for key, token in (
            ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
            ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))},
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    if smoke:
        config.update(VLM_SMOKE_TEXT, vision_config={**config["vision_config"], **VLM_SMOKE_VISION})
    with torch.device(device):
        torch.manual_seed(0)
        model = AutoModelForImageTextToText.from_config(
            Qwen2_5_VLConfig(**config), dtype=torch.bfloat16 if device.type == "cuda" else torch.float32
        )
    model.save_pretrained(directory, safe_serialization=True, max_shard_size="20GB")
    del model
    free_memory(device)
    with without_video():
        processor = transformers.Qwen2_5_VLProcessor(
            image_processor=qwen_image_processor(), tokenizer=tokenizer, chat_template=QWEN_TOKENS.template,
            **({"video_processor": None} if takes_video("Qwen2_5_VLProcessor") else {}),
        )  # fmt: skip
    save_processor(processor, directory)
    return time.perf_counter() - started


def vlm_suite(args, device, peak_tflops, context) -> dict:
    """QLoRA on Qwen2.5-VL-7B's shape, one 1024 x 1024 picture and its conversation a row, beside the planner."""
    from dataclasses import replace

    from benchmarks.vlm_step import measure, picture_shards
    from ft_assets.cli.plan import plan_request
    from ft_assets.control.model_shape import ImageLoad
    from ft_assets.control.planner import ModelShape, estimate_vram, flops_per_token
    from ft_assets.control.shipped_configs import shipped_preprocessor
    from ft_assets.training.config import TrainingConfig
    from ft_assets_tests.vlm_families import picture

    smoke = device.type != "cuda"
    side, seq_len = (VLM_SMOKE_PICTURE, VLM_SMOKE_SEQ_LEN) if smoke else (VLM_PICTURE, VLM_SEQ_LEN)
    directory = cache_dir() / "models" / ("qwen2.5-vl-smoke" if smoke else "qwen2.5-vl-7b-random")
    build_seconds = build_qwen2_5_vl(directory, device, smoke)
    answer = "A field of colored noise: every pixel drawn at random, no shape, no text, nothing in focus. " * 2
    pictures = [(picture("red", (side, side), seed=i), "Describe the picture.", answer) for i in range(VLM_ROWS)]
    shards = picture_shards(directory, cache_dir() / "work" / "gpu-step-vlm", pictures, seq_len)
    config = json.loads((directory / "config.json").read_text())
    shape = ModelShape.from_config(config, "qwen2.5-vl-7b-shape", processor=shipped_preprocessor(QWEN2_5_VL_7B))
    images = ImageLoad.of_shards({**shards, "train_packed_rows": shards["rows"]})
    steps, warmup = (2, 1) if smoke else (args.steps or SEVEN_B_STEPS, SEVEN_B_WARMUP)
    free_memory(device)
    flops = flops_per_token(shape, "qlora", seq_len, True, images=images)
    result = measure(directory, shards, device, seq_len, 1, steps, warmup, method="qlora", checkpointing=True,
                     peak_tflops=peak_tflops, flops_per_token=flops)  # fmt: skip
    settings = TrainingConfig(per_device_batch_size=1, gradient_checkpointing=True)
    planned = estimate_vram(replace(plan_request(shape, "qlora", seq_len, seq_len, settings), images=images))
    peak = result["peak_memory_gib"]
    result.update(
        picture_px=side, tokens_per_image=images.tokens_per_image, params=shape.describe_params(),
        planner_total_gib=planned.total_gib, planner=planned.as_dict(),
        peak_with_context_gib=peak + context if peak is not None and context is not None else None,
    )  # fmt: skip
    print(table(
        ["shape", "picture", "image tokens", "s/step", "images/s", "tokens/s", "pixels", "MFU", "peak GiB (+context)",
         "planner GiB"],
        [[result["params"], f"{side} px", fmt(images.tokens_per_image), f"{result['seconds_per_step']:.3f}",
          f"{result['images_per_s']:.2f}", fmt(result["real_tokens_per_s"]), f"{result['pixel_share']:.0%}",
          "-" if result["mfu"] is None else f"{result['mfu']:.1%}",
          "-" if result["peak_with_context_gib"] is None else f"{result['peak_with_context_gib']:.1f}",
          f"{result['planner_total_gib']:.1f}"]],
    ))  # fmt: skip
    return {"build_seconds": round(build_seconds, 1), "result": result}


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description="LoRA/QLoRA step throughput and memory on a GPU, beside the planner.")
    parser.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="run 2 tiny steps of the smollm2, gpt-oss-20b and qwen2.5-vl-7b suites on CPU (no figures)",
    )
    parser.add_argument(
        "--shape",
        default="smollm2",
        help="comma-separated suites: smollm2, llama2-7b, gpt-oss-20b, qwen2.5-vl-7b (default smollm2)",
    )
    parser.add_argument(
        "--model",
        type=Path,
        help="HF model directory for smollm2 (default: SmolLM2-135M-Instruct; --cpu-smoke: tiny.py's model)",
    )
    parser.add_argument(
        "--steps", type=int, help=f"timed steps per configuration (default {STEPS}; llama2-7b {SEVEN_B_STEPS})"
    )
    parser.add_argument("--methods", default="lora,qlora", help="smollm2 suite: methods to compare packed vs padded")
    parser.add_argument(
        "--peak-tflops", type=float, help="the GPU's dense bf16 peak for MFU (default: datasheet value by name)"
    )
    args = parser.parse_args(argv)
    import torch

    if args.cpu_smoke:
        device = torch.device("cpu")
        torch.set_num_threads(1)
        suites = ["smollm2", "gpt-oss-20b", "qwen2.5-vl-7b"]
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run on a GPU machine, or use --cpu-smoke to check the script")
        device = torch.device("cuda")
        torch.ones(1, device=device)  # create the CUDA context before measuring it
        suites = args.shape.split(",")
    unknown = set(suites) - set(SUITES)
    if unknown:
        raise SystemExit(f"unknown --shape {sorted(unknown)}: use {', '.join(SUITES)}")
    started = time.perf_counter()
    peak_tflops = device_peak_tflops(device, args.peak_tflops)
    context = cuda_context_gib(device) if device.type == "cuda" else None
    summary = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke run: not a measurement)",
        "peak_bf16_tflops": peak_tflops,
        "cuda_context_gib": context,
    }
    if "smollm2" in suites:
        summary.update(smollm2_suite(args, device, peak_tflops, context))
    if "llama2-7b" in suites:
        summary["llama2_7b"] = llama2_7b_suite(args, device, peak_tflops, context)
    if "gpt-oss-20b" in suites:
        summary["gpt_oss_20b"] = moe_suite(args, device, peak_tflops, context)
    if "qwen2.5-vl-7b" in suites:
        summary["qwen2_5_vl_7b"] = vlm_suite(args, device, peak_tflops, context)
    summary["benchmark_seconds"] = round(time.perf_counter() - started, 1)
    write_result("gpu_step_cpu_smoke" if args.cpu_smoke else "gpu_step", summary, argv)
    return summary


if __name__ == "__main__":
    main()
