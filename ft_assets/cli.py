"""``ft-assets``: register a dataset version and run the planes through the Dagster instance.

``ft-assets run --dataset PATH`` does what the control plane does in production, in one command:
it uploads the file(s) as ``datasets/<name>/<version>/`` with ``_SUCCESS`` written last, evaluates
``dataset_version_sensor`` (which adds the partition), then executes each plane's job for that
partition on the instance in ``DAGSTER_HOME`` — so the runs and materializations show up in the UI
(``make ui``). Runs execute in this process; with the daemon running, the sensor, run queue and
launcher do the same thing unattended.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import shutil
import sys
import traceback
from pathlib import Path

import yaml

PLANES = ("data", "training", "delivery")
REPO_ROOT = Path(__file__).resolve().parents[1]


class CliError(RuntimeError):
    pass


def ensure_home() -> Path:
    """Default FT_HOME=./var and DAGSTER_HOME=$FT_HOME/dagster_home, seeded with the project's dagster.yaml."""
    ft_home = Path(os.environ.get("FT_HOME") or "var").resolve()
    dagster_home = Path(os.environ.get("DAGSTER_HOME") or ft_home / "dagster_home").resolve()
    os.environ["FT_HOME"], os.environ["DAGSTER_HOME"] = str(ft_home), str(dagster_home)  # Dagster wants absolute paths
    dagster_home.mkdir(parents=True, exist_ok=True)
    target = dagster_home / "dagster.yaml"
    if not target.exists() and (REPO_ROOT / "dagster.yaml").is_file():
        shutil.copyfile(REPO_ROOT / "dagster.yaml", target)
    return dagster_home


def content_version(files: list[tuple[str, Path]]) -> str:
    """``v-`` + 12 hex of the sha256 over every (path under the version, content), read in 8 MiB chunks."""
    from ft_assets.storage import CHUNK

    digest = hashlib.sha256()
    for rel, path in files:
        digest.update(rel.encode())
        with open(path, "rb") as handle:
            while chunk := handle.read(CHUNK):
                digest.update(chunk)
    return "v-" + digest.hexdigest()[:12]


def register_dataset(store, spec: str, name: str | None, version: str | None) -> tuple[str, bool]:
    """Stage the input (``ft_assets.data.sources``) and upload it as a dataset version, ``_source.json``
    (for a non-file source) before ``_SUCCESS``, which goes last; returns (partition key, newly registered)."""
    import tempfile

    from ft_assets.data.sources import stage
    from ft_assets.layout import SOURCE_FILE, PartitionLayout
    from ft_assets.partitions import DatasetVersion, InvalidDatasetId
    from ft_assets.storage import join_key

    with tempfile.TemporaryDirectory(prefix="ft-assets-stage-") as work:
        staged = stage(spec, Path(work), store)
        files = list(staged.files)
        if staged.source is not None:
            record = Path(work) / SOURCE_FILE
            record.write_text(json.dumps(staged.source, indent=2, sort_keys=True))
            files.append((SOURCE_FILE, record))
        try:
            target = DatasetVersion(name or staged.name, version or content_version(files))
        except InvalidDatasetId as exc:
            raise CliError(str(exc)) from exc
        keys = PartitionLayout(target)
        uploads = {join_key(keys.inputs, rel): path for rel, path in files}
        marker = keys.success_marker
        if store.exists(marker):
            existing = {k for k in store.list(keys.inputs) if k != marker}
            same = existing == set(uploads) and all(
                store.size(k) == f.stat().st_size and store.get_bytes(k) == f.read_bytes() for k, f in uploads.items()
            )
            if not same:
                raise CliError(
                    f"dataset version {target.key} already exists in {store.uri(keys.inputs)} with different "
                    "content; pass a new --version"
                )
            return target.key, False
        for key, local in uploads.items():
            store.put_file(key, local)
        store.put_bytes(marker, b"")
    return target.key, True


def plane_run_config(job, run_config: dict) -> dict:
    """The part of a whole-pipeline run config that one plane's job accepts.

    The training plan is made for the run that will happen: the training settings given to
    lora_adapter are copied to training_plan (which has the same fields) unless it sets them itself.
    """
    ops = copy.deepcopy(run_config.get("ops", {}))
    training = ops.get("lora_adapter", {}).get("config", {})
    plan = ops.setdefault("training_plan", {}).setdefault("config", {})
    for name, value in training.items():
        plan.setdefault(name, value)
    names = {node.name for node in job.graph.nodes}
    config = {k: v for k, v in run_config.items() if k != "ops"}
    selected = {k: v for k, v in ops.items() if k in names}
    if selected:
        config["ops"] = selected
    return config


def load_run_config(path: str | None) -> dict:
    if not path:
        return {}
    try:
        loaded = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise CliError(f"cannot read run config {path}: {exc}") from exc
    if not isinstance(loaded, dict):
        raise CliError(f"run config {path} must be a mapping with an 'ops:' section")
    unknown = set(loaded) - {"ops", "resources", "execution", "loggers"}
    if unknown:
        raise CliError(f"run config {path}: unknown top-level key(s) {sorted(unknown)}; expected ops, resources, execution or loggers")
    return loaded


def set_data_executor(run_config: dict, workers: int | None, ray_address: str | None) -> None:
    """``--data-workers`` and ``--ray-address`` into the run config's ``data_executor`` resource, over the config file's."""
    settings = {name: value for name, value in (("workers", workers), ("ray_address", ray_address)) if value is not None}
    if settings:
        resource = run_config.setdefault("resources", {}).setdefault("data_executor", {})
        resource.setdefault("config", {}).update(settings)


def worker_count(text: str) -> int:
    """``--data-workers``: 0 (every core) or more."""
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of workers (0: every core, 1: one process)")
    return int(text)


def add_partitions(instance, partitions_def_name: str, keys: list[str], attempts: int = 3) -> None:
    """Add dynamic partitions, tolerating another ``ft-assets run`` adding the same ones at the same moment.

    Two runs started together both see every new version and both insert them; the instance checks for
    existing keys before inserting, so the slower one can hit a unique-constraint error. What matters is
    that the keys exist afterwards.
    """
    for attempt in range(1, attempts + 1):
        try:
            instance.add_dynamic_partitions(partitions_def_name, keys)
            return
        except Exception:  # the storage's own IntegrityError (SQLite, PostgreSQL): look before judging
            missing = set(keys) - set(instance.get_dynamic_partitions(partitions_def_name))
            if not missing:
                return
            if attempt == attempts:
                raise
            keys = sorted(missing)


def run_sensor(instance, defs, partition_key: str) -> list[str]:
    """Evaluate the dataset sensor once, apply its partition requests; returns the keys it requested runs for."""
    import dagster as dg

    from ft_assets.control.sensors import dataset_version_sensor

    context = dg.build_sensor_context(
        instance=instance,
        definitions=defs,
        sensor_name=dataset_version_sensor.name,
        resources={"store": defs.resources["store"]},
    )
    result = dataset_version_sensor(context)
    for request in result.dynamic_partitions_requests or []:
        add_partitions(instance, request.partitions_def_name, list(request.partition_keys))
    requested = [r.partition_key for r in result.run_requests or []]
    if partition_key not in instance.get_dynamic_partitions("dataset_version"):
        raise CliError(f"the sensor did not register {partition_key}")
    return requested


def failure_reason(result) -> str:
    """The most useful line of a failed run: a failed blocking check's description, else the first failure."""
    for event in result.all_events:
        if event.event_type_value == "ASSET_CHECK_EVALUATION":
            evaluation = event.event_specific_data
            if not evaluation.passed:
                return f"blocking check {evaluation.check_name} failed: {evaluation.description}"
    for event in result.all_events:
        if event.is_step_failure:
            error = event.step_failure_data.error
            return f"{event.step_key}: {error_line(error) if error else event.message}"
    for event in result.all_events:  # failed before any step: a resource that could not start (a Ray address)
        if event.is_run_failure and event.event_specific_data.error is not None:
            return error_line(event.event_specific_data.error)
    return f"see run {result.run_id} in the Dagster UI (make ui)"


def error_line(error) -> str:
    """One line for a Dagster error: the innermost cause, a ``Failure``'s own text without its class name."""
    while error.cause is not None and error.cls_name not in ("Failure", "CliError"):
        error = error.cause
    message = error.message.strip()
    if error.cls_name == "Failure":
        message = message.split(": ", 1)[-1]
    return message


def data_summary(store, partition_key: str) -> dict:
    from ft_assets.refs import read_ref

    shards = read_ref(store, partition_key, "tokenized_shards")
    acc = shards["stats"]["accounting"]
    uris = {}
    for asset in ("raw_dataset", "cleaned_dataset", "deduplicated_dataset", "train_eval_split", "tokenized_shards", "base_model"):
        uris[asset] = read_ref(store, partition_key, asset)["uri"]
    return {
        "rows_in": acc["rows_in"],
        "rows_kept": acc["rows_kept"],
        "rows_quarantined": acc["rows_quarantined"],
        "quarantine_reasons": acc["quarantine_reasons"],
        "exact_duplicates": acc["exact_duplicates"],
        "near_duplicates": acc["near_duplicates"],
        "accounting_invariant_holds": acc["invariant_holds"],
        "train_rows": shards["stats"]["train_rows"],
        "eval_rows": shards["stats"]["eval_rows"],
        "tokens": shards["stats"]["tokens"],
        "packing_efficiency": round(shards["stats"]["packing_efficiency"], 6),
        "artifacts": uris,
        **plan_summary(store, partition_key),
    }


def plan_summary(store, partition_key: str) -> dict:
    from ft_assets.refs import read_ref

    plan = read_ref(store, partition_key, "training_plan")["stats"]
    return {
        "gpu_tier": plan["gpu_tier"],
        "rental_mode": plan["rental_mode"],
        "estimated_vram_gib": round(plan["vram_gib"], 2),
        "estimated_hours": round(plan["est_hours"], 4),
        "estimated_cost_usd": round(plan["estimated_cost_usd"], 4),
    }


def training_summary(store, partition_key: str) -> dict:
    from ft_assets.control.assets import measured_throughput
    from ft_assets.control.cost_model import load_cost_model
    from ft_assets.refs import read_ref

    adapter = read_ref(store, partition_key, "lora_adapter")
    stats = adapter["stats"]
    speed = measured_throughput(adapter, read_ref(store, partition_key, "training_plan"), load_cost_model(os.environ.get("FT_COST_MODEL")))
    return {
        **speed.as_dict(),  # tokens_per_second, mfu (None off CUDA), usd_per_million_tokens
        "train_loss": stats["train_loss"],
        "eval_loss": stats["eval_loss"],
        "steps": stats["steps"],
        "resumed_from_step": stats["resumed_from_step"],
        "effective_training_fraction": round(stats["effective_training_fraction"], 4),
        "checkpoints": stats["checkpoints"],
        "training_wall_seconds": round(stats["wall_seconds"], 1),
        "training_method": stats["method"],
        "adapter_uri": adapter["uri"],
    }


def read_model_config(path: Path) -> dict:
    """A transformers config.json, given as the file or the model directory holding it."""
    file = path / "config.json" if path.is_dir() else path
    try:
        config = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CliError(f"cannot read the model config {file}: {exc}") from exc
    if not isinstance(config, dict):
        raise CliError(f"{file} is not a config.json object")
    return config


def cmd_plan(args: argparse.Namespace, partial: dict) -> dict:
    """Peak VRAM, the GPU tier and the estimate for a model, before any data or run exists."""
    from ft_assets.control.cost_model import CostModelError, load_cost_model
    from ft_assets.control.planner import ModelShape, NoGpuFits, flops_per_token, plan_training, throughput

    path = Path(args.model_config)
    try:
        shape = ModelShape.from_config(read_model_config(path), name=(path if path.is_dir() else path.parent).name)
        cost_model = load_cost_model(args.cost_model or os.environ.get("FT_COST_MODEL") or None)
        plan = plan_training(
            shape, args.method, args.seq_len, args.batch, args.gradient_checkpointing, train_tokens=args.tokens,
            cost_model=cost_model, purpose="experiment", attention=args.attn_implementation,
        )  # fmt: skip
    except NoGpuFits as exc:
        raise CliError(str(exc)) from exc
    except (CostModelError, ValueError) as exc:
        raise CliError(f"plan: {exc}") from exc
    flops = flops_per_token(shape, args.method, args.seq_len, args.gradient_checkpointing)
    speed = throughput(plan.tokens_per_second, flops, cost_model.offering(plan.tier), plan.usd_per_hour)
    return {
        "model": shape.name,
        "params": shape.params,
        **plan.vram.as_dict(),  # method, seq_len, micro_batch, attention, the *_gib parts and total_gib
        "breakdown": plan.vram.breakdown(),
        "tier": plan.tier,
        "gpu": plan.gpu,
        "rental_mode": plan.mode,
        "usd_per_hour": plan.usd_per_hour,
        "flops_per_token": flops,
        **speed.as_dict(),
        "train_tokens": plan.total_tokens,
        "est_hours": plan.est_hours,
        "est_cost_usd": plan.est_cost_usd,
        "warnings": list(plan.warnings),
    }


def print_plan(plan: dict) -> None:
    print(
        f"{plan['model']} ({plan['params'] / 1e9:.2f}B params), {plan['method']} at {plan['seq_len']} x {plan['micro_batch']} "
        f"tokens, gradient checkpointing {'on' if plan['grad_checkpointing'] else 'off'}, attention {plan['attention']}\n"
        f"  needs {plan['breakdown']}\n"
        f"  tier {plan['tier']} ({plan['gpu']}, {plan['rental_mode']}, ${plan['usd_per_hour']:.2f}/h): "
        f"~{plan['tokens_per_second']:,.0f} tokens/s at MFU {plan['mfu']:.0%}, ${plan['usd_per_million_tokens']:.2f} per million tokens\n"
        f"  {plan['train_tokens']:,} tokens: ~{plan['est_hours']:.2f} h, ~${plan['est_cost_usd']:.2f}",
        flush=True,
    )
    for warning in plan["warnings"]:
        print(f"  warning: {warning}", flush=True)


def delivery_summary(store, partition_key: str) -> dict:
    from ft_assets.refs import read_ref
    from ft_assets.storage import join_key

    cost = read_ref(store, partition_key, "training_cost")["stats"]
    evaluation = read_ref(store, partition_key, "eval_report")["stats"]
    gguf = read_ref(store, partition_key, "gguf_model")
    published = read_ref(store, partition_key, "published_model")
    adapter = read_ref(store, partition_key, "lora_adapter")
    return {
        "metric_name": evaluation["metric_name"],
        "base_metric": evaluation["base_metric"],
        "finetuned_metric": evaluation["finetuned_metric"],
        "base_eval_loss": evaluation["base_eval_loss"],
        "finetuned_eval_loss": evaluation["finetuned_eval_loss"],
        **preference_figures(evaluation),
        "gguf_metric": evaluation["gguf_metric"],
        "gguf_drop": evaluation["gguf_drop"],
        "gguf_file": evaluation["gguf_file"],
        "gguf_qtype": evaluation["gguf_qtype"],
        "gguf_uri": store.uri(join_key(gguf["prefix"], gguf["stats"]["shipped"])) if gguf["stats"]["shipped"] else None,
        "gguf_reason": gguf["stats"].get("reason"),  # why no GGUF shipped (qtypes: [], a model llama.cpp cannot take); else None
        "published_uri": published["uri"],
        "run_id": adapter["stats"]["run_id"],
        "actual_cost_usd": round(cost["total_usd"], 6),
        "eth_usd": None if cost["eth_usd_per_hour"] is None else round(cost["eth_usd_per_hour"], 4),
        "idle_share": round(cost["idle_share"], 4),
    }


def preference_figures(evaluation: dict) -> dict:
    """Reward accuracy and margin of the tuned model and of its base on the held-out pairs; None for a chat run."""
    from ft_assets.delivery.evaluate import PREFERENCE_METRIC

    if evaluation["metric_name"] != PREFERENCE_METRIC:
        return dict.fromkeys(("reward_accuracy", "reward_margin", "base_reward_accuracy", "base_reward_margin"))
    return {
        "reward_accuracy": evaluation["finetuned_metric"],
        "reward_margin": evaluation["finetuned_reward_margin"],
        "base_reward_accuracy": evaluation["base_metric"],
        "base_reward_margin": evaluation["base_reward_margin"],
    }


class PlaneFailed(CliError):
    """A plane's run failed; says which plane and run, for the one-line error and ``--json``."""

    def __init__(self, message: str, plane: str, run_id: str):
        super().__init__(message)
        self.plane, self.run_id = plane, run_id


def cmd_run(args: argparse.Namespace, summary: dict) -> dict:
    """Register the dataset version and run each plane; ``summary`` fills as planes complete (for --json on failure)."""
    ensure_home()
    import dagster as dg

    from ft_assets.control.jobs import DATA_PLANE, DELIVERY_PLANE, TRAINING_PLANE
    from ft_assets.definitions import defs
    from ft_assets.storage import open_store

    run_config = load_run_config(args.config)
    set_data_executor(run_config, args.data_workers, args.ray_address)
    run_config.setdefault("loggers", {"ft_console": {"config": {"verbose": args.verbose}}})
    store = open_store()
    key, new = register_dataset(store, args.dataset, args.name, args.version)
    summary.update(partition=key, store=store.url, dagster_home=os.environ["DAGSTER_HOME"], runs={}, completed=[], skipped=[])
    log(f"dataset version {key} {'registered' if new else 'already registered'} in {store.url}")
    instance = dg.DagsterInstance.get()
    requested = run_sensor(instance, defs, key)
    log(f"dataset_version_sensor: partition {key} present; runs requested: {requested or 'none (already known)'}")
    jobs = {"data": DATA_PLANE, "training": TRAINING_PLANE, "delivery": DELIVERY_PLANE}
    summaries = {"data": data_summary, "training": training_summary, "delivery": delivery_summary}
    for plane in PLANES[: PLANES.index(args.until) + 1]:
        job = defs.resolve_job_def(jobs[plane])
        config = plane_run_config(job, run_config)
        if not args.force and plane_is_current(store, job, key, config):
            log(f"{plane} plane: already materialized for {key} from the same inputs and settings; skipped (--force reruns it)")
            summary["skipped"].append(plane)
        else:
            wait_for_partition(store, instance, key)
            summary["runs"][plane] = run_plane(instance, job, plane, key, config)
        summary.update(summaries[plane](store, key))
        summary["completed"].append(plane)
        if plane == "data":
            log(
                f"training plan: {summary['gpu_tier']} ({summary['rental_mode']}), ~{summary['estimated_vram_gib']} GiB VRAM, "
                f"~{summary['estimated_hours']} h, ~${summary['estimated_cost_usd']}"
            )
    return summary


def plane_is_current(store, job, key: str, run_config: dict) -> bool:
    """Whether every asset of the plane has an output for ``key`` made with these settings from today's inputs.

    Each reference records the asset's resolved settings and the digests of the references it was
    built from. The plane is current when the settings equal those this run would use (defaults
    filled in by Dagster's own config resolution), the recorded upstream digests equal the outputs in
    the store now, and no upstream asset of the graph was materialized after it.
    """
    from dagster._core.system_config.objects import ResolvedRunConfig

    from ft_assets.refs import has_ref, read_ref

    resolved = ResolvedRunConfig.build(job, run_config)
    graph = job.asset_layer.asset_graph
    for asset_key in job.asset_layer.selected_asset_keys:
        asset = asset_key.to_user_string()
        if not has_ref(store, key, asset):
            return False
        ref = read_ref(store, key, asset)
        node = resolved.ops.get(asset)
        if (ref.get("config") or {}) != ((node.config if node is not None else None) or {}):
            return False
        for name, upstream in ref.get("upstream", {}).items():
            if not has_ref(store, key, name) or read_ref(store, key, name)["digest"] != upstream["digest"]:
                return False
        for parent in graph.get(asset_key).parent_keys:
            name = parent.to_user_string()
            if has_ref(store, key, name) and read_ref(store, key, name)["created_at"] > ref["created_at"]:
                return False
    return True


def wait_for_partition(store, instance, key: str, poll_seconds: float = 2.0) -> None:
    """Wait while another live run holds the partition's lease, saying why, up to the takeover time.

    A lease whose holder is known dead (its run failed or was canceled, or its process is gone from
    this host) is free at once; ``locks`` then lets this run take it over.
    """
    import time

    from ft_assets import locks

    def run_status(run_id: str) -> str | None:
        record = instance.get_run_by_id(run_id)
        return None if record is None else record.status.value

    said = None
    deadline = time.monotonic() + locks.EXPIRY_SECONDS + 2 * poll_seconds
    while (state := locks.read_lease(store, key)) is not None and (busy := locks.busy_reason(state, run_status, time.time())):
        left = deadline - time.monotonic()
        if left <= 0:
            raise CliError(f"{busy.message}; it is still renewing its lease, so it is alive: wait for it, or stop it first")
        if (state.generation, state.owner["run_id"]) != said:
            log(f"{busy.message}; waiting up to {min(busy.frees_in, left):.0f} s for it to free")
            said = (state.generation, state.owner["run_id"])
        time.sleep(poll_seconds)


def run_plane(instance, job, plane: str, key: str, run_config: dict) -> list[str]:
    """Execute one plane's job for a partition; like the daemon's run retries, a preempted run is rerun.

    Returns the run ids (more than one when a preempted run was retried and resumed).
    """
    from ft_assets.training.assets import PREEMPTED_TAG

    retries = int(job.tags.get("dagster/max_retries", 0))
    run_ids = []
    while True:
        log(f"running {job.name} for {key} ...")
        result = job.execute_in_process(
            instance=instance,
            partition_key=key,
            run_config=run_config,
            tags={"ft/dataset": key, "ft/launched-by": "ft-assets-cli"},
            raise_on_error=False,
        )
        run_ids.append(result.run_id)
        if result.success:
            return run_ids
        preempted = instance.get_run_by_id(result.run_id).tags.get(PREEMPTED_TAG) == "true"
        if preempted and len(run_ids) <= retries:
            log(f"{job.name} run {result.run_id} was preempted; retrying ({len(run_ids)}/{retries}), it resumes from its checkpoint")
            continue
        raise PlaneFailed(f"{job.name} failed for {key} (run {result.run_id}): {failure_reason(result)}", plane, result.run_id)


def cmd_lineage(args: argparse.Namespace, partial: dict) -> dict:
    """The chain behind a published model, from its lineage manifest, in the store at hand.

    Every link (the published artifact, each upstream artifact, the checkpoint) must still have the
    manifest digest the lineage recorded, and, unless ``--fast``, every file its manifest lists is
    re-hashed in the store: one flipped byte anywhere is named.
    """
    from datetime import UTC, datetime

    from ft_assets.delivery.publish import LINEAGE_FILE
    from ft_assets.layout import registry_key
    from ft_assets.manifests import ArtifactNotFound, changed_files, read_manifest
    from ft_assets.storage import StoreError, join_key, open_store

    try:
        store_url, key = registry_key(args.uri)
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    store = open_store(store_url or None)
    try:
        published = read_manifest(store, key)
        lineage = store.get_json(join_key(key, LINEAGE_FILE))
    except ArtifactNotFound as exc:
        raise CliError(f"{args.uri}: {exc}") from exc

    def check(asset: str, prefix: str, digest: str, created_at: float | None) -> dict:
        try:
            manifest = read_manifest(store, prefix)
            status = "ok" if manifest.digest == digest else "DIGEST MISMATCH"
            changed = [] if args.fast or status != "ok" else changed_files(store, manifest)
        except (ArtifactNotFound, StoreError):
            status, changed = "missing from the store", []
        if changed:
            status = "CHANGED: " + ", ".join(join_key(prefix, rel) for rel in changed)
        when = datetime.fromtimestamp(created_at, UTC).isoformat(timespec="seconds") if created_at else ""
        return {"asset": asset, "digest": digest, "created_at": when, "key": prefix, "uri": store.uri(prefix), "status": status}

    checkpoint = lineage["training"]["checkpoint"]
    chain = [check("published_model", key, published.digest, published.created_at)]
    chain += [check(a["asset"], a["key"], a["digest"], a["created_at"]) for a in lineage["artifacts"]]
    chain.append(check("checkpoint", checkpoint["key"], checkpoint["digest"], None))
    return {
        "published_uri": store.uri(lineage["published_key"]),
        "dataset_version": lineage["partition"],
        "dataset_source": lineage.get("dataset_source"),
        "base_model": lineage["base_model"],
        "checkpoint": store.uri(checkpoint["key"]),
        "training": {k: lineage["training"][k] for k in ("run_id", "method", "steps", "resumed_from_step")},
        "gguf": lineage["gguf"],
        "eval": lineage["eval"],
        "code_version": lineage["code_version"],
        "chain": chain,
        "files_rehashed": not args.fast,
        "verified": all(link["status"] == "ok" for link in chain),
    }


def print_lineage(report: dict) -> None:
    from ft_assets.data.sources import describe_source

    print(f"{report['published_uri']}")
    print(f"  dataset version {report['dataset_version']}; base model {report['base_model']['model_id']} (sha256 {report['base_model']['source_sha256'][:16]}…)")
    for line in describe_source(report["dataset_source"]):
        print(line)
    for link in report["chain"]:
        print(f"  ← {link['asset']:<21} {link['digest'][:16]}…  {link['created_at'] or '':<25} {link['status']}")
        if link["asset"] == "lora_adapter":
            print(f"      from {report['checkpoint']} ({report['training']['method']}, {report['training']['steps']} steps)")
    for name, info in report["gguf"].items():
        print(f"  GGUF {name}: sha256 {info['sha256'][:16]}…")
    ev = report["eval"]
    print(f"  eval {ev['metric_name']}: base {ev['base_metric']:.3f} → fine-tuned {ev['finetuned_metric']:.3f}; code {report['code_version']}")
    how = "every file re-hashed" if report["files_rehashed"] else "manifests only (--fast)"
    print(f"  lineage {'verified' if report['verified'] else 'NOT verified: see the statuses above'} ({how})")


def log(message: str) -> None:
    print(f"[ft-assets] {message}", file=sys.stderr, flush=True)


def print_summary(summary: dict) -> None:
    lines = [f"dataset version {summary['partition']} (store: {summary['store']})"]
    if "rows_in" in summary:
        lines += [
            f"  rows in {summary['rows_in']}: kept {summary['rows_kept']}, quarantined {summary['rows_quarantined']}, "
            f"exact duplicates {summary['exact_duplicates']}, near duplicates {summary['near_duplicates']} "
            f"(invariant {'holds' if summary['accounting_invariant_holds'] else 'BROKEN'})",
            f"  quarantine reasons: {summary['quarantine_reasons']}",
            f"  train/eval rows {summary['train_rows']}/{summary['eval_rows']}, tokens {summary['tokens']}, "
            f"packing efficiency {summary['packing_efficiency']:.4f}",
            f"  token shards: {summary['artifacts']['tokenized_shards']}",
        ]
    if "estimated_cost_usd" in summary:
        lines.append(
            f"  training plan: {summary['gpu_tier']} ({summary['rental_mode']}), ~{summary['estimated_vram_gib']} GiB VRAM, "
            f"~{summary['estimated_hours']} h, estimated ${summary['estimated_cost_usd']}"
        )
    if "steps" in summary:
        lines += [
            f"  training ({summary['training_method']}): {summary['steps']} steps, train loss {summary['train_loss']:.4f}, "
            f"eval loss {summary['eval_loss']:.4f}, resumed from step {summary['resumed_from_step'] or 0}",
            f"  effective-training fraction {summary['effective_training_fraction']:.1%} of "
            f"{summary['training_wall_seconds']:.0f} s worker wall time; adapter: {summary['adapter_uri']}",
        ]
    if "actual_cost_usd" in summary:
        eth = "n/a" if summary["eth_usd"] is None else f"${summary['eth_usd']:.2f}"
        lines.append(
            f"  training cost: ${summary['actual_cost_usd']:.4f} actual, ETH {eth} per effective training hour "
            f"(idle share {summary['idle_share']:.1%})"
        )
    if "published_uri" in summary:
        lines += [
            f"  eval ({summary['metric_name']}): base {summary['base_metric']:.3f} → fine-tuned {summary['finetuned_metric']:.3f}; "
            f"eval loss {summary['base_eval_loss']:.4f} → {summary['finetuned_eval_loss']:.4f}",
            f"  GGUF: {summary['gguf_uri']} ({summary['gguf_qtype']}, {summary['metric_name']} {summary['gguf_metric']:.3f} in llama.cpp)"
            if summary["gguf_uri"] else f"  GGUF: none ({summary['gguf_reason']})",
            f"  published: {summary['published_uri']} (lineage.json inside)",
        ]
    lines += [
        f"  Dagster instance: {summary['dagster_home']} — open the UI with `make ui` (http://127.0.0.1:3000)",
    ]
    print("\n".join(lines), flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ft-assets", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="register a dataset version and materialize the planes for it")
    run.add_argument(
        "--dataset",
        required=True,
        help="a .jsonl, .json, .csv, .tsv, .parquet or .arrow file (text ones also .gz) or a directory of them, a datasets "
        "save_to_disk directory, hf://owner/name@revision (a Hub dataset, pinned to its commit), s3://bucket/prefix/, "
        "or a mixture spec .yaml",
    )
    run.add_argument("--name", help="dataset name (default: the file, directory or repo name without its extension)")
    run.add_argument("--version", help="dataset version (default: v-<sha256 of the content, 12 hex>)")
    run.add_argument("--until", choices=PLANES, default="delivery", help="last plane to run (default: delivery)")
    run.add_argument("--config", help="Dagster run config YAML (an 'ops:' section keyed by asset name)")
    run.add_argument(
        "--data-workers", type=worker_count, metavar="N",
        help="data plane: shards run at once (default: every core, or every CPU of the Ray cluster; 1: one process)",
    )
    run.add_argument(
        "--ray-address", metavar="ADDR|local",
        help="data plane on Ray: 'local' starts Ray on this machine; ray://head:10001 or head:6379 uses a running cluster",
    )  # fmt: skip
    run.add_argument("--force", action="store_true", help="rerun planes that are already materialized from the same inputs")
    run.add_argument("--json", action="store_true", help="print a JSON summary as the last line of stdout, also on failure")
    run.add_argument("--verbose", action="store_true", help="print every run event with its stack trace")
    lineage = sub.add_parser("lineage", help="print the chain behind a published model, from the store alone")
    lineage.add_argument("uri", help="<store>/registry/<name>/<version>/<run> (a path, s3:// URI, or a key in $FT_STORE)")
    lineage.add_argument("--json", action="store_true", help="print the chain as one JSON object")
    lineage.add_argument("--fast", action="store_true", help="compare manifest digests only; do not re-hash every file")
    lineage.add_argument("--verbose", action="store_true", help="print the stack trace of an unexpected error")
    plan = sub.add_parser("plan", help="peak GPU memory, GPU tier and cost of a fine-tune, from the model's config alone")
    plan.add_argument("--model-config", required=True, help="a transformers config.json, or the model directory holding it")
    plan.add_argument("--method", choices=("lora", "qlora", "full"), required=True)
    plan.add_argument("--seq-len", type=int, required=True, help="tokens per packed row")
    plan.add_argument("--batch", type=int, default=1, help="packed rows per forward pass (default 1)")
    plan.add_argument("--gradient-checkpointing", action="store_true", help="recompute activations in backward")
    plan.add_argument("--attn-implementation", default="auto", choices=("auto", "flash_attention_2", "flex_attention", "sdpa", "eager"))
    plan.add_argument("--tokens", type=int, default=10_000_000, help="training tokens to price, all epochs (default 10M)")
    plan.add_argument("--cost-model", help="YAML overriding the cost model (default: $FT_COST_MODEL, else the defaults)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON, the last line of stdout")
    plan.add_argument("--verbose", action="store_true", help="print the stack trace of an unexpected error")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from ft_assets.data.readers import DatasetFileError
    from ft_assets.storage import StoreError

    command, show = {"run": (cmd_run, print_summary), "lineage": (cmd_lineage, print_lineage), "plan": (cmd_plan, print_plan)}[args.command]
    partial: dict = {}
    try:
        result = command(args, partial)
    except (CliError, StoreError, DatasetFileError) as exc:
        return fail(args, partial, str(exc), exc)
    except Exception as exc:  # noqa: BLE001 - a bug, not a user error: still one line (and JSON), trace with --verbose
        if args.verbose:
            traceback.print_exc()
        return fail(args, partial, f"internal error {type(exc).__name__}: {exc} (rerun with --verbose for the trace)", exc)
    if args.json and args.command == "lineage":
        print(json.dumps(result, sort_keys=True))
        return 0 if result["verified"] else 1
    show(result)
    if args.json:
        print(json.dumps(result, sort_keys=True))
    return 0 if args.command != "lineage" or result["verified"] else 1


def fail(args: argparse.Namespace, partial: dict, message: str, exc: Exception) -> int:
    """The one-line error on stderr; with --json also a JSON object on stdout: what failed, where, what completed."""
    print(f"ft-assets: error: {message}", file=sys.stderr)
    if args.json:
        failure = {
            **partial,
            "error": message,
            "failed_plane": getattr(exc, "plane", None),
            "run_id": getattr(exc, "run_id", None),
            "completed": partial.get("completed", []),
        }
        print(json.dumps(failure, sort_keys=True, default=str))
    return 2


if __name__ == "__main__":
    sys.exit(main())
