"""Where every input row of a dataset version went: the data plane's row accounting and its invariant.

Nothing is dropped silently. A row read from the input is kept, quarantined with a reason (by the
reader, the cleaner or the tokenizer), or counted as an exact or near duplicate, so at the end

    rows_in = rows_kept + rows_quarantined + exact_duplicates + near_duplicates

Each data asset carries the accounting of the stages before it in its stats (``as_dict``) and adds
its own (``quarantined``, ``deduplicated``, ``kept``); ``tokenized_shards`` records the final one,
whose ``invariant_holds`` the blocking check ``rows_accounted_for`` and the CLI read.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field, replace


@dataclass(frozen=True)
class RowAccounting:
    rows_in: int
    rows_quarantined: int = 0
    quarantine_reasons: dict[str, int] = field(default_factory=dict)
    exact_duplicates: int = 0
    near_duplicates: int = 0
    rows_kept: int | None = None  # known once tokenized_shards has kept (or quarantined) the last rows

    def quarantined(self, reasons: dict[str, int]) -> RowAccounting:
        """Add the rows a stage quarantined, by reason."""
        return replace(
            self,
            rows_quarantined=self.rows_quarantined + sum(reasons.values()),
            quarantine_reasons=dict(Counter(self.quarantine_reasons) + Counter(reasons)),
        )

    def deduplicated(self, exact: int, near: int) -> RowAccounting:
        return replace(
            self, exact_duplicates=self.exact_duplicates + exact, near_duplicates=self.near_duplicates + near
        )

    def kept(self, rows: int) -> RowAccounting:
        return replace(self, rows_kept=rows)

    @property
    def accounted(self) -> int:
        return (self.rows_kept or 0) + self.rows_quarantined + self.exact_duplicates + self.near_duplicates

    @property
    def invariant_holds(self) -> bool:
        return self.rows_kept is not None and self.accounted == self.rows_in

    @property
    def quarantine_fraction(self) -> float:
        return self.rows_quarantined / max(self.rows_in, 1)

    def line(self) -> str:
        """The invariant as one line of markdown (the UI's ``accounting`` entry)."""
        return (
            f"rows_in **{self.rows_in}** = kept {self.rows_kept} + quarantined {self.rows_quarantined} + exact "
            f"duplicates {self.exact_duplicates} + near duplicates {self.near_duplicates} → "
            f"{'holds' if self.invariant_holds else '**DOES NOT HOLD**'}"
        )

    def as_dict(self) -> dict:
        return {**asdict(self), "invariant_holds": self.invariant_holds}

    @classmethod
    def from_dict(cls, raw: dict) -> RowAccounting:
        return cls(**{name: raw[name] for name in cls.__dataclass_fields__ if name in raw})

    @classmethod
    def of(cls, stats: dict) -> RowAccounting:
        """The accounting a data asset recorded in its stats."""
        return cls.from_dict(stats["accounting"])
