"""The MLX training recipe (``backend: mlx``): the same run as ``recipe.py``, on Apple silicon through mlx-lm.

``MlxRecipe`` reads like ``FineTuneRecipe``: setup (rows, model, optimizer) -> resume (newest complete
checkpoint) -> train loop (step, checkpoint, evaluate, log, honour SIGTERM) -> finish (final checkpoint, eval,
the adapter) -> cleanup; ``train`` runs them and returns the same ``TrainingResult``, so ``lora_adapter``,
its metadata, the tracker and the delivery plane see one kind of run whichever backend trained it.

What is shared with the torch recipe, unchanged: the rows (the data plane's packed shards, read by
``shards.load_packed_rows``: no second tokenization), their order (``DataPlan``: a pure function of seed,
epoch and step), the settings and what they resolve to (``TrainingConfig.resolve``), the checkpoints' place,
manifest rule, background upload, pruning and the newest-complete lookup (``checkpoints.py``), SIGTERM ->
checkpoint -> ``Preempted``, the log lines (``progress.py``), the tracker and the figures (loss curve,
tokens/s of step time, wall time, effective-training fraction).

What differs, and why:

- **Packed rows are unpacked.** mlx-lm's models take no position ids (RoPE starts at the cache offset) and
  build their own causal mask, so a packed row cannot keep its examples apart. Each row is split where its
  position ids restart (``examples``), every example runs as its own sequence, right-padded to the longest
  of its forward (``padded``), and the loss is the same sum over the same learned tokens divided by the same
  count: the torch recipe's packed-row loss equals its examples' losses one by one (``test_families.py``).
  The price is padding inside a forward: examples are sorted by length and grouped under a budget of
  ``per_device_batch_size x seq_len`` padded tokens, so a forward is never larger than a packed one.
  ``tokens_seen`` counts the packed tokens, as the torch recipe does, so tokens/s compare.
- **Dropout draws are seeded per step** (``mx.random.seed`` of (seed, step)): MLX's random state cannot be set
  back, and so nothing about the RNG needs saving: a run killed at any step and resumed draws what an
  uninterrupted one draws, and ends with the same adapter (``test_mlx.py``).
- **A checkpoint** holds mlx-lm's adapter (``adapters.safetensors`` + ``adapter_config.json``, what
  ``mlx_lm generate --adapter-path`` reads) or, for ``full``, the model's weights (``model.safetensors``),
  AdamW's state (``optimizer.safetensors``: moments, step) and ``trainer_state.json``. The learning rate is a
  function of the step (``learning_rate_at``, the torch recipe's schedules), not state.
- **The finished adapter is a PEFT adapter** (``mlx_peft.convert``: transposed, ``scale`` -> ``lora_alpha``,
  PEFT's module names), so merge, GGUF, vLLM, eval and signing read it unchanged; mlx-lm's own files are kept
  beside it in ``mlx/``. A full fine-tune is written as a transformers model folder (mlx-lm's names are
  transformers', checked against the base's tensors).
- **SFT only**: DPO and GRPO are refused in one line (``backends.refusal``, said by the plan too) rather than run
  on a second implementation of their losses, and so are several processes. ``qlora`` is mlx-lm's QLoRA: LoRA over
  the base quantized to mlx's affine 4-bit (groups of 64, 4.5 bits a weight with its scale and bias) where the
  torch backend uses bitsandbytes' NF4; either way the adapter is merged into the full-precision base.
- ``gradient_checkpointing`` is mlx-lm's (``grad_checkpoint``: the decoder layer's class recomputes its forward in
  backward, for every model of that class in the process; the same math, and refused with ``lora_dropout`` > 0, whose
  masks mlx would draw anew in the recompute), and the loss holds every forward's logits (tokens x vocabulary x 4 bytes, as mlx-lm's own trainer does): on a
  128k vocabulary that is 0.5 MB a token, so a Mac trains long rows at a smaller ``per_device_batch_size``.

On Linux, mlx's CPU build runs the same code (what the tests use); on a Mac it runs on the GPU through Metal,
unchanged.
"""

from __future__ import annotations

import math
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from ft_assets import layout
from ft_assets.objectives import Objective
from ft_assets.shards import IGNORE_INDEX, load_packed_rows
from ft_assets.storage import ObjectStore
from ft_assets.training import backends, loop, mlx_peft
from ft_assets.training import mlx_model as mm
from ft_assets.training.base_model import TOKENIZER_FILES
from ft_assets.training.checkpoints import (
    BackgroundUploader,
    Checkpoint,
    TrainerState,
    check_resumable,
    delete_checkpoint,
    find_latest_checkpoint,
    write_fresh,
)
from ft_assets.training.config import ResolvedTraining, TrainingConfig
from ft_assets.training.data_order import DataPlan
from ft_assets.training.loop import Log, OnMetrics, RecipeLoop
from ft_assets.training.preemption import SigtermFlag
from ft_assets.training.progress import eval_line, progress_line
from ft_assets.training.result import TrainingResult
from ft_assets.training.tracking import Trackers

OPTIMIZER = "optimizer.safetensors"
FULL_WEIGHTS = "model.safetensors"
MLX_DIR = "mlx"  # mlx-lm's own adapter files, beside the PEFT ones in the final folder
BACKEND_FILES = ("config.json", "generation_config.json")  # copied from the base with a full fine-tune's weights
STEP_SEED = 1_000_003  # dropout seed of step s: seed * STEP_SEED + s (distinct per run seed and step)


def learning_rate_at(config: TrainingConfig, resolved: ResolvedTraining, step: int) -> float:
    """The learning rate of optimizer step ``step`` (0-based): transformers' ``get_scheduler`` schedules, as the
    torch recipe runs them (linear warmup from 0, then cosine to 0, linear to 0, or constant)."""
    warmup, total = resolved.warmup_steps, resolved.total_steps
    if step < warmup:
        factor = step / max(1, warmup)
    elif config.lr_scheduler == "constant":
        factor = 1.0
    else:
        progress = (step - warmup) / max(1, total - warmup)
        if config.lr_scheduler == "linear":
            factor = max(0.0, (total - step) / max(1, total - warmup))
        else:
            factor = max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
    return resolved.learning_rate * factor


def examples(labels: np.ndarray, position_ids: np.ndarray) -> list[tuple[int, int]]:
    """The (start, end) of each example of a packed row that has a learned token: where position ids restart."""
    starts = np.flatnonzero(position_ids == 0).tolist() + [len(position_ids)]
    return [(s, e) for s, e in zip(starts, starts[1:]) if (labels[s + 1 : e] != IGNORE_INDEX).any()]


def padded(
    input_ids: np.ndarray, labels: np.ndarray, position_ids: np.ndarray, budget: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """The examples of packed rows as right-padded forwards of at most ``budget`` padded tokens each: (inputs,
    targets), targets[i, t] the label predicted at position t (IGNORE_INDEX where nothing is learned)."""
    spans = [(row, s, e) for row in range(len(input_ids)) for s, e in examples(labels[row], position_ids[row])]
    spans.sort(key=lambda span: span[2] - span[1], reverse=True)
    groups: list[list[tuple[int, int, int]]] = []
    for span in spans:
        if groups and (len(groups[-1]) + 1) * (groups[-1][0][2] - groups[-1][0][1]) <= budget:
            groups[-1].append(span)
        else:
            groups.append([span])
    forwards = []
    for group in groups:
        width = group[0][2] - group[0][1]
        inputs = np.zeros((len(group), width), dtype=np.int32)
        targets = np.full((len(group), width), IGNORE_INDEX, dtype=np.int32)
        for i, (row, s, e) in enumerate(group):
            inputs[i, : e - s] = input_ids[row, s:e]
            targets[i, : e - s - 1] = labels[row, s + 1 : e]
        forwards.append((inputs, targets))
    return forwards


def loss_sum(model, inputs, targets):
    """Cross-entropy summed over the learned targets of one padded forward (float32)."""
    import mlx.core as mx
    import mlx.nn as nn

    logits = model(inputs).astype(mx.float32)
    mask = targets != IGNORE_INDEX
    losses = nn.losses.cross_entropy(logits, mx.where(mask, targets, 0), reduction="none")
    return (losses * mask).sum()


class MlxRecipe(RecipeLoop):
    """One attempt at a run on MLX: its state on one object, its phases in the order they run (see the module)."""

    attention = "mlx"

    def __init__(
        self,
        config: TrainingConfig,
        base_model_dir: Path,
        shards_dir: Path,
        store: ObjectStore,
        run_prefix: str,
        work_dir: Path,
        log: Log,
        on_metrics: OnMetrics | None,
        sigterm: SigtermFlag,
        started: float,
        tags: dict[str, str],
        objective: Objective,
    ):
        self.config, self.objective = config, objective
        self.base_model_dir, self.shards_dir, self.work_dir = Path(base_model_dir), Path(shards_dir), Path(work_dir)
        self.store, self.run_prefix = store, run_prefix
        self.log, self.on_metrics, self.sigterm, self.started, self.tags = log, on_metrics, sigterm, started, tags
        self.step_seconds = 0.0
        self.last_saved: int | None = None
        self.eval_loss: float | None = None
        self.eval_metrics: dict = {}
        self.tracker: Trackers | None = None
        self.output_dir = self.work_dir / "final"

    # --- setup ---

    def setup(self) -> None:
        import mlx.core as mx

        config = self.config
        self.method = config.resolved_method(False)
        backends.require_mlx()
        if config.resolved_backend(False, self.objective) != "mlx":  # a refusal (DPO, qlora, ...) is raised there
            raise ValueError(
                f"backend {config.backend!r} resolves to torch here: train with recipe.train, or set backend: mlx"
            )
        self.device = f"mlx-{'gpu' if mx.default_device() == mx.gpu else 'cpu'}"
        self._setup_data()
        self._setup_model()
        self.uploader = BackgroundUploader(self.store, self.run_prefix, keep=config.save_total_limit, log=self.log)
        self._setup_tracking()

    def _setup_data(self) -> None:
        config = self.config
        rows = load_packed_rows(self.shards_dir, "train", config.max_seq_len)
        if rows is None:
            raise FileNotFoundError(
                f"{self.shards_dir} has no sft training shards (packed chat rows): materialize tokenized_shards first"
            )
        self.train_rows = tuple(t.numpy() for t in (rows.input_ids, rows.labels, rows.position_ids))
        eval_rows = load_packed_rows(self.shards_dir, "eval", config.max_seq_len)
        self.eval_rows = (
            tuple(t.numpy() for t in (eval_rows.input_ids, eval_rows.labels, eval_rows.position_ids))
            if eval_rows
            else None
        )
        self.seq_len = rows.seq_len
        self.budget = config.per_device_batch_size * self.seq_len  # padded tokens of one forward at most
        self.plan = DataPlan(len(rows), config, 1)
        try:
            self.resolved = config.resolve(len(rows), False, self.objective, 1)
        except ValueError as exc:
            raise ValueError(f"{self.shards_dir}: {exc}") from exc
        self.total_steps = self.resolved.total_steps
        self.log(f"training {self.method} on {self.device} x1 (mlx-lm), run {self.store.uri(self.run_prefix)}")
        self.log(
            f"{len(rows)} train rows x {self.seq_len} tokens, {len(eval_rows) if eval_rows else 0} eval rows; "
            f"{self.resolved.describe()}"
        )

    def _setup_model(self) -> None:
        import mlx.core as mx
        import mlx.nn as nn
        import mlx.optimizers as optim
        from mlx.utils import tree_flatten

        config = self.config
        mx.random.seed(config.seed)  # the LoRA A matrices' init
        self.model = mm.load_base(self.base_model_dir, self.seq_len)
        if self.method == "qlora":  # mlx-lm's QLoRA: LoRA over the base quantized to mlx's affine 4-bit
            mm.quantize_base(self.model)
        self.lora = None
        if self.method == "full":
            self.model.unfreeze()
        else:
            keys = mm.lora_keys(self.model, config.target_modules)
            self.lora = mm.lora_parameters(config.lora_r, config.lora_alpha, config.lora_dropout, keys)
            mm.add_lora(self.model, self.lora)
        trainable = sum(v.size for _, v in tree_flatten(self.model.trainable_parameters()))
        self.log(f"{trainable:,} trainable parameters, attention mlx-lm sdpa (examples unpacked, causal)")
        if config.gradient_checkpointing:  # mlx-lm's: the decoder layer's class recomputes its forward in backward
            from mlx_lm.tuner.trainer import grad_checkpoint

            if self.lora and config.lora_dropout > 0:
                raise ValueError(
                    f"backend mlx: gradient_checkpointing recomputes the forward in backward with new dropout draws, "
                    f"so lora_dropout {config.lora_dropout:g} would train on mismatched gradients: set lora_dropout: 0, "
                    "or gradient_checkpointing: false"
                )

            grad_checkpoint(self.model.layers[0])
        self.optimizer = optim.AdamW(
            learning_rate=self.resolved.learning_rate, weight_decay=config.weight_decay, bias_correction=True
        )  # torch's AdamW: betas (0.9, 0.999), eps 1e-8, bias-corrected moments
        self.optimizer.init(self.model.trainable_parameters())
        self.loss_and_grad = nn.value_and_grad(self.model, loss_sum)

    def _setup_tracking(self) -> None:
        """The MLflow and W&B runs of this training run, as the torch recipe opens them (the backend in a tag)."""
        config = self.config
        if not (config.mlflow_tracking_uri or config.wandb.enabled):
            return
        run_id = self.run_prefix.rsplit("/", 1)[-1]
        params = {**config.result_fields(False, self.objective), **self.resolved.as_dict()}
        tags = {**self.tags, "ft.run_id": run_id, "ft.run_prefix": self.run_prefix, "ft.objective": self.objective.name,
                "ft.method": self.method, "ft.backend": "mlx"}  # fmt: skip
        self.tracker = Trackers.start(config, run_id, params, tags, self.log)

    # --- resume ---

    def resume(self) -> None:
        resume_dir = self.work_dir / "resume"
        checkpoint, skipped = find_latest_checkpoint(self.store, self.run_prefix, resume_dir, self.log)
        self.state = TrainerState(total_steps=self.total_steps, world_size=1, method=self.method)
        if checkpoint is not None:
            self.load_checkpoint(checkpoint)
        else:
            self.log(f"no complete checkpoint under {self.store.uri(self.run_prefix)}: starting from the base model")
        shutil.rmtree(resume_dir, ignore_errors=True)
        for step in skipped:
            delete_checkpoint(self.store, self.run_prefix, step)
        self.begin_attempt(checkpoint)

    def load_checkpoint(self, checkpoint: Checkpoint) -> None:
        import mlx.core as mx
        from mlx.utils import tree_unflatten

        self.state = checkpoint.trainer_state()
        self.state.total_steps = self.total_steps
        check_resumable(checkpoint, "ddp", self.plan.rows_per_step)
        weights = checkpoint.local_dir / (FULL_WEIGHTS if self.method == "full" else mm.ADAPTER_WEIGHTS)
        self.model.load_weights(list(mx.load(str(weights)).items()), strict=self.method == "full")
        self.optimizer.state = tree_unflatten(list(mx.load(str(checkpoint.local_dir / OPTIMIZER)).items()))
        mx.eval(self.model.parameters(), self.optimizer.state)
        self.log(f"resuming from {checkpoint.uri} (step {checkpoint.step}/{self.total_steps})")

    # --- train loop ---

    def train_step(self) -> None:
        """One optimizer step: every micro-batch's examples forward and backward, gradients summed, divided by the
        step's learned tokens, clipped, AdamW at the step's learning rate."""
        import mlx.core as mx
        import mlx.optimizers as optim
        from mlx.utils import tree_map

        started = time.monotonic()
        step, config = self.state.step, self.config
        mx.random.seed(config.seed * STEP_SEED + step)  # this step's dropout draws, the same after a resume
        input_ids, labels, position_ids = self.train_rows
        indices = np.concatenate(self.plan.micro_batches(step, 0))
        grads, total, items = None, mx.array(0.0), 0
        for inputs, targets in padded(input_ids[indices], labels[indices], position_ids[indices], self.budget):
            value, part = self.loss_and_grad(self.model, mx.array(inputs), mx.array(targets))
            grads = part if grads is None else tree_map(lambda a, b: a + b, grads, part)
            total, items = total + value, items + int((targets != IGNORE_INDEX).sum())
        items = max(items, 1)
        grads = tree_map(lambda g: g / items, grads)
        grads, norm = optim.clip_grad_norm(grads, config.max_grad_norm or float("inf"))
        self.optimizer.learning_rate = learning_rate_at(config, self.resolved, step)
        self.optimizer.update(self.model, grads)
        loss = total / items
        mx.eval(self.model.parameters(), self.optimizer.state, loss, norm)
        state = self.state
        state.step += 1
        state.epoch = state.step // self.plan.steps_per_epoch
        state.samples_seen += self.plan.rows_per_step
        tokens = len(indices) * self.seq_len  # packed tokens, as the torch recipe counts them
        state.tokens_seen += tokens
        self.window.add(state.step, torch.tensor(loss.item()), torch.tensor(norm.item()), tokens)
        self.window.read(state.loss_history)
        self.step_seconds += time.monotonic() - started

    def log_progress(self) -> None:
        lr = learning_rate_at(self.config, self.resolved, self.state.step)
        metrics = self.window.metrics(
            self.state.step, self.total_steps, self.plan.steps_per_epoch, self.state.loss_history, lr
        )
        self.log(progress_line(metrics, {}))
        self.report(metrics)
        self.uploader.drain_log()
        self.window.restart()

    def report(self, metrics: dict) -> None:
        if self.on_metrics is not None:
            self.on_metrics(metrics)
        if self.tracker is not None:
            self.tracker.log_metrics(metrics, step=metrics["step"])

    # --- checkpoint and eval ---

    def save_checkpoint(self) -> None:
        import mlx.core as mx
        from mlx.utils import tree_flatten

        state = self.state
        self.attempt.update(
            last_checkpoint_step=state.step,
            wall_seconds=round(time.monotonic() - self.started, 3),
            step_seconds=round(self.step_seconds, 3),
        )

        def write(folder: Path) -> None:
            if self.method == "full":
                mx.save_safetensors(str(folder / FULL_WEIGHTS), dict(tree_flatten(self.model.parameters())))
            else:
                mm.write_adapter(self.model, self.lora, folder)
            mx.save_safetensors(str(folder / OPTIMIZER), dict(tree_flatten(self.optimizer.state)))
            (folder / "trainer_state.json").write_text(state.to_json())

        local = self.work_dir / "checkpoints" / layout.checkpoint_name(state.step)
        write_fresh(local, lambda: write(local))
        meta = {"step": state.step, "method": self.method, "backend": "mlx", "world_size": 1}
        self.uploader.submit(local, state.step, meta=meta)
        self.last_saved = state.step

    def evaluate(self) -> dict[str, float]:
        """``eval_loss``: the mean token loss over every eval example, as the torch recipe's SFT eval."""
        import mlx.core as mx

        self.model.eval()
        total, count = 0.0, 0
        input_ids, labels, position_ids = self.eval_rows
        for inputs, targets in padded(input_ids, labels, position_ids, self.budget):
            total += loss_sum(self.model, mx.array(inputs), mx.array(targets)).item()
            count += int((targets != IGNORE_INDEX).sum())
        self.model.train()
        return {"eval_loss": total / max(count, 1)}

    # --- finish ---

    def finish(self) -> None:
        if self.last_saved != self.state.step:
            self.save_checkpoint()
        if self.eval_rows is not None:
            self.eval_metrics = self.evaluate()
            self.eval_loss = self.eval_metrics["eval_loss"]
            self.log(f"final {eval_line(self.eval_metrics)} on {len(self.eval_rows[0])} rows")
            self.report({"step": self.state.step, **self.eval_metrics})
        shutil.rmtree(self.output_dir, ignore_errors=True)
        if self.method == "full":
            self.write_full_model(self.output_dir)
        else:
            mm.write_adapter(self.model, self.lora, self.output_dir / MLX_DIR)
            summary = mlx_peft.convert(self.output_dir / MLX_DIR, self.base_model_dir, self.output_dir)
            self.log(
                f"adapter converted to PEFT: {summary['modules']} modules, r {summary['r']}, lora_alpha "
                f"{summary['lora_alpha']:g}, target_modules {summary['target_modules']}; mlx-lm's files in {MLX_DIR}/"
            )
        for name in TOKENIZER_FILES:
            if (self.base_model_dir / name).is_file():
                shutil.copyfile(self.base_model_dir / name, self.output_dir / name)
        self.uploader.close()

    def write_full_model(self, out: Path) -> None:
        """Every weight under transformers' names (mlx-lm's, checked against the base's tensors) with the base's config."""
        import mlx.core as mx
        from mlx.utils import tree_flatten

        weights = dict(tree_flatten(self.model.parameters()))
        base = mlx_peft.base_shapes(self.base_model_dir)
        unknown = sorted(set(weights) - set(base))
        missing = sorted(set(base) - set(weights) - {"lm_head.weight"})  # a tied head is the embedding
        if unknown or missing:
            raise ValueError(
                f"backend mlx: mlx-lm's weights of this model are not named as the base's ({unknown[:3]} not in the base, "
                f"{missing[:3]} missing): full fine-tuning of this family needs backend: torch"
            )
        out.mkdir(parents=True)
        mx.save_safetensors(str(out / FULL_WEIGHTS), weights, metadata={"format": "pt"})
        for name in BACKEND_FILES:
            if (self.base_model_dir / name).is_file():
                shutil.copyfile(self.base_model_dir / name, out / name)


def train(config: TrainingConfig, *args, **kwargs) -> TrainingResult:
    """Train (or resume) the run at ``run_prefix`` with MLX; the same arguments and result as ``recipe.train``."""
    return loop.train(MlxRecipe, config, *args, **kwargs)
