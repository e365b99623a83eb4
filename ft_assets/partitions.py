"""Dataset-version partitions: every asset of every plane is partitioned by ``dataset_version``.

A partition key is ``<name>@<version>`` for the dataset dropped at ``datasets/<name>/<version>/``, or
``<name>@<version>~<variant>`` for one **variant** of it: a named training configuration (``variants`` in the run
config) that trains and delivers as its own run. A variant reads its version's data plane (the same shards) and
writes its own training, delivery and control references (``layout.PartitionLayout``); being its own partition,
it has its own run id, lease and queue slot, so the variants of a version train side by side up to the GPU
pool's limit. Names, versions and variants are validated before they become object keys or partition keys, so a
hostile or mistyped name can never escape its prefix (``..``, ``/``) or break a key (whitespace, control chars).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import dagster as dg

dataset_version = dg.DynamicPartitionsDefinition(name="dataset_version")

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # 128 chars: fits S3 keys and UI columns
VARIANT_SEP = "~"  # never in a name or version (NAME_RE), and left as it is in URLs (the UI's partition links)


class InvalidDatasetId(ValueError):
    pass


def validate_part(kind: str, value: str) -> str:
    if not isinstance(value, str) or not NAME_RE.fullmatch(value) or ".." in value:
        shown = value if isinstance(value, str) else type(value).__name__
        raise InvalidDatasetId(
            f"invalid dataset {kind} {shown!r}: use 1-128 letters, digits, '.', '_' or '-', starting with a "
            "letter or digit (no '/', '..', whitespace or control characters)"
        )
    return value


@dataclass(frozen=True)
class DatasetVersion:
    name: str
    version: str
    variant: str = ""  # a named training configuration of the version; "": the version's own run

    def __post_init__(self):
        validate_part("name", self.name)
        validate_part("version", self.version)
        if self.variant:
            validate_part("variant", self.variant)

    @property
    def key(self) -> str:
        return f"{self.name}@{self.version}" + (f"{VARIANT_SEP}{self.variant}" if self.variant else "")

    @property
    def version_key(self) -> str:
        """The key of the version this variant belongs to (itself for the version's own run)."""
        return f"{self.name}@{self.version}"

    def with_variant(self, variant: str) -> DatasetVersion:
        return DatasetVersion(self.name, self.version, variant)

    @classmethod
    def from_key(cls, key: str) -> DatasetVersion:
        name, sep, rest = key.partition("@")
        if not sep:
            raise InvalidDatasetId(
                f"invalid partition key {key!r}: expected '<name>@<version>' or '<name>@<version>~<variant>'"
            )
        version, _, variant = rest.partition(VARIANT_SEP)
        return cls(name, version, variant)
