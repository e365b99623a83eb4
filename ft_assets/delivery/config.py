"""Launchpad configuration of the delivery-plane assets; every field has a default and a help text."""

from pydantic import Field

import dagster as dg


class MergeConfig(dg.Config):
    dtype: str = Field(default="float32", description="Precision of the merged weights: float32, bfloat16 or float16 (never 4-bit).")


class GgufConfig(dg.Config):
    qtypes: list[str] = Field(
        default=["f16", "q8_0", "q4_k_m", "q5_k_m", "q6_k"],
        description=(
            "GGUF types to export: f32, f16, q8_0 (llama.cpp's converter) and q4_0, q4_k_m, q5_k_m, q6_k (llama.cpp's quantizer on the "
            "f16 file). [] turns GGUF off: the merged model and the adapter are evaluated and published without one."
        ),
    )
    verify: bool = Field(
        default=True,
        description="Also load each f32/f16/q8_0 file with transformers' GGUF reader and record its logit error against the merged "
        "model (a second reader, not a gate: llama.cpp's check is).",
    )
    ship: str = Field(
        default="auto",
        description=(
            "The GGUF that ships (scored by eval_report, served by serving_smoke, FROM of the Modelfile): one of qtypes, or 'auto' = "
            "the smallest file whose logit error through llama.cpp is within ship_max_rel_error (the most accurate file when none is)."
        ),
    )
    ship_max_rel_error: float = Field(
        default=0.08,
        description=(
            "For ship='auto': the largest relative logit error against the merged model (through llama.cpp) a shipped file may have; "
            "0.08 is the bound a Q8_0 file is held to (gguf_export.TOLERANCES)."
        ),
    )
    system_prompt: str = Field(default="", description="SYSTEM line of the Ollama Modelfile (empty: none).")


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
    max_gguf_drop: float = Field(
        default=0.05,
        description=(
            "Blocking gate: the shipped GGUF, answering through llama.cpp, may score at most this much below the merged model "
            "on the same prompts and metric (absolute, 0.05 = 5 points)."
        ),
    )


class ServingConfig(dg.Config):
    prompts: list[str] = Field(
        default=["Say hello.", "What is the weather in Paris in celsius?"],
        description="One chat completion per prompt is asked of the OpenAI-compatible server on the published GGUF.",
    )
    max_tokens: int = Field(default=32, description="Generation budget per smoke answer.")


class PublishConfig(dg.Config):
    hub_repo_id: str = Field(default="", description="Also push to this Hugging Face Hub repo (needs HF_TOKEN); empty: registry only.")
    hub_dry_run: bool = Field(default=False, description="List what would be pushed to the Hub without uploading.")


class VllmConfig(dg.Config):
    prompts: list[str] = Field(
        default=["Say hello.", "What is the weather in Paris in celsius?"],
        description="One greedy chat completion per prompt from vLLM's OpenAI-compatible server, on the merged model and on "
        "the base + the published adapter (LoRA); each compared with transformers' answer token for token.",
    )
    max_tokens: int = Field(default=32, description="Generation budget per answer.")
