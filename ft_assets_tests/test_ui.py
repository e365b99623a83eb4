"""The Dagster UI in a real browser: the asset graph by plane, and an asset's metadata page.

``ft-assets run`` materializes the data plane on a fresh SQLite instance (what ``make demo`` does),
``dagster dev`` serves it (what ``make ui`` does), and headless Chromium (Debian's package, driven by
Playwright; no ``playwright install``) reads what the UI actually drew:

- the global asset lineage with every group expanded: one box per plane group of the definitions,
  each asset inside its group's box, and an arrow for every dependency of the definitions, read off
  the SVG geometry (an edge starts at its upstream node and ends at its downstream node);
- ``tokenized_shards``' page: the latest materialization's packing efficiency and row accounting,
  equal to what the CLI reported.

Screenshots land in ``test-artifacts/ui/``. ``FT_UPDATE_DOCS=1`` also writes the lineage graph to
``docs/lineage.png`` for the README.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from ft_assets.cli import main
from ft_assets.definitions import defs
from ft_assets_tests.pg import free_port

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "samples" / "toolcalls" / "part-000.jsonl"
SAMPLE_LINES = 300
ARTIFACTS = REPO / "test-artifacts" / "ui"
DOCS_LINEAGE = REPO / "docs" / "lineage.png"
PLANES = {"model", "control", "data", "training", "delivery"}  # the four planes' groups, and the base model that feeds them
DATA_LINEAGE = ["raw_dataset", "cleaned_dataset", "deduplicated_dataset", "train_eval_split", "tokenized_shards"]
INSTALL_HINT = "`make test` installs it (scripts/install-system-deps.sh)"
CHROMIUM_FLAGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync",
]
SERVER_TIMEOUT_S = 120.0
UI_TIMEOUT_MS = 60_000  # first paint of a page includes loading the code location on 2 busy cores
EDGE_TOUCH_PX = 12.0  # an edge ends this close to a node's box (Dagster leaves room for the arrowhead)


@pytest.fixture(scope="module")
def dagster_ui(tmp_path_factory, tiny_model_dir):
    """``dagster dev`` on an instance holding one data-plane materialization; yields (base URL, CLI summary)."""
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
            code = main(["run", "--dataset", str(data), "--name", "toolcalls", "--version", "ui1", "--until", "data",
                         "--config", str(config), "--json"])
        assert code == 0, "ft-assets run failed; see the captured log"
        summary = json.loads(out.read_text().strip().splitlines()[-1])

        from dagster._core.nux import set_nux_seen

        set_nux_seen()  # as if someone had dismissed the one-time "join the community" dialog

        port = free_port()
        log_path = root / "dagster-dev.log"
        with open(log_path, "w") as log:
            server = subprocess.Popen(
                [str(Path(sys.executable).parent / "dagster"), "dev", "-w", "workspace.yaml", "-h", "127.0.0.1", "-p", str(port)],
                cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,  # its code servers share the group
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
            yield url, summary
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
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=chromium, headless=True,
            args=CHROMIUM_FLAGS, viewport={"width": 1800, "height": 1000},
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


# The part of the page that holds the group boxes, with a margin: the README's picture of the graph.
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
    return (outer["x"] <= inner["x"] and inner["x"] + inner["w"] <= outer["x"] + outer["w"]
            and outer["y"] <= inner["y"] and inner["y"] + inner["h"] <= outer["y"] + outer["h"])


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
    url, _ = dagster_ui
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
        assert DOCS_LINEAGE.stat().st_size < 300_000, "docs/lineage.png should stay small for the README"

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
        for up, up_box in asset_boxes.items() if distance(edge["start"], up_box) <= EDGE_TOUCH_PX
        for down, down_box in asset_boxes.items() if down != up and distance(edge["end"], down_box) <= EDGE_TOUCH_PX
    }
    assert drawn_edges == edges, f"not drawn: {sorted(edges - drawn_edges)}; drawn, not in the definitions: {sorted(drawn_edges - edges)}"


def metadata_value(page, key: str) -> str:
    row = page.locator("tr", has=page.locator("td", has_text=re.compile(rf"^\s*{re.escape(key)}\s*$")))
    return row.first.locator("td").last.inner_text().strip()


def test_asset_page_shows_packing_efficiency_and_row_accounting(dagster_ui, page):
    url, summary = dagster_ui
    page.goto(f"{url}/assets/tokenized_shards")
    page.get_by_text("packing_efficiency", exact=True).wait_for()
    page.get_by_text(summary["partition"], exact=True).first.wait_for()  # latest materialization's partition

    assert float(metadata_value(page, "packing_efficiency")) == pytest.approx(summary["packing_efficiency"], abs=1e-4)
    assert metadata_value(page, "rows_in") == str(summary["rows_in"])
    accounting = metadata_value(page, "accounting")
    counts = [summary[k] for k in ("rows_in", "rows_kept", "rows_quarantined", "exact_duplicates", "near_duplicates")]
    assert [int(n) for n in re.findall(r"\d+", accounting)] == counts, accounting
    assert "holds" in accounting and "BROKEN" not in accounting
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "tokenized_shards.png"), full_page=True)
