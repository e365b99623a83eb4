"""The command line's run log: one short line per message of a run, no stack traces unless asked.

``ft-assets run`` executes the planes in-process. Dagster's default ``console`` logger prints every
event with its full stack trace, which buries an expected user error ("the input file is empty")
under 40 lines of Dagster internals. This logger prints ``[ft-assets] <step>: <message>`` for the
steps' own messages and warnings, and leaves failures to the command's closing one-line error;
with ``verbose`` it prints every event with its trace. The run's event log in the Dagster instance
keeps the traces either way (``make ui`` shows them).
"""

from __future__ import annotations

import logging
import sys

import dagster as dg

NOISE = ("STEP_FAILURE", "PIPELINE_FAILURE", "RUN_FAILURE", "STEP_SKIPPED", "STEP_UP_FOR_RETRY")


class _OneLine(logging.Formatter):
    def __init__(self, verbose: bool):
        super().__init__()
        self.verbose = verbose

    def format(self, record: logging.LogRecord) -> str:
        meta = getattr(record, "dagster_meta", {})
        message = meta.get("orig_message") or record.getMessage()
        where = meta.get("step_key") or meta.get("job_name") or "run"
        if self.verbose:
            return f"[ft-assets] {where}: {record.getMessage()}"
        return f"[ft-assets] {where}: {message.splitlines()[0] if message else ''}"


class _Quiet(logging.Filter):
    """Drops failure events (the command reports the failure itself) and dependency notices."""

    def filter(self, record: logging.LogRecord) -> bool:
        meta = getattr(record, "dagster_meta", {})
        event = meta.get("dagster_event")
        if event is not None and event.event_type_value in NOISE:
            return False
        return not (record.levelno >= logging.ERROR and "Dependencies for step" in (meta.get("orig_message") or ""))


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
