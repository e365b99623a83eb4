"""GPU-aware run routing: training runs go to the ``gpu`` pool, everything else to the ``cpu`` pool.

Two pieces, both configured in ``dagster.yaml``:

- ``PoolRunCoordinator`` (a ``QueuedRunCoordinator``) decides a run's pool when it is submitted and
  writes it as the run tag ``ft/pool``, so the queue's ``tag_concurrency_limits`` can cap GPU runs at
  the pool's size (slots = GPUs you are willing to rent at once). It rejects, with a message in the
  run's log, a run that mixes GPU assets with CPU assets: such a run would either hold a GPU while
  it cleans data or train on a CPU box. Materialize the planes separately instead (each plane has
  its own job, and `ft-assets run` and the automation sensors already do that).
- ``PoolRunLauncher`` wraps one ordinary Dagster launcher per pool (locally ``DefaultRunLauncher``
  for both; in production ``EcsRunLauncher`` with a GPU task definition, ``K8sRunLauncher`` with
  ``nvidia.com/gpu`` limits or ``SlurmRunLauncher`` (``ft_assets.control.slurm``) for ``gpu``) and hands
  each run to the launcher of its pool, and run monitoring's health checks and resumes to it.

The gpu pool may name a GPU target (``target``, ``ft_assets.targets``): its runs then stay with the pool's launcher
(the control host's ``DefaultRunLauncher``) and ``lora_adapter`` sends only the training to the target; the
launcher tags each gpu run ``ft/gpu-target`` with it unless the run names its own (``ft-assets run --gpu``).

A training run asks its pool for the GPUs its training settings need: ``num_processes`` per node
(``gpus_per_node``), read from the run config's lora_adapter settings by ``run_training_config``, the
one reader ``training_plan`` plans with too, so the GPUs asked for are the GPUs planned for.
``PoolRunLauncher`` writes it as the inner launcher's own per-run override before handing the run over
(``gpu_request_tags``): ``dagster-k8s/config`` container resources ``nvidia.com/gpu`` for
K8sRunLauncher, ``ecs/container_overrides`` ``resourceRequirements`` GPU for EcsRunLauncher; an
override already on the run wins. Settings TrainingConfig refuses fail the run before it reaches a
pool, with that one line in its log. With ``num_nodes`` > 1 the run's pod is node 0 and
``lora_adapter`` starts the other nodes itself, as copies of that pod (``ft_assets.training.nodes``),
so they ask for the same GPUs.

Why not just tag the training job: asset tags do not become run tags, so a training asset
materialized ad hoc from the UI arrives as an anonymous asset job. The routing therefore looks at,
in order: an explicit ``ft/pool`` run tag, the run's asset selection, the ``ft/plane`` job tag.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

import yaml
from dagster import Array, Field, Permissive, Shape
from dagster import _check as check
from dagster._core.launcher.base import (
    CheckRunHealthResult,
    LaunchRunContext,
    ResumeRunContext,
    RunLauncher,
    WorkerStatus,
)
from dagster._core.run_coordinator.base import SubmitRunContext
from dagster._core.run_coordinator.queued_run_coordinator import QueuedRunCoordinator
from dagster._core.storage.dagster_run import DagsterRun
from dagster._serdes import ConfigurableClass, ConfigurableClassData

from ft_assets.targets import TARGET_TAG, TargetError, parse_target
from ft_assets.training.settings import run_training_config

POOL_TAG = "ft/pool"
PLANE_TAG = "ft/plane"
GPU, CPU, ANY = "gpu", "cpu", "any"
DEFAULT_GPU_ASSETS = ("lora_adapter",)  # the only step that needs an accelerator
DEFAULT_ANY_ASSETS = ("base_model", "training_plan")  # cheap, needed by both sides: never force a pool
K8S_CONFIG_TAG, ECS_OVERRIDES_TAG = (
    "dagster-k8s/config",
    "ecs/container_overrides",
)  # the inner launchers' per-run overrides


class MixedPoolRun(ValueError):
    pass


def pool_for_run(
    tags: Mapping[str, str],
    asset_keys: Iterable[str] | None,
    gpu_assets: Iterable[str] = DEFAULT_GPU_ASSETS,
    any_assets: Iterable[str] = DEFAULT_ANY_ASSETS,
) -> str:
    """``gpu`` or ``cpu`` for a run; raises ``MixedPoolRun`` when it selects GPU and CPU assets together."""
    if tags.get(POOL_TAG) in (GPU, CPU):
        return tags[POOL_TAG]
    if asset_keys:
        names = {key.split("/")[-1] for key in asset_keys}
        gpu = names & set(gpu_assets)
        cpu = names - set(gpu_assets) - set(any_assets)
        if gpu and cpu:
            raise MixedPoolRun(
                f"this run selects GPU assets ({', '.join(sorted(gpu))}) together with CPU assets "
                f"({', '.join(sorted(cpu))}); materialize them in separate runs (one plane per run) so the "
                "GPU worker only trains"
            )
        if gpu:
            return GPU
        if cpu:
            return CPU
    return GPU if tags.get(PLANE_TAG) == "training" else CPU


def _asset_names(run: DagsterRun) -> list[str] | None:
    if not run.asset_selection:
        return None
    return ["/".join(key.path) for key in run.asset_selection]


def gpus_per_node(run_config: Mapping[str, Any]) -> int:
    """GPUs one node of a training run needs: its training settings' ``num_processes`` (``run_training_config``);
    a ValueError names a setting TrainingConfig refuses."""
    return run_training_config(run_config).num_processes


def gpu_request_tags(launcher: str, gpus: int, tags: Mapping[str, str]) -> dict[str, str]:
    """The run tags that make ``launcher`` (its class name) ask for ``gpus`` GPUs; {} if it has no such override,
    the run already carries one, or one GPU is what the pool's launcher asks for anyway."""
    if gpus == 1:
        return {}
    if launcher == "K8sRunLauncher" and K8S_CONFIG_TAG not in tags:
        count = {"nvidia.com/gpu": str(gpus)}  # an extended resource: requests = limits
        return {K8S_CONFIG_TAG: json.dumps({"container_config": {"resources": {"requests": count, "limits": count}}})}
    if launcher == "EcsRunLauncher" and ECS_OVERRIDES_TAG not in tags:
        return {ECS_OVERRIDES_TAG: json.dumps({"resourceRequirements": [{"type": "GPU", "value": str(gpus)}]})}
    return {}


class PoolRunCoordinator(QueuedRunCoordinator):
    """A ``QueuedRunCoordinator`` that tags each run with its pool on submission (see module doc)."""

    def __init__(self, gpu_assets=None, any_assets=None, **kwargs):
        self.gpu_assets = tuple(gpu_assets or DEFAULT_GPU_ASSETS)
        self.any_assets = tuple(any_assets or DEFAULT_ANY_ASSETS)
        super().__init__(**kwargs)

    @classmethod
    def config_type(cls):
        base = dict(super().config_type())
        base["gpu_assets"] = Field(Array(str), is_required=False, description="Asset names that need the gpu pool.")
        base["any_assets"] = Field(
            Array(str), is_required=False, description="Asset names that may run in either pool."
        )
        return base

    @classmethod
    def from_config_value(cls, inst_data: ConfigurableClassData, config_value: Mapping[str, Any]):
        config = dict(config_value)
        return cls(
            inst_data=inst_data,
            gpu_assets=config.pop("gpu_assets", None),
            any_assets=config.pop("any_assets", None),
            **config,
        )

    def submit_run(self, context: SubmitRunContext) -> DagsterRun:
        run = context.dagster_run
        try:
            pool = pool_for_run(run.tags, _asset_names(run), self.gpu_assets, self.any_assets)
        except MixedPoolRun as exc:
            self._instance.report_engine_event(f"ft-assets refused this run: {exc}", run, cls=self.__class__)
            self._instance.report_run_failed(run)
            return self._instance.get_run_by_id(run.run_id)
        if run.tags.get(POOL_TAG) != pool:
            self._instance.add_run_tags(run.run_id, {POOL_TAG: pool})
            run = self._instance.get_run_by_id(run.run_id)
        return super().submit_run(SubmitRunContext(run, context.workspace))


class PoolRunLauncher(RunLauncher, ConfigurableClass):
    """Delegates each run to the launcher of its pool (``pools.gpu`` / ``pools.cpu`` in dagster.yaml)."""

    def __init__(self, pools: Mapping[str, Mapping[str, Any]], inst_data: ConfigurableClassData | None = None):
        self._inst_data = inst_data
        missing = {GPU, CPU} - set(pools)
        check.invariant(not missing, f"PoolRunLauncher needs pools {sorted(missing)} in dagster.yaml")
        self._pool_specs = pools
        self._launchers: dict[str, RunLauncher] = {}
        try:  # a target that cannot be used stops the instance from loading, with its one line
            parse_target(pools[GPU].get("target"))
        except TargetError as exc:
            raise check.CheckError(f"run_launcher.config.pools.gpu.target: {exc}") from None
        super().__init__()

    @property
    def inst_data(self):
        return self._inst_data

    @classmethod
    def config_type(cls):
        launcher = Shape(
            {
                "module": str,
                "class": str,
                "config": Field(Permissive(), is_required=False, default_value={}),
                "target": Field(
                    str,
                    is_required=False,
                    description="gpu pool: where lora_adapter's GPU work runs (ft_assets.targets), e.g. "
                    "ssh://me@gpu-box?python=/opt/venv/bin/python; the run itself stays with this pool's launcher",
                ),
            }
        )
        return {"pools": Shape({GPU: launcher, CPU: launcher})}

    @classmethod
    def from_config_value(cls, inst_data: ConfigurableClassData, config_value: Mapping[str, Any]):
        return cls(pools=config_value["pools"], inst_data=inst_data)

    def launcher(self, pool: str) -> RunLauncher:
        if pool not in self._launchers:
            spec = self._pool_specs[pool]
            inner = ConfigurableClassData(
                spec["module"], spec["class"], yaml.safe_dump(dict(spec.get("config") or {}))
            ).rehydrate(as_type=RunLauncher)
            inner.register_instance(self._instance)
            self._launchers[pool] = inner
        return self._launchers[pool]

    def _pool_of(self, run: DagsterRun) -> str:
        return pool_for_run(run.tags, _asset_names(run))

    def launch_run(self, context: LaunchRunContext) -> None:
        run = context.dagster_run
        pool = self._pool_of(run)
        inner = self.launcher(pool)
        tags = {POOL_TAG: pool}
        where = ""
        if pool == GPU:
            target = run.tags.get(TARGET_TAG) or self._pool_specs[GPU].get("target")  # the run's own wins
            try:
                gpus = gpus_per_node(run.run_config)
                remote = parse_target(target)
            except ValueError as exc:  # a TargetError too
                self._instance.report_engine_event(f"ft-assets refused this run: {exc}", run, cls=self.__class__)
                self._instance.report_run_failed(run)
                return
            tags.update(gpu_request_tags(type(inner).__name__, gpus, run.tags))
            if remote is not None:
                tags[TARGET_TAG] = target
                where = f"; lora_adapter trains on {remote.describe()}"
        self._instance.add_run_tags(run.run_id, tags)
        self._instance.report_engine_event(
            f"ft-assets routed this run to the {pool} pool ({type(inner).__name__}){where}", run, cls=self.__class__
        )
        inner.launch_run(LaunchRunContext(self._instance.get_run_by_id(run.run_id), context.workspace))

    def terminate(self, run_id: str) -> bool:
        run = self._instance.get_run_by_id(run_id)
        return bool(run) and self.launcher(self._pool_of(run)).terminate(run_id)

    @property
    def supports_resume_run(self) -> bool:
        """A pool can resume a run whose worker died (SlurmRunLauncher: a requeued job, K8sRunLauncher)."""
        return any(self.launcher(pool).supports_resume_run for pool in (GPU, CPU))

    def resume_run(self, context: ResumeRunContext) -> None:
        run = context.dagster_run
        inner = self.launcher(self._pool_of(run))
        if not inner.supports_resume_run:  # run monitoring resumes any pool's run: this pool's fails instead
            message = f"the {self._pool_of(run)} pool's {type(inner).__name__} cannot resume a run whose worker died"
            self._instance.report_engine_event(message, run, cls=self.__class__)
            self._instance.report_run_failed(run, message)
            return
        inner.resume_run(context)

    @property
    def supports_check_run_worker_health(self) -> bool:
        """Run monitoring checks the runs of the pools whose launchers report health (a Slurm gpu pool beside a
        local cpu pool: the gpu runs)."""
        return any(self.launcher(pool).supports_check_run_worker_health for pool in (GPU, CPU))

    def check_run_worker_health(self, run: DagsterRun) -> CheckRunHealthResult:
        inner = self.launcher(self._pool_of(run))
        if not inner.supports_check_run_worker_health:  # as if monitoring did not check it: only its timeouts apply
            return CheckRunHealthResult(WorkerStatus.RUNNING, f"{type(inner).__name__} does not report worker health")
        return inner.check_run_worker_health(run)

    def dispose(self) -> None:
        for inner in self._launchers.values():
            inner.dispose()

    def join(self, timeout: int = 30) -> None:
        for inner in self._launchers.values():
            inner.join(timeout)
