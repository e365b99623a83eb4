"""SkyPilot clusters for the idle sensor, through SkyPilot's SDK (``sky.status``, ``sky.stop``, ``sky.down``)
in its venv (``sdk_venv``).

A cluster is ours when its name starts with ``RentedWorkersResource.skypilot_prefix`` (``ft-``: the
SkyPilot gpu pool names its managed jobs ``ft-<run>``, whose clusters are ``ft-<run>-<job id>``) and it
is UP. It counts as started at ``launched_at``. Most never need the sensor: a managed job's cluster is
autodowned by the jobs controller 5 idle minutes after its job ends, and the tasks the pool builds carry
``autostop`` (down after the idle threshold) for anyone who ``sky launch``es them. What is left is a
cluster whose controller was lost, or one started by hand: ``sky.stop`` keeps its disks (SkyPilot
refuses it for spot clusters except on GCP, and on RunPod, Lambda and Kubernetes: the refusal is
logged; use ``skypilot_action: down`` there), ``sky.down`` tears it down.
"""

from __future__ import annotations

from datetime import datetime, timezone

from ft_assets.control.idle_backends import RentedWorker
from ft_assets.providers import sdk_venv
from ft_assets.providers.worker_identity import SKY


def list_workers(resource, now: datetime) -> list[RentedWorker]:
    rows = sdk_venv.call("sky.clusters", {}, python=resource.python or None)
    workers = []
    for row in rows:
        if row.get("status") != "UP" or not str(row.get("name", "")).startswith(resource.skypilot_prefix):
            continue
        launched = row.get("launched_at")
        workers.append(
            RentedWorker(
                provider="skypilot",
                worker_id=row["name"],
                tag=f"{SKY}{row['name']}",
                what=row.get("resources_str") or f"{row.get('cloud')} {row.get('region')}",
                spot="[spot]" in str(row.get("resources_str", "")).lower(),
                started_at=datetime.fromtimestamp(launched, timezone.utc)
                if isinstance(launched, int | float)
                else None,
                usd_per_hour=None,
            )
        )
    return workers


def action(resource) -> str:
    return resource.skypilot_action


def shut_down(resource, worker: RentedWorker) -> str | None:
    """``sky.stop`` or ``sky.down`` the cluster (``resource.skypilot_action``); SkyPilot's refusal, else None.
    SkyPilot has no dry-run call: a dry run does nothing here."""
    if resource.dry_run:
        return None
    verb = "sky.down" if resource.skypilot_action == "down" else "sky.stop"
    try:
        sdk_venv.call(verb, {"cluster": worker.worker_id}, python=resource.python or None)
    except sdk_venv.SdkError as exc:
        return str(exc)
    return None
