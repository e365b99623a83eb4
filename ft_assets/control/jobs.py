"""One job per plane, so that each plane runs as its own run and the launcher can route it.

The data plane also materializes ``base_model`` (CPU work: it converts or copies the checkpoint and
gives the data plane its tokenizer). The training plane is the ``training`` group: ``training_plan``
first (milliseconds), then ``lora_adapter``, so the plan is made in the run it plans, for the settings
that run's lora_adapter trains with. The delivery plane also prices the finished training run. Only
the training plane needs a GPU. A version trained under several variants runs the training and delivery
planes once per variant (each its own partition), then ``version_comparison`` once for the version.
"""

import dagster as dg

DATA_PLANE = "data_plane"
TRAINING_PLANE = "training_plane"
DELIVERY_PLANE = "delivery_plane"
COMPARISON = "version_comparison_job"

data_plane = dg.define_asset_job(
    DATA_PLANE,
    selection=dg.AssetSelection.groups("data") | dg.AssetSelection.assets("base_model"),
    description="clean → deduplicate → split → tokenize/pack one dataset version (CPU).",
    tags={"ft/plane": "data"},
)

training_plane = dg.define_asset_job(
    TRAINING_PLANE,
    selection=dg.AssetSelection.groups("training"),
    description="plan, then fine-tune one dataset version on the GPU pool; retried from the last checkpoint after preemption.",
    tags={
        "ft/plane": "training",
        "ft/pool": "gpu",
        "dagster/max_retries": "3",  # a spot worker can be reclaimed several times in one run
        "dagster/retry_strategy": "ALL_STEPS",
    },
)

delivery_plane = dg.define_asset_job(
    DELIVERY_PLANE,
    selection=(dg.AssetSelection.groups("delivery") - dg.AssetSelection.assets("version_comparison"))
    | dg.AssetSelection.assets("training_cost", "cost_report"),
    description="price the training run (ETH), then merge → GGUF → evaluate (blocking gate) → publish (CPU).",
    tags={"ft/plane": "delivery"},
)

comparison = dg.define_asset_job(
    COMPARISON,
    selection=dg.AssetSelection.assets("version_comparison"),
    description="the runs of one dataset version (its own and each variant's) side by side, after they delivered (CPU).",
    tags={"ft/plane": "comparison"},
)

PLANE_JOBS = [data_plane, training_plane, delivery_plane, comparison]
