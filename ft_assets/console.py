"""The command line's run log: one short line per message of a run, no stack traces unless asked.

Dagster's default ``console`` logger prints every event with its full stack trace, which buries an
expected user error ("the input file is empty") under 40 lines of Dagster internals. The lines here
are ``[ft-assets] <step>: <message>`` for the steps' own messages and warnings; failures are left to
the command's closing one-line error; with ``verbose`` every event is printed with its trace. The
run's event log in the Dagster instance keeps the traces either way (``make ui`` shows them).

Two readers of a run share these rules (``shown``, ``one_line``): the ``ft_console`` logger, which a
run executed in the command's own process (``ft-assets run --in-process``) writes through, and
``entry_line``, with which ``ft-assets run`` prints the event log of a run it submitted to the
instance (the run executes in a worker process, possibly on another machine).
"""

from __future__ import annotations

import logging
import sys

import dagster as dg

NOISE = ("STEP_FAILURE", "PIPELINE_FAILURE", "RUN_FAILURE", "STEP_SKIPPED", "STEP_UP_FOR_RETRY")
PREFIX = "[ft-assets]"


def shown(event_type: str | None, level: int, message: str, verbose: bool) -> bool:
    """Whether a run's message gets a line: not the failure events (the command reports the failure
    itself) nor the dependency notices that follow a failed step, unless ``verbose``."""
    if verbose:
        return True
    if event_type in NOISE:
        return False
    return not (level >= logging.ERROR and "Dependencies for step" in message)


def one_line(where: str, message: str) -> str:
    return f"{PREFIX} {where}: {message.splitlines()[0] if message else ''}"


def entry_line(entry: dg.EventLogEntry, verbose: bool, min_level: int = logging.INFO) -> str | None:
    """The line for one event-log entry of a submitted run, or None when it gets none.

    ``verbose`` keeps the whole message and the stack trace of an error, as Dagster's console does.
    """
    event_type = entry.dagster_event.event_type_value if entry.dagster_event else None
    message = entry.message  # an event's own message (the launcher's engine events have no user message)
    if entry.level < min_level or not message or not shown(event_type, entry.level, message, verbose):
        return None
    where = entry.step_key or entry.job_name or "run"
    if not verbose:
        return one_line(where, message)
    error = entry.error_info or getattr(entry.dagster_event and entry.dagster_event.event_specific_data, "error", None)
    kind = f"{event_type} - " if event_type else ""
    return f"{PREFIX} {where}: {kind}{message}" + (f"\n\n{error.to_string()}" if error else "")


class _OneLine(logging.Formatter):
    def __init__(self, verbose: bool):
        super().__init__()
        self.verbose = verbose

    def format(self, record: logging.LogRecord) -> str:
        meta = getattr(record, "dagster_meta", {})
        where = meta.get("step_key") or meta.get("job_name") or "run"
        if self.verbose:
            return f"{PREFIX} {where}: {record.getMessage()}"
        return one_line(where, meta.get("orig_message") or record.getMessage())


class _Quiet(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        meta = getattr(record, "dagster_meta", {})
        event = meta.get("dagster_event")
        return shown(
            event.event_type_value if event else None, record.levelno, meta.get("orig_message") or "", verbose=False
        )


@dg.logger(
    config_schema={
        "log_level": dg.Field(str, default_value="INFO", description="Lowest level printed."),
        "verbose": dg.Field(bool, default_value=False, description="Print every event with its stack trace."),
    },
    description="ft-assets run's compact log on stderr: one line per message, failures left to the command.",
)
def ft_console(init_context) -> logging.Logger:
    config = init_context.logger_config
    logger = logging.Logger("ft-assets", level=config["log_level"].upper())
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_OneLine(config["verbose"]))
    if not config["verbose"]:
        handler.addFilter(_Quiet())
    logger.addHandler(handler)
    return logger
