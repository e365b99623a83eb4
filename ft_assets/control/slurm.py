"""``SlurmRunLauncher``: the gpu pool on a Slurm cluster, each training run one ``sbatch`` job.

What it submits (``batch_script``): the same ``dagster api execute_run`` command DefaultRunLauncher,
EcsRunLauncher and K8sRunLauncher run (``ExecuteRunArgs.get_command_args``), in a venv on the cluster
(``setup`` lines: ``module load``, ``source .../bin/activate``) or inside the worker image: Pyxis
(``srun --container-image``) or Apptainer (``apptainer exec --nv``). ``sbatch`` runs on this host, or
on a login node through ``ssh`` (key auth, ``BatchMode``), where most HPC users are allowed to submit.
The job asks for the run's GPUs (``--gres=gpu:N`` per node, ``--nodes=M`` for ``num_nodes`` M, the
other nodes started by the worker as an ``srun`` step: ``ft_assets.providers.slurm_job``), with the
partition, account, QOS and time limit of the config or of the run's tags ``ft/slurm-partition``,
``ft/slurm-account``, ``ft/slurm-qos``, ``ft/slurm-time``. Tags on the run: the job id, the output file
(also an engine event whose metadata is its path); the worker adds the node list when it starts.

Preemption and time limits become checkpoints. ``--requeue`` lets Slurm put a preempted job (or one on
a failed node, or one ``scontrol requeue`` names) back in the queue, and ``--signal=B:TERM@<grace>``
warns the batch shell ``grace`` seconds before the time limit. The script's trap records what Slurm
is doing (``scontrol show job -o``) and passes SIGTERM to the worker's whole process group, so the
recipe checkpoints at the next step boundary whichever process trains. Then:

- **requeue -> resume of the same Dagster run.** The requeued job is the same job (id, queue
  position, output file, appended), so it continues the same run: the worker leaves the run
  unfinished (an interrupt Dagster does not count as a failure when the run will be resumed) and the
  requeued job runs ``dagster api resume_run``, whose training step resumes from the newest complete
  checkpoint. A fail + retry instead would submit a second job at the back of the queue while Slurm
  starts the requeued one anyway: two jobs for one run, or one allocation wasted on a worker that
  finds its run finished. Dagster needs ``run_monitoring.max_resume_run_attempts`` >= 1 for an
  interrupted run to stay unfinished; ``launch_run`` refuses to submit without it.
- **time limit -> fail + Dagster run retry.** Slurm never requeues a job that reached its limit; the
  run fails as ``ft/preempted`` and ``run_retries`` submits its retry, a new job, which resumes.
- **scancel -> the run fails with that reason and is not retried** (someone decided to stop it).

Worker health (run monitoring, ``check_run_worker_health``) comes from ``squeue --states=all`` (the
controller keeps a finished job for ``MinJobAge``, 300 s by default) and, for a job it has forgotten,
``sacct`` (needs slurmdbd). A job that ended while its run is unfinished is a dead worker: monitoring
resumes the run in a new job (``resume_run``) while attempts remain, then fails it, and the run retry
takes over. ``terminate`` is ``scancel``. A queued job is a STARTING run: give
``run_monitoring.start_timeout_seconds`` room for the cluster's queue wait.

Verified on a one-node Slurm 22.05 with two fake GPUs (``ft_assets_tests/test_slurm.py``), venv path,
local and over ssh; the container lines are checked as script text only, and multi-node only as the
commands it builds. A multi-node run starts its other nodes with ``srun`` from the worker, so inside an
image that has no Slurm client it needs the venv path.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dagster import Array, Bool, Enum, EnumValue, Field, Int, MetadataValue, Noneable, Permissive, Shape, StringSource
from dagster import _check as check
from dagster._cli.api import ExecuteRunArgs
from dagster._core.events import EngineEventData
from dagster._core.launcher import LaunchRunContext, ResumeRunContext, RunLauncher
from dagster._core.launcher.base import CheckRunHealthResult, WorkerStatus
from dagster._core.storage.dagster_run import DagsterRun, DagsterRunStatus
from dagster._core.storage.tags import MAX_RETRIES_TAG
from dagster._grpc.types import ResumeRunArgs
from dagster._serdes import ConfigurableClass, ConfigurableClassData

from ft_assets.control.cost_model import load_cost_model
from ft_assets.control.launcher import gpus_per_node
from ft_assets.providers.slurm_cli import (
    COMMAND_TIMEOUT_S,
    DEFAULT_GRACE_S,
    JOB_NAME_PREFIX,
    JobRequest,
    JobState,
    SlurmCli,
    SlurmError,
)
from ft_assets.providers.slurm_job import JOB_TAG, OUTPUT_TAG, SIGNAL_FILE_ENV, STARTED_ENV
from ft_assets.targets.ssh import SshClient
from ft_assets.training.settings import run_training_config

PARTITION_TAG, ACCOUNT_TAG, QOS_TAG, TIME_TAG = (
    "ft/slurm-partition",
    "ft/slurm-account",
    "ft/slurm-qos",
    "ft/slurm-time",
)
# --- what is submitted ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Container:
    """The worker image, run by the cluster's container runtime: Pyxis/enroot or Apptainer."""

    runtime: str  # "pyxis" | "apptainer"
    image: str  # pyxis: an enroot URI or .sqsh file; apptainer: a .sif file or docker:// URI
    mounts: tuple[str, ...] = ()  # "src:dst" (or one path), besides the work dir, which is always mounted

    def wrap(self, command: Sequence[str], work_dir: str) -> list[str]:
        mounts = [f"{work_dir}:{work_dir}", *self.mounts]
        if self.runtime == "pyxis":  # a job step in the image; srun passes the trap's SIGTERM on to it
            return ["srun", "--ntasks=1", f"--container-image={self.image}", f"--container-mounts={','.join(mounts)}",
                    "--no-container-mount-home", *command]  # fmt: skip
        if self.runtime == "apptainer":
            return ["apptainer", "exec", "--nv", "--bind", ",".join(mounts), self.image, *command]
        raise ValueError(f"container.runtime {self.runtime!r}: use 'pyxis' (srun --container-image) or 'apptainer'")


def batch_script(
    request: JobRequest,
    execute: Sequence[str],
    resume: Sequence[str],
    setup: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    container: Container | None = None,
) -> str:
    """The sbatch script: options, environment, setup, then the run worker with SIGTERM passed on to it.

    ``execute`` runs on the job's first start, ``resume`` when Slurm has requeued it (``SLURM_RESTART_COUNT``).
    The worker runs in a process group of its own (``setsid``); the trap writes ``scontrol show job -o`` to
    ``$FT_SLURM_SIGNAL_FILE`` (the worker reads why it was stopped there, ``slurm_job.stop_reason``) and sends
    SIGTERM to that whole group, as slurmd does on a cancel, since ``--signal=B:`` reaches the batch shell only.
    """
    if container is not None:
        execute, resume = container.wrap(execute, request.work_dir), container.wrap(resume, request.work_dir)
    lines = ["#!/bin/bash", *(f"#SBATCH {option}" for option in request.options()),
             "# ft-assets run worker (ft_assets.control.slurm.batch_script)", "set -u",
             f"export {STARTED_ENV}=$(date +%s)",  # the allocation bills from here
             f'export {SIGNAL_FILE_ENV}={shlex.quote(request.work_dir)}/{request.name}-"$SLURM_JOB_ID".signal']  # fmt: skip
    lines += [f"export {key}={shlex.quote(value)}" for key, value in (env or {}).items()]
    lines += list(setup)
    lines += [
        'if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then',
        '  echo "ft-assets: Slurm requeued job $SLURM_JOB_ID (restart $SLURM_RESTART_COUNT): resuming the run"',
        f"  set -- {shlex.join(resume)}",
        "else",
        f"  set -- {shlex.join(execute)}",
        "fi",
        f'rm -f "${SIGNAL_FILE_ENV}"',
        'setsid "$@" &',
        "worker=$!",
        f'forward() {{ scontrol show job -o "$SLURM_JOB_ID" > "${SIGNAL_FILE_ENV}" 2>&1; kill -TERM -- "-$worker" 2>/dev/null; }}',
        "trap forward TERM",
        "while :; do",
        '  wait "$worker"; code=$?',  # a trapped signal ends `wait` early: wait again while the worker lives
        '  kill -0 "$worker" 2>/dev/null || break',
        "done",
        'exit "$code"',
    ]
    return "\n".join(lines) + "\n"


def worker_health(job: JobState | None, run_status: DagsterRunStatus) -> CheckRunHealthResult:
    """Run monitoring's view of a run from its job: alive while the job is (queued, running or requeued)."""
    if job is None:
        return CheckRunHealthResult(WorkerStatus.UNKNOWN, "Slurm knows no such job (squeue --states=all, sacct)")
    if job.active:
        return CheckRunHealthResult(WorkerStatus.RUNNING)
    if run_status in (DagsterRunStatus.STARTED, DagsterRunStatus.CANCELING):
        return CheckRunHealthResult(WorkerStatus.FAILED, f"{job.describe()} while its run was unfinished")
    if job.state == "COMPLETED":
        return CheckRunHealthResult(WorkerStatus.SUCCESS)
    return CheckRunHealthResult(WorkerStatus.FAILED, job.describe())


# --- the launcher ----------------------------------------------------------------------------------


def check_billing(env: Mapping[str, str]) -> None:
    """The pool's ``FT_GPU_TIER`` must name an offering of the cost model (``FT_COST_MODEL``'s, else the shipped one):
    refused in one line when the instance loads, not after the paid part as the cost asset's KeyError."""
    tier = env.get("FT_GPU_TIER")
    if not tier:
        return
    try:
        load_cost_model(os.environ.get("FT_COST_MODEL") or None).offering(tier)
    except KeyError as exc:
        raise check.CheckError(f"SlurmRunLauncher env.FT_GPU_TIER: {exc.args[0]}") from None


def _entry_point(args: Sequence[str], python: str | None) -> list[str]:
    """The run worker's command with the cluster's Python in place of the code location's (``python``)."""
    if not python:
        return list(args)
    return [python, "-m", "dagster", *args[list(args).index("api") :]]


class SlurmRunLauncher(RunLauncher, ConfigurableClass):
    """Launches each run as a Slurm batch job (module docstring); for the gpu pool of ``PoolRunLauncher``."""

    def __init__(
        self,
        work_dir: str,
        ssh: Mapping[str, Any] | None = None,
        partition: str | None = None,
        account: str | None = None,
        qos: str | None = None,
        time_limit: str | None = None,
        signal_grace_seconds: int = DEFAULT_GRACE_S,
        requeue: bool = True,
        python: str | None = None,
        setup: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        container: Mapping[str, Any] | None = None,
        sbatch_options: Sequence[str] = (),
        command_timeout_seconds: int = COMMAND_TIMEOUT_S,
        inst_data: ConfigurableClassData | None = None,
    ):
        self._inst_data = inst_data
        self.work_dir = work_dir.rstrip("/")
        self.defaults = dict(partition=partition, account=account, qos=qos, time_limit=time_limit)
        self.signal_grace_seconds, self.requeue, self.python = signal_grace_seconds, requeue, python
        self.setup, self.env, self.sbatch_options = tuple(setup), dict(env or {}), tuple(sbatch_options)
        check_billing(self.env)
        self.container = (
            Container(container["runtime"], container["image"], tuple(container.get("mounts") or ()))
            if container
            else None
        )
        if self.container is not None:
            self.container.wrap([], self.work_dir)  # a wrong runtime fails when the instance loads, not at a launch
        target = SshClient(ssh["host"], ssh.get("user"), ssh.get("port"), ssh.get("identity_file"),
                           tuple(ssh.get("options") or ())) if ssh else None  # fmt: skip
        self.cli = SlurmCli(target, command_timeout_seconds)
        super().__init__()

    @property
    def inst_data(self):
        return self._inst_data

    @classmethod
    def config_type(cls):
        text = lambda description: Field(Noneable(StringSource), is_required=False, description=description)  # noqa: E731
        return {
            "work_dir": Field(StringSource, description="Folder on the cluster's shared filesystem for the jobs' output files."),
            "ssh": Field(Shape({
                "host": Field(str, description="Login node to run sbatch/squeue/sacct/scancel on."),
                "user": Field(Noneable(str), is_required=False),
                "port": Field(Noneable(Int), is_required=False),
                "identity_file": Field(Noneable(StringSource), is_required=False, description="Private key (ssh -i)."),
                "options": Field(Array(str), is_required=False, description="More ssh -o options."),
            }), is_required=False, description="Submit through ssh to a login node; absent: Slurm's commands run here."),
            "partition": text("sbatch --partition; per run: tag ft/slurm-partition."),
            "account": text("sbatch --account; per run: tag ft/slurm-account."),
            "qos": text("sbatch --qos; per run: tag ft/slurm-qos."),
            "time_limit": text("sbatch --time ([days-]hours:minutes:seconds); per run: tag ft/slurm-time."),
            "signal_grace_seconds": Field(Int, is_required=False, default_value=DEFAULT_GRACE_S,
                                          description="SIGTERM this long before the time limit (--signal=B:TERM@N)."),
            "requeue": Field(Bool, is_required=False, default_value=True,
                             description="--requeue: a preempted job returns to the queue and resumes its run."),
            "python": text("The cluster's Python of the ft-assets venv or image; default: the code location's."),
            "setup": Field(Array(str), is_required=False, description="Shell lines before the worker (module load, source activate)."),
            "env": Field(Permissive(), is_required=False, description="Environment of the job (not secrets: the script is readable)."),
            "container": Field(Shape({
                "runtime": Field(Enum("SlurmContainerRuntime", [EnumValue("pyxis"), EnumValue("apptainer")])),
                "image": Field(str, description="pyxis: enroot image or .sqsh; apptainer: .sif or docker:// URI."),
                "mounts": Field(Array(str), is_required=False, description="More src:dst mounts (the work dir always is)."),
            }), is_required=False, description="Run the worker inside the ft-assets image; absent: in the setup's venv."),
            "sbatch_options": Field(Array(str), is_required=False, description="More sbatch options, e.g. --mem=64G."),
            "command_timeout_seconds": Field(Int, is_required=False, default_value=COMMAND_TIMEOUT_S),
        }  # fmt: skip

    @classmethod
    def from_config_value(cls, inst_data: ConfigurableClassData, config_value: Mapping[str, Any]):
        return cls(inst_data=inst_data, **config_value)

    def request(self, run: DagsterRun) -> JobRequest:
        """The job of ``run``: the GPUs its training settings ask for, the config's options, the run's tags over them."""
        tags = run.tags
        chosen = {key: tags.get(tag) or self.defaults[key] for key, tag in
                  (("partition", PARTITION_TAG), ("account", ACCOUNT_TAG), ("qos", QOS_TAG), ("time_limit", TIME_TAG))}  # fmt: skip
        return JobRequest(
            name=f"{JOB_NAME_PREFIX}{run.run_id}", work_dir=self.work_dir, gpus_per_node=gpus_per_node(run.run_config),
            nodes=run_training_config(run.run_config).num_nodes, signal_grace_s=self.signal_grace_seconds, requeue=self.requeue,
            extra=self.sbatch_options, **chosen,
        )  # fmt: skip

    def _commands(self, run: DagsterRun) -> tuple[list[str], list[str]]:
        origin = check.not_none(run.job_code_origin)
        ref = self._instance.get_ref()
        execute = ExecuteRunArgs(job_origin=origin, run_id=run.run_id, instance_ref=ref, set_exit_code_on_failure=True)
        resume = ResumeRunArgs(job_origin=origin, run_id=run.run_id, instance_ref=ref, set_exit_code_on_failure=True)
        return (_entry_point(execute.get_command_args(), self.python),
                _entry_point(resume.get_command_args(), self.python))  # fmt: skip

    def _submit(self, run: DagsterRun, resuming: bool) -> None:
        request = self.request(run)
        execute, resume = self._commands(run)
        script = batch_script(request, resume if resuming else execute, resume, self.setup, self.env, self.container)
        try:
            job_id = self.cli.submit(script, self.work_dir)
        except SlurmError as exc:
            self.refuse(run, f"Slurm refused the job of run {run.run_id}: {exc}")
            return
        output = request.output_of(job_id)
        self._instance.add_run_tags(run.run_id, {JOB_TAG: job_id, OUTPUT_TAG: output})
        asked = " ".join(option for option in request.options() if option.startswith(("--gres", "--nodes", "--partition",
                                                                                       "--account", "--qos", "--time")))  # fmt: skip
        self._instance.report_engine_event(
            f"Slurm job {job_id} submitted{' to resume the run' if resuming else ''} ({asked}); output: {output}",
            run,
            EngineEventData({"Slurm job id": job_id, "output file": MetadataValue.path(output), "sbatch": asked}),
            cls=self.__class__,
        )

    def refuse(self, run: DagsterRun, reason: str) -> None:
        """End ``run`` with ``reason`` (one line) and no retry: submitting it again would be refused again."""
        self._instance.add_run_tags(run.run_id, {MAX_RETRIES_TAG: "0"})
        self._instance.report_engine_event(reason, run, cls=self.__class__)
        self._instance.report_run_failed(self._instance.get_run_by_id(run.run_id), reason)

    def launch_run(self, context: LaunchRunContext) -> None:
        run = context.dagster_run
        if self.requeue and not (
            self._instance.run_monitoring_enabled and self._instance.run_monitoring_max_resume_run_attempts
        ):
            self.refuse(run, "SlurmRunLauncher with requeue: true needs run_monitoring (enabled: true, "
                             "max_resume_run_attempts: 1 or more) in dagster.yaml, so a requeued job can resume its run")  # fmt: skip
            return
        self._submit(run, resuming=False)

    @property
    def supports_resume_run(self) -> bool:
        return True

    def resume_run(self, context: ResumeRunContext) -> None:
        """A new job for a run whose job died unfinished (run monitoring); a cancelled job's run fails instead."""
        run = context.dagster_run
        job = self.cli.job(run.tags[JOB_TAG]) if JOB_TAG in run.tags else None
        if job is not None and job.state == "CANCELLED":
            self.refuse(run, f"{job.describe()}; a cancelled run is not resumed")
            return
        self._submit(run, resuming=True)

    def terminate(self, run_id: str) -> bool:
        run = self._instance.get_run_by_id(run_id)
        if not run or run.is_finished or JOB_TAG not in run.tags:
            return False
        self._instance.report_run_canceling(run)
        job_id = run.tags[JOB_TAG]
        before = self.cli.job(job_id)
        self.cli.cancel(job_id)
        self._instance.report_engine_event(f"scancel {job_id}", run, cls=self.__class__)
        if before is not None and not before.started:  # no worker ever ran: nothing else will end the run
            self._instance.report_run_canceled(run, f"Slurm job {job_id} was cancelled while queued")
        return True

    @property
    def supports_check_run_worker_health(self) -> bool:
        return True

    def check_run_worker_health(self, run: DagsterRun) -> CheckRunHealthResult:
        if JOB_TAG not in run.tags:
            return CheckRunHealthResult(WorkerStatus.UNKNOWN, "the run has no Slurm job (tag ft/slurm-job-id)")
        try:
            job = self.cli.job(run.tags[JOB_TAG])
        except SlurmError as exc:
            return CheckRunHealthResult(WorkerStatus.UNKNOWN, str(exc))
        return worker_health(job, run.status)

    def get_run_worker_debug_info(self, run: DagsterRun, include_container_logs: bool | None = True) -> str | None:
        if JOB_TAG not in run.tags:
            return None
        job = self.cli.job(run.tags[JOB_TAG])
        said = job.describe() if job else f"Slurm job {run.tags[JOB_TAG]}: unknown to squeue and sacct"
        output = run.tags.get(OUTPUT_TAG)
        tail = self.cli.tail(output) if (output and include_container_logs) else ""
        return f"{said}; output: {output}" + (f"\n{tail}" if tail else "")
