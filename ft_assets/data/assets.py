"""Data-plane assets (group ``data``, CPU): raw → cleaned → deduplicated → split → tokenized shards.

Each asset downloads its input artifact, calls one plain function of this plane, publishes its
output artifact under ``runs/<name>/<version>/data/<stage>/`` and returns a reference. The row
accounting travels along in the references, so ``tokenized_shards`` can prove the invariant
``rows_in = rows_kept + rows_quarantined + exact_duplicates + near_duplicates``. So does the kind
of the version (``stats["kind"]``: chat rows or preference pairs, found by ``raw_dataset``), which
picks the cleaning and the tokenization of pairs (``ft_assets.data.preference``, ``pair_packing``).
"""

from collections import Counter
from pathlib import Path

import dagster as dg

from ft_assets import layout
from ft_assets.data.cleaning import clean_dataset, clean_messages
from ft_assets.data.config import CleanConfig, DedupConfig, RawConfig, SplitConfig, TokenizeConfig
from ft_assets.data.dedup import deduplicate_dataset
from ft_assets.data.formats import SUPPORTED_SUFFIXES, is_data_file
from ft_assets.data.layouts import ColumnMapping
from ft_assets.data.mixture import Component, MixtureError, mix_dataset
from ft_assets.data.packing import EXAMPLES, TokenizerFiles, tokenize_splits
from ft_assets.data.pair_packing import PAIRS
from ft_assets.data.preference import PREFERENCE, clean_pair, dataset_kind
from ft_assets.data.readers import read_dataset
from ft_assets.data.resources import DataExecutorResource
from ft_assets.data.rows import QUARANTINE_SCHEMA, DatasetFileError, ParquetSink, iter_records, sample_rows
from ft_assets.data.sources import describe_source
from ft_assets.data.split import split_dataset
from ft_assets.materialize import STORE_KIND, Materialization, table
from ft_assets.partitions import dataset_version
from ft_assets.resources import ObjectStoreResource
from ft_assets.storage import join_key

DATA = dict(partitions_def=dataset_version, group_name="data", io_manager_key="refs", tags={"ft/pool": "cpu"})


def _reasons(reasons: dict[str, int]) -> dg.MetadataValue:
    ordered = sorted(reasons.items(), key=lambda kv: -kv[1])
    return table([{"reason": reason, "rows": count} for reason, count in ordered], columns=["reason", "rows"])


def _merge(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return dict(Counter(a) + Counter(b))


def _executor_metadata(data_executor: DataExecutorResource, retried_before: int) -> dict:
    """Where the asset's shards ran, and how many ran again after a worker died (never part of the output)."""
    executor = data_executor.executor
    return {"executor": executor.describe(), "shard_retries": executor.retried - retried_before}


def _fetch_inputs(m: Materialization, prefix: str, shown_as: str = "") -> list[tuple[str, Path]]:
    """Download the data files under ``prefix``: (name shown in row sources, local path) pairs."""
    keys = m.store.list(prefix)
    ignored = [k for k in keys if not is_data_file(k) and not k.rsplit("/", 1)[-1].startswith("_")]
    keys = [k for k in keys if is_data_file(k)]
    if not keys:
        raise dg.Failure(f"no data files ({', '.join(SUPPORTED_SUFFIXES)}) under {m.store.uri(prefix)}")
    if ignored:
        m.context.log.warning(f"ignoring {len(ignored)} file(s) of unsupported type: {', '.join(ignored[:5])}")
    files = []
    for key in keys:
        local = m.work / "in" / key
        m.store.get_file(key, local)
        files.append((join_key(shown_as, key.removeprefix(prefix + "/")), local))
    return files


def _mixture_component(m: Materialization, record: dict, mapping: ColumnMapping | None) -> Component:
    """A mixture component's files: a registered version's inputs, or those staged under the mixture's own folder."""
    if "dataset" in record:
        keys = layout.of(record["dataset"])
        if m.store.exists(keys.source):
            record = {**record, "origin": m.store.get_json(keys.source)}
        prefix = keys.inputs
    else:
        prefix = layout.of(m.partition).component(record["name"])
    try:
        own = ColumnMapping.of(record.get("columns") or {})
    except ValueError as exc:
        raise dg.Failure(f"mixture component {record['name']}: {exc}") from exc
    return Component(record, _fetch_inputs(m, prefix, record["name"]), own or mapping)


@dg.asset(**DATA, kinds={"python", "parquet", STORE_KIND})
def raw_dataset(
    context: dg.AssetExecutionContext, config: RawConfig, store: ObjectStoreResource, data_executor: DataExecutorResource
) -> dg.Output[dict]:
    """Every input file of the dataset version (for a mixture, the rows drawn from its components),
    normalized to one chat schema; bad rows quarantined. Where the version came from is in its stats."""
    keys_of = layout.of(context.partition_key)
    mapping = config.mapping()
    executor, retried = data_executor.executor, data_executor.executor.retried
    with Materialization(context, store, "raw") as m:
        source = m.store.get_json(keys_of.source) if m.store.exists(keys_of.source) else None
        try:
            if source is not None and source["kind"] == "mixture":
                components = [_mixture_component(m, record, mapping) for record in source["components"]]
                context.log.info(f"drawing {m.partition} from {len(components)} components (seed {source['seed']})")
                stats = mix_dataset(components, m.work / "components", m.out, source["seed"], source["rows"], executor)
            else:
                files = _fetch_inputs(m, keys_of.inputs)
                context.log.info(f"reading {len(files)} file(s) of {m.partition}")
                stats = read_dataset(files, m.out, mapping, executor)
                stats["source"] = source
            stats["kind"] = dataset_kind(m.out / "rows.parquet")
        except (DatasetFileError, MixtureError) as exc:
            raise dg.Failure(f"dataset version {m.partition}: {exc}") from exc
        if stats["rows_parsed"] == 0:
            raise dg.Failure(no_usable_rows(m.partition, stats, m.out / "quarantine.parquet"))
        sample = sample_rows(m.out / "rows.parquet")
        stats["accounting"] = {
            "rows_in": stats["rows_in"],
            "rows_quarantined": stats["rows_quarantined"],
            "quarantine_reasons": stats["quarantine_reasons"],
        }
        ref = m.publish(keys_of.data("raw"), stats)
    context.log.info(f"{stats['rows_in']} rows in ({stats['kind']}), {stats['rows_quarantined']} quarantined while parsing")
    origin = {"source": dg.MetadataValue.md("\n".join(describe_source(stats["source"], indent="- ")))} if stats["source"] else {}
    return m.output(
        ref,
        rows_in=stats["rows_in"],
        kind=stats["kind"],
        rows_parsed=stats["rows_parsed"],
        rows_quarantined=stats["rows_quarantined"],
        blank_lines=stats["blank_lines"],
        quarantine_reasons=_reasons(stats["quarantine_reasons"]),
        rows_per_file=dg.MetadataValue.json(stats["rows_per_file"]),
        sample=table(sample),
        **origin,
        **_executor_metadata(data_executor, retried),
    )


def no_usable_rows(partition: str, stats: dict, quarantine: Path) -> str:
    """The error for an input with no row to train on: each file, what was wrong, where, what to do."""
    examples: dict[str, str] = {}
    for record in iter_records(quarantine, columns=["source", "reason"]):
        examples.setdefault(record["reason"], record["source"])
    files = "; ".join(
        f"{name}: {count} row(s), all quarantined" if count else f"{name} holds no rows"
        for name, count in stats["rows_per_file"].items()
    )
    reasons = ", ".join(f"{reason} x{count} (first at {examples[reason]})" for reason, count in stats["quarantine_reasons"].items())
    return (
        f"dataset version {partition} has no usable row ({files}{'; ' + reasons if reasons else ''}). Rows must be in chat "
        "({messages: [{role, content}]}), ShareGPT ({conversations}) or alpaca ({instruction, output}) form, or their "
        "columns mapped with raw_dataset's config 'columns', or preference pairs ({prompt, chosen, rejected})"
    )


@dg.asset(**DATA, kinds={"python", "parquet", STORE_KIND})
def cleaned_dataset(
    context: dg.AssetExecutionContext,
    config: CleanConfig,
    store: ObjectStoreResource,
    data_executor: DataExecutorResource,
    raw_dataset: dict,
) -> dg.Output[dict]:
    """Unicode/whitespace cleanup, length filters and role-order validation; failures quarantined with a reason."""
    retried = data_executor.executor.retried
    kind = raw_dataset["stats"]["kind"]
    with Materialization(context, store, "clean") as m:
        clean = clean_pair if kind == PREFERENCE else clean_messages
        stats = clean_dataset(m.fetch(raw_dataset), m.out, config.rules(), data_executor.executor, clean)
        stats["kind"] = kind
        sample = sample_rows(m.out / "rows.parquet")
        before = raw_dataset["stats"]["accounting"]
        quarantined = before["rows_quarantined"] + stats["rows_quarantined"]
        stats["accounting"] = {
            "rows_in": before["rows_in"],
            "rows_quarantined": quarantined,
            "quarantine_reasons": _merge(before["quarantine_reasons"], stats["quarantine_reasons"]),
        }
        stats["quarantine_fraction"] = quarantined / max(before["rows_in"], 1)
        stats["max_quarantine_fraction"] = config.max_quarantine_fraction
        ref = m.publish(layout.of(m.partition).data("cleaned"), stats, {"raw_dataset": raw_dataset})
    context.log.info(f"{stats['rows_kept']} rows kept, {stats['rows_quarantined']} quarantined by cleaning")
    return m.output(
        ref,
        rows_kept=stats["rows_kept"],
        rows_quarantined=quarantined,
        rows_modified_by_cleanup=stats["rows_modified"],
        quarantine_fraction=dg.MetadataValue.float(round(stats["quarantine_fraction"], 4)),
        quarantine_reasons=_reasons(stats["accounting"]["quarantine_reasons"]),
        sample=table(sample),
        **_executor_metadata(data_executor, retried),
    )


@dg.asset(**DATA, kinds={"python", "parquet", STORE_KIND})
def deduplicated_dataset(
    context: dg.AssetExecutionContext,
    config: DedupConfig,
    store: ObjectStoreResource,
    data_executor: DataExecutorResource,
    cleaned_dataset: dict,
) -> dg.Output[dict]:
    """Exact dedup on normalized content, then MinHash-LSH near-dedup; every removed row recorded."""
    retried = data_executor.executor.retried
    with Materialization(context, store, "dedup") as m:
        stats = deduplicate_dataset(m.fetch(cleaned_dataset), m.out, config.rules(), data_executor.executor)
        stats["kind"] = cleaned_dataset["stats"]["kind"]
        stats["accounting"] = {
            **cleaned_dataset["stats"]["accounting"],
            "exact_duplicates": stats["exact_duplicates"],
            "near_duplicates": stats["near_duplicates"],
        }
        ref = m.publish(layout.of(m.partition).data("deduplicated"), stats, {"cleaned_dataset": cleaned_dataset})
    context.log.info(
        f"{stats['rows_kept']} unique rows; {stats['exact_duplicates']} exact and {stats['near_duplicates']} near duplicates"
    )
    return m.output(
        ref,
        rows_kept=stats["rows_kept"],
        exact_duplicates=stats["exact_duplicates"],
        near_duplicates=stats["near_duplicates"],
        near_clusters=stats["near_clusters"],
        lsh_bands_x_rows=f"{stats['lsh_bands']} x {stats['lsh_rows_per_band']}",
        **_executor_metadata(data_executor, retried),
    )


@dg.asset(**DATA, kinds={"python", "parquet", STORE_KIND})
def train_eval_split(
    context: dg.AssetExecutionContext,
    config: SplitConfig,
    store: ObjectStoreResource,
    data_executor: DataExecutorResource,
    deduplicated_dataset: dict,
) -> dg.Output[dict]:
    """Deterministic train/eval split by a stable hash of each near-duplicate cluster."""
    retried = data_executor.executor.retried
    with Materialization(context, store, "split") as m:
        stats = split_dataset(m.fetch(deduplicated_dataset), m.out, config.eval_fraction, config.salt, data_executor.executor)
        if stats["train_rows"] == 0:
            raise dg.Failure(f"{m.partition}: no training rows left after cleaning and deduplication")
        stats["eval_fraction"] = config.eval_fraction
        stats["kind"] = deduplicated_dataset["stats"]["kind"]
        stats["accounting"] = deduplicated_dataset["stats"]["accounting"]
        sample = sample_rows(m.out / "eval.parquet")
        ref = m.publish(layout.of(m.partition).data("split"), stats, {"deduplicated_dataset": deduplicated_dataset})
    return m.output(
        ref, train_rows=stats["train_rows"], eval_rows=stats["eval_rows"], eval_sample=table(sample),
        **_executor_metadata(data_executor, retried),
    )  # fmt: skip


def _tokenizer_files(m: Materialization, base_model: dict) -> TokenizerFiles:
    """The base model's tokenizer as files: each worker loads it once (the driver does not load it at all)."""
    return TokenizerFiles.from_dir(m.fetch(base_model, "tokenizer", include=lambda rel: not rel.endswith(".safetensors")))


def _accounting_line(acc: dict) -> str:
    return (
        f"rows_in **{acc['rows_in']}** = kept {acc['rows_kept']} + quarantined {acc['rows_quarantined']} + exact "
        f"duplicates {acc['exact_duplicates']} + near duplicates {acc['near_duplicates']} → "
        f"{'holds' if acc['invariant_holds'] else '**DOES NOT HOLD**'}"
    )


@dg.asset(**DATA, kinds={"huggingface", "parquet", STORE_KIND})
def tokenized_shards(
    context: dg.AssetExecutionContext,
    config: TokenizeConfig,
    store: ObjectStoreResource,
    data_executor: DataExecutorResource,
    train_eval_split: dict,
    base_model: dict,
) -> dg.Output[dict]:
    """Chat-templated, assistant-masked, packed token rows in Parquet shards (+ manifest); preference pairs packed whole."""
    retried = data_executor.executor.retried
    kind = train_eval_split["stats"]["kind"]
    with Materialization(context, store, "tokenize") as m:
        split_dir = m.fetch(train_eval_split)
        per_split = tokenize_splits(
            split_dir, ("train", "eval"), _tokenizer_files(m, base_model), config.seq_len, m.out, config.window, data_executor.executor,
            kind=PAIRS if kind == PREFERENCE else EXAMPLES,
        )  # fmt: skip
        for split, packed in per_split.items():
            context.log.info(
                f"{split}: {packed.examples} {'pairs' if kind == PREFERENCE else 'examples'}, {packed.tokens} tokens in "
                f"{packed.rows} rows (packing efficiency {packed.packing_efficiency:.4f})"
            )
        rejected = per_split["train"].rejected + per_split["eval"].rejected
        reasons = Counter(err.reason for _, err in rejected)
        with ParquetSink(m.out / "quarantine.parquet", QUARANTINE_SCHEMA) as quarantine:
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
            "kind": kind,
            "seq_len": config.seq_len,
            "pad_token_id": train.pad_id,
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
        ref = m.publish(
            layout.of(m.partition).data("shards"), stats, {"train_eval_split": train_eval_split, "base_model": base_model}
        )
    if not accounting["invariant_holds"]:
        context.log.error(f"row accounting does not balance: {accounting}")
    return m.output(
        ref,
        tokens=stats["tokens"],
        loss_tokens=stats["loss_tokens"],
        packing_efficiency=dg.MetadataValue.float(round(stats["packing_efficiency"], 5)),
        train_packed_rows=train.rows,
        eval_packed_rows=evaluation.rows,
        seq_len=config.seq_len,
        kind=kind,
        rows_in=accounting["rows_in"],
        rows_kept=accounting["rows_kept"],
        rows_quarantined=accounting["rows_quarantined"],
        exact_duplicates=accounting["exact_duplicates"],
        near_duplicates=accounting["near_duplicates"],
        accounting=dg.MetadataValue.md(_accounting_line(accounting)),
        quarantine_reasons=_reasons(accounting["quarantine_reasons"]),
        **_executor_metadata(data_executor, retried),
    )
