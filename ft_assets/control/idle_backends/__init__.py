"""The providers the idle sensor watches beside EC2, one module each, and what it knows of their machines.

Each module has ``list_workers(resource, now) -> list[RentedWorker]`` (the machines ft-assets may touch) and
``shut_down(resource, worker) -> error | None``; ``ft_assets.control.rented_workers`` holds the settings
(``RentedWorkersResource``) and applies the rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Literal

ROLE_ENV = ("FT_ASSETS_ROLE", "gpu-worker")  # in a pod's / instance's env: a machine ft-assets may stop
Provider = Literal["runpod", "vast", "skypilot"]


@dataclass(frozen=True)
class RentedWorker:
    """One machine of a provider, as its API describes it."""

    provider: Provider
    worker_id: str  # the provider's id: pod id, instance id, cluster name
    tag: str  # the ft/worker-instance-id value of runs on it
    what: str  # e.g. "1 x RTX 4090"
    spot: bool
    started_at: datetime | None  # None: unreadable, and the machine is never touched
    usd_per_hour: float | None  # the provider's own price of the machine, when its API says
