"""Charts for asset metadata: small SVG images inside markdown, drawn on the asset page without a click.

The Dagster UI (1.13) draws a markdown value in place only below 1,000 characters; a longer one hides
behind a "[Show Markdown]" link (``ft_assets_tests/test_ui.py`` records it). A matplotlib PNG of a
60-step loss curve was ~20,000 characters of base64, so it always hid. These charts are one SVG,
URL-encoded into a ``data:image/svg+xml`` URI, whose markdown stays within ``MAX_MARKDOWN`` (999)
characters for any input. The trade-off, to fit: a curve is drawn through at most 64 points (its first
and last, between them the means of equal runs of its history; fewer if the labels are long), the axes
carry only their end values, no gridlines; a bar chart writes each bar's value by it instead of a y
axis, and drops the value labels, then the oldest groups, when there are too many bars to fit. Every
bar is at least ``MIN_BAR_PX`` tall, so a bar of 0 is still seen; names sit under the bars or on the
title line, never on them.

Plain functions of numbers to strings: no plotting library, tested without Dagster. Beside the charts, an eval
picture with the models' answers under it (``picture_markdown``), within the same limit: the picture shrunk until
it fits.
"""

from __future__ import annotations

import math
from pathlib import Path
from urllib.parse import quote

MAX_MARKDOWN = 999  # the longest markdown the asset page draws in place (1,000 and more: a "[Show Markdown]" link)
MIN_BAR_PX = 3  # the least height of a bar: a value of 0 still shows as a bar
MAX_POINTS = 64  # points of a curve before it must shrink to fit; a loss curve needs no more at 270 px wide
CURVE_SIZES = (
    MAX_POINTS,
    48,
    36,
    28,
    20,
    16,
    12,
    8,
    6,
    4,
    2,
)  # the points a curve is tried with, most first, until it fits
MAX_DOTS = 8  # dots beside a curve (the eval losses); more are the means of equal runs, as a curve's points are
COLORS = ("#37c", "#e72", "#3a3", "#c33", "#85c")  # one per series, in order
URI_SAFE = "/:=',.-"  # left as they are in the data URI; <, >, #, spaces, parentheses and the rest are %-encoded
WIDTH, HEIGHT = 320, 130
LEFT, RIGHT, TOP, BOTTOM = 52, 312, 22, 108  # the plot area: y labels left of it, the title above, x labels below
SVG_OPEN = f"<svg xmlns='http://www.w3.org/2000/svg' width='{WIDTH}' height='{HEIGHT}' font-family='sans-serif' font-size='10'>"


class ChartTooLarge(ValueError):
    """Even the smallest form of a chart does not fit in ``MAX_MARKDOWN`` characters (a title far too long)."""


def number_label(value: float, digits: int = 4) -> str:
    """A value as a chart writes it: ``digits`` significant digits, no exponent for ordinary magnitudes."""
    if value == 0:
        return "0"
    return f"{value:.{digits}g}" if 1e-4 <= abs(value) < 1e6 else f"{value:.{digits - 2}e}"


def svg_markdown(svg: str, title: str) -> str:
    """An SVG image as markdown: ``![title](data:image/svg+xml,…)``, the SVG percent-encoded for a markdown link."""
    alt = title.replace("[", "(").replace("]", ")")
    return f"![{alt}](data:image/svg+xml,{quote(svg, safe=URI_SAFE)})"


def _text(x: float, y: float, text: str, anchor: str = "", fill: str = "") -> str:
    attributes = f" text-anchor='{anchor}'" * bool(anchor) + f" fill='{fill}'" * bool(fill)
    escaped = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return f"<text x='{x:g}' y='{y:g}'{attributes}>{escaped}</text>"


def _title_line(title: str, legend: list[str], colored: tuple[str, str] | None = None) -> str:
    """The title, then each series' name in its colour: above the plot area, never on a bar or a curve.

    ``colored`` = (a part of the title, a colour): that part of the title in that colour (a legend in the title)."""
    parts = [_text(4, 13, title)]
    if colored and colored[0] in title:
        part = colored[0].replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
        parts = [parts[0].replace(part, f"<tspan fill='{colored[1]}'>{part}</tspan>", 1)]
    x = RIGHT
    for i in reversed(range(len(legend))):
        parts.append(_text(x, 13, legend[i], "end", COLORS[i % len(COLORS)]))
        x -= 7 * len(legend[i]) + 8
    return "".join(parts)


def _fitted(candidates, title: str) -> str:
    """The first candidate SVG (most detailed first) whose markdown fits in ``MAX_MARKDOWN``."""
    for svg in candidates:
        markdown = svg_markdown(svg, title)
        if len(markdown) <= MAX_MARKDOWN:
            return markdown
    raise ChartTooLarge(
        f"chart {title!r} does not fit in {MAX_MARKDOWN} characters of markdown; shorten its title or names"
    )


def downsample(points: list[tuple[float, float]], n: int) -> list[tuple[float, float]]:
    """At most ``n`` (>= 2) points: the first and the last as they are, between them the means of ``n - 2`` equal runs
    of the others (all the points when there are no more than ``n``)."""
    if len(points) <= n:
        return list(points)
    inner, k = points[1:-1], n - 2
    runs = [inner[len(inner) * i // k : len(inner) * (i + 1) // k] for i in range(k)]
    means = [(sum(p[0] for p in run) / len(run), sum(p[1] for p in run) / len(run)) for run in runs]
    return [points[0], *means, points[-1]]


def _span(values: list[float]) -> tuple[float, float]:
    low, high = min(values), max(values)
    if low == high:
        pad = abs(low) * 0.1 or 1.0
        return low - pad, high + pad
    return low, high


def line_chart(
    series: dict[str, list[tuple[float, float]]],
    title: str,
    xlabel: str,
    dots: tuple[str, list[tuple[float, float]]] | None = None,
) -> str:
    """Curves of (x, y) points as markdown: the title and each series' name on top, y's range left, x's range below.

    ``dots`` = (name, points): points drawn as dots on the same axes (a few measurements beside a curve: the eval
    losses of a loss curve), in the next colour; their name is the part of the title in that colour, or written
    under the plot where the title does not hold it. Points whose y is NaN or infinite are left out; a chart
    without any point says "no points"."""
    clean = {name: [(x, y) for x, y in points if math.isfinite(y)] for name, points in series.items()}
    clean = {name: points for name, points in clean.items() if points}
    dotted = [(x, y) for x, y in (dots[1] if dots else []) if math.isfinite(y)]
    if not clean and not dotted:
        return _fitted([SVG_OPEN + _title_line(title, []) + _text(LEFT, 60, "no points") + "</svg>"], title)
    xs = [x for points in clean.values() for x, _ in points] + [x for x, _ in dotted]
    ys = [y for points in clean.values() for _, y in points] + [y for _, y in dotted]
    (x0, x1), (y0, y1) = _span(xs), _span(ys)
    dot_color = COLORS[len(clean) % len(COLORS)]
    named_above = bool(dotted) and dots[0] in title
    frame = (
        SVG_OPEN + _title_line(title, list(clean) if len(clean) > 1 else [], (dots[0], dot_color) if dotted else None)
        + f"<path d='M{LEFT},{TOP}V{BOTTOM}H{RIGHT}' fill='none' stroke='#999'/>"
        + _text(LEFT - 4, TOP + 8, number_label(y1, 3), "end") + _text(LEFT - 4, BOTTOM, number_label(y0, 3), "end")
        + _text(LEFT, BOTTOM + 13, number_label(x0)) + _text(RIGHT, BOTTOM + 13, f"{xlabel} {number_label(x1)}", "end")
        + (_text((LEFT + RIGHT) / 2, BOTTOM + 13, f"\u25a0 {dots[0]}", "middle", dot_color) if dotted and not named_above else "")
    )  # fmt: skip

    def at(x: float, y: float) -> tuple[int, int]:
        return round(LEFT + (x - x0) / (x1 - x0) * (RIGHT - LEFT)), round(
            BOTTOM - (y - y0) / (y1 - y0) * (BOTTOM - TOP)
        )

    def polyline(points, color: str) -> str:
        coords = ",".join("%d,%d" % at(x, y) for x, y in points)
        return f"<polyline fill='none' stroke='{color}' stroke-width='1.5' points='{coords}'/>"

    # every dot, a 4 px square, in one path of 4 px strokes: ~10 characters a dot, where a <circle> costs ~50
    marks = "".join("M%d,%dh4" % (lambda cx, cy: (cx - 2, cy))(*at(x, y)) for x, y in downsample(dotted, MAX_DOTS))
    dotted_path = f"<path d='{marks}' stroke='{dot_color}' stroke-width='4'/>" * bool(marks)

    def drawn(n: int) -> str:
        lines = (polyline(downsample(points, n), COLORS[i % len(COLORS)]) for i, points in enumerate(clean.values()))
        return frame + "".join(lines) + dotted_path + "</svg>"

    return _fitted((drawn(n) for n in CURVE_SIZES), title)


def bar_geometry(groups: dict[str, dict[str, float]]) -> tuple[float, list[dict]]:
    """The zero line's y, and where each bar goes: one cluster per group, one bar per series, up from zero (down for
    a negative value), 12 px left free beyond the longest bar for its value. A single group's bars stand apart,
    each in its own slot, so that each one's name fits under it.

    Every bar is at least ``MIN_BAR_PX`` tall, so a value of 0 is a visible stub on the zero line."""
    names = list(dict.fromkeys(name for values in groups.values() for name in values))
    if len(groups) == 1 and len(names) > 1:
        [(group, values_of)] = groups.items()
        zero, bars = bar_geometry({name: {name: value} for name, value in values_of.items()})
        return zero, [{**bar, "group": group} for bar in bars]
    values = [v for bars in groups.values() for v in bars.values()]
    low, high = min(0.0, *values), max(0.0, *values)
    room = BOTTOM - TOP - 12 - (12 if low < 0 else 0)
    scale = room / ((high - low) or 1.0)
    zero = TOP + 12 + high * scale
    slot = (RIGHT - LEFT) / len(groups)
    width = min(40.0, (slot - 8) / len(names))
    bars = []
    for g, (group, values_of) in enumerate(groups.items()):
        start = LEFT + g * slot + (slot - width * len(values_of)) / 2
        for i, (name, value) in enumerate(values_of.items()):
            height = max(abs(value) * scale, MIN_BAR_PX)
            bars.append({"group": group, "name": name, "value": value, "x": start + i * width, "y": zero - height if value >= 0 else zero,
                         "width": width - 2, "height": height, "color": COLORS[names.index(name) % len(COLORS)]})  # fmt: skip
    return zero, bars


def bar_chart(groups: dict[str, dict[str, float]], title: str, digits: int = 4) -> str:
    """Bars as markdown. ``groups``: group -> {series name: value}; one cluster of bars per group.

    One group: each bar's name under it. Several: the group's name under its cluster and the series' names,
    in their colours, on the title line. Each bar's value is written just above it (below, when negative)."""
    groups = {group: bars for group, bars in groups.items() if bars}
    if not groups:
        return _fitted([SVG_OPEN + _title_line(title, []) + _text(LEFT, 60, "no values") + "</svg>"], title)
    names = list(dict.fromkeys(name for bars in groups.values() for name in bars))

    def drawn(kept: dict[str, dict[str, float]], labels: bool) -> str:
        zero, bars = bar_geometry(kept)
        shown = title if len(kept) == len(groups) else f"{title} (last {len(kept)} of {len(groups)})"
        parts = [
            SVG_OPEN,
            _title_line(shown, names if len(kept) > 1 else []),
            f"<path d='M{LEFT},{zero:.0f}H{RIGHT}' stroke='#999'/>",
        ]
        for color in dict.fromkeys(bar["color"] for bar in bars):  # one path per colour: the cheapest form of many bars
            d = "".join(
                f"M{b['x']:.0f},{b['y']:.0f}h{b['width']:.0f}v{b['height']:.0f}h-{b['width']:.0f}z"
                for b in bars
                if b["color"] == color
            )
            parts.append(f"<path fill='{color}' d='{d}'/>")
        for b in bars:
            middle = b["x"] + b["width"] / 2
            if labels:
                above = b["y"] - 3 if b["value"] >= 0 else b["y"] + b["height"] + 10
                parts.append(_text(round(middle), round(above), number_label(b["value"], digits), "middle"))
            if len(kept) == 1:
                parts.append(_text(round(middle), BOTTOM + 13, b["name"], "middle"))
        if len(kept) > 1:
            slot = (RIGHT - LEFT) / len(kept)
            parts += [
                _text(round(LEFT + (g + 0.5) * slot), BOTTOM + 13, group, "middle") for g, group in enumerate(kept)
            ]
        return "".join(parts) + "</svg>"

    order = list(groups)
    candidates = (
        drawn({group: groups[group] for group in order[len(order) - k :]}, labels)
        for k in range(len(order), 0, -1) for labels in (True, False)
    )  # fmt: skip
    return _fitted(candidates, title)


PICTURE_SIDES = (128, 96, 64, 48, 32, 24)  # a picture's longest side in the page, tried largest first, until it fits
PICTURE_COLORS = (64, 16, 8)  # its palette, tried at each side: an eval picture is shown to be recognized, not measured


def picture_markdown(path: str | Path, caption: str) -> str:
    """A picture file with a caption under it, as markdown the asset page draws in place: the picture shrunk (its
    longest side at most one of ``PICTURE_SIDES``) to a PNG of one of ``PICTURE_COLORS`` colors in a data URI, the
    largest and most colorful that fits with the caption in ``MAX_MARKDOWN``. A picture too detailed to fit even at
    the smallest side is left out, and the caption says so; so is one that cannot be read."""
    import base64
    import io

    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as opened:
            picture = opened.convert("RGB")
    except (OSError, UnidentifiedImageError):
        return f"(picture {Path(path).name} cannot be read) {caption}"[:MAX_MARKDOWN]
    for side in PICTURE_SIDES:
        small = picture.copy()
        small.thumbnail((side, side))
        for colors in PICTURE_COLORS:
            png = io.BytesIO()
            small.quantize(colors).save(png, "PNG", optimize=True)
            markdown = f"![picture](data:image/png;base64,{base64.b64encode(png.getvalue()).decode()})\n\n{caption}"
            if len(markdown) <= MAX_MARKDOWN:
                return markdown
    return f"(picture {Path(path).name} too detailed to show here) {caption}"[:MAX_MARKDOWN]
