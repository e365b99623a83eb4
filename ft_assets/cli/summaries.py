"""What ``ft-assets run`` reports for each plane it completes: figures read from the assets' references.

Each plane's summary is a flat dict merged into the run's summary (the ``--json`` object, also on
failure for the planes that completed); ``print_summary`` renders it. All reads of the references'
stats for the command line are in this module.
"""

from __future__ import annotations

import os

from ft_assets.control.assets import measured_throughput
from ft_assets.control.cost_model import load_cost_model
from ft_assets import objectives
from ft_assets.refs import AdapterStats, CostStats, EvalStats, GgufStats, PlanStats, ShardStats, read_ref, stats_of
from ft_assets.storage import ObjectStore, join_key

DATA_ARTIFACTS = ("raw_dataset", "cleaned_dataset", "deduplicated_dataset", "train_eval_split", "tokenized_shards", "base_model")


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
        **plan_summary(store, partition_key),
    }


def plan_summary(store: ObjectStore, partition_key: str) -> dict:
    plan = stats_of(read_ref(store, partition_key, "training_plan"), PlanStats)
    return {
        "gpu_tier": plan["gpu_tier"],
        "rental_mode": plan["rental_mode"],
        "estimated_vram_gib": round(plan["vram_gib"], 2),
        "estimated_hours": round(plan["est_hours"], 4),
        "estimated_cost_usd": round(plan["estimated_cost_usd"], 4),
    }


def training_summary(store: ObjectStore, partition_key: str) -> dict:
    adapter = read_ref(store, partition_key, "lora_adapter")
    stats = stats_of(adapter, AdapterStats)
    speed = measured_throughput(adapter, read_ref(store, partition_key, "training_plan"), load_cost_model(os.environ.get("FT_COST_MODEL")))
    return {
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
    gguf_ref = read_ref(store, partition_key, "gguf_model")
    gguf = stats_of(gguf_ref, GgufStats)
    published = read_ref(store, partition_key, "published_model")
    adapter = stats_of(read_ref(store, partition_key, "lora_adapter"), AdapterStats)
    return {
        "metric_name": evaluation["metric_name"],
        "base_metric": evaluation["base_metric"],
        "finetuned_metric": evaluation["finetuned_metric"],
        "base_eval_loss": evaluation["base_eval_loss"],
        "finetuned_eval_loss": evaluation["finetuned_eval_loss"],
        **objectives.summary_figures(evaluation),
        "gguf_metric": evaluation["gguf_metric"],
        "gguf_drop": evaluation["gguf_drop"],
        "gguf_file": evaluation["gguf_file"],
        "gguf_qtype": evaluation["gguf_qtype"],
        "gguf_uri": store.uri(join_key(gguf_ref["prefix"], gguf["shipped"])) if gguf["shipped"] else None,
        "gguf_reason": gguf.get("reason"),  # why no GGUF shipped (qtypes: [], a model llama.cpp cannot take); else None
        "published_uri": published["uri"],
        "run_id": adapter["run_id"],
        "actual_cost_usd": round(cost["total_usd"], 6),
        "eth_usd": None if cost["eth_usd_per_hour"] is None else round(cost["eth_usd_per_hour"], 4),
        "idle_share": round(cost["idle_share"], 4),
    }


def _loss(value: float | None) -> str:
    """An eval loss for the run log; GRPO has none (a prompt has no reference reply)."""
    return "n/a" if value is None else f"{value:.4f}"


SUMMARIES = {"data": data_summary, "training": training_summary, "delivery": delivery_summary}


def summary_lines(summary: dict) -> list[str]:
    """The run's summary as text: the lines of each plane that completed."""
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
    if "estimated_cost_usd" in summary:
        lines.append(
            f"  training plan: {summary['gpu_tier']} ({summary['rental_mode']}), ~{summary['estimated_vram_gib']} GiB VRAM, "
            f"~{summary['estimated_hours']} h, estimated ${summary['estimated_cost_usd']}"
        )
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
            f"  GGUF: {summary['gguf_uri']} ({summary['gguf_qtype']}, {summary['metric_name']} {summary['gguf_metric']:.3f} in llama.cpp)"
            if summary["gguf_uri"] else f"  GGUF: none ({summary['gguf_reason']})",
            f"  published: {summary['published_uri']} (lineage.json inside)",
        ]
    lines.append(f"  Dagster instance: {summary['dagster_home']} — open the UI with `make ui` (http://127.0.0.1:3000)")
    return lines
