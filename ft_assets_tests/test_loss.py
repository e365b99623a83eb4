"""training/loss.py: the chunked lm_head + cross-entropy gives the model's own loss, at a fraction of the memory.

The memory test measures each loss in a fresh process: VmHWM (the kernel's high-water mark of its
resident memory since exec) after the inputs exist, then after loss + backward; the difference is the peak
that loss + backward added. Not getrusage's ``ru_maxrss``: Linux carries that across fork and exec, so a child
starts at its parent's peak (under a pytest worker that had held several GiB, the full loss once read 2.5 GiB
over that baseline instead of ~5.9). torch's CPU allocator hands large blocks straight back to the OS, so RSS
follows live tensors, and a high-water mark cannot miss a short-lived peak the way sampling can
(tracemalloc does not see torch's allocations at all).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from ft_assets.shards import IGNORE_INDEX
from ft_assets.training.loss import chunk_tokens, chunked_cross_entropy_sum, learned_tokens, token_loss_sum

VOCAB, TOKENS, HIDDEN = 128_256, 4096, 32  # Llama-3's vocabulary at 4k tokens; a small hidden size keeps lm_head small

PEAK_SCRIPT = """
import json, sys, torch, torch.nn.functional as F
from ft_assets.data.parallel import peak_rss_mib
from ft_assets.training.loss import chunked_cross_entropy_sum
torch.set_num_threads(1)
mode, out = sys.argv[1], sys.argv[2]
vocab, tokens, hidden = map(int, sys.argv[3:6])
torch.manual_seed(0)
h = torch.randn(tokens, hidden, requires_grad=True)
lm_head = torch.nn.Linear(hidden, vocab, bias=False)
targets = torch.randint(0, vocab, (tokens,))
targets[::5] = -100  # unlearned positions, as prompts are
before = peak_rss_mib()
if mode == "full":  # what the model's own loss does: every token's logits, upcast to fp32
    loss = F.cross_entropy(lm_head(h).float(), targets, ignore_index=-100, reduction="sum")
else:
    loss = chunked_cross_entropy_sum(h, lm_head, targets)
loss.backward()
peak = peak_rss_mib()
torch.save({"loss": loss.detach(), "h": h.grad, "w": lm_head.weight.grad}, out + ".pt")
json.dump({"peak_kib": (peak - before) * 1024}, open(out, "w"))
"""


def loss_in_fresh_process(mode: str, out) -> tuple[int, dict]:
    proc = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT, mode, str(out), str(VOCAB), str(TOKENS), str(HIDDEN)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())["peak_kib"], torch.load(str(out) + ".pt")


@pytest.mark.integration  # two fresh processes (their peak RSS), 1.3 GiB of logits each
def test_chunked_loss_cuts_peak_memory_4x_with_the_same_loss_and_gradients(tmp_path):
    full_peak, full = loss_in_fresh_process("full", tmp_path / "full.json")
    chunked_peak, chunked = loss_in_fresh_process("chunked", tmp_path / "chunked.json")
    logits_kib = TOKENS * VOCAB * 4 / 1024
    assert full_peak > 2 * logits_kib, "the full loss should hold several copies of the fp32 logits"
    assert chunked_peak * 4 <= full_peak, (chunked_peak, full_peak)
    print(f"peak of loss + backward: full {full_peak / 2**20:.2f} GiB, chunked {chunked_peak / 2**20:.2f} GiB")
    assert torch.allclose(chunked["loss"], full["loss"], rtol=1e-5, atol=0)
    for name in ("h", "w"):  # lm_head's gradient sums 4096 tokens in fp32 in another order: ~1e-6 of its scale apart
        scale = full[name].abs().max()
        assert torch.allclose(chunked[name], full[name], rtol=1e-5, atol=4e-6 * scale), (
            name,
            (chunked[name] - full[name]).abs().max(),
        )


def test_chunk_size_keeps_one_chunk_of_fp32_logits_at_64_mib():
    assert chunk_tokens(32_000) == 524 and chunk_tokens(128_256) == 130 and chunk_tokens(10**9) == 1


@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_chunked_sum_ignores_unlearned_labels_like_cross_entropy(chunk):
    torch.manual_seed(1)
    h, lm_head = torch.randn(50, 8), torch.nn.Linear(8, 40, bias=False)
    targets = torch.randint(0, 40, (50,))
    targets[:10] = IGNORE_INDEX
    expected = F.cross_entropy(lm_head(h), targets, ignore_index=IGNORE_INDEX, reduction="sum")
    assert torch.allclose(chunked_cross_entropy_sum(h, lm_head, targets, chunk=chunk), expected, rtol=1e-5)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from ft_assets_tests.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


def packed_batch(vocab: int) -> dict[str, torch.Tensor]:
    lengths = [30, 45, 25]
    generator = torch.Generator().manual_seed(2)
    input_ids = torch.randint(3, vocab, (1, sum(lengths)), generator=generator)
    position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    labels = input_ids.clone()
    labels[:, :5] = IGNORE_INDEX  # a prompt
    labels[position_ids == 0] = IGNORE_INDEX
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}


@pytest.mark.parametrize("method", ["full", "lora"])
def test_token_loss_sum_equals_the_models_own_loss_with_tied_embeddings_and_peft(tiny_model, method):
    """The tiny model ties lm_head to the input embedding; under LoRA it sits inside a peft wrapper."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert model.config.tie_word_embeddings
    if method == "lora":
        lora = LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], init_lora_weights=False
        )
        model = get_peft_model(model, lora)
    batch = packed_batch(model.config.vocab_size)
    params = [p for p in model.parameters() if p.requires_grad]

    ours = token_loss_sum(model, batch)
    ours_grads = torch.autograd.grad(ours, params)
    theirs = model(**batch, use_cache=False, num_items_in_batch=1).loss  # the HF loss as a sum
    theirs_grads = torch.autograd.grad(theirs, params)
    assert torch.allclose(ours, theirs, rtol=1e-5)
    for a, b in zip(ours_grads, theirs_grads):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)
    assert learned_tokens(batch) == int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
