"""Training configuration: every knob of the recipe, typed, defaulted and documented.

A plain pydantic model so that the Dagster asset can mirror it as a ``dagster.Config`` (which is
pydantic too): every field's ``description`` becomes the launchpad help text. Defaults follow the
common LoRA recipe for 0.1-8B chat models (r=16, alpha=32, every attention and MLP projection of the
model, whatever the family names them (``training.model.lora_target_modules``), lr 2e-4
for LoRA and QLoRA and 2e-5 for full fine-tuning, cosine decay after a 3% warmup, 3 epochs as the HF
Trainer does) and need no tuning for a first run.

Small datasets are where first runs fail: a 683-line alpaca set packs into ~48 rows, 12 optimizer
steps an epoch at batch 4, and a fixed 10-step warmup then leaves the model nowhere near learning.
So a run is never shorter than ``min_steps`` optimizer steps (200: more epochs over a small set), and
warmup is a fraction of the run. On the test suite's tiny model (240 tool-call rows, 30 packed rows),
today's defaults reach exact match 0.92 on held-out prompts; the old ones (1 epoch, 10 warmup steps,
8 steps in all) 0.00, and 150 steps at lr 2e-4 still 0.00.

``resolve`` turns the empty fields into the values a run uses (method, learning rate, warmup, steps),
which the plan, the run log and the training result all show.

The objective is not a setting: the data decides it (``ft_assets.objectives``; preference pairs train
with DPO, prompts with GRPO, conversations with supervised fine-tuning); a setting could only contradict
the data. Each objective owns its settings, nested under its name (``dpo: {beta: 0.2}``, ``grpo:
{rewards: [...]}``; ``ft_assets.objectives.dpo.DpoSettings``, ...): ``TrainingConfig`` is the shared
fields (``CommonTraining``) plus one such field per registered objective, so a new objective adds its
settings without touching this file. The flat names they had before (``dpo_beta``, ``rewards``, ...)
are refused naming their new place (``MOVED``). ``resolve`` takes the objective to fill in what depends
on it (the default learning rate; DPO and GRPO refuse ``method: full``, since their reference is the
base with the adapter disabled; the objective's own ``check``: GRPO needs its reward functions).
``method`` keeps meaning which weights train, so the planner, the merge and the run log read it as
they always did.

Fields split in two: those that change the trained weights (``result_fields``, hashed into the run
id, of the objectives' settings only the run's own objective's, so changing one starts a new run) and
those that only change how the run is operated (how often to checkpoint, log or evaluate, where to
report), which may differ between the attempts of one run.
How the global batch is split over processes, nodes and micro-batches (``SPLIT_FIELDS``) is hashed
as its product only: a run checkpointed on 2 GPUs resumes on 1 with twice the accumulation.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator

from ft_assets.objectives import OBJECTIVES, Objective
from ft_assets.training import backends
from ft_assets.training.wandb_tracking import WandbSettings

Method = Literal["qlora", "lora", "full"]
AttentionImplementation = Literal["auto", "flash_attention_2", "flex_attention", "sdpa", "eager"]
Parallelism = Literal["ddp", "fsdp"]
Backend = Literal["auto", "torch", "mlx"]

# Fields that do not change the trained weights: checkpoint cadence and retention, logging, evaluation
# and reporting. Resuming with different values continues the same run. gradient_checkpointing trades
# memory for compute with the same math, so it may be flipped between attempts to fit a smaller GPU;
# the attention backend and torch.compile are the same math too (an attempt on another GPU may have
# other kernels), different only in floating-point rounding.
OPERATIONAL_FIELDS = frozenset(
    {
        "save_steps", "save_total_limit", "report_to", "eval_steps", "logging_steps", "gradient_checkpointing",
        "attn_implementation", "compile", "mlflow_tracking_uri", "mlflow_experiment", "wandb",
    }
)  # fmt: skip

# How the global batch is split over processes, nodes and micro-batches: the same rows in the same steps and the
# same math (only the dropout draws differ), so the run id hashes their product instead (``result_fields``).
MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")  # config.json's expert count, by family


def experts_of(config: Mapping[str, Any]) -> int:
    """Experts per layer of the model whose config.json is ``config`` (its ``text_config`` for a multimodal one); 0 for a
    dense model."""
    if isinstance(config.get("text_config"), Mapping):
        config = config["text_config"]
    return next((int(config[key]) for key in MOE_KEYS if config.get(key)), 0)


MOE_DEFAULTS = {"lora_experts": True, "train_router": False, "router_aux_loss_coef": None}  # not in a run id at these
VISION_DEFAULTS = {"train_vision": "none"}  # a vision-language model's; not in a run id at its default
SPLIT_FIELDS = ("per_device_batch_size", "gradient_accumulation_steps", "num_processes", "num_nodes")
# The objectives' settings were flat training settings before each objective owned its own: where each is now.
MOVED = {
    "dpo_beta": "dpo.beta", "dpo_loss": "dpo.loss", "rewards": "grpo.rewards", "num_generations": "grpo.num_generations",
    "max_completion_length": "grpo.max_completion_length", "temperature": "grpo.temperature", "grpo_beta": "grpo.beta",
    "grpo_loss": "grpo.loss", "generation_backend": "grpo.generation_backend",
}  # fmt: skip

DEFAULT_LEARNING_RATES = {
    "lora": 2e-4,
    "qlora": 2e-4,
    "full": 2e-5,
}  # QLoRA paper / most LoRA recipes; HF-style full FT

# accelerate trackers; MLflow has its own setting (mlflow_tracking_uri), which also logs the lineage
REPORTERS = ("tensorboard", "wandb", "comet_ml", "aim", "clearml", "dvclive")


@dataclass(frozen=True)
class ResolvedTraining:
    """What a run does, with every default filled in (shown by the plan, the run log and the result)."""

    method: Method
    objective: str  # the objective's name (ft_assets.objectives)
    learning_rate: float
    warmup_steps: int
    total_steps: int
    steps_per_epoch: int
    rows_per_step: int
    backend: str = "torch"  # the framework that trains (ft_assets.training.backends)

    @property
    def epochs(self) -> float:
        return self.total_steps / self.steps_per_epoch

    def describe(self) -> str:
        return (
            f"{self.objective} ({self.method}{', mlx' if self.backend == 'mlx' else ''}), {self.total_steps} steps ({self.epochs:.3g} epochs of {self.steps_per_epoch} steps, "
            f"{self.rows_per_step} rows a step), learning rate {self.learning_rate:g}, warmup {self.warmup_steps} steps"
        )

    def as_dict(self) -> dict:
        return {**asdict(self), "epochs": self.epochs}


class CommonTraining(BaseModel):
    """The training settings every objective shares (``TrainingConfig`` adds each objective's own)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    method: Method | None = Field(
        default=None,
        description="'qlora' (4-bit NF4 base + LoRA), 'lora' (LoRA on the full-precision base) or 'full' "
        "(every weight trained). Empty: qlora when a CUDA GPU is present, else lora; lora for a mixture of experts "
        "(bitsandbytes quantizes linear layers only, not the fused experts that hold most of its weights).",
    )
    lora_r: int = Field(default=16, description="LoRA rank: size of the low-rank update (ignored by 'full').")
    lora_alpha: int = Field(default=32, description="LoRA scaling numerator; the update is scaled by alpha / r.")
    lora_dropout: float = Field(
        default=0.05,
        description="Dropout on the LoRA input, in [0, 1). A mixture of experts with lora_experts trains with 0 "
        "(PEFT's LoRA on the fused experts takes no dropout).",
    )
    target_modules: list[str] = Field(
        default_factory=list,
        description="Module names that get LoRA adapters, e.g. ['q_proj', 'v_proj']. Empty: every attention and MLP "
        "projection of the base model (q/k/v/o_proj, gate/up/down_proj for Llama, Qwen, Mistral, Gemma; qkv_proj, o_proj, "
        "gate_up_proj, down_proj for Phi-3). A name the model lacks is refused, naming the ones it has.",
    )
    lora_experts: bool = Field(
        default=True,
        description="On a mixture of experts (Qwen3-MoE, Mixtral, gpt-oss): LoRA on every expert's fused gate_up_proj "
        "and down_proj too (PEFT target_parameters). Off: the attention only.",
    )
    train_router: bool = Field(
        default=False,
        description="On a mixture of experts: train the router (each layer's gate) in full, beside the adapter. Off: "
        "it stays frozen, so tokens go to the experts they went to before.",
    )
    router_aux_loss_coef: float | None = Field(
        default=None,
        ge=0,
        description="Weight of the router's load-balancing loss added to the loss of a mixture of experts. Empty: the "
        "model's own router_aux_loss_coef when train_router is on, else 0.",
    )
    train_vision: Literal["none", "projector", "all"] = Field(
        default="none",
        description="On a vision-language model (Qwen2.5-VL, Qwen3-VL, Gemma 3, SmolVLM): 'none' trains the language "
        "model alone, its vision tower and projector frozen (and kept out of QLoRA's 4-bit); 'projector' also trains "
        "the projector from image features to the language model in full; 'all' also puts LoRA on the vision tower "
        "(full fine-tuning: every vision weight trains).",
    )
    learning_rate: float | None = Field(
        default=None,
        description=f"Peak learning rate of AdamW. Empty: {DEFAULT_LEARNING_RATES['lora']:g} for lora and qlora, "
        f"{DEFAULT_LEARNING_RATES['full']:g} for full fine-tuning; 5e-6 for DPO (preference pairs).",
    )
    lr_scheduler: Literal["cosine", "linear", "constant"] = Field(
        default="cosine", description="Learning-rate decay after warmup: 'cosine', 'linear' or 'constant'."
    )
    warmup_ratio: float = Field(
        default=0.03, description="Linear warmup from 0 to learning_rate over this fraction of the run's steps."
    )
    warmup_steps: int | None = Field(
        default=None, description="Warmup in optimizer steps; overrides warmup_ratio. Empty: warmup_ratio x steps."
    )
    epochs: int = Field(default=3, description="Passes over the training shards (ignored when max_steps is set).")
    min_steps: int = Field(
        default=200,
        description="A run is never shorter than this many optimizer steps: a small dataset is trained for more "
        "epochs (ignored when max_steps is set; 0: exactly epochs).",
    )
    max_steps: int | None = Field(
        default=None,
        description="Stop after this many optimizer steps (cycling over epochs if needed). Empty or -1: "
        "epochs x steps per epoch, at least min_steps.",
    )
    per_device_batch_size: int = Field(default=4, description="Packed rows per forward pass on each process.")
    gradient_accumulation_steps: int = Field(
        default=1, description="Forward/backward passes per optimizer step; global batch = this x batch x processes."
    )
    max_seq_len: int = Field(
        default=2048,
        description="Longest packed row accepted. Shards packed longer are refused (repack them shorter) so "
        "that a data change cannot silently blow up GPU memory.",
    )
    gradient_checkpointing: bool = Field(
        default=False, description="Recompute activations in backward: ~30% slower, much less GPU memory."
    )
    attn_implementation: AttentionImplementation = Field(
        default="auto",
        description="Attention backend: 'auto' (flash_attention_2 if flash-attn is installed on a CUDA GPU, else "
        "flex_attention on CUDA, else sdpa; each only if the model's architecture accepts it, so Gemma 2 gets eager on "
        "a CPU), 'flash_attention_2', 'flex_attention', 'sdpa' or 'eager'. Packed rows stay apart in all of them; flash "
        "and flex never build the per-head seq x seq score matrices of sdpa/eager.",
    )
    compile: bool = Field(
        default=False,
        description="torch.compile the model (fewer kernel launches for small models; the first steps compile). "
        "Off until measured on your GPU.",
    )
    save_steps: int = Field(default=50, description="Checkpoint to the object store every this many optimizer steps.")
    save_total_limit: int | None = Field(
        default=3, description="Keep only this many newest checkpoints in the store. Empty: keep all."
    )
    seed: int = Field(default=42, description="Seed of weight init, dropout and data order; same seed, same result.")
    num_processes: int = Field(
        default=1,
        description="Processes (GPUs) per node; >1 launches `torchrun --nproc_per_node N` (lora_adapter does it). The "
        "global batch is per_device_batch_size x gradient_accumulation_steps x num_processes x num_nodes.",
    )
    num_nodes: int = Field(
        default=1,
        description="Machines (nodes) of num_processes GPUs each; >1 launches torchrun on every node with one rendezvous "
        "(static, on a c10d store hosted by node 0): on Kubernetes, lora_adapter starts nodes 1..M-1 as an indexed Job.",
    )
    backend: Backend = Field(
        default="auto",
        description="What trains: 'torch' (transformers + peft: CUDA, MPS or CPU; every objective and method), 'mlx' "
        "(mlx-lm on Apple silicon's GPU, pip install 'ft-assets[mlx]': SFT with lora, qlora (mlx's 4-bit) or full on one "
        "process; the adapter "
        "is converted to PEFT's form, mlx-lm's kept beside it) or 'auto' (mlx on Apple silicon when installed and the "
        "run is one it trains, else torch).",
    )
    parallelism: Parallelism = Field(
        default="ddp",
        description="'ddp': every process holds the whole model (checkpoints from rank 0). 'fsdp': FSDP2 shards weights, "
        "gradients and optimizer state over the processes (what does not fit one GPU), every rank writes its shard of "
        "each checkpoint (torch.distributed.checkpoint), and a run may resume on another number of processes.",
    )
    report_to: list[str] = Field(
        default_factory=list,
        description=f"Experiment trackers that accelerate logs metrics to, any of {', '.join(REPORTERS)} "
        "(MLflow: mlflow_tracking_uri).",
    )
    mlflow_tracking_uri: str | None = Field(
        default=None,
        description="MLflow tracking server to log the run to, e.g. http://mlflow:5000 (needs pip install "
        "'ft-assets[mlflow]'): params, loss, learning rate, tokens/s and grad norm at every logging step, eval "
        "metrics, and the dataset version and lineage digests as tags, from rank 0 only. Empty: no tracking. A "
        "server that does not answer is a warning, never a failed run.",
    )
    mlflow_experiment: str = Field(
        default="ft-assets", description="MLflow experiment the run is logged under (created when missing)."
    )
    wandb: WandbSettings = Field(default_factory=WandbSettings, description=WandbSettings.__doc__)
    eval_steps: int | None = Field(
        default=None, description="Also compute eval loss every this many steps. Empty: only at the end."
    )
    logging_steps: int = Field(default=10, description="Log one progress line every this many optimizer steps.")
    weight_decay: float = Field(default=0.0, description="AdamW decoupled weight decay.")
    max_grad_norm: float = Field(default=1.0, description="Clip the global gradient norm to this value; 0 disables.")

    @model_validator(mode="before")
    @classmethod
    def _moved_settings(cls, data):
        moved = [name for name in MOVED if isinstance(data, dict) and name in data]
        if moved:
            where = ", ".join(f"{name} is now {MOVED[name]}" for name in moved)
            raise ValueError(
                f"{where}: each objective's settings sit under its name, e.g. dpo: {{beta: 0.1}}, grpo: {{rewards: [...]}}"
            )
        return data

    @field_validator("max_steps", mode="before")
    @classmethod
    def _minus_one_means_unset(cls, value):
        return None if value == -1 else value

    @field_validator("target_modules")
    @classmethod
    def _named_modules(cls, value: list[str]) -> list[str]:
        if any(not name.strip() for name in value):
            raise ValueError(
                f"target_modules {value} has a blank name; list module names such as ['q_proj', 'v_proj'], or none for all"
            )
        return value

    @field_validator("report_to")
    @classmethod
    def _known_reporters(cls, value: list[str]) -> list[str]:
        if "mlflow" in value:
            raise ValueError("report_to: for MLflow set mlflow_tracking_uri (and mlflow_experiment) instead")
        unknown = sorted(set(value) - set(REPORTERS))
        if unknown:
            raise ValueError(f"report_to has unknown tracker(s) {unknown}; use any of {list(REPORTERS)}")
        return value

    @model_validator(mode="after")
    def _check_ranges(self) -> CommonTraining:
        problems = []
        positive = ["lora_r", "lora_alpha", "epochs", "per_device_batch_size", "gradient_accumulation_steps"]
        positive += ["save_steps", "num_processes", "num_nodes", "logging_steps"]
        for name in positive:
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1 (got {getattr(self, name)})")
        for name in ("max_steps", "save_total_limit", "eval_steps"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1 or empty (got {getattr(self, name)})")
        if not 0 <= self.lora_dropout < 1:
            problems.append(f"lora_dropout must be in [0, 1) (got {self.lora_dropout})")
        if self.learning_rate is not None and not self.learning_rate > 0:
            problems.append(f"learning_rate must be > 0 (got {self.learning_rate})")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            problems.append(f"warmup_steps must be >= 0 (got {self.warmup_steps})")
        if not 0 <= self.warmup_ratio < 1:
            problems.append(f"warmup_ratio must be in [0, 1) (got {self.warmup_ratio})")
        if self.min_steps < 0:
            problems.append(f"min_steps must be >= 0 (got {self.min_steps})")
        if self.max_seq_len < 2:
            problems.append(f"max_seq_len must be >= 2 (got {self.max_seq_len})")
        if self.weight_decay < 0 or self.max_grad_norm < 0:
            problems.append("weight_decay and max_grad_norm must be >= 0")
        if problems:
            raise ValueError("invalid training config: " + "; ".join(problems))
        return self

    @property
    def world_size(self) -> int:
        """Processes of the run over all nodes."""
        return self.num_processes * self.num_nodes

    def rows_per_step(self, world_size: int | None = None) -> int:
        """Packed rows one optimizer step consumes over all processes (the global batch)."""
        return self.per_device_batch_size * self.gradient_accumulation_steps * (world_size or self.world_size)

    def steps_per_epoch(self, train_rows: int, world_size: int | None = None) -> int:
        """Optimizer steps in one pass over ``train_rows`` packed rows (the incomplete tail batch is dropped)."""
        steps = train_rows // self.rows_per_step(world_size)
        if steps == 0:
            raise ValueError(
                f"the shards hold {train_rows} train rows but one optimizer step needs {self.rows_per_step(world_size)} "
                "(per_device_batch_size x gradient_accumulation_steps x num_processes); lower them"
            )
        return steps

    def total_steps(self, train_rows: int, world_size: int | None = None) -> int:
        """Optimizer steps of the whole run: ``max_steps`` if set, else epochs x steps per epoch, at least ``min_steps``."""
        per_epoch = self.steps_per_epoch(train_rows, world_size)
        return self.max_steps or max(self.epochs * per_epoch, self.min_steps)

    def resolve(
        self, train_rows: int, cuda_available: bool, objective: Objective, world_size: int | None = None
    ) -> ResolvedTraining:
        """The values a run of ``objective`` on ``train_rows`` packed rows uses for every field left empty."""
        method = self.resolved_method(cuda_available)
        backend = self.resolved_backend(cuda_available, objective)  # what mlx cannot train is said first
        if method == "full" and objective.full_refused:
            raise ValueError(objective.full_refused)
        settings = objective.settings_in(self)
        if settings is not None:
            settings.check(self)
        steps = self.total_steps(train_rows, world_size)
        warmup = self.warmup_steps if self.warmup_steps is not None else round(self.warmup_ratio * steps)
        return ResolvedTraining(
            backend=backend,
            method=method,
            objective=objective.name,
            learning_rate=self.learning_rate or objective.learning_rate or DEFAULT_LEARNING_RATES[method],
            warmup_steps=min(warmup, steps),
            total_steps=steps,
            steps_per_epoch=self.steps_per_epoch(train_rows, world_size),
            rows_per_step=self.rows_per_step(world_size),
        )

    def resolved_method(self, cuda_available: bool) -> Method:
        """The method actually used: the configured one, else qlora on CUDA and lora elsewhere."""
        return self.method or ("qlora" if cuda_available else "lora")

    def resolved_backend(self, cuda_available: bool, objective: Objective) -> str:
        """``torch`` or ``mlx`` (``ft_assets.training.backends``); ``backend: mlx`` for a run mlx cannot do is refused."""
        return backends.resolve(self.backend, objective.name, self.resolved_method(cuda_available), self.world_size)

    def result_fields(self, cuda_available: bool, objective: Objective) -> dict:
        """The fields that change the trained weights of a run of ``objective``, with ``method`` resolved (hashed
        into the run id).

        Of the objectives' settings only ``objective``'s own count, under its name: another objective's
        settings do not change this run, and adding an objective changes no run id. The global batch counts,
        not how it is split: per-device batch, accumulation, processes and nodes become ``rows_per_step``
        (``SPLIT_FIELDS``), so a run resumes on another number of GPUs when the global batch stays the same.
        ``parallelism`` stays: DDP and FSDP checkpoints differ in format.
        """
        fields = self.model_dump(exclude=set(OPERATIONAL_FIELDS) | set(SPLIT_FIELDS) | set(OBJECTIVES))
        fields["rows_per_step"] = self.rows_per_step()
        settings = objective.settings_in(self)
        if settings is not None:
            fields[objective.name] = settings.model_dump()
        fields["method"] = self.resolved_method(cuda_available)
        fields.pop("backend")  # a torch run's id is what it was before the mlx backend
        if self.resolved_backend(cuda_available, objective) == "mlx":
            fields["backend"] = "mlx"
        if fields["method"] == "full":
            for name in ("lora_r", "lora_alpha", "lora_dropout", "target_modules", "lora_experts"):
                fields.pop(name, None)
        for name, default in {**MOE_DEFAULTS, **VISION_DEFAULTS}.items():  # kept: the id it had before they existed
            if fields.get(name, default) == default:
                fields.pop(name, None)
        return fields

    def for_base(self, experts: int) -> "CommonTraining":
        """These settings for a base with ``experts`` experts per layer (0: dense): an unset method is lora for a
        mixture, lora_dropout 0 when LoRA reaches its experts, and qlora is refused there in one line (its experts
        are 3-D parameters bitsandbytes leaves unquantized, and QLoRA's preparation upcasts them to fp32: more memory
        than lora, not less)."""
        if not experts:
            return self
        if self.method == "qlora":
            raise ValueError(
                f"method 'qlora' on a mixture of {experts} experts: bitsandbytes quantizes linear layers only, and the "
                "experts, most of the weights, are fused 3-D parameters it leaves as they are (QLoRA's preparation "
                "would even upcast them to fp32); use method 'lora'"
            )
        if self.backend == "mlx":
            raise ValueError(
                f"backend 'mlx' on a mixture of {experts} experts: the MLX recipe adapts linear layers only, not fused "
                "experts; use backend 'torch' (on a Mac too: it trains on MPS), or 'auto'"
            )
        update = {} if self.method else {"method": "lora"}
        if self.backend == "auto":
            update["backend"] = "torch"  # a Mac's auto would be mlx, which does not train a mixture's experts
        if self.lora_experts and self.lora_dropout > 0:  # PEFT's LoRA on a 3-D parameter (ParamWrapper) has no dropout
            update["lora_dropout"] = 0.0
        return self.model_copy(update=update) if update else self


TrainingConfig = create_model(
    "TrainingConfig",
    __base__=CommonTraining,
    __module__=__name__,
    __doc__="How to fine-tune the base model on the packed shards of one dataset version: the shared settings and "
    "each objective's own, under its name.",
    **{
        objective.name: (
            objective.settings,
            Field(default_factory=objective.settings, description=objective.settings.__doc__),
        )
        for objective in OBJECTIVES.values()
        if objective.settings is not None
    },
)


def validated(fields: dict) -> TrainingConfig:
    """``TrainingConfig(**fields)``, its problems in one ValueError line (``one_line``) instead of pydantic's lines."""
    try:
        return TrainingConfig(**fields)
    except ValidationError as exc:
        raise ValueError(one_line(exc)) from None


def one_line(error: ValidationError) -> str:
    """A pydantic error as one line: each problem as ``key.path: message (got value)``, joined with '; '."""
    problems = []
    for problem in error.errors():
        path, message = [str(part) for part in problem["loc"]], problem["msg"].removeprefix("Value error, ")
        if not path:
            problems.append(message)
            continue
        if message.startswith(path[-1]):  # the validator named its field already: "report_to: for MLflow set ..."
            message = message[len(path[-1]) :].lstrip(": ")
        problems.append(f"{'.'.join(path)}: {message} (got {problem['input']!r})")
    return "; ".join(problems)
