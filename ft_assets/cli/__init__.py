"""``ft-assets``: register a dataset version and run the planes through the Dagster instance.

``ft-assets run --dataset PATH`` does what the control plane does in production, in one command:
it uploads the file(s) as ``datasets/<name>/<version>/`` with ``_SUCCESS`` written last, evaluates
``dataset_version_sensor`` (which adds the partition), then submits each plane's run for that
partition through the instance in ``DAGSTER_HOME`` — its run queue and launcher, or the launcher
alone when no daemon runs — and follows it, so the runs and materializations show up in the UI
(``make ui``) under their jobs; ``--in-process`` executes them in this process instead. ``ft-assets lineage`` verifies a published model's chain
from the store alone; ``ft-assets plan`` sizes and prices a fine-tune from a model config.

One module per command (``run``, ``lineage``, ``plan``), each with ``execute(args, partial) -> dict``
and ``report(args, result) -> exit code``; ``main`` parses, quiets the libraries, dispatches, and
turns a user error into one line (exit 2).
"""

from __future__ import annotations

import importlib
import traceback

from ft_assets.cli.output import CliError, fail
from ft_assets.cli.parser import build_parser
from ft_assets.cli.quiet import library_noise
from ft_assets.storage import StoreError

# Imported once chosen, after library_noise has set TQDM_DISABLE (tqdm reads it when first imported, and
# `run` imports torch, which imports tqdm), and so that `lineage` does not pay `run`'s imports (parser.py: 6x its own).
COMMANDS = {"run": "ft_assets.cli.run", "lineage": "ft_assets.cli.lineage", "plan": "ft_assets.cli.plan"}


def main(argv: list[str] | None = None) -> int:
    args = build_parser(__doc__.split("\n")[0]).parse_args(argv)
    partial: dict = {}
    with library_noise(args.verbose):
        command = importlib.import_module(COMMANDS[args.command])
        try:
            result = command.execute(args, partial)
        except (CliError, StoreError) as exc:
            return fail(args, partial, str(exc), exc)
        except Exception as exc:  # noqa: BLE001 - a bug, not a user error: still one line (and JSON), trace with --verbose
            if args.verbose:
                traceback.print_exc()
            return fail(
                args, partial, f"internal error {type(exc).__name__}: {exc} (rerun with --verbose for the trace)", exc
            )
        return command.report(args, result)
