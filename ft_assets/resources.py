"""Dagster resources: the object store, and an IO manager that passes artifact *references* only.

Assets write their large outputs themselves, through ``ObjectStoreResource``, as manifest-published
artifacts. What flows between assets is a small JSON reference (``ArtifactRef``: the artifact's
prefix, URI, manifest digest, the stage's figures and the running row accounting), stored next to
the artifacts at ``runs/<name>/<version>/refs/<asset>.json``. Nothing is pickled, and a downstream
worker on another machine finds its inputs from the reference alone.
"""


import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

import dagster as dg
from pydantic import Field

from ft_assets.partitions import DatasetVersion
from ft_assets.storage import ObjectStore, join_key, open_store


class ObjectStoreResource(dg.ConfigurableResource):
    """Where every artifact lives: a local directory or ``s3://bucket/prefix``.

    Credentials are never configured here: boto3 reads the standard AWS_* environment variables.
    """

    url: str = Field(
        default="",
        description="Store URL: a local path or s3://bucket/prefix. Empty: $FT_STORE, else $FT_HOME/store (./var/store).",
    )

    def open(self) -> ObjectStore:
        return open_store(self.url or None)

    @contextmanager
    def scratch(self, what: str):
        """A temporary local directory for one asset's work; removed afterwards."""
        root = Path(os.environ.get("FT_SCRATCH", tempfile.gettempdir()))
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=f"ft-{what}-", dir=root) as path:
            yield Path(path)


def ref_key(partition_key: str, asset_name: str) -> str:
    return join_key(DatasetVersion.from_key(partition_key).run_prefix, "refs", f"{asset_name}.json")


class ArtifactRefIOManager(dg.ConfigurableIOManager):
    """Stores each asset's JSON-able return value (a reference, never the artifact) in the store."""

    store: dg.ResourceDependency[ObjectStoreResource]

    def _key(self, context) -> str:
        if not context.has_asset_partitions:
            raise dg.Failure(f"{context.asset_key.to_user_string()} must be partitioned by dataset_version")
        return ref_key(context.asset_partition_key, context.asset_key.path[-1])

    def handle_output(self, context: dg.OutputContext, obj: dict) -> None:
        if obj is None:
            return
        json.dumps(obj)  # fail loudly here, not in a reader, if a non-JSON value slipped in
        self.store.open().put_json(self._key(context), obj)

    def load_input(self, context: dg.InputContext) -> dict:
        store = self.store.open()
        key = self._key(context)
        if not store.exists(key):
            raise dg.Failure(
                f"upstream {context.asset_key.to_user_string()} has no output for partition "
                f"{context.asset_partition_key} ({store.uri(key)}): materialize it first"
            )
        return store.get_json(key)
