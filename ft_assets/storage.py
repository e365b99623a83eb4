"""Object storage: one byte-level interface, two backends (a local directory and S3).

Every large artifact of the pipeline (cleaned rows, token shards, checkpoints, models) lives in an
object store under a versioned prefix (``ft_assets.layout``), never on a worker's disk and never
pickled through Dagster. What makes a set of objects an atomic *artifact* (a manifest written last)
is ``ft_assets.manifests``; this module only moves bytes, atomically per object: S3 makes single PUTs
atomic, the local backend writes to a temporary name and renames.

Credentials never appear here: boto3 reads them from the standard ``AWS_*`` environment variables
(``AWS_ENDPOINT_URL`` included, so AWS S3, R2, MinIO and SeaweedFS all work alike).

Faults: an S3 call that cannot reach the endpoint (refused, reset, timed out, a 5xx) is retried with
exponential backoff, 0.5 s doubling to 8 s, 10 attempts: a store that comes back within ~45 s (a
SeaweedFS restart takes ~5 s) is never noticed, one that stays down is a ``StoreError`` naming the
endpoint. A full local disk is a ``StoreError`` naming the local path. Neither leaves a partial file
behind, and no artifact is published without its manifest.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from pathlib import Path

CHUNK = 8 * 1024 * 1024  # 8 MiB: read/hash granularity and S3 multipart part size
S3_ATTEMPTS = 10  # waits 0.5+1+2+4+8+8+8+8+8 = 47.5 s in all before an unreachable store is an error
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 8.0
# S3 error codes worth another attempt: the server is up but overloaded, restarting or timing out.
TRANSIENT_CODES = frozenset(
    {
        "InternalError",
        "ServiceUnavailable",
        "SlowDown",
        "RequestTimeout",
        "ConditionalRequestConflict",
        "500",
        "502",
        "503",
        "504",
    }
)

logger = logging.getLogger(__name__)


class StoreError(RuntimeError):
    """An object-store operation failed in a way the user must act on (what, where, what to do)."""


class ObjectNotFound(StoreError):
    """No object at a key."""


class ObjectExists(StoreError):
    """A create-if-absent write found the object already there."""


class KeysRefused(StoreError):
    """The store refused the keys (unknown, expired, revoked, or not allowed to do this): another attempt with the same
    keys fails the same way."""


REFUSED_CODES = frozenset(
    {"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403", "ExpiredToken", "InvalidToken",
     "TokenRefreshRequired"}
)  # fmt: skip


class _Transient(StoreError):
    """A failure another attempt may not have (connection refused or reset, timeout, 5xx)."""


def backoff_seconds(attempt: int) -> float:
    """The wait after failed attempt ``attempt`` (1-based): 0.5, 1, 2, 4, then 8 s."""
    return min(BACKOFF_FIRST_S * 2 ** (attempt - 1), BACKOFF_MAX_S)


def _disk_error(what: str, path: str | Path, exc: OSError) -> StoreError:
    hint = (
        " (free space there, or point FT_SCRATCH at a bigger disk)" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else ""
    )
    return StoreError(f"{what} {path}: {exc.strerror or exc}{hint}")


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def join_key(*parts: str) -> str:
    return "/".join(p.strip("/") for p in parts if p and p.strip("/"))


def check_key(key: str) -> str:
    """Refuse keys that could escape the store root (path traversal) or are not plain relative paths."""
    if not key or key.startswith("/") or "\\" in key or "\x00" in key:
        raise StoreError(f"invalid object key {key!r}: keys are relative, '/'-separated paths")
    if any(part in ("", ".", "..") for part in key.split("/")):
        raise StoreError(f"invalid object key {key!r}: empty, '.' or '..' path segments are not allowed")
    return key


class ObjectStore(ABC):
    """Byte-level store operations; artifact semantics are built on top in this module."""

    url: str

    @abstractmethod
    def put_file(self, key: str, path: str | Path) -> None: ...

    @abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None: ...

    @abstractmethod
    def put_bytes_if_absent(self, key: str, data: bytes) -> bool:
        """Create ``key`` atomically unless it exists; False if it did (another writer got there first)."""

    @abstractmethod
    def get_file(self, key: str, path: str | Path) -> None: ...

    @abstractmethod
    def get_bytes(self, key: str) -> bytes: ...

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def list(self, prefix: str) -> list[str]:
        """All keys under ``prefix`` (recursive), sorted."""

    @abstractmethod
    def list_dirs(self, prefix: str) -> list[str]:
        """Immediate child 'directories' of ``prefix`` (names only), sorted."""

    @abstractmethod
    def delete(self, key: str) -> None: ...

    @abstractmethod
    def size(self, key: str) -> int: ...

    @abstractmethod
    def sha256(self, key: str) -> str:
        """The sha256 of an object's bytes, read in ``CHUNK``-sized pieces (never the whole object in memory)."""

    def uri(self, key: str) -> str:
        return f"{self.url.rstrip('/')}/{key}"

    def download_url(self, key: str, expires_s: int) -> str:
        """Where a machine without this store's credentials reads ``key`` for ``expires_s`` seconds: a presigned
        HTTPS URL (S3), a path (a folder store, on a filesystem the machine shares)."""
        raise StoreError(f"{type(self).__name__} cannot hand out a download URL of {key}")

    def delete_prefix(self, prefix: str) -> None:
        for key in self.list(prefix):
            self.delete(key)

    def put_part(self, key: str, data: bytes) -> None:
        """``put_bytes`` for an object that one writer at a time writes, always with the same bytes (a part of an
        artifact, ``ft_assets.data.parts``): a writer killed halfway leaves nothing that the next write does not replace."""
        self.put_bytes(key, data)

    def put_json(self, key: str, obj: object) -> None:
        self.put_bytes(key, json.dumps(obj, indent=2, sort_keys=True).encode())

    def get_json(self, key: str) -> dict:
        return json.loads(self.get_bytes(key))


def _stored_files(directory: Path) -> Iterator[Path]:
    """Files under ``directory``, recursively, without the temporary files of writes in flight."""
    return (p for p in directory.rglob("*") if p.is_file() and not p.name.startswith(".tmp-"))


class LocalStore(ObjectStore):
    """A directory on the local disk; the embedded default."""

    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser().resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.url = str(self.root)

    def path(self, key: str) -> Path:
        """The file that holds ``key`` (whether it exists or not)."""
        return self.root / check_key(key)

    def _atomic_write(self, key: str, write, publish=os.replace, tmp_name: str | None = None) -> None:
        target = self.path(key)
        tmp = target.parent / (tmp_name or f".tmp-{uuid.uuid4().hex}-{target.name}")
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            write(tmp)
            publish(tmp, target)
        except OSError as exc:
            raise _disk_error("could not write", target, exc) from exc
        finally:
            tmp.unlink(missing_ok=True)

    def put_file(self, key: str, path: str | Path) -> None:
        self._atomic_write(key, lambda tmp: shutil.copyfile(path, tmp))

    def put_bytes(self, key: str, data: bytes) -> None:
        self._atomic_write(key, lambda tmp: tmp.write_bytes(data))

    def put_part(self, key: str, data: bytes) -> None:
        # The temporary name is the key's own: the rerun of a killed writer's shard writes over its half-written file.
        self._atomic_write(key, lambda tmp: tmp.write_bytes(data), tmp_name=f".tmp-part-{self.path(key).name}")

    def put_bytes_if_absent(self, key: str, data: bytes) -> bool:
        def link(tmp: Path, target: Path) -> None:
            try:  # a hard link fails if the target exists: an atomic create-if-absent, content in place
                os.link(tmp, target)
            except FileExistsError:
                raise ObjectExists(f"{target} already exists") from None

        try:
            self._atomic_write(key, lambda tmp: tmp.write_bytes(data), publish=link)
        except ObjectExists:
            return False
        return True

    def get_file(self, key: str, path: str | Path) -> None:
        source = self.path(key)
        if not source.is_file():
            raise ObjectNotFound(f"missing object {self.uri(key)}")
        path = Path(path)
        tmp = path.with_name(f".tmp-{uuid.uuid4().hex}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, tmp)
            os.replace(tmp, path)
        except OSError as exc:
            raise _disk_error(f"copy of {source} to", path, exc) from exc
        finally:
            tmp.unlink(missing_ok=True)

    def get_bytes(self, key: str) -> bytes:
        source = self.path(key)
        if not source.is_file():
            raise ObjectNotFound(f"missing object {self.uri(key)}")
        return source.read_bytes()

    def exists(self, key: str) -> bool:
        return self.path(key).is_file()

    def list(self, prefix: str) -> list[str]:
        base = self.path(prefix) if prefix else self.root
        if not base.is_dir():
            return []
        return sorted(path.relative_to(self.root).as_posix() for path in _stored_files(base))

    def list_dirs(self, prefix: str) -> list[str]:
        base = self.path(prefix) if prefix else self.root
        if not base.is_dir():
            return []
        # As on S3, a directory exists only while it holds a file: deleting an artifact's files leaves
        # empty folders behind here, and they must not show up as, say, a dataset version.
        return sorted(p.name for p in base.iterdir() if p.is_dir() and any(_stored_files(p)))

    def delete(self, key: str) -> None:
        self.path(key).unlink(missing_ok=True)

    def delete_prefix(self, prefix: str) -> None:
        """Every file under ``prefix``, the temporary files of writers killed mid-write included."""
        base = self.path(prefix) if prefix else self.root
        for path in sorted(base.rglob("*")) if base.is_dir() else []:
            if path.is_file():
                path.unlink(missing_ok=True)

    def size(self, key: str) -> int:
        source = self.path(key)
        if not source.is_file():
            raise ObjectNotFound(f"missing object {self.uri(key)}")
        return source.stat().st_size

    def sha256(self, key: str) -> str:
        source = self.path(key)
        if not source.is_file():
            raise ObjectNotFound(f"missing object {self.uri(key)}")
        return sha256_file(source)

    def uri(self, key: str) -> str:
        return str(self.root / key)

    def download_url(self, key: str, expires_s: int) -> str:
        return str(self.path(key))


def env_credentials() -> dict:
    """The ``AWS_*`` keys as they are now, for ``boto3.client``.

    boto3's default session caches the first credentials it resolves, so without this a store opened
    after the variables changed would sign with the old keys. (A fresh boto3 session per store would
    also do, but costs ~0.5 s of model loading each.)
    """
    if "AWS_ACCESS_KEY_ID" not in os.environ:
        return {}  # the rest of boto3's chain: shared config files, instance roles
    return {
        "aws_access_key_id": os.environ["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": os.environ.get("AWS_SECRET_ACCESS_KEY"),
        "aws_session_token": os.environ.get("AWS_SESSION_TOKEN"),
    }


def s3_client(credentials: Mapping[str, str | None]):
    """A boto3 S3 client with ``credentials`` (``env_credentials``' form) and the store's settings: one attempt per
    request (``S3Store._call`` retries), short connect timeout."""
    import boto3
    from botocore.config import Config as BotoConfig

    config = BotoConfig(retries={"total_max_attempts": 1, "mode": "standard"}, connect_timeout=5, read_timeout=60)
    return boto3.client("s3", **credentials, config=config)


class S3Store(ObjectStore):
    """An S3 bucket (AWS, R2, MinIO, SeaweedFS) through boto3, configured from the environment."""

    def __init__(self, bucket: str, prefix: str = "", client=None, max_attempts: int = S3_ATTEMPTS):
        if "@" in bucket or ":" in bucket:  # s3://KEY:SECRET@bucket: refuse without repeating it
            raise StoreError(
                "the store URL must not carry credentials (s3://user:secret@bucket); set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY in the environment instead"
            )
        if len(bucket) < 3:
            raise StoreError(f"invalid bucket name {bucket!r}: S3 bucket names have at least 3 characters")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}".rstrip("/")
        self.max_attempts = max(1, max_attempts)
        # Retries are ours (_call), not botocore's: one deterministic schedule for every operation, a
        # whole transfer retried as a unit, and an error message that says how long the store was down.
        self.client = client or s3_client(env_credentials())
        from boto3.s3.transfer import TransferConfig

        self.transfer = TransferConfig(multipart_threshold=CHUNK, multipart_chunksize=CHUNK)

    def _key(self, key: str) -> str:
        return join_key(self.prefix, check_key(key))

    def use_keys(self, keys: Mapping[str, str]) -> None:
        """Sign from now on with ``keys`` (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``):
        renewed keys. A transfer already under way finishes with the keys it started with."""
        self.client = s3_client({"aws_access_key_id": keys["AWS_ACCESS_KEY_ID"],
                                 "aws_secret_access_key": keys["AWS_SECRET_ACCESS_KEY"],
                                 "aws_session_token": keys.get("AWS_SESSION_TOKEN")})  # fmt: skip

    def download_url(self, key: str, expires_s: int) -> str:
        params = {"Bucket": self.bucket, "Key": self._key(key)}
        return self.client.generate_presigned_url("get_object", Params=params, ExpiresIn=expires_s)

    def _rel(self, full_key: str) -> str:
        return full_key[len(self.prefix) + 1 :] if self.prefix else full_key

    def _call(self, what: str, key: str, fn, *args, **kwargs):
        """``fn(*args, **kwargs)``, retried with backoff while the endpoint is unreachable; errors → StoreError."""
        started, attempt = time.monotonic(), 0
        while True:
            attempt += 1
            try:
                return fn(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - classified below; anything unknown is re-raised as is
                error = self._classify(what, key, exc)
                if error is None:
                    raise
                if not isinstance(error, _Transient):
                    raise error from exc
                if attempt >= self.max_attempts:
                    waited = time.monotonic() - started
                    raise StoreError(
                        f"{what} {self.uri(key)} failed: {error} (gave up after {attempt} attempt(s) over {waited:.0f} s); "
                        "check that the object store is up and reachable, then rerun"
                    ) from exc
                delay = backoff_seconds(attempt)
                logger.warning(
                    "%s %s: %s; retrying in %.1f s (attempt %d/%d)",
                    what,
                    self.uri(key),
                    error,
                    delay,
                    attempt,
                    self.max_attempts,
                )
                time.sleep(delay)

    def _classify(self, what: str, key: str, exc: Exception) -> StoreError | None:
        """The StoreError for a failed call: ``_Transient`` when another attempt may succeed, None if not ours."""
        from boto3.exceptions import RetriesExceededError, S3UploadFailedError
        from botocore.exceptions import BotoCoreError, ClientError, ConnectionError, HTTPClientError

        error = exc
        if isinstance(exc, S3UploadFailedError):  # upload_file re-raises a request's ClientError wrapped
            error = exc.__context__ or exc
        elif isinstance(exc, RetriesExceededError):  # download_file: the body stream kept breaking
            error = exc.last_exception or exc
        if isinstance(error, ClientError):
            code = error.response.get("Error", {}).get("Code", "")
            if code in ("NoSuchKey", "404", "NotFound"):
                return ObjectNotFound(f"missing object {self.uri(key)}")
            if code in ("PreconditionFailed", "412"):
                return ObjectExists(f"{self.uri(key)} already exists")
            if code in REFUSED_CODES:
                return KeysRefused(
                    f"{what} {self.uri(key)} was refused ({code}): check AWS_ACCESS_KEY_ID / "
                    "AWS_SECRET_ACCESS_KEY and the bucket policy"
                )
            if code == "NoSuchBucket":
                return StoreError(f"bucket {self.bucket!r} does not exist (create it first)")
            if code in TRANSIENT_CODES:
                return _Transient(f"{self.client.meta.endpoint_url} answered {code}")
            return StoreError(f"{what} {self.uri(key)} failed: {code or error}")
        if isinstance(error, (ConnectionError, HTTPClientError)) or isinstance(exc, RetriesExceededError):
            return _Transient(f"cannot reach {self.client.meta.endpoint_url}: {error}")
        if isinstance(error, BotoCoreError) or isinstance(exc, S3UploadFailedError):
            return StoreError(f"{what} {self.uri(key)} failed: {error}")
        return None

    def put_file(self, key: str, path: str | Path) -> None:
        self._call(
            "upload to", key, self.client.upload_file, str(path), self.bucket, self._key(key), Config=self.transfer
        )

    def put_bytes(self, key: str, data: bytes) -> None:
        self._call("write", key, self.client.put_object, Bucket=self.bucket, Key=self._key(key), Body=data)

    def put_bytes_if_absent(self, key: str, data: bytes) -> bool:
        # If-None-Match: '*' makes the PUT conditional (AWS S3 since 2024, SeaweedFS 4.x, R2, MinIO). A
        # retry after a lost response sees its own object and answers False: callers re-read to tell.
        try:
            self._call(
                "create of",
                key,
                self.client.put_object,
                Bucket=self.bucket,
                Key=self._key(key),
                Body=data,
                IfNoneMatch="*",
            )
        except ObjectExists:
            return False
        return True

    def get_file(self, key: str, path: str | Path) -> None:
        path = Path(path)
        tmp = path.with_name(f".tmp-{uuid.uuid4().hex}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._call(
                "download of",
                key,
                self.client.download_file,
                self.bucket,
                self._key(key),
                str(tmp),
                Config=self.transfer,
            )
            os.replace(tmp, path)
        except OSError as exc:  # the local side: a full disk, a read-only folder
            raise _disk_error(f"download of {self.uri(key)} to", path, exc) from exc
        finally:
            tmp.unlink(missing_ok=True)

    def get_bytes(self, key: str) -> bytes:
        # The body is read inside the retried call: a connection that drops mid-body is one more attempt.
        return self._call(
            "read of", key, lambda: self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()
        )

    def exists(self, key: str) -> bool:
        try:
            self._call("lookup of", key, self.client.head_object, Bucket=self.bucket, Key=self._key(key))
        except ObjectNotFound:
            return False
        return True

    def list(self, prefix: str) -> list[str]:
        full = join_key(self.prefix, prefix)
        full = f"{full}/" if full else ""
        paginator = self.client.get_paginator("list_objects_v2")
        pages = self._call(
            "listing of", prefix or ".", lambda: list(paginator.paginate(Bucket=self.bucket, Prefix=full))
        )
        return sorted(self._rel(obj["Key"]) for page in pages for obj in page.get("Contents", []))

    def list_dirs(self, prefix: str) -> list[str]:
        # From the keys, not from a Delimiter listing: SeaweedFS reports a folder whose last object was
        # deleted as a common prefix until its delayed empty-folder cleanup runs, minutes later.
        base = join_key(prefix)
        base = f"{base}/" if base else ""
        return sorted({key[len(base) :].split("/")[0] for key in self.list(prefix) if "/" in key[len(base) :]})

    def delete(self, key: str) -> None:
        self._call("delete of", key, self.client.delete_object, Bucket=self.bucket, Key=self._key(key))

    def size(self, key: str) -> int:
        head = self._call("lookup of", key, self.client.head_object, Bucket=self.bucket, Key=self._key(key))
        return int(head["ContentLength"])

    def sha256(self, key: str) -> str:
        def stream() -> str:  # retried as a whole: a connection that drops mid-body starts the hash over
            digest = hashlib.sha256()
            for chunk in self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].iter_chunks(CHUNK):
                digest.update(chunk)
            return digest.hexdigest()

        return self._call("read of", key, stream)


def default_store_path() -> Path:
    return Path(os.environ.get("FT_HOME", "var")).expanduser().resolve() / "store"


def store_kind(url: str | None = None) -> str:
    """The Dagster asset kind of the store ``url`` (or ``FT_STORE``) names: "s3" or "file" (a local directory)."""
    return "s3" if (url or os.environ.get("FT_STORE") or "").startswith("s3://") else "file"


def open_store(url: str | None = None) -> ObjectStore:
    """``url`` (or ``FT_STORE``): a local path, or ``s3://bucket/prefix``; default ``$FT_HOME/store``."""
    url = url or os.environ.get("FT_STORE") or str(default_store_path())
    if url.startswith("s3://"):
        bucket, _, prefix = url[len("s3://") :].partition("/")
        return S3Store(bucket, prefix)
    if "://" in url:
        raise StoreError(f"unsupported store URL {url!r}: use a local path or s3://bucket/prefix")
    return LocalStore(url)
