"""Experiment tracking in Weights & Biases, beside MLflow: the same params, metrics, eval figures, lineage and URIs.

One W&B run per training run, its id the run id (16 hex digits), so a resumed attempt continues it
(``resume="allow"``), as the MLflow run is found again by its ``ft.run_id`` tag. What it gets, from the same
calls as the MLflow tracker (``ft_assets.training.tracking.Trackers``):

- config: the settings hashed into the run id and the values the run resolved (MLflow's params), and the
  dataset version, run id, objective, method and lineage digests (MLflow's tags);
- history: ``loss``, ``learning_rate``, ``tokens_per_second``, ``grad_norm``, ``epoch``, ``eta_seconds`` at every
  logging step, the eval figures at eval steps and at the end, and after delivery ``eval_report``'s figures;
- summary: the adapter's manifest digest (``ft.digest.lora_adapter``) when it is published;
- artifacts: references (``Artifact.add_reference``, no upload, no checksum: the store holds the bytes) to the
  adapter's URI and the published registry folder's, the URIs MLflow's registry version points at.

Names: ``wandb.project`` / ``entity`` / ``run_name`` settings, else ``WANDB_PROJECT`` / ``WANDB_ENTITY`` /
``WANDB_NAME``, else project ``ft-assets``, your default entity and the run id. ``WANDB_MODE=offline`` writes the
run under ``WANDB_DIR`` for ``wandb sync`` later (what the tests read back, with wandb's own protobuf records).
A later addition (the adapter's digest, the eval, the published URI) opens the same run id again: offline, that
is another run folder of the same id, which ``wandb sync`` appends to the one run.

As with MLflow, a tracker never costs the run: the first call that fails logs one WARNING and turns W&B off
for the rest of the attempt. ``pip install 'ft-assets[wandb]'`` installs the client.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from pydantic import BaseModel, ConfigDict, Field

Log = Callable[[str], None]
NOT_METRICS = ("step", "total_steps")  # the step is W&B's x axis, as it is MLflow's
DEFAULT_PROJECT = "ft-assets"


class WandbSettings(BaseModel):
    """Log the run to Weights & Biases (pip install 'ft-assets[wandb]'), beside or instead of MLflow."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(
        default=False,
        description="Log params, metrics, eval figures, lineage digests and the adapter's and published model's URIs to "
        "W&B. WANDB_MODE=offline writes the run locally for `wandb sync`; a W&B that does not answer is a warning.",
    )
    project: str = Field(default="", description=f"W&B project. Empty: WANDB_PROJECT, else {DEFAULT_PROJECT!r}.")
    entity: str = Field(default="", description="W&B entity (team or user). Empty: WANDB_ENTITY, else your default.")
    run_name: str = Field(default="", description="The run's display name. Empty: WANDB_NAME, else the run id.")

    def names(self, run_id: str) -> dict:
        """wandb.init's project, entity and name: the settings, else W&B's environment, else the defaults."""
        return {
            "project": self.project or os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT,
            "entity": self.entity or os.environ.get("WANDB_ENTITY") or None,
            "name": self.run_name or os.environ.get("WANDB_NAME") or run_id,
        }


def _numbers(metrics: dict) -> dict:
    return {
        key: float(value)
        for key, value in metrics.items()
        if key not in NOT_METRICS and isinstance(value, int | float) and not isinstance(value, bool)
    }


_OPENED: dict[str, int] = {}  # run id -> the second this process last opened it


def _open(settings: WandbSettings, run_id: str, config: dict | None = None):
    """The W&B run ``run_id``, opened (or continued). An offline run's folder is named by the second it was opened in,
    so a second open of the same id within that second would write into the first's folder: it waits for the next."""
    import wandb

    while int(time.time()) == _OPENED.get(run_id):
        time.sleep(0.05)
    _OPENED[run_id] = int(time.time())
    return wandb.init(
        id=run_id,
        resume="allow",
        config=config,
        reinit="create_new",
        dir=os.environ.get("WANDB_DIR"),  # WANDB_DIR as it is now: wandb reads its environment once a process
        **settings.names(run_id),
    )


class WandbTracker:
    """The W&B run of one training run; ``start`` returns None when tracking is impossible."""

    def __init__(self, run, log: Log):
        self.run, self.log, self.run_id, self.active = run, log, run.id, True

    @classmethod
    def start(cls, settings: WandbSettings, run_id: str, params: dict, tags: dict[str, str], log: Log):
        try:
            import wandb  # noqa: F401
        except ImportError:
            log(
                "WARNING: wandb.enabled is set but wandb is not installed (pip install 'ft-assets[wandb]'); not tracking"
            )
            return None
        try:
            run = _open(settings, run_id, {**params, **tags})
        except Exception as exc:  # noqa: BLE001 -- whatever the tracker does, training goes on
            log(f"WARNING: W&B did not start ({type(exc).__name__}: {exc}); training goes on without it")
            return None
        log(f"tracking in W&B: project {run.project!r}, run {run.id} ({'offline' if run.offline else run.url})")
        return cls(run, log)

    def _call(self, what: str, call: Callable[[], object]) -> None:
        if not self.active:
            return
        try:
            call()
        except Exception as exc:  # noqa: BLE001 -- whatever the tracker does, training goes on
            self.active = False
            self.log(f"WARNING: W&B failed to {what} ({type(exc).__name__}: {exc}); tracking is off for this attempt")

    def log_metrics(self, metrics: dict, step: int) -> None:
        self._call("log metrics", lambda: self.run.log(_numbers(metrics), step=step))

    def finish(self, failed: bool) -> None:
        self._call("end the run", lambda: self.run.finish(exit_code=1 if failed else 0))


def record(
    settings: WandbSettings,
    run_id: str,
    log: Log,
    metrics: dict | None = None,
    tags: dict[str, str] | None = None,
    artifacts: dict[str, str] | None = None,
    step: int | None = None,
) -> None:
    """Add figures (history at ``step``), tags (summary) and artifact URIs (references) to the run; a failure is a warning."""
    try:
        import wandb

        run = _open(settings, run_id)
        try:
            if metrics:
                run.log(_numbers(metrics), step=step)
            if tags:
                run.summary.update(tags)
            for name, uri in (artifacts or {}).items():
                artifact = wandb.Artifact(f"{name}-{run_id}", type="model", metadata={"uri": uri})
                artifact.add_reference(uri, checksum=False)
                run.log_artifact(artifact)
        finally:
            run.finish()
    except Exception as exc:  # noqa: BLE001 -- a tracker never fails the asset
        log(f"WARNING: W&B did not take the figures for run {run_id} ({type(exc).__name__}: {exc})")
