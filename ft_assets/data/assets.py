"""Data-plane assets (group ``data``, CPU): raw → cleaned → deduplicated → split → tokenized shards.

Each asset downloads its input artifact, calls one plain function of this plane, publishes its
output artifact under ``runs/<name>/<version>/data/<stage>/`` and returns a reference. The row
accounting (``ft_assets.data.accounting.RowAccounting``) travels along in the references, so
``tokenized_shards`` can prove ``rows_in = rows_kept + rows_quarantined + exact_duplicates +
near_duplicates``. So does the objective (``ft_assets.objectives``: conversations train with SFT,
preference pairs with DPO), which ``raw_dataset`` chooses from the rows and which picks the row
cleaner and how the rows are tokenized and packed.
"""

import json
from collections import Counter
from pathlib import Path

import dagster as dg

from ft_assets import layout, objectives
from ft_assets.data.accounting import RowAccounting
from ft_assets.data.chat_encoding import TokenizerFiles
from ft_assets.data.cleaning import clean_dataset
from ft_assets.data.config import CleanConfig, DedupConfig, RawConfig, SplitConfig, TokenizeConfig
from ft_assets.data.dedup import deduplicate_dataset
from ft_assets.data.formats import SUPPORTED_SUFFIXES, is_data_file
from ft_assets.data.images import IMAGE_SUFFIXES, ImagePool, ImageResolver
from ft_assets.data.packing import for_vision
from ft_assets.data.layouts import ColumnMapping
from ft_assets.data.mixture import Component, MixtureError, mix_dataset
from ft_assets.data.parts import Artifact
from ft_assets.data.readers import read_dataset
from ft_assets.data.resources import DataExecutorResource
from ft_assets.data.rows import ROW_SCHEMA, DatasetFileError, sample_rows
from ft_assets.data.sources import describe_source
from ft_assets.data.split import split_dataset
from ft_assets.data.tokenizing import tokenize_splits
from ft_assets.materialize import STORE_KIND, Materialization, dataset_metadata, table
from ft_assets.partitions import dataset_version
from ft_assets.resources import ObjectStoreResource
from ft_assets.shards import IMAGES_FILE
from ft_assets.storage import join_key
from ft_assets.vision import is_vision_model

DATA = dict(partitions_def=dataset_version, group_name="data", io_manager_key="refs", tags={"ft/pool": "cpu"})


def _reasons(reasons: dict[str, int]) -> dg.MetadataValue:
    ordered = sorted(reasons.items(), key=lambda kv: -kv[1])
    return table([{"reason": reason, "rows": count} for reason, count in ordered], columns=["reason", "rows"])


def _fetch_inputs(m: Materialization, prefix: str, shown_as: str = "") -> list[tuple[str, Path]]:
    """Download the data files under ``prefix``: (name shown in row sources, local path) pairs."""
    keys = m.store.list(prefix)
    ignored = [
        k
        for k in keys
        if not is_data_file(k) and not k.rsplit("/", 1)[-1].startswith("_") and not k.lower().endswith(IMAGE_SUFFIXES)
    ]  # images are read where rows name them
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
    context: dg.AssetExecutionContext,
    config: RawConfig,
    store: ObjectStoreResource,
    data_executor: DataExecutorResource,
) -> dg.Output[dict]:
    """Every input file of the dataset version (for a mixture, the rows drawn from its components),
    normalized to one chat schema; bad rows quarantined. The rows choose the objective (conversations:
    sft, preference pairs: dpo); where the version came from is in its stats."""
    keys_of = layout.of(context.partition_key)
    with Materialization(context, store, "raw", data_executor) as m:
        source = m.store.get_json(keys_of.source) if m.store.exists(keys_of.source) else None
        out = Artifact.begin(m.store, keys_of.data("raw"))
        try:
            images = ImageResolver(m.store.url, keys_of.inputs, keys_of.images, config.image_rules())
            stats = _read_version(m, out, source, config.mapping(), data_executor.executor, images)
            objective = objectives.for_data_kind(stats.pop("data_kind"))
        except (DatasetFileError, MixtureError) as exc:
            raise dg.Failure(f"dataset version {m.partition}: {exc}") from exc
        if stats["rows_parsed"] == 0:
            raise dg.Failure(no_usable_rows(m.partition, stats, out))
        stats["objective"] = objective.name
        stats["accounting"] = RowAccounting(stats["rows_in"]).quarantined(stats["quarantine_reasons"]).as_dict()
        sample = table(sample_rows(out.records("rows")))
        dataset = dataset_metadata(stats["rows_parsed"], ROW_SCHEMA)
        ref = m.publish(out, stats)
    context.log.info(
        f"{stats['rows_in']} rows in ({objective.data_kind}: {objective.name}), {stats['rows_quarantined']} quarantined while parsing"
    )
    origin = (
        {"source": dg.MetadataValue.md("\n".join(describe_source(stats["source"], indent="- ")))}
        if stats["source"]
        else {}
    )
    return m.output(
        ref,
        rows_in=stats["rows_in"],
        objective=objective.name,
        rows_parsed=stats["rows_parsed"],
        rows_quarantined=stats["rows_quarantined"],
        blank_lines=stats["blank_lines"],
        quarantine_reasons=_reasons(stats["quarantine_reasons"]),
        rows_per_file=table(
            [{"file": name, "rows": rows} for name, rows in stats["rows_per_file"].items()], columns=["file", "rows"]
        ),
        **({"image_rows": stats["image_rows"], "images": stats["images"]} if stats.get("image_rows") else {}),
        sample=sample,
        **dataset,
        **origin,
    )


def _read_version(
    m: Materialization, out: Artifact, source: dict | None, mapping: ColumnMapping | None, executor,
    images: ImageResolver,
) -> dict:  # fmt: skip
    """Read the version's files (or draw a mixture from its components) into ``out``; the reader's stats."""
    if source is not None and source["kind"] == "mixture":
        components = [_mixture_component(m, record, mapping) for record in source["components"]]
        m.context.log.info(f"drawing {m.partition} from {len(components)} components (seed {source['seed']})")
        return mix_dataset(components, m.work / "components", out, source["seed"], source["rows"], executor)
    files = _fetch_inputs(m, layout.of(m.partition).inputs)
    m.context.log.info(f"reading {len(files)} file(s) of {m.partition}")
    return {**read_dataset(files, out, mapping, executor, images=images), "source": source}


def no_usable_rows(partition: str, stats: dict, raw: Artifact) -> str:
    """The error for an input with no row to train on: each file, what was wrong, where, what to do."""
    examples: dict[str, str] = {}
    for record in raw.records("quarantine", columns=["source", "reason"]):
        examples.setdefault(record["reason"], record["source"])
    files = "; ".join(
        f"{name}: {count} row(s), all quarantined" if count else f"{name} holds no rows"
        for name, count in stats["rows_per_file"].items()
    )
    reasons = ", ".join(
        f"{reason} x{count} (first at {examples[reason]})" for reason, count in stats["quarantine_reasons"].items()
    )
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
    objective = objectives.of_stats(raw_dataset["stats"])
    with Materialization(context, store, "clean", data_executor) as m:
        out = Artifact.begin(m.store, layout.of(m.partition).data("cleaned"))
        stats = clean_dataset(
            Artifact.committed(m.store, raw_dataset["prefix"]),
            out,
            config.rules(),
            data_executor.executor,
            objective.clean_row,
        )
        accounting = RowAccounting.of(raw_dataset["stats"]).quarantined(stats["quarantine_reasons"])
        stats.update(
            objective=objective.name, accounting=accounting.as_dict(), quarantine_fraction=accounting.quarantine_fraction,
            max_quarantine_fraction=config.max_quarantine_fraction,
        )  # fmt: skip
        sample = table(sample_rows(out.records("rows")))
        dataset = dataset_metadata(stats["rows_kept"], ROW_SCHEMA)
        ref = m.publish(out, stats, {"raw_dataset": raw_dataset})
    context.log.info(f"{stats['rows_kept']} rows kept, {stats['rows_quarantined']} quarantined by cleaning")
    return m.output(
        ref,
        rows_kept=stats["rows_kept"],
        rows_quarantined=accounting.rows_quarantined,
        rows_modified_by_cleanup=stats["rows_modified"],
        quarantine_fraction=dg.MetadataValue.float(round(accounting.quarantine_fraction, 4)),
        quarantine_reasons=_reasons(accounting.quarantine_reasons),
        sample=sample,
        **dataset,
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
    with Materialization(context, store, "dedup", data_executor) as m:
        out = Artifact.begin(m.store, layout.of(m.partition).data("deduplicated"))
        stats = deduplicate_dataset(
            Artifact.committed(m.store, cleaned_dataset["prefix"]), out, config.rules(), data_executor.executor, m.work
        )
        accounting = RowAccounting.of(cleaned_dataset["stats"]).deduplicated(
            stats["exact_duplicates"], stats["near_duplicates"]
        )
        stats.update(objective=cleaned_dataset["stats"]["objective"], accounting=accounting.as_dict())
        dataset = dataset_metadata(stats["rows_kept"], ROW_SCHEMA)
        ref = m.publish(out, stats, {"cleaned_dataset": cleaned_dataset})
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
        **dataset,
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
    with Materialization(context, store, "split", data_executor) as m:
        out = Artifact.begin(m.store, layout.of(m.partition).data("split"))
        stats = split_dataset(
            Artifact.committed(m.store, deduplicated_dataset["prefix"]),
            out,
            config.eval_fraction,
            config.salt,
            data_executor.executor,
        )
        if stats["train_rows"] == 0:
            raise dg.Failure(f"{m.partition}: no training rows left after cleaning and deduplication")
        before = deduplicated_dataset["stats"]
        stats.update(eval_fraction=config.eval_fraction, objective=before["objective"], accounting=before["accounting"])
        sample = table(sample_rows(out.records("eval")))
        dataset = dataset_metadata(stats["train_rows"] + stats["eval_rows"], ROW_SCHEMA)
        ref = m.publish(out, stats, {"deduplicated_dataset": deduplicated_dataset})
    return m.output(ref, train_rows=stats["train_rows"], eval_rows=stats["eval_rows"], eval_sample=sample, **dataset)


def _tokenizer_files(m: Materialization, base_model: dict) -> TokenizerFiles:
    """The base model's tokenizer as files: each worker loads it once (the driver does not load it at all)."""
    return TokenizerFiles.from_dir(
        m.fetch(base_model, "tokenizer", include=lambda rel: not rel.endswith(".safetensors"))
    )


def shard_stats(
    per_split: dict, seq_len: int, objective: str, accounting: RowAccounting, images: ImagePool | None = None
) -> dict:
    """tokenized_shards' stats: what was packed, per split and in all, and the final row accounting; for a
    vision-language model's shards, where their images are kept and how many they hold."""
    train, evaluation = per_split["train"], per_split["eval"]
    slots = train.slots + evaluation.slots
    pictures = {}
    if images is not None:
        pictures = {"images_prefix": images.prefix, "images": train.images, "image_tokens": train.image_tokens,
                    "eval_images": evaluation.images, "eval_image_tokens": evaluation.image_tokens}  # fmt: skip
    return {
        **pictures,
        "objective": objective,
        "seq_len": seq_len,
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
        "accounting": accounting.as_dict(),
    }


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
    objective = objectives.of_stats(train_eval_split["stats"])
    kind, images = objective.pack_kind, None
    keys = layout.of(context.partition_key)
    if is_vision_model(base_model.get("model_config") or {}):  # its rows may hold images, read from the dataset's pool
        try:
            kind = for_vision(kind)
        except ValueError as exc:
            raise dg.Failure(f"{context.partition_key}: {exc}") from exc
        images = ImagePool(store.open().url, keys.images)
    with Materialization(context, store, "tokenize", data_executor) as m:
        out = Artifact.begin(m.store, keys.data("shards"))
        per_split = tokenize_splits(
            Artifact.committed(m.store, train_eval_split["prefix"]), ("train", "eval"), _tokenizer_files(m, base_model), config.seq_len, out, config.window,
            data_executor.executor, kind=kind, images=images,
        )  # fmt: skip
        for split, packed in per_split.items():
            context.log.info(
                f"{split}: {packed.examples} {objective.items}, {packed.tokens} tokens in {packed.rows} rows "
                f"(packing efficiency {packed.packing_efficiency:.4f})"
            )
        # the encode tasks wrote the refused rows as quarantine-<split>-NNNNN parts: the count by reason
        rejected = dict(Counter(err.reason for _, err in per_split["train"].rejected + per_split["eval"].rejected))
        kept = per_split["train"].examples + per_split["eval"].examples
        accounting = RowAccounting.of(train_eval_split["stats"]).quarantined(rejected).kept(kept)
        stats = shard_stats(per_split, config.seq_len, objective.name, accounting, images)
        if images is not None:  # which stored pictures the shards name, per split: the lineage lists them
            named = {split: sorted(per_split[split].image_refs) for split in ("train", "eval")}
            (m.out / IMAGES_FILE).write_text(json.dumps({"prefix": images.prefix, **named}))
        dataset = dataset_metadata(stats["train_packed_rows"] + stats["eval_packed_rows"], kind.schema)
        ref = m.publish(out, stats, {"train_eval_split": train_eval_split, "base_model": base_model})
    if not accounting.invariant_holds:
        context.log.error(f"row accounting does not balance: {accounting}")
    return m.output(
        ref,
        tokens=stats["tokens"],
        loss_tokens=stats["loss_tokens"],
        packing_efficiency=dg.MetadataValue.float(round(stats["packing_efficiency"], 5)),
        train_packed_rows=stats["train_packed_rows"],
        eval_packed_rows=stats["eval_packed_rows"],
        seq_len=config.seq_len,
        objective=objective.name,
        **({"images": stats["images"], "image_tokens": stats["image_tokens"]} if images is not None else {}),
        rows_in=accounting.rows_in,
        rows_kept=accounting.rows_kept,
        rows_quarantined=accounting.rows_quarantined,
        exact_duplicates=accounting.exact_duplicates,
        near_duplicates=accounting.near_duplicates,
        accounting=dg.MetadataValue.md(accounting.line()),
        quarantine_reasons=_reasons(accounting.quarantine_reasons),
        **dataset,
    )
