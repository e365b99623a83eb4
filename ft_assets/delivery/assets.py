"""Delivery-plane assets (group ``delivery``, CPU): merge → GGUF → eval (blocking gate) → publish.

No GPU time is spent here: merging, export and evaluation of a small-to-mid model run on CPU
workers while the GPU pool trains the next version. Artifacts go to
``runs/<name>/<version>/delivery/<run>/``; only a model that passed the eval gate is copied to the
registry (``registry/<name>/<version>/<run>/``) with its lineage manifest.
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
from ft_assets.delivery.config import EvalConfig, GgufConfig, MergeConfig, PublishConfig
from ft_assets.delivery.gguf_export import SUPPORTED_QTYPES, export_gguf, verify_gguf, write_modelfile
from ft_assets.delivery.merge import copy_tokenizer, load_full_precision, merge_adapter
from ft_assets.delivery.publish import LINEAGE_CHAIN, LINEAGE_FILE, build_lineage, push_to_hub
from ft_assets.manifests import ArtifactNotFound, fetch_artifact, read_manifest
from ft_assets.materialize import Materialization, op_config, ref_metadata, table
from ft_assets.partitions import DatasetVersion, dataset_version
from ft_assets.plots import bar_chart
from ft_assets.refs import make_ref, publish, read_ref
from ft_assets.resources import ObjectStoreResource
from ft_assets.training.tracking import record

DELIVERY = dict(partitions_def=dataset_version, group_name="delivery", io_manager_key="refs", tags={"ft/pool": "cpu"})


def _delivery_prefix(partition: str, adapter: dict, what: str) -> str:
    return layout.of(partition).delivery(adapter["stats"]["run_id"], what)


@dg.asset(**DELIVERY, kinds={"pytorch", "safetensors"})
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


@dg.asset(**DELIVERY, kinds={"gguf"})
def gguf_model(
    context: dg.AssetExecutionContext, config: GgufConfig, store: ObjectStoreResource, merged_model: dict, lora_adapter: dict
) -> dg.Output[dict]:
    """GGUF files (llama.cpp / Ollama) with tokenizer and chat template embedded, each verified against the merged logits."""
    unknown = sorted(set(config.qtypes) - set(SUPPORTED_QTYPES))
    if unknown or not config.qtypes:
        raise dg.Failure(f"gguf_model config qtypes={config.qtypes}: choose from {', '.join(SUPPORTED_QTYPES)}")
    version = DatasetVersion.from_key(context.partition_key)
    with Materialization(context, store, "gguf") as m:
        merged_dir = m.fetch(merged_model, "merged")
        files, rows = {}, []
        for qtype in config.qtypes:
            name = f"{version.name}-{version.version}-{qtype}.gguf"
            written = export_gguf(merged_dir, m.out / name, qtype, name=f"{version.name}-{version.version}")
            entry = {"qtype": qtype, "bytes": written["bytes"], "sha256": written["sha256"]}
            if config.verify:
                report = verify_gguf(merged_dir, m.out / name, qtype)
                entry.update({k: report[k] for k in ("rel_error", "top1_agreement", "tolerance", "tokens_match", "ok")})
                if not report["ok"]:
                    raise dg.Failure(
                        f"{name} does not reproduce the merged model: rel_error {report['rel_error']:.4f} (tolerance "
                        f"{report['tolerance']}), tokens match {report['tokens_match']}, chat template {report['chat_template_match']}",
                        metadata={k: str(v) for k, v in report.items()},
                    )
            context.log.info(f"{name}: {written['bytes'] / 1e6:.1f} MB" + (f", rel. logit error {entry['rel_error']:.2e}" if config.verify else ""))
            files[name] = entry
            rows.append(
                {"file": name, "type": qtype, "MB": round(written["bytes"] / 1e6, 1), "rel_logit_error": entry.get("rel_error"),
                 "top1_agreement": entry.get("top1_agreement")}
            )  # fmt: skip
        first = next(iter(files))
        write_modelfile(first, m.out / "Modelfile", system=config.system_prompt or None)
        smoke = llamacpp_smoke(m.out / first)
        stats = {"files": files, "modelfile": "Modelfile", "llamacpp_smoke": smoke}
        ref = m.publish(_delivery_prefix(m.partition, lora_adapter, "gguf"), stats, {"merged_model": merged_model})
    return m.output(ref, files=table(rows), llamacpp_smoke=smoke)


def llamacpp_smoke(path: Path) -> str:
    """Load the GGUF in llama.cpp and generate a few tokens, when the optional [llamacpp] extra is installed."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return "not run: install the optional extra ft-assets[llamacpp] (llama-cpp-python)"
    model = Llama(model_path=str(path), n_ctx=256, verbose=False)
    reply = model.create_chat_completion(messages=[{"role": "user", "content": "Say hello."}], max_tokens=8)
    text = reply["choices"][0]["message"]["content"]
    return f"ok: llama.cpp answered {text!r}"


@dg.asset(**DELIVERY, kinds={"pytorch"})
def eval_report(
    context: dg.AssetExecutionContext,
    config: EvalConfig,
    store: ObjectStoreResource,
    merged_model: dict,
    base_model: dict,
    train_eval_split: dict,
    tokenized_shards: dict,
    lora_adapter: dict,
) -> dg.Output[dict]:
    """Base vs fine-tuned on the fixed eval split: eval loss, perplexity, the task metric, answers side by side;
    for a preference run, reward accuracy and margin on the held-out pairs (the gate's metric: reward_accuracy)."""
    if tokenized_shards["stats"]["kind"] == PREFERENCE:
        return _preference_report(context, config, store, merged_model, base_model, tokenized_shards, lora_adapter)
    if config.metric not in ev.METRICS:
        raise dg.Failure(f"eval_report config metric={config.metric!r}: choose one of {', '.join(ev.METRICS)}")
    from transformers import AutoTokenizer

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
        base, tuned = scores["base"], scores["fine-tuned"]
        improvement = tuned.metric - base.metric
        stats = {
            "metric_name": config.metric,
            "base_metric": base.metric,
            "finetuned_metric": tuned.metric,
            "improvement": improvement,
            "min_improvement": config.min_improvement,
            "passed": improvement >= config.min_improvement,
            "base_eval_loss": base.eval_loss,
            "finetuned_eval_loss": tuned.eval_loss,
            "base_perplexity": base.perplexity,
            "finetuned_perplexity": tuned.perplexity,
            "examples": len(examples),
        }
        samples = [
            {"source": e.source, "reference": e.reference, "base": a, "fine-tuned": b}
            for e, a, b in zip(examples, base.answers, tuned.answers)
        ]
        (m.out / "report.json").write_text(json.dumps({"stats": stats, "answers": samples}, indent=2))
        ref = m.publish(
            _delivery_prefix(m.partition, lora_adapter, "eval"), stats,
            {"merged_model": merged_model, "base_model": base_model, "train_eval_split": train_eval_split},
        )  # fmt: skip
    context.log.info(
        f"{config.metric}: base {base.metric:.3f} → fine-tuned {tuned.metric:.3f}; eval loss {base.eval_loss:.4f} → {tuned.eval_loss:.4f}"
    )
    _track(context, lora_adapter, {config.metric: tuned.metric, f"base_{config.metric}": base.metric})
    comparison = [
        {"": config.metric, "base": round(base.metric, 3), "fine-tuned": round(tuned.metric, 3)},
        {"": "eval loss", "base": round(base.eval_loss, 4), "fine-tuned": round(tuned.eval_loss, 4)},
        {"": "perplexity", "base": round(base.perplexity, 2), "fine-tuned": round(tuned.perplexity, 2)},
    ]
    chart = bar_chart({config.metric: {"base": base.metric, "fine-tuned": tuned.metric}}, f"{config.metric} on {len(examples)} eval prompts", config.metric)
    return m.output(
        ref,
        comparison=table(comparison),
        chart=dg.MetadataValue.md(chart),
        answers=dg.MetadataValue.md(ev.comparison_table(examples, base, tuned)),
        base_metric=dg.MetadataValue.float(base.metric),
        finetuned_metric=dg.MetadataValue.float(tuned.metric),
        base_eval_loss=dg.MetadataValue.float(base.eval_loss),
        finetuned_eval_loss=dg.MetadataValue.float(tuned.eval_loss),
    )


def _track(context: dg.AssetExecutionContext, lora_adapter: dict, metrics: dict) -> None:
    """The eval figures on the training run's MLflow run, when it was tracked."""
    run_id = lora_adapter["stats"]["mlflow_run_id"]
    if run_id:
        uri = lora_adapter["training_config"]["mlflow_tracking_uri"]
        record(uri, run_id, context.log.warning, metrics=metrics, step=lora_adapter["stats"]["steps"])


def _preference_report(context, config: EvalConfig, store, merged_model: dict, base_model: dict, tokenized_shards: dict, lora_adapter: dict):
    """eval_report for a preference run: base and tuned scored on every held-out pair (``evaluate.preference_scores``)."""
    from transformers import AutoTokenizer

    training = lora_adapter["training_config"]
    beta, loss_type = training["dpo_beta"], training["dpo_loss"]
    with Materialization(context, store, "eval") as m:
        shards_dir = m.fetch(tokenized_shards, "shards", include=lambda rel: rel.startswith("pairs-eval-"))
        try:
            rows = ev.eval_pairs(shards_dir)
        except FileNotFoundError as exc:
            raise dg.Failure(f"{m.partition}: the eval split holds no pairs; raise train_eval_split.eval_fraction") from exc
        scores = {}
        for label, ref in (("base", base_model), ("fine-tuned", merged_model)):
            model_dir = m.fetch(ref, label)
            context.log.info(f"scoring the {label} model on {rows.pairs} eval pairs")
            scores[label] = ev.pair_scores(load_full_precision(model_dir), rows)
        tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
        figures = ev.preference_scores(scores["fine-tuned"], scores["base"], rows, beta, loss_type)
        improvement = figures["finetuned_reward_accuracy"] - figures["base_reward_accuracy"]
        stats = {
            "metric_name": ev.PREFERENCE_METRIC,
            "base_metric": figures["base_reward_accuracy"],
            "finetuned_metric": figures["finetuned_reward_accuracy"],
            "improvement": improvement,
            "min_improvement": config.min_improvement,
            "passed": improvement >= config.min_improvement,
            "base_eval_loss": figures["base_eval_loss"],
            "finetuned_eval_loss": figures["finetuned_eval_loss"],
            "base_reward_margin": figures["base_reward_margin"],
            "finetuned_reward_margin": figures["finetuned_reward_margin"],
            "examples": figures["pairs"],
            "dpo_beta": beta,
            "dpo_loss": loss_type,
        }
        pairs = ev.pair_table(tokenizer, rows, scores["base"], scores["fine-tuned"], beta)
        (m.out / "report.json").write_text(json.dumps({"stats": stats}, indent=2))
        ref = m.publish(
            _delivery_prefix(m.partition, lora_adapter, "eval"), stats,
            {"merged_model": merged_model, "base_model": base_model, "tokenized_shards": tokenized_shards},
        )  # fmt: skip
    context.log.info(
        f"reward accuracy: base {stats['base_metric']:.3f} → fine-tuned {stats['finetuned_metric']:.3f}; reward margin "
        f"{stats['base_reward_margin']:+.3f} → {stats['finetuned_reward_margin']:+.3f} on {stats['examples']} pairs"
    )
    _track(context, lora_adapter, {
        "reward_accuracy": stats["finetuned_metric"], "reward_margin": stats["finetuned_reward_margin"],
        "base_reward_accuracy": stats["base_metric"], "base_reward_margin": stats["base_reward_margin"],
    })  # fmt: skip
    comparison = [
        {"": "reward accuracy", "base": round(stats["base_metric"], 3), "fine-tuned": round(stats["finetuned_metric"], 3)},
        {"": "reward margin", "base": round(stats["base_reward_margin"], 4), "fine-tuned": round(stats["finetuned_reward_margin"], 4)},
        {"": f"DPO loss ({loss_type})", "base": round(stats["base_eval_loss"], 4), "fine-tuned": round(stats["finetuned_eval_loss"], 4)},
    ]
    chart = bar_chart(
        {"reward accuracy": {"base": stats["base_metric"], "fine-tuned": stats["finetuned_metric"]}},
        f"reward accuracy on {stats['examples']} eval pairs", "reward accuracy",
    )  # fmt: skip
    return m.output(
        ref,
        comparison=table(comparison),
        chart=dg.MetadataValue.md(chart),
        pairs=dg.MetadataValue.md(pairs),
        base_metric=dg.MetadataValue.float(stats["base_metric"]),
        finetuned_metric=dg.MetadataValue.float(stats["finetuned_metric"]),
        base_reward_margin=dg.MetadataValue.float(stats["base_reward_margin"]),
        finetuned_reward_margin=dg.MetadataValue.float(stats["finetuned_reward_margin"]),
        base_eval_loss=dg.MetadataValue.float(stats["base_eval_loss"]),
        finetuned_eval_loss=dg.MetadataValue.float(stats["finetuned_eval_loss"]),
    )


@dg.asset(**DELIVERY, kinds={"python"}, deps=["gguf_model"])
def published_model(
    context: dg.AssetExecutionContext, config: PublishConfig, store: ObjectStoreResource, eval_report: dict, lora_adapter: dict
) -> dg.Output[dict]:
    """The gated model in the registry with its lineage manifest; a published run is never overwritten."""
    stats = eval_report["stats"]
    if not stats["passed"]:
        raise dg.Failure(
            f"not publishing {context.partition_key}: fine-tuned {stats['metric_name']} {stats['finetuned_metric']:.3f} does not beat "
            f"base {stats['base_metric']:.3f} by {stats['min_improvement']:.3f} (see eval_report)"
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
