"""Launchpad configuration of the data-plane assets; every field has a default and a help text."""

import dagster as dg
from pydantic import Field

from ft_assets.data.cleaning import CleaningRules
from ft_assets.data.dedup import DedupRules
from ft_assets.data.images import MAX_BYTES, MAX_PIXELS, MIN_SIDE, ImageRules
from ft_assets.data.layouts import ColumnMapping


class RawConfig(dg.Config):
    columns: dict[str, str] = Field(
        default={},
        description=(
            "Column names of tables in another layout than chat 'messages', ShareGPT 'conversations' or alpaca "
            "'instruction'/'input'/'output'. Either prompt, response (and optionally input, system): one column each, "
            "e.g. {prompt: question, response: answer} or {prompt: prompt, response: completion}; or messages: a column "
            "holding a list of turns, with role and content naming the keys inside each turn, e.g. "
            "{messages: dialog, role: from, content: value}. Empty: the layout is recognised from the column names. "
            "A mixture component's own 'columns' take precedence."
        ),
    )

    max_image_pixels: int = Field(
        default=MAX_PIXELS,
        description=(
            "Largest image accepted, in pixels (width x height), read from the file's header before any pixel is "
            "decoded: a larger one (a decompression bomb: a few kB of PNG for 20,000 x 20,000 pixels) quarantines its row."
        ),
    )
    max_image_bytes: int = Field(default=MAX_BYTES, description="Largest image file accepted, in bytes.")
    min_image_side: int = Field(default=MIN_SIDE, description="Smallest width or height of an image, in pixels.")

    def image_rules(self) -> ImageRules:
        if min(self.max_image_pixels, self.max_image_bytes, self.min_image_side) < 1:
            raise dg.Failure("raw_dataset config: max_image_pixels, max_image_bytes and min_image_side must be >= 1")
        return ImageRules(self.max_image_pixels, self.max_image_bytes, self.min_image_side)

    def mapping(self) -> ColumnMapping | None:
        try:
            return ColumnMapping.of(self.columns)
        except ValueError as exc:
            raise dg.Failure(f"raw_dataset config {exc}") from exc


class CleanConfig(dg.Config):
    unicode_form: str = Field(
        default="NFC", description="Unicode normalization form (NFC keeps '²' and full-width forms; NFKC folds them)."
    )
    min_chars: int = Field(default=1, description="Minimum characters of each user message after cleanup.")
    min_response_chars: int = Field(default=1, description="Minimum characters of each assistant reply after cleanup.")
    max_chars: int = Field(default=32_000, description="Maximum characters of a whole conversation.")
    max_quarantine_fraction: float = Field(
        default=0.2,
        description="Blocking check: fail (and stop downstream assets) when more than this fraction of input rows is quarantined.",
    )

    def rules(self) -> CleaningRules:
        if self.unicode_form not in ("NFC", "NFKC", "NFD", "NFKD"):
            raise dg.Failure(f"cleaned_dataset config unicode_form={self.unicode_form!r}: use NFC, NFKC, NFD or NFKD")
        return CleaningRules(self.unicode_form, self.min_chars, self.max_chars, self.min_response_chars)


class DedupConfig(dg.Config):
    ngram: int = Field(default=5, description="Word n-gram size of the MinHash shingles.")
    num_perm: int = Field(default=128, description="MinHash permutations (112-256 is the usual range).")
    threshold: float = Field(default=0.8, description="Jaccard similarity above which rows are near-duplicates.")
    min_words: int = Field(
        default=10, description="Rows with fewer words are only exact-deduplicated (too few shingles to judge)."
    )
    near_duplicates: str = Field(
        default="drop",
        description="'drop' removes near-duplicates; 'keep' keeps them but the split keeps each cluster together.",
    )

    def rules(self) -> DedupRules:
        if not 0 < self.threshold <= 1:
            raise dg.Failure(f"deduplicated_dataset config threshold={self.threshold}: must be in (0, 1]")
        return DedupRules(self.ngram, self.num_perm, self.threshold, self.min_words, 1, self.near_duplicates)


class SplitConfig(dg.Config):
    eval_fraction: float = Field(default=0.1, description="Fraction of near-duplicate clusters that go to eval.")
    salt: str = Field(
        default="ft-assets", description="Salt of the stable split hash; change it to draw a different split."
    )


class TokenizeConfig(dg.Config):
    seq_len: int = Field(default=512, description="Tokens per packed row (the training sequence length).")
    window: int = Field(
        default=16_384, description="Examples per packing window (bounds memory; larger packs slightly tighter)."
    )
