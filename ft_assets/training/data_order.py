"""Which packed rows every process reads at every optimizer step: a pure function of (seed, epoch, step, rank).

Data order is what makes resume exact: a run killed at any step and resumed reads the same rows in
the same order as an uninterrupted one, because nothing about the order is state. Each epoch is one
seeded permutation of the rows; step ``s`` takes the ``s``-th slice of it, split over micro-batches
and processes. The incomplete tail batch of an epoch is dropped (``TrainingConfig.steps_per_epoch``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ft_assets.training.config import TrainingConfig


@functools.lru_cache(maxsize=2)  # the current epoch's order, computed once rather than every step
def epoch_permutation(num_rows: int, seed: int, epoch: int) -> np.ndarray:
    order = np.random.default_rng([seed, epoch]).permutation(num_rows)
    order.flags.writeable = False
    return order


@dataclass(frozen=True)
class DataPlan:
    """Which rows every process reads at every step: a pure function of (seed, epoch, step, rank).

    The step arithmetic (rows per step, steps per epoch, total steps) is the training settings' own
    (``TrainingConfig``), so the plan and the recipe count the same steps.
    """

    num_rows: int
    config: TrainingConfig
    world_size: int

    @property
    def rows_per_step(self) -> int:
        return self.config.rows_per_step(self.world_size)

    @property
    def steps_per_epoch(self) -> int:
        return self.config.steps_per_epoch(self.num_rows, self.world_size)

    @property
    def total_steps(self) -> int:
        return self.config.total_steps(self.num_rows, self.world_size)

    def epoch_order(self, epoch: int) -> np.ndarray:
        return epoch_permutation(self.num_rows, self.config.seed, epoch)

    def micro_batches(self, step: int, rank: int) -> list[np.ndarray]:
        """Row indices of each micro-batch this rank runs for optimizer step ``step`` (0-based)."""
        epoch, position = divmod(step, self.steps_per_epoch)
        order = self.epoch_order(epoch)
        batches = []
        batch, accumulation = self.config.per_device_batch_size, self.config.gradient_accumulation_steps
        for micro in range(accumulation):
            start = ((position * accumulation + micro) * self.world_size + rank) * batch
            batches.append(order[start : start + batch])
        return batches
