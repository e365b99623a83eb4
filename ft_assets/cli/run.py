"""``ft-assets run``: check the run config, register the dataset version, then run each plane for it.

The order is what makes a rerun cheap and a mistake early: the whole run config is checked against
every plane's job before anything is uploaded (a misspelled key costs a second, not a data plane);
the dataset version is registered (``ft_assets.data.registration``) and the sensor adds its
partition; then each plane up to ``--until`` is skipped when it is current
(``ft_assets.control.freshness``), or submitted through the instance (``launch.launch_plane``:
the code location is loaded once, for the first plane that runs), or with ``--in-process`` executed
in this process (``planes.run_plane``). ``summary`` fills as planes complete, so a failure's
``--json`` still reports them.
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
from ft_assets.cli.planes import run_plane, run_sensor, wait_for_partition
from ft_assets.cli.run_config import config_mistakes, load_run_config, plane_run_config, set_data_executor
from ft_assets.cli.summaries import SUMMARIES, summary_lines
from ft_assets.control.freshness import asset_parents, plane_is_current
from ft_assets.control.jobs import DATA_PLANE, DELIVERY_PLANE, TRAINING_PLANE
from ft_assets.data.registration import RegistrationError, register_dataset
from ft_assets.data.rows import DatasetFileError
from ft_assets.definitions import defs
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


def checked_run_config(args: argparse.Namespace, jobs: dict[str, dg.JobDefinition]) -> dict:
    """The run config file with the command line's settings, every mistake in it refused in one line."""
    run_config = load_run_config(args.config)
    set_data_executor(run_config, args.data_workers, args.ray_address)
    run_config.setdefault("loggers", {"ft_console": {"config": {"verbose": args.verbose}}})
    mistakes = config_mistakes(list(jobs.values()), run_config)
    if mistakes:
        raise CliError(f"run config{' ' + args.config if args.config else ''}: {'; '.join(mistakes)}")
    return run_config


def execute(args: argparse.Namespace, summary: dict) -> dict:
    """Register the dataset version and run each plane; ``summary`` fills as planes complete (for --json on failure)."""
    ensure_home()
    jobs = {plane: defs.resolve_job_def(name) for plane, name in JOBS.items()}
    run_config = checked_run_config(args, jobs)
    store = open_store()
    try:
        key, new = register_dataset(store, args.dataset, args.name, args.version)
    except (DatasetFileError, RegistrationError) as exc:
        raise CliError(str(exc)) from exc
    summary.update(partition=key, store=store.url, dagster_home=os.environ["DAGSTER_HOME"], runs={}, completed=[], skipped=[])
    log(f"dataset version {key} {'registered' if new else 'already registered'} in {store.url}")
    instance = dg.DagsterInstance.get()
    requested = run_sensor(instance, defs, key)
    log(f"dataset_version_sensor: partition {key} present; runs requested: {requested or 'none (already known)'}")
    parents = asset_parents(defs)
    with PlaneLauncher(instance, args.verbose) as launcher:
        for plane in PLANES[: PLANES.index(args.until) + 1]:
            job, config = jobs[plane], plane_run_config(jobs[plane], run_config)
            if not args.force and plane_is_current(store, job, parents, key, config):
                log(f"{plane} plane: already materialized for {key} from the same inputs and settings; skipped (--force reruns it)")
                summary["skipped"].append(plane)
            else:
                wait_for_partition(store, instance, key)
                if args.in_process:
                    summary["runs"][plane] = run_plane(instance, job, plane, key, config)
                else:
                    summary["runs"][plane] = launcher.run(job, plane, key, config)
            summary.update(SUMMARIES[plane](store, key))
            summary["completed"].append(plane)
            if plane == "data":
                log(
                    f"training plan: {summary['gpu_tier']} ({summary['rental_mode']}), ~{summary['estimated_vram_gib']} GiB VRAM, "
                    f"~{summary['estimated_hours']} h, ~${summary['estimated_cost_usd']}"
                )
    return summary


def report(args: argparse.Namespace, summary: dict) -> int:
    print("\n".join(summary_lines(summary)), flush=True)
    if args.json:
        print_json(summary)
    return 0
