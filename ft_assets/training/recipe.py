"""The training recipe: fine-tune a base model on packed shards, checkpointing to the object store.

``FineTuneRecipe`` holds one attempt's state and reads top to bottom in phases: setup (device,
data, model, optimizer) -> resume (newest complete checkpoint) -> train loop (step, checkpoint,
evaluate, log, honour SIGTERM) -> finish (final checkpoint, eval and save) -> cleanup; ``train``
runs them. Packed rows come from ``ft_assets.shards`` and the loss from ``ft_assets.training.loss``,
which the data and delivery planes share. No Dagster here: the ``lora_adapter`` asset calls
``train`` and turns ``Preempted`` into a retry.

The objective (``ft_assets.objectives``, chosen by the data plane and passed in) brings the part that
differs: its step (``ft_assets.training.steps``; GRPO's, with its rollouts, ``ft_assets.training.grpo``)
loads the rows and, for the run, gives each micro-batch's rollout, loss, what that loss is a mean over,
the eval figures and its own per-step figures. Everything else — data order, checkpoints, resume,
SIGTERM, DDP — is this one loop, so every objective has the same guarantees.

With ``mlflow_tracking_uri`` set, rank 0 logs the run to MLflow (``ft_assets.training.tracking``).

Workers are stateless and often spot instances, so the recipe assumes it can die at any step:

- Every ``save_steps`` steps it writes a checkpoint (trainable weights, optimizer, scheduler, every
  RNG, trainer state) to local disk and a background thread publishes it while training continues.
- On start it resumes from the newest complete, sha256-verified checkpoint of the run. Data order
  is a pure function of (seed, epoch) and step, and the RNG states are restored after setup, so a
  run killed at any step and resumed ends with the same weights as an uninterrupted one (exactly on
  CPU; on CUDA up to the usual non-determinism of its kernels).
- SIGTERM (the spot reclaim notice) sets a flag; at the next step boundary the worker checkpoints,
  waits for the upload and raises ``Preempted``. ``python -m ft_assets.training.worker`` exits with
  ``EXIT_PREEMPTED`` (75, EX_TEMPFAIL) then. After a SIGKILL at most ``save_steps`` steps are lost.

Packed rows carry several examples each; the forward keeps attention inside each example
(``ft_assets.training.loss``, the backend from ``ft_assets.training.model.resolve_attention``).

On a GPU the loop does not wait for it between steps: AdamW is fused, the learned-token count comes
from the host copy of the rows, and the losses are read at log lines only (``ft_assets.training.progress``).

Several processes: ``torchrun -m ft_assets.training.worker ...`` (``ft_assets.training.launch``, 1 or M nodes).
Without a GPU it forms a gloo group, as the recipe asks accelerate for ``cpu=True`` (accelerate's ``--cpu``
flag would start one process). ``parallelism`` (``ft_assets.training.parallelism``): DDP, rank 0 writes
checkpoints; FSDP2, every rank writes its shard and rank 0 commits once all are in the store. Only rank 0
logs; all ranks restore their own RNG. A run resumes on another number of processes with the same global
batch (``TrainingConfig.result_fields``): the same rows in the same steps; only dropout draws differ.

On CPU the recipe runs, slowly (tens of tokens/s for a 135M model: docs/validation/planner-calibration.md).
QLoRA dequantizes every weight on every forward, a fixed cost that batching amortizes.
"""

from __future__ import annotations

import shutil
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate.utils import broadcast_object_list, gather_object, set_seed

from ft_assets.objectives import Objective
from ft_assets.providers.ec2_metadata import SpotNoticeWatcher
from ft_assets.storage import ObjectStore
from ft_assets.training import loop
from ft_assets.training.base_model import TOKENIZER_FILES
from ft_assets.training.checkpoints import (
    BackgroundUploader,
    Checkpoint,
    TrainerState,
    capture_rng_state,
    check_resumable,
    delete_checkpoint,
    fetch_checkpoint,
    find_latest_checkpoint,
    restore_rng_state,
    write_checkpoint,
    write_sharded_checkpoint,
)
from ft_assets.training.config import TrainingConfig
from ft_assets.training.data_order import DataPlan
from ft_assets.training.loop import Log, OnMetrics, RecipeLoop
from ft_assets.training.model import experts_line, load_model, load_trainable, make_scheduler, trainable_parameters
from ft_assets.training.parallelism import (
    attempt_id,
    consolidated_state,
    for_config,
    load_shards,
    save_shards,
    start_processes,
)
from ft_assets.training.preemption import SigtermFlag
from ft_assets.training.progress import eval_line, progress_line
from ft_assets.training.result import TrainingResult
from ft_assets.training.tracking import Trackers


def _to_device(tensor: torch.Tensor | dict, device: torch.device) -> torch.Tensor | dict:
    """Host to device without waiting for the GPU: pinned memory and a non-blocking copy on CUDA (the tensors of a dict
    too: Gemma 3's masks by layer type)."""
    if isinstance(tensor, dict):
        return {name: _to_device(value, device) for name, value in tensor.items()}
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


# --- the recipe ------------------------------------------------------------------------------------


@dataclass(eq=False)
class FineTuneRecipe(RecipeLoop):
    """One attempt at a run, on this process: its state on one object, its phases in the order they run.

    ``train`` drives it: ``setup`` (processes, data, model, optimizer) -> ``resume`` (the newest
    complete checkpoint) -> ``train_loop`` (``train_step`` up to ``total_steps``, with logs,
    ``save_checkpoint`` and ``evaluate`` at step boundaries, ``stop_if_preempted`` before every step)
    -> ``finish`` (final checkpoint, eval and save) -> ``cleanup`` -> ``result``.
    """

    config: TrainingConfig
    base_model_dir: Path
    shards_dir: Path
    store: ObjectStore
    run_prefix: str
    work_dir: Path
    log: Log
    on_metrics: OnMetrics | None
    sigterm: SigtermFlag
    started: float  # time.monotonic() at the start of this attempt (or of the caller's downloads)
    tags: dict[str, str]  # for the tracker: dataset version and lineage digests, from the caller
    objective: Objective

    def __post_init__(self):
        self.step_seconds = 0.0  # this attempt, inside forward + backward + optimizer step
        self.last_saved: int | None = None  # step of the newest checkpoint resumed from or handed to the uploader
        self.eval_loss: float | None = None  # the final one; None without eval shards
        self.eval_metrics: dict = {}  # the final eval's figures
        self.tracker: Trackers | None = None
        self.output_dir = self.work_dir / "final"

    # --- setup ---

    def setup(self) -> None:
        """Processes and device, packed data, model, optimizer and scheduler, the checkpoint uploader, the tracker."""
        self._setup_processes()
        self._setup_data()
        self._setup_model()
        self.step_run = self.objective.step.for_run(self.config, self.base_model_dir, self.unwrapped)
        shards = self.world if self.parallel.name == "fsdp" else 1  # FSDP: every rank uploads its shard
        self.uploader = BackgroundUploader(
            self.store,
            self.run_prefix,
            keep=self.config.save_total_limit,
            log=self.say,
            shards=shards,
            rank=self.rank,
            attempt=self.attempt_id,
        )
        self._setup_tracking()

    def _setup_processes(self) -> None:
        config, cuda = self.config, torch.cuda.is_available()
        self.accelerator = accelerator = start_processes(config, self.work_dir / "trackers")
        self.rank, self.world = accelerator.process_index, accelerator.num_processes
        self.is_main = accelerator.is_main_process
        self.say: Log = self.log if self.is_main else (lambda line: None)
        self.device = accelerator.device
        self.parallel = for_config(config, self.world, self.device)
        self.attempt_id = attempt_id(self.world)
        self.method = config.resolved_method(cuda)
        if self.device.type == "cpu":
            self.say("WARNING: no CUDA or MPS device found, training on CPU (fine for tests, ~100x slower than a GPU)")
        self.say(f"training {self.method} on {self.device} x{self.world}, run {self.store.uri(self.run_prefix)}")
        if config.report_to:
            accelerator.init_trackers(self.run_prefix.replace("/", "-"), config=config.model_dump())

    def _setup_data(self) -> None:
        """The train and eval rows, as the objective's step loads them (packed chat rows, packed pairs)."""
        config, step = self.config, self.objective.step
        self.train_rows = step.load_rows(self.shards_dir, "train", config.max_seq_len)
        if self.train_rows is None:
            raise FileNotFoundError(
                f"{self.shards_dir} has no {self.objective.name} training shards ({self.objective.items}): materialize "
                "tokenized_shards first, or pass the objective the data plane recorded"
            )
        self.eval_rows = step.load_rows(self.shards_dir, "eval", config.max_seq_len)
        self.plan = DataPlan(len(self.train_rows), config, self.world)
        try:
            self.resolved = config.resolve(len(self.train_rows), torch.cuda.is_available(), self.objective, self.world)
        except ValueError as exc:
            raise ValueError(f"{self.shards_dir}: {exc}") from exc
        self.total_steps = self.resolved.total_steps
        pairs = step.describe_rows(self.train_rows, config)
        self.say(
            f"{len(self.train_rows)} train rows x {self.train_rows.seq_len} tokens{pairs}, "
            f"{len(self.eval_rows) if self.eval_rows else 0} eval rows; {self.resolved.describe()}"
        )

    def _setup_model(self) -> None:
        """Model, optimizer and scheduler, seeded so that a fresh run is reproducible."""
        config = self.config
        set_seed(config.seed)
        model = load_model(config, self.method, self.base_model_dir, self.device)
        self.attention = model.config._attn_implementation
        self.model = self.parallel.wrap(model, self.accelerator)
        self.unwrapped = self.accelerator.unwrap_model(self.model)
        if config.compile:
            self.model.compile()  # in place: parameter names (and so checkpoints) stay the same
        self.params = trainable_parameters(self.unwrapped)
        self.say(
            f"{sum(p.numel() for p in self.params.values()):,} trainable parameters, attention {self.attention}"
            f"{experts_line(model.config)}"
            f"{', torch.compile' if config.compile else ''}{', sharded with FSDP2' if self.parallel.name == 'fsdp' and self.world > 1 else ''}"
        )
        self.optimizer = torch.optim.AdamW(
            self.params.values(),
            lr=self.resolved.learning_rate,
            weight_decay=config.weight_decay,
            fused=True if self.device.type == "cuda" else None,  # one kernel for all parameters; CPU: foreach
        )
        self.scheduler = make_scheduler(config, self.optimizer, self.resolved)

    def _setup_tracking(self) -> None:
        """Rank 0 only: the MLflow and W&B runs of this training run (resumed attempts continue them), when configured."""
        config = self.config
        if not (self.is_main and (config.mlflow_tracking_uri or config.wandb.enabled)):
            return
        run_id = self.run_prefix.rsplit("/", 1)[-1]
        params = {**config.result_fields(torch.cuda.is_available(), self.objective), **self.resolved.as_dict()}
        tags = {**self.tags, "ft.run_id": run_id, "ft.run_prefix": self.run_prefix, "ft.objective": self.objective.name,
                "ft.method": self.method}  # fmt: skip
        self.tracker = Trackers.start(config, run_id, params, tags, self.log)

    # --- resume ---

    def resume(self) -> None:
        """Continue from the newest complete checkpoint of the run, or start at step 0 from the base model.

        Rank 0 finds the checkpoint (newer, unusable ones are skipped, then deleted); the other ranks
        fetch the same step. The RNG states are restored last: setup (model load, LoRA init) draws from them.
        """
        resume_dir = self.work_dir / "resume" / f"rank-{self.rank}"
        checkpoint: Checkpoint | None = None
        skipped: list[int] = []
        if self.is_main:
            checkpoint, skipped = find_latest_checkpoint(self.store, self.run_prefix, resume_dir, self.log)
        resume_step = [checkpoint.step if checkpoint else None]
        if self.world > 1:
            broadcast_object_list(resume_step)
            if not self.is_main and resume_step[0] is not None:
                checkpoint = fetch_checkpoint(self.store, self.run_prefix, resume_step[0], resume_dir)
        self.state = TrainerState(total_steps=self.total_steps, world_size=self.world, method=self.method)
        rng_state = None
        if checkpoint is not None:
            rng_state = self.load_checkpoint(checkpoint)
        else:
            self.say(f"no complete checkpoint under {self.store.uri(self.run_prefix)}: starting from the base model")
        shutil.rmtree(resume_dir, ignore_errors=True)
        if self.is_main:
            for step in skipped:  # newer than the resume point and unusable: they will be rewritten
                delete_checkpoint(self.store, self.run_prefix, step)
        self.begin_attempt(checkpoint)
        if rng_state is not None:
            restore_rng_state(rng_state)

    def load_checkpoint(self, checkpoint: Checkpoint) -> dict:
        """Trainer state, weights, optimizer and scheduler from ``checkpoint``; returns this rank's RNG state to restore.

        A checkpoint of another number of processes continues the run when the global batch is the same (DDP
        checkpoints hold everything; FSDP ones are resharded by torch.distributed.checkpoint).
        """
        self.state = checkpoint.trainer_state()
        self.state.total_steps = self.total_steps
        check_resumable(checkpoint, self.parallel.name, self.plan.rows_per_step)
        if checkpoint.sharded_dir is not None:
            load_shards(self.model, self.optimizer, set(self.params), checkpoint.sharded_dir)
        else:
            load_trainable(self.unwrapped, checkpoint.weights(), checkpoint.uri)
            self.optimizer.load_state_dict(checkpoint.optimizer_state())
        self.scheduler.load_state_dict(checkpoint.scheduler_state())
        rng_states = checkpoint.rng_states()
        written_by = f"; written by {len(rng_states)} process(es), resumed on {self.world}"
        written_by = written_by if len(rng_states) != self.world else ""
        self.say(f"resuming from {checkpoint.uri} (step {checkpoint.step}/{self.total_steps}){written_by}")
        self.state.world_size = self.world
        return rng_states[self.rank % len(rng_states)]  # on another world size, dropout draws differ from here on

    # --- train loop ---

    def stop_requested(self) -> bool:
        """SIGTERM on any process: a collective under DDP (and a host sync per step), so all stop at the same step."""
        stop = self.sigterm.requested
        if self.world > 1:
            stop = self.accelerator.reduce(torch.tensor([float(stop)], device=self.device), "sum").item() > 0
        return stop

    def barrier(self) -> None:
        self.accelerator.wait_for_everyone()

    def train_step(self) -> None:
        """One optimizer step over this rank's micro-batches of step ``state.step``, then the step's bookkeeping.

        No host sync on CUDA except at logging and checkpoint steps: the learned-token count comes from the
        rows on the host, and the step's loss stays on the device (``window``) until ``read_losses`` copies
        the losses since the last read into the loss history in one transfer.
        """
        accelerator, device, world = self.accelerator, self.device, self.world
        step_started = time.monotonic()
        rows = [
            self.train_rows.batch(i, torch.device("cpu")) for i in self.plan.micro_batches(self.state.step, self.rank)
        ]
        # What the loss needs beyond the rows, from the model as it is before this step's update (GRPO: the completions,
        # sampled with a seed of where the micro-batch is, so that a resumed run samples the same ones).
        rows = [
            self.step_run.rollout(self.unwrapped, batch, self.state.step, self.rank, micro)
            for micro, batch in enumerate(rows)
        ]
        # Normalise by the learned tokens (DPO: the pairs) of the whole step (all micro-batches, all processes):
        # the loss is then the true per-token (per-pair) mean, whatever the packing put in each row.
        items = sum(self.count(b) for b in rows)
        if world > 1:
            items = accelerator.reduce(torch.tensor([items], device=device), "sum")[0].clamp(min=1)
        else:
            items = max(items, 1)
        step_loss = torch.zeros((), device=device)
        for micro, host_batch in enumerate(rows):
            batch = {name: _to_device(value, device) for name, value in host_batch.items()}
            last = micro == len(rows) - 1
            with accelerator.no_sync(self.model) if not last else nullcontext():
                loss_sum = self.loss_sum(batch)
                # DDP averages gradients over processes; scale back up to a sum over all tokens.
                accelerator.backward(loss_sum * (world / items))
            step_loss += loss_sum.detach().float() / items
        # The norm before clipping, for the logs; max_grad_norm 0 measures it without clipping (scaled by 1.0).
        grad_norm = self.parallel.clip_grad_norm(
            accelerator, list(self.params.values()), self.config.max_grad_norm or float("inf")
        )
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

        state = self.state
        state.step += 1
        state.epoch = state.step // self.plan.steps_per_epoch
        state.samples_seen += self.plan.rows_per_step
        # packed rows: rows x seq_len; GRPO: what was generated too
        tokens = sum(batch["input_ids"].numel() for batch in rows) * world
        state.tokens_seen += tokens
        self.window.add(state.step, accelerator.reduce(step_loss, "sum") if world > 1 else step_loss, grad_norm, tokens)
        step, config = state.step, self.config
        if step % config.logging_steps == 0 or step % config.save_steps == 0 or step == self.total_steps:
            self.read_losses()  # inside the timed step: on CUDA this is where the queued work finishes
        self.step_seconds += time.monotonic() - step_started

    def count(self, batch: dict[str, torch.Tensor]) -> int:
        """What the step's loss is a mean over (the objective's): learned tokens, pairs."""
        return self.step_run.count(batch)

    def loss_sum(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The objective's summed loss of a micro-batch (DPO's reference: the base with the adapter disabled)."""
        return self.step_run.loss_sum(self.model, self.unwrapped, batch, self.config)

    def log_progress(self) -> None:
        """Log and report the mean loss, learning rate, throughput and ETA of the steps since the last log line."""
        state, lr = self.state, self.scheduler.get_last_lr()[0]
        metrics = self.window.metrics(state.step, self.total_steps, self.plan.steps_per_epoch, state.loss_history, lr)
        figures = self.step_figures()
        metrics.update(figures)
        self.say(progress_line(metrics, figures))
        self.report(metrics)
        self.uploader.drain_log()
        self.window.restart()

    def step_figures(self) -> dict[str, float]:
        """The objective's own figures since the last log line (GRPO: reward mean and std, KL, completion length),
        averaged over the processes, and kept in the trainer state (checkpointed) for the adapter's metadata."""
        figures = self.step_run.figures(self.mean)
        if figures:
            self.state.figure_history.append((self.state.step, figures))
        return figures

    def mean(self, values: list[float]) -> list[float]:
        """``values`` averaged over the processes (a collective when there are several)."""
        if self.world == 1 or not values:
            return values
        return self.accelerator.reduce(torch.tensor(values, device=self.device), "mean").tolist()

    def report(self, metrics: dict) -> None:
        if self.is_main and self.on_metrics is not None:
            self.on_metrics(metrics)
        if self.config.report_to:
            self.accelerator.log(metrics, step=metrics["step"])
        if self.tracker is not None:  # rank 0 only
            self.tracker.log_metrics(metrics, step=metrics["step"])

    # --- checkpoint and eval ---

    def save_checkpoint(self) -> None:
        """All processes: gather RNG states; rank 0 (DDP) or every rank (FSDP, its shard): write locally and
        hand to the uploader."""
        self.read_losses()
        rng_states = gather_object([capture_rng_state()]) if self.world > 1 else [capture_rng_state()]
        state = self.state
        if self.is_main:
            self.attempt.update(
                last_checkpoint_step=state.step,
                wall_seconds=round(time.monotonic() - self.started, 3),
                step_seconds=round(self.step_seconds, 3),
            )
        meta = {"step": state.step, "method": self.method, "parallelism": self.parallel.name, "world_size": self.world}
        name = f"checkpoint-{state.step:08d}"
        if self.parallel.name == "fsdp":  # collective: every rank writes its shard, rank 0 the run state too
            run_state = (self.scheduler.state_dict(), rng_states, state) if self.is_main else None
            local = write_sharded_checkpoint(self.work_dir / "checkpoints" / f"rank-{self.rank}" / name,
                                             lambda folder: save_shards(self.model, self.optimizer, set(self.params), folder), run_state)  # fmt: skip
            self.uploader.submit(local, state.step, meta=meta)
        elif self.is_main:
            local = write_checkpoint(self.work_dir / "checkpoints" / name, dict(self.params), self.optimizer.state_dict(),
                                     self.scheduler.state_dict(), rng_states, state)  # fmt: skip
            self.uploader.submit(local, state.step, meta=meta)
        self.last_saved = state.step

    def evaluate(self) -> dict[str, float]:
        """The objective's eval figures over every eval row (``eval_loss`` first), each process taking every
        world_size-th row, summed over the processes."""

        def reduce(values: list[float]) -> torch.Tensor:
            return self.accelerator.reduce(torch.tensor(values, device=self.device), "sum")

        if self.parallel.lockstep_eval:  # FSDP: every forward gathers weights from all ranks, so each runs every row
            return self.step_run.evaluate(self.unwrapped, self.eval_rows, self.config, self.device, 0, 1, torch.tensor)
        return self.step_run.evaluate(
            self.unwrapped, self.eval_rows, self.config, self.device, self.rank, self.world, reduce
        )

    # --- finish ---

    def finish(self) -> None:
        """The final checkpoint, eval and weights (rank 0 saves them with the tokenizer files)."""
        if self.last_saved != self.state.step:
            self.save_checkpoint()  # a rerun after a crash from here on skips straight to the export
        if self.eval_rows is not None:
            self.eval_metrics = self.evaluate()
            self.eval_loss = self.eval_metrics.get("eval_loss")
            self.say(f"final {eval_line(self.eval_metrics)} on {len(self.eval_rows)} rows")
            self.report({"step": self.state.step, **self.eval_metrics})
        weights = None  # save_pretrained reads the model, unless it is sharded: then rank 0 gets the gathered weights
        if self.parallel.name == "fsdp" and self.world > 1:
            weights = consolidated_state(self.model, None if self.method == "full" else set(self.params))
        if self.is_main:
            shutil.rmtree(self.output_dir, ignore_errors=True)
            self.unwrapped.save_pretrained(self.output_dir, safe_serialization=True, state_dict=weights)
            for name in TOKENIZER_FILES:
                if (self.base_model_dir / name).is_file():
                    shutil.copyfile(self.base_model_dir / name, self.output_dir / name)
        self.uploader.close()
        self.accelerator.wait_for_everyone()

    def end_backend_tracking(self) -> None:
        if self.config.report_to:
            self.accelerator.end_training()

    @staticmethod
    def watch(log: Log) -> SpotNoticeWatcher:
        return SpotNoticeWatcher(log=log)  # on an EC2 spot worker: the reclaim notice becomes a SIGTERM

    def release(self) -> None:
        self.accelerator.free_memory()  # drop accelerate's references to the model, run gc, empty the CUDA cache

    @property
    def device_label(self) -> str:
        return f"{self.device.type} x{self.world}"


def train(config: TrainingConfig, *args, **kwargs) -> TrainingResult:
    """Train (or resume) the run at ``run_prefix`` with torch and return the final weights and figures
    (``loop.train``: the arguments after ``config``)."""
    return loop.train(FineTuneRecipe, config, *args, **kwargs)
