"""A real PostgreSQL for the tests: one server per session from the Debian packages, on a free loopback port.

The production instance (``dagster.prod.yaml``) keeps runs, events and schedules in PostgreSQL, so its
test needs the real server, not SQLite with another name. ``initdb`` + ``pg_ctl start`` in a temp dir
takes ~2 s here; each test then gets its own database (``pg_database``), so tests never see each
other's runs.

What it takes to run it anywhere the suite runs:
- PostgreSQL refuses to run as root. As root (CI containers), the cluster is created and started as
  the ``postgres`` system user that the Debian package creates (``runuser``), in a temp dir that user
  owns; any other user runs it directly. The dir sits directly under the system temp dir because
  pytest's own temp dirs are ``0700 root`` and the ``postgres`` user could not enter them.
- Debian keeps the server binaries off ``PATH`` (``/usr/lib/postgresql/<major>/bin``); the newest
  installed major is used unless ``initdb`` is on ``PATH``.
- TCP on 127.0.0.1 only, no Unix socket, password (scram-sha-256) required: the same way Dagster
  reaches a managed database in production, so a missing password in the config fails here too.
- ``fsync=off``: the cluster is thrown away after the session; durability buys the tests nothing.

Missing binaries FAIL the test (``make test`` installs them via ``scripts/install-system-deps.sh``);
a feature that cannot be tested must not look like a feature that works.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import socket
import subprocess
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

SUPERUSER = "ft_assets"
PASSWORD = "ft-assets-test-pg-password"
START_TIMEOUT_S = 30.0
INSTALL_HINT = "`make test` installs it (scripts/install-system-deps.sh: apt-get install postgresql)"


def postgres_bindir() -> Path:
    """The directory holding ``initdb``/``pg_ctl``: ``PATH`` first, else Debian's newest ``/usr/lib/postgresql/N/bin``."""
    on_path = shutil.which("initdb")
    if on_path and shutil.which("pg_ctl"):
        return Path(on_path).resolve().parent
    majors = sorted(
        (p for p in Path("/usr/lib/postgresql").glob("*/bin") if (p / "initdb").is_file() and (p / "pg_ctl").is_file()),
        key=lambda p: int(re.sub(r"\D", "", p.parent.name) or 0),
    )
    if not majors:
        pytest.fail(f"PostgreSQL server binaries (initdb, pg_ctl) not found: {INSTALL_HINT}")
    return majors[-1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class PostgresServer:
    """One running cluster; ``create_database`` hands out fresh databases on it."""

    root: Path
    bindir: Path
    port: int
    host: str = "127.0.0.1"
    user: str = SUPERUSER
    password: str = PASSWORD

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    @property
    def log_path(self) -> Path:
        return self.root / "postgres.log"

    def _as_owner(self, *argv: str) -> list[str]:
        """Run as the ``postgres`` user when we are root (the server refuses root), else as ourselves."""
        if os.geteuid() == 0:
            return ["runuser", "-u", "postgres", "--", *argv]
        return list(argv)

    def _run(self, *argv: str) -> None:
        result = subprocess.run(self._as_owner(*argv), capture_output=True, text=True)
        if result.returncode != 0:
            log = self.log_path.read_text(errors="replace")[-3000:] if self.log_path.exists() else ""
            raise RuntimeError(f"{' '.join(argv)} failed ({result.returncode}):\n{result.stdout}{result.stderr}\n{log}")

    def init_and_start(self) -> None:
        pwfile = self.root / "pwfile"
        pwfile.write_text(self.password + "\n")
        if os.geteuid() == 0:
            shutil.chown(pwfile, "postgres")
        self._run(
            str(self.bindir / "initdb"),
            "-D",
            str(self.data_dir),
            "-U",
            self.user,
            f"--pwfile={pwfile}",
            "--auth=scram-sha-256",
            "--encoding=UTF8",
            "--locale=C",
            "--no-sync",
        )
        pwfile.unlink()
        options = f"-c listen_addresses={self.host} -p {self.port} -c unix_socket_directories='' -c fsync=off"
        self._run(
            str(self.bindir / "pg_ctl"),
            "-D",
            str(self.data_dir),
            "-l",
            str(self.log_path),
            "-o",
            options,
            "-w",
            "-t",
            str(int(START_TIMEOUT_S)),
            "start",
        )

    def stop(self) -> None:
        if (self.data_dir / "postmaster.pid").exists():
            self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data_dir), "-m", "immediate", "-w", "stop")

    def connect(self, db_name: str = "postgres"):
        import psycopg2

        return psycopg2.connect(host=self.host, port=self.port, user=self.user, password=self.password, dbname=db_name)

    def create_database(self) -> PostgresDatabase:
        """A new, empty database on this server."""
        name = f"ft_{uuid.uuid4().hex[:12]}"
        conn = self.connect()
        conn.autocommit = True  # CREATE DATABASE cannot run in a transaction
        try:
            with conn.cursor() as cur:
                cur.execute(f'CREATE DATABASE "{name}"')
        finally:
            conn.close()
        return PostgresDatabase(self, name)


@dataclass
class PostgresDatabase:
    """Connection parameters of one database, plus the ``DAGSTER_PG_*`` variables that dagster.prod.yaml reads."""

    server: PostgresServer
    db_name: str

    @property
    def env(self) -> dict[str, str]:
        return {
            "DAGSTER_PG_HOST": self.server.host,
            "DAGSTER_PG_PORT": str(self.server.port),
            "DAGSTER_PG_USER": self.server.user,
            "DAGSTER_PG_PASSWORD": self.server.password,
            "DAGSTER_PG_DB": self.db_name,
        }

    def query(self, sql: str, *params) -> list[tuple]:
        conn = self.server.connect(self.db_name)
        try:
            with conn.cursor() as cur:
                cur.execute(sql, params or None)
                return cur.fetchall()
        finally:
            conn.close()


@pytest.fixture(scope="session")
def postgres_server():
    bindir = postgres_bindir()
    if os.geteuid() == 0:
        if shutil.which("runuser") is None:
            pytest.fail(
                f"running as root needs `runuser` (util-linux) to start PostgreSQL as the postgres user: {INSTALL_HINT}"
            )
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            pytest.fail(
                f"running as root needs the `postgres` system user that the Debian package creates: {INSTALL_HINT}"
            )
    root = Path(tempfile.mkdtemp(prefix="ft-assets-pg-"))
    if os.geteuid() == 0:
        shutil.chown(root, "postgres", "postgres")
    server = PostgresServer(root=root, bindir=bindir, port=free_port())
    try:
        server.init_and_start()
        yield server
    finally:
        try:
            server.stop()
        finally:
            shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def pg_database(postgres_server) -> PostgresDatabase:
    """A fresh, empty database on the session's server."""
    return postgres_server.create_database()
