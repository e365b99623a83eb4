"""Where a dataset version comes from: local files, Hugging Face Hub datasets, S3 prefixes, ``save_to_disk``.

A dataset version is always files under ``datasets/<name>/<version>/`` (``ft_assets.layout``), which
``raw_dataset`` reads with ``ft_assets.data.readers``. ``stage`` resolves what the user named into
those files *before anything is uploaded* (an input that cannot become a version is refused with the
accepted forms), and into a small record of the origin that ``ft-assets run`` stores as
``_source.json`` next to them (``layout.SOURCE_FILE``):

| input | files of the version | ``_source.json`` |
|---|---|---|
| a file or a directory of files (``formats.SUPPORTED_SUFFIXES``) | the files | none |
| ``hf://owner/name@revision`` (or ``owner/name@revision``) | the split's data files of the Hub repo at that revision | repo, revision, resolved commit, split, files |
| ``s3://bucket/prefix/`` | every data file under the prefix (Parquet, JSONL, ...) | URI, files |
| a ``datasets`` ``save_to_disk`` directory | the split's Arrow files | path, split, rows, columns |
| a mixture spec ``.yaml`` (``ft_assets.data.mixture``) | each source component's files under ``<component>/`` | seed, components |

``raw_dataset`` puts the record into its stats, so the lineage of a published model names the
origin (``ft-assets lineage`` prints ``describe_source``).

The files are uploaded as they are, not converted: their rows are read, quarantined and named
(``file:line``, ``file#row``) like those of any upload, and a Hub dataset's Parquet stays Parquet.
A Hub repo is resolved once, at registration, to the commit its revision names, through
``huggingface_hub.snapshot_download`` (from the local Hub cache when ``HF_HUB_OFFLINE=1``, else
downloading the data files only); which files make the split is what ``datasets`` decides for the
repo (its file-name conventions and the README's ``configs``). The default version is a hash of the
files and this record, so registering a revision again is the same version while the revision names
the same commit, and a new one once the branch has moved.
Files from S3 go through a scratch folder on disk one at a time, so no input is ever held in memory.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ft_assets.data.formats import SUPPORTED_SUFFIXES, is_data_file, suffix_of
from ft_assets.data.rows import DatasetFileError

ACCEPTED = (
    f"a data file ({', '.join(SUPPORTED_SUFFIXES)}) or a directory of them, a datasets save_to_disk directory, "
    "hf://owner/name@revision (a Hugging Face Hub dataset), s3://bucket/prefix/, or a mixture spec (.yaml)"
)
MIXTURE_SUFFIXES = (".yaml", ".yml")
DEFAULT_SPLIT = "train"
HUB_SPEC = re.compile(r"^(?:hf://)?(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$")


@dataclass(frozen=True)
class Staged:
    """An input resolved into the files of a dataset version."""

    name: str  # the default dataset name
    files: list[tuple[str, Path]]  # (path under the version's folder, local file), in reading order
    source: dict | None  # what _source.json records; None for plain local files


def dataset_name(text: str) -> str:
    """A dataset name from a file, directory or repo name: known suffixes dropped, other characters replaced."""
    suffix = suffix_of(text) or next((s for s in MIXTURE_SUFFIXES if text.endswith(s)), "")
    name = text.removesuffix(suffix) if suffix else text
    return "".join(c if c.isalnum() or c in "._-" else "-" for c in name).strip("-._") or "dataset"


def stage(spec: str, work: Path, store=None, split: str | None = None) -> Staged:
    """Resolve ``spec`` (what ``ft-assets run --dataset`` was given) into the files of a version.

    ``work`` is a scratch folder for files that must be fetched (S3); ``store`` resolves the
    ``dataset:`` components of a mixture; ``split`` picks a split of a Hub repo or a ``DatasetDict``
    (default ``train``). Raises ``DatasetFileError`` naming the input and the accepted forms.
    """
    path = Path(spec).expanduser()
    if spec.startswith("s3://"):
        return _stage_s3(spec, work)
    if spec.startswith("hf://") or (not path.exists() and "@" in spec and HUB_SPEC.match(spec)):
        return _stage_hub(spec, split or DEFAULT_SPLIT, work)
    if path.is_file() and path.name.endswith(MIXTURE_SUFFIXES):
        from ft_assets.data.mixture import stage_mixture

        return stage_mixture(path, work, store)
    if path.is_file():
        if not is_data_file(path.name):
            raise DatasetFileError(f"{path}: not an input ft-assets reads; use {ACCEPTED}")
        return Staged(dataset_name(path.name), [(path.name, path)], None)
    if path.is_dir():
        if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
            return _stage_saved(path, split)
        return _stage_directory(path)
    raise DatasetFileError(f"dataset path {spec} does not exist")


def _stage_directory(path: Path) -> Staged:
    files = sorted(p for p in path.rglob("*") if p.is_file() and is_data_file(p.relative_to(path).as_posix()))
    if not files:
        found = sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())
        listed = ", ".join(found[:5]) + (", …" if len(found) > 5 else "") if found else "nothing"
        raise DatasetFileError(f"{path}: no data files in this directory (found: {listed}); use {ACCEPTED}")
    return Staged(dataset_name(path.resolve().name), [(p.relative_to(path).as_posix(), p) for p in files], None)


def _hub_files(folder: Path, split: str, where: str, work: Path) -> list[str]:
    """The split's data files in a downloaded repo, as ``datasets`` resolves them (conventions, README configs)."""
    import datasets

    try:
        builder = datasets.load_dataset_builder(str(folder), cache_dir=str(work / "datasets-cache"))  # its lock files
    except (datasets.exceptions.DatasetsError, datasets.data_files.EmptyDatasetError, FileNotFoundError, ValueError) as exc:
        raise DatasetFileError(f"{where}: datasets cannot tell which files hold the rows ({exc})") from exc
    data_files = builder.config.data_files or {}
    if split not in data_files:
        raise DatasetFileError(f"{where}: no split {split!r}; splits: {', '.join(sorted(data_files)) or 'none'}")
    return sorted(Path(f).relative_to(folder).as_posix() for f in data_files[split])


def _stage_hub(spec: str, split: str, work: Path) -> Staged:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    match = HUB_SPEC.match(spec.removeprefix("hf://"))
    if not match:
        raise DatasetFileError(f"{spec}: not a Hub dataset id; write hf://owner/name@revision")
    repo, revision = match["repo"], match["revision"] or "main"
    where = f"hf://{repo}@{revision}"
    try:
        folder = Path(
            snapshot_download(
                repo, repo_type="dataset", revision=revision, allow_patterns=[f"*{s}" for s in SUPPORTED_SUFFIXES] + ["README.md"]
            )
        )
    except LocalEntryNotFoundError as exc:
        raise DatasetFileError(
            f"{where}: not in the local Hugging Face cache and HF_HUB_OFFLINE is set; download it once "
            f"(hf download --repo-type dataset {repo} --revision {revision}) or unset HF_HUB_OFFLINE"
        ) from exc
    except HfHubHTTPError as exc:
        raise DatasetFileError(f"{where}: the Hub refused it ({exc}); check the repo id, the revision and HF_TOKEN") from exc
    commit = folder.name  # snapshot_download returns <cache>/datasets--owner--name/snapshots/<commit>
    files = _hub_files(folder, split, where, work)
    unreadable = [f for f in files if not is_data_file(f)]
    if unreadable:
        raise DatasetFileError(f"{where}: split {split} has files ft-assets cannot read: {', '.join(unreadable[:5])}; use {ACCEPTED}")
    source = {"kind": "hub", "uri": where, "repo": repo, "revision": revision, "commit": commit, "split": split, "files": files}
    return Staged(dataset_name(repo.rsplit("/", 1)[-1]), [(f, folder / f) for f in files], source)


def _stage_s3(spec: str, work: Path) -> Staged:
    from ft_assets.storage import StoreError, open_store

    try:
        bucket = open_store(spec.rstrip("/"))
        keys = [key for key in bucket.list("") if is_data_file(key)]
    except StoreError as exc:
        raise DatasetFileError(f"{spec}: {exc}") from exc
    if not keys:
        raise DatasetFileError(f"{spec}: no data files ({', '.join(SUPPORTED_SUFFIXES)}) under this prefix")
    for key in keys:
        bucket.get_file(key, work / key)
    source = {"kind": "s3", "uri": spec, "files": keys}
    return Staged(dataset_name(spec.rstrip("/").rsplit("/", 1)[-1]), [(key, work / key) for key in keys], source)


def _stage_saved(path: Path, split: str | None) -> Staged:
    import datasets

    try:
        saved = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError, datasets.exceptions.DatasetsError) as exc:
        raise DatasetFileError(f"{path}: not a readable datasets save_to_disk directory ({exc})") from exc
    if isinstance(saved, datasets.DatasetDict):
        split = split or DEFAULT_SPLIT
        if split not in saved:
            raise DatasetFileError(f"{path}: no split {split!r}; splits: {', '.join(sorted(saved))}")
        saved = saved[split]
    files = [Path(cache["filename"]).resolve() for cache in saved.cache_files]
    rels = [f.relative_to(path.resolve()).as_posix() for f in files]
    source = {
        "kind": "save_to_disk", "uri": str(path.resolve()), "split": split, "rows": saved.num_rows,
        "columns": saved.column_names, "files": rels,
    }  # fmt: skip
    return Staged(dataset_name(path.resolve().name), list(zip(rels, files)), source)


def describe_source(source: dict | None, indent: str = "  ") -> list[str]:
    """Lines that say where a dataset version came from (``ft-assets lineage``); none for plain files."""
    if not source:
        return []
    kind = source["kind"]
    if kind == "hub":
        return [f"{indent}source {source['uri']} → commit {source['commit']} (split {source['split']}, {len(source['files'])} file(s))"]
    if kind == "s3":
        return [f"{indent}source {source['uri']} ({len(source['files'])} file(s))"]
    if kind == "save_to_disk":
        return [f"{indent}source save_to_disk {source['uri']} (split {source['split'] or '-'}, {source['rows']} rows)"]
    if kind == "files":
        return [f"{indent}source {source['uri']}"]
    lines = [f"{indent}mixture, seed {source['seed']}:"]
    for component in source["components"]:
        share = f"weight {component['weight']}" if "weight" in component else f"count {component['count']}"
        drawn = f", {component['rows_drawn']} rows drawn" if "rows_drawn" in component else ""
        origin = component.get("dataset") or component["source"]["uri"]
        pin = f" → commit {component['source']['commit']}" if component.get("source", {}).get("kind") == "hub" else ""
        digest = f", digest {component['digest'][:16]}…" if "digest" in component else ""
        lines.append(f"{indent}  {component['name']}: {origin}{pin} ({share}{drawn}{digest})")
        lines += describe_source(component.get("origin"), indent + "    ")
    return lines
