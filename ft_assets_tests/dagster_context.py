"""A pytest plugin: every test leaves Dagster's current instance context as it found it.

A Dagster instance, once entered (``with instance``; ``dg.build_init_resource_context()`` and
``dg.build_asset_context()`` enter an ephemeral one when given none), sets itself as the process's current
defs-state storage, a context variable that only its exit resets. A context a test builds without a ``with`` is
exited by the garbage collector, later and out of order: the variable is then reset to an instance an earlier test
already deleted, and a later test's ``dg.materialize`` fails with sqlite's "unable to open database file" (twice on
fresh clones: test_parallel's Ray resource test). test_style flags the known ways to leave one open; this fixture
puts the variable back after each test that changed it, collecting the test's leftovers first so that they reset
it now rather than during a later test, and the run's summary names those tests.
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
