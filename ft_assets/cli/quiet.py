"""Library noise off for a command (kept with ``--verbose``): progress bars, deprecation warnings, import notices.

Without it, the eval-gate run of ``test_pipeline.py`` (the 2-layer test model, 120 rows, 2 steps,
through delivery) printed 38 lines of its own log and 14 from libraries: transformers' "Loading
weights" bar 7 times, one "Writing model shards" and one "Converting and de-quantizing GGUF tensors"
bar, a FutureWarning from transformers on each of the 2 adapter loads (2 lines each), and
bitsandbytes' notice that an optional CPU kernel package is missing. None of them says anything the
run log does not; ``--verbose`` keeps them all. (The sensor's "new dataset version(s)" line, in
Dagster's format, is the sensor's own log and stays.)

Three switches, because the libraries read theirs at different times:
- ``TQDM_DISABLE=1`` in the environment: tqdm reads it once, when it is first imported, and it covers
  every bar, plain-tqdm ones included (transformers' GGUF loader). The command line sets it before
  it imports the command (which imports torch, which imports tqdm); child processes inherit it, as
  they do ``PYTHONWARNINGS``.
- transformers' and huggingface_hub's own progress-bar switches, for a caller of ``main`` in a process
  where tqdm is already imported (the tests): they are flipped in-process and restored afterwards.
- warning filters and logger levels, restored when the command returns.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

QUIET_ENV = {
    "TQDM_DISABLE": "1",
    "PYTHONWARNINGS": "ignore::FutureWarning,ignore::DeprecationWarning",
}
QUIET_WARNINGS = (FutureWarning, DeprecationWarning)
# Loggers whose notices are for library developers, at the level they keep: bitsandbytes warns at
# import when an optional CPU kernel package is missing.
QUIET_LOGGERS = {"bitsandbytes": logging.ERROR}
TRANSFORMERS_LOGGING = "transformers.utils.logging"


@contextmanager
def quiet_environment() -> Iterator[None]:
    """``QUIET_ENV`` set for the block (this process and the processes it starts), then restored."""
    saved = {name: os.environ.get(name) for name in QUIET_ENV}
    os.environ.update(QUIET_ENV)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextmanager
def quiet_progress_bars() -> Iterator[None]:
    """huggingface_hub's bars off, and transformers' when it is already imported (a later import reads
    huggingface_hub's switch); both as they were afterwards."""
    # Imported here, inside quiet_environment: huggingface_hub imports tqdm, which must read TQDM_DISABLE.
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    transformers_logging = sys.modules.get(TRANSFORMERS_LOGGING)
    hub_was_on = not are_progress_bars_disabled()
    transformers_was_on = transformers_logging is not None and transformers_logging.is_progress_bar_enabled()
    disable_progress_bars()
    if transformers_logging is not None:
        transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if hub_was_on:
            enable_progress_bars()
        if transformers_was_on:
            sys.modules[TRANSFORMERS_LOGGING].enable_progress_bar()


@contextmanager
def library_noise(verbose: bool) -> Iterator[None]:
    """Around a command: with ``verbose`` nothing changes; without, the switches above for the block."""
    if verbose:
        yield
        return
    levels = {name: logging.getLogger(name).level for name in QUIET_LOGGERS}
    with quiet_environment(), quiet_progress_bars(), warnings.catch_warnings():
        for category in QUIET_WARNINGS:
            warnings.simplefilter("ignore", category)
        for name, level in QUIET_LOGGERS.items():
            logging.getLogger(name).setLevel(level)
        try:
            yield
        finally:
            for name, level in levels.items():
                logging.getLogger(name).setLevel(level)
