"""Deduplication: exact on normalized content, then near-duplicates by MinHash LSH over word n-grams.

Exact: a 128-bit BLAKE2b of each turn's role, word characters, numbers and math/currency symbols
after NFKC + casefold (``message_key``), so rows that differ only in case, Unicode form, spacing or
punctuation are one row whatever their length: "Convert 12 km to m." and "convert 12  KM to m!" are
one row, while "5 km" and "6 km", "5.5" and "55" (other numbers) and "x + 1" and "x = 1" (other
symbols) stay two. The first occurrence (file order) is kept. A minus sign written as a hyphen is
punctuation here: "-5" and "5" differ only in it.

Near: datasketch MinHash signatures (``num_perm`` permutations) of the word ``ngram``-shingles of
the user and assistant turns, shingled turn by turn (no shingle spans two turns, so "thanks!" at the
end of a request changes one shingle, not n) — system prompts are left out: a prompt shared by
every row would make every pair look alike. The LSH banding (b bands of r rows) comes from datasketch's own optimizer for
the threshold, so pairs above ≈ ``threshold`` Jaccard collide in at least one band. Bands are kept as
one uint64 hash per row per band in numpy arrays (8·b bytes a row — 112 B at the defaults, vs ~2 kB
a row for a dict-based index), and clusters are the connected components of band collisions.

Throughput: every row is normalized once (exact key, shingles and numbers all come from it); each
distinct word is hashed once and a shingle's hash is a vectorized combination of its words' hashes
(no shingle strings, no per-shingle SHA-1); the MinHash values of 64 rows at a time are one numpy
pass (datasketch's values for that shingle hash, which the index checks when it starts); exact
duplicates are found by sorting the 16-byte keys instead of a dict of every key (~130 bytes a row in
all), LSH collisions are found with numpy sorts (the shuffle's steps: ``ft_assets.data.shuffle``), and
each worker filters its parts' rows as Arrow batches and writes them with their duplicate records. On the
200k-row benchmark corpus this stage takes ~31 s of CPU (``stages.dedup`` in
``benchmarks/results/data_plane.json``, from ``make bench``); the version before it, with a SHA-1
and a joined string per shingle (datasketch's default hash), took 47 s in the same benchmark.

What must not collapse: short rows that differ in what matters. "Convert 12 km to m." and
"Convert 19 km to m." are 5 words — below ``min_words`` rows are only ever exact-deduplicated (on
the normalized key above, so case, spacing and punctuation never keep two short rows apart) — and
two rows whose numbers differ are never near-duplicates, whatever their Jaccard similarity.

Defaults follow the literature (Lee et al. 2022 "Deduplicating Training Data…", Penedo et al. 2024
FineWeb: 5-grams, 112–256 permutations, threshold ≈ 0.8).
"""

from __future__ import annotations

import functools
import hashlib
import math
import re
import tempfile
import unicodedata
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from ft_assets.data.parallel import Executor, FileRef, InProcess, read_all
from ft_assets.data.parts import Artifact, Part, Target, Written, part_name, read_part, runs
from ft_assets.data.rows import DUPLICATE_SCHEMA, ROW_SCHEMA, plain
from ft_assets.data.shuffle import (
    band_pairs,
    band_records,
    cluster_roots,
    exact_duplicates,
    exact_records,
    partition,
    unique_pairs,
)

_WORD = re.compile(r"\w+", re.UNICODE)
_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
_ASCII_NUMBER = re.compile(rb"\d+(?:[.,]\d+)*")
_FMIX32 = (16, 0x85EBCA6B, 13, 0xC2B2AE35, 16)  # MurmurHash3 finalizer: datasketch's "affine32" pre-mix
MINHASH_BATCH = 64  # rows permuted in one numpy pass: ~4.5k shingles x 128 uint32 stay in cache (8x faster than 512)
WORD_CACHE_SIZE = 1 << 19  # word -> hash entries kept (~50 MB); the cache starts over when full
PARTITION_BYTES = 128 << 20  # shuffle records a reduce task sorts, at most (about): bounds a worker's memory
MAX_PARTITIONS = 512  # ... up to 1.6 billion rows; more rows make bigger partitions. A map task cuts its records into
# this many buckets, the driver puts bucket b in partition b % partitions: it sizes the partitions from the first map
# result's band count, so it never builds a MinHasher itself (datasketch and scipy: ~0.6 s of CPU to import)


@dataclass(frozen=True)
class DedupRules:
    ngram: int = 5
    num_perm: int = 128
    threshold: float = 0.8
    min_words: int = 10  # rows with fewer words than 2·ngram give too few shingles to judge
    seed: int = 1
    near_duplicates: str = "drop"  # "drop" removes them; "keep" only groups them (split keeps clusters together)


def normalize(text: str) -> str:
    """NFKC, casefold, whitespace runs to one space, stripped.

    An ASCII string is already NFKC and casefolds to ``lower()``; ``split()`` splits on exactly the
    characters that ``\\s`` matches (``str.isspace``), so the join equals a regex substitution.
    """
    if text.isascii():
        return " ".join(text.lower().split())
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


def _kept_symbol(char: str) -> bool:
    """Math and currency symbols stay in the exact key ("x + 1" is not "x = 1"); punctuation does not."""
    return unicodedata.category(char) in ("Sm", "Sc")


_ASCII_NOT_KEPT = bytes(c for c in range(128) if not _kept_symbol(chr(c)))  # deleted by bytes.translate
_NON_WORD = re.compile(r"[^\w\s]")


def message_key(text: str) -> tuple[bytes, list[bytes], list[bytes]]:
    """One message's share of the exact key, its numbers and its words, from its ``normalize``d text.

    The share is the message's word characters run together (every space and punctuation mark gone:
    "Hello, world" and "Hello,world", "don't" and "dont" give the same run), then its numbers as
    written and its math/currency symbols in order. The numbers keep apart what the run merges:
    "5.5" and "55" (numbers 5.5 / 55), "5 5" and "55" (5, 5 / 55), "5.5" and "5,5".
    """
    if text.isascii():
        raw = text.encode()
        words, numbers = raw.translate(_ASCII_NON_WORD).split(), _ASCII_NUMBER.findall(raw)
        symbols = raw.translate(None, _ASCII_NOT_KEPT)
    else:
        words, numbers = [word.encode() for word in _WORD.findall(text)], [n.encode() for n in _NUMBER.findall(text)]
        symbols = "".join(c for c in _NON_WORD.findall(text) if _kept_symbol(c)).encode()
    return b"\x1f".join((b"".join(words), b" ".join(numbers), symbols)), numbers, words


@functools.lru_cache(maxsize=1024)
def _system_key(content: str) -> bytes:
    """``message_key`` of a system prompt: they repeat (8 distinct ones in the 200k-row benchmark corpus)."""
    return message_key(normalize(content))[0]


def _key(roles: Iterable[str], shares: Iterable[bytes]) -> bytes:
    joined = b"\x1e".join(role.encode() + b"\x1f" + share for role, share in zip(roles, shares))
    return hashlib.blake2b(joined, digest_size=16).digest()


def _with_images(share: bytes, message: dict) -> bytes:
    """A turn's share of the exact key with its images' references (their sha256): the same question about another
    picture is another row."""
    images = message.get("images")
    return share + b"\x1d" + " ".join(images).encode() if images else share


def exact_key(messages: list[dict]) -> bytes:
    """Equal for conversations whose turns differ only in case, Unicode form, spacing or punctuation (and hold the
    same images)."""
    return _key(
        (m["role"] for m in messages), (_with_images(message_key(normalize(m["content"]))[0], m) for m in messages)
    )


# --- shingle hashes ------------------------------------------------------------------------------
# A shingle's hash is built from the hashes of its words: h = sum(word_hash(w_i) * M_i) mod 2**64,
# folded to 32 bits, with odd per-position multipliers M_i. Each distinct word is hashed once (BLAKE2b,
# cached), and the shingles of a batch of rows are then a few vectorized multiply-adds instead of one
# string join and one SHA-1 per shingle. ``shingle_hash`` is the same function on a shingle's text:
# datasketch's ``MinHash(hashfunc=shingle_hash)`` computes exactly the index's signatures.

_word_hashes: dict[bytes, int] = {}
# \w on ASCII is [0-9A-Za-z_]: a byte table that turns every other byte into a space, then split().
_ASCII_NON_WORD = bytes(c if chr(c).isalnum() or c == ord("_") else 32 for c in range(128)) + bytes([32] * 128)


def words_of(text: str) -> list[bytes]:
    """The ``\\w+`` words of ``text``, UTF-8 encoded (a byte-table pass for ASCII text, the regex otherwise)."""
    if text.isascii():
        return text.encode().translate(_ASCII_NON_WORD).split()
    return [word.encode() for word in _WORD.findall(text)]


def word_hash(word: bytes) -> int:
    """A 64-bit hash of ``word``, never 0 (0 pads short turns)."""
    found = _word_hashes.get(word)
    if found is None:
        if len(_word_hashes) >= WORD_CACHE_SIZE:
            _word_hashes.clear()
        found = _word_hashes[word] = int.from_bytes(hashlib.blake2b(word, digest_size=8).digest(), "little") | 1
    return found


def word_hashes(words: list[bytes]) -> list[int]:
    """``word_hash`` of each word."""
    hashed = list(map(_word_hashes.get, words))  # the common case: every word seen before
    if None in hashed:
        hashed = [found or word_hash(word) for found, word in zip(hashed, words)]
    return hashed


@functools.lru_cache(maxsize=8)
def _position_multipliers(n: int) -> np.ndarray:
    return np.random.default_rng(20261130).integers(1, 2**63, n, dtype=np.uint64) | np.uint64(1)


def _fold32(h: np.ndarray) -> np.ndarray:
    return ((h >> np.uint64(32)) ^ h).astype(np.uint32)


def shingle_hash(shingle: bytes, n: int = 5) -> int:
    """The 32-bit hash of one shingle's text (its words joined by spaces): the reference definition."""
    words = shingle.split(b" ") if shingle else []
    mix = _position_multipliers(n)
    h = sum(word_hash(word) * int(m) for word, m in zip(words, mix)) % 2**64
    return int(_fold32(np.array([h], dtype=np.uint64))[0])


def _shingle_texts(words: list[bytes], n: int) -> Iterable[bytes]:
    """Word n-grams joined by spaces (the whole text when shorter than n): what ``shingle_hash`` reads."""
    if len(words) <= n:
        return (b" ".join(words),)
    return map(b" ".join, zip(*(words[i:] for i in range(n))))


def shingle_hashes(rows: list[list[list[int]]], n: int) -> tuple[np.ndarray, np.ndarray]:
    """``shingle_hash`` of every n-gram of every turn of ``rows`` (word hashes per turn, per row).

    Returns the uint32 hashes, row after row, and each row's count. Each turn is followed by n zeros,
    so a turn shorter than n (even an empty one) is one shingle of all its words and no n-gram spans
    two turns. Repeated shingles stay: a minimum over them is the minimum over the set.
    """
    pad = [0] * n
    flat: list[int] = []
    turn_starts: list[int] = []
    turn_shingles: list[int] = []
    counts: list[int] = []
    for turns in rows:
        count = 0
        for turn in turns:
            turn_starts.append(len(flat))
            turn_shingles.append(max(len(turn) - n + 1, 1))
            count += turn_shingles[-1]
            flat.extend(turn)
            flat.extend(pad)
        counts.append(count)
    words = np.array(flat, dtype=np.uint64)
    per_turn = np.array(turn_shingles, dtype=np.int64)
    # start of every shingle: its turn's start plus its position in the turn
    first = np.repeat(np.cumsum(per_turn) - per_turn, per_turn)
    at = np.repeat(np.array(turn_starts, dtype=np.int64), per_turn) + (np.arange(len(first)) - first)
    mix = _position_multipliers(n)
    h = words[at] * mix[0]
    for i in range(1, n):
        h += words[at + i] * mix[i]  # wraps mod 2**64 by design
    return _fold32(h), np.array(counts, dtype=np.int64)


def numbers_salt(numbers: Iterable[bytes]) -> int:
    """A hash of the numbers of a row, whatever their order: rows whose numbers differ never collide."""
    return int.from_bytes(hashlib.blake2b(b" ".join(sorted(numbers)), digest_size=8).digest(), "little")


@dataclass(frozen=True)
class RowFeatures:
    """What deduplication needs of one row, from one normalization of each message."""

    key: bytes  # exact_key(messages)
    turns: list[list[int]] | None  # word hashes of the user/assistant turns; None: too short to judge
    salt: int  # numbers_salt of the user/assistant turns' numbers and images: rows whose numbers or images differ never collide


def row_features(messages: list[dict], rules: DedupRules) -> RowFeatures:
    shares, turns, numbers = [], [], []
    for message in messages:
        if message["role"] == "system":  # left out of the shingles and the numbers guard
            shares.append(_system_key(message["content"]))
            continue
        share, found, words = message_key(normalize(message["content"]))
        shares.append(_with_images(share, message))
        turns.append(words)
        numbers += found + [image.encode() for image in message.get("images") or ()]  # other images: never near
    hashed = [word_hashes(words) for words in turns] if sum(map(len, turns)) >= rules.min_words else None
    return RowFeatures(_key((m["role"] for m in messages), shares), hashed, numbers_salt(numbers))


class MinHasher:
    """MinHash signatures and LSH band hashes of rows given as ``RowFeatures``.

    Signatures are datasketch's ``MinHash(hashfunc=shingle_hash)`` (scheme "affine32": the shingle
    hash, MurmurHash3 pre-mix, ``a·h + b mod 2**32`` per permutation), computed for a batch of rows in
    one numpy pass instead of one ``MinHash`` object per row, and the constructor checks that the
    values are datasketch's own. A band's ``r`` values fold into one uint64 (8 bytes a row a band),
    mixed with the row's numbers salt so that rows whose numbers differ never collide.
    """

    # Banding tuned to miss few true pairs (weights 0.1 false positive / 0.9 false negative: at the
    # default 0.8 threshold, 14 bands x 9 rows catch 87% of pairs at J=0.8 and 97.5% at J=0.85);
    # the false positives this lets in are removed by the verification in ``cluster_roots``.
    FALSE_POSITIVE_WEIGHT, FALSE_NEGATIVE_WEIGHT = 0.1, 0.9

    def __init__(self, rules: DedupRules):
        from datasketch import MinHash  # here, not at the top: ~2 s to import, for near deduplication only
        from datasketch.lsh import _optimal_param

        self.rules = rules
        self.bands, self.rows_per_band = _optimal_param(
            rules.threshold, rules.num_perm, self.FALSE_POSITIVE_WEIGHT, self.FALSE_NEGATIVE_WEIGHT
        )
        template = MinHash(num_perm=rules.num_perm, seed=rules.seed)
        if template.scheme != "affine32":
            raise RuntimeError(f"datasketch's default MinHash scheme is now {template.scheme!r}; update dedup.py")
        self._a, self._b = (np.asarray(p, dtype=np.uint32) for p in template.permutations)
        # Odd 64-bit multipliers fold a band's r values into one uint64 (a polynomial hash).
        self._mix = np.random.default_rng(rules.seed).integers(1, 2**63, self.rows_per_band, dtype=np.uint64) | 1
        # A probe row: a long turn, a short one and an empty one, against datasketch on the shingle texts.
        probe = [words_of(text) for text in ("the probe turn has more words than one shingle", "two words", "")]
        reference = MinHash(num_perm=rules.num_perm, seed=rules.seed, hashfunc=lambda b: shingle_hash(b, rules.ngram))
        reference.update_batch([s for turn in probe for s in _shingle_texts(turn, rules.ngram)])
        if not np.array_equal(self.minhashes([[word_hashes(turn) for turn in probe]])[0], reference.hashvalues):
            raise RuntimeError("batched MinHash values differ from datasketch's; update dedup.py")

    def minhashes(self, rows: list[list[list[int]]]) -> np.ndarray:
        """MinHash values (rows x num_perm, uint32) of rows given as word hashes per turn, in one numpy pass."""
        h, counts = shingle_hashes(rows, self.rules.ngram)
        values = np.full((len(rows), len(self._a)), np.iinfo(np.uint32).max, dtype=np.uint32)  # datasketch's empty
        if not len(h):
            return values
        s1, m1, s2, m2, s3 = _FMIX32
        h ^= h >> np.uint32(s1)
        h *= np.uint32(m1)
        h ^= h >> np.uint32(s2)
        h *= np.uint32(m2)
        h ^= h >> np.uint32(s3)
        # permutations x shingles, so that each row's minimum runs over contiguous memory
        permuted = self._a[:, None] * h  # uint32: wraps mod 2**32, like datasketch
        permuted += self._b[:, None]
        filled = np.flatnonzero(counts)
        starts = (np.cumsum(counts) - counts)[filled]
        values[filled] = np.minimum.reduceat(permuted, starts, axis=1).T
        return values

    def signature(self, messages: list[dict]) -> np.ndarray | None:
        """MinHash values of the row, or None when it is too short to judge."""
        turns = row_features(messages, self.rules).turns
        return None if turns is None else self.minhashes([turns])[0]

    def band_hashes(self, rows: list[RowFeatures]) -> tuple[np.ndarray, np.ndarray]:
        """(rows x bands uint64 band hashes, whether each row is long enough to be compared at all)."""
        hashes = np.zeros((len(rows), self.bands), dtype=np.uint64)
        eligible = np.array([row.turns is not None for row in rows], dtype=bool)
        for start in range(0, len(rows), MINHASH_BATCH):
            chunk = rows[start : start + MINHASH_BATCH]
            judged = [row for row in chunk if row.turns is not None]
            if not judged:
                continue
            values = self.minhashes([row.turns for row in judged])
            bands = values[:, : self.bands * self.rows_per_band].reshape(-1, self.bands, self.rows_per_band)
            band_hashes = (bands.astype(np.uint64) * self._mix).sum(axis=2)  # wraps mod 2**64 by design
            salts = np.array([row.salt for row in judged], dtype=np.uint64)
            at = start + np.flatnonzero(eligible[start : start + len(chunk)])
            hashes[at] = band_hashes ^ salts[:, None]  # numbers mixed in: rows with different numbers never collide
        return hashes, eligible


@functools.lru_cache(maxsize=4)
def minhasher(rules: DedupRules) -> MinHasher:
    """One ``MinHasher`` per process and rules (its constructor checks itself against datasketch)."""
    return MinHasher(rules)


# --- the stage's tasks (``fn(common, shard)``, see ``ft_assets.data.parallel``) --------------------------


@dataclass(frozen=True)
class DedupMap:
    """A run's part of the shuffle: its exact keys in row order, its records split into ``MAX_PARTITIONS`` buckets,
    and the LSH banding that made them."""

    keys: bytes  # 16 bytes a row
    exact: list[np.ndarray]
    bands: list[np.ndarray]
    lsh: tuple[int, int]  # (bands, rows a band)


def map_run(rules: DedupRules, run: list[Part]) -> DedupMap:
    """Exact keys and band hashes of a run's rows (the costly part: one normalization of each message)."""
    hasher = minhasher(rules)
    features = [
        row_features(messages, rules)
        for part in run
        for messages in map(plain, read_part(part, ["messages"]).column("messages").to_pylist())
    ]
    keys = np.frombuffer(b"".join(f.key for f in features), dtype=np.uint8).reshape(-1, 16)
    hashes, eligible = hasher.band_hashes(features)
    exact = exact_records(keys, run[0].start)  # the parts of a run are consecutive: its rows are numbered on
    bands = band_records(hashes, eligible, run[0].start)
    buckets = (partition(exact, exact[:, 0], MAX_PARTITIONS), partition(bands, bands[:, 1], MAX_PARTITIONS))
    return DedupMap(keys.tobytes(), *buckets, (hasher.bands, hasher.rows_per_band))


def reduce_exact(_, records: FileRef) -> np.ndarray:
    return exact_duplicates(np.frombuffer(read_all(records), dtype=np.uint64).reshape(-1, 3))


def reduce_bands(excluded: FileRef, records: FileRef) -> np.ndarray:
    return band_pairs(
        np.frombuffer(read_all(records), dtype=np.uint64).reshape(-1, 3),
        np.frombuffer(read_all(excluded), dtype=np.int64),
    )


def look_up(rules: DedupRules, run: list[tuple[Part, np.ndarray, np.ndarray]]) -> tuple[np.ndarray, list[str]]:
    """For each (part, candidate rows, rows asked for) of a run (global row numbers, sorted): the MinHash signatures
    of the candidates, and the sources of the rows asked for (the rows others repeat, the clusters' roots)."""
    signatures, sources = [], []
    for part, candidates, wanted in run:
        table = read_part(part, ["source", "messages"])
        conversations = list(map(plain, table.column("messages").take(candidates - part.start).to_pylist()))
        signatures += [minhasher(rules).signature(messages) for messages in conversations]
        sources += table.column("source").take(wanted - part.start).to_pylist()
    return np.stack(signatures) if signatures else np.empty((0, rules.num_perm), np.uint32), sources


@dataclass(frozen=True)
class FilterItem:
    """What the last pass needs to know of one part's rows: their keys and which of them go."""

    part: Part
    keys: bytes  # 16 bytes a row, the part's own
    exact: list[tuple[int, str]]  # (part row, the source of the earlier row it repeats), in row order
    merged: list[tuple[int, str, bytes]]  # (part row, its cluster root's source, the root's key)


def filter_part(near_duplicates: str, item: FilterItem) -> tuple[pa.Table, pa.Table]:
    """(kept rows with their cluster key, duplicate records: exact ones, then near ones) of one part; the rows are
    filtered as Arrow."""
    table = read_part(item.part)
    clusters = [item.keys[at : at + 16].hex() for at in range(0, len(item.keys), 16)]
    kept = np.ones(table.num_rows, dtype=bool)
    kept[[row for row, _ in item.exact]] = False
    sources = table.column("source")
    records = [{"source": sources[row].as_py(), "kind": "exact", "duplicate_of": first} for row, first in item.exact]
    for row, root_source, root_key in item.merged:
        if near_duplicates == "drop":
            kept[row] = False
            records.append({"source": sources[row].as_py(), "kind": "near", "duplicate_of": root_source})
        else:
            clusters[row] = root_key.hex()
    mask = pa.array(kept)
    cluster = pa.array([c for c, keep in zip(clusters, kept.tolist()) if keep], type=pa.string())
    rows = pa.Table.from_arrays(
        [sources.filter(mask), cluster, table.column("messages").filter(mask)], schema=ROW_SCHEMA
    )
    return rows, pa.Table.from_pylist(records, schema=DUPLICATE_SCHEMA)


def filter_run(settings: tuple[str, Target], run: list[FilterItem]) -> list[tuple[Written, Written]]:
    """Each part of a run through ``filter_part``, written as its ``rows`` and ``duplicates`` parts (a data-plane task)."""
    near_duplicates, target = settings
    done = []
    for item in run:
        rows, duplicates = filter_part(near_duplicates, item)
        index = item.part.index
        done.append((
            target.put_table(part_name("rows", index), rows, ROW_SCHEMA),
            target.put_table(part_name("duplicates", index), duplicates, DUPLICATE_SCHEMA),
        ))  # fmt: skip
    return done


# --- the stage, in the driver ----------------------------------------------------------------------------


def _map(
    executor: Executor, tasks: list[list[Part]], rules: DedupRules, total: int, spill: Path
) -> tuple[int, tuple[int, int]]:
    """Step 1: the map tasks; their keys and records spilled to ``spill`` (``keys``, ``exact-P``, ``bands-P``), bucket b
    in partition b % partitions. Returns the partitions and the LSH banding (bands, rows a band)."""
    partitions, lsh = 0, (0, 0)
    with open(spill / "keys", "wb") as keys_file:
        for part in executor.map(map_run, tasks, rules):
            if not partitions:  # a row's exact record and its band records, if it is long enough
                lsh, record_bytes = part.lsh, 3 * 8 * (1 + part.lsh[0])
                partitions = min(
                    MAX_PARTITIONS, max(executor.workers, math.ceil(total * record_bytes / PARTITION_BYTES), 1)
                )
                for p in range(partitions):
                    for kind in ("exact", "bands"):
                        (spill / f"{kind}-{p}").touch()
            keys_file.write(part.keys)
            for kind, buckets in (("exact", part.exact), ("bands", part.bands)):
                for p in range(partitions):
                    pieces = [piece for piece in buckets[p::partitions] if len(piece)]
                    if pieces:
                        with open(
                            spill / f"{kind}-{p}", "ab"
                        ) as handle:  # hundreds of partitions: not all open at once
                            handle.write(np.concatenate(pieces).tobytes())
    return partitions, lsh


def _reduce(executor: Executor, spill: Path, partitions: int, total: int) -> tuple[np.ndarray, np.ndarray]:
    """Steps 2 and 3: (every exact duplicate with the row it repeats, sorted by row; the distinct colliding pairs)."""
    exact_parts = list(executor.map(reduce_exact, (executor.share(spill / f"exact-{p}") for p in range(partitions))))
    duplicates = np.concatenate(exact_parts) if exact_parts else np.empty((0, 2), dtype=np.int64)
    duplicates = duplicates[np.argsort(duplicates[:, 0], kind="stable")]
    (spill / "excluded").write_bytes(duplicates[:, 0].tobytes())
    excluded = executor.share(spill / "excluded")
    band_parts = list(
        executor.map(reduce_bands, (executor.share(spill / f"bands-{p}") for p in range(partitions)), excluded)
    )
    return duplicates, unique_pairs(
        np.concatenate(band_parts) if band_parts else np.empty((0, 2), dtype=np.int64), max(total, 1)
    )


def _in_parts(rows: np.ndarray, parts: list[Part]) -> list[np.ndarray]:
    """Sorted global row numbers cut at the parts' bounds: the rows of each part."""
    bounds = np.searchsorted(rows, [part.start for part in parts] + [parts[-1].start + parts[-1].rows if parts else 0])
    return [rows[bounds[i] : bounds[i + 1]] for i in range(len(parts))]


def _clusters(executor: Executor, parts: list[Part], pairs: np.ndarray, duplicates: np.ndarray, rules: DedupRules):
    """Step 4: (rows merged into a cluster, their cluster roots, the sources of the rows others repeat or merge into)."""
    candidates = np.unique(pairs)
    wanted = np.unique(np.concatenate([duplicates[:, 1], candidates]))
    items = [item for item in zip(parts, _in_parts(candidates, parts), _in_parts(wanted, parts)) if len(item[2])]
    found = list(executor.map(look_up, list(runs(items, lambda item: item[0].rows, executor.shard_rows)), rules))
    signatures = np.concatenate([s for s, _ in found]) if found else np.empty((0, rules.num_perm), np.uint32)
    sources = dict(zip(wanted.tolist(), (source for _, names in found for source in names)))
    roots = cluster_roots(pairs, candidates, signatures, rules.threshold)
    return candidates[roots != candidates], roots[roots != candidates], sources


def _filter_items(
    parts: list[Part], keys: np.ndarray, duplicates: np.ndarray, merged: np.ndarray, roots: np.ndarray, sources: dict
) -> Iterator[FilterItem]:
    """Step 5's work, part by part (made as the tasks are sent: each holds its part's keys)."""
    exact = _in_parts(duplicates[:, 0], parts)
    exact_at = np.searchsorted(duplicates[:, 0], [part.start for part in parts])
    into = dict(zip(merged.tolist(), roots.tolist()))
    for part, rows, at, near in zip(parts, exact, exact_at, _in_parts(merged, parts)):
        firsts = duplicates[at : at + len(rows), 1].tolist()
        yield FilterItem(
            part, keys[part.start : part.start + part.rows].tobytes(),
            [(row - part.start, sources[first]) for row, first in zip(rows.tolist(), firsts)],
            [(row - part.start, sources[into[row]], bytes(keys[into[row]])) for row in near.tolist()],
        )  # fmt: skip


def deduplicate_dataset(
    cleaned: Artifact, out: Artifact, rules: DedupRules, executor: Executor | None = None, scratch: Path | None = None
) -> dict:
    """Exact then near deduplication of the ``rows`` parts of ``cleaned``, as a map, two shuffles, a look-up and a
    filter, into the ``rows`` and ``duplicates`` parts of ``out``.

    1. map (a run of parts a task): every row's exact key and band hashes; records go to ``partitions`` files by
       key and by band hash (the driver spills them to ``scratch``: ~130 bytes a row).
    2. reduce by key (per partition): each row that repeats an earlier one, with that row.
    3. reduce by band hash (per partition): pairs of rows, exact duplicates left out, that share a band.
    4. look-up (per run) of the signatures of the rows in some pair and of the sources of the rows that others
       repeat; then ``cluster_roots`` in the driver: verified pairs, union-find, each row's cluster root. Memory
       here grows with the pairs, not the rows.
    5. filter (per run): each worker writes its parts' kept rows, with their cluster key, and their duplicate
       records (the exact ones in row order with the row they repeat, then the near ones with the row kept for
       their cluster).

    Steps run on ``executor`` (default: this process); the result does not depend on it.
    """
    if rules.near_duplicates not in ("drop", "keep"):
        raise ValueError(f"near_duplicates must be 'drop' or 'keep', got {rules.near_duplicates!r}")
    executor = executor or InProcess()
    parts = cleaned.parts("rows", executor)
    total = sum(part.rows for part in parts)
    with tempfile.TemporaryDirectory(prefix="ft-dedup-", dir=scratch) as spill:
        spill = Path(spill)
        partitions, lsh = _map(
            executor, list(runs(parts, lambda part: part.rows, executor.shard_rows)), rules, total, spill
        )
        shuffled = sum(path.stat().st_size for path in spill.glob("*-*"))
        duplicates, pairs = _reduce(executor, spill, partitions, total)
        merged, roots, sources = _clusters(executor, parts, pairs, duplicates, rules)
        keys = (
            np.memmap(spill / "keys", dtype=np.uint8, mode="r", shape=(total, 16))
            if total
            else np.empty((0, 16), np.uint8)
        )
        items = _filter_items(parts, keys, duplicates, merged, roots, sources)
        tasks = runs(items, lambda item: item.part.rows, executor.shard_rows)
        for run in executor.map(filter_run, tasks, (rules.near_duplicates, out.target(executor))):
            for rows, records in run:
                out.add(rows, records)
        del keys
    return {
        "rows_kept": out.rows("rows"),
        "exact_duplicates": len(duplicates),
        "near_duplicates": len(merged) if rules.near_duplicates == "drop" else 0,
        "near_clusters": total - len(duplicates) - len(merged),
        "lsh_bands": lsh[0],
        "lsh_rows_per_band": lsh[1],
        "lsh_pairs_verified": len(pairs),
        "shuffle_bytes": shuffled,
    }
