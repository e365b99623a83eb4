"""Deduplication's shuffle, as numpy arrays: records partitioned by key, duplicates and colliding pairs found by
sorting, pairs verified and merged into clusters.

Records are uint64 triples: exact (the key's first half, its second half, the row), band (the band, the
band's hash, the row). A map task sends each record to partition ``bucket % partitions``, so all the
records that can match meet in one partition, where a sort finds them (``exact_duplicates``,
``band_pairs``): ~130 bytes a row cross the shuffle, against ~2 kB a row for a dict-based LSH index.
Clusters are the connected components of the verified pairs (a union-find whose root is always the
earliest row: the one kept). ``ft_assets.data.dedup`` runs these steps as tasks.
"""

from __future__ import annotations

import numpy as np

VERIFY_BATCH = 65_536  # candidate pairs compared in one numpy pass (x num_perm bytes of temporaries)


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


def exact_records(keys: np.ndarray, first_row: int) -> np.ndarray:
    """(n, 3) uint64 exact-key records of ``keys`` (n x 16 uint8), rows numbered from ``first_row``."""
    halves = keys.view(np.uint64).reshape(-1, 2)
    rows = np.arange(first_row, first_row + len(keys), dtype=np.uint64)
    return np.column_stack([halves[:, 0], halves[:, 1], rows])


def band_records(hashes: np.ndarray, eligible: np.ndarray, first_row: int) -> np.ndarray:
    """(m, 3) uint64 band records (band, hash, row) of the rows long enough to compare, rows in order."""
    rows = np.flatnonzero(eligible)
    bands = hashes.shape[1]
    return np.column_stack([
        np.tile(np.arange(bands, dtype=np.uint64), len(rows)),
        hashes[rows].ravel(),
        np.repeat(rows.astype(np.uint64) + np.uint64(first_row), bands),
    ]).reshape(-1, 3)  # fmt: skip


def partition(records: np.ndarray, bucket: np.ndarray, partitions: int) -> list[np.ndarray]:
    """``records`` split by ``bucket % partitions``, each piece in the records' order."""
    target = (bucket % np.uint64(partitions)).astype(np.int64)
    order = np.argsort(target, kind="stable")
    bounds = np.searchsorted(target[order], np.arange(partitions + 1))
    return [records[order[bounds[p] : bounds[p + 1]]] for p in range(partitions)]


def exact_duplicates(records: np.ndarray) -> np.ndarray:
    """(row, first row with the same key) of every row that repeats an earlier one, from exact records."""
    order = np.lexsort((records[:, 2], records[:, 1], records[:, 0]))  # by key, then row
    ordered = records[order]
    new_key = np.ones(len(ordered), dtype=bool)
    new_key[1:] = np.any(ordered[1:, :2] != ordered[:-1, :2], axis=1)
    first = ordered[np.flatnonzero(new_key), 2][np.cumsum(new_key) - 1]
    return np.column_stack([ordered[~new_key, 2], first[~new_key]]).astype(np.int64).reshape(-1, 2)


def band_pairs(records: np.ndarray, excluded: np.ndarray) -> np.ndarray:
    """(first row, other row) for rows sharing a band hash: each against its run's first row.

    ``excluded`` (sorted rows, the exact duplicates) take no part: near-duplicates are looked for among
    the rows exact deduplication keeps.
    """
    records = records[~np.isin(records[:, 2].astype(np.int64), excluded)]
    order = np.lexsort((records[:, 2], records[:, 1], records[:, 0]))  # by band, hash, then row
    ordered = records[order]
    starts_run = np.ones(len(ordered), dtype=bool)
    starts_run[1:] = np.any(ordered[1:, :2] != ordered[:-1, :2], axis=1)
    run_first = ordered[np.flatnonzero(starts_run), 2][np.cumsum(starts_run) - 1]
    return np.column_stack([run_first[~starts_run], ordered[~starts_run, 2]]).astype(np.int64).reshape(-1, 2)


def unique_pairs(pairs: np.ndarray, rows: int) -> np.ndarray:
    """The distinct pairs (a pair collides in several bands), sorted."""
    codes = np.unique(pairs[:, 0] * rows + pairs[:, 1])
    return np.column_stack([codes // rows, codes % rows]).reshape(-1, 2)


def cluster_roots(pairs: np.ndarray, candidates: np.ndarray, signatures: np.ndarray, threshold: float) -> np.ndarray:
    """The cluster root (its smallest row) of every candidate row (sorted), from the colliding pairs.

    Each pair is verified on its MinHash estimate of the Jaccard similarity (``signatures``: one row of
    values per candidate); the clusters are the connected components of the verified pairs.
    """
    at_a, at_b = np.searchsorted(candidates, pairs[:, 0]), np.searchsorted(candidates, pairs[:, 1])
    similar = np.zeros(len(pairs), dtype=bool)
    for start in range(0, len(pairs), VERIFY_BATCH):
        a, b = at_a[start : start + VERIFY_BATCH], at_b[start : start + VERIFY_BATCH]
        similar[start : start + VERIFY_BATCH] = (signatures[a] == signatures[b]).mean(axis=1) >= threshold
    union = _UnionFind(len(candidates))
    for a, b in zip(at_a[similar].tolist(), at_b[similar].tolist()):
        union.union(a, b)
    return candidates[union.roots()]
