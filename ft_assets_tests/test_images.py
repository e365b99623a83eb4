"""Images in the data plane: the layouts that hold them, the checks on each image, the store that keeps them once,
deduplication that tells pictures apart, and registration that brings the files a data file names."""

import base64
import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from ft_assets.data.dedup import exact_key, row_features
from ft_assets.data.images import IMAGE_MARKER, ImageResolver, ImageRules, check_image, image_ref
from ft_assets.data.layouts import ColumnMapping, normalize_record
from ft_assets.data.parts import Artifact
from ft_assets.data.readers import read_dataset
from ft_assets.data.rows import RowError
from ft_assets.data.staging import stage_source
from ft_assets.storage import LocalStore


def png(color: str = "red", size: tuple[int, int] = (32, 24)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, "PNG")
    return buffer.getvalue()


def bomb() -> bytes:
    """A 20,000 x 20,000 PNG of 1-bit pixels: ~50 kB on disk, 1.2 GB decoded as RGB."""
    buffer = io.BytesIO()
    Image.new("1", (20_000, 20_000)).save(buffer, "PNG")
    return buffer.getvalue()


REPLY = {"role": "assistant", "content": "red"}
PARTS = [{"type": "image", "image": "img/a.png"}, {"type": "text", "text": "What color?"}]

LAYOUT_CASES = [
    ("parts", {"messages": [{"role": "user", "content": PARTS}, REPLY]}, "<image>What color?", ["img/a.png"]),
    (
        "trl-images-column",
        {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hue?"}]}, REPLY],
         "images": ["img/a.png"]},
        "<image>Hue?", ["img/a.png"],
    ),
    (
        "openai-image-url",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hue? "},
                      {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}, REPLY]},
        "Hue? <image>", ["data:image/png;base64,AA=="],
    ),
    (
        "sharegpt-markers",
        {"conversations": [{"from": "human", "value": "<image>\nWhich?<image>"}, {"from": "gpt", "value": "red"}],
         "images": ["a.png", "b.png"]},
        "<image>\nWhich?<image>", ["a.png", "b.png"],
    ),
    (
        "column-without-markers-goes-first",
        {"messages": [{"role": "user", "content": "What color?"}, REPLY], "image": "a.png"},
        "<image>What color?", ["a.png"],
    ),
    (
        "datasets-image-feature",
        {"messages": [{"role": "user", "content": [{"type": "image", "text": None}, {"type": "text", "text": "Q"}]},
                      REPLY], "images": [{"bytes": b"\x89PNG", "path": "x.png"}]},
        "<image>Q", [{"bytes": b"\x89PNG", "path": "x.png"}],
    ),
]  # fmt: skip


@pytest.mark.parametrize("name,record,content,images", LAYOUT_CASES, ids=[c[0] for c in LAYOUT_CASES])
def test_layouts_put_each_image_where_it_stands(name, record, content, images):
    messages = normalize_record(record)
    assert messages[0] == {"role": "user", "content": content, "images": images}
    assert messages[1] == REPLY


def test_a_mapped_images_column():
    mapping = ColumnMapping.of({"prompt": "question", "response": "answer", "images": "photo"})
    messages = mapping.record({"question": "Which shape?", "answer": "a circle", "photo": "shapes/1.png"})
    assert messages[0] == {"role": "user", "content": "<image>Which shape?", "images": ["shapes/1.png"]}


LAYOUT_ERRORS = [
    ("count", {"conversations": [{"from": "human", "value": "<image>"}, {"from": "gpt", "value": "x"}],
               "images": ["a.png", "b.png"]}, "image_count"),
    ("part-names-none", {"messages": [{"role": "user", "content": [{"type": "image"}]}, REPLY]}, "image_missing"),
    ("in-a-reply", {"messages": [{"role": "user", "content": "q"},
                                 {"role": "assistant", "content": [{"type": "image", "image": "a.png"}]}]}, "image_in_reply"),
    ("marker-in-a-text-part", {"messages": [{"role": "user", "content": [{"type": "text", "text": "<image>"}]}, REPLY]},
     "image_marker"),
    ("audio-part", {"messages": [{"role": "user", "content": [{"type": "audio", "audio": "a.wav"}]}, REPLY]}, "wrong_type"),
    ("pairs", {"prompt": "q", "chosen": "a", "rejected": "b", "images": ["a.png"]}, "images_unsupported"),
    ("prompts", {"messages": [{"role": "user", "content": PARTS}]}, "images_unsupported"),
]  # fmt: skip


@pytest.mark.parametrize("name,record,reason", LAYOUT_ERRORS, ids=[c[0] for c in LAYOUT_ERRORS])
def test_layouts_refuse_images_they_cannot_place(name, record, reason):
    with pytest.raises(RowError) as caught:
        normalize_record(record)
    assert caught.value.reason == reason


IMAGE_CHECKS = [
    ("truncated-png", png()[:60], "image_unreadable", "cannot be decoded (image file is truncated)"),
    ("zero-bytes", b"", "image_unreadable", "is empty (0 bytes)"),
    ("not-an-image", b"GIF89a but not really", "image_unreadable", "not an image Pillow can read"),
    ("decompression-bomb", bomb(), "image_too_large", "is 20000 x 20000 (400 MP), above the 64 MP limit"),
    ("too-small", png(size=(4, 40)), "image_too_small", "is 4 x 40, below 8 pixels a side"),
]


@pytest.mark.parametrize("name,data,reason,detail", IMAGE_CHECKS, ids=[c[0] for c in IMAGE_CHECKS])
def test_hostile_images_are_refused_in_one_line(name, data, reason, detail):
    with pytest.raises(RowError) as caught:
        check_image(data, "image img/x.png", ImageRules())
    assert caught.value.reason == reason
    assert detail in caught.value.detail and "\n" not in caught.value.detail


def test_a_bomb_is_refused_without_decoding_its_pixels(monkeypatch):
    from PIL import ImageFile

    big, small, decoded = bomb(), png(), []
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: decoded.append(self.size))
    with pytest.raises(RowError):
        check_image(big, "image bomb.png", ImageRules())
    assert decoded == []
    assert check_image(small, "image ok.png", ImageRules()) == ("png", 32, 24) and decoded == [(32, 24)]


def test_read_dataset_stores_each_image_once_and_quarantines_only_the_bad_rows(tmp_path):
    store, inputs = LocalStore(tmp_path / "store"), "datasets/shapes/v1"
    store.put_bytes(f"{inputs}/img/red.png", png("red"))
    store.put_bytes(f"{inputs}/img/truncated.png", png("blue")[:60])
    store.put_bytes(f"{inputs}/img/empty.png", b"")
    store.put_bytes(f"{inputs}/img/bomb.png", bomb())
    green = "data:image/png;base64," + base64.b64encode(png("green")).decode()

    def row(image, answer="red"):
        return {"messages": [{"role": "user", "content": [{"type": "image", "image": image},
                                                          {"type": "text", "text": "What color?"}]},
                             {"role": "assistant", "content": answer}]}  # fmt: skip

    rows = [row("img/red.png"), row("img/truncated.png"), row("img/empty.png"), row("img/bomb.png"),
            row("../../../etc/passwd"), row("img/missing.png"), row("https://example.com/x.png"), row(green, "green"),
            row("img/red.png", "crimson"), {"messages": [{"role": "user", "content": "text only"}, REPLY]}]  # fmt: skip
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = Artifact.begin(store, "runs/shapes/v1/data/raw")
    stats = read_dataset([("data.jsonl", data)], out, images=ImageResolver(store.url, inputs, "images/shapes"))

    assert (stats["rows_parsed"], stats["rows_quarantined"], stats["image_rows"]) == (4, 6, 3)
    reasons = {r["source"]: (r["reason"], r["detail"]) for r in out.records("quarantine")}
    assert reasons == {
        "data.jsonl:2": ("image_unreadable", "image img/truncated.png cannot be decoded (image file is truncated)"),
        "data.jsonl:3": ("image_unreadable", "image img/empty.png is empty (0 bytes)"),
        "data.jsonl:4": ("image_too_large", "image img/bomb.png is 20000 x 20000 (400 MP), above the 64 MP limit "
                                            "(raw_dataset config max_image_pixels); not decoded"),
        "data.jsonl:5": ("image_path", "image '../../../etc/passwd' leaves the dataset's folder (relative to data.jsonl)"),
        "data.jsonl:6": ("image_missing", "image 'img/missing.png' (relative to data.jsonl) is not in the dataset "
                                          "version: no file img/missing.png"),
        "data.jsonl:7": ("image_url", "image 'https://example.com/x.png': URLs are not fetched; put the file beside "
                                      "data.jsonl and name it by its relative path"),
    }  # fmt: skip
    kept = {r["source"]: r["messages"][0] for r in out.records("rows")}
    red, green_ref = image_ref(png("red"), "png"), image_ref(png("green"), "png")
    assert kept["data.jsonl:1"]["images"] == kept["data.jsonl:9"]["images"] == [red]
    assert kept["data.jsonl:8"] == {"role": "user", "content": f"{IMAGE_MARKER}What color?", "images": [green_ref]}
    assert "images" not in kept["data.jsonl:10"]
    assert sorted(store.list("images/shapes")) == sorted(f"images/shapes/{ref}" for ref in (red, green_ref))
    assert store.get_bytes(f"images/shapes/{red}") == png("red")


def test_parquet_image_bytes_as_datasets_writes_them(tmp_path):
    store = LocalStore(tmp_path / "store")
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    table = pa.table({
        "messages": [[{"role": "user", "content": "<image>Color?"}, {"role": "assistant", "content": "red"}]],
        "images": pa.array([[{"bytes": png("red"), "path": "r.png"}]], pa.list_(image)),
    })  # fmt: skip
    pq.write_table(table, tmp_path / "train.parquet")
    out = Artifact.begin(store, "runs/p/v1/data/raw")
    read_dataset([("train.parquet", tmp_path / "train.parquet")], out,
                 images=ImageResolver(store.url, "datasets/p/v1", "images/p"))  # fmt: skip
    (row,) = out.records("rows")
    assert row["messages"][0]["images"] == [image_ref(png("red"), "png")]


def test_deduplication_keeps_the_same_question_about_other_pictures():
    def row(ref: str, text: str = "What color is the shape in this picture, and how many sides does it have?"):
        return [{"role": "user", "content": f"<image>{text}", "images": [ref]}, {"role": "assistant", "content": "red"}]

    a, b = "a" * 64 + ".png", "b" * 64 + ".png"
    assert exact_key(row(a)) == exact_key(
        row(a, text="what COLOR is the shape in this picture and how many sides does it have")
    )
    assert exact_key(row(a)) != exact_key(row(b))
    from ft_assets.data.dedup import DedupRules

    rules = DedupRules()
    assert row_features(row(a), rules).salt != row_features(row(b), rules).salt  # never near duplicates either


def test_registering_a_data_file_brings_the_images_it_names(tmp_path):
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "1.png").write_bytes(png())
    (tmp_path / "other.png").write_bytes(png("blue"))  # beside the file but named by no row: not brought
    rows = [{"messages": [{"role": "user", "content": [{"type": "image", "image": "photos/1.png"}]}, REPLY]},
            {"messages": [{"role": "user", "content": [{"type": "image", "image": "photos/gone.png"}]}, REPLY]},
            {"messages": [{"role": "user", "content": [{"type": "image", "image": "../outside.png"}]}, REPLY]}]  # fmt: skip
    (tmp_path / "data.jsonl").write_text("\n".join(map(json.dumps, rows)))
    staged = stage_source(str(tmp_path / "data.jsonl"), tmp_path / "work")
    assert [rel for rel, _ in staged.files] == ["data.jsonl", "photos/1.png"]
    folder = stage_source(str(tmp_path), tmp_path / "work")  # a folder brings all its images
    assert [rel for rel, _ in folder.files] == ["data.jsonl", "other.png", "photos/1.png"]


def test_a_text_model_refuses_a_row_with_images_and_keeps_the_others():
    from ft_assets.data.chat_encoding import ChatEncoder
    from ft_assets_tests.tiny import build_tokenizer

    encoder = ChatEncoder(build_tokenizer())
    with_image = [{"role": "user", "content": "<image>What color?", "images": ["a" * 64 + ".png"]}, REPLY]
    refused, kept = encoder.encode_batch([with_image, [{"role": "user", "content": "What color?"}, REPLY]])
    assert isinstance(refused, RowError) and refused.reason == "image_without_vision"
    assert "has no vision tower" in refused.detail and kept.loss_mask.any()
