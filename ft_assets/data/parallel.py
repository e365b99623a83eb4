"""Where the data plane's shards run: in this process, in a pool of worker processes, or as Ray tasks.

Every data-plane stage is a pure function over one shard, ``fn(common, shard)``: ``common`` holds
what all shards of the stage share (the cleaning rules, the tokenizer, where to write), the shard
says what it covers (a run of parts of the input artifact, a line range of a JSONL file, a whole
input file, a partition of the deduplication shuffle), and the function writes its parts of the
output itself (``ft_assets.data.parts``) and returns small values: the parts' descriptors, counts,
the shuffle's records. The stage's driver, the asset's own process, cuts the shards, hands them to
an ``Executor`` and adds up what comes back in shard order. So:

- The parts are cut from the data alone (``parts.PART_ROWS``) and shards are runs of whole parts,
  never cut from the number of workers: one process, N processes and a Ray cluster write the same
  files, byte for byte, whatever ``shard_rows`` is (``test_parallel.py`` compares their digests).
- ``InProcess`` (``workers=1``) runs every shard in turn in this process: the data plane as it
  always ran. Any executor runs a stage of a single shard here too, so a small version never
  starts a pool.
- ``ProcessPool`` runs ``workers`` spawned processes on this machine. A worker that dies (SIGKILL,
  the OOM killer) breaks the pool: it is restarted and the shards that were in flight run again,
  up to ``MAX_ATTEMPTS`` times in all. A part is renamed into place (or PUT) only once it is whole,
  its rerun writes the same bytes over it, and the artifact is committed only when every shard is
  back, so a kill never leaves a partial output.
- ``RayTasks`` runs one Ray task a shard on the Ray cluster this process is connected to (the
  assets connect through dagster-ray, ``ft_assets.data.resources``); Ray reruns the task of a dead
  worker (``max_retries``). ``remote`` (a cluster that may span machines): the workers reach the
  files of this machine (the inputs, the shuffle's spill, a local store) through Ray's object store
  (``share``) and send back the bytes of parts they cannot write; an S3 store they read and write
  themselves, by its URL (``StoreObject``), so the cluster needs no filesystem shared with the driver.

At most ``2 × workers`` shards are in flight, so the driver holds a bounded number of results however
large the dataset version is, and a worker holds one part at a time (``PART_ROWS`` rows; an input
file that cannot be split by lines or row groups, gzip, CSV or a JSON array, is one part).
"""

from __future__ import annotations

import hashlib
import io
import itertools
import multiprocessing
import os
import pickle
import shutil
import signal
import socket
import tempfile
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import pyarrow as pa

from ft_assets.storage import ObjectStore, open_store, store_kind

# Ray (the optional `ray` extra, ~1.5 s to import) and grpc are imported inside the functions that use them,
# so that in-process and pool runs never load them.

MAX_ATTEMPTS = 3  # runs of a shard whose worker died before the stage gives up on it
DEFAULT_SHARD_ROWS = 16_384  # rows a task works on: ~10 MB of chat rows, ~8 s of tokenizing on one core
IN_FLIGHT_PER_WORKER = 2  # shards queued per worker: one running, one ready while the driver writes a part
RAY_CONNECT_TIMEOUT_S = 15.0  # a Ray address that does not answer in this time is reported as such
PROGRESS_EVERY_S = 30.0  # a stage that runs longer says how far it is, this often


class ShardFailed(RuntimeError):
    """A shard could not be run: its worker kept dying, or the Ray cluster lost it."""


class RayUnreachable(ConnectionError):
    """A Ray address that does not answer; the message says which and what to check."""


@dataclass(frozen=True)
class RayFile:
    """A local file put into Ray's object store, for workers on other machines (``RayTasks.share``)."""

    ref: Any  # ray.ObjectRef of the file's bytes as a uint8 numpy array
    name: str


@dataclass(frozen=True)
class StoreObject:
    """An object of the store, which a worker reads itself: by the store's URL (a directory of this machine, or
    ``s3://bucket/prefix``, for which boto3 takes the endpoint and credentials from the worker's environment)."""

    url: str
    key: str


FileRef = Path | RayFile | StoreObject  # how a worker reaches a file: a path here, Ray's object store, or the store

_STORES: dict[str, ObjectStore] = {}  # per process: the stores opened by URL (an S3 client takes ~0.1 s to make)


def store_at(url: str) -> ObjectStore:
    """The store at ``url``, opened once per process."""
    if url not in _STORES:
        _STORES[url] = open_store(url)
    return _STORES[url]


def _local(file: FileRef) -> Path | None:
    """The file's path when it is one of this machine (an object of a local store included)."""
    if isinstance(file, Path):
        return file
    if isinstance(file, StoreObject) and store_kind(file.url) == "file":
        return store_at(file.url).path(file.key)
    return None


def _remote_bytes(file: RayFile | StoreObject):
    """The bytes of a file that is not on this machine: Ray's read-only view of its copy, or the object's body."""
    if isinstance(file, RayFile):
        import ray

        return ray.get(file.ref)
    return store_at(file.url).get_bytes(file.key)


def open_file(file: FileRef) -> BinaryIO:
    """The file's bytes as a binary file object, wherever the worker runs."""
    path = _local(file)
    return open(path, "rb") if path is not None else io.BytesIO(_remote_bytes(file))


def read_all(file: FileRef):
    """The whole file as a bytes-like object (a read-only view of the object store's copy for Ray)."""
    path = _local(file)
    return path.read_bytes() if path is not None else _remote_bytes(file)


def read_range(file: FileRef, start: int, stop: int) -> bytes:
    """Bytes ``[start, stop)`` of the file (only those are copied from a file of this machine or of Ray's object store)."""
    path = _local(file)
    if path is None:
        return bytes(_remote_bytes(file)[start:stop])
    with open(path, "rb") as handle:
        handle.seek(start)
        return handle.read(stop - start)


def arrow_file(file: FileRef):
    """The file as a pyarrow readable (memory-mapped on this machine), for Parquet and Arrow readers."""
    path = _local(file)
    return pa.memory_map(str(path)) if path is not None else pa.BufferReader(pa.py_buffer(_remote_bytes(file)))


def peak_rss_mib() -> float:
    """This process's peak resident set so far (VmHWM), in MiB."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@dataclass
class WorkerUsage:
    """What one worker process did: shards, CPU seconds in stage functions and in all (imports, loading the
    tokenizer), peak resident memory."""

    shards: int = 0
    cpu_s: float = 0.0
    process_cpu_s: float = 0.0
    peak_rss_mib: float = 0.0


# --- the worker side ---------------------------------------------------------------------------------

_COMMON: dict[str, Any] = {}  # per worker: the ``common`` of the stage it works for, loaded once


def _common(key: str, source: Any) -> Any:
    if key not in _COMMON:
        _COMMON.clear()
        if isinstance(source, Path):
            _COMMON[key] = pickle.loads(source.read_bytes())
        else:  # [ray.ObjectRef]: wrapped in a list so that Ray does not fetch it for every task
            import ray

            _COMMON[key] = ray.get(source[0])
    return _COMMON[key]


def _run_shard(fn: Callable, key: str, source: Any, shard: Any) -> tuple[Any, tuple]:
    """One shard in a worker: (part, its usage: worker id, CPU seconds, the worker's CPU seconds and peak RSS so far)."""
    started = time.process_time()
    part = fn(_common(key, source) if key else None, shard)
    finished = time.process_time()
    return part, (f"{socket.gethostname()}:{os.getpid()}", finished - started, finished, peak_rss_mib())


# --- executors -----------------------------------------------------------------------------------------


@dataclass
class Executor:
    """Runs the shards of a stage and gives their parts back in shard order (see the module docstring)."""

    workers: int = 1
    shard_rows: int = DEFAULT_SHARD_ROWS
    retried: int = 0  # shard runs repeated because a worker died (ProcessPool; Ray retries on its own)
    usage: dict[str, WorkerUsage] = field(default_factory=dict)  # per worker process (host:pid)
    log: Callable[[str], None] | None = None  # where a long stage reports its progress (the run's log)
    progress_every_s: float = PROGRESS_EVERY_S
    remote: bool = False  # whether workers may run on other machines, out of reach of this machine's files

    kind = "in-process"

    def map(self, fn: Callable[[Any, Any], Any], shards: Iterable, common: Any = None) -> Iterator:
        """``fn(common, shard)`` for every shard, lazily, in shard order; a stage of one shard runs here.
        A stage that runs longer than ``progress_every_s`` logs its shards done (of how many, when known)."""
        total = len(shards) if isinstance(shards, list | tuple | range) else None
        shards = iter(shards)
        head = list(itertools.islice(shards, 2))
        if len(head) < 2:
            yield from (self._here(fn, common, shard) for shard in head)
            return
        yield from self._progress(fn.__name__, self._map(fn, itertools.chain(head, shards), common), total)

    def _progress(self, name: str, parts: Iterator, total: int | None) -> Iterator:
        started = last = time.monotonic()
        done = 0
        for part in parts:
            done += 1
            now = time.monotonic()
            if self.log is not None and now - last >= self.progress_every_s:
                last = now
                of = f"/{total}" if total else ""
                eta = f", about {(now - started) / done * (total - done):.0f} s left" if total else ""
                self.log(f"{name}: {done}{of} shards done in {now - started:.0f} s on {self.describe()}{eta}")
            yield part

    def _here(self, fn: Callable, common: Any, shard: Any) -> Any:
        started = time.process_time()
        part = fn(common, shard)
        finished = time.process_time()
        self._record((f"{socket.gethostname()}:{os.getpid()}", finished - started, finished, peak_rss_mib()))
        return part

    def _record(self, usage: tuple) -> None:
        worker, cpu_s, process_cpu_s, rss_mib = usage
        counted = self.usage.setdefault(worker, WorkerUsage())
        counted.shards += 1
        counted.cpu_s += cpu_s
        counted.process_cpu_s = max(counted.process_cpu_s, process_cpu_s)
        counted.peak_rss_mib = max(counted.peak_rss_mib, rss_mib)

    def _map(self, fn: Callable, shards: Iterator, common: Any) -> Iterator:
        for shard in shards:
            yield self._here(fn, common, shard)

    def share(self, path: Path) -> FileRef:
        """How this executor's workers reach a file of this machine (the driver's scratch folder, a local store)."""
        return path

    def reaches(self, url: str) -> bool:
        """Whether the workers can read and write the store at ``url`` themselves: an S3 store always (the
        cluster needs its endpoint and credentials), a directory only from this machine."""
        return store_kind(url) == "s3" or not self.remote

    def describe(self) -> str:
        return "1 process (in-process)"

    def close(self) -> None:
        pass

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class InProcess(Executor):
    """Every shard in turn, in this process."""


def _worker_main(connection) -> None:
    """A pool worker: shards in, parts out, over its own pipe, until told to stop or the driver is gone."""
    while True:
        try:
            message = connection.recv()
        except EOFError:
            return
        if message is None:
            return
        try:
            reply = ("part", _run_shard(*message))
        except BaseException as exc:  # the stage function's own error, raised again in the driver
            try:
                pickle.loads(pickle.dumps(exc))
                reply = ("error", exc)
            except Exception:  # an exception class that does not survive pickling: its type and text do
                reply = ("error", RuntimeError(f"{type(exc).__name__}: {exc}"))
        try:
            connection.send(reply)
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            connection.send(
                ("error", RuntimeError(f"a shard's result or error cannot be sent back: {exc}; {reply[1]!r:.500}"))
            )


@dataclass(eq=False)
class _Task:
    """One shard of a map, from submission to its part (or error)."""

    message: tuple  # (fn, common key, common source, shard)
    attempts: int = 0
    done: bool = False
    part: Any = None
    error: BaseException | None = None


@dataclass
class ProcessPool(Executor):
    """``workers`` spawned processes on this machine; the shards of a worker that dies run again.

    Each worker has its own pipe (no queue or lock shared between workers), so a worker killed at any
    moment, even halfway through sending a part back, costs its own shard only: the driver sees the
    process end (and the pipe's end of file), sends the shard to a new worker and counts the attempt.
    Spawned, not forked: the driver runs Dagster's threads (logging, the lease heartbeat).
    """

    kind = "processes"

    def __post_init__(self):
        self._context = multiprocessing.get_context("spawn")
        self._workers: list[tuple[Any, Any]] = []  # (process, connection)
        self._busy: dict[int, _Task] = {}  # worker index -> task it runs
        self._queue: deque[_Task] = deque()  # tasks waiting for a worker, in submission order
        self._common_dir = Path(tempfile.mkdtemp(prefix="ft-shard-common-"))

    def describe(self) -> str:
        return f"{self.workers} worker processes"

    def _start_worker(self, index: int | None = None) -> None:
        parent, child = self._context.Pipe()
        process = self._context.Process(target=_worker_main, args=(child,), daemon=True, name="ft-data-worker")
        process.start()
        child.close()  # the driver keeps its own end only, so a dead worker's pipe reads as end of file
        if index is None:
            self._workers.append((process, parent))
        else:
            self._workers[index] = (process, parent)

    def _publish(self, common: Any) -> tuple[str, Path | None]:
        """``common`` pickled once into a file every worker reads (once per worker and stage)."""
        if common is None:
            return "", None
        data = pickle.dumps(common, protocol=pickle.HIGHEST_PROTOCOL)
        key = hashlib.sha256(data).hexdigest()[:24]
        path = self._common_dir / key
        if not path.exists():
            path.write_bytes(data)
        return key, path

    def _dispatch(self) -> None:
        if not self._workers:
            for _ in range(self.workers):
                self._start_worker()
        for index in range(len(self._workers)):
            if not self._queue:
                return
            if index in self._busy:
                continue
            task = self._queue.popleft()
            task.attempts += 1
            self._busy[index] = task
            try:
                self._workers[index][1].send(task.message)
            except (BrokenPipeError, ConnectionResetError, EOFError):
                self._lost(index)

    def _lost(self, index: int) -> None:
        """Worker ``index`` died: its shard goes back to the front of the queue, a new worker takes its place."""
        process, connection = self._workers[index]
        connection.close()
        process.join(timeout=1)
        task = self._busy.pop(index)
        if task.attempts >= MAX_ATTEMPTS:
            task.done, task.error = (
                True,
                ShardFailed(
                    f"the worker process running this shard died {task.attempts} times (killed by a signal, or by the OS for "
                    "lack of memory?); lower the data executor's shard_rows, or give the workers more memory"
                ),
            )
        else:
            self.retried += 1
            self._queue.appendleft(task)
        self._start_worker(index)

    def _wait(self, task: _Task) -> None:
        """Run the pool until ``task`` is done, handling every part, error and dead worker on the way."""
        from multiprocessing.connection import wait

        while not task.done:
            self._dispatch()
            handles = {}
            for index in self._busy:
                process, connection = self._workers[index]
                handles[connection] = handles[process.sentinel] = index
            for ready in wait(list(handles)):
                index = handles[ready]
                if index not in self._busy:
                    continue  # its pipe and its process both said something this round
                connection = self._workers[index][1]
                try:
                    kind, payload = connection.recv() if connection.poll() else (None, None)
                except (EOFError, ConnectionResetError, OSError):
                    kind = None
                if kind is None:
                    self._lost(index)
                    continue
                done = self._busy.pop(index)
                done.done = True
                if kind == "error":
                    done.error = payload
                else:
                    done.part, usage = payload
                    self._record(usage)

    def _map(self, fn: Callable, shards: Iterator, common: Any) -> Iterator:
        key, source = self._publish(common)
        tasks: deque[_Task] = deque()

        def fill() -> None:
            while len(tasks) < IN_FLIGHT_PER_WORKER * self.workers and (shard := next(shards, None)) is not None:
                tasks.append(_Task((fn, key, source, shard)))
                self._queue.append(tasks[-1])

        try:
            fill()
            while tasks:
                self._wait(tasks[0])
                task = tasks.popleft()
                if task.error is not None:
                    raise task.error
                fill()
                yield task.part
        finally:
            for task in tasks:  # a map given up early: its queued shards never start
                if task in self._queue:
                    self._queue.remove(task)

    def close(self) -> None:
        for process, connection in self._workers:
            try:
                connection.send(None)
            except OSError:
                pass
        for process, connection in self._workers:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()
            connection.close()
        self._workers = []
        shutil.rmtree(self._common_dir, ignore_errors=True)


@dataclass
class RayTasks(Executor):
    """One Ray task a shard on the cluster this process is connected to (``ray.init`` done by the caller).

    ``remote``: the cluster may have nodes on other machines (the default); False for a Ray started on
    this machine, whose workers read and write this machine's files directly.
    """

    remote: bool = True
    kind = "ray"

    def __post_init__(self):
        import ray

        if not ray.is_initialized():
            raise RuntimeError("RayTasks needs a connected Ray (ray.init, or a dagster-ray resource)")
        if self.workers <= 0:
            self.workers = max(1, int(ray.cluster_resources().get("CPU", 1)))
        self._task = ray.remote(num_cpus=1, max_retries=MAX_ATTEMPTS - 1)(_run_shard)

    def describe(self) -> str:
        return f"Ray, {self.workers} tasks at a time"

    def share(self, path: Path) -> FileRef:
        if not self.remote:
            return path
        import ray

        return RayFile(ray.put(np.fromfile(path, dtype=np.uint8)), Path(path).name)

    def _map(self, fn: Callable, shards: Iterator, common: Any) -> Iterator:
        import ray
        from ray.exceptions import RayTaskError

        key, source = ("", None) if common is None else (uuid.uuid4().hex, [ray.put(common)])
        queue: deque = deque()

        def fill() -> None:
            while len(queue) < IN_FLIGHT_PER_WORKER * self.workers and (shard := next(shards, None)) is not None:
                queue.append(self._task.remote(fn, key, source, shard))

        try:
            fill()
            while queue:
                try:
                    part, usage = ray.get(queue[0])
                except RayTaskError as exc:  # the stage function's own error: raise it as itself
                    raise (exc.cause if isinstance(exc.cause, BaseException) else exc) from None
                except ray.exceptions.RayError as exc:
                    raise ShardFailed(f"Ray could not run a shard after {MAX_ATTEMPTS} attempts: {exc}") from exc
                queue.popleft()
                self._record(usage)
                fill()
                yield part
        finally:
            for ref in queue:
                ray.cancel(ref)


@contextmanager
def sigterm_handler_kept() -> Iterator[None]:
    """Around ``ray.init`` (or a dagster-ray resource that calls it): SIGTERM's handler from before is back on exit.

    ``ray.init`` replaces the handler with its own (``sys.exit``) and ``ray.shutdown`` leaves it there, so the
    process would lose its own for the rest of its life: in a Dagster run, the handler that turns a terminate from
    the UI into a clean interrupt. Only the main thread sets handlers; a handler set outside Python cannot be put back.
    """
    handler = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
    try:
        yield
    finally:
        if handler is not None:
            signal.signal(signal.SIGTERM, handler)


def check_ray_address(address: str, timeout_s: float = RAY_CONNECT_TIMEOUT_S) -> None:
    """Fail within ``timeout_s`` with ``RayUnreachable`` when nothing Ray-like answers at ``address``.

    ``ray.init`` itself waits minutes for a head node that does not answer. Here: a TCP connection,
    then a gRPC handshake (the protocol of Ray's GCS and of the Ray Client server), each bounded.
    ``auto`` (the cluster this machine belongs to) is left to Ray, which answers at once.
    """
    if address in ("", "auto", "local"):
        return
    hostport = address.removeprefix("ray://").rstrip("/")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise RayUnreachable(
            f"Ray address {address!r}: expected ray://host:port (Ray Client) or host:port (the head's GCS)"
        )
    hint = "check the address and that the cluster's head node is up and reachable from here"
    started = time.monotonic()
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise RayUnreachable(f"the Ray cluster at {address} does not answer ({exc}); {hint}") from exc
    import grpc

    channel = grpc.insecure_channel(hostport)
    try:
        grpc.channel_ready_future(channel).result(timeout=max(1.0, timeout_s - (time.monotonic() - started)))
    except grpc.FutureTimeoutError as exc:
        raise RayUnreachable(
            f"the Ray cluster at {address} does not answer: a connection opens but no Ray service speaks on it within "
            f"{timeout_s:.0f} s; {hint} (Ray Client listens on 10001, the GCS on 6379)"
        ) from exc
    finally:
        channel.close()
