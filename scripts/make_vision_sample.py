"""The shipped vision sample: small drawn pictures of one shape each, and one-word questions about them.

``python -m scripts.make_vision_sample samples/shapes`` regenerates ``samples/shapes/`` byte for byte (seed
``SEED``) with the Pillow and pyarrow it runs on: another zlib or libjpeg build encodes the same pixels into other
bytes. The demo fine-tunes a tiny vision-language model whose vision encoder starts untrained, with LoRA and the
projector, for 40-80 steps on two CPU cores. The task is shaped for that:

- Learnable from pixels fast. One flat, saturated shape (``SHAPES``, never rotated) fills 55-85% of the side of a
  48-96 px picture whose background is white or a pale near-gray (``BACKGROUNDS``; one picture in ``NOISE_EVERY``
  adds light per-pixel noise). Every pixel of the shape is near one of five far-apart ``COLORS`` and no background
  pixel is: the tint of the mean color away from gray alone names the color of 97% of the pictures. So 2/3 of the
  rows ask the color, what an untrained encoder learns first. Shapes differ in how much of their box they fill
  (square 1.0, circle 0.78, triangle 0.5, star 0.37): learnable, but slower.
- Scorable by exact match. Every answer is one lower-case word of a fixed vocabulary of 9 (``COLORS`` and
  ``SHAPES``), asked in four phrasings per kind (``COLOR_QUESTIONS``, ``SHAPE_QUESTIONS``).
- Small. A flat PNG is ~300 bytes, a noisy one ~4 kB, a JPEG (one image file in ``JPEG_EVERY``) ~1.7 kB: the
  folder's 294 files hold 341 kB.

``write_vision_sample`` spreads the rows over the input forms the data plane reads (``ft_assets.data.layouts``):

- ``chat.jsonl``: ``{"messages": [{"role": "user", "content": [{"type": "image", "image": "images/0001.png"},
  {"type": "text", "text": "..."}]}, {"role": "assistant", "content": "red"}]}``, the image a file under
  ``images/`` named relative to the data file. ``DATA_URI_ROWS`` of its rows carry the PNG inline as a
  ``data:image/png;base64,`` URI instead, half as an ``image`` part, half as OpenAI's ``image_url`` part.
- ``sharegpt.jsonl``: LLaVA / LLaMA-Factory ``{"conversations": [{"from": "human", "value": "<image>\\n..."},
  {"from": "gpt", "value": "circle"}], "images": ["images/0123.png"]}``.
- ``embedded.parquet``: a table as ``datasets`` writes an ``Image`` feature: ``messages`` (``{role, content}``, an
  ``<image>`` marker in the user turn) and ``images``, ``list<struct<bytes, path>>`` holding the PNG bytes, with
  the ``huggingface`` schema metadata that names the feature.

Dirt, as extra rows at exact, reported counts:

- unreadable images, quarantined (``UNREADABLE``): a truncated PNG (its first half), a zero-byte file, a row
  naming a file that is not there, a row whose path leaves the folder (``../outside.png``).
- exact duplicates, dropped: the same image with the same question and answer, as a byte-identical line, as the
  same row in the other JSONL form, with the question lower-cased and its punctuation gone, or as a Parquet row
  that embeds the bytes of the image file.
- look-alikes, kept: ``same_question_other_image`` rows repeat another row's question and answer about the same
  picture moved a few pixels: other bytes, the same colors pixel for pixel. Deduplicating on the text alone would
  drop them, and most of the sample: the 392 kept rows have 36 distinct question-answer texts.

After quarantine and exact deduplication ``unique_rows`` remain.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import io
import itertools
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, ImageDraw

SEED = 20261201  # the seed of the shipped files

COLORS = {  # answer -> fill: saturated, far apart in RGB and from every background
    "red": (215, 40, 40),
    "green": (40, 165, 60),
    "blue": (40, 80, 220),
    "yellow": (240, 205, 30),
    "purple": (140, 55, 180),
}
COLOR_JITTER = 12  # each channel of a fill moves by up to this much: a color is a region of RGB, not one value
SHAPES = ("circle", "square", "triangle", "star")
STAR_INNER = 0.42  # inner / outer radius of the five-pointed star: it fills 37% of its box, the triangle 50%
COLOR_QUESTIONS = (
    "What color is the shape?",
    "Which color is it?",
    "What is the color of the shape?",
    "Name the color.",
)
SHAPE_QUESTIONS = ("What shape is this?", "Which shape is shown?", "What shape do you see?", "Name the shape.")
COLOR_SHARE = (2, 3)  # 2 rows in 3 ask the color: the question an untrained encoder learns within the demo's steps

SIDES = (48, 64, 80, 96)  # px, square pictures
EXTENT = (0.55, 0.85)  # the shape's box, as a share of the side
MARGIN = 2  # px between the shape's box and the edge: a shape is never cut, so a moved copy keeps every pixel
BACKGROUNDS = ((255, 255, 255), (236, 236, 236), (245, 241, 228), (228, 233, 240))  # white, gray, cream, blue-gray
NOISE_EVERY = 8  # one picture in 8 has a noisy background: ~4 kB as PNG instead of ~300 bytes
NOISE_AMPLITUDE = 4  # gray levels either way, the same on all three channels
JPEG_EVERY = 10  # one image file in 10 is a JPEG
JPEG_QUALITY = 90

FILES = ("chat.jsonl", "sharegpt.jsonl", "embedded.parquet")
ROW_SHARES = {"chat.jsonl": 152, "data_uri": 8, "sharegpt.jsonl": 128, "embedded.parquet": 96}  # clean rows
N_ROWS = sum(ROW_SHARES.values())  # 384: ~19 per color-shape pair
DATA_URI_ROWS = ROW_SHARES["data_uri"]  # rows of chat.jsonl with the image inline
IMAGES = "images"  # folder of the image files, beside the data files
ESCAPING_PATH = "../outside.png"
UNREADABLE = {  # the rows the data plane quarantines, one of each kind: the file each is in, its question and answer
    "truncated_images": ("chat.jsonl", "What color is the shape?", "red"),
    "empty_images": ("sharegpt.jsonl", "What shape is this?", "square"),
    "missing_images": ("chat.jsonl", "Which color is it?", "green"),
    "escaping_paths": ("sharegpt.jsonl", "Which shape is shown?", "star"),
}
DUPLICATES = 8  # exact duplicates, two of each of the four kinds
LOOK_ALIKES = 8  # same question and answer, the same picture moved
HF_FEATURES = {  # the schema metadata datasets writes for these columns (datasets 5)
    "info": {
        "features": {
            "messages": {
                "feature": {
                    "role": {"dtype": "string", "_type": "Value"},
                    "content": {"dtype": "string", "_type": "Value"},
                },
                "_type": "List",
            },
            "images": {"feature": {"_type": "Image"}, "_type": "List"},
        }
    }
}
PARQUET_SCHEMA = pa.schema(
    [
        ("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("images", pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))),
    ],
    metadata={"huggingface": json.dumps(HF_FEATURES)},
)


@dataclass(frozen=True)
class Picture:
    """One picture and the truth about it: what ``draw`` makes of it."""

    shape: str
    color: str
    fill: tuple[int, int, int]  # COLORS[color], jittered
    side: int
    background: tuple[int, int, int]
    noise_seed: int | None  # the noise of the background, or a plain one
    box: tuple[int, int, int]  # x, y of the shape's box, and its side
    format: str  # "png" or "jpg"


@dataclass(frozen=True)
class Row:
    """One clean row: a picture, one question about it and its one-word answer."""

    picture: Picture
    image: bytes  # draw(picture)
    question: str
    answer: str
    home: str  # the key of ROW_SHARES it is written to


def star_points(x: int, y: int, size: int) -> list[tuple[float, float]]:
    """A five-pointed star, point up, centered in the ``size`` box at ``x, y``."""
    outer, inner = (size - 1) / 2, (size - 1) / 2 * STAR_INNER
    cx, cy = x + outer, y + outer
    radii = itertools.cycle((outer, inner))
    return [
        (cx + r * math.cos(math.radians(-90 + 36 * k)), cy + r * math.sin(math.radians(-90 + 36 * k)))
        for k, r in zip(range(10), radii)
    ]


def draw(picture: Picture) -> bytes:
    """The picture's PNG or JPEG bytes (the same bytes for the same picture)."""
    side = picture.side
    if picture.noise_seed is None:
        image = Image.new("RGB", (side, side), picture.background)
    else:
        noise = np.random.default_rng(picture.noise_seed).integers(
            -NOISE_AMPLITUDE, NOISE_AMPLITUDE + 1, (side, side, 1)
        )
        image = Image.fromarray(np.clip(np.array(picture.background) + noise, 0, 255).astype(np.uint8))
    x, y, size = picture.box
    pen, end = ImageDraw.Draw(image), size - 1
    if picture.shape == "circle":
        pen.ellipse((x, y, x + end, y + end), fill=picture.fill)
    elif picture.shape == "square":
        pen.rectangle((x, y, x + end, y + end), fill=picture.fill)
    elif picture.shape == "triangle":
        pen.polygon([(x + end / 2, y), (x + end, y + end), (x, y + end)], fill=picture.fill)
    else:
        pen.polygon(star_points(x, y, size), fill=picture.fill)
    out = io.BytesIO()
    if picture.format == "jpg":
        image.save(out, "JPEG", quality=JPEG_QUALITY)
    else:
        image.save(out, "PNG", optimize=True)
    return out.getvalue()


def colors_of(data: bytes) -> tuple:
    """What the pixels of an image are, position aside: (size, each color with its count). Equal for a picture and
    the same picture moved."""
    with Image.open(io.BytesIO(data)) as image:
        return image.size, tuple(sorted(image.convert("RGB").getcolors(image.width * image.height)))


def _picture(rng: random.Random, shape: str, color: str, noisy: bool, fmt: str) -> Picture:
    side = rng.choice(SIDES)
    size = round(side * rng.uniform(*EXTENT))
    fill = tuple(min(255, max(0, c + rng.randint(-COLOR_JITTER, COLOR_JITTER))) for c in COLORS[color])
    x, y = (rng.randint(MARGIN, side - size - MARGIN) for _ in range(2))
    noise_seed = rng.getrandbits(32) if noisy else None
    return Picture(shape, color, fill, side, rng.choice(BACKGROUNDS), noise_seed, (x, y, size), fmt)


def _ask(rng: random.Random, picture: Picture, asks_color: bool) -> tuple[str, str]:
    """(question, answer) about the picture's color or its shape."""
    if asks_color:
        return rng.choice(COLOR_QUESTIONS), picture.color
    return rng.choice(SHAPE_QUESTIONS), picture.shape


def generate_rows(seed: int = SEED) -> list[Row]:
    """The ``N_ROWS`` clean rows, in ``ROW_SHARES`` order: every color-shape pair about equally often, no two
    pictures with the same pixels."""
    rng = random.Random(seed)
    pairs = list(itertools.product(SHAPES, COLORS)) * math.ceil(N_ROWS / (len(SHAPES) * len(COLORS)))
    rng.shuffle(pairs)
    homes = [home for home, count in ROW_SHARES.items() for _ in range(count)]
    rows, seen, files = [], set(), 0
    for i, ((shape, color), home) in enumerate(zip(pairs, homes)):
        is_file = home in FILES[:2]
        fmt = "jpg" if is_file and files % JPEG_EVERY == JPEG_EVERY - 1 else "png"
        files += is_file
        noisy = i % NOISE_EVERY == NOISE_EVERY - 1
        picture = _picture(rng, shape, color, noisy, fmt)
        image = draw(picture)
        while colors_of(image) in seen:  # only a look-alike shares its pixels with another picture
            picture = _picture(rng, shape, color, noisy, fmt)
            image = draw(picture)
        seen.add(colors_of(image))
        rows.append(Row(picture, image, *_ask(rng, picture, i % COLOR_SHARE[1] < COLOR_SHARE[0]), home))
    return rows


def moved(rng: random.Random, row: Row) -> Row:
    """The row about the same picture with its shape somewhere else: other bytes, the same pixels."""
    x, y, size = row.picture.box
    span = range(MARGIN, row.picture.side - size - MARGIN + 1)
    spots = [spot for spot in itertools.product(span, span) if spot != (x, y)]
    picture = dataclasses.replace(row.picture, box=(*rng.choice(spots), size))
    return dataclasses.replace(row, picture=picture, image=draw(picture))


def _chat_line(question: str, answer: str, image: dict) -> str:
    user = [image, {"type": "text", "text": question}]
    return json.dumps({"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]})


def _sharegpt_line(question: str, answer: str, path: str) -> str:
    turns = [{"from": "human", "value": f"<image>\n{question}"}, {"from": "gpt", "value": answer}]
    return json.dumps({"conversations": turns, "images": [path]})


def _parquet_row(question: str, answer: str, data: bytes) -> dict:
    turns = [{"role": "user", "content": f"<image>{question}"}, {"role": "assistant", "content": answer}]
    return {"messages": turns, "images": [{"bytes": data, "path": None}]}


def _line(file: str, question: str, answer: str, path: str) -> str:
    if file == "chat.jsonl":
        return _chat_line(question, answer, {"type": "image", "image": path})
    return _sharegpt_line(question, answer, path)


def _data_uri_line(k: int, question: str, answer: str, data: bytes) -> str:
    uri = "data:image/png;base64," + base64.b64encode(data).decode()
    part = {"type": "image", "image": uri} if k % 2 == 0 else {"type": "image_url", "image_url": {"url": uri}}
    return _chat_line(question, answer, part)


def _plainly(question: str) -> str:
    """The question as a hurried user types it: lower case, no punctuation (the same row to the deduplicator)."""
    return question.lower().rstrip("?.")


def write_vision_sample(out_dir: str | Path, seed: int = SEED) -> dict[str, int]:
    """Write the sample with its dirt into ``out_dir``; return what was written.

    Keys: the rows of each of ``FILES``, ``image_files`` (all of ``images/``, the broken ones too) and ``jpeg_files``,
    ``data_uri_rows``, ``unique_rows`` (what survives quarantine and exact deduplication) and of those the
    ``color_questions`` and ``shape_questions``, then each kind of dirt. The rows add up: all files together hold
    unique_rows + exact_duplicates + the four unreadable kinds.
    """
    rows = generate_rows(seed)
    rng = random.Random(f"{seed}-dirt")  # own stream: the clean rows do not depend on the dirt
    images: dict[str, bytes] = {}  # path relative to out_dir -> bytes

    def image_file(fmt: str, data: bytes) -> str:
        path = f"{IMAGES}/{len(images) + 1:04d}.{fmt}"
        images[path] = data
        return path

    lines: dict[str, list] = {file: [] for file in FILES}  # JSONL lines, Parquet rows
    paths: dict[int, str] = {}  # row -> its image file
    inline = itertools.count()
    for i, row in enumerate(rows):
        if row.home == "embedded.parquet":
            lines[row.home].append(_parquet_row(row.question, row.answer, row.image))
        elif row.home == "data_uri":
            lines["chat.jsonl"].append(_data_uri_line(next(inline), row.question, row.answer, row.image))
        else:
            paths[i] = image_file(row.picture.format, row.image)
            lines[row.home].append(_line(row.home, row.question, row.answer, paths[i]))

    extra: dict[str, list] = {file: [] for file in FILES}
    flat_png = [i for i in paths if rows[i].picture.format == "png" and rows[i].picture.noise_seed is None]
    sources = rng.sample(flat_png, DUPLICATES + LOOK_ALIKES)
    for k, i in enumerate(sources[:DUPLICATES]):
        row, other = rows[i], FILES[1 - FILES.index(rows[i].home)]
        if k % 4 == 0:
            extra[row.home].append(_line(row.home, row.question, row.answer, paths[i]))
        elif k % 4 == 1:
            extra[other].append(_line(other, row.question, row.answer, paths[i]))
        elif k % 4 == 2:
            extra[row.home].append(_line(row.home, _plainly(row.question), row.answer, paths[i]))
        else:
            extra["embedded.parquet"].append(_parquet_row(row.question, row.answer, images[paths[i]]))
    look_alikes = [moved(rng, rows[i]) for i in sources[DUPLICATES:]]
    for row in look_alikes:
        extra[row.home].append(_line(row.home, row.question, row.answer, image_file("png", row.image)))

    whole = draw(_picture(rng, "circle", "red", False, "png"))  # the picture of the truncated image's question
    named = {  # kind of UNREADABLE -> the image its row names
        "truncated_images": image_file("png", whole[: len(whole) // 2]),
        "empty_images": image_file("png", b""),
        "missing_images": f"{IMAGES}/{len(images) + 1:04d}.png",  # never written
        "escaping_paths": ESCAPING_PATH,
    }
    for kind, (file, question, answer) in UNREADABLE.items():
        extra[file].append(_line(file, question, answer, named[kind]))

    out_dir = Path(out_dir)
    (out_dir / IMAGES).mkdir(parents=True, exist_ok=True)
    for path, data in images.items():
        (out_dir / path).write_bytes(data)
    written = {}
    for file in FILES:
        rest = lines[file][1:] + extra[file]
        rng.shuffle(rest)
        ordered = [lines[file][0], *rest]  # a good row first
        written[file] = len(ordered)
        if file == "embedded.parquet":
            pq.write_table(pa.Table.from_pylist(ordered, schema=PARQUET_SCHEMA), out_dir / file)
        else:
            (out_dir / file).write_text("\n".join(ordered) + "\n")

    kept = rows + look_alikes
    report = {
        **written,
        "image_files": len(images),
        "jpeg_files": sum(path.endswith(".jpg") for path in images),
        "data_uri_rows": DATA_URI_ROWS,
        "unique_rows": len(kept),
        "color_questions": sum(row.answer in COLORS for row in kept),
        "shape_questions": sum(row.answer in SHAPES for row in kept),
        **{kind: 1 for kind in UNREADABLE},
        "exact_duplicates": DUPLICATES,
        "same_question_other_image": LOOK_ALIKES,
    }
    size = sum(map(len, images.values())) + sum((out_dir / file).stat().st_size for file in FILES)
    (out_dir / "README.md").write_text(readme(report, size, named))
    return report


def readme(report: dict[str, int], size: int, named: dict[str, str]) -> str:
    """The sample's card: what the data is, its license, its files and its dirt (``named``: the image each row of
    ``UNREADABLE`` names)."""
    return f"""---
license: cc0-1.0
---

# shapes: one-word questions about drawn shapes

License: CC0 1.0 Universal, public domain dedication (https://creativecommons.org/publicdomain/zero/1.0/).

Each picture is one flat shape ({", ".join(SHAPES)}) in one of {len(COLORS)} colors ({", ".join(COLORS)})
on a white or pale background, {SIDES[0]}-{SIDES[-1]} px, drawn by `scripts/make_vision_sample.py` with Pillow:
no photograph, nothing copied.
Each row asks one question about its picture ("{COLOR_QUESTIONS[0]}", "{SHAPE_QUESTIONS[0]}", four phrasings each)
and the answer is one word, so exact match scores a reply.
Of the {report["unique_rows"]} distinct rows, {report["color_questions"]} ask the color and {report["shape_questions"]} the shape.

Regenerate, byte for byte: `python -m scripts.make_vision_sample samples/shapes` (seed {SEED}).
The data files and images are {size / 1000:.0f} kB.

| file | rows | images |
|---|---|---|
| `chat.jsonl` | {report["chat.jsonl"]} | files in `images/` named by `image` parts; {report["data_uri_rows"]} rows inline as `data:image/png;base64,` URIs |
| `sharegpt.jsonl` | {report["sharegpt.jsonl"]} | LLaVA / LLaMA-Factory: an `<image>` marker and an `images` list of paths |
| `embedded.parquet` | {report["embedded.parquet"]} | a `datasets` `Image` column, `list<struct<bytes, path>>`, of PNG bytes |

`images/` holds {report["image_files"]} files, {report["jpeg_files"]} of them JPEG.

Dirt, on purpose:

- quarantined: a row naming a truncated PNG (`{named["truncated_images"]}`), one naming a zero-byte file
  (`{named["empty_images"]}`), one naming a file that is not there (`{named["missing_images"]}`) and one whose path
  leaves the folder (`{named["escaping_paths"]}`);
- dropped as exact duplicates: {report["exact_duplicates"]} rows that repeat another row's image, question and answer;
- kept: {report["same_question_other_image"]} rows that ask another row's question about the same picture moved a few
  pixels. They are not duplicates.

After quarantine and deduplication {report["unique_rows"]} rows remain.
"""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Regenerate the shipped vision sample (same bytes).")
    parser.add_argument("out_dir", type=Path, help=f"folder to write {', '.join(FILES)}, {IMAGES}/ and README.md into")
    args = parser.parse_args(argv)
    print(json.dumps(write_vision_sample(args.out_dir), indent=2))


if __name__ == "__main__":
    main()
