"""The training recipe on a tiny Llama: methods, packing isolation, exact resume, preemption, pruning, DDP.

Everything runs on CPU against a ``LocalStore`` in ``tmp_path``. Runs that must be interrupted run in
a child process (multiprocessing spawn, or ``python -m ft_assets.training.worker``) so that SIGKILL
and SIGTERM hit a real worker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from ft_assets.shards import load_packed_rows, packed_table, shard_name
from ft_assets import layout
from ft_assets.manifests import MANIFEST
from ft_assets.storage import LocalStore, join_key
from ft_assets.training.checkpoints import (
    WEIGHTS,
    BackgroundUploader,
    CheckpointUploadFailed,
    capture_rng_state,
    checkpoint_steps,
    complete_checkpoints,
    find_latest_checkpoint,
    restore_rng_state,
    run_id,
)
from ft_assets.training.config import TrainingConfig
from ft_assets.training import parallelism
from ft_assets.training.loss import learned_tokens, token_loss_sum
from ft_assets.training.data_order import DataPlan
from ft_assets.training.model import resolve_attention
from ft_assets.objectives import DPO, SFT, named
from ft_assets.training.recipe import train
from ft_assets_tests.support import (
    ONE_THREAD,
    RUN,
    SEQ_LEN,
    assert_same_weights,
    final_weights,
    preempt_then_resume,
)
from ft_assets_tests.support import training_config as config

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


# --- fixtures: a tiny model and packed shards from the data plane's packer --------------------------


# --- config and run id ---------------------------------------------------------------------------

BAD_CONFIGS = [
    ({"lora_r": 0}, "lora_r must be >= 1"),
    ({"lora_dropout": 1.0}, "lora_dropout must be in [0, 1)"),
    ({"learning_rate": 0}, "learning_rate must be > 0"),
    ({"max_steps": 0}, "max_steps must be >= 1 or empty"),
    ({"target_modules": ["q_proj", " "]}, "target_modules .* has a blank name"),
    ({"report_to": ["stdout"]}, "unknown tracker"),
    ({"method": "dora"}, "method"),
    ({"save_stpes": 5}, "save_stpes"),
]


@pytest.mark.parametrize("overrides,message", BAD_CONFIGS, ids=[m for _, m in BAD_CONFIGS])
def test_config_rejects_bad_values_with_a_clear_message(overrides, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        TrainingConfig(**overrides)


def test_config_defaults_and_method_resolution():
    default = TrainingConfig()
    assert (
        default.target_modules == []
    )  # every projection of the model (test_families.py checks what that is per family)
    assert TrainingConfig(max_steps=-1).max_steps is None
    assert default.resolved_method(cuda_available=True) == "qlora"
    assert default.resolved_method(cuda_available=False) == "lora"
    assert all(field.description for field in TrainingConfig.model_fields.values())


def test_run_id_ignores_operational_fields_only():
    def rid(cfg, partition="timers@v1", base="b" * 64, data="d" * 64, objective=SFT):
        return run_id(partition, cfg, objective, base, data, cuda_available=False)

    reference = rid(TrainingConfig())
    assert rid(TrainingConfig(save_steps=7, report_to=["tensorboard"], eval_steps=3, logging_steps=1)) == reference
    assert rid(TrainingConfig(method="lora")) == reference  # None resolves to lora without CUDA
    for changed in (rid(TrainingConfig(learning_rate=1e-4)), rid(TrainingConfig(), partition="timers@v2"),
                    rid(TrainingConfig(), base="c" * 64), rid(TrainingConfig(), data="e" * 64)):  # fmt: skip
        assert changed != reference
    assert len(reference) == 16
    # an objective's own settings count for its runs only: DPO's beta is not part of an SFT run's id
    assert rid(TrainingConfig(dpo={"beta": 0.5})) == reference
    dpo = rid(TrainingConfig(), objective=DPO)
    assert rid(TrainingConfig(dpo={"beta": 0.5}), objective=DPO) != dpo
    assert rid(TrainingConfig(grpo={"num_generations": 4}), objective=DPO) == dpo


# --- data ----------------------------------------------------------------------------------------


def test_packed_rows_load_with_labels_from_the_loss_mask(shards):
    rows = load_packed_rows(shards, "train", max_seq_len=SEQ_LEN)
    table = pq.read_table(shards / "train-00000.parquet")
    first = table.slice(0, 1).to_pylist()[0]
    assert rows.seq_len == SEQ_LEN and len(first["seq_lens"]) >= 2  # really packed
    expected = [t if m else -100 for t, m in zip(first["input_ids"], first["loss_mask"])]
    assert rows.labels[0].tolist() == expected
    assert rows.position_ids[0].tolist() == first["position_ids"]
    with pytest.raises(ValueError, match="above max_seq_len=64"):
        load_packed_rows(shards, "train", max_seq_len=64)


def test_ragged_shard_is_refused_naming_the_file(tmp_path):
    rows = [
        {"input_ids": [1, 2, 3], "loss_mask": [1, 1, 1], "position_ids": [0, 1, 2], "seq_lens": [3]},
        {"input_ids": [1, 2], "loss_mask": [1, 1], "position_ids": [0, 1], "seq_lens": [2]},
    ]
    pq.write_table(packed_table(rows), tmp_path / shard_name("train", 0))
    with pytest.raises(ValueError, match=r"train-00000\.parquet: column 'input_ids' has rows of lengths \[2, 3\]"):
        load_packed_rows(tmp_path, "train", max_seq_len=16)


def test_data_plan_reads_every_row_once_per_epoch_split_across_ranks():
    plan = DataPlan(
        num_rows=50, config=TrainingConfig(per_device_batch_size=2, gradient_accumulation_steps=3, seed=1), world_size=2
    )
    assert plan.steps_per_epoch == 4  # 50 // 12, the tail is dropped
    seen = [i for step in range(4) for rank in range(2) for batch in plan.micro_batches(step, rank) for i in batch]
    assert len(seen) == len(set(seen)) == 48
    assert [b.tolist() for b in plan.micro_batches(5, 1)] == [b.tolist() for b in plan.micro_batches(5, 1)]
    assert plan.epoch_order(0).tolist() != plan.epoch_order(1).tolist()


# flex_attention (inductor compiles it on CPU: 20-50 s): every family's packed row, test_families.py; flash_attention_2:
# test_gpu.py
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_examples_do_not_attend_to_each_other(tiny_model, shards, attn):
    """transformers builds the block-diagonal mask from position_ids, but only without a KV cache.

    Each example alone goes through sdpa, the reference.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation=attn).eval()
    reference = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation="sdpa").eval()
    assert model.config._attn_implementation == attn
    row = pq.read_table(shards / "train-00000.parquet").slice(0, 1).to_pylist()[0]
    assert len(row["seq_lens"]) >= 2 and sum(row["seq_lens"]) < SEQ_LEN
    rows = load_packed_rows(shards, "train", max_seq_len=SEQ_LEN)
    batch = rows.batch([0], torch.device("cpu"))
    input_ids, position_ids = batch["input_ids"], batch["position_ids"]
    with torch.no_grad():
        packed = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits[0]
        leaky = model(input_ids=input_ids, position_ids=position_ids).logits[0]  # config.use_cache=True
        packed_loss = token_loss_sum(model, batch)
        alone_loss, start = 0.0, 0
        for length in row["seq_lens"]:
            alone = reference(input_ids=input_ids[:, start : start + length]).logits[0]
            assert torch.allclose(packed[start : start + length], alone, atol=1e-5)
            example = {name: value[:, start : start + length] for name, value in batch.items()}
            alone_loss += float(token_loss_sum(reference, example))
            start += length
    assert learned_tokens(batch) > 0 and float(packed_loss) == pytest.approx(alone_loss, rel=1e-5)
    second = slice(row["seq_lens"][0], row["seq_lens"][0] + row["seq_lens"][1])
    assert not torch.allclose(leaky[second], packed[second], atol=1e-3), "a KV cache should disable packing detection"


def test_auto_attention_is_sdpa_on_cpu_and_gpu_only_backends_are_refused():
    cpu = torch.device("cpu")
    assert resolve_attention("auto", cpu) == "sdpa" and resolve_attention("eager", cpu) == "eager"
    with pytest.raises(ValueError, match="flex_attention' trains on CUDA"):
        resolve_attention("flex_attention", cpu)
    with pytest.raises(ValueError, match="needs a CUDA GPU and the flash-attn package"):
        resolve_attention("flash_attention_2", cpu)


# --- checkpoint store pieces ---------------------------------------------------------------------


def test_rng_state_round_trips_through_weights_only_load(tmp_path):
    torch.save([capture_rng_state()], tmp_path / "rng.pt")
    expected = torch.rand(3)
    restore_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True)[0])
    assert torch.equal(torch.rand(3), expected)


def test_upload_error_surfaces_on_the_next_save(tmp_path):
    class BrokenStore(LocalStore):
        def put_file(self, key, path):
            raise OSError("disk full")

    uploader = BackgroundUploader(BrokenStore(tmp_path / "store"), RUN, log=lambda line: None)
    local = tmp_path / "ckpt"
    local.mkdir()
    (local / "a.bin").write_bytes(b"x")
    uploader.submit(local, 1)  # returns at once
    with pytest.raises(CheckpointUploadFailed, match="checkpoint-00000001 failed: .*disk full"):
        uploader.submit(local, 2)
    uploader.close()  # the error was reported once


# --- training ------------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize(
    "method,lr", [("lora", 2e-2), ("qlora", 2e-2), ("full", 5e-3)]
)  # fmt: skip
def test_each_method_trains_and_lowers_the_loss(tiny_model, shards, tmp_path, method, lr):
    store = LocalStore(tmp_path / "store")
    metrics, lines = [], []
    result = train(config(method=method, learning_rate=lr, max_steps=30, save_steps=10, eval_steps=15),
                   tiny_model, shards, store, RUN, tmp_path / "work", log=lines.append, on_metrics=metrics.append)  # fmt: skip
    first, last = result.loss_history[0][1], result.loss_history[-1][1]
    assert result.steps == 30 and result.method == method and result.device == "cpu x1"
    assert last < 0.5 * first, result.loss_history
    assert result.eval_loss is not None and result.eval_loss < first
    assert result.resumed_from_step is None and result.bytes_uploaded > 0
    assert [uri.rsplit("/", 1)[-1] for uri in result.checkpoints] == [
        "checkpoint-00000010", "checkpoint-00000020", "checkpoint-00000030"]  # fmt: skip
    assert 0 < result.effective_training_fraction < 1 and result.step_seconds < result.wall_seconds
    assert result.tokens_seen == 30 * 2 * SEQ_LEN
    assert any("WARNING: no CUDA or MPS device" in line for line in lines)
    assert any(line.startswith("step 30/30  loss") and "tok/s" in line and "eta" in line for line in lines)
    assert [m["step"] for m in metrics if "loss" in m] == [4, 8, 12, 16, 20, 24, 28, 30]
    assert [m["step"] for m in metrics if "eval_loss" in m] == [15, 30]
    assert result.eval_history == [
        (15, next(m["eval_loss"] for m in metrics if m.get("eval_loss") and m["step"] == 15))
    ]
    weights = final_weights(result)
    if method == "full":
        assert (result.output_dir / "config.json").is_file()
    else:
        assert (result.output_dir / "adapter_config.json").is_file()
        assert all("lora_" in name for name in weights)
    assert (result.output_dir / "tokenizer.json").is_file()


@pytest.mark.integration
def test_preempted_or_killed_then_rerun_resumes_and_matches_an_uninterrupted_run(
    tiny_model, shards, tmp_path, reference
):
    """Resumed from the checkpoint SIGTERM made, and from the one before it (steps replayed, as after a kill -9): the
    uninterrupted adapter (``support.preempt_then_resume``; the signals on a worker process: test_chaos.py)."""
    preempt_then_resume(config(max_steps=24), tiny_model, shards, RUN, tmp_path, SFT, reference)


@pytest.mark.integration
def test_corrupt_and_half_written_checkpoints_are_skipped_for_the_previous_one(tiny_model, shards, tmp_path, reference):
    store = LocalStore(tmp_path / "store")
    cfg = config(max_steps=24, save_steps=8)
    train(cfg, tiny_model, shards, store, RUN, tmp_path / "w1", log=lambda line: None)
    assert checkpoint_steps(store, RUN) == [24, 16, 8]
    weights = store.root / layout.checkpoint(RUN, 24) / WEIGHTS
    data = bytearray(weights.read_bytes())
    data[-10:] = bytes(b ^ 0xFF for b in data[-10:])  # same size: only the sha256 check can tell
    weights.write_bytes(bytes(data))
    store.delete(join_key(layout.checkpoint(RUN, 16), MANIFEST))  # as if the upload died before the manifest

    lines = []
    result = train(cfg, tiny_model, shards, store, RUN, tmp_path / "w2", log=lines.append)
    warnings = [line for line in lines if line.startswith("WARNING: skipping")]
    assert len(warnings) == 2 and "corrupt" in warnings[0] and "no manifest.json" in warnings[1]
    assert result.resumed_from_step == 8
    assert_same_weights(final_weights(result), reference)
    latest, skipped = find_latest_checkpoint(store, RUN, tmp_path / "check", log=lambda line: None)
    assert latest.step == 24 and skipped == []  # both were rewritten, verified


@pytest.mark.integration
def test_gradient_checkpointing_changes_memory_not_weights(tiny_model, shards, tmp_path, reference):
    """Why gradient_checkpointing is left out of the run id: same math, same dropout masks."""
    result = train(config(max_steps=24, gradient_checkpointing=True), tiny_model, shards, LocalStore(tmp_path / "store"),
                   RUN, tmp_path / "work", log=lambda line: None)  # fmt: skip
    assert_same_weights(final_weights(result), reference)


@pytest.mark.integration
def test_losses_read_only_at_logging_steps_are_the_losses_read_every_step(tiny_model, shards, tmp_path):
    """The loop reads losses to the host at logging and checkpoint steps only (no sync per step on CUDA)."""
    every = train(
        config(logging_steps=1),
        tiny_model,
        shards,
        LocalStore(tmp_path / "a"),
        RUN,
        tmp_path / "wa",
        log=lambda line: None,
    )
    once = train(config(logging_steps=12, save_steps=12), tiny_model, shards, LocalStore(tmp_path / "b"), RUN, tmp_path / "wb",
                 log=lambda line: None)  # fmt: skip
    assert [step for step, _ in once.loss_history] == list(range(1, 13))
    assert once.loss_history == every.loss_history
    assert_same_weights(final_weights(once), final_weights(every))
    assert once.attn_implementation == "sdpa" and once.tokens_per_second > 0


@pytest.mark.integration
def test_compiled_model_trains_like_the_eager_one(tiny_model, shards, tmp_path):
    """torch.compile on CPU (inductor, a C++ compiler): ~1 min of compiling, then the same losses."""
    train_only = tmp_path / "shards"
    train_only.mkdir()
    for path in shards.glob("train-*.parquet"):
        (train_only / path.name).write_bytes(path.read_bytes())
    runs = {
        compiled: train(config(max_steps=3, learning_rate=1e-3, compile=compiled), tiny_model, train_only, LocalStore(tmp_path / f"s{compiled}"),
                        RUN, tmp_path / f"w{compiled}", log=lambda line: None)
        for compiled in (False, True)
    }  # fmt: skip
    losses = {compiled: [loss for _, loss in run.loss_history] for compiled, run in runs.items()}
    # The same forward, then updates that differ by rounding only (a small learning rate keeps AdamW's
    # sign-like first steps on near-zero gradients from magnifying it).
    assert len(losses[True]) == 3 and losses[True][0] == pytest.approx(losses[False][0], rel=1e-5)
    assert losses[True] == pytest.approx(losses[False], rel=1e-3)


def test_accelerates_fsdp_plugin_is_refused_for_the_parallelism_setting(tiny_model, shards, tmp_path, monkeypatch):
    """Sharding is the recipe's (parallelism: fsdp, test_fsdp.py): accelerate's own FSDP plugin would wrap the model."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    class FsdpAccelerator(Accelerator):
        @property
        def distributed_type(self):
            return DistributedType.FSDP

    monkeypatch.setattr(parallelism, "Accelerator", FsdpAccelerator)
    with pytest.raises(
        ValueError, match="accelerate's FSDP plugin is not used: launch without --use_fsdp .* parallelism: fsdp"
    ):
        train(
            config(), tiny_model, shards, LocalStore(tmp_path / "store"), RUN, tmp_path / "work", log=lambda line: None
        )


@pytest.mark.integration
def test_save_total_limit_prunes_checkpoints_in_the_store(tiny_model, shards, tmp_path):
    store = LocalStore(tmp_path / "store")
    result = train(config(max_steps=10, save_steps=2, save_total_limit=2), tiny_model, shards, store, RUN,
                   tmp_path / "work", log=lambda line: None)  # fmt: skip
    assert checkpoint_steps(store, RUN) == [10, 8]
    assert result.checkpoints == [store.uri(layout.checkpoint(RUN, 8)), store.uri(layout.checkpoint(RUN, 10))]


class RecordingStore(LocalStore):
    """A local store that notes which process rank wrote each object."""

    def put_file(self, key, path):
        self._record(key)
        super().put_file(key, path)

    def put_bytes(self, key, data):
        self._record(key)
        super().put_bytes(key, data)

    def _record(self, key):
        with open(self.root.parent / "writers.log", "a") as handle:
            handle.write(f"{os.environ.get('RANK', '0')}\t{key}\n")


def ddp_main(argv: list[str]) -> None:
    """Entry point of each rank under `accelerate launch -m ft_assets_tests.test_training ...`."""
    cfg, base, shards_dir, store_dir, work, *objective = argv
    result = train(TrainingConfig.model_validate_json(cfg), Path(base), Path(shards_dir), RecordingStore(store_dir), RUN,
                   Path(work), log=print, objective=named(objective[0] if objective else "sft"))  # fmt: skip
    if os.environ.get("RANK") == "0":
        (Path(store_dir).parent / "result.json").write_text(json.dumps(result.to_json()))


@pytest.mark.integration
def test_two_process_data_parallel_run_on_cpu_only_rank0_writes(tiny_model, shards, tmp_path):
    cfg = config(num_processes=2, max_steps=8, per_device_batch_size=1)
    store_dir = tmp_path / "store"
    # `--cpu` would make accelerate 1.15 start ONE process; `--multi_gpu` starts torchrun, and the recipe's
    # Accelerator(cpu=True) turns the processes into a gloo group when there is no GPU.
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29517",
           "-m", "ft_assets_tests.test_training", cfg.model_dump_json(), str(tiny_model), str(shards), str(store_dir),
           str(tmp_path / "work")]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=ONE_THREAD)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["device"] == "cpu x2" and result["steps"] == 8
    assert result["tokens_seen"] == 8 * 2 * SEQ_LEN
    writers = {line.split("\t")[0] for line in (tmp_path / "writers.log").read_text().splitlines()}
    assert writers == {"0"}
    assert complete_checkpoints(LocalStore(store_dir), RUN)[-1].endswith("checkpoint-00000008")


if __name__ == "__main__":
    ddp_main(sys.argv[1:])
