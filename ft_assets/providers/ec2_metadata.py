"""EC2 instance metadata (IMDSv2) as a training worker reads it: which instance it is, and the spot notice.

- The control plane's idle-shutdown sensor (``ft_assets.control.shutdown``) ties runs to workers by
  the run tag ``WORKER_TAG``, which only the worker can set: the launcher does not know where the
  pool places a run.
- EC2 announces the reclaim of a spot instance two minutes ahead, at
  ``/latest/meta-data/spot/instance-action`` (404 until then, then ``{"action": "terminate", "time":
  ...}``). A container runtime passes the notice on as SIGTERM only if its agent drains spot instances
  (ECS: ``ECS_ENABLE_SPOT_INSTANCE_DRAINING``), and a bare EC2 worker never gets one. So the training
  plane watches the notice itself (``SpotNoticeWatcher``, every 5 s) and sends its own process the
  SIGTERM that the recipe already turns into checkpoint-and-exit at the next step boundary: one path
  for every way a worker is told to leave.

Off EC2 the metadata address does not answer: the tag is empty and the watcher stops after one try.
Both honour botocore's ``AWS_EC2_METADATA_SERVICE_ENDPOINT`` and ``AWS_EC2_METADATA_DISABLED``.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import signal
import threading
import time
import urllib.error
import urllib.request

WORKER_TAG = "ft/worker-instance-id"  # Dagster run tag: the EC2 instance the run ran on
IMDS_TIMEOUT_S = 0.5  # IMDS answers in milliseconds on EC2; off EC2 the address just does not answer
SPOT_POLL_S = 5.0  # the notice comes 120 s ahead: 5 s polls leave ~115 s to checkpoint
TOKEN_TTL_S = 21_600  # IMDSv2's longest token lifetime; the watcher renews it before it lapses
SPOT_ACTION = "/latest/meta-data/spot/instance-action"

logger = logging.getLogger(__name__)


class NotOnEc2(OSError):
    """The instance metadata service does not answer (or is disabled): this is not an EC2 instance."""


class Imds:
    """A minimal IMDSv2 client: a session token, then GETs with it."""

    def __init__(self, timeout_s: float = IMDS_TIMEOUT_S, ttl_s: int = 60):
        if os.environ.get("AWS_EC2_METADATA_DISABLED", "").lower() == "true":
            raise NotOnEc2("AWS_EC2_METADATA_DISABLED is set")
        self.endpoint = os.environ.get("AWS_EC2_METADATA_SERVICE_ENDPOINT", "http://169.254.169.254").rstrip("/")
        self.timeout_s, self.ttl_s = timeout_s, ttl_s
        self._token, self._token_until = "", 0.0

    def _open(self, request: urllib.request.Request) -> bytes:
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return response.read()
        except urllib.error.HTTPError:
            raise
        except (OSError, http.client.HTTPException) as exc:  # refused, timed out (URLError is an OSError), garbled
            raise NotOnEc2(f"no instance metadata at {self.endpoint}: {exc}") from exc

    def token(self) -> str:
        if time.monotonic() >= self._token_until:
            request = urllib.request.Request(
                f"{self.endpoint}/latest/api/token",
                method="PUT",
                headers={"X-aws-ec2-metadata-token-ttl-seconds": str(self.ttl_s)},
            )
            try:
                self._token = self._open(request).decode()
            except urllib.error.HTTPError as exc:  # something answers, but not IMDS (a proxy, a refusal)
                raise NotOnEc2(f"{self.endpoint} refused an IMDSv2 token ({exc.code})") from exc
            self._token_until = time.monotonic() + self.ttl_s * 0.9
        return self._token

    def get(self, path: str) -> str | None:
        """The text at ``path``, or None when the service answers 404 (nothing there, e.g. no spot notice)."""
        request = urllib.request.Request(f"{self.endpoint}{path}", headers={"X-aws-ec2-metadata-token": self.token()})
        try:
            return self._open(request).decode()
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise NotOnEc2(f"instance metadata {path} answered {exc.code}") from exc


def worker_instance_tag(timeout_s: float = IMDS_TIMEOUT_S) -> dict[str, str]:
    """``{"ft/worker-instance-id": <this EC2 instance id>}`` from IMDSv2, or ``{}`` when not on EC2."""
    try:
        instance_id = (Imds(timeout_s).get("/latest/meta-data/instance-id") or "").strip()
    except NotOnEc2:
        return {}
    return {WORKER_TAG: instance_id} if instance_id.startswith("i-") else {}


class SpotNoticeWatcher:
    """While entered, polls the spot ``instance-action`` notice; on a notice, SIGTERMs this process once.

    The recipe's SIGTERM handler (``preemption.SigtermFlag``) then checkpoints at the next step boundary,
    waits for the upload and exits with ``EXIT_PREEMPTED``, which the run retry resumes elsewhere.
    """

    def __init__(self, poll_s: float | None = None, timeout_s: float = IMDS_TIMEOUT_S, log=logger.warning):
        self.poll_s, self.timeout_s, self.log = poll_s or SPOT_POLL_S, timeout_s, log
        self.notice: dict | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> SpotNoticeWatcher:
        self._thread = threading.Thread(target=self._watch, name="spot-notice", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _watch(self) -> None:
        try:
            imds = Imds(self.timeout_s, ttl_s=TOKEN_TTL_S)
            while not self._stop.is_set():
                text = imds.get(SPOT_ACTION)
                if text is not None:
                    try:
                        self.notice = json.loads(text)
                    except ValueError:
                        self.notice = {"action": "stop", "raw": text[:200]}
                    self.log(f"spot notice: EC2 will {self.notice.get('action', 'stop')} this instance at "
                             f"{self.notice.get('time', 'soon')}; checkpointing and stopping (as on SIGTERM)")  # fmt: skip
                    os.kill(os.getpid(), signal.SIGTERM)
                    return
                self._stop.wait(self.poll_s)
        except NotOnEc2:
            return  # not an EC2 worker (or metadata disabled): nothing to watch
