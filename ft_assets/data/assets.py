"""Data-plane assets (group ``data``, CPU): raw → cleaned → deduplicated → split → tokenized shards.

Each asset downloads its input artifact, calls one plain function of this plane, publishes its
output artifact under ``runs/<name>/<version>/data/<stage>/`` and returns a reference. The row
accounting travels along in the references, so ``tokenized_shards`` can prove the invariant
``rows_in = rows_kept + rows_quarantined + exact_duplicates + near_duplicates``.
"""


import time
from collections import Counter
from pathlib import Path

import dagster as dg

from ft_assets.artifacts import publish, ref_metadata
from ft_assets.data.cleaning import clean_dataset
from ft_assets.data.config import CleanConfig, DedupConfig, SplitConfig, TokenizeConfig
from ft_assets.data.dedup import deduplicate_dataset
from ft_assets.data.packing import ChatEncoder, tokenize_and_pack
from ft_assets.data.readers import DatasetFileError, is_data_file, read_dataset
from ft_assets.data.rows import QUARANTINE_SCHEMA, ParquetSink, iter_records, sample_table
from ft_assets.data.split import split_dataset
from ft_assets.partitions import DatasetVersion, dataset_version
from ft_assets.resources import ObjectStoreResource
from ft_assets.storage import fetch_artifact, join_key

DATA = dict(partitions_def=dataset_version, group_name="data", io_manager_key="refs", tags={"ft/pool": "cpu"})


def _stage_prefix(partition: str, stage: str) -> str:
    return join_key(DatasetVersion.from_key(partition).run_prefix, "data", stage)


def _reasons_md(reasons: dict[str, int]) -> dg.MetadataValue:
    rows = "\n".join(f"| {reason} | {count} |" for reason, count in sorted(reasons.items(), key=lambda kv: -kv[1]))
    return dg.MetadataValue.md("| reason | rows |\n| --- | --- |\n" + (rows or "| (none) | 0 |"))


def _merge(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return dict(Counter(a) + Counter(b))


@dg.asset(**DATA, kinds={"python", "parquet"})
def raw_dataset(context: dg.AssetExecutionContext, store: ObjectStoreResource) -> dg.Output[dict]:
    """Every input file of the dataset version, normalized to one chat schema; bad rows quarantined."""
    started = time.perf_counter()
    version = DatasetVersion.from_key(context.partition_key)
    objects = store.open()
    keys = objects.list(version.input_prefix)
    ignored = [k for k in keys if not is_data_file(k) and not k.rsplit("/", 1)[-1].startswith("_")]
    keys = [k for k in keys if is_data_file(k)]
    if not keys:
        raise dg.Failure(f"no data files (.jsonl, .jsonl.gz, .parquet) under {objects.uri(version.input_prefix)}")
    if ignored:
        context.log.warning(f"ignoring {len(ignored)} file(s) of unsupported type: {', '.join(ignored[:5])}")
    with store.scratch("raw") as work:
        files = []
        for key in keys:
            local = work / "in" / key
            objects.get_file(key, local)
            files.append((key.removeprefix(version.input_prefix + "/"), local))
        context.log.info(f"reading {len(files)} file(s) of {version.key}")
        try:
            stats = read_dataset(files, work / "out")
        except DatasetFileError as exc:
            raise dg.Failure(f"dataset version {version.key}: {exc}") from exc
        sample = sample_table(work / "out" / "rows.parquet")
        stats["accounting"] = {
            "rows_in": stats["rows_in"],
            "rows_quarantined": stats["rows_quarantined"],
            "quarantine_reasons": stats["quarantine_reasons"],
        }
        ref = publish(objects, "raw_dataset", version.key, _stage_prefix(version.key, "raw"), work / "out", stats)
    context.log.info(f"{stats['rows_in']} rows in, {stats['rows_quarantined']} quarantined while parsing")
    return dg.Output(
        ref,
        metadata={
            **ref_metadata(ref),
            "rows_in": stats["rows_in"],
            "rows_parsed": stats["rows_parsed"],
            "rows_quarantined": stats["rows_quarantined"],
            "blank_lines": stats["blank_lines"],
            "quarantine_reasons": _reasons_md(stats["quarantine_reasons"]),
            "rows_per_file": dg.MetadataValue.json(stats["rows_per_file"]),
            "sample": dg.MetadataValue.md(sample),
            "duration_s": round(time.perf_counter() - started, 3),
        },
    )


@dg.asset(**DATA, kinds={"python", "parquet"})
def cleaned_dataset(
    context: dg.AssetExecutionContext, config: CleanConfig, store: ObjectStoreResource, raw_dataset: dict
) -> dg.Output[dict]:
    """Unicode/whitespace cleanup, length filters and role-order validation; failures quarantined with a reason."""
    started = time.perf_counter()
    objects = store.open()
    with store.scratch("clean") as work:
        fetch_artifact(objects, raw_dataset["prefix"], work / "raw")
        stats = clean_dataset(work / "raw", work / "out", config.rules())
        sample = sample_table(work / "out" / "rows.parquet")
        before = raw_dataset["stats"]["accounting"]
        quarantined = before["rows_quarantined"] + stats["rows_quarantined"]
        stats["accounting"] = {
            "rows_in": before["rows_in"],
            "rows_quarantined": quarantined,
            "quarantine_reasons": _merge(before["quarantine_reasons"], stats["quarantine_reasons"]),
        }
        stats["quarantine_fraction"] = quarantined / max(before["rows_in"], 1)
        stats["max_quarantine_fraction"] = config.max_quarantine_fraction
        ref = publish(
            objects, "cleaned_dataset", context.partition_key, _stage_prefix(context.partition_key, "cleaned"),
            work / "out", stats, {"raw_dataset": raw_dataset},
        )
    context.log.info(f"{stats['rows_kept']} rows kept, {stats['rows_quarantined']} quarantined by cleaning")
    return dg.Output(
        ref,
        metadata={
            **ref_metadata(ref),
            "rows_kept": stats["rows_kept"],
            "rows_quarantined": quarantined,
            "rows_modified_by_cleanup": stats["rows_modified"],
            "quarantine_fraction": dg.MetadataValue.float(round(stats["quarantine_fraction"], 4)),
            "quarantine_reasons": _reasons_md(stats["accounting"]["quarantine_reasons"]),
            "sample": dg.MetadataValue.md(sample),
            "duration_s": round(time.perf_counter() - started, 3),
        },
    )


@dg.asset(**DATA, kinds={"python", "parquet"})
def deduplicated_dataset(
    context: dg.AssetExecutionContext, config: DedupConfig, store: ObjectStoreResource, cleaned_dataset: dict
) -> dg.Output[dict]:
    """Exact dedup on normalized content, then MinHash-LSH near-dedup; every removed row recorded."""
    started = time.perf_counter()
    objects = store.open()
    with store.scratch("dedup") as work:
        fetch_artifact(objects, cleaned_dataset["prefix"], work / "cleaned")
        stats = deduplicate_dataset(work / "cleaned", work / "out", config.rules())
        stats["accounting"] = {
            **cleaned_dataset["stats"]["accounting"],
            "exact_duplicates": stats["exact_duplicates"],
            "near_duplicates": stats["near_duplicates"],
        }
        ref = publish(
            objects, "deduplicated_dataset", context.partition_key, _stage_prefix(context.partition_key, "deduplicated"),
            work / "out", stats, {"cleaned_dataset": cleaned_dataset},
        )
    context.log.info(
        f"{stats['rows_kept']} unique rows; {stats['exact_duplicates']} exact and {stats['near_duplicates']} near duplicates"
    )
    return dg.Output(
        ref,
        metadata={
            **ref_metadata(ref),
            "rows_kept": stats["rows_kept"],
            "exact_duplicates": stats["exact_duplicates"],
            "near_duplicates": stats["near_duplicates"],
            "near_clusters": stats["near_clusters"],
            "lsh_bands_x_rows": f"{stats['lsh_bands']} x {stats['lsh_rows_per_band']}",
            "duration_s": round(time.perf_counter() - started, 3),
        },
    )


@dg.asset(**DATA, kinds={"python", "parquet"})
def train_eval_split(
    context: dg.AssetExecutionContext, config: SplitConfig, store: ObjectStoreResource, deduplicated_dataset: dict
) -> dg.Output[dict]:
    """Deterministic train/eval split by a stable hash of each near-duplicate cluster."""
    started = time.perf_counter()
    objects = store.open()
    with store.scratch("split") as work:
        fetch_artifact(objects, deduplicated_dataset["prefix"], work / "dedup")
        stats = split_dataset(work / "dedup", work / "out", config.eval_fraction, config.salt)
        if stats["train_rows"] == 0:
            raise dg.Failure(f"{context.partition_key}: no training rows left after cleaning and deduplication")
        stats["eval_fraction"] = config.eval_fraction
        stats["accounting"] = deduplicated_dataset["stats"]["accounting"]
        sample = sample_table(work / "out" / "eval.parquet")
        ref = publish(
            objects, "train_eval_split", context.partition_key, _stage_prefix(context.partition_key, "split"),
            work / "out", stats, {"deduplicated_dataset": deduplicated_dataset},
        )
    return dg.Output(
        ref,
        metadata={
            **ref_metadata(ref),
            "train_rows": stats["train_rows"],
            "eval_rows": stats["eval_rows"],
            "eval_sample": dg.MetadataValue.md(sample),
            "duration_s": round(time.perf_counter() - started, 3),
        },
    )


def _load_tokenizer(objects, base_model: dict, work: Path):
    from transformers import AutoTokenizer

    model_dir = work / "tokenizer"
    fetch_artifact(objects, base_model["prefix"], model_dir, include=lambda rel: not rel.endswith(".safetensors"))
    return AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)


@dg.asset(**DATA, kinds={"python", "parquet"})
def tokenized_shards(
    context: dg.AssetExecutionContext,
    config: TokenizeConfig,
    store: ObjectStoreResource,
    train_eval_split: dict,
    base_model: dict,
) -> dg.Output[dict]:
    """Chat-templated, assistant-masked, packed token rows in Parquet shards (+ manifest)."""
    started = time.perf_counter()
    objects = store.open()
    with store.scratch("tokenize") as work:
        fetch_artifact(objects, train_eval_split["prefix"], work / "split")
        encoder = ChatEncoder(_load_tokenizer(objects, base_model, work))
        out = work / "out"
        out.mkdir()
        per_split = {}
        for split in ("train", "eval"):
            rows = ((r["source"], r["messages"]) for r in iter_records(work / "split" / f"{split}.parquet"))
            per_split[split] = tokenize_and_pack(rows, encoder, config.seq_len, out, split, config.window)
            context.log.info(
                f"{split}: {per_split[split].examples} examples, {per_split[split].tokens} tokens in "
                f"{per_split[split].rows} rows (packing efficiency {per_split[split].packing_efficiency:.4f})"
            )
        rejected = per_split["train"].rejected + per_split["eval"].rejected
        reasons = Counter(err.reason for _, err in rejected)
        with ParquetSink(out / "quarantine.parquet", QUARANTINE_SCHEMA) as quarantine:
            for source, err in rejected:
                quarantine.write({"source": source, "stage": "tokenize", "reason": err.reason, "detail": err.detail, "raw": ""})
        before = train_eval_split["stats"]["accounting"]
        train, evaluation = per_split["train"], per_split["eval"]
        accounting = {
            "rows_in": before["rows_in"],
            "rows_kept": train.examples + evaluation.examples,
            "rows_quarantined": before["rows_quarantined"] + len(rejected),
            "quarantine_reasons": _merge(before["quarantine_reasons"], dict(reasons)),
            "exact_duplicates": before["exact_duplicates"],
            "near_duplicates": before["near_duplicates"],
        }
        balance = accounting["rows_kept"] + accounting["rows_quarantined"] + accounting["exact_duplicates"] + accounting["near_duplicates"]
        accounting["invariant_holds"] = balance == accounting["rows_in"]
        slots = train.slots + evaluation.slots
        stats = {
            "seq_len": config.seq_len,
            "pad_token_id": encoder.tokenizer.pad_token_id if encoder.tokenizer.pad_token_id is not None else encoder.tokenizer.eos_token_id,
            "train_rows": train.examples,
            "eval_rows": evaluation.examples,
            "train_packed_rows": train.rows,
            "eval_packed_rows": evaluation.rows,
            "train_tokens": train.tokens,
            "eval_tokens": evaluation.tokens,
            "tokens": train.tokens + evaluation.tokens,
            "loss_tokens": train.loss_tokens + evaluation.loss_tokens,
            "packing_efficiency": (train.tokens + evaluation.tokens) / slots if slots else 0.0,
            "train_packing_efficiency": train.packing_efficiency,
            "train_files": train.files,
            "eval_files": evaluation.files,
            "accounting": accounting,
        }
        ref = publish(
            objects, "tokenized_shards", context.partition_key, _stage_prefix(context.partition_key, "shards"),
            out, stats, {"train_eval_split": train_eval_split, "base_model": base_model},
        )
    if not accounting["invariant_holds"]:
        context.log.error(f"row accounting does not balance: {accounting}")
    return dg.Output(
        ref,
        metadata={
            **ref_metadata(ref),
            "tokens": stats["tokens"],
            "loss_tokens": stats["loss_tokens"],
            "packing_efficiency": dg.MetadataValue.float(round(stats["packing_efficiency"], 5)),
            "train_packed_rows": train.rows,
            "eval_packed_rows": evaluation.rows,
            "seq_len": config.seq_len,
            "rows_in": accounting["rows_in"],
            "rows_kept": accounting["rows_kept"],
            "rows_quarantined": accounting["rows_quarantined"],
            "exact_duplicates": accounting["exact_duplicates"],
            "near_duplicates": accounting["near_duplicates"],
            "accounting": dg.MetadataValue.md(
                f"rows_in **{accounting['rows_in']}** = kept {accounting['rows_kept']} + quarantined "
                f"{accounting['rows_quarantined']} + exact duplicates {accounting['exact_duplicates']} + near duplicates "
                f"{accounting['near_duplicates']} → {'holds' if accounting['invariant_holds'] else '**DOES NOT HOLD**'}"
            ),
            "quarantine_reasons": _reasons_md(accounting["quarantine_reasons"]),
            "duration_s": round(time.perf_counter() - started, 3),
        },
    )
