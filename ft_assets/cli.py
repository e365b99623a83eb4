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


def dataset_files(path: Path) -> list[Path]:
    from ft_assets.data.readers import SUPPORTED_SUFFIXES, is_data_file

    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and is_data_file(p.name))
        if files:
            return files
        raise CliError(f"{path} holds no data files ({', '.join(SUPPORTED_SUFFIXES)})")
    raise CliError(f"dataset path {path} does not exist")


def default_name(path: Path) -> str:
    name = path.name
    for suffix in (".gz", ".jsonl", ".parquet"):
        name = name.removesuffix(suffix)
    return "".join(c if c.isalnum() or c in "._-" else "-" for c in name).strip("-._") or "dataset"


def content_version(files: list[Path], root: Path) -> str:
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.relative_to(root).as_posix().encode() if path != root else path.name.encode())
        digest.update(path.read_bytes())
    return "v-" + digest.hexdigest()[:12]


def register_dataset(store, path: Path, name: str | None, version: str | None) -> tuple[str, bool]:
    """Upload the files as a dataset version (``_SUCCESS`` last); returns (partition key, newly registered)."""
    from ft_assets.layout import PartitionLayout
    from ft_assets.partitions import DatasetVersion, InvalidDatasetId
    from ft_assets.storage import join_key

    files = dataset_files(path)
    root = path if path.is_dir() else path.parent
    try:
        target = DatasetVersion(name or default_name(path), version or content_version(files, root))
    except InvalidDatasetId as exc:
        raise CliError(str(exc)) from exc
    keys = PartitionLayout(target)
    uploads = {join_key(keys.inputs, f.relative_to(root).as_posix()): f for f in files}
    marker = keys.success_marker
    if store.exists(marker):
        existing = {k for k in store.list(keys.inputs) if k != marker}
        same = existing == set(uploads) and all(store.get_bytes(k) == f.read_bytes() for k, f in uploads.items())
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
        raise CliError(f"run config {path}: unknown top-level key(s) {sorted(unknown)}; expected 'ops:'")
    return loaded


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
            message = error.message.strip() if error else event.message
            return f"{event.step_key}: {message}"
    return "see the run in the Dagster UI"


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
    from ft_assets.refs import read_ref

    adapter = read_ref(store, partition_key, "lora_adapter")
    stats = adapter["stats"]
    return {
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
        "gguf_metric": evaluation["gguf_metric"],
        "gguf_drop": evaluation["gguf_drop"],
        "gguf_file": evaluation["gguf_file"],
        "gguf_qtype": evaluation["gguf_qtype"],
        "gguf_uri": store.uri(join_key(gguf["prefix"], gguf["stats"]["shipped"])),
        "published_uri": published["uri"],
        "run_id": adapter["stats"]["run_id"],
        "actual_cost_usd": round(cost["total_usd"], 6),
        "eth_usd": None if cost["eth_usd_per_hour"] is None else round(cost["eth_usd_per_hour"], 4),
        "idle_share": round(cost["idle_share"], 4),
    }


def cmd_run(args: argparse.Namespace) -> dict:
    ensure_home()
    import dagster as dg

    from ft_assets.control.jobs import DATA_PLANE, DELIVERY_PLANE, TRAINING_PLANE
    from ft_assets.definitions import defs
    from ft_assets.storage import open_store

    run_config = load_run_config(args.config)
    run_config.setdefault("loggers", {"console": {"config": {"log_level": "INFO"}}})
    store = open_store()
    key, new = register_dataset(store, Path(args.dataset), args.name, args.version)
    log(f"dataset version {key} {'registered' if new else 'already registered'} in {store.url}")
    instance = dg.DagsterInstance.get()
    requested = run_sensor(instance, defs, key)
    log(f"dataset_version_sensor: partition {key} present; runs requested: {requested or 'none (already known)'}")
    summary: dict = {"partition": key, "store": store.url, "dagster_home": os.environ["DAGSTER_HOME"], "runs": {}}
    jobs = {"data": DATA_PLANE, "training": TRAINING_PLANE, "delivery": DELIVERY_PLANE}
    summaries = {"data": data_summary, "training": training_summary, "delivery": delivery_summary}
    for plane in PLANES[: PLANES.index(args.until) + 1]:
        if plane not in jobs:
            log(f"the {plane} plane is not available in this version of ft-assets; stopping here")
            break
        job = defs.resolve_job_def(jobs[plane])
        summary["runs"][plane] = run_plane(instance, job, key, plane_run_config(job, run_config))
        summary.update(summaries[plane](store, key))
        if plane == "data":
            log(
                f"training plan: {summary['gpu_tier']} ({summary['rental_mode']}), ~{summary['estimated_vram_gib']} GiB VRAM, "
                f"~{summary['estimated_hours']} h, ~${summary['estimated_cost_usd']}"
            )
    return summary


def run_plane(instance, job, key: str, run_config: dict) -> list[str]:
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
        raise CliError(f"{job.name} failed for {key} (run {result.run_id}): {failure_reason(result)}")


def cmd_lineage(args: argparse.Namespace) -> dict:
    """The chain behind a published model, from its lineage manifest, each link checked against its manifest."""
    from datetime import UTC, datetime

    from ft_assets.delivery.publish import LINEAGE_FILE
    from ft_assets.layout import registry_key
    from ft_assets.manifests import ArtifactNotFound, read_manifest
    from ft_assets.storage import StoreError, join_key, open_store

    try:
        store_url, key = registry_key(args.uri)
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    store = open_store(store_url or None)
    try:
        read_manifest(store, key)
        lineage = store.get_json(join_key(key, LINEAGE_FILE))
    except ArtifactNotFound as exc:
        raise CliError(f"{args.uri}: {exc}") from exc
    chain = []
    for artifact in lineage["artifacts"]:
        prefix = artifact["uri"][len(store.url) :].lstrip("/") if artifact["uri"].startswith(store.url) else artifact["uri"]
        try:
            status = "ok" if read_manifest(store, prefix).digest == artifact["digest"] else "DIGEST MISMATCH"
        except (ArtifactNotFound, StoreError):
            status = "missing from the store"
        chain.append(
            {
                "asset": artifact["asset"],
                "digest": artifact["digest"],
                "created_at": datetime.fromtimestamp(artifact["created_at"], UTC).isoformat(timespec="seconds"),
                "uri": artifact["uri"],
                "status": status,
            }
        )
    return {
        "published_uri": lineage["published_uri"],
        "dataset_version": lineage["partition"],
        "base_model": lineage["base_model"],
        "checkpoint": lineage["training"]["checkpoint"],
        "training": {k: lineage["training"][k] for k in ("run_id", "method", "steps", "resumed_from_step")},
        "gguf": lineage["gguf"],
        "eval": lineage["eval"],
        "code_version": lineage["code_version"],
        "chain": chain,
        "verified": all(link["status"] == "ok" for link in chain),
    }


def print_lineage(report: dict) -> None:
    print(f"{report['published_uri']}")
    print(f"  dataset version {report['dataset_version']}; base model {report['base_model']['model_id']} (sha256 {report['base_model']['source_sha256'][:16]}…)")
    for link in report["chain"]:
        print(f"  ← {link['asset']:<21} {link['digest'][:16]}…  {link['created_at']}  {link['status']}")
        if link["asset"] == "lora_adapter":
            print(f"      checkpoint {report['checkpoint']} ({report['training']['method']}, {report['training']['steps']} steps)")
    for name, info in report["gguf"].items():
        print(f"  GGUF {name}: sha256 {info['sha256'][:16]}…")
    ev = report["eval"]
    print(f"  eval {ev['metric_name']}: base {ev['base_metric']:.3f} → fine-tuned {ev['finetuned_metric']:.3f}; code {report['code_version']}")
    print(f"  lineage {'verified against every manifest' if report['verified'] else 'NOT verified: see the statuses above'}")


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
            f"  GGUF: {summary['gguf_uri']} ({summary['gguf_qtype']}, {summary['metric_name']} {summary['gguf_metric']:.3f} in llama.cpp)",
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
    run.add_argument("--dataset", required=True, help="a .jsonl/.jsonl.gz/.parquet file or a directory of them")
    run.add_argument("--name", help="dataset name (default: the file or directory name)")
    run.add_argument("--version", help="dataset version (default: v-<sha256 of the content, 12 hex>)")
    run.add_argument("--until", choices=PLANES, default="delivery", help="last plane to run (default: delivery)")
    run.add_argument("--config", help="Dagster run config YAML (an 'ops:' section keyed by asset name)")
    run.add_argument("--json", action="store_true", help="print a JSON summary as the last line of stdout")
    lineage = sub.add_parser("lineage", help="print the chain behind a published model, from the store alone")
    lineage.add_argument("uri", help="<store>/registry/<name>/<version>/<run> (a path, s3:// URI, or a key in $FT_STORE)")
    lineage.add_argument("--json", action="store_true", help="print the chain as one JSON object")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from ft_assets.data.readers import DatasetFileError
    from ft_assets.storage import StoreError

    command, show = {"run": (cmd_run, print_summary), "lineage": (cmd_lineage, print_lineage)}[args.command]
    try:
        result = command(args)
    except (CliError, StoreError, DatasetFileError) as exc:
        print(f"ft-assets: error: {exc}", file=sys.stderr)
        return 2
    if args.json and args.command == "lineage":
        print(json.dumps(result, sort_keys=True))
        return 0 if result["verified"] else 1
    show(result)
    if args.json:
        print(json.dumps(result, sort_keys=True))
    return 0 if args.command == "run" or result["verified"] else 1


if __name__ == "__main__":
    sys.exit(main())
