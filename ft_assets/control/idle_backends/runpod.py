"""RunPod pods for the idle sensor, through the ``runpod`` SDK (its GraphQL API: ``myself { pods }``,
``podStop``, ``podTerminate``).

A pod is ours when its env has ``FT_ASSETS_ROLE=gpu-worker`` (put it in the pod's template). It counts
as started ``uptimeSeconds`` ago (RunPod restarts the count when a stopped pod is resumed, like EC2's
LaunchTime), is spot when its ``podType`` is ``INTERRUPTABLE``, and costs ``costPerHr``. Stopping
releases the GPU and keeps the volume disk (``/workspace``, billed while stopped); terminating deletes
the pod and its disks. A network volume is not the pod's: its data survives stop and terminate alike
and it bills until deleted in RunPod's console. RunPod refused ``podStop`` for pods with a network
volume until May 2026 (terminate only); such a refusal is logged and the pod left up, never terminated
instead.
"""

from __future__ import annotations

import os
from datetime import datetime, timedelta

from ft_assets.control.idle_backends import ROLE_ENV, RentedWorker
from ft_assets.providers.worker_identity import RUNPOD


def list_workers(resource, now: datetime) -> list[RentedWorker]:
    runpod = _sdk()
    workers = []
    for pod in runpod.get_pods():
        env = dict(item.split("=", 1) for item in (pod.get("env") or []) if "=" in item)
        if pod.get("desiredStatus") != "RUNNING" or env.get(ROLE_ENV[0]) != ROLE_ENV[1]:
            continue
        uptime = pod.get("uptimeSeconds")
        started = now - timedelta(seconds=uptime) if isinstance(uptime, int | float) and uptime >= 0 else None
        gpu = (pod.get("machine") or {}).get("gpuDisplayName") or "GPU"
        workers.append(
            RentedWorker(
                provider="runpod",
                worker_id=pod["id"],
                tag=f"{RUNPOD}{pod['id']}",
                what=f"{pod.get('gpuCount') or '?'} x {gpu}",
                spot=pod.get("podType") == "INTERRUPTABLE",
                started_at=started,
                usd_per_hour=pod.get("costPerHr"),
            )
        )
    return workers


def action(resource) -> str:
    return resource.runpod_action


def shut_down(resource, worker: RentedWorker) -> str | None:
    """Stop or terminate the pod (``resource.runpod_action``); the API's refusal as one line, else None. RunPod has no
    dry-run call: a dry run does nothing here."""
    from runpod.error import RunPodError

    if resource.dry_run:
        return None
    runpod = _sdk()
    try:
        if resource.runpod_action == "terminate":
            runpod.terminate_pod(worker.worker_id)
        else:
            runpod.stop_pod(worker.worker_id)
    except (RunPodError, OSError) as exc:  # QueryError (a GraphQL error), AuthenticationError, the network
        return f"{type(exc).__name__}: {exc}"
    return None


def _sdk():
    """The runpod module with its API key: $RUNPOD_API_KEY, else the key ``runpod config`` saved."""
    import runpod

    runpod.api_key = os.environ.get("RUNPOD_API_KEY") or runpod.api_key
    if not runpod.api_key:
        raise ValueError("no RunPod API key: set RUNPOD_API_KEY (or run `runpod config`) on the control host")
    return runpod
