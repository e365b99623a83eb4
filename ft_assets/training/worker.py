"""The training worker's command line: ``python -m ft_assets.training.worker`` / ``accelerate launch -m ft_assets.training.worker``.

One process, or one rank of a torchrun launch (``ft_assets.training.launch``), runs the recipe
(``ft_assets.training.recipe.train``) and exits 0, or ``EXIT_PREEMPTED`` (75) after SIGTERM once its
checkpoint is in the store; rank 0 then also writes ``{"preempted": ...}`` to ``--result``, since
torchrun turns any worker's non-zero exit into its own exit code 1. Rank 0
reports to Dagster through dagster-pipes when ``--pipes`` is given (the ``lora_adapter`` asset's
launch); the other ranks drop the Pipes channel they inherited.

On a GPU target's machine (``ft_assets.training.remote`` runs the ranks) each rank follows the renewals of the
worker's store keys itself (``ft_assets.targets.renewal``), and a rank whose keys the store refused writes
``launch.refusal_file`` beside ``--result`` and exits ``EXIT_KEYS_REFUSED`` (77).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from contextlib import ExitStack, nullcontext
from pathlib import Path

from ft_assets.objectives import OBJECTIVES, SFT, named
from ft_assets.targets.renewal import EXIT_KEYS_REFUSED, follower, refused
from ft_assets.storage import open_store
from ft_assets.training.config import TrainingConfig
from ft_assets.training.launch import refusal_file
from ft_assets.training.preemption import EXIT_PREEMPTED, Preempted
from ft_assets.training.recipe import train


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Run the training recipe (one process, or one rank of accelerate launch)."
    )
    parser.add_argument("--config", default="{}", help="TrainingConfig as JSON, or a path to a JSON file")
    parser.add_argument("--base-model", required=True, type=Path, help="local HF model directory (safetensors)")
    parser.add_argument("--shards", required=True, type=Path, help="local directory of packed Parquet shards")
    parser.add_argument("--store", required=True, help="object store URL: a local path or s3://bucket/prefix")
    parser.add_argument("--run-prefix", required=True, help="runs/<name>/<version>/train/<run_id>")
    parser.add_argument("--work-dir", required=True, type=Path, help="local scratch directory")
    parser.add_argument("--result", type=Path, help="write the TrainingResult here as JSON (rank 0)")
    parser.add_argument("--pipes", action="store_true", help="report to Dagster through dagster-pipes (rank 0 only)")
    parser.add_argument(
        "--tags", default="{}", help="tags of the MLflow run as a JSON object (dataset version, lineage digests)"
    )
    parser.add_argument(
        "--objective", default=SFT.name, choices=sorted(OBJECTIVES),
        help="what the shards teach, as the data plane recorded it (tokenized_shards' stats): sft (chat rows), dpo (pairs), grpo (prompts)",
    )  # fmt: skip
    args = parser.parse_args(argv)

    raw = args.config if args.config.lstrip().startswith("{") else Path(args.config).read_text()
    config = TrainingConfig.model_validate_json(raw)
    # Rank from the launcher's environment: creating accelerate's PartialState here would fix the
    # process group before train() asks for a CPU (gloo) one.
    rank = int(os.environ.get("RANK", "0"))
    is_main = rank == 0
    pipes = nullcontext(None)
    if args.pipes:
        if is_main:
            from dagster_pipes import open_dagster_pipes

            pipes = open_dagster_pipes()
        else:  # only rank 0 talks to Dagster: the other ranks drop the Pipes channel they inherited
            for name in [n for n in os.environ if n.startswith("DAGSTER_PIPES_")]:
                del os.environ[name]

    with pipes as channel, ExitStack() as renewals:

        def log(line: str) -> None:
            if channel is not None:
                channel.log.info(line)
            else:
                print(line, flush=True)

        store = open_store(args.store)
        keys = follower(store, os.environ, log)  # each rank signs its own uploads: it follows the renewed keys too
        if keys:
            renewals.enter_context(keys)
        try:
            result = train(
                config, args.base_model, args.shards, store, args.run_prefix, args.work_dir, log=log,
                tags=json.loads(args.tags), objective=named(args.objective),
            )  # fmt: skip
        except Preempted as exc:
            log(str(exc))
            if args.result and is_main:  # torchrun reports any worker's non-zero exit as 1: the caller reads this
                args.result.write_text(json.dumps({"preempted": {"step": exc.step, "checkpoint": exc.checkpoint_uri}}))
            return EXIT_PREEMPTED
        except Exception as exc:
            if not (args.result and refused(exc)):
                raise
            refusal_file(args.result, rank).write_text(str(refused(exc)))
            print(f"rank {rank}: the store refused this worker's keys ({refused(exc)}); stopping", file=sys.stderr)
            return EXIT_KEYS_REFUSED
    if args.result and is_main:
        args.result.write_text(json.dumps(result.to_json(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
