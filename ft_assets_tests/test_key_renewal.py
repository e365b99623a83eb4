"""A rented worker's store keys renewed while its attempt runs (``ft_assets.targets.renewal``), against SeaweedFS.

SeaweedFS makes no temporary keys (no STS), so the keys "minted" here are two of its identities: read-only keys
(what the store answers to keys it no longer allows: AccessDenied) and keys that may write. The worker's store
client is switched between them by the renewal itself, sealed through the store, and the store's answers show which
keys it signs with. STS's own request is checked at its SDK boundary in test_remote_worker.py.
"""

import os
import time

import pytest
from dagster_pipes import DAGSTER_PIPES_MESSAGES_ENV_VAR, encode_env_var

from ft_assets.targets.renewal import EXIT_KEYS_REFUSED, Renewal, follower, new_seal, unsealed
from ft_assets.targets.session import outcome_of
from ft_assets.targets import WorkerState
from ft_assets.storage import KeysRefused, S3Store, StoreError
from ft_assets.training import remote
from ft_assets.training.config import TrainingConfig
from ft_assets.training.launch import WorkerJob
from ft_assets_tests.s3server import READER_KEYS

FOLDER = "runs/r/pipes/001/keys"


def stores(s3_env: str) -> tuple[S3Store, S3Store]:
    bucket, _, prefix = s3_env.removeprefix("s3://").partition("/")
    return S3Store(bucket, prefix), S3Store(bucket, prefix)  # the control host's, the worker's


def test_renewed_keys_reach_the_worker_sealed_and_it_signs_with_them_from_then_on(s3_env):
    control, worker = stores(s3_env)
    writer = {k: os.environ[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    minted = iter([READER_KEYS, writer, READER_KEYS])
    renewal, first = Renewal.start(control, FOLDER, lambda: next(minted), life_s=120)
    worker.use_keys(first)
    control.put_bytes("runs/r/in.txt", b"x")
    assert worker.get_bytes("runs/r/in.txt") == b"x"
    with pytest.raises(KeysRefused, match=r"was refused \(AccessDenied\)"):
        worker.put_bytes("runs/r/out.txt", b"y")

    plain, secrets = renewal.worker_env()
    assert set(secrets) == {"FT_KEYS_SEAL"} and secrets["FT_KEYS_SEAL"] not in str(plain)
    said: list[str] = []
    follows = follower(worker, {**plain, **secrets}, said.append)
    assert follows.check_s == 6 and not follows.check()  # a twentieth of the keys' life; nothing renewed yet
    renewal.tick(said.append, now=renewal.issued + 59)  # before half their life: not yet
    assert control.list(FOLDER) == []
    renewal.tick(said.append, now=renewal.issued + 61)
    [key] = control.list(FOLDER)
    raw = control.get_bytes(key)
    assert writer["AWS_SECRET_ACCESS_KEY"].encode() not in raw and b"AWS_" not in raw  # sealed: noise without the seal
    with pytest.raises(StoreError, match="seal does not open"):
        unsealed(new_seal(), raw)
    assert follows.check() and not follows.check()
    worker.put_bytes("runs/r/out.txt", b"y")  # signed with the renewed keys

    follows.check_s = 0.05  # the thread, as on a worker: it takes the next renewal by itself
    with follows:
        renewal.tick(said.append, now=renewal.issued + 61)
        deadline = time.monotonic() + 10
        while follows.seen != "0002.sealed" and time.monotonic() < deadline:
            time.sleep(0.05)
    assert follows.seen == "0002.sealed", said
    with pytest.raises(KeysRefused):
        worker.put_bytes("runs/r/out.txt", b"z")  # the read-only keys again: it switched

    def refused():
        raise StoreError("AWS STS refused GetFederationToken")

    failing = Renewal(control, FOLDER, refused, 120, renewal.issued, renewal.seal, renewal.count)
    failing.tick(said.append, now=failing.issued + 100)
    assert failing.count == 2 and said[-1].startswith("could not renew the worker's store keys (StoreError: AWS STS")
    assert "its current keys expire in 0 min" in said[-1]
    assert [m for m in said if m.startswith("renewed the worker's store keys (renewal 1; valid until ")]
    assert not [m for m in said if writer["AWS_SECRET_ACCESS_KEY"] in m or "ft-assets-reader-secret" in m]


def test_a_worker_whose_keys_the_store_refuses_stops_with_its_own_exit_code(s3_env, monkeypatch, capsys, tmp_path):
    """Refused keys end the attempt with ``EXIT_KEYS_REFUSED`` (not a failure of the run): the control host starts the
    next attempt with new keys, or, where it cannot make new ones, fails the step in one line."""
    control, _ = stores(s3_env)
    job = WorkerJob(TrainingConfig(), s3_env, "runs/r", "models/m", "datasets/d/v1/data/shards", "sft", {})
    spec = {"job": job.to_json(), "attempt": 1, "output": "runs/r/output",
            "pipes": {DAGSTER_PIPES_MESSAGES_ENV_VAR: encode_env_var({"key_prefix": "runs/r/pipes/001"})}}  # fmt: skip
    control.put_json("runs/r/pipes/001/job.json", spec)
    for name, value in READER_KEYS.items():  # it reads its job; its first write (claiming its start) is refused
        monkeypatch.setenv(name, value)
    args = ["--store", s3_env, "--job", "runs/r/pipes/001/job.json", "--work-dir", str(tmp_path)]
    assert remote.main(args) == EXIT_KEYS_REFUSED
    err = capsys.readouterr().err
    assert "ft-assets worker: the store refused this worker's keys (" in err and "AccessDenied" in err
    assert READER_KEYS["AWS_SECRET_ACCESS_KEY"] not in err
    assert outcome_of(WorkerState(running=False, exit_code=EXIT_KEYS_REFUSED)) == "refused"
