"""The metadata charts (``ft_assets.plots``): SVG inside markdown that the asset page draws without a click.

Each chart is read back as the browser gets it (the data URI decoded and parsed as XML): it fits in the
markdown the UI draws in place, a curve spans its plot area, every bar is visible (a 0 included) and no
text sits on a bar.
"""

import math
import re

import pytest

from ft_assets.plots import (
    BOTTOM,
    LEFT,
    MAX_MARKDOWN,
    MAX_POINTS,
    MIN_BAR_PX,
    RIGHT,
    TOP,
    ChartTooLarge,
    bar_chart,
    downsample,
    line_chart,
    number_label,
)
from ft_assets_tests.charts import SVG, bars, curves, dots, overlaps, svg_of, text_boxes

LOSS = [(step, 7.5 * math.exp(-step / 40) + 0.05) for step in range(1, 100_001)]
EVALS = [(step, 7.5 * math.exp(-step / 40) + 0.06) for step in (20, 40, 80, 100_000)]  # 3 evals, then the final one
CHARTS = [  # (name, markdown)
    ("loss of 100,000 steps", line_chart({"train loss": LOSS}, "training loss 7.366 → 0.05", "step")),
    ("loss of one step", line_chart({"train loss": [(1, 2.3)]}, "training loss", "step")),
    ("flat loss", line_chart({"train loss": [(s, 0.5) for s in range(50)]}, "training loss", "step")),
    ("loss with NaN", line_chart({"train loss": [(1, 2.0), (2, float("nan")), (3, 1.0)]}, "training loss", "step")),
    ("no points", line_chart({"train loss": []}, "training loss", "step")),
    ("two curves of 20,000 steps", line_chart(
        {"reward mean": [(s, s / 1e4) for s in range(20_000)], "reward std": [(s, 1 - s / 4e4) for s in range(20_000)]},
        "rollout reward", "step")),
    ("tiny and huge values", line_chart({"x": [(0, 1e-9), (1, 3e9)]}, "range", "step")),
    ("eval with a base of 0", bar_chart({"exact_match": {"base": 0.0, "fine-tuned": 0.95, "shipped GGUF": 0.95}}, "exact_match on 20 eval answers")),
    ("a negative reward", bar_chart({"reward_mean": {"base": -0.5, "fine-tuned": 0.7, "shipped GGUF": 0.65}}, "reward_mean on 8 eval prompts")),
    ("cost of fractions of a cent", bar_chart({"cost": {"compute": 0.0123, "storage": 1.2e-7, "egress": 0.0}}, "training run cost, USD")),
    ("forty dataset versions", bar_chart(
        {f"support-chats@2026-11-{d:02d}": {"estimate": d / 100, "actual": d / 90} for d in range(1, 41)}, "estimate vs actual, USD")),
    ("no bars", bar_chart({}, "estimate vs actual, USD")),
    ("loss with its evals", line_chart({"train loss": LOSS}, "train_loss 0.05 (mean, last 10); eval_loss 0.06", "step",
                                       dots=("eval_loss", EVALS))),
    ("evals not named in the title", line_chart({"train loss": LOSS}, "training loss", "step", dots=("eval loss", EVALS))),
]  # fmt: skip


@pytest.mark.parametrize("name, markdown", CHARTS, ids=[name for name, _ in CHARTS])
def test_every_chart_fits_in_the_markdown_the_page_draws_in_place_and_parses(name, markdown):
    assert len(markdown) <= MAX_MARKDOWN < 1000, f"{name}: {len(markdown)} characters"
    svg = svg_of(markdown)
    assert svg.tag == f"{SVG}svg" and int(svg.get("width")) > 0 and int(svg.get("height")) > 0


def test_a_long_loss_history_is_drawn_across_the_plot_from_its_top_left_to_its_bottom_right():
    svg = svg_of(CHARTS[0][1])
    [curve] = curves(svg)
    assert 2 <= len(curve) <= MAX_POINTS
    assert curve[0][0] == LEFT and curve[-1][0] == RIGHT  # the whole run, first step to last
    assert curve[0][1] < curve[-1][1] and all(
        TOP <= y <= BOTTOM for _, y in curve
    )  # starts high, ends low (SVG y grows down)
    assert [y for _, y in curve] == sorted(y for _, y in curve)  # a falling loss stays falling once averaged
    labels = [text for text, *_ in text_boxes(svg)]
    assert "step 1e+05" in labels and "training loss 7.366 → 0.05" in labels


def test_evals_are_dots_on_the_curves_axes_named_in_their_colour():
    """The final eval sits at the curve's last step (the plot's right edge), each intermediate one at its own step; the
    dots' name is the title's part in their colour, or the line under the plot when the title does not say it."""
    charts = dict(CHARTS)
    svg = svg_of(charts["loss with its evals"])
    [curve], marks = curves(svg), dots(svg)
    assert len(curve) >= 16  # the dots cost the curve a few of its points, not most of them
    assert [x for x, _ in marks] == [LEFT, LEFT, LEFT, RIGHT]  # steps 20-80 of 100,000 are the left edge
    assert marks[-1][1] == BOTTOM and marks[0][1] < marks[1][1] < marks[2][1]  # the lowest loss at the bottom
    [path] = [p for p in svg.iter(f"{SVG}path") if p.get("stroke-width") == "4"]
    [named] = [t for t in svg.iter(f"{SVG}tspan")]
    assert named.text == "eval_loss" and named.get("fill") == path.get("stroke") != curve_stroke(svg)
    assert [text for text, *_ in text_boxes(svg)][0] == "train_loss 0.05 (mean, last 10); eval_loss 0.06"
    below = svg_of(charts["evals not named in the title"])
    assert not list(below.iter(f"{SVG}tspan")) and len(dots(below)) == 4
    assert [t.get("fill") for t in below.iter(f"{SVG}text") if "".join(t.itertext()) == "\u25a0 eval loss"] == [
        path.get("stroke")
    ]


def curve_stroke(svg) -> str:
    return next(svg.iter(f"{SVG}polyline")).get("stroke")


def test_two_curves_are_told_apart_by_colour_on_the_title_line():
    svg = svg_of(CHARTS[5][1])
    strokes = [p.get("stroke") for p in svg.iter(f"{SVG}polyline")]
    legend = {t.text: t.get("fill") for t in svg.iter(f"{SVG}text") if t.get("fill")}
    assert len(set(strokes)) == 2 and legend == {"reward mean": strokes[0], "reward std": strokes[1]}
    assert all(float(t.get("y")) < TOP for t in svg.iter(f"{SVG}text") if t.get("fill"))  # above the plot area


@pytest.mark.parametrize(
    "values",
    [
        {"base": 0.0, "fine-tuned": 0.95, "shipped GGUF": 0.95},
        {"base": 0.0, "fine-tuned": 0.0},
        {"base": -0.5, "fine-tuned": 0.7, "shipped GGUF": 0.65},
        {"compute": 0.0123, "storage": 1.2e-7, "egress": 0.0},
    ],
)
def test_every_bar_is_seen_and_no_text_sits_on_a_bar(values):
    svg = svg_of(bar_chart({"metric": values}, "a chart"))
    drawn = bars(svg)
    assert len(drawn) == len(values)
    assert all(height >= MIN_BAR_PX for *_, height in drawn), drawn  # a 0 is a stub on the zero line, not nothing
    largest = max(values.values(), key=abs)
    tallest = max(drawn, key=lambda bar: bar[3])
    assert drawn.index(tallest) == list(values.values()).index(largest)
    texts = text_boxes(svg)
    assert {number_label(v) for v in values.values()} <= {text for text, *_ in texts}  # each value written by its bar
    assert set(values) <= {text for text, *_ in texts}  # each bar's name under it
    for text, *box in texts:
        for x, y, width, height in drawn:
            assert not overlaps(box, (x, y, x + width, y + height)), f"{text!r} is drawn on a bar"


def test_many_groups_keep_the_latest_that_fit_and_say_so():
    svg = svg_of(CHARTS[10][1])
    [title] = [t.text for t in svg.iter(f"{SVG}text") if t.text.startswith("estimate vs actual")]
    kept = int(re.search(r"last (\d+) of 40", title).group(1))
    assert 1 <= kept < 40 and len(bars(svg)) == 2 * kept
    assert "support-chats@2026-11-40" in {t.text for t in svg.iter(f"{SVG}text")}  # the newest version is among them


def test_downsample_keeps_both_ends_averages_equal_runs_between_and_keeps_short_histories():
    assert downsample([(1, 4.0), (2, 2.0)], 8) == [(1, 4.0), (2, 2.0)]
    assert downsample([(s, float(s)) for s in range(1, 9)], 5) == [
        (1, 1.0),
        (2.5, 2.5),
        (4.5, 4.5),
        (6.5, 6.5),
        (8, 8.0),
    ]
    assert len(downsample(LOSS, 64)) == 64


@pytest.mark.parametrize(
    "value, digits, label",
    [(0.0, 4, "0"), (2 / 3, 4, "0.6667"), (7.366, 3, "7.37"), (1234.5678, 4, "1235"), (0.000123456, 4, "0.0001235"),
     (1.2e-7, 4, "1.20e-07"), (3e9, 4, "3.00e+09"), (-0.5, 4, "-0.5")],
)  # fmt: skip
def test_number_label(value, digits, label):
    assert number_label(value, digits) == label


def test_a_title_too_long_for_any_form_of_the_chart_is_refused_with_what_to_do():
    with pytest.raises(ChartTooLarge, match="shorten its title"):
        bar_chart({"m": {"base": 1.0}}, "x" * 1000)


def test_an_eval_picture_is_drawn_in_place_with_its_caption_shrunk_until_it_fits(tmp_path):
    """A shipped sample picture as it is; a noisy photo shrunk (or left out, said so) to fit; an unreadable file said."""
    import base64
    import io
    from pathlib import Path

    import numpy as np
    from PIL import Image

    from ft_assets.plots import picture_markdown

    sample = Path(__file__).parents[1] / "samples" / "shapes" / "images" / "0001.png"
    caption = "**What color is the shape?** · expected *red* · base: blue · fine-tuned: red ✓"
    drawn = picture_markdown(sample, caption)
    uri, text = re.fullmatch(r"!\[picture\]\(data:image/png;base64,([^)]+)\)\n\n(.*)", drawn, re.S).groups()
    shown = Image.open(io.BytesIO(base64.b64decode(uri)))
    original = Image.open(sample)
    assert text == caption and len(drawn) <= MAX_MARKDOWN and max(shown.size) <= 128
    assert shown.size[0] / shown.size[1] == pytest.approx(original.size[0] / original.size[1], rel=0.05)
    noisy = tmp_path / "photo.png"
    Image.fromarray(np.random.RandomState(0).randint(0, 255, (600, 800, 3), dtype=np.uint8)).save(noisy)
    drawn = picture_markdown(noisy, caption)
    assert len(drawn) <= MAX_MARKDOWN and drawn.endswith(caption)
    if drawn.startswith("![picture]"):  # random pixels compress badly: shrunk to the smallest side, or left out
        assert max(Image.open(io.BytesIO(base64.b64decode(drawn.split(",", 1)[1].split(")")[0]))).size) <= 48
    else:
        assert drawn.startswith("(picture photo.png too detailed to show here)")
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n")
    assert picture_markdown(tmp_path / "broken.png", caption) == f"(picture broken.png cannot be read) {caption}"
