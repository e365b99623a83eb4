"""Store keys that last as long as the attempt: made anew by the control host, picked up by the worker.

Keys scoped to one run (AWS STS, ``credentials``) expire. While an attempt runs, the control host makes the next keys
each time the current ones have lived half their life (``Renewal``), seals them with the attempt's own seal (Fernet:
AES-128-CBC and HMAC-SHA256, from ``cryptography``) and puts them in the store, in the attempt's folder:
``<attempt>/keys/<n>.sealed``. The seal reaches the worker as a secret, as its first keys did (``SEAL_ENV``), and
never leaves it or this host: a sealed object reads as noise to whoever can list the bucket. The worker looks in that
folder every ``check_s`` (``Follower``) and signs with the newest keys from then on, a quarter of a life or more
before the old ones expire.

A worker whose keys the store refuses anyway (revoked, expired while the control host was down) stops with
``EXIT_KEYS_REFUSED`` and its last complete checkpoint in the store; the next attempt gets new keys and resumes.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ft_assets.storage import KeysRefused, ObjectStore, S3Store, StoreError

SEAL_ENV = "FT_KEYS_SEAL"  # the attempt's Fernet key: a secret
FOLDER_ENV = "FT_KEYS_FOLDER"  # where the sealed keys appear (a store key): plain
CHECK_ENV = "FT_KEYS_CHECK_S"  # how often the worker looks there: plain
EXIT_KEYS_REFUSED = 77  # the worker's exit code when the store refused its keys (sysexits' EX_NOPERM)
RENEW_AT = 0.5  # of a key's life: when the next keys are made
CHECKS_PER_LIFE = 20  # the worker looks this often in a life, at most once a minute


def new_seal() -> str:
    from cryptography.fernet import Fernet

    return Fernet.generate_key().decode()


def sealed(seal: str, keys: Mapping[str, str]) -> bytes:
    from cryptography.fernet import Fernet

    return Fernet(seal.encode()).encrypt(json.dumps(dict(keys)).encode())


def unsealed(seal: str, data: bytes) -> dict[str, str]:
    from cryptography.fernet import Fernet, InvalidToken

    try:
        return json.loads(Fernet(seal.encode()).decrypt(data))
    except InvalidToken:
        raise StoreError("renewed store keys that this attempt's seal does not open: not for this worker") from None


def check_seconds(life_s: float) -> float:
    return min(60.0, life_s / CHECKS_PER_LIFE)


@dataclass
class Renewal:
    """The control host's side for one attempt: ``mint`` makes keys that last ``life_s``; ``tick`` (called as the
    attempt is polled) makes and puts the next ones once the current ones have lived ``RENEW_AT`` of their life."""

    store: ObjectStore
    folder: str  # <attempt>/keys
    mint: Callable[[], dict[str, str]]
    life_s: float
    issued: float  # time.time() when the current keys were made
    seal: str
    count: int = 0  # keys renewed so far

    @classmethod
    def start(cls, store: ObjectStore, folder: str, mint: Callable[[], dict[str, str]], life_s: float):
        """The attempt's renewal, and its first keys (to launch the worker with)."""
        keys = mint()
        return cls(store, folder, mint, life_s, time.time(), new_seal()), keys

    def worker_env(self) -> tuple[dict[str, str], dict[str, str]]:
        """(plain settings, secrets) the worker needs to follow the renewals."""
        return {FOLDER_ENV: self.folder, CHECK_ENV: f"{check_seconds(self.life_s):g}"}, {SEAL_ENV: self.seal}

    def due(self, now: float) -> bool:
        return now >= self.issued + RENEW_AT * self.life_s

    def tick(self, log: Callable[[str], None], now: float | None = None) -> None:
        """Renew if due; a failure is logged and tried again at the next tick (the current keys still hold)."""
        now = time.time() if now is None else now
        if not self.due(now):
            return
        try:
            keys = self.mint()
            self.store.put_bytes(f"{self.folder}/{self.count + 1:04d}.sealed", sealed(self.seal, keys))
        except Exception as exc:  # noqa: BLE001 - the worker keeps its keys until they expire; retried next tick
            left = self.issued + self.life_s - now
            log(f"could not renew the worker's store keys ({type(exc).__name__}: {' '.join(str(exc).split())}); "
                f"its current keys expire in {left / 60:.0f} min; trying again")  # fmt: skip
            return
        self.count, self.issued = self.count + 1, now
        until = time.strftime("%H:%M UTC", time.gmtime(now + self.life_s))
        log(f"renewed the worker's store keys (renewal {self.count}; valid until {until})")


class Follower:
    """The worker's side: a daemon thread that switches ``store`` to the newest sealed keys in ``folder``."""

    def __init__(self, store: S3Store, folder: str, seal: str, check_s: float, log: Callable[[str], None]):
        self.store, self.folder, self.seal, self.check_s, self.log = store, folder, seal, check_s, log
        self.seen: str | None = None
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.run, name="store-keys", daemon=True)

    def check(self) -> bool:
        """Take the newest keys there if they are new; whether it did."""
        names = [key.rsplit("/", 1)[-1] for key in self.store.list(self.folder) if key.endswith(".sealed")]
        if not names or max(names) == self.seen:
            return False
        newest = max(names)
        keys = unsealed(self.seal, self.store.get_bytes(f"{self.folder}/{newest}"))
        self.store.use_keys(keys)
        os.environ.update(keys)  # a store opened later, a child process: the new keys too
        self.seen = newest
        self.log(f"this worker signs with renewed store keys from now on ({newest.split('.')[0].lstrip('0')})")
        return True

    def run(self) -> None:
        while not self.stopping.wait(self.check_s):
            try:
                self.check()
            except StoreError as exc:  # the next look may succeed; the keys in use still hold
                self.log(f"could not read renewed store keys: {exc}")

    def __enter__(self) -> Follower:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()


def follower(store: ObjectStore, environ: Mapping[str, str], log: Callable[[str], None]) -> Follower | None:
    """The worker's follower when its control host renews its keys (``FOLDER_ENV`` and ``SEAL_ENV`` set), else None."""
    if not (environ.get(FOLDER_ENV) and environ.get(SEAL_ENV) and isinstance(store, S3Store)):
        return None
    return Follower(store, environ[FOLDER_ENV], environ[SEAL_ENV], float(environ.get(CHECK_ENV) or 60), log)


def refused(exc: BaseException | None) -> KeysRefused | None:
    """The store's refusal of a worker's keys behind ``exc`` (raised in a checkpoint upload, say), if any."""
    while exc is not None:
        if isinstance(exc, KeysRefused):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None
