"""Chaos on training: the worker is killed (SIGKILL) or preempted (SIGTERM) at seeded random points.

One training run of the tiny model is interrupted ``INTERRUPTIONS`` times, restarted after each, and
must end with exactly the adapter of an uninterrupted run. After every interruption the next worker
must resume from the newest complete checkpoint in the store, and a reader polling the store the
whole time must never be handed a checkpoint whose files do not match its manifest.

The schedule is a seeded list of (kind, step, delay): ``step`` kills land ``delay`` seconds after the
worker logged that step (mid-step, mid-checkpoint write or mid-upload, wherever it is), ``upload``
kills land while a checkpoint upload is in flight (its files partly in the store, no manifest yet).
Uploads are slowed a little (``UPLOAD_DELAY_S`` per file) so that such a window exists, and training
steps too (``STEP_DELAY_S``, longer than the longest kill delay): the tiny model's steps take a few
milliseconds, and unslowed, every worker ran several steps past its scheduled kill, so the schedule
degenerated into "kill 4 steps after each restart" and the last kill raced the end of the run.

Workers are forked from a forkserver that has torch, transformers and peft imported already: a
restart costs a second or two instead of ~15 s of imports, and each worker is still its own process,
killed for real. The SIGKILL run uses the S3 store (SeaweedFS), the SIGTERM run the local one. The
figures of both runs go to test-artifacts/reliability.json (``record_figures``), as do those of the
other reliability suites (test_storage_faults, test_fuzz_inputs, test_security).
"""

from __future__ import annotations

import os
import random
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ft_assets.manifests import MANIFEST, ArtifactCorrupt, ArtifactNotFound
from ft_assets.storage import LocalStore, ObjectStore, open_store
from ft_assets.training.checkpoints import checkpoint_steps, fetch_checkpoint
from ft_assets.training.preemption import EXIT_PREEMPTED
from ft_assets_tests.support import RUN, assert_same_weights, record_figures, training_config as config, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_cpu_thread")]

INTERRUPTIONS = 6
SIGKILL_SEED, SIGTERM_SEED = 20261101, 20261102
TOTAL_STEPS = 24  # the `reference` fixture's run
UPLOAD_DELAY_S = 0.05  # per uploaded file: a checkpoint (5 files) takes >= 0.25 s to publish
STEP_DELAY_S = 0.25  # per training step: a kill lands within a step or two of its scheduled one
WORKER_TIMEOUT_S = 120
SETTLE_S = 0.3  # after a SIGKILL, a request the worker had already sent may still land in the store


# --- the worker: the recipe's command line, in a forked process ------------------------------------


def chaos_worker(argv: list[str], env: dict[str, str], log_path: str) -> None:
    """Child process: ``python -m ft_assets.training.worker ARGV`` with slowed uploads, logging to a file."""
    os.environ.update(env)  # a forkserver child starts with the environment of the forkserver, not ours
    torch.set_num_threads(1)
    sys.stdout = sys.stderr = open(log_path, "a", buffering=1)
    from ft_assets.training import steps, worker

    def slow_store(url: str) -> ObjectStore:
        store = open_store(url)
        put_file = store.put_file

        def slowed(key, path):
            time.sleep(UPLOAD_DELAY_S)
            put_file(key, path)

        store.put_file = slowed
        return store

    token_loss_sum = steps.token_loss_sum

    def slow_step(model, batch, **options):  # the SFT training step only: evaluation calls training.loss directly
        time.sleep(STEP_DELAY_S)
        return token_loss_sum(model, batch, **options)

    worker.open_store = slow_store
    steps.token_loss_sum = slow_step
    sys.exit(worker.main(argv))


def schedule(seed: int, count: int) -> list[tuple[str, int, float]]:
    """``count`` interruptions at increasing steps; at least two of them during an upload."""
    rng = random.Random(seed)
    # The last kill lands by step 15 + 0.2 s (a few steps of ~0.05 s): never after the run has finished.
    steps = sorted(rng.sample(range(2, TOTAL_STEPS - 8), count))
    kinds = ["upload" if rng.random() < 0.4 else "step" for _ in steps]
    for index in (1, count - 2):
        kinds[index] = "upload"
    return [(kind, step, round(rng.uniform(0.0, 0.2), 3)) for kind, step in zip(kinds, steps)]


# --- watching the store and the worker ----------------------------------------------------------------


def complete_steps(store: ObjectStore) -> list[int]:
    keys = set(store.list(RUN))
    return [s for s in checkpoint_steps(store, RUN) if f"{RUN}/checkpoint-{s:08d}/{MANIFEST}" in keys]


def upload_in_flight(store: ObjectStore, after: int) -> bool:
    keys = store.list(RUN)
    for step in checkpoint_steps(store, RUN):
        names = [k for k in keys if k.startswith(f"{RUN}/checkpoint-{step:08d}/")]
        if step > after and names and not any(k.endswith(MANIFEST) for k in names):
            return True
    return False


@dataclass
class Reader:
    """Polls the store the whole run and fetches every complete checkpoint it sees, verifying its sha256."""

    store: ObjectStore
    dest: Path
    verified: set[int] = field(default_factory=set)
    problems: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self.stop.wait(0.05):
            try:
                steps = complete_steps(self.store)
            except Exception as exc:  # noqa: BLE001 - a listing error is a finding, not a crash
                self.problems.append(f"listing failed: {exc!r}")
                continue
            for step in steps:
                if step in self.verified:
                    continue
                try:
                    fetch_checkpoint(self.store, RUN, step, self.dest / str(len(self.verified)))
                except (ArtifactCorrupt, ArtifactNotFound) as exc:
                    self.problems.append(f"checkpoint {step} listed as complete but: {exc}")
                else:
                    self.verified.add(step)

    def __enter__(self) -> Reader:
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def logged_steps(log_path: Path) -> list[int]:
    text = log_path.read_text() if log_path.exists() else ""
    return [int(m) for m in re.findall(r"^step (\d+)/\d+ ", text, flags=re.M)]


def run_with_interruptions(
    forkserver, store: ObjectStore, env: dict, tiny_model, shards, tmp_path: Path, sig: int, seed: int
):
    cfg = config(max_steps=TOTAL_STEPS, save_steps=2, logging_steps=1)
    argv = ["--config", cfg.model_dump_json(), "--base-model", str(tiny_model), "--shards", str(shards),
            "--store", store.url, "--run-prefix", RUN, "--work-dir", str(tmp_path / "work")]  # fmt: skip
    attempts = []
    for number, (kind, step, delay) in enumerate([*schedule(seed, INTERRUPTIONS), ("finish", TOTAL_STEPS, 0.0)]):
        before = max(complete_steps(store), default=None)
        log_path = tmp_path / f"attempt-{number}.log"
        worker = forkserver.Process(target=chaos_worker, args=(argv, env, str(log_path)))
        worker.start()
        try:
            if kind != "finish":
                wait_until(lambda: max(logged_steps(log_path), default=-1) >= step, worker, f"step {step}", log_path)
                if kind == "upload":
                    wait_until(lambda: upload_in_flight(store, before or 0), worker, "an upload", log_path)
                else:
                    time.sleep(delay)
                # A kill after the last step would test nothing (and a SIGTERM there ends in success).
                assert max(logged_steps(log_path)) < TOTAL_STEPS, f"attempt {number}: the run ended before its kill"
                os.kill(worker.pid, sig)
            sent = time.monotonic()
            worker.join(WORKER_TIMEOUT_S)
            seconds_to_exit = time.monotonic() - sent
            assert not worker.is_alive(), f"attempt {number} did not stop"
        finally:
            worker.kill()
        time.sleep(SETTLE_S)
        log = log_path.read_text()
        resumed = re.search(r"resuming from \S+checkpoint-(\d+) \(step", log)
        # Every restart resumes from the newest complete checkpoint there was when it started.
        assert (int(resumed.group(1)) if resumed else None) == before, log[-2000:]
        preempted = re.search(r"preempted by SIGTERM at step (\d+)", log)
        attempts.append({
            "kind": kind, "target": step, "resumed": before, "exitcode": worker.exitcode, "log": log,
            "preempted": int(preempted.group(1)) if preempted else None, "partial": "has no manifest.json" in log,
        })  # fmt: skip
        history = [{k: v for k, v in a.items() if k != "log"} for a in attempts]
        if kind == "finish":
            assert worker.exitcode == 0, (history, log[-3000:])
        elif sig == signal.SIGKILL:
            assert worker.exitcode == -signal.SIGKILL, (history, log[-3000:])
        else:
            # SIGTERM: checkpoint at the step boundary, wait for the upload, exit EX_TEMPFAIL.
            assert worker.exitcode == EXIT_PREEMPTED, (history, log[-3000:])
            assert max(complete_steps(store)) == attempts[-1]["preempted"], history
            assert seconds_to_exit < 30, (seconds_to_exit, history)  # the step in flight, its checkpoint, its upload
    return attempts


def check_final(tmp_path: Path, reference, reader: Reader, attempts: list[dict], name: str, seed: int) -> None:
    assert_same_weights(load_file(tmp_path / "work" / "final" / "adapter_model.safetensors"), reference)
    assert reader.problems == []
    assert len(reader.verified) >= TOTAL_STEPS // 2 - 1, sorted(reader.verified)  # nearly every checkpoint was read
    interruptions = [a for a in attempts if a["kind"] != "finish"]
    assert len(interruptions) == INTERRUPTIONS
    record_figures(
        name,
        interruptions_survived=len(interruptions),
        during_an_upload=sum(a["kind"] == "upload" for a in interruptions),
        half_uploaded_checkpoints_skipped=sum(a["partial"] for a in attempts),
        checkpoints_verified_by_a_concurrent_reader=len(reader.verified),
        partial_checkpoints_seen_by_the_reader=len(reader.problems),
        final_adapter_equals_uninterrupted=True,
        schedule=schedule(seed, INTERRUPTIONS),
        attempts=[
            {k: v for k, v in a.items() if k in ("kind", "target", "resumed", "preempted", "exitcode")}
            for a in attempts
        ],
    )


def test_sigkill_at_random_points_resumes_to_the_uninterrupted_adapter(
    forkserver, s3_env, tiny_model, shards, tmp_path, reference
):
    store = open_store(s3_env)
    env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")} | {"OMP_NUM_THREADS": "1"}
    with Reader(open_store(s3_env), tmp_path / "reader") as reader:
        attempts = run_with_interruptions(
            forkserver, store, env, tiny_model, shards, tmp_path, signal.SIGKILL, seed=SIGKILL_SEED
        )
    # At least one kill left a half-uploaded checkpoint behind, and the next worker skipped it.
    assert any(a["partial"] for a in attempts), "no kill landed mid-upload; the schedule proves less than it should"
    check_final(tmp_path, reference, reader, attempts, "chaos_sigkill", SIGKILL_SEED)


def test_sigterm_at_random_points_checkpoints_and_resumes_to_the_uninterrupted_adapter(
    forkserver, tiny_model, shards, tmp_path, reference
):
    store = LocalStore(tmp_path / "store")
    env = {"OMP_NUM_THREADS": "1"}
    with Reader(LocalStore(tmp_path / "store"), tmp_path / "reader") as reader:
        attempts = run_with_interruptions(
            forkserver, store, env, tiny_model, shards, tmp_path, signal.SIGTERM, seed=SIGTERM_SEED
        )
    # A preempted worker leaves no partial checkpoint: the next one never has anything to skip.
    assert not any(a["partial"] for a in attempts)
    check_final(tmp_path, reference, reader, attempts, "chaos_sigterm", SIGTERM_SEED)
