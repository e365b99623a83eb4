"""A local model server as a subprocess for the length of a block: llama.cpp's (``llamacpp.serve``) and mlx-lm's
(``exports.mlx``), each OpenAI-compatible, which ``general_eval`` and the smoke tests talk to.

The server gets a free loopback port, counts as up when a GET of ``ready_path`` answers, and is stopped (SIGTERM,
then SIGKILL after 10 s) when the block ends. The port is picked by binding port 0 and released just before the
server binds it: another process could take it in between, and the server then fails to start with that in its log
(the error carries the log's last 3,000 characters). Polling every 0.25 s costs a start-up at most that much.
"""

from __future__ import annotations

import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class ServerError(RuntimeError):
    """The server exited or did not answer in time; the message ends with its log's tail."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def serve(
    command: Callable[[int], list[str]], what: str, serving: str, start_timeout_s: float, ready_path: str = "/v1/models"
) -> Iterator[str]:
    """Run ``command(port)`` on a free loopback port until ``ready_path`` answers; yield its base URL. ``what`` names
    the server and ``serving`` what it serves in the errors."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as server_log:
        server = subprocess.Popen(command(port), stdout=server_log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

        def log_tail() -> str:
            server_log.seek(0)
            return server_log.read().decode("utf-8", "replace")[-3000:]

        try:
            deadline = time.monotonic() + start_timeout_s
            while True:
                if server.poll() is not None:
                    raise ServerError(f"{what} exited with {server.returncode} before serving {serving}:\n{log_tail()}")
                try:
                    with urllib.request.urlopen(f"{url}{ready_path}", timeout=2):
                        break
                except (urllib.error.URLError, ConnectionError, TimeoutError):
                    if time.monotonic() > deadline:
                        raise ServerError(
                            f"{what} did not answer on {url} within {start_timeout_s:.0f} s:\n{log_tail()}"
                        ) from None
                    time.sleep(0.25)
            yield url
        finally:
            stop(server, 10)


def stop(server: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM, ``grace_s`` seconds to exit, then SIGKILL: a model server never outlives its caller."""
    server.terminate()
    try:
        server.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
