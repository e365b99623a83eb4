"""Preemption: a spot worker's SIGTERM becomes a checkpoint at the next step boundary and a clean exit.

``SigtermFlag`` only records the signal (a handler that does work can hit a reentrant print or a
half-finished step); the recipe's loop checks it at every step boundary, checkpoints, waits for the
upload and raises ``Preempted``. The worker command exits with ``EXIT_PREEMPTED`` then, and the
``lora_adapter`` asset turns it into a Dagster retry that resumes from that checkpoint.
"""

from __future__ import annotations

import signal
import threading

EXIT_PREEMPTED = 75  # EX_TEMPFAIL from sysexits.h: "temporary failure, try again"


class Preempted(RuntimeError):
    """The worker got SIGTERM, saved a checkpoint at ``step`` and stopped; rerun to resume."""

    def __init__(self, step: int, checkpoint_uri: str | None):
        super().__init__(f"preempted by SIGTERM at step {step}; the run resumes from {checkpoint_uri or 'scratch'}")
        self.step = step
        self.checkpoint_uri = checkpoint_uri


class SigtermFlag:
    """While entered, SIGTERM only sets ``requested``; the loop acts on it at the next step boundary.

    Signal handlers can only be installed from the main thread; elsewhere this is a no-op flag.
    The previous handler (Dagster's, in a run worker) is restored on exit.
    """

    def __init__(self):
        self.requested = False
        self._installed = False
        self._previous = None

    def _handle(self, signum, frame) -> None:
        self.requested = True  # nothing else here: a handler that prints can hit a reentrant print

    def __enter__(self) -> SigtermFlag:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
            self._installed = True
        return self

    def __exit__(self, *exc_info) -> None:
        if self._installed:
            # None means a handler installed outside Python; the default action is the closest match.
            signal.signal(signal.SIGTERM, signal.SIG_DFL if self._previous is None else self._previous)
            self._installed = False
