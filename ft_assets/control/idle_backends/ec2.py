"""EC2 instances for the idle sensor, through boto3 (``DescribeInstances``, ``StopInstances``,
``TerminateInstances``), with the settings of ``ec2_workers`` (``shutdown.Ec2WorkersResource``).

An instance is ours when it is running and tagged ``ft-assets:role = gpu-worker`` (``role_tag_key`` /
``role_tag_value``; put the tag in the worker's launch template). It counts as started at its
``LaunchTime`` (EC2 resets it on every start, so a restarted worker gets a fresh allowance), as active
at its optional ``ft-assets:last-active`` tag (ISO 8601, for a worker busy with work Dagster does not
see; it needs ``ec2:CreateTags`` on itself), and costs the cost model's price of its GPUs (``EC2_GPUS``).
Stopping keeps the root volume, so a restarted worker finds its downloaded base model again, and bills
only that disk (gp3: $0.08/GB-month); terminating frees everything and is the only choice for one-time
spot instances, which EC2 refuses to stop (the refusal is logged, never turned into a terminate). A dry
run sends the same calls with ``DryRun=True``: nothing changes, but EC2 checks the IAM permission.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from ft_assets.control.cost_model import CostModel
from ft_assets.control.idle_backends import RentedWorker

ROLE_TAG_KEY = "ft-assets:role"  # EC2 instance tag that marks a machine as ours to stop
ROLE_TAG_VALUE = "gpu-worker"
HEARTBEAT_TAG = "ft-assets:last-active"  # optional EC2 instance tag, ISO 8601, refreshed by the worker

# EC2 GPU instance types -> (default cost-model offering, GPUs per instance), to log the $/h a stop saves.
# The price is the cost model's per-GPU price, not the EC2 list price (g5.xlarge lists $1.006/h).
EC2_GPUS: dict[str, tuple[str, int]] = {
    **{f"g5.{size}": ("a10g-24gb", 1) for size in ("xlarge", "2xlarge", "4xlarge", "8xlarge", "16xlarge")},
    **{f"g5.{size}": ("a10g-24gb", 4) for size in ("12xlarge", "24xlarge")},
    "g5.48xlarge": ("a10g-24gb", 8),
    **{f"g6.{size}": ("l4-24gb", 1) for size in ("xlarge", "2xlarge", "4xlarge", "8xlarge", "16xlarge")},
    **{f"g6.{size}": ("l4-24gb", 4) for size in ("12xlarge", "24xlarge")},
    "g6.48xlarge": ("l4-24gb", 8),
    "p4d.24xlarge": ("a100-40gb", 8),
    "p4de.24xlarge": ("a100-80gb", 8),
    "p5.48xlarge": ("h100-80gb", 8),
}


def list_workers(resource, now: datetime) -> list[RentedWorker]:
    key, value = resource.role_tag
    filters = [{"Name": f"tag:{key}", "Values": [value]}, {"Name": "instance-state-name", "Values": ["running"]}]
    pages = resource.client().get_paginator("describe_instances").paginate(Filters=filters)
    return [
        as_worker(instance)
        for page in pages
        for reservation in page["Reservations"]
        for instance in reservation["Instances"]
    ]


def as_worker(instance: Mapping[str, Any]) -> RentedWorker:
    """One EC2 DescribeInstances entry as the sensor sees it."""
    tags = {tag["Key"]: tag["Value"] for tag in instance.get("Tags", [])}
    instance_type = instance.get("InstanceType", "?")
    spot = instance.get("InstanceLifecycle") == "spot"
    try:
        heartbeat, unreadable = read_heartbeat(tags), ""
    except ValueError as exc:
        heartbeat, unreadable = None, str(exc)
    price, gpus = None, ""
    if instance_type in EC2_GPUS:
        name, count = EC2_GPUS[instance_type]
        per_gpu = CostModel().offering(name).usd_per_hour("spot" if spot else "on_demand")
        price, gpus = None if per_gpu is None else per_gpu * count, f"{count} x {name}, cost model"
    return RentedWorker(
        provider="ec2",
        worker_id=instance["InstanceId"],
        tag=instance["InstanceId"],
        what=instance_type,
        spot=spot,
        started_at=instance.get("LaunchTime"),
        usd_per_hour=price,
        priced_by=gpus,
        last_active=heartbeat,
        unreadable=unreadable,
    )


def read_heartbeat(tags: Mapping[str, str]) -> datetime | None:
    """The ``ft-assets:last-active`` tag as an aware datetime (naive = UTC); None when absent."""
    value = tags.get(HEARTBEAT_TAG)
    if value is None:
        return None
    try:
        moment = datetime.fromisoformat(value.strip())
    except ValueError:
        raise ValueError(
            f"instance tag {HEARTBEAT_TAG}={value!r} is not an ISO 8601 timestamp; write e.g. '2026-01-31T14:05:00Z'"
        ) from None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=timezone.utc)


def action(resource) -> str:
    return resource.action


def shut_down(resource, worker: RentedWorker) -> str | None:
    """Stop or terminate the instance (``resource.action``; ``DryRun=True`` in a dry run); EC2's refusal, else None."""
    client = resource.client()
    call = client.stop_instances if resource.action == "stop" else client.terminate_instances
    try:
        call(InstanceIds=[worker.worker_id], DryRun=resource.dry_run)
    except ClientError as exc:
        error = exc.response.get("Error", {})
        if resource.dry_run and error.get("Code") == "DryRunOperation":  # EC2's answer to an allowed dry run
            return None
        return f"{error.get('Code', '')}: {error.get('Message', exc)}"
    except BotoCoreError as exc:
        return str(exc)
    return None
