"""Which rented machine runs this training run: the run tag ``ft/worker-instance-id`` the idle sensor reads.

The idle-shutdown sensor (``ft_assets.control.shutdown`` and ``ft_assets.control.rented_workers``) never
stops a worker with an unfinished run tied to it, and only the worker knows where it is. Each provider
tells its machines who they are; the tag value names the provider so that ids never collide:

| where | value | from |
|---|---|---|
| a SkyPilot cluster (a managed job's too) | ``sky:<cluster name>`` | ``SKYPILOT_CLUSTER_INFO``, set by SkyPilot in every task |
| a RunPod pod | ``runpod:<pod id>`` | ``RUNPOD_POD_ID``, set by RunPod in every pod |
| a Vast.ai instance | ``vast:<instance id>`` | ``CONTAINER_ID``, set by Vast.ai in every container |
| an EC2 instance | ``i-...`` | IMDSv2 (``ec2_metadata.worker_instance_tag``) |

A SkyPilot cluster comes first: on a RunPod pod or EC2 instance that SkyPilot rented, the cluster is what
its sensor backend stops. The environment is read before IMDS: free, where IMDS costs its 0.5 s timeout
off EC2.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

from ft_assets.providers.ec2_metadata import WORKER_TAG, worker_instance_tag

SKY, RUNPOD, VAST = "sky:", "runpod:", "vast:"  # tag value prefixes, one per provider


def worker_tag(env: Mapping[str, str] = os.environ) -> dict[str, str]:
    """``{WORKER_TAG: <this machine>}`` (table above), or ``{}`` when it is none of them (a laptop, CI)."""
    cluster = env.get("SKYPILOT_CLUSTER_INFO")
    if cluster:
        try:
            name = json.loads(cluster).get("cluster_name")
        except ValueError:
            name = None
        if name:
            return {WORKER_TAG: f"{SKY}{name}"}
    if env.get("RUNPOD_POD_ID"):
        return {WORKER_TAG: f"{RUNPOD}{env['RUNPOD_POD_ID']}"}
    if env.get("CONTAINER_ID"):
        return {WORKER_TAG: f"{VAST}{env['CONTAINER_ID']}"}
    return worker_instance_tag()
