"""The data plane on every core and on Ray (issue #17): same outputs in every mode, killed workers, Ray addresses.

Every stage runs from read to packed shards on one messy corpus (the benchmark generator's dirt, plus
a Parquet file of small row groups and a gzip file) in one process with whole-file shards, in one
process with small shards, on 2 worker processes and on 2 Ray workers: every file written must be
the same, byte for byte, and every count the same. Then workers are killed with SIGKILL in the
middle of a stage, and the stage must finish with those same bytes.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import signal
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import dagster as dg
import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ft_assets.data.chat_encoding import TokenizerFiles
from ft_assets.data.cleaning import CleaningRules, clean_dataset
from ft_assets.data.dedup import DedupRules, deduplicate_dataset
from ft_assets.data.parallel import InProcess, ProcessPool, RayTasks, ShardFailed, sigterm_handler_kept
from ft_assets.data.parts import Artifact, Target, Written
from ft_assets.data.readers import file_shards, read_dataset
from ft_assets.data.resources import DataExecutorResource
from ft_assets.data.split import split_dataset
from ft_assets.data.tokenizing import tokenize_splits
from ft_assets.storage import open_store

pytestmark = pytest.mark.integration

PART_ROWS = 250  # ~20 parts a stage on the corpus below: the files every mode must write alike
SHARD_ROWS = 250  # a part a task; the reference runs every part of a stage in one task
STAGES = ("read", "clean", "dedup", "split", "tokenize")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> list[tuple[str, Path]]:
    """~4,400 rows: the benchmark corpus generator's three JSONL files (duplicates, near duplicates, bad
    rows), one more with a BOM, CRLF and blank lines, a Parquet file of 100-row row groups and a gzip
    file (read whole)."""
    from benchmarks.corpus import write_corpus

    folder = tmp_path_factory.mktemp("corpus")
    write_corpus(folder, rows_per_unit=3000)
    chat = [
        json.loads(line)
        for line in (folder / "chat.jsonl").read_text().splitlines()[:500]
        if line.startswith('{"messages"')
    ]
    pq.write_table(
        pa.Table.from_pylist([{"messages": row["messages"]} for row in chat]),
        folder / "tables.parquet",
        row_group_size=100,
    )
    (folder / "more.jsonl.gz").write_bytes(
        gzip.compress(b"".join((folder / "alpaca.jsonl").read_bytes().splitlines(True)[:300]))
    )
    lines = (folder / "sharegpt.jsonl").read_bytes().splitlines()[:600]  # a BOM, CRLF, blank lines across shard edges
    edges = b"\xef\xbb\xbf" + b"".join(line + (b"\r\n\r\n" if i % 97 == 0 else b"\r\n") for i, line in enumerate(lines))
    (folder / "edges.jsonl").write_bytes(edges + b"   \n" + lines[0])  # ends without a newline
    return [(path.name, path) for path in sorted(folder.iterdir())]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir) -> TokenizerFiles:
    return TokenizerFiles.from_dir(tiny_model_dir)


@pytest.fixture(scope="module")
def ray_session():
    import gc

    import ray

    yield
    ray.shutdown()
    gc.collect()  # Ray's object references go now, not in a finalizer run by a later import


@pytest.fixture
def local_ray(ray_session):
    """A local Ray of 2 CPUs, started once for the module (again after a test that shut it down)."""
    import ray

    if not ray.is_initialized():
        with sigterm_handler_kept():
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)


def run_stage(stage: str, files, out: Artifact, executor, tokenizer, artifacts: dict) -> dict:
    """One stage into ``out``; ``artifacts`` holds each stage's output for the next one."""
    artifacts[stage] = out
    if stage == "read":
        return read_dataset(files, out, None, executor, part_rows=PART_ROWS)
    if stage == "clean":
        return clean_dataset(artifacts["read"], out, CleaningRules(), executor)
    if stage == "dedup":
        return deduplicate_dataset(artifacts["clean"], out, DedupRules(), executor)
    if stage == "split":
        return split_dataset(artifacts["dedup"], out, 0.2, "ft-assets", executor)
    packed = tokenize_splits(artifacts["split"], ("train", "eval"), tokenizer, 2048, out, 1000, executor)
    return {
        split: {
            "examples": p.examples, "tokens": p.tokens, "loss_tokens": p.loss_tokens, "rows": p.rows, "slots": p.slots,
            "pad_id": p.pad_id, "files": p.files, "rejected": [(row, error.reason, error.detail) for row, error in p.rejected],
        }
        for split, p in packed.items()
    }  # fmt: skip


def outputs(work: Path) -> dict[str, str]:
    """sha256 of every file the stages wrote."""
    return {
        str(p.relative_to(work)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(work.rglob("*"))
        if p.is_file()
    }


def run_all(files, work: Path, executor, tokenizer, during: dict | None = None) -> tuple[dict, dict]:
    """Every stage in order; ``during``: {stage: a context manager to run that stage in}. Returns the stats and the
    digests of every file written, and checks that the artifacts list exactly the files in their folders."""
    stats, artifacts = {}, {}
    for stage in STAGES:
        with (during or {}).get(stage, _nothing)():
            stats[stage] = run_stage(stage, files, Artifact.folder(work / stage), executor, tokenizer, artifacts)
    files = outputs(work)
    listed = {
        f"{stage}/{name}": info["sha256"]
        for stage, artifact in artifacts.items()
        for name, info in artifact.files.items()
    }
    assert listed == files  # every part written is described, whole, and nothing else is left (no temporary file)
    return stats, files


@contextmanager
def _nothing():
    yield


@pytest.fixture(scope="module")
def reference(corpus, tokenizer, tmp_path_factory) -> tuple[dict, dict]:
    """One process, one task a stage (shard_rows above every row count): every part of a stage written in turn."""
    with InProcess(1, 1_000_000) as executor:
        return run_all(corpus, tmp_path_factory.mktemp("reference"), executor, tokenizer)


def test_reference_accounts_for_every_row_and_packs_tightly(reference):
    stats, files = reference
    raw, clean, dedup, split, packed = (stats[s] for s in STAGES)
    assert raw["rows_in"] > 3500 and raw["rows_quarantined"] > 0 and raw["blank_lines"] > 0
    assert set(raw["rows_per_file"]) == {
        "alpaca.jsonl",
        "chat.jsonl",
        "edges.jsonl",
        "more.jsonl.gz",
        "sharegpt.jsonl",
        "tables.parquet",
    }
    assert dedup["exact_duplicates"] > 0 and dedup["near_duplicates"] > 0 and clean["rows_quarantined"] > 0
    rejected = sum(len(p["rejected"]) for p in packed.values())
    kept = sum(p["examples"] for p in packed.values())
    quarantined = raw["rows_quarantined"] + clean["rows_quarantined"] + rejected
    assert raw["rows_in"] == kept + quarantined + dedup["exact_duplicates"] + dedup["near_duplicates"]
    assert split["train_rows"] + split["eval_rows"] == dedup["rows_kept"] == kept + rejected
    assert sum(p["tokens"] for p in packed.values()) / sum(p["slots"] for p in packed.values()) >= 0.99
    assert len(packed["train"]["files"]) >= 1 and "tokenize/train-00000.parquet" in files


@pytest.mark.parametrize(
    "mode", ["in-process, small shards", "2 processes", "ray, 2 workers", "ray, as if on other machines"]
)
def test_every_mode_writes_the_same_bytes(mode, corpus, tokenizer, reference, tmp_path, request):
    """Workers write their parts; as if on other machines, they read them through Ray's object store and send
    their bytes back to the driver, which writes them: the files are the same in every mode."""
    if mode.startswith("ray"):
        request.getfixturevalue("local_ray")
        executor = RayTasks(2, SHARD_ROWS, remote=mode.endswith("machines"))
    else:
        executor = InProcess(1, SHARD_ROWS) if mode.startswith("in-process") else ProcessPool(2, SHARD_ROWS)
    with executor:
        stats, files = run_all(corpus, tmp_path, executor, tokenizer)
    chat = dict(corpus)["chat.jsonl"]
    assert len(file_shards("chat.jsonl", chat, chat, PART_ROWS)) > 3  # really sharded
    assert stats == reference[0]
    assert files == reference[1]
    if not mode.startswith("in-process"):
        workers = [w for w in executor.usage.values() if w.shards]
        assert len(workers) >= 2, executor.usage  # both workers took shards


# 2 worker processes on S3: the whole data plane through the instance, test_data_plane.py (the single process's digests)
@pytest.mark.parametrize("kind", ["ray, on other machines"])
def test_workers_write_their_parts_to_s3(kind, corpus, tokenizer, reference, s3_env, seaweedfs, ray_session):
    """With an S3 store the workers read their input parts from it and write their parts to it themselves, from the
    store's URL and the credentials of their environment (a Ray cluster's: its runtime_env): the same bytes."""
    import ray

    store = open_store(s3_env)
    if kind.startswith("ray"):
        ray.shutdown()  # this test's Ray, with the store's endpoint and keys in its workers' environment
        with sigterm_handler_kept():
            ray.init(
                num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": seaweedfs.env()}
            )
    stats, artifacts = {}, {}
    try:
        with ProcessPool(2, SHARD_ROWS) if kind == "processes" else RayTasks(2, SHARD_ROWS, remote=True) as executor:
            for stage in STAGES:
                stats[stage] = run_stage(
                    stage, corpus, Artifact(store.url, f"runs/t/{stage}"), executor, tokenizer, artifacts
                )
            assert len([w for w in executor.usage.values() if w.shards]) >= 2
    finally:
        if kind.startswith("ray"):
            ray.shutdown()
    assert stats == reference[0]
    listed = {
        f"{stage}/{name}": info["sha256"]
        for stage, artifact in artifacts.items()
        for name, info in artifact.files.items()
    }
    assert listed == reference[1]
    assert {f"{key.removeprefix('runs/t/')}": store.sha256(key) for key in store.list("runs/t")} == reference[1]


# --- faults --------------------------------------------------------------------------------------------


def worker_pids(kind: str) -> list[int]:
    """Processes of this test running shards: its pool's workers, or its Ray's workers busy with a task."""
    pids = []
    for process in psutil.Process().children(recursive=True):
        try:
            command = process.cmdline()
        except psutil.Error:  # gone, or a zombie not reaped yet
            continue
        if (
            "spawn_main" in " ".join(command)
            if kind == "processes"
            else command[:1] and command[0].startswith("ray::_run_shard")
        ):
            pids.append(process.pid)
    return pids


@contextmanager
def killing_a_worker(kind: str, executor, killed: list):
    """SIGKILL one worker in the middle of the stage: once a first shard of it is back and others are in flight."""
    stop = threading.Event()
    done_before = sum(w.shards for w in executor.usage.values())

    def kill() -> None:
        while not stop.is_set():
            pids = worker_pids(kind) if sum(w.shards for w in executor.usage.values()) > done_before else []
            if pids:
                os.kill(pids[0], signal.SIGKILL)
                killed.append(pids[0])
                return
            time.sleep(0.005)

    killer = threading.Thread(target=kill, daemon=True)
    killer.start()
    try:
        yield
    finally:
        stop.set()
        killer.join()


@pytest.mark.parametrize(
    # dedup's kill on Ray; a killed process worker in the stages that differ most (rows in, tokens out)
    "kind,stage",
    [("processes", "clean"), ("processes", "tokenize"), ("ray", "dedup")],
)
def test_a_worker_killed_mid_stage_changes_nothing(kind, stage, corpus, tokenizer, reference, tmp_path, request):
    """The dead worker's shard runs again; the stage writes the same bytes as if nothing happened."""
    if kind == "ray":
        request.getfixturevalue("local_ray")
    killed: list[int] = []
    with ProcessPool(2, SHARD_ROWS) if kind == "processes" else RayTasks(2, SHARD_ROWS, remote=False) as executor:
        stats, files = run_all(
            corpus, tmp_path, executor, tokenizer, {stage: lambda: killing_a_worker(kind, executor, killed)}
        )
    assert killed, f"no {kind} worker was busy during {stage}"
    assert not psutil.pid_exists(killed[0]) or psutil.Process(killed[0]).status() == psutil.STATUS_ZOMBIE
    if kind == "processes":
        assert executor.retried >= 1  # Ray retries on its own and does not say
    assert (stats, files) == reference


def _die(marker_dir: str, shard: int) -> int:
    """A stage function whose worker dies (SIGKILL) the first time it meets shard 3, or every time with marker_dir ''."""
    marker = Path(marker_dir) / str(shard) if marker_dir else None
    if shard == 3 and (marker is None or not marker.exists()):
        if marker is not None:
            marker.touch()
        os.kill(os.getpid(), signal.SIGKILL)
    return shard * shard


def _put_dying_midway(settings: tuple[Target, str], shard: int) -> Written:
    """Write part ``shard``; the first time shard 1 is written, its worker dies (SIGKILL) halfway through the file."""
    target, marker_dir = settings
    marker = Path(marker_dir) / "died"
    if shard == 1 and not marker.exists():
        marker.touch()

        def half_then_die(path: Path, data) -> None:
            with open(path, "wb") as handle:
                handle.write(bytes(data)[: len(data) // 2])
            os.kill(os.getpid(), signal.SIGKILL)

        Path.write_bytes = half_then_die  # this worker only: it dies in its first write
    return target.put(f"rows-{shard:05d}.parquet", bytes([shard]) * 100_000, shard)


def test_a_part_half_written_by_a_killed_worker_is_replaced_whole(tmp_path):
    """A worker killed in the middle of writing a part leaves a temporary file named after the part; the shard's
    rerun writes over it and renames it: the folder holds every part whole, and nothing else."""
    out = Artifact.folder(tmp_path / "out")
    (tmp_path / "markers").mkdir()
    with ProcessPool(1) as executor:
        out.add(*executor.map(_put_dying_midway, range(3), (out.target(executor), str(tmp_path / "markers"))))
        assert executor.retried == 1 and (tmp_path / "markers" / "died").exists()
    assert (
        sorted(p.name for p in (tmp_path / "out").iterdir())
        == sorted(out.files)
        == [f"rows-{i:05d}.parquet" for i in range(3)]
    )
    assert all(
        (tmp_path / "out" / name).read_bytes() == bytes([i]) * 100_000 for i, name in enumerate(sorted(out.files))
    )


@pytest.mark.parametrize("kind", ["processes", "ray"])
def test_a_shard_whose_worker_dies_runs_again(kind, tmp_path, request):
    if kind == "ray":
        request.getfixturevalue("local_ray")
    with ProcessPool(2) if kind == "processes" else RayTasks(2) as executor:
        assert list(executor.map(_die, range(8), str(tmp_path))) == [i * i for i in range(8)]
        assert (tmp_path / "3").exists()  # the first run of shard 3 did die
        if kind == "processes":
            assert executor.retried >= 1


@pytest.mark.parametrize("kind", ["processes", "ray"])
def test_a_shard_that_always_kills_its_worker_fails_the_stage(kind, request):
    if kind == "ray":
        request.getfixturevalue("local_ray")
    with ProcessPool(2) if kind == "processes" else RayTasks(2) as executor:
        with pytest.raises(ShardFailed):
            list(executor.map(_die, range(8), ""))


# --- Ray addresses ---------------------------------------------------------------------------------


def _silent_port() -> tuple[socket.socket, int]:
    """A port that accepts TCP connections and never says a word: a firewall, or the wrong service."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    return server, server.getsockname()[1]


def test_a_ray_address_that_does_not_answer_fails_clearly_within_30_s():
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    server, silent = _silent_port()
    try:
        for address, says in (
            (f"127.0.0.1:{port}", "does not answer"),
            (f"ray://127.0.0.1:{silent}", "no Ray service speaks"),
        ):
            started = time.monotonic()
            resource = DataExecutorResource(ray_address=address)
            with pytest.raises(dg.Failure, match=says) as failure:
                with dg.build_init_resource_context() as init, resource.yield_for_execution(init):
                    pass
            assert time.monotonic() - started < 30
            assert address in str(failure.value)
    finally:
        server.close()


def test_a_dagster_ray_resource_given_in_python_runs_the_shards(tmp_path):
    """``make_definitions(DataExecutorResource(ray=LocalRay(...)))`` (docs/guides/data.md's KubeRay recipe, with a
    local Ray): Dagster connects the dagster-ray resource, the shards run on it."""
    import ray
    from dagster_ray import LocalRay

    from ft_assets.definitions import make_definitions

    ray.shutdown()  # the module's Ray, if a test before started it: this one starts its own

    @dg.asset
    def squares(data_executor: DataExecutorResource) -> list[int]:
        assert data_executor.executor.kind == "ray"
        assert data_executor.executor.log is not None  # long stages report progress to the run's log
        return list(data_executor.executor.map(_die, range(6), str(tmp_path)))

    defs = make_definitions(
        DataExecutorResource(workers=2, ray=LocalRay(ray_init_options={"num_cpus": 2, "include_dashboard": False}))
    )
    with sigterm_handler_kept():  # Dagster connects dagster-ray's LocalRay (ray.init) before ft-assets' resource opens
        result = dg.materialize([squares], resources={"data_executor": defs.resources["data_executor"]})
    assert result.output_for_node("squares") == [i * i for i in range(6)]


def test_a_long_stage_logs_its_progress(tmp_path):
    """Past ``progress_every_s`` a stage says how many shards are done, of how many, and what is left;
    a short one (the default 30 s) says nothing."""
    lines: list[str] = []
    with ProcessPool(2, log=lines.append, progress_every_s=0) as executor:
        assert list(executor.map(_die, range(6), str(tmp_path))) == [i * i for i in range(6)]
    assert [line.split(" shards done")[0] for line in lines] == [f"_die: {done}/6" for done in range(1, 7)]
    assert lines[0].endswith("s left") and "on 2 worker processes" in lines[0] and lines[-1].endswith("about 0 s left")
    quiet: list[str] = []
    (tmp_path / "3").touch()  # shard 3 has died once already: in this process it must not
    with InProcess(1, log=quiet.append) as executor:
        assert list(executor.map(_die, iter(range(6)), str(tmp_path))) == [i * i for i in range(6)]
    assert quiet == []
