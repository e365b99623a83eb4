"""SkyPilot's SDK boundary for the tests: the calls that would reach a cloud are answered here, the rest is SkyPilot.

Run by the SkyPilot venv's python, in place of ``sdk_venv.py``'s own process (``wrapper`` writes the
executable that the launcher's ``python`` and ``FT_SKYPILOT_PYTHON`` point at)::

    <.venv-skypilot python> fake_skypilot.py sdk <sdk_venv.py> VERB ANSWER   one SDK call (sdk_venv.serve)
    <.venv-skypilot python> fake_skypilot.py controller JOB_ID              a managed job's attempts

Replaced: ``sky.jobs.launch``, ``sky.jobs.queue_v2``, ``sky.jobs.cancel``, ``sky.status``, ``sky.stop``,
``sky.down`` and ``sky.get`` of their results. Real: ``sky.Task.from_yaml_config`` (the launcher's task
is parsed and validated by SkyPilot, its ``to_yaml_config`` recorded), SkyPilot's response models
(``ManagedJobRecord``, ``StatusResponse``, ``ManagedJobStatus``), its catalog (the test's files under
``SKY_RUNTIME_DIR``). With ``clouds`` empty in the state, a launch meets SkyPilot's own optimizer, as the
API server runs it for ``jobs.launch``: with no cloud enabled it raises ``NoCloudAccessError`` (the same
one-line reason the real ``sky.jobs.launch`` returns through a local API server: 15-200 s to start
here, too slow to start for every test run).

A launched job gets a controller process, as SkyPilot's jobs controller: it runs the task's ``run`` in
bash, each attempt in a fresh scratch directory (``cwd``, ``TMPDIR``, ``FT_SCRATCH``) with the task's
envs and secrets, ``SKYPILOT_CLUSTER_INFO``, and the test's environment minus the secrets' names (so
they arrive only as secrets). Commands the test appends to the job's ``commands``: ``preempt`` (SIGKILL
of the attempt's process group, RECOVERING, then the next attempt on the next ``placements`` entry,
``recovery_count`` + 1) and ``cancel`` (what ``sky.jobs.cancel`` sends). ``hold`` keeps new jobs
PENDING (waiting for capacity).

State: the JSON file ``$FT_FAKE_SKY_STATE``, read and written under an ``flock``.
"""

from __future__ import annotations

import fcntl
import json
import os
import runpy
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

STATE_ENV = "FT_FAKE_SKY_STATE"
POLL_S = 0.2
RECOVERY_S = 1.0  # "provisioning" the next attempt's cluster after a preemption


def wrapper(path: Path, python: str, state: Path) -> Path:
    """An executable that runs sdk_venv's other end with this module's fakes: what the tests' ``python`` is."""
    path.write_text(f'#!/bin/sh\nexport {STATE_ENV}="{state}"\nexec "{python}" "{Path(__file__).resolve()}" sdk "$@"\n')
    path.chmod(0o755)
    return path


@contextmanager
def state_file(path: str | None = None):
    """The state, locked; written back on exit."""
    path = Path(path or os.environ[STATE_ENV])
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        state = json.loads(path.read_text()) if path.exists() else {}
        yield state
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1, default=str))
        tmp.replace(path)


def new_state(path: Path, **fields) -> None:
    base = {"clouds": ["runpod"], "placements": [["RunPod", "CA", "CA-MTL-1"]], "hold": False, "jobs": {},
            "launches": [], "cancels": [], "clusters": [], "cluster_calls": [], "next_job_id": 1}  # fmt: skip
    path.write_text(json.dumps({**base, **fields}))


class Done:
    """What a faked SDK call returns in place of a request id; ``sky.get`` unwraps it."""

    def __init__(self, value):
        self.value = value


def install() -> None:
    import sky
    from sky.jobs.state import ManagedJobStatus
    from sky.schemas.api.responses import ManagedJobRecord, StatusResponse
    from sky.utils import status_lib

    from sky import dag as dag_lib, optimizer

    real_get = sky.get

    def launch(task, name=None, **kwargs):
        config = task.to_yaml_config()
        with state_file() as state:
            refuse = not state["clouds"]
            if not refuse:
                job_id = state["next_job_id"]
                state["next_job_id"] += 1
                state["launches"].append({"name": name, "task": config, "envs": dict(task.envs),
                                          "secrets": sorted(task.secrets)})  # fmt: skip
                state["jobs"][str(job_id)] = {
                    "job_id": job_id, "job_name": name, "status": "PENDING", "recovery_count": 0,
                    "submitted_at": time.time(), "start_at": None, "end_at": None, "last_recovered_at": -1,
                    "job_duration": 0.0, "cloud": None, "region": None, "zone": None, "cluster_resources": None,
                    "accelerators": dict(next(iter(task.resources)).accelerators or {}), "commands": [],
                    "task": {"run": task.run, "envs": dict(task.envs), "secrets": {k: v.get_secret_value() for k, v in task.secrets.items()}},
                    "attempts": [], "failure_reason": None, "current_cluster_name": None,
                }  # fmt: skip
        if refuse:  # what SkyPilot's API server runs for jobs.launch: its optimizer, which finds no enabled cloud
            with dag_lib.Dag() as dag:
                dag.add(task)
            optimizer.Optimizer.optimize(dag, quiet=True)
            raise AssertionError("SkyPilot's optimizer found an enabled cloud in the test's SkyPilot home")
        subprocess.Popen([sys.executable, __file__, "controller", str(job_id)], start_new_session=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        return Done(([job_id], None))

    def queue_v2(refresh, job_ids=None, fields=None, **kwargs):
        with state_file() as state:
            jobs = [state["jobs"][str(i)] for i in job_ids or [] if str(i) in state["jobs"]]
        records = []
        for job in jobs:
            row = {k: v for k, v in job.items() if k in ManagedJobRecord.model_fields}
            row["status"] = ManagedJobStatus(job["status"])
            if job["status"] == "RUNNING":  # the queue's total: the prior attempts' plus the current one's
                row["job_duration"] = job["job_duration"] + time.time() - job["last_recovered_at"]
            elif job["end_at"] and job["last_recovered_at"] > 0 and job["status"] != "RECOVERING":
                row["job_duration"] = job["job_duration"] + job["end_at"] - job["last_recovered_at"]
            records.append(ManagedJobRecord(**row))
        return Done((records, len(records), {}, len(records)))

    def cancel(job_ids=None, **kwargs):
        with state_file() as state:
            for i in job_ids or []:
                state["cancels"].append(i)
                state["jobs"][str(i)]["commands"].append("cancel")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # SkyPilot's cancel returns once the job is cancelled
            with state_file() as state:
                if all(state["jobs"][str(i)]["status"] == "CANCELLED" for i in job_ids or []):
                    return Done(None)
            time.sleep(POLL_S)
        raise RuntimeError(f"jobs {job_ids} did not cancel within 30 s")

    def status(*args, **kwargs):
        with state_file() as state:
            rows = state["clusters"]
        return Done([StatusResponse(**{**row, "status": status_lib.ClusterStatus(row["status"])}) for row in rows])

    def cluster_call(verb):
        def call(cluster_name, **kwargs):
            refused = None
            with state_file() as state:
                state["cluster_calls"].append([verb, cluster_name])
                for row in state["clusters"]:
                    if row["name"] == cluster_name and verb == "stop" and "[Spot]" in (row.get("resources_str") or ""):
                        refused = f"Stopping spot cluster {cluster_name} is not supported."  # SkyPilot's refusal
                    elif row["name"] == cluster_name:
                        row["status"] = "STOPPED" if verb == "stop" else "TERMINATED"
            if refused:
                raise sky.exceptions.NotSupportedError(refused)
            return Done(None)

        return call

    sky.jobs.launch, sky.jobs.queue_v2, sky.jobs.cancel = launch, queue_v2, cancel
    sky.status, sky.stop, sky.down = status, cluster_call("stop"), cluster_call("down")
    sky.get = lambda request: request.value if isinstance(request, Done) else real_get(request)


# --- a managed job's controller ------------------------------------------------------------------


def controller(job_id: str) -> None:
    """The job's life: PENDING until not ``hold``, then attempts until one exits, or a cancel."""
    attempt, process, lost_at = 0, None, None
    while True:
        now = time.time()
        with state_file() as state:
            job = state["jobs"][job_id]
            commands, job["commands"] = job["commands"], []
            if "cancel" in commands:
                _kill(process)
                job.update(status="CANCELLED", end_at=now)
                return
            if process is not None and "preempt" in commands:
                _kill(process)
                job["job_duration"] += now - job["last_recovered_at"]  # SkyPilot's count: prior attempts' running
                job["status"] = "RECOVERING"
                process, attempt, lost_at = None, attempt + 1, now
            elif process is not None and process.poll() is not None:
                job.update(status="SUCCEEDED" if process.returncode == 0 else "FAILED", end_at=now)
                if process.returncode:
                    job["failure_reason"] = f"the task exited with code {process.returncode}"
                return
            elif process is None and not state["hold"] and (lost_at is None or now - lost_at >= RECOVERY_S):
                cloud, region, zone = state["placements"][min(attempt, len(state["placements"]) - 1)]
                process = _start(job_id, job, attempt, cloud, region)
                job.update(
                    status="RUNNING", cloud=cloud, region=region, zone=zone, recovery_count=attempt,
                    cluster_resources=f"1x {cloud}({_accelerators(job)})", last_recovered_at=now,
                    start_at=job["start_at"] or now, current_cluster_name=f"{job['job_name']}-{job_id}",
                )  # fmt: skip
                job["attempts"].append({"attempt": attempt, "pid": process.pid, "cloud": cloud, "region": region})
        time.sleep(POLL_S)


def _accelerators(job: dict) -> str:
    return ", ".join(f"gpus={name}:{count}" for name, count in job["accelerators"].items())


def _start(job_id: str, job: dict, attempt: int, cloud: str, region: str) -> subprocess.Popen:
    scratch = Path(os.environ[STATE_ENV]).parent / f"job-{job_id}" / f"attempt-{attempt}"  # a fresh disk each time
    scratch.mkdir(parents=True)
    task = job["task"]
    env = {k: v for k, v in os.environ.items() if k not in task["secrets"] and k != STATE_ENV}
    env.update(task["envs"])
    env.update(task["secrets"])
    env.update(TMPDIR=str(scratch), FT_SCRATCH=str(scratch), SKYPILOT_CLUSTER_INFO=json.dumps(
        {"cluster_name": f"{job['job_name']}-{job_id}", "cloud": cloud, "region": region, "zone": None}))  # fmt: skip
    with open(scratch / "run.log", "w") as log:
        return subprocess.Popen(["bash", "-c", task["run"]], cwd=scratch, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip


def _kill(process: subprocess.Popen | None) -> None:
    """What a preempted or cancelled cluster does to its processes: they are gone, all of them, at once."""
    if process is not None and process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


if __name__ == "__main__":
    if sys.argv[1] == "sdk":
        install()
        sys.argv = sys.argv[2:]  # sdk_venv.py VERB ANSWER
        runpy.run_path(sys.argv[0], run_name="__main__")
    else:
        controller(sys.argv[2])
