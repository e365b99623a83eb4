"""The eval gate: nothing is published unless the fine-tuned model beats its base."""

import dagster as dg

from ft_assets.delivery.assets import eval_report


@dg.asset_check(
    asset=eval_report,
    blocking=True,
    description="The fine-tuned model beats the base on the task metric by at least min_improvement.",
)
def finetuned_beats_base(eval_report: dict) -> dg.AssetCheckResult:
    stats = eval_report["stats"]
    return dg.AssetCheckResult(
        passed=stats["passed"],
        description=(
            f"{stats['metric_name']}: base {stats['base_metric']:.3f}, fine-tuned {stats['finetuned_metric']:.3f} "
            f"(improvement {stats['improvement']:+.3f}, required {stats['min_improvement']:+.3f}); "
            f"eval loss {stats['base_eval_loss']:.4f} → {stats['finetuned_eval_loss']:.4f}"
        ),
        metadata={k: stats[k] for k in ("base_metric", "finetuned_metric", "improvement", "min_improvement")},
    )
