"""Packing efficiency: the share of token slots that hold real tokens, ours vs padding.

``python -m benchmarks.packing`` takes the example lengths that ``tokenized_shards`` produced (the
``seq_lens`` of every packed row) and compares, on the same examples:

- **ours**: bin-completion packing into rows of ``seq_len`` tokens (what the shards hold);
- **pad to longest, batch 8**: a ``DataCollatorWithPadding``-style loader, examples in a seeded random
  order, each batch of 8 padded to its longest example;
- **pad to longest, map batch 1000**: what the tutorials' ``Dataset.map(padding="longest")`` stores,
  each batch of 1,000 rows padded to its longest. The shards hold examples in packing order (long with
  short), so the rows are taken in a seeded random order: the files of both datasets are shuffled, so
  file order has the same statistics;
- **pad to max length**: every example padded to ``seq_len``.

Datasets: the shipped sample (SmolLM2 tokenizer, 512 tokens, as in ``make demo``) and the generated
corpus ×1 (1,024 tokens; the shards of ``benchmarks.data_plane`` when it ran first, else built here).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import ROOT, benchmark_model, cache_dir, fmt, table, write_result

SAMPLE = ROOT / "samples" / "toolcalls"
SAMPLE_SEQ_LEN = 512  # the demo's tokenized_shards seq_len
TRAIN_BATCH = 8
MAP_BATCH = 1000  # datasets.Dataset.map's default batch_size


def build_shards(corpus: Path, work: Path, seq_len: int, model_dir: Path) -> Path:
    """Run the data plane's plain functions on ``corpus`` into ``work``; returns the shards folder."""
    from transformers import AutoTokenizer

    from ft_assets.data.chat_encoding import ChatEncoder
    from ft_assets.data.cleaning import CleaningRules, clean_dataset
    from ft_assets.data.dedup import DedupRules, deduplicate_dataset
    from ft_assets.data.formats import is_data_file
    from ft_assets.data.parts import Artifact
    from ft_assets.data.readers import read_dataset
    from ft_assets.data.split import split_dataset
    from ft_assets.data.tokenizing import tokenize_and_pack

    stage = {name: Artifact.folder(work / name) for name in ("raw", "cleaned", "deduplicated", "split")}
    read_dataset([(p.name, p) for p in sorted(corpus.iterdir()) if is_data_file(p.name)], stage["raw"])
    clean_dataset(stage["raw"], stage["cleaned"], CleaningRules())
    deduplicate_dataset(stage["cleaned"], stage["deduplicated"], DedupRules())
    split_dataset(stage["deduplicated"], stage["split"], 0.1)
    encoder = ChatEncoder(AutoTokenizer.from_pretrained(model_dir))
    (work / "shards").mkdir(parents=True, exist_ok=True)
    for name in ("train", "eval"):
        rows = ((r["source"], r["messages"]) for r in stage["split"].records(name))
        tokenize_and_pack(rows, encoder, seq_len, work / "shards", name)
    return work / "shards"


def shard_lengths(shards: Path) -> tuple[list[int], int, int]:
    """(example lengths in shard order, packed rows, seq_len) of every train and eval shard (not the quarantine parts)."""
    import pyarrow.parquet as pq

    from ft_assets.shards import shard_files

    lengths, rows, seq_len = [], 0, 0
    for path in [*shard_files(shards, "eval"), *shard_files(shards, "train")]:  # the order the files sort in
        table_ = pq.read_table(path, columns=["seq_lens", "input_ids"])
        rows += table_.num_rows
        if table_.num_rows:
            seq_len = len(table_.column("input_ids")[0])
        lengths += [n for row in table_.column("seq_lens").to_pylist() for n in row]
    return lengths, rows, seq_len


def padded_slots(lengths: list[int], batch: int) -> int:
    """Slots used when consecutive batches of ``batch`` examples are each padded to their longest."""
    return sum(max(lengths[i : i + batch]) * len(lengths[i : i + batch]) for i in range(0, len(lengths), batch))


def efficiencies(lengths: list[int], packed_rows: int, seq_len: int, seed: int = 0) -> dict:
    tokens = sum(lengths)
    shuffled = lengths[:]
    random.Random(seed).shuffle(shuffled)
    return {
        "examples": len(lengths),
        "tokens": tokens,
        "seq_len": seq_len,
        "mean_length": tokens / len(lengths) if lengths else 0.0,
        "p95_length": float(np.percentile(lengths, 95)) if lengths else 0.0,
        "ours_packing": tokens / (packed_rows * seq_len) if packed_rows else 0.0,
        "pad_longest_batch8": tokens / padded_slots(shuffled, TRAIN_BATCH) if lengths else 0.0,
        "pad_longest_map1000": tokens / padded_slots(shuffled, MAP_BATCH) if lengths else 0.0,
        "pad_max_length": tokens / (len(lengths) * seq_len) if lengths else 0.0,
        "packed_rows": packed_rows,
        "lower_bound_rows": -(-tokens // seq_len),
    }


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description="Packing efficiency vs padding, on the sample and the corpus.")
    parser.add_argument("--quick", action="store_true", help="the data-plane --quick corpus, tiny.py's tokenizer")
    parser.add_argument("--rows", type=int, help="rows of the corpus (default: the data-plane benchmark's x1)")
    args = parser.parse_args(argv)
    import shutil

    from benchmarks.corpus import ROWS_PER_UNIT, ensure_corpus
    from benchmarks.data_plane import QUICK_ROWS, SEQ_LEN

    started = time.perf_counter()
    rows = args.rows or (QUICK_ROWS if args.quick else ROWS_PER_UNIT)
    model_dir, model_name = benchmark_model(args.quick)
    work = cache_dir() / "work"
    shutil.rmtree(work / "packing-sample", ignore_errors=True)
    results = {
        "sample": efficiencies(*shard_lengths(build_shards(SAMPLE, work / "packing-sample", SAMPLE_SEQ_LEN, model_dir)))
    }
    corpus_dir, counts = ensure_corpus(cache_dir(), 1, rows)
    shards, stamp = work / "data-plane-x1" / "shards", work / "data-plane-x1" / "corpus.txt"
    if not (shards.is_dir() and stamp.is_file() and stamp.read_text() == f"{corpus_dir}\n{model_dir}"):
        shutil.rmtree(work / "packing-corpus", ignore_errors=True)
        shards = build_shards(corpus_dir, work / "packing-corpus", SEQ_LEN, model_dir)
    results["corpus_x1"] = efficiencies(*shard_lengths(shards))
    results["corpus_x1"]["rows_in"] = counts["lines"]

    header = [
        "dataset",
        "examples",
        "seq_len",
        "mean len",
        "ours (packed)",
        "pad longest, batch 8",
        "pad longest, map 1000",
        "pad to max length",
    ]
    body = [
        [
            name,
            fmt(r["examples"]),
            r["seq_len"],
            fmt(r["mean_length"]),
            f"{r['ours_packing']:.4f}",
            f"{r['pad_longest_batch8']:.4f}",
            f"{r['pad_longest_map1000']:.4f}",
            f"{r['pad_max_length']:.4f}",
        ]
        for name, r in results.items()
    ]
    print(table(header, body))
    write_result(
        "packing",
        {"tokenizer": model_name, "results": results, "benchmark_seconds": round(time.perf_counter() - started, 1)},
        argv,
    )
    return results


if __name__ == "__main__":
    main()
