"""Where a ``lora_adapter`` step runs, as the step needs to know it: the one object it asks about its provider.

``current()`` is a ``SlurmJob`` when Slurm started this process (the Slurm gpu pool: ``ft_assets.control.slurm``),
else a ``Machine`` (a laptop, a rented pod, an EC2 instance, a Kubernetes pod). Either answers:

| question | ``Machine`` | ``SlurmJob`` |
|---|---|---|
| ``tags()``: the run tags that tie the run to where it runs (idle shutdown) | the rented machine (``worker_identity``) | and the job id and its nodes |
| ``billing()``: what the run is billed as | ``FT_GPU_TIER`` / ``FT_RENTAL_MODE`` if declared | rental mode ``slurm`` unless declared |
| ``billed_since(now)``: when the bill started | now | the allocation's start |
| ``restarted()``: a line for the log about this start | None | the requeue, if any |
| ``rendezvous()``: node 0's address of a multi-node run | this pod's (Kubernetes) | this node's |
| ``peer_nodes(...)``: nodes 1..M-1 | an indexed Kubernetes Job | an ``srun`` step of the job |
| ``after_stop(...)``: what a SIGTERM meant, checkpoint saved | a preemption (returns) | a requeue or a cancel may end the step otherwise |

A GPU target's worker (``ft_assets.training.remote``) does not ask: it is one attempt of a run whose step runs on the
control host, and the target's session records where it ran.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

from ft_assets.providers import slurm_job
from ft_assets.providers.worker_identity import worker_tag
from ft_assets.training.launch import WorkerJob
from ft_assets.training.nodes import PeerNodes, rendezvous_endpoint
from ft_assets.training.preemption import Preempted

Log = Callable[[str], None]


class Machine:
    """A step on any machine Slurm did not start."""

    def __init__(self, env: Mapping[str, str] = os.environ):
        self.env = env

    def tags(self) -> dict[str, str]:
        return worker_tag(self.env)

    def billing(self) -> dict[str, str]:
        """What the worker declared it is billed as (``FT_GPU_TIER``, ``FT_RENTAL_MODE``), for ``training_cost``."""
        return {key: self.env[key] for key in ("FT_GPU_TIER", "FT_RENTAL_MODE") if self.env.get(key)}

    def billed_since(self, monotonic_now: float) -> float:
        return monotonic_now

    def restarted(self) -> str | None:
        return None

    def rendezvous(self) -> str:
        return rendezvous_endpoint()

    def peer_nodes(self, job: WorkerJob, endpoint: str, log: Log):
        return PeerNodes(job, endpoint, log)

    def after_stop(self, context, exc: Preempted, run_prefix: str) -> None:
        """Returns: the caller fails the run as preempted, and the run retry resumes it."""


class SlurmJob(Machine):
    """A step inside a Slurm job (``slurm_job``: its variables, its signals, its billing)."""

    def tags(self) -> dict[str, str]:
        return super().tags() | slurm_job.job_tags(self.env)

    def billing(self) -> dict[str, str]:
        """In a Slurm job the rental mode defaults to ``slurm`` (the allocation's GPU-hour)."""
        return {"FT_RENTAL_MODE": "slurm", **super().billing()}

    def billed_since(self, monotonic_now: float) -> float:
        return slurm_job.billed_since(monotonic_now, self.env)

    def restarted(self) -> str | None:
        restarts = slurm_job.restart_count(self.env)
        return f"Slurm requeued job {self.env['SLURM_JOB_ID']} (restart {restarts})" if restarts else None

    def rendezvous(self) -> str:
        return slurm_job.rendezvous_endpoint(self.env)

    def peer_nodes(self, job: WorkerJob, endpoint: str, log: Log):
        return slurm_job.SlurmPeerNodes(job, endpoint, log)

    def after_stop(self, context, exc: Preempted, run_prefix: str) -> None:
        slurm_job.act_on_signalled_stop(context, exc, run_prefix, self.env)


def current(env: Mapping[str, str] = os.environ) -> Machine:
    """Where this process runs: a Slurm job's step, or any other machine."""
    return SlurmJob(env) if slurm_job.in_slurm_job(env) else Machine(env)
