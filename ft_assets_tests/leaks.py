"""A pytest plugin: every test leaves Dagster's current instance context as it found it.

A Dagster instance, once entered (``with instance``, or an ephemeral one a context enters for itself), sets itself
as the process's current defs-state storage, a context variable that only its exit resets. A context left open is
exited later, by the garbage collector and out of order: the variable is then reset to an instance an earlier test
already deleted, and a later test's ``dg.materialize`` fails with sqlite's "unable to open database file" (twice on
fresh clones: test_parallel's Ray resource test). Building ``dg.build_init_resource_context()`` alone, without a
``with``, does not set it; which call in test_benchmarks_smoke (the test named on the last run) leaves one open is
not found yet. This fixture puts the variable back after each test that changed it, collecting the test's leftovers
first so that they reset it now rather than during a later test, and the run's summary names those tests.
"""

import gc

import pytest

LEFT_OPEN: list[str] = []


@pytest.fixture(autouse=True)
def dagster_instance_context_left_as_found(request):
    from dagster._core.storage.defs_state.base import _current_storage

    before = _current_storage.get()
    yield
    if _current_storage.get() is before:
        return
    gc.collect()
    _current_storage.set(before)
    LEFT_OPEN.append(request.node.nodeid)


def pytest_terminal_summary(terminalreporter):
    if LEFT_OPEN:
        terminalreporter.write_line(
            f"{len(LEFT_OPEN)} tests left a Dagster instance context open (Dagster's current defs-state storage was "
            f"put back after them): {', '.join(LEFT_OPEN)}"
        )
