"""The training worker on a rented machine: ``python -m ft_assets.training.remote --store URL --job KEY``.

Started by a GPU target (``ft_assets.targets``) for one attempt of one run. Everything it needs comes from the
object store: the attempt's job (``KEY``: the run's ``WorkerJob`` and its Pipes parameters, written by the
control host), the base model and the shards (fetched into ``--work-dir``, kept there between attempts: a file
already present with the right sha256 is not fetched again), the newest complete checkpoint of the run. It holds
no key to the control plane: it reports to the run's Dagster process through Pipes messages that it writes to the
store (``StoreMessageWriter``, read back by ``ft_assets.targets.session``), and the store credentials, if any, come
from its environment.

Where the control host renews its store keys (scoped keys, ``ft_assets.targets.renewal``) it follows the renewals.

With ``num_processes`` N > 1 (the target's ``gpus=N``) it fetches the inputs once, then runs N ranks of
``ft_assets.training.worker`` on this machine (torchrun, through ``ft_assets.targets.ranks``) and stays the attempt's one
Pipes reporter: rank 0's output lines become its log lines, rank 0 writes the result it publishes, a SIGTERM is passed
on to the ranks (they checkpoint at the step boundary), each rank follows the key renewals itself, and a rank killed
by a signal ends the attempt with 128 + that signal, as a killed worker does: the next attempt resumes from the newest
complete checkpoint.

It ends with exit code 0 after publishing the final weights at the job's ``output`` key, ``EXIT_PREEMPTED`` (75)
after a SIGTERM once its checkpoint is in the store, ``EXIT_KEYS_REFUSED`` (77) when the store refused its keys (its
newest complete checkpoint stays; the next attempt, with new keys, resumes from it), 1 on an error (its message is the
last Pipes log line).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import ExitStack
from io import StringIO
from pathlib import Path

from dagster_pipes import (
    PipesBlobStoreMessageWriter,
    PipesBlobStoreMessageWriterChannel,
    PipesDefaultContextLoader,
    PipesMappingParamsLoader,
    open_dagster_pipes,
)

from ft_assets.manifests import fetch_artifact, publish_dir
from ft_assets.objectives import named
from ft_assets.targets.bootstrap import STARTED_ENV
from ft_assets.targets.renewal import EXIT_KEYS_REFUSED, follower, refused
from ft_assets.providers.worker_identity import worker_tag
from ft_assets.shards import fetch_images
from ft_assets.storage import ObjectStore, open_store
from ft_assets.training.gpu_monitor import GpuUtilization
from ft_assets.training.launch import WorkerJob, free_port, refusal_files, torchrun_command, worker_args
from ft_assets.training.preemption import EXIT_PREEMPTED, Preempted

MESSAGE_INTERVAL_S = 2.0  # Pipes messages go to the store in chunks at most this often (one object each)
WORKER_MESSAGE, RESULT_MESSAGE, PREEMPTED_MESSAGE = "worker", "result", "preempted"  # custom messages' "kind"
RANK_0 = "[default0]:"  # torchrun's prefix (``--tee 3``) of rank 0's output lines: those become the Pipes log


class StoreMessageChannel(PipesBlobStoreMessageWriterChannel):
    """Pipes message chunks as objects ``<key_prefix>/<n>.json`` of the run's store, as dagster-aws' S3 channel
    writes them, through ft-assets' store (S3 or a shared filesystem alike)."""

    def __init__(self, store: ObjectStore, key_prefix: str, interval: float):
        super().__init__(interval=interval)
        self.store, self.key_prefix = store, key_prefix

    def upload_messages_chunk(self, payload: StringIO, index: int) -> None:
        self.store.put_bytes(f"{self.key_prefix}/{index}.json", payload.read().encode())


class StoreMessageWriter(PipesBlobStoreMessageWriter):
    """Writes this life's chunks under ``<key_prefix>/<life>/`` (``claim_life``; ``session.StoreMessageReader``)."""

    def __init__(self, store: ObjectStore, life: int, interval: float = MESSAGE_INTERVAL_S):
        super().__init__(interval=interval)
        self.store, self.life = store, life

    def make_channel(self, params) -> StoreMessageChannel:
        return StoreMessageChannel(self.store, f"{params['key_prefix']}/{self.life}", self.interval)


def claim_life(store: ObjectStore, key_prefix: str, identity: dict) -> int:
    """The number of this start of the attempt's worker: 1, or the next free one when the target restarted it (SkyPilot
    runs a recovered managed job's command again). Claimed with a conditional put, so two starts never share one."""
    life = 1
    while not store.put_bytes_if_absent(f"{key_prefix}/{life}/claim.json", json.dumps(identity).encode()):
        life += 1
    return life


def worker_identity() -> dict:
    """Who runs this attempt: the host name, and the rented machine's tag where the provider says (``worker_tag``)."""
    return {"host": socket.gethostname(), **worker_tag()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Run one attempt of a training run on this machine (a GPU target's worker)."
    )
    parser.add_argument("--store", required=True, help="the object store: s3://bucket/prefix or a shared folder")
    parser.add_argument("--job", required=True, help="the attempt's job in the store (written by the control host)")
    parser.add_argument("--work-dir", type=Path, default=Path("work"), help="scratch folder (default ./work)")
    args = parser.parse_args(argv)
    started, started_wall = time.monotonic(), time.time()
    started_wall = float(os.environ.get(STARTED_ENV) or started_wall)  # the bootstrap's start: its install is paid
    store = open_store(args.store)
    try:
        return attempt(store, args, started, started_wall)
    except Exception as exc:
        if refused(exc) is None:
            raise
        # its messages may not reach the control host now (they go to the store): the exit code says it
        print(f"ft-assets worker: the store refused this worker's keys ({refused(exc)}); stopping", file=sys.stderr)
        return EXIT_KEYS_REFUSED


def run_ranks(job: WorkerJob, base_dir: Path, shards_dir: Path, work_dir: Path, log) -> tuple[int, Path]:
    """torchrun of ``job``'s ``num_processes`` ranks on this machine: (its exit code, rank 0's result file). Every
    output line goes to this process's output (the target's log of the worker), rank 0's to ``log`` as well; a SIGTERM
    here is passed on to torchrun, which passes it to the ranks."""
    result = work_dir / "result.json"
    for stale in [result, *refusal_files(result)]:  # an earlier attempt's, same folder
        stale.unlink(missing_ok=True)
    args = worker_args(job, base_dir, shards_dir, work_dir / "run", result=result)
    command = torchrun_command(
        job.config, 0, f"127.0.0.1:{free_port()}", args, "ft_assets.targets.ranks", ("--tee", "3")
    )
    ranks = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: ranks.send_signal(signal.SIGTERM))
    try:
        for line in ranks.stdout:
            print(line, end="", flush=True)
            if line.startswith(RANK_0):
                log(line[len(RANK_0) :].rstrip("\n"))
        return ranks.wait(), result
    finally:
        signal.signal(signal.SIGTERM, previous)


def ranks_outcome(code: int, result: Path) -> dict:
    """What the ranks' end means for the attempt: ``{"result": ...}`` (rank 0's TrainingResult as JSON),
    ``{"preempted": {step, checkpoint}}``, ``{"refused": why}``, ``{"killed": exit code}`` (a rank ended by a signal:
    128 + it, ``ranks.exit_code``) or ``{"failed": exit code}``."""
    said = json.loads(result.read_text()) if result.is_file() else {}
    refusals = refusal_files(result)
    if "preempted" in said:
        return {"preempted": said["preempted"]}
    if refusals:
        return {"refused": refusals[0].read_text()}
    if code == 0 and said:
        return {"result": said}
    return {"killed": code} if code > 128 else {"failed": code}


def attempt(store: ObjectStore, args: argparse.Namespace, started: float, started_wall: float) -> int:
    spec = store.get_json(args.job)
    job = WorkerJob.from_json(spec["job"])
    params = PipesMappingParamsLoader(spec["pipes"])
    identity = worker_identity()
    life = claim_life(store, params.load_messages_params()["key_prefix"], identity)
    with (
        open_dagster_pipes(
            params_loader=params,
            context_loader=PipesDefaultContextLoader(),
            message_writer=StoreMessageWriter(store, life),
        ) as pipes,
        ExitStack() as renewals,
    ):
        log = pipes.log.info
        keys = follower(store, os.environ, log)  # from the start: fetching a 70B model can outlast half a key's life
        if keys:
            renewals.enter_context(keys)
        pipes.report_custom_message(
            {"kind": WORKER_MESSAGE, "identity": identity, "life": life, "started_at": started_wall}
        )
        again = f" (start {life}: the target restarted it)" if life > 1 else ""
        log(f"attempt {spec['attempt']} on {socket.gethostname()}{again}: fetching the base model and the shards")
        base_dir, shards_dir = args.work_dir / "base", args.work_dir / "shards"
        fetch_artifact(store, job.base_model_key, base_dir)
        fetch_artifact(store, job.shards_key, shards_dir)
        fetch_images(store, job.images_key, shards_dir)  # a vision-language model's: only its shards' images
        if job.config.num_processes > 1:
            return attempt_ranks(store, spec, job, pipes, base_dir, shards_dir, args.work_dir)
        from ft_assets.training.recipe import train  # torch and transformers: after the cheap checks above

        try:
            with GpuUtilization() as utilization:
                result = train(
                    job.config, base_dir, shards_dir, store, job.run_prefix, args.work_dir / "run", log=log,
                    started_at=started, tags=job.tags, objective=named(job.objective),
                )  # fmt: skip
        except Preempted as exc:
            log(str(exc))
            pipes.report_custom_message({"kind": PREEMPTED_MESSAGE, "step": exc.step, "checkpoint": exc.checkpoint_uri})
            return EXIT_PREEMPTED
        except Exception as exc:
            if refused(exc):
                pipes.log.error(f"the store refused this worker's keys: {refused(exc)}; stopping (the newest complete "
                                "checkpoint stays in the store)")  # fmt: skip
                raise refused(exc) from exc
            pipes.log.error(f"the worker failed: {type(exc).__name__}: {exc}")
            raise
        publish_dir(store, spec["output"], result.output_dir)
        log(f"final weights published at {store.uri(spec['output'])}")
        pipes.report_custom_message(
            {"kind": RESULT_MESSAGE, "result": result.to_json(), "gpu_utilization": utilization.mean}
        )
    return 0


def attempt_ranks(store: ObjectStore, spec: dict, job: WorkerJob, pipes, base_dir: Path, shards_dir: Path,
                  work_dir: Path) -> int:  # fmt: skip
    """The attempt on ``num_processes`` ranks (``run_ranks``), reported through ``pipes`` as a one-process one is."""
    log = pipes.log.info
    log(f"training on {job.config.num_processes} processes on this machine (torchrun, {job.config.parallelism})")
    with GpuUtilization() as utilization:
        code, result = run_ranks(job, base_dir, shards_dir, work_dir, log)
    outcome = ranks_outcome(code, result)
    if "preempted" in outcome:
        stop = outcome["preempted"]
        pipes.report_custom_message({"kind": PREEMPTED_MESSAGE, "step": stop["step"], "checkpoint": stop["checkpoint"]})
        return EXIT_PREEMPTED
    if "refused" in outcome:
        pipes.log.error(f"the store refused this worker's keys: {outcome['refused']}; stopping (the newest complete "
                        "checkpoint stays in the store)")  # fmt: skip
        return EXIT_KEYS_REFUSED
    if "killed" in outcome:
        pipes.log.warning(f"a training process was killed (exit code {code}); the next attempt resumes from the "
                          "newest complete checkpoint")  # fmt: skip
        return code
    if "failed" in outcome:
        pipes.log.error(f"the worker failed: torchrun of {job.config.num_processes} processes ended with exit code "
                        f"{code} (its output: the worker's log)")  # fmt: skip
        return 1
    trained = outcome["result"]
    publish_dir(store, spec["output"], Path(trained["output_dir"]))
    log(f"final weights published at {store.uri(spec['output'])}")
    pipes.report_custom_message({"kind": RESULT_MESSAGE, "result": trained, "gpu_utilization": utilization.mean})
    return 0


if __name__ == "__main__":
    sys.exit(main())
