"""A plane's run submitted through the Dagster instance, as the UI submits it, and followed to its end.

``ft-assets run`` creates each plane's run against the ``ft_assets`` code location, loaded as
workspace.yaml loads it (``ft_assets.definitions`` in a code server process). So the run is attached
to its job in the UI, sits on the timeline, can be re-executed from there, and goes through the
instance's run coordinator and launcher: in this project ``PoolRunCoordinator`` tags it with its pool
and ``PoolRunLauncher`` hands it to that pool's launcher, the training run to the ``gpu`` pool's.

A queued coordinator needs ``dagster-daemon`` to take runs off the queue; without one heartbeating, a
submitted run would wait forever. The command then says so and hands each run to the instance's
launcher itself (the queue's limits do not apply; the partition lease in the store still keeps two
runs of one version apart, ``ft_assets.locks``). It follows the run through the event log and prints
its messages as a run in its own process would (``console.entry_line``). A failed run is retried the
way the instance does it: with the daemon, the daemon's run retries make the retry and the command
follows it; without, the command makes the same re-execution for a preempted run.

What it costs over ``--in-process`` (one process for everything): the code server and each run's
worker import ``ft_assets.definitions`` (torch, transformers, Dagster) again, about 5 s of CPU each
(``/usr/bin/time python -c "import ft_assets.definitions"``; docs/validation/planner-calibration.md). The output of those processes (library progress bars, warnings, the worker's own copy of
the log) goes to ``$DAGSTER_HOME/logs/ft-assets-run.log``, not to the terminal.

Dagster exports no public name for a workspace loaded from a module (``WorkspaceProcessContext``,
``ModuleTarget``: what ``dagster dev`` and the daemon use), nor for the run-retry tags and strategies;
they are imported from its modules. Dagster is pinned (1.13.27); test_production.py,
test_training_asset.py and test_ui.py fail if they change.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path
from types import MappingProxyType

import dagster as dg
from dagster._core.execution.plan.resume_retry import ReexecutionStrategy
from dagster._core.storage.tags import AUTO_RETRY_RUN_ID_TAG, RETRY_NUMBER_TAG, RETRY_STRATEGY_TAG, WILL_RETRY_TAG
from dagster._core.workspace.context import WorkspaceProcessContext
from dagster._core.workspace.load_target import ModuleTarget

from ft_assets.cli.output import CliError, PlaneFailed, log
from ft_assets.cli.planes import failure_reason
from ft_assets.cli.run_config import steps_in_one_process
from ft_assets.control.automation import CLI_TAGS
from ft_assets.console import entry_line
from ft_assets.training.assets import PREEMPTED_TAG

CODE_LOCATION = "ft_assets"  # workspace.yaml's location_name: the UI finds the runs' jobs under it
DEFINITIONS = "ft_assets.definitions"
QUEUE_DAEMON = "QUEUED_RUN_COORDINATOR"  # Dagster's name for the daemon that takes runs off the queue
DAEMON_SILENCE_S = 90.0  # daemons beat every 30 s: three beats missed, no daemon
RETRY_WAIT_S = 60.0  # the daemon's run retries look for failed runs every 5 s
POLL_S = 0.5  # event log and run status; a step takes seconds at least


@contextmanager
def output_to(path: Path) -> Iterator[None]:
    """File descriptors 1 and 2 to ``path`` (appended) for the block: processes started in it keep them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "ab") as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in zip((1, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)


def code_server_log() -> Path:
    return Path(os.environ["DAGSTER_HOME"]) / "logs" / "ft-assets-run.log"


@contextmanager
def code_location(instance: dg.DagsterInstance) -> Iterator[WorkspaceProcessContext]:
    """The ``ft_assets`` code location in a code server process whose output (and its runs') goes to a file."""
    target = ModuleTarget(module_name=DEFINITIONS, attribute=None, working_directory=None, location_name=CODE_LOCATION)
    with output_to(code_server_log()):
        context = WorkspaceProcessContext(instance, target)
    with context:
        error = context.create_request_context().get_code_location_error(CODE_LOCATION)
        if error is not None:
            raise CliError(
                f"cannot load the code location {CODE_LOCATION} ({DEFINITIONS}): {error.message.strip()} (see {code_server_log()})"
            )
        yield context


def daemon_running(instance: dg.DagsterInstance) -> bool:
    beat = instance.get_daemon_heartbeats().get(QUEUE_DAEMON)
    return beat is not None and time.time() - beat.timestamp < DAEMON_SILENCE_S


def launches_directly(instance: dg.DagsterInstance) -> bool:
    """True when a submitted run would wait forever: a queued coordinator and no daemon to dequeue it."""
    return isinstance(instance.run_coordinator, dg.QueuedRunCoordinator) and not daemon_running(instance)


def direct_launch_notice(instance: dg.DagsterInstance) -> str:
    launcher = type(instance.run_launcher).__name__
    return (
        f"no dagster-daemon is running for {os.environ['DAGSTER_HOME']}, so its run queue would hold the runs: launching each "
        f"with the instance's launcher ({launcher}) directly; start `dagster-daemon run -w workspace.yaml` to queue them instead"
    )


def start(instance: dg.DagsterInstance, context: WorkspaceProcessContext, run: dg.DagsterRun, plane: str) -> None:
    """Submit the run to the coordinator, or hand it to the launcher when no daemon would take it off the queue."""
    direct = launches_directly(instance)
    log(
        f"{'launching' if direct else 'submitting'} {run.job_name} run {run.run_id} for {run.tags['dagster/partition']} ..."
    )
    workspace = context.create_request_context()
    try:
        if direct:
            instance.launch_run(run.run_id, workspace)
        else:
            instance.submit_run(run.run_id, workspace)
    except Exception as exc:  # the instance has written the failure into the run's log already
        raise PlaneFailed(
            f"{run.job_name} run {run.run_id} could not start: {str(exc).strip().splitlines()[0]}", plane, run.run_id
        ) from exc


def follow(instance: dg.DagsterInstance, run_id: str, verbose: bool) -> dg.DagsterRun:
    """Print the run's event log as it grows, until the run has finished; the finished run."""
    cursor, said_queued = None, False
    while True:
        run = instance.get_run_by_id(run_id)  # read before the events: once finished, its last events are in
        while True:
            batch = instance.get_records_for_run(run_id, cursor=cursor, limit=500)
            for record in batch.records:
                line = entry_line(record.event_log_entry, verbose)
                if line is not None:
                    print(line, file=sys.stderr, flush=True)
            cursor = batch.cursor
            if not batch.has_more:
                break
        if run.is_finished:
            return run
        if run.status == dg.DagsterRunStatus.QUEUED:
            if not daemon_running(instance):
                raise CliError(
                    f"run {run_id} is queued but no dagster-daemon is running any more: start it again, or cancel the run in the UI"
                )
            if not said_queued:
                log(
                    f"run {run_id} is queued; the daemon launches it when its pool ({run.tags.get('ft/pool', '?')}) has a free slot"
                )
                said_queued = True
        time.sleep(POLL_S)


def create_run(
    instance: dg.DagsterInstance, context: WorkspaceProcessContext, job: dg.JobDefinition, key: str, run_config: dict,
    tags: Mapping[str, str] = MappingProxyType({}),
) -> dg.DagsterRun:  # fmt: skip
    """A run of ``job`` for partition ``key`` whose origin is the code location's job (as the UI creates one), with
    ``tags`` besides the job's own (the training plane's GPU target)."""
    remote_job = remote(context, job.name)
    return instance.create_run_for_job(
        job_def=job,
        run_config=run_config,
        tags={**job.tags, "dagster/partition": key, "ft/dataset": key, **CLI_TAGS, **tags},
        remote_job_origin=remote_job.get_remote_origin(),
        job_code_origin=remote_job.get_python_origin(),
    )


def remote(context: WorkspaceProcessContext, job_name: str):
    location = context.create_request_context().get_code_location(CODE_LOCATION)
    return next(iter(location.get_repositories().values())).get_full_job(job_name)


def retry(
    instance: dg.DagsterInstance, context: WorkspaceProcessContext, failed: dg.DagsterRun, number: int
) -> dg.DagsterRun:
    """Re-execute a failed run as the daemon's run retries do: the same tags and config, linked to it in the UI."""
    workspace = context.create_request_context()
    strategy = ReexecutionStrategy[failed.tags.get(RETRY_STRATEGY_TAG, ReexecutionStrategy.FROM_FAILURE.name)]
    new = instance.create_reexecuted_run(
        request_context=workspace,
        parent_run=failed,
        code_location=workspace.get_code_location(CODE_LOCATION),
        remote_job=remote(context, failed.job_name),
        strategy=strategy,
        extra_tags={RETRY_NUMBER_TAG: str(number)},
        use_parent_run_tags=True,
    )
    instance.add_run_tags(
        failed.run_id, {AUTO_RETRY_RUN_ID_TAG: new.run_id}
    )  # a daemon started later does not retry it again
    return new


def daemon_retry(instance: dg.DagsterInstance, failed: dg.DagsterRun) -> str | None:
    """The id of the retry the daemon makes of ``failed``, or None when it makes none."""
    if not (daemon_running(instance) and instance.run_retries_enabled):
        return None
    deadline = time.monotonic() + RETRY_WAIT_S
    while time.monotonic() < deadline:
        tags = instance.get_run_by_id(failed.run_id).tags
        if tags.get(WILL_RETRY_TAG) == "false":
            return None
        if AUTO_RETRY_RUN_ID_TAG in tags:
            return tags[AUTO_RETRY_RUN_ID_TAG]
        time.sleep(POLL_S)
    return None


def launch_plane(
    instance: dg.DagsterInstance,
    context: WorkspaceProcessContext,
    job: dg.JobDefinition,
    plane: str,
    key: str,
    run_config: dict,
    verbose: bool,
    tags: Mapping[str, str] = MappingProxyType({}),
) -> list[str]:
    """Submit one plane's run, follow it, follow or make its retries; the run ids (several after retries)."""
    return finish_plane(
        instance, context, job, plane, key, submit_plane(instance, context, job, plane, key, run_config, tags), verbose
    )


def submit_plane(
    instance: dg.DagsterInstance, context: WorkspaceProcessContext, job: dg.JobDefinition, plane: str, key: str,
    run_config: dict, tags: Mapping[str, str] = MappingProxyType({}),
) -> dg.DagsterRun:  # fmt: skip
    """Create and submit (or launch) one plane's run for ``key``; it runs in its own process from here."""
    run = create_run(instance, context, job, key, run_config, tags)
    start(instance, context, run, plane)
    return run


def finish_plane(
    instance: dg.DagsterInstance, context: WorkspaceProcessContext, job: dg.JobDefinition, plane: str, key: str,
    run: dg.DagsterRun, verbose: bool,
) -> list[str]:  # fmt: skip
    """Follow a submitted run to its end, following or making its retries; the run ids, or ``PlaneFailed``."""
    retries = int(job.tags.get("dagster/max_retries", 0))
    run_ids = [run.run_id]
    while True:
        run = follow(instance, run_ids[-1], verbose)
        if run.status == dg.DagsterRunStatus.SUCCESS:
            return run_ids
        retried = daemon_retry(instance, run)
        if retried is not None:
            log(f"{job.name} run {run.run_id} failed; the daemon retries it as run {retried}")
            run_ids.append(retried)
            continue
        if run.tags.get(PREEMPTED_TAG) == "true" and len(run_ids) <= retries:
            log(
                f"{job.name} run {run.run_id} was preempted; retrying ({len(run_ids)}/{retries}), it resumes from its checkpoint"
            )
            run = retry(instance, context, run, len(run_ids))
            start(instance, context, run, plane)
            run_ids.append(run.run_id)
            continue
        events = [record.event_log_entry.dagster_event for record in instance.get_records_for_run(run.run_id).records]
        reason = failure_reason([event for event in events if event is not None], run.run_id)
        raise PlaneFailed(f"{job.name} failed for {key} (run {run.run_id}): {reason}", plane, run.run_id)


class PlaneLauncher:
    """``launch_plane`` for each plane that runs; the code location is loaded for the first one, once."""

    def __init__(
        self, instance: dg.DagsterInstance, verbose: bool, plane_tags: Mapping[str, Mapping] = MappingProxyType({})
    ):
        self.instance, self.verbose, self.plane_tags = instance, verbose, plane_tags  # plane -> its runs' extra tags
        self.stack = ExitStack()
        self.context: WorkspaceProcessContext | None = None

    def __enter__(self) -> PlaneLauncher:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stack.close()

    def _context(self) -> WorkspaceProcessContext:
        if self.context is None:
            log(
                f"loading the code location {CODE_LOCATION} ({DEFINITIONS}); its output and its runs' go to {code_server_log()}"
            )
            self.context = self.stack.enter_context(code_location(self.instance))
            if launches_directly(self.instance):
                log(direct_launch_notice(self.instance))
        return self.context

    def run(self, job: dg.JobDefinition, plane: str, key: str, run_config: dict) -> list[str]:
        return launch_plane(
            self.instance, self._context(), job, plane, key, steps_in_one_process(run_config), self.verbose,
            self.plane_tags.get(plane, {}),
        )  # fmt: skip

    def run_all(
        self, job: dg.JobDefinition, plane: str, targets: dict[str, dict]
    ) -> dict[str, list[str] | PlaneFailed]:
        """One run of ``job`` per partition of ``targets`` (key -> run config), all submitted before any is followed:
        the queue runs them side by side up to their pool's limit (the GPU pool's for training). Each key's run ids,
        or the ``PlaneFailed`` that ended it (the others still finish)."""
        context = self._context()
        submitted = {
            key: submit_plane(
                self.instance, context, job, plane, key, steps_in_one_process(config), self.plane_tags.get(plane, {})
            )
            for key, config in targets.items()
        }
        outcome = {}
        for key, run in submitted.items():
            try:
                outcome[key] = finish_plane(self.instance, context, job, plane, key, run, self.verbose)
            except PlaneFailed as exc:
                outcome[key] = exc
        return outcome
