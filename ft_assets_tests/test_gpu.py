"""GPU-only checks (skipped on CPU-only machines): QLoRA in bf16 on CUDA, and the NVML utilization reading."""

import pytest
import torch

from ft_assets.training.config import TrainingConfig
from ft_assets.training.gpu_monitor import GpuUtilization
from ft_assets.training.recipe import train
from ft_assets.storage import LocalStore

pytestmark = pytest.mark.gpu


def test_qlora_is_the_default_on_cuda_and_trains_in_bf16(tiny_model_dir, tmp_path):
    from ft_assets_tests.test_training import chat_examples, write_shards

    write_shards(tiny_model_dir, tmp_path / "shards", "train", chat_examples(64), rows_per_shard=64)
    config = TrainingConfig(max_steps=10, save_steps=5, per_device_batch_size=4, learning_rate=5e-3, warmup_steps=0)
    assert config.resolved_method(cuda_available=True) == "qlora"
    result = train(config, tiny_model_dir, tmp_path / "shards", LocalStore(tmp_path / "store"), "runs/t/v/train/r", tmp_path / "work", log=print)
    assert result.method == "qlora" and result.device.startswith("cuda")
    assert result.loss_history[-1][1] < result.loss_history[0][1]


def test_nvml_utilization_is_sampled_on_cuda():
    with GpuUtilization() as utilization:
        x = torch.randn(4096, 4096, device="cuda")
        for _ in range(200):
            x = x @ x.T / 4096
        torch.cuda.synchronize()
        import time

        time.sleep(2.5)
    assert utilization.mean is not None and 0.0 <= utilization.mean <= 1.0
