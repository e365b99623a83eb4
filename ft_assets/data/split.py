"""Train/eval split by a stable hash, so a row lands in the same split in every dataset version.

The hash is taken over the row's near-duplicate *cluster* key (the content hash of the cluster's
first row), not over the row itself: all members of a cluster share one key, so a cluster can never
straddle train and eval even when near-duplicates are kept. Position in the file plays no part, so
appending rows to a dataset never reshuffles the rows that were already there.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from ft_assets.data.parallel import Executor, InProcess
from ft_assets.data.rows import ROW_SCHEMA, ParquetSink, RowRange, row_ranges

TRAIN, EVAL = "train", "eval"


def split_of(cluster_key: str, eval_fraction: float, salt: str = "ft-assets") -> str:
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    digest = hashlib.blake2b(f"{salt}\x1f{cluster_key}".encode(), digest_size=8).digest()
    return EVAL if int.from_bytes(digest, "little") / 2**64 < eval_fraction else TRAIN


def split_shard(settings: tuple[float, str], shard: RowRange) -> tuple:
    """(train rows, eval rows) of one shard; only the cluster column is read into Python."""
    eval_fraction, salt = settings
    table = shard.read()
    to_eval = pa.array([split_of(key, eval_fraction, salt) == EVAL for key in table.column("cluster").to_pylist()], type=pa.bool_())
    return table.filter(pc.invert(to_eval)), table.filter(to_eval)


def split_dataset(
    dedup_dir: Path, out_dir: Path, eval_fraction: float, salt: str = "ft-assets", executor: Executor | None = None
) -> dict:
    """``dedup_dir/rows.parquet`` into ``train.parquet`` and ``eval.parquet``, in shards on ``executor``
    (default: this process); the rows are filtered as Arrow tables, never converted."""
    executor = executor or InProcess()
    out_dir.mkdir(parents=True, exist_ok=True)
    with ParquetSink(out_dir / "train.parquet", ROW_SCHEMA) as train, ParquetSink(
        out_dir / "eval.parquet", ROW_SCHEMA
    ) as evaluation:
        for train_rows, eval_rows in executor.map(split_shard, row_ranges(dedup_dir / "rows.parquet", executor), (eval_fraction, salt)):
            train.write_table(train_rows)
            evaluation.write_table(eval_rows)
    return {"train_rows": train.count, "eval_rows": evaluation.count}
