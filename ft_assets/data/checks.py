"""Blocking checks that guard the data plane: nothing trains on a mostly-broken or miscounted version."""

import dagster as dg

from ft_assets.data.accounting import RowAccounting
from ft_assets.data.assets import cleaned_dataset, tokenized_shards


@dg.asset_check(
    asset=cleaned_dataset,
    blocking=True,
    description="Quarantined fraction of input rows is within the configured limit.",
)
def quarantine_fraction_within_limit(cleaned_dataset: dict) -> dg.AssetCheckResult:
    stats = cleaned_dataset["stats"]
    fraction, limit = stats["quarantine_fraction"], stats["max_quarantine_fraction"]
    reasons = RowAccounting.of(stats).quarantine_reasons
    top = ", ".join(f"{r}: {n}" for r, n in sorted(reasons.items(), key=lambda kv: -kv[1])[:5]) or "none"
    return dg.AssetCheckResult(
        passed=fraction <= limit,
        description=(
            f"{fraction:.1%} of rows quarantined (limit {limit:.1%}); top reasons: {top}. "
            "Inspect the quarantine-NNNNN.parquet parts of raw_dataset and cleaned_dataset."
        ),
        metadata={"quarantine_fraction": fraction, "limit": limit},
    )


@dg.asset_check(
    asset=tokenized_shards,
    blocking=True,
    description="rows_in = rows_kept + rows_quarantined + exact_duplicates + near_duplicates",
)
def rows_accounted_for(tokenized_shards: dict) -> dg.AssetCheckResult:
    accounting = RowAccounting.of(tokenized_shards["stats"])
    return dg.AssetCheckResult(
        passed=accounting.invariant_holds,
        description=f"{accounting.rows_in} rows in; kept + quarantined + duplicates = {accounting.accounted}",
        metadata={k: v for k, v in accounting.as_dict().items() if isinstance(v, int) and not isinstance(v, bool)},
    )
