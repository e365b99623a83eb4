"""One job per plane, so that each plane runs as its own run and the launcher can route it.

The data plane also materializes ``base_model`` (CPU work: it converts or copies the checkpoint and
gives the data plane its tokenizer) and ``training_plan`` (so the GPU plan is known before training);
the delivery plane also prices the finished training run. Only the training plane needs a GPU.
"""


import dagster as dg


DATA_PLANE = "data_plane"
TRAINING_PLANE = "training_plane"
DELIVERY_PLANE = "delivery_plane"

data_plane = dg.define_asset_job(
    DATA_PLANE,
    selection=dg.AssetSelection.groups("data") | dg.AssetSelection.assets("base_model", "training_plan"),
    description="clean → deduplicate → split → tokenize/pack one dataset version (CPU).",
    tags={"ft/plane": "data"},
)

training_plane = dg.define_asset_job(
    TRAINING_PLANE,
    selection=dg.AssetSelection.assets("lora_adapter"),
    description="fine-tune one dataset version on the GPU pool; retried from the last checkpoint after preemption.",
    tags={
        "ft/plane": "training",
        "ft/pool": "gpu",
        "dagster/max_retries": "3",  # a spot worker can be reclaimed several times in one run
        "dagster/retry_strategy": "ALL_STEPS",
    },
)

delivery_plane = dg.define_asset_job(
    DELIVERY_PLANE,
    selection=dg.AssetSelection.groups("delivery") | dg.AssetSelection.assets("training_cost", "cost_report"),
    description="price the training run (ETH), then merge → GGUF → evaluate (blocking gate) → publish (CPU).",
    tags={"ft/plane": "delivery"},
)

PLANE_JOBS = [data_plane, training_plane, delivery_plane]
