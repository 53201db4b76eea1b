"""Every canvas workflow opens with its Note and all its nodes in sight, in both frontends the pack supports.

The frontend restores a workflow's saved view (extra.ds): a canvas point p lands on the canvas element at
(p + offset) * scale. What the frontends float over the canvas was measured in headless Chromium (Debian's
chromium driven by Playwright, fresh profile and server, default settings) with ComfyUI 0.3.64, which serves
frontend 1.27.10, and ComfyUI 0.8.0, which serves 1.35.9: the element rectangles from the DOM, the floating
panels from document.elementFromPoint on a 4 px grid (rounded outwards to it). Window coordinates in px,
(left, top, right, bottom).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import workflow_check as wc  # noqa: E402
from fewstep_workflows.graph import MIN_SCALE, Graph, to_ui  # noqa: E402

UI_FILES = sorted(p for p in (wc.ROOT / "workflows").glob("*.json") if not p.name.endswith(".api.json"))
WINDOWS = [(1600, 900), (1920, 1080)]


def frontend_1_27_10(width: int, height: int) -> tuple[tuple, dict]:
    """ComfyUI 0.3.64's frontend: the canvas element (#graph-canvas) sits below the 78 px top menu (tabs, menu
    bar and Run toolbar: .comfyui-body-top) and right of the 64 px sidebar (.comfyui-body-left); the minimap
    (.minimap-main-container, 250x200) and the zoom controls float in its bottom-right corner."""
    canvas = (64, 78, width, height)
    panels = {
        "minimap": (width - 294, height - 266, width - 44, height - 66),
        "zoom controls": (width - 320, height - 60, width - 16, height - 16),
    }
    return canvas, panels


def frontend_1_35_9(width: int, height: int) -> tuple[tuple, dict]:
    """ComfyUI 0.8.0's frontend: the canvas element spans the whole window and everything floats over it: the
    workflow tabs (.workflow-tabs-container, 38 px), the row below them down to y 90 that holds the breadcrumb
    (the workflow's name at the left, as wide as the name) and the Run toolbar (.actionbar-container, 331 px at
    the right), the sidebar (.side-toolbar-container, 59 px), the minimap (253x200) and the zoom controls."""
    canvas = (0, 0, width, height)
    panels = {
        "workflow tabs": (0, 0, width, 38),
        "breadcrumb and Run toolbar": (0, 38, width, 90),
        "sidebar": (0, 38, 59, height),
        "minimap": (width - 257, height - 258, width - 4, height - 58),
        "zoom controls": (width - 256, height - 52, width - 4, height - 4),
    }
    return canvas, panels


FRONTENDS = {"1.27.10 (ComfyUI 0.3.64)": frontend_1_27_10, "1.35.9 (ComfyUI 0.8.0)": frontend_1_35_9}
# Drawn above a node's pos, in canvas units: LiteGraph's title bar (node.getBounding() starts 30 above pos in both
# frontends) and 1.27.10's node-source badge over the title's right end (17 px at scale 0.8: 21 units, say 24).
TITLE_AND_BADGE = 30 + 24
# The lowest scale measured at which both frontends still draw the nodes' text (canvas.low_quality false after a
# draw at 0.59, true at 0.57: their 8 px minimum font size over 14 px text)
FULL_QUALITY_FROM = 0.59


def screen_box(node: dict, ds: dict, origin: tuple[int, int]) -> tuple[float, float, float, float]:
    (x, y), (w, h) = node["pos"], node["size"]
    scale, (dx, dy) = ds["scale"], ds["offset"]
    return (
        origin[0] + (x + dx) * scale,
        origin[1] + (y - TITLE_AND_BADGE + dy) * scale,
        origin[0] + (x + w + dx) * scale,
        origin[1] + (y + h + dy) * scale,
    )


def overlaps(a, b) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def hidden_parts(workflow: dict, frontend, window: tuple[int, int]) -> list[str]:
    canvas, panels = frontend(*window)
    problems = []
    for node in workflow["nodes"]:
        box = screen_box(node, workflow["extra"]["ds"], canvas[:2])
        name = f"{node['title']!r} at {[round(v) for v in box]}"
        if not (canvas[0] <= box[0] and canvas[1] <= box[1] and box[2] <= canvas[2] and box[3] <= canvas[3]):
            problems.append(f"{name} reaches outside the canvas {canvas}")
        problems += [
            f"{name} is under the {panel} {rect}" for panel, rect in panels.items() if overlaps(box, rect)
        ]
    return problems


@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"{w[0]}x{w[1]}")
@pytest.mark.parametrize("frontend", FRONTENDS, ids=lambda f: f.split()[0])
@pytest.mark.parametrize("path", UI_FILES, ids=lambda p: p.name)
def test_saved_view_shows_every_node_and_the_note(path, frontend, window):
    workflow = json.loads(path.read_text())
    assert any(n["type"] == "Note" for n in workflow["nodes"])
    assert hidden_parts(workflow, FRONTENDS[frontend], window) == []


@pytest.mark.parametrize("path", UI_FILES, ids=lambda p: p.name)
def test_saved_view_draws_the_nodes_text(path):
    assert json.loads(path.read_text())["extra"]["ds"]["scale"] >= MIN_SCALE >= FULL_QUALITY_FROM


def test_a_node_behind_a_panel_is_found():
    """The check itself: the old saved view (scale 0.8, offset 420, 80) put the Note at x 32 under 1.35.9's
    sidebar, and a node at the top right under its Run toolbar."""
    note = {"title": "About this workflow", "pos": [-380, 0], "size": [340, 440]}
    top_right = {"title": "Save image", "pos": [1520, 0], "size": [340, 420]}
    workflow = {"nodes": [note, top_right], "extra": {"ds": {"scale": 0.8, "offset": [420, 80]}}}
    problems = hidden_parts(workflow, FRONTENDS["1.35.9 (ComfyUI 0.8.0)"], (1600, 900))
    assert any("'About this workflow'" in p and "sidebar" in p for p in problems)
    assert any("'Save image'" in p and "Run toolbar" in p for p in problems)
    assert hidden_parts(workflow, FRONTENDS["1.27.10 (ComfyUI 0.3.64)"], (1600, 900)) == [
        "'Save image' at [1616, 99, 1888, 478] reaches outside the canvas (64, 78, 1600, 900)"
    ]


def test_the_builder_refuses_a_graph_too_wide_to_show():
    g = Graph("too_wide", wc.node_specs())
    for col in range(1, 8):
        g.add("FewStepSchedule", f"Schedule {col}", col, schedule="flux.1-schnell", steps=4)
    g.note = "Seven columns of nodes and the Note."
    with pytest.raises(ValueError, match="too_wide: the graph does not fit a 1600x900 window at scale 0.62"):
        to_ui(g)


# Nodes the frontend draws taller than their saved size (it grows a node to fit its widgets, never shrinks one):
# the file combos with an upload button, measured in both frontends on workflows that saved them smaller
# (LoadImage 80 -> 102, LoadVideo 58 -> 82). The boxes above use the saved size, so it must not be smaller.
DRAWN_HEIGHT = {"LoadImage": 102, "LoadVideo": 82}


def test_saved_sizes_hold_what_the_frontend_draws():
    found = [
        (p.name, n) for p in UI_FILES for n in json.loads(p.read_text())["nodes"] if n["type"] in DRAWN_HEIGHT
    ]
    assert {n["type"] for _, n in found} == set(DRAWN_HEIGHT)
    assert [(name, n["title"]) for name, n in found if n["size"][1] < DRAWN_HEIGHT[n["type"]]] == []
