"""Images of a dataset version: where a row's images come from, how each is checked, and where it is kept.

A row's image (``ft_assets.data.layouts`` finds them: an image part of a turn, an ``images`` column)
is one of

- a path relative to the data file that names it (``photos/receipt-12.png`` in ``data.jsonl``), a
  file of the same dataset version: ``ft-assets run`` uploads the files a data file names with it;
- the image's bytes: a Parquet or ``datasets`` ``Image`` column (``{"bytes": ..., "path": ...}``);
- a ``data:image/...;base64,`` URI.

Each is read, checked and stored once by content (``ImageResolver.resolve``):

- decoded by Pillow in full (a truncated or empty file is refused), of a format on ``FORMATS``;
- its size read from the header *before* any pixel is decoded and refused above ``max_pixels``
  (a 20,000 x 20,000 PNG of a few kB would otherwise expand to 1.2 GB: a decompression bomb), and
  Pillow's own ``MAX_IMAGE_PIXELS`` set to the same bound as a second guard;
- kept as its bytes under ``images/<dataset name>/<sha256>.<format>`` (``ft_assets.layout``), written only when
  absent: a photo used by 50 rows, or by every version of the dataset, is stored once.

A row's turns then hold references (``<sha256>.<format>``) in place of the images, and an
``IMAGE_MARKER`` in their text where each image stands; every check failure is a ``RowError`` that
names the row's file and the image, so the row is quarantined and nothing else is lost. URLs are
refused rather than fetched: what a dataset version trains on must be in the version.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import posixpath
import re
from dataclasses import dataclass

from ft_assets.data.parallel import store_at
from ft_assets.data.rows import RowError
from ft_assets.storage import ObjectNotFound, join_key

IMAGE_MARKER = "<image>"  # where an image stands in a turn's text (LLaVA's and LLaMA-Factory's placeholder)
FORMATS = {"PNG": "png", "JPEG": "jpg", "WEBP": "webp", "GIF": "gif", "BMP": "bmp", "TIFF": "tiff"}  # Pillow -> suffix
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp", ".tif", ".tiff")  # files staged with the data
MAX_PIXELS = 64_000_000  # 8,000 x 8,000: above any photo a VLM processor keeps whole (they resize to ~1-12 MP)
MAX_BYTES = 64 * 1024 * 1024  # one image file
MIN_SIDE = 8  # pixels: below this no processor has a patch to cut
_REF = re.compile(r"^[0-9a-f]{64}\.[a-z]+$")
_DATA_URI = re.compile(r"^data:image/[\w.+-]+;base64,", re.IGNORECASE)


@dataclass(frozen=True)
class ImageRules:
    """The bounds an image must keep (``raw_dataset`` config)."""

    max_pixels: int = MAX_PIXELS
    max_bytes: int = MAX_BYTES
    min_side: int = MIN_SIDE


def is_ref(value: object) -> bool:
    """Whether ``value`` is a stored image's reference (``<sha256>.<format>``)."""
    return isinstance(value, str) and bool(_REF.match(value))


def count_markers(text: str) -> int:
    return text.count(IMAGE_MARKER)


def describe(source: object) -> str:
    """An image source as an error names it: its path, or what kind of bytes it is."""
    if isinstance(source, dict):
        return describe(source.get("path") or source.get("bytes"))
    if isinstance(source, bytes | bytearray):
        return f"<{len(source)} bytes>"
    if isinstance(source, str) and _DATA_URI.match(source):
        return "<data URI>"
    return repr(source)


def check_image(data: bytes, where: str, rules: ImageRules) -> tuple[str, int, int]:
    """(format suffix, width, height) of an image's bytes, or a ``RowError`` saying what is wrong with it."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise RowError("image_unreadable", f"{where} is empty (0 bytes)")
    if len(data) > rules.max_bytes:
        raise RowError("image_too_large", f"{where} is {len(data):,} bytes, above the {rules.max_bytes:,}-byte limit")
    Image.MAX_IMAGE_PIXELS = rules.max_pixels  # Pillow's own guard, at our bound: what it refuses, we name
    try:
        with Image.open(io.BytesIO(data)) as image:  # reads the header only
            width, height = image.size
            if min(width, height) < rules.min_side:
                raise RowError(
                    "image_too_small", f"{where} is {width} x {height}, below {rules.min_side} pixels a side"
                )
            if image.format not in FORMATS:
                raise RowError(
                    "image_format", f"{where} is {image.format}; use {', '.join(FORMATS)} (convert it first)"
                )
            if width * height > rules.max_pixels:  # Pillow refuses twice its bound at open; between, we do
                raise Image.DecompressionBombError(f"{width} x {height}")
            image.load()  # every pixel decoded: a truncated file fails here, not on a GPU worker
            return FORMATS[image.format], width, height
    except RowError:
        raise
    except Image.DecompressionBombError:
        raise RowError(
            "image_too_large",
            f"{where} is {_header_size(data)}, above the {rules.max_pixels / 1e6:.0f} MP limit (raw_dataset config "
            "max_image_pixels); not decoded",
        ) from None
    except UnidentifiedImageError as exc:
        raise RowError("image_unreadable", f"{where} is not an image Pillow can read ({exc})") from None
    except (OSError, ValueError, SyntaxError) as exc:  # Pillow's truncated / corrupt-data errors
        raise RowError("image_unreadable", f"{where} cannot be decoded ({' '.join(str(exc).split())})") from None


def _header_size(data: bytes) -> str:
    """An image's size as its header gives it ("20000 x 20000 (400 MP)"), read with Pillow's guard off: no pixel is
    decoded."""
    from PIL import Image

    guard, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None
    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
        return f"{width} x {height} ({width * height / 1e6:.0f} MP)"
    finally:
        Image.MAX_IMAGE_PIXELS = guard


def image_ref(data: bytes, suffix: str) -> str:
    return f"{hashlib.sha256(data).hexdigest()}.{suffix}"


def relative_key(data_file: str, path: str) -> str:
    """The key, under the version's inputs, of an image named by ``path`` relative to the data file ``data_file``;
    a ``RowError`` for a path that leaves the version's folder (``../``, an absolute path) or is a URL."""
    if re.match(r"^[a-z][a-z0-9+.-]*://", path, re.IGNORECASE):
        raise RowError(
            "image_url",
            f"image {path!r}: URLs are not fetched; put the file beside {data_file} and name it by its relative path",
        )
    clean = path.replace("\\", "/")
    if clean.startswith("/") or re.match(r"^[A-Za-z]:/", clean):
        raise RowError("image_path", f"image {path!r} is an absolute path; name it relative to {data_file}")
    key = posixpath.normpath(posixpath.join(posixpath.dirname(data_file), clean))
    if key == ".." or key.startswith("../"):
        raise RowError("image_path", f"image {path!r} leaves the dataset's folder (relative to {data_file})")
    return key


@dataclass(frozen=True)
class ImageResolver:
    """Reads, checks and stores the images of one dataset version's rows (sent to each data-plane worker).

    ``url``: the store; ``inputs``: the version's input files (``layout.PartitionLayout.inputs``);
    ``pool``: where its images are kept (``layout.PartitionLayout.images``)."""

    url: str
    inputs: str
    pool: str
    rules: ImageRules = ImageRules()

    def _bytes(self, source: object, data_file: str) -> tuple[bytes, str]:
        """(the image's bytes, how errors name it)."""
        if isinstance(source, dict):  # datasets' Image feature: bytes, else a path
            if source.get("bytes"):
                return bytes(source["bytes"]), f"image {source.get('path') or '<bytes>'}"
            source = source.get("path")
        if isinstance(source, bytes | bytearray):
            return bytes(source), "image <bytes>"
        if not isinstance(source, str) or not source.strip():
            raise RowError("image_missing", f"an image part names no image (got {describe(source)})")
        if _DATA_URI.match(source):
            try:
                return base64.b64decode(source.split(",", 1)[1], validate=True), "image <data URI>"
            except (binascii.Error, ValueError) as exc:
                raise RowError("image_unreadable", f"image <data URI> is not valid base64 ({exc})") from None
        key = relative_key(data_file, source)
        try:
            return store_at(self.url).get_bytes(join_key(self.inputs, key)), f"image {key}"
        except ObjectNotFound:
            raise RowError(
                "image_missing",
                f"image {source!r} (relative to {data_file}) is not in the dataset version: no file {key}",
            ) from None

    def resolve(self, source: object, data_file: str) -> str:
        """The stored image's reference; the image is checked and stored first (once by content)."""
        if is_ref(source):
            return source  # already stored (rows read back from an earlier stage)
        data, where = self._bytes(source, data_file)
        suffix, _, _ = check_image(data, where, self.rules)
        ref, store = image_ref(data, suffix), store_at(self.url)
        key = join_key(self.pool, ref)
        if not store.exists(key):  # a HEAD first: an image of an earlier version is not uploaded again
            store.put_bytes_if_absent(key, data)
        return ref

    def resolve_messages(self, messages: list[dict], data_file: str) -> list[dict]:
        """``messages`` with each turn's image sources replaced by stored references."""
        if not any(m.get("images") for m in messages):
            return messages
        return [
            {**m, "images": [self.resolve(image, data_file) for image in m["images"]]} if m.get("images") else m
            for m in messages
        ]


def open_image(data: bytes, where: str):
    """An image's bytes as the RGB picture processors take (a stored image: checked once already)."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.convert("RGB")
    except (OSError, ValueError) as exc:
        raise RowError("image_unreadable", f"{where} cannot be decoded ({' '.join(str(exc).split())})") from None


def verified(data: bytes, ref: str, where: str) -> bytes:
    """``data`` if its sha256 is the one its reference names; else a ``RowError``: a stored image was changed."""
    if image_ref(data, ref.rsplit(".", 1)[-1]) != ref:
        raise RowError("image_changed", f"{where} does not hash to its name: the stored image was changed")
    return data


@dataclass(frozen=True)
class ImagePool:
    """Where a dataset's stored images are read back (``images/<name>/`` in the store at ``url``), each checked
    against the sha256 its reference names."""

    url: str
    prefix: str

    def get(self, ref: str) -> bytes:
        where = f"stored image {ref}"
        if not is_ref(ref):
            raise RowError("image_missing", f"{ref!r} is not a stored image's reference")
        try:
            return verified(store_at(self.url).get_bytes(join_key(self.prefix, ref)), ref, where)
        except ObjectNotFound:
            raise RowError("image_missing", f"{where} is not in {self.prefix}/ any more") from None

    def open(self, ref: str):
        return open_image(self.get(ref), f"stored image {ref}")
