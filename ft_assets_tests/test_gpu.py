"""GPU-only checks (skipped on CPU-only machines): QLoRA in bf16 on CUDA, the attention backends that train
only there (flash_attention_2, flex_attention) keeping packed examples apart, Liger's fused loss, and the
NVML utilization reading. flash-attn and liger-kernel are optional installs: their cases need them."""

import pytest
import torch

from ft_assets.training.config import TrainingConfig
from ft_assets.training.gpu_monitor import GpuUtilization
from ft_assets.training.recipe import train
from ft_assets.storage import LocalStore

pytestmark = pytest.mark.gpu


def test_qlora_is_the_default_on_cuda_and_trains_in_bf16(tiny_model_dir, tmp_path):
    from ft_assets_tests.support import chat_examples, write_shards

    write_shards(tiny_model_dir, tmp_path / "shards", "train", chat_examples(64))
    config = TrainingConfig(max_steps=10, save_steps=5, per_device_batch_size=4, learning_rate=5e-3, warmup_steps=0)
    assert config.resolved_method(cuda_available=True) == "qlora"
    result = train(
        config,
        tiny_model_dir,
        tmp_path / "shards",
        LocalStore(tmp_path / "store"),
        "runs/t/v/train/r",
        tmp_path / "work",
        log=print,
    )
    assert result.method == "qlora" and result.device.startswith("cuda")
    assert result.attn_implementation in ("flash_attention_2", "flex_attention")  # auto: never a dense score path
    assert result.loss_history[-1][1] < result.loss_history[0][1] and result.tokens_per_second > 0


@pytest.mark.parametrize(
    "attn, dtype, rel", [("flex_attention", torch.float32, 1e-5), ("flash_attention_2", torch.bfloat16, 2e-2)]
)
def test_packed_row_loss_and_gradients_equal_its_examples_one_by_one(tiny_model_dir, attn, dtype, rel):
    """Training mode, with backward: the packed row through the backend vs each example alone through sdpa."""
    from transformers import AutoModelForCausalLM

    from ft_assets.training.loss import token_loss_sum

    if attn == "flash_attention_2":
        pytest.importorskip("flash_attn")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype, attn_implementation=attn).cuda().train()
    reference = (
        AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype, attn_implementation="sdpa").cuda().train()
    )
    lengths = [100, 150, 200, 62]
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, model.config.vocab_size, (1, sum(lengths)), generator=generator).cuda()
    position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0).cuda()
    labels = ids.clone()
    labels[position_ids == 0] = -100
    packed = token_loss_sum(model, {"input_ids": ids, "labels": labels, "position_ids": position_ids})
    packed.backward()
    alone, start = 0.0, 0
    for n in lengths:
        part = slice(start, start + n)
        loss = token_loss_sum(
            reference, {"input_ids": ids[:, part], "labels": labels[:, part], "position_ids": position_ids[:, part]}
        )
        loss.backward()
        alone += float(loss)
        start += n
    assert float(packed) == pytest.approx(alone, rel=rel)
    grads = {name: p.grad for name, p in model.named_parameters()}
    for name, p in reference.named_parameters():
        assert torch.allclose(grads[name].float(), p.grad.float(), rtol=rel * 10, atol=rel), name


def test_liger_fused_loss_equals_the_chunked_one():
    pytest.importorskip("liger_kernel")
    from ft_assets.training.loss import _fused_linear_cross_entropy, chunked_cross_entropy_sum

    torch.manual_seed(0)
    lm_head = torch.nn.Linear(256, 32000, bias=False).cuda()
    hidden = torch.randn(1024, 256, device="cuda", requires_grad=True)
    targets = torch.randint(0, 32000, (1024,), device="cuda")
    targets[:100] = -100
    fused = _fused_linear_cross_entropy(lm_head, hidden)
    assert fused is not None
    expected = chunked_cross_entropy_sum(hidden, lm_head, targets)
    assert torch.allclose(fused(lm_head.weight, hidden, targets), expected, rtol=1e-4)


def test_nvml_utilization_is_sampled_on_cuda():
    """Busy for two sampling windows, the mean is high; idle for two, it is low (idle time counts)."""
    import time

    x = torch.randn(4096, 4096, device="cuda")
    with GpuUtilization() as busy:
        until = time.monotonic() + 4.5  # samples at 2 s and 4 s both land on a busy GPU
        while time.monotonic() < until:
            for _ in range(50):
                x = x @ x.T / 4096
            torch.cuda.synchronize()
    with GpuUtilization() as idle:
        time.sleep(4.5)
    assert len(busy.samples) >= 2 and busy.mean > 0.5, busy.samples
    assert len(idle.samples) >= 2 and idle.mean < 0.2, idle.samples
