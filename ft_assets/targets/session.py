"""A training run on a GPU target: the control host's side of the Dagster Pipes session with the worker.

``train_remote`` runs in ``lora_adapter``'s step, in the run's own process on the control host. For each
attempt it opens a Pipes session whose messages the worker writes to the store under
``<run>/pipes/<attempt>/`` (``StoreMessageReader``; the worker's ``StoreMessageWriter``), writes the attempt's job
next to them (the ``WorkerJob`` and the Pipes parameters: nothing secret), and asks the target to start
``python -m ft_assets.training.remote``. The worker's log lines appear in the run's log as it trains.

- A worker that ends with ``EXIT_PREEMPTED`` (SIGTERM, checkpoint saved), is killed (exit code 128 + signal) or
  vanishes with its machine starts a new attempt, up to ``max_attempts``; the recipe resumes from the newest
  complete checkpoint in the store. Each attempt keeps its own messages; ``attempts`` lists them all, with their
  seconds and ``paid_seconds`` (from the worker's first start), which ``training_cost`` bills.
- A target may restart the worker itself within one attempt (SkyPilot recovers a preempted managed job on a new
  cluster): each start writes its messages to a folder of its own under the attempt's (``<attempt>/<start>/``), the
  reader follows them in turn, and the attempt counts its ``starts``.
- The worker's code: with the target's ``code=wheel`` (the default) this ft-assets as a wheel in the store, which the
  worker installs before it starts (``ft_assets.targets.code``); the summary's ``code`` names it for the lineage.
- A worker that fails (any other exit code) fails the step with the end of its output.
- The worker's handle is kept at ``<run>/pipes/worker.json`` while it runs: a re-executed run (a control host
  that restarted mid-run) finds a worker still running there and cancels it before starting its own, so one run
  never pays for two workers; the new attempt resumes from the checkpoint.
- Terminating the run (the UI, Ctrl-C of ``ft-assets run``) interrupts the wait: the worker is cancelled before
  the step ends. A termination that comes while the worker is being started waits until its handle is kept
  (Dagster's ``capture_interrupts``), so a worker is never started without a way to stop it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from secrets import token_hex

import dagster as dg
from dagster._core.errors import DagsterExecutionInterruptedError
from dagster._core.pipes.utils import PipesBlobStoreMessageReader, PipesEnvContextInjector
from dagster._utils.interrupts import capture_interrupts, check_captured_interrupt

from ft_assets.targets import GpuRequest, Target, WorkerLaunch, WorkerState
from ft_assets.targets.code import WHEEL, worker_code
from ft_assets.targets.credentials import STS, describe_keys, hours_of, scoped_keys, worker_keys, worker_secrets
from ft_assets.targets.renewal import EXIT_KEYS_REFUSED, Renewal
from ft_assets.storage import ObjectNotFound, ObjectStore
from ft_assets.training import remote
from ft_assets.training.launch import WorkerJob
from ft_assets.training.preemption import EXIT_PREEMPTED

DEFAULT_ATTEMPTS = 4  # a worker lost or preempted 3 times in a row fails the step (run retries may go on)
POLL_S = 5.0  # how often the target is asked whether the worker still runs
READ_INTERVAL_S = 2.0  # how often the store is read for the worker's next message chunk
SIGKILL_EXIT = 128 + 9  # a shell's exit code for a child killed by SIGKILL (kill -9, the OOM killer)
REMOTE_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_REGION", "AWS_REGION")  # the store's settings


class StoreMessageReader(PipesBlobStoreMessageReader):
    """Reads the chunks ``<key_prefix>/<life>/<n>.json`` that the worker's ``StoreMessageWriter`` puts in the store.

    One attempt can have several lives: a target that restarts its worker itself (SkyPilot's recovery of a managed
    job) runs the same command again, and each start claims the next ``<life>`` folder (``remote.claim_life``). The
    reader goes on to life ``k + 1`` once its first chunk is there and life ``k`` has no next chunk: Dagster's one
    stream of chunks, made of each life's in turn (a chunk a dead life writes after its successor started is not
    read)."""

    def __init__(self, store: ObjectStore, key_prefix: str, interval: float = READ_INTERVAL_S):
        super().__init__(interval=interval)
        self.store, self.key_prefix = store, key_prefix
        self.life, self.offset = 1, 0  # the life being read, and how many chunks the lives before it had

    @contextmanager
    def get_params(self):
        yield {"key_prefix": self.key_prefix}

    def messages_are_readable(self, params) -> bool:
        return self.store.exists(f"{self.key_prefix}/1/1.json")

    def _chunk(self, life: int, index: int) -> str | None:
        try:
            return self.store.get_bytes(f"{self.key_prefix}/{life}/{index}.json").decode()
        except ObjectNotFound:
            return None

    def download_messages_chunk(self, index: int, params) -> str | None:
        chunk = self._chunk(self.life, index - self.offset)
        if chunk is None and self.store.exists(f"{self.key_prefix}/{self.life + 1}/1.json"):
            chunk = self._chunk(self.life, index - self.offset)  # one more look: written just before its successor
            if chunk is None:
                self.life, self.offset = self.life + 1, index - 1
                chunk = self._chunk(self.life, 1)
        return chunk

    def no_messages_debug_text(self) -> str:
        return (
            f"read message chunks from {self.store.uri(self.key_prefix)}/<life>/, written by ft_assets.training.remote"
        )


@dataclass
class Attempt:
    number: int
    name: str
    seconds: float = 0.0
    exit_code: int | None = None
    outcome: str = "running"  # finished | preempted | killed | lost | refused (its keys) | failed | cancelled
    identity: dict | None = None  # of its last start
    starts: int = 1  # the worker's starts in this attempt: more than 1 where the target restarted it (SkyPilot)
    paid_seconds: float = 0.0  # from the worker's first start (its clock) to the attempt's end (ours): the bill's

    def as_dict(self) -> dict:
        return {"attempt": self.number, "name": self.name, "seconds": round(self.seconds, 1),
                "exit_code": self.exit_code, "outcome": self.outcome, "worker": self.identity or {},
                "starts": self.starts, "paid_seconds": round(self.paid_seconds, 1)}  # fmt: skip


def paid_seconds(seconds: float, started_at: list, now: float) -> float:
    """An attempt's billed time: from its worker's first start (the machine's clock, in its ``worker`` message: the
    bootstrap's start where it installed the code first) to ``now``, so that waiting for a machine (a SkyPilot job
    pending capacity) is not billed; ``seconds`` (launch to end, as measured here) when the worker never reported,
    and at most that (a clock ahead of ours)."""
    starts = [t for t in started_at if isinstance(t, int | float)]
    return min(seconds, max(0.0, now - min(starts))) if starts else seconds


def outcome_of(state: WorkerState) -> str:
    if state.lost:
        return "lost"
    if state.exit_code == 0:
        return "finished"
    if state.exit_code == EXIT_PREEMPTED:
        return "preempted"
    if state.exit_code == EXIT_KEYS_REFUSED:
        return "refused"  # the store refused its keys
    if state.exit_code is not None and state.exit_code > 128:
        return "killed"
    return "failed"


def worker_environment(environ: Mapping[str, str]) -> dict:
    """The store's plain settings (endpoint, region) that the worker needs from this host's environment; its keys are
    ``credentials.worker_secrets``'."""
    return {k: environ[k] for k in REMOTE_ENV if environ.get(k)}


def attempt_keys(
    keys: str, environ: Mapping[str, str], store: ObjectStore, reads: list[str], run_prefix: str, name: str, folder: str
) -> tuple[dict, dict, Renewal | None]:
    """One attempt's store keys (``keys``: ``credentials.worker_keys``' answer): (plain settings, secrets, and the
    ``Renewal`` to tick while it runs). Scoped keys are made fresh for each attempt and renewed in ``folder``."""
    if keys != STS:
        return {}, worker_secrets(environ, store, reads, run_prefix, name), None
    hours = hours_of(environ)
    renewal, first = Renewal.start(
        store, folder, lambda: scoped_keys(store, reads, run_prefix, name, hours), hours * 3600
    )
    plain, seal = renewal.worker_env()
    return plain, {**first, **seal}, renewal


def cancel_leftover(target: Target, store: ObjectStore, record_key: str, log: Callable[[str], None]) -> None:
    """A worker that an earlier execution of this run left running (its control host restarted): cancelled."""
    try:
        record = store.get_json(record_key)
    except ObjectNotFound:
        return
    if target.poll(record["handle"]).running:
        log(f"a worker of this run is still running on {record['target']} (attempt {record['attempt']}, from run "
            f"{record['dagster_run']}): cancelling it; this run resumes from its newest checkpoint")  # fmt: skip
        target.cancel(record["handle"])
    store.delete(record_key)


def train_remote(
    context: dg.AssetExecutionContext,
    target: Target,
    job: WorkerJob,
    store: ObjectStore,
    environ: Mapping[str, str],
    gpu: GpuRequest | None = None,
    max_attempts: int = DEFAULT_ATTEMPTS,
    poll_s: float = POLL_S,
) -> tuple[dict, dict]:
    """Train ``job`` on ``target`` (with ``gpu``, the plan's card) until an attempt finishes; (the TrainingResult as
    JSON with ``output_key``, a summary: the attempts, the worker's identity and GPU utilization)."""
    log = context.log.info
    pipes_prefix = f"{job.run_prefix}/pipes"
    record_key = f"{pipes_prefix}/worker.json"
    keys = worker_keys(environ, store)  # refused here, before anything is rented, when no keys may go
    cancel_leftover(target, store, record_key, log)
    log(f"the worker gets {describe_keys(keys, environ)}")
    env = worker_environment(environ)
    reads = [job.base_model_key, job.shards_key, *([job.images_key] if job.images_key else [])]
    code = None
    if target.code == WHEEL:
        code = worker_code(store)
        log(f"the worker installs this ft-assets: {code.wheel} (sha256 {code.sha256[:12]}), {store.uri(code.key)}")
    first = 1 + len(store.list_dirs(pipes_prefix))  # a re-executed run's attempts go on from the earlier ones
    attempts: list[Attempt] = []
    for number in range(first, first + max_attempts):
        # unique on the target even across stores and sessions: a folder or job name of an earlier run is never reused
        attempt = Attempt(number, f"{job.run_prefix.rsplit('/', 1)[-1]}-{number}-{token_hex(3)}")
        attempts.append(attempt)
        key_prefix = f"{pipes_prefix}/{number:03d}"
        started = time.monotonic()
        with dg.open_pipes_session(
            context=context,
            context_injector=PipesEnvContextInjector(),
            message_reader=StoreMessageReader(store, key_prefix),
        ) as session:
            spec = {"job": job.to_json(), "pipes": session.get_bootstrap_env_vars(), "attempt": number,
                    "output": f"{job.run_prefix}/output"}  # fmt: skip
            store.put_json(f"{key_prefix}/job.json", spec)
            plain, hidden = code.environment(store) if code else ({}, {})  # a fresh URL for each attempt
            follow, secrets, renewal = attempt_keys(keys, environ, store, reads, job.run_prefix, attempt.name,
                                                    f"{key_prefix}/keys")  # fmt: skip
            plain = {**plain, **follow}
            launch = WorkerLaunch(attempt.name, "ft_assets.training.remote",
                                  ("--store", store.url, "--job", f"{key_prefix}/job.json"), {**env, **plain},
                                  {**secrets, **hidden}, gpu, job.config.num_processes,
                                  bootstrap=code is not None)  # fmt: skip
            log(f"starting attempt {number} of this run's worker on {target.describe()}")
            with capture_interrupts():  # a termination during the launch is acted on once the handle is kept
                handle = target.launch(launch)
                store.put_json(record_key, {"target": target.describe(), "handle": handle, "attempt": number,
                                            "dagster_run": context.run.run_id})  # fmt: skip
                interrupted = check_captured_interrupt()
            try:
                if interrupted:
                    raise DagsterExecutionInterruptedError()
                state = wait(target, handle, target.poll_s or poll_s, renewal and (lambda: renewal.tick(log)))
            except BaseException:  # the run was terminated (or this process interrupted): nothing left running
                attempt.outcome = "cancelled"
                with capture_interrupts():
                    log(f"cancelling the worker on {target.describe()} (attempt {number})")
                    target.cancel(handle)
                    store.delete(record_key)
                raise
            store.delete(record_key)
        attempt.seconds, attempt.exit_code, attempt.outcome = (
            time.monotonic() - started,
            state.exit_code,
            outcome_of(state),
        )
        custom = [m for m in session.get_custom_messages() if isinstance(m, dict)]
        messages = {m.get("kind"): m for m in custom}  # of each kind, the last start's
        attempt.identity = (messages.get(remote.WORKER_MESSAGE) or {}).get("identity")
        lives = [m for m in custom if m.get("kind") == remote.WORKER_MESSAGE]
        attempt.starts = max([m.get("life", 1) for m in lives] or [1])
        attempt.paid_seconds = paid_seconds(attempt.seconds, [m.get("started_at") for m in lives], time.time())
        if attempt.outcome == "failed" and custom and custom[-1].get("kind") == remote.PREEMPTED_MESSAGE:
            attempt.outcome = "preempted"  # it checkpointed after a SIGTERM, whatever exit code its target reports
        if attempt.outcome == "finished" and remote.RESULT_MESSAGE in messages:
            found = messages[remote.RESULT_MESSAGE]
            summary = {"attempts": [a.as_dict() for a in attempts], "worker": attempt.identity or {},
                       "gpu_utilization": found.get("gpu_utilization"),
                       "code": code.lineage(store) if code else None}  # fmt: skip
            return {**found["result"], "output_key": spec["output"]}, summary
        if attempt.outcome == "refused" and keys != STS:  # the same keys again would be refused again
            raise dg.Failure(
                description=f"the store refused the training worker's keys on {target.describe()} (attempt {number}): "
                f"{describe_keys(keys, environ)}; its checkpoints stay in {store.uri(job.run_prefix)}, and a rerun "
                "with keys the store accepts resumes from the newest",
                metadata={"attempts": dg.MetadataValue.json([a.as_dict() for a in attempts])},
            )
        if attempt.outcome in ("failed", "finished"):  # finished without a result: its messages were lost
            raise dg.Failure(
                description=f"the training worker on {target.describe()} failed (attempt {number}, exit code "
                f"{state.exit_code}); the end of its output:\n{state.detail}",
                metadata={"attempts": dg.MetadataValue.json([a.as_dict() for a in attempts])},
            )
        what = "the store refused its keys" if attempt.outcome == "refused" else f"was {attempt.outcome}"
        log(f"attempt {number} on {target.describe()}: {what} after {attempt.seconds:.0f} s; the next attempt "
            f"{'gets new keys and ' if attempt.outcome == 'refused' else ''}resumes from the newest complete "
            "checkpoint")  # fmt: skip
    raise dg.Failure(
        description=f"the training worker on {target.describe()} ended {max_attempts} times without finishing "
        f"(last: {attempts[-1].outcome}); its checkpoints stay in {store.uri(job.run_prefix)}",
        metadata={"attempts": dg.MetadataValue.json([a.as_dict() for a in attempts])},
        allow_retries=True,
    )


def wait(target: Target, handle: Mapping, poll_s: float, tick: Callable[[], None] | None = None) -> WorkerState:
    """Poll the worker until it ends; ``tick`` between polls (its keys' renewal)."""
    while True:
        state = target.poll(handle)
        if not state.running:
            return state
        if tick:
            tick()
        time.sleep(poll_s)
