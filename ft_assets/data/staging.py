"""One input staged into the files of a dataset version: a local file or directory, a ``datasets``
``save_to_disk`` directory, a Hugging Face Hub dataset at a revision, or an S3 prefix.

``stage_source`` resolves what the user named *before anything is uploaded* (an input that cannot
become a version is refused with the accepted forms) into the files of the version and a small
record of their origin (``Staged.source``; none for plain local files). A mixture of such inputs is
``ft_assets.data.mixture``; ``ft_assets.data.sources.stage`` takes either.

A local data file brings the image files its rows name by relative paths (``named_images``), a folder
all of its image files: ``raw_dataset`` reads them where the rows name them (``ft_assets.data.images``).
The files are kept as they are, not converted: their rows are read, quarantined and named
(``file:line``, ``file#row``) like those of any upload, and a Hub dataset's Parquet stays Parquet.
A Hub repo is resolved once, at registration, to the commit its revision names, through
``huggingface_hub.snapshot_download`` (from the local Hub cache when ``HF_HUB_OFFLINE=1``, else
downloading the data files only); which files make the split is what ``datasets`` decides for the
repo (its file-name conventions and the README's ``configs``). Files from S3 go through a scratch
folder on disk one at a time, so no input is ever held in memory.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ft_assets.data.formats import SUPPORTED_SUFFIXES, Row, is_data_file, iter_dataset_file, suffix_of
from ft_assets.data.images import IMAGE_SUFFIXES, relative_key
from ft_assets.data.rows import DatasetFileError, RowError
from ft_assets.storage import StoreError, open_store

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


def stage_source(spec: str, work: Path, split: str | None = None) -> Staged:
    """Resolve ``spec`` (a path, ``hf://owner/name@revision`` or ``s3://bucket/prefix/``) into the files of a version.

    ``work`` is a scratch folder for files that must be fetched (S3); ``split`` picks a split of a
    Hub repo or a ``DatasetDict`` (default ``train``). Raises ``DatasetFileError`` naming the input
    and the accepted forms; a mixture spec is not a source (``ft_assets.data.sources.stage`` takes it).
    """
    path = Path(spec).expanduser()
    if spec.startswith("s3://"):
        return _stage_s3(spec, work)
    if spec.startswith("hf://") or (not path.exists() and "@" in spec and HUB_SPEC.match(spec)):
        return _stage_hub(spec, split or DEFAULT_SPLIT, work)
    if path.is_file():
        if not is_data_file(path.name):
            raise DatasetFileError(f"{path}: not an input ft-assets reads; use {ACCEPTED}")
        return Staged(dataset_name(path.name), [(path.name, path), *named_images(path)], None)
    if path.is_dir():
        if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
            return _stage_saved(path, split)
        return _stage_directory(path)
    raise DatasetFileError(f"dataset path {spec} does not exist")


def _named_paths(item) -> list[str]:
    """The image paths a row names (not its bytes or data URIs)."""
    if not isinstance(item, Row):
        return []
    paths = []
    for image in (image for message in item.messages for image in message.get("images") or ()):
        if isinstance(image, dict):
            image = None if image.get("bytes") else image.get("path")
        if isinstance(image, str) and not image.startswith("data:"):
            paths.append(image)
    return paths


def named_images(data_file: Path) -> list[tuple[str, Path]]:
    """The image files that the rows of ``data_file`` name by a relative path, found beside it: (path under the
    version's folder, local file). What is not found, or lies outside the file's folder, is left for ``raw_dataset``
    to quarantine with the row that names it."""
    folder, found = data_file.parent.resolve(), {}
    try:
        for item in iter_dataset_file(data_file, data_file.name):
            for image in _named_paths(item):
                try:
                    key = relative_key(data_file.name, image)
                except RowError:
                    continue
                local = (folder / key).resolve()
                if local.is_relative_to(folder) and local.is_file():
                    found[key] = local
    except DatasetFileError:
        pass  # a file whose layout needs raw_dataset's column mapping, or one it refuses itself: it says why
    return sorted(found.items())


def _stage_directory(path: Path) -> Staged:
    """A folder's data files, and its image files (rows name them by paths relative to their data file)."""
    files = sorted(
        p
        for p in path.rglob("*")
        if p.is_file() and (is_data_file(p.relative_to(path).as_posix()) or p.name.lower().endswith(IMAGE_SUFFIXES))
    )
    if not any(is_data_file(p.relative_to(path).as_posix()) for p in files):
        found = sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())
        listed = ", ".join(found[:5]) + (", …" if len(found) > 5 else "") if found else "nothing"
        raise DatasetFileError(f"{path}: no data files in this directory (found: {listed}); use {ACCEPTED}")
    return Staged(dataset_name(path.resolve().name), [(p.relative_to(path).as_posix(), p) for p in files], None)


def _hub_files(folder: Path, split: str, where: str, work: Path) -> list[str]:
    """The split's data files in a downloaded repo, as ``datasets`` resolves them (conventions, README configs)."""
    import datasets  # here, not at the top: its import takes ~0.9 s, and only Hub and save_to_disk inputs need it

    try:
        builder = datasets.load_dataset_builder(str(folder), cache_dir=str(work / "datasets-cache"))  # its lock files
    except (
        datasets.exceptions.DatasetsError,
        datasets.data_files.EmptyDatasetError,
        FileNotFoundError,
        ValueError,
    ) as exc:
        raise DatasetFileError(f"{where}: datasets cannot tell which files hold the rows ({exc})") from exc
    data_files = builder.config.data_files or {}
    if split not in data_files:
        raise DatasetFileError(f"{where}: no split {split!r}; splits: {', '.join(sorted(data_files)) or 'none'}")
    return sorted(Path(f).relative_to(folder).as_posix() for f in data_files[split])


def _stage_hub(spec: str, split: str, work: Path) -> Staged:
    from huggingface_hub import snapshot_download  # here, not at the top: ~0.2 s to import, for Hub inputs only
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    match = HUB_SPEC.match(spec.removeprefix("hf://"))
    if not match:
        raise DatasetFileError(f"{spec}: not a Hub dataset id; write hf://owner/name@revision")
    repo, revision = match["repo"], match["revision"] or "main"
    where = f"hf://{repo}@{revision}"
    try:
        folder = Path(
            snapshot_download(
                repo,
                repo_type="dataset",
                revision=revision,
                allow_patterns=[f"*{s}" for s in SUPPORTED_SUFFIXES] + ["README.md"],
            )
        )
    except LocalEntryNotFoundError as exc:
        raise DatasetFileError(
            f"{where}: not in the local Hugging Face cache and HF_HUB_OFFLINE is set; download it once "
            f"(hf download --repo-type dataset {repo} --revision {revision}) or unset HF_HUB_OFFLINE"
        ) from exc
    except HfHubHTTPError as exc:
        raise DatasetFileError(
            f"{where}: the Hub refused it ({exc}); check the repo id, the revision and HF_TOKEN"
        ) from exc
    commit = folder.name  # snapshot_download returns <cache>/datasets--owner--name/snapshots/<commit>
    files = _hub_files(folder, split, where, work)
    unreadable = [f for f in files if not is_data_file(f)]
    if unreadable:
        raise DatasetFileError(
            f"{where}: split {split} has files ft-assets cannot read: {', '.join(unreadable[:5])}; use {ACCEPTED}"
        )
    source = {
        "kind": "hub",
        "uri": where,
        "repo": repo,
        "revision": revision,
        "commit": commit,
        "split": split,
        "files": files,
    }
    return Staged(dataset_name(repo.rsplit("/", 1)[-1]), [(f, folder / f) for f in files], source)


def _stage_s3(spec: str, work: Path) -> Staged:
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
    import datasets  # here, not at the top: its import takes ~0.9 s, and only Hub and save_to_disk inputs need it

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
