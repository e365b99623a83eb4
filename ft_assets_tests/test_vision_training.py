"""Vision-language models in the data and training planes, one tiny random model per family (``vlm_families.py``).

Each family's rows go the product's whole way: encoded with images by the data plane (``ChatEncoder`` with the
processor), packed, their images fetched beside the shards, turned into the family's forward inputs
(``ft_assets.training.vision``). What must hold, per family: the tokens are the processor's own for the same
conversation (what the model reads at inference), only the reply is learned, a packed row's loss is the sum of its
examples' separate losses, a separate loss is the model's own ``labels=`` loss on the processor's inputs, the
picture changes the loss, and the recipe trains, checkpoints and resumes after SIGKILL.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from ft_assets.data.chat_encoding import TokenizerFiles, for_template
from ft_assets.data.images import ImagePool
from ft_assets.delivery import vllm
from ft_assets.objectives import named
from ft_assets.refs import read_ref
from ft_assets.shards import load_packed_rows
from ft_assets.storage import LocalStore
from ft_assets.training.loss import learned_tokens, token_loss_sum
from ft_assets.training.model import load_model
from ft_assets.training.recipe import train
from ft_assets.training.vision import pixel_inputs
from ft_assets.vision import FAMILIES, is_vision_module, load_processor
from ft_assets_tests.support import (
    assert_same_weights,
    final_weights,
    sigkill_training_after_checkpoint,
    training_config,
)
from ft_assets_tests.vlm_families import build_vlm, color_rows, image_shards, picture, store_image

SHAPES = Path(__file__).resolve().parents[1] / "samples" / "shapes"
POOL = "images/colors"
RUN = "runs/colors/v1/train/run"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return LocalStore(tmp_path_factory.mktemp("store"))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlms")
    return {name: build_vlm(name, root / name) for name in FAMILIES}


def two_examples(store) -> list[tuple[str, list[dict]]]:
    """One picture at the start of a turn; two pictures of other sizes inside another's text."""
    a, b, c = (
        store_image(store, POOL, picture("", size, seed)) for seed, size in enumerate([(64, 64), (112, 84), (64, 32)])
    )
    return [
        ("a", [{"role": "user", "content": "<image>What is in it?", "images": [a]},
               {"role": "assistant", "content": "a dog and a cat"}]),
        ("b", [{"role": "user", "content": "Look <image> and <image> now", "images": [b, c]},
               {"role": "assistant", "content": "two things here"}]),
    ]  # fmt: skip


def loss_of(model, model_dir, shards) -> tuple[float, int]:
    rows = load_packed_rows(shards, "train", 512)
    batch = pixel_inputs(model_dir, model.config)(model, rows.batch(np.arange(len(rows)), torch.device("cpu")))
    with torch.no_grad():
        return token_loss_sum(model, batch).item(), learned_tokens(batch)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_packed_row_of_images_trains_as_its_examples_apart(family, models, store, tmp_path):
    from transformers import AutoModelForImageTextToText

    torch.set_num_threads(1)
    model_dir = models[family]
    model = AutoModelForImageTextToText.from_pretrained(model_dir, attn_implementation="sdpa").eval()
    examples = two_examples(store)
    encoder = TokenizerFiles.from_dir(model_dir).encoder(ImagePool(store.url, POOL))
    processor = load_processor(model_dir)

    # the tokens are the processor's own for the conversation; only the reply (and its end of turn) is learned
    (_, turns) = examples[1]
    example = encoder.encode_batch([turns])[0]
    text = processor.tokenizer.apply_chat_template([for_template(m) for m in turns], tokenize=False)
    own = processor(text=[text], images=[[ImagePool(store.url, POOL).open(r) for r in turns[0]["images"]]],
                    add_special_tokens=False, return_tensors="pt")  # fmt: skip
    assert example.input_ids.tolist() == own["input_ids"][0].tolist()
    learned = processor.tokenizer.decode(example.input_ids[example.loss_mask.astype(bool)])
    assert learned.strip().startswith("two things here") and "Look" not in learned

    separate = [loss_of(model, model_dir, image_shards(model_dir, store, POOL, tmp_path / name, {"train": [row]}))
                for name, row in zip("ab", examples)]  # fmt: skip
    packed = loss_of(model, model_dir, image_shards(model_dir, store, POOL, tmp_path / "ab", {"train": examples}))
    assert packed[1] == separate[0][1] + separate[1][1]
    assert packed[0] == pytest.approx(separate[0][0] + separate[1][0], rel=1e-5)

    # a separate example's loss is the model's own on the processor's inputs
    labels = own["input_ids"].clone()
    labels[0, ~torch.from_numpy(example.loss_mask.astype(bool))] = -100
    with torch.no_grad():
        reference = model(**own, labels=labels).loss.item() * int((labels[:, 1:] != -100).sum())
    assert separate[1][0] == pytest.approx(reference, rel=1e-4)

    # and the picture is seen: another picture, another loss
    other = [(row_id, [{**turns[0], "images": [store_image(store, POOL, picture("red", (112, 84)))] + turns[0]["images"][1:]},
                       turns[1]]) for row_id, turns in examples[1:]]  # fmt: skip
    changed = loss_of(model, model_dir, image_shards(model_dir, store, POOL, tmp_path / "other", {"train": other}))
    assert abs(changed[0] - separate[1][0]) > 1e-3


TRAIN_VISION = [
    ("none", set()),
    ("projector", {"projector"}),
    ("all", {"projector", "tower"}),
]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "gemma3", "smolvlm"])
@pytest.mark.parametrize("setting,trained", TRAIN_VISION, ids=[c[0] for c in TRAIN_VISION])
def test_the_vision_side_trains_only_as_train_vision_says(family, setting, trained, models):
    model = load_model(training_config(train_vision=setting), "lora", models[family], torch.device("cpu"))
    names = [name for name, param in model.named_parameters() if param.requires_grad]
    towers, projectors = (
        ("visual.blocks", "vision_tower", "vision_model"),
        ("merger", "multi_modal_projector", "connector"),
    )
    assert any(".layers." in name and "lora_" in name for name in names)  # the language model's adapter, always
    assert any(any(p in name for p in projectors) for name in names) == ("projector" in trained)
    assert any(any(t in name for t in towers) for name in names) == ("tower" in trained)


@pytest.mark.integration
def test_a_vision_run_learns_checkpoints_and_resumes_after_sigkill(models, store, tmp_path):
    """Qwen2.5-VL with its projector trained: the loss falls, and a run killed after its checkpoint at step 4 ends
    with the same weights as one that was never interrupted."""
    model_dir = models["qwen2_5_vl"]
    splits = {"train": color_rows(store, POOL, 24), "eval": color_rows(store, POOL, 4, start=24)}
    shards = image_shards(model_dir, store, POOL, tmp_path / "shards", splits)
    config = training_config(max_seq_len=256, train_vision="projector", learning_rate=3e-3, max_steps=8)
    whole = train(config, model_dir, shards, store, RUN + "-whole", tmp_path / "whole", log=lambda line: None,
                  objective=named("sft"))  # fmt: skip
    first, last = whole.loss_history[0][1], whole.loss_history[-1][1]
    assert last < first * 0.7, whole.loss_history

    sigkill_training_after_checkpoint(config, model_dir, shards, store, RUN, 4, tmp_path / "killed")
    resumed = train(config, model_dir, shards, store, RUN, tmp_path / "resumed", log=lambda line: None,
                    objective=named("sft"))  # fmt: skip
    assert resumed.resumed_from_step == 4
    assert_same_weights(final_weights(resumed), final_weights(whole))


@pytest.mark.parametrize("family", ["qwen2_5_vl", "smolvlm"])
def test_qlora_quantizes_the_language_model_alone(family, models):
    import bitsandbytes as bnb

    model = load_model(training_config(method="qlora"), "qlora", models[family], torch.device("cpu"))
    quantized = [name for name, module in model.named_modules() if isinstance(module, bnb.nn.Linear4bit)]
    assert quantized and all(".layers." in name and "vision" not in name for name in quantized)
    assert not any(is_vision_module(name) for name in quantized)


@pytest.mark.integration
def test_the_shipped_vision_sample_trains_and_publishes_a_vlm_through_ft_assets_run(home, capsys, models, monkeypatch):
    """The whole command on the shipped sample's chat file and a tiny Qwen2.5-VL, through every plane: its broken images
    quarantined with their reasons, each picture stored once by content, the worker fetching the images its shards
    name; eval_report scoring base, fine-tuned and the shipped GGUF (with its projector, in libmtmd) on the held-back
    picture questions with their pictures (its eval loss the trainer's own on the same rows), general_eval's text tasks
    on the VLM and its GGUF, and a published merged VLM that PEFT's adapter reproduces on a picture, its GGUF and
    projector beside it. The gate's margin is off (``min_improvement: -1``): a tiny random model learns the
    answers' words in 24 steps (eval loss ~9 -> ~2), not yet which one a picture shows. vllm_smoke, with the serving
    venv on, says in one line why its vLLM cannot serve this family, and the run goes on."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from ft_assets_tests.support import run_cli

    data = SHAPES / "chat.jsonl"
    config = home / "run_config.yaml"
    training = {"max_steps": 24, "per_device_batch_size": 2, "save_steps": 24, "learning_rate": 5e-3, "warmup_steps": 0}
    config.write_text(
        json.dumps(
            {
                "ops": {
                    "base_model": {"config": {"source": str(models["qwen2_5_vl"])}},
                    "tokenized_shards": {"config": {"seq_len": 256}},
                    "lora_adapter": {"config": training},
                    "eval_report": {"config": {"max_examples": 20, "max_new_tokens": 8, "min_improvement": -1.0}},
                    "gguf_model": {"config": {"qtypes": ["f16"]}},
                }
            }
        )
    )
    argv = ["run", "--dataset", str(data), "--name", "shapes", "--version", "v1", "--config", str(config)]
    monkeypatch.setenv(vllm.PYTHON_ENV, str(vllm.DEFAULT_PYTHON))  # conftest turns it off elsewhere
    code, summary, err = run_cli(capsys, *argv, "--json")
    assert code == 0, err[-3000:]
    assert summary["quarantine_reasons"] == {"image_missing": 1, "image_unreadable": 1}, summary
    store = home / "home" / "store"
    stored = {p.name.split(".")[0]: p for p in (store / "images" / "shapes").iterdir()}
    assert all(hashlib.sha256(p.read_bytes()).hexdigest() == digest for digest, p in stored.items())  # named by content
    uris = re.findall(r'"(data:image/[a-z]+;base64,[^"]+)"', data.read_text())
    named = {hashlib.sha256(p.read_bytes()).hexdigest() for p in (SHAPES / "images").iterdir()}
    named |= {hashlib.sha256(base64.b64decode(uri.split(",", 1)[1])).hexdigest() for uri in uris}
    assert stored and set(stored) <= named  # the sample's pictures, nothing else
    fetched = re.search(r"lora_adapter: fetched the (\d+) images of the shards", err)
    assert fetched and 0 < int(fetched[1]) <= len(stored), err[-3000:]

    # eval_report: the eval rows' pictures fetched (and only theirs), answered with them, the loss the trainer's own
    evaluated = re.search(r"eval_report: fetched the (\d+) images of the shards", err)
    assert evaluated, err[-3000:]
    assert summary["finetuned_eval_loss"] == pytest.approx(summary["eval_loss"], rel=1e-4)
    assert summary["finetuned_eval_loss"] < 0.5 * summary["base_eval_loss"], summary
    answers = [json.loads(line) for line in next(store.glob("runs/shapes/v1/delivery/*/eval/answers.jsonl")).open()]
    assert len(answers) == 20 and all(a["prompt"].startswith("<image>") for a in answers)
    assert summary["general_items"] == 72 and summary["general_reason"] is None  # 24 items on each model, the GGUF too

    # eval_report's page draws a few of those pictures in place, each with the question and every model's answer
    import dagster as dg

    page = dg.DagsterInstance.get().get_latest_materialization_event(dg.AssetKey("eval_report"))
    drawn = [v.value for k, v in page.asset_materialization.metadata.items() if k.startswith("picture_")]
    assert 1 <= len(drawn) <= 4 and all(md.startswith("![picture](data:image/png;base64,") for md in drawn), drawn
    assert all(len(md) < 1000 and "expected *" in md and "GGUF f16 (llama.cpp):" in md for md in drawn), drawn

    # the GGUF and its projector: answering the picture questions through libmtmd as the fine-tuned model does, shipped
    assert summary["gguf_file"] == "shapes-v1-f16.gguf" and summary["gguf_reason"] is None, summary
    gguf_answers = [a["GGUF f16 (llama.cpp)"] for a in answers]
    assert sum(g == a["fine-tuned"] for g, a in zip(gguf_answers, answers)) >= 0.7 * len(answers), answers

    # lineage.json lists the pictures by content; `ft-assets lineage` re-hashes them and names one changed in the store
    from ft_assets.delivery.lineage import verify_lineage
    from ft_assets.storage import LocalStore

    registry = Path(summary["published_uri"])
    assert {"shapes-v1-f16.gguf", "shapes-v1-mmproj-f16.gguf", "Modelfile"} <= {
        p.name for p in (registry / "gguf").iterdir()
    }
    lineage = json.loads((registry / "lineage.json").read_text())
    assert lineage["exports"]["gguf"]["companions"] == ["shapes-v1-mmproj-f16.gguf"]  # the projector ships with it
    pictures = lineage["images"]
    assert pictures["prefix"] == "images/shapes" and len(pictures["eval"]) == int(evaluated[1])
    assert {*pictures["train"], *pictures["eval"]} == {p.name for p in stored.values()}  # the sample kept them all
    objects = LocalStore(store)
    key = str(registry.relative_to(store))
    assert verify_lineage(objects, key)["chain"][-1]["status"] == "ok"
    changed = stored[pictures["eval"][0].split(".")[0]]
    changed.write_bytes(changed.read_bytes() + b"\0")
    link = verify_lineage(objects, key)["chain"][-1]
    assert link["asset"] == "images" and link["status"] == f"CHANGED: 1 of {len(stored)} images, e.g. {changed.name}"
    served = read_ref(objects, "shapes@v1", "vllm_smoke")["stats"]
    assert not served["served"] and served["reason"].startswith(
        "vLLM cannot read Qwen2_5_VLForConditionalGeneration's processor in its serving venv"
    ), served

    merged = AutoModelForImageTextToText.from_pretrained(registry / "merged").eval()
    base = AutoModelForImageTextToText.from_pretrained(models["qwen2_5_vl"]).eval()
    tuned = PeftModel.from_pretrained(
        AutoModelForImageTextToText.from_pretrained(models["qwen2_5_vl"]), registry / "adapter"
    )
    processor = load_processor(registry / "merged")  # the processor travels with the merged model
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What color is the shape?"}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(
        text=[prompt], images=[Image.open(SHAPES / "images" / "0001.png").convert("RGB")], return_tensors="pt"
    )
    with torch.no_grad():
        assert torch.allclose(merged(**inputs).logits, tuned.eval()(**inputs).logits, atol=1e-4)
        assert not torch.allclose(base(**inputs).logits, merged(**inputs).logits, atol=1e-2)


def test_an_export_that_does_not_take_a_vlm_refuses_it_in_one_line_and_takes_a_text_model(models, tiny_model_dir):
    """An export of a VLM that would drop its image encoder is refused by the runner before any work, from what the
    export declares (``Export.takes_vision``); the model ships without it. GGUF (libmtmd) and MLX (mlx-vlm) take VLMs,
    and refuse the families their runtimes cannot take themselves."""
    from dataclasses import replace

    from ft_assets.delivery.exports import EXPORTS, named
    from ft_assets.delivery.exports.protocol import ExportRefused, refuse_model

    text_only = replace(named("mlx"), takes_vision=False)
    for name in ("qwen2_5_vl", "gemma3"):
        with pytest.raises(ExportRefused, match="^MLX of a vision-language model is not supported"):
            refuse_model(text_only, models[name])
    for export in EXPORTS:
        assert export.takes_vision
        refuse_model(export, models["qwen2_5_vl"])
        refuse_model(export, tiny_model_dir)  # a text model goes on


@pytest.mark.parametrize("family", ["qwen2_5_vl", "gemma3", "smolvlm"])
def test_eval_answers_a_picture_question_batched_as_alone_and_sees_the_picture(family, models, tmp_path):
    """eval_report's answers of a VLM (``evaluate.generate_with_images``): the stored turn as content parts naming its
    files, left-padded batches of pictures of other sizes answering as each prompt alone, and the picture read."""
    from ft_assets.delivery import evaluate as ev

    files = []
    for i, (size, seed) in enumerate([((64, 64), 1), ((96, 48), 2), ((64, 64), 3)]):
        (tmp_path / f"{i}.png").write_bytes(picture("", size, seed))
        files.append(f"{i}.png")
    rows = [
        {"source": f"r{i}", "messages": [{"role": "user", "content": text, "images": [f]},
                                         {"role": "assistant", "content": "red"}]}
        for i, (f, text) in enumerate(zip(files, ["<image>What color?", "Name <image> the shape, please", "<image>What color?"]))
    ]  # fmt: skip
    examples = ev.eval_examples(rows, 3, tmp_path)
    assert examples[1].prompt[0]["content"] == [
        {"type": "text", "text": "Name "}, {"type": "image", "image": str(tmp_path / "1.png")},
        {"type": "text", "text": " the shape, please"},
    ]  # fmt: skip
    assert ev.last_user_turn(examples[1].prompt) == "Name <image> the shape, please"
    model = vlm_from(models[family])
    processor = load_processor(models[family])
    prompts = [e.prompt for e in examples]
    batched = ev.generate_with_images(model, processor, prompts, 6, log=lambda _: None)
    alone = [ev.generate_with_images(model, processor, [p], 6, log=lambda _: None)[0] for p in prompts]
    assert batched == alone
    first, _, third = (_first_logits(model, processor, p) for p in prompts)  # same question, other picture
    assert not torch.allclose(first, third, atol=1e-4)


def vlm_from(model_dir):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(model_dir).eval()


def _first_logits(model, processor, prompt):
    from ft_assets.delivery.evaluate import _rendered, image_files

    text = processor.apply_chat_template(_rendered(prompt), add_generation_prompt=True, tokenize=False)
    images = [Image.open(f).convert("RGB") for f in image_files(prompt)]
    with torch.no_grad():
        return model(**processor(text=[text], images=[images], return_tensors="pt")).logits[0, -1]
