"""The object store's key layout: every key ft-assets writes or reads is built here and nowhere else.

| prefix | what | written by |
|---|---|---|
| `datasets/<name>/<version>/` + `_SUCCESS` | the input files, as dropped by the user (marker last) | the user, `ft-assets run` |
| `datasets/<name>/<version>/_source.json` | where a non-file input came from: Hub repo + commit, S3 prefix, `save_to_disk` split, mixture | `ft-assets run` (``ft_assets.data.sources``) |
| `runs/<name>/<version>/data/<stage>/` | raw, cleaned, deduplicated, split, shards | data plane |
| `runs/<name>/<version>/control/plan/`, `cost/<run>/`, `cost_report/` | GPU plan, priced run, report | control plane |
| `runs/<name>/<version>/train/<run>/checkpoint-<step>/`, `final/` | checkpoints, the trained adapter | training plane |
| `runs/<name>/<version>/delivery/<run>/merged/`, `gguf/`, `eval/`, `serving/`, `vllm/` | delivery artifacts (`serving/`, `vllm/`: the smoke tests' answers) | delivery plane |
| `runs/<name>/<version>/refs/<asset>.json` | the reference each asset hands downstream | the IO manager |
| `registry/<name>/<version>/<run>/` | published models with `lineage.json` | `published_model` |
| `models/<model>/<sha256[:16]>/` | base models converted once, shared by every version | `base_model` |
| `leases/<name>/<version>/<generation>/` | partition leases (one writer per version) | `ft_assets.locks` |

Every prefix except `datasets/` holds artifacts (``ft_assets.manifests``: files + a manifest written
last). Dataset names and versions are validated (``ft_assets.partitions``) before they reach a key.
``<run>`` is the training run id: a hash of the partition, the result-changing training settings,
the base model and the shards (``ft_assets.training.checkpoints.run_id``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ft_assets.partitions import DatasetVersion
from ft_assets.storage import ObjectStore, join_key

DATASETS = "datasets"
RUNS = "runs"
REGISTRY = "registry"
MODELS = "models"
LEASES = "leases"
SUCCESS_MARKER = "_SUCCESS"  # written last by an uploader: the version is complete
SOURCE_FILE = "_source.json"  # the origin of a version staged from a non-file source ("_": never a data file)
CHECKPOINT_RE = re.compile(r"^checkpoint-(\d{8})$")  # 8 digits: sorts by name up to 99,999,999 steps


@dataclass(frozen=True)
class PartitionLayout:
    """The keys of one dataset version (one ``dataset_version`` partition)."""

    version: DatasetVersion

    @property
    def partition(self) -> str:
        return self.version.key

    @property
    def inputs(self) -> str:
        return join_key(DATASETS, self.version.name, self.version.version)

    @property
    def success_marker(self) -> str:
        return join_key(self.inputs, SUCCESS_MARKER)

    @property
    def source(self) -> str:
        """``SOURCE_FILE`` of the version: present when it was staged from a Hub repo, an S3 prefix, a
        ``save_to_disk`` directory or a mixture spec (``ft_assets.data.sources``)."""
        return join_key(self.inputs, SOURCE_FILE)

    def component(self, name: str) -> str:
        """The files of one component of a mixture version, under the version's own inputs."""
        return join_key(self.inputs, name)

    @property
    def runs(self) -> str:
        return join_key(RUNS, self.version.name, self.version.version)

    def data(self, stage: str) -> str:
        """A data-plane stage's artifact: raw, cleaned, deduplicated, split, shards."""
        return join_key(self.runs, "data", stage)

    def control(self, what: str, *more: str) -> str:
        """A control-plane artifact: plan, cost/<run>, cost_report."""
        return join_key(self.runs, "control", what, *more)

    def train(self, run_id: str) -> str:
        """Everything of one training run: its checkpoints and its final weights."""
        return join_key(self.runs, "train", run_id)

    def delivery(self, run_id: str, what: str) -> str:
        """A delivery artifact of one training run: merged, gguf, eval, serving, vllm."""
        return join_key(self.runs, "delivery", run_id, what)

    def ref(self, asset: str) -> str:
        """The JSON reference an asset hands downstream (``ft_assets.refs``)."""
        return join_key(self.runs, "refs", f"{asset}.json")

    def registry(self, run_id: str) -> str:
        return join_key(REGISTRY, self.version.name, self.version.version, run_id)

    @property
    def lease(self) -> str:
        return join_key(LEASES, self.version.name, self.version.version)


def of(partition: str) -> PartitionLayout:
    """The layout of a partition key ``<name>@<version>`` (validated)."""
    return PartitionLayout(DatasetVersion.from_key(partition))


def checkpoint_name(step: int) -> str:
    return f"checkpoint-{step:08d}"


def checkpoint(train_prefix: str, step: int) -> str:
    """One checkpoint of the training run at ``train_prefix`` (``PartitionLayout.train``)."""
    return join_key(train_prefix, checkpoint_name(step))


def final_weights(train_prefix: str) -> str:
    return join_key(train_prefix, "final")


def base_model(slug: str, fingerprint: str) -> str:
    """A base model converted once, keyed by its name and the sha256 of its source."""
    return join_key(MODELS, slug, fingerprint[:16])


def dataset_folders(store: ObjectStore) -> list[tuple[str, str]]:
    """(name, version) of every folder under ``datasets/``, complete or not, valid or not."""
    return [(name, version) for name in store.list_dirs(DATASETS) for version in store.list_dirs(join_key(DATASETS, name))]


def partitions_with_runs(store: ObjectStore) -> list[str]:
    """Partition keys of every dataset version that has outputs under ``runs/``."""
    return [f"{name}@{version}" for name in store.list_dirs(RUNS) for version in store.list_dirs(join_key(RUNS, name))]


def registry_key(uri: str) -> tuple[str, str]:
    """'<store URL>/registry/<name>/<version>/<run>' (or the bare key) → (store URL or '', key)."""
    marker = f"/{REGISTRY}/"
    if uri.startswith(f"{REGISTRY}/"):
        return "", uri.rstrip("/")
    if marker not in uri:
        raise ValueError(f"{uri} is not a published model: expected <store>/{REGISTRY}/<name>/<version>/<run>")
    store_url, _, rest = uri.rstrip("/").partition(marker)
    return store_url, f"{REGISTRY}/{rest}"
