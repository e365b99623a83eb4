"""What every command prints besides its result: progress lines and the one-line error (with ``--json``, an object).

A user error is exit code 2 with one line on stderr (what, where, what to do) and no stack trace; with
``--json`` the last line of stdout is still one JSON object (``error``, ``failed_plane``, ``run_id``,
``completed`` and whatever the completed planes reported), so a script never has to parse stderr.
"""

from __future__ import annotations

import argparse
import json
import sys

USER_ERROR = 2  # the exit code of any failure: argparse's own for a bad command line


class CliError(RuntimeError):
    """A mistake the user can fix; its text is the whole message."""


class PlaneFailed(CliError):
    """A plane's run failed; says which plane and run, for the one-line error and ``--json``."""

    def __init__(self, message: str, plane: str, run_id: str):
        super().__init__(message)
        self.plane, self.run_id = plane, run_id


def log(message: str) -> None:
    print(f"[ft-assets] {message}", file=sys.stderr, flush=True)


def fail(args: argparse.Namespace, partial: dict, message: str, exc: Exception) -> int:
    """The one-line error on stderr; with --json also a JSON object on stdout: what failed, where, what completed."""
    print(f"ft-assets: error: {message}", file=sys.stderr)
    if args.json:
        failure = {
            **partial,
            "error": message,
            "failed_plane": getattr(exc, "plane", None),
            "run_id": getattr(exc, "run_id", None),
            "completed": partial.get("completed", []),
        }
        print(json.dumps(failure, sort_keys=True, default=str))
    return USER_ERROR


def print_json(result: dict) -> None:
    """The result as one JSON object, the last line of stdout."""
    print(json.dumps(result, sort_keys=True))
