"""Published models in MLflow's Model Registry: one model version per published run, and who is champion.

With ``mlflow_tracking_uri`` set (the training config's, where the run was tracked), ``published_model``
registers the published directory as a version of the registered model named after the dataset
(``toolcalls`` for ``toolcalls@sample-v1``). The version's source is the store URI of that directory,
a reference: nothing is copied into MLflow's artifact store (the demo's published run is ~1 GB), and
what the registry points at is the signed, lineage-checked directory itself. MLflow's server refuses a
local path as a source (it means nothing to the server's other users), so a registry behind
``mlflow server`` wants an ``s3://`` store; a local store registers in a local registry (``sqlite:///…``).

Each version carries tags: ``ft.dataset_version``, ``ft.run_id``, ``ft.digest.<asset>`` (the manifest
digest of every artifact ``lineage.json`` names, and of the published directory), ``ft.signature.sha256``
(``unsigned`` without a key), and the eval gate's figures (``ft.gate.<field>``; each export's verdict as
``ft.gate.<export>.<field>``: ``ft.gate.gguf.file``, ``ft.gate.gguf.metric``, or ``ft.gate.gguf.reason`` when it
shipped nothing). Aliases:

- ``champion`` moves to the new version only when its gate passed, it did not regress on a general task
  (``general_eval``, even when that only warns), and its metric beats the current champion's on the same metric (strictly; a tie keeps the champion, a different metric cannot be compared);
- otherwise the new version gets ``candidate`` (MLflow moves an alias, so ``candidate`` is the latest
  such version).

Publishing the same run again registers nothing twice (the ``ft.run_id`` tag finds the version). A
registry that does not answer is a warning, never a failed publish, as for tracking: the client's
retries are bounded to seconds (``tracking.CLIENT_LIMITS``). MLflow is imported inside the calls: it is
the optional ``mlflow`` extra.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ft_assets.partitions import DatasetVersion
from ft_assets.training.tracking import LINEAGE_TAG, mlflow_client

Log = Callable[[str], None]
CHAMPION, CANDIDATE = "champion", "candidate"
METRIC_NAME_TAG, METRIC_TAG = "ft.gate.metric_name", "ft.gate.finetuned_metric"  # what champions are compared on
RUN_TAG = "ft.run_id"


@dataclass(frozen=True)
class Release:
    """What one published model brings to the registry."""

    model_name: str  # the registered model: the dataset's name
    source: str  # the store URI of the published directory, by reference
    run_id: str  # ft-assets' content-addressed run id
    gate: Mapping  # eval_report's Gate, flat (Gate.flat): passed, metric_name, finetuned_metric, gguf.metric, …
    tags: Mapping[str, str]  # dataset version, lineage digests, signature digest
    mlflow_run_id: str | None = None  # the training run in the same MLflow, linked from the version

    def version_tags(self) -> dict[str, str]:
        return {**self.tags, RUN_TAG: self.run_id, **{f"ft.gate.{k}": str(v) for k, v in self.gate.items()}}


def release_of(
    partition: str, published: Mapping, lineage: Mapping, gate: Mapping, signature: Mapping, mlflow_run_id: str | None
) -> Release:
    """The release of a published model: its reference, its ``lineage.json``, its eval gate and its signature."""
    digests = {a["asset"]: a["digest"] for a in lineage["artifacts"]}
    digests |= {"checkpoint": lineage["training"]["checkpoint"]["digest"], "published_model": published["digest"]}
    return Release(
        model_name=DatasetVersion.from_key(partition).name,
        source=published["uri"],
        run_id=lineage["training"]["run_id"],
        gate=gate,
        tags={
            "ft.dataset_version": partition,
            **{f"{LINEAGE_TAG}{name}": digest for name, digest in digests.items()},
            "ft.signature.sha256": signature["sha256"] or "unsigned",
        },
        mlflow_run_id=mlflow_run_id,
    )


def not_promotable(gate: Mapping) -> str | None:
    """Why a model with this gate (``Gate.flat``) may never be ``champion``, or None: its eval gate failed, or it
    regressed on a general task (``general_eval`` with ``on_regression: warn`` publishes such a model)."""
    if str(gate["passed"]) != "True":
        return "its eval gate did not pass"
    if str(gate.get("general.regressed")) == "True":
        return "it regressed on a general-ability task (general_eval)"
    return None


def choose_alias(release: Release, champion_tags: Mapping[str, str] | None) -> tuple[str, str]:
    """``champion`` or ``candidate`` for a new version, given the current champion's tags (None: no champion); and why."""
    metric, value = release.gate["metric_name"], float(release.gate["finetuned_metric"])
    refused = not_promotable(release.gate)
    if refused:
        return CANDIDATE, refused
    if champion_tags is None:
        return CHAMPION, "the first version to pass its gate"
    if champion_tags.get(METRIC_NAME_TAG) != metric:
        return (
            CANDIDATE,
            f"the champion is scored on {champion_tags.get(METRIC_NAME_TAG)!r}, not {metric!r}: not comparable",
        )
    best = float(champion_tags[METRIC_TAG])
    if value > best:
        return CHAMPION, f"{metric} {value:.4f} beats the champion's {best:.4f}"
    return CANDIDATE, f"{metric} {value:.4f} does not beat the champion's {best:.4f}"


def _champion_tags(client, name: str) -> dict[str, str] | None:
    from mlflow.exceptions import MlflowException

    if CHAMPION not in client.get_registered_model(name).aliases:
        return None
    try:
        return client.get_model_version_by_alias(name, CHAMPION).tags
    except MlflowException:  # the champion's version was deleted meanwhile
        return None


def register(uri: str, release: Release, log: Log, warn: Log) -> dict | None:
    """Register ``release`` as a new model version and set its alias; None (after one ``warn``) when the registry fails."""
    try:
        from mlflow.exceptions import MlflowException

        client = mlflow_client(uri)
        name = release.model_name
        try:
            client.create_registered_model(
                name, description="Fine-tuned by ft-assets; every version is a published run."
            )
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        found = client.search_model_versions(f"name = '{name}' and tags.`{RUN_TAG}` = '{release.run_id}'")
        if found:
            version = found[0]
            log(
                f"{name} version {version.version} already holds run {release.run_id} (aliases {version.aliases or 'none'})"
            )
            return {
                "name": name,
                "version": version.version,
                "aliases": list(version.aliases),
                "reason": "already registered",
            }
        alias, reason = choose_alias(release, _champion_tags(client, name))
        version = client.create_model_version(
            name, release.source, run_id=release.mlflow_run_id, tags=release.version_tags(), await_creation_for=0,
            description=f"ft-assets run {release.run_id}, {release.tags.get('ft.dataset_version', '')}",
        )  # fmt: skip
        client.set_registered_model_alias(name, alias, version.version)
    except Exception as exc:  # noqa: BLE001 -- a registry never fails the publish
        local = "://" not in release.source and uri.startswith(("http://", "https://"))
        hint = "; a server takes no local path as a source: publish to an s3:// store (FT_STORE)" if local else ""
        warn(f"MLflow Model Registry at {uri} did not register {release.source} ({type(exc).__name__}: {exc}){hint}; "
             "the model is published all the same")  # fmt: skip
        return None
    log(f"registered {release.source} as {name} version {version.version} @{alias}: {reason}")
    return {"name": name, "version": version.version, "aliases": [alias], "reason": reason}


def summary(registered: dict | None) -> str:
    """One line for metadata: the registered model, version and alias, or 'not registered'."""
    if registered is None:
        return "not registered"
    return f"{registered['name']} version {registered['version']} {' '.join('@' + a for a in registered['aliases'])}".strip()
