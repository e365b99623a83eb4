"""Part files: the data plane's workers write an artifact's rows themselves; the driver only commits the manifest.

A data artifact is a set of part files, ``<family>-NNNNN.parquet`` (``rows-00000.parquet``,
``quarantine-00000.parquet``, ``train-…``, ``eval-…``, ``duplicates-…``; the packed shards are
``train-…`` too, one a packing window), and the manifest that commits them (``ft_assets.manifests``).
``raw_dataset`` cuts its input into parts of ``PART_ROWS`` input rows (a line range of a JSONL file,
row groups of a Parquet file, a whole file that cannot be cut), and every stage after it keeps that
numbering: part k of the cleaned rows is what cleaning kept of part k of the raw rows. So the files
depend on the data alone, never on the executor or the shard size: a task works on a run of whole
parts (``runs``) and writes one output part per input part, with row groups of exactly ``FLUSH_ROWS``
rows (``ParquetSink``).

The worker builds each part in memory (~10 MB of chat rows), hashes it and writes it under its final
name in one step (``Target.put``): renamed into place in a local store, from a temporary name fixed
by the part's name (so a rerun after a SIGKILL overwrites the dead worker's half-written file rather
than leaving it behind), one PUT to S3. What comes back to the driver is a ``Written`` descriptor —
name, rows, size, sha256, ~150 bytes — instead of the rows; the driver adds it to the ``Artifact`` it
commits. Before the change the driver encoded every part itself: 26 µs of its CPU a row, which capped
a cluster near 38k rows/s (``benchmarks/data_plane.py``). Workers that cannot reach the store (a Ray
cluster on other machines, and a store that is a directory of the driver's machine) send the part's
bytes back with its descriptor and the driver writes them as they are: still no row is converted or
encoded in the driver.

A reader reads a part whole and checks it against the sha256 the manifest lists (``read_part``): the
next stage's workers read their input parts from the store themselves, as the driver did before.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from ft_assets.data.parallel import Executor, FileRef, StoreObject, read_all, store_at
from ft_assets.data.rows import ParquetSink, plain_record
from ft_assets.manifests import ArtifactCorrupt, begin_artifact, read_manifest
from ft_assets.storage import ObjectStore, join_key

PART_ROWS = 16_384  # input rows a part covers: ~10 MB of chat rows, two row groups; 6,100 parts a stage at 100M rows
SINGLE_FILES = ("rows.parquet", "train.parquet", "eval.parquet")  # what data artifacts held before part files
_PART_NAME = re.compile(r"^(?P<family>.+)-(?P<index>\d{5,})\.parquet$")


def part_name(family: str, index: int) -> str:
    """``rows-00042.parquet``: part ``index`` of ``family``."""
    return f"{family}-{index:05d}.parquet"


def family_index(name: str) -> tuple[str, int] | None:
    """(family, index) of a part's file name; None for a file that is not a part."""
    match = _PART_NAME.match(name)
    return (match["family"], int(match["index"])) if match else None


def part_paths(folder: Path, family: str) -> list[Path]:
    """The parts of ``family`` in a local folder (an artifact fetched from the store), in order."""
    named = {path: family_index(path.name) for path in Path(folder).glob(f"{family}-*.parquet")}
    return sorted(
        (path for path, found in named.items() if found and found[0] == family), key=lambda path: named[path][1]
    )


def check_layout(names: Iterable[str], where: str) -> None:
    """Refuse an artifact written before data artifacts were part files (one ``rows.parquet``, ``train.parquet``,
    ``eval.parquet``): read as parts it would look empty."""
    old = sorted(set(names) & set(SINGLE_FILES))
    if old:
        raise ArtifactCorrupt(
            f"{where} holds {', '.join(old)}: the layout of an older ft-assets, before part files; rebuild the data "
            "plane's artifacts (ft-assets run --until data --force)"
        )


@dataclass(frozen=True)
class Part:
    """One part of an input artifact, as its manifest lists it, and how a worker reaches it."""

    name: str
    index: int
    file: FileRef
    rows: int
    sha256: str
    start: int  # the number of its first row among the rows of its family


@dataclass(frozen=True)
class Written:
    """What a worker sends back for a part it wrote: its descriptor (and its bytes, when the store is out of its reach)."""

    name: str
    rows: int
    size: int
    sha256: str
    data: bytes | None = None

    def info(self) -> dict:
        """The part's entry in the manifest."""
        return {"size": self.size, "sha256": self.sha256, "rows": self.rows}


def part_bytes(part: Part):
    """The bytes of a part, after checking them against the sha256 its manifest lists (or its writer reported)."""
    data = read_all(part.file)
    if hashlib.sha256(data).hexdigest() != part.sha256:
        raise ArtifactCorrupt(
            f"part {part.name} does not match the sha256 of its manifest; the artifact is corrupt, rebuild it"
        )
    return data


def read_part(part: Part, columns: list[str] | None = None) -> pa.Table:
    """The rows of a part (``part_bytes``: checked against its sha256)."""
    return pq.read_table(pa.BufferReader(pa.py_buffer(part_bytes(part))), columns=columns)


def table_bytes(table: pa.Table, schema: pa.Schema) -> pa.Buffer:
    """``table`` as a Parquet file in memory, in row groups of exactly ``FLUSH_ROWS`` rows (``ParquetSink``)."""
    buffer = pa.BufferOutputStream()
    with ParquetSink(buffer, schema) as sink:
        sink.write_table(table)
    return buffer.getvalue()


@dataclass(frozen=True)
class Target:
    """Where a stage's workers write their parts: the store's URL and the artifact's prefix in it. ``url`` None:
    the store is out of the workers' reach, the parts go back to the driver as bytes."""

    url: str | None
    prefix: str

    def put(self, name: str, data: bytes | pa.Buffer, rows: int) -> Written:
        """Write one part under its final name (or hand its bytes back) and describe it."""
        digest = hashlib.sha256(data).hexdigest()
        data = data.to_pybytes() if isinstance(data, pa.Buffer) else data
        if self.url is None:
            return Written(name, rows, len(data), digest, data)
        store_at(self.url).put_part(join_key(self.prefix, name), data)
        return Written(name, rows, len(data), digest)

    def put_table(self, name: str, table: pa.Table, schema: pa.Schema) -> Written:
        return self.put(name, table_bytes(table, schema), table.num_rows)


@dataclass
class Artifact:
    """A data artifact's files at ``prefix`` of the store at ``url``: read (``committed``) or being written.

    ``files`` maps each file name to its manifest entry (size, sha256 and, for a part, rows). A stage's
    driver gives its workers ``target`` and adds their ``Written`` descriptors as they come back; the
    asset then commits ``files`` with the manifest (``Materialization.publish``).
    """

    url: str
    prefix: str = ""
    files: dict[str, dict] = field(default_factory=dict)

    @classmethod
    def folder(cls, path: Path) -> Artifact:
        """An artifact of its own in a local folder (tests, benchmarks): the folder is the store, the prefix empty."""
        Path(path).mkdir(parents=True, exist_ok=True)
        return cls(str(Path(path).resolve()))

    @classmethod
    def begin(cls, store: ObjectStore, prefix: str) -> Artifact:
        """An empty artifact at ``prefix`` that a data stage's workers write their parts into (what an earlier
        attempt left there is deleted first, its manifest before anything); ``Materialization.publish`` commits it."""
        begin_artifact(store, prefix)
        return cls(store.url, prefix)

    @classmethod
    def committed(cls, store: ObjectStore, prefix: str) -> Artifact:
        """The artifact whose manifest is at ``prefix`` (``ArtifactNotFound`` without one)."""
        files = dict(read_manifest(store, prefix).files)
        check_layout(files, store.uri(prefix))
        return cls(store.url, prefix, files)

    def names(self, family: str) -> list[str]:
        """The parts of ``family``, in order."""
        parts = {found[1]: name for name in self.files if (found := family_index(name)) and found[0] == family}
        return [parts[index] for index in sorted(parts)]

    def rows(self, family: str) -> int:
        return sum(self.files[name]["rows"] for name in self.names(family))

    def part(self, name: str, executor: Executor | None = None, start: int = 0) -> Part:
        """The part ``name`` as ``executor``'s workers reach it (this process's by default)."""
        info, key = self.files[name], join_key(self.prefix, name)
        if executor is None or executor.reaches(self.url):
            file = StoreObject(self.url, key)
        else:  # a local store, and workers on other machines: through Ray's object store
            file = executor.share(store_at(self.url).path(key))
        return Part(name, family_index(name)[1], file, info["rows"], info["sha256"], start)

    def parts(self, family: str, executor: Executor | None = None) -> list[Part]:
        """The parts of ``family``, in order, as ``executor``'s workers reach them (this process's by default)."""
        parts, start = [], 0
        for name in self.names(family):
            parts.append(self.part(name, executor, start))
            start += parts[-1].rows
        return parts

    def target(self, executor: Executor | None = None) -> Target:
        """Where ``executor``'s workers write this artifact's parts (``url`` None: back to the driver)."""
        return Target(self.url if executor is None or executor.reaches(self.url) else None, self.prefix)

    def add(self, *written: Written) -> None:
        """Parts the workers wrote (or whose bytes they sent back: written here, as they are)."""
        for part in written:
            if part.data is not None:
                store_at(self.url).put_part(join_key(self.prefix, part.name), part.data)
            self.files[part.name] = part.info()

    def tables(self, family: str, columns: list[str] | None = None) -> Iterator[pa.Table]:
        """The parts of ``family``, one table each, read in this process."""
        for part in self.parts(family):
            yield read_part(part, columns)

    def records(self, family: str, columns: list[str] | None = None) -> Iterator[dict]:
        """The rows of ``family`` as dicts, in order, read in this process."""
        for table in self.tables(family, columns):
            for batch in table.to_batches():
                yield from map(plain_record, batch.to_pylist())


def runs(items: Iterable, rows: Callable, shard_rows: int) -> Iterator[list]:
    """Consecutive ``items`` (parts, or what a stage makes of them) in runs of at most ``shard_rows`` rows, each
    at least one item: the tasks of a stage, lazily. They depend on ``shard_rows``; what the tasks write does not."""
    run: list = []
    total = 0
    for item in items:
        size = rows(item)
        if run and total + size > shard_rows:
            yield run
            run, total = [], 0
        run.append(item)
        total += size
    if run:
        yield run
