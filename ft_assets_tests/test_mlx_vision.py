"""The MLX export of a vision-language model, through mlx-vlm (``ft_assets.delivery.exports.mlx_vision``).

Tiny random VLMs of ``vlm_families.py``: Qwen2.5-VL and SmolVLM exported by ``mlx.make`` (one mlx-vlm child process
each), every folder held to transformers on picture prompts (the processor's token ids, logits within
``mlx_vision.TOLERANCES``) and text prompts; the runtime answers picture questions as the merged model does; Gemma 3,
whose image attention mlx-vlm runs causally, refused in one line before any work; a picture the runtime cannot read
refused in one line; and the gate refuses a folder that sees the pictures otherwise (mlx-vlm's answers made up).
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from ft_assets.delivery import llamacpp, mtmd
from ft_assets.delivery.exports import EXPORTS, mlx, mlx_vision
from ft_assets.delivery.exports.protocol import ExportRefused, refuse_model
from ft_assets_tests.vlm_families import build_vlm, picture

pytest.importorskip("mlx_vlm")

VARIANTS = {"qwen2_5_vl": ["fp16", "4bit"], "smolvlm": ["bf16"]}  # what each family is exported as here


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """family -> its merged model, its out folder and ``mlx.make``'s result; made on first use, so that a test process
    exports only the families it tests."""
    root, made = tmp_path_factory.mktemp("mlx-vision"), {}

    def get(family: str) -> dict:
        if family not in made:
            merged, out = build_vlm(family, root / family), root / f"{family}-out"
            out.mkdir()
            settings = mlx.MlxSettings(variants=VARIANTS[family])
            made[family] = {"merged": merged, "out": out,
                            "made": mlx.make(merged, out, root / f"{family}-work", "shapes-v1", settings, logging.getLogger())}  # fmt: skip
        return made[family]

    return get


def test_the_mlx_export_is_one_export_that_takes_a_vlm(with_mlx, tiny_model_dir, tmp_path):
    assert [export.name for export in EXPORTS].count("mlx") == 1
    assert mlx.MLX.takes_vision and mlx.MLX.off(mlx.MlxSettings()) is None
    refuse_model(mlx.MLX, build_vlm("qwen3_vl", tmp_path / "qwen3_vl"))  # taken: the family is checked in make
    refuse_model(mlx.MLX, tiny_model_dir)  # a text model goes on to mlx-lm's path


@pytest.mark.parametrize("family", list(VARIANTS))
def test_each_mlx_vlm_folder_sees_the_pictures_as_transformers_does(exported, family):
    model = exported(family)
    made = model["made"]
    assert sorted(made.files) == sorted(f"shapes-v1-mlx-{variant}" for variant in VARIANTS[family])
    for name, entry in made.files.items():
        seen = entry["mlx_vlm"]
        assert seen["tokens_match"] and seen["prompts"] == len(mtmd.VISION_PROMPTS)
        assert all(got == expected > 0 for got, expected in seen["image_tokens"]), seen["image_tokens"]
        if entry["variant"] in mlx_vision.TOLERANCES:
            assert seen["rel_error"] <= mlx_vision.TOLERANCES[entry["variant"]], (name, seen)
            assert entry["mlx"]["greedy_match"] >= 1, (name, entry["mlx"])
        folder = model["out"] / name
        config = json.loads((folder / "config.json").read_text())
        assert config["text_config"]["rope_theta"] and (folder / "chat_template.jinja").is_file()  # what mlx-vlm reads
    assert made.shipped == min(made.files, key=lambda n: made.files[n]["mlx"]["rel_error"])  # 4bit is past 0.08 here
    assert all("picture_logit_error" in row for row in made.rows) and not made.companions


def test_the_runtime_answers_picture_questions_as_the_merged_model(exported, tmp_path):
    """``MLX.runtime`` of a VLM's folder: mlx-vlm's greedy answers, through the folder's template and processor, equal to
    transformers' (``evaluate.generate_with_images``) on pictures of the sample's sizes, and other pictures give other
    answers; a picture it cannot read is refused in one line naming it."""
    from transformers import AutoModelForImageTextToText

    from ft_assets.delivery import evaluate
    from ft_assets.vision import load_processor

    model = exported("qwen2_5_vl")
    conversations = []
    for number, (color, size) in enumerate([("red", 64), ("blue", 48), ("", 96), ("", 80)]):
        (tmp_path / f"{number}.png").write_bytes(picture(color, (size, size), seed=number if not color else None))
        conversations.append([{"role": "user", "content": [{"type": "image", "image": str(tmp_path / f"{number}.png")},
                                                           {"type": "text", "text": "What color is it?"}]}])  # fmt: skip
    runtime = mlx.MLX.runtime(model["out"] / model["made"].shipped)
    assert isinstance(runtime.vision, mlx_vision.MlxVlm)
    answers = runtime.chat_answers(conversations, 6, log=lambda line: None)
    merged = AutoModelForImageTextToText.from_pretrained(model["merged"]).eval()
    expected = evaluate.generate_with_images(
        merged, load_processor(model["merged"]), conversations, 6, log=lambda _: None
    )
    assert sum(a == e for a, e in zip(answers, expected)) >= 3, (answers, expected)
    assert len(set(answers)) > 1  # the pictures are read

    (tmp_path / "broken.png").write_bytes(b"not a picture")  # a hostile eval row: the runtime refuses it in one line
    conversations[1][0]["content"][0]["image"] = str(tmp_path / "broken.png")
    with pytest.raises(ExportRefused) as refused:
        runtime.chat_answers(conversations, 6, log=lambda line: None)
    assert "broken.png" in str(refused.value) and "\n" not in str(refused.value)


def test_gemma3_is_refused_in_one_line_before_any_work(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ExportRefused) as refused:
        mlx.make(
            build_vlm("gemma3", tmp_path / "gemma3"), out, tmp_path, "shapes-v1", mlx.MlxSettings(), logging.getLogger()
        )
    assert str(refused.value) == (
        "MLX export of a gemma3 vision-language model is not supported: mlx-vlm 0.7.10's gemma3 attends causally over "
        "an image's tokens, where Gemma 3 attends bidirectionally within each image, so its logits after a picture part "
        "from the merged model's by 8e-2 (relative) even in float32"
    )
    assert not list(out.iterdir())


def test_the_gate_refuses_a_folder_that_sees_the_pictures_otherwise(tmp_path):
    """``mlx_vision.checked`` on mlx-vlm's answers made equal to transformers', then with an image token lost, then with
    the logits after a picture moved past the bound: the first passes at zero error, the others are refused in one line."""
    merged = build_vlm("smolvlm", tmp_path / "smolvlm")
    reference, pictures = llamacpp.reference(merged), mtmd.vision_reference(merged)
    exact = {"string_ids": reference.token_ids, "greedy": reference.continuations, "picture_ids": pictures.token_ids,
             "text_logits": reference.logits, "picture_logits": pictures.logits, "sha256": ""}  # fmt: skip
    folder = tmp_path / "shapes-v1-mlx-bf16"  # mlx-vlm's folder: only its name and size are read here
    entry = mlx_vision.checked(folder, "bf16", exact, reference, pictures, logging.getLogger())
    assert entry["mlx_vlm"]["rel_error"] == 0 and entry["mlx"]["greedy_match"] == entry["mlx"]["greedy_prompts"]

    lost = [ids[:] for ids in pictures.token_ids]
    lost[0].remove(pictures.image_token_id)
    moved = [
        logits + np.random.RandomState(0).normal(0, 0.2 * np.abs(logits).mean(), logits.shape)
        for logits in pictures.logits
    ]
    for changed, line in [({"picture_ids": lost}, "other token ids than the merged model's on picture prompts"),
                          ({"picture_logits": moved}, "at most 0.1 for bf16")]:  # fmt: skip
        with pytest.raises(ExportRefused, match=line) as refused:
            mlx_vision.checked(folder, "bf16", exact | changed, reference, pictures, logging.getLogger())
        assert "\n" not in str(refused.value)


def test_vlm_config_gives_mlx_vlm_the_keys_it_reads():
    """transformers 5's configs -> what mlx-vlm 0.7.10 reads (without them: Qwen3-VL's default M-RoPE sections 24/20/20,
    rope_theta missing, Qwen2.5-VL's text model from empty top-level keys)."""
    qwen = {"model_type": "qwen2_5_vl", "tie_word_embeddings": True, "vision_config": {"model_type": "qwen2_5_vl_vision"},
            "text_config": {"hidden_size": 128, "model_type": "qwen2_5_vl_text",
                            "rope_parameters": {"mrope_section": [4, 6, 6], "rope_theta": 1e6, "rope_type": "default"}}}  # fmt: skip
    read = mlx_vision.vlm_config(qwen)
    assert read["hidden_size"] == 128 and read["rope_theta"] == 1e6 and read["model_type"] == "qwen2_5_vl"
    assert read["rope_scaling"] == {"type": "mrope", "mrope_section": [4, 6, 6]} and read["tie_word_embeddings"]
    assert read["vision_config"]["model_type"] == "qwen2_5_vl" and read["text_config"]["tie_word_embeddings"]
    smol = {"model_type": "smolvlm", "text_config": {"rope_parameters": {"rope_theta": 1e5, "rope_type": "default"}}}
    assert mlx_vision.vlm_config(smol)["text_config"]["rope_theta"] == 1e5


def test_a_vlm_is_refused_in_one_line_where_mlx_vlm_is_not_installed(tmp_path, monkeypatch):
    merged, out = build_vlm("smolvlm", tmp_path / "smolvlm"), tmp_path / "out"
    out.mkdir()
    installed = mlx_vision.importlib.util.find_spec
    monkeypatch.setattr(
        mlx_vision.importlib.util, "find_spec", lambda name: None if name == "mlx_vlm" else installed(name)
    )
    with pytest.raises(ExportRefused, match=r"^mlx-vlm is not installed here.*pip install 'ft-assets\[mlx\]'$"):
        mlx.make(merged, out, tmp_path, "shapes-v1", mlx.MlxSettings(), logging.getLogger())
    with pytest.raises(ExportRefused, match="^mlx-vlm is not installed here"):
        mlx_vision.MlxVlm(out).chat_answers([[{"role": "user", "content": "hi"}]], 4, log=lambda line: None)
    assert not list(out.iterdir())
