"""Training on a GPU target through Dagster Pipes: the ``ssh://`` target against OpenSSH's sshd on loopback.

The worker logs in as an unprivileged user (``sshhost.worker_host``) who cannot read the control host's
``DAGSTER_HOME`` and whose environment holds no instance setting; the store is a folder both users write. One
data plane for the module (embedded SQLite instance, ``ft-assets run --in-process``), then:
(a) a training run on the target whose worker is killed with ``kill -9`` after its first checkpoint: the next
attempt resumes from it, the run's log shows the worker's progress, and the adapter equals the one an
uninterrupted run of the same seed trains; (b) terminating the run cancels the worker; (c) a worker left running
by an earlier execution of the run is cancelled before a new one starts, and a worker's secrets reach its
environment only; (d) a target that cannot be used is refused in one line before anything runs; (e) ``gpus=2`` on the target: two
ranks under torchrun on the worker (gloo), one Pipes reporter an attempt, the result published, and a ``kill -9`` of
rank 1 after the first checkpoint ends the attempt as killed: the next one resumes from that checkpoint.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import sys
import threading
import time
from pathlib import Path

import dagster as dg
import pytest
import yaml
from dagster._check import CheckError
from dagster._core.launcher.base import LaunchRunContext, RunLauncher
from dagster._core.test_utils import create_run_for_test
from dagster._serdes import ConfigurableClass
from safetensors.torch import load_file

from ft_assets import layout
from ft_assets.cli.launch import PlaneLauncher
from ft_assets.cli.parser import build_parser
from ft_assets.cli.output import PlaneFailed
from ft_assets.control.jobs import TRAINING_PLANE
from ft_assets.definitions import defs
from ft_assets.manifests import fetch_artifact
from ft_assets.targets import TARGET_TAG, TARGETS, GpuRequest, Target, TargetError, WorkerLaunch, parse_target
from ft_assets.targets import ssh as ssh_target
from ft_assets.targets.code import DEFAULT_IMAGE
from ft_assets.targets.session import cancel_leftover
from ft_assets.refs import read_ref
from ft_assets.storage import LocalStore
from ft_assets.training.config import TrainingConfig
from ft_assets.training.recipe import train
from ft_assets_tests import fake_skypilot
from ft_assets_tests.support import assert_same_weights, run_cli, run_config

pytest_plugins = ["ft_assets_tests.sshhost", "ft_assets_tests.skypilot_env"]

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "samples" / "toolcalls" / "part-000.jsonl"
SAMPLE_LINES = 200
VERSION = "remote1"
KEY = f"toolcalls@{VERSION}"
WAIT_S = 240.0
RANK_STEPS = 12  # the 2-rank run's steps: killed after its first checkpoint (step 4), resumed to the end


def settings(**overrides) -> dict:
    return {"per_device_batch_size": 2, "warmup_steps": 0, "lora_r": 8, "lora_alpha": 16, "learning_rate": 0.01,
            "max_steps": 24, "save_steps": 8, "seed": 3, "method": "lora", **overrides}  # fmt: skip  # a CPU worker


@pytest.fixture(scope="module")
def remote_home(worker_host, tmp_path_factory, tiny_model_dir):
    """The control host: an embedded instance in a folder only root reads, the store shared with the worker, the
    data plane materialized once. The control side writes with umask 000 so that the worker may add to its folders."""
    root = tmp_path_factory.mktemp("remote")
    home = root / "dagster_home"
    home.mkdir(mode=0o700)
    store_dir = worker_host.store / "module-a"
    data = root / "toolcalls.jsonl"
    data.write_text("".join(SAMPLE.read_text().splitlines(keepends=True)[:SAMPLE_LINES]))
    config = run_config(tiny_model_dir, steps=24, lr=0.01)
    config["ops"]["lora_adapter"]["config"] = settings()
    (root / "run.yaml").write_text(yaml.safe_dump(config))
    umask = os.umask(0)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("DAGSTER_HOME", str(home))
            mp.setenv("FT_HOME", str(root / "ft"))
            mp.setenv("FT_STORE", str(store_dir))
            mp.setenv("OMP_NUM_THREADS", "1")
            argv = ["run", "--dataset", str(data), "--name", "toolcalls", "--version", VERSION, "--until", "data",
                    "--config", str(root / "run.yaml"), "--in-process"]  # fmt: skip
            from ft_assets.cli import main

            assert main(argv) == 0, "the data plane failed"
            yield {"root": root, "data": data, "store": LocalStore(store_dir), "config": root / "run.yaml",
                   "home": home}  # fmt: skip
    finally:
        os.umask(umask)


def worker_pids(worker_host) -> list[int]:
    """The workers' pids (``worker.pid`` of each attempt folder in the worker user's home) that still run: processes
    of the worker user running ``ft_assets.training.remote`` (a pid is never taken on trust: pids are reused)."""
    pids = []
    for path in (Path(worker_host.account.pw_dir) / "ft-assets-worker").glob("*/worker.pid"):
        pid = int(path.read_text().strip() or 0)
        try:
            ours = Path(f"/proc/{pid}").stat().st_uid == worker_host.account.pw_uid
            started = b"ft_assets.training.remote" in Path(f"/proc/{pid}/cmdline").read_bytes()  # exec'd, not forked
        except (FileNotFoundError, ProcessLookupError):
            continue
        if pid and ours and started:
            pids.append(pid)
    return pids


def checkpoints(store: LocalStore) -> set[str]:
    return {
        k for k in store.list(f"runs/toolcalls/{VERSION}/train") if "/checkpoint-" in k and k.endswith("manifest.json")
    }


class Watcher(threading.Thread):
    """Polls ``ready()`` every 0.2 s (up to ``WAIT_S``) in the background while the test's run goes on, until it says
    True; an exception is kept in ``error`` for the test to report."""

    def __init__(self):
        super().__init__(daemon=True)
        self.error, self.stop = None, threading.Event()

    def ready(self) -> bool:
        raise NotImplementedError

    def run(self):
        deadline = time.monotonic() + WAIT_S
        try:
            while not self.stop.is_set() and time.monotonic() < deadline and not self.ready():
                time.sleep(0.2)
        except Exception as exc:  # reported by the test
            self.error = exc

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()


class WhenTraining(Watcher):
    """Calls ``act(pid)`` with the worker's pid once it runs (and, with ``after_checkpoint``, has saved one)."""

    def __init__(self, worker_host, store, act, after_checkpoint: bool):
        super().__init__()
        self.worker_host, self.store, self.act, self.after_checkpoint = worker_host, store, act, after_checkpoint
        self.before = checkpoints(store)
        self.pid, self.environ, self.cmdline = None, None, None

    def ready(self) -> bool:
        pids = worker_pids(self.worker_host)
        if not pids or (self.after_checkpoint and not checkpoints(self.store) - self.before):
            return False
        self.pid = pids[0]
        self.environ = Path(f"/proc/{self.pid}/environ").read_bytes().split(b"\0")
        self.cmdline = Path(f"/proc/{self.pid}/cmdline").read_bytes().split(b"\0")
        self.act(self.pid)
        return True


@pytest.mark.integration
def test_a_killed_worker_is_started_again_and_resumes_to_the_uninterrupted_adapter(
    remote_home, worker_host, capsys, tmp_path, monkeypatch
):
    store = remote_home["store"]
    secret = "planted-secret-" + os.urandom(6).hex()  # this host's store key and the workers': a folder needs neither
    for name, value in (("DAGSTER_HOME", remote_home["home"]), ("FT_HOME", remote_home["root"] / "ft"),
                        ("FT_STORE", store.root), ("OMP_NUM_THREADS", "1"), ("AWS_ACCESS_KEY_ID", "control-id"),
                        ("AWS_SECRET_ACCESS_KEY", secret), ("FT_WORKER_AWS_ACCESS_KEY_ID", "planted-id"),
                        ("FT_WORKER_AWS_SECRET_ACCESS_KEY", secret)):  # fmt: skip
        monkeypatch.setenv(name, str(value))
    umask = os.umask(0)
    try:
        with WhenTraining(worker_host, store, lambda pid: os.kill(pid, 9), after_checkpoint=True) as killer:
            code, summary, err = run_cli(
                capsys, "run", "--dataset", str(remote_home["data"]), "--name", "toolcalls", "--version", VERSION,
                "--until", "training", "--config", str(remote_home["config"]), "--gpu", worker_host.target(),
                "--in-process", "--json",
            )  # fmt: skip
    finally:
        os.umask(umask)
    assert code == 0, err
    assert killer.error is None and killer.pid, killer.error
    environ = {line.split(b"=", 1)[0].decode() for line in killer.environ if b"=" in line}
    # least privilege: a folder store's worker holds no store key at all, neither this host's nor the workers'
    assert not [line for line in killer.environ if secret.encode() in line or line.startswith((b"AWS_", b"FT_WORKER_"))]
    worker_files = [*store.root.rglob("pipes/*/*"), *Path(worker_host.account.pw_dir).rglob("ft-assets-worker/*/*.log")]
    assert worker_files and not [f for f in worker_files if f.is_file() and secret.encode() in f.read_bytes()]
    assert secret not in err
    assert not {name for name in environ if name.startswith(("DAGSTER", "PG")) or name == "FT_HOME"}, environ
    assert not os.access(remote_home["home"], os.R_OK) or os.getuid() == 0  # the home is root's alone (mode 0700)
    assert oct(remote_home["home"].stat().st_mode & 0o777) == "0o700"

    adapter = read_ref(store, KEY, "lora_adapter")
    stats = adapter["stats"]
    assert stats["gpu_target"].startswith("ssh://ftworker@127.0.0.1")
    # the worker ran this checkout's code from the wheel it installed (code=wheel), in its own cached venv
    code = stats["worker_code"]
    assert store.sha256(code["uri"].removeprefix(f"{store.root}/")) == code["sha256"]
    venvs = Path(worker_host.account.pw_dir) / ".cache" / "ft-assets" / "venvs"
    assert killer.cmdline[0].decode().startswith(f"{venvs}/{code['sha256'][:16]}-"), killer.cmdline
    assert not [name for name in environ if name in ("FT_CODE_URL", "FT_BOOTSTRAP")]
    outcomes = [a["outcome"] for a in stats["attempts"]]
    assert outcomes == ["killed", "finished"], stats["attempts"]
    assert stats["attempts"][0]["exit_code"] == 137 and stats["steps"] == 24 and stats["resumed_from_step"] >= 8
    assert all(a["worker"].get("host") for a in stats["attempts"])
    instance = dg.DagsterInstance.get()
    try:
        [run] = instance.get_runs(dg.RunsFilter(job_name=TRAINING_PLANE, tags={TARGET_TAG: worker_host.target()}))
        said = [e.message or "" for e in instance.all_logs(run.run_id)]
    finally:
        instance.dispose()
    assert not [m for m in said if secret in m]
    assert "the worker gets no store keys (a folder store)" in said
    assert any(m.startswith("starting attempt 2 of this run's worker on ssh://") for m in said)
    assert any("was killed after" in m and "resumes from the newest complete checkpoint" in m for m in said)
    assert any(m.startswith("attempt 1 on ") and "fetching the base model" in m for m in said)  # the worker's own
    assert any("resuming" in m.lower() for m in said), said[-20:]  # the recipe's resume line, sent through Pipes

    inputs = {name: read_ref(store, KEY, name)["prefix"] for name in ("base_model", "tokenized_shards")}
    for name, prefix in inputs.items():
        fetch_artifact(store, prefix, tmp_path / name)
    reference = train(TrainingConfig(**settings()), tmp_path / "base_model", tmp_path / "tokenized_shards",
                      LocalStore(tmp_path / "ref"), "runs/ref/v/train/ref", tmp_path / "work", log=lambda line: None)  # fmt: skip
    fetch_artifact(store, adapter["prefix"], tmp_path / "adapter")
    assert_same_weights(load_file(tmp_path / "adapter" / "adapter_model.safetensors"),
                        load_file(reference.output_dir / "adapter_model.safetensors"))  # fmt: skip


def rank_pids(worker_host, rank: int) -> list[int]:
    """The worker user's training processes of torchrun rank ``rank`` (``ft_assets.training.worker``, ``RANK`` set)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            ours = proc.name.isdigit() and proc.stat().st_uid == worker_host.account.pw_uid
            if ours and b"ft_assets.training.worker" in (proc / "cmdline").read_bytes():
                if f"RANK={rank}".encode() in (proc / "environ").read_bytes().split(b"\0"):
                    pids.append(int(proc.name))
        except (FileNotFoundError, ProcessLookupError):
            continue
    return pids


class WhenRankCheckpointed(Watcher):
    """``kill -9`` of rank 1 once the run has its first checkpoint: torchrun then fails the attempt."""

    def __init__(self, worker_host, store):
        super().__init__()
        self.worker_host, self.store, self.before, self.killed = worker_host, store, checkpoints(store), None

    def ready(self) -> bool:
        pids = rank_pids(self.worker_host, 1) if checkpoints(self.store) - self.before else []
        if pids:
            os.kill(pids[0], 9)
            self.killed = pids[0]
        return bool(pids)


@pytest.mark.integration
def test_gpus_2_on_the_target_trains_two_ranks_under_one_pipes_reporter_and_a_killed_rank_resumes_in_a_new_attempt(
    remote_home, worker_host, monkeypatch
):
    store = remote_home["store"]
    for name, value in (("DAGSTER_HOME", remote_home["home"]), ("FT_HOME", remote_home["root"] / "ft"),
                        ("FT_STORE", store.root), ("OMP_NUM_THREADS", "1")):  # fmt: skip
        monkeypatch.setenv(name, str(value))
    target = f"{worker_host.target()}&gpus=2"
    config = {"ops": {"lora_adapter": {"config": settings(max_steps=RANK_STEPS, save_steps=4, seed=5)}}}
    instance = dg.DagsterInstance.get()
    umask = os.umask(0)
    try:
        with WhenRankCheckpointed(worker_host, store) as killer:
            with PlaneLauncher(instance, False, {"training": {TARGET_TAG: target}}) as planes:
                planes.run(defs.resolve_job_def(TRAINING_PLANE), "training", KEY, config)
        [run] = instance.get_runs(dg.RunsFilter(job_name=TRAINING_PLANE, tags={TARGET_TAG: target}))
        said = [e.message or "" for e in instance.all_logs(run.run_id)]
    finally:
        os.umask(umask)
        instance.dispose()
    assert killer.error is None and killer.killed, killer.error
    plan, stats = read_ref(store, KEY, "training_plan")["stats"], read_ref(store, KEY, "lora_adapter")["stats"]
    assert plan["gpus"] == 2 and plan["training_config"]["num_processes"] == 2  # planned and billed for 2 cards
    # kill -9 of one rank: torchrun fails, the worker ends as killed, the next attempt resumes from the checkpoint
    assert [a["outcome"] for a in stats["attempts"]] == ["killed", "finished"], stats["attempts"]
    assert stats["attempts"][0]["exit_code"] == 137 and stats["resumed_from_step"] >= 4
    assert stats["steps"] == RANK_STEPS and stats["resolved"]["rows_per_step"] == 4  # 2 rows on each of 2 ranks
    assert stats["device"] == "cpu x2"  # on CUDA, "cuda x2": training_cost bills 2 cards
    prefix = f"runs/toolcalls/{VERSION}/train/{stats['run_id']}"
    state = json.loads(store.get_bytes(f"{layout.checkpoint(prefix, RANK_STEPS)}/trainer_state.json"))
    assert state["world_size"] == 2
    assert any("training on 2 processes on this machine" in m for m in said), said[-20:]
    assert any("a training process was killed (exit code 137)" in m for m in said), said[-20:]
    assert any("resuming" in m.lower() for m in said), said[-20:]  # rank 0's own line, through the worker's Pipes
    assert any("final weights published at" in m for m in said) and not [m for m in said if "[default1]" in m]
    lives = [key for key in store.list(f"{prefix}/pipes") if key.endswith("claim.json")]
    assert sorted(key.split("/")[-3:-1] for key in lives) == [["001", "1"], ["002", "1"]]  # one reporter an attempt


class WhenSkyJobTrains(Watcher):
    """Preempts the fake SkyPilot's managed job (SIGKILL of its process group: a reclaimed spot machine) once its
    worker runs and the run has a checkpoint; SkyPilot's recovery then runs the same command on the next placement."""

    def __init__(self, state: Path, store):
        super().__init__()
        self.state, self.store, self.before, self.preempted = state, store, checkpoints(store), None

    def ready(self) -> bool:
        if not checkpoints(self.store) - self.before:
            return False
        with fake_skypilot.state_file(self.state) as state:
            running = [job for job in state["jobs"].values() if job["status"] == "RUNNING"]
            if running:
                running[0]["commands"].append("preempt")
                self.preempted = running[0]["job_id"]
        return self.preempted is not None


@pytest.mark.integration
def test_skypilot_recovers_a_preempted_worker_inside_one_attempt_which_resumes_from_its_checkpoint(
    remote_home, sky_env, capsys, monkeypatch, tmp_path
):
    """``--gpu skypilot:runpod`` at SkyPilot's SDK boundary: the managed job rents the plan's card, gets its secrets as
    SkyPilot secrets only (a folder store: no store key; this host's planted one stays here), and its recovered start
    (same command, fresh disk) resumes the run."""
    store = remote_home["store"]
    secret = "planted-secret-" + os.urandom(6).hex()
    for name, value in (("DAGSTER_HOME", remote_home["home"]), ("FT_HOME", remote_home["root"] / "ft"),
                        ("FT_STORE", store.root), ("OMP_NUM_THREADS", "1"), ("AWS_ACCESS_KEY_ID", "planted-id"),
                        ("AWS_SECRET_ACCESS_KEY", secret), ("FT_SKYPILOT_PYTHON", sky_env["python"])):  # fmt: skip
        monkeypatch.setenv(name, str(value))
    fake_skypilot.new_state(sky_env["state"], placements=[["RunPod", "CA", "CA-MTL-1"], ["RunPod", "US", "US-GA-1"]])
    target = f"skypilot:runpod?python={sys.executable}&poll=2"
    config = yaml.safe_load(remote_home["config"].read_text())
    config["ops"]["lora_adapter"]["config"] = settings(seed=5)  # a run of its own (the run id is of the settings)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    umask = os.umask(0)
    try:
        with WhenSkyJobTrains(sky_env["state"], store) as preempter:
            code, summary, err = run_cli(
                capsys, "run", "--dataset", str(remote_home["data"]), "--name", "toolcalls", "--version", VERSION,
                "--until", "training", "--config", str(tmp_path / "run.yaml"), "--gpu", target, "--in-process",
                "--json",
            )  # fmt: skip
    finally:
        os.umask(umask)
    assert code == 0, err
    assert preempter.error is None and preempter.preempted, preempter.error
    state = json.loads(sky_env["state"].read_text())
    [launched] = state["launches"]
    plan = read_ref(store, KEY, "training_plan")["stats"]
    assert launched["task"]["resources"]["accelerators"] == {plan["accelerator"]: 1} and plan["accelerator"]
    assert launched["task"]["resources"]["use_spot"] == (plan["rental_mode"] == "spot")
    assert launched["secrets"] == ["FT_CODE_URL"]  # the wheel's URL; no store key for a folder store, not this host's
    assert launched["task"]["resources"]["image_id"] == {"null": f"docker:{DEFAULT_IMAGE}"}  # PyTorch's, any region
    assert secret not in json.dumps(launched["envs"]) + launched["task"]["run"]
    assert not [k for k in launched["envs"] if k.startswith(("DAGSTER", "PG", "FT_HOME"))]
    job = state["jobs"][str(preempter.preempted)]
    assert job["status"] == "SUCCEEDED" and job["recovery_count"] == 1

    adapter = read_ref(store, KEY, "lora_adapter")["stats"]
    assert adapter["gpu_target"] == target
    [attempt] = adapter["attempts"]
    assert attempt["outcome"] == "finished" and attempt["starts"] == 2, adapter["attempts"]
    assert 0 < attempt["paid_seconds"] <= attempt["seconds"]  # from the worker's first start, not the job's launch
    assert adapter["resumed_from_step"] >= 8 and adapter["steps"] == 24
    instance = dg.DagsterInstance.get()
    try:
        [run] = instance.get_runs(dg.RunsFilter(job_name=TRAINING_PLANE, tags={TARGET_TAG: target}))
        said = [e.message or "" for e in instance.all_logs(run.run_id)]
    finally:
        instance.dispose()
    assert any("(start 2: the target restarted it)" in m for m in said), said[-20:]
    assert any("resuming" in m.lower() for m in said), said[-20:]
    assert not [m for m in said if secret in m]


@pytest.mark.integration
def test_terminating_the_run_cancels_its_worker(remote_home, worker_host, monkeypatch):
    store = remote_home["store"]
    for name, value in (("DAGSTER_HOME", remote_home["home"]), ("FT_HOME", remote_home["root"] / "ft"),
                        ("FT_STORE", store.root), ("OMP_NUM_THREADS", "1")):  # fmt: skip
        monkeypatch.setenv(name, str(value))
    config = {"ops": {"lora_adapter": {"config": settings(max_steps=20000, save_steps=10000, seed=4)}}}
    instance = dg.DagsterInstance.get()
    umask = os.umask(0)
    try:

        def terminate(pid):
            [run] = instance.get_runs(dg.RunsFilter(job_name=TRAINING_PLANE, statuses=[dg.DagsterRunStatus.STARTED]))
            assert instance.run_launcher.terminate(run.run_id)

        with WhenTraining(worker_host, store, terminate, after_checkpoint=False) as watcher:
            with PlaneLauncher(instance, False, {"training": {TARGET_TAG: worker_host.target()}}) as planes:
                with pytest.raises(PlaneFailed):
                    planes.run(defs.resolve_job_def(TRAINING_PLANE), "training", KEY, config)
        assert watcher.error is None and watcher.pid, watcher.error
        deadline = time.monotonic() + 60
        while Path(f"/proc/{watcher.pid}").exists():
            assert time.monotonic() < deadline, "the worker still runs after its run was terminated"
            time.sleep(0.5)
        assert not [k for k in store.list(f"runs/toolcalls/{VERSION}/train") if k.endswith("pipes/worker.json")]
        [run] = instance.get_runs(dg.RunsFilter(job_name=TRAINING_PLANE, statuses=[dg.DagsterRunStatus.CANCELED]))
        said = [e.message or "" for e in instance.all_logs(run.run_id)]
        assert any(m.startswith("cancelling the worker on ssh://ftworker@127.0.0.1") for m in said), said[-10:]
    finally:
        os.umask(umask)
        instance.dispose()


def test_a_worker_left_running_is_cancelled_and_its_secrets_stay_out_of_its_command_line(worker_host, tmp_path):
    target = parse_target(worker_host.target())
    secret = "planted-secret-" + os.urandom(6).hex()
    launch = WorkerLaunch("leftover", "http.server", ("0", "--bind", "127.0.0.1"), {"AWS_DEFAULT_REGION": "x"},
                          {"AWS_SECRET_ACCESS_KEY": secret})  # fmt: skip
    handle = target.launch(launch)
    folder = Path(worker_host.account.pw_dir) / handle["folder"]
    deadline = time.monotonic() + 30
    while not (folder / "worker.pid").is_file():
        assert time.monotonic() < deadline
        time.sleep(0.1)
    pid = int((folder / "worker.pid").read_text())
    while b"http.server" not in Path(f"/proc/{pid}/cmdline").read_bytes():  # forked, not yet exec'd: the shell's env
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert target.poll(handle).running
    assert not (folder / "env").exists()  # read and deleted before the worker started
    assert secret.encode() in Path(f"/proc/{pid}/environ").read_bytes()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            assert secret.encode() not in (proc / "cmdline").read_bytes()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            pass
    store = LocalStore(tmp_path / "store")
    store.put_json("run/pipes/worker.json", {"target": target.describe(), "handle": handle, "attempt": 1,
                                             "dagster_run": "earlier"})  # fmt: skip
    said = []
    cancel_leftover(target, store, "run/pipes/worker.json", said.append)
    assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    assert not target.poll(handle).running and not store.exists("run/pipes/worker.json")
    assert said and "still running on ssh://" in said[0] and "cancelling it" in said[0]


@pytest.mark.parametrize(
    "text, said",
    [
        ("gpu-cloud://x", "unknown kind 'gpu-cloud'; use one of local, skypilot:..., slurm://..., ssh://..."),
        ("slurm://login.example.edu", "write slurm://[user@]login-host[:port]/partition"),
        ("slurm://login.example.edu/gpu?gpus=0", "gpus=0 is not a whole number >= 1"),
        ("ssh://host?gpus=two", "gpus=two is not a whole number >= 1"),
        ("slurm://login.example.edu/gpu?partition=a100", "unknown setting(s) partition"),
        ("ssh://host?pyhton=/x", "unknown setting(s) pyhton"),
        ("ssh://user:pw@host", "no password in the URL"),
        ("ssh://host:port", "the port is not a number"),
        ("skypilot:runpod?imag=x", "unknown setting(s) imag; known: image, python"),
        ("skypilot:runpod?restarts=-1", "restarts=-1 is not a whole number >= 0"),
        ("skypilot:runpod,/CA", "'/CA' is not SkyPilot infra"),
    ],
)
def test_a_target_that_cannot_be_used_is_refused_in_one_line(text, said):
    with pytest.raises(TargetError, match=None) as caught:
        parse_target(text)
    assert said in str(caught.value) and "\n" not in str(caught.value)


def test_ft_assets_run_refuses_an_unknown_target_before_anything_runs(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home"))
    code, summary, err = run_cli(capsys, "run", "--dataset", str(SAMPLE), "--gpu", "runpod", "--json")
    assert code != 0 and "--gpu: GPU target 'runpod': unknown kind 'runpod'" in err and "write skypilot:runpod" in err
    assert not (tmp_path / "home").exists()


def test_ft_assets_run_on_a_store_without_sts_refuses_to_send_this_hosts_keys_before_anything_runs(
    capsys, tmp_path, monkeypatch
):
    """The rented-GPU quickstart on an S3-compatible store with this host's keys only: refused before the dataset is
    registered (nothing reaches the store, nothing is rented), in one line naming both ways out."""
    for name, value in (("DAGSTER_HOME", tmp_path / "home"), ("FT_STORE", "s3://my-bucket/ft"),
                        ("AWS_ENDPOINT_URL", "http://127.0.0.1:9"), ("AWS_ACCESS_KEY_ID", "host-id"),
                        ("AWS_SECRET_ACCESS_KEY", "host-secret")):  # fmt: skip
        monkeypatch.setenv(name, str(value))
    for name in ("FT_WORKER_KEYS", "FT_WORKER_AWS_ACCESS_KEY_ID", "FT_WORKER_AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)
    code, summary, err = run_cli(capsys, "run", "--dataset", str(SAMPLE), "--gpu", "skypilot:runpod", "--json")
    [line] = [line for line in err.splitlines() if "S3-compatible" in line]
    assert code != 0 and line.count("--gpu skypilot:runpod: the store s3://my-bucket/ft is on http://127.0.0.1:9") == 1
    assert "FT_WORKER_AWS_ACCESS_KEY_ID" in line and "FT_WORKER_KEYS=host-keys" in line and "host-secret" not in err
    assert summary is not None and "partition" not in summary  # no dataset version was registered


def test_every_registered_target_parses_its_example_into_a_target_and_its_docs_page_and_gpu_help_show_it():
    assert TARGETS, "no GPU target is registered"
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown), pytest.raises(SystemExit):
        build_parser("ft-assets").parse_args(["run", "--help"])
    helps = "".join(shown.getvalue().split())  # argparse's lines joined (it also breaks them at hyphens)
    for scheme, kind in TARGETS.items():
        module = importlib.import_module(kind.parser.partition(":")[0])
        target = parse_target(module.EXAMPLE)
        assert isinstance(target, Target) and target.scheme == scheme, (scheme, target)
        page = REPO / "docs" / "deploy" / f"{scheme}.md"
        assert page.exists() and module.EXAMPLE in page.read_text(), f"{page} shows no --gpu example of {scheme}"
        assert "".join(f"{kind.usage} ({kind.summary})".split()) in helps, f"--gpu's help does not show {scheme}"


class Recorder(RunLauncher, ConfigurableClass):
    """A pool's launcher that only records the runs it is handed (the pool's routing is what is tested)."""

    def __init__(self, inst_data=None):
        self._inst_data = inst_data
        super().__init__()

    @property
    def inst_data(self):
        return self._inst_data

    @classmethod
    def config_type(cls):
        return {}

    @classmethod
    def from_config_value(cls, inst_data, config_value):
        return cls(inst_data)

    def launch_run(self, context) -> None:
        pass

    def terminate(self, run_id: str) -> bool:
        return False


def pool_instance(target: str):
    recorder = {"module": __name__, "class": "Recorder"}
    pools = {"gpu": {**recorder, "target": target}, "cpu": recorder}
    launcher = {"module": "ft_assets.control.launcher", "class": "PoolRunLauncher", "config": {"pools": pools}}
    return dg.instance_for_test(overrides={"run_launcher": launcher})


def test_the_gpu_pools_target_tags_its_runs_and_a_runs_own_target_wins():
    with pool_instance(ssh_target.EXAMPLE) as instance:
        for own, expected in ((None, ssh_target.EXAMPLE), ("ssh://other-box", "ssh://other-box")):
            run = create_run_for_test(
                instance, job_name=TRAINING_PLANE, tags={"ft/pool": "gpu", **({TARGET_TAG: own} if own else {})}
            )
            instance.run_launcher.launch_run(LaunchRunContext(run, None))
            assert instance.get_run_by_id(run.run_id).tags[TARGET_TAG] == expected
            said = [e.message or "" for e in instance.all_logs(run.run_id)]
            assert any(f"lora_adapter trains on {parse_target(expected).describe()}" in m for m in said), said
        cpu = create_run_for_test(instance, job_name="data_plane", tags={"ft/pool": "cpu"})
        instance.run_launcher.launch_run(LaunchRunContext(cpu, None))
        assert TARGET_TAG not in instance.get_run_by_id(cpu.run_id).tags
        wrong = create_run_for_test(
            instance, job_name=TRAINING_PLANE, tags={"ft/pool": "gpu", TARGET_TAG: "gpu-cloud://x"}
        )
        instance.run_launcher.launch_run(LaunchRunContext(wrong, None))
        assert instance.get_run_by_id(wrong.run_id).status == dg.DagsterRunStatus.FAILURE
        assert any("ft-assets refused this run: GPU target 'gpu-cloud://x': unknown kind" in (e.message or "")
                   for e in instance.all_logs(wrong.run_id))  # fmt: skip


def test_a_gpu_pool_target_that_cannot_be_used_stops_the_instance_in_one_line():
    with pool_instance("ssh://host?pyhton=/x") as instance:
        with pytest.raises(CheckError, match=r"pools.gpu.target: GPU target .* unknown setting\(s\) pyhton"):
            instance.run_launcher  # noqa: B018 (loading the launcher is the test)


def test_the_workers_s3_policy_allows_what_a_worker_reads_and_writes_and_nothing_of_the_other_planes():
    """``deploy/worker-s3-policy.json`` (the workers' own keys, ``FT_WORKER_AWS_*``) against the keys the layout builds:
    the IAM wildcard ``*`` matches across ``/`` as fnmatch's does. AWS evaluates the policy; no test here enforces it."""
    from fnmatch import fnmatchcase

    from ft_assets import layout

    policy = json.loads((REPO / "deploy" / "worker-s3-policy.json").read_text())

    def allowed(action: str, key: str) -> bool:
        arn = f"arn:aws:s3:::my-bucket/ft/{key}"
        return any(action in st["Action"] and any(fnmatchcase(arn, r) for r in st["Resource"])
                   for st in policy["Statement"] if st["Effect"] == "Allow")  # fmt: skip

    part, variant, run = layout.of("toolcalls@v1"), layout.of("toolcalls@v1~wide"), "0123456789abcdef"
    reads = [f"{layout.base_model('smollm2-135m', 'ab' * 8)}/manifest.json", f"{part.data('shards')}/train-0.parquet"]
    writes = [f"{layout.checkpoint(p.train(run), 8)}/model.safetensors" for p in (part, variant)]
    writes += [f"{part.train(run)}/pipes/001/1/1.json", f"{part.train(run)}/output/adapter_model.safetensors"]
    elsewhere = [f"{part.inputs}/part-000.jsonl", part.ref("lora_adapter"), f"{part.data('cleaned')}/x.parquet",
                 f"{part.registry(run)}/lineage.json", f"{part.delivery(run, 'merged')}/model.safetensors",
                 f"{part.control('plan')}/manifest.json", layout.worker_wheel("ab" * 32, "ft_assets-0.1.0.whl")]  # fmt: skip
    assert all(allowed("s3:GetObject", key) for key in reads + writes)
    assert all(allowed("s3:PutObject", key) and allowed("s3:DeleteObject", key) for key in writes)
    assert not [key for key in reads if allowed("s3:PutObject", key) or allowed("s3:DeleteObject", key)]
    assert not [
        key for key in elsewhere if any(allowed(a, key) for a in ("s3:GetObject", "s3:PutObject", "s3:DeleteObject"))
    ]


def test_a_gpu_targets_attempts_are_billed_from_each_workers_first_start_and_every_start_counts_as_a_restart():
    """The bill counts every attempt, a killed one too, from its worker's first start (not the wait for a machine)."""
    from ft_assets.control.assets import measurements
    from ft_assets.targets.session import paid_seconds

    assert paid_seconds(100.0, [1_000.0, 1_030.0], now=1_060.0) == 60.0  # pending 40 s: not paid
    assert paid_seconds(100.0, [], now=1_060.0) == 100.0  # no worker message: launch to end
    assert paid_seconds(100.0, [2_000.0], now=1_060.0) == 0.0  # a worker clock ahead of ours: never negative
    attempts = [{"attempt": 1, "seconds": 50.0, "paid_seconds": 40.0, "outcome": "killed", "starts": 1},
                {"attempt": 2, "seconds": 95.0, "paid_seconds": 90.0, "outcome": "finished", "starts": 2}]  # fmt: skip
    adapter = {"stats": {"wall_seconds": 20.0, "step_seconds": 15.0, "restarts": [], "checkpoints": [],
                         "tokens_seen": 1000, "device": "cpu", "attempts": attempts, "gpu_utilization": None},
               "upstream_bytes": 0, "run_prefix": "runs/x/v/train/r"}  # fmt: skip
    plan = {"stats": {"gpu_tier": "rtx4090-24gb", "rental_mode": "spot", "warnings": []}}
    measured, notes = measurements(adapter, plan, store=None, retention_days=0)
    assert measured.wall_seconds == 130.0 and measured.restarts == 2
    assert any("billed from the GPU target's 2 attempt(s), 2 restart(s)" in n for n in notes), notes


@pytest.mark.integration
def test_a_skypilot_job_waiting_for_a_machine_is_running_to_the_session_and_its_cancel_is_sky_jobs_cancel(
    sky_env, monkeypatch
):
    """``poll`` and ``cancel`` of the ``skypilot:`` target on a managed job still PENDING (no capacity yet)."""
    monkeypatch.setenv("FT_SKYPILOT_PYTHON", sky_env["python"])
    fake_skypilot.new_state(sky_env["state"], hold=True)
    target = parse_target("skypilot:runpod/CA?code=installed")
    launch = WorkerLaunch(
        "held-1-abc123", "http.server", ("0",), {}, {}, GpuRequest("rtx4090-24gb", "RTX4090", 1, "spot")
    )
    handle = target.launch(launch)
    assert target.poll(handle).running
    target.cancel(handle)
    state = json.loads(sky_env["state"].read_text())
    assert state["cancels"] == [handle["job_id"]] and state["jobs"][str(handle["job_id"])]["status"] == "CANCELLED"
    after = target.poll(handle)  # cancelled by someone else, to a session that did not: a failure, not a retry
    assert not after.running and after.exit_code == 1 and "cancelled outside this run" in after.detail


def test_with_worker_keys_sts_each_attempt_gets_keys_whose_policy_reaches_its_run_alone(monkeypatch, tmp_path):
    """A store on AWS S3, no setting: at AWS STS's SDK boundary (moto), GetFederationToken with an inline policy that
    allows the run's inputs and its own prefix, nothing else; the worker gets the temporary keys, never this host's."""
    from fnmatch import fnmatchcase

    import boto3
    from moto import mock_aws

    from ft_assets import layout
    from ft_assets.targets.credentials import worker_keys, worker_secrets
    from ft_assets.storage import S3Store

    for name, value in (("AWS_ACCESS_KEY_ID", "AKIAHOSTKEY"), ("AWS_SECRET_ACCESS_KEY", "host-secret"),
                        ("AWS_DEFAULT_REGION", "us-east-1")):  # fmt: skip
        monkeypatch.setenv(name, value)
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    part, run = layout.of("toolcalls@v1"), "0123456789abcdef"
    reads = [layout.base_model("smollm2-135m", "ab" * 8), part.data("shards")]
    asked = []
    with mock_aws():
        boto3.setup_default_session()
        boto3.DEFAULT_SESSION.events.register(
            "provide-client-params.sts.GetFederationToken", lambda params, **kw: asked.append(params)
        )
        store = S3Store("my-bucket", "ft")
        assert worker_keys(os.environ, store) == "sts"  # the default on AWS
        keys = worker_secrets(dict(os.environ), store, reads, part.train(run), "run-1-abc")
    [request] = asked
    assert request["DurationSeconds"] == 12 * 3600 and request["Name"] == "run-1-abc"
    assert set(keys) == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"}
    assert keys["AWS_ACCESS_KEY_ID"] != "AKIAHOSTKEY" and "host-secret" not in keys.values()
    policy = json.loads(request["Policy"])

    def allowed(action: str, key: str) -> bool:
        arn = f"arn:aws:s3:::my-bucket/ft/{key}"
        return any(action in st["Action"] and any(fnmatchcase(arn, r) for r in st["Resource"])
                   for st in policy["Statement"])  # fmt: skip

    assert all(allowed("s3:GetObject", f"{prefix}/manifest.json") for prefix in reads)
    mine = f"{layout.checkpoint(part.train(run), 8)}/model.safetensors"
    assert allowed("s3:PutObject", mine) and allowed("s3:DeleteObject", mine)
    other_run = f"{part.train('fedcba9876543210')}/output/adapter_model.safetensors"
    assert not [k for k in (other_run, f"{reads[1]}/x.parquet", part.ref("lora_adapter"), f"{part.registry(run)}/x")
                if allowed("s3:PutObject", k) or allowed("s3:DeleteObject", k)]  # fmt: skip
    assert not allowed("s3:GetObject", other_run) and not allowed("s3:GetObject", part.ref("lora_adapter"))


def test_an_attempts_scoped_keys_are_renewed_through_the_store_at_half_their_life(monkeypatch):
    """The session's keys for one attempt on AWS S3 (moto's STS and S3): the first scoped keys and the seal as secrets,
    where the renewals appear as plain settings; at half the keys' life new keys from STS, sealed in the store, and
    the worker's follower signs with them. ``test_key_renewal.py`` checks the switch against a real store."""
    import boto3
    from moto import mock_aws

    from ft_assets.targets.renewal import follower, unsealed
    from ft_assets.targets.session import attempt_keys
    from ft_assets.storage import S3Store

    for name, value in (("AWS_ACCESS_KEY_ID", "AKIAHOSTKEY"), ("AWS_SECRET_ACCESS_KEY", "host-secret"),
                        ("AWS_DEFAULT_REGION", "us-east-1"), ("FT_WORKER_KEYS_HOURS", "0.25")):  # fmt: skip
        monkeypatch.setenv(name, value)
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    asked, said = [], []
    with mock_aws():
        boto3.setup_default_session()
        boto3.DEFAULT_SESSION.events.register(
            "provide-client-params.sts.GetFederationToken", lambda params, **kw: asked.append(params)
        )
        boto3.client("s3").create_bucket(Bucket="my-bucket")
        store = S3Store("my-bucket", "ft")
        folder = "runs/r/pipes/001/keys"
        plain, secrets, renewal = attempt_keys("sts", dict(os.environ), store, ["models/m"], "runs/r", "r-1-ab", folder)
        assert plain == {"FT_KEYS_FOLDER": folder, "FT_KEYS_CHECK_S": "45"}  # 15 min keys: a look every 45 s
        assert set(secrets) == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "FT_KEYS_SEAL"}
        assert secrets["AWS_ACCESS_KEY_ID"] != "AKIAHOSTKEY" and renewal.life_s == 900
        renewal.tick(said.append, now=renewal.issued + 449)
        assert len(asked) == 1 and store.list(folder) == []
        renewal.tick(said.append, now=renewal.issued + 451)  # half their life: the next keys, from STS again
        assert len(asked) == 2 and asked[1]["DurationSeconds"] == 900 and asked[1]["Policy"] == asked[0]["Policy"]
        worker = S3Store("my-bucket", "ft")
        before = worker.client
        follows = follower(worker, {**plain, **secrets}, said.append)
        assert follows.check()
        [sealed] = store.list(folder)
        keys = unsealed(secrets["FT_KEYS_SEAL"], store.get_bytes(sealed))
        signs = worker.client._request_signer._credentials  # noqa: SLF001 - which keys it signs with now
        assert worker.client is not before and (signs.access_key, signs.token) == (
            keys["AWS_ACCESS_KEY_ID"],
            keys["AWS_SESSION_TOKEN"],
        )
    assert any(m.startswith("renewed the worker's store keys (renewal 1; valid until ") for m in said), said
    own = attempt_keys("own", {"FT_WORKER_AWS_ACCESS_KEY_ID": "w"}, store, [], "r", "n", folder)
    assert own == ({}, {"AWS_ACCESS_KEY_ID": "w"}, None)  # keys of their own are not renewed: they do not expire


KEYS = {"AWS_ACCESS_KEY_ID": "host-id", "AWS_SECRET_ACCESS_KEY": "host-secret"}  # this host's, planted
WORKERS = {"FT_WORKER_AWS_ACCESS_KEY_ID": "worker-id", "FT_WORKER_AWS_SECRET_ACCESS_KEY": "worker-secret"}


@pytest.mark.parametrize(
    "store_kind, environ, expected",
    [
        ("folder", {**KEYS, **WORKERS}, {}),  # a folder store: nothing, whatever is set
        ("folder", {**KEYS, "FT_WORKER_KEYS": "host-keys"}, {}),
        (
            "compatible",
            {**KEYS, **WORKERS},
            {"AWS_ACCESS_KEY_ID": "worker-id", "AWS_SECRET_ACCESS_KEY": "worker-secret"},
        ),
        ("compatible", {**KEYS, "FT_WORKER_KEYS": "host-keys"}, KEYS),  # said in so many words
        ("compatible", KEYS, "an S3-compatible store where ft-assets cannot make keys scoped to one run"),
        ("compatible", {**KEYS, "FT_WORKER_KEYS": "iam"}, "use sts (keys scoped to the run, AWS S3), host-keys"),
        ("folder", {"FT_WORKER_KEYS": "sts"}, "is not on S3; a folder store needs no keys"),
        ("aws", {**KEYS, "FT_WORKER_KEYS_HOURS": "48"}, "hours from 0.25 to 36"),
    ],
)
def test_a_worker_gets_no_key_of_this_hosts_unless_told_and_a_store_without_sts_is_refused(
    store_kind, environ, expected, tmp_path, monkeypatch
):
    """``worker_keys``' table: least privilege by default. An S3-compatible store (an endpoint that is not AWS)
    without keys for workers is refused in one line that names both ways out; nothing is sent to a worker then."""
    from ft_assets.targets.credentials import worker_secrets
    from ft_assets.storage import S3Store

    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    if store_kind == "folder":
        store = LocalStore(tmp_path)
    else:  # no request is made: worker_keys reads the client's endpoint only
        monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
        monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
        if store_kind == "compatible":
            monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
        store = S3Store("my-bucket", "ft")
    if isinstance(expected, dict):
        assert worker_secrets(environ, store, ["models/m"], "runs/r", "n") == expected
    else:
        with pytest.raises(TargetError) as refused:
            worker_secrets(environ, store, ["models/m"], "runs/r", "n")
        message = str(refused.value)
        assert expected in message and "\n" not in message and "host-secret" not in message
        if "S3-compatible" in expected:
            assert "FT_WORKER_AWS_ACCESS_KEY_ID" in message and "FT_WORKER_KEYS=host-keys" in message
