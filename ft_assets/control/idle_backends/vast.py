"""Vast.ai instances for the idle sensor, through the ``vastai`` SDK (``show_instances``, ``stop_instance``,
``destroy_instance``), run in the SkyPilot venv (``sdk_venv``: vastai pins cryptography 49 and pillow 12.2).

An instance is ours when its env has ``FT_ASSETS_ROLE=gpu-worker``. It counts as started at the later of
its ``start_date`` and ``uptime_mins`` ago (a restarted instance gets a fresh allowance), is spot when it
is an interruptible bid (``is_bid``), and costs ``dph_total``. Stopping keeps its disk (billed per GB
while stopped) but not its GPU: the host may rent it out, so a restart can wait for it; destroying
deletes the instance and its disk.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from ft_assets.control.idle_backends import ROLE_ENV, RentedWorker
from ft_assets.providers import sdk_venv
from ft_assets.providers.worker_identity import VAST


def list_workers(resource, now: datetime) -> list[RentedWorker]:
    rows = sdk_venv.call("vast.instances", {"server_url": resource.vast_url}, python=resource.python or None)
    workers = []
    for row in rows:
        env = row.get("extra_env") or {}
        if row.get("actual_status") != "running" or env.get(ROLE_ENV[0]) != ROLE_ENV[1]:
            continue
        workers.append(
            RentedWorker(
                provider="vast",
                worker_id=str(row["id"]),
                tag=f"{VAST}{row['id']}",
                what=f"{row.get('num_gpus') or '?'} x {row.get('gpu_name') or 'GPU'}",
                spot=bool(row.get("is_bid")),
                started_at=_started(row, now),
                usd_per_hour=row.get("dph_total"),
            )
        )
    return workers


def _started(row: dict, now: datetime) -> datetime | None:
    """The later of the instance's creation and its last start; None when neither is a number."""
    times = []
    if isinstance(row.get("start_date"), int | float):
        times.append(datetime.fromtimestamp(row["start_date"], timezone.utc))
    if isinstance(row.get("uptime_mins"), int | float):
        times.append(now - timedelta(minutes=row["uptime_mins"]))
    return max(times) if times else None


def action(resource) -> str:
    return resource.vast_action


def shut_down(resource, worker: RentedWorker) -> str | None:
    """Stop or destroy the instance (``resource.vast_action``); the API's refusal as one line, else None. Vast.ai has
    no dry-run call: a dry run does nothing here."""
    if resource.dry_run:
        return None
    verb = "vast.destroy" if resource.vast_action == "destroy" else "vast.stop"
    try:
        reply = sdk_venv.call(
            verb, {"id": worker.worker_id, "server_url": resource.vast_url}, python=resource.python or None
        )
    except sdk_venv.SdkError as exc:
        return str(exc)
    if isinstance(reply, dict) and reply.get("success") is False:
        return str(reply.get("msg") or reply.get("error") or reply)
    return None
