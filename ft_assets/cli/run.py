"""``ft-assets run``: check the run config, register the dataset version, then run each plane for it.

The order is what makes a rerun cheap and a mistake early: the whole run config is checked against
every plane's job before anything is uploaded (a misspelled key costs a second, not a data plane);
the dataset version is registered (``ft_assets.data.registration``) and the sensor adds its
partition; then each plane up to ``--until`` is skipped when it is current
(``ft_assets.control.freshness``), or submitted through the instance (``launch.launch_plane``:
the code location is loaded once, for the first plane that runs), or with ``--in-process`` executed
in this process (``planes.run_plane``). After the data plane the training run is planned here, with
training_plan's own function (``summaries.plan_before_training``), so a run no GPU fits is refused
before the training plane is submitted. ``summary`` fills as planes complete, so a failure's
``--json`` still reports them.

With ``variants:`` in the run config, the data plane runs once for the version and the training and delivery
planes once per variant, each variant its own partition (``<name>@<version>~<variant>``): through the instance
every variant's run of a plane is submitted before any is followed, so the queue runs them side by side up to
the pool's limit (``--in-process``: one after another); a variant that fails is reported and the others go on.
Then ``version_comparison`` puts the version's runs in one table (``summary["comparison"]``).
"""

from __future__ import annotations

import argparse
import os
from importlib.resources import files
from pathlib import Path

import dagster as dg

from ft_assets.cli.launch import PlaneLauncher
from ft_assets.cli.output import CliError, log, print_json
from ft_assets.cli.parser import PLANES
from ft_assets.cli.planes import add_partitions, run_plane, run_sensor, wait_for_partition
from ft_assets.cli.output import PlaneFailed
from ft_assets.cli.run_config import config_mistakes, load_run_config, select_ops, set_data_executor, split_variants
from ft_assets.cli.summaries import SUMMARIES, plan_before_training, plan_line, summary_lines
from ft_assets.control.freshness import asset_parents, plane_is_current
from ft_assets.control.jobs import COMPARISON, DATA_PLANE, DELIVERY_PLANE, TRAINING_PLANE
from ft_assets.data.registration import RegistrationError, register_dataset
from ft_assets.data.rows import DatasetFileError
from ft_assets.definitions import defs
from ft_assets.partitions import DatasetVersion
from ft_assets.targets import TARGET_TAG, TargetError, is_local, parse_target
from ft_assets.targets.credentials import worker_keys
from ft_assets.refs import read_ref
from ft_assets.storage import open_store

JOBS = {"data": DATA_PLANE, "training": TRAINING_PLANE, "delivery": DELIVERY_PLANE}
INSTANCE_CONFIG = files("ft_assets.control") / "dagster.yaml"  # package data: an installed wheel starts too


def ensure_home() -> Path:
    """Default FT_HOME=./var and DAGSTER_HOME=$FT_HOME/dagster_home, seeded with the package's dagster.yaml."""
    ft_home = Path(os.environ.get("FT_HOME") or "var").resolve()
    dagster_home = Path(os.environ.get("DAGSTER_HOME") or ft_home / "dagster_home").resolve()
    os.environ["FT_HOME"], os.environ["DAGSTER_HOME"] = str(ft_home), str(dagster_home)  # Dagster wants absolute paths
    dagster_home.mkdir(parents=True, exist_ok=True)
    target = dagster_home / "dagster.yaml"
    if not target.exists():
        target.write_bytes(INSTANCE_CONFIG.read_bytes())
    return dagster_home


def checked_run_config(args: argparse.Namespace, jobs: dict[str, dg.JobDefinition]) -> tuple[dict, dict[str, dict]]:
    """The run config file with the command line's settings, and each variant's (none without ``variants:``), every
    mistake in them refused in one line."""
    run_config = load_run_config(args.config)
    set_data_executor(run_config, args.data_workers, args.ray_address)
    run_config.setdefault("loggers", {"ft_console": {"config": {"verbose": args.verbose}}})
    where = f"run config{' ' + args.config if args.config else ''}"
    run_config, variants = split_variants(run_config, where)
    mistakes = config_mistakes(list(jobs.values()), run_config)
    for name, config in variants.items():
        mistakes += [f"variants.{name}: {line}" for line in config_mistakes(list(jobs.values()), config)]
    if mistakes:
        raise CliError(f"{where}: {'; '.join(dict.fromkeys(mistakes))}")
    return run_config, variants


def plane_tags(args: argparse.Namespace) -> dict[str, dict]:
    """Each plane's extra run tags: the training plane's GPU target (``--gpu``)."""
    return {"training": {TARGET_TAG: args.gpu}} if getattr(args, "gpu", None) else {}


def checked_target(text: str | None) -> None:
    """``--gpu`` refused in one line before anything runs when it names no usable target."""
    try:
        parse_target(text)
    except TargetError as exc:
        raise CliError(f"--gpu: {exc}") from exc


def checked_worker_keys(args: argparse.Namespace, store) -> None:
    """A run on a GPU target whose workers could get no keys but this host's is refused before anything runs
    (``credentials.worker_keys``), not when its training starts."""
    if is_local(args.gpu) or PLANES.index(args.until) < PLANES.index("training"):
        return
    try:
        worker_keys(os.environ, store)
    except TargetError as exc:
        raise CliError(f"--gpu {args.gpu}: {exc}") from exc


def execute(args: argparse.Namespace, summary: dict) -> dict:
    """Register the dataset version and run each plane; ``summary`` fills as planes complete (for --json on failure)."""
    checked_target(args.gpu)
    ensure_home()
    jobs = {plane: defs.resolve_job_def(name) for plane, name in JOBS.items()}
    run_config, variants = checked_run_config(args, jobs)
    store = open_store()
    checked_worker_keys(args, store)
    try:
        key, new = register_dataset(store, args.dataset, args.name, args.version)
    except (DatasetFileError, RegistrationError) as exc:
        raise CliError(str(exc)) from exc
    summary.update(
        partition=key, store=store.url, dagster_home=os.environ["DAGSTER_HOME"], runs={}, completed=[], skipped=[]
    )
    log(f"dataset version {key} {'registered' if new else 'already registered'} in {store.url}")
    instance = dg.DagsterInstance.get()
    requested = run_sensor(instance, defs, key)
    log(f"dataset_version_sensor: partition {key} present; runs requested: {requested or 'none (already known)'}")
    if variants:
        keys = {DatasetVersion.from_key(key).with_variant(name).key: config for name, config in variants.items()}
        add_partitions(instance, "dataset_version", list(keys))
        summary["variants"] = {name: {"partition": k} for name, k in zip(variants, keys)}
    planes = Planes(args, store, instance, asset_parents(defs), summary)
    with PlaneLauncher(instance, args.verbose, plane_tags(args)) as launcher:
        for plane in PLANES[: PLANES.index(args.until) + 1]:
            if plane == "data" or not variants:
                planes.run(launcher, plane, jobs[plane], {key: run_config})
            else:
                planes.run(launcher, plane, jobs[plane], {k: c for k, c in keys.items() if k not in planes.failed})
            if plane == "data":
                for target, config in ({key: run_config} if not variants else keys).items():
                    planes.update(target, plan_before_training(store, key, config, args.gpu))
                    log(f"training plan{planes.label(target)}: {plan_line(planes.figures(target))}")
        if variants and args.until == "delivery":
            planes.run(launcher, "comparison", defs.resolve_job_def(COMPARISON), {key: run_config}, always=True)
            stats = read_ref(store, key, "version_comparison")["stats"]
            summary.update(comparison=stats["rows"], promoted=stats["promoted"], promoted_why=stats["why"])
    if planes.failed:
        failed = "; ".join(f"{planes.label(k).strip(' ()')}: {exc}" for k, exc in planes.failed.items())
        raise PlaneFailed(f"{len(planes.failed)} of {len(variants)} variants failed: {failed}", "delivery", None)
    return summary


class Planes:
    """Runs one plane for one or several partitions (the version, or each of its variants) and fills the summary:
    the version's figures at the top level, a variant's under ``summary["variants"][name]``."""

    def __init__(self, args, store, instance, parents, summary: dict):
        self.args, self.store, self.instance, self.parents, self.summary = args, store, instance, parents, summary
        self.failed: dict[str, PlaneFailed] = {}

    def label(self, key: str) -> str:
        variant = DatasetVersion.from_key(key).variant
        return f" (variant {variant})" if variant else ""

    def figures(self, key: str) -> dict:
        variant = DatasetVersion.from_key(key).variant
        return self.summary["variants"][variant] if variant else self.summary

    def update(self, key: str, figures: dict) -> None:
        self.figures(key).update(figures)

    def run(
        self, launcher: PlaneLauncher, plane: str, job: dg.JobDefinition, targets: dict[str, dict], always: bool = False
    ) -> None:
        """``job`` for each partition of ``targets`` that is not current (``always``: even then, for a job that reads
        other partitions' outputs, as version_comparison reads the variants')."""
        todo = {}
        for key, run_config in targets.items():
            config = select_ops(job, run_config)
            if not (self.args.force or always) and plane_is_current(self.store, job, self.parents, key, config):
                log(
                    f"{plane} plane: already materialized for {key} from the same inputs and settings; skipped (--force reruns it)"
                )
                self.figures(key).setdefault("skipped", []).append(plane)
            else:
                wait_for_partition(self.store, self.instance, key)
                todo[key] = config
        if self.args.in_process or len(todo) == 1:
            outcome = {}
            for key, config in todo.items():
                try:
                    outcome[key] = (
                        run_plane(self.instance, job, plane, key, config, plane_tags(self.args).get(plane))
                        if self.args.in_process
                        else launcher.run(job, plane, key, config)
                    )  # fmt: skip
                except PlaneFailed as exc:
                    outcome[key] = exc
        else:
            outcome = launcher.run_all(job, plane, todo)
        for key in targets:
            result = outcome.get(key)
            if isinstance(result, PlaneFailed):
                if not DatasetVersion.from_key(key).variant:
                    raise result
                log(f"{plane} plane failed{self.label(key)}: {result}; the other variants go on")
                self.failed[key] = result
                continue
            figures = self.figures(key)
            if result is not None:
                figures.setdefault("runs", {})[plane] = result
            if plane in SUMMARIES:
                figures.update(SUMMARIES[plane](self.store, key))
                figures.setdefault("completed", []).append(plane)


def report(args: argparse.Namespace, summary: dict) -> int:
    print("\n".join(summary_lines(summary)), flush=True)
    if args.json:
        print_json(summary)
    return 0
