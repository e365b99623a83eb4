"""The eval gate: nothing is published unless the fine-tuned model beats its base and the shipped GGUF keeps its score."""

import dagster as dg

from ft_assets.delivery.assets import eval_report
from ft_assets.delivery.evaluate import PREFERENCE_METRIC


@dg.asset_check(
    asset=eval_report,
    blocking=True,
    description="The fine-tuned model beats the base on the task metric (preference runs: reward accuracy on the "
    "held-out pairs) by at least min_improvement.",
)
def finetuned_beats_base(eval_report: dict) -> dg.AssetCheckResult:
    stats = eval_report["stats"]
    margins = ""
    if stats["metric_name"] == PREFERENCE_METRIC:
        margins = f"; reward margin {stats['base_reward_margin']:+.4f} → {stats['finetuned_reward_margin']:+.4f} (DPO {stats['dpo_loss']})"
    return dg.AssetCheckResult(
        passed=stats["beats_base"],
        description=(
            f"{stats['metric_name']}: base {stats['base_metric']:.3f}, fine-tuned {stats['finetuned_metric']:.3f} "
            f"(improvement {stats['improvement']:+.3f}, required {stats['min_improvement']:+.3f}); "
            f"eval loss {stats['base_eval_loss']:.4f} → {stats['finetuned_eval_loss']:.4f}{margins}"
        ),
        metadata={k: stats[k] for k in ("base_metric", "finetuned_metric", "improvement", "min_improvement")},
    )


@dg.asset_check(
    asset=eval_report,
    blocking=True,
    description="The shipped GGUF, answering through llama.cpp, scores at most max_gguf_drop below the merged model.",
)
def shipped_gguf_keeps_the_metric(eval_report: dict) -> dg.AssetCheckResult:
    stats = eval_report["stats"]
    return dg.AssetCheckResult(
        passed=stats["gguf_within_drop"],
        description=(
            f"{stats['metric_name']}: merged model {stats['finetuned_metric']:.3f}, {stats['gguf_file']} in llama.cpp "
            f"{stats['gguf_metric']:.3f} (drop {stats['gguf_drop']:+.3f}, allowed {stats['max_gguf_drop']:.3f})"
        ),
        metadata={k: stats[k] for k in ("finetuned_metric", "gguf_metric", "gguf_drop", "max_gguf_drop", "gguf_file")},
    )
