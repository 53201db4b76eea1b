"""Build the shipped workflows: each graph is defined once below and written in both ComfyUI formats.

    python workflows/build_workflows.py          # (re)write workflows/<name>.json and <name>.api.json
    python workflows/build_workflows.py --check  # exit 1 if the files on disk differ from what it would write

<name>.json is the canvas (UI) format the frontend's Load opens; <name>.api.json is the API format that
POST /prompt takes. Widget values are given by input name; the UI's positional widgets_values are laid out
from the node definitions (the pack's INPUT_TYPES and tests/workflow_check.py's CORE_NODES), and every
file is validated against them before it is written.

To add a workflow: write a function that fills a Graph and decorate it with @workflow("<name>").
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

import workflow_check as wc  # noqa: E402

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
    "taef1_decoder.pth": ("vae_approx", "https://github.com/madebyollin/taesd/raw/main/taef1_decoder.pth"),
    "taef1_encoder.pth": ("vae_approx", "https://github.com/madebyollin/taesd/raw/main/taef1_encoder.pth"),
    "taew2_1.pth": ("vae_approx", "https://github.com/madebyollin/taehv/raw/main/taew2_1.pth"),
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
    "taef2_decoder.pth": ("vae_approx", "https://github.com/madebyollin/taesd/raw/main/taef2_decoder.pth"),
    "taef2_encoder.pth": ("vae_approx", "https://github.com/madebyollin/taesd/raw/main/taef2_encoder.pth"),
}


@dataclass(frozen=True)
class Out:
    node: Node
    slot: int


@dataclass
class Node:
    id: int
    spec: wc.NodeSpec
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
    specs: dict[str, wc.NodeSpec]
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


def widget_default(inp: wc.InputSpec, where: str):
    if "default" in inp.opts:
        return inp.opts["default"]
    if inp.type == "COMBO" and inp.options and not inp.is_file_combo:
        return inp.options[0]  # what the frontend shows for a combo without a default
    raise ValueError(f"{where}: no value given for {inp.name}")


def node_height(spec: wc.NodeSpec) -> int:
    slots = max(len([i for i in spec.inputs if not i.is_widget]), len(spec.outputs))
    widgets = sum(TEXT_H if w.opts.get("multiline") else WIDGET_H * (1 + w.has_control) for w in spec.widgets)
    return slots * SLOT_H + widgets + 10


def execution_order(graph: Graph) -> dict[int, int]:
    """Topological order of the nodes (the UI format's 'order'), ties broken by id."""
    deps = {n.id: {v.node.id for v in n.values.values() if isinstance(v, Out)} for n in graph.nodes}
    order: dict[int, int] = {}
    while len(order) < len(deps):
        ready = min(i for i, d in deps.items() if i not in order and d <= set(order))
        order[ready] = len(order)
    return order


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
    nodes.append(
        {
            "id": note_id,
            "type": "Note",
            "pos": [-COL_WIDTH, 0],
            "size": [NODE_WIDTH, 20 * graph.note.strip().count("\n") + 60],
            "flags": {},
            "order": len(graph.nodes),
            "mode": 0,
            "title": "About this workflow",
            "inputs": [],
            "outputs": [],
            "properties": {},
            "widgets_values": [graph.note.strip()],
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
        "extra": {"ds": {"scale": 0.8, "offset": [COL_WIDTH + 40, 80]}},
        "version": 0.4,
    }


def sockets(node: Node) -> list[wc.InputSpec]:
    """The node's UI input slots: link inputs, then widgets driven by a link (which keep their widget)."""
    linked_widgets = [w for w in node.spec.widgets if isinstance(node.values[w.name], Out)]
    return [i for i in node.spec.inputs if not i.is_widget] + linked_widgets


def input_slot(node: Node, name: str) -> int:
    return [i.name for i in sockets(node)].index(name)


def out_type(out: Out) -> str:
    return out.node.spec.outputs[out.slot][1]


# ---- the workflows ----

WORKFLOWS: dict[str, Callable[[Graph], None]] = {}


def workflow(name: str):
    def register(fn: Callable[[Graph], None]):
        WORKFLOWS[name] = fn
        return fn

    return register


PROMPT = "a red fox sitting in fresh snow at sunrise, soft golden light, detailed fur, shallow depth of field"
FLUX_SIDE_FILES = """- text_encoders/t5xxl_fp16.safetensors and text_encoders/clip_l.safetensors
  (huggingface.co/comfyanonymous/flux_text_encoders)
- vae/ae.safetensors (the FLUX VAE)"""


def flux_text(g: Graph, col: int) -> Node:
    clip = g.add(
        "DualCLIPLoader",
        "Load text encoders (T5-XXL + CLIP-L)",
        col,
        clip_name1="t5xxl_fp16.safetensors",
        clip_name2="clip_l.safetensors",
        type="flux",
    )
    return g.add(
        "CLIPTextEncodeFlux", "Prompt", col + 1, clip=clip[0], clip_l=PROMPT, t5xxl=PROMPT, guidance=3.5
    )


def decode_and_save(g: Graph, latent: Out, col: int, prefix: str) -> None:
    vae = g.add("VAELoader", "Load VAE", col, vae_name="ae.safetensors")
    image = g.add("VAEDecode", "Decode", col, samples=latent, vae=vae[0])
    g.add("SaveImage", "Save image", col + 1, ui_height=420, images=image[0], filename_prefix=prefix)


def dummy_flux_inputs(g: Graph, size: int = 256) -> tuple[Node, Node, Node]:
    """(model, conditioning, latent) with no files: dummy:flux-tiny, synthetic embeddings, an empty latent."""
    model = g.add("FewStepDiTLoader", "FewStep DiT Loader (dummy weights)", 1, model_name="dummy:flux-tiny")
    cond = g.add("FewStepSyntheticConditioning", "Synthetic conditioning (no text encoder)", 1)
    latent = g.add("EmptySD3LatentImage", "Image size", 1, width=size, height=size, batch_size=1)
    return model, cond, latent


def fewstep_sampler(
    g: Graph,
    title: str,
    col: int,
    model: Out,
    cond: Out,
    latent: Out,
    steps: int = 4,
    schedule: str = "flux.1-schnell",
    **inputs,
) -> Node:
    """FewStepSampler with the shipped settings: seed 42, euler, no CFG."""
    return g.add(
        "FewStepSampler",
        title,
        col,
        model=model,
        positive=cond,
        latent_image=latent,
        seed=42,
        steps=steps,
        schedule=schedule,
        sampler="euler",
        cfg=1.0,
        **inputs,
    )


def first_block_gate(g: Graph, title: str, col: int, model: Out, threshold: float) -> Node:
    return g.add(
        "FewStepCacheGate",
        title,
        col,
        model=model,
        method="first_block",
        threshold=threshold,
        start=0.1,
        end=1.0,
        force=False,
        cfg_cutoff=1.0,
    )


@workflow("flux_schnell_fewstep")
def flux_schnell_fewstep(g: Graph) -> None:
    g.note = f"""FLUX.1-schnell in 4 steps with the FewStep engine.

FewStep DiT Loader loads the diffusion transformer into the pack's own engine; ComfyUI's text encoders
and VAE do the rest. FewStep Sampler runs the schnell schedule (4 steps, euler, no CFG: one DiT forward
per step) and its 'report' output lists the sigmas and the time of each step.

Files (ComfyUI/models/...):
- diffusion_models/flux1-schnell.safetensors (huggingface.co/Comfy-Org/flux1-schnell), or an fp8 file
{FLUX_SIDE_FILES}

No files? Open flux_schnell_fewstep_dummy.json: the same sampler with random weights."""
    model = g.add(
        "FewStepDiTLoader", "FewStep DiT Loader (FLUX.1-schnell)", 1, model_name="flux1-schnell.safetensors"
    )
    cond = flux_text(g, 1)
    latent = g.add("EmptySD3LatentImage", "Image size", 1, width=1024, height=1024, batch_size=1)
    sampler = fewstep_sampler(g, "FewStep Sampler (4 steps)", 3, model[0], cond[0], latent[0])
    g.add("PreviewAny", "Sampler report", 3, ui_height=200, source=sampler[1])
    decode_and_save(g, sampler[0], 4, "fewstep/flux_schnell")


@workflow("flux_schnell_fewstep_dummy")
def flux_schnell_fewstep_dummy(g: Graph) -> None:
    g.note = """FewStep sampling with no model files at all (runs on a CPU in seconds).

'dummy:flux-tiny' builds a tiny FLUX-shaped transformer with seeded random weights, and FewStep
Synthetic Conditioning stands in for the text encoders (random T5/CLIP-shaped embeddings). The output
is noise-like, not a picture: the workflow is for checking an install and trying the sampler settings.
The latent is written to output/fewstep/ by SaveLatent; the report shows sigmas and step times.

Needs no files. For real images open flux_schnell_fewstep.json."""
    model, cond, latent = dummy_flux_inputs(g)
    sampler = fewstep_sampler(g, "FewStep Sampler (4 steps)", 2, model[0], cond[0], latent[0])
    g.add("SaveLatent", "Save latent", 3, samples=sampler[0], filename_prefix="fewstep/flux_schnell_dummy")
    g.add("PreviewAny", "Sampler report", 3, ui_height=200, source=sampler[1])


@workflow("flux_dev_step_cache")
def flux_dev_step_cache(g: Graph) -> None:
    g.note = f"""FLUX.1-dev in 28 steps with the FewStep step-cache gate (First-Block-Cache).

FewStep Cache Gate attaches a step cache to the model (the model itself is shared, not changed). Before
the run it reads the schedule: 28 flux.1-dev steps move the noise level by ~0.03 per step, so caching can
pay and the gate turns on. On each step block 0 runs; when its residual changed by less than the threshold
(0.08: relative L1 change) since the last computed step, the other blocks are skipped and their last
residual is reused. The sampler's report lists the decision, the steps computed and skipped, the change
measured at each step (* = skipped) and the estimated speed-up. Threshold 0 gives exactly the uncached image.

Files (ComfyUI/models/...):
- diffusion_models/flux1-dev.safetensors (huggingface.co/black-forest-labs/FLUX.1-dev, gated), or an fp8 file
{FLUX_SIDE_FILES}

No files? Open flux_dev_step_cache_dummy.json."""
    model = g.add(
        "FewStepDiTLoader", "FewStep DiT Loader (FLUX.1-dev)", 1, model_name="flux1-dev.safetensors"
    )
    cond = flux_text(g, 1)
    latent = g.add("EmptySD3LatentImage", "Image size", 1, width=1024, height=1024, batch_size=1)
    gate = first_block_gate(g, "FewStep Cache Gate (First-Block-Cache)", 2, model[0], 0.08)
    sampler = fewstep_sampler(
        g, "FewStep Sampler (28 steps)", 3, gate[0], cond[0], latent[0], steps=28, schedule="flux.1-dev"
    )
    g.add("PreviewAny", "Sampler report (cache telemetry)", 3, ui_height=260, source=sampler[1])
    decode_and_save(g, sampler[0], 4, "fewstep/flux_dev_step_cache")


@workflow("flux_dev_step_cache_dummy")
def flux_dev_step_cache_dummy(g: Graph) -> None:
    g.note = """The step-cache gate with no model files (random weights, runs on a CPU in seconds).

Random weights react very differently to neighbouring timesteps (block 0's residual changes by ~60% per
step, a trained FLUX by a few %), so this graph uses threshold 0.7 to show skipped steps in the report; with
a real model use ~0.08. The output is noise-like, not a picture.

Needs no files. For real images open flux_dev_step_cache.json."""
    model, cond, latent = dummy_flux_inputs(g)
    gate = first_block_gate(g, "FewStep Cache Gate (First-Block-Cache)", 2, model[0], 0.7)
    sampler = fewstep_sampler(
        g, "FewStep Sampler (28 steps)", 2, gate[0], cond[0], latent[0], steps=28, schedule="flux.1-dev"
    )
    g.add(
        "SaveLatent",
        "Save latent",
        3,
        samples=sampler[0],
        filename_prefix="fewstep/flux_dev_step_cache_dummy",
    )
    g.add("PreviewAny", "Sampler report (cache telemetry)", 3, ui_height=260, source=sampler[1])


@workflow("flux_schnell_cache_gate_refuses")
def flux_schnell_cache_gate_refuses(g: Graph) -> None:
    g.note = f"""FLUX.1-schnell in 4 steps with the step-cache gate attached: the gate refuses, and says why.

A distilled 4-step schedule moves the noise level by 0.25 per step; every step is a turning point, so a
step cache would skip nothing or corrupt the image. FewStep Cache Gate reads the schedule before the run,
turns itself off and the sampler's report says: "off: 4-step distilled few-step schedule: adjacent steps
differ by 0.250 in sigma ...". The image is exactly the uncached one. 'force' overrides (not advised).

Files (ComfyUI/models/...):
- diffusion_models/flux1-schnell.safetensors (huggingface.co/Comfy-Org/flux1-schnell), or an fp8 file
{FLUX_SIDE_FILES}

No files? Open flux_schnell_cache_gate_refuses_dummy.json."""
    model = g.add(
        "FewStepDiTLoader", "FewStep DiT Loader (FLUX.1-schnell)", 1, model_name="flux1-schnell.safetensors"
    )
    cond = flux_text(g, 1)
    latent = g.add("EmptySD3LatentImage", "Image size", 1, width=1024, height=1024, batch_size=1)
    gate = first_block_gate(g, "FewStep Cache Gate", 2, model[0], 0.08)
    sampler = fewstep_sampler(g, "FewStep Sampler (4 steps)", 3, gate[0], cond[0], latent[0])
    g.add("PreviewAny", "Sampler report (the gate's reason)", 3, ui_height=200, source=sampler[1])
    decode_and_save(g, sampler[0], 4, "fewstep/flux_schnell_cache_gate")


@workflow("flux_schnell_cache_gate_refuses_dummy")
def flux_schnell_cache_gate_refuses_dummy(g: Graph) -> None:
    g.note = """The step-cache gate refusing a 4-step schedule, with no model files (random weights).

The report's 'step cache' line gives the reason; the latent is exactly the uncached one.

Needs no files. For real images open flux_schnell_cache_gate_refuses.json."""
    model, cond, latent = dummy_flux_inputs(g)
    gate = first_block_gate(g, "FewStep Cache Gate", 2, model[0], 0.08)
    sampler = fewstep_sampler(g, "FewStep Sampler (4 steps)", 2, gate[0], cond[0], latent[0])
    g.add(
        "SaveLatent",
        "Save latent",
        3,
        samples=sampler[0],
        filename_prefix="fewstep/flux_schnell_cache_gate_dummy",
    )
    g.add("PreviewAny", "Sampler report (the gate's reason)", 3, ui_height=200, source=sampler[1])


@workflow("native_fewstep_schedule")
def native_fewstep_schedule(g: Graph) -> None:
    g.note = f"""FLUX.1-schnell on ComfyUI's own model path, with FewStep's schedule and sampler.

ComfyUI loads and runs the model (Load Diffusion Model, SamplerCustomAdvanced), so LoRAs and other
MODEL patches apply as usual; FewStep Schedule supplies the SIGMAS and FewStep Sampler Select the
SAMPLER. Keep the schedule's width/height equal to the image size (flux.1-dev's shift depends on it).

Files (ComfyUI/models/...):
- diffusion_models/flux1-schnell.safetensors (huggingface.co/Comfy-Org/flux1-schnell)
{FLUX_SIDE_FILES}"""
    model = g.add(
        "UNETLoader", "Load Diffusion Model (FLUX.1-schnell)", 1, unet_name="flux1-schnell.safetensors"
    )
    cond = flux_text(g, 1)
    latent = g.add("EmptySD3LatentImage", "Image size", 1, width=1024, height=1024, batch_size=1)
    guider = g.add("BasicGuider", "Guider (no CFG)", 3, model=model[0], conditioning=cond[0])
    noise = g.add("RandomNoise", "Noise", 3, noise_seed=42)
    sigmas = g.add(
        "FewStepSchedule", "FewStep Schedule", 3, schedule="flux.1-schnell", steps=4, width=1024, height=1024
    )
    sampler = g.add("FewStepSamplerSelect", "FewStep Sampler Select", 3, sampler="euler")
    out = g.add(
        "SamplerCustomAdvanced",
        "SamplerCustomAdvanced",
        4,
        noise=noise[0],
        guider=guider[0],
        sampler=sampler[0],
        sigmas=sigmas[0],
        latent_image=latent[0],
    )
    decode_and_save(g, out[0], 5, "fewstep/native_schnell")


@workflow("fewstep_schedule_dummy")
def fewstep_schedule_dummy(g: Graph) -> None:
    g.note = """The SIGMAS that FewStep Schedule hands to ComfyUI's samplers, shown without any model.

ComfyUI's native sampling needs a MODEL, which core nodes cannot make without a model file, so this
workflow only builds two schedules and previews them: FLUX.1-schnell (4 steps, unshifted) and FLUX.1-dev
(28 steps, shifted by resolution; change width/height to see the shift move).

Needs no files. native_fewstep_schedule.json uses these schedules with a real model."""
    schnell = g.add("FewStepSchedule", "Schedule: FLUX.1-schnell", 1, schedule="flux.1-schnell", steps=4)
    dev = g.add("FewStepSchedule", "Schedule: FLUX.1-dev", 1, schedule="flux.1-dev", steps=28)
    g.add("PreviewAny", "Sigmas (schnell)", 2, ui_height=140, source=schnell[0])
    g.add("PreviewAny", "Sigmas (dev)", 2, ui_height=240, source=dev[0])


@workflow("flux_schnell_tiny_decode")
def flux_schnell_tiny_decode(g: Graph) -> None:
    g.note = f"""FLUX.1-schnell in 4 steps, decoded with the tiny autoencoder TAEF1.

With a 4-step model the full VAE becomes a large share of the time; TAEF1 (a few MB) decodes in
milliseconds at slightly lower detail. The sampler also sends a TAEF1 preview of each step's x0 to the
progress bar (preview = true).

Files (ComfyUI/models/...):
- diffusion_models/flux1-schnell.safetensors
- vae_approx/taef1_decoder.pth and taef1_encoder.pth (github.com/madebyollin/taesd)
{FLUX_SIDE_FILES.splitlines()[0]}
{FLUX_SIDE_FILES.splitlines()[1]}

No files? Open flux_schnell_tiny_decode_dummy.json."""
    model = g.add(
        "FewStepDiTLoader", "FewStep DiT Loader (FLUX.1-schnell)", 1, model_name="flux1-schnell.safetensors"
    )
    cond = flux_text(g, 1)
    latent = g.add("EmptySD3LatentImage", "Image size", 1, width=1024, height=1024, batch_size=1)
    tiny = g.add("FewStepTinyVAELoader", "Tiny VAE (TAEF1)", 3, vae_name="taef1_decoder.pth")
    sampler = fewstep_sampler(
        g,
        "FewStep Sampler (4 steps, previews)",
        3,
        model[0],
        cond[0],
        latent[0],
        preview_vae=tiny[0],
        preview=True,
    )
    image = g.add("FewStepTinyVAEDecode", "Tiny decode", 4, tiny_vae=tiny[0], samples=sampler[0])
    g.add("PreviewAny", "Sampler report", 4, ui_height=200, source=sampler[1])
    g.add(
        "SaveImage", "Save image", 5, ui_height=420, images=image[0], filename_prefix="fewstep/schnell_tiny"
    )


@workflow("flux_schnell_tiny_decode_dummy")
def flux_schnell_tiny_decode_dummy(g: Graph) -> None:
    g.note = """Few-step sampling plus tiny-VAE decode with no model files (random weights, CPU, seconds).

dummy:flux-tiny and dummy:taef1 have seeded random weights, so the saved image is noise; the workflow checks
the install and shows the path latent -> tiny decode -> image, with per-step previews.

Needs no files. For real images open flux_schnell_tiny_decode.json."""
    model, cond, latent = dummy_flux_inputs(g)
    tiny = g.add("FewStepTinyVAELoader", "Tiny VAE (dummy TAEF1)", 2, vae_name="dummy:taef1")
    sampler = fewstep_sampler(
        g,
        "FewStep Sampler (4 steps, previews)",
        2,
        model[0],
        cond[0],
        latent[0],
        preview_vae=tiny[0],
        preview=True,
    )
    image = g.add("FewStepTinyVAEDecode", "Tiny decode", 3, tiny_vae=tiny[0], samples=sampler[0])
    g.add("PreviewAny", "Sampler report", 3, ui_height=200, source=sampler[1])
    g.add(
        "SaveImage",
        "Save image",
        4,
        ui_height=300,
        images=image[0],
        filename_prefix="fewstep/schnell_tiny_dummy",
    )


@workflow("tiny_vae_round_trip")
def tiny_vae_round_trip(g: Graph) -> None:
    g.note = """Encode an image with a tiny VAE and decode it again (TAEF1 here).

Shows what the tiny autoencoder keeps: compare the saved image with the input. Swap the loader's file for
taesd / taesdxl / taesd3 / taef2 to try other latent spaces; the LATENT in between is ComfyUI's raw VAE
latent, so ComfyUI's own VAEDecode with ae.safetensors decodes it too.

Files: vae_approx/taef1_encoder.pth and taef1_decoder.pth (github.com/madebyollin/taesd); an image in
ComfyUI/input (height and width divisible by 8)."""
    picture = g.add("LoadImage", "Image", 1, image="example.png")
    tiny = g.add("FewStepTinyVAELoader", "Tiny VAE (TAEF1)", 1, vae_name="taef1_encoder.pth")
    latent = g.add("FewStepTinyVAEEncode", "Tiny encode", 2, tiny_vae=tiny[0], pixels=picture[0])
    image = g.add("FewStepTinyVAEDecode", "Tiny decode", 2, tiny_vae=tiny[0], samples=latent[0])
    g.add(
        "SaveImage",
        "Save round trip",
        3,
        ui_height=420,
        images=image[0],
        filename_prefix="fewstep/round_trip",
    )


@workflow("tiny_vae_round_trip_dummy")
def tiny_vae_round_trip_dummy(g: Graph) -> None:
    g.note = """Tiny-VAE encode then decode with no files: a plain-colour image through dummy:taef1.

Random weights, so the output is not the input; the workflow checks shapes and the IMAGE <-> LATENT path.

Needs no files. tiny_vae_round_trip.json does this with real TAEF1 weights and your image."""
    picture = g.add("EmptyImage", "Plain image", 1, width=256, height=256, batch_size=1, color=0x3366CC)
    tiny = g.add("FewStepTinyVAELoader", "Tiny VAE (dummy TAEF1)", 1, vae_name="dummy:taef1")
    latent = g.add("FewStepTinyVAEEncode", "Tiny encode", 2, tiny_vae=tiny[0], pixels=picture[0])
    image = g.add("FewStepTinyVAEDecode", "Tiny decode", 2, tiny_vae=tiny[0], samples=latent[0])
    g.add(
        "SaveImage",
        "Save round trip",
        3,
        ui_height=300,
        images=image[0],
        filename_prefix="fewstep/round_trip_dummy",
    )


VIDEO_PROMPT = "a corgi running along a beach at sunset, waves rolling in, tracking shot"
VIDEO_PROMPT_2 = "the corgi stops and looks at the camera, waves splash around its paws"
WAN_FILES = """- diffusion_models/self_forcing_dmd.pt (Self-Forcing, Wan2.1-T2V-1.3B student: huggingface.co/gdhe17/Self-Forcing)
  or another CausVid / Self-Forcing checkpoint
- text_encoders/umt5_xxl_fp8_e4m3fn_scaled.safetensors (huggingface.co/Comfy-Org/Wan_2.1_ComfyUI_repackaged)
- vae_approx/taew2_1.pth (github.com/madebyollin/taehv)"""


def wan_text(g: Graph, col: int, text: str, title: str = "Prompt") -> tuple[Node, Node]:
    """(text encoder, prompt) nodes."""
    clip = g.add(
        "CLIPLoader", "Load umT5-XXL", col, clip_name="umt5_xxl_fp8_e4m3fn_scaled.safetensors", type="wan"
    )
    return clip, g.add("CLIPTextEncode", title, col + 1, text=text, clip=clip[0])


def dummy_wan_inputs(g: Graph) -> tuple[Node, Node, Node]:
    """(model, umT5-shaped conditioning, tiny VAE) with no files: dummy:wan-tiny, synthetic embeddings, dummy TAEW2.1."""
    model = g.add("FewStepDiTLoader", "FewStep DiT Loader (dummy Wan)", 1, model_name="dummy:wan-tiny")
    cond = g.add("FewStepSyntheticConditioning", "Synthetic umT5 prompt", 1, pooled_width=0, guidance=0.0)
    tiny = g.add("FewStepTinyVAELoader", "Tiny VAE (dummy TAEW2.1)", 1, vae_name="dummy:taew2_1")
    return model, cond, tiny


def save_video(g: Graph, frames: Out, col: int, prefix: str) -> None:
    g.add(
        "SaveAnimatedWEBP",
        "Save video (16 fps)",
        col,
        ui_height=420,
        images=frames,
        filename_prefix=prefix,
        fps=16.0,
        lossless=False,
        quality=85,
        method="default",
    )


@workflow("wan_causal_stream")
def wan_causal_stream(g: Graph) -> None:
    g.note = f"""Text to streaming video with a causal Wan 2.1 student (Self-Forcing / CausVid), decoded by TAEW2.1.

The video is generated 3 latent frames (12 video frames) at a time; each chunk takes 4 denoising steps and
attends to earlier chunks through a rolling KV cache, so memory stays flat. Each chunk is decoded by the tiny
VAE as soon as it is done and shown on the node. The session output can be continued
(wan_causal_continue.json). 7 chunks = 21 latent frames = 81 frames at 16 fps.

Files (ComfyUI/models/...):
{WAN_FILES}

No files? Open wan_causal_stream_dummy.json."""
    model = g.add(
        "FewStepDiTLoader", "FewStep DiT Loader (Self-Forcing)", 1, model_name="self_forcing_dmd.pt"
    )
    _, cond = wan_text(g, 1, VIDEO_PROMPT)
    tiny = g.add("FewStepTinyVAELoader", "Tiny VAE (TAEW2.1)", 1, vae_name="taew2_1.pth")
    video = g.add(
        "FewStepCausalVideoSampler",
        "FewStep Causal Video Sampler",
        3,
        model=model[0],
        positive=cond[0],
        width=832,
        height=480,
        num_chunks=7,
        chunk_frames=3,
        window_frames=21,
        sink_frames=0,
        seed=7,
        tiny_vae=tiny[0],
    )
    g.add("PreviewAny", "Report", 4, ui_height=200, source=video[3])
    g.add("SaveLatent", "Save latent", 4, samples=video[0], filename_prefix="fewstep/wan_stream")
    save_video(g, video[1], 5, "fewstep/wan_stream")


@workflow("wan_causal_stream_dummy")
def wan_causal_stream_dummy(g: Graph) -> None:
    g.note = """Causal chunk-by-chunk video with no model files (random weights; a few seconds on a CPU).

dummy:wan-tiny is a tiny Wan-shaped transformer and dummy:taew2_1 a TAEW2.1-shaped decoder, both with seeded
random weights: the saved video is noise. It exercises the KV window (6 latent frames, 1 sink frame: the
oldest frames are evicted from chunk 3 on), the streaming decode and the report.

Needs no files. For real video open wan_causal_stream.json."""
    model, cond, tiny = dummy_wan_inputs(g)
    video = g.add(
        "FewStepCausalVideoSampler",
        "FewStep Causal Video Sampler",
        2,
        model=model[0],
        positive=cond[0],
        width=96,
        height=64,
        num_chunks=4,
        chunk_frames=2,
        window_frames=6,
        sink_frames=1,
        seed=7,
        tiny_vae=tiny[0],
    )
    g.add("PreviewAny", "Report", 3, ui_height=200, source=video[3])
    save_video(g, video[1], 3, "fewstep/wan_stream_dummy")


def continue_graph(
    g: Graph,
    model: Out,
    first: Out,
    second: Out,
    tiny: Out,
    size: tuple[int, int],
    chunks: tuple,
    window: int,
    prefix: str,
) -> None:
    video = g.add(
        "FewStepCausalVideoSampler",
        "Video: first prompt",
        3,
        model=model,
        positive=first,
        width=size[0],
        height=size[1],
        num_chunks=chunks[0],
        chunk_frames=chunks[2],
        window_frames=window,
        seed=7,
        tiny_vae=tiny,
    )
    more = g.add(
        "FewStepCausalContinue",
        "Continue: second prompt",
        4,
        session=video[2],
        num_chunks=chunks[1],
        positive=second,
    )
    frames = g.add("ImageBatch", "Join the frames", 5, image1=video[1], image2=more[1])
    g.add("PreviewAny", "Report (continuation)", 5, ui_height=200, source=more[3])
    save_video(g, frames[0], 6, prefix)


@workflow("wan_causal_continue")
def wan_causal_continue(g: Graph) -> None:
    g.note = f"""Continue a causal video with a new prompt (CausVid-style prompt switching).

The first sampler generates 4 chunks; FewStep Causal Video Continue carries the same session on for 3 more
chunks with the second prompt. Only the cross-attention (text) cache is rebuilt: the KV cache keeps the video,
so motion and content carry across the switch. Both parts' frames are joined and saved as one video.

Files (ComfyUI/models/...):
{WAN_FILES}

No files? Open wan_causal_continue_dummy.json."""
    model = g.add(
        "FewStepDiTLoader", "FewStep DiT Loader (Self-Forcing)", 1, model_name="self_forcing_dmd.pt"
    )
    clip, first = wan_text(g, 1, VIDEO_PROMPT, "First prompt")
    second = g.add("CLIPTextEncode", "Second prompt", 2, text=VIDEO_PROMPT_2, clip=clip[0])
    tiny = g.add("FewStepTinyVAELoader", "Tiny VAE (TAEW2.1)", 1, vae_name="taew2_1.pth")
    continue_graph(
        g, model[0], first[0], second[0], tiny[0], (832, 480), (4, 3, 3), 21, "fewstep/wan_continue"
    )


@workflow("wan_causal_continue_dummy")
def wan_causal_continue_dummy(g: Graph) -> None:
    g.note = """Continue a causal video session with a new prompt, with no model files (random weights).

Same graph as wan_causal_continue.json: two synthetic prompts stand in for the text encoder.

Needs no files."""
    model = g.add("FewStepDiTLoader", "FewStep DiT Loader (dummy Wan)", 1, model_name="dummy:wan-tiny")
    first = g.add(
        "FewStepSyntheticConditioning", "Synthetic prompt 1", 1, pooled_width=0, guidance=0.0, seed=1
    )
    second = g.add(
        "FewStepSyntheticConditioning", "Synthetic prompt 2", 2, pooled_width=0, guidance=0.0, seed=2
    )
    tiny = g.add("FewStepTinyVAELoader", "Tiny VAE (dummy TAEW2.1)", 1, vae_name="dummy:taew2_1")
    continue_graph(
        g, model[0], first[0], second[0], tiny[0], (96, 64), (2, 2, 2), 6, "fewstep/wan_continue_dummy"
    )


@workflow("native_flux_dev_cache_gate")
def native_flux_dev_cache_gate(g: Graph) -> None:
    g.note = f"""FLUX.1-dev in 28 steps on ComfyUI's own model, with the FewStep cache gate.

FewStep Cache Gate (native MODEL) patches a clone of the model through ComfyUI's wrappers (no copy, no
monkeypatch): before sampling it reads the schedule and decides whether skipping steps can pay. At 28 steps
it is on and skips the steps where the model's input changed by less than the threshold; with a 4-step
schedule it turns itself off and says why in the console. LoRAs and other patches still apply.

Files (ComfyUI/models/...):
- diffusion_models/flux1-dev.safetensors
{FLUX_SIDE_FILES}"""
    model = g.add("UNETLoader", "Load Diffusion Model (FLUX.1-dev)", 1, unet_name="flux1-dev.safetensors")
    cond = flux_text(g, 1)
    latent = g.add("EmptySD3LatentImage", "Image size", 1, width=1024, height=1024, batch_size=1)
    gate = g.add(
        "FewStepCacheGateNative", "FewStep Cache Gate (native)", 3, model=model[0], method="input_change",
        threshold=0.1, start=0.1, end=1.0, force=False, cfg_cutoff=1.0,
    )  # fmt: skip
    guider = g.add("BasicGuider", "Guider (no CFG)", 3, model=gate[0], conditioning=cond[0])
    noise = g.add("RandomNoise", "Noise", 3, noise_seed=42)
    sigmas = g.add(
        "FewStepSchedule", "FewStep Schedule (28 steps)", 3, schedule="flux.1-dev", steps=28, width=1024,
        height=1024,
    )  # fmt: skip
    sampler = g.add("FewStepSamplerSelect", "FewStep Sampler Select", 3, sampler="euler")
    out = g.add(
        "SamplerCustomAdvanced", "SamplerCustomAdvanced", 4, noise=noise[0], guider=guider[0], sampler=sampler[0],
        sigmas=sigmas[0], latent_image=latent[0],
    )  # fmt: skip
    decode_and_save(g, out[0], 5, "fewstep/native_dev_cache_gate")


# ---- quantized KV cache for long streams (issue 5) ----


@workflow("wan_causal_long_int8")
def wan_causal_long_int8(g: Graph) -> None:
    g.note = f"""A long causal video with the KV window stored in int8.

20 chunks of 3 latent frames (237 video frames, ~15 s at 16 fps) through a 21-frame rolling window with 3
sink frames. The newest completed chunk stays in bf16; older chunks are quantized to int8 once, when they
age out (about half the KV memory; int4 is about a quarter). The report shows KV bytes and how many frames
are quantized. Memory stays flat however long the stream runs.

Files (ComfyUI/models/...):
{WAN_FILES}

No files? Open wan_causal_long_int8_dummy.json."""
    model = g.add(
        "FewStepDiTLoader", "FewStep DiT Loader (Self-Forcing)", 1, model_name="self_forcing_dmd.pt"
    )
    _, cond = wan_text(g, 1, VIDEO_PROMPT)
    tiny = g.add("FewStepTinyVAELoader", "Tiny VAE (TAEW2.1)", 1, vae_name="taew2_1.pth")
    video = g.add(
        "FewStepCausalVideoSampler", "FewStep Causal Video Sampler (int8 KV)", 3, model=model[0],
        positive=cond[0], width=832, height=480, num_chunks=20, chunk_frames=3, window_frames=21, sink_frames=3,
        seed=7, tiny_vae=tiny[0], kv_dtype="int8", keep_recent_chunks=1,
    )  # fmt: skip
    g.add("PreviewAny", "Report (KV bytes)", 4, ui_height=200, source=video[3])
    save_video(g, video[1], 4, "fewstep/wan_long_int8")


@workflow("wan_causal_long_int8_dummy")
def wan_causal_long_int8_dummy(g: Graph) -> None:
    g.note = """A quantized KV window with no files (random weights, CPU): 6 chunks through a 6-frame window,
older chunks in int4 (keep_recent_chunks 1). The report gives KV bytes and the frames quantized. Noise output.

Needs no files. For real video open wan_causal_long_int8.json."""
    model, cond, tiny = dummy_wan_inputs(g)
    video = g.add(
        "FewStepCausalVideoSampler", "FewStep Causal Video Sampler (int4 KV)", 2, model=model[0],
        positive=cond[0], width=96, height=64, num_chunks=6, chunk_frames=2, window_frames=6, sink_frames=1,
        seed=7, tiny_vae=tiny[0], kv_dtype="int4", keep_recent_chunks=1,
    )  # fmt: skip
    g.add("PreviewAny", "Report (KV bytes)", 3, ui_height=200, source=video[3])
    save_video(g, video[1], 3, "fewstep/wan_long_int4_dummy")


# ---- stream batch (issue 9) ----

STREAM_FILES = """- diffusion_models/flux1-schnell.safetensors
- vae_approx/taef1_encoder.pth and taef1_decoder.pth (github.com/madebyollin/taesd): both halves are used
- text_encoders/t5xxl_fp16.safetensors and text_encoders/clip_l.safetensors
- input/: a short video to stylise (frames of equal size, multiples of 16 px)"""


def stream_batch(g: Graph, model: Out, tiny: Out, frames: Out, cond: Out, col: int, **widgets) -> Node:
    return g.add(
        "FewStepStreamBatch",
        "FewStep Stream Batch (2 steps per frame)",
        col,
        model=model,
        tiny_vae=tiny,
        frames=frames,
        positive=cond,
        **widgets,
    )


@workflow("flux_schnell_stream_batch")
def flux_schnell_stream_batch(g: Graph) -> None:
    g.note = f"""Stylise a frame sequence in realtime style: StreamDiffusion's stream batch on FLUX.1-schnell.

Each frame is encoded by TAEF1, noised to the first of the t_index_list steps and denoised through the
listed steps (here steps 2 and 3 of schnell's own 4-step grid: sigmas 0.5 and 0.25, like img2img at denoise
0.5; "1,2,3" keeps more of the prompt, "3" more of the input); frames at different steps share one batched forward, so the throughput is one frame per DiT
forward while each frame still gets every listed step. Near-identical consecutive frames are skipped
(similarity_threshold < 1). The report gives frames per second and frames skipped. The output has as many
frames as the input.

Files (ComfyUI/models/... and ComfyUI/input/):
{STREAM_FILES}

No files? Open flux_schnell_stream_batch_dummy.json."""
    model = g.add(
        "FewStepDiTLoader", "FewStep DiT Loader (FLUX.1-schnell)", 1, model_name="flux1-schnell.safetensors"
    )
    cond = flux_text(g, 1)
    video = g.add("LoadVideo", "Input video", 1, file="input.mp4")
    frames = g.add("GetVideoComponents", "Video frames", 2, video=video[0])
    tiny = g.add("FewStepTinyVAELoader", "Tiny VAE (TAEF1)", 2, vae_name="taef1_encoder.pth")
    out = stream_batch(
        g, model[0], tiny[0], frames[0], cond[0], 3,
        t_index_list="2,3", schedule="flux.1-schnell", schedule_steps=4, similarity_threshold=0.98,
        max_skip_frames=10, seed=42,
    )  # fmt: skip
    g.add("PreviewAny", "Report (fps, frames skipped)", 4, ui_height=200, source=out[1])
    save_video(g, out[0], 4, "fewstep/stream_batch")


@workflow("flux_schnell_stream_batch_dummy")
def flux_schnell_stream_batch_dummy(g: Graph) -> None:
    g.note = """The stream batch with no model files (random weights, CPU, seconds).

Six 64x64 frames: three blue, then three orange. With similarity_threshold 0.98 the filter skips repeats of
a near-identical frame (seeded, so the same frames every run) and the report says which. Random weights: the
output frames are noise.

Needs no files. For real stylisation open flux_schnell_stream_batch.json."""
    model = g.add("FewStepDiTLoader", "FewStep DiT Loader (dummy weights)", 1, model_name="dummy:flux-tiny")
    cond = g.add("FewStepSyntheticConditioning", "Synthetic conditioning (no text encoder)", 1)
    tiny = g.add("FewStepTinyVAELoader", "Tiny VAE (dummy TAEF1)", 1, vae_name="dummy:taef1")
    blue = g.add("EmptyImage", "Frames 1-3 (blue)", 2, width=64, height=64, batch_size=3, color=0x3366CC)
    orange = g.add("EmptyImage", "Frames 4-6 (orange)", 2, width=64, height=64, batch_size=3, color=0xEE8833)
    frames = g.add("ImageBatch", "Frame sequence", 2, image1=blue[0], image2=orange[0])
    out = stream_batch(
        g, model[0], tiny[0], frames[0], cond[0], 3,
        t_index_list="20,35", schedule="flux.1-schnell", schedule_steps=50, similarity_threshold=0.98,
        max_skip_frames=10, seed=42,
    )  # fmt: skip
    g.add("PreviewAny", "Report (fps, frames skipped)", 4, ui_height=200, source=out[1])
    save_video(g, out[0], 4, "fewstep/stream_batch_dummy")


# ---- compile / CUDA graphs (issue 7) ----


@workflow("flux_schnell_compiled")
def flux_schnell_compiled(g: Graph) -> None:
    g.note = f"""FLUX.1-schnell with a compiled DiT and a CUDA graph.

FewStep Compile compiles the repeated transformer block once (regional: seconds, not minutes), with the
token dimension dynamic so a new prompt length or resolution does not recompile, and replays the whole
forward as a CUDA graph (one per shape, kept in a small LRU). The first run pays compile and capture; later
runs replay. The sampler report shows compile time, recompiles with their reasons, and graph hits / misses.
On a machine without a GPU the graph is skipped (allow_fallback) and the report says why.

Files (ComfyUI/models/...):
- diffusion_models/flux1-schnell.safetensors
{FLUX_SIDE_FILES}

No files? Open flux_schnell_compiled_dummy.json."""
    model = g.add(
        "FewStepDiTLoader", "FewStep DiT Loader (FLUX.1-schnell)", 1, model_name="flux1-schnell.safetensors"
    )
    cond = flux_text(g, 1)
    latent = g.add("EmptySD3LatentImage", "Image size", 1, width=1024, height=1024, batch_size=1)
    fast = g.add(
        "FewStepCompile", "FewStep Compile (regional + CUDA graph)", 3, model=model[0], compile="regional",
        cuda_graph="whole", dynamic=True, backend="inductor", allow_fallback=True,
    )  # fmt: skip
    sampler = fewstep_sampler(g, "FewStep Sampler (4 steps)", 3, fast[0], cond[0], latent[0])
    g.add("PreviewAny", "Sampler report (compile, graphs)", 4, ui_height=260, source=sampler[1])
    decode_and_save(g, sampler[0], 4, "fewstep/schnell_compiled")


@workflow("flux_schnell_compiled_dummy")
def flux_schnell_compiled_dummy(g: Graph) -> None:
    g.note = """Compile and CUDA-graph switches with no model files (random weights, CPU).

Compiles the tiny FLUX block with the aot_eager backend (traced by dynamo, no C++ compiler needed); the
CUDA graph is requested, and on a CPU it falls back to eager with the reason in the report (allow_fallback).
The report lists compile time and recompiles. The output is noise.

Needs no files. For the real model open flux_schnell_compiled.json."""
    model, cond, latent = dummy_flux_inputs(g)
    fast = g.add(
        "FewStepCompile", "FewStep Compile (regional + CUDA graph)", 2, model=model[0], compile="regional",
        cuda_graph="whole", dynamic=True, backend="aot_eager", allow_fallback=True,
    )  # fmt: skip
    sampler = fewstep_sampler(g, "FewStep Sampler (4 steps)", 2, fast[0], cond[0], latent[0])
    g.add("PreviewAny", "Sampler report (compile, graphs)", 3, ui_height=260, source=sampler[1])
    g.add("SaveLatent", "Save latent", 3, samples=sampler[0], filename_prefix="fewstep/compiled_dummy")


# ---- sequence parallel (issue 8) ----


def launcher(g: Graph, col: int, **widgets) -> Node:
    return g.add(
        "FewStepParallelLauncher", "FewStep Parallel Launcher (Ulysses x2)", col, mode="sp", ulysses_degree=2,
        ring_degree=1, backend="auto", timeout=120.0, **widgets,
    )  # fmt: skip


@workflow("flux_sequence_parallel")
def flux_sequence_parallel(g: Graph) -> None:
    g.note = f"""FLUX.1-schnell at 2048x2048 on two GPUs with sequence parallelism (Ulysses, degree 2).

The launcher starts two worker processes on torch.distributed (NCCL); each loads the model once and keeps it.
Every forward runs on half of the image tokens per rank (text tokens replicated); attention exchanges heads
for tokens with an all-to-all. The sampler sends the job to the pool and gets the latent back from rank 0.
Unload models (or switch the launcher off) to stop the workers. For more ranks raise ulysses_degree (it must
divide FLUX's 24 heads) or ring_degree.

Files (ComfyUI/models/...):
- diffusion_models/flux1-schnell.safetensors
{FLUX_SIDE_FILES}

No GPUs? Open flux_sequence_parallel_dummy.json (two CPU workers on gloo)."""
    model = g.add(
        "FewStepDiTLoader", "FewStep DiT Loader (FLUX.1-schnell)", 1, model_name="flux1-schnell.safetensors"
    )
    cond = flux_text(g, 1)
    latent = g.add("EmptySD3LatentImage", "Image size", 1, width=2048, height=2048, batch_size=1)
    pool = launcher(g, 3)
    sampler = fewstep_sampler(
        g, "FewStep Sampler (4 steps, on the pool)", 3, model[0], cond[0], latent[0], parallel=pool[0]
    )
    g.add("PreviewAny", "Pool", 4, ui_height=140, source=pool[1])
    g.add("PreviewAny", "Sampler report", 4, ui_height=200, source=sampler[1])
    decode_and_save(g, sampler[0], 5, "fewstep/schnell_sp")


@workflow("flux_sequence_parallel_dummy")
def flux_sequence_parallel_dummy(g: Graph) -> None:
    g.note = """Sequence parallelism with no model files and no GPU: two CPU worker processes (gloo).

The tiny random-weight FLUX runs with its image tokens split over two ranks (Ulysses all-to-all). The result
equals the single-process run. The first run starts the workers (a few seconds); unload models to stop them.

Needs no files. For the real model open flux_sequence_parallel.json."""
    model, cond, latent = dummy_flux_inputs(g)
    pool = launcher(g, 2, threads_per_rank=1)
    sampler = fewstep_sampler(
        g, "FewStep Sampler (4 steps, on the pool)", 2, model[0], cond[0], latent[0], parallel=pool[0]
    )
    g.add("PreviewAny", "Pool", 3, ui_height=140, source=pool[1])
    g.add("PreviewAny", "Sampler report", 3, ui_height=200, source=sampler[1])
    g.add("SaveLatent", "Save latent", 3, samples=sampler[0], filename_prefix="fewstep/sp_dummy")


@workflow("wan_causal_sequence_parallel")
def wan_causal_sequence_parallel(g: Graph) -> None:
    g.note = f"""Causal streaming video on two GPUs with sequence parallelism (Ulysses, degree 2).

Each rank holds half of every frame's tokens and its share of the rolling KV cache; chunks stream back from
rank 0 and are decoded by TAEW2.1 here. Use it for resolutions or windows one GPU cannot hold. ulysses_degree
must divide Wan-1.3B's 12 heads.

Files (ComfyUI/models/...):
{WAN_FILES}

No GPUs? Open wan_causal_sequence_parallel_dummy.json."""
    model = g.add(
        "FewStepDiTLoader", "FewStep DiT Loader (Self-Forcing)", 1, model_name="self_forcing_dmd.pt"
    )
    _, cond = wan_text(g, 1, VIDEO_PROMPT)
    tiny = g.add("FewStepTinyVAELoader", "Tiny VAE (TAEW2.1)", 1, vae_name="taew2_1.pth")
    pool = launcher(g, 3)
    video = g.add(
        "FewStepCausalVideoSampler", "FewStep Causal Video Sampler (on the pool)", 3, model=model[0],
        positive=cond[0], width=832, height=480, num_chunks=7, chunk_frames=3, window_frames=21, sink_frames=0,
        seed=7, tiny_vae=tiny[0], parallel=pool[0],
    )  # fmt: skip
    g.add("PreviewAny", "Report", 4, ui_height=200, source=video[3])
    save_video(g, video[1], 4, "fewstep/wan_stream_sp")


@workflow("wan_causal_sequence_parallel_dummy")
def wan_causal_sequence_parallel_dummy(g: Graph) -> None:
    g.note = """Causal video under sequence parallelism with no files and no GPU (two CPU workers, gloo).

The tiny random-weight Wan runs chunk by chunk with each rank caching its share of the KV window; chunks
equal the single-process ones. The output is noise.

Needs no files. For the real model open wan_causal_sequence_parallel.json."""
    model, cond, tiny = dummy_wan_inputs(g)
    pool = launcher(g, 2, threads_per_rank=1)
    video = g.add(
        "FewStepCausalVideoSampler", "FewStep Causal Video Sampler (on the pool)", 2, model=model[0],
        positive=cond[0], width=96, height=64, num_chunks=3, chunk_frames=2, window_frames=6, sink_frames=1,
        seed=7, tiny_vae=tiny[0], parallel=pool[0],
    )  # fmt: skip
    g.add("PreviewAny", "Report", 3, ui_height=200, source=video[3])
    save_video(g, video[1], 3, "fewstep/wan_stream_sp_dummy")


# ---- cost planner (issue 10) ----


@workflow("cost_plan")
def cost_plan(g: Graph) -> None:
    g.note = """The bill of a job before you queue it: FLOPs per DiT forward, number of forwards, weight and
KV-cache bytes, and predicted seconds on a chosen GPU at a chosen efficiency (MFU).

Left: FLUX.1-schnell at 1024x1024 in 4 steps on an H200. Right: causal Wan 2.1-1.3B, 81 frames at 832x480,
chunks of 3 latent frames, a 21-frame window, KV in int8. Width / height / steps 0 mean "the model's usual".
The planner reads only the model's configuration (load the file you would sample with).

Files (ComfyUI/models/diffusion_models/): flux1-schnell.safetensors, self_forcing_dmd.pt.
No files? Open cost_plan_dummy.json."""
    flux = g.add(
        "FewStepDiTLoader", "FewStep DiT Loader (FLUX.1-schnell)", 1, model_name="flux1-schnell.safetensors"
    )
    bill = g.add(
        "FewStepCostPlan", "Cost plan: schnell 1024 px, 4 steps", 2, model=flux[0], width=1024, height=1024,
        steps=4, gpu="h200",
    )  # fmt: skip
    g.add("PreviewAny", "Bill (FLUX)", 3, ui_height=320, source=bill[0])
    wan = g.add("FewStepDiTLoader", "FewStep DiT Loader (Self-Forcing)", 1, model_name="self_forcing_dmd.pt")
    video = g.add(
        "FewStepCostPlan", "Cost plan: causal video 81 frames", 2, model=wan[0], width=832, height=480, steps=4,
        gpu="h200", frames=81, chunk_frames=3, window_frames=21, kv_dtype="int8",
    )  # fmt: skip
    g.add("PreviewAny", "Bill (video)", 3, ui_height=320, source=video[0])


@workflow("cost_plan_dummy")
def cost_plan_dummy(g: Graph) -> None:
    g.note = """The cost planner on the tiny dummy presets (no files): FLUX-tiny at 256x256 in 4 steps, and
Wan-tiny causal video with an int4 KV cache. The same node gives the bill of the real models (cost_plan.json).
The JSON output is what `python -m fewstep plan --json` prints."""
    flux = g.add("FewStepDiTLoader", "FewStep DiT Loader (dummy FLUX)", 1, model_name="dummy:flux-tiny")
    bill = g.add(
        "FewStepCostPlan",
        "Cost plan: FLUX-tiny",
        2,
        model=flux[0],
        width=256,
        height=256,
        steps=4,
        gpu="h100",
    )
    g.add("PreviewAny", "Bill (FLUX-tiny)", 3, ui_height=320, source=bill[0])
    g.add("PreviewAny", "Bill as JSON", 3, ui_height=200, source=bill[1])
    wan = g.add("FewStepDiTLoader", "FewStep DiT Loader (dummy Wan)", 1, model_name="dummy:wan-tiny")
    video = g.add(
        "FewStepCostPlan", "Cost plan: Wan-tiny video", 2, model=wan[0], width=96, height=64, steps=4,
        gpu="h100", frames=29, chunk_frames=2, window_frames=6, sink_frames=1, kv_dtype="int4",
    )  # fmt: skip
    g.add("PreviewAny", "Bill (Wan-tiny)", 3, ui_height=320, source=video[0])


# ---- FLUX.2 [klein] and Z-Image-Turbo (issue 16) ----

KLEIN_FILES = """- diffusion_models/flux-2-klein-4b.safetensors (huggingface.co/black-forest-labs/FLUX.2-klein-4B, Apache-2.0;
  the same file is in huggingface.co/Comfy-Org/Flux-2-Klein-4B under split_files/diffusion_models/)
- text_encoders/qwen_3_4b.safetensors (Qwen3-4B: huggingface.co/Comfy-Org/Flux-2-Klein-4B split_files/text_encoders/)
- vae_approx/taef2_decoder.pth (github.com/madebyollin/taesd); for full-quality decoding ComfyUI's VAEDecode with
  vae/flux2-vae.safetensors (Comfy-Org/Flux-2-Klein-4B split_files/vae/) decodes the same LATENT"""
ZIMAGE_FILES = """- diffusion_models/z_image_turbo_bf16.safetensors (huggingface.co/Comfy-Org/z_image_turbo; Tongyi-MAI/Z-Image-Turbo's
  sharded transformer/ folder loads too: pick any of its shards)
- text_encoders/qwen_3_4b.safetensors (Qwen3-4B: huggingface.co/Comfy-Org/z_image_turbo split_files/text_encoders/)"""
ZIMAGE_PROMPT = PROMPT
# ComfyUI 0.3.64 (CI's server) has neither CLIPLoader type flux2 nor EmptyFlux2LatentImage, and its CLIPLoader
# type lumina2 loads Gemma-2 only: the real workflows below need a current ComfyUI, the dummy twins do not.
CURRENT_COMFYUI = "Needs a current ComfyUI (FLUX.2 and Z-Image text encoders; 0.3.64 has neither)."


def qwen_text(g: Graph, col: int, clip_type: str, title: str) -> Node:
    """Qwen3-4B through ComfyUI's CLIPLoader (type flux2: FLUX.2 klein's stacked layers; lumina2: Z-Image)."""
    clip = g.add("CLIPLoader", title, col, clip_name="qwen_3_4b.safetensors", type=clip_type)
    return g.add("CLIPTextEncode", "Prompt", col + 1, text=ZIMAGE_PROMPT, clip=clip[0])


def synthetic_qwen(g: Graph, col: int, width: int, title: str) -> Node:
    """Stand-in Qwen3 features: no pooled vector, no distilled guidance."""
    return g.add(
        "FewStepSyntheticConditioning", title, col, tokens=16, width=width, pooled_width=0, guidance=0.0
    )


@workflow("flux2_klein_tiny_decode")
def flux2_klein_tiny_decode(g: Graph) -> None:
    g.note = f"""FLUX.2 [klein] 4B in 4 steps with the FewStep engine, decoded by the tiny autoencoder TAEF2.

klein is step-distilled: the flux.2-klein schedule runs 4 steps (its shift follows the image size), no CFG and
no distilled guidance, one DiT forward per step. The prompt is encoded by Qwen3-4B (CLIPLoader type flux2: three
of its hidden layers stacked, 7680 wide). The LATENT is ComfyUI's FLUX.2 latent (128 channels at 1/16 of the
image size, from Empty Flux 2 Latent); TAEF2 decodes it in milliseconds at lower detail than the full VAE.
{CURRENT_COMFYUI}

Files (ComfyUI/models/...):
{KLEIN_FILES}

No files? Open flux2_klein_tiny_decode_dummy.json."""
    model = g.add(
        "FewStepDiTLoader",
        "FewStep DiT Loader (FLUX.2 klein 4B)",
        1,
        model_name="flux-2-klein-4b.safetensors",
    )
    cond = qwen_text(g, 1, "flux2", "Load text encoder (Qwen3-4B, FLUX.2)")
    latent = g.add(
        "EmptyFlux2LatentImage", "Image size (FLUX.2 latent)", 1, width=1024, height=1024, batch_size=1
    )
    tiny = g.add("FewStepTinyVAELoader", "Tiny VAE (TAEF2)", 3, vae_name="taef2_decoder.pth")
    sampler = fewstep_sampler(
        g, "FewStep Sampler (klein, 4 steps)", 3, model[0], cond[0], latent[0], schedule="flux.2-klein",
        preview_vae=tiny[0], preview=True,
    )  # fmt: skip
    image = g.add("FewStepTinyVAEDecode", "Tiny decode (TAEF2)", 4, tiny_vae=tiny[0], samples=sampler[0])
    g.add("PreviewAny", "Sampler report", 4, ui_height=200, source=sampler[1])
    g.add(
        "SaveImage",
        "Save image",
        5,
        ui_height=420,
        images=image[0],
        filename_prefix="fewstep/flux2_klein_tiny",
    )


@workflow("flux2_klein_tiny_decode_dummy")
def flux2_klein_tiny_decode_dummy(g: Graph) -> None:
    g.note = """FLUX.2 [klein] sampling and TAEF2 decode with no model files (random weights, CPU, seconds).

dummy:flux2-tiny is a tiny FLUX.2-shaped transformer (klein's interface: 128 latent channels, 7680-wide text
features, no guidance embedding) and dummy:taef2 a TAEF2-shaped autoencoder, both with seeded random weights: the
saved image is noise. Synthetic conditioning stands in for Qwen3-4B.

The start LATENT: ComfyUI 0.3.x before FLUX.2 has no Empty Flux 2 Latent node, so the tiny AE encodes a plain
image into a FLUX.2 LATENT of the right shape ([1, 128, 8, 8] for 128x128 px). At denoise 1 the sampler starts
from pure noise (sigma 1), so only the shape of that latent is used, as with an empty one.

Needs no files. For real images open flux2_klein_tiny_decode.json (a current ComfyUI)."""
    model = g.add("FewStepDiTLoader", "FewStep DiT Loader (dummy FLUX.2)", 1, model_name="dummy:flux2-tiny")
    cond = synthetic_qwen(g, 1, 7680, "Synthetic Qwen3-4B features (klein, 7680)")
    tiny = g.add("FewStepTinyVAELoader", "Tiny VAE (dummy TAEF2)", 1, vae_name="dummy:taef2")
    picture = g.add("EmptyImage", "Image size (any picture)", 2, width=128, height=128, batch_size=1, color=0)
    latent = g.add(
        "FewStepTinyVAEEncode", "FLUX.2 LATENT of that size", 2, tiny_vae=tiny[0], pixels=picture[0]
    )
    sampler = fewstep_sampler(
        g, "FewStep Sampler (klein, 4 steps)", 3, model[0], cond[0], latent[0], schedule="flux.2-klein",
        preview_vae=tiny[0], preview=True,
    )  # fmt: skip
    image = g.add("FewStepTinyVAEDecode", "Tiny decode (TAEF2)", 4, tiny_vae=tiny[0], samples=sampler[0])
    g.add("PreviewAny", "Sampler report", 4, ui_height=200, source=sampler[1])
    g.add(
        "SaveImage",
        "Save image",
        5,
        ui_height=300,
        images=image[0],
        filename_prefix="fewstep/flux2_klein_dummy",
    )


@workflow("zimage_turbo_t2i")
def zimage_turbo_t2i(g: Graph) -> None:
    g.note = f"""Z-Image-Turbo in 8 steps with the FewStep engine, decoded by ComfyUI's VAEDecode.

Z-Image-Turbo (Tongyi-MAI, 6B, single-stream S3-DiT) is distilled for 8 DiT forwards without CFG: the
z-image-turbo schedule (shift 3) runs them. Qwen3-4B encodes the prompt (CLIPLoader type lumina2, 2560-wide
features); the image latent and the VAE are FLUX.1's (16 channels at 1/8: Empty SD3 Latent, ae.safetensors).
{CURRENT_COMFYUI}

Files (ComfyUI/models/...):
{ZIMAGE_FILES}
- vae/ae.safetensors (the FLUX.1 VAE, which Z-Image uses)

No files? Open zimage_turbo_t2i_dummy.json."""
    model = g.add(
        "FewStepDiTLoader",
        "FewStep DiT Loader (Z-Image-Turbo)",
        1,
        model_name="z_image_turbo_bf16.safetensors",
    )
    cond = qwen_text(g, 1, "lumina2", "Load text encoder (Qwen3-4B, Z-Image)")
    latent = g.add("EmptySD3LatentImage", "Image size", 1, width=1024, height=1024, batch_size=1)
    sampler = fewstep_sampler(
        g, "FewStep Sampler (Z-Image-Turbo, 8 steps)", 3, model[0], cond[0], latent[0], steps=8,
        schedule="z-image-turbo",
    )  # fmt: skip
    g.add("PreviewAny", "Sampler report", 3, ui_height=200, source=sampler[1])
    decode_and_save(g, sampler[0], 4, "fewstep/zimage_turbo")


@workflow("zimage_turbo_t2i_dummy")
def zimage_turbo_t2i_dummy(g: Graph) -> None:
    g.note = """Z-Image-Turbo sampling with no model files (random weights, CPU, seconds).

dummy:zimage-tiny is a tiny Z-Image-shaped transformer (Z-Image's interface: 16-channel FLUX.1 latent, 2x2
patches, 2560-wide Qwen3 caption features, caption and image tokens padded to multiples of 32) with seeded random
weights; synthetic conditioning stands in for Qwen3-4B and dummy:taef1 for the VAE. The saved image is noise.

Needs no files. For real images open zimage_turbo_t2i.json (a current ComfyUI)."""
    model = g.add("FewStepDiTLoader", "FewStep DiT Loader (dummy Z-Image)", 1, model_name="dummy:zimage-tiny")
    cond = synthetic_qwen(g, 1, 2560, "Synthetic Qwen3-4B features (2560)")
    latent = g.add("EmptySD3LatentImage", "Image size", 1, width=128, height=128, batch_size=1)
    tiny = g.add("FewStepTinyVAELoader", "Tiny VAE (dummy TAEF1)", 2, vae_name="dummy:taef1")
    sampler = fewstep_sampler(
        g, "FewStep Sampler (Z-Image-Turbo, 8 steps)", 2, model[0], cond[0], latent[0], steps=8,
        schedule="z-image-turbo",
    )  # fmt: skip
    image = g.add("FewStepTinyVAEDecode", "Tiny decode (TAEF1)", 3, tiny_vae=tiny[0], samples=sampler[0])
    g.add("PreviewAny", "Sampler report", 3, ui_height=200, source=sampler[1])
    g.add(
        "SaveImage",
        "Save image",
        4,
        ui_height=300,
        images=image[0],
        filename_prefix="fewstep/zimage_turbo_dummy",
    )


@workflow("zimage_turbo_stream_batch")
def zimage_turbo_stream_batch(g: Graph) -> None:
    g.note = f"""Stylise a frame sequence with Z-Image-Turbo: StreamDiffusion's stream batch, TAEF1 in and out.

Each frame is encoded by TAEF1, noised to the first listed step of the z-image-turbo schedule and denoised by
the listed steps (here 4 and 6 of its 8-step grid: about half strength); frames at different steps share one
batched forward, so the throughput is one frame per DiT forward. Near-identical consecutive frames are skipped
(similarity_threshold < 1). The report gives frames per second and frames skipped.
{CURRENT_COMFYUI}

Files (ComfyUI/models/... and ComfyUI/input/):
{ZIMAGE_FILES}
- vae_approx/taef1_encoder.pth and taef1_decoder.pth (github.com/madebyollin/taesd): both halves are used
- input/: a short video to stylise (frames of equal size, multiples of 16 px)

No files? Open zimage_turbo_stream_batch_dummy.json."""
    model = g.add(
        "FewStepDiTLoader",
        "FewStep DiT Loader (Z-Image-Turbo)",
        1,
        model_name="z_image_turbo_bf16.safetensors",
    )
    cond = qwen_text(g, 1, "lumina2", "Load text encoder (Qwen3-4B, Z-Image)")
    video = g.add("LoadVideo", "Input video", 1, file="input.mp4")
    frames = g.add("GetVideoComponents", "Video frames", 2, video=video[0])
    tiny = g.add("FewStepTinyVAELoader", "Tiny VAE (TAEF1)", 2, vae_name="taef1_encoder.pth")
    out = stream_batch(
        g, model[0], tiny[0], frames[0], cond[0], 3,
        t_index_list="4,6", schedule="z-image-turbo", schedule_steps=8, similarity_threshold=0.98,
        max_skip_frames=10, seed=42,
    )  # fmt: skip
    g.add("PreviewAny", "Report (fps, frames skipped)", 4, ui_height=200, source=out[1])
    save_video(g, out[0], 4, "fewstep/zimage_stream_batch")


@workflow("zimage_turbo_stream_batch_dummy")
def zimage_turbo_stream_batch_dummy(g: Graph) -> None:
    g.note = """The Z-Image stream batch with no model files (random weights, CPU, seconds).

Six 64x64 frames: three blue, then three orange, through dummy:zimage-tiny and dummy:taef1. With
similarity_threshold 0.98 the filter skips repeats of a near-identical frame (seeded: the same frames every run)
and the report says which. Random weights: the output frames are noise.

Needs no files. For real stylisation open zimage_turbo_stream_batch.json (a current ComfyUI)."""
    model = g.add("FewStepDiTLoader", "FewStep DiT Loader (dummy Z-Image)", 1, model_name="dummy:zimage-tiny")
    cond = synthetic_qwen(g, 1, 2560, "Synthetic Qwen3-4B features (2560)")
    tiny = g.add("FewStepTinyVAELoader", "Tiny VAE (dummy TAEF1)", 1, vae_name="dummy:taef1")
    blue = g.add("EmptyImage", "Frames 1-3 (blue)", 2, width=64, height=64, batch_size=3, color=0x3366CC)
    orange = g.add("EmptyImage", "Frames 4-6 (orange)", 2, width=64, height=64, batch_size=3, color=0xEE8833)
    frames = g.add("ImageBatch", "Frame sequence", 2, image1=blue[0], image2=orange[0])
    out = stream_batch(
        g, model[0], tiny[0], frames[0], cond[0], 3,
        t_index_list="20,35", schedule="z-image-turbo", schedule_steps=50, similarity_threshold=0.98,
        max_skip_frames=10, seed=42,
    )  # fmt: skip
    g.add("PreviewAny", "Report (fps, frames skipped)", 4, ui_height=200, source=out[1])
    save_video(g, out[0], 4, "fewstep/zimage_stream_batch_dummy")


# ---- writing ----


def render(name: str, specs: dict[str, wc.NodeSpec]) -> dict[str, str]:
    """File name -> text for one workflow, validated."""
    g = Graph(name, specs)
    WORKFLOWS[name](g)
    ui, api = to_ui(g), to_api(g)
    errors = wc.validate(ui, specs) + wc.validate(api, specs) + wc.compare_twins(ui, api, specs)
    if errors:
        raise SystemExit(f"{name}: invalid workflow:\n  " + "\n  ".join(errors))
    return {f"{name}.json": dump(ui), f"{name}.api.json": dump(api)}


def dump(obj) -> str:
    return json.dumps(obj, indent=2, ensure_ascii=False) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare with the files on disk, write nothing")
    args = ap.parse_args(argv)
    specs = wc.node_specs()
    files = {}
    for name in WORKFLOWS:
        files.update(render(name, specs))
    if not args.check:
        for fname, text in files.items():
            (HERE / fname).write_text(text)
        print(f"wrote {len(files)} files to {HERE}")
        return 0
    problems = [f"{f}: missing" for f in files if not (HERE / f).exists()]
    problems += [
        f"{f}: differs" for f, t in files.items() if (HERE / f).exists() and (HERE / f).read_text() != t
    ]
    problems += [
        f"{p.name}: stale (not built by this script)"
        for p in sorted(HERE.glob("*.json"))
        if p.name not in files
    ]
    for p in problems:
        print(p)
    if problems:
        print("run: python workflows/build_workflows.py")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
