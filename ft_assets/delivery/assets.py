"""Delivery-plane assets (group ``delivery``, CPU): merge → exports (GGUF, MLX) → eval (blocking gate) → publish → serving smokes.

No GPU time is spent here: merging, export and evaluation of a small-to-mid model run on CPU
workers while the GPU pool trains the next version. Artifacts go to
``runs/<name>/<version>/delivery/<run>/``; only a model that passed the eval gate is copied to the
registry (``registry/<name>/<version>/<run>/``) with its lineage manifest.

Each export of ``ft_assets.delivery.exports`` (GGUF, MLX) gets its own asset here (``export_asset``:
``gguf_model``, ``mlx_model``), made from its module: it writes the files, checks each in the format's own runtime and
picks the one that ships, or ships none with the reason in one line; ``eval_report`` scores every
shipped file in its runtime beside the merged model, ``published_model`` copies each into the registry.
``serving_smoke`` serves the published GGUF with llama.cpp's server; ``vllm_smoke`` serves the published
merged model and adapter with vLLM, from a serving venv of its own.
"""

import json
import os
import shutil
from contextlib import contextmanager, nullcontext
from pathlib import Path

import dagster as dg

from ft_assets import layout, objectives, portable
from ft_assets.delivery import comparison, harness, llamacpp, model_registry, regression, signing, vllm
from ft_assets.delivery.config import (
    EvalConfig,
    GeneralEvalConfig,
    MergeConfig,
    PublishConfig,
    ServingConfig,
    VllmConfig,
    export_config,
)
from ft_assets.delivery.exports import EXPORTS
from ft_assets.delivery.exports.protocol import Export, ExportRefused, Made, refuse_model
from ft_assets.delivery.gate import Gate, dropped, gate, shipped
from ft_assets.delivery.gguf_export import GgufExportError, modelfile_gguf
from ft_assets.delivery.lineage import LINEAGE_CHAIN, LINEAGE_FILE, build_lineage, exports_of
from ft_assets.delivery.lora_registry import served_name
from ft_assets.delivery.merge import copy_tokenizer, merge_adapter
from ft_assets.delivery.publish import push_to_hub
from ft_assets.delivery.scoring import Shipped
from ft_assets.manifests import ArtifactNotFound, fetch_artifact, read_manifest
from ft_assets.materialize import (
    STORE_KIND,
    Materialization,
    figures,
    megabytes,
    op_config,
    ref_metadata,
    rounded,
    table,
)
from ft_assets.partitions import DatasetVersion, dataset_version
from ft_assets.plots import bar_chart, picture_markdown
from ft_assets.refs import (
    AdapterStats,
    ArtifactRef,
    EvalStats,
    ExportStats,
    has_ref,
    make_ref,
    publish,
    read_ref,
    stats_of,
)
from ft_assets.resources import ObjectStoreResource
from ft_assets.shards import IMAGES_FILE
from ft_assets.storage import join_key
from ft_assets.training.config import validated
from ft_assets.training.tracking import record_run

DELIVERY = dict(partitions_def=dataset_version, group_name="delivery", io_manager_key="refs", tags={"ft/pool": "cpu"})
ANSWERS_FILE = "answers.jsonl"  # every eval answer, in eval_report's artifact; the page shows ANSWERS_SHOWN of them
ANSWERS_SHOWN = 8  # the wrong ones first: what a user reads to see why the metric is what it is
PICTURES_SHOWN = 4  # a vision-language model's eval pictures drawn on eval_report's page with the answers
EXPORT_ASSETS = [export.asset for export in EXPORTS]


def _delivery_prefix(partition: str, adapter: dict, what: str) -> str:
    return layout.of(partition).delivery(adapter["stats"]["run_id"], what)


@dg.asset(**DELIVERY, kinds={"pytorch", "huggingface", "safetensors", STORE_KIND})
def merged_model(
    context: dg.AssetExecutionContext,
    config: MergeConfig,
    store: ObjectStoreResource,
    lora_adapter: dict,
    base_model: dict,
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
            _delivery_prefix(m.partition, lora_adapter, "merged"),
            stats,
            {"lora_adapter": lora_adapter, "base_model": base_model},
            folder=out,
        )
    return m.output(ref, dtype=stats["dtype"])


def export_asset(export: Export) -> dg.AssetsDefinition:
    """The asset of one export: its files from the merged model, checked in its runtime, or none and why (one line)."""
    config_class = export_config(export.settings)

    @dg.asset(name=export.asset, description=export.description, kinds={*export.kinds, STORE_KIND}, **DELIVERY)
    def made(
        context: dg.AssetExecutionContext,
        config: config_class,
        store: ObjectStoreResource,
        merged_model: dict,
        lora_adapter: dict,
    ) -> dg.Output[dict]:
        settings = export.settings(**config.model_dump())
        version = DatasetVersion.from_key(context.partition_key)
        with Materialization(context, store, export.name) as m:
            made, reason = export_outcome(
                export, settings, lambda: export.make(refused_or(export, m.fetch(merged_model, "merged")), m.out, m.work,
                                                      f"{version.name}-{version.version}", settings, context.log),
                context.log,
            )  # fmt: skip
            if made is None:
                shutil.rmtree(m.out)  # nothing half-made is published
            stats = {
                "export": export.name, "files": made.files if made else {}, "shipped": made.shipped if made else None,
                "reason": reason, "required": settings.required, "max_drop": settings.max_drop, **(made.stats if made else {}),
                **({"companions": made.companions} if made and made.companions else {}),
            }  # fmt: skip
            ref = m.publish(
                _delivery_prefix(m.partition, lora_adapter, export.name), stats, {"merged_model": merged_model}
            )
        if made is None:
            return m.output(ref, shipped="none", reason=reason)
        entry = made.files[made.shipped]
        return m.output(
            ref, shipped=made.shipped, **{f"shipped_{export.variant}": entry[export.variant]},
            **figures(shipped_mb=megabytes(entry["bytes"])),
            files=table([{k: rounded(v) if isinstance(v, float) else v for k, v in row.items()} for row in made.rows]),
        )  # fmt: skip

    return made


def export_outcome(export: Export, settings, make, log) -> tuple[Made | None, str | None]:
    """What ``make`` gave (``Made``, None), or why the export ships nothing: (None, its reason in one line).

    A setting that cannot work fails here, before any work; a refusal (``ExportRefused``) fails the run only when the
    export is ``required``, else it is logged and the run goes on without the export."""
    try:
        export.check(settings)
    except ValueError as exc:
        raise dg.Failure(f"{export.asset} config {exc}") from exc
    reason = export.off(settings)
    if reason:
        if settings.required:
            raise dg.Failure(f"{export.asset} config: required is true, but {reason}")
        log.warning(f"no {export.title}: {reason}")
        return None, reason
    try:
        return make(), None
    except ExportRefused as exc:
        if settings.required:
            raise dg.Failure(required_refused(export, str(exc))) from exc
        log.warning(f"no {export.title}: {exc}; the model is published without it")
        return None, str(exc)


def refused_or(export: Export, merged_dir: Path) -> Path:
    """``merged_dir``, unless ``export`` does not take a model of its kind (``ExportRefused``, one line)."""
    refuse_model(export, merged_dir)
    return merged_dir


def required_refused(export: Export, reason: str) -> str:
    """The line a run fails with when an export it requires is refused."""
    return f"{export.title} is required ({export.asset} config required: true) and was refused: {reason}"


def shipped_files(stats: ExportStats) -> list[str]:
    """What of an export travels with its shipped file (to eval_report, general_eval): that file (or folder) and its
    companions (a VLM GGUF's projector)."""
    return [stats["shipped"], *stats.get("companions", [])]


def shipped_only(stats: ExportStats):
    """A fetch filter keeping ``shipped_files(stats)`` (a folder's files too) of the export's artifact."""
    names = shipped_files(stats)
    return lambda rel: any(rel == name or rel.startswith(f"{name}/") for name in names)


export_assets = [export_asset(export) for export in EXPORTS]  # gguf_model, ...


@dg.asset(**DELIVERY, kinds={"python", "json", STORE_KIND}, deps=EXPORT_ASSETS)
def general_eval(
    context: dg.AssetExecutionContext,
    config: GeneralEvalConfig,
    store: ObjectStoreResource,
    merged_model: dict,
    base_model: dict,
    lora_adapter: dict,
) -> dg.Output[dict]:
    """General-ability tasks (lm-eval: task names or local task files) on the base, the merged model and each shipped
    file in its runtime (GGUF: llama.cpp's server), each model's drop against the base judged for eval_report's gate
    (``ft_assets.delivery.regression``). Off (``general_off``), the gate has nothing to hold against the model."""
    with Materialization(context, store, "general") as m:
        reason = general_off(config.tasks, harness.installed())
        if reason is None:
            made = {export.name: read_ref(m.store, m.partition, export.asset) for export in EXPORTS}
            try:
                verdict, run = general_check(config, m.fetch, base_model, merged_model, made, context.log.info)
            except (harness.HarnessError, ValueError) as exc:
                raise dg.Failure(f"general_eval for {m.partition}: {exc}") from exc
            upstream = {"merged_model": merged_model, "base_model": base_model,
                        **{export.asset: made[export.name] for export in EXPORTS}}  # fmt: skip
            scores, answers = (
                {key: [score.as_dict() for score in by_task] for key, by_task in run.scores.items()},
                run.answers,
            )
        else:
            verdict, upstream = regression.off(reason), {}
            scores, answers = {}, {}
            (context.log.info if not config.tasks else context.log.warning)(f"general_eval: {reason}; the check is off")
        stats = {**verdict.as_dict(), "limit": config.limit, "seed": config.seed, "tasks_config": config.tasks}
        (m.out / "general.json").write_text(
            json.dumps({"verdict": stats, "scores": scores, "answers": answers}, indent=2)
        )
        ref = m.publish(_delivery_prefix(m.partition, lora_adapter, "general"), stats, upstream)
    for line in verdict.lines:
        context.log.warning(f"general-ability regression ({verdict.on_regression}): {line}")
    return m.output(ref, **general_metadata(verdict, config.limit))


def general_off(tasks: list[str], lm_eval_installed: bool) -> str | None:
    """Why general_eval runs nothing, in one line, or None: no task chosen, or only the tasks shipped with the package
    (the default) where lm-eval is not installed (an install without the lmeval extra publishes as before, saying so).
    A task the user named fails the run instead when lm-eval is missing (``harness.HarnessError``)."""
    if not tasks:
        return "no general-ability tasks (general_eval.tasks: [])"
    if not lm_eval_installed and set(tasks) <= set(harness.SHIPPED):
        return f"{', '.join(tasks)} not run: lm-eval is not installed ({harness.INSTALL_HINT}; [] turns this off)"
    return None


def general_check(config: GeneralEvalConfig, fetch, base_model: dict, merged_model: dict, made: dict, log):
    """The suite of ``config.tasks`` on the base, the merged model and (``config.shipped``) each export's shipped file,
    judged against the base: (verdict, the suite's run). ``made``: each export's reference, by name."""
    suite = harness.load_suite(harness.task_specs(config.tasks))
    settings = harness.RunSettings(
        limit=config.limit or None, seed=config.seed, num_fewshot=config.num_fewshot,
        apply_chat_template=config.apply_chat_template,
    )  # fmt: skip
    merged = fetch(merged_model, "merged")
    subjects = [
        harness.Subject(
            "base", "base", lambda: nullcontext(harness.hf_model(fetch(base_model, "base"), "base", config.batch_size))
        ),
        harness.Subject(
            regression.FINETUNED,
            "fine-tuned",
            lambda: nullcontext(harness.hf_model(merged, "fine-tuned", config.batch_size)),
        ),
    ]
    for export in EXPORTS if config.shipped else ():
        stats = stats_of(made[export.name], ExportStats)
        name = stats["shipped"]
        if name is None:
            continue
        folder = fetch(made[export.name], export.name, include=shipped_only(stats))
        title = f"shipped {export.title} {stats['files'][name][export.variant]}"
        runtime = export.runtime(folder / name)
        subjects.append(harness.Subject(export.name, title, lambda r=runtime, t=title: _served(r, merged, t, settings)))
    run = harness.run_suite(suite, settings, subjects, log)
    if any(score.refused for score in run.scores["base"]):
        raise harness.HarnessError(
            f"the base model could not run {', '.join(s.task for s in run.scores['base'] if s.refused)}"
        )
    scores = {
        key: {s.task: regression.Score(s.value, s.stderr, s.refused) for s in by_task}
        for key, by_task in run.scores.items()
    }
    metrics = {s.task: (s.metric, s.higher_is_better) for s in run.scores["base"]}
    verdict = regression.judge(
        scores, metrics, config.max_drop, config.max_drop_per_task, config.stderr_z, config.on_regression, run.items,
        run.seconds, {subject.key: subject.title for subject in subjects},
    )  # fmt: skip
    return verdict, run


@contextmanager
def _served(runtime, tokenizer_dir: Path, title: str, settings: harness.RunSettings):
    """An export's lm-eval model (its runtime's server) for the length of its tasks; a runtime that refuses the file, or
    cannot answer, refuses its tasks with that line (``harness.Refused``) instead of failing the check."""
    try:
        with runtime.harness(tokenizer_dir, title, settings.apply_chat_template) as model:
            yield model
    except (ExportRefused, harness.HarnessError) as exc:
        raise harness.Refused(str(exc)) from exc


def general_metadata(verdict: regression.GeneralVerdict, limit: int) -> dict:
    """general_eval's page: each task base → fine-tuned → each shipped file, the drops and what the gate said, a chart,
    and what the check cost."""
    if verdict.reason:
        return {"general": verdict.reason}
    names = model_names()
    rows = []
    for name, task in verdict.tasks.items():
        row = {"task": name, "metric": task.metric.partition(",")[0], "base": rounded(task.base)}
        for key, judged in task.models.items():
            row[names.get(key, key)] = "refused" if judged.refused else rounded(judged.value)
        row["max_drop"] = task.max_drop
        row["verdict"] = ", ".join(f"{names.get(m, m)} regressed" for m in task.regressed) or "kept"
        rows.append(row)
    refused = sorted({j.refused for t in verdict.tasks.values() for j in t.models.values() if j.refused})
    return {
        **general_summary(verdict),
        "cost": f"{verdict.items} items in {verdict.seconds:.1f} s of lm-eval (limit {limit or 'none'} per task)",
        "tasks": table(rows),
        "chart": dg.MetadataValue.md(bar_chart(general_bars(verdict), "general tasks (lm-eval)", digits=3)),
        **({"refused": "; ".join(refused)} if refused else {}),
    }


def model_names() -> dict[str, str]:
    """How pages name the scored models: the merged model and each export's shipped file."""
    return {regression.FINETUNED: "fine-tuned", **{e.name: f"shipped {e.title}" for e in EXPORTS}}


@dg.asset(**DELIVERY, kinds={"pytorch", "json", STORE_KIND}, deps=EXPORT_ASSETS)
def eval_report(
    context: dg.AssetExecutionContext,
    config: EvalConfig,
    store: ObjectStoreResource,
    merged_model: dict,
    base_model: dict,
    train_eval_split: dict,
    tokenized_shards: dict,
    lora_adapter: dict,
    general_eval: dict,
) -> dg.Output[dict]:
    """Base vs fine-tuned vs each export's shipped file (in its own runtime: llama.cpp for GGUF) on the fixed eval split,
    scored as the objective says (``ft_assets.delivery.scoring``: the task metric on answers, reward accuracy on held-out
    pairs, or the mean reward of replies to the eval prompts), then gated (``ft_assets.delivery.gate``) with
    general_eval's verdict beside it (what the fine-tune forgot)."""
    objective = objectives.of_stats(tokenized_shards["stats"])
    try:
        settings = objective.settings_in(validated(lora_adapter["training_config"]))
        scorer = objective.scorer(config.metric, config.max_examples, config.max_new_tokens, settings)
    except ValueError as exc:
        raise dg.Failure(str(exc)) from exc
    with Materialization(context, store, "eval") as m:
        made = {export.name: read_ref(m.store, m.partition, export.asset) for export in EXPORTS}
        try:
            size = scorer.load(m.fetch, train_eval_split, tokenized_shards)
        except ValueError as exc:
            raise dg.Failure(f"{m.partition}: {exc}") from exc
        scores = {}
        for label, ref in (("base", base_model), ("fine-tuned", merged_model)):
            context.log.info(f"scoring the {label} model on {size} {scorer.unit} ({scorer.metric})")
            scores[label] = scorer.score(m.fetch(ref, label), context.log.info)
        columns, verdicts = score_exports(scorer, made, m.fetch, scores["fine-tuned"].metric, size, context.log)
        report = scorer.report(scores["base"], scores["fine-tuned"], columns)
        general = regression.GeneralVerdict.of(general_eval["stats"])
        verdict = gate(
            scorer.metric, scores["base"].metric, scores["fine-tuned"].metric, config.min_improvement, verdicts, general
        )
        stats = {
            **verdict.as_dict(), **report.stats, "objective": objective.name, "examples": size,
            "export_figures": {column.name: column.scored.figures for column in columns},
        }  # fmt: skip
        gallery = picture_gallery(report, [column.label for column in columns])  # while the eval pictures are here
        (m.out / "report.json").write_text(json.dumps({"stats": stats, "samples": report.samples}, indent=2))
        (m.out / ANSWERS_FILE).write_text("".join(json.dumps(row) + "\n" for row in report.samples))
        ref = m.publish(
            _delivery_prefix(m.partition, lora_adapter, "eval"), stats,
            {"merged_model": merged_model, "base_model": base_model, "train_eval_split": train_eval_split,
             "tokenized_shards": tokenized_shards, "general_eval": general_eval,
             **{export.asset: made[export.name] for export in EXPORTS}},
        )  # fmt: skip
    shipped_figures = "".join(
        f" → {c.label} {c.scored.metric:.3f}" for c in columns
    )  # the log line: base → fine-tuned → each shipped file
    context.log.info(
        f"{scorer.metric}: base {verdict.base_metric:.3f} → fine-tuned {verdict.finetuned_metric:.3f}{shipped_figures}; {report.summary}"
    )
    if not general.reason:
        context.log.info(f"general (lm-eval): {general_summary(general)['general_figures']}")
    for line in general.lines:
        context.log.warning(f"general-ability regression ({general.on_regression}): {line}")
    _track(context, lora_adapter, report.tracked | general_tracked(general))
    answers_uri = m.store.uri(join_key(ref["prefix"], ANSWERS_FILE))
    return m.output(ref, **eval_metadata(verdict, report, size, scorer.unit, answers_uri), **gallery)


def picture_gallery(report, shipped: list[str]) -> dict:
    """A vision-language model's eval pictures on eval_report's page (``picture_1``...), each drawn in place with its
    question, the expected answer and what the base, the fine-tuned model and each shipped file (``shipped``: the
    report's column labels) answered; up to ``PICTURES_SHOWN``, at most half of them ones the fine-tuned model got
    wrong while it got others right. None for a text model."""
    shown = [index for index, picture in enumerate(report.pictures) if picture]
    right = [index for index in shown if report.samples[index].get("correct") is True]
    wrong = [index for index in shown if index not in right]
    chosen = sorted((wrong[: max(PICTURES_SHOWN // 2, PICTURES_SHOWN - len(right))] + right)[:PICTURES_SHOWN])
    gallery = {}
    for number, index in enumerate(chosen, 1):
        row = report.samples[index]
        answers = [
            ("base", row["base"]),
            ("fine-tuned", row["fine-tuned"]),
            *((label, row[label]) for label in shipped),
        ]
        caption = " · ".join(
            [f"**{_md(row['prompt'].replace('<image>', ' '))}**", f"expected *{_md(row['reference'])}*"]
            + [f"{label}: {_md(answer)}" for label, answer in answers]
        ) + (" ✓" if row.get("correct") is True else " ✗")  # fmt: skip
        gallery[f"picture_{number}"] = dg.MetadataValue.md(picture_markdown(report.pictures[index], caption))
    return gallery


def _md(text: object, limit: int = 40) -> str:
    """A question or an answer inside a caption: one line, cut at ``limit`` characters, markdown's marks escaped."""
    line = " ".join(str(text).split())
    line = line if len(line) <= limit else line[: limit - 1] + "…"
    return "".join(f"\\{ch}" if ch in "\\`*_[]<>|#" else ch for ch in line)


def score_exports(scorer, made: dict[str, dict], fetch, finetuned: float, size: int, log) -> tuple[list[Shipped], dict]:
    """Each export's shipped file scored in its own runtime on the eval set: the report's columns and the gate's verdicts.

    ``made``: each export's reference, by export name; ``fetch``: ``Materialization.fetch``. An export that ships nothing,
    or whose runtime cannot answer (``ExportRefused``), gets a verdict with its reason; a required one fails the run."""
    columns, verdicts = [], {}
    for export in EXPORTS:
        stats = stats_of(made[export.name], ExportStats)
        name = stats["shipped"]
        if name is None:
            log.info(f"no {export.title} shipped ({stats['reason']}): scoring without it")
            verdicts[export.name] = dropped(stats["reason"], stats["max_drop"])
            continue
        folder = fetch(made[export.name], export.name, include=shipped_only(stats))
        variant = stats["files"][name][export.variant]
        log.info(f"scoring the shipped {name} in {export.runtime_name} on the same {size} {scorer.unit}")
        try:
            scored = scorer.score_export(export.runtime(folder / name), log.info)
        except ExportRefused as exc:
            reason = f"{export.runtime_name} could not answer the eval prompts with {name}: {exc}"
            if stats["required"]:
                raise dg.Failure(required_refused(export, reason)) from exc
            log.warning(f"{reason}; the model is published without {export.title}")
            verdicts[export.name] = dropped(reason, stats["max_drop"])
            continue
        columns.append(Shipped(export.name, f"{export.title} {variant} ({export.runtime_name})", scored))
        verdicts[export.name] = shipped(name, variant, scored.metric, finetuned, stats["max_drop"])
    return columns, verdicts


def eval_metadata(verdict: Gate, report, size: int, unit: str, answers_uri: str) -> dict:
    """eval_report's page, each figure once: the comparison table holds every model's figures (the task metric to 3
    decimals, losses to 4 significant digits, as the command line prints them); above it only what is not in it (the
    improvement the gate judged, each export's file and drop, the general-ability verdict); one chart of the task
    metric and each general task; a short sample of the answers, the wrong ones first (all of them in the store,
    ``answers_uri``)."""
    bars = {"base": verdict.base_metric, "fine-tuned": verdict.finetuned_metric}
    per_export = {}
    for export in EXPORTS:
        shipped_export = verdict.exports[export.name]
        if shipped_export.file:
            bars[f"shipped {export.title}"] = shipped_export.metric
        per_export[f"{export.name}_file"] = shipped_export.file or f"none: {shipped_export.reason}"
        if shipped_export.drop is not None:
            per_export[f"{export.name}_drop"] = dg.MetadataValue.float(round(shipped_export.drop, 3))
    groups = {verdict.metric_name: bars} | general_bars(verdict.general)
    wrong_first = sorted(report.samples, key=lambda row: row.get("correct", True) is True)
    return dict(
        metric=verdict.metric_name,
        improvement=dg.MetadataValue.float(round(verdict.improvement, 3)),
        **figures(examples=size),
        **per_export,
        **general_summary(verdict.general),
        chart=dg.MetadataValue.md(
            bar_chart(groups, f"{verdict.metric_name} on {size} {unit}, general tasks", digits=3)
        ),
        comparison=table(report.comparison),
        answers_shown=f"{min(ANSWERS_SHOWN, len(report.samples))} of {len(report.samples)}, the wrong ones first; "
        "every answer is in all_answers (one JSON object a line)",
        answers=table(wrong_first[:ANSWERS_SHOWN]),  # each row's `correct` by the objective's own measure (scoring.py)
        all_answers=dg.MetadataValue.path(answers_uri),
    )


def general_bars(general: regression.GeneralVerdict | None) -> dict[str, dict[str, float]]:
    """Each general task's bars (base, fine-tuned, each shipped file) for a chart; none when the check was off."""
    if general is None or general.reason:
        return {}
    names = model_names()
    return {
        task: {"base": t.base, **{names.get(k, k): j.value for k, j in t.models.items() if j.value is not None}}
        for task, t in general.tasks.items()
    }


def general_summary(general: regression.GeneralVerdict | None) -> dict:
    """The general-ability verdict in one line of eval_report's page (and what it cost)."""
    if general is None:
        return {}
    if general.reason:
        return {"general": general.reason}
    line = ("regressed: " + "; ".join(general.lines)) if general.regressed else f"kept ({len(general.tasks)} tasks)"
    figures = "; ".join(f"{task} {chain}" for task, chain in general.chains(model_names()).items())
    return {"general": line, "general_figures": figures, "general_on_regression": general.on_regression}


def general_tracked(general: regression.GeneralVerdict) -> dict:
    """The general tasks' figures as MLflow metrics: ``general/<task>/<model>`` (base, finetuned, each export)."""
    metrics = {}
    for name, task in general.tasks.items():
        metrics[f"general/{name}/base"] = task.base
        metrics |= {f"general/{name}/{k}": j.value for k, j in task.models.items() if j.value is not None}
    return metrics


def _track(context: dg.AssetExecutionContext, lora_adapter: dict, metrics: dict) -> None:
    """The eval figures on the training run's MLflow and W&B runs, when it was tracked."""
    stats = lora_adapter["stats"]
    record_run(lora_adapter["training_config"], stats, context.log.warning, metrics=metrics, step=stats["steps"])


@dg.asset(**DELIVERY, kinds={"huggingface", STORE_KIND}, deps=EXPORT_ASSETS)
def published_model(
    context: dg.AssetExecutionContext,
    config: PublishConfig,
    store: ObjectStoreResource,
    eval_report: dict,
    lora_adapter: dict,
) -> dg.Output[dict]:
    """The gated model in the registry with its lineage manifest, and each export that shipped; never overwritten."""
    stats_of(eval_report, EvalStats)  # one of an older ft-assets: RefOutdated names what it lacks
    verdict = Gate.of(eval_report["stats"])
    _refuse_ungated(context.partition_key, verdict)
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
            ref = make_ref(
                objects, "published_model", context.partition_key, existing, stats, {}, config=op_config(context)
            )
        else:
            lineage, signature = _assemble(context, objects, refs, verdict, prefix, out, key)
            ref = publish(
                objects, "published_model", context.partition_key, prefix, out, {"already_published": False, "signature": signature},
                {name: refs[name] for name in ("eval_report", *EXPORT_ASSETS, "merged_model", "lora_adapter")},
                config=op_config(context),
            )  # fmt: skip
        if config.hub_repo_id:
            push_to_hub(out, config.hub_repo_id, os.environ.get("HF_TOKEN"), config.hub_dry_run, log=context.log.info)
    registered = _register(context, ref, lineage, verdict, signature, lora_adapter)
    # the published folder's URI on the W&B run (MLflow's registry version, above, points at it already)
    record_run(lora_adapter["training_config"], lora_adapter["stats"], context.log.warning,
               artifacts={"published_model": ref["uri"]})  # fmt: skip
    return dg.Output(
        ref,
        metadata={
            **shipped_metadata(verdict, {export.name: refs[export.asset]["stats"] for export in EXPORTS}),
            **ref_metadata(ref),
            "code_version": lineage["code_version"],
            "store": objects.url,
            "lineage": lineage_table(objects, lineage),
            "already_published": existing is not None,
            "signature": signing.summary(signature),
            "model_registry": model_registry.summary(registered),
        },
    )


def lineage_table(objects, lineage: dict) -> dg.MetadataValue:
    """published_model's lineage: each artifact, its digest and its key in the store (the store's URL is on the page
    once, as ``store``: full URIs, ~130 characters of one unbreakable word each, ran past the panel)."""
    return table([{"asset": a["asset"], "digest": a["digest"][:16], "key": a["key"]} for a in lineage["artifacts"]])


def _refuse_ungated(partition: str, verdict: Gate) -> None:
    reason = ungated(verdict)
    if reason:
        raise dg.Failure(f"not publishing {partition}: {reason}")


def ungated(verdict: Gate) -> str | None:
    """Which gate the model missed, in one line (beating the base, its general abilities where that blocks, an export's
    shipped file within its drop), or None when it passed."""
    if not verdict.beats_base:
        return (
            f"fine-tuned {verdict.metric_name} {verdict.finetuned_metric:.3f} does not beat "
            f"base {verdict.base_metric:.3f} by {verdict.min_improvement:.3f} (see eval_report)"
        )
    if verdict.general is not None and verdict.general.blocks:
        return (
            f"it forgot general abilities: {'; '.join(verdict.general.lines)} "
            "(general_eval on_regression: block; warn publishes it without promoting it, see general_eval's tasks)"
        )
    for export in EXPORTS:
        shipped_export = verdict.exports[export.name]
        if not shipped_export.within_drop:
            return (
                f"the shipped {shipped_export.file} scores {verdict.metric_name} "
                f"{shipped_export.metric:.3f} in {export.runtime_name}, {shipped_export.drop:.3f} below the merged model's "
                f"{verdict.finetuned_metric:.3f} (at most {export.asset}.max_drop = {shipped_export.max_drop:.3f}); ship a "
                f"more precise file ({export.asset} config) or see eval_report's answers"
            )
    return None


def _assemble(
    context, objects, refs: dict[str, ArtifactRef], verdict: Gate, prefix: str, out: Path, key
) -> tuple[dict, dict]:
    """The registry folder ``out``: merged weights, the adapter (what multi-LoRA servers load), each export that shipped
    (in a folder of its name: ``gguf/``), the eval, ``lineage.json`` and, with a signing key, ``model.sig`` over every
    file; (lineage, signature)."""
    fetch_artifact(objects, refs["merged_model"]["prefix"], out / "merged")
    if stats_of(refs["lora_adapter"], AdapterStats)["method"] != "full":
        fetch_artifact(objects, refs["lora_adapter"]["prefix"], out / "adapter")
    for export in EXPORTS:
        shipped_export = verdict.exports[export.name]
        if shipped_export.file:
            fetch_artifact(objects, refs[export.asset]["prefix"], out / export.name)
        else:  # the lineage says why
            context.log.warning(f"publishing without {export.title}: {shipped_export.reason}")
    fetch_artifact(objects, refs["eval_report"]["prefix"], out / "eval")
    shards = refs["tokenized_shards"]
    images = objects.get_json(join_key(shards["prefix"], IMAGES_FILE)) if shards["stats"].get("images_prefix") else None
    lineage = build_lineage(context.partition_key, refs, prefix, images)
    (out / LINEAGE_FILE).write_text(json.dumps(lineage, indent=2, sort_keys=True))
    signature = signing.sign_directory(out, key) if key else dict(signing.UNSIGNED)
    context.log.info(f"{prefix}: {signing.summary(signature)}")
    return lineage, signature


def shipped_metadata(verdict: Gate, made: dict[str, dict]) -> dict:
    """published_model's headline, once: the metric base → fine-tuned → each shipped export (3 decimals, as eval_report
    and the command line), the general tasks' verdict, and what each export shipped (or why nothing did).
    ``made``: each export's asset stats, by export name (the shipped file's size)."""
    scores = f"{verdict.metric_name}: base {verdict.base_metric:.3f} → fine-tuned {verdict.finetuned_metric:.3f}"
    what = {}
    for export in EXPORTS:
        shipped_export = verdict.exports[export.name]
        if shipped_export.file:
            scores += f" → shipped {shipped_export.variant} {export.title} {shipped_export.metric:.3f}"
            what |= {
                f"shipped_{export.name}": shipped_export.file,
                **figures(**{f"{export.name}_mb": megabytes(made[export.name]["files"][shipped_export.file]["bytes"])}),
            }
        else:
            scores += f" (no {export.title} shipped)"
            what[f"shipped_{export.name}"] = f"none: {shipped_export.reason}"
    return {"result": scores, **general_summary(verdict.general), **what}


def _register(context, ref: dict, lineage: dict, verdict: Gate, signature: dict, lora_adapter: dict) -> dict | None:
    """The published model as a version in MLflow's Model Registry, when the training run was tracked there."""
    uri = lora_adapter["training_config"].get("mlflow_tracking_uri")
    if not uri:
        return None
    release = model_registry.release_of(
        context.partition_key, ref, lineage, verdict.flat(), signature, lora_adapter["stats"]["mlflow_run_id"]
    )
    return model_registry.register(uri, release, context.log.info, context.log.warning)


@dg.asset(**DELIVERY, kinds={"llama", "openai"})
def serving_smoke(
    context: dg.AssetExecutionContext,
    config: ServingConfig,
    store: ObjectStoreResource,
    published_model: dict,
    lora_adapter: dict,
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
            reason = "no GGUF to serve: " + (
                exports_of(json.loads((published / LINEAGE_FILE).read_text()))["gguf"]["reason"] or "none published"
            )
            context.log.warning(reason)
            stats = {"file": None, "answers": [], "reason": reason, "signature": signature}
            ref = m.publish(
                _delivery_prefix(m.partition, lora_adapter, "serving"), stats, {"published_model": published_model}
            )
            return m.output(ref, file="none", reason=reason)
        try:
            shipped = modelfile_gguf(published / "gguf" / "Modelfile")
            m.fetch(published_model, "published", include=lambda rel: rel == f"gguf/{shipped}")
            context.log.info(
                f"serving {shipped} with llama_cpp.server; {len(config.prompts)} chat completions over HTTP"
            )
            answers = llamacpp.serving_smoke(published / "gguf" / shipped, config.prompts, config.max_tokens)
        except (GgufExportError, llamacpp.LlamaCppError) as exc:
            raise dg.Failure(str(exc)) from exc
        (m.out / "answers.json").write_text(json.dumps(answers, indent=2))
        stats = {"file": shipped, "answers": answers, "server": "llama_cpp.server (OpenAI-compatible, /v1/chat/completions)",
                 "signature": signature}  # fmt: skip
        ref = m.publish(
            _delivery_prefix(m.partition, lora_adapter, "serving"), stats, {"published_model": published_model}
        )
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
        raise dg.Failure(
            f"not serving {published_model['uri']}: {str(exc).replace(str(published), published_model['uri'])}"
        ) from exc


@dg.asset(**DELIVERY, kinds={"vllm", "openai", STORE_KIND})
def vllm_smoke(
    context: dg.AssetExecutionContext,
    config: VllmConfig,
    store: ObjectStoreResource,
    published_model: dict,
    lora_adapter: dict,
    base_model: dict,
) -> dg.Output[dict]:
    """The published model behind vLLM's OpenAI-compatible server (its own serving venv): the merged model, then the base
    with the published adapter as a LoRA module; one greedy chat completion per prompt, each against transformers'.

    A sibling of serving_smoke, for the same reasons: it serves the files as published (verified first, as there,
    when FT_SIGNING_PUBLIC_KEY is set), and a server that fails fails this asset alone while the model stays
    published. Where vLLM is not installed, or cannot read the model (a vision-language model whose processor needs
    what the serving venv lacks), it says so in one line and materializes without serving
    (``ft_assets.delivery.vllm``: ``FT_VLLM_PYTHON``, ``make install``). A vision-language model is also asked
    picture prompts, each answer against transformers'.
    """
    reason = vllm.unavailable()
    with Materialization(context, store, "vllm") as m:
        if reason:
            context.log.warning(f"vllm_smoke: {reason}; nothing served (the model stays published)")
            stats = {"served": False, "reason": reason}
        else:
            signature = _verified(m, published_model)  # with FT_SIGNING_PUBLIC_KEY: only verified files are served
            published = m.fetch(
                published_model, "published", include=lambda rel: rel.startswith(("merged/", "adapter/"))
            )
            lora = (published / "adapter" / "adapter_config.json").is_file()  # a full fine-tune publishes no adapter
            context.log.info(f"serving the merged model{' and the base + adapter (LoRA)' if lora else ''} with vLLM")
            try:
                stats = vllm.smoke(
                    published / "merged", config.prompts, config.max_tokens, m.fetch(base_model, "base") if lora else None,
                    published / "adapter" if lora else None, served_name(published_model["prefix"]),
                )  # fmt: skip
                stats.update(served=True, signature=signature)
            except vllm.VllmRefused as exc:  # this vLLM cannot take the kind of model: said, not failed
                reason = str(exc)
                context.log.warning(f"vllm_smoke: {reason}; nothing served (the model stays published)")
                stats = {"served": False, "reason": reason}
            except vllm.VllmError as exc:
                raise dg.Failure(str(exc)) from exc
        (m.out / "vllm.json").write_text(json.dumps(stats, indent=2))
        ref = m.publish(
            _delivery_prefix(m.partition, lora_adapter, "vllm"), stats, {"published_model": published_model}
        )
    if not stats["served"]:
        return m.output(ref, vllm=reason)
    if stats.get("lora_skipped"):
        context.log.warning(f"vllm_smoke: LoRA not served: {stats['lora_skipped']}")
    equal = ", ".join(f"{label} {count}/{stats['prompts']}" for label, count in stats["greedy_equal"].items())
    context.log.info(f"vLLM greedy answers equal to transformers': {equal}; loaded in {stats['load_seconds']} s")
    return m.output(
        ref, vllm="served", greedy_equal=equal,
        **figures(tokens_per_second=stats["tokens_per_second"]),
        load_seconds=table([{"server": label, "seconds": seconds} for label, seconds in stats["load_seconds"].items()], columns=["server", "seconds"]),
        answers=table(stats["rows"]),
    )  # fmt: skip


@dg.asset(
    partitions_def=dataset_version, group_name="delivery", io_manager_key="refs", tags={"ft/pool": "cpu"},
    kinds={"python", "json", STORE_KIND},
)  # fmt: skip
def version_comparison(context: dg.AssetExecutionContext, store: ObjectStoreResource) -> dg.Output[dict]:
    """The runs of one dataset version side by side: its own run and each variant's (``variants`` in the run config),
    with the settings that differ, the task metric base → tuned → shipped, the general tasks, tokens, wall time,
    dollars and ETH, and which one the registry's rule promotes (``ft_assets.delivery.comparison``)."""
    version = DatasetVersion.from_key(context.partition_key)
    if version.variant:
        raise dg.Failure(
            f"version_comparison compares the runs of a version: materialize it for {version.version_key}, not for its "
            f"variant {context.partition_key}"
        )
    with Materialization(context, store, "comparison") as m:
        runs = version_runs(m.store, m.partition)
        if not runs:
            raise dg.Failure(
                f"{m.partition} has no delivered run to compare: run its delivery plane (or a variant's) first"
            )
        champion, why = comparison.promoted(runs)
        rows = comparison.table(runs, champion)
        (m.out / "comparison.json").write_text(json.dumps({"rows": rows, "promoted": champion, "why": why}, indent=2))
        stats = {"runs": len(runs), "promoted": champion, "why": why, "rows": rows}
        ref = m.publish(layout.of(m.partition).comparison, stats)
    context.log.info(f"{m.partition}: {len(runs)} runs compared; promoted: {champion or 'none'} ({why})")
    groups = {run.name: {run.metric_name: run.finetuned_metric} for run in runs}
    return m.output(
        ref, runs=len(runs), promoted=f"{champion}: {why}" if champion else why, comparison=table(rows),
        chart=dg.MetadataValue.md(bar_chart(groups, f"{runs[0].metric_name} of each run (fine-tuned)")),
    )  # fmt: skip


def version_runs(store, partition: str) -> list[comparison.RunFigures]:
    """Every delivered run of the version ``partition``: its own and each variant's, from their references."""
    runs = []
    for key in [partition, *layout.of(partition).variant_keys(store)]:
        if not has_ref(store, key, "eval_report"):
            continue
        evaluation, adapter = read_ref(store, key, "eval_report"), read_ref(store, key, "lora_adapter")
        verdict = Gate.of(evaluation["stats"])
        cost = read_ref(store, key, "training_cost")["stats"] if has_ref(store, key, "training_cost") else {}
        published = has_ref(store, key, "published_model") and (
            read_ref(store, key, "published_model")["upstream"]["eval_report"]["digest"] == evaluation["digest"]
        )
        shipped = {export.title: verdict.exports[export.name].metric for export in EXPORTS}
        runs.append(
            comparison.RunFigures(
                DatasetVersion.from_key(key).variant, adapter["stats"]["run_id"], adapter["training_config"],
                verdict.metric_name, verdict.base_metric, verdict.finetuned_metric, shipped, verdict.flat(),
                verdict.general, adapter["stats"]["tokens_seen"], adapter["stats"]["wall_seconds"], cost.get("total_usd"),
                cost.get("eth_usd_per_hour"), published, evaluation["created_at"], None if published else ungated(verdict),
            )
        )  # fmt: skip
    return runs
