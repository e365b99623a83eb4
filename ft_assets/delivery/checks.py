"""The eval gate: nothing is published unless the fine-tuned model beats its base, every shipped export keeps its score
and no general-ability task fell by more than allowed.

One blocking check for the model, one per export (``shipped_gguf_keeps_the_metric``), made from the export registry,
and ``keeps_general_ability`` (general_eval's verdict: an error when it blocks, a warning, which does not block, when
``on_regression`` is ``warn``); each reads the gate's verdict from eval_report's stats (``ft_assets.delivery.gate``).
"""

import dagster as dg

from ft_assets.delivery.assets import eval_report
from ft_assets.delivery.exports import EXPORTS
from ft_assets.delivery.exports.protocol import Export
from ft_assets.delivery.gate import Gate


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
            + (
                f"; eval loss {stats['base_eval_loss']:.4f} → {stats['finetuned_eval_loss']:.4f}"
                if stats["base_eval_loss"] is not None
                else ""
            )
        ),
        metadata={
            k: getattr(verdict, k) for k in ("base_metric", "finetuned_metric", "improvement", "min_improvement")
        },
    )


def keeps_the_metric(export: Export) -> dg.AssetChecksDefinition:
    """The blocking check of one export: its shipped file, in its own runtime, within its max_drop of the merged model."""

    @dg.asset_check(
        asset=eval_report,
        name=f"shipped_{export.name}_keeps_the_metric",
        blocking=True,
        description=f"The shipped {export.title}, answering through {export.runtime_name}, scores at most "
        f"{export.asset}.max_drop below the merged model (nothing to compare when none ships).",
    )
    def check(eval_report: dict) -> dg.AssetCheckResult:
        verdict = Gate.of(eval_report["stats"])
        shipped = verdict.exports[export.name]
        if shipped.file is None:
            return dg.AssetCheckResult(
                passed=True, description=f"no {export.title} ships ({shipped.reason}): nothing to compare"
            )
        return dg.AssetCheckResult(
            passed=shipped.within_drop,
            description=(
                f"{verdict.metric_name}: merged model {verdict.finetuned_metric:.3f}, {shipped.file} in {export.runtime_name} "
                f"{shipped.metric:.3f} (drop {shipped.drop:+.3f}, allowed {shipped.max_drop:.3f})"
            ),
            metadata={
                "finetuned_metric": verdict.finetuned_metric,
                f"{export.name}_metric": shipped.metric,
                f"{export.name}_drop": shipped.drop,
                "max_drop": shipped.max_drop,
                f"{export.name}_file": shipped.file,
            },
        )

    return check


export_checks = [keeps_the_metric(export) for export in EXPORTS]  # shipped_gguf_keeps_the_metric, ...


@dg.asset_check(
    asset=eval_report,
    blocking=True,
    description="No general-ability task (general_eval, lm-eval) fell on the fine-tuned model or a shipped file by more "
    "than max_drop beyond stderr_z standard errors; a regression blocks (on_regression: block) or warns (warn).",
)
def keeps_general_ability(eval_report: dict) -> dg.AssetCheckResult:
    general = Gate.of(eval_report["stats"]).general
    if general is None or general.reason:
        return dg.AssetCheckResult(passed=True, description=general.reason if general else "no general_eval verdict")
    kept = f"kept on {', '.join(general.tasks)} ({general.items} items, {general.seconds:.0f} s of lm-eval)"
    return dg.AssetCheckResult(
        passed=not general.regressed,
        severity=dg.AssetCheckSeverity.ERROR if general.blocks else dg.AssetCheckSeverity.WARN,
        description="; ".join(general.lines) if general.regressed else kept,
        metadata={"on_regression": general.on_regression, "regressions": len(general.lines)},
    )
