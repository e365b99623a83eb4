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
all), LSH collisions are found with numpy sorts, and the rows are filtered as Arrow batches. On the
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
import re
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_WORD = re.compile(r"\w+", re.UNICODE)
_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
_ASCII_NUMBER = re.compile(rb"\d+(?:[.,]\d+)*")
_FMIX32 = (16, 0x85EBCA6B, 13, 0xC2B2AE35, 16)  # MurmurHash3 finalizer: datasketch's "affine32" pre-mix
MINHASH_BATCH = 64  # rows permuted in one numpy pass: ~4.5k shingles x 128 uint32 stay in cache (8x faster than 512)
WORD_CACHE_SIZE = 1 << 19  # word -> hash entries kept (~50 MB); the cache starts over when full


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


def exact_key(messages: list[dict]) -> bytes:
    """Equal for conversations whose turns differ only in case, Unicode form, spacing or punctuation."""
    return _key((m["role"] for m in messages), (message_key(normalize(m["content"]))[0] for m in messages))


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
    salt: int  # numbers_salt of the user/assistant turns' numbers: rows whose numbers differ never collide


def row_features(messages: list[dict], rules: DedupRules) -> RowFeatures:
    shares, turns, numbers = [], [], []
    for message in messages:
        if message["role"] == "system":  # left out of the shingles and the numbers guard
            shares.append(_system_key(message["content"]))
            continue
        share, found, words = message_key(normalize(message["content"]))
        shares.append(share)
        turns.append(words)
        numbers += found
    hashed = [word_hashes(words) for words in turns] if sum(map(len, turns)) >= rules.min_words else None
    return RowFeatures(_key((m["role"] for m in messages), shares), hashed, numbers_salt(numbers))


class _UnionFind:
    def __init__(self, n: int):
        self.parent = np.arange(n, dtype=np.int64)

    def find(self, i: int) -> int:
        root = i
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[i] != root:
            self.parent[i], i = root, self.parent[i]
        return int(root)

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:  # the smaller index (earlier row) becomes the root: it is the one kept
            self.parent[max(ra, rb)] = min(ra, rb)

    def roots(self) -> np.ndarray:
        """``find(i)`` for every i at once, by pointer jumping (parents only ever point down)."""
        roots = self.parent.copy()
        while not np.array_equal(jumped := roots[roots], roots):
            roots = jumped
        return roots


class NearDuplicateIndex:
    """Collects MinHash band hashes row by row, then resolves clusters in one vectorized pass.

    Rows are numbered in insertion order. ``candidates()`` lists the rows that collide with another
    row in some band; ``clusters(signatures)`` verifies each colliding pair on the MinHash estimate of
    its Jaccard similarity (the caller recomputes ``signature()`` for the candidates only, so full
    signatures are never all held at once) and maps each row to the smallest row index of its cluster.
    Rows too short to judge map to themselves.

    Signatures are datasketch's ``MinHash(hashfunc=shingle_hash)`` (scheme "affine32": the shingle
    hash, MurmurHash3 pre-mix, ``a·h + b mod 2**32`` per permutation), computed for a batch of rows in
    one numpy pass instead of one ``MinHash`` object per row, and the constructor checks that the
    values are datasketch's own.
    """

    CHUNK = 65_536  # rows per numpy block: the index grows in blocks instead of per row
    # Banding tuned to miss few true pairs (weights 0.1 false positive / 0.9 false negative: at the
    # default 0.8 threshold, 14 bands x 9 rows catch 87% of pairs at J=0.8 and 97.5% at J=0.85);
    # the false positives this lets in are removed by the verification in ``clusters``.
    FALSE_POSITIVE_WEIGHT, FALSE_NEGATIVE_WEIGHT = 0.1, 0.9

    def __init__(self, rules: DedupRules):
        from datasketch import MinHash
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
        self._blocks: list[tuple[np.ndarray, np.ndarray]] = []  # (band hashes, eligible) per full block
        self._new_block()
        self.count = 0
        self.pairs_checked = 0
        # A probe row: a long turn, a short one and an empty one, against datasketch on the shingle texts.
        probe = [words_of(text) for text in ("the probe turn has more words than one shingle", "two words", "")]
        reference = MinHash(num_perm=rules.num_perm, seed=rules.seed, hashfunc=lambda b: shingle_hash(b, rules.ngram))
        reference.update_batch([s for turn in probe for s in _shingle_texts(turn, rules.ngram)])
        if not np.array_equal(self.minhashes([[word_hashes(turn) for turn in probe]])[0], reference.hashvalues):
            raise RuntimeError("batched MinHash values differ from datasketch's; update dedup.py")

    def _new_block(self) -> None:
        self._block = np.zeros((self.CHUNK, self.bands), dtype=np.uint64)
        self._eligible = np.zeros(self.CHUNK, dtype=bool)  # False: too short, never compared
        self._fill = 0

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

    def add(self, messages: list[dict]) -> None:
        self.add_rows([row_features(messages, self.rules)])

    def add_rows(self, rows: list[RowFeatures]) -> None:
        for start in range(0, len(rows), MINHASH_BATCH):
            chunk = rows[start : start + MINHASH_BATCH]
            eligible = np.array([row.turns is not None for row in chunk], dtype=bool)
            hashes = np.zeros((len(chunk), self.bands), dtype=np.uint64)
            if eligible.any():
                values = self.minhashes([row.turns for row in chunk if row.turns is not None])
                bands = values[:, : self.bands * self.rows_per_band].reshape(-1, self.bands, self.rows_per_band)
                band_hashes = (bands.astype(np.uint64) * self._mix).sum(axis=2)  # wraps mod 2**64 by design
                salts = np.array([row.salt for row in chunk if row.turns is not None], dtype=np.uint64)
                hashes[eligible] = band_hashes ^ salts[:, None]  # numbers mixed in: rows with different numbers never collide
            self._append(hashes, eligible)

    def _append(self, hashes: np.ndarray, eligible: np.ndarray) -> None:
        done = 0
        while done < len(hashes):
            take = min(len(hashes) - done, self.CHUNK - self._fill)
            self._block[self._fill : self._fill + take] = hashes[done : done + take]
            self._eligible[self._fill : self._fill + take] = eligible[done : done + take]
            self._fill += take
            self.count += take
            done += take
            if self._fill == self.CHUNK:
                self._blocks.append((self._block, self._eligible))
                self._new_block()

    def _table(self) -> tuple[np.ndarray, np.ndarray]:
        blocks = self._blocks + [(self._block[: self._fill], self._eligible[: self._fill])]
        return np.concatenate([b for b, _ in blocks]), np.concatenate([e for _, e in blocks])

    def keep_only(self, rows: np.ndarray) -> None:
        """Drop every row not in ``rows`` (sorted indices) and renumber the rest 0, 1, 2, …"""
        table, eligible = self._table()
        self._blocks = [(table[rows], eligible[rows])]
        self._new_block()
        self.count = len(rows)

    def _collisions(self) -> list[tuple[int, int]]:
        """Sorted (first, other) pairs: rows sharing a band hash, each against the run's first row."""
        if not self.count:
            return []
        table, eligible = self._table()
        rows = np.flatnonzero(eligible)
        found = []
        for band in range(self.bands):
            hashes = table[rows, band]
            order = np.argsort(hashes, kind="stable")  # stable: a run of equal hashes starts at its smallest row
            sorted_hashes = hashes[order]
            starts_run = np.empty(len(order), dtype=bool)
            starts_run[:1] = True
            np.not_equal(sorted_hashes[1:], sorted_hashes[:-1], out=starts_run[1:])
            run_first = order[np.flatnonzero(starts_run)][np.cumsum(starts_run) - 1]
            members = ~starts_run
            found.append(rows[run_first[members]] * self.count + rows[order[members]])
        codes = np.unique(np.concatenate(found)) if found else np.empty(0, dtype=np.int64)
        return list(zip((codes // self.count).tolist(), (codes % self.count).tolist()))

    def candidates(self) -> set[int]:
        self._pairs = self._collisions()
        return {i for pair in self._pairs for i in pair}

    def clusters(self, signatures: dict[int, np.ndarray]) -> np.ndarray:
        union = _UnionFind(self.count)
        for a, b in getattr(self, "_pairs", None) or self._collisions():
            self.pairs_checked += 1
            if float(np.mean(signatures[a] == signatures[b])) >= self.rules.threshold:
                union.union(a, b)
        return union.roots()


def _first_occurrences(keys: np.ndarray) -> np.ndarray:
    """For each row, the index of the first row with the same 16-byte key (itself if none earlier)."""
    if not len(keys):
        return np.empty(0, dtype=np.int64)
    halves = keys.view(np.uint64).reshape(-1, 2)
    order = np.lexsort((halves[:, 1], halves[:, 0]))  # stable: equal keys stay in row order
    ordered = halves[order]
    new_key = np.ones(len(order), dtype=bool)
    new_key[1:] = np.any(ordered[1:] != ordered[:-1], axis=1)
    first = np.empty(len(order), dtype=np.int64)
    first[order] = order[np.flatnonzero(new_key)][np.cumsum(new_key) - 1]
    return first


def deduplicate_dataset(cleaned_dir: Path, out_dir: Path, rules: DedupRules) -> dict:
    """Three streaming passes over ``cleaned_dir/rows.parquet``, holding ~130 bytes a row.

    Pass 1 computes every row's exact key and MinHash band hashes; the keys (16 bytes a row) then give
    each row's first occurrence, and the band hashes of the first occurrences give the LSH candidates.
    Pass 2 records every exact duplicate (with the row it repeats) and recomputes the signatures of
    the candidates only, to verify them. Pass 3 filters the Arrow batches: it writes every surviving
    row with its cluster key and records every near duplicate with the row it was merged into.
    """
    import pyarrow as pa

    from ft_assets.data.rows import DUPLICATE_SCHEMA, ROW_SCHEMA, ParquetSink, iter_batches

    if rules.near_duplicates not in ("drop", "keep"):
        raise ValueError(f"near_duplicates must be 'drop' or 'keep', got {rules.near_duplicates!r}")
    out_dir.mkdir(parents=True, exist_ok=True)
    source_path = cleaned_dir / "rows.parquet"
    index = NearDuplicateIndex(rules)
    keys = []
    for batch in iter_batches(source_path, columns=["messages"]):
        features = [row_features(messages, rules) for messages in batch.column("messages").to_pylist()]
        keys.append(b"".join(f.key for f in features))
        index.add_rows(features)
    keys = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(-1, 16)
    first = _first_occurrences(keys)
    survivors = np.flatnonzero(first == np.arange(len(first)))
    rank = np.full(len(first), -1, dtype=np.int64)  # position among the survivors (= near-duplicate index row)
    rank[survivors] = np.arange(len(survivors))
    index.keep_only(survivors)
    candidates = np.zeros(len(survivors), dtype=bool)
    candidates[sorted(index.candidates())] = True
    exact = int(len(first) - len(survivors))

    with ParquetSink(out_dir / "duplicates.parquet", DUPLICATE_SCHEMA) as duplicates:
        quoted = np.zeros(len(first), dtype=bool)  # rows some duplicate refers to: their source is kept
        quoted[first[first != np.arange(len(first))]] = True
        sources: dict[int, str] = {}
        signatures: dict[int, np.ndarray] = {}
        position = 0
        for batch in iter_batches(source_path, columns=["source", "messages"]):
            span = np.arange(position, position + batch.num_rows)
            names = batch.column("source").to_pylist()
            for i in np.flatnonzero(quoted[span] | (first[span] != span)).tolist():
                row = position + i
                if quoted[row]:
                    sources[row] = names[i]
                if first[row] != row:
                    duplicates.write({"source": names[i], "kind": "exact", "duplicate_of": sources[int(first[row])]})
            picked = np.flatnonzero((rank[span] >= 0) & candidates[np.maximum(rank[span], 0)])
            conversations = batch.column("messages").take(picked).to_pylist()
            for i, messages in zip(picked.tolist(), conversations):
                signatures[int(rank[position + i])] = index.signature(messages)
            position += batch.num_rows
        roots = index.clusters(signatures)

        merged = roots != np.arange(len(roots))
        quoted = np.zeros(len(roots), dtype=bool)
        quoted[roots[merged]] = True
        survivor_sources: dict[int, str] = {}
        near = 0
        position = 0
        with ParquetSink(out_dir / "rows.parquet", ROW_SCHEMA) as rows:
            for batch in iter_batches(source_path):
                ranks = rank[position : position + batch.num_rows]
                position += batch.num_rows
                kept = ranks >= 0
                names = batch.column("source").to_pylist()
                for i in np.flatnonzero(kept).tolist():
                    r = int(ranks[i])
                    if quoted[r]:
                        survivor_sources[r] = names[i]
                    if merged[r] and rules.near_duplicates == "drop":
                        near += 1
                        kept[i] = False
                        duplicates.write({"source": names[i], "kind": "near", "duplicate_of": survivor_sources[int(roots[r])]})
                kept_rows = batch.filter(pa.array(kept))
                clusters = [bytes(key).hex() for key in keys[survivors[roots[ranks[kept]]]]]
                columns = [kept_rows.column("source"), pa.array(clusters, type=pa.string()), kept_rows.column("messages")]
                rows.write_table(pa.RecordBatch.from_arrays(columns, schema=ROW_SCHEMA))
    return {
        "rows_kept": rows.count,
        "exact_duplicates": exact,
        "near_duplicates": near,
        "near_clusters": int(len(np.unique(roots))),
        "lsh_bands": index.bands,
        "lsh_rows_per_band": index.rows_per_band,
        "lsh_pairs_verified": index.pairs_checked,
    }
