"""``SkyPilotRunLauncher``: the gpu pool as SkyPilot managed jobs, on whichever allowed cloud has the planned GPU.

SkyPilot (``sky.jobs.launch``) takes one task spec onto AWS, GCP, Azure, Lambda, RunPod, Vast.ai,
Nebius or Kubernetes, and relaunches a preempted spot job elsewhere (``job_recovery``). ``PoolRunLauncher``
wraps this launcher as its ``gpu`` pool (``deploy/launchers/skypilot-gpu.yaml``); each training run
becomes one managed job (``task_config``):

- **the command**: ``python -m ft_assets.providers.sky_attempt '<ExecuteRunArgs>'``, i.e. the same
  ``dagster api execute_run`` the other launchers run (a recovered attempt runs ``resume_run``:
  ``sky_attempt``), in the worker image (``image_id: docker:<image>``);
- **the resources, from the plan**: made at launch with ``training_plan``'s own function
  (``control.assets.plan_run``) on the partition's ``tokenized_shards`` and ``base_model`` and the run's
  lora_adapter settings, so the GPU rented is the one the plan will name and a run no GPU fits fails
  before anything is rented. The plan's offering gives SkyPilot's accelerator name
  (``GpuOffering.accelerator``) and count (up to 8 on one node: SkyPilot runs a task's command on
  every node, and a run has one Dagster worker, so multi-node plans are refused), its rental mode
  ``use_spot``; ``infra`` (allowed ``cloud[/region]``s, the data's region moved first) becomes
  ``resources.ordered``, SkyPilot's preference list; ``disk_size``; ``job_recovery`` (strategy,
  ``max_restarts_on_errors``); ``autostop`` (down after ``autostop_minutes`` idle), which only a
  ``sky launch`` of the same task uses: the jobs controller tears a managed job's cluster down itself;
- **credentials** (``secrets``: names of this host's environment variables, e.g. the store's
  ``AWS_SECRET_ACCESS_KEY``, ``DAGSTER_PG_PASSWORD``) go in the task's ``secrets``, which SkyPilot keeps
  out of its logs, dashboard and ``sky jobs queue``; ``env`` holds the rest (``FT_STORE``, endpoints)
  with ``FT_GPU_TIER`` / ``FT_RENTAL_MODE``, which training_cost prices the worker as.

No bucket is mounted: SkyPilot cannot mount one on RunPod or Vast.ai, and a ``MOUNT_CACHED``
checkpoint can be incomplete after a preemption. A recovered attempt downloads the base model and
shards again and resumes from the newest checkpoint whose manifest (written last) is in the store.

**Health and tags** (``check_run_worker_health``, run monitoring): ``sky.jobs.queue_v2`` of the job:
PENDING/STARTING/RUNNING/RECOVERING/... are a running worker (a recovery is SkyPilot's business),
SUCCEEDED a finished one, FAILED*/CANCELLED a dead one (monitoring then fails the run and the run
retry starts a new job). Each check writes the run tags ``ft/sky-job-id``, ``ft/sky-cloud``,
``ft/sky-region``, ``ft/sky-instance``, ``ft/sky-recoveries`` and ``ft/worker-instance-id =
sky:<cluster>``. ``terminate`` is ``sky.jobs.cancel``.

**Cost**: each check brings the run tag ``ft/sky-attempts`` up to date (``sky_bill.update_attempts``:
the cloud, region, instance, catalog $/h and running time of every attempt, and the gap before it);
``training_cost`` prices the run from those attempts (``sky_bill.adapter_bill``) and counts the egress
of every attempt outside the data's region.

Verified at SkyPilot's SDK boundary: the task through ``sky.Task``, ``Task.validate()`` and a YAML
round trip (``ft_assets_tests/test_skypilot.py``); the launcher on a Dagster instance with its daemon,
a preemption whose recovered attempt resumes on a fresh scratch disk, a cancel, and SkyPilot's
optimizer refusing a launch with no cloud enabled (``test_skypilot_pool.py``). Not yet launched on a real
cloud.
"""

from __future__ import annotations

import json
import os
import shlex
import time
from collections.abc import Mapping, Sequence
from typing import Any

from dagster import Array, Field, Int, Noneable, Permissive, Shape
from dagster import _check as check
from dagster._core.launcher import LaunchRunContext, RunLauncher
from dagster._core.launcher.base import CheckRunHealthResult, WorkerStatus
from dagster._core.storage.dagster_run import DagsterRun
from dagster._grpc.types import ExecuteRunArgs
from dagster._serdes import ConfigurableClass, ConfigurableClassData, serialize_value

from ft_assets.control.sky_bill import ATTEMPTS_TAG, JOB_TAG, SPOT_TAG, update_attempts
from ft_assets.providers import sdk_venv
from ft_assets.providers.ec2_metadata import WORKER_TAG
from ft_assets.targets.skypilot import (
    DEFAULT_AUTOSTOP_MINUTES,
    DEFAULT_RECOVERY,
    RUNNING,
    ordered_infra,
    secret_values,
    task_config,
)
from ft_assets.providers.worker_identity import SKY

NAME_TAG = "ft/sky-job-name"
CLOUD_TAG, REGION_TAG, INSTANCE_TAG = "ft/sky-cloud", "ft/sky-region", "ft/sky-instance"
RECOVERIES_TAG = "ft/sky-recoveries"
NAME_PREFIX = "ft-"  # + the run id's first 8 characters: the job's name; its clusters are <name>-<job id>


# --- the launcher --------------------------------------------------------------------------------


class SkyPilotRunLauncher(RunLauncher, ConfigurableClass):
    """Launches each run as a SkyPilot managed job (see the module docstring)."""

    def __init__(
        self,
        image: str,
        infra: Sequence[str] = (),
        disk_size: int | None = None,
        job_recovery: Mapping[str, Any] | None = None,
        autostop_minutes: int = DEFAULT_AUTOSTOP_MINUTES,
        env: Mapping[str, str] | None = None,
        secrets: Sequence[str] = (),
        python: str | None = None,
        worker_python: str = "python",
        inst_data: ConfigurableClassData | None = None,
    ):
        self._inst_data = inst_data
        self.image = check.str_param(image, "image")
        self.infra = list(infra)
        self.disk_size = disk_size
        self.job_recovery = {**DEFAULT_RECOVERY, **(job_recovery or {})}
        self.autostop_minutes = autostop_minutes
        self.env = dict(env or {})
        self.secrets = list(secrets)
        self.python = python
        self.worker_python = worker_python
        super().__init__()

    @property
    def inst_data(self):
        return self._inst_data

    @classmethod
    def config_type(cls):
        return {
            "image": Field(str, description="The worker image (SkyPilot runs it as image_id: docker:<image>)."),
            "infra": Field(
                Array(str),
                is_required=False,
                default_value=[],
                description="Allowed cloud[/region] entries in order of preference, e.g. [aws/us-east-1, runpod, "
                "vast]; those in the data's region are moved first. Empty: any cloud SkyPilot has credentials for.",
            ),
            "disk_size": Field(Noneable(Int), is_required=False, default_value=None, description="OS disk, GB."),
            "job_recovery": Field(
                Shape(
                    {"strategy": Field(str, is_required=False), "max_restarts_on_errors": Field(Int, is_required=False)}
                ),
                is_required=False,
                description="SkyPilot's job_recovery: EAGER_NEXT_REGION (default) or FAILOVER, and restarts on errors.",
            ),
            "autostop_minutes": Field(Int, is_required=False, default_value=DEFAULT_AUTOSTOP_MINUTES),
            "env": Field(Permissive(), is_required=False, default_value={}, description="Plain env of the task."),
            "secrets": Field(
                Array(str),
                is_required=False,
                default_value=[],
                description="Names of this host's environment variables sent as SkyPilot secrets (store keys, "
                "DAGSTER_PG_PASSWORD), never as plain env.",
            ),
            "python": Field(
                str, is_required=False, description="The python of the SkyPilot venv ($FT_SKYPILOT_PYTHON)."
            ),
            "worker_python": Field(
                str, is_required=False, default_value="python", description="The image's python with ft-assets."
            ),
        }

    @classmethod
    def from_config_value(cls, inst_data: ConfigurableClassData, config_value: Mapping[str, Any]):
        return cls(inst_data=inst_data, **config_value)

    def _call(self, verb: str, request: dict) -> Any:
        return sdk_venv.call(verb, request, python=self.python)

    def launch_run(self, context: LaunchRunContext) -> None:
        run = context.dagster_run
        try:
            planned = launch_plan(run)
            task = self.task_for(run, planned)
        except ValueError as exc:  # NoGpuFits, a settings error, a missing ref or secret: one line each
            return self._refuse(run, f"ft-assets cannot launch this run on SkyPilot: {' '.join(str(exc).split())}")
        try:
            job = self._call("sky.launch", {"task": task, "name": task["name"]})
        except sdk_venv.SdkError as exc:
            return self._refuse(run, f"SkyPilot refused the managed job: {exc}")
        job_id = job["job_id"]
        self._instance.add_run_tags(
            run.run_id,
            {
                JOB_TAG: str(job_id),
                NAME_TAG: task["name"],
                SPOT_TAG: str(task["resources"]["use_spot"]).lower(),
                WORKER_TAG: f"{SKY}{task['name']}-{job_id}",  # the cluster a managed job gets: <name>-<job id>
            },
        )
        resources = task["resources"]
        where = ", ".join(e["infra"] for e in resources.get("ordered", [])) or "any enabled cloud"
        self._instance.report_engine_event(
            f"SkyPilot managed job {job_id} ({task['name']}) submitted: {resources['accelerators']} x "
            f"{task['num_nodes']} node(s), {'spot' if resources['use_spot'] else 'on-demand'}, on {where} "
            f"(plan: {planned.plan.describe()}, ${planned.plan.usd_per_hour:.2f}/h)",
            run,
            cls=self.__class__,
        )

    def task_for(self, run: DagsterRun, planned) -> dict[str, Any]:
        """The managed job's task for ``run`` with its plan ``planned`` (``control.assets.PlannedRun``)."""
        plan = planned.plan
        if plan.tier is None:
            raise ValueError(f"the plan of run {run.run_id} rents no GPU (purpose {plan.purpose})")
        if plan.nodes > 1:  # SkyPilot would run the Dagster command on every node: one run, several workers
            raise ValueError(
                f"the run is planned on {plan.nodes} nodes ({plan.describe()}); the SkyPilot pool launches one node "
                "a run: set num_nodes 1 (up to 8 GPUs on one node), or use the Kubernetes pool for multi-node runs"
            )
        offering = launch_cost_model(run).offering(plan.tier)
        if not offering.accelerator:
            raise ValueError(
                f"offering {plan.tier} has no accelerator (SkyPilot's name for {offering.gpu}): add "
                f"`accelerator:` to it in the cost model to rent it through SkyPilot"
            )
        args = ExecuteRunArgs(run.job_code_origin, run.run_id, self._instance.get_ref(), set_exit_code_on_failure=True)
        command = (
            f"{shlex.quote(self.worker_python)} -m ft_assets.providers.sky_attempt {shlex.quote(serialize_value(args))}"
        )
        envs = {**self.env, "FT_GPU_TIER": plan.tier, "FT_RENTAL_MODE": plan.mode}
        return task_config(
            name=f"{NAME_PREFIX}{run.run_id[:8]}",
            command=command,
            image=self.image,
            accelerator=offering.accelerator,
            gpus_per_node=plan.gpus // plan.nodes,
            nodes=plan.nodes,
            spot=plan.mode == "spot",
            infra=ordered_infra(self.infra, planned.region),
            disk_size=self.disk_size,
            job_recovery=self.job_recovery,
            autostop_minutes=self.autostop_minutes,
            envs={k: str(v) for k, v in envs.items()},
            secrets=secret_values(self.secrets),
        )

    def _refuse(self, run: DagsterRun, message: str) -> None:
        self._instance.report_engine_event(message, run, cls=self.__class__)
        self._instance.report_run_failed(run, message)

    @property
    def supports_check_run_worker_health(self) -> bool:
        return True

    def check_run_worker_health(self, run: DagsterRun) -> CheckRunHealthResult:
        job_id = run.tags.get(JOB_TAG)
        if job_id is None:
            return CheckRunHealthResult(WorkerStatus.UNKNOWN, "no SkyPilot managed job yet")
        try:
            records = self._call("sky.queue", {"job_ids": [int(job_id)], "use_spot": run.tags.get(SPOT_TAG) == "true"})
        except sdk_venv.SdkError as exc:
            return CheckRunHealthResult(WorkerStatus.UNKNOWN, f"SkyPilot's queue did not answer: {exc}")
        if not records:
            return CheckRunHealthResult(WorkerStatus.FAILED, f"managed job {job_id} is not in SkyPilot's queue")
        record = records[0]
        self._record(run, record)
        status = record.get("status")
        if status in RUNNING:
            return CheckRunHealthResult(WorkerStatus.RUNNING, f"managed job {job_id} is {status}")
        if status == "SUCCEEDED":
            return CheckRunHealthResult(WorkerStatus.SUCCESS, f"managed job {job_id} succeeded")
        reason = record.get("failure_reason") or record.get("details") or ""
        return CheckRunHealthResult(
            WorkerStatus.FAILED, f"managed job {job_id} is {status}" + (f": {reason}" if reason else "")
        )

    def _record(self, run: DagsterRun, record: Mapping[str, Any]) -> None:
        """The job's placement, recoveries and attempts as run tags."""
        attempts = update_attempts(json.loads(run.tags.get(ATTEMPTS_TAG, "[]")), record, time.time())
        tags = {RECOVERIES_TAG: str(record.get("recovery_count") or 0), ATTEMPTS_TAG: json.dumps(attempts)}
        if record.get("cloud"):
            tags.update({CLOUD_TAG: str(record["cloud"]), REGION_TAG: str(record.get("region") or "")})
        if record.get("cluster_resources"):
            tags[INSTANCE_TAG] = str(record["cluster_resources"])
        if record.get("current_cluster_name"):
            tags[WORKER_TAG] = f"{SKY}{record['current_cluster_name']}"
        changed = {k: v for k, v in tags.items() if run.tags.get(k) != v}
        if changed:
            self._instance.add_run_tags(run.run_id, changed)

    def terminate(self, run_id: str) -> bool:
        run = self._instance.get_run_by_id(run_id)
        if run is None or run.is_finished or JOB_TAG not in run.tags:
            return False
        self._instance.report_run_canceling(run)
        try:
            self._call("sky.cancel", {"job_ids": [int(run.tags[JOB_TAG])]})
        except sdk_venv.SdkError as exc:
            self._instance.report_engine_event(f"sky.jobs.cancel failed: {exc}", run, cls=self.__class__)
            return False
        self._instance.report_run_canceled(run, f"SkyPilot managed job {run.tags[JOB_TAG]} cancelled (sky.jobs.cancel)")
        return True


# --- the plan at launch --------------------------------------------------------------------------


def launch_plan(run: DagsterRun):
    """The run's plan, made before it starts by training_plan's own function, from the store's references of its
    partition's shards and base model; a ValueError (``NoGpuFits`` too) says why there is none."""
    from ft_assets.control.assets import PlanConfig, plan_run
    from ft_assets.refs import read_ref
    from ft_assets.storage import ObjectNotFound, open_store
    from ft_assets.training.settings import run_training_config

    partition = run.tags.get("dagster/partition")
    if not partition:
        raise ValueError(f"run {run.run_id} has no dagster/partition tag: a training run is of one dataset version")
    store = open_store(_store_url(run.run_config))
    try:
        shards, base = read_ref(store, partition, "tokenized_shards"), read_ref(store, partition, "base_model")
    except ObjectNotFound as exc:
        raise ValueError(f"{partition}: {exc}; run the data plane first") from None
    ops = run.run_config.get("ops") or {}
    config = PlanConfig(**((ops.get("training_plan") or {}).get("config") or {}))
    return plan_run(run_training_config(run.run_config), config, shards, base, cuda=True)


def launch_cost_model(run: DagsterRun):
    """The cost model the run's plan was priced with (training_plan's cost_model_path, else $FT_COST_MODEL)."""
    from ft_assets.control.cost_model import load_cost_model

    ops = run.run_config.get("ops") or {}
    path = ((ops.get("training_plan") or {}).get("config") or {}).get("cost_model_path")
    return load_cost_model(path or os.environ.get("FT_COST_MODEL") or None)


def _store_url(run_config: Mapping[str, Any]) -> str | None:
    return (((run_config.get("resources") or {}).get("store") or {}).get("config") or {}).get("url") or None
