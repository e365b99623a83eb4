"""A real Slurm for the tests: munged, slurmctld and slurmd from Debian's packages, one node with two fake GPUs.

Everything lives in one temp folder: the munge key and socket (``AuthInfo=socket=``), the controller's
state, slurmd's spool, logs and pid files; the ports are free ones chosen at start. Jobs run as the
user the suite runs as (root in CI: ``SlurmUser=root``). ``gres.conf`` gives the node two GPUs backed by
``/dev/null`` and ``/dev/zero`` (slurmd drops a GPU that has no ``File=``); Slurm sets
``CUDA_VISIBLE_DEVICES`` for a job as on a real GPU node, and training runs on the CPU. ``sinfo`` shows
the node idle ~3 s after the daemons start; they are stopped by the pids in their pid files.

``login_node``: an ``sshd`` on a free loopback port (``sshhost.running_sshd``) whose sessions get
``SLURM_CONF`` (``SetEnv``), as a login node has ``/etc/slurm/slurm.conf``.

Missing binaries FAIL the test (``make test`` installs them: scripts/install-system-deps.sh).
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from ft_assets_tests.pg import free_port
from ft_assets_tests.sshhost import running_sshd

INSTALL_HINT = (
    "`make test` installs it (scripts/install-system-deps.sh: apt-get install slurm-wlm munge openssh-server)"
)
START_TIMEOUT_S = 30.0
KILL_WAIT_S = 5  # SIGTERM to SIGKILL of a cancelled job: room for a tiny checkpoint, not the default 30 s
PARTITION = "gpu"
NODE_GPUS = 2


def _need(binary: str) -> str:
    path = shutil.which(binary) or (f"/usr/sbin/{binary}" if Path(f"/usr/sbin/{binary}").exists() else None)
    if path is None:
        pytest.fail(f"{binary} not found: {INSTALL_HINT}")
    return path


@dataclass
class SlurmCluster:
    root: Path
    node: str

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **self.env}, timeout=60)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()}")
        return done

    def state(self, job_id: str) -> str:
        return self.run("squeue", "--states=all", "-h", "-j", job_id, "-o", "%T", check=False).stdout.strip()

    def log(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted((self.root / "log").glob("*.log"))
        )

    def write_config(self) -> None:
        r, node = self.root, self.node
        lines = [
            "ClusterName=fttest", f"SlurmctldHost={node}", "SlurmUser=root", "SlurmdUser=root",
            f"SlurmctldPort={free_port()}", f"SlurmdPort={free_port()}",
            "AuthType=auth/munge", f"AuthInfo=socket={r}/munge/munge.socket", "CredType=cred/munge",
            f"StateSaveLocation={r}/state", f"SlurmdSpoolDir={r}/spool",
            f"SlurmctldPidFile={r}/slurmctld.pid", f"SlurmdPidFile={r}/slurmd.pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log", f"SlurmdLogFile={r}/log/slurmd.log",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core", "GresTypes=gpu", "MpiDefault=none", "ReturnToService=2",
            f"KillWait={KILL_WAIT_S}", "MinJobAge=300", "SchedulerParameters=sched_min_interval=100000",
            f"NodeName={node} CPUs=2 RealMemory=20000 Gres=gpu:{NODE_GPUS} State=UNKNOWN",
            f"PartitionName={PARTITION} Nodes={node} Default=YES MaxTime=INFINITE State=UP",
        ]  # fmt: skip
        self.conf.write_text("\n".join(lines) + "\n")
        (r / "gres.conf").write_text(
            f"NodeName={node} Name=gpu File=/dev/null\nNodeName={node} Name=gpu File=/dev/zero\n"
        )

    def start(self) -> None:
        for sub in ("munge", "state", "spool", "log"):
            (self.root / sub).mkdir(mode=0o700)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.write_config()
        munge = self.root / "munge"
        subprocess.run([_need("munged"), "--force", f"--key-file={key}", f"--socket={munge}/munge.socket",
                        f"--pid-file={munge}/munged.pid", f"--log-file={self.root}/log/munged.log",
                        f"--seed-file={munge}/seed"], check=True, capture_output=True)  # fmt: skip
        for daemon in ("slurmctld", "slurmd"):
            subprocess.run([_need(daemon)], check=True, capture_output=True, env={**os.environ, **self.env})
        deadline = time.monotonic() + START_TIMEOUT_S
        while "idle" not in self.run("sinfo", "-h", "-o", "%t", check=False).stdout:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Slurm node is not idle after {START_TIMEOUT_S:.0f} s\n{self.log()}")
            time.sleep(0.5)

    def stop(self) -> None:
        self.run("scancel", "--full", "--user", str(os.getuid()), check=False)  # jobs first: their steps exit
        for pid_file in ("slurmd.pid", "slurmctld.pid", "munge/munged.pid"):
            path = self.root / pid_file
            if not path.is_file():
                continue
            pid = int(path.read_text().split()[0])
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            for _ in range(100):
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)


@pytest.fixture(scope="session")
def slurm_cluster():
    """A one-node Slurm 22.05 with two fake GPUs, for the whole session; SLURM_CONF points its clients at it."""
    for binary in ("sbatch", "squeue", "scontrol", "scancel", "sinfo"):
        _need(binary)
    root = Path(tempfile.mkdtemp(prefix="ft-assets-slurm-"))
    cluster = SlurmCluster(root, socket.gethostname().split(".")[0])
    try:
        cluster.start()
        yield cluster
    finally:
        try:
            cluster.stop()
        finally:
            shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def login_node(slurm_cluster):
    """sshd on a free loopback port: public-key login for this user, sessions with the test cluster's SLURM_CONF."""
    with running_sshd(pwd.getpwuid(os.getuid()).pw_name, [f"SetEnv SLURM_CONF={slurm_cluster.conf}"]) as node:
        yield node
