"""The training recipe: fine-tune a base model on packed shards, checkpointing to the object store.

One function, ``train``, that reads top to bottom: setup (device, data, model, optimizer, resume)
-> train loop (checkpoint, evaluate, log, honour SIGTERM) -> final eval and save -> cleanup. No
Dagster here: the ``lora_adapter`` asset calls ``train`` and turns ``Preempted`` into a retry.

Workers are stateless and often spot instances, so the recipe assumes it can die at any step:

- Every ``save_steps`` steps it writes a checkpoint (trainable weights, optimizer, scheduler, every
  RNG, trainer state) to local disk and a background thread publishes it while training continues.
- On start it resumes from the newest complete, sha256-verified checkpoint of the run. Data order
  is a pure function of (seed, epoch) and step, and the RNG states are restored after setup, so a
  run killed at any step and resumed ends with the same weights as an uninterrupted one (exactly on
  CPU; on CUDA up to the usual non-determinism of its kernels).
- SIGTERM (the spot reclaim notice) sets a flag; at the next step boundary the worker checkpoints,
  waits for the upload and raises ``Preempted``. ``python -m ft_assets.training.recipe`` exits with
  ``EXIT_PREEMPTED`` (75, EX_TEMPFAIL) then. After a SIGKILL at most ``save_steps`` steps are lost.

Packed rows carry several chat examples each. Attention must not cross example boundaries:
transformers (5.x) builds a block-diagonal causal mask from ``position_ids`` (they restart at 0 at
every example) when ``attention_mask`` is None AND no KV cache exists. Llama's config says
``use_cache=True``, which silently creates a cache in training and turns the packing detection off,
so every forward here passes ``use_cache=False`` (the tests pin both facts).

Data parallel: ``accelerate launch --multi_gpu --num_processes N -m ft_assets.training.recipe ...``
(or ``torchrun --nproc_per_node N -m ...``). Without a GPU the same command forms a gloo group,
because the recipe asks accelerate for ``cpu=True`` then; accelerate's own ``--cpu`` flag would
start a single process. Only rank 0 writes checkpoints and logs; all ranks restore their own RNG.

On CPU the recipe runs, slowly: SmolLM2-135M, 512-token packed rows, 2 shared cores, seconds per
optimizer step after the first: lora 7.6 (batch 1) / 25.5 (batch 4), qlora 21.4 / 41.5, i.e. 50-80
tokens/s. QLoRA dequantizes every weight on every forward, a fixed cost that batching amortizes.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list, gather_object, set_seed

from ft_assets import layout
from ft_assets.storage import ObjectStore, open_store
from ft_assets.training.checkpoints import (
    BackgroundUploader,
    Checkpoint,
    TrainerState,
    capture_rng_state,
    complete_checkpoints,
    delete_checkpoint,
    fetch_checkpoint,
    find_latest_checkpoint,
    restore_rng_state,
    write_checkpoint,
)
from ft_assets.training.config import TrainingConfig

EXIT_PREEMPTED = 75  # EX_TEMPFAIL from sysexits.h: "temporary failure, try again"
IGNORE_INDEX = -100  # label value the HF loss skips
PACKED_COLUMNS = ("input_ids", "loss_mask", "position_ids")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")

Log = Callable[[str], None]
OnMetrics = Callable[[dict], None]


class Preempted(RuntimeError):
    """The worker got SIGTERM, saved a checkpoint at ``step`` and stopped; rerun to resume."""

    def __init__(self, step: int, checkpoint_uri: str | None):
        super().__init__(f"preempted by SIGTERM at step {step}; the run resumes from {checkpoint_uri or 'scratch'}")
        self.step = step
        self.checkpoint_uri = checkpoint_uri


@dataclass
class TrainingResult:
    output_dir: Path  # final adapter (lora/qlora) or model (full) with tokenizer files, written by rank 0
    method: str
    device: str
    steps: int
    train_loss: float | None  # mean of the last `logging_steps` step losses
    eval_loss: float | None  # None when there are no eval shards
    tokens_seen: int  # packed tokens (padding included) over all processes, whole run
    wall_seconds: float  # this attempt, from `started_at` (model load, data, uploads, eval included)
    step_seconds: float  # this attempt, inside forward + backward + optimizer step
    effective_training_fraction: float  # step_seconds / wall_seconds
    resumed_from_step: int | None
    checkpoints: list[str]  # URIs of the complete checkpoints left in the store, oldest first
    loss_history: list[tuple[int, float]]
    restarts: list[dict]  # earlier attempts of this run (start step, last checkpoint, timings)
    bytes_uploaded: int

    def to_json(self) -> dict:
        raw = asdict(self)
        raw["output_dir"] = str(self.output_dir)
        return raw


# --- data: packed Parquet rows ---------------------------------------------------------------------


@dataclass(frozen=True)
class PackedRows:
    input_ids: torch.Tensor  # (rows, seq_len) int32; batches are widened to int64
    labels: torch.Tensor  # input_ids where loss_mask is 1 (never an example's first token), else IGNORE_INDEX
    position_ids: torch.Tensor  # restart at 0 at every packed example (and the padding tail)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]

    def batch(self, indices: np.ndarray, device: torch.device) -> dict[str, torch.Tensor]:
        index = torch.tensor(indices)
        return {
            "input_ids": self.input_ids[index].to(device, torch.long),
            "labels": self.labels[index].to(device, torch.long),
            "position_ids": self.position_ids[index].to(device, torch.long),
        }


def _fixed_width(path: Path, table, column: str) -> np.ndarray:
    values = table.column(column).combine_chunks()
    lengths = pc.unique(pc.list_value_length(values)).to_pylist()
    if len(lengths) != 1 or lengths[0] is None:
        raise ValueError(
            f"{path}: column {column!r} has rows of lengths {sorted(x for x in lengths if x is not None)}; every "
            "packed row must hold exactly seq_len tokens (rebuild the shards with the data plane's packer)"
        )
    return values.flatten().to_numpy(zero_copy_only=False).reshape(len(values), lengths[0])


def load_packed_rows(shards_dir: Path, split: str, max_seq_len: int) -> PackedRows | None:
    """All rows of ``<split>-*.parquet`` in memory: 3 int32 tensors, 12 bytes/token (0.6 GB per 50M tokens)."""
    files = sorted(shards_dir.glob(f"{split}-*.parquet"))
    if not files:
        return None
    parts = {column: [] for column in PACKED_COLUMNS}
    for path in files:
        table = pq.read_table(path, columns=list(PACKED_COLUMNS))
        widths = set()
        for column in PACKED_COLUMNS:
            parts[column].append(_fixed_width(path, table, column))
            widths.add(parts[column][-1].shape[1])
        if len(widths) != 1 or widths != {parts["input_ids"][0].shape[1]}:
            raise ValueError(f"{path}: columns or files disagree on seq_len ({sorted(widths)}); repack the shards")
    input_ids, loss_mask, position_ids = (torch.from_numpy(np.concatenate(parts[c]).astype(np.int32)) for c in PACKED_COLUMNS)
    if input_ids.shape[1] > max_seq_len:
        raise ValueError(
            f"{shards_dir}: shards are packed at {input_ids.shape[1]} tokens, above max_seq_len={max_seq_len}; "
            "repack them shorter or raise max_seq_len if the GPU has the memory"
        )
    # A label at the first token of an example would be predicted from the previous example's last
    # token; the mask should never ask for that, and this makes sure it cannot.
    labels = torch.where(loss_mask.bool() & (position_ids != 0), input_ids, torch.tensor(IGNORE_INDEX, dtype=torch.int32))
    return PackedRows(input_ids=input_ids, labels=labels, position_ids=position_ids)


@functools.lru_cache(maxsize=2)  # the current epoch's order, computed once rather than every step
def _permutation(num_rows: int, seed: int, epoch: int) -> np.ndarray:
    order = np.random.default_rng([seed, epoch]).permutation(num_rows)
    order.flags.writeable = False
    return order


@dataclass(frozen=True)
class DataPlan:
    """Which rows every process reads at every step: a pure function of (seed, epoch, step, rank)."""

    num_rows: int
    batch_size: int
    accumulation: int
    world_size: int
    seed: int

    @property
    def rows_per_step(self) -> int:
        return self.batch_size * self.accumulation * self.world_size

    @property
    def steps_per_epoch(self) -> int:
        return self.num_rows // self.rows_per_step  # the incomplete tail batch of an epoch is dropped

    def epoch_order(self, epoch: int) -> np.ndarray:
        return _permutation(self.num_rows, self.seed, epoch)

    def micro_batches(self, step: int, rank: int) -> list[np.ndarray]:
        """Row indices of each micro-batch this rank runs for optimizer step ``step`` (0-based)."""
        epoch, position = divmod(step, self.steps_per_epoch)
        order = self.epoch_order(epoch)
        batches = []
        for micro in range(self.accumulation):
            start = ((position * self.accumulation + micro) * self.world_size + rank) * self.batch_size
            batches.append(order[start : start + self.batch_size])
        return batches


# --- model -----------------------------------------------------------------------------------------


def load_model(config: TrainingConfig, method: str, base_model_dir: Path, device: torch.device):
    """The base model from safetensors (no pickle, no remote code), wrapped for the chosen method."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if not any(base_model_dir.glob("*.safetensors")):
        raise FileNotFoundError(
            f"{base_model_dir} holds no *.safetensors weights; the recipe loads safetensors only (no pickled "
            ".bin), convert the base model with save_pretrained(safe_serialization=True)"
        )
    compute_dtype = torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    kwargs = {"use_safetensors": True, "trust_remote_code": False}
    if method == "qlora":
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=compute_dtype,
        )
        kwargs["device_map"] = {"": device}
    kwargs["dtype"] = compute_dtype if method in ("lora", "qlora") else torch.float32  # full: fp32 master weights
    model = AutoModelForCausalLM.from_pretrained(base_model_dir, **kwargs)

    gc_kwargs = {"use_reentrant": False}  # the non-reentrant variant works with frozen inputs and DDP
    if method == "qlora":
        model = prepare_model_for_kbit_training(
            model,
            use_gradient_checkpointing=config.gradient_checkpointing,
            gradient_checkpointing_kwargs=gc_kwargs,
        )
    elif config.gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=gc_kwargs)
        if method == "lora":
            model.enable_input_require_grads()
    if method in ("lora", "qlora"):
        lora = LoraConfig(
            r=config.lora_r,
            lora_alpha=config.lora_alpha,
            lora_dropout=config.lora_dropout,
            target_modules=list(config.target_modules),
            bias="none",
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, lora)
    return model


def trainable_parameters(model) -> dict[str, torch.nn.Parameter]:
    """Name -> parameter of what the optimizer updates (tied weights appear once)."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def load_trainable(model, weights: dict[str, torch.Tensor], source: str) -> None:
    params = trainable_parameters(model)
    missing, unexpected = sorted(set(params) - set(weights)), sorted(set(weights) - set(params))
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {source} does not match this model (missing {missing[:3]}, unexpected {unexpected[:3]}); "
            "it was written by a different method or target_modules, delete it or change the run"
        )
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(weights[name])


def make_scheduler(config: TrainingConfig, optimizer, total_steps: int):
    from transformers import get_scheduler

    name = "constant_with_warmup" if config.lr_scheduler == "constant" else config.lr_scheduler
    return get_scheduler(name, optimizer, num_warmup_steps=config.warmup_steps, num_training_steps=total_steps)


def learned_tokens(batch: dict[str, torch.Tensor]) -> int:
    """How many labels the shifted loss counts (label i is predicted from token i-1)."""
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


def token_loss_sum(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Cross-entropy summed over the learned tokens of a batch, and their count.

    No attention mask and no KV cache: the packed rows' position_ids give the block-diagonal mask.
    """
    # num_items_in_batch=1 turns the HF loss into a plain sum (it divides the summed loss by it).
    return model(**batch, use_cache=False, num_items_in_batch=1).loss, learned_tokens(batch)


def evaluate(model, rows: PackedRows, batch_size: int, accelerator: Accelerator) -> float:
    """Mean token loss over every eval row, each process taking every world_size-th row."""
    model.eval()
    indices = np.arange(accelerator.process_index, len(rows), accelerator.num_processes)
    total = torch.zeros(2, device=accelerator.device)
    with torch.no_grad():
        for start in range(0, len(indices), batch_size):
            loss_sum, count = token_loss_sum(model, rows.batch(indices[start : start + batch_size], accelerator.device))
            total += torch.tensor([loss_sum.item(), count], device=accelerator.device)
    model.train()
    total = accelerator.reduce(total, "sum")
    return float(total[0] / max(total[1], 1))


# --- preemption ------------------------------------------------------------------------------------


class SigtermFlag:
    """While entered, SIGTERM only sets ``requested``; the loop acts on it at the next step boundary.

    Signal handlers can only be installed from the main thread; elsewhere this is a no-op flag.
    The previous handler (Dagster's, in a run worker) is restored on exit.
    """

    def __init__(self):
        self.requested = False
        self._installed = False
        self._previous = None

    def _handle(self, signum, frame) -> None:
        self.requested = True  # nothing else here: a handler that prints can hit a reentrant print

    def __enter__(self) -> SigtermFlag:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
            self._installed = True
        return self

    def __exit__(self, *exc_info) -> None:
        if self._installed:
            # None means a handler installed outside Python; the default action is the closest match.
            signal.signal(signal.SIGTERM, signal.SIG_DFL if self._previous is None else self._previous)
            self._installed = False


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


# --- the recipe ------------------------------------------------------------------------------------


def train(
    config: TrainingConfig,
    base_model_dir: Path,
    shards_dir: Path,
    store: ObjectStore,
    run_prefix: str,
    work_dir: Path,
    log: Log = print,
    on_metrics: OnMetrics | None = None,
    started_at: float | None = None,
) -> TrainingResult:
    """Train (or resume) the run at ``run_prefix`` and return the final weights and figures.

    ``started_at`` is a ``time.monotonic()`` value from before the caller's downloads, so that wall
    time covers them; default now.
    """
    started = time.monotonic() if started_at is None else started_at
    # The SIGTERM handler goes in first: a spot notice during a long model load still ends in Preempted.
    with SigtermFlag() as sigterm:
        base_model_dir, shards_dir, work_dir = Path(base_model_dir), Path(shards_dir), Path(work_dir)

        # --- setup: processes and device ---
        cuda = torch.cuda.is_available()
        accelerator = Accelerator(
            # cpu=True is what makes several processes without a GPU join one gloo group (MULTI_CPU);
            # without it each torchrun/`accelerate launch --multi_gpu` process would train alone.
            cpu=not cuda and not torch.backends.mps.is_available(),
            mixed_precision="bf16" if cuda and torch.cuda.is_bf16_supported() else "no",
            log_with=config.report_to or None,
            project_dir=work_dir / "trackers",
        )
        rank, world, is_main = accelerator.process_index, accelerator.num_processes, accelerator.is_main_process
        say: Log = log if is_main else (lambda line: None)
        if world != config.num_processes:
            raise ValueError(
                f"config.num_processes={config.num_processes} but {world} process(es) were started; launch with "
                f"`accelerate launch --num_processes {config.num_processes} -m ft_assets.training.recipe ...` "
                "or set num_processes to match"
            )
        device = accelerator.device
        method = config.resolved_method(cuda)
        if device.type == "cpu":
            say("WARNING: no CUDA or MPS device found, training on CPU (fine for tests, ~100x slower than a GPU)")
        say(f"training {method} on {device} x{world}, run {store.uri(run_prefix)}")
        if config.report_to:
            accelerator.init_trackers(run_prefix.replace("/", "-"), config=config.model_dump())

        # --- setup: data ---
        train_rows = load_packed_rows(shards_dir, "train", config.max_seq_len)
        if train_rows is None:
            raise FileNotFoundError(f"{shards_dir} has no train-*.parquet shards; materialize tokenized_shards first")
        eval_rows = load_packed_rows(shards_dir, "eval", config.max_seq_len)
        plan = DataPlan(len(train_rows), config.per_device_batch_size, config.gradient_accumulation_steps, world, config.seed)
        if plan.steps_per_epoch == 0:
            raise ValueError(
                f"{shards_dir} holds {len(train_rows)} train rows but one optimizer step needs {plan.rows_per_step} "
                "(per_device_batch_size x gradient_accumulation_steps x num_processes); lower them"
            )
        total_steps = config.max_steps or config.epochs * plan.steps_per_epoch
        tokens_per_step = plan.rows_per_step * train_rows.seq_len
        say(
            f"{len(train_rows)} train rows x {train_rows.seq_len} tokens, {len(eval_rows) if eval_rows else 0} eval rows; "
            f"{plan.steps_per_epoch} steps/epoch, {total_steps} steps"
        )

        # --- setup: model and optimizer (seeded so a fresh run is reproducible) ---
        set_seed(config.seed)
        model = load_model(config, method, base_model_dir, device)
        model = accelerator.prepare_model(model)
        unwrapped = accelerator.unwrap_model(model)
        params = trainable_parameters(unwrapped)
        say(f"{sum(p.numel() for p in params.values()):,} trainable parameters")
        optimizer = torch.optim.AdamW(params.values(), lr=config.learning_rate, weight_decay=config.weight_decay)
        scheduler = make_scheduler(config, optimizer, total_steps)

        # --- setup: resume from the newest complete checkpoint ---
        resume_dir = work_dir / "resume" / f"rank-{rank}"
        checkpoint: Checkpoint | None = None
        skipped: list[int] = []
        if is_main:
            checkpoint, skipped = find_latest_checkpoint(store, run_prefix, resume_dir, log)
        resume_step = [checkpoint.step if checkpoint else None]
        if world > 1:
            broadcast_object_list(resume_step)
            if not is_main and resume_step[0] is not None:
                checkpoint = fetch_checkpoint(store, run_prefix, resume_step[0], resume_dir)
        state = TrainerState(total_steps=total_steps, world_size=world, method=method)
        rng_state = None
        if checkpoint is not None:
            state = checkpoint.trainer_state()
            state.total_steps = total_steps
            load_trainable(unwrapped, checkpoint.weights(), checkpoint.uri)
            optimizer.load_state_dict(checkpoint.optimizer_state())
            scheduler.load_state_dict(checkpoint.scheduler_state())
            rng_states = checkpoint.rng_states()
            if len(rng_states) != world:
                raise ValueError(f"checkpoint {checkpoint.uri} was written by {len(rng_states)} processes, not {world}")
            rng_state = rng_states[rank]
            say(f"resuming from {checkpoint.uri} (step {checkpoint.step}/{total_steps})")
        else:
            say(f"no complete checkpoint under {store.uri(run_prefix)}: starting from the base model")
        shutil.rmtree(resume_dir, ignore_errors=True)
        if is_main:
            for step in skipped:  # newer than the resume point and unusable: they will be rewritten
                delete_checkpoint(store, run_prefix, step)
        resumed_from = checkpoint.step if checkpoint else None
        state.attempts.append({"resumed_from_step": resumed_from, "last_checkpoint_step": None})
        attempt = state.attempts[-1]

        uploader = BackgroundUploader(store, run_prefix, keep=config.save_total_limit, log=say)
        step_seconds = 0.0
        last_saved = state.step if checkpoint else None

        def save_checkpoint() -> None:
            """All processes: gather RNG states; rank 0: write locally and hand to the uploader."""
            nonlocal last_saved
            rng_states = gather_object([capture_rng_state()]) if world > 1 else [capture_rng_state()]
            if is_main:
                attempt.update(
                    last_checkpoint_step=state.step,
                    wall_seconds=round(time.monotonic() - started, 3),
                    step_seconds=round(step_seconds, 3),
                )
                local = write_checkpoint(
                    work_dir / "checkpoints" / f"checkpoint-{state.step:08d}",
                    weights=dict(params),
                    optimizer_state=optimizer.state_dict(),
                    scheduler_state=scheduler.state_dict(),
                    rng_states=rng_states,
                    trainer_state=state,
                )
                uploader.submit(local, state.step, meta={"step": state.step, "method": method})
            last_saved = state.step

        def report(metrics: dict) -> None:
            if is_main and on_metrics is not None:
                on_metrics(metrics)
            if config.report_to:
                accelerator.log(metrics, step=metrics["step"])

        try:
            # Restore the RNGs last: everything above (LoRA init, model load) may draw from them.
            if rng_state is not None:
                restore_rng_state(rng_state)
            model.train()
            window_start, window_steps = time.monotonic(), 0

            # --- train loop ---
            while True:
                stop = torch.tensor([float(sigterm.requested)], device=device)
                if world > 1:
                    stop = accelerator.reduce(stop, "sum")
                if stop.item() > 0:
                    say(f"SIGTERM received: checkpointing step {state.step} and stopping")
                    if state.step > 0 and last_saved != state.step:
                        save_checkpoint()
                    uploader.wait()
                    accelerator.wait_for_everyone()
                    uri = store.uri(layout.checkpoint(run_prefix, last_saved)) if last_saved is not None else None
                    raise Preempted(state.step, uri)
                if state.step >= total_steps:
                    break

                step_started = time.monotonic()
                batches = [train_rows.batch(i, device) for i in plan.micro_batches(state.step, rank)]
                # Normalise by the learned tokens of the whole step (all micro-batches, all processes):
                # the loss is then the true per-token mean, whatever the packing put in each row.
                items = torch.tensor([sum(learned_tokens(b) for b in batches)], device=device)
                items = max(int(accelerator.reduce(items, "sum").item()), 1)
                step_loss = torch.zeros((), device=device)
                for micro, batch in enumerate(batches):
                    last = micro == len(batches) - 1
                    with accelerator.no_sync(model) if not last else nullcontext():
                        loss_sum, _ = token_loss_sum(model, batch)
                        # DDP averages gradients over processes; scale back up to a sum over all tokens.
                        accelerator.backward(loss_sum * (world / items))
                    step_loss += loss_sum.detach().float() / items
                if config.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(params.values(), config.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                loss = float(accelerator.reduce(step_loss, "sum").item())
                step_seconds += time.monotonic() - step_started

                state.step += 1
                state.epoch = state.step // plan.steps_per_epoch
                state.samples_seen += plan.rows_per_step
                state.tokens_seen += tokens_per_step
                state.loss_history.append((state.step, loss))
                window_steps += 1

                if state.step % config.logging_steps == 0 or state.step == total_steps:
                    elapsed = time.monotonic() - window_start
                    per_step = elapsed / window_steps
                    recent = [value for _, value in state.loss_history[-window_steps:]]
                    metrics = {
                        "step": state.step,
                        "total_steps": total_steps,
                        "epoch": state.step / plan.steps_per_epoch,
                        "loss": sum(recent) / len(recent),
                        "learning_rate": scheduler.get_last_lr()[0],
                        "tokens_per_second": tokens_per_step * window_steps / elapsed if elapsed > 0 else 0.0,
                        "eta_seconds": per_step * (total_steps - state.step),
                    }
                    say(
                        f"step {state.step}/{total_steps}  loss {metrics['loss']:.4f}  lr {metrics['learning_rate']:.2e}  "
                        f"{metrics['tokens_per_second']:,.0f} tok/s  eta {_duration(metrics['eta_seconds'])}"
                    )
                    report(metrics)
                    uploader.drain_log()
                    window_start, window_steps = time.monotonic(), 0
                if state.step % config.save_steps == 0 and state.step < total_steps:
                    save_checkpoint()
                if config.eval_steps and eval_rows and state.step % config.eval_steps == 0 and state.step < total_steps:
                    eval_loss = evaluate(unwrapped, eval_rows, config.per_device_batch_size, accelerator)
                    state.eval_history.append((state.step, eval_loss))
                    say(f"step {state.step}/{total_steps}  eval loss {eval_loss:.4f}")
                    report({"step": state.step, "eval_loss": eval_loss})

            # --- final checkpoint, eval and save ---
            if last_saved != state.step:
                save_checkpoint()  # a rerun after a crash from here on skips straight to the export
            eval_loss = None
            if eval_rows is not None:
                eval_loss = evaluate(unwrapped, eval_rows, config.per_device_batch_size, accelerator)
                say(f"final eval loss {eval_loss:.4f} on {len(eval_rows)} rows")
                report({"step": state.step, "eval_loss": eval_loss})
            output_dir = work_dir / "final"
            if is_main:
                shutil.rmtree(output_dir, ignore_errors=True)
                unwrapped.save_pretrained(output_dir, safe_serialization=True)
                for name in TOKENIZER_FILES:
                    if (base_model_dir / name).is_file():
                        shutil.copyfile(base_model_dir / name, output_dir / name)
            uploader.close()
            accelerator.wait_for_everyone()
        finally:
            if sys.exc_info()[0] is not None:
                try:  # let a checkpoint already in flight land; the original error is what matters
                    uploader.wait()
                except Exception as exc:  # noqa: BLE001
                    log(f"WARNING: checkpoint upload also failed: {exc}")
            if config.report_to:
                accelerator.end_training()
            accelerator.free_memory()  # drop accelerate's references to the model, run gc, empty the CUDA cache

    wall = time.monotonic() - started
    recent = [value for _, value in state.loss_history[-config.logging_steps :]]
    result = TrainingResult(
        output_dir=output_dir,
        method=method,
        device=f"{device.type} x{world}",
        steps=state.step,
        train_loss=sum(recent) / len(recent) if recent else None,
        eval_loss=eval_loss,
        tokens_seen=state.tokens_seen,
        wall_seconds=wall,
        step_seconds=step_seconds,
        effective_training_fraction=step_seconds / wall if wall > 0 else 0.0,
        resumed_from_step=resumed_from,
        checkpoints=complete_checkpoints(store, run_prefix),
        loss_history=list(state.loss_history),
        restarts=state.attempts[:-1],
        bytes_uploaded=uploader.bytes_uploaded,
    )
    losses = ", ".join(f"{name} loss {value:.4f}" for name, value in (("train", result.train_loss), ("eval", eval_loss)) if value is not None)
    say(f"done: {result.steps} steps, {losses}, {_duration(wall)} wall, {result.effective_training_fraction:.0%} of it in training steps")
    return result


# --- command line: `python -m ft_assets.training.recipe` / `accelerate launch -m ...` -------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run the training recipe (one process, or one rank of accelerate launch).")
    parser.add_argument("--config", default="{}", help="TrainingConfig as JSON, or a path to a JSON file")
    parser.add_argument("--base-model", required=True, type=Path, help="local HF model directory (safetensors)")
    parser.add_argument("--shards", required=True, type=Path, help="local directory of packed Parquet shards")
    parser.add_argument("--store", required=True, help="object store URL: a local path or s3://bucket/prefix")
    parser.add_argument("--run-prefix", required=True, help="runs/<name>/<version>/train/<run_id>")
    parser.add_argument("--work-dir", required=True, type=Path, help="local scratch directory")
    parser.add_argument("--result", type=Path, help="write the TrainingResult here as JSON (rank 0)")
    parser.add_argument("--pipes", action="store_true", help="report to Dagster through dagster-pipes (rank 0 only)")
    args = parser.parse_args(argv)

    raw = args.config if args.config.lstrip().startswith("{") else Path(args.config).read_text()
    config = TrainingConfig.model_validate_json(raw)
    # Rank from the launcher's environment: creating accelerate's PartialState here would fix the
    # process group before train() asks for a CPU (gloo) one.
    is_main = int(os.environ.get("RANK", "0")) == 0
    pipes = nullcontext(None)
    if args.pipes:
        if is_main:
            from dagster_pipes import open_dagster_pipes

            pipes = open_dagster_pipes()
        else:  # only rank 0 talks to Dagster: the other ranks drop the Pipes channel they inherited
            for name in [n for n in os.environ if n.startswith("DAGSTER_PIPES_")]:
                del os.environ[name]

    with pipes as channel:

        def log(line: str) -> None:
            if channel is not None:
                channel.log.info(line)
            else:
                print(line, flush=True)

        try:
            result = train(config, args.base_model, args.shards, open_store(args.store), args.run_prefix, args.work_dir, log=log)
        except Preempted as exc:
            log(str(exc))
            return EXIT_PREEMPTED
    if args.result and is_main:
        args.result.write_text(json.dumps(result.to_json(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
