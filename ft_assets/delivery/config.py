"""Launchpad configuration of the delivery-plane assets; every field has a default and a help text."""

from pydantic import Field

import dagster as dg


class MergeConfig(dg.Config):
    dtype: str = Field(default="float32", description="Precision of the merged weights: float32, bfloat16 or float16 (never 4-bit).")


class GgufConfig(dg.Config):
    qtypes: list[str] = Field(default=["f16", "q8_0"], description="GGUF quantization types to export (f32, f16, q8_0, q4_0).")
    verify: bool = Field(default=True, description="Load each GGUF back with transformers and compare logits with the merged model.")
    system_prompt: str = Field(default="", description="SYSTEM line of the Ollama Modelfile (empty: none).")


class EvalConfig(dg.Config):
    metric: str = Field(
        default="exact_match",
        description="Task metric on generations: exact_match, token_f1 or rouge_l. A preference (DPO) run is scored on its "
        "held-out pairs instead: reward_accuracy.",
    )
    max_examples: int = Field(default=100, description="Eval conversations to generate answers for (the first N of the fixed eval split).")
    max_new_tokens: int = Field(default=96, description="Generation budget per answer.")
    min_improvement: float = Field(
        default=0.05,
        description="Blocking gate: the fine-tuned metric (preference runs: reward accuracy) must beat the base's by at least this "
        "much (absolute, 0.05 = 5 points).",
    )


class PublishConfig(dg.Config):
    hub_repo_id: str = Field(default="", description="Also push to this Hugging Face Hub repo (needs HF_TOKEN); empty: registry only.")
    hub_dry_run: bool = Field(default=False, description="List what would be pushed to the Hub without uploading.")
