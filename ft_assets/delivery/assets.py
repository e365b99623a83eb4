"""Delivery-plane assets (group ``delivery``, CPU): merge → GGUF → eval (blocking gate) → publish → serving smoke.

No GPU time is spent here: merging, export and evaluation of a small-to-mid model run on CPU
workers while the GPU pool trains the next version. Artifacts go to
``runs/<name>/<version>/delivery/<run>/``; only a model that passed the eval gate is copied to the
registry (``registry/<name>/<version>/<run>/``) with its lineage manifest.

The GGUF side runs in llama.cpp, the runtime users run (``ft_assets.delivery.llamacpp``; the
``llamacpp`` extra): ``gguf_model`` checks every file in it and picks the one that ships,
``eval_report`` scores that file beside the merged model, ``serving_smoke`` serves the published one.
"""

import json
import os
import shutil
from pathlib import Path

import dagster as dg

from ft_assets import layout
from ft_assets.data.preference import PREFERENCE
from ft_assets.data.rows import iter_records
from ft_assets.delivery import evaluate as ev
from ft_assets.delivery import llamacpp
from ft_assets.delivery.config import EvalConfig, GgufConfig, MergeConfig, PublishConfig, ServingConfig
from ft_assets.delivery.gguf_export import (
    SUPPORTED_QTYPES,
    GgufExportError,
    export_gguf,
    modelfile_gguf,
    verify_gguf,
    write_modelfile,
)
from ft_assets.delivery.merge import copy_tokenizer, load_full_precision, merge_adapter
from ft_assets.delivery.publish import LINEAGE_CHAIN, LINEAGE_FILE, build_lineage, push_to_hub
from ft_assets.manifests import ArtifactNotFound, fetch_artifact, read_manifest
from ft_assets.materialize import STORE_KIND, Materialization, op_config, ref_metadata, table
from ft_assets.partitions import DatasetVersion, dataset_version
from ft_assets.plots import bar_chart
from ft_assets.refs import make_ref, publish, read_ref
from ft_assets.resources import ObjectStoreResource
from ft_assets.training.tracking import record

GGUF_QTYPES = (*SUPPORTED_QTYPES, *llamacpp.K_QUANTS)
DELIVERY = dict(partitions_def=dataset_version, group_name="delivery", io_manager_key="refs", tags={"ft/pool": "cpu"})


def _delivery_prefix(partition: str, adapter: dict, what: str) -> str:
    return layout.of(partition).delivery(adapter["stats"]["run_id"], what)


@dg.asset(**DELIVERY, kinds={"pytorch", "huggingface", "safetensors", STORE_KIND})
def merged_model(
    context: dg.AssetExecutionContext, config: MergeConfig, store: ObjectStoreResource, lora_adapter: dict, base_model: dict
) -> dg.Output[dict]:
    """The adapter folded into a full-precision copy of the base (never a 4-bit one): safetensors + tokenizer."""
    with Materialization(context, store, "merge") as m:
        adapter_dir = m.fetch(lora_adapter, "adapter")
        out = m.work / "merged"
        if lora_adapter["stats"]["method"] == "full":
            shutil.copytree(adapter_dir, out)
            stats = {"dtype": "as trained", "method": "full"}
        else:
            base_dir = m.fetch(base_model, "base")
            context.log.info(f"merging the {lora_adapter['stats']['method']} adapter into a {config.dtype} base")
            stats = merge_adapter(base_dir, adapter_dir, out, config.dtype)
            stats["method"] = lora_adapter["stats"]["method"]
        copy_tokenizer(adapter_dir, out)
        ref = m.publish(
            _delivery_prefix(m.partition, lora_adapter, "merged"), stats, {"lora_adapter": lora_adapter, "base_model": base_model},
            folder=out,
        )
    return m.output(ref, dtype=stats["dtype"])


@dg.asset(**DELIVERY, kinds={"llama", "gguf", STORE_KIND})
def gguf_model(
    context: dg.AssetExecutionContext, config: GgufConfig, store: ObjectStoreResource, merged_model: dict, lora_adapter: dict
) -> dg.Output[dict]:
    """GGUF files (llama.cpp / Ollama) with tokenizer and chat template embedded, each checked in llama.cpp against the merged model."""
    unknown = sorted(set(config.qtypes) - set(GGUF_QTYPES))
    if unknown or not config.qtypes:
        raise dg.Failure(f"gguf_model config qtypes={config.qtypes}: choose from {', '.join(GGUF_QTYPES)}")
    if config.ship not in ("auto", *config.qtypes):
        raise dg.Failure(f"gguf_model config ship={config.ship!r}: 'auto' or one of the exported qtypes {config.qtypes}")
    version = DatasetVersion.from_key(context.partition_key)
    stem = f"{version.name}-{version.version}"
    with Materialization(context, store, "gguf") as m:
        merged_dir = m.fetch(merged_model, "merged")
        try:
            reference = llamacpp.reference(merged_dir)
            files = {}
            for qtype in sorted(config.qtypes, key=lambda q: q in llamacpp.K_QUANTS):  # K-quants are made from the f16 file
                name = f"{stem}-{qtype}.gguf"
                if qtype in llamacpp.K_QUANTS:
                    f16 = m.out / f"{stem}-f16.gguf" if "f16" in config.qtypes else m.work / f"{stem}-f16.gguf"
                    if not f16.is_file():
                        export_gguf(merged_dir, f16, "f16", name=stem)
                    written = llamacpp.quantize(f16, m.out / name, qtype)
                else:
                    written = export_gguf(merged_dir, m.out / name, qtype, name=stem)
                files[name] = _checked_gguf(context, merged_dir, m.out / name, written, reference, config.verify)
            shipped = llamacpp.choose_shipped(files, config.ship, config.ship_max_rel_error)
            write_modelfile(shipped, m.out / "Modelfile", reference.chat_template, system=config.system_prompt or None)
        except (GgufExportError, llamacpp.LlamaCppError) as exc:
            raise dg.Failure(str(exc)) from exc
        context.log.info(f"shipping {shipped} ({config.ship}; llama.cpp rel. logit error {files[shipped]['llamacpp']['rel_error']:.2e})")
        stats = {"files": files, "shipped": shipped, "ship": config.ship, "ship_max_rel_error": config.ship_max_rel_error, "modelfile": "Modelfile"}
        ref = m.publish(_delivery_prefix(m.partition, lora_adapter, "gguf"), stats, {"merged_model": merged_model})
    rows = [
        {"file": name, "type": e["qtype"], "MB": round(e["bytes"] / 1e6, 2), "shipped": name == shipped,
         "llamacpp_rel_logit_error": e["llamacpp"]["rel_error"], "llamacpp_top1": e["llamacpp"]["top1_agreement"],
         "llamacpp_kl": e["llamacpp"]["kl_divergence"], "greedy_equal": f"{e['llamacpp']['greedy_match']}/{e['llamacpp']['greedy_prompts']}",
         "token_ids_equal": e["llamacpp"]["tokens_match"], "transformers_rel_logit_error": e.get("transformers", {}).get("rel_error"),
         "tensor_types": ", ".join(f"{t} {n}" for t, n in sorted(e["tensor_types"].items()))}
        for name, e in files.items()
    ]  # fmt: skip
    return m.output(ref, files=table(rows), shipped=shipped, shipped_qtype=files[shipped]["qtype"])


def _checked_gguf(context, merged_dir: Path, path: Path, written: dict, reference: "llamacpp.Reference", verify: bool) -> dict:
    """One file's entry in gguf_model's stats: what was written, llama.cpp's check, transformers' round trip."""
    check = llamacpp.check_file(path, reference)
    if not check["tokens_match"]:
        raise dg.Failure(
            f"{path.name}: llama.cpp tokenizes {len(check['token_mismatches'])} test strings differently from the HF tokenizer, "
            f"e.g. {check['token_mismatches'][0]!r}; the tokenizer metadata is wrong",
            metadata={"token_mismatches": json.dumps(check["token_mismatches"])},
        )
    entry = {
        "qtype": written["qtype"], "bytes": written["bytes"], "sha256": written["sha256"], "tensor_types": written["tensor_types"],
        "llamacpp": {k: v for k, v in check.items() if k != "token_mismatches"},
    }  # fmt: skip
    if verify and written["qtype"] in SUPPORTED_QTYPES:  # the round trip through transformers checks our own writer
        report = verify_gguf(merged_dir, path, written["qtype"])
        entry["transformers"] = {k: report[k] for k in ("rel_error", "top1_agreement", "tolerance", "tokens_match", "ok")}
        if not report["ok"]:
            raise dg.Failure(
                f"{path.name} does not reproduce the merged model under transformers: rel_error {report['rel_error']:.4f} (tolerance "
                f"{report['tolerance']}), tokens match {report['tokens_match']}, chat template {report['chat_template_match']}",
                metadata={k: str(v) for k, v in report.items()},
            )
    context.log.info(
        f"{path.name}: {written['bytes'] / 1e6:.1f} MB {written['tensor_types']}; llama.cpp rel. logit error {check['rel_error']:.2e}, "
        f"greedy equal on {check['greedy_match']}/{check['greedy_prompts']} prompts"
    )
    return entry


@dg.asset(**DELIVERY, kinds={"pytorch", "llama", "json", STORE_KIND})
def eval_report(
    context: dg.AssetExecutionContext,
    config: EvalConfig,
    store: ObjectStoreResource,
    merged_model: dict,
    base_model: dict,
    gguf_model: dict,
    train_eval_split: dict,
    tokenized_shards: dict,
    lora_adapter: dict,
) -> dg.Output[dict]:
    """Base vs fine-tuned vs the shipped GGUF (through llama.cpp) on the fixed eval split: loss, perplexity, the task metric, answers;
    for a preference run, reward accuracy and margin on the held-out pairs (``_preference_report``)."""
    if tokenized_shards["stats"]["kind"] == PREFERENCE:
        return _preference_report(context, config, store, merged_model, base_model, gguf_model, tokenized_shards, lora_adapter)
    if config.metric not in ev.METRICS:
        raise dg.Failure(f"eval_report config metric={config.metric!r}: choose one of {', '.join(ev.METRICS)}")
    from transformers import AutoTokenizer

    shipped = gguf_model["stats"]["shipped"]
    qtype = gguf_model["stats"]["files"][shipped]["qtype"]
    with Materialization(context, store, "eval") as m:
        split_dir = m.fetch(train_eval_split, "split", include=lambda rel: rel == "eval.parquet")
        shards_dir = m.fetch(tokenized_shards, "shards", include=lambda rel: rel.startswith("eval-"))
        examples = ev.eval_examples(list(iter_records(split_dir / "eval.parquet")), config.max_examples)
        if not examples:
            raise dg.Failure(f"{m.partition}: the eval split is empty; raise train_eval_split.eval_fraction")
        scores = {}
        for label, ref in (("base", base_model), ("fine-tuned", merged_model)):
            model_dir = m.fetch(ref, label)
            tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
            model = load_full_precision(model_dir)
            context.log.info(f"scoring the {label} model on {len(examples)} eval conversations ({config.metric})")
            scores[label] = ev.score_model(model, tokenizer, examples, shards_dir, config.metric, config.max_new_tokens, context.log.info)
            del model
        gguf_path = m.fetch(gguf_model, "gguf", include=lambda rel: rel == shipped) / shipped
        context.log.info(f"scoring the shipped {shipped} through llama.cpp on the same {len(examples)} conversations")
        try:
            gguf_answers = llamacpp.chat_answers(gguf_path, [e.prompt for e in examples], config.max_new_tokens, context.log.info)
        except llamacpp.LlamaCppError as exc:
            raise dg.Failure(str(exc)) from exc
        base, tuned = scores["base"], scores["fine-tuned"]
        gguf_metric = ev.task_metric(gguf_answers, examples, config.metric)
        stats = ev.gate(config.metric, base.metric, tuned.metric, gguf_metric, config.min_improvement, config.max_gguf_drop)
        stats.update({
            "gguf_file": shipped,
            "gguf_qtype": qtype,
            "base_eval_loss": base.eval_loss,
            "finetuned_eval_loss": tuned.eval_loss,
            "base_perplexity": base.perplexity,
            "finetuned_perplexity": tuned.perplexity,
            "examples": len(examples),
        })  # fmt: skip
        samples = [
            {"source": e.source, "reference": e.reference, "base": a, "fine-tuned": b, f"gguf {qtype}": c}
            for e, a, b, c in zip(examples, base.answers, tuned.answers, gguf_answers)
        ]
        (m.out / "report.json").write_text(json.dumps({"stats": stats, "answers": samples}, indent=2))
        ref = m.publish(
            _delivery_prefix(m.partition, lora_adapter, "eval"), stats,
            {"merged_model": merged_model, "base_model": base_model, "gguf_model": gguf_model, "train_eval_split": train_eval_split},
        )  # fmt: skip
    gguf_label = f"GGUF {qtype} (llama.cpp)"
    context.log.info(
        f"{config.metric}: base {base.metric:.3f} → fine-tuned {tuned.metric:.3f} → shipped {qtype} {stats['gguf_metric']:.3f}; "
        f"eval loss {base.eval_loss:.4f} → {tuned.eval_loss:.4f}"
    )
    _track(context, lora_adapter, {config.metric: tuned.metric, f"base_{config.metric}": base.metric, f"gguf_{config.metric}": stats["gguf_metric"]})
    comparison = [
        {"": config.metric, "base": round(base.metric, 3), "fine-tuned": round(tuned.metric, 3), gguf_label: round(stats["gguf_metric"], 3)},
        {"": "eval loss", "base": round(base.eval_loss, 4), "fine-tuned": round(tuned.eval_loss, 4), gguf_label: None},
        {"": "perplexity", "base": round(base.perplexity, 2), "fine-tuned": round(tuned.perplexity, 2), gguf_label: None},
    ]
    bars = {"base": base.metric, "fine-tuned": tuned.metric, f"GGUF {qtype}": stats["gguf_metric"]}
    chart = bar_chart({config.metric: bars}, f"{config.metric} on {len(examples)} eval prompts", config.metric)
    return m.output(
        ref,
        comparison=table(comparison),
        chart=dg.MetadataValue.md(chart),
        answers=dg.MetadataValue.md(ev.comparison_table(examples, base, tuned, gguf_answers, gguf_label)),
        base_metric=dg.MetadataValue.float(base.metric),
        finetuned_metric=dg.MetadataValue.float(tuned.metric),
        gguf_metric=dg.MetadataValue.float(stats["gguf_metric"]),
        gguf_drop=dg.MetadataValue.float(stats["gguf_drop"]),
        gguf_file=shipped,
        base_eval_loss=dg.MetadataValue.float(base.eval_loss),
        finetuned_eval_loss=dg.MetadataValue.float(tuned.eval_loss),
    )


def _track(context: dg.AssetExecutionContext, lora_adapter: dict, metrics: dict) -> None:
    """The eval figures on the training run's MLflow run, when it was tracked."""
    run_id = lora_adapter["stats"]["mlflow_run_id"]
    if run_id:
        uri = lora_adapter["training_config"]["mlflow_tracking_uri"]
        record(uri, run_id, context.log.warning, metrics=metrics, step=lora_adapter["stats"]["steps"])


def _preference_report(
    context, config: EvalConfig, store, merged_model: dict, base_model: dict, gguf_model: dict, tokenized_shards: dict, lora_adapter: dict
):
    """eval_report for a preference run: base, tuned and the shipped GGUF (through llama.cpp) scored on the same held-out
    pairs (``evaluate.preference_scores``), gated by reward accuracy like a chat run by its task metric."""
    from transformers import AutoTokenizer

    training = lora_adapter["training_config"]
    beta, loss_type = training["dpo_beta"], training["dpo_loss"]
    shipped = gguf_model["stats"]["shipped"]
    qtype = gguf_model["stats"]["files"][shipped]["qtype"]
    with Materialization(context, store, "eval") as m:
        shards_dir = m.fetch(tokenized_shards, "shards", include=lambda rel: rel.startswith("pairs-eval-"))
        try:
            rows = ev.eval_pairs(shards_dir, config.max_examples)
        except FileNotFoundError as exc:
            raise dg.Failure(f"{m.partition}: the eval split holds no pairs; raise train_eval_split.eval_fraction") from exc
        scores = {}
        for label, ref in (("base", base_model), ("fine-tuned", merged_model)):
            model_dir = m.fetch(ref, label)
            context.log.info(f"scoring the {label} model on {rows.pairs} eval pairs")
            scores[label] = ev.pair_scores(load_full_precision(model_dir), rows)
        tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
        gguf_path = m.fetch(gguf_model, "gguf", include=lambda rel: rel == shipped) / shipped
        context.log.info(f"scoring the shipped {shipped} through llama.cpp on the same {rows.pairs} pairs")
        try:
            gguf_scores = ev.gguf_pair_scores(gguf_path, rows)
        except llamacpp.LlamaCppError as exc:
            raise dg.Failure(str(exc)) from exc
        figures = ev.preference_scores(scores["fine-tuned"], scores["base"], rows, beta, loss_type)
        gguf = ev.preference_scores(gguf_scores, scores["base"], rows, beta, loss_type)
        stats = ev.gate(
            ev.PREFERENCE_METRIC, figures["base_reward_accuracy"], figures["finetuned_reward_accuracy"],
            gguf["finetuned_reward_accuracy"], config.min_improvement, config.max_gguf_drop,
        )  # fmt: skip
        stats.update({
            "gguf_file": shipped,
            "gguf_qtype": qtype,
            "base_eval_loss": figures["base_eval_loss"],
            "finetuned_eval_loss": figures["finetuned_eval_loss"],
            "base_reward_margin": figures["base_reward_margin"],
            "finetuned_reward_margin": figures["finetuned_reward_margin"],
            "gguf_reward_margin": gguf["finetuned_reward_margin"],
            "examples": figures["pairs"],
            "dpo_beta": beta,
            "dpo_loss": loss_type,
        })  # fmt: skip
        pairs = ev.pair_table(tokenizer, rows, scores["base"], scores["fine-tuned"], beta)
        (m.out / "report.json").write_text(json.dumps({"stats": stats}, indent=2))
        ref = m.publish(
            _delivery_prefix(m.partition, lora_adapter, "eval"), stats,
            {"merged_model": merged_model, "base_model": base_model, "gguf_model": gguf_model, "tokenized_shards": tokenized_shards},
        )  # fmt: skip
    context.log.info(
        f"reward accuracy: base {stats['base_metric']:.3f} → fine-tuned {stats['finetuned_metric']:.3f} → shipped {qtype} "
        f"{stats['gguf_metric']:.3f}; reward margin {stats['base_reward_margin']:+.3f} → {stats['finetuned_reward_margin']:+.3f} "
        f"on {stats['examples']} pairs"
    )
    _track(context, lora_adapter, {
        "reward_accuracy": stats["finetuned_metric"], "reward_margin": stats["finetuned_reward_margin"],
        "base_reward_accuracy": stats["base_metric"], "base_reward_margin": stats["base_reward_margin"],
        "gguf_reward_accuracy": stats["gguf_metric"],
    })  # fmt: skip
    gguf_label = f"GGUF {qtype} (llama.cpp)"
    comparison = [
        {"": "reward accuracy", "base": round(stats["base_metric"], 3), "fine-tuned": round(stats["finetuned_metric"], 3),
         gguf_label: round(stats["gguf_metric"], 3)},
        {"": "reward margin", "base": round(stats["base_reward_margin"], 4), "fine-tuned": round(stats["finetuned_reward_margin"], 4),
         gguf_label: round(stats["gguf_reward_margin"], 4)},
        {"": f"DPO loss ({loss_type})", "base": round(stats["base_eval_loss"], 4), "fine-tuned": round(stats["finetuned_eval_loss"], 4),
         gguf_label: None},
    ]  # fmt: skip
    bars = {"base": stats["base_metric"], "fine-tuned": stats["finetuned_metric"], f"GGUF {qtype}": stats["gguf_metric"]}
    chart = bar_chart({"reward accuracy": bars}, f"reward accuracy on {stats['examples']} eval pairs", "reward accuracy")
    return m.output(
        ref,
        comparison=table(comparison),
        chart=dg.MetadataValue.md(chart),
        pairs=dg.MetadataValue.md(pairs),
        base_metric=dg.MetadataValue.float(stats["base_metric"]),
        finetuned_metric=dg.MetadataValue.float(stats["finetuned_metric"]),
        gguf_metric=dg.MetadataValue.float(stats["gguf_metric"]),
        gguf_drop=dg.MetadataValue.float(stats["gguf_drop"]),
        gguf_file=shipped,
        base_reward_margin=dg.MetadataValue.float(stats["base_reward_margin"]),
        finetuned_reward_margin=dg.MetadataValue.float(stats["finetuned_reward_margin"]),
        base_eval_loss=dg.MetadataValue.float(stats["base_eval_loss"]),
        finetuned_eval_loss=dg.MetadataValue.float(stats["finetuned_eval_loss"]),
    )


@dg.asset(**DELIVERY, kinds={"huggingface", "llama", STORE_KIND}, deps=["gguf_model"])
def published_model(
    context: dg.AssetExecutionContext, config: PublishConfig, store: ObjectStoreResource, eval_report: dict, lora_adapter: dict
) -> dg.Output[dict]:
    """The gated model in the registry with its lineage manifest; a published run is never overwritten."""
    stats = eval_report["stats"]
    if not stats["beats_base"]:
        raise dg.Failure(
            f"not publishing {context.partition_key}: fine-tuned {stats['metric_name']} {stats['finetuned_metric']:.3f} does not beat "
            f"base {stats['base_metric']:.3f} by {stats['min_improvement']:.3f} (see eval_report)"
        )
    if not stats["gguf_within_drop"]:
        raise dg.Failure(
            f"not publishing {context.partition_key}: the shipped {stats['gguf_file']} scores {stats['metric_name']} {stats['gguf_metric']:.3f} "
            f"in llama.cpp, {stats['gguf_drop']:.3f} below the merged model's {stats['finetuned_metric']:.3f} (at most "
            f"{stats['max_gguf_drop']:.3f}); ship a more precise type (gguf_model.ship) or see eval_report's answers"
        )
    objects = store.open()
    prefix = layout.of(context.partition_key).registry(lora_adapter["stats"]["run_id"])
    refs = {name: read_ref(objects, context.partition_key, name) for name in LINEAGE_CHAIN}
    try:
        existing = read_manifest(objects, prefix)
    except ArtifactNotFound:
        existing = None
    with store.scratch("publish") as work:
        out = work / "published"
        if existing is not None:
            context.log.warning(f"{objects.uri(prefix)} is already published; not overwriting it")
            fetch_artifact(objects, prefix, out, include=lambda rel: rel == LINEAGE_FILE)
            lineage = json.loads((out / LINEAGE_FILE).read_text())
            ref = make_ref(objects, "published_model", context.partition_key, existing, {"already_published": True}, {}, config=op_config(context))
        else:
            fetch_artifact(objects, refs["merged_model"]["prefix"], out / "merged")
            if lora_adapter["stats"]["method"] != "full":  # the adapter alone: what multi-LoRA servers load
                fetch_artifact(objects, refs["lora_adapter"]["prefix"], out / "adapter")
            fetch_artifact(objects, refs["gguf_model"]["prefix"], out / "gguf")
            fetch_artifact(objects, refs["eval_report"]["prefix"], out / "eval")
            lineage = build_lineage(context.partition_key, refs, prefix)
            (out / LINEAGE_FILE).write_text(json.dumps(lineage, indent=2, sort_keys=True))
            ref = publish(
                objects, "published_model", context.partition_key, prefix, out, {"already_published": False},
                {name: refs[name] for name in ("eval_report", "gguf_model", "merged_model", "lora_adapter")},
                config=op_config(context),
            )  # fmt: skip
        if config.hub_repo_id:
            push_to_hub(out, config.hub_repo_id, os.environ.get("HF_TOKEN"), config.hub_dry_run, log=context.log.info)
    return dg.Output(
        ref,
        metadata={
            **ref_metadata(ref),
            "code_version": lineage["code_version"],
            "lineage": table([{"asset": a["asset"], "digest": a["digest"][:16], "uri": objects.uri(a["key"])} for a in lineage["artifacts"]]),
            "already_published": existing is not None,
        },
    )


@dg.asset(**DELIVERY, kinds={"llama", "openai"})
def serving_smoke(
    context: dg.AssetExecutionContext, config: ServingConfig, store: ObjectStoreResource, published_model: dict, lora_adapter: dict
) -> dg.Output[dict]:
    """The published GGUF behind llama-cpp-python's OpenAI-compatible server on loopback: one chat completion per smoke prompt.

    Its own asset after published_model, not part of it: it serves the file as published (the one the
    registry's Modelfile names in FROM), a published run is never rewritten to add metadata to it, and a
    server that fails to start shows as this asset failing, rerun alone, while the model stays published.
    """
    with Materialization(context, store, "serving") as m:
        published = m.fetch(published_model, "published", include=lambda rel: rel == "gguf/Modelfile")
        try:
            shipped = modelfile_gguf(published / "gguf" / "Modelfile")
            m.fetch(published_model, "published", include=lambda rel: rel == f"gguf/{shipped}")
            context.log.info(f"serving {shipped} with llama_cpp.server; {len(config.prompts)} chat completions over HTTP")
            answers = llamacpp.serving_smoke(published / "gguf" / shipped, config.prompts, config.max_tokens)
        except (GgufExportError, llamacpp.LlamaCppError) as exc:
            raise dg.Failure(str(exc)) from exc
        (m.out / "answers.json").write_text(json.dumps(answers, indent=2))
        stats = {"file": shipped, "answers": answers, "server": "llama_cpp.server (OpenAI-compatible, /v1/chat/completions)"}
        ref = m.publish(_delivery_prefix(m.partition, lora_adapter, "serving"), stats, {"published_model": published_model})
    return m.output(ref, file=shipped, answers=table(answers))
