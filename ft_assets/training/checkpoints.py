"""Training checkpoints in the object store: contents, latest-complete lookup, pruning, upload.

A training run lives under ``runs/<name>/<version>/train/<run_id>/`` (``layout.PartitionLayout.train``)
and writes one artifact per checkpoint, ``checkpoint-<step:08d>/`` (``layout.checkpoint``), published
with ``manifests.publish_dir`` (manifest last), so a checkpoint either has a manifest and verified files or does not exist as far as a reader is concerned.
The run id hashes everything that changes the trained weights (partition, result-changing config,
base model digest, shards digest): rerunning the same work finds and resumes the same checkpoints,
changing any of it starts fresh.

One checkpoint holds everything needed to continue bit-for-bit:

| file                  | what                                                    | written with       |
|-----------------------|---------------------------------------------------------|--------------------|
| weights.safetensors   | trainable parameters (LoRA adapters, or every weight)   | safetensors        |
| optimizer.pt          | AdamW moments and step counts                           | torch.save         |
| scheduler.pt          | learning-rate scheduler position                        | torch.save         |
| rng_state.pt          | python, numpy, torch CPU (+CUDA) RNG, one entry per rank | torch.save         |
| trainer_state.json    | step, epoch, samples/tokens seen, loss history, timings | json               |

Under FSDP (``parallelism: fsdp``) ``weights.safetensors`` and ``optimizer.pt`` are replaced by
``sharded/``, a ``torch.distributed.checkpoint`` folder of the trainable weights and AdamW state
(``.metadata`` + one ``__<rank>_0.distcp`` a rank), which loads back on any number of processes.
Every rank uploads its own shard and leaves a receipt (``shards/rank-<r>.json``: its files, sizes and
sha256); rank 0 writes the manifest, listing every rank's files, only once every receipt of this
attempt is in the store. So a checkpoint whose shards are not all complete never looks complete,
on one node or many (each node uploads from its own disk).

Torch files are read back with ``torch.load(weights_only=True)``: a tampered checkpoint cannot run
code, it is refused with ``UntrustedCheckpoint``. Weights never go through pickle at all.

A store that cannot be reached while resuming is not a corrupt checkpoint: ``find_latest_checkpoint``
skips (and the recipe then deletes) only checkpoints that have no manifest or fail their sha256; an
outage, after the store's own retries, is an error and nothing is skipped or deleted.

Uploading is slow next to a training step (a 7B LoRA checkpoint is ~0.5 GB with optimizer state, a
few seconds to S3; a full fine-tune tens of GB), so ``BackgroundUploader`` publishes a checkpoint that
was written to local disk while training continues. At most one upload is in flight: the GPU waits
only when checkpoints are produced faster than the store takes them.
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import random
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ft_assets import layout
from ft_assets.manifests import (
    MANIFEST,
    ArtifactCorrupt,
    ArtifactNotFound,
    Manifest,
    fetch_artifact,
    publish_dir,
    upload_files,
    write_manifest,
)
from ft_assets.objectives import Objective
from ft_assets.storage import ObjectStore, StoreError, join_key
from ft_assets.training.config import TrainingConfig

WEIGHTS = "weights.safetensors"
OPTIMIZER = "optimizer.pt"
SCHEDULER = "scheduler.pt"
RNG_STATE = "rng_state.pt"
TRAINER_STATE = "trainer_state.json"
SHARDED = "sharded"  # FSDP: the torch.distributed.checkpoint folder of the trainable weights and optimizer state
RECEIPTS = "shards"  # FSDP: shards/rank-<r>.json, what rank r uploaded; rank 0 commits once all are there
SHARD_WAIT_S = 1800.0  # how long rank 0 waits for the other ranks' shards before it gives the checkpoint up
SHARD_POLL_S = 0.2

Log = Callable[[str], None]


def run_id(
    partition_key: str,
    config: TrainingConfig,
    objective: Objective,
    base_model_digest: str,
    shards_digest: str,
    cuda_available: bool | None = None,
) -> str:
    """A stable 16-hex-digit id of one training run: same inputs, same id, same checkpoints to resume.

    ``cuda_available`` resolves ``method=None`` (qlora on CUDA, lora elsewhere); it defaults to this
    machine, so compute the id on the worker that trains. Of the objectives' settings only ``objective``'s
    count (``TrainingConfig.result_fields``).
    """
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    identity = {
        "partition": partition_key,
        "config": config.result_fields(cuda_available, objective),
        "base_model": base_model_digest,
        "shards": shards_digest,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def _scan(store: ObjectStore, prefix: str) -> dict[int, bool]:
    """Step -> has a manifest, for every ``checkpoint-*`` under a run that holds at least one file.

    One recursive listing answers both questions for every checkpoint (one request per 1,000 keys
    on S3), instead of a folder listing plus one existence check per checkpoint.
    """
    found: dict[int, bool] = {}
    for key in store.list(prefix):
        name, _, rest = key[len(prefix) :].strip("/").partition("/")
        if (match := layout.CHECKPOINT_RE.match(name)) and rest:
            step = int(match.group(1))
            found[step] = found.get(step, False) or rest == MANIFEST
    return found


def checkpoint_steps(store: ObjectStore, prefix: str) -> list[int]:
    """Steps of every checkpoint under a run, complete or not, newest first."""
    return sorted(_scan(store, prefix), reverse=True)


def complete_checkpoints(store: ObjectStore, prefix: str) -> list[str]:
    """URIs of the checkpoints that have a manifest, oldest first."""
    steps = sorted(step for step, complete in _scan(store, prefix).items() if complete)
    return [store.uri(layout.checkpoint(prefix, step)) for step in steps]


# --- contents ------------------------------------------------------------------------------------


@dataclass
class TrainerState:
    """Progress of a run, carried from checkpoint to checkpoint across worker restarts."""

    step: int = 0
    total_steps: int = 0
    epoch: int = 0
    samples_seen: int = 0
    tokens_seen: int = 0
    world_size: int = 1
    method: str = ""
    loss_history: list[tuple[int, float]] = field(default_factory=list)
    eval_history: list[tuple[int, float]] = field(default_factory=list)
    figure_history: list[tuple[int, dict]] = field(
        default_factory=list
    )  # the objective's own figures at each log line (GRPO)
    # One entry per worker attempt: start step, last checkpointed step and the attempt's timings up
    # to that checkpoint. Time an attempt spent after its last checkpoint (before a SIGKILL) is lost.
    attempts: list[dict] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> TrainerState:
        raw = json.loads(text)
        raw["loss_history"] = [tuple(item) for item in raw.get("loss_history", [])]
        raw["eval_history"] = [tuple(item) for item in raw.get("eval_history", [])]
        raw["figure_history"] = [tuple(item) for item in raw.get("figure_history", [])]
        return cls(**raw)


def capture_rng_state() -> dict:
    """Every RNG the training step may draw from, in a form ``torch.load(weights_only=True)`` accepts."""
    bit_generator, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {
            "bit_generator": bit_generator,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np_state = state["numpy"]
    np.random.set_state(
        (
            np_state["bit_generator"],
            np_state["keys"].numpy().astype(np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class CheckpointWriteFailed(OSError):
    """A checkpoint could not be written to the worker's local disk (full, read-only)."""


class _WriteRecorder(io.RawIOBase):
    """A file wrapper that keeps the OSError of a failed write: torch.save reports only 'unexpected pos'."""

    def __init__(self, handle):
        super().__init__()
        self.handle = handle
        self.error: OSError | None = None

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        try:
            return self.handle.write(data)
        except OSError as exc:
            self.error = exc
            raise


def _torch_save(obj, path: Path) -> None:
    with open(path, "wb") as handle:
        recorder = _WriteRecorder(handle)
        try:
            torch.save(obj, recorder)
        except RuntimeError as exc:
            if recorder.error is None:
                raise
            raise recorder.error from exc


def write_checkpoint(
    local_dir: Path,
    weights: dict[str, torch.Tensor],
    optimizer_state: dict,
    scheduler_state: dict,
    rng_states: list[dict],
    trainer_state: TrainerState,
) -> Path:
    """Write one checkpoint to a local folder (the uploader publishes it); ``rng_states[rank]``."""
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in weights.items()}

    def write() -> None:
        save_file(tensors, local_dir / WEIGHTS)
        _torch_save(optimizer_state, local_dir / OPTIMIZER)
        write_run_state(local_dir, scheduler_state, rng_states, trainer_state)

    return write_fresh(local_dir, write)


def write_sharded_checkpoint(local_dir: Path, write_shard: Callable[[Path], None], run_state: tuple | None) -> Path:
    """One rank's part of an FSDP checkpoint: ``write_shard(local_dir / SHARDED)`` (the collective
    torch.distributed.checkpoint save), and on rank 0 ``run_state`` = (scheduler state, RNG states, TrainerState)."""

    def write() -> None:
        write_shard(local_dir / SHARDED)
        if run_state is not None:
            write_run_state(local_dir, *run_state)

    return write_fresh(local_dir, write)


def write_run_state(
    local_dir: Path, scheduler_state: dict, rng_states: list[dict], trainer_state: TrainerState
) -> None:
    _torch_save(scheduler_state, local_dir / SCHEDULER)
    _torch_save(rng_states, local_dir / RNG_STATE)
    (local_dir / TRAINER_STATE).write_text(trainer_state.to_json())


def write_fresh(local_dir: Path, write: Callable[[], None]) -> Path:
    """Run ``write`` into an emptied ``local_dir``; a full or read-only disk becomes ``CheckpointWriteFailed``."""
    try:
        if local_dir.exists():
            shutil.rmtree(local_dir)
        local_dir.mkdir(parents=True)
        write()
    except (OSError, SafetensorError) as exc:
        shutil.rmtree(local_dir, ignore_errors=True)
        try:
            free = f"{shutil.disk_usage(local_dir.parent).free / 1e6:,.2f} MB free there"
        except OSError:
            free = "free space unknown"
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise CheckpointWriteFailed(
            f"could not write checkpoint {local_dir} ({free}): {reason}; free space on that disk or point FT_SCRATCH "
            "at a bigger one, then rerun: the run resumes from its last complete checkpoint"
        ) from exc
    return local_dir


class UntrustedCheckpoint(ValueError):
    """A checkpoint file holds pickled objects other than tensors and plain data: it is not loaded."""


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint fetched (and sha256-verified) to a local folder."""

    step: int
    uri: str
    local_dir: Path
    manifest: Manifest

    def weights(self) -> dict[str, torch.Tensor]:
        return load_file(self.local_dir / WEIGHTS)

    def optimizer_state(self) -> dict:
        return self._load(OPTIMIZER)

    def scheduler_state(self) -> dict:
        return self._load(SCHEDULER)

    def rng_states(self) -> list[dict]:
        return self._load(RNG_STATE)

    def _load(self, name: str):
        """A torch file of the checkpoint, unpickled with ``weights_only``: tensors and plain data only."""
        try:
            return torch.load(self.local_dir / name, weights_only=True)
        except pickle.UnpicklingError as exc:
            reason = str(exc).strip().splitlines()[0][:300]
            raise UntrustedCheckpoint(
                f"refusing to load {self.uri}/{name}: it holds pickled objects other than tensors ({reason}). "
                "Unpickling them could run arbitrary code, and ft-assets never writes such files: if you did not "
                f"put it there, treat the store as compromised; otherwise delete {self.uri} and rerun"
            ) from exc

    def trainer_state(self) -> TrainerState:
        return TrainerState.from_json((self.local_dir / TRAINER_STATE).read_text())

    @property
    def sharded_dir(self) -> Path | None:
        """The torch.distributed.checkpoint folder of an FSDP checkpoint; None for a DDP one."""
        return self.local_dir / SHARDED if (self.local_dir / SHARDED).is_dir() else None


def check_resumable(checkpoint: Checkpoint, parallelism: str, rows_per_step: int) -> None:
    """Refuse a checkpoint this run cannot continue: another format (DDP's files vs FSDP's shards) or global batch.

    Another number of processes is fine when the global batch is the same: the same rows in the same steps.
    """
    sharded = checkpoint.sharded_dir is not None
    if sharded != (parallelism == "fsdp"):
        raise ValueError(
            f"checkpoint {checkpoint.uri} was written under parallelism {'fsdp' if sharded else 'ddp'} but this run is "
            f"{parallelism}: set parallelism back, or delete the run's checkpoints to start over"
        )
    state = checkpoint.trainer_state()
    if state.step and state.samples_seen != state.step * rows_per_step:
        raise ValueError(
            f"checkpoint {checkpoint.uri} took {state.samples_seen // state.step} rows a step, this run takes "
            f"{rows_per_step}; keep per_device_batch_size x gradient_accumulation_steps x processes x nodes equal to "
            "resume on another number of processes"
        )


def fetch_checkpoint(store: ObjectStore, prefix: str, step: int, dest: Path) -> Checkpoint:
    """Download and verify one checkpoint.

    Raises ``ArtifactNotFound`` (no manifest), ``ArtifactCorrupt`` (a file missing or failing its sha256)
    and, for anything else (the store unreachable after its retries, access refused), ``StoreError``.
    """
    key = layout.checkpoint(prefix, step)
    local_dir = dest / layout.checkpoint_name(step)
    manifest = fetch_artifact(store, key, local_dir)
    return Checkpoint(step=step, uri=store.uri(key), local_dir=local_dir, manifest=manifest)


def find_latest_checkpoint(
    store: ObjectStore, prefix: str, dest: Path, log: Log = print
) -> tuple[Checkpoint | None, list[int]]:
    """The newest checkpoint that is complete and verifies, and the steps of the newer ones skipped.

    A checkpoint without a manifest (its upload was interrupted) or whose files fail their sha256 is
    skipped with a warning and the previous one is tried. Any other store error is raised: an outage
    must not make good checkpoints look corrupt (the recipe deletes the skipped ones).
    """
    skipped = []
    try:
        steps = checkpoint_steps(store, prefix)
    except StoreError as exc:
        raise StoreError(f"cannot look for checkpoints under {store.uri(prefix)}: {exc}") from exc
    for step in steps:
        uri = store.uri(layout.checkpoint(prefix, step))
        try:
            checkpoint = fetch_checkpoint(store, prefix, step, dest)
        except ArtifactNotFound:
            log(f"WARNING: skipping {uri}: it has no {MANIFEST} (its upload was interrupted)")
        except ArtifactCorrupt as exc:
            log(f"WARNING: skipping {uri}: corrupt ({exc})")
        except StoreError as exc:
            raise StoreError(
                f"cannot resume from {uri}: {exc}. Nothing was skipped or deleted; rerun once the store is reachable"
            ) from exc
        else:
            return checkpoint, skipped
        shutil.rmtree(dest / layout.checkpoint_name(step), ignore_errors=True)
        skipped.append(step)
    return None, skipped


def receipt_key(checkpoint_prefix: str, rank: int) -> str:
    """Where rank ``rank`` notes the files it uploaded for an FSDP checkpoint."""
    return join_key(checkpoint_prefix, RECEIPTS, f"rank-{rank:05d}.json")


def delete_checkpoint(store: ObjectStore, prefix: str, step: int) -> None:
    """Delete one checkpoint, manifest first: a half-deleted checkpoint never looks complete."""
    key = layout.checkpoint(prefix, step)
    store.delete(join_key(key, MANIFEST))
    store.delete_prefix(key)


def prune_checkpoints(store: ObjectStore, prefix: str, keep: int, log: Log = print) -> list[int]:
    """Keep the ``keep`` newest complete checkpoints; delete older ones and older incomplete leftovers.

    Incomplete checkpoints newer than the newest complete one are left alone: one may be uploading.
    """
    scan = _scan(store, prefix)
    steps = sorted(scan, reverse=True)
    complete = [step for step in steps if scan[step]]
    if not complete:
        return []
    kept = set(complete[:keep])
    doomed = [s for s in steps if s not in kept and s < complete[0]]
    for step in doomed:
        delete_checkpoint(store, prefix, step)
    if doomed:
        log(f"pruned {len(doomed)} old checkpoint(s) of {store.uri(prefix)}: steps {sorted(doomed)}")
    return doomed


# --- background upload ---------------------------------------------------------------------------


class CheckpointUploadFailed(StoreError):
    """A background checkpoint upload failed; raised on the next save, ``wait()`` or ``close()``."""


class BackgroundUploader:
    """Publish locally written checkpoints of one run in a background thread, one at a time.

    ``submit`` first waits for the previous upload (re-raising its error), then starts the next one
    and returns at once. After each manifest lands, old checkpoints are pruned to ``keep``. The local
    folder is deleted once published: the store is the only copy that counts. Log lines from the
    upload thread are queued and handed to ``log`` on the caller's thread (``submit``, ``wait``,
    ``drain_log``), so ``log`` need not be thread-safe.
    """

    def __init__(
        self,
        store: ObjectStore,
        run: str,
        keep: int | None = None,
        log: Log = print,
        shards: int = 1,
        rank: int = 0,
        attempt: str = "",
    ):
        """``shards`` > 1 (FSDP): each of that many ranks uploads its own part of every checkpoint and leaves a
        receipt tagged ``attempt`` (the same on every rank of this attempt); rank 0 commits and prunes."""
        self.store = store
        self.run = run
        self.keep = keep
        self.log = log
        self.shards, self.rank, self.attempt = shards, rank, attempt
        self.bytes_uploaded = 0
        self.upload_seconds = 0.0  # time the uploads took, in the background
        self.wait_seconds = 0.0  # time the caller was blocked waiting for an upload
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._current = ""
        self._messages: list[str] = []

    def submit(self, local_dir: Path, step: int, meta: dict | None = None) -> str:
        """Start publishing ``local_dir`` as the checkpoint of ``step``; returns its URI."""
        self.wait()
        prefix = layout.checkpoint(self.run, step)
        self._current = self.store.uri(prefix)
        self._thread = threading.Thread(
            target=self._upload, args=(Path(local_dir), prefix, meta), name="checkpoint-upload", daemon=True
        )
        self._thread.start()
        return self._current

    def _upload(self, local_dir: Path, prefix: str, meta: dict | None) -> None:
        started = time.monotonic()
        try:
            if self.shards == 1:
                manifest = publish_dir(self.store, prefix, local_dir, meta=meta)
                uploaded = manifest.total_bytes
            elif self.rank:
                files = upload_files(self.store, prefix, local_dir)
                self.store.put_json(receipt_key(prefix, self.rank), {"attempt": self.attempt, "files": files})
                uploaded = sum(info["size"] for info in files.values())
            else:
                self.store.delete(join_key(prefix, MANIFEST))
                files = upload_files(self.store, prefix, local_dir)
                uploaded = sum(info["size"] for info in files.values())
                manifest = write_manifest(self.store, prefix, {**self._other_shards(prefix), **files}, meta)
            seconds = time.monotonic() - started
            self.bytes_uploaded += uploaded
            self.upload_seconds += seconds
            if self.rank == 0:
                self._messages.append(
                    f"published {self.store.uri(prefix)} ({manifest.total_bytes / 1e6:,.1f} MB in {seconds:.1f}s)"
                )
                if self.keep is not None:
                    prune_checkpoints(self.store, self.run, self.keep, log=self._messages.append)
            shutil.rmtree(local_dir, ignore_errors=True)
        except BaseException as exc:  # surfaced in the training thread by wait()
            self._error = exc

    def _other_shards(self, prefix: str) -> dict[str, dict]:
        """Rank 0: the manifest entries of ranks 1.. from their receipts of this attempt, waiting for them to land."""
        deadline = time.monotonic() + SHARD_WAIT_S
        files: dict[str, dict] = {}
        waiting = set(range(1, self.shards))
        while waiting:
            for rank in sorted(waiting):
                key = receipt_key(prefix, rank)
                if self.store.exists(key) and (receipt := self.store.get_json(key)).get("attempt") == self.attempt:
                    files.update(receipt["files"])
                    waiting.discard(rank)
            if waiting and time.monotonic() > deadline:
                raise TimeoutError(
                    f"rank(s) {sorted(waiting)} did not upload their shards of {self.store.uri(prefix)} within "
                    f"{SHARD_WAIT_S:.0f}s; the checkpoint stays uncommitted and the run resumes from the previous one"
                )
            if waiting:
                time.sleep(SHARD_POLL_S)
        return files

    def drain_log(self) -> None:
        while self._messages:
            self.log(self._messages.pop(0))

    def wait(self) -> None:
        """Block until the upload in flight (if any) is published; raise its error if it failed."""
        if self._thread is not None:
            started = time.monotonic()
            self._thread.join()
            self.wait_seconds += time.monotonic() - started
            self._thread = None
        self.drain_log()
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointUploadFailed(f"upload of checkpoint {self._current} failed: {error}") from error

    def close(self) -> None:
        """Wait for the last upload; a worker must not report success before its checkpoint landed."""
        self.wait()
