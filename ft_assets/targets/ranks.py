"""torchrun of a GPU target's training processes, with how each rank ended in the exit code: ``python -m
ft_assets.targets.ranks TORCHRUN-ARGS``.

A worker with ``gpus=N`` (``ft_assets.training.remote``) runs its N ranks through this instead of ``torchrun``, whose
exit code is 1 however a rank failed. Here torchrun's own ``run`` is called in this process and a rank that a signal
ended (``kill -9``, the kernel's OOM killer) makes the exit code 128 + that signal, as a shell reports a killed
process: the session then starts a new attempt that resumes from the newest complete checkpoint, where a rank that
raised fails the step (the same error would come back). A SIGTERM to this process reaches every rank (torchrun's
agent passes it on and waits ``--shutdown_timeout`` for their step-boundary checkpoint).
"""

from __future__ import annotations

import signal
import sys


def exit_code(codes: list[int]) -> int:
    """The exit code of ranks that ended with ``codes`` (torchrun's: negative for a signal), not all of them 0: 128 +
    the signal that ended one (a signal other than the SIGTERM torchrun sends the others when one fails), else 1."""
    signals = [-code for code in codes if code < 0]
    if not signals:
        return 1
    return 128 + next((s for s in signals if s != signal.SIGTERM), signals[0])


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(sys.argv[1:] if argv is None else argv))
    except ChildFailedError as exc:
        print(exc.format_msg(), file=sys.stderr, flush=True)
        return exit_code([failure.exitcode for failure in exc.failures.values()])
    except SignalException as exc:  # this process's SIGTERM: the ranks got it too, and checkpointed
        return 128 + exc.sigval
    return 0


if __name__ == "__main__":
    sys.exit(main())
