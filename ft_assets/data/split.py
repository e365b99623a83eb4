"""Train/eval split by a stable hash, so a row lands in the same split in every dataset version.

The hash is taken over the row's near-duplicate *cluster* key (the content hash of the cluster's
first row), not over the row itself: all members of a cluster share one key, so a cluster can never
straddle train and eval even when near-duplicates are kept. Position in the file plays no part, so
appending rows to a dataset never reshuffles the rows that were already there.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

TRAIN, EVAL = "train", "eval"


def split_of(cluster_key: str, eval_fraction: float, salt: str = "ft-assets") -> str:
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    digest = hashlib.blake2b(f"{salt}\x1f{cluster_key}".encode(), digest_size=8).digest()
    return EVAL if int.from_bytes(digest, "little") / 2**64 < eval_fraction else TRAIN


def split_dataset(dedup_dir: Path, out_dir: Path, eval_fraction: float, salt: str = "ft-assets") -> dict:
    """Stream ``dedup_dir/rows.parquet`` into ``train.parquet`` and ``eval.parquet``.

    Only the cluster column is read into Python; the rows themselves are filtered as Arrow batches.
    """
    import pyarrow as pa

    from ft_assets.data.rows import ROW_SCHEMA, ParquetSink, iter_batches

    out_dir.mkdir(parents=True, exist_ok=True)
    with ParquetSink(out_dir / "train.parquet", ROW_SCHEMA) as train, ParquetSink(
        out_dir / "eval.parquet", ROW_SCHEMA
    ) as evaluation:
        for batch in iter_batches(dedup_dir / "rows.parquet"):
            to_eval = pa.array([split_of(key, eval_fraction, salt) == EVAL for key in batch.column("cluster").to_pylist()])
            train.write_table(batch.filter(pa.compute.invert(to_eval)))
            evaluation.write_table(batch.filter(to_eval))
    return {"train_rows": train.count, "eval_rows": evaluation.count}
