"""A workflow graph and its two ComfyUI formats: nodes added by input name, laid out in columns, written as
the canvas (UI) format and the API format, plus the registry the ``@workflow`` decorator fills."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .nodes import InputSpec, NodeSpec

COL_WIDTH, GAP, NODE_WIDTH = 380, 40, 340
SLOT_H, WIDGET_H, TEXT_H, TITLE_H = 22, 26, 110, 36


# Download locations as ComfyUI's own workflow templates give them (the frontend offers them when missing).
MODELS = {
    "flux1-dev.safetensors": (
        "diffusion_models",
        "https://huggingface.co/black-forest-labs/FLUX.1-dev/resolve/main/flux1-dev.safetensors",
    ),
    "flux1-schnell.safetensors": (
        "diffusion_models",
        "https://huggingface.co/Comfy-Org/flux1-schnell/resolve/main/flux1-schnell.safetensors",
    ),
    "ae.safetensors": (
        "vae",
        "https://huggingface.co/Comfy-Org/Lumina_Image_2.0_Repackaged/resolve/main/split_files/vae/ae.safetensors",
    ),
    "clip_l.safetensors": (
        "text_encoders",
        "https://huggingface.co/comfyanonymous/flux_text_encoders/resolve/main/clip_l.safetensors",
    ),
    # The tiny autoencoders as safetensors on huggingface.co (the dialog offers no .pth and nothing from github.com):
    # madebyollin's own taef1 / taef2 repos (diffusers' AutoencoderTiny key names, both halves in one file; the
    # taef1 file is named diffusion_pytorch_model.safetensors there, so a browser download must be renamed) and
    # Kijai's copy of taew2_1 (taew2_1.pth's tensors under the same names).
    "taef1.safetensors": (
        "vae_approx",
        "https://huggingface.co/madebyollin/taef1/resolve/main/diffusion_pytorch_model.safetensors",
    ),
    "taew2_1.safetensors": (
        "vae_approx",
        "https://huggingface.co/Kijai/WanVideo_comfy/resolve/main/taew2_1.safetensors",
    ),
    "umt5_xxl_fp8_e4m3fn_scaled.safetensors": (
        "text_encoders",
        "https://huggingface.co/Comfy-Org/Wan_2.1_ComfyUI_repackaged/resolve/main/split_files/text_encoders/"
        "umt5_xxl_fp8_e4m3fn_scaled.safetensors",
    ),
    "t5xxl_fp16.safetensors": (
        "text_encoders",
        "https://huggingface.co/comfyanonymous/flux_text_encoders/resolve/main/t5xxl_fp16.safetensors",
    ),
    # FLUX.2 [klein] 4B: BFL's own single file (the official layout, Apache-2.0, not gated); Comfy-Org/Flux-2-Klein-4B
    # repacks the same file as split_files/diffusion_models/flux-2-klein-4b.safetensors, next to the VAE.
    "flux-2-klein-4b.safetensors": (
        "diffusion_models",
        "https://huggingface.co/black-forest-labs/FLUX.2-klein-4B/resolve/main/flux-2-klein-4b.safetensors",
    ),
    "flux2-vae.safetensors": (
        "vae",
        "https://huggingface.co/Comfy-Org/Flux-2-Klein-4B/resolve/main/split_files/vae/flux2-vae.safetensors",
    ),
    # Qwen3-4B, the text encoder of both FLUX.2 klein 4B and Z-Image-Turbo (the same file in both Comfy-Org repos)
    "qwen_3_4b.safetensors": (
        "text_encoders",
        "https://huggingface.co/Comfy-Org/z_image_turbo/resolve/main/split_files/text_encoders/qwen_3_4b.safetensors",
    ),
    "z_image_turbo_bf16.safetensors": (
        "diffusion_models",
        "https://huggingface.co/Comfy-Org/z_image_turbo/resolve/main/split_files/diffusion_models/"
        "z_image_turbo_bf16.safetensors",
    ),
    "taef2.safetensors": (
        "vae_approx",
        "https://huggingface.co/madebyollin/taef2/resolve/main/taef2.safetensors",
    ),
    # the Wan 2.1 VAE, for core VAEEncode of a start image / input video (ComfyUI's Wan templates name this copy)
    "wan_2.1_vae.safetensors": (
        "vae",
        "https://huggingface.co/Comfy-Org/Wan_2.1_ComfyUI_repackaged/resolve/main/split_files/vae/wan_2.1_vae.safetensors",
    ),
}

# The step-distillation LoRAs (folder loras, as ComfyUI's LoraLoader reads them) and the Wan base they patch
MODELS["wan2.1_t2v_1.3B_bf16.safetensors"] = (
    "diffusion_models",
    "https://huggingface.co/Comfy-Org/Wan_2.1_ComfyUI_repackaged/resolve/main/split_files/diffusion_models/"
    "wan2.1_t2v_1.3B_bf16.safetensors",
)
MODELS["Hyper-FLUX.1-dev-8steps-lora.safetensors"] = (
    "loras",
    "https://huggingface.co/ByteDance/Hyper-SD/resolve/main/Hyper-FLUX.1-dev-8steps-lora.safetensors",
)
MODELS["Wan21_CausVid_bidirect2_T2V_1_3B_lora_rank32.safetensors"] = (
    "loras",
    "https://huggingface.co/Kijai/WanVideo_comfy/resolve/main/Wan21_CausVid_bidirect2_T2V_1_3B_lora_rank32.safetensors",
)

# Files the Missing Models dialog cannot download: no safetensors copy of the official tensors on huggingface.co
# was found (the frontend downloads only .safetensors / .sft names). They are still listed, so the dialog names
# them as missing with their folder and a "Copy URL" button (beside its refusal), and each workflow's Note says
# where to get them.
SELF_FORCING_URL = "https://huggingface.co/gdhe17/Self-Forcing/resolve/main/checkpoints/self_forcing_dmd.pt"
MODELS["self_forcing_dmd.pt"] = ("diffusion_models", SELF_FORCING_URL)


@dataclass(frozen=True)
class Out:
    node: Node
    slot: int


@dataclass
class Node:
    id: int
    spec: NodeSpec
    title: str
    col: int
    values: dict  # input name -> widget value or Out
    size: tuple[int, int]
    pos: tuple[int, int] = (0, 0)

    def __getitem__(self, slot: int) -> Out:
        return Out(self, slot)

    @property
    def class_type(self) -> str:
        return self.spec.name


@dataclass
class Graph:
    name: str
    specs: dict[str, NodeSpec]
    nodes: list[Node] = field(default_factory=list)
    note: str = ""

    def add(self, class_type: str, title: str, col: int, /, ui_height: int | None = None, **inputs) -> Node:
        """A node in layout column ``col`` (1 = leftmost), stacked below the column's earlier nodes."""
        spec = self.specs[class_type]
        unknown = set(inputs) - {i.name for i in spec.inputs}
        if unknown:
            raise ValueError(f"{self.name}: {class_type} has no inputs {sorted(unknown)}")
        values = {}
        for inp in spec.inputs:
            if inp.name in inputs:
                values[inp.name] = inputs[inp.name]
            elif inp.is_widget:
                values[inp.name] = widget_default(inp, f"{self.name}: {class_type}")
        node = Node(
            len(self.nodes) + 1, spec, title, col, values, (NODE_WIDTH, ui_height or node_height(spec))
        )
        below = [n for n in self.nodes if n.col == col]
        y = below[-1].pos[1] + below[-1].size[1] + GAP + TITLE_H if below else 0
        node.pos = ((col - 1) * COL_WIDTH, y)
        self.nodes.append(node)
        return node

    def links(self) -> list[tuple[int, Out, Node, str]]:
        """(link id, source, target node, target input) in a stable order."""
        found = [(out, n, name) for n in self.nodes for name, out in n.values.items() if isinstance(out, Out)]
        return [(i + 1, *link) for i, link in enumerate(found)]


def widget_default(inp: InputSpec, where: str):
    if "default" in inp.opts:
        return inp.opts["default"]
    if inp.type == "COMBO" and inp.options and not inp.is_file_combo:
        return inp.options[0]  # what the frontend shows for a combo without a default
    raise ValueError(f"{where}: no value given for {inp.name}")


def node_height(spec: NodeSpec) -> int:
    slots = max(len([i for i in spec.inputs if not i.is_widget]), len(spec.outputs))
    widgets = sum(TEXT_H if w.opts.get("multiline") else WIDGET_H * (1 + w.has_control) for w in spec.widgets)
    # the frontend adds an upload button under an image / video file combo (and grows a node saved smaller)
    uploads = sum(bool(w.opts.get("image_upload") or w.opts.get("video_upload")) for w in spec.widgets)
    return slots * SLOT_H + widgets + WIDGET_H * uploads + 10


def execution_order(graph: Graph) -> dict[int, int]:
    """Topological order of the nodes (the UI format's 'order'), ties broken by id."""
    deps = {n.id: {v.node.id for v in n.values.values() if isinstance(v, Out)} for n in graph.nodes}
    order: dict[int, int] = {}
    while len(order) < len(deps):
        ready = min(i for i, d in deps.items() if i not in order and d <= set(order))
        order[ready] = len(order)
    return order


def reflow(text: str) -> str:
    """A note's text with no hard line breaks inside a paragraph or a list item: the Note widget wraps lines to its
    width itself, and a source line break inside a sentence renders as a ragged short line. Paragraphs stay
    apart (a blank line); each ``- `` item starts a line of its own, its indented continuation joined to it."""
    paragraphs = []
    for paragraph in text.strip().split("\n\n"):
        lines: list[str] = []
        for raw in paragraph.splitlines():
            line = raw.strip()
            if not lines or line.startswith("- ") or lines[-1].endswith(":"):
                lines.append(line)
            else:
                lines[-1] += " " + line
        paragraphs.append("\n".join(lines))
    return "\n\n".join(paragraphs)


NOTE_CHARS_PER_LINE = 52  # what fits a NODE_WIDTH-wide Note at the frontend's default font


def note_height(text: str) -> int:
    """The Note's height for ``text`` wrapped at :data:`NOTE_CHARS_PER_LINE` (20 px a line, 60 px of frame)."""
    rows = sum(max(1, -(-len(line) // NOTE_CHARS_PER_LINE)) for line in text.split("\n"))
    return 20 * rows + 60


def models_of(node: Node) -> list[dict]:
    names = [v for v in node.values.values() if isinstance(v, str) and v in MODELS]
    return [{"name": n, "url": MODELS[n][1], "directory": MODELS[n][0]} for n in names]


def to_api(graph: Graph) -> dict:
    api = {}
    for n in graph.nodes:
        inputs = {name: [str(v.node.id), v.slot] if isinstance(v, Out) else v for name, v in n.values.items()}
        api[str(n.id)] = {"inputs": inputs, "class_type": n.class_type, "_meta": {"title": n.title}}
    return api


def to_ui(graph: Graph) -> dict:
    links = graph.links()
    order = execution_order(graph)
    nodes = []
    for n in graph.nodes:
        in_links = {name: lid for lid, _, dst, name in links if dst is n}
        inputs = []
        for i in sockets(n):
            slot = {"name": i.name, "type": i.type, "link": in_links.get(i.name)}
            if i.is_widget:
                slot["widget"] = {"name": i.name}
            inputs.append(slot)
        outputs = [
            {
                "name": name,
                "type": typ,
                "links": [lid for lid, out, _, _ in links if out.node is n and out.slot == slot] or None,
                "slot_index": slot,
            }
            for slot, (name, typ) in enumerate(n.spec.outputs)
        ]
        widgets_values = []
        for w in n.spec.widgets:
            value = n.values[w.name]
            widgets_values.append(value if not isinstance(value, Out) else widget_default(w, n.title))
            if w.companion:
                widgets_values.append(w.companion[2])
        properties = {"Node name for S&R": n.class_type}
        if models := models_of(n):
            properties["models"] = models
        nodes.append(
            {
                "id": n.id,
                "type": n.class_type,
                "pos": list(n.pos),
                "size": list(n.size),
                "flags": {},
                "order": order[n.id],
                "mode": 0,
                "title": n.title,
                "inputs": inputs,
                "outputs": outputs,
                "properties": properties,
                "widgets_values": widgets_values,
            }
        )
    note_id = len(graph.nodes) + 1
    note = reflow(graph.note)
    nodes.append(
        {
            "id": note_id,
            "type": "Note",
            "pos": [-COL_WIDTH, 0],
            "size": [NODE_WIDTH, note_height(note)],
            "flags": {},
            "order": len(graph.nodes),
            "mode": 0,
            "title": "About this workflow",
            "inputs": [],
            "outputs": [],
            "properties": {},
            "widgets_values": [note],
            "color": "#432",
            "bgcolor": "#653",
        }
    )
    return {
        "last_node_id": note_id,
        "last_link_id": len(links),
        "nodes": nodes,
        "links": [
            [lid, out.node.id, out.slot, dst.id, input_slot(dst, name), out_type(out)]
            for lid, out, dst, name in links
        ],
        "groups": [],
        "config": {},
        "extra": {"ds": saved_view(graph.name, nodes)},
        "version": 0.4,
    }


# The saved view (extra.ds) opens every workflow with its Note and all its nodes in sight, in both frontends the
# pack supports, measured in headless Chromium at 1600x900 and 1920x1080 (tests/workflows/test_canvas_view.py
# pins the measurements per frontend). Frontend 1.27.10 (ComfyUI 0.3.64) puts the canvas element below its 78 px
# top menu and right of its 64 px sidebar; 1.35.9 (ComfyUI 0.8.0) spreads the canvas under the whole window and
# floats its 38 px workflow tabs, the row below them (breadcrumb and Run toolbar, down to y 90) and its 59 px
# sidebar over it. Both float the minimap and the zoom controls in the bottom-right corner. Below in px of the
# canvas element, which is where extra.ds places the graph: screen = (pos + offset) * scale.
VIEW_WINDOW = (1600, 900)  # the smaller window size supported; a larger window only adds room right and below
VIEW_LEFT = 64  # 1.35.9's sidebar (59 px) and 1.27.10's canvas starting right of its sidebar (64 px)
VIEW_TOP = 90  # 1.35.9's tabs and the breadcrumb / Run toolbar row below them
VIEW_RIGHT_INSET = 64  # 1.27.10's canvas is its sidebar's width narrower than the window
VIEW_BOTTOM_INSET = 78  # and its top menu's height shorter
# 1.27.10's minimap and zoom controls (1.35.9's are smaller): the corner from 384 px left of the window's right
# edge (320 + 64) and 344 px above its bottom (266 + 78), in canvas-element px
CORNER_WIDTH, CORNER_HEIGHT = 384, 344
VIEW_MARGIN = 16  # room between the graph and the panels
# What the frontend draws above a node's pos: LiteGraph's 30 unit title bar and 1.27.10's node-source badge
# (the pack's name) above it
ABOVE_NODE = 30 + 24
DEFAULT_SCALE = 0.8
# Zoomed out further, LiteGraph draws nodes without their text: both frontends set canvas.low_quality at scale
# 0.57 and below, not at 0.59 (their 8 px minimum font size over 14 px text). Six columns (the Note and five of
# nodes) fit 1600 px wide at 0.64.
MIN_SCALE = 0.62


def node_boxes(nodes: list[dict]) -> list[tuple[float, float, float, float]]:
    """Each UI node's box on the canvas (x0, y0, x1, y1), title bar and badge included."""
    return [
        (n["pos"][0], n["pos"][1] - ABOVE_NODE, n["pos"][0] + n["size"][0], n["pos"][1] + n["size"][1])
        for n in nodes
    ]


def saved_view(name: str, nodes: list[dict]) -> dict:
    """The largest scale, from :data:`DEFAULT_SCALE` down to :data:`MIN_SCALE` in steps of 0.01, at which the
    graph's top-left sits at the free area's top-left and no node reaches past its right or bottom edge or into
    the bottom-right corner; the offset that puts it there."""
    boxes = node_boxes(nodes)
    left, top = min(b[0] for b in boxes), min(b[1] for b in boxes)
    width, height = VIEW_WINDOW
    right, bottom = width - VIEW_RIGHT_INSET - VIEW_MARGIN, height - VIEW_BOTTOM_INSET - VIEW_MARGIN
    corner = (width - CORNER_WIDTH - VIEW_MARGIN, height - CORNER_HEIGHT - VIEW_MARGIN)
    for step in range(round((DEFAULT_SCALE - MIN_SCALE) * 100) + 1):
        scale = round(DEFAULT_SCALE - step / 100, 2)
        offset = [
            round((VIEW_LEFT + VIEW_MARGIN) / scale - left),
            round((VIEW_TOP + VIEW_MARGIN) / scale - top),
        ]
        screen = [[(x + offset[i % 2]) * scale for i, x in enumerate(b)] for b in boxes]
        if all(
            b[2] <= right and b[3] <= bottom and not (b[2] > corner[0] and b[3] > corner[1]) for b in screen
        ):
            return {"scale": scale, "offset": offset}
    raise ValueError(
        f"{name}: the graph does not fit a {width}x{height} window at scale {MIN_SCALE}: "
        "lay it out in fewer columns or shorter ones"
    )


def sockets(node: Node) -> list[InputSpec]:
    """The node's UI input slots: link inputs, then widgets driven by a link (which keep their widget)."""
    linked_widgets = [w for w in node.spec.widgets if isinstance(node.values[w.name], Out)]
    return [i for i in node.spec.inputs if not i.is_widget] + linked_widgets


def input_slot(node: Node, name: str) -> int:
    return [i.name for i in sockets(node)].index(name)


def out_type(out: Out) -> str:
    return out.node.spec.outputs[out.slot][1]


WORKFLOWS: dict[str, Callable[[Graph], None]] = {}


def workflow(name: str):
    def register(fn: Callable[[Graph], None]):
        WORKFLOWS[name] = fn
        return fn

    return register
