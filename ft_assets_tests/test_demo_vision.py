"""``make demo-vision``'s pieces, cheaply: the model builder (``scripts/make_demo_vlm.py``) on tests.py's tiny Llama in
place of SmolLM2-135M makes a SmolVLM that keeps the text model's weights, whose processor expands a picture into the
builder's image tokens and that the recipe trains as the demo's config says; and that config is one ``ft-assets run``
accepts, naming the folder the Makefile builds. The demo itself (minutes) runs with ``make demo-vision``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from ft_assets.cli.run_config import config_mistakes, load_run_config
from scripts.make_demo_vlm import IMAGE_TOKENS, build_demo_vlm

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "samples" / "demo_vision_run_config.yaml"


@pytest.fixture(scope="module")
def demo_vlm(tiny_model_dir, tmp_path_factory):
    return build_demo_vlm(tmp_path_factory.mktemp("demo-vlm") / "model", tiny_model_dir)


def test_the_demo_vlm_keeps_the_text_model_and_sees_a_picture_as_its_image_tokens(demo_vlm, tiny_model_dir):
    from PIL import Image
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from ft_assets.vision import image_token_id, load_processor, model_has_vision, read_config

    assert model_has_vision(demo_vlm) and read_config(demo_vlm)["model_type"] == "smolvlm"
    vlm = AutoModelForImageTextToText.from_pretrained(demo_vlm).eval()
    text = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    ids = torch.tensor([[5, 17, 42, 9, 3]])
    with torch.no_grad():  # the text side is the text model: the same logits over its vocabulary
        vocab = text.config.vocab_size
        assert torch.allclose(vlm(input_ids=ids).logits[0, :, :vocab], text(input_ids=ids).logits[0], atol=1e-5)
    processor = load_processor(demo_vlm)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What color?"}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\n<image>What color?<|im_end|>\n<|im_start|>assistant\n"
    inputs = processor(text=[prompt], images=[[Image.new("RGB", (80, 56), "red")]], return_tensors="pt")
    assert int((inputs["input_ids"] == image_token_id(read_config(demo_vlm))).sum()) == IMAGE_TOKENS
    with torch.no_grad():
        assert vlm.generate(**inputs, max_new_tokens=2, do_sample=False).shape[1] > inputs["input_ids"].shape[1]


def test_the_recipe_trains_the_demo_vlm_and_its_connector_as_the_demo_config_says(demo_vlm, tmp_path):
    from ft_assets.shards import load_packed_rows
    from ft_assets.storage import LocalStore
    from ft_assets.training.config import TrainingConfig
    from ft_assets.training.loss import learned_tokens, token_loss_sum
    from ft_assets.training.model import load_model, trainable_parameters
    from ft_assets.training.steps import TokenLossStep
    from ft_assets_tests.vlm_families import color_rows, image_shards

    training = load_run_config(str(CONFIG))["ops"]["lora_adapter"]["config"]
    assert training["train_vision"] == "projector"
    store = LocalStore(tmp_path / "store")
    shards = image_shards(
        demo_vlm, store, "images/demo", tmp_path / "shards", {"train": color_rows(store, "images/demo", 8)}
    )
    config = TrainingConfig(method="lora", train_vision=training["train_vision"], max_seq_len=256)
    model = load_model(config, "lora", demo_vlm, torch.device("cpu"))
    trained = trainable_parameters(model)
    assert any(".connector." in name for name in trained) and not any(".vision_model." in name for name in trained)
    step = TokenLossStep().for_run(config, demo_vlm, model)
    rows = load_packed_rows(shards, "train", 256)
    optimizer = torch.optim.AdamW(trained.values(), lr=1e-2)
    losses = []
    for _ in range(4):
        batch = step.rollout(None, rows.batch([0], torch.device("cpu")), 0, 0, 0)
        assert batch["pixel_values"].shape[-2:] == (64, 64)  # one tile of the builder's size a picture
        loss = token_loss_sum(model, batch) / learned_tokens(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0], losses


def test_the_demo_config_is_a_run_config_ft_assets_run_accepts_naming_the_model_the_makefile_builds():
    from ft_assets.cli.run import JOBS
    from ft_assets.definitions import defs

    run_config = load_run_config(str(CONFIG))
    assert config_mistakes([defs.resolve_job_def(name) for name in JOBS.values()], run_config) == []
    recipe = re.search(r"^demo-vision:.*?(?=^\S)", (ROOT / "Makefile").read_text(), re.S | re.M)[0]
    source = run_config["ops"]["base_model"]["config"]["source"]
    assert f"-m scripts.make_demo_vlm {source}" in recipe and f"--config {CONFIG.relative_to(ROOT)}" in recipe
