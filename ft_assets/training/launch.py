"""How the training worker is launched on one node or many: the torchrun command every node runs.

Every multi-process run is ``torchrun ... -m ft_assets.training.worker`` (``torchrun_command``), with
the same arguments on 1 node and on M nodes, so the 2-node test on loopback runs the command the
Kubernetes nodes run. Node 0 is the process of the ``lora_adapter`` asset: it fetched the inputs,
reports through dagster-pipes (rank 0 lives there) and publishes the final weights. Nodes 1..M-1 run
``python -m ft_assets.training.launch`` (``main``): fetch the base model and the shards from the store
(sha256-verified), then the same torchrun command with their node rank.

The rendezvous is torchrun's static one over a c10d TCPStore that node 0 hosts at
``--rdzv_endpoint``: node ranks are the ones given, so global rank 0 is on node 0. torchrun's dynamic
c10d rendezvous would order nodes by host name and could put rank 0 (and with it the Pipes channel
and the final weights) on a node with no Dagster run. ``--shutdown_timeout``: on SIGTERM (a spot
notice, a pod deletion) torchrun passes the signal to every worker and waits that long before SIGKILL,
time for the step-boundary checkpoint (Kubernetes' grace period is 120 s, ``deploy/launchers``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from ft_assets.manifests import fetch_artifact
from ft_assets.shards import fetch_images
from ft_assets.storage import open_store
from ft_assets.training.config import TrainingConfig

SHUTDOWN_TIMEOUT_S = 110  # SIGTERM to SIGKILL of the workers: below the pods' 120 s grace period
JOIN_TIMEOUT_S = 1800  # nodes may wait this long for the others (a GPU node can take minutes to start)
RDZV_PORT = 29400  # node 0's rendezvous store on a cluster


@dataclass(frozen=True)
class WorkerJob:
    """What every node of one run trains, in the store's terms (nodes share no disk)."""

    config: TrainingConfig
    store_url: str
    run_prefix: str
    base_model_key: str  # artifact prefixes in the store
    shards_key: str
    objective: str
    tags: dict
    images_key: str = ""  # where the shards' images are (the dataset's in the store); "": a text model's shards

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "config": self.config.model_dump(mode="json")})

    @classmethod
    def from_json(cls, text: str) -> WorkerJob:
        raw = json.loads(text)
        return cls(**{**raw, "config": TrainingConfig.model_validate(raw["config"])})


def worker_args(
    job: WorkerJob, base_dir: Path, shards_dir: Path, work_dir: Path, result: Path | None = None, pipes: bool = False
) -> list[str]:
    """``ft_assets.training.worker``'s arguments for ``job`` with its inputs at ``base_dir`` and ``shards_dir``."""
    args = [
        "--config", job.config.model_dump_json(), "--base-model", str(base_dir), "--shards", str(shards_dir),
        "--store", job.store_url, "--run-prefix", job.run_prefix, "--work-dir", str(work_dir),
        "--tags", json.dumps(job.tags), "--objective", job.objective,
    ]  # fmt: skip
    if result is not None:
        args += ["--result", str(result)]
    return args + (["--pipes"] if pipes else [])


def refusal_file(result: Path, rank: int) -> Path:
    """Where rank ``rank`` says that the store refused its keys (beside ``--result``): torchrun reports any rank's
    exit code as 1, and the one that reads the result must end its attempt with ``EXIT_KEYS_REFUSED``."""
    return result.with_name(f"{result.stem}.rank{rank}.refused")


def refusal_files(result: Path) -> list[Path]:
    """The ``refusal_file`` of every rank that wrote one."""
    return sorted(result.parent.glob(f"{result.stem}.rank*.refused"))


def free_port() -> int:
    """A free port on loopback: the rendezvous of one node's ranks."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun_command(
    config: TrainingConfig, node_rank: int, endpoint: str, args: list[str], launcher: str = "torch.distributed.run",
    options: tuple[str, ...] = (),
) -> list[str]:  # fmt: skip
    """``torchrun`` of the worker on one node: ``num_processes`` ranks, node ``node_rank`` of ``num_nodes``; run by
    ``launcher`` (a module that takes torchrun's arguments), with torchrun's ``options`` added."""
    if not 0 <= node_rank < config.num_nodes:
        raise ValueError(f"node rank {node_rank} is outside 0..{config.num_nodes - 1} (num_nodes {config.num_nodes})")
    return [
        sys.executable, "-m", launcher, *options,
        "--nnodes", str(config.num_nodes), "--nproc_per_node", str(config.num_processes), "--node_rank", str(node_rank),
        "--rdzv_backend", "static", "--rdzv_endpoint", endpoint, "--rdzv_conf", f"timeout={JOIN_TIMEOUT_S}",
        "--max_restarts", "0", "--shutdown_timeout", str(SHUTDOWN_TIMEOUT_S),
        "-m", "ft_assets.training.worker", *args,
    ]  # fmt: skip


def node_command(job: WorkerJob, endpoint: str, work_dir: str) -> list[str]:
    """The command of nodes 1..M-1 (``main``); the node rank comes from the indexed Job's JOB_COMPLETION_INDEX."""
    return [
        "python", "-m", "ft_assets.training.launch", "--job", job.to_json(), "--endpoint", endpoint, "--work-dir", work_dir,
        "--node-rank-from-env", "JOB_COMPLETION_INDEX",
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Run one node (1..M-1) of a multi-node training run: fetch its inputs, then torchrun."
    )
    parser.add_argument("--job", required=True, help="the run's WorkerJob as JSON")
    parser.add_argument("--endpoint", required=True, help="node 0's rendezvous host:port")
    parser.add_argument("--work-dir", required=True, type=Path, help="local scratch directory")
    rank = parser.add_mutually_exclusive_group(required=True)
    rank.add_argument("--node-rank", type=int, help="this node's rank, 1..M-1")
    rank.add_argument(
        "--node-rank-from-env", metavar="VAR", help="read the rank from VAR + 1 (an indexed Job's JOB_COMPLETION_INDEX)"
    )
    args = parser.parse_args(argv)
    job = WorkerJob.from_json(args.job)
    if args.node_rank is not None:
        node_rank = args.node_rank
    else:
        if args.node_rank_from_env not in os.environ:
            parser.error(
                f"{args.node_rank_from_env} is not set: run this as a pod of an indexed Job, or pass --node-rank"
            )
        node_rank = int(os.environ[args.node_rank_from_env]) + 1
    store = open_store(job.store_url)
    base_dir, shards_dir = args.work_dir / "base", args.work_dir / "shards"
    fetch_artifact(store, job.base_model_key, base_dir)
    fetch_artifact(store, job.shards_key, shards_dir)
    fetch_images(store, job.images_key, shards_dir)
    command = torchrun_command(
        job.config, node_rank, args.endpoint, worker_args(job, base_dir, shards_dir, args.work_dir / "run")
    )
    os.execv(command[0], command)  # torchrun in this process's place: a pod's SIGTERM reaches it (and the workers)


if __name__ == "__main__":
    main()
