"""Tiny random models of the families people fine-tune, built in-process: the model-family matrix.

Each ``Family`` builds a 2-layer model of its architecture with the features that break exporters
and trainers in that family (Llama 3's ``llama3`` RoPE scaling, Qwen2.5's q/k/v biases, Qwen3's q/k
norms, Gemma's soft-capping, sliding window, its own norms and embedding scale, Phi-3's fused
``qkv_proj`` and ``gate_up_proj``), and a byte-level BPE trained on a few lines that carries the
family's own special tokens and chat template (Llama 3 headers, Gemma turns with no system role,
Mistral ``[INST]``, Phi ``<|user|>``, ChatML for Qwen). Building one takes well under a second; no
download. ``build_family(name, out_dir)`` writes it as a HF directory (safetensors + tokenizer).

The mixtures of experts (``MOE``) are built the same way, with 4 experts of which each token takes 2:
Qwen3-MoE (normalized top-k, q/k norms), Mixtral (Mistral's template) and gpt-oss (attention
sinks, q/k/v/o and expert biases, alternating sliding-window layers, YaRN RoPE, the harmony
format: system and developer messages, final and analysis channels, a reply ending <|return|>).
transformers 5 holds their experts as fused 3-D parameters and saves
Qwen3-MoE and Mixtral in their released per-expert layout, gpt-oss in its fused one.

Head dims are multiples of 32 (llama.cpp's K-quants work on rows of 256 values, Q8_0 on 32) and the
vocabulary is padded to a multiple of 64 so that every GGUF type has whole blocks to quantize.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ft_assets_tests.tiny import train_bpe

HIDDEN = 128  # 4 heads of 32
VOCAB = 448  # the BPE's merges fill it up; a multiple of 64

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
GEMMA_TEMPLATE = (  # Gemma has no system role: a system message is prepended to the first user turn
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] + '\n\n' %}"
    "{% set messages = messages[1:] %}{% else %}{% set system = '' %}{% endif %}"
    "{% for message in messages %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (system if loop.first else '') + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
MISTRAL_TEMPLATE = (  # [INST] user [/INST] reply</s>; a system message goes before the first user turn
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] + '\n\n' %}"
    "{% set messages = messages[1:] %}{% else %}{% set system = '' %}{% endif %}"
    "{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + (system if loop.first else '') + message['content'] + ' [/INST]' }}"
    "{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)
HARMONY_TEMPLATE = (  # gpt-oss's harmony format as its released template renders chats without tools
    "<|start|>system<|message|>Current date: {{ strftime_now('%Y-%m-%d') }}\n\n"
    "Reasoning: {{ reasoning_effort | default('medium') }}<|end|>"  # the released one says more (identity, channels)
    "{% set turns = messages %}{% if messages[0]['role'] in ('system', 'developer') %}{% set turns = messages[1:] %}"
    "{{ '<|start|>developer<|message|># Instructions\n\n' + messages[0]['content'] + '\n\n<|end|>' }}{% endif %}"
    "{% set called = namespace(name='') %}"
    "{% for message in turns %}{% if message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{% for call in message['tool_calls'] %}{% set called.name = call['function']['name'] %}"
    "{{ '<|start|>assistant to=functions.' + called.name + '<|channel|>commentary json<|message|>' }}"
    "{{ call['function']['arguments'] | tojson }}{{ '<|call|>' }}{% endfor %}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|start|>functions.' + called.name + ' to=assistant<|channel|>commentary<|message|>' }}"
    "{{ message['content'] | tojson }}{{ '<|end|>' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{% if loop.last and not add_generation_prompt %}"
    "{% if message.get('thinking') %}{{ '<|start|>assistant<|channel|>analysis<|message|>' + message['thinking'] + '<|end|>' }}{% endif %}"
    "{{ '<|start|>assistant<|channel|>final<|message|>' + message['content'] + '<|return|>' }}"
    "{% else %}{{ '<|start|>assistant<|channel|>final<|message|>' + message['content'] + '<|end|>' }}{% endif %}"
    "{% else %}{{ '<|start|>' + message['role'] + '<|message|>' + message['content'] + '<|end|>' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start|>assistant' }}{% endif %}"
)  # history replies end <|end|>, the last one <|return|> (what generation stops at); a reply's thinking only there
PHI3_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


@dataclass(frozen=True)
class Tokens:
    """A family's special tokens and chat template."""

    special: list[str]
    bos: str | None
    eos: str
    pad: str
    template: str


LLAMA3_TOKENS = Tokens(
    ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
    "<|begin_of_text|>", "<|eot_id|>", "<|end_of_text|>", LLAMA3_TEMPLATE,
)  # fmt: skip
CHATML_TOKENS = Tokens(
    ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>", "<|endoftext|>", CHATML_TEMPLATE
)
GEMMA_TOKENS = Tokens(
    ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"], "<bos>", "<end_of_turn>", "<pad>", GEMMA_TEMPLATE
)
MISTRAL_TOKENS = Tokens(["<unk>", "<s>", "</s>", "[INST]", "[/INST]"], "<s>", "</s>", "</s>", MISTRAL_TEMPLATE)
PHI3_TOKENS = Tokens(
    ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"],
    None,
    "<|end|>",
    "<|endoftext|>",
    PHI3_TEMPLATE,
)
HARMONY_TOKENS = Tokens(
    ["<|startoftext|>", "<|endoftext|>", "<|start|>", "<|message|>", "<|channel|>", "<|end|>", "<|return|>", "<|call|>"],
    "<|startoftext|>", "<|return|>", "<|endoftext|>", HARMONY_TEMPLATE,
)  # fmt: skip


@dataclass(frozen=True)
class Family:
    name: str  # how the matrix names it
    model_type: str  # config.json's model_type
    config_class: str  # transformers config class
    tokens: Tokens
    config: dict = field(default_factory=dict)  # the family's own settings, over the shared tiny shape
    features: str = ""  # what the tiny model exercises


FAMILIES = [
    Family("llama3", "llama", "LlamaConfig", LLAMA3_TOKENS, {
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
    }, "rope_type llama3 (theta 500k), untied embeddings"),
    Family("llama3-tied", "llama", "LlamaConfig", LLAMA3_TOKENS, {
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
    }, "rope_type llama3, tied embeddings (Llama 3.2 1B/3B)"),
    Family("qwen2.5", "qwen2", "Qwen2Config", CHATML_TOKENS, {
        "tie_word_embeddings": True, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    }, "q/k/v biases, ChatML"),
    Family("qwen3", "qwen3", "Qwen3Config", CHATML_TOKENS, {
        "tie_word_embeddings": True, "head_dim": 32, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    }, "q/k RMS norms, explicit head_dim"),
    Family("mistral", "mistral", "MistralConfig", MISTRAL_TOKENS, {
        "tie_word_embeddings": False, "sliding_window": None, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    }, "[INST] template, untied embeddings"),
    Family("gemma2", "gemma2", "Gemma2Config", GEMMA_TOKENS, {
        "head_dim": 32, "query_pre_attn_scalar": 32, "sliding_window": 16, "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0, "layer_types": ["sliding_attention", "full_attention"],
    }, "logit soft-capping, sliding window, pre/post norms, embedding scale, no system role"),
    Family("gemma3", "gemma3_text", "Gemma3TextConfig", GEMMA_TOKENS, {
        "head_dim": 32, "query_pre_attn_scalar": 32, "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
    }, "q/k norms, sliding window with its own RoPE base, embedding scale, no system role"),
    Family("phi3", "phi3", "Phi3Config", PHI3_TOKENS, {
        "tie_word_embeddings": False, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "sliding_window": None,
    }, "fused qkv_proj and gate_up_proj"),
]  # fmt: skip
DENSE = [family.name for family in FAMILIES]
MOE_FAMILIES = [
    Family("qwen3-moe", "qwen3_moe", "Qwen3MoeConfig", CHATML_TOKENS, {
        "tie_word_embeddings": False, "head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 256, "norm_topk_prob": True, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    }, "4 experts, top-2 normalized, q/k norms"),
    Family("mixtral", "mixtral", "MixtralConfig", MISTRAL_TOKENS, {
        "tie_word_embeddings": False, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    }, "4 experts, top-2, [INST] template"),
    Family("gpt-oss", "gpt_oss", "GptOssConfig", HARMONY_TOKENS, {
        "tie_word_embeddings": False, "head_dim": 32, "num_local_experts": 4, "num_experts_per_tok": 2,
        "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"], "max_position_embeddings": 131072,
        "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                            "original_max_position_embeddings": 4096, "rope_theta": 150000.0},  # gpt-oss-20b's
    }, "4 experts, top-2, attention sinks, biases, sliding window, YaRN, harmony"),
]  # fmt: skip
MOE = [family.name for family in MOE_FAMILIES]
FAMILIES = FAMILIES + MOE_FAMILIES
BY_NAME = {family.name: family for family in FAMILIES}


def build_family_tokenizer(tokens: Tokens, vocab_size: int = VOCAB):
    """A byte-level BPE trained on the test corpus, with the family's special tokens and chat template."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=train_bpe(tokens.special, vocab_size), bos_token=tokens.bos, eos_token=tokens.eos, pad_token=tokens.pad,
        unk_token=tokens.pad,
    )  # fmt: skip
    fast.chat_template = tokens.template
    return fast


def family_config(family: Family, tokenizer, init_std: float = 0.2):
    """The tiny config of ``family``: 2 layers, hidden 128, 4 query heads over 2 KV heads, then the family's own settings."""
    import transformers

    shape = dict(
        vocab_size=-(-len(tokenizer) // 64) * 64,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=init_std,
        bos_token_id=tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return getattr(transformers, family.config_class)(**{**shape, **family.config})


def build_family(name: str, out_dir: str | Path, seed: int = 0, init_std: float = 0.2) -> Path:
    """Write a random-init tiny model of family ``name`` + its tokenizer as a HF directory (safetensors)."""
    import torch
    from transformers import AutoModelForCausalLM

    family = BY_NAME[name]
    out_dir = Path(out_dir)
    tokenizer = build_family_tokenizer(family.tokens)
    config = family_config(family, tokenizer, init_std)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


FP4_CODES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # E2M1, by code


def write_mxfp4(model_dir: str | Path, out_dir: str | Path) -> Path:
    """``model_dir`` (a tiny gpt-oss) as the released gpt-oss checkpoints are: the experts' weights as MXFP4 blocks of
    32 (4-bit E2M1 codes, two a byte, low nibble first, laid out (experts, out, in / 32, 16)) with one power-of-two
    scale each (E8M0, bias 127), ``quantization_config.quant_method: mxfp4`` in config.json. Everything else as it was.
    Returns ``out_dir``; ``exact_weights(out_dir)`` are the weights it stands for."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    shutil.copytree(model_dir, out_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    codes = torch.tensor(FP4_CODES)
    state = load_file(model_dir / "model.safetensors")
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        weight = state.pop(name).transpose(1, 2).float()  # (experts, in, out) -> the checkpoint's (experts, out, in)
        experts, rows, columns = weight.shape
        blocks = weight.reshape(experts, rows, columns // 32, 32)
        exponent = torch.ceil(torch.log2(blocks.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 6.0))
        index = (blocks.div(torch.pow(2.0, exponent)).unsqueeze(-1) - codes).abs().argmin(-1)  # the nearest code
        state[name + "_blocks"] = (index[..., 0::2] | (index[..., 1::2] << 4)).to(torch.uint8)
        state[name + "_scales"] = (exponent.squeeze(-1) + 127).to(torch.uint8)
    save_file(state, out_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}  # fmt: skip
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir


def exact_weights(mxfp4_dir: str | Path) -> dict:
    """The float weights an MXFP4 folder of ``write_mxfp4`` stands for, as the model names them (experts dequantized)."""
    import torch
    from safetensors.torch import load_file

    state, codes = load_file(Path(mxfp4_dir) / "model.safetensors"), torch.tensor(FP4_CODES)
    for name in [n[: -len("_blocks")] for n in state if n.endswith("_blocks")]:
        packed, scales = state.pop(name + "_blocks"), state.pop(name + "_scales").to(torch.int32) - 127
        values = torch.stack([codes[(packed & 0x0F).long()], codes[(packed >> 4).long()]], -1).flatten(-2)
        weight = torch.ldexp(values, scales.unsqueeze(-1)).flatten(-2)  # (experts, out, in)
        state[name] = weight.transpose(1, 2).contiguous()
    return state
