"""ft-assets: LLM fine-tuning as Dagster software-defined assets (control, data, training, delivery)."""
