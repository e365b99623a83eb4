"""Where a dataset version comes from: ``stage`` resolves what ``ft-assets run --dataset`` names into files.

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

One source is staged by ``ft_assets.data.staging``, a mixture by ``ft_assets.data.mixture`` (whose
components are sources). ``raw_dataset`` puts the record into its stats, so the lineage of a
published model names the origin (``ft-assets lineage`` prints ``describe_source``). The default
version is a hash of the files and this record, so registering a revision again is the same version
while the revision names the same commit, and a new one once the branch has moved.
"""

from __future__ import annotations

from pathlib import Path

from ft_assets.data.mixture import stage_mixture
from ft_assets.data.staging import MIXTURE_SUFFIXES, Staged, stage_source


def stage(spec: str, work: Path, store=None, split: str | None = None) -> Staged:
    """Resolve ``spec`` (what ``ft-assets run --dataset`` was given) into the files of a version.

    ``work`` is a scratch folder for files that must be fetched (S3); ``store`` resolves the
    ``dataset:`` components of a mixture; ``split`` picks a split of a Hub repo or a ``DatasetDict``
    (default ``train``). Raises ``DatasetFileError`` naming the input and the accepted forms.
    """
    path = Path(spec).expanduser()
    if not spec.startswith(("s3://", "hf://")) and path.is_file() and path.name.endswith(MIXTURE_SUFFIXES):
        return stage_mixture(path, work, store)
    return stage_source(spec, work, split)


def describe_source(source: dict | None, indent: str = "  ") -> list[str]:
    """Lines that say where a dataset version came from (``ft-assets lineage``); none for plain files."""
    if not source:
        return []
    kind = source["kind"]
    if kind == "hub":
        return [
            f"{indent}source {source['uri']} → commit {source['commit']} (split {source['split']}, {len(source['files'])} file(s))"
        ]
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
