"""A vision-language model's GGUF and projector, in llama.cpp's multimodal path (libmtmd), per family of the VLM matrix.

Each tiny VLM of ``vlm_families.py`` (Qwen2.5-VL, Qwen3-VL, Gemma 3, Idefics3, SmolVLM) is written by llama.cpp's
converter as F16 and Q8_0 language models and an F16 projector (one child process), loaded in libmtmd
(``ft_assets.delivery.mtmd``) and held to transformers on picture prompts: token ids equal to the processor's (each
image as its number of image tokens), next-token logits within ``mtmd.TOLERANCES``. LLaVA-1.5, whose CLIP projector
llama.cpp's converter does not write, is refused in one line; the GGUF export ships the projector beside its files,
and its runtime answers picture questions through it.
"""

from __future__ import annotations

import logging

import pytest

from ft_assets.delivery import llamacpp, mtmd
from ft_assets.delivery.converter import MMPROJ_OUTTYPE, pixel_bounds
from ft_assets.delivery.gguf_export import export_ggufs
from ft_assets.vision import FAMILIES
from ft_assets_tests.vlm_families import build_vlm, picture

CONVERTED = ("f16", "q8_0")
# Qwen-VL's processor bounds of the tiny models, as libmtmd's token bounds (min_pixels / (patch * merge)^2 ...)
TOKEN_BOUNDS = {"qwen2_5_vl": (4, 16), "qwen3_vl": (4, 16)}

pytestmark = pytest.mark.integration  # llama.cpp's converter and libmtmd


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """family -> its model directory, its files (qtype -> path, and the projector) and its reference; made on first use
    (one converter process a family), so that a test process makes only the families it tests."""
    root, made = tmp_path_factory.mktemp("gguf-vision"), {}

    def get(family: str) -> dict:
        if family not in made:
            model_dir = build_vlm(family, root / family)
            outputs = {q: root / f"{family}-{q}.gguf" for q in CONVERTED}
            export_ggufs(model_dir, {**outputs, MMPROJ_OUTTYPE: root / mtmd.mmproj_file(family)})
            made[family] = {"dir": model_dir, "files": outputs, "ref": mtmd.vision_reference(model_dir)}
        return made[family]

    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_the_projector_loads_in_libmtmd_and_sees_the_pictures_as_transformers_does(built, family):
    model = built(family)
    projector = mtmd.mmproj_path(model["files"]["f16"])
    assert projector.is_file() and mtmd.projector_metadata(projector)["clip.projector_type"] in mtmd.MARKERS
    for qtype, path in model["files"].items():
        check = mtmd.check_vision_file(path, projector, model["ref"])
        assert check["tokens_match"], (qtype, check["token_mismatches"], check["image_tokens"])
        assert all(got == expected > 0 for got, expected in check["image_tokens"]), check["image_tokens"]
        assert check["rel_error"] <= mtmd.TOLERANCES[qtype], (qtype, check)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "gemma3"])
def test_the_projector_carries_qwen_vl_pixel_bounds_as_libmtmd_token_bounds(built, family):
    """Fix 5: libmtmd reads no pixel bounds of a Qwen-VL projector; the converter writes the processor's and
    ``VisionModel`` turns them into token bounds. Other projectors keep libmtmd's own (-1)."""
    metadata = mtmd.projector_metadata(mtmd.mmproj_path(built(family)["files"]["f16"]))
    assert mtmd.image_token_bounds(metadata) == TOKEN_BOUNDS.get(family, (-1, -1))


PIXEL_SETTINGS = [
    ("transformers 5", {"size": {"shortest_edge": 3136, "longest_edge": 12544}}, (3136, 12544)),
    ("transformers 4", {"min_pixels": 3136, "max_pixels": 12845056, "size": {"shortest_edge": 56}}, (3136, 12845056)),
    ("in size", {"size": {"min_pixels": 100, "max_pixels": 200}}, (100, 200)),
]


@pytest.mark.parametrize("saved,expected", [c[1:] for c in PIXEL_SETTINGS], ids=[c[0] for c in PIXEL_SETTINGS])
def test_pixel_bounds_read_every_way_a_qwen_vl_processor_is_saved(saved, expected, tmp_path):
    assert pixel_bounds(saved, tmp_path) == expected


def test_a_qwen_vl_processor_without_pixel_bounds_is_refused_in_one_line(tmp_path):
    with pytest.raises(Exception, match="names no pixel bounds") as raised:
        pixel_bounds({"size": {"height": 224, "width": 224}}, tmp_path)
    assert "\n" not in str(raised.value)


def test_llava_is_refused_in_one_line_and_the_gguf_export_ships_nothing(tmp_path):
    from ft_assets.delivery.exports import gguf
    from ft_assets.delivery.exports.protocol import ExportRefused

    (tmp_path / "out").mkdir()
    settings = gguf.GgufSettings(qtypes=["f16"])
    with pytest.raises(ExportRefused) as refused:
        gguf.make(
            build_vlm("llava", tmp_path / "llava"),
            tmp_path / "out",
            tmp_path,
            "llava-v1",
            settings,
            logging.getLogger(),
        )
    assert str(refused.value).startswith(
        "llama.cpp cannot take this model: llama.cpp 0.3.36's converter has no vision projector (mmproj) layout for "
        "LlavaForConditionalGeneration with a clip_vision_model vision tower"
    )
    assert "\n" not in str(refused.value) and not list((tmp_path / "out").glob("*.gguf"))


def test_mmproj_path_names_one_projector_for_every_type(tmp_path):
    assert mtmd.mmproj_file("shapes-v1") == "shapes-v1-mmproj-f16.gguf"
    for qtype in ("f16", "q8_0", "q4_k_m"):
        assert mtmd.mmproj_path(tmp_path / f"shapes-v1-{qtype}.gguf") == tmp_path / "shapes-v1-mmproj-f16.gguf"


def test_text_chat_answers_refuse_a_conversation_with_pictures(built, tmp_path):
    (tmp_path / "red.png").write_bytes(picture("red"))
    with_picture = [{"role": "user", "content": [{"type": "image", "image": str(tmp_path / "red.png")},
                                                 {"type": "text", "text": "What color?"}]}]  # fmt: skip
    with pytest.raises(llamacpp.LlamaCppError, match="answers text only, and 1 of 2 conversations hold pictures"):
        llamacpp.chat_answers(built("smolvlm")["files"]["f16"], [[{"role": "user", "content": "hi"}], with_picture], 4)


def test_the_gguf_export_ships_the_projector_and_answers_picture_questions_as_transformers(tmp_path):
    """``gguf_model`` of a VLM: the files and the projector written and checked, the projector a companion of the
    shipped file, a text-only Modelfile that says where it goes; the runtime answers through libmtmd, greedily as the
    merged model does (``evaluate.generate_with_images``) on pictures of the sample's sizes."""
    from transformers import AutoModelForImageTextToText

    from ft_assets.delivery import evaluate
    from ft_assets.delivery.exports import gguf
    from ft_assets.vision import load_processor

    model_dir, out = build_vlm("qwen2_5_vl", tmp_path / "qwen"), tmp_path / "out"
    out.mkdir()
    made = gguf.make(model_dir, out, tmp_path, "shapes-v1", gguf.GgufSettings(qtypes=["f16"]), logging.getLogger())
    projector = "shapes-v1-mmproj-f16.gguf"
    assert made.shipped == "shapes-v1-f16.gguf" and made.companions == [projector] and made.stats["mmproj"] == projector
    entry = made.files[made.shipped]
    assert entry["mtmd"]["tokens_match"] and entry["mtmd"]["rel_error"] <= mtmd.TOLERANCES["f16"]
    assert "transformers" not in entry  # its GGUF reader takes no VLM
    modelfile = (out / "Modelfile").read_text()
    assert "FROM ./shapes-v1-f16.gguf" in modelfile and f"--mmproj {projector}" in modelfile

    conversations = []
    for number, (color, size) in enumerate([("red", 64), ("blue", 48), ("", 96), ("", 80)]):
        (tmp_path / f"{number}.png").write_bytes(picture(color, (size, size), seed=number if not color else None))
        conversations.append([{"role": "user", "content": [{"type": "image", "image": str(tmp_path / f"{number}.png")},
                                                           {"type": "text", "text": "What color is it?"}]}])  # fmt: skip
    runtime = gguf.GGUF.runtime(out / made.shipped)
    assert runtime.mmproj == out / projector
    answers = runtime.chat_answers(conversations, 6, log=lambda line: None)
    merged = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    expected = evaluate.generate_with_images(merged, load_processor(model_dir), conversations, 6, log=lambda _: None)
    assert sum(a == e for a, e in zip(answers, expected)) >= 3, (answers, expected)
    assert len(set(answers)) > 1  # the pictures are read: other pictures, other answers
