"""The data plane's executor setting: one Dagster resource that every data asset runs its shards on.

A resource, not asset config, because it says *where* the work runs, never *what* comes out: every
mode writes the same files (``ft_assets.data.parallel``). So it is set once for the whole plane, and
changing it does not make the plane's outputs stale (``ft-assets run`` compares asset config only).

    resources:
      data_executor:
        config:
          workers: 0            # 0: every core (local) or every CPU of the Ray cluster; 1: one process
          ray_address: ""       # "": processes on this machine; "local": a local Ray; ray://head:10001
          ray_runtime_env: {}   # e.g. {py_modules: [...], env_vars: {...}}: how Ray workers get the code
          shard_rows: 16384     # rows per task (the unit of retry and of a worker's memory)

``ft-assets run --data-workers N --ray-address ADDR|local`` sets the first two. Ray connections go
through dagster-ray: ``LocalRay`` for ``local``, a ``RayResource`` at the given address otherwise, or
any dagster-ray resource given as ``ray`` in Python (``KubeRayInteractiveJob`` creates a cluster on
Kubernetes for the run; see docs/guides/data.md).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import dagster as dg
from pydantic import Field, PrivateAttr

from ft_assets.data.parallel import (
    DEFAULT_SHARD_ROWS,
    Executor,
    InProcess,
    ProcessPool,
    RayTasks,
    RayUnreachable,
    check_ray_address,
    sigterm_handler_kept,
)


def ray_cluster(address: str, init_options: dict[str, Any]) -> dg.ConfigurableResource:
    """dagster-ray's resource for ``address``: ``LocalRay`` for ``local``, else one for a cluster already running there."""
    try:
        from dagster_ray import LocalRay, RayResource
    except ImportError as exc:
        raise dg.Failure(f"ray_address {address!r} needs the ray extra: pip install 'ft-assets[ray]'") from exc
    if address == "local":
        return LocalRay(ray_init_options=init_options)

    class RunningCluster(RayResource):
        @property
        def host(self) -> str:
            return address

        @property
        def name(self) -> str:
            return f"the Ray cluster at {address}"

        @property
        def ray_address(self) -> str:  # dagster-ray's default is ray://<host>:<redis_port>
            return address

        @property
        def created(self) -> bool:  # nothing to create: the cluster is running already
            return True

        @property
        def ready(self) -> bool:
            return True

    return RunningCluster(ray_init_options=init_options)


class DataExecutorResource(dg.ConfigurableResource):
    """Where the data plane's shards run: processes on this machine, or a Ray cluster. Outputs are the same in every mode."""

    workers: int = Field(
        default=0,
        description="Shards run at once. 0: one per core of this machine (one per CPU of the Ray cluster with ray_address); "
        "1: one process, no pool (the data plane's single-process path).",
    )
    ray_address: str = Field(
        default="",
        description="Empty: worker processes on this machine. 'local': start a Ray instance on this machine for the run. "
        "Otherwise a running Ray cluster: ray://head:10001 (Ray Client), head:6379, or auto (from one of its nodes).",
    )
    ray_runtime_env: dict[str, Any] = Field(
        default={},
        description="Ray runtime environment of the workers (ray.init's runtime_env): py_modules, pip, env_vars, ... The "
        "workers import ft_assets: install it in the cluster's image or ship it with py_modules.",
    )
    shard_rows: int = Field(
        default=DEFAULT_SHARD_ROWS,
        description="Rows per shard: the unit of work, of retry after a worker dies, and of a worker's memory. Outputs do not depend on it.",
    )
    ray: dg.ConfigurableResource | None = Field(
        default=None,
        description="A dagster-ray RayResource that provides the cluster, set in Python (e.g. KubeRayInteractiveJob); "
        "Dagster connects it before the run. Overrides ray_address.",
    )

    _executor: Executor | None = PrivateAttr(default=None)

    @property
    def executor(self) -> Executor:
        """The executor of this run (opened when the run starts, closed when it ends)."""
        if self._executor is None:
            raise dg.Failure("the data executor is not open: use it as a resource of a Dagster run")
        return self._executor

    @contextmanager
    def yield_for_execution(self, context: dg.InitResourceContext) -> Iterator[DataExecutorResource]:
        with self._open(context) as executor:
            executor.log = context.log.info
            self._executor = executor
            context.log.info(f"data plane runs on {executor.describe()}, {self.shard_rows:,} rows a shard")
            try:
                yield self
            finally:
                self._executor = None

    @contextmanager
    def _open(self, context: dg.InitResourceContext) -> Iterator[Executor]:
        if self.workers < 0 or self.shard_rows < 1:
            raise dg.Failure(
                f"data_executor: workers must be >= 0 and shard_rows >= 1 (got {self.workers}, {self.shard_rows})"
            )
        if self.ray is not None:  # connected by Dagster as a nested resource
            with RayTasks(self.workers, self.shard_rows) as executor:
                yield executor
            return
        if self.ray_address:
            try:
                check_ray_address(self.ray_address)
            except RayUnreachable as exc:
                raise dg.Failure(str(exc)) from exc
            options = {"include_dashboard": False, "log_to_driver": False}
            if self.ray_runtime_env:
                options["runtime_env"] = self.ray_runtime_env
            if self.ray_address == "local":
                options["num_cpus"] = self.workers or os.cpu_count()
            local = self.ray_address == "local"  # its workers share this machine's files, a local store included
            with ExitStack() as stack:
                with sigterm_handler_kept():  # Dagster's, which turns a terminate from the UI into an interrupt
                    stack.enter_context(ray_cluster(self.ray_address, options).yield_for_execution(context))
                yield stack.enter_context(RayTasks(self.workers, self.shard_rows, remote=not local))
            return
        workers = self.workers or os.cpu_count() or 1
        with InProcess(1, self.shard_rows) if workers == 1 else ProcessPool(workers, self.shard_rows) as executor:
            yield executor
