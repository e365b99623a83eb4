"""EC2 instance metadata (IMDSv2) as a training worker reads it: which instance it is.

The control plane's idle-shutdown sensor (``ft_assets.control.shutdown``) ties runs to workers by the
run tag ``WORKER_TAG``, which only the worker can set: the launcher does not know where the pool
places a run. Off EC2 the metadata address does not answer and the worker sets nothing.
"""

from __future__ import annotations

import http.client
import os
import urllib.request

WORKER_TAG = "ft/worker-instance-id"  # Dagster run tag: the EC2 instance the run ran on
IMDS_TIMEOUT_S = 0.5  # IMDS answers in milliseconds on EC2; off EC2 the address just does not answer


def worker_instance_tag(timeout_s: float = IMDS_TIMEOUT_S) -> dict[str, str]:
    """``{"ft/worker-instance-id": <this EC2 instance id>}`` from IMDSv2, or ``{}`` when not on EC2.

    Honors botocore's ``AWS_EC2_METADATA_SERVICE_ENDPOINT`` and ``AWS_EC2_METADATA_DISABLED``.
    """
    if os.environ.get("AWS_EC2_METADATA_DISABLED", "").lower() == "true":
        return {}
    endpoint = os.environ.get("AWS_EC2_METADATA_SERVICE_ENDPOINT", "http://169.254.169.254").rstrip("/")
    try:
        token_request = urllib.request.Request(
            f"{endpoint}/latest/api/token", method="PUT", headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"}
        )
        with urllib.request.urlopen(token_request, timeout=timeout_s) as response:
            token = response.read().decode()
        id_request = urllib.request.Request(
            f"{endpoint}/latest/meta-data/instance-id", headers={"X-aws-ec2-metadata-token": token}
        )
        with urllib.request.urlopen(id_request, timeout=timeout_s) as response:
            instance_id = response.read().decode().strip()
    except (OSError, http.client.HTTPException):  # refused, timed out (URLError is an OSError), garbled
        return {}
    return {WORKER_TAG: instance_id} if instance_id.startswith("i-") else {}
