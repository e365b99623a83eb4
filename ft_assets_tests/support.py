"""Builders and helpers the tests share: tiny datasets, run configs, shards, the CLI runner, launcher and lease helpers.

Plain functions and constants only (fixtures live in ``conftest.py``); no test module imports another.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from safetensors.torch import load_file

from ft_assets.cli import main
from ft_assets.data.chat_encoding import ChatEncoder
from ft_assets.data.tokenizing import PACK_WINDOW, tokenize_and_pack
from ft_assets.delivery import gate
from ft_assets.delivery.lineage import LINEAGE_CHAIN
from ft_assets.training.config import TrainingConfig

# --- a dataset the tiny model learns in a few dozen LoRA steps (the end-to-end pipeline tests) -------

ANSWER = '{"name": "ok"}'


def write_dataset(path: Path, rows: int = 240) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "part-0.jsonl", "w") as handle:
        for i in range(rows):
            handle.write(
                json.dumps(
                    {"instruction": f"Request number {i}: please acknowledge item {i * 7 % 1000}.", "output": ANSWER}
                )
                + "\n"
            )
    return path


# The shipped general task is on by default; the suite's full runs turn it off (each would pay for lm-eval on three
# models), except the session's published run (published.py), which covers the default, and the tests that set tasks.
GENERAL_OFF = {"general_eval": {"config": {"tasks": []}}}


def run_config(tiny_model_dir, steps: int, lr: float) -> dict:
    return {
        "ops": {
            "base_model": {"config": {"source": str(tiny_model_dir)}},
            "tokenized_shards": {"config": {"seq_len": 256}},
            "train_eval_split": {"config": {"eval_fraction": 0.1}},
            "lora_adapter": {
                "config": {
                    "max_steps": steps,
                    "save_steps": 10,
                    "per_device_batch_size": 4,
                    "learning_rate": lr,
                    "warmup_steps": 0,
                    "lora_r": 8,
                    "lora_alpha": 16,
                }
            },  # fmt: skip
            "gguf_model": {"config": {"qtypes": ["f16"]}},
            "eval_report": {"config": {"max_examples": 12, "max_new_tokens": 12, "min_improvement": 0.5}},
            **GENERAL_OFF,
        }
    }


def run_cli(capsys, *argv) -> tuple[int, dict | None, str]:
    """``ft-assets ARGV`` in-process: exit code, the JSON object on the last line of stdout (or None), stderr."""
    code = main(list(argv))
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    return code, (json.loads(lines[-1]) if lines and lines[-1].startswith("{") else None), captured.err


def run_cli_quiet(*argv) -> tuple[int, dict | None, str]:
    """``run_cli`` outside a test's capsys (module and session fixtures): stdout and stderr caught here."""
    import contextlib

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    lines = out.getvalue().strip().splitlines()
    return code, (json.loads(lines[-1]) if lines and lines[-1].startswith("{") else None), err.getvalue()


# --- packed chat shards for the training tests (made by the data plane's own packer) ---------------

SEQ_LEN = 128  # fits two ~55-token tiny chat examples per row, so rows really are packed
RUN = "runs/timers/v1/train/test"
SYSTEM = "Reply with one JSON tool call."


def chat_examples(count: int) -> list[tuple[str, str]]:
    examples = []
    for i in range(count):
        minutes = 1 + (i * 7) % 19
        examples.append(
            (
                f"Set a timer for {minutes} minutes.",
                json.dumps({"name": "set_timer", "arguments": {"minutes": minutes}}),
            )
        )
    return examples


def conversations(examples: list[tuple[str, str]]) -> list[tuple[str, list[dict]]]:
    """(row id, messages) pairs, as the data plane hands them to the packer."""
    roles = ("system", "user", "assistant")
    return [
        (f"timer-{i}", [{"role": role, "content": content} for role, content in zip(roles, (SYSTEM, user, reply))])
        for i, (user, reply) in enumerate(examples)
    ]


def write_shards(
    model_dir: Path, out_dir: Path, split: str, examples: list[tuple[str, str]], window: int = PACK_WINDOW
) -> None:
    """Packed shards of ``examples`` at SEQ_LEN, made by the data plane's own tokenizer and packer (a shard a window)."""
    from transformers import AutoTokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    encoder = ChatEncoder(AutoTokenizer.from_pretrained(model_dir))
    stats = tokenize_and_pack(iter(conversations(examples)), encoder, SEQ_LEN, out_dir, split, window)
    assert stats.examples == len(examples), stats.rejected


def training_config(**overrides) -> TrainingConfig:
    base = dict(
        method="lora", lora_r=8, lora_alpha=16, learning_rate=2e-2, warmup_steps=2, max_steps=12,
        per_device_batch_size=2, save_steps=4, save_total_limit=None, seed=7, logging_steps=4, max_seq_len=SEQ_LEN,
    )  # fmt: skip
    return TrainingConfig(**(base | overrides))


def final_weights(result) -> dict[str, torch.Tensor]:
    name = "model.safetensors" if result.method == "full" else "adapter_model.safetensors"
    return load_file(result.output_dir / name)


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name], b[name], rtol=0, atol=1e-7), name


# --- killed workers and recorded figures (the reliability suites) -----------------------------------

FIGURES = Path(__file__).resolve().parents[1] / "test-artifacts" / "reliability.json"
# What the forkserver imports once, so that every worker forked from it starts in a second or two.
PRELOAD = [
    "torch", "transformers", "transformers.models.llama.modeling_llama", "peft", "accelerate",
    "ft_assets.training.recipe", "ft_assets.cli.run", "ft_assets.definitions",
]  # fmt: skip


def record_figures(name: str, **figures) -> None:
    """Keep one test's figures in test-artifacts/reliability.json, the source of the README's Reliability numbers.
    Under a lock: the suite's workers (make test runs two) may record at the same time."""
    FIGURES.parent.mkdir(parents=True, exist_ok=True)
    with open(FIGURES.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        recorded = json.loads(FIGURES.read_text()) if FIGURES.exists() else {}
        recorded[name] = figures
        FIGURES.write_text(json.dumps(recorded, indent=2, sort_keys=True) + "\n")


def wait_until(predicate, process, what: str, log_path: Path, timeout_s: float = 120) -> None:
    """Poll ``predicate`` while ``process`` lives; fail with the end of its log if it dies or time runs out."""

    def tail() -> str:  # only read when an assertion fails
        return log_path.read_text()[-3000:] if log_path.exists() else ""

    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert process.is_alive(), f"the worker exited (code {process.exitcode}) before {what}\n{tail()}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}\n{tail()}"
        time.sleep(0.01)


def _slow_training(cfg_json: str, base: str, shards: str, store: str, run: str, work: str, objective: str) -> None:
    """Child process: the recipe of the config's backend, slowed by a sleeping metrics callback so the parent can kill
    it mid-run."""
    from ft_assets.objectives import named
    from ft_assets.storage import LocalStore
    from ft_assets.training import mlx_recipe, recipe

    torch.set_num_threads(1)
    config = TrainingConfig.model_validate_json(cfg_json)
    train = mlx_recipe.train if config.backend == "mlx" else recipe.train
    train(config, Path(base), Path(shards), LocalStore(store), run, Path(work),
          log=lambda line: None, on_metrics=lambda metrics: time.sleep(0.15), objective=named(objective))  # fmt: skip


def sigkill_training_after_checkpoint(
    cfg: TrainingConfig, base: Path, shards: Path, store, run: str, step: int, work: Path, objective: str = "sft"
) -> None:
    """Train ``cfg`` in a spawned process (slowed down) and SIGKILL it once checkpoint ``step`` is in ``store``;
    fails unless the kill is what ended it, before its last step."""
    import multiprocessing
    import signal

    from ft_assets import layout
    from ft_assets.manifests import MANIFEST
    from ft_assets.storage import join_key
    from ft_assets.training.checkpoints import checkpoint_steps

    worker = multiprocessing.get_context("spawn").Process(
        target=_slow_training,
        args=(cfg.model_dump_json(), str(base), str(shards), str(store.root), run, str(work), objective),
    )
    worker.start()
    try:
        wait_until(
            lambda: store.exists(join_key(layout.checkpoint(run, step), MANIFEST)),
            worker,
            f"checkpoint {step}",
            work / "none.log",
        )
        os.kill(worker.pid, signal.SIGKILL)
        worker.join()
    finally:
        worker.kill()
    assert worker.exitcode == -signal.SIGKILL
    assert max(checkpoint_steps(store, run)) < cfg.max_steps, "the worker finished before it could be killed"


# --- the run queue and the pool launcher -------------------------------------------------------------

MOCK = {"module": "dagster._core.test_utils", "class": "MockedRunLauncher"}


def submit(instance, workspace, remote_job, job_def, assets=None, tags=None) -> dg.DagsterRun:
    run = instance.create_run_for_job(
        job_def=job_def,
        remote_job_origin=remote_job.get_remote_origin(),
        job_code_origin=remote_job.get_python_origin(),
        asset_selection=frozenset(dg.AssetKey(a) for a in assets) if assets else None,
        tags={"dagster/partition": "acks@v1", **(tags or {})},
    )
    instance.submit_run(run.run_id, workspace)
    return instance.get_run_by_id(run.run_id)


def launched(instance, pool: str) -> set[str]:
    return {run.run_id for run in instance.run_launcher.launcher(pool).queue()}


def training_worker_pid(instance) -> int | None:
    """The process of the training run in progress: the one its steps' events came from."""
    for run in instance.get_runs(dg.RunsFilter(job_name="training_plane", statuses=[dg.DagsterRunStatus.STARTED])):
        starts = instance.get_records_for_run(run.run_id, of_type=dg.DagsterEventType.STEP_START).records
        if starts:
            return starts[0].event_log_entry.dagster_event.pid
    return None


# --- a Hugging Face Hub cache built on disk (offline Hub sources) ------------------------------------

MAIN = "1111111111111111111111111111111111111111"
V1 = "2222222222222222222222222222222222222222"


def parquet_bytes(table: pa.Table) -> bytes:
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    return buffer.getvalue()


def qa_rows(n: int, prefix: str = "q") -> bytes:
    return parquet_bytes(
        pa.table({"question": [f"{prefix} {i}?" for i in range(n)], "answer": [f"a {i}." for i in range(n)]})
    )


def add_hub_revision(cache: Path, repo: str, commit: str, files: dict[str, bytes], refs: tuple[str, ...] = ()) -> None:
    """One commit of a Hub dataset repo in a cache with ``huggingface_hub``'s layout."""
    repo_dir = cache / f"datasets--{repo.replace('/', '--')}"
    for rel, data in files.items():
        blob = repo_dir / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = repo_dir / "snapshots" / commit / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
        (repo_dir / "refs" / ref).write_text(commit)


# --- preference pairs and DPO runs (test_preference, test_dpo, test_tracking) ------------------------

PAIR_SEQ_LEN = 256  # a timer pair is ~80 tokens with the pair model's tokenizer: rows hold several pairs
DPO_RUN = "runs/timers/v1/train/dpo"
ONE_THREAD = os.environ | {"OMP_NUM_THREADS": "1"}  # for recipe subprocesses on the 2 shared cores


def timer_pairs(count: int, start: int = 0) -> list[dict]:
    """A small preference set a tiny model learns: the right tool call over another tool, or over prose."""
    rows = []
    for i in range(start, start + count):
        minutes = 1 + i % 97
        chosen = json.dumps({"name": "set_timer", "arguments": {"minutes": minutes}})
        rejected = [json.dumps({"name": "set_alarm", "arguments": {"minutes": minutes}}), f"Okay, a timer for {minutes} minutes starts now.",
                    json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})][i % 3]  # fmt: skip
        rows.append({"prompt": f"Set a timer for {minutes} minutes, request {i}.", "chosen": chosen, "rejected": rejected,
                     "system": "Reply with one JSON tool call."})  # fmt: skip
    return rows


def write_jsonl(path: Path, rows: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def dpo_config(**overrides) -> TrainingConfig:
    base = dict(
        method="lora", lora_r=8, lora_alpha=16, learning_rate=5e-3, warmup_steps=2, max_steps=16, per_device_batch_size=2,
        save_steps=4, save_total_limit=None, seed=7, logging_steps=4, max_seq_len=PAIR_SEQ_LEN, dpo={"beta": 0.1},
    )  # fmt: skip
    return TrainingConfig(**(base | overrides))


def the_run(client, experiment: str):
    """The one MLflow run of an experiment (fails naming the runs if there are several)."""
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert len(runs) == 1, [run.info.run_name for run in runs]
    return runs[0]


# --- references of a whole published chain (lineage) ------------------------------------------------


def lineage_refs() -> dict[str, dict]:
    refs = {}
    for i, name in enumerate(LINEAGE_CHAIN):
        refs[name] = {"asset": name, "prefix": f"runs/t/v1/{name}", "uri": f"/store/runs/t/v1/{name}", "digest": f"{i:064x}", "created_at": 1000.0 + i,
                      "upstream": {LINEAGE_CHAIN[i - 1]: {"digest": f"{i - 1:064x}"}} if i else {}, "stats": {}}  # fmt: skip
    refs["base_model"]["stats"] = {"model_id": "tiny", "source": "/m", "source_sha256": "ab" * 32,
                                   "chat_template": {"setting": "gemma", "kind": "named", "sha256": "12" * 32}}  # fmt: skip
    refs["lora_adapter"].update(
        {
            "training_config": {"lora_r": 16},
            "checkpoint": {"key": "runs/t/v1/train/r1/checkpoint-00000008", "digest": "ef" * 32},
        }
    )
    refs["lora_adapter"]["stats"] = {"run_id": "r1", "method": "lora", "steps": 8, "resumed_from_step": None}
    shipped = gate.shipped("m-q8_0.gguf", "q8_0", 0.85, 0.9, max_drop=0.05)
    no_mlx = "MLX export is off (mlx_model variants: [])"
    verdict = gate.gate("exact_match", 0.0, 0.9, 0.05, {"gguf": shipped, "mlx": gate.dropped(no_mlx, 0.05)})
    refs["eval_report"]["stats"] = {**verdict.as_dict(), "base_eval_loss": 3.0, "finetuned_eval_loss": 1.0}
    refs["gguf_model"]["stats"] = {"export": "gguf", "files": {"m-f16.gguf": {"sha256": "cd" * 32}, "m-q8_0.gguf": {"sha256": "ce" * 32}},
                                   "shipped": "m-q8_0.gguf", "reason": None, "required": False, "max_drop": 0.05}  # fmt: skip
    refs["mlx_model"]["stats"] = {"export": "mlx", "files": {}, "shipped": None, "reason": no_mlx, "required": False,
                                  "max_drop": 0.05}  # fmt: skip
    return refs


# --- prompts and GRPO runs (test_prompts, test_grpo) ------------------------------------------------

GRPO_RUN = "runs/timers/v1/train/grpo"
PROMPT_SEQ_LEN = 64  # a timer prompt is ~40 tokens with the tiny tokenizer
TOOL_REWARDS = [
    f"ft_assets.rewards:{name}"
    for name in ("tool_call_format", "tool_call_json", "tool_call_name", "tool_call_arguments")
]


def timer_call(minutes: int) -> dict:
    return {"name": "set_timer", "arguments": {"minutes": minutes}}


def timer_prompts(count: int, start: int = 0) -> list[dict]:
    """Prompts for GRPO in TRL's layout: the request, a system prompt, and the reference call as the ``answer`` column."""
    return [{"prompt": f"Set a timer for {1 + i % 97} minutes, request {i}.", "system": SYSTEM, "answer": timer_call(1 + i % 97)}
            for i in range(start, start + count)]  # fmt: skip


def prose_reply(minutes: int) -> str:
    return f"Okay, a timer for {minutes} minutes starts now."


def prose_or_call_model(out_dir: Path, steps: int = 40, seed: int = 0) -> Path:
    """A tiny base that answers timer requests with a JSON tool call or in prose, about half and half when sampling
    (greedy: mostly prose): tiny.py's Llama, every weight trained ``steps`` AdamW steps on such replies (~10 s on one
    core). GRPO with the tool-call rewards has something to climb from: the first tokens decide between the two."""
    from ft_assets_tests.tiny import build_tiny_model

    texts = [SYSTEM] + [
        f"{row['prompt']} {json.dumps(row['answer'])} {prose_reply(row['answer']['arguments']['minutes'])}"
        for row in timer_prompts(20)
    ]
    model_dir = build_tiny_model(out_dir, extra_text=texts)
    conversations = [
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": row["prompt"]},
         {"role": "assistant", "content": json.dumps(row["answer"]) if i % 2 else prose_reply(row["answer"]["arguments"]["minutes"])}]
        for i, row in enumerate(timer_prompts(200, 1000))
    ]  # fmt: skip
    return teach(model_dir, conversations, steps, seed=seed)


def teach(model_dir: Path, conversations: list[list[dict]], steps: int, lr: float = 3e-3, seed: int = 0) -> Path:
    """Every weight of the model at ``model_dir`` trained ``steps`` AdamW steps of 8 conversations on their replies,
    saved in place: a tiny base made to know (or to forget) something on purpose."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    examples = ChatEncoder(AutoTokenizer.from_pretrained(model_dir)).encode_batch(conversations)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        loss = torch.zeros(())
        for i in torch.randint(len(examples), (8,), generator=generator).tolist():
            ids = torch.tensor(examples[i].input_ids, dtype=torch.long)[None]
            labels = torch.where(torch.tensor(examples[i].loss_mask, dtype=torch.bool)[None], ids, torch.tensor(-100))
            loss = loss + model(input_ids=ids, labels=labels).loss / 8
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(model_dir)
    return model_dir


# --- a general-ability task for general_eval: a local lm-eval task over a local JSONL (offline) ------

KM_ITEMS = [(f"Convert {n} km to m.", f"{n}000") for n in range(1, 31)]  # 30 items the random tiny model fails
KM_TASK = "km_to_m"


def km_conversations() -> list[list[dict]]:
    return [[{"role": "user", "content": q}, {"role": "assistant", "content": a}] for q, a in KM_ITEMS]


def write_general_tasks(out: Path) -> dict[str, Path]:
    """Local lm-eval task files over one local JSONL of ``KM_ITEMS``: ``km_to_m`` (generate_until: exact match of the
    greedy answer), ``km_to_m_choice`` (multiple_choice by log-likelihood: the answer or a wrong one as long, 1000
    more, so a model that does not know scores ~0.5) and ``km_to_m_plain`` (km_to_m with the ChatML turn in its
    prompt, for a run without lm-eval's chat template)."""
    import yaml

    out.mkdir(parents=True, exist_ok=True)
    data = write_jsonl(
        out / "km.jsonl", [{"question": q, "answer": a, "wrong": f"{int(a) + 1000}"} for q, a in KM_ITEMS]
    )
    common = {"dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}}, "test_split": "test",
              "doc_to_text": "{{question}}"}  # fmt: skip
    tasks = {
        KM_TASK: {**common, "output_type": "generate_until", "doc_to_target": "{{answer}}",
                  "generation_kwargs": {"until": ["<|im_end|>", "\n"], "max_gen_toks": 8, "do_sample": False},
                  "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}]},
        f"{KM_TASK}_choice": {**common, "output_type": "multiple_choice", "doc_to_choice": "{{[answer, wrong]}}",
                              "doc_to_target": 0, "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]},
    }  # fmt: skip
    tasks[f"{KM_TASK}_plain"] = {  # the chat turn written into the prompt: for apply_chat_template: false
        **tasks[KM_TASK],
        "doc_to_text": "<|im_start|>user\n{{question}}<|im_end|>\n<|im_start|>assistant\n",
    }
    paths = {}
    for name, config in tasks.items():
        paths[name] = out / f"{name}.yaml"
        paths[name].write_text(yaml.safe_dump({"task": name, **config}, sort_keys=False))
    return paths


def write_prompt_shards(model_dir: Path, out_dir: Path, rows: dict[str, list[dict]]) -> Path:
    """Prompt shards (``prompts-<split>-*.parquet``) of ``{split: rows}``, made by the data plane's own parser and tokenizer."""
    from transformers import AutoTokenizer

    from ft_assets.data.decoding import parse_line
    from ft_assets.data.prompt_packing import tokenize_prompts

    encoder = ChatEncoder(AutoTokenizer.from_pretrained(model_dir))
    for split, part in rows.items():
        items = [(f"{split}-{i}", parse_line(json.dumps(row).encode())) for i, row in enumerate(part)]
        stats = tokenize_prompts(items, encoder, PROMPT_SEQ_LEN, out_dir, split)
        assert stats.examples == len(part), stats.rejected
    return out_dir


def grpo_config(grpo: dict | None = None, **overrides) -> TrainingConfig:
    """The tests' GRPO run: ``grpo`` overrides its GRPO settings, ``overrides`` the shared ones."""
    base = dict(
        method="lora", lora_r=8, lora_alpha=16, learning_rate=2e-2, warmup_steps=0, max_steps=8, per_device_batch_size=2,
        save_steps=4, save_total_limit=None, seed=7, logging_steps=4, max_seq_len=128,
    )  # fmt: skip
    settings = {"num_generations": 4, "max_completion_length": 24, "rewards": TOOL_REWARDS} | (grpo or {})
    return TrainingConfig(**(base | overrides), grpo=settings)


# --- an objective's resume at the function level ------------------------------------------------------


def preempt_then_resume(
    cfg: TrainingConfig, base: Path, shards: Path, run: str, tmp: Path, objective, reference: dict, stop_at: int = 5
) -> None:
    """SIGTERM in this process after step ``stop_at`` of ``cfg`` (saving every 3 steps): the recipe's handler makes a
    checkpoint at that step boundary and raises ``Preempted``. Then the run resumed twice, on copies of the store: from
    that checkpoint (a spot notice), and from the periodic one before it, the steps between replayed (a kill -9, whose
    last checkpoint never got its manifest). Both end with ``reference``, the uninterrupted run's weights.

    The objective's state is what must survive (its sampling, its reference); the signals themselves, on a worker
    process: test_chaos.py (SIGKILL and SIGTERM at random points), test_training_asset.py (a launched run)."""
    import shutil
    import signal

    from ft_assets import layout
    from ft_assets.manifests import MANIFEST
    from ft_assets.storage import LocalStore, join_key
    from ft_assets.training.checkpoints import complete_checkpoints
    from ft_assets.training.preemption import Preempted
    from ft_assets.training.recipe import train

    def sigterm_after(metrics: dict) -> None:
        if metrics.get("step") == stop_at and "loss" in metrics:
            signal.raise_signal(signal.SIGTERM)  # the recipe's handler is installed: it only sets its flag

    store = LocalStore(tmp / "store")
    stopped = cfg.model_copy(update={"logging_steps": 1, "save_steps": 3})
    try:
        train(stopped, base, shards, store, run, tmp / "w1", log=lambda line: None, on_metrics=sigterm_after,
              objective=objective)  # fmt: skip
        raise AssertionError("the run ended without being preempted")
    except Preempted as preempted:
        assert preempted.step == stop_at and preempted.checkpoint_uri == store.uri(layout.checkpoint(run, stop_at))
    assert complete_checkpoints(store, run) == [store.uri(layout.checkpoint(run, step)) for step in (3, stop_at)]
    shutil.copytree(store.root, tmp / "killed")
    killed = LocalStore(tmp / "killed")
    killed.delete(join_key(layout.checkpoint(run, stop_at), MANIFEST))
    for resumed_store, resumed_from in ((store, stop_at), (killed, 3)):
        lines = []
        result = train(cfg, base, shards, resumed_store, run, tmp / f"w-{resumed_from}", log=lines.append,
                       objective=objective)  # fmt: skip
        assert result.objective == objective.name and result.resumed_from_step == resumed_from
        assert any(
            line.startswith(f"resuming from {resumed_store.uri(layout.checkpoint(run, resumed_from))}")
            for line in lines
        )
        assert result.restarts and result.restarts[0]["resumed_from_step"] is None  # the first attempt, from scratch
        assert_same_weights(final_weights(result), reference)


# --- W&B offline runs, read back with wandb's own protobuf records -------------------------------------

WANDB_BLOCK = 32768  # the .wandb file is a LevelDB-style log: 7-byte file header, 32 KiB blocks, 7-byte record headers


def wandb_records(wandb_dir: Path, run_id: str) -> list:
    """Every record (``wandb.proto.wandb_internal_pb2.Record``) of the offline run folders of ``run_id`` under
    ``wandb_dir``, in the order written (one folder per ``wandb.init`` of that id). wandb 0.31 reads these files in
    its Go core only; the framing is LevelDB's log format, each record one of wandb's own protobuf messages."""
    from wandb.proto import wandb_internal_pb2

    # offline-run-<YYYYmmdd_HHMMSS>-<id>, and -<id>-<n> for a second wandb.init of that id in the same second
    named = re.compile(rf"offline-run-(\d{{8}}_\d{{6}})-{re.escape(run_id)}(?:-(\d+))?")
    folders = {}
    for folder in Path(wandb_dir).glob("wandb/offline-run-*"):
        if matched := named.fullmatch(folder.name):
            folders[(matched[1], int(matched[2] or 0))] = folder
    found = []
    for _, folder in sorted(folders.items()):
        found += _finished_records(folder / f"run-{run_id}.wandb", wandb_internal_pb2.Record)
    return found


def _finished_records(path: Path, record_type, timeout_s: float = 30.0) -> list:
    """The records of one .wandb file once its ``exit`` record is in (wandb-core may still be writing it)."""
    import struct

    deadline = time.monotonic() + timeout_s
    while True:
        records = []
        data, position, pending = path.read_bytes(), 7, b""
        assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
        while position + 7 <= len(data):
            if WANDB_BLOCK - position % WANDB_BLOCK < 7:  # a block's tail too short for a header is padding
                position += WANDB_BLOCK - position % WANDB_BLOCK
                continue
            _, length, kind = struct.unpack("<IHB", data[position : position + 7])
            pending += data[position + 7 : position + 7 + length]
            position += 7 + length
            if kind in (1, 4):  # FULL, or LAST of a FIRST/MIDDLE.../LAST chain
                record = record_type()
                record.ParseFromString(pending)
                records.append(record)
                pending = b""
        if any(record.WhichOneof("record_type") == "exit" for record in records):
            return records
        assert time.monotonic() < deadline, f"{path} has no exit record after {timeout_s:.0f} s"
        time.sleep(0.2)


def wandb_run_data(wandb_dir: Path, run_id: str) -> dict:
    """What an offline W&B run holds: config, history ({key: [(step, value)]}), summary and artifact references."""

    def key(item) -> str:  # wandb-core writes a key as a path of one or more parts
        return item.key or ".".join(item.nested_key)

    config, history, summary, artifacts = {}, {}, {}, {}
    for record in wandb_records(wandb_dir, run_id):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            config.update({key(item): json.loads(item.value_json) for item in record.run.config.update})
        elif kind == "config":
            config.update({key(item): json.loads(item.value_json) for item in record.config.update})
        elif kind == "history":
            values = {key(item): json.loads(item.value_json) for item in record.history.item}
            step = values.get("_step", record.history.step.num)
            for name, value in values.items():
                if not name.startswith("_"):
                    history.setdefault(name, []).append((step, value))
        elif kind == "summary":
            summary.update({key(item): json.loads(item.value_json) for item in record.summary.update if key(item)})
        elif kind == "artifact":
            artifacts[record.artifact.name] = [entry.ref for entry in record.artifact.manifest.contents]
    return {"config": config, "history": history, "summary": summary, "artifacts": artifacts}


# --- a real dagster-daemon (the run queue, run retries, run monitoring, the sensors) ------------------------


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL a process started with ``start_new_session=True`` and the code servers it started."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)


@contextmanager
def dagster_daemon(log_path: Path) -> Iterator[subprocess.Popen]:
    """``dagster-daemon run`` on workspace.yaml (the run queue, run retries, the sensors), killed afterwards."""
    with open(log_path, "w") as log_file:
        daemon = subprocess.Popen([str(Path(sys.executable).parent / "dagster-daemon"), "run", "-w", "workspace.yaml"],
                                  cwd=Path(__file__).resolve().parents[1], stdout=log_file, stderr=subprocess.STDOUT,
                                  start_new_session=True)  # fmt: skip
    try:
        yield daemon
    finally:
        kill_group(daemon)
