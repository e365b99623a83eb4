"""A real MLflow tracking server for the tests: ``mlflow server`` on a free loopback port, SQLite backend.

Started once per session, only when a test asks for ``mlflow_server`` (~10 s on 2 shared cores: the
first start creates the SQLite schema). One worker, and the job executor that ``mlflow server``
starts for its GenAI jobs is off (it would need ``huey`` and spawns consumers). Tests read back what
a run logged with ``MlflowClient``, exactly as a user would, and each test uses its own experiment.

``MlflowServer.stop()`` kills it (the "tracker goes away mid-run" test); ``start()`` brings it back on
the same port and database.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from ft_assets_tests.pg import free_port

START_TIMEOUT_S = 90.0


class MlflowServer:
    def __init__(self, root: Path):
        self.root = root
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        command = [
            sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
            "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}", "--default-artifact-root", str(self.root / "artifacts"),
        ]  # fmt: skip
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        log = open(self.root / "server.log", "a")  # noqa: SIM115 -- the server's output, for a failing test to show
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                tail = (self.root / "server.log").read_text()[-3000:]
                self.stop()
                pytest.fail(f"mlflow server did not start at {self.uri}:\n{tail}")
            time.sleep(0.3)

    def stop(self) -> None:
        """SIGKILL the server's process group (uvicorn's worker included)."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
        self.process = None

    def client(self):
        from mlflow.tracking import MlflowClient

        return MlflowClient(tracking_uri=self.uri)


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    server = MlflowServer(tmp_path_factory.mktemp("mlflow"))
    server.start()
    yield server
    server.stop()
