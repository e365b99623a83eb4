"""What a SkyPilot managed job cost: its attempts, read from SkyPilot's queue, each priced where it ran.

SkyPilot's queue record of a managed job gives its running time over every attempt (``job_duration``),
when the current attempt started (``last_recovered_at``), the recovery count and the cloud, region,
instance and (``sdk_venv``: the catalog's) $/h it runs on now. ``SkyPilotRunLauncher`` brings the run
tag ``ft/sky-attempts`` up to date with each record its health checks read (``update_attempts``); an
attempt's running time is final once the next one is seen, or the job recovering. ``attempts_bill``
prices each attempt's paid time: its running time plus the gap before it (the first one's
provisioning; a later one's recovery, billed at that attempt's rate: an upper bound, since the wait
for capacity is not billed). ``training_cost`` reads the bill of the run that trained
(``adapter_bill``), with SkyPilot's last record of the job (run monitoring stops at the run's end,
seconds before the job's), and counts the egress of every attempt outside the data's region: each
one downloads the base model and the shards again.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

import dagster as dg
from dagster._core.storage.dagster_run import DagsterRun

from ft_assets.control.launcher import GPU, PoolRunLauncher
from ft_assets.providers import sdk_venv
from ft_assets.targets.skypilot import RUNNING

JOB_TAG, ATTEMPTS_TAG, SPOT_TAG = "ft/sky-job-id", "ft/sky-attempts", "ft/sky-spot"


def update_attempts(attempts: list[dict], record: Mapping[str, Any], now: float) -> list[dict]:
    """The attempts so far, brought up to date with one ``sky.jobs.queue`` record (see the module docstring).

    Each attempt: ``attempt`` (0 first), ``cloud``/``region``/``zone``/``instance``/``usd_per_hour`` (None until
    seen running; an attempt never seen is priced at the plan's rate), ``started_at``, ``seconds`` (running,
    SkyPilot's count), ``gap_seconds`` (before it: provisioning, or the recovery) and ``ended``.
    """
    attempts = [dict(a) for a in attempts]
    k = int(record.get("recovery_count") or 0)
    while len(attempts) <= k:
        attempts.append(
            {"attempt": len(attempts), "cloud": None, "region": None, "zone": None, "instance": None,
             "usd_per_hour": None, "started_at": None, "seconds": 0.0, "gap_seconds": 0.0, "ended": False}
        )  # fmt: skip
    total = float(record.get("job_duration") or 0.0)  # running seconds of every attempt so far
    status = record.get("status")
    if status == "RECOVERING":  # attempt k was lost; its running time is final
        _finish(attempts, k, total)
        return attempts
    started = record.get("last_recovered_at")
    if not started or started <= 0 or status in ("PENDING", "SUBMITTED", "STARTING"):
        return attempts
    end = record.get("end_at") or now
    current = max(0.0, end - started)
    if k > 0 and not attempts[k - 1]["ended"]:
        _finish(attempts, k - 1, total - current)
    attempt = attempts[k]
    if attempt["cloud"] is None and record.get("cloud"):
        attempt.update(
            cloud=record.get("cloud"), region=record.get("region"), zone=record.get("zone"),
            instance=record.get("cluster_resources"), usd_per_hour=record.get("usd_per_hour"),
        )  # fmt: skip
    attempt["started_at"] = started
    attempt["seconds"] = round(current, 3)
    if k == 0 and record.get("submitted_at"):
        attempt["gap_seconds"] = round(max(0.0, started - record["submitted_at"]), 3)
    elif k > 0 and attempts[k - 1]["started_at"]:
        lost_at = attempts[k - 1]["started_at"] + attempts[k - 1]["seconds"]
        attempt["gap_seconds"] = round(max(0.0, started - lost_at), 3)
    attempt["ended"] = status not in RUNNING
    return attempts


def _finish(attempts: list[dict], k: int, total_through_k: float) -> None:
    before = sum(a["seconds"] for a in attempts[:k])
    attempts[k]["seconds"] = round(max(0.0, total_through_k - before), 3)
    attempts[k]["ended"] = True


def attempts_bill(
    attempts: Sequence[Mapping[str, Any]], nodes: int, fallback_usd_per_hour: float, data_region: str | None = None
) -> dict[str, Any]:
    """The compute bill of every attempt: paid hours (running + the gap before it) at its cloud/region's price for
    all ``nodes`` (``fallback_usd_per_hour``, the plan's rate for all GPUs, where the catalog had none); and how many
    attempts ran outside ``data_region`` (each downloads the base model and shards across regions: egress)."""
    rows, total_usd, total_s = [], 0.0, 0.0
    for a in attempts:
        rate = a["usd_per_hour"] * nodes if a.get("usd_per_hour") is not None else fallback_usd_per_hour
        paid = a["seconds"] + a["gap_seconds"]
        usd = rate * paid / 3600
        rows.append({**a, "usd_per_hour_all_nodes": rate, "paid_seconds": paid, "usd": usd})
        total_usd += usd
        total_s += paid
    outside = sum(1 for a in attempts if data_region is not None and a.get("region") != data_region)
    return {
        "attempts": rows,
        "paid_seconds": total_s,
        "compute_usd": total_usd,
        "recoveries": max(0, len(rows) - 1),
        "attempts_outside_data_region": outside,
    }


def sdk_python_of(instance) -> str | None:
    """The SkyPilot venv's python the instance's gpu pool calls (its ``python``); None: ``sdk_venv``'s default."""
    launcher = instance.run_launcher
    if isinstance(launcher, PoolRunLauncher):
        launcher = launcher.launcher(GPU)
    return getattr(launcher, "python", None)


def run_bill(
    instance, run: DagsterRun, nodes: int, fallback_usd_per_hour: float, data_region: str | None
) -> dict | None:
    """The bill of a run the SkyPilot pool launched (None for any other run): its attempts as the launcher's health
    checks recorded them, brought up to date with SkyPilot's last record of the job (run monitoring stops checking
    when the run finishes, before the job does); ``note`` says which."""
    if JOB_TAG not in run.tags:
        return None
    attempts = json.loads(run.tags.get(ATTEMPTS_TAG, "[]"))
    job = run.tags[JOB_TAG]
    note = f"SkyPilot managed job {job}: attempts as SkyPilot reported them to run monitoring"
    request = {"job_ids": [int(job)], "use_spot": run.tags.get(SPOT_TAG) == "true"}
    try:
        records = sdk_venv.call("sky.queue", request, python=sdk_python_of(instance))
        if records:
            attempts = update_attempts(attempts, records[0], time.time())
            note = f"SkyPilot managed job {job} ({records[0]['status']}): every attempt as SkyPilot's queue reports it"
    except sdk_venv.SdkError as exc:
        note += f" (its queue did not answer now: {exc})"
    return {**attempts_bill(attempts, nodes, fallback_usd_per_hour, data_region), "note": note}


def adapter_bill(instance, partition: str, plan_stats: Mapping[str, Any]) -> dict | None:
    """The SkyPilot bill of the run that materialized the partition's newest lora_adapter; None if another pool ran it."""
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey("lora_adapter"), asset_partitions=[partition]), limit=1
    ).records
    run = instance.get_run_by_id(records[0].run_id) if records else None
    if run is None:
        return None
    rate = plan_stats.get("usd_per_hour") or 0.0
    return run_bill(instance, run, int(plan_stats.get("nodes") or 1), rate, plan_stats.get("data_region"))
