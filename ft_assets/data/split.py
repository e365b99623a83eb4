"""Train/eval split by a stable hash, so a row lands in the same split in every dataset version.

The hash is taken over the row's near-duplicate *cluster* key (the content hash of the cluster's
first row), not over the row itself: all members of a cluster share one key, so a cluster can never
straddle train and eval even when near-duplicates are kept. Position in the file plays no part, so
appending rows to a dataset never reshuffles the rows that were already there. Part k of the rows
becomes the parts ``train-k`` and ``eval-k``, written by the worker that splits it.
"""

from __future__ import annotations

import hashlib

import pyarrow as pa
import pyarrow.compute as pc

from ft_assets.data.parallel import Executor, InProcess
from ft_assets.data.parts import Artifact, Part, Target, Written, part_name, read_part, runs
from ft_assets.data.rows import ROW_SCHEMA

TRAIN, EVAL = "train", "eval"


def split_of(cluster_key: str, eval_fraction: float, salt: str = "ft-assets") -> str:
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    digest = hashlib.blake2b(f"{salt}\x1f{cluster_key}".encode(), digest_size=8).digest()
    return EVAL if int.from_bytes(digest, "little") / 2**64 < eval_fraction else TRAIN


def split_run(settings: tuple[float, str, Target], run: list[Part]) -> list[tuple[Written, Written]]:
    """Each part of a run into its ``train`` and ``eval`` parts (a data-plane task); only the cluster column is read
    into Python, the rows are filtered as Arrow tables."""
    eval_fraction, salt, target = settings
    done = []
    for part in run:
        table = read_part(part)
        to_eval = pa.array(
            [split_of(key, eval_fraction, salt) == EVAL for key in table.column("cluster").to_pylist()], type=pa.bool_()
        )
        done.append((
            target.put_table(part_name(TRAIN, part.index), table.filter(pc.invert(to_eval)), ROW_SCHEMA),
            target.put_table(part_name(EVAL, part.index), table.filter(to_eval), ROW_SCHEMA),
        ))  # fmt: skip
    return done


def split_dataset(
    deduplicated: Artifact,
    out: Artifact,
    eval_fraction: float,
    salt: str = "ft-assets",
    executor: Executor | None = None,
) -> dict:
    """The ``rows`` parts of ``deduplicated`` into the ``train`` and ``eval`` parts of ``out``, a run of parts a task
    on ``executor`` (default: this process)."""
    split_of("", eval_fraction)  # a bad fraction fails here, before any task
    executor = executor or InProcess()
    counts = {TRAIN: 0, EVAL: 0}
    tasks = list(runs(deduplicated.parts("rows", executor), lambda part: part.rows, executor.shard_rows))
    for run in executor.map(split_run, tasks, (eval_fraction, salt, out.target(executor))):
        for train, evaluation in run:
            out.add(train, evaluation)
            counts[TRAIN] += train.rows
            counts[EVAL] += evaluation.rows
    return {"train_rows": counts[TRAIN], "eval_rows": counts[EVAL]}
