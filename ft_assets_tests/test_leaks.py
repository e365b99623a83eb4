"""The leak guard (``leaks.py``): a test, or a module's fixtures, that leave a Dagster instance entered or SIGTERM
changed get an error naming what and where; the tests after them see the state as it was. Run on a sample file with
a real pytest, as the suite runs it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from ft_assets.data.parallel import sigterm_handler_kept

ROOT = Path(__file__).resolve().parents[1]

SAMPLE = """
import signal

import dagster as dg
import pytest

KEPT = []


def test_enters_an_instance_and_keeps_it():
    KEPT.append(dg.DagsterInstance.ephemeral().__enter__())


def test_closes_what_it_enters_and_executes_in_process():
    with dg.instance_for_test() as instance:
        assert dg.materialize([dg.asset(lambda: 1, name="one")], instance=instance).success


def test_ignores_sigterm():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def test_blocks_sigterm():
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])


def test_ignores_sigint():
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def test_sees_sigterm_as_it_was():
    assert signal.getsignal(signal.SIGTERM) is signal.default_int_handler  # Dagster's mapping, as in a dagster CLI
    assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, [])


@pytest.fixture(scope="module")
def handler_left_by_a_fixture():
    signal.signal(signal.SIGTERM, lambda *a: None)
    yield


def test_in_a_module_whose_fixture_leaks(handler_left_by_a_fixture):
    pass
"""


def test_a_leaking_test_is_named_with_what_it_left_and_the_next_test_sees_the_state_as_before(tmp_path):
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rE", "-p", "no:cacheprovider", "-p", "ft_assets_tests.leaks",
         "-c", os.devnull, "--rootdir", str(tmp_path), str(tmp_path)],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "1000"}, cwd=tmp_path,
        timeout=300,
    )  # fmt: skip
    out = done.stdout
    errors = {line.split(" - ")[0]: line for line in out.splitlines() if line.startswith("ERROR ")}
    expected = ("enters_an_instance_and_keeps_it", "ignores_sigterm", "blocks_sigterm", "ignores_sigint",
                "in_a_module_whose_fixture_leaks")  # fmt: skip
    assert set(errors) == {f"ERROR test_sample.py::test_{name}" for name in expected}, out + done.stderr
    entered = errors.pop("ERROR test_sample.py::test_enters_an_instance_and_keeps_it")
    assert f"left 1 Dagster instance(s) entered, at {tmp_path}/test_sample.py:11 " in entered, entered
    ignored = errors.pop("ERROR test_sample.py::test_ignores_sigterm")
    assert (
        "changed SIGTERM's handler or mask (or SIGINT's handler) from (<built-in function default_int_handler>, False, "
        "<built-in function default_int_handler>, 'none') to (<Handlers.SIG_IGN: 1>, False" in ignored
    )
    blocked = errors.pop("ERROR test_sample.py::test_blocks_sigterm")
    assert (
        "to (<built-in function default_int_handler>, True, <built-in function default_int_handler>, 'none')" in blocked
    )
    sigint = errors.pop("ERROR test_sample.py::test_ignores_sigint")
    assert "to (<built-in function default_int_handler>, False, <Handlers.SIG_IGN: 1>, 'SIGINT')" in sigint, sigint
    module = errors.pop("ERROR test_sample.py::test_in_a_module_whose_fixture_leaks")  # at the module's end
    assert "changed SIGTERM's handler" in module and "<lambda>" in module and "Dagster" not in module
    assert not errors, errors
    assert "7 passed, 5 errors" in out, out  # test_sees_sigterm_as_it_was passed after the two SIGTERM leaks


def test_sigterm_handler_kept_puts_back_what_ray_init_replaces():
    """ray.init sets its own SIGTERM handler and ray.shutdown leaves it (the data plane's Ray executor is connected
    within ``sigterm_handler_kept``; test_benchmarks_smoke runs it in the test process, where the guard watches)."""
    import ray

    def ours(signum, frame):
        pass

    before = signal.signal(signal.SIGTERM, ours)
    try:
        with sigterm_handler_kept():
            ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
            assert signal.getsignal(signal.SIGTERM) is not ours  # what it puts back: ray.init's own handler
        assert signal.getsignal(signal.SIGTERM) is ours
    finally:
        ray.shutdown()
        signal.signal(signal.SIGTERM, before)
