"""Data-plane throughput on 1 and N cores and on Ray: clean + dedup + split + tokenize + pack.

``python -m benchmarks.data_plane`` runs, each in its own process so that its peak RSS is its own
(``--quick`` runs them all in its own process, on 300 rows in shards of 100 and tiny.py's tokenizer: a
smoke run of every path):

- **ours**: the plain functions of the ``data`` assets, in order (``read_dataset`` →
  ``clean_dataset`` → ``deduplicate_dataset`` → ``split_dataset`` → ``tokenize_splits``), on the
  executor the assets get from ``DataExecutorResource`` (opened the way Dagster opens it): one process
  (``--workers 1``, the corpus at ×1), ``N`` worker processes (×1 and ×4: is a worker's memory
  independent of the corpus?) and a local Ray of ``N`` CPUs started through dagster-ray (×1). Timed
  per stage; the driver's CPU seconds, every worker's CPU seconds and peak RSS (VmHWM) are recorded.
- **ceiling**: the same tokenizer's Rust ``encode_batch`` alone, on exactly the chat-templated texts
  that ours tokenized (written by the ours run after its timed work), in batches of the same size.
  Nothing can tokenize the corpus faster on one core; ratio = ceiling seconds / (our seconds × cores).
- **baseline**: the data preparation of the Hugging Face tutorials: rows into ``datasets`` (bad JSON
  lines skipped, formats mapped to chat messages), ``Dataset.map`` rendering each row with
  ``apply_chat_template``, then ``Dataset.map(batched=True)`` tokenizing with ``padding="longest"``,
  truncation at the sequence length and labels copied from the ids. No cleaning, no deduplication.

Every run loads the tokenizer (and imports transformers) inside the timed span (ours: in each
worker), with ``TOKENIZERS_PARALLELISM=false``: one core per process. The machine is shared: wall
seconds are the headline, CPU seconds are reported next to them because they move less when other
processes compete for the cores, and the load average at the start is recorded with the results.

The sizing table is a projection, not a measurement: from the N-worker run it takes the CPU seconds a
row costs in the workers (spread over the cores) and in the driver (one process, which works while the
workers do: it cuts the inputs into parts, spills the deduplication shuffle, merges the clusters, cuts
the encoded examples into packing windows and adds up the parts' descriptors; the workers write the
parts), the bytes a row that cross the driver's link on a cluster at ``NETWORK_BYTES_S`` (counted from
the run, ``driver_bytes``), and a fixed start-up. The parts go from the workers to the store (S3),
whose bandwidth grows with the cluster and is not modelled.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import socket
import sys
import time
from contextlib import ExitStack
from pathlib import Path

from benchmarks.common import benchmark_model, cache_dir, fmt, last_json, run_child, table, write_result
from benchmarks.corpus import ROWS_PER_UNIT, ensure_corpus
from ft_assets.data.parallel import peak_rss_mib

SEQ_LEN = 1024  # packed row length for the corpus (its replies run to ~1,300 tokens; 0.1% are longer)
EVAL_FRACTION = 0.1
QUICK_ROWS = 300
QUICK_SHARD_ROWS = 100  # --quick: shards small enough that 300 rows are cut into several
NETWORK_BYTES_S = 1.25e9  # projection: one 10 Gb/s link into the driver
PROJECTION_ROWS = (10_000_000, 100_000_000)
PROJECTION_CORES = (16, 64, 256, 1024)
KEY_BYTES = 16  # a row's exact key: back to the driver from the map, out again to the filter
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
    from ft_assets.data.formats import is_data_file

    return [(p.name, p) for p in sorted(corpus.iterdir()) if is_data_file(p.name)]


# --- workers (one per process) -----------------------------------------------------------------------


def work_ours(
    corpus: Path, work: Path, model_dir: Path, seq_len: int, texts_path: Path | None, workers: int = 1, ray: bool = False,
    shard_rows: int = 0,
) -> dict:  # fmt: skip
    import dagster as dg

    from ft_assets.data.chat_encoding import TokenizerFiles
    from ft_assets.data.cleaning import CleaningRules, clean_dataset
    from ft_assets.data.dedup import DedupRules, deduplicate_dataset
    from ft_assets.data.parts import Artifact
    from ft_assets.data.readers import read_dataset
    from ft_assets.data.resources import DataExecutorResource
    from ft_assets.data.split import split_dataset
    from ft_assets.data.tokenizing import tokenize_splits

    settings = {"workers": workers, "ray_address": "local" if ray else ""} | (
        {"shard_rows": shard_rows} if shard_rows else {}
    )
    watch = Stopwatch()
    with ExitStack() as stack:
        init = stack.enter_context(dg.build_init_resource_context())  # its ephemeral instance is closed with it
        opened = DataExecutorResource(**settings).yield_for_execution(init)
        executor = watch("executor_start", stack.enter_context, opened).executor
        out = {name: Artifact.folder(work / name) for name in ("raw", "cleaned", "deduplicated", "split", "shards")}
        raw = watch("read", read_dataset, data_files(corpus), out["raw"], None, executor)
        cleaned = watch("clean", clean_dataset, out["raw"], out["cleaned"], CleaningRules(), executor)
        deduplicated = watch("dedup", deduplicate_dataset, out["cleaned"], out["deduplicated"], DedupRules(), executor)
        split = watch("split", split_dataset, out["deduplicated"], out["split"], EVAL_FRACTION, "ft-assets", executor)
        tokenizer = TokenizerFiles.from_dir(model_dir)
        packed = watch(
            "tokenize_pack",
            tokenize_splits,
            out["split"],
            ("train", "eval"),
            tokenizer,
            seq_len,
            out["shards"],
            executor=executor,
        )
        driver_peak = peak_rss_mib()  # before the untimed extra below
        part_bytes = sum(f.stat().st_size for f in work.rglob("*.parquet"))
        outputs = hashlib.sha256()  # every file the stages wrote, untimed: the same in every mode?
        for path in sorted(work.rglob("*.parquet")):
            outputs.update(str(path.relative_to(work)).encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
        usage = dict(executor.usage)
        kind, workers = executor.kind, executor.workers
    here = f"{socket.gethostname()}:{os.getpid()}"
    others = {w: u for w, u in usage.items() if w != here}
    if texts_path is not None:
        write_rendered_texts(tokenizer.encoder(), out["split"], texts_path)
    tokens = sum(p.tokens for p in packed.values())
    slots = sum(p.slots for p in packed.values())
    wall = watch.total("wall_s")
    return {
        "executor": kind,
        "workers": workers,
        "shard_rows": shard_rows or None,
        "stages": watch.stages,
        "wall_s": wall,
        "cpu_s": watch.total("cpu_s"),  # the driver's (all of it when the executor is in-process)
        "workers_cpu_s": sum(
            u.process_cpu_s for u in others.values()
        ),  # every worker's, imports and tokenizer loads included
        "workers_stage_cpu_s": sum(u.cpu_s for u in others.values()),  # inside stage functions only
        "rows_in": raw["rows_in"],
        "rows_quarantined": raw["rows_quarantined"]
        + cleaned["rows_quarantined"]
        + sum(len(p.rejected) for p in packed.values()),
        "exact_duplicates": deduplicated["exact_duplicates"],
        "near_duplicates": deduplicated["near_duplicates"],
        "train_rows": split["train_rows"],
        "eval_rows": split["eval_rows"],
        "examples": sum(p.examples for p in packed.values()),
        "tokens": tokens,
        "loss_tokens": sum(p.loss_tokens for p in packed.values()),
        "packed_rows": sum(p.rows for p in packed.values()),
        "packing_efficiency": tokens / slots if slots else 0.0,
        "shuffle_bytes": deduplicated["shuffle_bytes"],
        "outputs_sha256": outputs.hexdigest(),
        "part_bytes": part_bytes,  # every part the workers wrote (to the store, never through the driver)
        "corpus_bytes": sum(path.stat().st_size for _, path in data_files(corpus)),
        "peak_rss_mib_self": driver_peak,
        "workers_peak_rss_mib": {w: round(u.peak_rss_mib, 1) for w, u in others.items()},
        "workers_shards": {w: u.shards for w, u in others.items()},
    }


def write_rendered_texts(encoder, split, texts_path: Path) -> None:
    """The ceiling's input, untimed: the chat-templated text of every row that ours tokenized (``split``: the split's
    artifact)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ft_assets.data.rows import RowError

    schema = pa.schema([("text", pa.large_string())])
    with pq.ParquetWriter(texts_path, schema) as writer:
        for name in ("train", "eval"):
            for batch in (batch for table in split.tables(name, ["messages"]) for batch in table.to_batches()):
                texts = []
                for messages in batch.column("messages").to_pylist():
                    try:
                        texts.append(encoder.render(messages)[0])
                    except RowError:
                        pass  # ours rejects these before tokenizing
                writer.write_table(pa.table({"text": pa.array(texts, type=pa.large_string())}, schema=schema))


def work_ceiling(texts_path: Path, model_dir: Path) -> dict:
    import pyarrow.parquet as pq

    from ft_assets.data.chat_encoding import TOKENIZE_BATCH

    texts = pq.read_table(texts_path).column("text").to_pylist()  # input, not timed
    wall, cpu = time.perf_counter(), time.process_time()
    from transformers import AutoTokenizer

    backend = AutoTokenizer.from_pretrained(model_dir).backend_tokenizer
    load_s = time.perf_counter() - wall
    tokens = 0
    for start in range(0, len(texts), TOKENIZE_BATCH):
        tokens += sum(
            len(e) for e in backend.encode_batch(texts[start : start + TOKENIZE_BATCH], add_special_tokens=False)
        )
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
        return [
            {"role": SHAREGPT_ROLES.get(t["from"], t["from"]), "content": t["value"]} for t in record["conversations"]
        ]
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
        lambda row: {"text": tokenizer.apply_chat_template(row["messages"], tokenize=False)},
        remove_columns=["messages"],
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


def run_kind(
    kind: str, work: Path, model: Path, corpus: Path | None = None, seq_len: int = SEQ_LEN, render_texts: bool = False,
    workers: int = 1, ray: bool = False, shard_rows: int = 0,
) -> dict:  # fmt: skip
    texts = work / "ceiling_texts.parquet"
    if kind == "ours":
        return work_ours(corpus, work, model, seq_len, texts if render_texts else None, workers, ray, shard_rows)
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
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--ray", action="store_true")
    parser.add_argument("--shard-rows", type=int, default=0)
    parser.add_argument(
        "--render-texts", action="store_true", help="ours: write the ceiling's input afterwards (untimed)"
    )
    args = parser.parse_args(argv)
    print(json.dumps(run_kind(
        args.kind, args.work, args.model, args.corpus, args.seq_len, args.render_texts, args.workers, args.ray, args.shard_rows,
    )))  # fmt: skip


# --- orchestration -----------------------------------------------------------------------------------


def run_worker(kind: str, in_process: bool, render_texts: bool = False, ray: bool = False, **options) -> dict:
    """Run one measurement in its own process (its peak RSS its own), or in this one (--quick)."""
    if in_process:
        result = run_kind(kind, render_texts=render_texts, ray=ray, **options)
        result["peak_rss_mib"] = round(result.pop("peak_rss_mib_self"), 1)  # this whole process's
        return result
    argv = (
        ["-m", "benchmarks.data_plane", "worker", kind]
        + (["--render-texts"] if render_texts else [])
        + (["--ray"] if ray else [])
    )
    for key, value in options.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    child = run_child(argv, env=ENV)
    if child.returncode != 0:
        raise RuntimeError(f"data_plane worker {kind} failed (exit {child.returncode}):\n{child.output[-4000:]}")
    result = last_json(child.output)
    # The process's own VmHWM at the end of its timed work (ours: the driver's; then it renders the ceiling's input).
    result["peak_rss_mib"] = round(result.pop("peak_rss_mib_self"), 1)
    result["peak_rss_mib_whole_process"] = round(child.peak_rss_mib, 1)
    result["child_wall_s"] = round(child.wall_seconds, 2)
    result["child_cpu_s"] = round(child.cpu_seconds, 2)
    return result


def measure(
    rows_per_unit: int, scales: list[int], workers: int, ray: bool, baseline: bool, model: Path, in_process: bool,
    shard_rows: int = 0, log=print,
) -> dict:  # fmt: skip
    """x1: ours on 1 process, on ``workers`` processes and on Ray, the ceiling, the baseline; larger scales:
    ours on ``workers`` processes (a worker's memory against the corpus size)."""
    runs: dict[str, dict] = {}
    for scale in scales:
        corpus, counts = ensure_corpus(cache_dir(), scale, rows_per_unit)
        first = scale == scales[0]
        log(f"x{scale}: {counts['lines']:,} lines, {counts['bytes'] / 1e6:,.1f} MB")
        modes = ([("ours", 1, False)] if first else []) + [(f"ours_n{workers}", workers, False)]
        if first and ray:
            modes.append((f"ours_ray{workers}", workers, True))
        for name, count, on_ray in modes:
            work = cache_dir() / "work" / f"data-plane-x{scale}-{name}"
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir(parents=True)
            log(f"x{scale}: {name} …")
            runs[f"{name}_x{scale}"] = {"corpus": counts, **run_worker(
                "ours", in_process, first and count == 1, on_ray, corpus=corpus, work=work, model=model, seq_len=SEQ_LEN,
                workers=count, shard_rows=shard_rows,
            )}  # fmt: skip
            if name == "ours" and first:
                (work / "corpus.txt").write_text(f"{corpus}\n{model}")  # benchmarks.packing reuses these shards
                continue
            shutil.rmtree(work, ignore_errors=True)
        if first:
            work = cache_dir() / "work" / f"data-plane-x{scale}-ours"
            log(f"x{scale}: ceiling …")
            runs[f"ceiling_x{scale}"] = run_worker("ceiling", in_process, work=work, model=model)
            if baseline:
                log(f"x{scale}: baseline …")
                runs[f"baseline_x{scale}"] = run_worker(
                    "baseline", in_process, corpus=corpus, work=work / "baseline", model=model, seq_len=SEQ_LEN
                )
                shutil.rmtree(work / "baseline", ignore_errors=True)
    return runs


def workers_peak(run: dict) -> float:
    """The largest peak RSS of a worker process; the driver's when the run had none (one process)."""
    return max(run["workers_peak_rss_mib"].values(), default=run["peak_rss_mib"])


def driver_bytes(run: dict) -> dict:
    """What crosses the driver's link on a cluster, in bytes, from a run's figures: the input files (in from the
    store, out to the workers through Ray's object store) and the deduplication shuffle (records and keys in from the
    map, out to the reduce and filter tasks). The parts do not, nor the encoded examples on their way to the packing
    tasks: the workers write them to the store and read them from it. (Left out: the look-up's signatures of
    candidate pairs, the descriptors.)"""
    return {"inputs": 2 * run["corpus_bytes"], "shuffle": 2 * (run["shuffle_bytes"] + KEY_BYTES * run["rows_in"])}


def projection(run: dict, larger: dict | None = None) -> dict:
    """Hours for PROJECTION_ROWS on PROJECTION_CORES, from one N-worker run (see the module docstring). With the same
    run on a larger corpus (``larger``), the driver's CPU a row is the difference of the two over the rows in between,
    and what is left of its CPU (imports, the first tasks) is counted once, in the start-up."""
    rows = run["rows_in"]
    worker_s = run["workers_cpu_s"] / rows  # CPU seconds a row costs in the workers
    driver_s = run["cpu_s"] / rows  # ... in the driver
    if larger is not None and larger["rows_in"] > rows:
        driver_s = max(0.0, (larger["cpu_s"] - run["cpu_s"]) / (larger["rows_in"] - rows))
    driver_fixed_s = max(0.0, run["cpu_s"] - driver_s * rows)
    crossing = driver_bytes(run)
    network_s = sum(crossing.values()) / rows / NETWORK_BYTES_S
    start_s = (
        run["stages"]["executor_start"]["wall_s"] + driver_fixed_s
        + run["workers_cpu_s"] / run["workers"] - run["workers_stage_cpu_s"] / run["workers"]
    )  # fmt: skip
    table_ = {
        f"{total:,} rows": {
            f"{cores} cores": round((total * max(worker_s / cores, driver_s + network_s) + start_s) / 3600, 2)
            for cores in PROJECTION_CORES
        }
        for total in PROJECTION_ROWS
    }
    return {
        "worker_cpu_s_per_row": worker_s,
        "driver_cpu_s_per_row": driver_s,
        "driver_cpu_s_fixed": driver_fixed_s,
        "driver_cpu_s_per_row_from": "x1 and x4 runs" if larger is not None and larger["rows_in"] > rows else "one run",
        "network_bytes_per_row": sum(crossing.values()) / rows,
        "network_bytes_per_row_by_kind": {kind: round(value / rows, 1) for kind, value in crossing.items()},
        "part_bytes_per_row": run["part_bytes"] / rows,  # what the workers write to the store, a row
        "start_s": start_s,
        "driver_bound_above_cores": int(worker_s / (driver_s + network_s)),
        "hours": table_,
    }


def summarize(runs: dict, scales: list[int], workers: int) -> dict:
    first, last = f"x{scales[0]}", f"x{scales[-1]}"
    one, many, ceiling = runs[f"ours_{first}"], runs[f"ours_n{workers}_{first}"], runs[f"ceiling_{first}"]
    many_last = runs[f"ours_n{workers}_{last}"]
    summary = {
        "rows_per_s": one["rows_in"] / one["wall_s"],
        "tokens_per_s": one["tokens"] / one["wall_s"],
        f"rows_per_s_n{workers}": many["rows_in"] / many["wall_s"],
        f"tokens_per_s_n{workers}": many["tokens"] / many["wall_s"],
        "speedup": one["wall_s"] / many["wall_s"],
        "speedup_cpu": one["cpu_s"]
        / (many["cpu_s"] + many["workers_cpu_s"]),  # < 1: what the N-process run costs in extra CPU
        "scaling_efficiency": one["wall_s"] / many["wall_s"] / workers,
        "ceiling_tokens_per_s": ceiling["tokens"] / ceiling["wall_s"],
        "ratio_to_ceiling": ceiling["wall_s"] / one["wall_s"],
        "ratio_to_ceiling_cpu": ceiling["cpu_s"] / one["cpu_s"],
        f"ratio_to_ceiling_per_core_n{workers}": ceiling["wall_s"] / (many["wall_s"] * workers),
        f"ratio_to_ceiling_per_core_n{workers}_cpu": ceiling["cpu_s"] / (many["cpu_s"] + many["workers_cpu_s"]),
        "peak_rss_mib_per_worker": {f"x{s}": workers_peak(runs[f"ours_n{workers}_x{s}"]) for s in scales},
        "peak_rss_mib_driver": {f"x{s}": runs[f"ours_n{workers}_x{s}"]["peak_rss_mib"] for s in scales},
        "peak_rss_growth": workers_peak(many_last) / workers_peak(many),
        "driver_peak_rss_growth": many_last["peak_rss_mib"] / many["peak_rss_mib"],
        "peak_rss_mib_one_process": one["peak_rss_mib"],
        "projection": projection(many, many_last),
    }
    if f"ours_ray{workers}_{first}" in runs:
        on_ray = runs[f"ours_ray{workers}_{first}"]
        summary[f"rows_per_s_ray{workers}"] = on_ray["rows_in"] / on_ray["wall_s"]
        summary["ray_overhead"] = on_ray["wall_s"] / many["wall_s"] - 1
        summary["ray_start_s"] = on_ray["stages"]["executor_start"]["wall_s"]
    if f"baseline_{first}" in runs:
        baseline = runs[f"baseline_{first}"]
        summary["baseline_rows_per_s"] = baseline["rows_in"] / baseline["wall_s"]
        summary["speedup_over_baseline"] = baseline["wall_s"] / one["wall_s"]
        summary["speedup_over_baseline_cpu"] = baseline["cpu_s"] / one["cpu_s"]
    return summary


def report(runs: dict, summary: dict, scales: list[int], workers: int) -> str:
    rows = []
    for name, run in runs.items():
        kind, scale = name.rsplit("_", 1)
        rows_in = run["rows_in"] if "rows_in" in run else runs[f"ours_{scale}"]["rows_in"]
        cpu = run["cpu_s"] + run.get("workers_cpu_s", 0)
        peak = workers_peak(run) if "workers_peak_rss_mib" in run else run["peak_rss_mib"]
        rows.append([
            kind, scale, fmt(rows_in), fmt(run["wall_s"], 1), fmt(cpu, 1), fmt(rows_in / run["wall_s"]),
            fmt(run["tokens"] / run["wall_s"]), fmt(peak), fmt(run["peak_rss_mib"]),
        ])  # fmt: skip
    out = [
        table(
            [
                "run",
                "corpus",
                "rows in",
                "wall s",
                "cpu s (all)",
                "rows/s",
                "tokens/s",
                "peak RSS/worker MiB",
                "driver MiB",
            ],
            rows,
        )
    ]
    for name in (f"ours_x{scales[0]}", f"ours_n{workers}_x{scales[0]}"):
        out.append(f"\nstages of {name}:\n" + table(
            ["stage", "wall s", "driver cpu s", "share"],
            [[k, fmt(v["wall_s"], 1), fmt(v["cpu_s"], 1), f"{v['wall_s'] / runs[name]['wall_s']:.0%}"] for k, v in runs[name]["stages"].items()],
        ))  # fmt: skip
    line = (
        f"\n{workers} processes: {summary['speedup']:.2f}x the rows/s of one (efficiency {summary['scaling_efficiency']:.2f}); "
        f"ratio to the tokenizer ceiling {summary['ratio_to_ceiling']:.2f} on 1 process, "
        f"{summary[f'ratio_to_ceiling_per_core_n{workers}']:.2f} per core on {workers}"
    )
    if "ray_overhead" in summary:
        line += f"; Ray {summary['ray_overhead']:+.1%} against {workers} processes"
    line += f"; peak RSS per worker x{scales[-1]} / x{scales[0]} = {summary['peak_rss_growth']:.2f}"
    out.append(line)
    return "\n".join(out)


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        worker(argv[1:])
        return {}
    parser = argparse.ArgumentParser(
        description="Data-plane throughput on 1 and N cores and on Ray, vs the tokenizer ceiling and the HF-tutorial baseline."
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"{QUICK_ROWS} rows in shards of {QUICK_SHARD_ROWS}, tiny.py's tokenizer, every run in this process (no per-run RSS): a smoke run of every path",
    )
    parser.add_argument("--rows", type=int, help=f"rows of the x1 corpus (default {ROWS_PER_UNIT:,})")
    parser.add_argument("--scales", default="1,4", help="corpus sizes to run, as multiples of --rows")
    parser.add_argument("--workers", type=int, default=2, help="processes (and Ray CPUs) of the parallel runs")
    parser.add_argument("--no-ray", action="store_true", help="skip the Ray run")
    parser.add_argument("--no-baseline", action="store_true", help="skip the HF-tutorial baseline")
    args = parser.parse_args(argv)
    rows = args.rows or (QUICK_ROWS if args.quick else ROWS_PER_UNIT)
    scales = [int(s) for s in args.scales.split(",")]
    started = time.perf_counter()
    model_dir, model_name = benchmark_model(args.quick)
    if args.quick:
        os.environ.update(ENV)  # the workers run in this process
    shard_rows = QUICK_SHARD_ROWS if args.quick else 0
    runs = measure(rows, scales, args.workers, not args.no_ray, not args.no_baseline, model_dir, args.quick, shard_rows)
    summary = summarize(runs, scales, args.workers)
    print(report(runs, summary, scales, args.workers))
    write_result("data_plane", {
        "rows_per_unit": rows, "scales": scales, "workers": args.workers, "seq_len": SEQ_LEN, "tokenizer": model_name,
        "summary": summary, "runs": runs, "benchmark_seconds": round(time.perf_counter() - started, 1),
    }, argv)  # fmt: skip
    return summary


if __name__ == "__main__":
    main()
