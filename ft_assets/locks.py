"""Partition leases: one run at a time writes the artifacts of a dataset version, on either backend.

The run queue serializes the runs of one partition (dagster.yaml: ``dagster/partition`` with
``applyLimitPerUniqueValue``), but ``ft-assets run``, ``dagster asset materialize`` and tests execute
in-process and never meet the queue, and two Dagster instances can share one bucket. So the store
holds the lock too, and a second writer fails at start with a message naming the run in its way,
before it has written anything.

Layout (``layout.PartitionLayout.lease``): ``leases/<name>/<version>/<generation>/owner.json`` names
the run that holds the partition; each process of that run (one per step under the multiprocess
executor) keeps a heartbeat object next to it, renewed every ``RENEW_SECONDS``, that names its host,
pid and the pid's start time. The owner object is created with an atomic create-if-absent
(``O_EXCL``-like hard link locally, ``If-None-Match: *`` on S3), so of two runs racing for the same
generation exactly one wins; a run taking over a free lease creates the next generation, so a
takeover is a race for a fresh key as well, and generations never go back.

A lease is free when its run is finished (asked of the Dagster instance), when a run this instance
does not know has released every heartbeat, when every process still holding it is known to be dead
(it ran on this host and no longer exists: an ``ft-assets run`` killed with SIGKILL is taken over at
once by the rerun), or when no heartbeat came for ``EXPIRY_SECONDS`` (a worker on another machine
killed with SIGKILL, whose run the instance still thinks is running).
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ft_assets import layout
from ft_assets.storage import ObjectNotFound, ObjectStore, StoreError, join_key

OWNER = "owner.json"
RENEW_SECONDS = 10.0  # heartbeat period of every process of the run holding a lease
EXPIRY_SECONDS = 60.0  # six missed heartbeats: the process is gone (or cut off from the store)

logger = logging.getLogger(__name__)

RunStatus = Callable[[str], "str | None"]  # run id -> "STARTED", "SUCCESS", ... or None if unknown here
FINISHED = frozenset({"SUCCESS", "FAILURE", "CANCELED"})


class PartitionBusy(StoreError):
    """Another run holds the partition's lease."""


@dataclass(frozen=True)
class LeaseState:
    generation: int
    owner: dict  # {"run_id", "lease_id", "partition", "created_at"}
    heartbeats: list[dict]  # [{"holder", "renewed_at", "released"}]


def read_lease(store: ObjectStore, partition: str, heartbeats: bool = True) -> LeaseState | None:
    """The newest generation that has an owner, with its heartbeats (unless not wanted); None if never leased."""
    prefix = layout.of(partition).lease
    generations: dict[int, list[str]] = {}
    for key in store.list(prefix):
        generation, _, name = key[len(prefix) + 1 :].partition("/")
        if generation.isdigit():
            generations.setdefault(int(generation), []).append(name)
    for generation in sorted(generations, reverse=True):
        names = generations[generation]
        if OWNER not in names:
            continue  # a late heartbeat of a lease that was taken over and cleaned up
        base = join_key(prefix, f"{generation:08d}")
        try:
            owner = store.get_json(join_key(base, OWNER))
        except ObjectNotFound:
            continue  # removed between the listing and the read: an older generation being cleaned up
        beats = []
        for name in names if heartbeats else ():
            if name.startswith("holders/"):
                try:
                    beats.append(store.get_json(join_key(base, name)))
                except ObjectNotFound:
                    pass
        return LeaseState(generation, owner, beats)
    return None


@dataclass(frozen=True)
class Busy:
    """Why a lease is held, and in how many seconds it frees itself if its holder has died silently."""

    message: str
    frees_in: float


def process_identity() -> dict:
    """Who holds a heartbeat: host, pid and the process's start time (so a reused pid is not mistaken for it)."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "pid_started": _start_time(os.getpid())}


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux /proc), None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22, counted after the command name


def gone_from_this_host(entry: dict) -> bool:
    """Whether the process named in a lease entry ran on this host and no longer exists."""
    if entry.get("host") != socket.gethostname() or not isinstance(entry.get("pid"), int):
        return False
    try:
        os.kill(entry["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # exists, owned by someone else
        pass
    return entry.get("pid_started") is not None and _start_time(entry["pid"]) != entry["pid_started"]


def busy_reason(state: LeaseState, run_status: RunStatus, now: float) -> Busy | None:
    """Why the lease is held, or None when it is free to take over.

    Free: the run finished (its Dagster status), every process still holding a heartbeat is known
    to be gone (it ran on this host and exited, e.g. a SIGKILLed ``ft-assets run``), or no heartbeat
    came for ``EXPIRY_SECONDS`` (a holder on another host that died silently).
    """
    run_id = state.owner["run_id"]
    status = run_status(run_id)
    if status in FINISHED:
        return None
    holding = [b for b in state.heartbeats if not b["released"]] or ([] if state.heartbeats else [state.owner])
    if holding and all(gone_from_this_host(entry) for entry in holding):
        return None
    beats = [state.owner["created_at"]] + [b["renewed_at"] for b in state.heartbeats]
    if status is None:
        # A run of another Dagster instance (or an ephemeral one): only its own heartbeats tell.
        live = [b["renewed_at"] for b in state.heartbeats if not b["released"]]
        if not state.heartbeats:
            live = [state.owner["created_at"]]  # created, first heartbeat not written yet
    else:
        live = beats  # known and not finished: between two steps, released heartbeats still count
    fresh = [t for t in live if now - t < EXPIRY_SECONDS]
    if not fresh:
        return None
    age = now - max(fresh)
    message = (
        f"partition {state.owner['partition']} is being materialized by run {run_id} "
        f"({status.lower() if status else 'unknown to this Dagster instance'}, last heartbeat {age:.0f} s ago)"
    )
    return Busy(message, EXPIRY_SECONDS - age)


def _holder_id() -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "-", f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


class Lease:
    """One process's share of a partition lease: a heartbeat renewed in a daemon thread until ``release``."""

    def __init__(self, store: ObjectStore, partition: str, generation: int, run_id: str):
        self.store, self.partition, self.generation, self.run_id = store, partition, generation, run_id
        self.base = join_key(layout.of(partition).lease, f"{generation:08d}")
        self.holder_key = join_key(self.base, "holders", f"{_holder_id()}.json")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _beat(self, released: bool = False) -> None:
        beat = {"holder": self.holder_key, "renewed_at": time.time(), "released": released, **process_identity()}
        self.store.put_json(self.holder_key, beat)

    def start(self) -> Lease:
        self._beat()
        self._thread = threading.Thread(target=self._renew, name=f"lease-{self.partition}", daemon=True)
        self._thread.start()
        return self

    def _renew(self) -> None:
        while not self._stop.wait(RENEW_SECONDS):
            try:
                self._beat()
            except StoreError as exc:  # an outage: keep trying; EXPIRY_SECONDS leaves room for several misses
                logger.warning("could not renew the lease on %s: %s", self.partition, exc)

    def held(self) -> bool:
        """Whether this run still holds the partition (nobody took the lease over after it expired)."""
        state = read_lease(self.store, self.partition, heartbeats=False)
        return state is not None and state.generation == self.generation and state.owner["run_id"] == self.run_id

    def release(self) -> None:
        """Stop the heartbeat and mark it released; the run's other processes keep theirs."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            self._beat(released=True)
        except StoreError as exc:  # the lease then expires on its own
            logger.warning("could not release the lease on %s: %s", self.partition, exc)


def acquire(store: ObjectStore, partition: str, run_id: str, run_status: RunStatus, now=time.time) -> Lease:
    """Hold ``partition`` for ``run_id`` (re-entrant for the run's other processes) or raise ``PartitionBusy``."""
    prefix = layout.of(partition).lease
    for _ in range(5):  # each pass either returns, raises, or lost a creation race and looks again
        state = read_lease(store, partition)
        if state is not None and state.owner["run_id"] == run_id:
            return Lease(store, partition, state.generation, run_id).start()
        if state is not None and (busy := busy_reason(state, run_status, now())):
            raise PartitionBusy(
                f"{busy.message}; retry when it finishes. A run that died without finishing frees it "
                f"{EXPIRY_SECONDS:.0f} s after its last heartbeat."
            )
        generation = state.generation + 1 if state else 1
        owner = {
            "run_id": run_id,
            "lease_id": uuid.uuid4().hex,
            "partition": partition,
            "created_at": now(),
            **process_identity(),
        }
        key = join_key(prefix, f"{generation:08d}", OWNER)
        created = store.put_bytes_if_absent(key, json.dumps(owner, indent=2).encode())
        if not created:
            try:  # a retried request may have created it before its answer was lost
                created = store.get_json(key).get("lease_id") == owner["lease_id"]
            except ObjectNotFound:
                created = False
        if created:
            lease = Lease(store, partition, generation, run_id).start()
            _drop_generations_below(store, prefix, generation)
            return lease
    raise PartitionBusy(f"partition {partition}: the lease changed hands five times while acquiring it; retry")


def _drop_generations_below(store: ObjectStore, prefix: str, generation: int) -> None:
    try:
        for key in store.list(prefix):
            head = key[len(prefix) + 1 :].split("/", 1)[0]
            if head.isdigit() and int(head) < generation:
                store.delete(key)
    except StoreError as exc:  # leftovers are ignored by read_lease and dropped by the next takeover
        logger.warning("could not clean up old leases under %s: %s", prefix, exc)
