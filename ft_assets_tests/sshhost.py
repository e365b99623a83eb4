"""OpenSSH's sshd on a free loopback port, for the tests that reach a machine through ssh.

``running_sshd`` starts one with a host key and a client key made in a temp folder, public-key login only,
for the user given; ``login_node`` (``slurmcluster``) and ``worker_host`` (below) are built on it.

``worker_host``: a rented GPU as a training worker sees it, on this machine. An unprivileged user
(``ftworker``, made with ``useradd`` once) who cannot read the control host's ``DAGSTER_HOME`` logs in through
sshd; its Python is Debian's ``/usr/bin/python3.11`` in a venv of its own that sees the suite's packages (a
``.pth`` line that adds their folder), as a stock PyTorch image with ft-assets installed would. The store is a
folder both users can write (``/var/tmp``; the control side writes with umask 000 for the test: a shared
filesystem's group or ACLs do this on a cluster).
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import sysconfig
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import pytest

from ft_assets_tests.pg import free_port

START_TIMEOUT_S = 30.0
WORKER_USER = "ftworker"
WORKER_PYTHON = "/usr/bin/python3.11"  # Debian 12's: the suite's packages are built for 3.11
INSTALL_HINT = "`make test` installs it (scripts/install-system-deps.sh: openssh-server)"


def need(binary: str) -> str:
    path = shutil.which(binary) or (f"/usr/sbin/{binary}" if Path(f"/usr/sbin/{binary}").exists() else None)
    if path is None:
        pytest.fail(f"{binary} not found: {INSTALL_HINT}")
    return path


@dataclass
class SshHost:
    host: str
    port: int
    user: str
    identity_file: Path
    known_hosts: Path
    log: Path  # sshd's log: one "Accepted publickey" line per session

    @property
    def ssh_config(self) -> dict:
        """The ``ssh`` block of SlurmRunLauncher's config for this host."""
        return {
            "host": self.host, "port": self.port, "user": self.user, "identity_file": str(self.identity_file),
            "options": [f"UserKnownHostsFile={self.known_hosts}", "StrictHostKeyChecking=accept-new"],
        }  # fmt: skip

    def target(self, python: str, workdir: str | None = None) -> str:
        """The ``ssh://`` GPU target of this host (``ft_assets.targets.ssh``)."""
        query = [f"python={quote(python)}", f"identity={quote(str(self.identity_file))}",
                 f"option=UserKnownHostsFile={quote(str(self.known_hosts))}", "option=StrictHostKeyChecking=accept-new"]  # fmt: skip
        if workdir:
            query.append(f"workdir={quote(workdir)}")
        return f"ssh://{self.user}@{self.host}:{self.port}?{'&'.join(query)}"


@contextmanager
def running_sshd(user: str, extra: list[str] = ()):
    """sshd on a free loopback port that lets ``user`` in with a key made here; yields the ``SshHost``."""
    sshd, keygen = need("sshd"), need("ssh-keygen")
    need("ssh")
    root = Path(tempfile.mkdtemp(prefix="ft-assets-sshd-"))
    root.chmod(0o755)  # the key files are read by sshd as root; the user's session needs nothing here
    for name in ("host_key", "client_key"):
        subprocess.run([keygen, "-q", "-t", "ed25519", "-N", "", "-f", str(root / name)], check=True)
    (root / "authorized_keys").write_text((root / "client_key.pub").read_text())
    (root / "authorized_keys").chmod(0o644)
    port = free_port()
    (root / "sshd_config").write_text(
        "\n".join([
            f"Port {port}", "ListenAddress 127.0.0.1", f"HostKey {root}/host_key", f"PidFile {root}/sshd.pid",
            f"AuthorizedKeysFile {root}/authorized_keys", "PubkeyAuthentication yes", "PasswordAuthentication no",
            "KbdInteractiveAuthentication no", "PermitRootLogin prohibit-password", "UsePAM no", "StrictModes no",
            f"AllowUsers {user}", "LogLevel INFO", *extra,
        ]) + "\n"
    )  # fmt: skip
    Path("/run/sshd").mkdir(exist_ok=True)  # its privilege-separation directory
    started = subprocess.run([sshd, "-f", str(root / "sshd_config"), "-E", str(root / "sshd.log")],
                             capture_output=True, text=True)  # fmt: skip
    if started.returncode != 0:
        pytest.fail(f"sshd did not start: {started.stderr.strip()}")
    host = SshHost("127.0.0.1", port, user, root / "client_key", root / "known_hosts", root / "sshd.log")
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (root / "sshd.pid").is_file():
            if time.monotonic() > deadline:
                pytest.fail(f"sshd wrote no pid file: {(root / 'sshd.log').read_text()}")
            time.sleep(0.1)
        yield host
    finally:
        try:
            os.kill(int((root / "sshd.pid").read_text()), signal.SIGTERM)
        except (FileNotFoundError, ProcessLookupError, ValueError):
            pass
        shutil.rmtree(root, ignore_errors=True)


def worker_account() -> pwd.struct_passwd:
    """The unprivileged worker user, made on first use (``useradd``)."""
    try:
        pwd.getpwnam(WORKER_USER)
    except KeyError:
        subprocess.run([need("useradd"), "--create-home", "--shell", "/bin/sh", WORKER_USER], check=True)
    # "*": no password to log in with, but not locked ("!"), which sshd refuses even for a key without PAM
    subprocess.run([need("usermod"), "--password", "*", WORKER_USER], check=True)
    return pwd.getpwnam(WORKER_USER)


@dataclass
class WorkerHost:
    ssh: SshHost
    account: pwd.struct_passwd
    python: str  # the worker's venv's python
    store: Path  # the shared store folder

    def target(self) -> str:
        return self.ssh.target(self.python)

    def as_worker(self, command: str) -> subprocess.CompletedProcess:
        """``command`` as the worker user, through its ssh login."""
        argv = ["ssh", "-p", str(self.ssh.port), "-i", str(self.ssh.identity_file), "-o", "BatchMode=yes",
                "-o", f"UserKnownHostsFile={self.ssh.known_hosts}", "-o", "StrictHostKeyChecking=accept-new",
                f"{self.ssh.user}@{self.ssh.host}", command]  # fmt: skip
        return subprocess.run(argv, capture_output=True, text=True, timeout=60)


TEMPORARY = ("/tmp/", "/var/tmp/")  # where a folder of ours that others cannot enter may be opened for the worker


@contextmanager
def enterable_by_others(*paths: Path):
    """The folders above ``paths`` that are ours, in a temporary directory and closed to other users (a clone in
    ``mktemp -d``, mode 0700), made enterable meanwhile (o+x: entered by name, never listed), so that the worker user
    reaches the suite's packages and the checkout; their modes are put back after. Folders elsewhere are left as
    they are (the probe then says which cannot be read)."""
    opened: dict[Path, int] = {}
    for path in paths:
        for folder in [path, *path.parents]:
            info = folder.stat()
            if str(folder).startswith(TEMPORARY) and info.st_uid == os.getuid() and not info.st_mode & 0o001:
                opened.setdefault(folder, info.st_mode & 0o7777)
                folder.chmod(info.st_mode & 0o7777 | 0o001)
    try:
        yield
    finally:
        for folder, mode in opened.items():
            folder.chmod(mode)


@pytest.fixture(scope="session")
def worker_host():
    account = worker_account()
    shutil.rmtree(Path(account.pw_dir) / "ft-assets-worker", ignore_errors=True)  # an interrupted session's
    root = Path(tempfile.mkdtemp(prefix="ft-assets-worker-", dir="/var/tmp"))
    root.chmod(0o755)
    venv = root / "venv"
    subprocess.run([WORKER_PYTHON, "-m", "venv", "--without-pip", str(venv)], check=True)
    packages = sysconfig.get_paths()["purelib"]
    (venv / "lib" / "python3.11" / "site-packages" / "ft-suite.pth").write_text(
        f"import site; site.addsitedir({packages!r})\n"
    )
    store = root / "store"
    store.mkdir()
    store.chmod(0o777)
    checkout = Path(__file__).resolve().parents[1]  # an editable install imports ft_assets from here
    with enterable_by_others(Path(packages), checkout), running_sshd(account.pw_name) as ssh:
        host = WorkerHost(ssh, account, str(venv / "bin" / "python"), store)
        probe = host.as_worker(f"{host.python} -c 'import ft_assets.training.remote'")
        if probe.returncode != 0:
            pytest.fail(
                f"the worker user {WORKER_USER} cannot import ft-assets from {packages} (its folders must be readable "
                f"by other users): {probe.stderr.strip()[-500:]}"
            )
        try:
            yield host
        finally:
            subprocess.run(["pkill", "-KILL", "-u", account.pw_name], capture_output=True)
            shutil.rmtree(root, ignore_errors=True)
            shutil.rmtree(Path(account.pw_dir) / "ft-assets-worker", ignore_errors=True)
