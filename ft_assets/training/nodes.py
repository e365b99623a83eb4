"""Nodes 1..M-1 of a multi-node training run on Kubernetes: an indexed Job cloned from the run's own pod.

The run's pod (K8sRunLauncher, gpu pool, ``num_processes`` GPUs) is node 0: it runs ``lora_adapter``,
hosts the rendezvous and rank 0. ``start_peer_nodes`` reads that pod back from the API server and
creates a ``batch/v1`` Job with ``completionMode: Indexed`` and M-1 pods made from it: same image,
environment (store credentials, Dagster settings), GPU requests, node selector, tolerations, service
account and grace period; only the command differs (``launch.node_command``: fetch the inputs, then
``torchrun --node_rank JOB_COMPLETION_INDEX + 1`` against node 0's pod IP). The Job is owned by the run
pod, so Kubernetes deletes it with the run; ``lora_adapter`` also deletes it when torchrun on node 0
ends. ``backoffLimit: 0``: a lost node fails its torchrun, node 0's torchrun fails with it, the Dagster
run fails and its retry resumes from the newest complete checkpoint on a fresh set of nodes.

Why an indexed Job and not PyTorchJob (Kubeflow) or JobSet: they are operators to install in the
cluster, and what they add (a rendezvous Service, gang restarts) is covered by node 0's pod IP and
Dagster's run retries. Why not Ray Train on KubeRay (dagster-ray): the worker already is a torchrun
program, and Ray would add its runtime and scheduler to the GPU image for no step that training
needs. docs/guides/training.md shows both.

The run pod needs ``FT_POD_IP`` (downward API: ``status.podIP``) and its service account may create,
get and delete Jobs and get Pods in its namespace (``deploy/launchers/k8s-gpu.yaml``).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from pathlib import Path

from ft_assets.training.launch import RDZV_PORT, WorkerJob, node_command

POD_IP_ENV = "FT_POD_IP"  # node 0's address, from the downward API
NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
PEER_WORK_DIR = "/tmp/ft-node"  # each peer's scratch: the fetched inputs and its ranks' checkpoint shards
POD_FIELDS = ("nodeSelector", "tolerations", "affinity", "serviceAccountName", "imagePullSecrets", "securityContext",
              "terminationGracePeriodSeconds", "volumes", "priorityClassName")  # fmt: skip
CONTAINER_FIELDS = ("image", "imagePullPolicy", "env", "envFrom", "resources", "volumeMounts", "securityContext")

Log = Callable[[str], None]


def rendezvous_endpoint() -> str:
    """Node 0's rendezvous host:port: this pod's IP on a cluster."""
    address = os.environ.get(POD_IP_ENV)
    if not address:
        raise ValueError(
            f"num_nodes > 1 needs {POD_IP_ENV} (this pod's IP, from the downward API status.podIP) so that the other nodes "
            "can reach node 0: run on the Kubernetes gpu pool of deploy/launchers/k8s-gpu.yaml, or set num_nodes to 1"
        )
    return f"{address}:{RDZV_PORT}"


def peer_job(run_pod: dict, name: str, command: list[str], nodes: int) -> dict:
    """The indexed Job of nodes 1..``nodes``-1, as a Kubernetes manifest (camelCase, as the API server takes it).

    ``run_pod`` is the run's pod as the API server returns it (``ApiClient.sanitize_for_serialization``).
    """
    if nodes < 2:
        raise ValueError(f"a multi-node run has at least 2 nodes (got {nodes})")
    metadata, spec = run_pod["metadata"], run_pod["spec"]
    container = spec["containers"][0]  # K8sRunLauncher's one container
    peer = {
        "name": "node",
        "command": command,
        **{k: copy.deepcopy(container[k]) for k in CONTAINER_FIELDS if k in container},
    }
    pod_spec = {
        "restartPolicy": "Never",
        "containers": [peer],
        **{k: copy.deepcopy(spec[k]) for k in POD_FIELDS if k in spec},
    }
    labels = {
        key: value
        for key, value in (metadata.get("labels") or {}).items()
        if not key.startswith(("job-name", "controller-uid", "batch."))
    }
    labels["ft/node-of"] = metadata["name"]
    owner = {
        "apiVersion": "v1",
        "kind": "Pod",
        "name": metadata["name"],
        "uid": metadata["uid"],
        "blockOwnerDeletion": False,
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": metadata["namespace"], "labels": labels, "ownerReferences": [owner]},
        "spec": {
            "completionMode": "Indexed",
            "completions": nodes - 1,
            "parallelism": nodes - 1,
            "backoffLimit": 0,
            "ttlSecondsAfterFinished": 3600,
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
        },
    }


class PeerNodes:
    """Nodes 1..M-1 of this run, started from this pod's spec; ``delete`` removes them (and their pods)."""

    def __init__(self, job: WorkerJob, endpoint: str, log: Log):
        from kubernetes import client, config  # the [k8s] extra (dagster-k8s's dependency): only on a cluster

        config.load_incluster_config()
        self.batch, self.namespace = client.BatchV1Api(), NAMESPACE_FILE.read_text().strip()
        pod = client.CoreV1Api().read_namespaced_pod(os.environ["HOSTNAME"], self.namespace)
        run_pod = client.ApiClient().sanitize_for_serialization(pod)
        self.name = f"{run_pod['metadata']['name'][:50]}-nodes"
        manifest = peer_job(run_pod, self.name, node_command(job, endpoint, PEER_WORK_DIR), job.config.num_nodes)
        # left by an earlier attempt of this run (its pod name is reused by a retry's pod only by chance)
        if self._exists():
            self.delete()
        self.batch.create_namespaced_job(self.namespace, manifest)
        log(
            f"started nodes 1..{job.config.num_nodes - 1} as Job {self.namespace}/{self.name}, rendezvous at {endpoint}"
        )

    def _exists(self) -> bool:
        from kubernetes.client.exceptions import ApiException  # the [k8s] extra

        try:
            self.batch.read_namespaced_job(self.name, self.namespace)
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def delete(self) -> None:
        self.batch.delete_namespaced_job(self.name, self.namespace, propagation_policy="Background")
