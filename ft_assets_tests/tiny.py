"""Hermetic tiny model for tests: a byte-level BPE trained in-process and a 2-layer Llama.

No downloads. The tokenizer speaks ChatML like SmolLM2 (``<|im_start|>``/``<|im_end|>``) so the
chat-template, loss-masking and GGUF paths see the same shapes as the real base model. Building it
takes well under a second; the model has ~100k parameters.
"""

from __future__ import annotations

from pathlib import Path

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CORPUS = [
    "Reply with one JSON tool call.",
    'What is the weather in Paris in celsius? {"name": "get_weather", "arguments": {"city": "Paris"}}',
    'Set a timer for 12 minutes. {"name": "set_timer", "arguments": {"minutes": 12}}',
    "Convert 12 km to m. Convert 19 km to m. The quick brown fox jumps over the lazy dog.",
    "system user assistant 0 1 2 3 4 5 6 7 8 9 { } [ ] : , \" ' . ? !",
    "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ",
]


def train_bpe(special_tokens: list[str], vocab_size: int, extra_text: list[str] | None = None):
    """A byte-level BPE (``tokenizers.Tokenizer``) trained on the test corpus, special tokens first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS + (extra_text or []), trainer=trainer)
    return tok


def build_tokenizer(extra_text: list[str] | None = None, vocab_size: int = 384):
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=train_bpe(SPECIAL_TOKENS, vocab_size, extra_text),
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def build_tiny_model(
    out_dir: str | Path, seed: int = 0, extra_text: list[str] | None = None, hidden: int = 64, init_std: float = 0.2
) -> Path:
    """Write a random-init 2-layer Llama + ChatML BPE tokenizer as a HF directory (safetensors).

    ``init_std`` 0.2, not Llama's 0.02: at 0.02 the frozen tied embedding bounds every logit to about
    ±0.6, so LoRA alone cannot move the loss off ln(vocab); a base with some range behaves like a
    pretrained one and LoRA visibly learns on it.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out_dir = Path(out_dir)
    tokenizer = build_tokenizer(extra_text)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=init_std,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
