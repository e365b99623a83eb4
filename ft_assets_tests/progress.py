"""A pytest plugin: with ``FT_TEST_PROGRESS=<file>``, each test's start and outcome are appended to that file as they
happen, one line each, flushed at once.

pytest writes ``junit.xml`` only when the session ends, so a process that dies under it (a native library's
segfault: llama.cpp's AMX kernels did once, at 28 % of a CI run) leaves no junit at all and only the last lines of
its terminal. This file still names the test it died in: its last ``start`` line with no outcome after it.
``.ci/run`` keeps it with the run's output, and ``scripts/ci_report.py`` reads it.
"""

from __future__ import annotations

import os
import time

_file = None


def pytest_configure(config):
    global _file
    path = os.environ.get("FT_TEST_PROGRESS")
    if path and not hasattr(config, "workerinput"):
        _file = open(path, "a", buffering=1)  # noqa: SIM115 -- open for the whole session, closed in unconfigure
        _file.write(f"{time.strftime('%H:%M:%S')} session pid={os.getpid()}\n")


def pytest_runtest_logstart(nodeid, location):
    if _file:
        _file.write(f"{time.strftime('%H:%M:%S')} start {nodeid}\n")


def pytest_runtest_logreport(report):
    """One line for the test's outcome (its call, or the setup or teardown that failed or skipped it)."""
    if _file and (report.when == "call" or report.outcome != "passed"):
        line = f"{time.strftime('%H:%M:%S')} {report.outcome} {report.when} {report.nodeid} {report.duration:.1f}s"
        if report.failed:  # what went wrong, in a line, as it happens (the whole error is in junit.xml at the end)
            crash = getattr(report.longrepr, "reprcrash", None)
            line += ": " + " ".join((crash.message if crash else str(report.longrepr)).split())[:300]
        _file.write(line + "\n")


def pytest_unconfigure(config):
    global _file
    if _file:
        _file.write(f"{time.strftime('%H:%M:%S')} session ended\n")
        _file.close()
        _file = None
