"""The Slurm GPU pool: SlurmRunLauncher on a real Slurm (one node, two fake GPUs) and the production instance.

Unit tier (no cluster): the batch script's options and container lines, the squeue/sacct parsing, worker
health, why SIGTERM came (``slurm_job.stop_reason``, on ``scontrol`` lines captured from Slurm 22.05),
the example config against the launcher's schema.

Integration: one Slurm (``slurmcluster.py``), one PostgreSQL database, one data plane and one
``dagster-daemon`` (queue, run retries, run monitoring) shared by the module; the training settings
differ per test, so each test's run has a store prefix of its own. Through ``ft-assets run`` on the
production profile with deploy/launchers/slurm-gpu.yaml's gpu pool (local sbatch, the venv):
(a) the whole pipeline: training is a Slurm job, data and delivery stay on the cpu pool;
(b) ``scontrol requeue`` mid-training: the requeued job resumes the same run from its newest
checkpoint and ends with the adapter an uninterrupted run of the same seed trains;
(c) a time limit shorter than the run: the job checkpoints on ``--signal=B:TERM``, the run retry resumes;
(d) ``scancel`` of a running job, and a job Slurm refuses (3 GPUs on a 2-GPU node): one-line reasons,
no retry, the store intact; (e) the ssh path, against an sshd on loopback.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import dagster as dg
import pytest
import yaml
from dagster._check import CheckError
from dagster._config import process_config
from dagster._config.field_utils import convert_potential_field
from dagster._core.launcher.base import LaunchRunContext, WorkerStatus
from dagster._core.test_utils import create_run_for_test
from safetensors.torch import load_file

from ft_assets.cli import main
from ft_assets.cli.launch import QUEUE_DAEMON, PlaneLauncher
from ft_assets.cli.output import PlaneFailed
from ft_assets.cli.planes import run_plane
from ft_assets.control.launcher import POOL_TAG, PoolRunLauncher
from ft_assets.control.slurm import Container, SlurmRunLauncher, batch_script, worker_health
from ft_assets.definitions import defs
from ft_assets.manifests import fetch_artifact, read_manifest, verify_artifact
from ft_assets.providers import environment, slurm_job
from ft_assets.targets import TARGET_TAG
from ft_assets.providers.slurm_cli import (
    JobRequest,
    JobState,
    SlurmError,
    parse_job_id,
    parse_sacct,
    parse_squeue,
)
from ft_assets.targets.ssh import SshClient
from ft_assets.refs import read_ref
from ft_assets.storage import LocalStore
from ft_assets.training.config import TrainingConfig
from ft_assets.training.launch import WorkerJob
from ft_assets.training.recipe import train
from ft_assets_tests.support import assert_same_weights, dagster_daemon, run_cli, run_config

pytest_plugins = ["ft_assets_tests.pg", "ft_assets_tests.slurmcluster"]

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "deploy/launchers/slurm-gpu.yaml"
SAMPLE = REPO / "samples" / "toolcalls" / "part-000.jsonl"
SAMPLE_LINES = 300
VERSION = "slurm1"
DAEMON_TIMEOUT_S = 180.0
RUN_TIMEOUT_S = 300.0
DagsterRunStatus = dg.DagsterRunStatus


# --- unit tier: the batch script ---------------------------------------------------------------------

SCRIPT_CASES = [  # (request, options that must be there, options that must not)
    (JobRequest("ft-assets-r1", "/w"), ["--gres=gpu:1", "--nodes=1", "--requeue", "--signal=B:TERM@120",
     "--output=/w/ft-assets-r1-%j.out", "--open-mode=append", "--chdir=/w"], ["--partition", "--time", "--qos"]),
    (JobRequest("n", "/w", gpus_per_node=4, nodes=2, partition="a100", account="proj", qos="high", time_limit="1-00:00:00",
     signal_grace_s=300), ["--gres=gpu:4", "--nodes=2", "--ntasks-per-node=1", "--partition=a100", "--account=proj",
     "--qos=high", "--time=1-00:00:00", "--signal=B:TERM@300"], []),
    (JobRequest("n", "/w", requeue=False, signal_grace_s=0, extra=("--mem=64G",)), ["--no-requeue", "--mem=64G"],
     ["--requeue", "--signal"]),
]  # fmt: skip


@pytest.mark.parametrize(("request_", "present", "absent"), SCRIPT_CASES)
def test_batch_script_asks_for_the_runs_resources(request_, present, absent):
    script = batch_script(request_, ["python", "-m", "dagster", "api", "execute_run", '{"a": 1}'], ["resume"])
    options = [line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH ")]
    for option in present:
        assert option in options, (option, options)
    for option in absent:
        assert not any(o.startswith(option) for o in options), (option, options)
    assert script.startswith("#!/bin/bash\n") and """set -- python -m dagster api execute_run '{"a": 1}'""" in script


CONTAINER_CASES = [
    (Container("pyxis", "/img/ft.sqsh", ("/data:/data",)),
     "srun --ntasks=1 --container-image=/img/ft.sqsh --container-mounts=/w:/w,/data:/data --no-container-mount-home python -m x"),
    (Container("apptainer", "docker://ghcr.io/x/ft:1"), "apptainer exec --nv --bind /w:/w docker://ghcr.io/x/ft:1 python -m x"),
]  # fmt: skip


@pytest.mark.parametrize(("container", "command"), CONTAINER_CASES)
def test_the_worker_runs_in_the_image_through_the_clusters_runtime(container, command):
    script = batch_script(JobRequest("n", "/w"), ["python", "-m", "x"], ["python", "-m", "y"], container=container)
    assert f"  set -- {command}" in script
    with pytest.raises(ValueError, match="use 'pyxis'"):
        Container("docker", "x").wrap(["a"], "/w")


SQUEUE_CASES = [  # one squeue line -> (state, started, active)
    ("41|PENDING|Priority|(null)|2026-12-02T10:00:00|2026-12-02T11:00:00", ("PENDING", False, True)),
    ("41|PENDING|BeginTime|vm|2026-12-01T22:49:26|N/A", ("PENDING", False, True)),
    ("42|RUNNING|None|vm|2026-12-01T22:47:24|Unknown", ("RUNNING", True, True)),
    ("43|COMPLETING|None|vm|2026-12-01T22:50:56|2026-12-01T22:51:03", ("COMPLETING", True, True)),
    ("44|CANCELLED|None|vm|2026-12-01T22:53:58|2026-12-01T22:54:01", ("CANCELLED", True, False)),
    ("45|TIMEOUT|TimeLimit|vm|2026-12-01T22:00:00|2026-12-01T22:02:00", ("TIMEOUT", True, False)),
    ("46|FAILED|NonZeroExitCode|vm|2026-12-01T22:51:06|2026-12-01T22:51:12", ("FAILED", True, False)),
    ("47|NODE_FAIL|None|gpu01|2026-12-01T22:00:00|2026-12-01T23:00:00", ("NODE_FAIL", True, False)),
]


@pytest.mark.parametrize(("line", "expected"), SQUEUE_CASES)
def test_squeue_lines_become_job_states(line, expected):
    [job] = parse_squeue(line + "\n")
    assert (job.state, job.started, job.active) == expected
    assert job.job_id == line.split("|")[0] and job.source == "squeue"


SACCT_CASES = [
    ("50|CANCELLED by 0|None|vm|2026-12-01T22:53:58|2026-12-01T22:54:01", ("CANCELLED", "was cancelled (scancel)")),
    ("51|TIMEOUT|None|vm|2026-12-01T22:00:00|2026-12-01T22:02:00", ("TIMEOUT", "reached its time limit")),
    ("52|OUT_OF_MEMORY|None|gpu02|2026-12-01T22:00:00|2026-12-01T22:00:30", ("OUT_OF_MEMORY", "ran out of memory")),
    ("53|RUNNING|None|gpu02|2026-12-01T22:00:00|Unknown", ("RUNNING", "is RUNNING")),
]


@pytest.mark.parametrize(("line", "expected"), SACCT_CASES)
def test_sacct_lines_become_job_states(line, expected):
    [job] = parse_sacct(line)
    state, said = expected
    assert job.state == state and said in job.describe() and job.source == "sacct"
    assert "\n" not in job.describe()


@pytest.mark.parametrize("garbage", ["42|RUNNING", "a|b|c|d|e|f|g"])
def test_unreadable_squeue_and_sacct_lines_are_refused_with_the_line(garbage):
    for parse in (parse_squeue, parse_sacct):
        with pytest.raises(SlurmError, match="expected"):
            parse(garbage)


@pytest.mark.parametrize(("stdout", "job_id"), [("42\n", "42"), ("42;fttest\n", "42"), ("sbatch: warn\n43\n", "43")])
def test_sbatch_parsable_output_gives_the_job_id(stdout, job_id):
    assert parse_job_id(stdout) == job_id


def test_sbatch_output_without_a_job_id_is_refused():
    with pytest.raises(SlurmError, match="not a job id"):
        parse_job_id("sbatch: error: Batch job submission failed\n")


HEALTH_CASES = [  # (job state or None, run status) -> worker status
    (None, DagsterRunStatus.STARTED, WorkerStatus.UNKNOWN),
    ("PENDING", DagsterRunStatus.STARTING, WorkerStatus.RUNNING),
    ("RUNNING", DagsterRunStatus.STARTED, WorkerStatus.RUNNING),
    ("REQUEUED", DagsterRunStatus.STARTED, WorkerStatus.RUNNING),
    ("COMPLETING", DagsterRunStatus.STARTED, WorkerStatus.RUNNING),
    ("COMPLETED", DagsterRunStatus.STARTED, WorkerStatus.FAILED),  # the worker ended, the run did not
    ("COMPLETED", DagsterRunStatus.SUCCESS, WorkerStatus.SUCCESS),
    ("TIMEOUT", DagsterRunStatus.STARTED, WorkerStatus.FAILED),
    ("NODE_FAIL", DagsterRunStatus.STARTED, WorkerStatus.FAILED),
    ("CANCELLED", DagsterRunStatus.FAILURE, WorkerStatus.FAILED),
]


@pytest.mark.parametrize(("state", "run_status", "expected"), HEALTH_CASES)
def test_worker_health_comes_from_the_jobs_state(state, run_status, expected):
    start = datetime(2026, 12, 1, 22, tzinfo=timezone.utc)
    job = None if state is None else JobState("42", state, "None", "vm", start, start + timedelta(minutes=3))
    health = worker_health(job, run_status)
    assert health.status == expected
    if expected == WorkerStatus.FAILED:
        assert health.msg.startswith("Slurm job 42 ") and "\n" not in health.msg


def test_a_queued_job_costs_nothing_and_a_running_one_bills_from_its_start():
    start, now = datetime(2026, 12, 1, 22, tzinfo=timezone.utc), datetime(2026, 12, 1, 23, tzinfo=timezone.utc)
    assert JobState("1", "PENDING").billed_seconds(now) == 0.0
    assert JobState("1", "RUNNING", start=start).billed_seconds(now) == 3600.0
    assert JobState("1", "COMPLETED", start=start, end=start + timedelta(minutes=5)).billed_seconds(now) == 300.0
    env = {slurm_job.STARTED_ENV: "1000"}
    assert slurm_job.billed_since(500.0, env, wall_now=1090.0) == 410.0  # 90 s of the allocation before this process
    assert slurm_job.billed_since(500.0, {}) == 500.0
    in_job = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "gpu01", "FT_GPU_TIER": "a100-80gb"}
    job, elsewhere = environment.current(in_job), environment.current({"FT_GPU_TIER": "a100-80gb"})
    assert type(job) is environment.SlurmJob and type(elsewhere) is environment.Machine
    assert job.billing() == {"FT_GPU_TIER": "a100-80gb", "FT_RENTAL_MODE": "slurm"}
    assert environment.current({**in_job, "FT_RENTAL_MODE": "on_demand"}).billing()["FT_RENTAL_MODE"] == "on_demand"
    assert elsewhere.billing() == {"FT_GPU_TIER": "a100-80gb"} and environment.current({}).billing() == {}
    assert elsewhere.billed_since(500.0) == 500.0 and job.restarted() is None
    assert job.tags()[slurm_job.JOB_TAG] == "42" and job.tags()[slurm_job.NODES_TAG] == "gpu01"
    assert (
        environment.current({**in_job, "SLURM_RESTART_COUNT": "2"}).restarted() == "Slurm requeued job 42 (restart 2)"
    )


# What `scontrol show job -o` printed in the trap, on Slurm 22.05 (trimmed), and what it means.
REQUEUED = "JobId=1 JobName=job.sh JobState=COMPLETING Reason=None Requeue=1 Restarts=1 BatchFlag=1 RunTime=00:00:04 TimeLimit=UNLIMITED"
CANCELLED = (
    "JobId=4 JobName=job2.sh JobState=COMPLETING Reason=None Requeue=1 Restarts=0 RunTime=00:00:03 TimeLimit=UNLIMITED"
)
WARNED = "JobId=3 JobName=job.sh JobState=RUNNING Reason=None Requeue=1 Restarts=0 RunTime=00:00:06 TimeLimit=00:01:00"
TIMED_OUT = "JobId=5 JobState=COMPLETING Reason=None Restarts=0 RunTime=00:01:00 TimeLimit=00:01:00"
# the time-limit warning caught while slurmctld's agent was still delivering it (a fresh-clone run's time-limit test)
SIGNALING = (
    "JobId=3 JobState=SIGNALING Reason=None Requeue=1 Restarts=0 BatchFlag=1 RunTime=00:00:10 TimeLimit=00:02:00"
)
STOP_CASES = [(REQUEUED, 0, slurm_job.REQUEUE), (CANCELLED, 0, slurm_job.CANCEL), (WARNED, 0, slurm_job.TIME_LIMIT),
              (TIMED_OUT, 0, slurm_job.TIME_LIMIT), (SIGNALING, 0, slurm_job.TIME_LIMIT),
              (REQUEUED, 1, slurm_job.CANCEL)]  # fmt: skip


@pytest.mark.parametrize(("scontrol", "restarts", "reason"), STOP_CASES)
def test_why_slurm_sent_sigterm(scontrol, restarts, reason):
    assert slurm_job.stop_reason(scontrol, restarts) == reason


@pytest.mark.parametrize(("text", "seconds"), [("00:01:00", 60), ("1-02:00:00", 93_600), ("5:30", 330), ("45", 45),
                                               ("UNLIMITED", None), ("", None)])  # fmt: skip
def test_slurm_durations(text, seconds):
    assert slurm_job.duration_s(text) == seconds


def test_the_other_nodes_are_one_srun_step_with_a_task_per_node():
    job = WorkerJob(
        TrainingConfig(num_nodes=3, num_processes=2), "s3://b/p", "runs/t/v/train/x", "models/m", "shards", "sft", {}
    )
    command = slurm_job.peer_srun_command(job, "gpu01:29400", nodes=3)
    assert command[:6] == [
        "srun",
        "--relative=1",
        "--nodes=2",
        "--ntasks=2",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
    ]
    assert command[command.index("--node-rank-from-env") + 1] == "SLURM_PROCID"  # node ranks 1, 2
    assert WorkerJob.from_json(command[command.index("--job") + 1]) == job
    assert slurm_job.rendezvous_endpoint({"SLURMD_NODENAME": "gpu01"}) == "gpu01:29400"
    with pytest.raises(ValueError, match="at least 2"):
        slurm_job.peer_srun_command(job, "gpu01:29400", nodes=1)


def test_ssh_runs_the_command_quoted_on_the_login_node():
    target = SshClient("login.hpc", "me", 2222, "/k/id", ("StrictHostKeyChecking=yes",))
    argv = target.argv(["sbatch", "--parsable"])
    assert argv[:3] == ["ssh", "-o", "BatchMode=yes"] and argv[-3:] == ["me@login.hpc", "--", "sbatch --parsable"]
    assert ["-p", "2222"] == argv[3:5] and "/k/id" in argv and "StrictHostKeyChecking=yes" in argv


def example_block() -> dict:
    block = yaml.safe_load(EXAMPLE.read_text())["run_launcher"]
    assert (block["module"], block["class"]) == ("ft_assets.control.launcher", "PoolRunLauncher")
    return block


def test_the_slurm_example_matches_the_launchers_own_schema():
    block = example_block()
    assert process_config(convert_potential_field(PoolRunLauncher.config_type()).config_type, block["config"]).success
    gpu = block["config"]["pools"]["gpu"]
    assert (gpu["module"], gpu["class"]) == ("ft_assets.control.slurm", "SlurmRunLauncher")
    schema = convert_potential_field(SlurmRunLauncher.config_type()).config_type
    result = process_config(schema, gpu["config"])
    assert result.success, [e.message for e in result.errors]
    assert not process_config(schema, {**gpu["config"], "gpus": 1}).success  # a misspelt key is an error
    assert not process_config(schema, {**gpu["config"], "container": {"runtime": "docker", "image": "x"}}).success
    monitoring = yaml.safe_load(EXAMPLE.read_text())["run_monitoring"]
    assert monitoring["enabled"] and monitoring["max_resume_run_attempts"] >= 1  # a requeued job resumes its run


def test_the_examples_gpu_tier_is_an_offering_and_an_unknown_one_is_refused_when_the_instance_loads(tmp_path):
    config = example_block()["config"]["pools"]["gpu"]["config"]
    assert config["env"]["FT_GPU_TIER"] == "a100-80gb" and "FT_RENTAL_MODE" not in config["env"]  # billed as slurm
    SlurmRunLauncher(work_dir=str(tmp_path), env={"FT_GPU_TIER": config["env"]["FT_GPU_TIER"]})
    with pytest.raises(CheckError, match=r"env.FT_GPU_TIER: no GPU offering named 'slurm-a100-80gb' in the cost model"):
        SlurmRunLauncher(work_dir=str(tmp_path), env={"FT_GPU_TIER": "slurm-a100-80gb"})


def local_block(work_dir: Path) -> dict:
    block = example_block()
    gpu = block["config"]["pools"]["gpu"]["config"]
    gpu.pop("ssh")
    gpu["work_dir"] = str(work_dir)
    return block


def test_the_pool_launcher_hands_resumes_and_health_checks_to_the_slurm_pool(tmp_path):
    """Dagster resumes runs only through a launcher that supports it: PoolRunLauncher does when a pool does, checks
    the health of the gpu pool's runs through SlurmRunLauncher and leaves the local cpu pool's runs alone."""
    monitoring = {"enabled": True, "max_resume_run_attempts": 1}
    with dg.instance_for_test(
        overrides={"run_launcher": local_block(tmp_path), "run_monitoring": monitoring}
    ) as instance:
        pools = instance.run_launcher
        assert pools.supports_resume_run and pools.supports_check_run_worker_health
        gpu = create_run_for_test(instance, job_name="training_plane", tags={POOL_TAG: "gpu"})
        cpu = create_run_for_test(instance, job_name="data_plane", tags={POOL_TAG: "cpu"})
        assert pools.check_run_worker_health(cpu).status == WorkerStatus.RUNNING  # not checked: its timeouts apply
        unknown = pools.check_run_worker_health(gpu)
        assert unknown.status == WorkerStatus.UNKNOWN and "no Slurm job" in unknown.msg


def test_requeue_without_resumable_runs_is_refused_before_anything_is_submitted(tmp_path):
    with dg.instance_for_test(overrides={"run_launcher": local_block(tmp_path)}) as instance:
        run = create_run_for_test(instance, job_name="training_plane", tags={POOL_TAG: "gpu"})
        instance.run_launcher.launcher("gpu").launch_run(LaunchRunContext(run, None))
        run = instance.get_run_by_id(run.run_id)
        assert run.status == DagsterRunStatus.FAILURE and run.tags["dagster/max_retries"] == "0"
        said = "[SlurmRunLauncher] SlurmRunLauncher with requeue: true needs run_monitoring (enabled: true, "
        assert any(m.startswith(said) for m in events(instance, run.run_id))
    assert not list(tmp_path.iterdir())  # no sbatch, not even the work dir


# --- the batch script under bash, no Slurm: SIGTERM reaches the worker, execute then resume ---------------


def as_slurmstepd_starts_it() -> None:
    """In the batch shell's process before exec: SIGTERM at its default and unblocked."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGTERM])


@pytest.mark.integration
@pytest.mark.parametrize("restarts", [0, 1])
def test_the_batch_shell_passes_sigterm_to_the_worker_and_records_why(tmp_path, restarts):
    """``--signal=B:TERM`` reaches the batch shell only: its trap must pass SIGTERM to the worker's process group
    (the worker's own child too) and leave ``scontrol show job -o`` where the worker reads why it was stopped."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho JobId=$4 JobState=RUNNING Restarts=0\n")
    (bin_dir / "scontrol").chmod(0o755)
    worker = ("import signal, subprocess, sys, time, pathlib; child = subprocess.Popen(['sleep', '60']); "
              "signal.signal(signal.SIGTERM, lambda *a: (pathlib.Path(sys.argv[1]).write_text('term'), sys.exit(75))); "
              "pathlib.Path(sys.argv[2]).write_text(str(child.pid)); time.sleep(60)")  # fmt: skip
    execute = [sys.executable, "-c", worker, str(tmp_path / "got"), str(tmp_path / "child")]
    resume = [sys.executable, "-c", "import sys; sys.exit(3)"]
    script = tmp_path / "job.sh"
    script.write_text(batch_script(JobRequest("ft-assets-x", str(tmp_path)), execute, resume))
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "7",
        "SLURM_RESTART_COUNT": str(restarts),
    }
    # This process's SIGTERM as the shell would inherit it: a signal ignored at a shell's start cannot be trapped, and a
    # blocked one stays blocked across exec. slurmstepd starts a batch script with SIGTERM default and unblocked; so
    # does this test, whatever a library loaded earlier in the suite left (it once timed out here, in the suite only).
    inherited = f"SIGTERM here: {signal.getsignal(signal.SIGTERM)}, blocked: {signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, [])}"
    shell = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             preexec_fn=as_slurmstepd_starts_it)  # fmt: skip
    if restarts:  # a requeued job runs the resume command
        assert shell.wait(30) == 3 and "Slurm requeued job 7 (restart 1): resuming the run" in shell.stdout.read()
        return
    deadline = time.monotonic() + 30
    while not (tmp_path / "child").is_file():
        assert time.monotonic() < deadline and shell.poll() is None, shell.stdout.read()
        time.sleep(0.05)
    shell.send_signal(signal.SIGTERM)
    try:
        assert shell.wait(30) == 75  # the worker's exit code is the job's
    except subprocess.TimeoutExpired:
        shell.kill()
        pytest.fail(f"the batch shell did not pass SIGTERM on within 30 s ({inherited}): {shell.stdout.read()}")
    assert (tmp_path / "got").read_text() == "term"
    assert (tmp_path / "ft-assets-x-7.signal").read_text().startswith("JobId=7 JobState=RUNNING")
    child = int((tmp_path / "child").read_text())
    deadline = time.monotonic() + 10
    while _alive(child):  # the whole group got SIGTERM, the worker's own child too
        assert time.monotonic() < deadline, "the worker's child did not get the SIGTERM"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


# --- integration: the production instance with the Slurm gpu pool -----------------------------------------


def slurm_pool(work_dir: Path, **overrides) -> dict:
    """The example's gpu pool for this machine: this venv's Python, the test cluster's partition, no module loads."""
    pool = example_block()["config"]["pools"]["gpu"]
    config = {
        key: value for key, value in pool["config"].items() if key not in ("ssh", "account", "qos", "setup", "env")
    }
    config.update(work_dir=str(work_dir), partition="gpu", time_limit="10:00", python=sys.executable, sbatch_options=[],
                  env={"FT_GPU_TIER": pool["config"]["env"]["FT_GPU_TIER"]})  # the example's tier; its store is S3  # fmt: skip
    return {**pool, "config": {**config, **overrides}}


def instance_yaml(gpu_pool: dict) -> dict:
    """dagster.prod.yaml with the example's Slurm gpu pool and run monitoring, polled every 2 s (production: 60 s)."""
    instance = yaml.safe_load((REPO / "dagster.prod.yaml").read_text())
    example = yaml.safe_load(EXAMPLE.read_text())
    instance["run_launcher"] = example["run_launcher"]
    instance["run_launcher"]["config"]["pools"]["gpu"] = gpu_pool
    instance["run_monitoring"] = {**example["run_monitoring"], "poll_interval_seconds": 2, "start_timeout_seconds": 180}
    return instance


def training(tiny_model_dir, **settings) -> dict:
    """The module's run config (the data plane's settings never change, so it runs once) with these training settings."""
    config = run_config(tiny_model_dir, steps=8, lr=0.01)
    config["ops"]["eval_report"]["config"].update(min_improvement=-1.0, max_examples=4, max_new_tokens=8)
    config["ops"]["lora_adapter"]["config"].update(per_device_batch_size=2, save_steps=4, **settings)
    return config


@pytest.fixture(scope="module")
def slurm_prod(postgres_server, slurm_cluster, tmp_path_factory, tiny_model_dir):
    """The production instance on a fresh database with the Slurm gpu pool, one data plane run, and a daemon."""
    db = postgres_server.create_database()
    root = tmp_path_factory.mktemp("slurm-prod")
    home = root / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text(yaml.safe_dump(instance_yaml(slurm_pool(root / "jobs"))))
    data = root / "toolcalls.jsonl"
    data.write_text("".join(SAMPLE.read_text().splitlines(keepends=True)[:SAMPLE_LINES]))
    env = {**db.env, **slurm_cluster.env, "FT_HOME": str(root / "ft"), "DAGSTER_HOME": str(home), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO)}  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        mp.delenv("FT_STORE", raising=False)
        config = root / "data.yaml"
        config.write_text(yaml.safe_dump(training(tiny_model_dir)))
        argv = ["run", "--dataset", str(data), "--name", "toolcalls", "--version", VERSION, "--until", "data",
                "--config", str(config)]  # fmt: skip
        assert main(argv) == 0, "the data plane failed on the production instance"
        daemon_log = root / "daemon.log"
        with dg.DagsterInstance.get() as instance, dagster_daemon(daemon_log) as daemon:
            deadline = time.monotonic() + DAEMON_TIMEOUT_S
            while QUEUE_DAEMON not in instance.get_daemon_heartbeats():
                assert daemon.poll() is None, f"dagster-daemon exited:\n{daemon_log.read_text()[-3000:]}"
                assert time.monotonic() < deadline, f"no queue daemon heartbeat after {DAEMON_TIMEOUT_S:.0f} s"
                time.sleep(1)
            with PlaneLauncher(instance, verbose=False) as planes:
                yield {"root": root, "data": data, "db": db, "cluster": slurm_cluster, "daemon_log": daemon_log,
                       "store": LocalStore(root / "ft" / "store"), "instance": instance, "planes": planes}  # fmt: skip


def ft_run(prod, capsys, config: dict, name: str, until: str = "training") -> tuple[int, dict | None, str]:
    path = prod["root"] / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    argv = ["run", "--dataset", str(prod["data"]), "--name", "toolcalls", "--version", VERSION, "--until", until,
            "--config", str(path), "--json"]  # fmt: skip
    return run_cli(capsys, *argv)


def checkpoints(store: LocalStore) -> set[str]:
    return {
        k for k in store.list(f"runs/toolcalls/{VERSION}/train") if "/checkpoint-" in k and k.endswith("manifest.json")
    }


class OnFirstCheckpoint(threading.Thread):
    """Calls ``act(job_id)`` once the running training run's job has written a new checkpoint (a watcher thread)."""

    def __init__(self, prod, act):
        super().__init__(daemon=True)
        self.prod, self.act, self.before = prod, act, checkpoints(prod["store"])
        self.job_id, self.error, self.stop = None, None, threading.Event()

    def run(self):
        instance = self.prod["instance"]
        try:
            while not self.stop.is_set():
                running = instance.get_runs(
                    dg.RunsFilter(job_name="training_plane", statuses=[DagsterRunStatus.STARTED])
                )
                tagged = [r for r in running if slurm_job.JOB_TAG in r.tags]
                if tagged and checkpoints(self.prod["store"]) - self.before:
                    self.job_id = tagged[0].tags[slurm_job.JOB_TAG]
                    self.act(self.job_id)
                    return
                time.sleep(0.2)
        except Exception as exc:  # reported by the test
            self.error = exc

    def __enter__(self) -> OnFirstCheckpoint:
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()


def events(instance, run_id: str) -> list[str]:
    return [e.message or "" for e in instance.all_logs(run_id)]


def step_failure(instance, run_id: str) -> str:
    """The error message of the run's failed step."""
    [failed] = instance.all_logs(run_id, of_type=dg.DagsterEventType.STEP_FAILURE)
    return failed.dagster_event.step_failure_data.error.message


@pytest.mark.integration
def test_the_training_plane_is_a_slurm_job_and_data_and_delivery_stay_on_the_cpu_pool(
    slurm_prod, capsys, tiny_model_dir
):
    instance, cluster = slurm_prod["instance"], slurm_prod["cluster"]
    config = training(tiny_model_dir)
    config["ops"]["gguf_model"] = {"config": {"qtypes": []}}  # where delivery runs is the point; GGUF: test_pipeline.py
    code, summary, err = ft_run(slurm_prod, capsys, config, "whole", until="delivery")
    assert code == 0, err[-3000:] + slurm_prod["daemon_log"].read_text()[-2000:]
    assert summary["skipped"] == ["data"]
    [train_id] = summary["runs"]["training"]
    [deliver_id] = summary["runs"]["delivery"]
    run = instance.get_run_by_id(train_id)
    assert run.status == DagsterRunStatus.SUCCESS and run.tags[POOL_TAG] == "gpu"
    job_id, output = run.tags[slurm_job.JOB_TAG], Path(run.tags[slurm_job.OUTPUT_TAG])
    assert run.tags[slurm_job.NODES_TAG] == cluster.node  # written by the worker in the job
    said = events(instance, train_id)
    assert "[PoolRunLauncher] ft-assets routed this run to the gpu pool (SlurmRunLauncher)" in said
    [submitted] = [m for m in said if m.startswith(f"[SlurmRunLauncher] Slurm job {job_id} submitted")]
    assert "(--nodes=1 --gres=gpu:1 --partition=gpu --time=10:00)" in submitted and str(output) in submitted
    assert cluster.state(job_id) == "COMPLETED"
    log = output.read_text()  # the job's output: the run worker's own log lines
    assert "lora_adapter" in log and "Traceback" not in log, log[-2000:]
    data_runs = [r.run_id for r in instance.get_runs(dg.RunsFilter(job_name="data_plane"))]  # the fixture's
    for other in (*data_runs, deliver_id):
        assert (
            instance.get_run_by_id(other).tags[POOL_TAG] == "cpu"
            and slurm_job.JOB_TAG not in instance.get_run_by_id(other).tags
        )
    assert any("routed this run to the cpu pool (DefaultRunLauncher)" in m for m in events(instance, deliver_id))
    assert summary["steps"] == 8

    # Billed as the job declared (FT_GPU_TIER in the pool's env, mode slurm), from the allocation's start.
    adapter, cost = (read_ref(slurm_prod["store"], KEY, name)["stats"] for name in ("lora_adapter", "training_cost"))
    assert adapter["billed_as"] == {"FT_GPU_TIER": "a100-80gb", "FT_RENTAL_MODE": "slurm"}
    assert (cost["gpu_tier"], cost["rental_mode"], cost["usd_per_hour"]) == ("a100-80gb", "slurm", 1.00)
    starts = instance.all_logs(train_id, of_type=dg.DagsterEventType.STEP_START)
    [step_start] = [e for e in starts if e.step_key == "lora_adapter"]  # after training_plan, in the same job
    [job] = parse_squeue(cluster.run("squeue", "--states=all", "-h", "-j", job_id, "-o", "%i|%T|%r|%N|%S|%e").stdout)
    before_step = step_start.timestamp - job.start.timestamp()  # the worker's start-up, on the allocation
    assert before_step > 1 and adapter["wall_seconds"] >= before_step


KEY = f"toolcalls@{VERSION}"
TRAINING_PLANE = defs.resolve_job_def("training_plane")


def train_settings() -> dict:
    return {"per_device_batch_size": 2, "warmup_steps": 0, "lora_r": 8, "lora_alpha": 16, "learning_rate": 0.01}


def train_on_slurm(prod, **settings) -> list[str]:
    """A training_plane run with these lora_adapter settings, submitted through the queue as ``ft-assets run`` does
    (PlaneLauncher: follows it and its retries); its run ids. The data plane is not re-planned for them."""
    config = {"ops": {"lora_adapter": {"config": {**train_settings(), **settings}}}}
    return prod["planes"].run(TRAINING_PLANE, "training", KEY, config)


def adapter_weights(store, tmp_path: Path) -> dict:
    ref = read_ref(store, KEY, "lora_adapter")
    fetch_artifact(store, ref["prefix"], tmp_path / "adapter")
    return load_file(tmp_path / "adapter" / "adapter_model.safetensors")


@pytest.mark.integration
def test_a_requeued_job_resumes_the_same_run_and_trains_the_uninterrupted_adapter(slurm_prod, tmp_path, one_cpu_thread):
    cluster, instance, store = slurm_prod["cluster"], slurm_prod["instance"], slurm_prod["store"]
    settings = dict(max_steps=60, save_steps=10, seed=2)

    def requeue(job_id):
        cluster.run("scontrol", "requeue", job_id)
        deadline = time.monotonic() + 60
        while cluster.state(job_id) != "PENDING":  # Slurm holds a requeued job ~2 min (BeginTime): start it now
            assert time.monotonic() < deadline, cluster.state(job_id)
            time.sleep(0.2)
        cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")

    watcher = OnFirstCheckpoint(slurm_prod, requeue)
    with watcher:
        [run_id] = train_on_slurm(slurm_prod, **settings)  # one run: the requeued job went on with it
    assert watcher.error is None and watcher.job_id, watcher.error
    run = instance.get_run_by_id(run_id)
    assert run.status == DagsterRunStatus.SUCCESS and run.tags[slurm_job.JOB_TAG] == watcher.job_id
    said = events(instance, run_id)
    assert any(m.startswith(f"Slurm is requeueing job {watcher.job_id}: preempted by SIGTERM at step") for m in said)
    assert any("not treating as failure because run will be resumed" in m for m in said)
    assert any(m.startswith(f"Slurm requeued job {watcher.job_id} (restart 1)") for m in said)
    output = Path(run.tags[slurm_job.OUTPUT_TAG]).read_text()  # one file, both starts (--open-mode=append)
    assert "CANCELLED AT" in output and "DUE TO JOB REQUEUE" in output
    assert f"Slurm requeued job {watcher.job_id} (restart 1): resuming the run" in output
    stats = read_ref(store, KEY, "lora_adapter")["stats"]
    assert stats["steps"] == 60 and stats["resumed_from_step"] >= 10

    inputs = {name: read_ref(store, KEY, name)["prefix"] for name in ("base_model", "tokenized_shards")}
    for name, prefix in inputs.items():
        fetch_artifact(store, prefix, tmp_path / name)
    reference = train(TrainingConfig(**{**train_settings(), **settings}), tmp_path / "base_model",
                      tmp_path / "tokenized_shards", LocalStore(tmp_path / "ref"), "runs/ref/v/train/ref",
                      tmp_path / "work", log=lambda line: None)  # fmt: skip
    assert_same_weights(adapter_weights(store, tmp_path), load_file(reference.output_dir / "adapter_model.safetensors"))


@pytest.mark.integration
def test_a_time_limit_shorter_than_the_run_checkpoints_and_the_run_retry_resumes(slurm_prod):
    cluster, instance, store = slurm_prod["cluster"], slurm_prod["instance"], slurm_prod["store"]

    # 10 min asked; once training runs, the job's limit becomes the minute after this one: 60-120 s left, under
    # grace (120 s) + Slurm's 30 s check period, so --signal=B:TERM comes at the next time-limit check, as for a job
    # submitted with a --time the run outlasts, and the limit itself is a minute or more away.
    def shorten(job_id):
        shown = slurm_job.parse_scontrol(cluster.run("scontrol", "show", "job", "-o", job_id).stdout)
        minutes = math.ceil(slurm_job.duration_s(shown["RunTime"]) / 60) + 1
        cluster.run("scontrol", "update", f"JobId={job_id}", f"TimeLimit={minutes}")

    watcher = OnFirstCheckpoint(slurm_prod, shorten)
    with watcher:
        # Slurm checks time limits every 30 s: steps enough to outlast that on a quiet machine (~20 steps/s here)
        runs = train_on_slurm(slurm_prod, max_steps=1200, save_steps=50, seed=3)
    assert watcher.error is None, watcher.error
    assert len(runs) == 2, f"one run, no retry: it trained its 1,200 steps before Slurm's TERM ({runs})"
    first_id, retry_id = runs
    first, retry = instance.get_run_by_id(first_id), instance.get_run_by_id(retry_id)
    assert first.status == DagsterRunStatus.FAILURE and first.tags["ft/preempted"] == "true"
    assert retry.status == DagsterRunStatus.SUCCESS and retry.parent_run_id == first_id
    assert first.tags[slurm_job.JOB_TAG] != retry.tags[slurm_job.JOB_TAG]  # the retry is a new job
    assert cluster.state(first.tags[slurm_job.JOB_TAG]) in ("COMPLETED", "FAILED")  # it ended itself, before the kill
    assert "Failure: ft/preempted: preempted by SIGTERM at step" in step_failure(instance, first_id)
    stats = read_ref(store, KEY, "lora_adapter")["stats"]
    assert stats["steps"] == 1200 and stats["resumed_from_step"] >= 50 and len(stats["restarts"]) == 1


@pytest.mark.integration
def test_scancel_ends_the_run_with_its_reason_and_the_checkpoints_stay(slurm_prod):
    cluster, instance, store = slurm_prod["cluster"], slurm_prod["instance"], slurm_prod["store"]
    watcher = OnFirstCheckpoint(slurm_prod, lambda job_id: cluster.run("scancel", job_id))
    with watcher, pytest.raises(PlaneFailed) as failed:
        train_on_slurm(slurm_prod, max_steps=300, save_steps=10, seed=4)
    assert watcher.error is None, watcher.error
    message = str(failed.value)
    assert f"lora_adapter: Slurm job {watcher.job_id} was cancelled (scancel) at step" in message
    assert "\n" not in message and "the run is not retried" in message
    run = instance.get_run_by_id(failed.value.run_id)
    assert run.status == DagsterRunStatus.FAILURE and "dagster/auto_retry_run_id" not in run.tags
    time.sleep(8)  # the daemon's run retries look every few seconds: it must not retry this run
    assert not instance.get_runs(dg.RunsFilter(tags={"dagster/parent_run_id": run.run_id}))
    kept = sorted(checkpoints(store) - watcher.before)  # every checkpoint the cancelled job published verifies
    assert kept
    for key in kept:
        verify_artifact(store, read_manifest(store, key.rsplit("/", 1)[0]))
    assert cluster.state(watcher.job_id) == "CANCELLED"


@pytest.mark.integration
def test_a_gpu_count_the_partition_lacks_is_refused_by_slurm_in_one_line(slurm_prod):
    instance, store = slurm_prod["instance"], slurm_prod["store"]
    before = set(store.list(f"runs/toolcalls/{VERSION}"))
    with pytest.raises(PlaneFailed) as failed:
        train_on_slurm(slurm_prod, max_steps=10, num_processes=3, seed=5)  # the node has 2 GPUs
    message = str(failed.value)
    assert "Slurm refused the job of run" in message and "Requested node configuration is not available" in message
    assert "\n" not in message
    run = instance.get_run_by_id(failed.value.run_id)
    assert run.status == DagsterRunStatus.FAILURE and run.tags["dagster/max_retries"] == "0"
    assert slurm_job.JOB_TAG not in run.tags
    assert set(store.list(f"runs/toolcalls/{VERSION}")) >= before  # nothing removed


@pytest.mark.integration
def test_the_ssh_path_submits_watches_and_reads_the_job_on_a_login_node(slurm_prod, login_node, monkeypatch, tmp_path):
    """The gpu pool as deploy/launchers/slurm-gpu.yaml has it: sbatch, squeue and tail through ssh to a login node
    (sshd on loopback, a key made here), the job's environment from ``env`` and a secrets file ``setup`` sources.
    Here the launcher has no SLURM_CONF: a Slurm command run locally would fail."""
    db = slurm_prod["db"]
    secrets = tmp_path / "secrets.sh"
    secrets.write_text(f"export DAGSTER_PG_PASSWORD={db.env['DAGSTER_PG_PASSWORD']}\n")
    secrets.chmod(0o600)
    home = tmp_path / "dagster_home"
    home.mkdir()
    env = {key: value for key, value in db.env.items() if key != "DAGSTER_PG_PASSWORD"}
    env.update(DAGSTER_HOME=str(home), FT_HOME=os.environ["FT_HOME"], PYTHONPATH=str(REPO), OMP_NUM_THREADS="1",
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")  # fmt: skip
    pool = slurm_pool(tmp_path / "jobs", ssh=login_node.ssh_config, setup=[f"source {secrets}"], env=env)
    instance_config = instance_yaml(pool)
    instance_config["run_coordinator"] = {"module": "dagster._core.run_coordinator", "class": "DefaultRunCoordinator"}
    (home / "dagster.yaml").write_text(yaml.safe_dump(instance_config))  # launched at once: not the module daemon's
    monkeypatch.delenv("SLURM_CONF")
    healths = []
    with dg.DagsterInstance.from_config(str(home)) as instance, PlaneLauncher(instance, verbose=False) as planes:
        slurm = instance.run_launcher.launcher("gpu")
        assert slurm.cli.ssh is not None

        def watch(stop: threading.Event):
            while not stop.is_set():
                for run in instance.get_runs(
                    dg.RunsFilter(job_name="training_plane", statuses=[DagsterRunStatus.STARTED])
                ):
                    if slurm_job.JOB_TAG in run.tags:
                        healths.append(slurm.check_run_worker_health(run).status)
                stop.wait(1.0)

        stop = threading.Event()
        watcher = threading.Thread(target=watch, args=(stop,), daemon=True)
        watcher.start()
        try:
            config = {
                "ops": {"lora_adapter": {"config": {**train_settings(), "max_steps": 20, "save_steps": 10, "seed": 6}}}
            }
            [run_id] = planes.run(TRAINING_PLANE, "training", KEY, config)
        finally:
            stop.set()
            watcher.join()
        run = instance.get_run_by_id(run_id)
        assert run.status == DagsterRunStatus.SUCCESS and run.tags[POOL_TAG] == "gpu"
        assert WorkerStatus.RUNNING in healths  # squeue through ssh while the job ran
        deadline = time.monotonic() + 60  # the run worker reports success, then its process (the job) ends
        while (health := slurm.check_run_worker_health(run).status) == WorkerStatus.RUNNING:
            assert time.monotonic() < deadline, "the job did not end after its run succeeded"
            time.sleep(1)
        assert health == WorkerStatus.SUCCESS
        debug = slurm.get_run_worker_debug_info(run)  # squeue and tail of the output file, through ssh
        assert debug.startswith(f"Slurm job {run.tags[slurm_job.JOB_TAG]} ended on ") and "lora_adapter" in debug
    assert read_ref(slurm_prod["store"], KEY, "lora_adapter")["stats"]["steps"] == 20
    accepted = login_node.log.read_text().count("Accepted publickey")
    assert accepted >= 3, login_node.log.read_text()  # mkdir, sbatch, squeue (and tail)


@pytest.mark.integration
def test_the_idle_sensor_cancels_a_slurm_job_whose_run_has_ended(slurm_prod):
    """A job of the gpu pool still queued or running after its run ended holds (or will take) an allocation for
    nothing: the idle sensor scancels it. A job naming a run this instance does not know is left alone."""
    from ft_assets.control.rented_workers import RentedWorkersResource
    from ft_assets.control.shutdown import Ec2WorkersResource, idle_gpu_worker_sensor

    cluster, instance = slurm_prod["cluster"], slurm_prod["instance"]
    [ended] = instance.get_runs(dg.RunsFilter(job_name="data_plane", statuses=[DagsterRunStatus.SUCCESS]), limit=1)
    jobs = {}
    for run_id in (ended.run_id, "not-a-run-of-this-instance"):
        jobs[run_id] = cluster.run("sbatch", "--parsable", f"--job-name=ft-assets-{run_id}", "--output=/dev/null",
                                   "--wrap", "sleep 300").stdout.strip()  # fmt: skip
    try:
        context = dg.build_sensor_context(
            instance=instance,
            resources={"ec2_workers": Ec2WorkersResource(idle_minutes=0.01), "rented_workers": RentedWorkersResource()},
        )
        said = idle_gpu_worker_sensor(context).skip_message
        assert said == f"cancelled 1 idle Slurm job(s) ({jobs[ended.run_id]})"
        deadline = time.monotonic() + 30
        while cluster.state(jobs[ended.run_id]) not in ("CANCELLED",):
            assert time.monotonic() < deadline, cluster.state(jobs[ended.run_id])
            time.sleep(0.5)
        assert cluster.state(jobs["not-a-run-of-this-instance"]) in ("PENDING", "RUNNING")
    finally:
        cluster.run("scancel", *jobs.values(), check=False)


@pytest.mark.integration
def test_the_slurm_target_trains_in_a_job_that_holds_no_instance_setting(slurm_prod, tmp_path):
    """``--gpu slurm://localhost/gpu``: the run stays in this process, only the worker is an sbatch job (Pipes through
    the store), submitted with --export=NONE so the database settings in this environment stay here."""
    instance, store = slurm_prod["instance"], slurm_prod["store"]
    jobs = slurm_prod["root"] / "target-jobs"
    target = f"slurm://localhost/gpu?gpu=a100-80gb&python={sys.executable}&workdir={jobs}&time=10:00"
    seen = {}

    def watch(stop: threading.Event):
        while not stop.is_set():
            for pid_file in jobs.glob("*/worker.pid"):
                pid = int(pid_file.read_text().strip() or 0)
                if (
                    pid
                    and Path(f"/proc/{pid}/cmdline").is_file()
                    and b"remote" in Path(f"/proc/{pid}/cmdline").read_bytes()
                ):
                    seen["environ"] = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                    return
            time.sleep(0.1)

    stop = threading.Event()
    watcher = threading.Thread(target=watch, args=(stop,), daemon=True)
    watcher.start()
    config = {"ops": {"lora_adapter": {"config": {**train_settings(), "max_steps": 12, "save_steps": 6, "seed": 7,
                                                  "method": "lora"}}}}  # fmt: skip  # a CPU node: not qlora
    try:
        [run_id] = run_plane(instance, TRAINING_PLANE, "training", KEY, config, {TARGET_TAG: target})
    finally:
        stop.set()
    assert instance.get_run_by_id(run_id).status == DagsterRunStatus.SUCCESS
    stats = read_ref(store, KEY, "lora_adapter")["stats"]
    assert stats["gpu_target"] == target and stats["steps"] == 12
    assert [a["outcome"] for a in stats["attempts"]] == ["finished"]
    plan = read_ref(store, KEY, "training_plan")["stats"]  # made for the partition's card, at its GPU-hour price
    assert (plan["gpu_tier"], plan["rental_mode"], plan["usd_per_hour"]) == ("a100-80gb", "slurm", 1.0)
    names = {line.split(b"=", 1)[0].decode() for line in seen.get("environ", []) if b"=" in line}
    assert "SLURM_JOB_ID" in names, names  # it ran as a Slurm job
    assert not {n for n in names if n.startswith(("DAGSTER", "PG")) or n == "FT_HOME"}, names
    said = events(instance, run_id)
    assert any(m.startswith("starting attempt 1 of this run's worker on slurm://localhost/gpu") for m in said)
    assert any("fetching the base model" in m for m in said)  # the worker's own line, through Pipes
