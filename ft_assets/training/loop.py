"""The training loop both backends run: torch's ``recipe.FineTuneRecipe`` and MLX's ``mlx_recipe.MlxRecipe``.

``run`` drives a recipe through its phases: ``setup`` -> ``resume`` -> ``train_loop`` -> ``finish``, then
``cleanup`` whatever happened, and its ``result``. ``RecipeLoop`` holds what the two recipes share, so that a fix
reaches both: the loop over steps (logs, checkpoints and evals at step boundaries), the check for a SIGTERM before
every step (checkpoint, wait for the upload, raise ``Preempted``), the start of an attempt after the resume, the
closing ``TrainingResult`` and the cleanup. Each recipe brings its own ``setup``, ``resume`` (what a checkpoint
holds differs), ``train_step``, ``log_progress``, ``save_checkpoint``, ``evaluate``, ``finish`` and ``report``, and
may override the hooks: ``say`` (the log of the process that speaks), ``stop_requested`` (a collective over several
processes), ``barrier``, ``end_backend_tracking``, ``release`` and ``device_label``.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

from ft_assets import layout
from ft_assets.objectives import SFT, Objective
from ft_assets.storage import ObjectStore
from ft_assets.training.checkpoints import Checkpoint, complete_checkpoints
from ft_assets.training.config import TrainingConfig, experts_of
from ft_assets.training.preemption import Preempted, SigtermFlag
from ft_assets.training.progress import Window, duration, eval_line
from ft_assets.training.result import TrainingResult

Log = Callable[[str], None]
OnMetrics = Callable[[dict], None]


class RecipeLoop:
    """The phases both recipes share (see the module); the attributes it reads are set by the recipe's own phases."""

    attention = "unknown"  # the attention implementation the result names (a recipe sets its own)

    # --- hooks ---

    def say(self, line: str) -> None:
        self.log(line)

    def stop_requested(self) -> bool:
        return self.sigterm.requested

    def barrier(self) -> None:
        """Wait for the other processes of the run (none on one process)."""

    def end_backend_tracking(self) -> None:
        """End a tracker of the backend's own (accelerate's), before ft-assets' trackers end."""

    def release(self) -> None:
        """Free the backend's memory once the attempt is over."""

    @staticmethod
    def watch(log: Log) -> AbstractContextManager:
        """What watches the machine while the recipe runs (torch: EC2's spot notice, turned into a SIGTERM)."""
        return nullcontext()

    @property
    def device_label(self) -> str:
        return f"{self.device} x1"

    # --- the shared phases ---

    def begin_attempt(self, checkpoint: Checkpoint | None) -> None:
        """After the resume (``checkpoint`` or the base model): this attempt's record in the trainer state, the figures
        it counts from, and a fresh window of steps."""
        self.resumed_from = checkpoint.step if checkpoint else None
        self.tokens_at_start = self.state.tokens_seen
        self.last_saved = self.state.step if checkpoint else None
        self.state.attempts.append({"resumed_from_step": self.resumed_from, "last_checkpoint_step": None})
        self.attempt = self.state.attempts[-1]
        self.window = Window()  # the steps since the last log line, their losses queued on the device

    def train_loop(self) -> None:
        """Optimizer steps up to ``total_steps``; at every step boundary: SIGTERM, logs, checkpoints, evals."""
        config, total = self.config, self.total_steps
        self.model.train()
        self.window.restart()
        while True:
            self.stop_if_preempted()
            if self.state.step >= total:
                return
            self.train_step()
            step = self.state.step
            if step % config.logging_steps == 0 or step == total:
                self.log_progress()
            if step % config.save_steps == 0 and step < total:
                self.save_checkpoint()
            if config.eval_steps and self.eval_rows and step % config.eval_steps == 0 and step < total:
                metrics = self.evaluate()
                self.state.eval_history.append((step, next(iter(metrics.values()))))  # the headline (GRPO: reward)
                self.say(f"step {step}/{total}  {eval_line(metrics)}")
                self.report({"step": step, **metrics})

    def stop_if_preempted(self) -> None:
        """After SIGTERM (on any process): checkpoint this step unless saved, wait for the upload, raise ``Preempted``.
        Every process calls it at every step boundary, so all of them stop at the same step."""
        if not self.stop_requested():
            return
        self.say(f"SIGTERM received: checkpointing step {self.state.step} and stopping")
        if self.state.step > 0 and self.last_saved != self.state.step:
            self.save_checkpoint()
        self.uploader.wait()
        self.barrier()
        uri = (
            self.store.uri(layout.checkpoint(self.run_prefix, self.last_saved)) if self.last_saved is not None else None
        )
        raise Preempted(self.state.step, uri)

    def read_losses(self) -> None:
        """Append the losses of the steps since the last read to the loss history (one device-to-host copy)."""
        self.window.read(self.state.loss_history)

    def cleanup(self, failed: bool) -> None:
        """End the trackers and free the backend's memory; after a failure, first let a checkpoint in flight land."""
        if failed:
            try:  # the original error is what matters
                self.uploader.wait()
            except Exception as exc:  # noqa: BLE001
                self.log(f"WARNING: checkpoint upload also failed: {exc}")
        self.end_backend_tracking()
        if self.tracker is not None:
            self.tracker.finish(failed)
        self.release()

    def result(self) -> TrainingResult:
        """This attempt's figures, with wall time up to now; logs the closing line."""
        wall = time.monotonic() - self.started
        state = self.state
        self.read_losses()
        trained = state.tokens_seen - self.tokens_at_start  # this attempt
        recent = [value for _, value in state.loss_history[-self.config.logging_steps :]]
        result = TrainingResult(
            output_dir=self.output_dir,
            method=self.method,
            objective=self.objective.name,
            device=self.device_label,
            steps=state.step,
            train_loss=sum(recent) / len(recent) if recent else None,
            eval_loss=self.eval_loss,
            eval_metrics=self.eval_metrics,
            figure_history=list(state.figure_history),
            tokens_seen=state.tokens_seen,
            wall_seconds=wall,
            step_seconds=self.step_seconds,
            effective_training_fraction=self.step_seconds / wall if wall > 0 else 0.0,
            resumed_from_step=self.resumed_from,
            checkpoints=complete_checkpoints(self.store, self.run_prefix),
            loss_history=list(state.loss_history),
            eval_history=list(state.eval_history),
            restarts=state.attempts[:-1],
            bytes_uploaded=self.uploader.bytes_uploaded,
            resolved=self.resolved.as_dict(),
            attn_implementation=self.attention,
            tokens_per_second=trained / self.step_seconds if self.step_seconds > 0 else 0.0,
            mlflow_run_id=self.tracker.mlflow_run_id if self.tracker is not None else None,
            wandb_run_id=self.tracker.wandb_run_id if self.tracker is not None else None,
        )
        named = (("train", result.train_loss), ("eval", self.eval_loss))
        losses = ", ".join(f"{name} loss {value:.4f}" for name, value in named if value is not None)
        self.say(
            f"done: {result.steps} steps, {losses}, {duration(wall)} wall, "
            f"{result.effective_training_fraction:.0%} of it in training steps"
        )
        return result


def train(
    recipe_class: type,
    config: TrainingConfig,
    base_model_dir: Path,
    shards_dir: Path,
    store: ObjectStore,
    run_prefix: str,
    work_dir: Path,
    log: Log = print,
    on_metrics: OnMetrics | None = None,
    started_at: float | None = None,
    tags: dict[str, str] | None = None,
    objective: Objective = SFT,
) -> TrainingResult:
    """Train (or resume) the run at ``run_prefix`` with a recipe of ``recipe_class``; its final weights and figures.

    ``started_at`` is a ``time.monotonic()`` value from before the caller's downloads, so that wall time covers them;
    default now. ``tags`` go to the MLflow run (dataset version, lineage digests). ``objective`` is the one the data
    plane recorded for the shards (``tokenized_shards``' stats).
    """
    started = time.monotonic() if started_at is None else started_at
    config = config.for_base(experts_of(json.loads((Path(base_model_dir) / "config.json").read_text())))
    # The SIGTERM handler goes in first: a spot notice during a long model load still ends in Preempted.
    with SigtermFlag() as sigterm, recipe_class.watch(log):
        recipe = recipe_class(config, Path(base_model_dir), Path(shards_dir), store, run_prefix, Path(work_dir), log,
                              on_metrics, sigterm, started, tags or {}, objective)  # fmt: skip
        return run(recipe)


def run(recipe: Any) -> TrainingResult:
    """``recipe``'s phases in order (see the module); its result, or the error of the phase that failed."""
    recipe.setup()
    recipe.resume()
    try:
        recipe.train_loop()
        recipe.finish()
    finally:
        recipe.cleanup(failed=sys.exc_info()[0] is not None)
    return recipe.result()
