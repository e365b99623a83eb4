"""What one training attempt returns: the final weights' folder and the run's figures (``recipe.train``).

``worker.py`` writes it as JSON for the ``lora_adapter`` asset, which publishes its ``RESULT_STATS``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class TrainingResult:
    output_dir: Path  # final adapter (lora/qlora) or model (full) with tokenizer files, written by rank 0
    method: str
    objective: str  # the objective's name (ft_assets.objectives): "sft", "dpo", "grpo"
    device: str
    steps: int
    train_loss: float | None  # mean of the last `logging_steps` step losses
    eval_loss: (
        float | None
    )  # None without eval shards, or for GRPO (no loss to evaluate); DPO: the DPO loss on the eval pairs
    eval_metrics: dict  # the final eval's figures (DPO: reward accuracy and margin of the model and its reference)
    # the objective's own figures at each log line (GRPO: reward mean/std, KL, completion length)
    figure_history: list[tuple[int, dict]]
    tokens_seen: int  # packed tokens (padding included) over all processes, whole run
    wall_seconds: float  # this attempt, from `started_at` (model load, data, uploads, eval included)
    step_seconds: float  # this attempt, inside forward + backward + optimizer step
    effective_training_fraction: float  # step_seconds / wall_seconds
    resumed_from_step: int | None
    checkpoints: list[str]  # URIs of the complete checkpoints left in the store, oldest first
    loss_history: list[tuple[int, float]]
    restarts: list[dict]  # earlier attempts of this run (start step, last checkpoint, timings)
    bytes_uploaded: int
    resolved: dict  # the settings the run used, defaults filled in (ResolvedTraining.as_dict)
    attn_implementation: str  # the attention backend the run used (``auto`` resolved)
    tokens_per_second: float  # this attempt: packed tokens (padding included) per second of step time, all processes
    mlflow_run_id: str | None  # the MLflow run this run is logged to (None: no tracking, or the tracker did not answer)
    wandb_run_id: str | None = None  # the W&B run (its id is the run id; None: W&B off, or it did not start)
    # the eval headline at each intermediate eval (``eval_steps``; SFT, DPO: eval_loss; GRPO: reward), oldest first
    eval_history: list[tuple[int, float]] = field(default_factory=list)

    def to_json(self) -> dict:
        raw = asdict(self)
        raw["output_dir"] = str(self.output_dir)
        return raw
