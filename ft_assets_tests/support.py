"""Builders and helpers the tests share: tiny datasets, run configs, shards, the CLI runner, launcher and lease helpers.

Plain functions and constants only (fixtures live in ``conftest.py``); no test module imports another.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import time
from pathlib import Path

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from safetensors.torch import load_file

from ft_assets.cli import main
from ft_assets.data.packing import PACK_WINDOW, ChatEncoder, tokenize_and_pack
from ft_assets.delivery.lineage import LINEAGE_CHAIN
from ft_assets.training.config import TrainingConfig

# --- a dataset the tiny model learns in a few dozen LoRA steps (the end-to-end pipeline tests) -------

ANSWER = '{"name": "ok"}'


def write_dataset(path: Path, rows: int = 240) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "part-0.jsonl", "w") as handle:
        for i in range(rows):
            handle.write(json.dumps({"instruction": f"Request number {i}: please acknowledge item {i * 7 % 1000}.", "output": ANSWER}) + "\n")
    return path


def run_config(tiny_model_dir, steps: int, lr: float) -> dict:
    return {
        "ops": {
            "base_model": {"config": {"source": str(tiny_model_dir)}},
            "tokenized_shards": {"config": {"seq_len": 256}},
            "train_eval_split": {"config": {"eval_fraction": 0.1}},
            "lora_adapter": {"config": {"max_steps": steps, "save_steps": 10, "per_device_batch_size": 4,
                                        "learning_rate": lr, "warmup_steps": 0, "lora_r": 8, "lora_alpha": 16}},  # fmt: skip
            "gguf_model": {"config": {"qtypes": ["f16"]}},
            "eval_report": {"config": {"max_examples": 12, "max_new_tokens": 12, "min_improvement": 0.5}},
        }
    }


def run_cli(capsys, *argv) -> tuple[int, dict | None, str]:
    """``ft-assets ARGV`` in-process: exit code, the JSON object on the last line of stdout (or None), stderr."""
    code = main(list(argv))
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    return code, (json.loads(lines[-1]) if lines and lines[-1].startswith("{") else None), captured.err


# --- packed chat shards for the training tests (made by the data plane's own packer) ---------------

SEQ_LEN = 128  # fits two ~55-token tiny chat examples per row, so rows really are packed
RUN = "runs/timers/v1/train/test"
SYSTEM = "Reply with one JSON tool call."


def chat_examples(count: int) -> list[tuple[str, str]]:
    examples = []
    for i in range(count):
        minutes = 1 + (i * 7) % 19
        examples.append((f"Set a timer for {minutes} minutes.", json.dumps({"name": "set_timer", "arguments": {"minutes": minutes}})))
    return examples


def conversations(examples: list[tuple[str, str]]) -> list[tuple[str, list[dict]]]:
    """(row id, messages) pairs, as the data plane hands them to the packer."""
    roles = ("system", "user", "assistant")
    return [
        (f"timer-{i}", [{"role": role, "content": content} for role, content in zip(roles, (SYSTEM, user, reply))])
        for i, (user, reply) in enumerate(examples)
    ]


def write_shards(model_dir: Path, out_dir: Path, split: str, examples: list[tuple[str, str]], window: int = PACK_WINDOW) -> None:
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
    """Keep one test's figures in test-artifacts/reliability.json, the source of the README's Reliability numbers."""
    FIGURES.parent.mkdir(parents=True, exist_ok=True)
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
    """Child process: the recipe, slowed by a sleeping metrics callback so the parent can kill it mid-run."""
    from ft_assets.objectives import named
    from ft_assets.storage import LocalStore
    from ft_assets.training.recipe import train

    torch.set_num_threads(1)
    train(TrainingConfig.model_validate_json(cfg_json), Path(base), Path(shards), LocalStore(store), run, Path(work),
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
        target=_slow_training, args=(cfg.model_dump_json(), str(base), str(shards), str(store.root), run, str(work), objective)
    )
    worker.start()
    try:
        wait_until(lambda: store.exists(join_key(layout.checkpoint(run, step), MANIFEST)), worker, f"checkpoint {step}", work / "none.log")
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
    return parquet_bytes(pa.table({"question": [f"{prefix} {i}?" for i in range(n)], "answer": [f"a {i}." for i in range(n)]}))


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
        save_steps=4, save_total_limit=None, seed=7, logging_steps=4, max_seq_len=PAIR_SEQ_LEN, dpo_beta=0.1,
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
    refs["lora_adapter"].update({"training_config": {"lora_r": 16}, "checkpoint": {"key": "runs/t/v1/train/r1/checkpoint-00000008", "digest": "ef" * 32}})
    refs["lora_adapter"]["stats"] = {"run_id": "r1", "method": "lora", "steps": 8, "resumed_from_step": None}
    refs["eval_report"]["stats"] = {"metric_name": "exact_match", "base_metric": 0.0, "finetuned_metric": 0.9,
                                    "base_eval_loss": 3.0, "finetuned_eval_loss": 1.0, "improvement": 0.9,
                                    "gguf_file": "m-q8_0.gguf", "gguf_qtype": "q8_0", "gguf_metric": 0.85, "gguf_drop": 0.05}  # fmt: skip
    refs["gguf_model"]["stats"] = {"files": {"m-f16.gguf": {"sha256": "cd" * 32}}}
    return refs


# --- prompts and GRPO runs (test_prompts, test_grpo) ------------------------------------------------

GRPO_RUN = "runs/timers/v1/train/grpo"
PROMPT_SEQ_LEN = 64  # a timer prompt is ~40 tokens with the tiny tokenizer
TOOL_REWARDS = [f"ft_assets.rewards:{name}" for name in ("tool_call_format", "tool_call_json", "tool_call_name", "tool_call_arguments")]


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
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ft_assets_tests.tiny import build_tiny_model

    texts = [SYSTEM] + [f"{row['prompt']} {json.dumps(row['answer'])} {prose_reply(row['answer']['arguments']['minutes'])}" for row in timer_prompts(20)]
    model_dir = build_tiny_model(out_dir, extra_text=texts)
    encoder = ChatEncoder(AutoTokenizer.from_pretrained(model_dir))
    conversations = [
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": row["prompt"]},
         {"role": "assistant", "content": json.dumps(row["answer"]) if i % 2 else prose_reply(row["answer"]["arguments"]["minutes"])}]
        for i, row in enumerate(timer_prompts(200, 1000))
    ]  # fmt: skip
    examples = encoder.encode_batch(conversations)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
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


def grpo_config(**overrides) -> TrainingConfig:
    base = dict(
        method="lora", lora_r=8, lora_alpha=16, learning_rate=2e-2, warmup_steps=0, max_steps=8, per_device_batch_size=2,
        save_steps=4, save_total_limit=None, seed=7, logging_steps=4, max_seq_len=128, num_generations=4,
        max_completion_length=24, rewards=TOOL_REWARDS,
    )  # fmt: skip
    return TrainingConfig(**(base | overrides))
