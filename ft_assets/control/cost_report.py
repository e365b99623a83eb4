"""cost_report: every priced training run summed per dataset version, estimate against actual.

``aggregate_cost_report`` adds up the ``EthReport`` of each run (``eth.py``) with the estimate its
training plan made, per dataset version and over all of them. ETH and idle share are hour-weighted
(all dollars over all effective hours), not means of the per-run figures, so one short run does not
weigh as much as a long one.

Its $ per million tokens is ``usd_per_mtok_actual``: the actual dollars over the tokens trained, idle
time, checkpoint storage and egress included. ``training_plan``'s ``usd_per_mtok_planned`` is the other
definition (the tier's price over the planned throughput); the two names say which is which.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from ft_assets.control.eth import EthReport


@dataclass(frozen=True)
class CostRecord:
    """One finished training run for the cost report: what was planned and what it cost."""

    dataset_version: str  # partition key, e.g. 'support-chats@2026-11-02'
    run_id: str
    report: EthReport
    estimated_usd: float | None = None  # the training plan's estimate, None if the run had no plan
    estimated_hours: float | None = None


@dataclass(frozen=True)
class CostReportRow:
    """Runs of one dataset version (or of all versions, in CostReport.total) summed."""

    dataset_version: str
    runs: int
    restarts: int
    wall_hours: float
    step_hours: float
    effective_hours: float
    tokens_trained: int
    compute_usd: float
    storage_usd: float
    egress_usd: float
    estimated_usd: float | None  # sum over the runs that had an estimate; None if none had
    estimated_hours: float | None
    actual_vs_estimate: float | None  # actual $ / estimated $ over the runs that had an estimate

    @property
    def actual_usd(self) -> float:
        return self.compute_usd + self.storage_usd + self.egress_usd

    @property
    def eth_usd_per_hour(self) -> float | None:
        """Hour-weighted: all dollars over all effective hours (not a mean of per-run ETHs)."""
        return self.actual_usd / self.effective_hours if self.effective_hours > 0 else None

    @property
    def idle_share(self) -> float:
        return 1.0 - self.step_hours / self.wall_hours if self.wall_hours > 0 else 0.0

    @property
    def usd_per_mtok_actual(self) -> float | None:
        """Actual dollars (compute, storage, egress) over the tokens trained, per million tokens."""
        return self.actual_usd / self.tokens_trained * 1e6 if self.tokens_trained else None

    def as_dict(self) -> dict[str, Any]:
        extra = {
            "actual_usd": self.actual_usd,
            "eth_usd_per_hour": self.eth_usd_per_hour,
            "idle_share": self.idle_share,
            "usd_per_mtok_actual": self.usd_per_mtok_actual,
        }
        return {**asdict(self), **extra}


@dataclass(frozen=True)
class CostReport:
    """cost_report: one row per dataset version (sorted by key) and the total over all of them."""

    rows: tuple[CostReportRow, ...]
    total: CostReportRow

    def table_rows(self) -> list[dict[str, Any]]:
        """The report as rows for a metadata table: one per dataset version, then the total; 4 significant digits,
        None where a figure does not exist (no estimate, no tokens)."""
        return [
            {
                "dataset_version": row.dataset_version,
                "runs": row.runs,
                "restarts": row.restarts,
                "estimate_usd": _rounded(row.estimated_usd),
                "actual_usd": _rounded(row.actual_usd),
                "actual_vs_estimate": _rounded(row.actual_vs_estimate),
                "eth_usd_per_hour": _rounded(row.eth_usd_per_hour),
                "idle_share": _rounded(row.idle_share),
                "usd_per_mtok_actual": _rounded(row.usd_per_mtok_actual),
            }  # fmt: skip
            for row in (*self.rows, self.total)
        ]


def aggregate_cost_report(records: Iterable[CostRecord]) -> CostReport:
    """Sum runs per dataset version: estimate vs actual, hour-weighted ETH and idle share."""
    records = list(records)
    by_version: dict[str, list[CostRecord]] = {}
    for record in records:
        by_version.setdefault(record.dataset_version, []).append(record)
    rows = tuple(_sum_records(version, by_version[version]) for version in sorted(by_version))
    return CostReport(rows=rows, total=_sum_records("(all)", records))


def _sum_records(label: str, records: list[CostRecord]) -> CostReportRow:
    estimated = [r for r in records if r.estimated_usd is not None]
    estimated_usd = sum(r.estimated_usd for r in estimated) if estimated else None
    hours = [r.estimated_hours for r in records if r.estimated_hours is not None]
    actual_of_estimated = sum(r.report.total_usd for r in estimated)
    return CostReportRow(
        dataset_version=label,
        runs=len(records),
        restarts=sum(r.report.restarts for r in records),
        wall_hours=sum(r.report.wall_hours for r in records),
        step_hours=sum(r.report.step_hours for r in records),
        effective_hours=sum(r.report.effective_hours for r in records),
        tokens_trained=sum(r.report.tokens_trained for r in records),
        compute_usd=sum(r.report.compute_usd for r in records),
        storage_usd=sum(r.report.storage_usd for r in records),
        egress_usd=sum(r.report.egress_usd for r in records),
        estimated_usd=estimated_usd,
        estimated_hours=sum(hours) if hours else None,
        actual_vs_estimate=actual_of_estimated / estimated_usd if estimated_usd else None,
    )


def _rounded(value: float | None) -> float | None:
    """4 significant digits (dollars of a tiny demo run are fractions of a cent)."""
    return None if value is None else float(f"{value:.4g}")
