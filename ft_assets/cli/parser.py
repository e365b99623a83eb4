"""The command line's grammar: ``ft-assets run | lineage | plan`` and their options.

Kept apart from the commands and light to import (argparse, and the GPU targets' registry for ``--gpu``'s help): ``--help`` and a mistyped option
answer in well under a second, while a command imports what it needs once chosen.
By ``python -X importtime -c "import ft_assets.cli.<command>"``: ``lineage`` costs
about what ``import dagster`` does (2.7 s vs 2.6 s), ``plan`` (the planner, torch) 3.3 times that,
``run`` (Dagster, torch and every plane) 6 times.
"""

from __future__ import annotations

import argparse

from ft_assets.targets import gpu_help

PLANES = ("data", "training", "delivery")  # run order; ``--until`` names the last one


def worker_count(text: str) -> int:
    """``--data-workers``: 0 (every core) or more."""
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of workers (0: every core, 1: one process)")
    return int(text)


def add_run(sub) -> None:
    run = sub.add_parser("run", help="register a dataset version and materialize the planes for it")
    run.add_argument(
        "--dataset",
        required=True,
        help="a .jsonl, .json, .csv, .tsv, .parquet or .arrow file (text ones also .gz) or a directory of them, a datasets "
        "save_to_disk directory, hf://owner/name@revision (a Hub dataset, pinned to its commit), s3://bucket/prefix/, "
        "or a mixture spec .yaml",
    )
    run.add_argument("--name", help="dataset name (default: the file, directory or repo name without its extension)")
    run.add_argument("--version", help="dataset version (default: v-<sha256 of the content, 12 hex>)")
    run.add_argument("--until", choices=PLANES, default="delivery", help="last plane to run (default: delivery)")
    run.add_argument("--config", help="Dagster run config YAML (an 'ops:' section keyed by asset name)")
    run.add_argument(
        "--data-workers",
        type=worker_count,
        metavar="N",
        help="data plane: shards run at once (default: every core, or every CPU of the Ray cluster; 1: one process)",
    )
    run.add_argument(
        "--ray-address", metavar="ADDR|local",
        help="data plane on Ray: 'local' starts Ray on this machine; ray://head:10001 or head:6379 uses a running cluster",
    )  # fmt: skip
    run.add_argument("--gpu", metavar="TARGET", help=gpu_help())  # the registry's kinds: ft_assets.targets
    run.add_argument(
        "--force", action="store_true", help="rerun planes that are already materialized from the same inputs"
    )
    run.add_argument(
        "--in-process", action="store_true",
        help="execute each plane's run in this process instead of submitting it through the instance's run queue and "
        "launcher (no code server, no worker process; the run is not attached to the code location, so the UI cannot "
        "re-execute it)",
    )  # fmt: skip
    run.add_argument(
        "--json", action="store_true", help="print a JSON summary as the last line of stdout, also on failure"
    )
    run.add_argument(
        "--verbose", action="store_true",
        help="print every run event with its stack trace, and the libraries' progress bars and warnings",
    )  # fmt: skip


def add_lineage(sub) -> None:
    lineage = sub.add_parser("lineage", help="print the chain behind a published model, from the store alone")
    lineage.add_argument(
        "uri", help="<store>/registry/<name>/<version>/<run> (a path, s3:// URI, or a key in $FT_STORE)"
    )
    lineage.add_argument("--json", action="store_true", help="print the chain as one JSON object")
    lineage.add_argument("--fast", action="store_true", help="compare manifest digests only; do not re-hash every file")
    lineage.add_argument(
        "--public-key", metavar="PEM",
        help="verify the model's signature (model.sig) with this public key, or the root certificate(s) of a certificate-signed "
        "model (default: $FT_SIGNING_PUBLIC_KEY; neither: not checked)",
    )  # fmt: skip
    lineage.add_argument("--verbose", action="store_true", help="print the stack trace of an unexpected error")


def gpu_count(text: str) -> int | str:
    """``--gpus``: a positive count, or 'auto' (the planner tries 1, 2, 4, ... 64)."""
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"--gpus takes a count >= 1 or 'auto', not {text!r}")
    return int(text)


def add_plan(sub) -> None:
    plan = sub.add_parser(
        "plan",
        help="peak GPU memory, GPU tier and cost of a fine-tune, from a run config or a model's config.json (no data, "
        "no weights)",
    )
    plan.add_argument(
        "--config", metavar="RUN_CONFIG",
        help="a run config YAML, as ft-assets run --config takes (e.g. examples/qwen2.5-7b-qlora-24gb.yaml): the base "
        "model (ops.base_model.config.source), the row length (ops.tokenized_shards.config.seq_len) and the training "
        "settings (ops.lora_adapter.config: method, per_device_batch_size, gradient_checkpointing, num_processes, "
        "parallelism, dpo, grpo, ...); the options below override it",
    )  # fmt: skip
    plan.add_argument(
        "--model-config",
        help="a transformers config.json, the model directory holding it, or the hub id of a model whose config.json "
        "ships with ft-assets (the examples' models); default: the shipped one of --config's base model",
    )
    plan.add_argument(
        "--method", choices=("lora", "qlora", "full"),
        help="which weights train (default: the run config's method, else qlora, as on a CUDA GPU)",
    )  # fmt: skip
    plan.add_argument(
        "--objective", choices=("sft", "dpo", "grpo"),
        help="what the data will train (default: the objective whose settings the run config sets, dpo: or grpo:, else "
        "sft); GRPO plans prompts of --seq-len tokens and their completions",
    )  # fmt: skip
    plan.add_argument(
        "--seq-len",
        type=int,
        help="tokens per packed row (default: the run config's tokenized_shards seq_len, 512 when it sets none; "
        "required without --config)",
    )
    plan.add_argument(
        "--batch", type=int,
        help="packed rows per forward pass (default: the run config's per_device_batch_size; 1 without --config)",
    )  # fmt: skip
    plan.add_argument(
        "--gradient-checkpointing", action=argparse.BooleanOptionalAction,
        help="recompute activations in backward (default: the run config's setting; off without --config)",
    )  # fmt: skip
    plan.add_argument(
        "--attn-implementation",
        choices=("auto", "flash_attention_2", "flex_attention", "sdpa", "eager"),
        help="the attention backend to plan (default: the run config's, else auto)",
    )
    plan.add_argument(
        "--gpus", type=gpu_count,
        help="GPUs to spread the run over (default: the run config's num_processes x num_nodes, else 1); 'auto': the "
        "fewest of 1, 2, 4, 8, ... 64 that fit, cheapest",
    )  # fmt: skip
    plan.add_argument(
        "--parallelism", choices=("ddp", "fsdp"),
        help="how the GPUs share the model: ddp (a copy each) or fsdp (sharded; the default when --gpus asks for more "
        "than one and the run config does not say, and what --gpus auto plans above one)",
    )  # fmt: skip
    plan.add_argument(
        "--tokens", type=int, default=10_000_000, help="trained tokens to price, all epochs (default 10M)"
    )
    plan.add_argument(
        "--cost-model", help="YAML overriding the cost model (default: $FT_COST_MODEL, else the defaults)"
    )
    plan.add_argument(
        "--mac", metavar="TIER",
        help="your Mac's unified-memory tier (m4-16gb, m4-24gb, m4-32gb, m4pro-48gb, m4pro-64gb, m4max-64gb, m4max-128gb, "
        "m3max-128gb: gpu_offerings.yaml's macs): planned beside the rented GPUs (MLX backend), so the plan says whether "
        "the run fits on it or must rent, and what renting would cost",
    )  # fmt: skip
    plan.add_argument(
        "--mac-usd-per-hour", type=float, default=0.0, help="what an hour of your Mac costs you, amortized (default 0)"
    )
    plan.add_argument("--json", action="store_true", help="print the plan as JSON, the last line of stdout")
    plan.add_argument("--verbose", action="store_true", help="print the stack trace of an unexpected error")


def build_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ft-assets", description=description)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (add_run, add_lineage, add_plan):
        add(sub)
    return parser
