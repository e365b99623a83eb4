"""Tiny random vision-language models of the families people fine-tune, built in-process: the VLM matrix.

Each ``VlmFamily`` builds its released architecture at toy size (text: 2 layers, hidden 128, head dim 32, the
vocabulary padded to a multiple of 64; vision: 2 layers, hidden 64, head dim 32) and keeps the released
hyper-parameters that exporters and trainers trip on, since llama.cpp's ``convert_hf_to_gguf.py --mmproj`` and its
multimodal path expect the released shapes, not just the released tensor names:

- ``qwen2_5_vl``: patch 14, temporal patch 2, spatial merge 2 (2x2 patches -> 1 token), window attention (112 px
  windows) with full attention every 2nd block of 4 (``fullatt_block_indexes``; llama.cpp's converter wants 3 or more), SwiGLU vision MLP, q/k/v biases, M-RoPE
  (``mrope_section`` 4/6/6: the released 16/24/24 at head dim 32), dynamic resolution (4-16 tokens an image).
- ``qwen3_vl``: patch 16, a learned 48x48 position grid (interpolated), DeepStack (vision block 0 feeds text layer 0),
  interleaved M-RoPE 6/5/5 (released 24/20/20), q/k norms; 4-16 tokens an image.
- ``gemma3``: a SigLIP tower (patch 14, 224 px -> 16x16 patches) average-pooled 4x4, the released kernel, to
  ``mm_tokens_per_image`` 16 (a perfect square); image tokens attend bidirectionally within their image
  (``token_type_ids``); sliding and global layers; no system role.
- ``idefics3`` (Llama 3 text) and ``smolvlm`` (SmolLM2 text, ChatML specials): pixel shuffle by ``scale_factor``
  2 (patch 14, 56 px tiles) and 4 (patch 16, 128 px tiles, as the 256M/500M models), 4 tokens a tile; the released
  image splitting is on (rows x cols tiles tagged ``<row_i_col_j>``, then the global image) and bounded to 2x2 tiles by
  ``size.longest_edge`` = 2 tiles: a square image is 20 image tokens, 4 with ``do_image_splitting=False``.
- ``llava``: LLaVA-1.5: CLIP (2nd-to-last layer, CLS dropped), 2-layer GELU projector, 16 tokens, a template
  without end-of-turn token whose BOS the tokenizer adds.

The text weights are drawn at ``init_std`` 0.2 (as ``tiny.py`` explains: so that LoRA visibly learns), the vision
towers at 0.02 as released; Gemma 3's projector, which transformers starts at zeros (images would change nothing),
at 0.02 too. Each directory holds safetensors weights in the released layout, the processor (with transformers'
PIL image processor: no torchvision), a byte-level BPE trained in-process with the family's special tokens, and a
faithful simplified copy of the released chat template (``chat_template.jinja``, which both the tokenizer and the
processor read) rendering ``content`` as a string or as a list of ``{"type": "image"}`` / ``{"type": "text"}`` parts
as the released one does. ``build_vlm(name, out_dir)`` writes one in a tenth of a second once transformers is
imported; ``AutoModelForImageTextToText.from_pretrained`` loads it offline, and so does ``AutoProcessor``, except
that transformers 5 cannot build Qwen-VL's and SmolVLM's processors without torchvision: ``load_vlm_processor`` can.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ft_assets.vision import takes_video, without_video
from ft_assets_tests.tiny import train_bpe

HIDDEN = 128  # text: 4 query heads of 32 over 2 KV heads
VISION_HIDDEN = 64  # vision: 2 heads of 32
VOCAB = 448  # the BPE's merges fill it up; a multiple of 64
TEXT = {
    "hidden_size": HIDDEN, "intermediate_size": 2 * HIDDEN, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 2048,
}  # fmt: skip
VISION = {"hidden_size": VISION_HIDDEN, "intermediate_size": 2 * VISION_HIDDEN, "initializer_range": 0.02}
# the templates' role names, and runs of newlines so that the BPE merges "\n\n" as the released vocabularies do: Gemma 3's
# processor wraps each image in "\n\n", which then tokenizes differently after the template's "\n" than alone
VLM_CORPUS = ["USER: ASSISTANT: User: Assistant: user model system"] + [
    "Describe the image.\n\nThe image shows a dog.\n\n\nA cat.\n\n"
] * 4

# Qwen2.5-VL's released template (no tools; videos left out), its default system prompt included
QWEN2_5_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}{{ '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Qwen3-VL's (no tools, no thinking): no default system prompt; a system message's parts contribute their text
QWEN3_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}"
    "{% if messages[0]['role'] == 'system' %}{{ '<|im_start|>system\n' }}"
    "{% if messages[0]['content'] is string %}{{ messages[0]['content'] }}{% else %}"
    "{% for content in messages[0]['content'] %}{% if 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}"
    "{% endif %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}{% if message['role'] in ('user', 'assistant') %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for content in message['content'] %}"
    "{% if message['role'] == 'user' and (content['type'] == 'image' or 'image' in content or 'image_url' in content) %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}{{ '<|im_end|>\n' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Gemma 3's: no system role (its text goes before the first user turn), assistant -> model, parts trimmed
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{% if messages[0]['content'] is string %}{% set first_user_prefix = messages[0]['content'] + '\n\n' %}"
    "{% else %}{% set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' %}{% endif %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<start_of_image>' }}{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def _idefics_template(bos: str) -> str:
    """Idefics3's and SmolVLM's: ``User:<image>text<end_of_utterance>\n``, ': ' when the turn opens with text; the
    released ones index ``content[0]['type']`` and so only take lists: a string renders here as one text part."""
    return (
        bos + "{% for message in messages %}"
        "{% set parts = [{'type': 'text', 'text': message['content']}] if message['content'] is string else message['content'] %}"
        "{{ message['role'] | capitalize }}{% if parts[0]['type'] == 'image' %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
        "{% for line in parts %}{% if line['type'] == 'text' %}{{ line['text'] }}"
        "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}{{ '<end_of_utterance>\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
    )


# LLaVA-1.5's (llava-hf): "USER: <image>\ntext ASSISTANT: reply " -- a turn's images first, then its texts each followed
# by a space, no end-of-turn token (the reply does not end in </s>) and no BOS (the tokenizer adds it)
LLAVA_TEMPLATE = (
    "{% for message in messages %}"
    "{% set parts = [{'type': 'text', 'text': message['content']}] if message['content'] is string else message['content'] %}"
    "{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}{% endif %}"
    "{% for content in parts | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{% for content in parts | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' ' }}{% endfor %}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


@dataclass(frozen=True)
class VlmTokens:
    """A family's special tokens, its chat template and the named tokens its processor looks up on the tokenizer."""

    special: list[str]
    bos: str | None
    eos: str
    pad: str
    template: str
    named: dict = field(default_factory=dict)  # e.g. {"image_token": "<|image_pad|>"}: tokenizer.image_token(_id)
    add_bos: bool = False  # the tokenizer puts BOS before every text it encodes (Llama 2's SentencePiece did)


QWEN_TOKENS = VlmTokens(
    ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"],
    None, "<|im_end|>", "<|endoftext|>", QWEN2_5_VL_TEMPLATE,
    {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>", "vision_start_token": "<|vision_start|>",
     "vision_end_token": "<|vision_end|>"},
)  # fmt: skip
QWEN3_TOKENS = VlmTokens(QWEN_TOKENS.special, None, "<|im_end|>", "<|endoftext|>", QWEN3_VL_TEMPLATE, QWEN_TOKENS.named)
GEMMA3_TOKENS = VlmTokens(
    ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>",
     "<image_soft_token>"],
    "<bos>", "<end_of_turn>", "<pad>", GEMMA3_TEMPLATE,
    {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"},
)  # fmt: skip
IDEFICS_IMAGE = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"] + [
    f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)
]
IDEFICS3_TOKENS = VlmTokens(
    ["<|begin_of_text|>", "<|end_of_text|>"] + IDEFICS_IMAGE, "<|begin_of_text|>", "<end_of_utterance>",
    "<|end_of_text|>", _idefics_template("<|begin_of_text|>"), {"image_token": "<image>"},
)  # fmt: skip
SMOLVLM_TOKENS = VlmTokens(
    ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + IDEFICS_IMAGE, "<|im_start|>", "<end_of_utterance>",
    "<|im_end|>", _idefics_template("<|im_start|>"), {"image_token": "<image>"},
)  # fmt: skip
LLAVA_TOKENS = VlmTokens(
    ["<unk>", "<s>", "</s>", "<image>", "<pad>"], "<s>", "</s>", "<pad>", LLAVA_TEMPLATE, {"image_token": "<image>"},
    add_bos=True,
)  # fmt: skip


def _ids(tokenizer, **names: str) -> dict:
    return {key: tokenizer.convert_tokens_to_ids(token) for key, token in names.items()}


def _text_shape(tokenizer, init_std: float) -> dict:
    return dict(
        TEXT, vocab_size=-(-len(tokenizer) // 64) * 64, initializer_range=init_std,
        bos_token_id=tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip


def _qwen2_5_vl_config(tokenizer, init_std: float):
    from transformers import Qwen2_5_VLConfig

    text = _text_shape(tokenizer, init_std)
    text.pop("head_dim")  # Qwen2.5's head dim is hidden / heads
    text["rms_norm_eps"] = 1e-6
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [4, 6, 6]}
    vision = dict(
        VISION, depth=4, num_heads=2, hidden_act="silu", patch_size=14, temporal_patch_size=2, spatial_merge_size=2,
        window_size=112, fullatt_block_indexes=[1, 3], tokens_per_second=2, out_hidden_size=HIDDEN,
    )  # fmt: skip
    return Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, tie_word_embeddings=True,
        **_ids(tokenizer, image_token_id="<|image_pad|>", video_token_id="<|video_pad|>",
               vision_start_token_id="<|vision_start|>", vision_end_token_id="<|vision_end|>"),
    )  # fmt: skip


def _qwen3_vl_config(tokenizer, init_std: float):
    from transformers import Qwen3VLConfig

    text = dict(_text_shape(tokenizer, init_std), rms_norm_eps=1e-6)
    text["rope_parameters"] = {
        "rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [6, 5, 5], "mrope_interleaved": True,
    }  # fmt: skip
    vision = dict(
        VISION, depth=2, num_heads=2, hidden_act="gelu_pytorch_tanh", patch_size=16, temporal_patch_size=2,
        spatial_merge_size=2, num_position_embeddings=2304, deepstack_visual_indexes=[0], out_hidden_size=HIDDEN,
    )  # fmt: skip
    return Qwen3VLConfig(
        text_config=text, vision_config=vision, tie_word_embeddings=True,
        **_ids(tokenizer, image_token_id="<|image_pad|>", video_token_id="<|video_pad|>",
               vision_start_token_id="<|vision_start|>", vision_end_token_id="<|vision_end|>"),
    )  # fmt: skip


def _gemma3_config(tokenizer, init_std: float):
    from transformers import Gemma3Config

    text = dict(
        _text_shape(tokenizer, init_std), model_type="gemma3_text", query_pre_attn_scalar=32, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
    )  # fmt: skip
    vision = dict(
        VISION, model_type="siglip_vision_model", num_hidden_layers=2, num_attention_heads=2, patch_size=14,
        image_size=224, vision_use_head=False, layer_norm_eps=1e-6,
    )  # fmt: skip
    return Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=16, initializer_range=0.02,
        **_ids(tokenizer, boi_token_index="<start_of_image>", eoi_token_index="<end_of_image>",
               image_token_index="<image_soft_token>"),
    )  # fmt: skip


def _idefics_config(config_class: str, patch_size: int, image_size: int, scale_factor: int, text_class: str):
    def config(tokenizer, init_std: float):
        import transformers

        text = dict(
            _text_shape(tokenizer, init_std), model_type="llama", rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, architectures=[text_class],
        )  # fmt: skip
        vision = dict(VISION, num_hidden_layers=2, num_attention_heads=2, patch_size=patch_size, image_size=image_size)
        return getattr(transformers, config_class)(
            text_config=text, vision_config=vision, scale_factor=scale_factor, tie_word_embeddings=False,
            image_token_id=tokenizer.convert_tokens_to_ids("<image>"), pad_token_id=tokenizer.pad_token_id,
        )  # fmt: skip

    return config


def _llava_config(tokenizer, init_std: float):
    from transformers import LlavaConfig

    text = dict(_text_shape(tokenizer, init_std), model_type="llama", rms_norm_eps=1e-5, tie_word_embeddings=False)
    vision = dict(
        VISION, model_type="clip_vision_model", num_hidden_layers=2, num_attention_heads=2, patch_size=14,
        image_size=56, projection_dim=HIDDEN, hidden_act="quick_gelu", layer_norm_eps=1e-5,
    )  # fmt: skip
    return LlavaConfig(
        text_config=text, vision_config=vision, image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        image_seq_length=16, vision_feature_layer=-2, vision_feature_select_strategy="default",
        projector_hidden_act="gelu", multimodal_projector_bias=True, tie_word_embeddings=False,
    )  # fmt: skip


@dataclass(frozen=True)
class VlmFamily:
    name: str  # how the matrix names it
    model_type: str  # config.json's model_type
    tokens: VlmTokens
    config: Callable  # (tokenizer, init_std) -> the transformers config
    image_processor: str  # the PIL image processor class
    image_processor_kwargs: dict
    processor: str  # the processor class
    processor_kwargs: dict = field(default_factory=dict)
    features: str = ""  # what the tiny model exercises
    vision_prefix: str = ""  # the released checkpoints nest the CLIP/SigLIP tower one level deeper, under this name


def _nest_vision_tower(weights: Path, prefix: str) -> None:
    """Put ``vision_tower.*`` back under ``vision_tower.<prefix>.*`` as the released checkpoints (and llama.cpp's tensor
    map) have it: transformers 5 flattens ``CLIPVisionModel``/``SiglipVisionModel`` and saves ``vision_tower.encoder...``,
    and renames the released names to its own when it loads them."""
    from safetensors.torch import load_file, save_file

    state = load_file(weights)
    nested = {
        (f"vision_tower.{prefix}." + k[len("vision_tower.") :] if k.startswith("vision_tower.") else k): v
        for k, v in state.items()
    }
    save_file(nested, weights, metadata={"format": "pt"})


VLM_FAMILY_LIST = [
    VlmFamily(
        "qwen2_5_vl", "qwen2_5_vl", QWEN_TOKENS, _qwen2_5_vl_config, "Qwen2VLImageProcessorPil",
        {"patch_size": 14, "temporal_patch_size": 2, "merge_size": 2, "min_pixels": 56 * 56, "max_pixels": 112 * 112},
        "Qwen2_5_VLProcessor", {}, "window attention + fullatt_block_indexes, M-RoPE, dynamic resolution 4-16 tokens",
    ),
    VlmFamily(
        "qwen3_vl", "qwen3_vl", QWEN3_TOKENS, _qwen3_vl_config, "Qwen2VLImageProcessorPil",
        {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "min_pixels": 64 * 64, "max_pixels": 128 * 128,
         "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]},
        "Qwen3VLProcessor", {}, "DeepStack, learned interpolated position grid, interleaved M-RoPE, q/k norms",
    ),
    VlmFamily(
        "gemma3", "gemma3", GEMMA3_TOKENS, _gemma3_config, "Gemma3ImageProcessorPil",
        {"size": {"height": 224, "width": 224}, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
         "resample": 2, "do_pan_and_scan": False},
        "Gemma3Processor", {"image_seq_length": 16}, "SigLIP + 4x4 average pool to 16 tokens, bidirectional image attention",
        "vision_model",
    ),
    VlmFamily(
        "idefics3", "idefics3", IDEFICS3_TOKENS, _idefics_config("Idefics3Config", 14, 56, 2, "LlamaForCausalLM"), "Idefics3ImageProcessorPil",
        {"size": {"longest_edge": 2 * 56}, "max_image_size": {"longest_edge": 56}, "do_image_splitting": True,
         "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": 1},
        "Idefics3Processor", {"image_seq_len": 4}, "pixel shuffle x2, image splitting with row/col tags, Llama 3 text",
    ),
    VlmFamily(
        "smolvlm", "smolvlm", SMOLVLM_TOKENS, _idefics_config("SmolVLMConfig", 16, 128, 4, "VLlama3ForCausalLM"), "SmolVLMImageProcessorPil",
        {"size": {"longest_edge": 2 * 128}, "max_image_size": {"longest_edge": 128}, "do_image_splitting": True,
         "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": 1},
        "SmolVLMProcessor", {"image_seq_len": 4}, "pixel shuffle x4, image splitting with row/col tags, ChatML specials",
    ),
    VlmFamily(
        "llava", "llava", LLAVA_TOKENS, _llava_config, "CLIPImageProcessorPil",
        {"size": {"shortest_edge": 56}, "crop_size": {"height": 56, "width": 56}},
        "LlavaProcessor", {"patch_size": 14, "vision_feature_select_strategy": "default", "num_additional_image_tokens": 1},
        "LLaVA-1.5: CLIP (CLS dropped, 2nd-to-last layer) + 2-layer GELU projector, 16 tokens, BOS from the tokenizer",
        "vision_model",
    ),
]  # fmt: skip
VLM_FAMILIES = {family.name: family for family in VLM_FAMILY_LIST}
VLMS = list(VLM_FAMILIES)


def build_vlm_tokenizer(tokens: VlmTokens, vocab_size: int = VOCAB):
    """A byte-level BPE trained on the test corpus, with the family's special tokens, named tokens and chat template."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=train_bpe(tokens.special, vocab_size, VLM_CORPUS), bos_token=tokens.bos, eos_token=tokens.eos,
        pad_token=tokens.pad, unk_token=tokens.pad, extra_special_tokens=dict(tokens.named),
    )  # fmt: skip
    if tokens.add_bos:
        from tokenizers import processors

        bos = (tokens.bos, fast.convert_tokens_to_ids(tokens.bos))
        fast.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{tokens.bos} $A", pair=f"{tokens.bos} $A {tokens.bos} $B", special_tokens=[bos]
        )
    fast.chat_template = tokens.template
    return fast


def build_vlm(name: str, out_dir: str | Path, seed: int = 0, init_std: float = 0.2) -> Path:
    """Write a random-init tiny VLM of family ``name`` + its processor, tokenizer and chat template as a HF directory."""
    import torch
    import transformers
    from transformers import AutoModelForImageTextToText

    family = VLM_FAMILIES[name]
    out_dir = Path(out_dir)
    tokenizer = build_vlm_tokenizer(family.tokens)
    config = family.config(tokenizer, init_std)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config)
    if name == "gemma3":  # transformers starts the projector at zeros: the images would not reach the text model
        torch.nn.init.normal_(model.model.multi_modal_projector.mm_input_projection_weight, std=0.02)
    model.save_pretrained(out_dir)
    if family.vision_prefix:
        _nest_vision_tower(out_dir / "model.safetensors", family.vision_prefix)
    image_processor = getattr(transformers, family.image_processor)(**family.image_processor_kwargs)
    no_video = {"video_processor": None} if takes_video(family.processor) else {}
    with without_video():
        processor = getattr(transformers, family.processor)(
            image_processor=image_processor, tokenizer=tokenizer, chat_template=family.tokens.template,
            **no_video, **family.processor_kwargs,
        )  # fmt: skip
        processor.save_pretrained(out_dir)
    return out_dir


def load_vlm_processor(path: str | Path):
    """The processor of a built model, as the product loads it (``ft_assets.vision.load_processor``)."""
    from ft_assets.vision import load_processor

    return load_processor(path)


# --- image rows and their shards, as the data plane makes them --------------------------------------

COLORS = ("red", "green", "blue", "yellow")


def picture(color: str, size: tuple[int, int] = (56, 56), seed: int | None = None) -> bytes:
    """A PNG of one color (or, with ``seed``, of random pixels) of ``size``."""
    import io

    import numpy as np
    from PIL import Image

    if seed is None:
        image = Image.new("RGB", size, color)
    else:
        image = Image.fromarray(np.random.RandomState(seed).randint(0, 255, (size[1], size[0], 3), dtype=np.uint8))
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def store_image(store, pool: str, data: bytes) -> str:
    """``data`` kept in ``pool`` of ``store`` as raw_dataset keeps an image; its reference."""
    from ft_assets.data.images import image_ref

    ref = image_ref(data, "png")
    store.put_bytes(f"{pool}/{ref}", data)
    return ref


def color_rows(store, pool: str, count: int, start: int = 0) -> list[tuple[str, list[dict]]]:
    """``count`` (row id, turns) rows asking the color of a one-color picture, as the data plane reads them."""
    rows = []
    for i in range(start, start + count):
        color = COLORS[i % len(COLORS)]
        ref = store_image(store, pool, picture(color, (56 + 8 * (i % 3), 56)))
        turns = [{"role": "user", "content": "<image>What color?", "images": [ref]},
                 {"role": "assistant", "content": color}]  # fmt: skip
        rows.append((f"color-{i}", turns))
    return rows


def image_shards(model_dir: Path, store, pool: str, out_dir: Path, splits: dict, seq_len: int = 256) -> Path:
    """Packed shards of ``splits`` ({split: rows}) made by the data plane's encoder and packer, with their images
    fetched beside them as the trainer fetches them."""
    from ft_assets.data.chat_encoding import TokenizerFiles
    from ft_assets.data.images import ImagePool
    from ft_assets.data.packing import IMAGE_EXAMPLES
    from ft_assets.data.tokenizing import tokenize_and_pack
    from ft_assets.shards import fetch_images

    encoder = TokenizerFiles.from_dir(model_dir).encoder(ImagePool(store.url, pool))
    for split, rows in splits.items():
        stats = tokenize_and_pack(iter(rows), encoder, seq_len, out_dir, split, kind=IMAGE_EXAMPLES)
        assert not stats.rejected, stats.rejected
    fetch_images(store, pool, out_dir)
    return out_dir
