"""Idle shutdown of rented GPU machines: one registry of providers (``PROVIDERS``), one set of rules.

``idle_gpu_worker_sensor`` (``shutdown.py``) calls ``rented_tick`` once a tick for EC2 (when ``ec2_workers`` has a
region) and the providers listed in ``RentedWorkersResource.providers``; each provider is one module of
``idle_backends``, which lists the machines ft-assets may touch and stops or removes one:

| provider | ours when | stop (default) | remove | notes |
|---|---|---|---|---|
| ``ec2`` (boto3, the AWS credential chain; settings ``ec2_workers``) | the instance is tagged ``ft-assets:role=gpu-worker`` | ``StopInstances``: the root volume kept and billed | ``TerminateInstances`` | a one-time spot instance can only be terminated: the refusal is logged; the heartbeat tag ``ft-assets:last-active`` counts as activity; a dry run is EC2's ``DryRun=True`` call, which checks the IAM permission |
| ``runpod`` (``runpod`` SDK, ``RUNPOD_API_KEY``) | the pod's env has ``FT_ASSETS_ROLE=gpu-worker`` | ``podStop``: GPU released, the volume disk (``/workspace``) kept and billed | ``podTerminate`` | a network volume survives both; RunPod refused to stop such pods before May 2026: the refusal is logged, never turned into a terminate |
| ``vast`` (``vastai`` SDK, ``VAST_API_KEY``) | the instance's env has ``FT_ASSETS_ROLE=gpu-worker`` | ``stop_instance``: the disk is kept and billed, the GPU may be rented by someone else meanwhile | ``destroy_instance`` | |
| ``skypilot`` (``sky.status``) | the cluster's name starts with ``skypilot_prefix`` (``ft-``) | ``sky.stop`` (SkyPilot refuses it for spot clusters but GCP's, and on RunPod, Lambda, Kubernetes) | ``sky.down`` | a managed job's cluster is autodowned by its controller (5 idle min); tasks that ft-assets builds carry ``autostop`` for a ``sky launch`` of them |

The rules (``find_idle``): idle since the latest of the machine's start, its heartbeat and the end of each run tied
to it by the run tag ``ft/worker-instance-id`` (``ft_assets.providers.worker_identity``: ``i-...``, ``runpod:<pod>``,
``vast:<id>``, ``sky:<cluster>``); never a machine with an unfinished run tied to it, never one whose start time or
heartbeat cannot be read, and nothing while a gpu-pool run is started without a worker tag (the sensor checks that
before calling here). One threshold for all: ``ec2_workers.idle_minutes``. Only EC2 has a dry-run call; elsewhere a
dry run lists and reports only, without checking that the API key may stop anything.

Adding a provider: its module in ``idle_backends``, its entry in ``PROVIDERS`` and its action field here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal

import dagster as dg
from pydantic import Field

from ft_assets.control.idle_backends import RentedWorker, ec2, runpod, skypilot_clusters, vast

PROVIDERS = {"ec2": ec2, "runpod": runpod, "vast": vast, "skypilot": skypilot_clusters}  # the registration line
DONE = {"stop": "stopped", "terminate": "terminated", "destroy": "destroyed", "down": "tore down"}  # for the log
RunsOf = Callable[[Sequence[str]], Mapping[str, Sequence[Any]]]  # worker tags -> their runs (shutdown.WorkerRun)


class RentedWorkersResource(dg.ConfigurableResource):
    """The marketplace and SkyPilot machines the idle sensor may stop, and what it does to them. The idle threshold
    is the sensor's one, ``ec2_workers.idle_minutes``, for every provider.

    Credentials are the SDKs' own: ``RUNPOD_API_KEY`` (and ``RUNPOD_API_BASE_URL``), ``VAST_API_KEY``,
    SkyPilot's API server (``SKYPILOT_API_SERVER_ENDPOINT`` or its local one)."""

    providers: list[str] = Field(
        default=[],
        description="Which to watch besides EC2 (set up in ec2_workers): any of runpod, vast, skypilot. Empty: none.",
    )
    runpod_action: Literal["stop", "terminate"] = Field(
        default="stop", description="'stop' keeps the pod's volume disk (billed); 'terminate' deletes the pod."
    )
    vast_action: Literal["stop", "destroy"] = Field(
        default="stop", description="'stop' keeps the instance's disk (billed); 'destroy' deletes the instance."
    )
    skypilot_action: Literal["stop", "down"] = Field(
        default="stop", description="'stop' keeps the cluster's disks (not possible for spot); 'down' tears it down."
    )
    skypilot_prefix: str = Field(default="ft-", description="SkyPilot clusters whose name starts with this are ours.")
    vast_url: str = Field(default="", description="Vast.ai's API server. Empty: the SDK's (console.vast.ai).")
    python: str = Field(default="", description="The python of the SkyPilot/Vast.ai venv. Empty: $FT_SKYPILOT_PYTHON.")
    dry_run: bool = Field(default=False, description="Only log what would be done (no provider has a dry-run call).")

    def watched(self) -> dict[str, RentedWorkersResource]:
        """provider -> the settings its module reads (this resource), for each of ``providers``."""
        choices = [provider for provider in PROVIDERS if provider != "ec2"]
        unknown = [p for p in self.providers if p not in choices]
        if unknown:
            raise ValueError(
                f"rented_workers.providers: unknown {unknown}; use any of {', '.join(choices)} "
                "(EC2 is watched through ec2_workers)"
            )
        return {provider: self for provider in self.providers}


@dataclass(frozen=True)
class IdleRented:
    worker: RentedWorker
    idle_since: datetime
    last_activity: str  # "start", "heartbeat" or "run <id> ended"
    idle_for: timedelta


def find_idle(
    workers: Iterable[RentedWorker], runs: Mapping[str, Sequence[Any]], now: datetime, threshold: timedelta
) -> list[IdleRented]:
    """Workers idle longer than ``threshold``: none with an unsettled run (``shutdown.WorkerRun`` without an end), an
    unreadable start time or an unreadable heartbeat."""
    idle = []
    for worker in workers:
        tied = runs.get(worker.tag, ())
        if worker.started_at is None or worker.unreadable or any(run.ended_at is None for run in tied):
            continue
        signals = [(worker.started_at, "start")]
        if worker.last_active is not None:
            signals.append((worker.last_active, "heartbeat"))
        signals += [(run.ended_at, f"run {run.run_id} ended") for run in tied if run.ended_at is not None]
        since, what = max(signals, key=lambda signal: signal[0])
        if now - since > threshold:
            idle.append(IdleRented(worker, since, what, now - since))
    return idle


def describe(idle: IdleRented, verb: str) -> str:
    w = idle.worker
    priced_by = w.priced_by or f"{w.provider}'s price"
    price = f"; saves ~${w.usd_per_hour:.2f}/h ({priced_by})" if w.usd_per_hour is not None else ""
    return (
        f"{verb} {w.provider} {w.worker_id} ({w.what}{', spot' if w.spot else ''}), idle "
        f"{int(idle.idle_for.total_seconds() // 60)} min since {idle.idle_since:%Y-%m-%d %H:%M} UTC ({idle.last_activity}){price}"
    )


def rented_tick(context, watched: Mapping[str, Any], now: datetime, threshold: timedelta, runs_of: RunsOf) -> list[str]:
    """One tick over the ``watched`` providers (provider -> the settings its module reads): a summary line each; each
    action logged. ``runs_of``: the runs tied to each worker tag (the sensor's ``shutdown.runs_by_worker``)."""
    summaries = []
    for provider, settings in watched.items():
        backend = PROVIDERS[provider]
        try:
            workers = backend.list_workers(settings, now)
        except Exception as exc:  # an API error skips this provider's tick, never the others'
            context.log.warning(f"could not list {provider} workers, trying again next tick: {exc}")
            summaries.append(f"{provider}: listing failed ({exc})")
            continue
        for worker in workers:
            if worker.started_at is None or worker.unreadable:
                why = worker.unreadable or "its start time cannot be read"
                context.log.warning(f"{provider} {worker.worker_id}: {why}; it stays up")
        idle = find_idle(workers, runs_of([w.tag for w in workers]), now, threshold)
        if not idle:
            minutes = threshold.total_seconds() / 60
            summaries.append(f"{provider}: {len(workers)} worker(s), none idle for more than {minutes:g} min")
            continue
        action = backend.action(settings)
        done = []
        for item in idle:  # one call per machine, so that one refusal does not block the rest
            error = backend.shut_down(settings, item.worker)
            if error:
                context.log.warning(describe(item, f"could not {action}") + f": {error}")
            else:
                context.log.info(describe(item, f"dry run: would {action}" if settings.dry_run else DONE[action]))
                done.append(item)
        prices = [item.worker.usd_per_hour for item in done if item.worker.usd_per_hour is not None]
        verb = f"would {action}" if settings.dry_run else action
        summary = f"{provider}: {len(workers)} worker(s), {verb} {len(done)} idle"
        if done:
            ids = ", ".join(item.worker.worker_id for item in done)
            summary += f" ({ids}" + (f"; ~${sum(prices):.2f}/h" if prices else "") + ")"
        if len(done) < len(idle):
            summary += f", {len(idle) - len(done)} refused (see the log)"
        summaries.append(summary)
    return summaries
