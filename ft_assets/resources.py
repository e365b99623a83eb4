"""Dagster resources: the object store, and an IO manager that passes artifact *references* only.

Assets write their large outputs themselves, through ``ObjectStoreResource``, as manifest-published
artifacts. What flows between assets is a small JSON reference (``ArtifactRef``: the artifact's
prefix, URI, manifest digest, the stage's figures and the running row accounting), stored next to
the artifacts (``ft_assets.refs``). Nothing is pickled, and a downstream worker on another machine
finds its inputs from the reference alone.
"""

import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

import dagster as dg
from pydantic import Field, PrivateAttr

from ft_assets import layout, locks, refs
from ft_assets.partitions import DatasetVersion
from ft_assets.storage import ObjectStore, open_store

PARTITION_TAG = "dagster/partition"


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


def variant_refusal(partition: str, assets: list[str]) -> str:
    """Why a variant's run may not write its version's data-plane outputs."""
    version = DatasetVersion.from_key(partition)
    return (
        f"{', '.join(assets)} of {partition}: the variants of a version share its data plane; materialize "
        f"{'them' if len(assets) > 1 else 'it'} for {version.version_key} (a variant trains and delivers only)"
    )


class ArtifactRefIOManager(dg.ConfigurableIOManager):
    """Stores each asset's JSON-able return value (a reference, never the artifact) in the store.

    Every asset of every plane writes through it, so it also holds the run's partition lease
    (``ft_assets.locks``) from setup to teardown: two runs of the same dataset version never write its
    artifacts at once, the second fails at start naming the first. (On the IO manager rather than on
    ``ObjectStoreResource``, which sensors use outside any run.)
    """

    store: dg.ResourceDependency[ObjectStoreResource]
    _lease: locks.Lease | None = PrivateAttr(default=None)

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        run = context.run
        partition = run.tags.get(PARTITION_TAG) if run is not None else None
        if partition is None:  # not a run of one partition
            return
        shared = sorted(key.path[-1] for key in run.asset_selection or () if key.path[-1] in layout.VERSION_ASSETS)
        if shared and DatasetVersion.from_key(partition).variant:
            raise dg.Failure(variant_refusal(partition, shared))
        instance = context.instance

        def run_status(run_id: str) -> str | None:
            record = instance.get_run_by_id(run_id) if instance is not None else None
            return None if record is None else record.status.value

        try:
            self._lease = locks.acquire(self.store.open(), partition, run.run_id, run_status)
        except locks.PartitionBusy as exc:
            raise dg.Failure(str(exc)) from exc

    def teardown_after_execution(self, context: dg.InitResourceContext) -> None:
        if self._lease is not None:
            self._lease.release()
            self._lease = None

    def _check_lease(self) -> None:
        """Fail if another run took this run's partition over (after this one missed its heartbeats)."""
        if self._lease is not None and not self._lease.held():
            raise dg.Failure(
                f"run {self._lease.run_id} lost the lease on partition {self._lease.partition} to another run "
                f"(no heartbeat for {locks.EXPIRY_SECONDS:.0f} s); its output is not published"
            )

    @staticmethod
    def _partition(context) -> str:
        # Every asset is partitioned by dataset_version with the identity mapping, so an input's partition
        # is the run's. Asked for the asset's own, Dagster may answer with "all partitions" when the run's
        # partition was the only one at its start, which names two as soon as a second one is added.
        return context.partition_key if context.has_partition_key else context.asset_partition_key

    def _where(self, context) -> tuple[str, str]:
        if not context.has_asset_partitions:
            raise dg.Failure(f"{context.asset_key.to_user_string()} must be partitioned by dataset_version")
        return self._partition(context), context.asset_key.path[-1]

    def handle_output(self, context: dg.OutputContext, obj: dict) -> None:
        if obj is None:
            return
        json.dumps(obj)  # fail loudly here, not in a reader, if a non-JSON value slipped in
        self._check_lease()
        partition, asset = self._where(context)
        if asset in layout.VERSION_ASSETS and DatasetVersion.from_key(partition).variant:
            raise dg.Failure(variant_refusal(partition, [asset]))
        refs.write_ref(self.store.open(), partition, asset, obj)

    def load_input(self, context: dg.InputContext) -> dict:
        try:
            return refs.read_ref(self.store.open(), *self._where(context))
        except refs.RefNotFound as exc:
            raise dg.Failure(f"upstream {exc}") from exc
