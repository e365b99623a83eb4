"""The shipped vision sample: deterministic, dirt exactly as reported, every answer true to its picture's pixels.

The census below reads the files with its own small reader (json, pyarrow, Pillow; not the data plane's), so the
counts ``write_vision_sample`` reports are checked against what is really on disk, and the answers against what the
pictures show.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import posixpath
import re
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from scripts.make_vision_sample import (
    COLOR_QUESTIONS,
    COLORS,
    FILES,
    SHAPE_QUESTIONS,
    SHAPES,
    generate_rows,
    write_vision_sample,
)

SHIPPED = Path(__file__).resolve().parents[1] / "samples" / "shapes"
NEAR_COLOR = 60  # RGB distance within which a pixel is of a color: the fills are jittered by 12 a channel, JPEG blurs
SHAPE_BY_FILL = ((0.47, "star"), (0.65, "triangle"), (0.9, "circle"), (1.01, "square"))  # share of its box it fills
PALETTE = np.array(list(COLORS.values()), dtype=np.int32)
UNREADABLE = ("escaping_paths", "missing_images", "empty_images", "truncated_images")


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("shapes")
    return out, write_vision_sample(out)


@pytest.fixture(scope="module")
def on_disk(written):
    return census(written[0])


def words(question: str) -> str:
    return " ".join(re.findall(r"\w+", question.lower()))


def rows_of(folder: Path) -> list[tuple[str, str, object]]:
    """(question, answer, image as named: a path, a data URI or bytes) of every row in the folder's data files."""
    rows = []
    for line in (folder / "chat.jsonl").read_text().splitlines():
        user, reply = json.loads(line)["messages"]
        image, text = user["content"]
        rows.append((text["text"], reply["content"], image.get("image") or image["image_url"]["url"]))
    for line in (folder / "sharegpt.jsonl").read_text().splitlines():
        record = json.loads(line)
        human, gpt = record["conversations"]
        rows.append((human["value"].removeprefix("<image>\n"), gpt["value"], *record["images"]))
    for record in pq.read_table(folder / "embedded.parquet").to_pylist():
        user, reply = record["messages"]
        rows.append((user["content"].removeprefix("<image>"), reply["content"], record["images"][0]["bytes"]))
    return rows


def image_of(folder: Path, named: object) -> tuple[str, bytes]:
    """("ok", the image's bytes), or which of UNREADABLE it is."""
    if isinstance(named, bytes):
        data = named
    elif named.startswith("data:image/png;base64,"):
        data = base64.b64decode(named.split(",", 1)[1])
    elif posixpath.normpath(named).startswith(".."):
        return "escaping_paths", b""
    elif not (folder / named).is_file():
        return "missing_images", b""
    else:
        data = (folder / named).read_bytes()
    if not data:
        return "empty_images", b""
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
    except OSError:
        return "truncated_images", b""
    return "ok", data


def read_back(data: bytes) -> tuple[str, str]:
    """(color, shape) the pixels show: the color most pixels are near, and how much of its box that color fills."""
    with Image.open(io.BytesIO(data)) as image:
        rgb = np.asarray(image.convert("RGB"), dtype=np.int32)
    packed = rgb[..., 0] << 16 | rgb[..., 1] << 8 | rgb[..., 2]
    distinct, where = np.unique(packed, return_inverse=True)  # a few colors a picture: judge each once
    channels = np.stack([distinct >> 16, distinct >> 8 & 255, distinct & 255], axis=-1)
    distance = ((channels[:, None, :] - PALETTE) ** 2).sum(-1)
    nearest = np.where(distance.min(-1) < NEAR_COLOR**2, distance.argmin(-1), -1)[where.reshape(packed.shape)]
    color = np.bincount(nearest[nearest >= 0], minlength=len(COLORS)).argmax()
    ys, xs = np.nonzero(nearest == color)
    fill = len(ys) / ((ys.max() - ys.min() + 1) * (xs.max() - xs.min() + 1))
    return list(COLORS)[color], next(shape for bound, shape in SHAPE_BY_FILL if fill < bound)


def census(folder: Path) -> tuple[Counter[str], list[tuple[str, str, bytes]]]:
    """Count every kind of row as quarantine + exact dedup see them; also return the rows kept, with their bytes."""
    counts: Counter[str] = Counter()
    kept: dict[tuple[str, str, str], tuple[str, str, bytes]] = {}
    for question, answer, named in rows_of(folder):
        counts["data_uri_rows"] += isinstance(named, str) and named.startswith("data:")
        kind, data = image_of(folder, named)
        if kind != "ok":
            counts[kind] += 1
            continue
        key = (words(question), answer.lower(), hashlib.sha256(data).hexdigest())
        counts["exact_duplicates"] += key in kept
        kept.setdefault(key, (question, answer, data))
    rows = list(kept.values())
    counts["unique_rows"] = len(rows)
    counts["color_questions"] = sum(words(q) in map(words, COLOR_QUESTIONS) for q, _, _ in rows)
    counts["shape_questions"] = sum(words(q) in map(words, SHAPE_QUESTIONS) for q, _, _ in rows)
    same_pixels = defaultdict(set)  # the same question and answer about the same colors pixel for pixel
    for question, answer, data in rows:
        with Image.open(io.BytesIO(data)) as image:
            colors = tuple(sorted(image.convert("RGB").getcolors(image.width * image.height)))
        same_pixels[words(question), answer, image.size, colors].add(data)
    counts["same_question_other_image"] = sum(len(images) - 1 for images in same_pixels.values())
    files = sorted((folder / "images").iterdir())
    counts["image_files"] = len(files)
    counts["jpeg_files"] = sum(file.read_bytes()[:2] == b"\xff\xd8" for file in files)
    return counts, rows


@pytest.mark.parametrize(
    "kind",
    [
        "unique_rows",
        "color_questions",
        "shape_questions",
        "data_uri_rows",
        "image_files",
        "jpeg_files",
        "exact_duplicates",
        "same_question_other_image",
        *UNREADABLE,
    ],
)
def test_dirt_on_disk_matches_the_report(written, on_disk, kind):
    counts, _ = on_disk
    assert counts[kind] == written[1][kind]


def test_rows_add_up(written, on_disk):
    out_dir, report = written
    assert {file: report[file] for file in FILES} == {
        "chat.jsonl": len((out_dir / "chat.jsonl").read_text().splitlines()),
        "sharegpt.jsonl": len((out_dir / "sharegpt.jsonl").read_text().splitlines()),
        "embedded.parquet": pq.read_metadata(out_dir / "embedded.parquet").num_rows,
    }
    dropped = ("unique_rows", "exact_duplicates", *UNREADABLE)
    assert sum(report[file] for file in FILES) == sum(report[kind] for kind in dropped)
    assert report["color_questions"] + report["shape_questions"] == report["unique_rows"]
    assert report["color_questions"] == pytest.approx(report["unique_rows"] * 2 / 3, abs=2)


def test_every_answer_is_what_its_picture_shows_and_what_the_generator_drew(on_disk):
    """Each kept row's answer against the pixels, and each picture the generator drew against the truth it keeps."""
    _, rows = on_disk
    drawn = {row.image: row for row in generate_rows()}
    for question, answer, data in rows:
        assert answer in (*COLORS, *SHAPES) and words(question) in map(words, COLOR_QUESTIONS + SHAPE_QUESTIONS)
        color, shape = read_back(data)
        assert answer == (color if words(question) in map(words, COLOR_QUESTIONS) else shape), (question, answer)
        if data in drawn:
            row = drawn.pop(data)
            assert (row.picture.color, row.picture.shape) == (color, shape), row.picture
            assert (words(row.question), row.answer) == (words(question), answer)
    assert not drawn, f"{len(drawn)} drawn pictures are in no kept row"


def test_pictures_are_small_and_the_folder_is_too(written):
    out_dir, _ = written
    for file in (out_dir / "images").iterdir():
        if file.stat().st_size:
            with Image.open(file) as image:
                assert 48 <= image.width == image.height <= 96, file.name
    assert sum(file.stat().st_size for file in out_dir.rglob("*") if file.is_file()) < 500_000


def test_embedded_parquet_is_what_datasets_writes_for_an_image_feature(written):
    schema = pq.read_schema(written[0] / "embedded.parquet")
    assert str(schema.field("images").type) == "list<element: struct<bytes: binary, path: string>>"
    features = json.loads(schema.metadata[b"huggingface"])["info"]["features"]
    assert features["images"] == {"feature": {"_type": "Image"}, "_type": "List"}


def test_write_vision_sample_is_deterministic(written, tmp_path):
    out_dir, report = written
    assert write_vision_sample(tmp_path) == report
    assert files_of(tmp_path) == files_of(out_dir)


def files_of(folder: Path) -> dict[str, bytes]:
    return {file.relative_to(folder).as_posix(): file.read_bytes() for file in folder.rglob("*") if file.is_file()}


def test_shipped_files_equal_a_fresh_generation(written):
    """Nobody edits samples/ by hand: regenerate with `python -m scripts.make_vision_sample samples/shapes`.

    The Parquet file is compared as a table (its PNG bytes included): its footer names the pyarrow that wrote it.
    """
    fresh, shipped = files_of(written[0]), files_of(SHIPPED)
    assert sorted(shipped) == sorted(fresh)
    for name in fresh:
        if name.endswith(".parquet"):
            assert pq.read_table(SHIPPED / name).equals(pq.read_table(written[0] / name), check_metadata=True)
        else:
            assert shipped[name] == fresh[name], name
