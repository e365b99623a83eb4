"""Experiment tracking in MLflow (and, through ``Trackers``, W&B beside it): a training run's settings, metrics, eval
figures and lineage.

``Trackers`` is what the recipes (torch and mlx) open on rank 0: MLflow when ``mlflow_tracking_uri`` is set, W&B when
``wandb.enabled`` (``ft_assets.training.wandb_tracking``), the same calls to both; ``record_run`` is how the
training and delivery assets add to the run afterwards (the adapter's digest, the eval figures, the URIs).

One MLflow run per training run, named by the run id (tag ``ft.run_id``). A resumed attempt finds
the MLflow run by that tag and continues it, so the attempts of a preempted run are one run in
MLflow (steps trained twice after a SIGKILL are logged twice, at the same step numbers).

What is logged, from rank 0 only (the recipe opens a tracker on the main process alone):

- params: the settings that change the weights (those hashed into the run id; the objective's own
  as ``dpo.beta``, ``grpo.rewards``, ...) and the values the run resolved (objective, method,
  learning rate, warmup, steps); they are the same for every attempt of a run, which MLflow requires
  of params;
- metrics at every logging step: ``loss``, ``learning_rate``, ``tokens_per_second``, ``grad_norm``,
  ``epoch``, ``eta_seconds``; the eval figures at eval steps and at the end (``eval_loss``; DPO:
  ``eval_reward_accuracy``, ``eval_reward_margin`` and their reference's); after delivery,
  ``eval_report``'s base-vs-tuned figures (``reward_accuracy``, ``reward_margin`` of a DPO run);
- tags: ``ft.dataset_version``, ``ft.run_id``, ``ft.objective``, ``ft.method``, and
  ``ft.digest.<asset>``, the manifest digest of every artifact the run was built from (the
  digests ``lineage.json`` records; the adapter's is added when it is published).

A tracker must never cost the run: every call is guarded, and the first one that fails logs one
WARNING and turns tracking off for the rest of the attempt. MLflow's client retries a request 7
times with exponential backoff by default, minutes against a dead server; unless the environment
says otherwise, requests are retried twice (backoff factor 1) with a 10 s timeout, so a tracker
that does not answer costs seconds, once.

``pip install 'ft-assets[mlflow]'`` installs the client (mlflow-skinny); the full ``mlflow`` package
(server and UI) pins pyarrow below 26 in its 3.17 release, which this project's pyarrow is not.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from ft_assets.training.wandb_tracking import WandbSettings, WandbTracker
from ft_assets.training.wandb_tracking import record as wandb_record

Log = Callable[[str], None]
CLIENT_LIMITS = {  # MLflow's own environment variables, set only when the environment has not
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
}
NOT_METRICS = ("step", "total_steps")  # in the recipe's progress dicts, but the step is MLflow's x axis
LINEAGE_TAG = "ft.digest."


def mlflow_client(uri: str):
    """An MlflowClient for ``uri`` whose requests give up in seconds, not minutes (``CLIENT_LIMITS``)."""
    from mlflow.tracking import MlflowClient

    for name, value in CLIENT_LIMITS.items():
        os.environ.setdefault(name, value)
    return MlflowClient(tracking_uri=uri)


def _experiment_id(client, name: str) -> str:
    from mlflow.exceptions import MlflowException

    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    try:
        return client.create_experiment(name)
    except MlflowException:  # created by another run in the meantime
        return client.get_experiment_by_name(name).experiment_id


def _metrics(metrics: dict, step: int | None):
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    return [
        Metric(key, float(value), now, step or 0)
        for key, value in metrics.items()
        if key not in NOT_METRICS and isinstance(value, int | float) and not isinstance(value, bool)
    ]


def flat(params: dict, prefix: str = "") -> dict:
    """Nested settings as MLflow params, one a leaf: ``{"dpo": {"beta": 0.1}}`` -> ``{"dpo.beta": 0.1}``."""
    found = {}
    for key, value in params.items():
        if isinstance(value, dict):
            found.update(flat(value, f"{prefix}{key}."))
        else:
            found[f"{prefix}{key}"] = value
    return found


class MlflowTracker:
    """The MLflow run of one training run, on rank 0; ``start`` returns None when tracking is impossible."""

    def __init__(self, client, uri: str, run_id: str, log: Log):
        self.client, self.uri, self.run_id, self.log = client, uri, run_id, log
        self.active = True

    @classmethod
    def start(
        cls, uri: str, experiment: str, run_name: str, params: dict, tags: dict[str, str], log: Log
    ) -> MlflowTracker | None:
        """Open (or, for a resumed attempt, reopen) the run named ``run_name`` and log its params and tags."""
        try:
            import mlflow  # noqa: F401
        except ImportError:
            log(
                "WARNING: mlflow_tracking_uri is set but MLflow is not installed (pip install 'ft-assets[mlflow]'); not tracking"
            )
            return None
        from mlflow.entities import Param, RunTag

        try:
            client = mlflow_client(uri)
            experiment_id = _experiment_id(client, experiment)
            found = client.search_runs([experiment_id], filter_string=f"tags.`ft.run_id` = '{run_name}'", max_results=1)
            if found:
                run_id = found[0].info.run_id
                client.update_run(run_id, status="RUNNING")
            else:
                run_id = client.create_run(experiment_id, run_name=run_name).info.run_id
            client.log_batch(
                run_id,
                params=[Param(key, str(value)) for key, value in flat(params).items()],
                tags=[RunTag(key, str(value)) for key, value in tags.items()],
            )
        except Exception as exc:  # noqa: BLE001 -- whatever the tracker does, training goes on
            log(
                f"WARNING: MLflow at {uri} did not answer ({type(exc).__name__}: {exc}); training goes on without tracking"
            )
            return None
        log(f"tracking in MLflow at {uri}: experiment {experiment!r}, run {run_id} ({'resumed' if found else 'new'})")
        return cls(client, uri, run_id, log)

    def _call(self, what: str, call: Callable[[], object]) -> None:
        if not self.active:
            return
        try:
            call()
        except Exception as exc:  # noqa: BLE001 -- whatever the tracker does, training goes on
            self.active = False
            self.log(
                f"WARNING: MLflow at {self.uri} failed to {what} ({type(exc).__name__}: {exc}); tracking is off for this attempt"
            )

    def log_metrics(self, metrics: dict, step: int) -> None:
        self._call("log metrics", lambda: self.client.log_batch(self.run_id, metrics=_metrics(metrics, step)))

    def finish(self, failed: bool) -> None:
        """FINISHED, or FAILED for an attempt that stopped (preempted, crashed; a retry sets it RUNNING again)."""
        self._call("end the run", lambda: self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED"))


def record(
    uri: str,
    run_id: str,
    log: Log,
    metrics: dict | None = None,
    tags: dict[str, str] | None = None,
    step: int | None = None,
) -> None:
    """Add metrics and tags to an existing MLflow run (the adapter's digest, delivery's eval); a failure is a warning."""
    try:
        from mlflow.entities import RunTag

        mlflow_client(uri).log_batch(
            run_id, metrics=_metrics(metrics or {}, step), tags=[RunTag(k, str(v)) for k, v in (tags or {}).items()]
        )
    except Exception as exc:  # noqa: BLE001 -- a tracker never fails the asset
        log(f"WARNING: MLflow at {uri} did not take the figures for run {run_id} ({type(exc).__name__}: {exc})")


def lineage_tags(partition: str, refs: dict[str, dict]) -> dict[str, str]:
    """The dataset version and the manifest digest of every artifact in ``refs`` (asset name -> reference)."""
    return {"ft.dataset_version": partition, **{f"{LINEAGE_TAG}{name}": ref["digest"] for name, ref in refs.items()}}


class Trackers:
    """The trackers of one training run (rank 0): MLflow when ``mlflow_tracking_uri`` is set, W&B when
    ``wandb.enabled``; each call goes to every one that started, the same figures to both."""

    def __init__(self, mlflow: MlflowTracker | None, wandb: WandbTracker | None):
        self.mlflow, self.wandb = mlflow, wandb

    @classmethod
    def start(cls, config, run_id: str, params: dict, tags: dict[str, str], log: Log) -> Trackers:
        """``config``: the run's TrainingConfig; ``run_id``: its id, the name of its MLflow run and its W&B run id."""
        mlflow = None
        if config.mlflow_tracking_uri:
            mlflow = MlflowTracker.start(
                config.mlflow_tracking_uri, config.mlflow_experiment, run_id, params, tags, log
            )
        wandb = WandbTracker.start(config.wandb, run_id, params, tags, log) if config.wandb.enabled else None
        return cls(mlflow, wandb)

    def log_metrics(self, metrics: dict, step: int) -> None:
        for tracker in (self.mlflow, self.wandb):
            if tracker is not None:
                tracker.log_metrics(metrics, step)

    def finish(self, failed: bool) -> None:
        for tracker in (self.mlflow, self.wandb):
            if tracker is not None:
                tracker.finish(failed)

    @property
    def mlflow_run_id(self) -> str | None:
        return self.mlflow.run_id if self.mlflow is not None else None

    @property
    def wandb_run_id(self) -> str | None:
        return self.wandb.run_id if self.wandb is not None else None


def record_run(
    training_config: dict,
    stats: dict,
    log: Log,
    metrics: dict | None = None,
    tags: dict[str, str] | None = None,
    artifacts: dict[str, str] | None = None,
    step: int | None = None,
) -> None:
    """Add figures, tags and artifact URIs to every tracker the training run was logged to (``lora_adapter``'s
    ``training_config`` and ``stats``): MLflow takes the figures and tags (its registry version carries the URIs),
    W&B all three (``artifacts``: name -> URI, as references)."""
    if stats.get("mlflow_run_id"):
        record(training_config["mlflow_tracking_uri"], stats["mlflow_run_id"], log, metrics, tags, step)
    if stats.get("wandb_run_id"):
        settings = WandbSettings(**training_config.get("wandb", {}))
        uris = {name: uri if "://" in uri else f"file://{uri}" for name, uri in (artifacts or {}).items()}
        wandb_record(settings, stats["wandb_run_id"], log, metrics, tags, uris, step)
