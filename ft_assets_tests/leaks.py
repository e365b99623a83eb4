"""A pytest plugin: a test that leaves process-wide state changed fails, and the state is put back for the next one.

Two such leaks once failed tests far from their cause, and only in full runs:
- **A Dagster instance left entered.** An instance, once entered (``with instance``, ``instance_for_test``, an
  ephemeral one that a context enters for itself, or one that a sensor context opens from its reference), sets
  itself as the process's current defs-state storage, a context variable that only its exit resets. One left
  entered inside an object that nothing closes is exited later, by the garbage collector, during some other test:
  the variable then goes back to an instance an earlier test already deleted, and a later ``dg.materialize``
  fails with sqlite's "unable to open database file". So every entry is recorded with where it was made, and a
  test that ends with one of its own still open fails, naming the line that entered it.
- **SIGTERM's disposition and mask, and SIGINT's disposition.** A child process inherits an ignored or blocked
  SIGTERM across exec, and a shell started so cannot trap it; a handler left behind (``ray.init``'s, say) changes
  what SIGTERM does to the test process itself. An ignored SIGINT is inherited too (a Python child then keeps it
  ignored), and Dagster maps SIGTERM to SIGINT's handler, so it ends up ignoring SIGTERM as well.

A test that leaked gets an error in its teardown naming what (the test itself passed or failed as it did); the
state is put back first and its leftovers collected, so the tests after it run as they would alone.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import signal
import sysconfig
import traceback
from collections.abc import Iterator

import pytest
from dagster._core.storage.defs_state import base as defs_state
from dagster._utils.interrupts import setup_interrupt_handlers

# Where a line is not ours: the standard library and the installed packages (ft-assets is installed editable).
LIBRARIES = tuple({sysconfig.get_paths()[name] for name in ("stdlib", "purelib", "platlib")})
_entered: dict[int, str] = {}  # the instances entered and not yet exited: entry number -> where it was entered
_numbers = itertools.count()
_set_storage = defs_state.set_defs_state_storage


@contextlib.contextmanager
def _recorded_set_defs_state_storage(storage):
    """Dagster's own ``set_defs_state_storage`` (what entering an instance does), recording where it was entered."""
    number = next(_numbers)
    frames = [f for f in traceback.extract_stack()[:-2] if not f.filename.startswith(LIBRARIES)]
    _entered[number] = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "(no frame outside the libraries)"
    try:
        with _set_storage(storage):
            yield
    finally:
        _entered.pop(number, None)


defs_state.set_defs_state_storage = _recorded_set_defs_state_storage  # DagsterInstance.__enter__ looks it up per call

# The suite's process is a Dagster process: Dagster's CLI maps SIGTERM to SIGINT's handler when it starts
# (setup_interrupt_handlers), and every execution in a process (dg.materialize, execute_in_process) sets that mapping
# again when it ends (capture_interrupts). Set from the start, it is the state every test must leave.
# A pytest-xdist worker starts with SIGINT ignored (execnet's workers leave Ctrl-C to the controller): mapped to it,
# SIGTERM would be ignored too, and every child would inherit both ignored (a shell that cannot trap SIGTERM, a Python
# that never sees KeyboardInterrupt). Each worker starts as a plain Python process does instead.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
setup_interrupt_handlers()


def ignored_by_the_os() -> str:
    """Which of SIGINT and SIGTERM the kernel has as ignored for this process (``SigIgn`` in /proc/self/status): what
    a child inherits, also when native code set it behind Python's back (``signal.getsignal`` would not tell)."""
    with open("/proc/self/status") as status:
        mask = int(next(line for line in status if line.startswith("SigIgn:")).split()[1], 16)
    return ",".join(s.name for s in (signal.SIGINT, signal.SIGTERM) if mask & (1 << (s - 1))) or "none"


def sigterm_state() -> tuple[object, bool, object, str]:
    """SIGTERM's handler in this process, whether this thread blocks it, SIGINT's handler (Dagster maps SIGTERM
    to it: an ignored SIGINT is inherited by every child, and makes the next mapping ignore SIGTERM too), and which
    of the two the kernel has as ignored."""
    blocked = signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    return signal.getsignal(signal.SIGTERM), blocked, signal.getsignal(signal.SIGINT), ignored_by_the_os()


def restore_sigterm(state: tuple[object, bool, object, str]) -> None:
    handler, blocked, interrupt, _ = state
    if handler is not None:  # None: a handler set outside Python, which Python cannot put back
        signal.signal(signal.SIGTERM, handler)
    if interrupt is not None:  # setting it again also puts the kernel's disposition back
        signal.signal(signal.SIGINT, interrupt)
    signal.pthread_sigmask(signal.SIG_BLOCK if blocked else signal.SIG_UNBLOCK, [signal.SIGTERM])


def left_as_found() -> Iterator[None]:
    """Fails if what is within changed either state and did not put it back; puts it back first."""
    storage, sigterm, entered = defs_state._current_storage.get(), sigterm_state(), set(_entered)
    yield
    changed = []
    left_open = {number: where for number, where in _entered.items() if number not in entered}
    if left_open:
        changed.append(
            f"left {len(left_open)} Dagster instance(s) entered, at {', '.join(sorted(set(left_open.values())))}"
        )
        gc.collect()  # the leftovers exit now, not during a later test
        for number in left_open:  # named once: one still referenced (so never exited) is not the next scope's leak
            _entered.pop(number, None)
    if defs_state._current_storage.get() is not storage:
        defs_state._current_storage.set(storage)
        if not left_open:
            changed.append("changed Dagster's current defs-state storage")
    if sigterm_state() != sigterm:
        now = sigterm_state()
        restore_sigterm(sigterm)
        changed.append(f"changed SIGTERM's handler or mask (or SIGINT's handler) from {sigterm} to {now}")
    if changed:
        pytest.fail("; and ".join(changed) + " (put back for the next test)", pytrace=False)


# Each scope's own check: set up before, and torn down after, the fixtures of its scope (autouse fixtures come first),
# so a module's fixtures that leave a change behind are caught at the module's end, not missed by every test in it.
@pytest.fixture(autouse=True)
def test_leaves_process_state_as_found():
    yield from left_as_found()


@pytest.fixture(scope="module", autouse=True)
def module_leaves_process_state_as_found():
    yield from left_as_found()


@pytest.fixture(scope="session", autouse=True)
def session_leaves_process_state_as_found():
    yield from left_as_found()
