"""What ``ft-assets run`` reports for each plane it completes: figures read from the assets' references.

Each plane's summary is a flat dict merged into the run's summary (the ``--json`` object, also on
failure for the planes that completed); ``summary_lines`` renders it. All reads of the references'
stats for the command line are in this module, and the plan made before the training plane
(``plan_before_training``).
"""

from __future__ import annotations

import os

import torch

from ft_assets import objectives
from ft_assets.cli.output import CliError
from ft_assets.control.assets import PlanConfig, measured_throughput, plan_run
from ft_assets.control.cost_model import load_cost_model
from ft_assets.control.gpu_plan import NoGpuFits
from ft_assets.delivery.assets import model_names
from ft_assets.delivery.exports import EXPORTS
from ft_assets.delivery.regression import GeneralVerdict
from ft_assets.targets import worker_has_cuda
from ft_assets.refs import AdapterStats, CostStats, EvalStats, PlanStats, ShardStats, read_ref, stats_of
from ft_assets.storage import ObjectStore, join_key
from ft_assets.training.settings import TRAINING_ASSET, run_training_config

DATA_ARTIFACTS = (
    "raw_dataset",
    "cleaned_dataset",
    "deduplicated_dataset",
    "train_eval_split",
    "tokenized_shards",
    "base_model",
)


def data_summary(store: ObjectStore, partition_key: str) -> dict:
    shards = stats_of(read_ref(store, partition_key, "tokenized_shards"), ShardStats)
    acc = shards["accounting"]
    return {
        "rows_in": acc["rows_in"],
        "rows_kept": acc["rows_kept"],
        "rows_quarantined": acc["rows_quarantined"],
        "quarantine_reasons": acc["quarantine_reasons"],
        "exact_duplicates": acc["exact_duplicates"],
        "near_duplicates": acc["near_duplicates"],
        "accounting_invariant_holds": acc["invariant_holds"],
        "train_rows": shards["train_rows"],
        "eval_rows": shards["eval_rows"],
        "tokens": shards["tokens"],
        "packing_efficiency": round(shards["packing_efficiency"], 6),
        "artifacts": {asset: read_ref(store, partition_key, asset)["uri"] for asset in DATA_ARTIFACTS},
    }


def plan_summary(plan: PlanStats) -> dict:
    """The plan's figures in the summary: the plan made before the training plane, then the one made in it."""
    return {
        "gpu_tier": plan["gpu_tier"],
        "rental_mode": plan["rental_mode"],
        "gpus": plan["gpus"],
        "estimated_vram_gib": round(plan["vram_gib"], 2),
        "estimated_hours": round(plan["est_hours"], 4),
        "estimated_cost_usd": round(plan["estimated_cost_usd"], 4),
    }


def plan_before_training(store: ObjectStore, partition_key: str, run_config: dict, target: str | None = None) -> dict:
    """The plan of the training run this run config starts, made here before the training plane is submitted, with
    training_plan's own function: a run no GPU fits is refused before anything is rented (``CliError``).

    An empty ``method`` resolves as on this machine (lora without CUDA); the training plane's own plan resolves it on
    its worker, and its figures replace these in the summary once that plane has run."""
    settings = ((run_config.get("ops") or {}).get("training_plan") or {}).get("config") or {}
    try:
        run = plan_run(
            run_training_config(run_config), PlanConfig(**settings), read_ref(store, partition_key, "tokenized_shards"),
            read_ref(store, partition_key, "base_model"), worker_has_cuda(target, torch.cuda.is_available()), target,
        )  # fmt: skip
    except NoGpuFits as exc:
        raise CliError(f"training_plan for {partition_key}: {exc}") from exc
    except ValueError as exc:
        raise CliError(f"training_plan for {partition_key}: {exc}; nothing was submitted to the GPU pool") from exc
    return plan_summary(run.stats(f"{TRAINING_ASSET} of this run config"))


def plan_line(summary: dict) -> str:
    """'rtx4090-24gb (spot), ~1.74 GiB VRAM, ~0.1667 h, estimated $0.0584'; '2 x ...' and 'per GPU' on several."""
    gpus, per_gpu = (f"{summary['gpus']} x ", " per GPU") if summary["gpus"] > 1 else ("", "")
    return (
        f"{gpus}{summary['gpu_tier']} ({summary['rental_mode']}), ~{summary['estimated_vram_gib']} GiB VRAM{per_gpu}, "
        f"~{summary['estimated_hours']} h, estimated ${summary['estimated_cost_usd']}"
    )


def training_summary(store: ObjectStore, partition_key: str) -> dict:
    adapter = read_ref(store, partition_key, "lora_adapter")
    stats = stats_of(adapter, AdapterStats)
    plan = read_ref(store, partition_key, "training_plan")
    speed = measured_throughput(adapter, plan, load_cost_model(os.environ.get("FT_COST_MODEL")))
    return {
        **plan_summary(stats_of(plan, PlanStats)),
        **speed.as_dict(),  # tokens_per_second, mfu (None off CUDA), usd_per_million_tokens
        "train_loss": stats["train_loss"],
        "eval_loss": stats["eval_loss"],
        "steps": stats["steps"],
        "resumed_from_step": stats["resumed_from_step"],
        "effective_training_fraction": round(stats["effective_training_fraction"], 4),
        "checkpoints": stats["checkpoints"],
        "training_wall_seconds": round(stats["wall_seconds"], 1),
        "training_method": stats["method"],
        "adapter_uri": adapter["uri"],
    }


def delivery_summary(store: ObjectStore, partition_key: str) -> dict:
    cost = stats_of(read_ref(store, partition_key, "training_cost"), CostStats)
    evaluation = stats_of(read_ref(store, partition_key, "eval_report"), EvalStats)
    published = read_ref(store, partition_key, "published_model")
    adapter = stats_of(read_ref(store, partition_key, "lora_adapter"), AdapterStats)
    return {
        "metric_name": evaluation["metric_name"],
        "base_metric": evaluation["base_metric"],
        "finetuned_metric": evaluation["finetuned_metric"],
        "base_eval_loss": evaluation["base_eval_loss"],
        "finetuned_eval_loss": evaluation["finetuned_eval_loss"],
        **objectives.summary_figures(evaluation),
        **{
            key: value
            for export in EXPORTS
            for key, value in export_summary(store, partition_key, export, evaluation).items()
        },
        **general_summary(evaluation.get("general")),
        "published_uri": published["uri"],
        "run_id": adapter["run_id"],
        "actual_cost_usd": round(cost["total_usd"], 6),
        "eth_usd": None if cost["eth_usd_per_hour"] is None else round(cost["eth_usd_per_hour"], 4),
        "idle_share": round(cost["idle_share"], 4),
    }


def export_summary(store: ObjectStore, partition_key: str, export, evaluation: EvalStats) -> dict:
    """One export's keys of the summary: ``<name>_file``, ``_<variant>``, ``_metric``, ``_drop``, ``_uri``, and ``_reason``
    (why it shipped nothing, in one line: turned off, refused by its converter or runtime; else None)."""
    verdict, name = evaluation["exports"][export.name], export.name
    uri = (
        store.uri(join_key(read_ref(store, partition_key, export.asset)["prefix"], verdict["file"]))
        if verdict["file"]
        else None
    )
    return {
        f"{name}_file": verdict["file"], f"{name}_{export.variant}": verdict["variant"], f"{name}_metric": verdict["metric"],
        f"{name}_drop": verdict["drop"], f"{name}_uri": uri, f"{name}_reason": verdict["reason"],
    }  # fmt: skip


def general_summary(general: dict | None) -> dict:
    """The general-ability figures (general_eval): per task the metric, the base's value, the fine-tuned model's and each
    shipped file's (``None`` where refused), and whether it regressed; ``general_regressed`` over all of them."""
    if not general or general["reason"]:
        return {"general": {}, "general_regressed": False, "general_reason": general["reason"] if general else None}
    tasks = {
        name: {"metric": task["metric"], "base": task["base"],
               **{model: judged["value"] for model, judged in task["models"].items()},
               "regressed": [model for model, judged in task["models"].items() if judged["regressed"]]}
        for name, task in general["tasks"].items()
    }  # fmt: skip
    return {
        "general": tasks, "general_regressed": general["regressed"], "general_on_regression": general["on_regression"],
        "general_chains": GeneralVerdict.of(general).chains(model_names()), "general_lines": general["lines"],
        "general_items": general["items"], "general_seconds": general["seconds"], "general_reason": None,
    }  # fmt: skip


def general_line(summary: dict) -> str:
    """'general (lm-eval): ft-general-mini names_answer: base 0.833 → fine-tuned 0.792 → shipped GGUF 0.792; kept
    (72 items, 21 s)', or 'REGRESSED (warn): ft-general-mini on fine-tuned, shipped GGUF' (the drops: the log's lines,
    ``general_lines``)."""
    if not summary["general"]:
        return f"  general (lm-eval): {summary['general_reason'] or 'not measured'}"
    cells = [f"{name} {chain}" for name, chain in summary["general_chains"].items()]
    names = model_names()
    fell = [
        f"{name} on {', '.join(names.get(model, model) for model in task['regressed'])}"
        for name, task in summary["general"].items()
        if task["regressed"]
    ]
    verdict = f"REGRESSED ({summary['general_on_regression']}): {'; '.join(fell)}" if fell else "kept"
    return f"  general (lm-eval): {'; '.join(cells)}; {verdict} ({summary['general_items']} items, {summary['general_seconds']:.0f} s)"


def export_lines(summary: dict) -> list[str]:
    """One line per export: where its shipped file is and how it scored in its runtime, or why none shipped."""
    lines = []
    for export in EXPORTS:
        name = export.name
        if summary[f"{name}_uri"]:
            lines.append(
                f"  {export.title}: {summary[f'{name}_uri']} ({summary[f'{name}_{export.variant}']}, {summary['metric_name']} "
                f"{summary[f'{name}_metric']:.3f} in {export.runtime_name})"
            )
        else:
            lines.append(f"  {export.title}: none ({summary[f'{name}_reason']})")
    return lines


def _loss(value: float | None) -> str:
    """An eval loss for the run log; GRPO has none (a prompt has no reference reply)."""
    return "n/a" if value is None else f"{value:.4f}"


SUMMARIES = {"data": data_summary, "training": training_summary, "delivery": delivery_summary}


def summary_lines(summary: dict) -> list[str]:
    """The run's summary as text: the lines of each plane that completed, then each variant's and the comparison."""
    lines = [f"dataset version {summary['partition']} (store: {summary['store']})"]
    if "rows_in" in summary:
        lines += [
            f"  rows in {summary['rows_in']}: kept {summary['rows_kept']}, quarantined {summary['rows_quarantined']}, "
            f"exact duplicates {summary['exact_duplicates']}, near duplicates {summary['near_duplicates']} "
            f"(invariant {'holds' if summary['accounting_invariant_holds'] else 'BROKEN'})",
            f"  quarantine reasons: {summary['quarantine_reasons']}",
            f"  train/eval rows {summary['train_rows']}/{summary['eval_rows']}, tokens {summary['tokens']}, "
            f"packing efficiency {summary['packing_efficiency']:.4f}",
            f"  token shards: {summary['artifacts']['tokenized_shards']}",
        ]
    lines += run_lines(summary)
    for name, figures in summary.get("variants", {}).items():
        lines += [f"  variant {name} ({figures['partition']}):", *("  " + line for line in run_lines(figures))]
    if summary.get("comparison"):
        lines += comparison_lines(summary)
    lines.append(f"  Dagster instance: {summary['dagster_home']} — open the UI with `make ui` (http://127.0.0.1:3000)")
    return lines


def comparison_lines(summary: dict) -> list[str]:
    """The version's runs side by side, one line each, and which one the registry's rule promotes."""
    lines = ["  runs side by side (version_comparison):"]
    for row in summary["comparison"]:
        metric = next(key for key in row if key not in COMPARISON_COLUMNS)
        lines.append(
            f"    {row['variant']}: {row['settings that differ']}; {metric} {row[metric]}; general "
            f"{row['general (base → tuned → shipped)']}; {row['tokens']} tokens, {row['wall_s']} s, "
            f"${row['usd']}; {row['verdict']}{' ← promoted' if row['promoted'] else ''}"
        )
    lines.append(f"  promoted: {summary['promoted'] or 'none'} ({summary['promoted_why']})")
    return lines


COMPARISON_COLUMNS = {
    "variant", "settings that differ", "general (base → tuned → shipped)", "tokens", "wall_s", "usd", "eth_usd_per_h",
    "verdict", "promoted", "run_id",
}  # fmt: skip


def run_lines(summary: dict) -> list[str]:
    """The training plan's, the training's and the delivery's lines of one run (the version's or a variant's)."""
    lines = []
    if "estimated_cost_usd" in summary:
        lines.append(f"  training plan: {plan_line(summary)}")
    if "steps" in summary:
        lines += [
            f"  training ({summary['training_method']}): {summary['steps']} steps, train loss {summary['train_loss']:.4f}, "
            f"eval loss {_loss(summary['eval_loss'])}, resumed from step {summary['resumed_from_step'] or 0}",
            f"  effective-training fraction {summary['effective_training_fraction']:.1%} of "
            f"{summary['training_wall_seconds']:.0f} s worker wall time; adapter: {summary['adapter_uri']}",
        ]
    if "actual_cost_usd" in summary:
        eth = "n/a" if summary["eth_usd"] is None else f"${summary['eth_usd']:.2f}"
        lines.append(
            f"  training cost: ${summary['actual_cost_usd']:.4f} actual, ETH {eth} per effective training hour "
            f"(idle share {summary['idle_share']:.1%})"
        )
    if "published_uri" in summary:
        lines += [
            f"  eval ({summary['metric_name']}): base {summary['base_metric']:.3f} → fine-tuned {summary['finetuned_metric']:.3f}; "
            f"eval loss {_loss(summary['base_eval_loss'])} → {_loss(summary['finetuned_eval_loss'])}",
            *export_lines(summary),
            general_line(summary),
            f"  published: {summary['published_uri']} (lineage.json inside)",
        ]
    return lines
