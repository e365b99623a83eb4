"""The run command of a SkyPilot managed job: ``dagster api execute_run`` on its first attempt, ``resume_run`` after.

``SkyPilotRunLauncher`` submits ``python -m ft_assets.providers.sky_attempt '<ExecuteRunArgs>'``. SkyPilot
relaunches a preempted managed job (``job_recovery``) by running the task's command again, on a new
cluster with none of the old one's disk, and tells the attempt nothing about being one. Dagster's
``execute_run`` refuses a run that is already started (with run monitoring on, it ignores it and exits
0, so the job would "succeed" with the run still unfinished); ``resume_run`` is how Dagster continues a
run whose worker died (run monitoring runs it for Kubernetes). So the run's own status decides:

| the run is | the attempt runs |
|---|---|
| NOT_STARTED or STARTING (launched, no worker yet) | ``dagster api execute_run`` |
| STARTED (an earlier attempt ran and was lost) | ``dagster api resume_run``: the steps run again, and ``lora_adapter`` resumes from the newest complete checkpoint in the store |
| finished or canceling (a recovery raced the run's end, or a cancel) | nothing; exits 0 |

Both commands are Dagster's own, run by this python (``python -m dagster``), with the launcher's
arguments; nothing of the execution is ft-assets'.
"""

from __future__ import annotations

import os
import sys

from dagster import DagsterInstance, DagsterRunStatus
from dagster._grpc.types import ExecuteRunArgs, ResumeRunArgs
from dagster._serdes import deserialize_value, serialize_value

FRESH = (DagsterRunStatus.NOT_STARTED, DagsterRunStatus.STARTING)


def attempt_command(args: ExecuteRunArgs, status: DagsterRunStatus, python: str = sys.executable) -> list[str] | None:
    """The Dagster command this attempt runs for a run in ``status`` (table above); None when it is finished."""
    if status in FRESH:
        return [python, "-m", "dagster", "api", "execute_run", serialize_value(args)]
    if status == DagsterRunStatus.STARTED:
        resume = ResumeRunArgs(args.job_origin, args.run_id, args.instance_ref, args.set_exit_code_on_failure)
        return [python, "-m", "dagster", "api", "resume_run", serialize_value(resume)]
    return None


def main(argv: list[str]) -> int:
    args = deserialize_value(argv[0], ExecuteRunArgs)
    instance = DagsterInstance.from_ref(args.instance_ref) if args.instance_ref else DagsterInstance.get()
    run = instance.get_run_by_id(args.run_id)
    if run is None:
        print(f"ft-assets: run {args.run_id} is not in the Dagster instance; nothing to run", file=sys.stderr)
        return 1
    command = attempt_command(args, run.status)
    instance.dispose()
    if command is None:
        print(f"ft-assets: run {args.run_id} is already {run.status.value}; this attempt has nothing to do")
        return 0
    print(f"ft-assets: run {args.run_id} is {run.status.value}: dagster api {command[4]}", flush=True)
    os.execv(command[0], command)
    return 1  # not reached: execv replaces this process


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
