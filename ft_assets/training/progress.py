"""A run's progress between two log lines: the step losses waiting on the device, and the line itself.

On a GPU the recipe does not wait for the device between steps: each step's loss and gradient norm
stay on the device (``Window.add``) until a logging or checkpoint step reads every pending one at
once (``Window.read``: one device-to-host copy per log line instead of a sync per step), so the loss
history is the same as reading every step, without the stall. ``Window.metrics`` then makes the log
line's figures from the steps since the last line: mean loss and gradient norm, learning rate,
tokens/s and the ETA; ``progress_line``, ``eval_line`` and ``duration`` say them in the run log.
"""

from __future__ import annotations

import time

import torch


def duration(seconds: float) -> str:
    """``1h05m`` from an hour on, else ``4m07s``."""
    seconds = int(seconds)
    return (
        f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"
    )


def eval_line(metrics: dict[str, float]) -> str:
    """Eval figures for a log line: 'eval loss 0.6931, eval reward accuracy 0.5000, …'."""
    return ", ".join(f"{name.replace('_', ' ')} {value:.4f}" for name, value in metrics.items())


def progress_line(metrics: dict, figures: dict[str, float]) -> str:
    """``step 40/200  loss 1.2345  lr 2.00e-04  1,234 tok/s  eta 4m07s`` and the objective's own figures."""
    return (
        f"step {metrics['step']}/{metrics['total_steps']}  loss {metrics['loss']:.4f}  lr {metrics['learning_rate']:.2e}  "
        f"{metrics['tokens_per_second']:,.0f} tok/s  eta {duration(metrics['eta_seconds'])}"
        + "".join(f"  {name.replace('_', ' ')} {value:.4g}" for name, value in figures.items())
    )


class Window:
    """The steps since the last log line: their losses and gradient norms (queued on the device until read),
    the tokens they trained and when the window opened."""

    def __init__(self):
        self.pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (step, loss, grad norm), not yet read
        self.norms: list[float] = []  # the gradient norms read since the window opened
        self.restart()

    def restart(self) -> None:
        """Open a new window (after a log line); losses still pending stay queued."""
        self.started, self.steps, self.tokens = time.monotonic(), 0, 0
        self.norms = []

    def add(self, step: int, loss: torch.Tensor, norm: torch.Tensor, tokens: int) -> None:
        self.pending.append((step, loss, norm))
        self.steps, self.tokens = self.steps + 1, self.tokens + tokens

    def read(self, loss_history: list) -> None:
        """Append the pending losses to ``loss_history`` as (step, loss) (one device-to-host copy)."""
        if self.pending:
            steps = [step for step, _, _ in self.pending]
            values = torch.stack([torch.stack([loss, norm.float()]) for _, loss, norm in self.pending]).tolist()
            loss_history.extend((step, loss) for step, (loss, _) in zip(steps, values))
            self.norms.extend(norm for _, norm in values)
            self.pending = []

    def metrics(self, step: int, total: int, steps_per_epoch: int, loss_history: list, learning_rate: float) -> dict:
        """The figures of the window's steps (read first): mean loss and grad norm, throughput, ETA."""
        elapsed = time.monotonic() - self.started
        recent = [value for _, value in loss_history[-self.steps :]]
        norms = self.norms[-self.steps :]
        return {
            "step": step,
            "total_steps": total,
            "epoch": step / steps_per_epoch,
            "loss": sum(recent) / len(recent),
            "learning_rate": learning_rate,
            "tokens_per_second": self.tokens / elapsed if elapsed > 0 else 0.0,
            "grad_norm": sum(norms) / len(norms),
            "eta_seconds": elapsed / self.steps * (total - step),
        }
