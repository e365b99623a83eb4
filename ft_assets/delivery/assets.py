"""Delivery-plane assets (group ``delivery``, CPU): merge → GGUF → eval (blocking gate) → publish → serving smokes.

No GPU time is spent here: merging, export and evaluation of a small-to-mid model run on CPU
workers while the GPU pool trains the next version. Artifacts go to
``runs/<name>/<version>/delivery/<run>/``; only a model that passed the eval gate is copied to the
registry (``registry/<name>/<version>/<run>/``) with its lineage manifest.

The GGUF side runs in llama.cpp, the runtime users run (``ft_assets.delivery.llamacpp``; the
``llamacpp`` extra): ``gguf_model`` checks every file in it and picks the one that ships,
``eval_report`` scores that file beside the merged model, ``serving_smoke`` serves the published one.
``vllm_smoke`` serves the published merged model and adapter with vLLM, from a serving venv of its own.
"""

import json
import os
import shutil
from pathlib import Path

import dagster as dg

from ft_assets import layout, objectives
from ft_assets.delivery import evaluate as ev
from ft_assets.delivery import llamacpp, model_registry, portable, signing, vllm
from ft_assets.delivery.config import EvalConfig, GgufConfig, MergeConfig, PublishConfig, ServingConfig, VllmConfig
from ft_assets.delivery.converter import GgufUnsupported
from ft_assets.delivery.gguf_export import (
    SUPPORTED_QTYPES,
    GgufExportError,
    export_ggufs,
    modelfile_gguf,
    verify_gguf,
    write_modelfile,
)
from ft_assets.delivery.lora_registry import served_name
from ft_assets.delivery.merge import copy_tokenizer, load_full_precision, merge_adapter
from ft_assets.delivery.lineage import LINEAGE_CHAIN, LINEAGE_FILE, build_lineage
from ft_assets.delivery.publish import push_to_hub
from ft_assets.manifests import ArtifactNotFound, fetch_artifact, read_manifest
from ft_assets.materialize import STORE_KIND, Materialization, figures, megabytes, op_config, ref_metadata, rounded, table
from ft_assets.partitions import DatasetVersion, dataset_version
from ft_assets.plots import bar_chart
from ft_assets.refs import AdapterStats, ArtifactRef, EvalStats, GgufStats, make_ref, publish, read_ref, stats_of
from ft_assets.resources import ObjectStoreResource
from ft_assets.training.tracking import record

GGUF_QTYPES = (*SUPPORTED_QTYPES, *llamacpp.QUANTIZED)
GGUF_OFF = "GGUF export is off (gguf_model qtypes: [])"
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
        portable.make_portable(out)  # loads unchanged in transformers 4.x and 5.x, vLLM, llama.cpp
        ref = m.publish(
            _delivery_prefix(m.partition, lora_adapter, "merged"), stats, {"lora_adapter": lora_adapter, "base_model": base_model},
            folder=out,
        )
    return m.output(ref, dtype=stats["dtype"])


@dg.asset(**DELIVERY, kinds={"llama", "gguf", STORE_KIND})
def gguf_model(
    context: dg.AssetExecutionContext, config: GgufConfig, store: ObjectStoreResource, merged_model: dict, lora_adapter: dict
) -> dg.Output[dict]:
    """GGUF files (llama.cpp / Ollama) with tokenizer and chat template embedded, each checked in llama.cpp against the merged
    model; or none, with the reason in one line (``qtypes: []``, or a model llama.cpp cannot take): the model still ships."""
    unknown = sorted(set(config.qtypes) - set(GGUF_QTYPES))
    if unknown:
        raise dg.Failure(f"gguf_model config qtypes={config.qtypes}: choose from {', '.join(GGUF_QTYPES)}, or [] for no GGUF")
    if config.qtypes and config.ship not in ("auto", *config.qtypes):
        raise dg.Failure(f"gguf_model config ship={config.ship!r}: 'auto' or one of the exported qtypes {config.qtypes}")
    version = DatasetVersion.from_key(context.partition_key)
    stem = f"{version.name}-{version.version}"
    with Materialization(context, store, "gguf") as m:
        files, shipped, reason = {}, None, GGUF_OFF
        if config.qtypes:
            merged_dir = m.fetch(merged_model, "merged")
            try:
                files, chat_template = _written_and_checked(context, m, merged_dir, stem, config)
                shipped = llamacpp.choose_shipped(files, config.ship, config.ship_max_rel_error)
                write_modelfile(shipped, m.out / "Modelfile", chat_template, system=config.system_prompt or None)
                reason = None
            except GgufUnsupported as exc:
                files, reason = {}, f"llama.cpp cannot take this model: {exc}"
                for written in m.out.glob("*.gguf"):  # nothing half-made is published
                    written.unlink()
            except (GgufExportError, llamacpp.LlamaCppError) as exc:
                raise dg.Failure(str(exc)) from exc
        if shipped:
            context.log.info(f"shipping {shipped} ({config.ship}; llama.cpp rel. logit error {files[shipped]['llamacpp']['rel_error']:.2e})")
        else:
            context.log.warning(f"no GGUF: {reason}")
        stats = {
            "files": files, "shipped": shipped, "reason": reason, "ship": config.ship, "ship_max_rel_error": config.ship_max_rel_error,
            "modelfile": "Modelfile" if shipped else None,
        }  # fmt: skip
        ref = m.publish(_delivery_prefix(m.partition, lora_adapter, "gguf"), stats, {"merged_model": merged_model})
    if not shipped:
        return m.output(ref, shipped="none", gguf_reason=reason)
    return m.output(
        ref, shipped=shipped, shipped_qtype=files[shipped]["qtype"], **figures(shipped_mb=megabytes(files[shipped]["bytes"])),
        files=table(gguf_rows(files, shipped)),
    )  # fmt: skip


def _written_and_checked(context, m: Materialization, merged_dir: Path, stem: str, config: GgufConfig) -> tuple[dict[str, dict], str | None]:
    """Every file of ``config.qtypes`` (the converter's in one process, then the quantizer's from the f16 file), each checked
    in llama.cpp; and the chat template they embed."""
    converted = [q for q in config.qtypes if q in SUPPORTED_QTYPES]
    quantized = [q for q in config.qtypes if q in llamacpp.QUANTIZED]
    outputs = {q: m.out / f"{stem}-{q}.gguf" for q in converted}
    if quantized and "f16" not in outputs:
        outputs["f16"] = m.work / f"{stem}-f16.gguf"  # the quantizer's input, not shipped
    written = export_ggufs(merged_dir, outputs, name=stem)
    for qtype in quantized:
        written[qtype] = llamacpp.quantize(outputs["f16"], m.out / f"{stem}-{qtype}.gguf", qtype)
    reference = llamacpp.reference(merged_dir)
    files = {
        Path(written[q]["path"]).name: _checked_gguf(context, merged_dir, Path(written[q]["path"]), written[q], reference, config.verify)
        for q in config.qtypes
    }
    return files, reference.chat_template


def gguf_rows(files: dict[str, dict], shipped: str) -> list[dict]:
    """gguf_model's metadata table: one row per file."""
    return [
        {"file": name, "type": e["qtype"], "MB": megabytes(e["bytes"]), "shipped": name == shipped,
         "llamacpp_rel_logit_error": rounded(e["llamacpp"]["rel_error"]), "llamacpp_top1": rounded(e["llamacpp"]["top1_agreement"]),
         "llamacpp_kl": rounded(e["llamacpp"]["kl_divergence"]), "greedy_equal": f"{e['llamacpp']['greedy_match']}/{e['llamacpp']['greedy_prompts']}",
         "greedy_near_ties": e["llamacpp"]["greedy_near_ties"], "token_ids_equal": e["llamacpp"]["tokens_match"],
         "transformers_rel_logit_error": rounded(e.get("transformers", {}).get("rel_error")),
         "tensor_types": ", ".join(f"{t} {n}" for t, n in sorted(e["tensor_types"].items()))}
        for name, e in files.items()
    ]  # fmt: skip


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
    if verify and written["qtype"] in SUPPORTED_QTYPES:
        entry["transformers"] = _second_reader(context, merged_dir, path, written["qtype"], check["rel_error"])
    context.log.info(
        f"{path.name}: {written['bytes'] / 1e6:.1f} MB {written['tensor_types']}; llama.cpp rel. logit error {check['rel_error']:.2e}, "
        f"greedy equal on {check['greedy_match']}/{check['greedy_prompts']} prompts ({check['greedy_near_ties']} more part at a near-tie)"
    )
    return entry


def _second_reader(context, merged_dir: Path, path: Path, qtype: str, llamacpp_rel_error: float) -> dict:
    """transformers' own GGUF reader on the file, recorded beside llama.cpp's check but not a gate: it reads Llama 3's
    RoPE scaling, Gemma 2/3 and Qwen3 files differently from llama.cpp (python -m benchmarks.gguf_families), and
    llama.cpp is the runtime the file ships to."""
    try:
        report = verify_gguf(merged_dir, path, qtype)
    except Exception as exc:  # noqa: BLE001 - a second reader, not a gate: an architecture or vocabulary it cannot read is recorded
        context.log.warning(f"{path.name}: transformers' GGUF reader cannot load it: {' '.join(str(exc).split())[:300]}")
        return {"error": " ".join(str(exc).split())[:300]}
    if not report["ok"]:
        context.log.warning(
            f"{path.name}: transformers' GGUF reader gives rel. logit error {report['rel_error']:.2e} (tolerance {report['tolerance']}), "
            f"tokens match {report['tokens_match']}; llama.cpp gives {llamacpp_rel_error:.2e}"
        )
    return {k: report[k] for k in ("rel_error", "top1_agreement", "tolerance", "tokens_match", "ok")}


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
    """Base vs fine-tuned vs the shipped GGUF (through llama.cpp) on the fixed eval split, scored as the objective says
    (``ft_assets.delivery.scoring``: the task metric on answers, reward accuracy on held-out pairs, or the mean reward
    of replies to the eval prompts), then gated."""
    objective = objectives.of_stats(tokenized_shards["stats"])
    try:
        scorer = objective.scorer(config.metric, config.max_examples, config.max_new_tokens, lora_adapter["training_config"])
    except ValueError as exc:
        raise dg.Failure(str(exc)) from exc
    shipped = gguf_model["stats"]["shipped"]
    with Materialization(context, store, "eval") as m:
        try:
            size = scorer.load(m.fetch, train_eval_split, tokenized_shards)
        except ValueError as exc:
            raise dg.Failure(f"{m.partition}: {exc}") from exc
        scores = {}
        for label, ref in (("base", base_model), ("fine-tuned", merged_model)):
            context.log.info(f"scoring the {label} model on {size} {scorer.unit} ({scorer.metric})")
            scores[label] = scorer.score(m.fetch(ref, label), context.log.info)
        gguf = _score_shipped(context, m, scorer, gguf_model, size)
        qtype = gguf_model["stats"]["files"][shipped]["qtype"] if shipped else None
        gguf_label = f"GGUF {qtype} (llama.cpp)" if shipped else "GGUF (none shipped)"
        report = scorer.report(scores["base"], scores["fine-tuned"], gguf, gguf_label)
        verdict = ev.gate(scorer.metric, scores["base"].metric, scores["fine-tuned"].metric, gguf.metric if gguf else None,
                          config.min_improvement, config.max_gguf_drop)  # fmt: skip
        stats = {
            **verdict.as_dict(), **report.stats, "objective": objective.name, "gguf_file": shipped, "gguf_qtype": qtype, "examples": size,
        }  # fmt: skip
        (m.out / "report.json").write_text(json.dumps({"stats": stats, "samples": report.samples}, indent=2))
        ref = m.publish(
            _delivery_prefix(m.partition, lora_adapter, "eval"), stats,
            {"merged_model": merged_model, "base_model": base_model, "gguf_model": gguf_model, "train_eval_split": train_eval_split,
             "tokenized_shards": tokenized_shards},
        )  # fmt: skip
    shipped_figure = f" → shipped {qtype} {verdict.gguf_metric:.3f}" if gguf else " (no GGUF shipped)"
    context.log.info(
        f"{scorer.metric}: base {verdict.base_metric:.3f} → fine-tuned {verdict.finetuned_metric:.3f}{shipped_figure}; {report.summary}"
    )
    _track(context, lora_adapter, report.tracked)
    return m.output(ref, **eval_metadata(verdict, report, size, scorer.unit, shipped))


def _score_shipped(context, m: Materialization, scorer, gguf_model: dict, size: int):
    """The shipped GGUF scored through llama.cpp on the eval set; None when no GGUF ships."""
    shipped = gguf_model["stats"]["shipped"]
    if shipped is None:
        context.log.info(f"no GGUF shipped ({gguf_model['stats'].get('reason', 'none exported')}): scoring the merged model only")
        return None
    path = m.fetch(gguf_model, "gguf", include=lambda rel: rel == shipped) / shipped
    context.log.info(f"scoring the shipped {shipped} through llama.cpp on the same {size} {scorer.unit}")
    try:
        return scorer.score_gguf(path, context.log.info)
    except llamacpp.LlamaCppError as exc:
        raise dg.Failure(str(exc)) from exc


def eval_metadata(verdict: ev.Gate, report, size: int, unit: str, shipped: str | None) -> dict:
    """eval_report's metadata: the metric base → fine-tuned → shipped GGUF and the eval losses as numbers, the chart,
    the comparison, and the answers with whether each is correct."""
    bars = {"base": verdict.base_metric, "fine-tuned": verdict.finetuned_metric}
    if verdict.gguf_metric is not None:
        bars["shipped GGUF"] = verdict.gguf_metric
    return dict(
        metric=verdict.metric_name,
        **figures(
            base_metric=verdict.base_metric, finetuned_metric=verdict.finetuned_metric, gguf_metric=verdict.gguf_metric,
            improvement=verdict.improvement, gguf_drop=verdict.gguf_drop, base_eval_loss=report.stats["base_eval_loss"],
            finetuned_eval_loss=report.stats["finetuned_eval_loss"], examples=size,
        ),  # fmt: skip
        gguf_file=shipped or "none shipped",
        chart=dg.MetadataValue.md(bar_chart({verdict.metric_name: bars}, f"{verdict.metric_name} on {size} {unit}")),
        comparison=table(report.comparison),
        answers=table(report.samples),  # each row's `correct` by the objective's own measure (scoring.py)
    )


def _track(context: dg.AssetExecutionContext, lora_adapter: dict, metrics: dict) -> None:
    """The eval figures on the training run's MLflow run, when it was tracked."""
    run_id = lora_adapter["stats"]["mlflow_run_id"]
    if run_id:
        uri = lora_adapter["training_config"]["mlflow_tracking_uri"]
        record(uri, run_id, context.log.warning, metrics=metrics, step=lora_adapter["stats"]["steps"])


@dg.asset(**DELIVERY, kinds={"huggingface", "llama", STORE_KIND}, deps=["gguf_model"])
def published_model(
    context: dg.AssetExecutionContext, config: PublishConfig, store: ObjectStoreResource, eval_report: dict, lora_adapter: dict
) -> dg.Output[dict]:
    """The gated model in the registry with its lineage manifest; a published run is never overwritten."""
    verdict = ev.Gate.of(eval_report["stats"])
    _refuse_ungated(context.partition_key, verdict, stats_of(eval_report, EvalStats))
    try:
        key = signing.signing_key()
    except signing.SigningError as exc:
        raise dg.Failure(f"not publishing {context.partition_key}: {exc}") from exc
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
            signature = signing.recorded(objects, prefix, existing.files)
            stats = {"already_published": True, "signature": signature}
            ref = make_ref(objects, "published_model", context.partition_key, existing, stats, {}, config=op_config(context))
        else:
            lineage, signature = _assemble(context, objects, refs, prefix, out, key)
            ref = publish(
                objects, "published_model", context.partition_key, prefix, out, {"already_published": False, "signature": signature},
                {name: refs[name] for name in ("eval_report", "gguf_model", "merged_model", "lora_adapter")},
                config=op_config(context),
            )  # fmt: skip
        if config.hub_repo_id:
            push_to_hub(out, config.hub_repo_id, os.environ.get("HF_TOKEN"), config.hub_dry_run, log=context.log.info)
    registered = _register(context, ref, lineage, verdict, signature, lora_adapter)
    return dg.Output(
        ref,
        metadata={
            **shipped_metadata(verdict, eval_report["stats"], refs["gguf_model"]["stats"]),
            **ref_metadata(ref),
            "code_version": lineage["code_version"],
            "lineage": table([{"asset": a["asset"], "digest": a["digest"][:16], "uri": objects.uri(a["key"])} for a in lineage["artifacts"]]),
            "already_published": existing is not None,
            "signature": signing.summary(signature),
            "model_registry": model_registry.summary(registered),
        },
    )


def _refuse_ungated(partition: str, verdict: ev.Gate, evaluation: EvalStats) -> None:
    """A Failure saying which gate the model missed: beating the base, or the shipped GGUF within its drop."""
    if not verdict.beats_base:
        raise dg.Failure(
            f"not publishing {partition}: fine-tuned {verdict.metric_name} {verdict.finetuned_metric:.3f} does not beat "
            f"base {verdict.base_metric:.3f} by {verdict.min_improvement:.3f} (see eval_report)"
        )
    if not verdict.gguf_within_drop:
        raise dg.Failure(
            f"not publishing {partition}: the shipped {evaluation['gguf_file']} scores {verdict.metric_name} "
            f"{verdict.gguf_metric:.3f} in llama.cpp, {verdict.gguf_drop:.3f} below the merged model's {verdict.finetuned_metric:.3f} "
            f"(at most {verdict.max_gguf_drop:.3f}); ship a more precise type (gguf_model.ship) or see eval_report's answers"
        )


def _assemble(context, objects, refs: dict[str, ArtifactRef], prefix: str, out: Path, key) -> tuple[dict, dict]:
    """The registry folder ``out``: merged weights, the adapter (what multi-LoRA servers load), the shipped GGUF,
    the eval, ``lineage.json`` and, with a signing key, ``model.sig`` over every file; (lineage, signature)."""
    fetch_artifact(objects, refs["merged_model"]["prefix"], out / "merged")
    if stats_of(refs["lora_adapter"], AdapterStats)["method"] != "full":
        fetch_artifact(objects, refs["lora_adapter"]["prefix"], out / "adapter")
    gguf = stats_of(refs["gguf_model"], GgufStats)
    if gguf["shipped"]:
        fetch_artifact(objects, refs["gguf_model"]["prefix"], out / "gguf")
    else:  # merged weights, adapter, eval and lineage; the lineage says why there is no GGUF
        context.log.warning(f"publishing without a GGUF: {gguf.get('reason')}")
    fetch_artifact(objects, refs["eval_report"]["prefix"], out / "eval")
    lineage = build_lineage(context.partition_key, refs, prefix)
    (out / LINEAGE_FILE).write_text(json.dumps(lineage, indent=2, sort_keys=True))
    signature = signing.sign_directory(out, key) if key else dict(signing.UNSIGNED)
    context.log.info(f"{prefix}: {signing.summary(signature)}")
    return lineage, signature


def shipped_metadata(verdict: ev.Gate, evaluation: dict, gguf: dict) -> dict:
    """published_model's headline: the metric base → fine-tuned → shipped GGUF, and which GGUF shipped (or why none did).

    ``evaluation``: eval_report's stats (the file it scored); ``gguf``: gguf_model's stats (its size, or the reason for none)."""
    scores = f"{verdict.metric_name}: base {verdict.base_metric:.4g} → fine-tuned {verdict.finetuned_metric:.4g}"
    shipped = evaluation["gguf_file"]
    if shipped:
        what = {"shipped_gguf": shipped, "shipped_qtype": evaluation["gguf_qtype"], **figures(shipped_mb=megabytes(gguf["files"][shipped]["bytes"]))}
        scores += f" → shipped {evaluation['gguf_qtype']} GGUF {verdict.gguf_metric:.4g}"
    else:
        what = {"shipped_gguf": f"none: {gguf.get('reason') or 'no GGUF exported'}"}
        scores += " (no GGUF shipped)"
    return {
        "result": scores, "metric": verdict.metric_name,
        **figures(base_metric=verdict.base_metric, finetuned_metric=verdict.finetuned_metric, shipped_metric=verdict.gguf_metric),
        **what,
    }  # fmt: skip


def _register(context, ref: dict, lineage: dict, verdict: ev.Gate, signature: dict, lora_adapter: dict) -> dict | None:
    """The published model as a version in MLflow's Model Registry, when the training run was tracked there."""
    uri = lora_adapter["training_config"].get("mlflow_tracking_uri")
    if not uri:
        return None
    release = model_registry.release_of(
        context.partition_key, ref, lineage, verdict.as_dict(), signature, lora_adapter["stats"]["mlflow_run_id"]
    )
    return model_registry.register(uri, release, context.log.info, context.log.warning)


@dg.asset(**DELIVERY, kinds={"llama", "openai"})
def serving_smoke(
    context: dg.AssetExecutionContext, config: ServingConfig, store: ObjectStoreResource, published_model: dict, lora_adapter: dict
) -> dg.Output[dict]:
    """The published GGUF behind llama-cpp-python's OpenAI-compatible server on loopback: one chat completion per smoke prompt
    (a model published without a GGUF materializes with that reason, in one line, and no answers).

    Its own asset after published_model, not part of it: it serves the file as published (the one the
    registry's Modelfile names in FROM), a published run is never rewritten to add metadata to it, and a
    server that fails to start shows as this asset failing, rerun alone, while the model stays published.
    """
    with Materialization(context, store, "serving") as m:
        signature = _verified(m, published_model)
        published = m.fetch(published_model, "published", include=lambda rel: rel in ("gguf/Modelfile", LINEAGE_FILE))
        if not (published / "gguf" / "Modelfile").is_file():
            reason = "no GGUF to serve: " + (json.loads((published / LINEAGE_FILE).read_text()).get("gguf_reason") or "none published")
            context.log.warning(reason)
            stats = {"file": None, "answers": [], "reason": reason, "signature": signature}
            ref = m.publish(_delivery_prefix(m.partition, lora_adapter, "serving"), stats, {"published_model": published_model})
            return m.output(ref, file="none", reason=reason)
        try:
            shipped = modelfile_gguf(published / "gguf" / "Modelfile")
            m.fetch(published_model, "published", include=lambda rel: rel == f"gguf/{shipped}")
            context.log.info(f"serving {shipped} with llama_cpp.server; {len(config.prompts)} chat completions over HTTP")
            answers = llamacpp.serving_smoke(published / "gguf" / shipped, config.prompts, config.max_tokens)
        except (GgufExportError, llamacpp.LlamaCppError) as exc:
            raise dg.Failure(str(exc)) from exc
        (m.out / "answers.json").write_text(json.dumps(answers, indent=2))
        stats = {"file": shipped, "answers": answers, "server": "llama_cpp.server (OpenAI-compatible, /v1/chat/completions)",
                 "signature": signature}  # fmt: skip
        ref = m.publish(_delivery_prefix(m.partition, lora_adapter, "serving"), stats, {"published_model": published_model})
    return m.output(ref, file=shipped, answers=table(answers), signature=signature)


def _verified(m: Materialization, published_model: dict) -> str:
    """With ``FT_SIGNING_PUBLIC_KEY``, the whole published directory, verified against its model.sig before anything
    is served (a Failure naming the changed file otherwise); without it, nothing is checked."""
    trusted = signing.trusted_key_from_env()
    if trusted is None:
        return f"not checked (no {signing.PUBLIC_KEY_ENV})"
    published = m.fetch(published_model, "published")  # the files served below are the files verified here
    try:
        return signing.summary(signing.verify_directory(published, trusted))
    except signing.SigningError as exc:
        raise dg.Failure(f"not serving {published_model['uri']}: {str(exc).replace(str(published), published_model['uri'])}") from exc


@dg.asset(**DELIVERY, kinds={"vllm", "openai", STORE_KIND})
def vllm_smoke(
    context: dg.AssetExecutionContext, config: VllmConfig, store: ObjectStoreResource, published_model: dict, lora_adapter: dict,
    base_model: dict,
) -> dg.Output[dict]:
    """The published model behind vLLM's OpenAI-compatible server (its own serving venv): the merged model, then the base
    with the published adapter as a LoRA module; one greedy chat completion per prompt, each against transformers'.

    A sibling of serving_smoke, for the same reasons: it serves the files as published (verified first, as there,
    when FT_SIGNING_PUBLIC_KEY is set), and a server that fails fails this asset alone while the model stays
    published. Where vLLM is not installed it says so in one line and materializes without serving
    (``ft_assets.delivery.vllm``: ``FT_VLLM_PYTHON``, ``make install``).
    """
    reason = vllm.unavailable()
    with Materialization(context, store, "vllm") as m:
        if reason:
            context.log.warning(f"vllm_smoke: {reason}; nothing served (the model stays published)")
            stats = {"served": False, "reason": reason}
        else:
            signature = _verified(m, published_model)  # with FT_SIGNING_PUBLIC_KEY: only verified files are served
            published = m.fetch(published_model, "published", include=lambda rel: rel.startswith(("merged/", "adapter/")))
            lora = (published / "adapter" / "adapter_config.json").is_file()  # a full fine-tune publishes no adapter
            context.log.info(f"serving the merged model{' and the base + adapter (LoRA)' if lora else ''} with vLLM")
            try:
                stats = vllm.smoke(
                    published / "merged", config.prompts, config.max_tokens, m.fetch(base_model, "base") if lora else None,
                    published / "adapter" if lora else None, served_name(published_model["prefix"]),
                )  # fmt: skip
            except vllm.VllmError as exc:
                raise dg.Failure(str(exc)) from exc
            stats.update(served=True, signature=signature)
        (m.out / "vllm.json").write_text(json.dumps(stats, indent=2))
        ref = m.publish(_delivery_prefix(m.partition, lora_adapter, "vllm"), stats, {"published_model": published_model})
    if not stats["served"]:
        return m.output(ref, vllm=reason)
    equal = ", ".join(f"{label} {count}/{stats['prompts']}" for label, count in stats["greedy_equal"].items())
    context.log.info(f"vLLM greedy answers equal to transformers': {equal}; loaded in {stats['load_seconds']} s")
    return m.output(
        ref, vllm="served", greedy_equal=equal,
        **figures(tokens_per_second=stats["tokens_per_second"]),
        load_seconds=table([{"server": label, "seconds": seconds} for label, seconds in stats["load_seconds"].items()], columns=["server", "seconds"]),
        answers=table(stats["rows"]),
    )  # fmt: skip
