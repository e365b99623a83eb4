"""The providers the idle sensor watches, one module each, and what it knows of their machines.

Each module has ``list_workers(resource, now) -> list[RentedWorker]`` (the machines ft-assets may touch),
``action(resource) -> str`` (the verb its settings ask for) and ``shut_down(resource, worker) -> error | None``
(which honours ``resource.dry_run``); ``resource`` is the provider's settings, ``ec2_workers`` for EC2 and
``rented_workers`` for the others. ``ft_assets.control.rented_workers`` registers the modules and applies the rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Literal

ROLE_ENV = ("FT_ASSETS_ROLE", "gpu-worker")  # in a pod's / instance's env: a machine ft-assets may stop
Provider = Literal["ec2", "runpod", "vast", "skypilot"]


@dataclass(frozen=True)
class RentedWorker:
    """One machine of a provider, as its API describes it."""

    provider: Provider
    worker_id: str  # the provider's id: instance id, pod id, cluster name
    tag: str  # the ft/worker-instance-id value of runs on it
    what: str  # e.g. "1 x RTX 4090"
    spot: bool
    started_at: datetime | None  # None: unreadable, and the machine is never touched
    usd_per_hour: float | None  # the machine's price, when its API (or the cost model) says
    priced_by: str = ""  # where usd_per_hour comes from when not the provider's own price
    last_active: datetime | None = None  # the machine's own heartbeat, where it keeps one (EC2's tag)
    unreadable: str = ""  # why its heartbeat cannot be read: the machine is never touched
