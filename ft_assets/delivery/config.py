"""Launchpad configuration of the delivery-plane assets; every field has a default and a help text.

An export's asset takes its settings from the export's own module (``ft_assets.delivery.exports``), as a
``dagster.Config`` derived field by field (``export_config``), so the launchpad cannot drift from them.
"""

from pydantic import BaseModel, Field, create_model

import dagster as dg

from ft_assets.delivery.harness import DEFAULT_TASK

# Settings that moved, as an older run config names them -> where they are now (the run-config check says so).
MOVED = {("eval_report", "max_gguf_drop"): "ops.gguf_model.config.max_drop"}


def export_config(settings: type[BaseModel]) -> type[dg.Config]:
    """An export's settings as launchpad config: the same names, types, defaults and help texts."""
    return create_model(
        settings.__name__.removesuffix("Settings") + "Config",
        __base__=dg.Config,
        __doc__=settings.__doc__,
        **{
            name: (field.annotation, Field(default=field.get_default(call_default_factory=True), description=field.description))
            for name, field in settings.model_fields.items()
        },
    )  # fmt: skip


class MergeConfig(dg.Config):
    dtype: str = Field(
        default="float32", description="Precision of the merged weights: float32, bfloat16 or float16 (never 4-bit)."
    )


class EvalConfig(dg.Config):
    metric: str = Field(
        default="exact_match",
        description="Task metric on generations: exact_match, token_f1, rouge_l, or a reward function ('module:function' or "
        "'path/to/file.py:function', TRL's signature; the reference reply is its 'answer' column), whose mean is reported as "
        "reward_mean. A preference (DPO) run is scored on its held-out pairs instead (reward_accuracy), a prompt (GRPO) run by "
        "the mean reward of its own reward functions on the eval prompts (reward_mean).",
    )
    max_examples: int = Field(
        default=100,
        description="Eval conversations (GRPO: prompts) to generate answers for (the first N of the fixed eval split); preference "
        "runs: eval pairs to score.",
    )
    max_new_tokens: int = Field(default=96, description="Generation budget per answer.")
    min_improvement: float = Field(
        default=0.05,
        description="Blocking gate: the fine-tuned metric (preference runs: reward accuracy; GRPO: mean reward) must beat the base's by at least this "
        "much (absolute, 0.05 = 5 points).",
    )


class ServingConfig(dg.Config):
    prompts: list[str] = Field(
        default=["Say hello.", "What is the weather in Paris in celsius?"],
        description="One chat completion per prompt is asked of the OpenAI-compatible server on the published GGUF.",
    )
    max_tokens: int = Field(default=32, description="Generation budget per smoke answer.")


class PublishConfig(dg.Config):
    hub_repo_id: str = Field(
        default="", description="Also push to this Hugging Face Hub repo (needs HF_TOKEN); empty: registry only."
    )
    hub_dry_run: bool = Field(default=False, description="List what would be pushed to the Hub without uploading.")


class VllmConfig(dg.Config):
    prompts: list[str] = Field(
        default=["Say hello.", "What is the weather in Paris in celsius?"],
        description="One greedy chat completion per prompt from vLLM's OpenAI-compatible server, on the merged model and on "
        "the base + the published adapter (LoRA); each compared with transformers' answer token for token.",
    )
    max_tokens: int = Field(default=32, description="Generation budget per answer.")


class GeneralEvalConfig(dg.Config):
    """General-ability tasks (lm-eval) on the base, the merged model and each shipped file; none chosen: the check is off."""

    tasks: list[str] = Field(
        default=[DEFAULT_TASK],
        description=f"lm-eval tasks. Default: {DEFAULT_TASK}, shipped with ft-assets (24 short general-knowledge "
        "questions, scored on the words of each reply; runs offline, in seconds a model for a 135M one on CPU). Add or "
        "replace with names lm-eval knows (gsm8k, ifeval, arc_easy, hellaswag, mmlu, ...: a worker with network or a warm "
        "Hugging Face cache) and/or local task files (path/to/task.yaml: an lm-eval YAML task, e.g. over a local JSONL "
        "with dataset_path: json). Empty ([]): no general-ability check.",
    )
    limit: int = Field(
        default=100, description="Documents per task (lm-eval's limit: the first N); 0: every document of the task."
    )
    seed: int = Field(default=1234, description="lm-eval's seeds (few-shot sampling, generation).")
    batch_size: int = Field(
        default=8,
        description="Documents per forward pass of the base and the merged model (lm-eval's batch_size); a shipped "
        "file's server answers one at a time.",
    )
    num_fewshot: int | None = Field(default=None, description="Few-shot examples per prompt; empty: each task's own.")
    apply_chat_template: bool = Field(
        default=True,
        description="Render each prompt with the model's chat template (lm-eval's apply_chat_template), as a chat fine-tune "
        "is used; the shipped GGUF then answers through /v1/chat/completions with the template in its file.",
    )
    max_drop: float = Field(
        default=0.05,
        description="Gate: a task's metric may fall at most this much below the base's (absolute, 0.05 = 5 points) beyond "
        "stderr_z standard errors of the difference, on the fine-tuned model and on each shipped file.",
    )
    max_drop_per_task: dict[str, float] = Field(
        default={}, description="max_drop for named tasks, e.g. {gsm8k: 0.02}; the others take max_drop."
    )
    stderr_z: float = Field(
        default=1.0,
        description="Standard errors of the difference (lm-eval's stderr of each mean) a drop must exceed beyond max_drop to "
        "count; 0 compares bare means.",
    )
    on_regression: str = Field(
        default="block",
        description="What a regression does: block (nothing is published; the gate names the task) or warn (published, "
        "never promoted to champion in the registry).",
    )
    shipped: bool = Field(
        default=True,
        description="Also run the tasks on each export's shipped file in its runtime (GGUF: llama.cpp's server; "
        "generate_until tasks only).",
    )
