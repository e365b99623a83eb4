"""A vision-language model's training step: images/s and tokens/s, the pixels' share of the step, on CPU.

    python -m benchmarks.vlm_step            # every tiny family and the demo's SmolVLM (~1 min on 2 cores)
    python -m benchmarks.vlm_step --quick    # two tiny families, 2 steps each: checks the script, no figures

Every step is the recipe's, as ``lora_adapter`` runs it: the packed rows of the data plane (each picture expanded
into its image tokens by the model's processor, stored once by content), ``load_model`` (LoRA r=16 on every
projection of the language model), then per step the host work of ``TokenLossStep.rollout`` (the pictures decoded
and turned into each family's pixel inputs: Qwen's patches and M-RoPE positions, Gemma 3's masks, Idefics3's
tiles) and the model's step (``token_loss_sum``, backward, AdamW). Both are timed, so images/s and tokens/s are
of the whole step; the pixels' share says how much of it the host spends before the model sees a picture.

Models:

- each family of ``ft_assets_tests/vlm_families.py`` at toy size (text 2 layers of 128, vision 2-4 layers of 64;
  their processors' own resize rules): the pictures' cost beside a model too small to hide it;
- ``demo``: the demo's SmolVLM (``scripts/make_demo_vlm.py``: SmolLM2-135M-Instruct's 30 layers, a 0.7M-parameter
  vision side, 16 image tokens a picture) at ``make demo-vision``'s settings (``train_vision: projector``, one
  512-token row a step): what a step costs on a CPU.

The pictures and questions are the shipped ``samples/shapes`` (48-96 px). ``measure`` is also what
``benchmarks/gpu_step.py --shape qwen2.5-vl-7b`` times on a GPU. Writes ``benchmarks/results/vlm_step.json``
(``--quick``: under the cache, marked as not a measurement).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from benchmarks.common import ROOT, cache_dir, fmt, smollm2_dir, table, write_result
from benchmarks.gpu_step import load_configured

SAMPLE = ROOT / "samples" / "shapes"
TINY_FAMILIES = ("qwen2_5_vl", "qwen3_vl", "gemma3", "idefics3", "smolvlm")
QUICK_FAMILIES = ("qwen2_5_vl", "smolvlm")
TINY = dict(seq_len=256, batch=2, steps=20, warmup=3)  # a step of ~10 pictures: long enough to time on a tiny model
DEMO = dict(seq_len=512, batch=1, steps=5, warmup=1, train_vision="projector")  # make demo-vision's lora_adapter
QUICK = dict(steps=2, warmup=1)
ROWS = 120  # sample rows made into shards: enough for every step to take other rows
QUICK_ROWS = 16


def decodes(path: Path) -> bool:
    """Whether a picture file is there and decodes whole (the sample's broken ones, on purpose, do not)."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            image.load()
    except (OSError, SyntaxError):
        return False
    return True


def sample_rows(limit: int) -> list[tuple[str, str, str]]:
    """(picture file, question, answer) of the first ``limit`` rows of samples/shapes/chat.jsonl that name a file that
    decodes."""
    rows = []
    for line in (SAMPLE / "chat.jsonl").read_text().splitlines():
        messages = json.loads(line)["messages"]
        parts = {part["type"]: part for part in messages[0]["content"]}
        image = parts.get("image", {}).get("image", "")
        if image.startswith("images/") and decodes(SAMPLE / image):
            rows.append((image, parts["text"]["text"], messages[1]["content"]))
        if len(rows) == limit:
            break
    return rows


def picture_shards(model_dir: Path, work: Path, pictures: list[tuple[bytes, str, str]], seq_len: int) -> dict:
    """Packed train shards of (picture bytes, question, answer) rows made by the data plane's encoder and packer, the
    pictures stored once by content and fetched beside the shards as the trainer fetches them; the packing's counts."""
    import shutil

    import pyarrow.parquet as pq

    from ft_assets.data.chat_encoding import TokenizerFiles
    from ft_assets.data.images import ImagePool, image_ref
    from ft_assets.data.packing import IMAGE_EXAMPLES
    from ft_assets.data.tokenizing import tokenize_and_pack
    from ft_assets.shards import fetch_images, shard_files
    from ft_assets.storage import LocalStore

    shutil.rmtree(work, ignore_errors=True)
    store, pool = LocalStore(work / "store"), "images/bench"
    rows = []
    for i, (data, question, answer) in enumerate(pictures):
        ref = image_ref(data, "png" if data.startswith(b"\x89PNG") else "jpg")
        store.put_bytes(f"{pool}/{ref}", data)
        turns = [{"role": "user", "content": f"<image>{question}", "images": [ref]},
                 {"role": "assistant", "content": answer}]  # fmt: skip
        rows.append((f"row-{i}", turns))
    shards = work / "shards"
    shards.mkdir(parents=True)
    encoder = TokenizerFiles.from_dir(model_dir).encoder(ImagePool(store.url, pool))
    stats = tokenize_and_pack(iter(rows), encoder, seq_len, shards, "train", kind=IMAGE_EXAMPLES)
    if stats.rejected:
        raise SystemExit(f"{model_dir.name}: the data plane refused {len(stats.rejected)} rows: {stats.rejected[:2]}")
    fetch_images(store, pool, shards)
    files = shard_files(shards, "train")  # the order load_packed_rows reads them in
    row_tokens = [sum(n) for f in files for n in pq.read_table(f, columns=["seq_lens"]).column("seq_lens").to_pylist()]
    return {"dir": shards, "row_tokens": row_tokens, "examples": stats.examples, "images": stats.images,
            "image_tokens": stats.image_tokens, "tokens": stats.tokens, "rows": stats.rows}  # fmt: skip


def measure(
    model_dir: Path, shards: dict, device, seq_len: int, batch: int, steps: int, warmup: int,
    method: str = "lora", train_vision: str = "none", checkpointing: bool = False, peak_tflops: float | None = None,
    flops_per_token: float | None = None,
) -> dict:  # fmt: skip
    """The recipe's step on ``shards``' packed rows, ``batch`` rows a step: the host's pixel inputs and the model's
    forward, backward and AdamW step, each timed over ``steps`` steps after ``warmup``; images/s, tokens/s, peak memory
    and (with the device's ``peak_tflops`` and the planner's ``flops_per_token``) MFU."""
    import torch

    from ft_assets.shards import load_packed_rows
    from ft_assets.training.config import TrainingConfig
    from ft_assets.training.loss import learned_tokens, to_device, token_loss_sum
    from ft_assets.training.model import trainable_parameters
    from ft_assets.training.steps import TokenLossStep
    from ft_assets.vision import image_token_id, read_config

    cuda = device.type == "cuda"
    image_token = image_token_id(read_config(model_dir))
    config = TrainingConfig(
        method=method, max_seq_len=seq_len, train_vision=train_vision, gradient_checkpointing=checkpointing
    )
    model, optimizer = load_configured(config, model_dir, device)
    step_run = TokenLossStep().for_run(config, model_dir, model)
    rows = load_packed_rows(shards["dir"], "train", seq_len)
    order = list(range(len(rows)))
    random.Random(0).shuffle(order)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    pixels_s = model_s = 0.0
    images = real = image_tokens = 0
    for step in range(warmup + steps):
        pick = [order[(step * batch + i) % len(order)] for i in range(batch)]
        started = time.perf_counter()
        host = step_run.rollout(None, rows.batch(pick, torch.device("cpu")), step, 0, 0)
        prepared = time.perf_counter()
        inputs = to_device(host, device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda and torch.cuda.is_bf16_supported()):
            loss = token_loss_sum(model, inputs) / max(learned_tokens(inputs), 1)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(device)
        if step >= warmup:
            pixels_s += prepared - started
            model_s += time.perf_counter() - prepared
            images += sum(len(rows.images[i]) for i in pick)
            real += sum(shards["row_tokens"][i] for i in pick)
            image_tokens += int((rows.input_ids[pick] == image_token).sum())
    wall = pixels_s + model_s
    tokens_per_s = real / wall
    figures = {
        "method": method, "train_vision": train_vision, "batch": batch, "seq_len": seq_len, "steps": steps,
        "seconds_per_step": wall / steps, "pixel_seconds_per_step": pixels_s / steps, "pixel_share": pixels_s / wall,
        "images_per_step": images / steps, "images_per_s": images / wall, "real_tokens_per_s": tokens_per_s,
        "image_token_share": image_tokens / real, "final_loss": float(loss.detach()),
        "trainable": sum(p.numel() for p in trainable_parameters(model).values()),
        "peak_memory_gib": torch.cuda.max_memory_reserved(device) / 2**30 if cuda else None,
        "mfu": tokens_per_s * flops_per_token / (peak_tflops * 1e12) if peak_tflops and flops_per_token else None,
    }  # fmt: skip
    del model, optimizer
    return figures


def sample_pictures(count: int) -> list[tuple[bytes, str, str]]:
    return [((SAMPLE / image).read_bytes(), question, answer) for image, question, answer in sample_rows(count)]


def run_model(name: str, model_dir: Path, settings: dict, pictures: list) -> dict:
    import torch

    shards = picture_shards(model_dir, cache_dir() / "work" / f"vlm-step-{name}", pictures, settings["seq_len"])
    figures = measure(model_dir, shards, torch.device("cpu"), **settings)
    shape = {k: shards[k] for k in ("examples", "images", "image_tokens", "tokens", "rows")}
    return {"model": name, "shards": shape, **figures}


def tiny_dir(family: str) -> Path:
    """The family's tiny model of the tests' VLM matrix, built once into the cache."""
    out = cache_dir() / "models" / f"tiny-vlm-{family}"
    if not (out / "config.json").is_file():
        from ft_assets_tests.vlm_families import build_vlm

        build_vlm(family, out)
    return out


def demo_dir() -> Path:
    """The demo's SmolVLM (scripts/make_demo_vlm.py), built once into the cache from SmolLM2-135M-Instruct."""
    out = cache_dir() / "models" / "demo-vlm"
    if not (out / "model.safetensors").is_file():
        from scripts.make_demo_vlm import build_demo_vlm

        build_demo_vlm(out, smollm2_dir())
    return out


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description="A VLM training step on CPU: images/s, tokens/s, the pixels' share.")
    parser.add_argument("--quick", action="store_true", help="two tiny families, 2 steps each: a smoke run")
    parser.add_argument("--families", help=f"comma-separated tiny families (default: {','.join(TINY_FAMILIES)})")
    parser.add_argument("--no-demo", action="store_true", help="leave out the demo's SmolVLM (SmolLM2-135M)")
    args = parser.parse_args(argv)
    import torch

    torch.manual_seed(0)
    started = time.perf_counter()
    families = args.families.split(",") if args.families else list(QUICK_FAMILIES if args.quick else TINY_FAMILIES)
    unknown = sorted(set(families) - set(TINY_FAMILIES))
    if unknown:
        raise SystemExit(f"unknown --families {unknown}: choose from {', '.join(TINY_FAMILIES)}")
    pictures = sample_pictures(QUICK_ROWS if args.quick else ROWS)
    tiny = {**TINY, **(QUICK if args.quick else {})}
    results = [run_model(family, tiny_dir(family), tiny, pictures) for family in families]
    if not (args.quick or args.no_demo):
        results.append(run_model("demo", demo_dir(), DEMO, pictures))
    print(table(
        ["model", "rows x tokens", "images/step", "s/step", "pixels", "images/s", "real tokens/s", "image tokens"],
        [[r["model"], f"{r['batch']} x {r['seq_len']}", fmt(r["images_per_step"], 1), f"{r['seconds_per_step']:.3f}",
          f"{r['pixel_share']:.0%}", fmt(r["images_per_s"], 1), fmt(r["real_tokens_per_s"]), f"{r['image_token_share']:.0%}"]
         for r in results],
    ))  # fmt: skip
    summary = {
        "device": "cpu" + (" (smoke run: not a measurement)" if args.quick else ""),
        "threads": torch.get_num_threads(),
        "pictures": f"samples/shapes/chat.jsonl, the first {len(pictures)} rows that name a picture file (48-96 px)",
        "results": results,
        "benchmark_seconds": round(time.perf_counter() - started, 1),
    }
    write_result("vlm_step", summary, argv)
    return summary


if __name__ == "__main__":
    main()
