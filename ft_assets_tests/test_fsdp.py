"""FSDP2 on 2 CPU processes (gloo) and 2 "nodes" on loopback: sharded checkpoints, preemption and resume, resharding.

The reference is one process with twice the gradient accumulation: the same global batch, the same rows
in the same steps (``DataPlan``), so a 2-process run must give the same losses and weights up to float
summation order. LoRA dropout is 0: with dropout each process would draw its own masks. Every
multi-process run is the worker under torchrun, signalled for real: SIGTERM to one rank, after which every
rank checkpoints at the same step, then a rerun on 2 processes and on 1 from that sharded checkpoint. (SIGKILL
at random points, and the half-uploaded checkpoints it leaves: test_chaos.py; a rank that never uploads its
shard: ``test_rank_0_commits_...`` below.) Four torchrun launches: the preempted run, its rerun, full
fine-tuning, and QLoRA on 2 nodes (each mostly the processes importing torch and transformers).
Its figures: docs/validation/verified.md, "FSDP and multi-node".
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ft_assets import layout
from ft_assets.manifests import MANIFEST, publish_dir, read_manifest
from ft_assets.storage import LocalStore, join_key
from ft_assets.training.checkpoints import RECEIPTS, complete_checkpoints, find_latest_checkpoint
from ft_assets.training.config import TrainingConfig
from ft_assets.training.launch import WorkerJob, node_command, torchrun_command, worker_args
from ft_assets.training.parallelism import decoder_layers
from ft_assets.training.recipe import train
from ft_assets_tests.families import build_family
from ft_assets_tests.support import (
    ONE_THREAD,
    RUN,
    chat_examples,
    final_weights,
    record_figures,
    training_config,
    write_shards,
)

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

STEPS = 8
KILL_AFTER = 4  # the checkpoint the SIGTERM waits for
STEP_DELAY_S = 0.3  # slowed steps in the preempted run: it is still training when the SIGTERM lands
TIMEOUT_S = 300


def fsdp_config(world: int, **overrides) -> TrainingConfig:
    """Global batch 2 rows: 1 row x 1 micro-batch on each of 2 processes, or 1 row x 2 micro-batches on one."""
    settings = dict(max_steps=STEPS, save_steps=2, logging_steps=1) | overrides
    return training_config(
        lora_dropout=0.0, per_device_batch_size=1, gradient_accumulation_steps=2 // world, num_processes=world, parallelism="fsdp",
        **settings,
    )  # fmt: skip


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(
    cfg: TrainingConfig, model: Path, shards: Path, store: Path, work: Path, slow: bool = False
) -> subprocess.Popen:
    """The worker on 2 local processes, as lora_adapter launches it (``launch.torchrun_command``), in its own session."""
    job = WorkerJob(cfg, str(store), RUN, "", "", "sft", {})
    command = torchrun_command(
        cfg, 0, f"127.0.0.1:{free_port()}", worker_args(job, model, shards, work, result=work / "result.json")
    )
    if slow:  # the same worker, with slowed steps: python -m ft_assets_tests.test_fsdp
        command[command.index("ft_assets.training.worker")] = "ft_assets_tests.test_fsdp"
    log = open(work.parent / f"{work.name}.log", "w")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=ONE_THREAD, start_new_session=True)


def kill_all(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun and its workers, as a dead node loses them: torchrun starts each worker in a session of its own,
    out of reach of a signal to torchrun's group."""
    for pid in rank_pids(proc.pid).values():
        os.kill(pid, signal.SIGKILL)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def finish(proc: subprocess.Popen, log: Path) -> str:
    try:
        proc.wait(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            kill_all(proc)
    return log.read_text()


def rank_pids(launcher_pid: int) -> dict[int, int]:
    """RANK -> pid of the workers torchrun started (read from /proc)."""
    pids = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) != launcher_pid:
                continue
            environ = dict(item.split("=", 1) for item in (entry / "environ").read_text().split("\0") if "=" in item)
        except (OSError, IndexError, ValueError):
            continue
        if "RANK" in environ:
            pids[int(environ["RANK"])] = int(entry.name)
    return pids


def wait_for(predicate, proc: subprocess.Popen, log: Path, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not predicate():
        assert proc.poll() is None, f"torchrun exited ({proc.returncode}) before {what}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{log.read_text()[-3000:]}"
        time.sleep(0.05)


def shard_files(store: LocalStore, step: int) -> list[str]:
    return sorted(
        name for name in read_manifest(store, layout.checkpoint(RUN, step)).files if name.startswith("sharded/")
    )


def assert_close_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 1e-6) -> float:
    """Fails unless every tensor of ``a`` is within ``atol`` of ``b``'s; returns the largest difference."""
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name], b[name], rtol=0, atol=atol), (name, (a[name] - b[name]).abs().max())
    return max(float((a[name] - b[name]).abs().max()) for name in a)


def loss_gap(history: list, reference: list) -> float:
    """The largest difference between two loss histories, step by step (they must cover the same steps)."""
    assert [step for step, _ in history] == [step for step, _ in reference]
    return max(abs(loss - other) for (_, loss), (_, other) in zip(history, reference))


@pytest.fixture(scope="module")
def one_process(tiny_model, shards, tmp_path_factory):
    """The reference: one process, two micro-batches a step, FSDP's checkpoint format (nothing to shard)."""
    tmp = tmp_path_factory.mktemp("fsdp-one")
    return train(
        fsdp_config(1), tiny_model, shards, LocalStore(tmp / "store"), RUN, tmp / "work", log=lambda line: None
    )


@pytest.fixture(scope="module")
def preempted_run(tiny_model, shards, tmp_path_factory):
    """A 2-process FSDP run (slowed steps) whose rank 1 alone gets SIGTERM once checkpoint KILL_AFTER is complete, as a
    spot notice reaches one node: every rank checkpoints at the same step and the run exits preempted. A copy of the
    store is kept aside for the resume on 1 process."""
    tmp = tmp_path_factory.mktemp("fsdp-preempted")
    store = LocalStore(tmp / "store")
    log = tmp / "w1.log"
    proc = torchrun(fsdp_config(2), tiny_model, shards, store.root, tmp / "w1", slow=True)
    manifest = join_key(layout.checkpoint(RUN, KILL_AFTER), MANIFEST)
    try:
        wait_for(lambda: store.exists(manifest), proc, log, f"checkpoint {KILL_AFTER}")
        os.kill(rank_pids(proc.pid)[1], signal.SIGTERM)  # rank 1 only: rank 0 never gets the signal
    except BaseException:
        if proc.poll() is None:
            kill_all(proc)
        raise
    sent = time.monotonic()
    text = finish(proc, log)
    seconds = time.monotonic() - sent
    preempted = json.loads((tmp / "w1" / "result.json").read_text())["preempted"]
    assert preempted["step"] < STEPS, "the run finished before the signal"
    shutil.copytree(store.root, tmp / "aside")
    return store, LocalStore(tmp / "aside"), tmp, proc.returncode, text, preempted, seconds


@pytest.mark.integration
def test_every_rank_writes_its_shard_and_rank_0_commits_after_all(preempted_run):
    store, _, tmp, *_, preempted, _ = preempted_run
    step = preempted["step"]
    assert shard_files(store, step) == ["sharded/.metadata", "sharded/__0_0.distcp", "sharded/__1_0.distcp"]
    assert store.exists(join_key(layout.checkpoint(RUN, step), RECEIPTS, "rank-00001.json"))
    latest, _ = find_latest_checkpoint(store, RUN, tmp / "check", log=lambda line: None)
    assert latest.step == step and latest.trainer_state().world_size == 2


@pytest.mark.integration
def test_sigterm_on_one_rank_checkpoints_every_rank_at_the_same_step(preempted_run):
    store, _, tmp, returncode, text, preempted, seconds = preempted_run
    step = preempted["step"]
    assert KILL_AFTER <= step < STEPS
    assert returncode != 0 and f"preempted by SIGTERM at step {step}" in text, text[-3000:]
    assert complete_checkpoints(store, RUN)[-1] == store.uri(layout.checkpoint(RUN, step)) == preempted["checkpoint"]
    latest, _ = find_latest_checkpoint(store, RUN, tmp / "check-sigterm", log=lambda line: None)
    assert latest.trainer_state().step == step
    record_figures("fsdp_sigterm_on_rank_1", stopped_at_step=step, seconds_from_sigterm_to_exit=round(seconds, 1))


@pytest.mark.integration
def test_two_process_fsdp_preempted_and_rerun_matches_one_process(preempted_run, one_process, tiny_model, shards):
    """Preempted mid-run, rerun: resumes from the sharded checkpoint every rank wrote; losses and adapter = 1 process."""
    store, _, tmp, *_, preempted, _ = preempted_run
    started = time.monotonic()
    log = finish(torchrun(fsdp_config(2), tiny_model, shards, store.root, tmp / "w2"), tmp / "w2.log")
    result = json.loads((tmp / "w2" / "result.json").read_text())
    assert result["device"] == "cpu x2" and result["steps"] == STEPS, log[-3000:]
    assert result["resumed_from_step"] == preempted["step"] and "sharded with FSDP2" in log
    losses = [loss for _, loss in result["loss_history"]]
    assert losses == pytest.approx([loss for _, loss in one_process.loss_history], rel=1e-5)
    assert result["eval_loss"] == pytest.approx(one_process.eval_loss, rel=1e-5)
    weights = assert_close_weights(
        load_file(Path(result["output_dir"]) / "adapter_model.safetensors"), final_weights(one_process)
    )
    assert shard_files(store, STEPS) == ["sharded/.metadata", "sharded/__0_0.distcp", "sharded/__1_0.distcp"]
    record_figures(
        "fsdp_2_processes_preempted_and_rerun", steps=STEPS, preempted_at_step=preempted["step"], resumed_from=result["resumed_from_step"],
        max_loss_difference_to_1_process=loss_gap(result["loss_history"], one_process.loss_history),
        max_adapter_difference_to_1_process=weights, eval_loss=result["eval_loss"], one_process_eval_loss=one_process.eval_loss,
        rerun_wall_seconds=round(time.monotonic() - started, 1),
    )  # fmt: skip


@pytest.mark.integration
def test_a_two_process_checkpoint_resumes_on_one_process(preempted_run, one_process, tiny_model, shards):
    _, aside, tmp, *_, preempted, _ = preempted_run
    lines = []
    result = train(fsdp_config(1), tiny_model, shards, aside, RUN, tmp / "w-one", log=lines.append)
    assert result.resumed_from_step == preempted["step"] and result.device == "cpu x1"
    assert any("written by 2 process(es), resumed on 1" in line for line in lines)
    assert [step for step, _ in result.loss_history] == list(range(1, STEPS + 1))
    assert [loss for _, loss in result.loss_history] == pytest.approx(
        [loss for _, loss in one_process.loss_history], rel=1e-5
    )
    weights = assert_close_weights(final_weights(result), final_weights(one_process))
    record_figures("fsdp_2_process_checkpoint_on_1_process", resumed_from=result.resumed_from_step, max_adapter_difference_to_1_process=weights,
                   max_loss_difference_to_1_process=loss_gap(result.loss_history, one_process.loss_history))  # fmt: skip


@pytest.mark.integration
def test_fsdp_trains_full_like_one_process(tiny_model, shards, tmp_path):
    """Full fine-tuning shards too; its final weights are consolidated on rank 0 (QLoRA's 4-bit base: the 2 nodes below)."""
    cfg = {"method": "full", "learning_rate": 5e-3, "max_steps": 3, "save_steps": 3}
    one = train(
        fsdp_config(1, **cfg),
        tiny_model,
        shards,
        LocalStore(tmp_path / "s1"),
        RUN,
        tmp_path / "w1",
        log=lambda line: None,
    )
    log = finish(
        torchrun(fsdp_config(2, **cfg), tiny_model, shards, tmp_path / "s2", tmp_path / "w2"), tmp_path / "w2.log"
    )
    result = json.loads((tmp_path / "w2" / "result.json").read_text())
    assert result["steps"] == 3 and result["method"] == "full", log[-3000:]
    assert [loss for _, loss in result["loss_history"]] == pytest.approx(
        [loss for _, loss in one.loss_history], rel=1e-5
    )
    weights = assert_close_weights(
        load_file(Path(result["output_dir"]) / "model.safetensors"), final_weights(one), atol=1e-5
    )
    record_figures("fsdp_2_processes_full", max_loss_difference_to_1_process=loss_gap(result["loss_history"], one.loss_history),
                   max_weight_difference_to_1_process=weights)  # fmt: skip


@pytest.mark.integration
def test_two_nodes_on_loopback_through_the_launchers_command(tmp_path):
    """Node 0 as lora_adapter runs it (local inputs), node 1 as the Kubernetes Job's pods do (``launch.node_command``:
    fetch the inputs from the store, then torchrun with its node rank); a Qwen2 model; each node its own disk. QLoRA:
    the 4-bit base shards too, and the 2 nodes' losses and adapter are one process's with the same global batch."""
    model = build_family("qwen2.5", tmp_path / "model")
    examples = chat_examples(24)
    write_shards(model, tmp_path / "shards", "train", examples, window=8)
    store = LocalStore(tmp_path / "store")
    publish_dir(store, "inputs/base", model)
    publish_dir(store, "inputs/shards", tmp_path / "shards")
    qlora = {"method": "qlora", "learning_rate": 5e-3, "max_steps": 4}
    cfg = fsdp_config(1, num_nodes=2, **qlora)  # 2 nodes x 1 process x 2 micro-batches: 4 rows a step
    job = WorkerJob(cfg, str(store.root), RUN, "inputs/base", "inputs/shards", "sft", {})
    endpoint = f"127.0.0.1:{free_port()}"
    node0 = torchrun_command(
        cfg, 0, endpoint, worker_args(job, model, tmp_path / "shards", tmp_path / "n0", result=tmp_path / "result.json")
    )
    node1 = node_command(job, endpoint, str(tmp_path / "n1"))
    node1[0] = sys.executable
    started = time.monotonic()
    procs = [subprocess.Popen(cmd, stdout=open(tmp_path / f"n{i}.log", "w"), stderr=subprocess.STDOUT, start_new_session=True,
                              env=ONE_THREAD | {"JOB_COMPLETION_INDEX": "0"}) for i, cmd in enumerate((node0, node1))]  # fmt: skip
    logs = [finish(proc, tmp_path / f"n{i}.log") for i, proc in enumerate(procs)]
    assert [proc.returncode for proc in procs] == [0, 0], logs[0][-2000:] + logs[1][-2000:]
    result = json.loads((tmp_path / "result.json").read_text())
    wall = round(time.monotonic() - started, 1)
    assert result["device"] == "cpu x2" and result["steps"] == 4 and result["method"] == "qlora"
    assert result["loss_history"][-1][1] < result["loss_history"][0][1]
    assert shard_files(store, 4) == ["sharded/.metadata", "sharded/__0_0.distcp", "sharded/__1_0.distcp"]
    assert (tmp_path / "n1" / "base" / "config.json").is_file()  # node 1 fetched its own inputs
    one = train(
        training_config(lora_dropout=0.0, per_device_batch_size=1, gradient_accumulation_steps=4, parallelism="fsdp",
                        save_steps=2, logging_steps=1, **qlora),
        model, tmp_path / "shards", LocalStore(tmp_path / "s1"), RUN, tmp_path / "w1", log=lambda line: None,
    )  # fmt: skip
    assert [loss for _, loss in result["loss_history"]] == pytest.approx(
        [loss for _, loss in one.loss_history], rel=1e-5
    )
    # Adam's 1/sqrt(v) magnifies the all-reduce's summation order on the 4-bit base: measured 1.3e-5 after 4 steps
    # (a wrong row or an unsynced gradient already fails the losses' 1e-5 above)
    weights = assert_close_weights(
        load_file(Path(result["output_dir"]) / "adapter_model.safetensors"), final_weights(one), atol=5e-5
    )
    record_figures("fsdp_2_nodes_on_loopback", wall_seconds=wall, steps=result["steps"], method="qlora",
                   first_loss=result["loss_history"][0][1], last_loss=result["loss_history"][-1][1],
                   max_loss_difference_to_1_process=loss_gap(result["loss_history"], one.loss_history),
                   max_weight_difference_to_1_process=weights)  # fmt: skip


def shard_folder(root: Path, rank: int, world: int) -> Path:
    """What one rank of an FSDP checkpoint leaves on its disk: its shard, and on rank 0 the metadata and run state."""
    folder = root / f"rank-{rank}"
    (folder / "sharded").mkdir(parents=True)
    (folder / "sharded" / f"__{rank}_0.distcp").write_bytes(bytes([rank]) * 100)
    if rank == 0:
        (folder / "sharded" / ".metadata").write_bytes(b"m" * world)
        (folder / "trainer_state.json").write_text(json.dumps({"step": 2, "samples_seen": 4, "world_size": world}))
    return folder


def test_rank_0_commits_a_sharded_checkpoint_only_once_every_rank_of_its_attempt_uploaded(tmp_path, monkeypatch):
    from ft_assets.training import checkpoints
    from ft_assets.training.checkpoints import BackgroundUploader, receipt_key

    store = LocalStore(tmp_path / "store")
    prefix = layout.checkpoint(RUN, 2)
    store.put_json(
        receipt_key(prefix, 1), {"attempt": "earlier", "files": {"sharded/__1_0.distcp": {"size": 1, "sha256": "0"}}}
    )
    ranks = [BackgroundUploader(store, RUN, log=lambda line: None, shards=2, rank=r, attempt="now") for r in (0, 1)]
    ranks[0].submit(shard_folder(tmp_path, 0, 2), 2, meta={"step": 2})
    time.sleep(0.5)  # rank 0 uploaded its files and waits: the receipt in the store is an earlier attempt's
    assert not store.exists(join_key(prefix, MANIFEST)) and store.exists(join_key(prefix, "sharded/__0_0.distcp"))
    ranks[1].submit(shard_folder(tmp_path, 1, 2), 2)
    for uploader in ranks:
        uploader.close()
    manifest = read_manifest(store, prefix)
    assert sorted(manifest.files) == [
        "sharded/.metadata",
        "sharded/__0_0.distcp",
        "sharded/__1_0.distcp",
        "trainer_state.json",
    ]
    assert manifest.files["sharded/__1_0.distcp"]["size"] == 100  # this attempt's, not the stale receipt's
    assert complete_checkpoints(store, RUN) == [store.uri(prefix)]

    monkeypatch.setattr(checkpoints, "SHARD_WAIT_S", 0.3)
    alone = BackgroundUploader(store, RUN, log=lambda line: None, shards=2, rank=0, attempt="lonely")
    alone.submit(shard_folder(tmp_path / "again", 0, 2), 4)
    with pytest.raises(
        checkpoints.CheckpointUploadFailed, match=r"rank\(s\) \[1\] did not upload their shards .* stays uncommitted"
    ):
        alone.wait()
    assert complete_checkpoints(store, RUN) == [store.uri(prefix)]  # step 4 never looks complete


@pytest.mark.parametrize(
    "parallelism, rows_per_step, message",
    [
        ("ddp", 2, "was written under parallelism fsdp but this run is ddp: set parallelism back"),
        (
            "fsdp",
            4,
            "took 2 rows a step, this run takes 4; keep per_device_batch_size x gradient_accumulation_steps x processes",
        ),
        ("fsdp", 2, None),  # another number of processes, the same global batch: resumable
    ],
)
def test_a_checkpoint_of_another_format_or_global_batch_is_refused(tmp_path, parallelism, rows_per_step, message):
    from ft_assets.manifests import Manifest
    from ft_assets.training.checkpoints import Checkpoint, check_resumable

    folder = shard_folder(tmp_path, 0, 2)
    checkpoint = Checkpoint(step=2, uri="s3://b/ckpt", local_dir=folder, manifest=Manifest("p", {}, {}, 0.0))
    if message is None:
        check_resumable(checkpoint, parallelism, rows_per_step)
        return
    with pytest.raises(ValueError, match=message):
        check_resumable(checkpoint, parallelism, rows_per_step)


FAMILY_LAYERS = [
    ("llama3", "LlamaDecoderLayer"),
    ("qwen2.5", "Qwen2DecoderLayer"),
    ("gemma2", "Gemma2DecoderLayer"),
    ("phi3", "Phi3DecoderLayer"),
]


@pytest.mark.parametrize("family,layer", FAMILY_LAYERS, ids=[f for f, _ in FAMILY_LAYERS])
def test_fsdp_shards_each_decoder_layer_of_every_family(family, layer, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(build_family(family, tmp_path / family))
    targets = ["qkv_proj"] if family == "phi3" else ["q_proj", "v_proj"]
    for wrapped in (model, get_peft_model(model, LoraConfig(r=4, target_modules=targets))):
        assert [type(m).__name__ for m in decoder_layers(wrapped)] == [layer, layer]


def test_a_model_without_known_layers_is_refused_for_fsdp():
    with pytest.raises(
        ValueError, match="parallelism fsdp: cannot find the decoder layers of Linear .*use parallelism ddp"
    ):
        decoder_layers(torch.nn.Linear(2, 2))


def test_the_run_id_counts_the_global_batch_not_how_it_is_split():
    from ft_assets.objectives import SFT
    from ft_assets.training.checkpoints import run_id

    def rid(**fields):
        return run_id("timers@v1", TrainingConfig(**fields), SFT, "b" * 64, "d" * 64, cuda_available=False)

    two_gpus = rid(num_processes=2, per_device_batch_size=2, parallelism="fsdp")
    assert rid(num_processes=1, gradient_accumulation_steps=2, per_device_batch_size=2, parallelism="fsdp") == two_gpus
    assert rid(num_nodes=2, per_device_batch_size=2, parallelism="fsdp") == two_gpus
    assert rid(num_processes=1, per_device_batch_size=2, parallelism="fsdp") != two_gpus  # half the global batch
    assert rid(num_processes=2, per_device_batch_size=2, parallelism="ddp") != two_gpus  # another checkpoint format


def test_torchrun_command_names_the_node_and_the_rendezvous():
    cfg = TrainingConfig(num_processes=4, num_nodes=3)
    command = torchrun_command(cfg, 2, "10.0.0.7:29400", ["--config", "{}"])
    flags = dict(zip(command[3:-4:2], command[4:-4:2]))
    assert flags["--nnodes"] == "3" and flags["--nproc_per_node"] == "4" and flags["--node_rank"] == "2"
    assert flags["--rdzv_backend"] == "static" and flags["--rdzv_endpoint"] == "10.0.0.7:29400"
    assert command[-4:] == ["-m", "ft_assets.training.worker", "--config", "{}"]
    with pytest.raises(ValueError, match="node rank 3 is outside 0..2"):
        torchrun_command(cfg, 3, "10.0.0.7:29400", [])


def slowed_worker(argv: list[str]) -> int:
    """``python -m ft_assets_tests.test_fsdp ARGS``: the worker with every training step slowed by STEP_DELAY_S."""
    from ft_assets.training import steps, worker

    token_loss_sum = steps.token_loss_sum

    def slow(model, batch, **options):
        time.sleep(STEP_DELAY_S)
        return token_loss_sum(model, batch, **options)

    steps.token_loss_sum = slow
    return worker.main(argv)


if __name__ == "__main__":
    sys.exit(slowed_worker(sys.argv[1:]))
