"""Data-plane throughput: clean + dedup + split + tokenize + pack on the generated corpus.

``python -m benchmarks.data_plane`` runs, each in its own process so that its peak RSS is its own
(``--quick`` runs them all in its own process, on 300 rows and tiny.py's tokenizer: a smoke run):

- **ours**: the plain functions of the ``data`` assets, in order (``read_dataset`` →
  ``clean_dataset`` → ``deduplicate_dataset`` → ``split_dataset`` → ``tokenize_and_pack``), on the
  corpus at ×1 (200k rows, ≈ 110 MB) and ×4, timed per stage (wall and CPU seconds).
- **ceiling**: the same tokenizer's Rust ``encode_batch`` alone, on exactly the chat-templated texts
  that ours tokenized (written by the ours run after its timed work), in batches of the same size.
  Nothing can tokenize the corpus faster; ratio = ceiling seconds / our seconds.
- **baseline**: the data preparation of the Hugging Face tutorials: rows into ``datasets`` (bad JSON
  lines skipped, formats mapped to chat messages), ``Dataset.map`` rendering each row with
  ``apply_chat_template``, then ``Dataset.map(batched=True)`` tokenizing with ``padding="longest"``,
  truncation at the sequence length and labels copied from the ids. No cleaning, no deduplication.

All three load the tokenizer (and import transformers) inside the timed span, and run with
``TOKENIZERS_PARALLELISM=false``: one core each, so the comparison is per core and does not depend on
what else the machine runs (the benchmark machine is shared). Wall seconds are the headline; CPU
seconds are reported next to them because they move less when other processes compete for the cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

from benchmarks.common import benchmark_model, cache_dir, fmt, last_json, peak_rss_mib, run_child, table, write_result
from benchmarks.corpus import ROWS_PER_UNIT, ensure_corpus

SEQ_LEN = 1024  # packed row length for the corpus (its replies run to ~1,300 tokens; 0.1% are longer)
EVAL_FRACTION = 0.1
QUICK_ROWS = 300
ENV = {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


class Stopwatch:
    """Wall and CPU seconds of named stages."""

    def __init__(self):
        self.stages: dict[str, dict[str, float]] = {}

    def __call__(self, name: str, fn, *args, **kwargs):
        wall, cpu = time.perf_counter(), time.process_time()
        result = fn(*args, **kwargs)
        self.stages[name] = {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu}
        return result

    def total(self, key: str) -> float:
        return sum(stage[key] for stage in self.stages.values())


def data_files(corpus: Path) -> list[tuple[str, Path]]:
    from ft_assets.data.readers import is_data_file

    return [(p.name, p) for p in sorted(corpus.iterdir()) if is_data_file(p.name)]


# --- workers (one per process) -----------------------------------------------------------------------


def work_ours(corpus: Path, work: Path, model_dir: Path, seq_len: int, texts_path: Path | None) -> dict:
    from ft_assets.data.cleaning import CleaningRules, clean_dataset
    from ft_assets.data.dedup import DedupRules, deduplicate_dataset
    from ft_assets.data.packing import ChatEncoder, tokenize_and_pack
    from ft_assets.data.readers import read_dataset
    from ft_assets.data.rows import iter_records
    from ft_assets.data.split import split_dataset

    watch = Stopwatch()
    raw = watch("read", read_dataset, data_files(corpus), work / "raw")
    cleaned = watch("clean", clean_dataset, work / "raw", work / "cleaned", CleaningRules())
    deduplicated = watch("dedup", deduplicate_dataset, work / "cleaned", work / "deduplicated", DedupRules())
    split = watch("split", split_dataset, work / "deduplicated", work / "split", EVAL_FRACTION)

    def load_tokenizer():
        from transformers import AutoTokenizer

        return ChatEncoder(AutoTokenizer.from_pretrained(model_dir))

    encoder = watch("tokenizer_load", load_tokenizer)
    (work / "shards").mkdir(parents=True, exist_ok=True)

    def pack_all():
        out = {}
        for name in ("train", "eval"):
            rows = ((r["source"], r["messages"]) for r in iter_records(work / "split" / f"{name}.parquet"))
            out[name] = tokenize_and_pack(rows, encoder, seq_len, work / "shards", name)
        return out

    packed = watch("tokenize_pack", pack_all)
    peak = peak_rss_mib()  # before the untimed extra below
    if texts_path is not None:
        write_rendered_texts(encoder, work / "split", texts_path)
    tokens = sum(p.tokens for p in packed.values())
    slots = sum(p.slots for p in packed.values())
    return {
        "stages": watch.stages,
        "wall_s": watch.total("wall_s"),
        "cpu_s": watch.total("cpu_s"),
        "rows_in": raw["rows_in"],
        "rows_quarantined": raw["rows_quarantined"] + cleaned["rows_quarantined"] + sum(len(p.rejected) for p in packed.values()),
        "exact_duplicates": deduplicated["exact_duplicates"],
        "near_duplicates": deduplicated["near_duplicates"],
        "train_rows": split["train_rows"],
        "eval_rows": split["eval_rows"],
        "examples": sum(p.examples for p in packed.values()),
        "tokens": tokens,
        "loss_tokens": sum(p.loss_tokens for p in packed.values()),
        "packed_rows": sum(p.rows for p in packed.values()),
        "packing_efficiency": tokens / slots if slots else 0.0,
        "peak_rss_mib_self": peak,
    }


def write_rendered_texts(encoder, split_dir: Path, texts_path: Path) -> None:
    """The ceiling's input, untimed: the chat-templated text of every row that ours tokenized."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ft_assets.data.readers import RowError
    from ft_assets.data.rows import iter_batches

    schema = pa.schema([("text", pa.large_string())])
    with pq.ParquetWriter(texts_path, schema) as writer:
        for name in ("train", "eval"):
            for batch in iter_batches(split_dir / f"{name}.parquet", columns=["messages"]):
                texts = []
                for messages in batch.column("messages").to_pylist():
                    try:
                        texts.append(encoder.render(messages)[0])
                    except RowError:
                        pass  # ours rejects these before tokenizing
                writer.write_table(pa.table({"text": pa.array(texts, type=pa.large_string())}, schema=schema))


def work_ceiling(texts_path: Path, model_dir: Path) -> dict:
    import pyarrow.parquet as pq

    from ft_assets.data.packing import TOKENIZE_BATCH

    texts = pq.read_table(texts_path).column("text").to_pylist()  # input, not timed
    wall, cpu = time.perf_counter(), time.process_time()
    from transformers import AutoTokenizer

    backend = AutoTokenizer.from_pretrained(model_dir).backend_tokenizer
    load_s = time.perf_counter() - wall
    tokens = 0
    for start in range(0, len(texts), TOKENIZE_BATCH):
        tokens += sum(len(e) for e in backend.encode_batch(texts[start : start + TOKENIZE_BATCH], add_special_tokens=False))
    return {
        "wall_s": time.perf_counter() - wall,
        "cpu_s": time.process_time() - cpu,
        "tokenizer_load_s": load_s,
        "texts": len(texts),
        "tokens": tokens,
        "peak_rss_mib_self": peak_rss_mib(),
    }


SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}


def to_messages(record) -> list[dict] | None:
    """The tutorials' format conversion: ShareGPT and alpaca rows to chat messages."""
    if not isinstance(record, dict):
        return None
    if "messages" in record:
        return record["messages"]
    if "conversations" in record:
        return [{"role": SHAREGPT_ROLES.get(t["from"], t["from"]), "content": t["value"]} for t in record["conversations"]]
    if "instruction" in record and "output" in record:
        prompt = record["instruction"] + (f"\n\n{record['input']}" if record.get("input") else "")
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": record["output"]}]
    return None


def work_baseline(corpus: Path, work: Path, model_dir: Path, seq_len: int) -> dict:
    wall, cpu = time.perf_counter(), time.process_time()
    import datasets
    from transformers import AutoTokenizer

    datasets.disable_progress_bars()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    files = data_files(corpus)
    lines = 0

    def records():
        nonlocal lines
        for _, path in files:
            with open(path, encoding="utf-8") as handle:
                for line in handle:
                    lines += 1
                    try:
                        messages = to_messages(json.loads(line))
                    except (json.JSONDecodeError, KeyError, TypeError):
                        continue
                    if messages:
                        yield {"messages": messages}

    cache = work / "hf_datasets_cache"
    dataset = datasets.Dataset.from_generator(records, cache_dir=str(cache))
    dataset = dataset.map(
        lambda row: {"text": tokenizer.apply_chat_template(row["messages"], tokenize=False)}, remove_columns=["messages"]
    )

    def tokenize(batch):
        encoded = tokenizer(batch["text"], padding="longest", truncation=True, max_length=seq_len)
        encoded["labels"] = [
            [token if keep else -100 for token, keep in zip(ids, mask)]
            for ids, mask in zip(encoded["input_ids"], encoded["attention_mask"])
        ]
        return encoded

    dataset = dataset.map(tokenize, batched=True, remove_columns=["text"])
    elapsed, cpu_s = time.perf_counter() - wall, time.process_time() - cpu
    lengths = dataset.with_format("numpy", columns=["attention_mask"])
    tokens = slots = 0
    for start in range(0, len(dataset), 10_000):
        masks = lengths[start : start + 10_000]["attention_mask"]
        tokens += int(sum(m.sum() for m in masks))
        slots += int(sum(len(m) for m in masks))
    return {
        "wall_s": elapsed,
        "cpu_s": cpu_s,
        "rows_in": lines,
        "examples": len(dataset),
        "tokens": tokens,
        "slots": slots,
        "padding_efficiency": tokens / slots if slots else 0.0,
        "peak_rss_mib_self": peak_rss_mib(),
    }


def run_kind(kind: str, work: Path, model: Path, corpus: Path | None = None, seq_len: int = SEQ_LEN, render_texts: bool = False) -> dict:
    texts = work / "ceiling_texts.parquet"
    if kind == "ours":
        return work_ours(corpus, work, model, seq_len, texts if render_texts else None)
    if kind == "ceiling":
        return work_ceiling(texts, model)
    return work_baseline(corpus, work, model, seq_len)


def worker(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.data_plane worker")
    parser.add_argument("kind", choices=["ours", "ceiling", "baseline"])
    parser.add_argument("--corpus", type=Path)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--seq-len", type=int, default=SEQ_LEN)
    parser.add_argument("--render-texts", action="store_true", help="ours: write the ceiling's input afterwards (untimed)")
    args = parser.parse_args(argv)
    print(json.dumps(run_kind(args.kind, args.work, args.model, args.corpus, args.seq_len, args.render_texts)))


# --- orchestration -----------------------------------------------------------------------------------


def run_worker(kind: str, in_process: bool, render_texts: bool = False, **options) -> dict:
    """Run one measurement in its own process (its peak RSS its own), or in this one (--quick)."""
    if in_process:
        result = run_kind(kind, render_texts=render_texts, **options)
        result["peak_rss_mib"] = round(result.pop("peak_rss_mib_self"), 1)  # this whole process's
        return result
    argv = ["-m", "benchmarks.data_plane", "worker", kind] + (["--render-texts"] if render_texts else [])
    for key, value in options.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    child = run_child(argv, env=ENV)
    if child.returncode != 0:
        raise RuntimeError(f"data_plane worker {kind} failed (exit {child.returncode}):\n{child.output[-4000:]}")
    result = last_json(child.output)
    # The worker's own VmHWM at the end of its timed work (ours then renders the ceiling's input).
    result["peak_rss_mib"] = round(result.pop("peak_rss_mib_self"), 1)
    result["peak_rss_mib_whole_process"] = round(child.peak_rss_mib, 1)
    result["child_wall_s"] = round(child.wall_seconds, 2)
    result["child_cpu_s"] = round(child.cpu_seconds, 2)
    return result


def measure(rows_per_unit: int, scales: list[int], baseline: bool, model: Path, in_process: bool, log=print) -> dict:
    runs: dict[str, dict] = {}
    for scale in scales:
        corpus, counts = ensure_corpus(cache_dir(), scale, rows_per_unit)
        work = cache_dir() / "work" / f"data-plane-x{scale}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        log(f"x{scale}: {counts['lines']:,} lines, {counts['bytes'] / 1e6:,.1f} MB; ours …")
        ours = run_worker("ours", in_process, scale == scales[0], corpus=corpus, work=work, model=model, seq_len=SEQ_LEN)
        runs[f"ours_x{scale}"] = {"corpus": counts, **ours}
        (work / "corpus.txt").write_text(f"{corpus}\n{model}")  # benchmarks.packing reuses these shards
        if scale == scales[0]:
            log(f"x{scale}: ceiling …")
            runs[f"ceiling_x{scale}"] = run_worker("ceiling", in_process, work=work, model=model)
            if baseline:
                log(f"x{scale}: baseline …")
                runs[f"baseline_x{scale}"] = run_worker(
                    "baseline", in_process, corpus=corpus, work=work / "baseline", model=model, seq_len=SEQ_LEN
                )
                shutil.rmtree(work / "baseline", ignore_errors=True)
        if scale != scales[0]:
            shutil.rmtree(work, ignore_errors=True)  # keep x1's shards for the packing benchmark
    return runs


def summarize(runs: dict, scales: list[int]) -> dict:
    first, last = f"x{scales[0]}", f"x{scales[-1]}"
    ours, ceiling = runs[f"ours_{first}"], runs[f"ceiling_{first}"]
    summary = {
        "rows_per_s": ours["rows_in"] / ours["wall_s"],
        "tokens_per_s": ours["tokens"] / ours["wall_s"],
        "ceiling_tokens_per_s": ceiling["tokens"] / ceiling["wall_s"],
        "ratio_to_ceiling": ceiling["wall_s"] / ours["wall_s"],
        "ratio_to_ceiling_cpu": ceiling["cpu_s"] / ours["cpu_s"],
        "peak_rss_mib": {f"x{s}": runs[f"ours_x{s}"]["peak_rss_mib"] for s in scales},
        "peak_rss_growth": runs[f"ours_{last}"]["peak_rss_mib"] / ours["peak_rss_mib"],
    }
    if f"baseline_{first}" in runs:
        baseline = runs[f"baseline_{first}"]
        summary["baseline_rows_per_s"] = baseline["rows_in"] / baseline["wall_s"]
        summary["speedup_over_baseline"] = baseline["wall_s"] / ours["wall_s"]
        summary["speedup_over_baseline_cpu"] = baseline["cpu_s"] / ours["cpu_s"]
    return summary


def report(runs: dict, summary: dict, scales: list[int]) -> str:
    rows = []
    for name, run in runs.items():
        kind, scale = name.rsplit("_", 1)
        rows_in = run.get("rows_in", runs[f"ours_{scale}"]["rows_in"])
        rows.append([
            kind, scale, fmt(rows_in), fmt(run["wall_s"], 1), fmt(run["cpu_s"], 1), fmt(rows_in / run["wall_s"]),
            fmt(run["tokens"] / run["wall_s"]), fmt(run["peak_rss_mib"]),
        ])
    out = [table(["run", "corpus", "rows in", "wall s", "cpu s", "rows/s", "tokens/s", "peak RSS MiB"], rows)]
    first = f"ours_x{scales[0]}"
    out.append("\nstages of " + first + ":\n" + table(
        ["stage", "wall s", "cpu s", "share"],
        [[k, fmt(v["wall_s"], 1), fmt(v["cpu_s"], 1), f"{v['wall_s'] / runs[first]['wall_s']:.0%}"] for k, v in runs[first]["stages"].items()],
    ))
    line = f"\nratio to the tokenizer ceiling {summary['ratio_to_ceiling']:.2f} (cpu {summary['ratio_to_ceiling_cpu']:.2f})"
    if "speedup_over_baseline" in summary:
        line += f"; speedup over the HF-tutorial baseline {summary['speedup_over_baseline']:.1f}x (cpu {summary['speedup_over_baseline_cpu']:.1f}x)"
    line += f"; peak RSS x{scales[-1]} / x{scales[0]} = {summary['peak_rss_growth']:.2f}"
    out.append(line)
    return "\n".join(out)


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        worker(argv[1:])
        return {}
    parser = argparse.ArgumentParser(description="Data-plane throughput vs the tokenizer ceiling and the HF-tutorial baseline.")
    parser.add_argument(
        "--quick", action="store_true",
        help="300 rows, tiny.py's tokenizer, every run in this process (no per-run RSS): a smoke run of every path",
    )
    parser.add_argument("--rows", type=int, help=f"rows of the x1 corpus (default {ROWS_PER_UNIT:,})")
    parser.add_argument("--scales", default="1,4", help="corpus sizes to run, as multiples of --rows")
    parser.add_argument("--no-baseline", action="store_true", help="skip the HF-tutorial baseline")
    args = parser.parse_args(argv)
    rows = args.rows or (QUICK_ROWS if args.quick else ROWS_PER_UNIT)
    scales = [int(s) for s in args.scales.split(",")]
    started = time.perf_counter()
    model_dir, model_name = benchmark_model(args.quick)
    if args.quick:
        os.environ.update(ENV)  # the workers run in this process
    runs = measure(rows, scales, not args.no_baseline, model_dir, in_process=args.quick)
    summary = summarize(runs, scales)
    print(report(runs, summary, scales))
    write_result("data_plane", {
        "rows_per_unit": rows, "scales": scales, "seq_len": SEQ_LEN, "tokenizer": model_name, "summary": summary, "runs": runs,
        "benchmark_seconds": round(time.perf_counter() - started, 1),
    }, argv)
    return summary


if __name__ == "__main__":
    main()
