"""Print the planner's VRAM and throughput tables for the reference models.

``python -m scripts.planner_tables`` prints what ``ft_assets/control/planner.py``'s docstring quotes:
peak VRAM of each reference model (``ft_assets_tests/reference_models.py``) per method at seq 512
and 2048, Llama-2-13B's per GPU under FSDP, and Llama-2-7B LoRA tokens/s on each default GPU offering.
"""

from ft_assets.cli.plan import plan_request
from ft_assets.control.cost_model import CostModel
from ft_assets.control.planner import (
    METHODS,
    ModelShape,
    VramEstimate,
    estimate_vram,
    flops_per_token,
    tokens_per_second,
)
from ft_assets.training.config import TrainingConfig
from ft_assets_tests.reference_models import REFERENCE_CONFIGS

SETTINGS = TrainingConfig(per_device_batch_size=1, gradient_checkpointing=True)  # every other setting its default


def vram(shape: ModelShape, method: str, seq_len: int, gpus: int = 1) -> VramEstimate:
    """Per GPU, as ``ft-assets plan --batch 1 --gradient-checkpointing`` plans it (FSDP above one GPU)."""
    return estimate_vram(plan_request(shape, method, seq_len, seq_len, SETTINGS), gpus, "fsdp" if gpus > 1 else "ddp")


def main() -> None:
    """Print the VRAM and throughput tables quoted in the planner's module docstring."""
    cost_model = CostModel()
    print("VRAM GiB, batch 1, gradient checkpointing, LoRA r=16 on all projections, seq 512 / 2048")
    for name, config in REFERENCE_CONFIGS.items():
        shape = ModelShape.from_config(config, name)
        cells = []
        for method in METHODS:
            short, long = (vram(shape, method, s).total_gib for s in (512, 2048))
            cells.append(f"{method} {short:.1f} / {long:.1f}")
        print(f"  {name:<14} {shape.params:>14,} params   " + "   ".join(cells))
    print("VRAM GiB per GPU, seq 2048, batch 1, gradient checkpointing, LoRA r=16: 1 GPU, then FSDP on 2 / 4 / 8")
    llama13b = ModelShape.from_config(REFERENCE_CONFIGS["Llama-2-13B"], "Llama-2-13B")
    for method in ("full", "lora"):
        one = vram(llama13b, method, 2048).total_gib
        sharded = [vram(llama13b, method, 2048, n).total_gib for n in (2, 4, 8)]
        print(
            f"  Llama-2-13B {method:<5} 1 GPU {one:5.1f}   fsdp 2: {sharded[0]:5.1f}   4: {sharded[1]:5.1f}   8: {sharded[2]:5.1f}"
        )
    llama7b = ModelShape.from_config(REFERENCE_CONFIGS["Llama-2-7B"], "Llama-2-7B")
    gflops = flops_per_token(llama7b, "lora", 2048, True) / 1e9
    print(f"Llama-2-7B LoRA at seq 2048 with checkpointing: {gflops:.1f} GFLOP/token; tokens/s by tier:")
    for offering in cost_model.offerings:
        speed = tokens_per_second(llama7b, "lora", 2048, True, offering, cost_model)
        print(f"  {offering.name:<14} {speed:>7,.0f}")


if __name__ == "__main__":
    main()
