"""Artifact references: what assets hand each other instead of data.

A reference names a published artifact (prefix, URI, manifest digest, bytes), carries the figures
of the stage that made it, and records the references it was built from, so the lineage of any
output can be walked back to the dataset version from the store alone. References are small JSON
objects stored at ``layout.of(partition).ref(asset)``: written by the IO manager after each
materialization, read through ``read_ref`` by everything else (the IO manager's inputs, the CLI,
the sensors, the control and delivery assets).

References are JSON in the store, read by processes of other versions (the CLI, sensors, a rerun), so
they stay plain dicts on the wire; their shape is typed here: ``ArtifactRef`` for the envelope and, for
each asset whose figures another module reads, a ``TypedDict`` of those stats (``STATS``). A reader takes
them through ``stats_of``, which names what is missing — a reference written by an older ft-assets — instead
of a ``KeyError`` deep in a summary. ``test_pipeline.py`` checks that every asset writes what its
``STATS`` entry promises, so a renamed field fails there, not in a consumer.
"""

import time
from pathlib import Path
from typing import Any, NotRequired, TypedDict, TypeVar, cast

from ft_assets import layout
from ft_assets.manifests import Manifest, publish_dir
from ft_assets.storage import ObjectStore, StoreError


class RefNotFound(StoreError):
    """An asset has no output (no reference) for a partition yet."""


class RefOutdated(StoreError):
    """A reference lacks stats that this version of ft-assets reads (written by an older one)."""


class ArtifactRef(TypedDict):
    asset: str
    partition: str
    prefix: str  # store-relative key of the artifact
    uri: str
    digest: str  # the manifest's digest
    bytes: int
    files: list[str]
    stats: dict[str, Any]  # the stage's figures; what other modules read of them is typed below
    upstream: dict[str, dict[str, str]]  # input name -> {asset, uri, digest}
    created_at: float


# --- the stats other modules read, per asset (the producer may write more) -----------------------------


class RawStats(TypedDict):
    objective: str  # ft_assets.objectives: what the rows train
    source: dict | None  # where the version came from (Hub commit, S3 prefix, mixture components); None: files


class Accounting(TypedDict):  # ft_assets.data.accounting.RowAccounting.as_dict
    rows_in: int
    rows_kept: int | None
    rows_quarantined: int
    quarantine_reasons: dict[str, int]
    exact_duplicates: int
    near_duplicates: int
    invariant_holds: bool


class ShardStats(TypedDict):
    objective: str
    seq_len: int
    train_rows: int  # kept rows (examples, pairs or prompts) of the train split
    eval_rows: int
    train_packed_rows: int  # what one epoch's steps are counted over
    tokens: int
    packing_efficiency: float
    accounting: Accounting


class BaseModelStats(TypedDict):
    model_id: str
    source: str
    source_sha256: str
    parameters: NotRequired[int]
    chat_template: NotRequired[str | None]


class PlanStats(TypedDict):
    gpu_tier: str | None  # None: nothing to rent (no GPU fits, or delivery only)
    rental_mode: str
    accelerator: str  # SkyPilot's name of the tier's card ("" when the offering has none)
    vram_gib: float
    est_hours: float
    estimated_cost_usd: float
    flops_per_token: float
    warnings: list[str]
    gpus: int  # num_processes x num_nodes of the settings planned for
    training_config: dict  # the TrainingConfig planned for (lora_adapter's), as model_dump() writes it
    resolved: dict  # ResolvedTraining.as_dict(): the method, steps and learning rate the run uses
    planned_for: str  # whose settings: the lora_adapter of a run, or its defaults (a preview)


class AdapterStats(TypedDict):
    run_id: str
    method: str
    objective: str
    device: str  # "cpu", "cuda", "cuda x4"
    steps: int
    train_loss: float | None
    eval_loss: float | None
    resumed_from_step: int | None
    effective_training_fraction: float
    checkpoints: list[str]
    wall_seconds: float
    step_seconds: float
    tokens_seen: int
    tokens_per_second: float
    mlflow_run_id: str | None
    restarts: list[dict]
    worker_image: dict  # ft_assets.training.worker_image: the image's digest (None outside one, with the reason)
    gpu_target: str  # where it trained: "local", or a GPU target (ft_assets.targets) such as ssh://host
    attempts: list[dict]  # a GPU target's worker attempts: outcome, seconds, exit code, the machine ([] locally)
    worker_code: NotRequired[
        dict | None
    ]  # the wheel a GPU target's worker installed (ft_assets.targets.code); None: none


class CostStats(TypedDict):
    run_id: str
    total_usd: float
    eth_usd_per_hour: float | None
    idle_share: float
    estimated_cost_usd: float
    estimated_hours: float


class ExportStats(TypedDict):  # every export's asset (ft_assets.delivery.exports: gguf_model, ...)
    export: str  # the export's name: "gguf"
    files: dict[str, dict]  # file name -> its variant (GGUF: qtype), bytes, sha256 and its runtime's figures
    shipped: str | None  # the file that ships; None: none (``reason``)
    reason: str | None  # why none ships, in one line (turned off, refused by its converter or runtime)
    required: bool  # a refusal fails the run
    max_drop: float  # what its gate allows below the merged model
    companions: NotRequired[list[str]]  # files that travel with the shipped one (a VLM GGUF's projector)


class EvalStats(TypedDict):
    metric_name: str
    base_metric: float
    finetuned_metric: float
    base_eval_loss: float | None
    finetuned_eval_loss: float | None
    # export name -> its gate verdict (ft_assets.delivery.gate.ExportVerdict): file, metric, reason
    exports: dict[str, dict]
    general: NotRequired[dict | None]  # general_eval's verdict (delivery.regression.GeneralVerdict.as_dict)


STATS: dict[str, type] = {
    "raw_dataset": RawStats,
    "tokenized_shards": ShardStats,
    "base_model": BaseModelStats,
    "training_plan": PlanStats,
    "lora_adapter": AdapterStats,
    "training_cost": CostStats,
    "eval_report": EvalStats,
}  # every export's asset: ExportStats
Stats = TypeVar("Stats")


def stats_of(ref: dict, kind: type[Stats]) -> Stats:
    """``ref``'s stats as ``kind`` (one of ``STATS``' types); ``RefOutdated`` names the fields it lacks."""
    missing = sorted(key for key in kind.__required_keys__ if key not in ref["stats"])  # type: ignore[attr-defined]
    if missing:
        raise RefOutdated(
            f"{ref['asset']} of {ref['partition']} ({ref['uri']}) has no {', '.join(missing)} in its stats: it was written by an "
            f"older ft-assets; materialize {ref['asset']} again"
        )
    return cast(Stats, ref["stats"])


def make_ref(
    store: ObjectStore,
    asset: str,
    partition: str,
    manifest: Manifest,
    stats: dict,
    upstream: dict[str, dict] | None = None,
    **extra,
) -> ArtifactRef:
    return {
        "asset": asset,
        "partition": partition,
        "prefix": manifest.prefix,
        "uri": store.uri(manifest.prefix),
        "digest": manifest.digest,
        "bytes": manifest.total_bytes,
        "files": sorted(manifest.files),
        "stats": stats,
        "upstream": {
            name: {"asset": ref["asset"], "uri": ref["uri"], "digest": ref["digest"]}
            for name, ref in (upstream or {}).items()
        },
        "created_at": time.time(),
        **extra,
    }


def publish(
    store: ObjectStore,
    asset: str,
    partition: str,
    prefix: str,
    local_dir: Path,
    stats: dict,
    upstream: dict[str, dict] | None = None,
    parts: dict[str, dict] | None = None,
    **extra,
) -> ArtifactRef:
    """Publish ``local_dir`` (and ``parts``, files already written under ``prefix``) as an artifact at ``prefix``
    (manifest last) and return its reference."""
    manifest = publish_dir(store, prefix, local_dir, meta={"asset": asset, "partition": partition}, parts=parts)
    return make_ref(store, asset, partition, manifest, stats, upstream, **extra)


def write_ref(store: ObjectStore, partition: str, asset: str, ref: dict) -> None:
    store.put_json(layout.of(partition).ref(asset), ref)


def has_ref(store: ObjectStore, partition: str, asset: str) -> bool:
    return store.exists(layout.of(partition).ref(asset))


def read_ref(store: ObjectStore, partition: str, asset: str) -> ArtifactRef:
    """The reference ``asset`` published for ``partition``; ``RefNotFound`` says what to materialize."""
    key = layout.of(partition).ref(asset)
    if not store.exists(key):
        raise RefNotFound(f"{asset} has no output for partition {partition} ({store.uri(key)}): materialize it first")
    return store.get_json(key)
