"""The object store's key layout: every key ft-assets writes or reads is built here and nowhere else.

| prefix | what | written by |
|---|---|---|
| `datasets/<name>/<version>/` + `_SUCCESS` | the input files, as dropped by the user (marker last) | the user, `ft-assets run` |
| `datasets/<name>/<version>/_source.json` | where a non-file input came from: Hub repo + commit, S3 prefix, `save_to_disk` split, mixture | `ft-assets run` (``ft_assets.data.sources``) |
| `runs/<name>/<version>/data/<stage>/` | raw, cleaned, deduplicated, split, shards | data plane |
| `runs/<name>/<version>/control/plan/`, `cost/<run>/`, `cost_report/` | GPU plan, priced run, report | control plane |
| `runs/<name>/<version>/train/<run>/checkpoint-<step>/`, `final/` | checkpoints, the trained adapter | training plane |
| `runs/<name>/<version>/delivery/<run>/merged/`, `<export>/` (`gguf/`), `eval/`, `serving/`, `vllm/` | delivery artifacts (`serving/`, `vllm/`: the smoke tests' answers) | delivery plane |
| `runs/<name>/<version>/refs/<asset>.json` | the reference each asset hands downstream | the IO manager |
| `runs/<name>/<version>/comparison/` | the version's runs side by side (its own and every variant's) | `version_comparison` |
| `runs/<name>/<version>/variants/<variant>/refs/`, `control/` | a variant's own references and control artifacts (plan, cost); it reads its version's data refs | the IO manager, the control plane |
| `registry/<name>/<version>/<run>/` | published models with `lineage.json` | `published_model` |
| `models/<model>/<sha256[:16]>/` | base models converted once, shared by every version | `base_model` |
| `images/<name>/<sha256>.<format>` | a dataset's images, checked and stored once by content, shared by its versions | `raw_dataset` (``ft_assets.data.images``) |
| `leases/<name>/<version>/<generation>/` | partition leases (one writer per version) | `ft_assets.locks` |
| `code/<sha256>/<wheel>` | the ft-assets wheel a GPU target's worker installs (``code=wheel``) | ``ft_assets.targets.code`` |

Every prefix except `datasets/` and `images/` holds artifacts (``ft_assets.manifests``: files + a manifest written
last); an image's key is the sha256 of its bytes, which its readers check. Dataset names and versions are validated (``ft_assets.partitions``) before they reach a key.
``<run>`` is the training run id: a hash of the partition, the result-changing training settings,
the base model and the shards (``ft_assets.training.checkpoints.run_id``); a variant's partition key holds its
name, so two variants of a version never share a run id, even with equal settings (a repeated run).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ft_assets.partitions import VARIANT_SEP, DatasetVersion
from ft_assets.storage import ObjectStore, join_key

DATASETS = "datasets"
RUNS = "runs"
REGISTRY = "registry"
MODELS = "models"
IMAGES = "images"
LEASES = "leases"
CODE = "code"
SUCCESS_MARKER = "_SUCCESS"  # written last by an uploader: the version is complete
SOURCE_FILE = "_source.json"  # the origin of a version staged from a non-file source ("_": never a data file)
CHECKPOINT_RE = re.compile(r"^checkpoint-(\d{8})$")  # 8 digits: sorts by name up to 99,999,999 steps
VARIANTS = "variants"
# The data plane's outputs: one per version, read by every variant of it (the data_plane job's selection;
# test_variants.py keeps the two equal). Everything else has a reference per variant.
VERSION_ASSETS = frozenset(
    {"raw_dataset", "cleaned_dataset", "deduplicated_dataset", "train_eval_split", "tokenized_shards", "base_model"}
)


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

    @property
    def images(self) -> str:
        """The dataset's images, one object each by content (``ft_assets.data.images``): every version of the
        dataset shares them; a version's shards list the ones it uses."""
        return join_key(IMAGES, self.version.name)

    @property
    def own(self) -> str:
        """Where this partition's own references and control artifacts live: the version's, or its variant's."""
        return join_key(self.runs, VARIANTS, self.version.variant) if self.version.variant else self.runs

    def data(self, stage: str) -> str:
        """A data-plane stage's artifact: raw, cleaned, deduplicated, split, shards."""
        return join_key(self.runs, "data", stage)

    def control(self, what: str, *more: str) -> str:
        """A control-plane artifact: plan, cost/<run>, cost_report (a variant's under its own prefix)."""
        return join_key(self.own, "control", what, *more)

    def train(self, run_id: str) -> str:
        """Everything of one training run: its checkpoints and its final weights."""
        return join_key(self.runs, "train", run_id)

    def delivery(self, run_id: str, what: str) -> str:
        """A delivery artifact of one training run: merged, each export's (gguf), eval, serving, vllm."""
        return join_key(self.runs, "delivery", run_id, what)

    @property
    def comparison(self) -> str:
        """The version's runs side by side (``version_comparison``): its own run's and every variant's."""
        return join_key(self.runs, "comparison")

    def ref(self, asset: str) -> str:
        """The JSON reference an asset hands downstream (``ft_assets.refs``): a variant's own, but its version's for
        the data plane's outputs (``VERSION_ASSETS``)."""
        return join_key(self.runs if asset in VERSION_ASSETS else self.own, "refs", f"{asset}.json")

    def variant_keys(self, store: ObjectStore) -> list[str]:
        """The partition keys of the version's variants that have references in the store."""
        version = self.version.with_variant("")
        return [version.with_variant(name).key for name in store.list_dirs(join_key(self.runs, VARIANTS))]

    def registry(self, run_id: str) -> str:
        return join_key(REGISTRY, self.version.name, self.version.version, run_id)

    @property
    def lease(self) -> str:
        """One writer per partition: the version's data plane, and each variant's runs on their own."""
        own = self.version.version + (f"{VARIANT_SEP}{self.version.variant}" if self.version.variant else "")
        return join_key(LEASES, self.version.name, own)


def of(partition: str) -> PartitionLayout:
    """The layout of a partition key ``<name>@<version>`` (validated)."""
    return PartitionLayout(DatasetVersion.from_key(partition))


def worker_wheel(sha256: str, name: str) -> str:
    """Where the ft-assets wheel with this sha256 is kept for GPU targets' workers."""
    return join_key(CODE, sha256, name)


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
    return [
        (name, version) for name in store.list_dirs(DATASETS) for version in store.list_dirs(join_key(DATASETS, name))
    ]


def partitions_with_runs(store: ObjectStore) -> list[str]:
    """Partition keys of every dataset version that has outputs under ``runs/``, each followed by its variants'."""
    keys = []
    for name in store.list_dirs(RUNS):
        for version in store.list_dirs(join_key(RUNS, name)):
            key = f"{name}@{version}"
            keys += [key, *of(key).variant_keys(store)]
    return keys


def registry_key(uri: str) -> tuple[str, str]:
    """'<store URL>/registry/<name>/<version>/<run>' (or the bare key) → (store URL or '', key)."""
    marker = f"/{REGISTRY}/"
    if uri.startswith(f"{REGISTRY}/"):
        return "", uri.rstrip("/")
    if marker not in uri:
        raise ValueError(f"{uri} is not a published model: expected <store>/{REGISTRY}/<name>/<version>/<run>")
    store_url, _, rest = uri.rstrip("/").partition(marker)
    return store_url, f"{REGISTRY}/{rest}"
