"""The object store on both backends (a local directory and a real S3 server, SeaweedFS) and the
artifact rule built on it: files first, manifest last, and a reader trusts nothing else."""

import hashlib
import os
import re
import socket
import time
import traceback
import uuid
from pathlib import Path

import pytest

from ft_assets.manifests import (
    MANIFEST,
    ArtifactCorrupt,
    ArtifactNotFound,
    changed_files,
    fetch_artifact,
    publish_dir,
    read_manifest,
    verify_artifact,
)
from ft_assets.storage import CHUNK, LocalStore, S3Store, StoreError, join_key, open_store, sha256_file


def bucket_and_key(uri: str) -> tuple[str, str]:
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    return bucket, key


# --- bytes and files --------------------------------------------------------------------------------

ROUND_TRIPS = [
    # (how it is written, key, payload)
    ("bytes", "a.bin", b"\x00\x01 binary \xff"),
    ("bytes", "empty.txt", b""),
    ("bytes", "runs/demo/v1/data/deep/nested/rows.jsonl", b'{"a": 1}\n' * 100),
    ("file", "model/adapter.safetensors", bytes(range(256)) * 400),
    ("file", "names/with space/ünïcode.txt", "héllo".encode()),
]


@pytest.mark.parametrize("how,key,payload", ROUND_TRIPS, ids=[f"{c[0]}-{c[1]}" for c in ROUND_TRIPS])
def test_round_trip(store, tmp_path, how, key, payload):
    if how == "bytes":
        store.put_bytes(key, payload)
    else:
        source = tmp_path / "source.bin"
        source.write_bytes(payload)
        store.put_file(key, source)

    assert store.exists(key)
    assert store.size(key) == len(payload)
    assert store.get_bytes(key) == payload
    store.get_file(key, tmp_path / "out" / "copy.bin")
    assert (tmp_path / "out" / "copy.bin").read_bytes() == payload

    store.put_bytes(key, b"second version")  # an overwrite replaces the object
    assert store.get_bytes(key) == b"second version"


MISSING_KEY_OPS = {
    "get_bytes": lambda store, key, dest: store.get_bytes(key),
    "get_json": lambda store, key, dest: store.get_json(key),
    "get_file": lambda store, key, dest: store.get_file(key, dest),
    "size": lambda store, key, dest: store.size(key),
}


@pytest.mark.parametrize("op", MISSING_KEY_OPS)
def test_missing_key_raises_store_error_naming_the_uri(store, tmp_path, op):
    key = "no/such/object.bin"
    dest = tmp_path / "out" / "object.bin"
    with pytest.raises(StoreError, match=re.escape(store.uri(key))):
        MISSING_KEY_OPS[op](store, key, dest)
    assert not store.exists(key)
    assert not dest.exists()
    assert not [p for p in tmp_path.rglob(".tmp-*")], "a failed download left a temporary file"


LAYOUT = ["top.txt", "runs/b/3.txt", "runs/a/sub/2.txt", "runs/a/1.txt", "runs_other/4.txt"]  # unsorted
LIST_CASES = {
    "": sorted(LAYOUT),
    "runs": ["runs/a/1.txt", "runs/a/sub/2.txt", "runs/b/3.txt"],
    "runs/a": ["runs/a/1.txt", "runs/a/sub/2.txt"],
    "runs/a/sub": ["runs/a/sub/2.txt"],
    "run": [],  # a prefix is a directory, not the start of a name
    "runs/a/1.txt": [],  # a file is not a directory
    "nope": [],
}
LIST_DIRS_CASES = {
    "": ["runs", "runs_other"],
    "runs": ["a", "b"],
    "runs/a": ["sub"],
    "runs/a/sub": [],
    "nope": [],
}


def test_list_and_list_dirs(store):
    for key in LAYOUT:
        store.put_bytes(key, key.encode())
    assert {prefix: store.list(prefix) for prefix in LIST_CASES} == LIST_CASES
    assert {prefix: store.list_dirs(prefix) for prefix in LIST_DIRS_CASES} == LIST_DIRS_CASES


def test_delete(store):
    for key in LAYOUT:
        store.put_bytes(key, key.encode())

    store.delete("runs/b/3.txt")
    store.delete("runs/b/3.txt")  # deleting what is gone is not an error
    assert not store.exists("runs/b/3.txt")
    assert "runs/b/3.txt" not in store.list("")
    assert store.list_dirs("runs") == ["a"]  # an emptied directory disappears, as on S3
    with pytest.raises(StoreError, match="missing object"):
        store.get_bytes("runs/b/3.txt")

    store.delete_prefix("runs")
    assert store.list("") == ["runs_other/4.txt", "top.txt"]
    assert store.list_dirs("") == ["runs_other"]


@pytest.mark.integration
def test_uri_names_where_the_bytes_are(tmp_path, s3_env, seaweedfs):
    local = LocalStore(tmp_path / "store")
    assert local.uri("a/b.txt") == str(tmp_path.resolve() / "store" / "a" / "b.txt")
    local.put_bytes("a/b.txt", b"local")
    assert Path(local.uri("a/b.txt")).read_bytes() == b"local"

    client = seaweedfs.client()
    bucket, _ = bucket_and_key(s3_env)
    for url in (s3_env, f"s3://{bucket}"):  # with and without a prefix
        s3 = open_store(url)
        assert s3.uri("a/b.txt") == f"{url}/a/b.txt"
        s3.put_bytes("a/b.txt", url.encode())
        uri_bucket, uri_key = bucket_and_key(s3.uri("a/b.txt"))
        assert client.get_object(Bucket=uri_bucket, Key=uri_key)["Body"].read() == url.encode()


@pytest.mark.integration
def test_multipart_upload_round_trips(s3_env, tmp_path):
    store = open_store(s3_env)
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(CHUNK + 12345))  # just over one part: two parts
    store.put_file("model/big.bin", big)

    head = store.client.head_object(Bucket=store.bucket, Key=join_key(store.prefix, "model/big.bin"))
    assert head["ETag"].strip('"').endswith("-2"), f"not a 2-part multipart upload: ETag {head['ETag']}"
    assert store.size("model/big.bin") == big.stat().st_size
    store.get_file("model/big.bin", tmp_path / "back.bin")
    assert sha256_file(tmp_path / "back.bin") == sha256_file(big)


# --- unsafe keys, credentials, endpoints, URLs --------------------------------------------------------

UNSAFE_KEYS = ["../x", "<tmp>/abs.txt", "a/../../b", "a//b", "", ".", "a/./b", "x/..", "a\\b", "trailing/"]
KEY_OPS = {
    "put_bytes": lambda store, key, source: store.put_bytes(key, b"payload"),
    "put_file": lambda store, key, source: store.put_file(key, source),
    "get_bytes": lambda store, key, source: store.get_bytes(key),
    "get_file": lambda store, key, source: store.get_file(key, source.with_name("out.bin")),
    "exists": lambda store, key, source: store.exists(key),
    "size": lambda store, key, source: store.size(key),
    "delete": lambda store, key, source: store.delete(key),
}


@pytest.mark.parametrize("key", UNSAFE_KEYS)
def test_unsafe_keys_are_refused(store, tmp_path, key):
    key = key.replace("<tmp>", str(tmp_path))  # an absolute path that lands in tmp_path if accepted
    source = tmp_path / "source.bin"
    source.write_bytes(b"payload")
    for name, op in KEY_OPS.items():
        with pytest.raises(StoreError, match="invalid object key"):
            op(store, key, source)
    assert store.list("") == []
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == [source]


def test_fetch_refuses_a_manifest_path_outside_dest(store, tmp_path):
    outside = tmp_path / "outside.txt"
    prefix = "runs/evil"
    store.put_bytes(join_key(prefix, str(outside)), b"planted")  # where the absolute path would read from
    planted = {"size": 7, "sha256": hashlib.sha256(b"planted").hexdigest()}
    store.put_json(join_key(prefix, MANIFEST), {"prefix": prefix, "files": {str(outside): planted}, "created_at": 0})
    with pytest.raises(StoreError, match="invalid object key"):
        fetch_artifact(store, prefix, tmp_path / "dest")
    assert not outside.exists()


REMOTE_OPS = {
    "put_bytes": lambda store, source: store.put_bytes("new.txt", b"x"),
    "put_file": lambda store, source: store.put_file("new.txt", source),
    "get_bytes": lambda store, source: store.get_bytes("seed.txt"),
    "get_file": lambda store, source: store.get_file("seed.txt", source.with_name("out.txt")),
    "exists": lambda store, source: store.exists("seed.txt"),
    "size": lambda store, source: store.size("seed.txt"),
    "list": lambda store, source: store.list(""),
    "list_dirs": lambda store, source: store.list_dirs(""),
    "delete": lambda store, source: store.delete("seed.txt"),
}
WRONG_CREDENTIALS = {
    "wrong-secret": {"AWS_SECRET_ACCESS_KEY": f"not-the-secret-{uuid.uuid4().hex}"},
    "unknown-access-key": {"AWS_ACCESS_KEY_ID": "AKIANOSUCHKEY0000000"},
}


@pytest.mark.integration
@pytest.mark.parametrize("case", WRONG_CREDENTIALS)
def test_wrong_credentials_are_refused_without_leaking_the_secret(s3_env, seaweedfs, monkeypatch, tmp_path, case):
    good = open_store(s3_env)  # the client resolves its credentials now
    good.put_bytes("seed.txt", b"seed")
    for name, value in WRONG_CREDENTIALS[case].items():
        monkeypatch.setenv(name, value)
    bad = open_store(s3_env)
    source = tmp_path / "source.txt"
    source.write_text("x")

    for name, op in REMOTE_OPS.items():
        with pytest.raises(StoreError) as info:
            op(bad, source)
        message = str(info.value)
        assert "refused" in message and "AWS_ACCESS_KEY_ID" in message, f"{name}: {message}"
        shown = "".join(traceback.format_exception(info.value))  # chained boto errors included
        assert os.environ["AWS_SECRET_ACCESS_KEY"] not in shown, f"{name} shows the secret"
        assert seaweedfs.secret_key not in shown, f"{name} shows the secret"

    assert good.get_bytes("seed.txt") == b"seed"
    assert not good.exists("new.txt")


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_unreachable_endpoint_is_named(monkeypatch, tmp_path):
    endpoint = f"http://127.0.0.1:{closed_port()}"
    for name, value in {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(name, value)
    store = S3Store("ft-nowhere", "runs", max_attempts=1)
    source = tmp_path / "source.txt"
    source.write_text("x")
    started = time.monotonic()
    for name, op in REMOTE_OPS.items():
        with pytest.raises(StoreError, match=f"cannot reach {re.escape(endpoint)}"):
            op(store, source)
    assert time.monotonic() - started < 10, "max_attempts=1 should fail fast"


@pytest.mark.integration
def test_outage_is_a_store_error_and_data_survives_a_restart(seaweedfs, s3_env):
    store = S3Store(*bucket_and_key(s3_env), max_attempts=1)
    store.put_bytes("before.txt", b"kept")
    seaweedfs.stop(grace=0)
    try:
        with pytest.raises(StoreError, match=f"cannot reach {re.escape(seaweedfs.endpoint)}"):
            store.put_bytes("during.txt", b"lost")
    finally:
        seaweedfs.start()
    assert store.get_bytes("before.txt") == b"kept"
    store.put_bytes("after.txt", b"new")
    assert store.list("") == ["after.txt", "before.txt"]


def s3_expect(bucket, prefix):
    url = f"s3://{bucket}/{prefix}".rstrip("/")
    return lambda store, tmp: (
        isinstance(store, S3Store)
        and (store.bucket, store.prefix, store.url)
        == (
            bucket,
            prefix,
            url,
        )
    )


def local_expect(relative):
    return lambda store, tmp: isinstance(store, LocalStore) and store.url == str(tmp / relative) and store.root.is_dir()


OPEN_STORE_CASES = [
    # (name, url argument, FT_STORE, check of the store it opens)
    ("local-path", "<tmp>/a", None, local_expect("a")),
    ("s3-prefix", "s3://bucket-x/runs/deep", None, s3_expect("bucket-x", "runs/deep")),
    ("s3-bucket-only", "s3://bucket-x", None, s3_expect("bucket-x", "")),
    ("s3-trailing-slash", "s3://bucket-x/p/", None, s3_expect("bucket-x", "p")),
    ("ft-store-s3", None, "s3://bucket-y/p", s3_expect("bucket-y", "p")),
    ("ft-store-local", None, "<tmp>/b", local_expect("b")),
    ("argument-over-ft-store", "<tmp>/a", "s3://bucket-y/p", local_expect("a")),
    ("default-ft-home", None, None, local_expect("home/store")),
]


@pytest.mark.parametrize("name,url,ft_store,check", OPEN_STORE_CASES, ids=[c[0] for c in OPEN_STORE_CASES])
def test_open_store_picks_the_backend(monkeypatch, tmp_path, name, url, ft_store, check):
    tmp = tmp_path.resolve()
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("FT_HOME", str(tmp / "home"))
    if ft_store is None:
        monkeypatch.delenv("FT_STORE", raising=False)
    else:
        monkeypatch.setenv("FT_STORE", ft_store.replace("<tmp>", str(tmp)))
    store = open_store(url.replace("<tmp>", str(tmp)) if url else None)
    assert check(store, tmp), vars(store)


BAD_URLS = [
    ("gs://bucket/p", "unsupported store URL"),
    ("s3://ab/p", "at least 3 characters"),
    ("s3:///p", "invalid bucket name ''"),
]


@pytest.mark.parametrize("url,error", BAD_URLS)
def test_open_store_refuses_bad_urls(url, error):
    with pytest.raises(StoreError, match=re.escape(error)):
        open_store(url)


# --- artifacts -----------------------------------------------------------------------------------------

PREFIX = "runs/demo/v1/train/run-1/checkpoint-00000010"
FILES = {
    "config.json": b'{"r": 8}',
    "empty.txt": b"",
    "weights/adapter.safetensors": bytes(range(256)) * 64,
    "weights/deep/er/optimizer.pt": b"opt" * 1000,
}


def write_tree(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def read_tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_publish_read_fetch_round_trip(store, tmp_path):
    source = write_tree(tmp_path / "source", FILES)
    (source / MANIFEST).write_text("a stale manifest in the source is not published")
    manifest = publish_dir(store, PREFIX, source, meta={"step": 10})

    assert manifest.files == {
        rel: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()} for rel, data in FILES.items()
    }
    assert store.list(PREFIX) == sorted(join_key(PREFIX, rel) for rel in [*FILES, MANIFEST])

    read = read_manifest(store, PREFIX)
    assert (read.prefix, read.files, read.meta, read.digest) == (PREFIX, manifest.files, {"step": 10}, manifest.digest)
    assert read.total_bytes == sum(len(data) for data in FILES.values())
    verify_artifact(store, read)

    fetched = fetch_artifact(store, PREFIX, tmp_path / "dest")
    assert fetched.digest == manifest.digest
    assert read_tree(tmp_path / "dest") == FILES


def test_changed_files_rehashes_every_object_in_the_store(store, tmp_path):
    manifest = publish_dir(store, PREFIX, write_tree(tmp_path / "source", FILES))
    assert changed_files(store, manifest) == []
    first, second = sorted(FILES)[:2]
    data = FILES[first]
    store.put_bytes(join_key(PREFIX, first), bytes([data[0] ^ 1]) + data[1:])  # same size, one bit flipped
    store.delete(join_key(PREFIX, second))
    assert changed_files(store, manifest) == [first, second]
    assert store.sha256(join_key(PREFIX, sorted(FILES)[2])) == hashlib.sha256(FILES[sorted(FILES)[2]]).hexdigest()


def test_fetch_artifact_include_and_local_copies(store, tmp_path):
    publish_dir(store, PREFIX, write_tree(tmp_path / "source", FILES))
    dest = tmp_path / "dest"

    fetch_artifact(store, PREFIX, dest, include=lambda rel: not rel.startswith("weights/"))
    assert read_tree(dest) == {"config.json": FILES["config.json"], "empty.txt": b""}

    (dest / "config.json").write_bytes(b'{"r": 9}')  # a stale local copy is replaced
    fetch_artifact(store, PREFIX, dest)
    assert read_tree(dest) == FILES

    store.delete(join_key(PREFIX, "weights/deep/er/optimizer.pt"))  # verified local copies are not fetched
    fetch_artifact(store, PREFIX, dest)
    assert read_tree(dest) == FILES


def drop_manifest(store):
    store.delete(join_key(PREFIX, MANIFEST))


def garble_manifest(store):
    store.put_bytes(join_key(PREFIX, MANIFEST), b"{not json")


def delete_weights(store):
    store.delete(join_key(PREFIX, "weights/adapter.safetensors"))


def truncate_weights(store):
    key = join_key(PREFIX, "weights/adapter.safetensors")
    store.put_bytes(key, store.get_bytes(key)[:-1])


def flip_a_byte_of_weights(store):
    key = join_key(PREFIX, "weights/adapter.safetensors")
    data = store.get_bytes(key)
    store.put_bytes(key, bytes([data[0] ^ 1]) + data[1:])


CORRUPTIONS = [
    # (damage after publish, read_manifest raises, verify_artifact raises, fetch_artifact raises)
    (drop_manifest, ArtifactNotFound, None, ArtifactNotFound),  # files uploaded, manifest never landed
    (garble_manifest, ArtifactCorrupt, None, ArtifactCorrupt),
    (delete_weights, None, ArtifactCorrupt, ArtifactCorrupt),
    (truncate_weights, None, ArtifactCorrupt, ArtifactCorrupt),
    (flip_a_byte_of_weights, None, None, ArtifactCorrupt),  # same size: only the sha256 tells
]


@pytest.mark.parametrize(
    "damage,manifest_error,verify_error,fetch_error", CORRUPTIONS, ids=[c[0].__name__ for c in CORRUPTIONS]
)
def test_reader_never_trusts_a_damaged_artifact(store, tmp_path, damage, manifest_error, verify_error, fetch_error):
    publish_dir(store, PREFIX, write_tree(tmp_path / "source", FILES))
    damage(store)
    where = re.escape(store.uri(PREFIX))

    if manifest_error:
        with pytest.raises(manifest_error, match=where):
            read_manifest(store, PREFIX)
    elif verify_error:
        with pytest.raises(verify_error, match=f"{where}.*weights/adapter.safetensors"):
            verify_artifact(store, read_manifest(store, PREFIX))
    with pytest.raises(fetch_error, match=where):
        fetch_artifact(store, PREFIX, tmp_path / "dest")


def test_interrupted_republish_is_no_artifact(store, tmp_path, monkeypatch):
    publish_dir(store, PREFIX, write_tree(tmp_path / "v1", FILES))
    real_put_file = store.put_file
    uploaded = []

    def dies_after_one_file(key, path):
        if uploaded:
            raise StoreError("connection lost")
        uploaded.append(key)
        real_put_file(key, path)

    monkeypatch.setattr(store, "put_file", dies_after_one_file)
    with pytest.raises(StoreError, match="connection lost"):
        publish_dir(store, PREFIX, write_tree(tmp_path / "v2", {rel: b"v2" + data for rel, data in FILES.items()}))

    assert uploaded, "the interrupted publish uploaded nothing; the test proves nothing"
    with pytest.raises(ArtifactNotFound):  # neither v1 (manifest gone) nor a v1/v2 mix
        fetch_artifact(store, PREFIX, tmp_path / "dest")


def test_a_worker_without_the_stores_keys_installs_the_runs_wheel_from_its_presigned_url_and_refuses_another(
    s3_env, tmp_path
):
    """``code=wheel`` on S3: the wheel goes to the bucket once; the worker's bootstrap (no AWS key in its environment)
    reads it through the presigned URL, checks its sha256, installs it and runs the module in that venv."""
    import subprocess
    import sys

    from ft_assets.targets import BOOTSTRAP_LINE
    from ft_assets.targets.code import worker_code

    store = open_store(s3_env)
    code = worker_code(store)
    assert worker_code(store) == code and store.sha256(code.key) == code.sha256  # put once, by its sha256
    plain, hidden = code.environment(store)
    assert hidden["FT_CODE_URL"].startswith("http") and "Signature=" in hidden["FT_CODE_URL"]
    base = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env = {**base, **plain, **hidden, "FT_CODE_CACHE": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", BOOTSTRAP_LINE, "ft_assets.training.remote", "--help"], env=env,
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0 and "a GPU target's worker" in done.stdout, done.stderr[-2000:]
    [venv] = (tmp_path / "cache" / "venvs").glob(f"{code.sha256[:16]}-*/")
    where = subprocess.run([venv / "bin" / "python", "-c", "import ft_assets; print(ft_assets.__file__)"],
                           capture_output=True, text=True, check=True, cwd=tmp_path).stdout  # fmt: skip
    assert where.startswith(str(venv))  # the wheel's code, not this checkout's
    assert "ft-assets bootstrap: installing" in done.stderr

    other = {**env, "FT_CODE_SHA256": "0" * 64, "FT_CODE_CACHE": str(tmp_path / "other")}
    refused = subprocess.run([sys.executable, "-c", BOOTSTRAP_LINE, "json.tool", "--help"], env=other,
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    assert refused.returncode != 0 and f"has sha256 {code.sha256}, not {'0' * 64}" in refused.stderr
    assert not list((tmp_path / "other").rglob("*.whl")) and not list((tmp_path / "other").rglob("bin/python"))
