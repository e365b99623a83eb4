"""Reading a metadata chart back as the browser gets it: the markdown's data URI decoded and parsed as SVG."""

import re
import urllib.parse
import xml.etree.ElementTree as ET

SVG = "{http://www.w3.org/2000/svg}"
BAR_RE = re.compile(r"M([\d.]+),([\d.]+)h([\d.]+)v([\d.]+)h-[\d.]+z")
CHAR_PX = 6.0  # a generous width of one 10 px sans-serif character, for the text boxes below


def svg_of(markdown: str) -> ET.Element:
    """The SVG a chart's markdown shows: ``![title](data:image/svg+xml,…)`` decoded and parsed."""
    match = re.fullmatch(r"!\[[^\]]*\]\(data:image/svg\+xml,([^()\s]+)\)", markdown)
    assert match, markdown[:120]
    return ET.fromstring(urllib.parse.unquote(match.group(1)))


def curves(svg: ET.Element) -> list[list[tuple[int, int]]]:
    lines = []
    for polyline in svg.iter(f"{SVG}polyline"):
        numbers = [int(n) for n in polyline.get("points").split(",")]
        lines.append(list(zip(numbers[::2], numbers[1::2])))
    return lines


def bars(svg: ET.Element) -> list[tuple[float, float, float, float]]:
    """Every bar drawn, as (x, y, width, height): the filled paths are made of one rectangle per bar."""
    return [
        tuple(float(n) for n in match.groups())
        for path in svg.iter(f"{SVG}path") if path.get("fill")
        for match in BAR_RE.finditer(path.get("d"))
    ]  # fmt: skip


def text_boxes(svg: ET.Element) -> list[tuple[str, float, float, float, float]]:
    """Each text's (text, left, top, right, bottom), from its anchor and a generous character width."""
    boxes = []
    for text in svg.iter(f"{SVG}text"):
        said = "".join(text.itertext())  # a coloured part of it (a <tspan>) included
        x, y, width = float(text.get("x")), float(text.get("y")), CHAR_PX * len(said)
        left = {"end": x - width, "middle": x - width / 2}.get(text.get("text-anchor"), x)
        boxes.append((said, left, y - 9, left + width, y))
    return boxes


def dots(svg: ET.Element) -> list[tuple[float, float]]:
    """The centres of the dots drawn beside the curves (4 px squares: ``Mx,yh4`` strokes of one unfilled path)."""
    return [
        (float(x) + 2, float(y))
        for path in svg.iter(f"{SVG}path") if path.get("stroke-width") == "4"
        for x, y in re.findall(r"M([\d.]+),([\d.]+)h4", path.get("d"))
    ]  # fmt: skip


def overlaps(a, b) -> bool:
    (ax0, ay0, ax1, ay1), (bx0, by0, bx1, by1) = a, b
    return ax0 < bx1 and bx0 < ax1 and ay0 < by1 and by0 < ay1
