"""A failed CI run can be read afterwards: ``.ci/run`` keeps pytest's junit.xml and progress.log outside the clone, and
``scripts/ci_report.py`` prints the failing tests' names and first error lines, or the test a crashed pytest died in.

Each case runs a real pytest on a small test file with this suite's progress plugin, as ``make test`` runs it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FAILING = """
import os, signal

def test_fine():
    assert 1 + 1 == 2

def test_wrong_sum():
    total = 2 + 2
    assert total == 5, f"the sum of the parts is {total}"

def test_crash():
    os.kill(os.getpid(), signal.SIGSEGV)  # as a native library's fault would
"""


def run_ci(tmp_path: Path, selection: str, *options: str) -> tuple[int, str, Path]:
    """pytest on FAILING (``selection``: a -k expression) with junit and progress in a run folder, then the report."""
    tests = tmp_path / "suite"
    tests.mkdir(exist_ok=True)
    (tests / "test_sample.py").write_text(FAILING)
    run_dir = tmp_path / "ci" / "_".join([selection, *options]).replace(" ", "_")
    run_dir.mkdir(parents=True)
    env = {**os.environ, "FT_TEST_PROGRESS": str(run_dir / "progress.log"), "PYTHONPATH": str(ROOT)}
    with open(run_dir / "output.log", "w") as output:
        status = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "ft_assets_tests.progress",
             "-c", os.devnull, "--rootdir", str(tests), f"--junitxml={run_dir / 'junit.xml'}", "-k", selection, *options,
             str(tests)],
            stdout=output, stderr=subprocess.STDOUT, env=env, timeout=120,
        ).returncode  # fmt: skip
    report = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "ci_report.py"), str(run_dir), "--status", str(status),
         "--seconds", "75", "--root", str(tests)],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    return status, report, run_dir


def test_a_failing_test_is_named_with_its_error_in_the_report_and_the_kept_files(tmp_path):
    status, report, run_dir = run_ci(tmp_path, "not crash")
    assert status == 1
    lines = report.splitlines()
    assert lines[0].startswith("ci: `make test` exited 1 after 1 min 15 s in all")
    assert "2 tests in" in lines[0] and "1 passed, 1 failed, 0 errors, 0 skipped" in lines[0]
    failed = lines.index("FAILED test_sample.py::test_wrong_sum")
    error = "\n".join(lines[failed + 1 :])
    assert "AssertionError: the sum of the parts is 4" in error and "test_sample.py:9: AssertionError" in error
    assert "test_fine" not in report and "died" not in report
    assert "FAILED" not in report.replace("FAILED test_sample.py::test_wrong_sum", "")
    progress = (run_dir / "progress.log").read_text()
    assert "failed call test_sample.py::test_wrong_sum" in progress and "session ended" in progress


def test_a_crashed_pytest_is_named_by_the_test_it_died_in(tmp_path):
    status, report, run_dir = run_ci(tmp_path, "fine or crash")
    assert status not in (0, 1) and not (run_dir / "junit.xml").exists()  # died: no junit
    assert "ci: pytest died while running test_sample.py::test_crash" in report
    assert "pytest wrote no junit.xml; the last 40 lines of output.log:" in report
    assert "Fatal Python error: Segmentation fault" in report  # faulthandler's traceback, from the kept output
    assert "passed call test_sample.py::test_fine" in (run_dir / "progress.log").read_text()


def test_a_worker_that_crashed_is_named_by_its_test(tmp_path):
    """Under make test's workers (pytest-xdist) a worker's crash is the test's failure, and junit.xml is written."""
    status, report, run_dir = run_ci(
        tmp_path, "fine or crash", "-n", "2", "--dist", "loadfile", "--max-worker-restart=1"
    )
    assert status == 1 and (run_dir / "junit.xml").is_file()
    lines = report.splitlines()
    assert "1 passed, 1 failed" in lines[0]
    (failed,) = [i for i, line in enumerate(lines) if line.startswith("FAILED test_sample.py::test_crash")]
    assert "crashed while running" in lines[failed + 1] and "died" not in report


def test_a_passing_run_reports_its_times_and_nothing_else(tmp_path):
    status, report, _ = run_ci(tmp_path, "fine")
    assert status == 0
    head = report.splitlines()[0]
    assert head.startswith("ci: `make test` exited 0") and "1 tests in" in head
    assert head.endswith("1 passed, 0 failed, 0 errors, 0 skipped")
    assert "FAILED" not in report and "died" not in report and "output.log:" not in report
