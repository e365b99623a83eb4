"""Storage faults: the S3 server stopped mid-upload and mid-download, and a full local disk.

The server is the real SeaweedFS of ``s3server.py``, stopped with SIGKILL at a chosen moment and
started again on the same ports and data. A short outage must be ridden out by the store's retries
(the training run ends with the same adapter as an undisturbed one); an outage that lasts must end in
a ``StoreError`` naming the endpoint, with nothing published without its manifest and no partial
file left locally; after the restart a rerun completes. The full disk is a real one: a 1 MiB tmpfs
mounted in a private mount namespace of a forked worker (an unprivileged user namespace when the
tests do not run as root).
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from boto3.exceptions import RetriesExceededError
from boto3.s3.transfer import TransferConfig
from botocore.exceptions import (
    ClientError,
    ConnectionClosedError,
    EndpointConnectionError,
    NoCredentialsError,
    ResponseStreamingError,
)

from ft_assets import layout
from ft_assets.manifests import MANIFEST, ArtifactNotFound, fetch_artifact, publish_dir, read_manifest
from ft_assets.storage import CHUNK, LocalStore, ObjectExists, S3Store, StoreError, join_key, open_store, sha256_file
from ft_assets.training.checkpoints import (
    CheckpointUploadFailed,
    TrainerState,
    checkpoint_steps,
    complete_checkpoints,
    write_checkpoint,
)
from ft_assets.training.recipe import train
from ft_assets_tests.support import RUN, assert_same_weights, final_weights, record_figures, training_config as config

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

OUTAGE_S = 1.0  # the server is down this long, plus its restart (~4 s)
SHORT_ATTEMPTS = 3  # 0.5 + 1 = 1.5 s of backoff: "stays down" is decided quickly in the tests


def s3_store(url: str, **kwargs) -> S3Store:
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    return S3Store(bucket, prefix, **kwargs)


def quiet(line: str) -> None:
    pass


# --- the retry policy, without a server -------------------------------------------------------------


def client_error(code: str, status: int = 400) -> ClientError:
    return ClientError(
        {"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject"
    )


RETRY_CASES = [
    # (name, errors raised by successive attempts, expected: result / exception type and message, attempts)
    (
        "connection-refused",
        [EndpointConnectionError(endpoint_url="http://x")] * 9,
        (StoreError, "cannot reach .*gave up after 4 attempt"),
        4,
    ),
    ("connection-reset", [ConnectionClosedError(endpoint_url="http://x")] * 9, (StoreError, "cannot reach"), 4),
    (
        "stream-broke-during-download",
        [RetriesExceededError(ResponseStreamingError(error="reset"))] * 9,
        (StoreError, "cannot reach"),
        4,
    ),
    ("server-restarting", [client_error("InternalError", 500)] * 9, (StoreError, "answered InternalError"), 4),
    ("throttled", [client_error("SlowDown", 503)] * 9, (StoreError, "answered SlowDown"), 4),
    ("outage-then-back", [EndpointConnectionError(endpoint_url="http://x")] * 2, "ok", 3),
    ("missing", [client_error("NoSuchKey", 404)], (StoreError, "missing object"), 1),
    ("refused", [client_error("AccessDenied", 403)], (StoreError, "was refused"), 1),
    ("exists", [client_error("PreconditionFailed", 412)], (ObjectExists, "already exists"), 1),
    ("no-credentials", [NoCredentialsError()], (StoreError, "Unable to locate credentials"), 1),
    ("local-disk-error-is-not-ours", [OSError(errno.ENOSPC, "No space left on device")], (OSError, "No space left"), 1),
]


@pytest.mark.parametrize("name,errors,expected,attempts", RETRY_CASES, ids=[c[0] for c in RETRY_CASES])
def test_retry_policy(monkeypatch, name, errors, expected, attempts):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    waits = []
    monkeypatch.setattr("ft_assets.storage.time.sleep", waits.append)
    store = S3Store("ft-nowhere", max_attempts=4)
    calls = iter(errors)

    def attempt():
        error = next(calls, None)
        if error is not None:
            raise error
        return "ok"

    if expected == "ok":
        assert store._call("write", "k", attempt) == "ok"
    else:
        with pytest.raises(expected[0], match=expected[1]):
            store._call("write", "k", attempt)
    assert len(waits) == attempts - 1
    assert waits == [0.5, 1.0, 2.0][: attempts - 1]  # exponential backoff


# --- the server stopped during a checkpoint upload ----------------------------------------------------


def stop_during_upload(store: S3Store, seaweedfs, step: int, restart_after: float | None) -> threading.Event:
    """Stop the server once the first file of checkpoint ``step`` is in; restart it ``restart_after`` s later."""
    stopped = threading.Event()
    real_put_file = store.put_file
    marker = layout.checkpoint(RUN, step) + "/"

    def put_file(key, path):
        if marker in key and not stopped.is_set() and any(k.startswith(marker) for k in store.list(RUN)):
            seaweedfs.stop(grace=0)
            stopped.set()
            if restart_after is not None:
                threading.Timer(restart_after, seaweedfs.start).start()
        real_put_file(key, path)

    store.put_file = put_file
    return stopped


@pytest.mark.integration
def test_outage_during_a_checkpoint_upload_is_retried_and_the_run_completes(
    s3_env, seaweedfs, tiny_model, shards, tmp_path, reference, caplog
):
    store = s3_store(s3_env)
    stopped = stop_during_upload(store, seaweedfs, step=8, restart_after=OUTAGE_S)
    with caplog.at_level(logging.WARNING, logger="ft_assets.storage"):
        result = train(config(max_steps=24, save_steps=4), tiny_model, shards, store, RUN, tmp_path / "work", log=quiet)
    assert stopped.is_set()
    retries = [r.getMessage() for r in caplog.records if "retrying in" in r.getMessage()]
    assert retries and all(seaweedfs.endpoint in line for line in retries)
    assert result.steps == 24 and [uri.rsplit("-", 1)[-1] for uri in result.checkpoints][:2] == ["00000004", "00000008"]
    assert_same_weights(final_weights(result), reference)
    record_figures(
        "outage_during_a_checkpoint_upload",
        server_killed=1,
        retries=len(retries),
        run_completed_with_the_uninterrupted_adapter=True,
    )


@pytest.mark.integration
def test_store_down_for_good_fails_the_upload_clearly_and_a_rerun_resumes(
    s3_env, seaweedfs, tiny_model, shards, tmp_path, reference
):
    store = s3_store(s3_env, max_attempts=SHORT_ATTEMPTS)
    stop_during_upload(store, seaweedfs, step=8, restart_after=None)
    started = time.monotonic()
    try:
        with pytest.raises(CheckpointUploadFailed) as info:
            train(config(max_steps=24, save_steps=4), tiny_model, shards, store, RUN, tmp_path / "w1", log=quiet)
        failed_after = time.monotonic() - started
    finally:
        seaweedfs.start()
    message = str(info.value)
    assert f"checkpoint {store.uri(layout.checkpoint(RUN, 8))} failed" in message
    assert f"cannot reach {seaweedfs.endpoint}" in message and f"gave up after {SHORT_ATTEMPTS} attempt(s)" in message
    assert failed_after < 60
    # Nothing partial was published: checkpoint 8 has a file or more, but no manifest.
    assert 8 in checkpoint_steps(store, RUN)
    with pytest.raises(ArtifactNotFound):
        read_manifest(store, layout.checkpoint(RUN, 8))
    assert complete_checkpoints(store, RUN) == [store.uri(layout.checkpoint(RUN, 4))]

    lines = []
    result = train(
        config(max_steps=24, save_steps=4), tiny_model, shards, s3_store(s3_env), RUN, tmp_path / "w2", log=lines.append
    )
    assert result.resumed_from_step == 4
    assert any("skipping" in line and "checkpoint-00000008" in line and "no manifest.json" in line for line in lines)
    assert_same_weights(final_weights(result), reference)
    record_figures("store_down_during_a_checkpoint_upload", server_killed=1, attempts=SHORT_ATTEMPTS, error_after_s=round(failed_after, 1),
                   partial_checkpoints_published=0, rerun_completed_with_the_uninterrupted_adapter=True)  # fmt: skip


@pytest.mark.integration
def test_outage_while_resuming_is_an_error_not_a_corrupt_checkpoint(s3_env, seaweedfs, tiny_model, shards, tmp_path):
    """The store going down between the listing and the download must not get good checkpoints deleted."""
    cfg = config(max_steps=8, save_steps=4)
    train(cfg, tiny_model, shards, s3_store(s3_env), RUN, tmp_path / "w1", log=quiet)
    before = complete_checkpoints(s3_store(s3_env), RUN)
    assert len(before) == 2

    store = s3_store(s3_env, max_attempts=SHORT_ATTEMPTS)
    real_list = store.list

    def list_then_stop(prefix):
        keys = real_list(prefix)
        if seaweedfs.running:
            seaweedfs.stop(grace=0)
        return keys

    store.list = list_then_stop
    try:
        with pytest.raises(
            StoreError, match=f"cannot resume from .*checkpoint-00000008.*cannot reach {seaweedfs.endpoint}"
        ) as info:
            train(cfg.model_copy(update={"max_steps": 12}), tiny_model, shards, store, RUN, tmp_path / "w2", log=quiet)
        assert "Nothing was skipped or deleted" in str(info.value)
    finally:
        seaweedfs.start()
    assert complete_checkpoints(s3_store(s3_env), RUN) == before
    record_figures("outage_while_resuming", server_killed=1, good_checkpoints_deleted=0)


# --- the server stopped during a shard download -----------------------------------------------------

SHARDS = "runs/acks/v1/data/shards"


@pytest.fixture
def published_shards(s3_env, tmp_path) -> S3Store:
    source = tmp_path / "shards"
    source.mkdir()
    for index in range(2):
        (source / f"train-{index:05d}.parquet").write_bytes(os.urandom(CHUNK * 2 + 4321))  # 2 ranged parts + a tail
    publish_dir(open_store(s3_env), SHARDS, source)
    return source


def throttled(url: str, **kwargs) -> S3Store:
    """A store whose downloads run at 8 MB/s, so that a 16 MB file is still streaming when the server dies."""
    store = s3_store(url, **kwargs)
    store.transfer = TransferConfig(multipart_threshold=CHUNK, multipart_chunksize=CHUNK, max_bandwidth=8 * 1024 * 1024)
    return store


def stop_when_streaming(seaweedfs, dest: Path, restart_after: float | None) -> threading.Thread:
    """Stop the server as soon as a download has written its first bytes under ``dest``."""

    def watch():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            partial = [p for p in dest.rglob(".tmp-*") if p.is_file() and p.stat().st_size > 0] if dest.exists() else []
            if partial:
                seaweedfs.stop(grace=0)
                if restart_after is not None:
                    time.sleep(restart_after)
                    seaweedfs.start()
                return
            time.sleep(0.005)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.mark.integration
def test_outage_mid_download_is_retried_and_the_shards_verify(s3_env, seaweedfs, published_shards, tmp_path, caplog):
    dest = tmp_path / "fetched"
    watcher = stop_when_streaming(seaweedfs, dest, restart_after=OUTAGE_S)
    with caplog.at_level(logging.WARNING, logger="ft_assets.storage"):
        manifest = fetch_artifact(throttled(s3_env), SHARDS, dest)
    watcher.join()
    retries = [r for r in caplog.records if "retrying in" in r.getMessage()]
    assert retries, "the server never went down mid-download"
    for rel, info in manifest.files.items():
        assert sha256_file(dest / rel) == info["sha256"] == sha256_file(published_shards / rel)
    assert not list(dest.rglob(".tmp-*"))
    record_figures(
        "outage_mid_shard_download", server_killed=1, retries=len(retries), shards_verified=len(manifest.files)
    )


@pytest.mark.integration
def test_download_with_the_store_down_fails_clearly_and_leaves_no_partial_file(
    s3_env, seaweedfs, published_shards, tmp_path
):
    dest = tmp_path / "fetched"
    watcher = stop_when_streaming(seaweedfs, dest, restart_after=None)
    try:
        with pytest.raises(
            StoreError, match=f"download of .*{SHARDS}/train-00000.parquet failed: cannot reach {seaweedfs.endpoint}"
        ):
            fetch_artifact(throttled(s3_env, max_attempts=SHORT_ATTEMPTS), SHARDS, dest)
        watcher.join()
    finally:
        if not seaweedfs.running:
            seaweedfs.start()
    assert [p.name for p in dest.rglob("*") if p.is_file()] == []  # no partial shard, no temporary file
    record_figures("store_down_during_a_shard_download", server_killed=1, attempts=SHORT_ATTEMPTS, partial_files_left=0)


# --- a full local disk ------------------------------------------------------------------------------

DISK_BYTES = 1024 * 1024
CLONE_NEWNS, CLONE_NEWUSER = 0x00020000, 0x10000000
MS_REC, MS_PRIVATE = 0x4000, 1 << 18


def mount_tmpfs(path: Path, size: int) -> None:
    """A private mount namespace for this (single-threaded, forked) process, and a tmpfs of ``size`` bytes in it."""
    libc = ctypes.CDLL(None, use_errno=True)
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWNS if os.geteuid() == 0 else CLONE_NEWNS | CLONE_NEWUSER

    def check(result: int, what: str) -> None:
        if result != 0:
            raise OSError(ctypes.get_errno(), f"{what}: {os.strerror(ctypes.get_errno())}")

    check(libc.unshare(flags), "unshare")
    if flags & CLONE_NEWUSER:
        Path("/proc/self/setgroups").write_text("deny")
        Path("/proc/self/uid_map").write_text(f"0 {uid} 1")
        Path("/proc/self/gid_map").write_text(f"0 {gid} 1")
    check(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "making / private")
    path.mkdir(parents=True, exist_ok=True)
    check(libc.mount(b"tmpfs", str(path).encode(), b"tmpfs", 0, f"size={size}".encode()), f"mounting a tmpfs on {path}")


def fill(disk: Path, leave: int) -> None:
    """Take all of the disk's free space but ``leave`` bytes."""
    free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
    (disk / "filler").write_bytes(b"\0" * max(free - leave, 0))


def case_store_write(disk: Path, ctx: dict) -> None:
    LocalStore(disk / "store").put_file("big.bin", ctx["big_file"])


def case_publish(disk: Path, ctx: dict) -> None:
    store = LocalStore(disk / "store")
    try:
        publish_dir(store, "runs/acks/v1/data/cleaned", ctx["big_dir"])
    finally:
        ctx["manifest_published"] = store.exists(join_key("runs/acks/v1/data/cleaned", MANIFEST))


def case_local_download(disk: Path, ctx: dict) -> None:
    LocalStore(ctx["source_store"]).get_file("big.bin", disk / "copy" / "big.bin")


def case_s3_download(disk: Path, ctx: dict) -> None:
    fetch_artifact(open_store(ctx["s3_url"]), "big", disk / "fetched")


def case_checkpoint_write(disk: Path, ctx: dict) -> None:
    fill(disk, leave=64 * 1024)  # the weights fit, the optimizer state (torch.save, not safetensors) does not
    optimizer = {"state": {0: {"exp_avg": torch.zeros(256, 256)}}, "param_groups": []}
    write_checkpoint(disk / "ckpt", {"lora_A": torch.zeros(8, 8)}, optimizer, {}, [{}], TrainerState())


def case_training(disk: Path, ctx: dict) -> None:
    fill(disk, leave=16 * 1024)  # the model loads from elsewhere; the first checkpoint does not fit
    train(
        config(max_steps=4, save_steps=2),
        ctx["tiny_model"],
        ctx["shards"],
        LocalStore(ctx["train_store"]),
        RUN,
        disk / "work",
        log=quiet,
    )


FULL_DISK_CASES = [
    # (name, what runs with its local side on the full disk, the error type, the path the message names)
    ("store-write", case_store_write, "StoreError", "store/big.bin"),
    ("publish", case_publish, "StoreError", "store/runs/acks/v1/data/cleaned/"),
    ("local-download", case_local_download, "StoreError", "copy/big.bin"),
    ("s3-download", case_s3_download, "StoreError", "fetched/rows.parquet"),
    ("checkpoint-write", case_checkpoint_write, "CheckpointWriteFailed", "ckpt"),
    ("training", case_training, "CheckpointWriteFailed", "work/checkpoints/checkpoint-00000002"),
]


def full_disk_worker(disk: str, ctx: dict, env: dict, result_path: str) -> None:
    """Forked child: mount the small tmpfs, run every case on it, write what each raised as JSON."""
    os.environ.update(env)
    torch.set_num_threads(1)
    disk = Path(disk)
    try:
        mount_tmpfs(disk, DISK_BYTES)
    except OSError as exc:
        Path(result_path).write_text(json.dumps({"unsupported": str(exc)}))
        return
    results = {}
    for name, case, _, _ in FULL_DISK_CASES:
        try:
            case(disk, ctx)
            outcome = {"type": None, "message": "no error"}
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which asserts on it
            outcome = {"type": type(exc).__name__, "message": str(exc)}
        outcome["left_on_disk"] = sorted(
            p.relative_to(disk).as_posix() for p in disk.rglob("*") if p.is_file() and p.name != "filler"
        )
        outcome["manifest_published"] = ctx.pop("manifest_published", False)
        results[name] = outcome
        for path in sorted(disk.iterdir()):
            os.system(f"rm -rf '{path}'")  # noqa: S605 - a tmp path we own
    Path(result_path).write_text(json.dumps(results))


@pytest.mark.integration
def test_a_full_local_disk_is_a_clear_error_naming_the_path(forkserver, s3_env, tiny_model, shards, tmp_path):  # noqa: F811
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(2 * DISK_BYTES))
    big_dir = tmp_path / "big_dir"
    big_dir.mkdir()
    (big_dir / "rows.parquet").write_bytes(os.urandom(2 * DISK_BYTES))
    source = LocalStore(tmp_path / "source_store")
    source.put_file("big.bin", big)
    publish_dir(open_store(s3_env), "big", big_dir)
    ctx = {"big_file": str(big), "big_dir": str(big_dir), "source_store": str(source.root), "s3_url": s3_env,
           "tiny_model": str(tiny_model), "shards": str(shards), "train_store": str(tmp_path / "train_store")}  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    disk, result = tmp_path / "disk", tmp_path / "result.json"
    worker = forkserver.Process(target=full_disk_worker, args=(str(disk), ctx, env, str(result)))
    worker.start()
    worker.join(180)
    assert worker.exitcode == 0
    results = json.loads(result.read_text())
    if "unsupported" in results:
        pytest.skip(f"cannot mount a small tmpfs here: {results['unsupported']}")
    for name, _, error_type, path in FULL_DISK_CASES:
        outcome = results[name]
        assert outcome["type"] == error_type, (name, outcome)
        assert str(disk / path) in outcome["message"], (name, outcome["message"])
        assert "No space left on device" in outcome["message"], (name, outcome["message"])
        assert "FT_SCRATCH" in outcome["message"], (name, outcome["message"])  # what to do about it
        assert outcome["left_on_disk"] == [], (name, outcome["left_on_disk"])  # no partial file
        assert not outcome["manifest_published"], name
    record_figures(
        "full_local_disk", tmpfs_bytes=DISK_BYTES, cases=[case[0] for case in FULL_DISK_CASES], partial_files_left=0
    )
