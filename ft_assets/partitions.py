"""Dataset-version partitions: every asset of every plane is partitioned by ``dataset_version``.

A partition key is ``<name>@<version>`` for the dataset dropped at ``datasets/<name>/<version>/``.
Names and versions are validated before they become object keys or partition keys, so a hostile or
mistyped name can never escape its prefix (``..``, ``/``) or break a key (whitespace, control chars).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import dagster as dg

dataset_version = dg.DynamicPartitionsDefinition(name="dataset_version")

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # 128 chars: fits S3 keys and UI columns


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

    def __post_init__(self):
        validate_part("name", self.name)
        validate_part("version", self.version)

    @property
    def key(self) -> str:
        return f"{self.name}@{self.version}"

    @classmethod
    def from_key(cls, key: str) -> DatasetVersion:
        name, sep, version = key.partition("@")
        if not sep:
            raise InvalidDatasetId(f"invalid partition key {key!r}: expected '<name>@<version>'")
        return cls(name, version)
