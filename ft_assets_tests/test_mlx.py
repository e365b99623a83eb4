"""The MLX training backend (mlx-cpu here, Metal on a Mac): the MLX -> PEFT adapter conversion in transformers, the
unpacked-example loss against the torch recipe's packed one, the schedule, training, SIGTERM, kill -9 and resume,
full fine-tuning, and the runs it refuses.

The parity tolerance: the converted adapter's logits in transformers equal the MLX model's with its adapter to a
max absolute difference of 1e-4 x the largest logit (measured: 3e-6 to 5e-5 on the five families, with adapters that
move the logits by ~10). The kill -9 test is the only one that spawns a process (integration).
"""

from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest
import torch

from ft_assets.objectives import DPO, GRPO, SFT
from ft_assets.shards import load_packed_rows
from ft_assets.storage import LocalStore
from ft_assets.training import backends, mlx_peft
from ft_assets.training import mlx_model as mm
from ft_assets.training.checkpoints import checkpoint_steps
from ft_assets.training.config import TrainingConfig
from ft_assets.training.loss import learned_tokens, token_loss_sum
from ft_assets.training.mlx_recipe import MLX_DIR, learning_rate_at, loss_sum, padded, train
from ft_assets.training.preemption import Preempted
from ft_assets_tests.families import build_family
from ft_assets_tests.support import RUN, SEQ_LEN, sigkill_training_after_checkpoint
from ft_assets_tests.support import training_config as torch_config

mx = pytest.importorskip("mlx.core", reason="the [mlx] extra (mlx, mlx-lm) is not installed")
pytestmark = pytest.mark.usefixtures("one_cpu_thread", "with_mlx")

PARITY_FAMILIES = ["llama3", "qwen2.5", "mistral", "gemma3", "phi3"]
RELATIVE_TOLERANCE = 1e-4


def mlx_config(**overrides) -> TrainingConfig:
    return torch_config(backend="mlx", **overrides)


def torch_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float().numpy()


def mlx_logits(model, ids: np.ndarray) -> np.ndarray:
    return np.array(model(mx.array(ids)).astype(mx.float32))


@pytest.mark.parametrize("family", PARITY_FAMILIES)
def test_the_converted_peft_adapter_gives_the_mlx_models_logits_in_transformers(family, tmp_path):
    """A LoRA on every projection with random B (a fresh one is zero and would prove nothing), written as mlx-lm writes
    it, converted, loaded by peft on the transformers base: its logits are those of mlx-lm loading our mlx files."""
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import load_adapters
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = build_family(family, tmp_path / "base")
    mx.random.seed(0)
    model = mm.load_base(base, 64)
    parameters = mm.lora_parameters(8, 16, 0.0, mm.lora_keys(model, []))
    mm.add_lora(model, parameters)
    random_b = {k: mx.random.normal(v.shape) * 0.2 for k, v in tree_flatten(model.trainable_parameters())}
    model.load_weights(list(random_b.items()), strict=False)
    mm.write_adapter(model, parameters, tmp_path / "mlx")
    summary = mlx_peft.convert(tmp_path / "mlx", base, tmp_path / "peft", "tiny/" + family)

    reloaded = mm.load_base(base, 64)
    load_adapters(reloaded, str(tmp_path / "mlx"))  # mlx-lm's own reader of the MLX original
    reloaded.eval()
    ids = np.random.default_rng(0).integers(5, 400, size=(2, 12))
    expected = mlx_logits(reloaded, ids)
    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), tmp_path / "peft"
    )
    got = torch_logits(peft_model.eval(), ids)
    with peft_model.disable_adapter():
        without = torch_logits(peft_model, ids)
    assert np.abs(without - expected).max() > 1.0, (
        "the adapter must move the logits for the comparison to mean anything"
    )
    assert np.abs(got - expected).max() <= RELATIVE_TOLERANCE * np.abs(expected).max()
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["lora_alpha"] == 16 and config["r"] == 8 and config["base_model_name_or_path"] == "tiny/" + family
    assert sorted(config["target_modules"]) == summary["target_modules"]
    assert {"q_proj", "o_proj"} <= set(config["target_modules"]) or {"qkv_proj", "o_proj"} <= set(
        config["target_modules"]
    )


def test_an_adapter_on_some_layers_names_each_module_and_a_foreign_one_is_refused(tmp_path):
    from safetensors.numpy import load_file, save_file

    base = build_family("qwen2.5", tmp_path / "base")
    model = mm.load_base(base, 64)
    parameters = mm.lora_parameters(4, 8, 0.0, mm.lora_keys(model, ["v_proj"]))
    mm.add_lora(model, parameters)
    mm.write_adapter(model, parameters, tmp_path / "mlx")
    weights = load_file(tmp_path / "mlx" / mm.ADAPTER_WEIGHTS)
    only_layer_1 = {k: v for k, v in weights.items() if ".layers.1." in k}
    save_file(only_layer_1, tmp_path / "mlx" / mm.ADAPTER_WEIGHTS)
    mlx_peft.convert(tmp_path / "mlx", base, tmp_path / "peft")
    assert json.loads((tmp_path / "peft" / "adapter_config.json").read_text())["target_modules"] == [
        "model.layers.1.self_attn.v_proj"
    ]
    save_file(
        {k.replace("v_proj", "w_proj"): v for k, v in only_layer_1.items()}, tmp_path / "mlx" / mm.ADAPTER_WEIGHTS
    )
    with pytest.raises(mlx_peft.ConversionRefused, match=r"model.layers.1.self_attn.w_proj.weight is not in the base"):
        mlx_peft.convert(tmp_path / "mlx", base, tmp_path / "peft2")
    config = json.loads((tmp_path / "mlx" / mm.ADAPTER_CONFIG).read_text()) | {"fine_tune_type": "dora"}
    (tmp_path / "mlx" / mm.ADAPTER_CONFIG).write_text(json.dumps(config))
    with pytest.raises(mlx_peft.ConversionRefused, match="fine_tune_type 'dora' has no PEFT LoRA equivalent"):
        mlx_peft.convert(tmp_path / "mlx", base, tmp_path / "peft3")


def test_unpacked_examples_have_the_packed_rows_loss(tiny_model, shards):
    """The MLX recipe's loss over the examples of packed rows (each its own padded sequence) is the torch recipe's
    loss over the packed rows (block-diagonal attention by position ids), on the same base weights."""
    from transformers import AutoModelForCausalLM

    rows = load_packed_rows(shards, "train", SEQ_LEN)
    batch = rows.batch(np.arange(4), torch.device("cpu"))
    with torch.no_grad():
        expected = token_loss_sum(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), batch).item()
    model = mm.load_base(tiny_model, SEQ_LEN)
    arrays = [t[:4].numpy() for t in (rows.input_ids, rows.labels, rows.position_ids)]
    forwards = padded(*arrays, budget=2 * SEQ_LEN)
    assert len(forwards) > 1 and all(inputs.size <= 2 * SEQ_LEN for inputs, _ in forwards)
    assert sum(int((targets != -100).sum()) for _, targets in forwards) == learned_tokens(batch)
    got = sum(loss_sum(model, mx.array(inputs), mx.array(targets)).item() for inputs, targets in forwards)
    assert got == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("scheduler", ["cosine", "linear", "constant"])
def test_the_learning_rate_schedule_is_transformers(scheduler):
    from transformers import get_scheduler

    config = mlx_config(lr_scheduler=scheduler, max_steps=20, warmup_steps=3)
    resolved = config.resolve(8, False, SFT, 1)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=resolved.learning_rate)
    name = "constant_with_warmup" if scheduler == "constant" else scheduler
    schedule = get_scheduler(name, optimizer, num_warmup_steps=3, num_training_steps=20)
    for step in range(20):
        assert learning_rate_at(config, resolved, step) == pytest.approx(schedule.get_last_lr()[0], abs=1e-12)
        optimizer.step()
        schedule.step()


def test_the_backend_setting_resolves_and_refuses_in_one_line():
    assert backends.resolve("auto", "sft", "lora", 1) == ("mlx" if backends.apple_silicon() else "torch")
    assert backends.resolve("auto", "dpo", "lora", 1) == "torch"  # auto never picks what mlx cannot do
    assert mlx_config().resolve(8, False, SFT, 1).backend == "mlx"
    for objective in (DPO, GRPO):
        with pytest.raises(ValueError, match=f"objective is {objective.name} .*: set backend: torch"):
            mlx_config().resolve(8, False, objective, 1)
    assert mlx_config(method="qlora").resolve(8, False, SFT, 1).backend == "mlx"  # mlx's 4-bit
    with pytest.raises(ValueError, match="one process"):
        mlx_config(num_processes=2).resolve(8, False, SFT)
    torch_fields = torch_config().result_fields(False, SFT)
    assert "backend" not in torch_fields and mlx_config().result_fields(False, SFT)["backend"] == "mlx"


# --- training -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mlx_reference(tiny_model, shards, tmp_path_factory):
    """An uninterrupted MLX run (24 steps), its log and its final adapter's weights."""
    tmp = tmp_path_factory.mktemp("mlx-reference")
    lines: list[str] = []
    with pytest.MonkeyPatch.context() as env:  # a module fixture: with_mlx is not set up yet
        env.setenv("FT_MLX", "1")
        store = LocalStore(tmp / "store")
        result = train(mlx_config(max_steps=24), tiny_model, shards, store, RUN, tmp / "work", lines.append)
    return result, lines, final_adapter(result.output_dir)


def final_adapter(folder) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(folder / MLX_DIR / mm.ADAPTER_WEIGHTS)


def assert_same_adapter(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=0, atol=1e-6, err_msg=name)


def test_an_mlx_run_trains_checkpoints_and_publishes_a_peft_adapter(tiny_model, mlx_reference):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    result, lines, _ = mlx_reference
    losses = [loss for _, loss in result.loss_history]
    assert len(losses) == 24 and np.mean(losses[-4:]) < 0.5 * np.mean(losses[:4])
    assert result.device == "mlx-cpu x1" and result.eval_loss is not None and result.tokens_per_second > 0
    assert 0 < result.effective_training_fraction < 1 and result.resolved["backend"] == "mlx"
    assert [c.rsplit("-", 1)[-1] for c in result.checkpoints] == [f"{s:08d}" for s in (4, 8, 12, 16, 20, 24)]
    assert any(line.startswith("step 24/24  loss ") and "tok/s" in line for line in lines)
    assert any(line.startswith("training lora on mlx-cpu x1") for line in lines)
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), result.output_dir)
    assert peft_model.peft_config["default"].lora_alpha == 16
    assert (result.output_dir / MLX_DIR / mm.ADAPTER_CONFIG).is_file() and (
        result.output_dir / "tokenizer.json"
    ).is_file()


def test_sigterm_checkpoints_then_the_rerun_ends_with_the_uninterrupted_adapter(
    tiny_model, shards, tmp_path, mlx_reference
):
    store = LocalStore(tmp_path / "store")

    def sigterm_at_step_8(metrics: dict) -> None:
        if metrics.get("step") == 8:
            os.kill(os.getpid(), signal.SIGTERM)

    config = mlx_config(max_steps=24, logging_steps=2)
    with pytest.raises(Preempted, match="at step 8"):
        train(config, tiny_model, shards, store, RUN, tmp_path / "a", lambda line: None, on_metrics=sigterm_at_step_8)
    assert checkpoint_steps(store, RUN)[0] == 8
    lines: list[str] = []
    result = train(config, tiny_model, shards, store, RUN, tmp_path / "b", lines.append)
    assert result.resumed_from_step == 8 and any("resuming from" in line for line in lines)
    assert_same_adapter(final_adapter(result.output_dir), mlx_reference[2])


@pytest.mark.integration
def test_kill_9_then_rerun_resumes_and_ends_with_the_uninterrupted_adapter(tiny_model, shards, tmp_path, mlx_reference):
    store = LocalStore(tmp_path / "store")
    config = mlx_config(max_steps=24)
    sigkill_training_after_checkpoint(config, tiny_model, shards, store, RUN, 8, tmp_path / "killed")
    result = train(config, tiny_model, shards, store, RUN, tmp_path / "rerun", lambda line: None)
    assert result.resumed_from_step >= 8 and result.steps == 24
    assert_same_adapter(final_adapter(result.output_dir), mlx_reference[2])


def test_gradient_checkpointing_trains_the_same_adapter(tiny_model, shards, tmp_path):
    """mlx-lm's grad_checkpoint (it patches the decoder layer's class for the process: the same math from then on).
    Without dropout: mlx recomputes the forward in backward with new dropout draws, which lora_dropout > 0 refuses."""
    adapters = []
    for checkpointing in (False, True):
        config = mlx_config(max_steps=8, lora_dropout=0.0, gradient_checkpointing=checkpointing)
        work = tmp_path / str(checkpointing)
        adapters.append(
            final_adapter(train(config, tiny_model, shards, LocalStore(work / "s"), RUN, work, print).output_dir)
        )
    assert adapters[0].keys() == adapters[1].keys()
    for name in adapters[0]:
        np.testing.assert_allclose(adapters[1][name], adapters[0][name], rtol=0, atol=1e-5, err_msg=name)
    with pytest.raises(ValueError, match="lora_dropout"):
        train(
            mlx_config(gradient_checkpointing=True), tiny_model, shards, LocalStore(tmp_path / "x"), RUN, tmp_path / "x"
        )


def test_qlora_trains_over_mlx_4bit_and_converts_for_the_full_precision_base(tiny_model, shards, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    lines: list[str] = []
    result = train(mlx_config(method="qlora", max_steps=8), tiny_model, shards, LocalStore(tmp_path / "store"), RUN,
                   tmp_path / "work", lines.append)  # fmt: skip
    losses = [loss for _, loss in result.loss_history]
    assert result.method == "qlora" and np.mean(losses[-2:]) < np.mean(losses[:2])
    assert any(line.startswith("training qlora on mlx-cpu") for line in lines)
    merged = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_model), result.output_dir
    ).merge_and_unload()
    assert merged.config.architectures == ["LlamaForCausalLM"]


def test_full_fine_tuning_writes_a_transformers_model_with_the_mlx_logits(tiny_model, shards, tmp_path):
    from mlx_lm.utils import load_model
    from transformers import AutoModelForCausalLM

    result = train(mlx_config(method="full", max_steps=4, learning_rate=1e-3), tiny_model, shards,
                   LocalStore(tmp_path / "store"), RUN, tmp_path / "work", lambda line: None)  # fmt: skip
    ids = np.random.default_rng(1).integers(5, 300, size=(1, 16))
    trained = torch_logits(AutoModelForCausalLM.from_pretrained(result.output_dir, dtype=torch.float32), ids)
    base = torch_logits(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), ids)
    mlx_trained, _ = load_model(
        result.output_dir, model_config=mm.mlx_config(json.loads((result.output_dir / "config.json").read_text()))
    )
    assert np.abs(trained - base).max() > 0.1
    assert np.abs(trained - mlx_logits(mlx_trained, ids)).max() <= RELATIVE_TOLERANCE * np.abs(trained).max()
