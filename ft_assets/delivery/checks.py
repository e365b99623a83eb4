"""The eval gate: nothing is published unless the fine-tuned model beats its base and the shipped GGUF keeps its score."""

import dagster as dg

from ft_assets.delivery.assets import eval_report
from ft_assets.delivery.evaluate import Gate


@dg.asset_check(
    asset=eval_report,
    blocking=True,
    description="The fine-tuned model beats the base on the task metric (preference runs: reward accuracy on the "
    "held-out pairs) by at least min_improvement.",
)
def finetuned_beats_base(eval_report: dict) -> dg.AssetCheckResult:
    stats, verdict = eval_report["stats"], Gate.of(eval_report["stats"])
    return dg.AssetCheckResult(
        passed=verdict.beats_base,
        description=(
            f"{verdict.metric_name}: base {verdict.base_metric:.3f}, fine-tuned {verdict.finetuned_metric:.3f} "
            f"(improvement {verdict.improvement:+.3f}, required {verdict.min_improvement:+.3f})"
            + (f"; eval loss {stats['base_eval_loss']:.4f} → {stats['finetuned_eval_loss']:.4f}" if stats["base_eval_loss"] is not None else "")
        ),
        metadata={k: getattr(verdict, k) for k in ("base_metric", "finetuned_metric", "improvement", "min_improvement")},
    )


@dg.asset_check(
    asset=eval_report,
    blocking=True,
    description="The shipped GGUF, answering through llama.cpp, scores at most max_gguf_drop below the merged model.",
)
def shipped_gguf_keeps_the_metric(eval_report: dict) -> dg.AssetCheckResult:
    stats, verdict = eval_report["stats"], Gate.of(eval_report["stats"])
    if verdict.gguf_metric is None:
        return dg.AssetCheckResult(passed=True, description="no GGUF ships for this run (see gguf_model): nothing to compare")
    return dg.AssetCheckResult(
        passed=verdict.gguf_within_drop,
        description=(
            f"{verdict.metric_name}: merged model {verdict.finetuned_metric:.3f}, {stats['gguf_file']} in llama.cpp "
            f"{verdict.gguf_metric:.3f} (drop {verdict.gguf_drop:+.3f}, allowed {verdict.max_gguf_drop:.3f})"
        ),
        metadata={"finetuned_metric": verdict.finetuned_metric, "gguf_metric": verdict.gguf_metric, "gguf_drop": verdict.gguf_drop,
                  "max_gguf_drop": verdict.max_gguf_drop, "gguf_file": stats["gguf_file"]},
    )
