"""The end of a CI run's output: how long it took and, for a failed run, which tests failed and their first error lines.

    python3 scripts/ci_report.py RUN_DIR --status N --seconds S

``RUN_DIR`` is the folder ``.ci/run`` keeps (``junit.xml``, ``progress.log``, ``output.log``). Standard library
only: it runs with the system's python3 even when the install failed. When pytest wrote no junit.xml (it died,
or never started), the report names the test that ``progress.log`` shows as started and not finished, and
prints the end of ``output.log``.
"""

from __future__ import annotations

import argparse
from collections import Counter
import xml.etree.ElementTree as ET
from pathlib import Path

ERROR_LINES = 8  # of each failure: enough for the assertion and its values, short enough to read 20 failures
TAIL_LINES = 40  # of output.log, when there is no junit to say what failed


def duration(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes} min {seconds} s" if minutes else f"{seconds} s"


def node_id(classname: str, name: str, root: Path) -> str:
    """pytest's node id from junit's ``classname`` (module path, then any class names) and ``name``."""
    parts = classname.split(".")
    for cut in range(len(parts), 0, -1):
        module = Path(*parts[:cut]).with_suffix(".py")
        if (root / module).is_file():
            return "::".join([module.as_posix(), *parts[cut:], name])
    return f"{classname}::{name}"


def first_error_lines(problem: ET.Element) -> list[str]:
    """The exception's own lines (pytest's ``E`` lines) and where it was raised; else junit's message."""
    text = problem.text or ""
    said = [line for line in text.splitlines() if line.startswith("E ")][:ERROR_LINES]
    where = [line for line in text.splitlines() if line and not line.startswith((" ", "E ")) and ":" in line][-1:]
    if not said:
        said = (problem.get("message") or text or "(no message)").splitlines()[:ERROR_LINES]
    return said + where


def failures(junit: Path, root: Path) -> tuple[dict, list[tuple[str, str, list[str]]]]:
    """The totals of every suite in ``junit``, and (node id, failure or error, first lines) of each failed test."""
    tree = ET.parse(junit).getroot()
    suites = [tree] if tree.tag == "testsuite" else list(tree.iter("testsuite"))
    totals = {key: sum(int(float(s.get(key, 0))) for s in suites) for key in ("tests", "failures", "errors", "skipped")}
    totals["time"] = sum(float(s.get("time", 0)) for s in suites)
    failed = []
    for case in tree.iter("testcase"):
        for problem in case:
            if problem.tag in ("failure", "error"):
                nodeid = node_id(case.get("classname", ""), case.get("name", ""), root)
                failed.append((nodeid, problem.tag, first_error_lines(problem)))
    return totals, failed


def died_in(progress: Path) -> list[str]:
    """The tests that were started and never reported on (one a worker): where pytest died, if it did."""
    if not progress.is_file():
        return []
    running: dict[str, None] = {}
    for line in progress.read_text(errors="replace").splitlines():
        fields = line.split(" ", 4)
        if len(fields) >= 3 and fields[1] == "start":
            running[fields[2]] = None
        elif len(fields) >= 4 and fields[2] in ("call", "setup", "teardown"):
            running.pop(fields[3], None)
    return list(running)


def tail(path: Path, lines: int = TAIL_LINES) -> list[str]:
    return path.read_text(errors="replace").splitlines()[-lines:] if path.is_file() else [f"({path} is missing)"]


def report(run_dir: Path, status: int, seconds: float, root: Path) -> list[str]:
    junit = run_dir / "junit.xml"
    head = f"ci: `make test` exited {status} after {duration(seconds)} in all (install included)"
    out = []
    totals, failed = ({}, [])
    if junit.is_file():
        try:
            totals, failed = failures(junit, root)
        except ET.ParseError as error:
            out.append(f"ci: {junit} is not readable XML ({error})")
    if totals:
        passed = totals["tests"] - totals["failures"] - totals["errors"] - totals["skipped"]
        head += (
            f"; pytest: {totals['tests']:,} tests in {duration(totals['time'])}: {passed:,} passed, "
            f"{totals['failures']} failed, {totals['errors']} errors, {totals['skipped']} skipped"
        )
    out.insert(0, head)
    if failed:
        times = Counter(nodeid for nodeid, _, _ in failed)  # a test that crashed its worker is reported per restart
        out.append(f"ci: {len(times)} failing test{'s' if len(times) > 1 else ''}:")
        shown = set()
        for nodeid, kind, lines in failed:
            if nodeid in shown:
                continue
            shown.add(nodeid)
            notes = (["error in setup or teardown"] if kind == "error" else []) + (
                [f"{times[nodeid]} times"] if times[nodeid] > 1 else []
            )
            out.append(f"FAILED {nodeid}" + (f" ({', '.join(notes)})" if notes else ""))
            out.extend(f"    {line}" for line in lines)
    crashed = [] if totals else died_in(run_dir / "progress.log")  # with junit.xml, pytest itself did not die
    if crashed:
        out.append(f"ci: pytest died while running {', '.join(crashed)} (started, never reported: progress.log)")
    if status != 0 and not failed:
        why = "pytest wrote no junit.xml" if not totals else "no test failed"
        out.append(f"ci: {why}; the last {TAIL_LINES} lines of output.log:")
        out.extend(tail(run_dir / "output.log"))
    out.append(f"ci: the whole output, junit.xml and progress.log are in {run_dir}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="the folder .ci/run keeps for this run")
    parser.add_argument("--status", type=int, required=True, help="make test's exit status")
    parser.add_argument("--seconds", type=float, required=True, help="how long make test took")
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="the repository (to name tests by file)")
    args = parser.parse_args()
    print("\n".join(report(args.run_dir, args.status, args.seconds, args.root)))


if __name__ == "__main__":
    main()
