"""The Dagster UI in a real browser: the asset graph by plane, and an asset's metadata page.

``ft-assets run`` materializes the data plane on a fresh SQLite instance (what ``make demo`` does:
the run is launched through the instance, no daemon), ``dagster dev`` serves it (what ``make ui``
does, from ``$DAGSTER_HOME``), and headless Chromium (Debian's package, driven by Playwright; no
``playwright install``) reads what the UI actually drew:

- the global asset lineage with every group expanded: one box per plane group of the definitions,
  each asset inside its group's box, and an arrow for every dependency of the definitions, read off
  the SVG geometry (an edge starts at its upstream node and ends at its downstream node);
- ``tokenized_shards``' page: the latest materialization's packing efficiency and row accounting,
  equal to what the CLI reported;
- each dataset's page: Dagster's "Row count" and "Columns" of its Parquet files as they lie in the
  store, and its headline numbers (sizes in MB, not bytes);
- the ``data_plane`` job's Runs tab: it lists the CLI's run, which re-executes as the same job version;
- how the asset page shows each kind of metadata value (``RENDERING``), on a probe asset: what shows
  without a click and what hides behind a "[Show Markdown]" link; among them the training plane's loss
  curve and the delivery plane's eval chart and answers, as their own functions build them (this
  fixture runs the data plane only), the eval chart's every bar drawn, its base of 0 included.

``dagster dev`` must not warn that a ``dagster.yaml`` in its folder "will not be used" (the repository's
top-level link is not where ``make ui`` runs it).

Screenshots land in ``test-artifacts/ui/``. ``FT_UPDATE_DOCS=1`` (``make docs-screenshots``) also writes the lineage
graph to ``docs/lineage.png`` (the README, the docs' home page) and the tokenized_shards asset page to
``docs/asset-page.png`` (the demo's page).
"""

import base64
import io
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq
import pytest
import yaml

from ft_assets.cli import main
from ft_assets.definitions import defs
from ft_assets.delivery.gate import dropped, gate, shipped
from ft_assets.delivery.assets import eval_metadata, shipped_metadata
from ft_assets.delivery.scoring import Report
from ft_assets.training.assets import loss_curve
from ft_assets_tests.charts import SVG, svg_of
from ft_assets_tests.pg import free_port

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "samples" / "toolcalls" / "part-000.jsonl"
SAMPLE_LINES = 300
ARTIFACTS = REPO / "test-artifacts" / "ui"
DOCS_LINEAGE = REPO / "docs" / "lineage.png"
DOCS_ASSET_PAGE = REPO / "docs" / "asset-page.png"  # an asset page leading with its numbers (docs/get-started/demo.md)
PLANES = {
    "model",
    "control",
    "data",
    "training",
    "delivery",
}  # the four planes' groups, and the base model that feeds them
DATA_LINEAGE = ["raw_dataset", "cleaned_dataset", "deduplicated_dataset", "train_eval_split", "tokenized_shards"]
INSTALL_HINT = "`make test` installs it (scripts/install-system-deps.sh)"
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SERVER_TIMEOUT_S = 120.0
UI_TIMEOUT_MS = 60_000  # first paint of a page includes loading the code location on 2 busy cores
EDGE_TOUCH_PX = 12.0  # an edge ends this close to a node's box (Dagster leaves room for the arrowhead)


@dataclass
class Served:
    url: str  # dagster dev's base URL
    summary: dict  # what `ft-assets run --json` reported
    log: Path  # dagster dev's output


@pytest.fixture(scope="module")
def dagster_ui(tmp_path_factory, tiny_model_dir):
    """``dagster dev`` on an instance holding one data-plane materialization, run by the CLI."""
    root = tmp_path_factory.mktemp("ui")
    data = root / "toolcalls.jsonl"
    data.write_text("".join(SAMPLE.read_text().splitlines(keepends=True)[:SAMPLE_LINES]))
    config = root / "run_config.yaml"
    config.write_text(yaml.safe_dump({"ops": {"base_model": {"config": {"source": str(tiny_model_dir)}}}}))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FT_HOME", str(root / "home"))
        mp.setenv("DAGSTER_HOME", str(root / "home" / "dagster_home"))
        mp.delenv("FT_STORE", raising=False)
        out = root / "summary.json"
        with open(out, "w") as stdout, pytest.MonkeyPatch.context() as mp_out:
            mp_out.setattr(sys, "stdout", stdout)
            code = main(
                [
                    "run",
                    "--dataset",
                    str(data),
                    "--name",
                    "toolcalls",
                    "--version",
                    "ui1",
                    "--until",
                    "data",
                    "--config",
                    str(config),
                    "--json",
                ]
            )
        assert code == 0, "ft-assets run failed; see the captured log"
        summary = json.loads(out.read_text().strip().splitlines()[-1])

        from dagster._core.nux import set_nux_seen

        set_nux_seen()  # as if someone had dismissed the one-time "join the community" dialog

        port = free_port()
        log_path = root / "dagster-dev.log"
        with open(log_path, "w") as log:
            server = subprocess.Popen(
                [
                    str(Path(sys.executable).parent / "dagster"),
                    "dev",
                    "-w",
                    str(REPO / "workspace.yaml"),
                    "-h",
                    "127.0.0.1",
                    "-p",
                    str(port),
                ],
                cwd=root / "home" / "dagster_home",
                stdout=log,  # from $DAGSTER_HOME, as `make ui` runs it
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its code servers share the group
            )
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + SERVER_TIMEOUT_S
            while True:
                assert server.poll() is None, f"dagster dev exited:\n{log_path.read_text()[-3000:]}"
                assert time.monotonic() < deadline, f"dagster dev not serving after {SERVER_TIMEOUT_S:.0f} s"
                try:
                    with urllib.request.urlopen(f"{url}/server_info", timeout=2) as response:
                        if response.status == 200:
                            break
                except OSError:
                    pass
                time.sleep(0.5)
            yield Served(url, summary, log_path)
        finally:
            if server.poll() is None:
                os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=30)


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(chromium).is_file():
        pytest.fail(f"Chromium not found (Debian package `chromium`): {INSTALL_HINT}")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")),
            executable_path=chromium,
            headless=True,
            args=CHROMIUM_FLAGS,
            viewport={"width": 1800, "height": 1000},
        )
        context.set_default_timeout(UI_TIMEOUT_MS)
        try:
            yield context.new_page()
        finally:
            context.close()


# What the graph drew, in the SVG's own coordinates: group boxes, asset boxes (with their possibly
# middle-truncated labels) and the start and end point of every edge.
READ_GRAPH_JS = """() => {
  const box = (fo) => ({x: +fo.getAttribute('x'), y: +fo.getAttribute('y'), w: +fo.getAttribute('width'), h: +fo.getAttribute('height')});
  const groups = [...document.querySelectorAll('svg foreignObject.group')].map((fo) => ({
    name: fo.querySelector('[data-tooltip]')?.getAttribute('data-tooltip'), box: box(fo)}));
  const assets = [...document.querySelectorAll('svg foreignObject')]
    .filter((fo) => fo.querySelector('[class*="AssetNode_assetName"]'))
    .map((fo) => ({label: fo.querySelector('[class*="AssetNode_assetName"]').textContent.trim(), box: box(fo)}));
  const edges = [...document.querySelectorAll('svg path[marker-end]')].map((p) => {
    const n = (p.getAttribute('d').match(/-?[0-9.]+/g) || []).map(Number);
    return {start: [n[0], n[1]], end: [n[n.length - 2], n[n.length - 1]]};
  });
  return {groups, assets, edges};
}"""


# The part of the page that holds the group boxes, with a margin: the docs' picture of the graph.
GROUPS_CLIP_JS = """() => {
  const r = [...document.querySelectorAll('svg foreignObject.group')].map((fo) => fo.getBoundingClientRect());
  const x = Math.max(Math.min(...r.map((b) => b.left)) - 16, 0), y = Math.max(Math.min(...r.map((b) => b.top)) - 16, 0);
  return {x, y, width: Math.max(...r.map((b) => b.right)) + 16 - x, height: Math.max(...r.map((b) => b.bottom)) + 16 - y};
}"""


def asset_for_label(label: str, names: set[str]) -> str:
    """The asset name a node label stands for; the UI shortens long names to ``start…end``."""
    if label in names:
        return label
    head, sep, tail = label.partition("…")
    matches = [n for n in names if sep and n.startswith(head) and n.endswith(tail)]
    assert len(matches) == 1, f"node label {label!r} matches {matches or 'no asset'}"
    return matches[0]


def distance(point, box) -> float:
    x, y = point
    dx = max(box["x"] - x, 0.0, x - (box["x"] + box["w"]))
    dy = max(box["y"] - y, 0.0, y - (box["y"] + box["h"]))
    return (dx * dx + dy * dy) ** 0.5


def inside(inner, outer) -> bool:
    return (
        outer["x"] <= inner["x"]
        and inner["x"] + inner["w"] <= outer["x"] + outer["w"]
        and outer["y"] <= inner["y"]
        and inner["y"] + inner["h"] <= outer["y"] + outer["h"]
    )


def expected_graph() -> tuple[dict[str, str], set[tuple[str, str]]]:
    """From the definitions: asset name → group, and every (upstream, downstream) dependency."""
    graph = defs.get_repository_def().asset_graph
    groups, edges = {}, set()
    for key in graph.get_all_asset_keys():
        node = graph.get(key)
        groups[key.to_user_string()] = node.group_name
        edges |= {(parent.to_user_string(), key.to_user_string()) for parent in node.parent_keys}
    return groups, edges


def test_lineage_graph_draws_every_plane_group_and_the_data_lineage(dagster_ui, page):
    url = dagster_ui.url
    groups, edges = expected_graph()
    assert set(groups.values()) <= PLANES, f"asset groups outside the four planes: {set(groups.values()) - PLANES}"
    assert set(zip(DATA_LINEAGE, DATA_LINEAGE[1:])) <= edges

    page.goto(f"{url}/asset-groups")  # "Global asset lineage"
    page.locator("svg foreignObject").first.wait_for()
    if page.locator('svg [aria-label="unfold_more"]').count():  # groups start collapsed
        page.keyboard.press("Alt+e")  # the graph's own shortcut: expand all groups
    names = page.locator('svg [class*="AssetNode_assetName"]')
    deadline = time.monotonic() + UI_TIMEOUT_MS / 1000
    while names.count() < len(groups):
        assert time.monotonic() < deadline, f"only {names.count()} of {len(groups)} asset nodes drawn"
        page.wait_for_timeout(250)
    page.wait_for_timeout(1000)  # let the layout animation settle before measuring and screenshotting
    drawn = page.evaluate(READ_GRAPH_JS)

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "lineage.png"))
    if os.environ.get("FT_UPDATE_DOCS") == "1":
        page.wait_for_timeout(3000)  # materialization status colours arrive after the layout
        page.add_style_tag(content="#zoom-slider-container { display: none; }")  # it overlaps the graph's edge
        DOCS_LINEAGE.parent.mkdir(exist_ok=True)
        page.screenshot(path=str(DOCS_LINEAGE), clip=page.evaluate(GROUPS_CLIP_JS))
        assert DOCS_LINEAGE.stat().st_size < 300_000, "docs/lineage.png should stay small for the README and the docs"

    group_boxes = {g["name"]: g["box"] for g in drawn["groups"]}
    assert set(group_boxes) == set(groups.values()), "one box per plane group of the definitions"
    asset_boxes = {}
    for node in drawn["assets"]:
        name = asset_for_label(node["label"], set(groups))
        assert name not in asset_boxes, f"{name} drawn twice"
        asset_boxes[name] = node["box"]
    assert set(asset_boxes) == set(groups)
    for name, group in groups.items():
        assert inside(asset_boxes[name], group_boxes[group]), f"{name} is not drawn inside its group {group}"

    drawn_edges = {
        (up, down)
        for edge in drawn["edges"]
        for up, up_box in asset_boxes.items()
        if distance(edge["start"], up_box) <= EDGE_TOUCH_PX
        for down, down_box in asset_boxes.items()
        if down != up and distance(edge["end"], down_box) <= EDGE_TOUCH_PX
    }
    assert drawn_edges == edges, (
        f"not drawn: {sorted(edges - drawn_edges)}; drawn, not in the definitions: {sorted(drawn_edges - edges)}"
    )


def metadata_value(page, key: str) -> str:
    row = page.locator("tr", has=page.locator("td", has_text=re.compile(rf"^\s*{re.escape(key)}\s*$")))
    return row.first.locator("td").last.inner_text().strip()


def test_asset_page_shows_packing_efficiency_and_row_accounting(dagster_ui, page):
    url, summary = dagster_ui.url, dagster_ui.summary
    page.goto(f"{url}/assets/tokenized_shards")
    page.get_by_text("packing_efficiency", exact=True).wait_for()
    page.get_by_text(summary["partition"], exact=True).first.wait_for()  # latest materialization's partition

    assert float(metadata_value(page, "packing_efficiency")) == pytest.approx(summary["packing_efficiency"], abs=1e-4)
    assert metadata_value(page, "rows_in") == str(summary["rows_in"])
    cell = (
        page.locator("tr", has=page.locator("td", has_text=re.compile(r"^\s*accounting\s*$"))).first.locator("td").last
    )
    cell.get_by_text(
        re.compile(r"holds|DOES NOT HOLD")
    ).first.wait_for()  # markdown renders after the table (seen empty under load)
    accounting = cell.inner_text().strip()
    counts = [summary[k] for k in ("rows_in", "rows_kept", "rows_quarantined", "exact_duplicates", "near_duplicates")]
    assert [int(n) for n in re.findall(r"\d+", accounting)] == counts, accounting
    assert "holds" in accounting and "BROKEN" not in accounting
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "tokenized_shards.png"), full_page=True)
    if os.environ.get("FT_UPDATE_DOCS") == "1":
        page.screenshot(path=str(DOCS_ASSET_PAGE))
        assert DOCS_ASSET_PAGE.stat().st_size < 300_000, "docs/asset-page.png should stay small for the docs"


def test_make_ui_does_not_warn_about_a_dagster_yaml_it_will_not_use(dagster_ui):
    assert "will not be used" not in dagster_ui.log.read_text()


def test_the_jobs_runs_tab_lists_the_clis_run_and_it_re_executes_as_the_same_job(dagster_ui, page):
    url, summary = dagster_ui.url, dagster_ui.summary
    [run_id] = summary["runs"]["data"]
    page.goto(f"{url}/locations/ft_assets/jobs/data_plane/runs")
    page.get_by_text(run_id[:8], exact=True).wait_for()  # the list shows a run by its id's first 8 characters
    assert page.locator(f'a[href="/runs/{run_id}"]').count() >= 1
    listed = page.inner_text("body")
    assert (
        f"partition: {summary['partition']}" in listed
        and "ft/launched-by: ft-assets-cli" in listed
        and "Success" in listed
    )
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "data_plane_runs.png"))

    page.goto(f"{url}/runs/{run_id}")
    button = page.get_by_role("button", name=re.compile(r"^Re-execute all"))
    button.wait_for()
    # An in-process run's button carries a warning: "The job "data_plane" may be a different version from the original pipeline run."
    assert button.is_enabled() and button.locator('[aria-label="warning"]').count() == 0


def test_each_dataset_page_shows_its_row_count_columns_and_size_in_mb(dagster_ui, page):
    for asset in DATA_LINEAGE:
        folder = Path(dagster_ui.summary["artifacts"][asset])  # the local store: the artifact's folder
        tables = sorted(
            p for p in folder.glob("*.parquet") if not p.name.startswith(("quarantine", "duplicates"))
        )  # the rows' parts
        rows, columns = sum(pq.ParquetFile(p).metadata.num_rows for p in tables), pq.read_schema(tables[0]).names
        page.goto(f"{dagster_ui.url}/assets/{asset}")
        row_count = page.locator("div", has=page.get_by_text("Row count", exact=True)).last
        row_count.wait_for()
        assert row_count.inner_text().split()[-1] == f"{rows:,}", asset  # Dagster's Overview shows dagster/row_count
        for column in columns:  # ... and dagster/column_schema in its "Columns" section
            page.get_by_text(column, exact=True).first.wait_for(timeout=10_000)
        assert float(metadata_value(page, "size_mb")) > 0 and page.get_by_text("bytes", exact=True).count() == 0, asset
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "tokenized_shards_overview.png"), full_page=True)


# How the asset page shows a materialization's metadata, by kind of value (Dagster 1.13, the webserver's
# ui-core/src/metadata/MetadataEntry.tsx; the asset's Overview and its Events view both pass
# expandSmallValues): numbers and text as they are, floats unrounded; tables always inline; JSON and
# markdown inline under 1,000 characters, else behind a "[Show JSON]" / "[Show Markdown]" link to a
# dialog. Images in markdown may be data: URIs. So a chart shows without a click only as markdown under
# 1,000 characters (an SVG data URI, ``ft_assets.plots``), never as a matplotlib PNG (tens of kB).
PROBE = "ui_metadata_probe"
SVG_CURVE = (
    "<svg xmlns='http://www.w3.org/2000/svg' width='240' height='60'><polyline fill='none' stroke='#4a78d6' "
    "stroke-width='2' points='0,5 30,20 60,32 90,41 120,47 150,52 180,54 210,55 240,56'/></svg>"
)
WORDS_999 = ("loss " * 200)[:999]


def png_chart() -> str:
    """A matplotlib line chart as a base64 PNG in markdown: how the charts were drawn before ``ft_assets.plots``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot([1, 2, 3], [2.0, 1.0, 0.5])
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=96)
    plt.close(fig)
    return f"![loss](data:image/png;base64,{base64.b64encode(buffer.getvalue()).decode()})"


# The training and delivery planes' charts and answers, as their own functions build them for a long run
# whose base model scores 0: this fixture runs the data plane only, so they are shown on the probe.
LOSS_CURVE = loss_curve([(step, 7.5 * math.exp(-step / 300) + 0.05) for step in range(1, 5001)])
EVAL = eval_metadata(
    gate("exact_match", 0.0, 0.95, 0.1, {"gguf": shipped("toolcalls-ui1-f16.gguf", "f16", 0.9, 0.95, 0.1),
                                         "mlx": dropped("MLX export is off (mlx_model variants: [])", 0.05)}),
    Report({"base_eval_loss": 7.5, "finetuned_eval_loss": 0.08}, [], [
        {"prompt": "set a timer", "reference": "ok", "base": "hm", "fine-tuned": "ok", "correct": True, "exact_match": 1.0,
         "source": "a:1"},  # as ChatScorer.report makes them
    ], {}, ""),
    20, "eval conversations", "/store/runs/toolcalls/ui1/delivery/r1/eval/answers.jsonl",
)  # fmt: skip
RENDERING = [  # (label, value, how it shows: "text" as written / "table" / "image" drawn / "link" to click)
    ("a_float", dg.MetadataValue.float(2 / 3), "text", "0.6666666666666666"),
    ("an_int", dg.MetadataValue.int(771636891), "text", "771636891"),
    ("a_text_sparkline", dg.MetadataValue.text("2.31 ▇▆▅▄▃▂▂▁ 0.05"), "text", "2.31 ▇▆▅▄▃▂▂▁ 0.05"),
    ("a_small_json", dg.MetadataValue.json({"lora_r": 8}), "text", '{\n  "lora_r": 8\n}'),
    ("a_table", dg.MetadataValue.table([dg.TableRecord({"prompt": "set a timer", "correct": True})],
                                       dg.TableSchema([dg.TableColumn("prompt"), dg.TableColumn("correct", "bool")])), "table", "set a timer\ttrue"),
    ("markdown_999_chars", dg.MetadataValue.md(WORDS_999), "text", WORDS_999.strip()),
    ("markdown_1000_chars", dg.MetadataValue.md(WORDS_999 + "s"), "link", "[Show Markdown]"),
    ("svg_chart_in_markdown", dg.MetadataValue.md(f"![loss](data:image/svg+xml,{urllib.parse.quote(SVG_CURVE)})"), "image", ""),
    ("lora_adapter_loss_curve", dg.MetadataValue.md(LOSS_CURVE), "image", ""),
    ("eval_report_chart", EVAL["chart"], "image", ""),
    ("eval_report_answers", EVAL["answers"], "table", "correct"),
    ("png_chart_in_markdown", dg.MetadataValue.md(png_chart()), "link", "[Show Markdown]"),
]  # fmt: skip

# The colour of the drawn image at each point, read back from a canvas at the image's own size.
PIXELS_JS = """(img, points) => {
  const canvas = document.createElement('canvas');
  canvas.width = img.naturalWidth; canvas.height = img.naturalHeight;
  const g = canvas.getContext('2d'); g.drawImage(img, 0, 0);
  return points.map(([x, y]) => Array.from(g.getImageData(x, y, 1, 1).data.slice(0, 3)));
}"""


@pytest.fixture(scope="module")
def probe(dagster_ui) -> str:
    """The probe asset's page, after one materialization event carrying ``RENDERING``'s values."""
    with dg.DagsterInstance.get() as instance:  # the instance the UI serves
        instance.report_runless_asset_event(
            dg.AssetMaterialization(asset_key=PROBE, metadata={label: value for label, value, _, _ in RENDERING})
        )
    return f"{dagster_ui.url}/assets/{PROBE}?view=events"  # no definition: the latest event's metadata


def test_what_the_asset_page_shows_without_a_click_by_kind_of_metadata(probe, page):
    page.goto(probe)
    page.get_by_text(RENDERING[-1][0], exact=True).wait_for()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "metadata_rendering.png"), full_page=True)
    for label, _, shows, text in RENDERING:
        value = probe_value(page, label)
        if shows == "image":
            image = value.locator("img")
            image.wait_for()
            assert image.evaluate("img => img.complete && img.naturalWidth") > 0, f"{label}: the chart is not drawn"
            value.screenshot(path=str(ARTIFACTS / f"{label}.png"))
        else:
            assert value.locator("img").count() == 0, label
            assert (value.locator("table").count() > 0) == (shows == "table"), label
            assert text in value.inner_text(), f"{label}: {value.inner_text()[:200]!r}"
    dialog_chart = page.locator("tr", has=page.locator("td", has_text="png_chart_in_markdown")).get_by_text(
        "[Show Markdown]"
    )
    dialog_chart.click()
    drawn = page.locator('img[src^="data:image/png"]')
    drawn.wait_for()
    assert drawn.evaluate("img => img.naturalWidth") > 0  # the PNG is drawn once the dialog opens


def probe_value(page, label: str):
    """The value cell of the probe's metadata row ``label``."""
    return (
        page.locator("tr", has=page.locator("td", has_text=re.compile(rf"^\s*{label}\s*$"))).first.locator("td").nth(1)
    )


def test_the_eval_chart_draws_every_bar_on_the_page_its_base_of_0_included(probe, page):
    svg = svg_of(EVAL["chart"].value)
    bars = [(path.get("fill"), match) for path in svg.iter(f"{SVG}path") if path.get("fill")
            for match in re.finditer(r"M(\d+),(\d+)h(\d+)v(\d+)", path.get("d"))]  # fmt: skip
    assert len(bars) == 3
    centres = [[int(m[1]) + int(m[3]) // 2, int(m[2]) + int(m[4]) // 2] for _, m in bars]
    page.goto(probe)
    image = probe_value(page, "eval_report_chart").locator("img")
    image.wait_for()
    drawn = image.evaluate(PIXELS_JS, centres)
    expected = [[int(c * 2, 16) for c in fill[1:]] for fill, _ in bars]  # '#37c' -> [51, 119, 204]
    for (fill, _), pixel, colour in zip(bars, drawn, expected):
        assert max(abs(a - b) for a, b in zip(pixel, colour)) <= 8, f"bar {fill} is not drawn: {pixel} at its centre"


# --- the pages users read (issue 35): each value as its own function builds it, on probe assets of their own -----

PAGES_PROBE, EVAL_PROBE, PUBLISHED_PROBE = "ui_pages_probe", "ui_eval_report_probe", "ui_published_model_probe"
STORE_ROOT = "/home/user/ft-assets/var/store"
SIXTY = [  # 60 answers as ChatScorer.report makes them: 40 right, then 20 wrong (the eval split's order)
    {"prompt": f"set a timer for {i} minutes", "reference": '{"name": "set_timer"}', "base": "Sure!",
     "fine-tuned": '{"name": "set_timer"}' if i < 40 else '{"name": "create_timer"}', "correct": i < 40,
     "exact_match": 1.0 if i < 40 else 0.0, "source": f"part-000.jsonl:{i + 1}"}
    for i in range(60)
]  # fmt: skip
EVAL_PAGE = eval_metadata(
    gate("exact_match", 1 / 6, 2 / 3, 0.1, {"gguf": shipped("toolcalls-ui1-q8_0.gguf", "q8_0", 2 / 3, 2 / 3, 0.05),
                                            "mlx": dropped("MLX export is off (mlx_model variants: [])", 0.05)}),
    Report({"base_eval_loss": 2.048893, "finetuned_eval_loss": 0.051501},
           [{"": "exact_match", "base": 0.167, "fine-tuned": 0.667, "GGUF q8_0 (llama.cpp)": 0.667},
            {"": "eval loss", "base": 2.049, "fine-tuned": 0.0515, "GGUF q8_0 (llama.cpp)": None}], SIXTY, {}, ""),
    60, "eval conversations", f"{STORE_ROOT}/runs/toolcalls/ui1/delivery/96e5c3fdc1495bb9/eval/answers.jsonl",
)  # fmt: skip


PUBLISHED_PAGE = shipped_metadata(
    gate(
        "exact_match",
        1 / 6,
        2 / 3,
        0.1,
        {
            "gguf": shipped("toolcalls-ui1-q8_0.gguf", "q8_0", 2 / 3, 2 / 3, 0.05),
            "mlx": dropped("MLX export is off (mlx_model variants: [])", 0.05),
        },
    ),
    {"gguf": {"files": {"toolcalls-ui1-q8_0.gguf": {"bytes": 144_800_000}}}},
)


def pages_values() -> dict:
    """The loss curve and figures of lora_adapter, training_cost's pricing of a CPU run, and the wide tables (the VRAM
    breakdown and the GPU candidates of a 7B plan, the GGUF files, the published model's lineage)."""
    from ft_assets.cli.plan import plan_request
    from ft_assets.control.assets import candidates_table, pricing_line, vram_table
    from ft_assets.control.cost_model import CostModel
    from ft_assets.control.gpu_plan import plan_training
    from ft_assets.control.planner import ModelShape
    from ft_assets.delivery.assets import lineage_table
    from ft_assets.delivery.exports.gguf import rows as gguf_rows
    from ft_assets.materialize import table
    from ft_assets.storage import LocalStore
    from ft_assets.training.assets import adapter_metadata
    from ft_assets.training.config import TrainingConfig
    from ft_assets_tests.reference_models import REFERENCE_CONFIGS

    shape = ModelShape.from_config(REFERENCE_CONFIGS["Llama-2-7B"], "Llama-2-7B")
    plan = plan_training(
        plan_request(shape, "lora", 2048, 10_000_000, TrainingConfig(gradient_checkpointing=True)), CostModel(),
        "experiment", None,
    )  # fmt: skip
    check = {"rel_error": 0.0481234, "top1_agreement": 0.9333, "kl_divergence": 0.00781, "greedy_match": 3,
             "greedy_prompts": 5, "greedy_near_ties": 1, "tokens_match": True}  # fmt: skip
    files = {
        f"toolcalls-sample-v1-{q}.gguf": {"qtype": q, "bytes": size, "sha256": "0" * 64, "tensor_types": types,
                                          "llamacpp": check, "transformers": {"rel_error": 0.0019}}
        for q, size, types in [("f16", 270_900_000, {"F16": 211, "F32": 61}),
                               ("q4_k_m", 105_500_000, {"Q5_0": 166, "F32": 61, "Q4_K": 16, "Q8_0": 15, "Q6_K": 14})]
    }  # fmt: skip
    run = "runs/toolcalls/sample-v1"
    lineage = {"artifacts": [{"asset": a, "digest": "0123456789abcdef" * 4, "key": f"{run}/{p}"} for a, p in
                             [("tokenized_shards", "data/shards"), ("lora_adapter", "train/96e5c3fdc1495bb9/final"),
                              ("gguf_model", "delivery/96e5c3fdc1495bb9/gguf"), ("eval_report", "delivery/96e5c3fdc1495bb9/eval")]]}  # fmt: skip
    history = [(step, 2.589 * math.exp(-step / 8) + 0.02 + 0.03 * (step % 3)) for step in range(1, 41)]
    stats = {"method": "lora", "objective": "sft", "device": "cpu x1", "steps": 40, "train_loss": 0.04821,
             "eval_loss": 0.0515, "eval_metrics": {"eval_loss": 0.0515}, "tokens_seen": 40960, "tokens_per_second": 424.0,
             "wall_seconds": 430.984, "effective_training_fraction": 0.74, "resumed_from_step": None,
             "attn_implementation": "sdpa", "resolved": {"method": "lora"}, "checkpoints": [], "run_id": "r1",
             "figure_history": [], "train_loss_window": 10,
             "worker_image": {"digest": "sha256:" + "ab" * 32, "reference": None, "source": "FT_IMAGE_DIGEST",
                              "base": "python:3.11-slim", "ft_assets": "0.1.0", "torch": "2.13.0+cpu",
                              "packages_sha256": "cd" * 32, "reason": None}}  # fmt: skip
    return {
        **{
            k: v for k, v in adapter_metadata(stats, history, [(20, 0.09)]).items() if k in ("train_loss", "loss_curve")
        },
        "pricing": pricing_line("cpu x1", "rtx4090-24gb", "spot", 0.35, declared=False),
        "vram": vram_table(plan.vram),
        "candidates": candidates_table(plan.candidate_rows()),
        "gguf_files": table(gguf_rows(files, "toolcalls-sample-v1-q4_k_m.gguf")),
        "lineage": lineage_table(LocalStore(STORE_ROOT), lineage),
    }


@pytest.fixture(scope="module")
def pages(dagster_ui) -> dict[str, str]:
    """The two probes' pages, after one materialization event each."""
    with dg.DagsterInstance.get() as instance:
        instance.report_runless_asset_event(dg.AssetMaterialization(asset_key=EVAL_PROBE, metadata=EVAL_PAGE))
        instance.report_runless_asset_event(dg.AssetMaterialization(asset_key=PAGES_PROBE, metadata=pages_values()))
        instance.report_runless_asset_event(dg.AssetMaterialization(asset_key=PUBLISHED_PROBE, metadata=PUBLISHED_PAGE))
    return {name: f"{dagster_ui.url}/assets/{name}?view=events" for name in (EVAL_PROBE, PAGES_PROBE, PUBLISHED_PROBE)}


def metadata_text(page) -> str:
    """Everything the metadata section of the open event says, as text."""
    return page.locator("table").first.inner_text()


def test_eval_answers_are_a_short_sample_wrong_first_and_the_full_table_is_in_the_store(pages, page):
    page.goto(pages[EVAL_PROBE])
    answers = probe_value(page, "answers")
    answers.locator("table").wait_for()
    page.screenshot(path=str(ARTIFACTS / "eval_report_page.png"), full_page=True)
    rows = answers.locator("tbody tr")
    assert rows.count() == 8  # of 60: ~6,500 px of table before
    assert answers.bounding_box()["height"] < 1000
    cells = [rows.nth(i).locator("td").nth(4).inner_text().strip() for i in range(8)]
    assert cells == ["false"] * 8  # the wrong answers first
    assert "8 of 60, the wrong ones first" in probe_value(page, "answers_shown").inner_text()
    assert probe_value(page, "all_answers").inner_text().strip().endswith("/eval/answers.jsonl")


def test_each_eval_figure_shows_once_at_one_precision(pages, page):
    page.goto(pages[EVAL_PROBE])
    probe_value(page, "comparison").locator("table").wait_for()
    text = metadata_text(page)
    assert text.count("0.667") == 2  # the table's fine-tuned and shipped cells, nowhere else
    assert "0.6667" not in text and "0.66666" not in text
    assert text.count("2.049") == 1 and "2.0489" not in text  # the base's eval loss, once
    labels = [t.text for t in svg_of(EVAL_PAGE["chart"].value).iter(f"{SVG}text")]
    assert "0.667" in labels and "0.6667" not in labels  # the chart writes the metric as the table does


def test_published_model_says_its_result_once(pages, page):
    page.goto(pages[PUBLISHED_PROBE])
    result = probe_value(page, "result")
    result.wait_for()
    assert result.inner_text().strip() == (
        "exact_match: base 0.167 → fine-tuned 0.667 → shipped q8_0 GGUF 0.667 (no MLX shipped)"
    )
    text = metadata_text(page)
    assert text.count("0.667") == 2 and "0.6667" not in text  # the result line's two, no row repeating them


def test_the_loss_curve_names_the_train_loss_beside_it_as_what_it_is(pages, page):
    page.goto(pages[PAGES_PROBE])
    image = probe_value(page, "loss_curve").locator("img")
    image.wait_for()
    assert probe_value(page, "train_loss").inner_text().strip() == "0.04821"
    assert image.get_attribute("alt") == "train_loss 0.04821 (mean, last 10); eval_loss 0.0515"
    assert image.evaluate("img => img.complete && img.naturalWidth") > 0


def test_training_cost_says_a_cpu_run_is_priced_as_if_on_the_plans_tier(pages, page):
    page.goto(pages[PAGES_PROBE])
    said = probe_value(page, "pricing")
    said.wait_for()
    assert said.inner_text().startswith(
        "trained on cpu, priced as if on rtx4090-24gb (spot) at $0.35/h, the plan's tier"
    )


# The right edge of a metadata value, and of the nearest box that clips it (the event panel scrolls nothing sideways).
CLIPPED_JS = """(cell) => {
  let box = cell.parentElement;
  while (box && !['hidden', 'auto', 'scroll', 'clip'].includes(getComputedStyle(box).overflowX)) box = box.parentElement;
  const content = [...cell.querySelectorAll('*')].reduce((r, e) => Math.max(r, e.getBoundingClientRect().right), 0);
  return {content, box: box ? box.getBoundingClientRect().right : window.innerWidth};
}"""


@pytest.mark.parametrize("label", ["vram", "candidates", "gguf_files", "lineage"])
def test_wide_values_fit_the_panel(pages, page, label):
    page.goto(pages[PAGES_PROBE])
    value = probe_value(page, label)
    value.locator("table").wait_for()
    edges = value.evaluate(CLIPPED_JS)
    value.screenshot(path=str(ARTIFACTS / f"wide_{label}.png"))
    assert edges["content"] <= edges["box"] + 1, f"{label} runs {edges['content'] - edges['box']:.0f} px past the panel"
