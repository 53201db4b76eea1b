"""The node definitions the workflows are built and checked against.

They come from the pack, loaded exactly as ComfyUI loads a custom-node folder, and from ``CORE_NODES``, a
hand-written table of the core nodes the shipped workflows use (checked against a real server's /object_info
by ``compare_object_info``).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the pack: workflows/fewstep_workflows/ -> the repository root
# The module name the pack is imported under (ComfyUI names a custom-node module after its folder).
PACK_MODULE = "ComfyUI-FewStep-test"

CONTROL_VALUES = {"fixed", "increment", "decrement", "randomize"}
MODEL_FILE_SUFFIXES = (".safetensors", ".sft", ".ckpt", ".pt", ".pth", ".bin", ".gguf")
IMAGE_FILE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".mp4", ".webm", ".mov", ".mkv")
DUMMY_PREFIX = "dummy:"


@dataclass(frozen=True)
class InputSpec:
    name: str
    type: str  # "INT", "COMBO", "MODEL", "*", ...
    required: bool
    options: tuple = ()  # COMBO choices
    opts: dict = field(default_factory=dict, compare=False)

    @property
    def is_widget(self) -> bool:
        return self.type in comfy_format().WIDGET_TYPES and not self.opts.get("forceInput")

    @property
    def has_control(self) -> bool:
        """Whether the frontend follows this widget with a 'control after generate' value."""
        return bool(self.opts.get("control_after_generate")) or (
            self.type == "INT" and self.name in comfy_format().SEED_INPUT_NAMES
        )

    @property
    def companion(self) -> tuple[str, frozenset, str] | None:
        """The extra widget the frontend puts after this one: (what, allowed values, value to write)."""
        if self.has_control:
            return ("control_after_generate", frozenset(CONTROL_VALUES), "fixed")
        if self.opts.get("image_upload"):
            return ("upload", frozenset({"image"}), "image")
        return None

    @property
    def is_file_combo(self) -> bool:
        """A combo listing model files: its list depends on the machine's models/ folders."""
        return self.type == "COMBO" and (
            "model_files" in self.opts or any(str(o).startswith(DUMMY_PREFIX) for o in self.options)
        )


@dataclass(frozen=True)
class NodeSpec:
    name: str
    inputs: tuple[InputSpec, ...]
    outputs: tuple[tuple[str, str], ...]  # (name, type) per slot

    def input(self, name: str) -> InputSpec | None:
        return next((i for i in self.inputs if i.name == name), None)

    @property
    def widgets(self) -> list[InputSpec]:
        return [i for i in self.inputs if i.is_widget]

    @property
    def widget_value_count(self) -> int:
        return sum(1 + (w.companion is not None) for w in self.widgets)


def parse_input(name: str, decl, required: bool) -> InputSpec:
    typ = decl[0]
    opts = dict(decl[1]) if len(decl) > 1 and decl[1] else {}
    if isinstance(typ, (list, tuple)):
        return InputSpec(name, "COMBO", required, tuple(typ), opts)
    if typ == "COMBO":  # V3 schema form
        return InputSpec(name, "COMBO", required, tuple(opts.get("options", ())), opts)
    return InputSpec(name, typ, required, (), opts)


def spec_from_input_types(name: str, input_types: dict, outputs) -> NodeSpec:
    inputs = [
        parse_input(n, decl, section == "required")
        for section in ("required", "optional")
        for n, decl in input_types.get(section, {}).items()
    ]
    return NodeSpec(name, tuple(inputs), tuple(outputs))


def spec_from_class(name: str, cls) -> NodeSpec:
    types = tuple(cls.RETURN_TYPES)
    names = tuple(getattr(cls, "RETURN_NAMES", None) or types)
    return spec_from_input_types(name, cls.INPUT_TYPES(), zip(names, types))


def core(required: dict, optional: dict | None = None, outputs: dict | None = None) -> dict:
    return {"required": required, "optional": optional or {}, "outputs": outputs or {}}


def files(folder: str, *extra: str) -> tuple:
    """A combo of the model files in ``folder`` (plus fixed extra entries)."""
    return (list(extra), {"model_files": folder})


def seed_int() -> tuple:
    return ("INT", {"default": 0, "min": 0, "max": 0xFFFFFFFFFFFFFFFF, "control_after_generate": True})


# The core nodes the shipped workflows use, as ComfyUI 0.3.64 declares them (nodes.py, comfy_extras/).
CORE_NODES = {
    "DualCLIPLoader": core(
        {
            "clip_name1": files("text_encoders"),
            "clip_name2": files("text_encoders"),
            "type": (["sdxl", "sd3", "flux", "hunyuan_video", "hidream", "hunyuan_image"],),
        },
        {"device": (["default", "cpu"], {"advanced": True})},
        outputs={"CLIP": "CLIP"},
    ),
    "CLIPTextEncodeFlux": core(
        {
            "clip": ("CLIP",),
            "clip_l": ("STRING", {"multiline": True, "dynamicPrompts": True}),
            "t5xxl": ("STRING", {"multiline": True, "dynamicPrompts": True}),
            "guidance": ("FLOAT", {"default": 3.5, "min": 0.0, "max": 100.0, "step": 0.1}),
        },
        outputs={"CONDITIONING": "CONDITIONING"},
    ),
    "EmptySD3LatentImage": core(
        {
            "width": ("INT", {"default": 1024, "min": 16, "max": 16384, "step": 16}),
            "height": ("INT", {"default": 1024, "min": 16, "max": 16384, "step": 16}),
            "batch_size": ("INT", {"default": 1, "min": 1, "max": 4096}),
        },
        outputs={"LATENT": "LATENT"},
    ),
    "UNETLoader": core(
        {
            "unet_name": files("diffusion_models"),
            "weight_dtype": (["default", "fp8_e4m3fn", "fp8_e4m3fn_fast", "fp8_e5m2"],),
        },
        outputs={"MODEL": "MODEL"},
    ),
    "VAELoader": core({"vae_name": files("vae", "pixel_space")}, outputs={"VAE": "VAE"}),
    "VAEDecode": core({"samples": ("LATENT",), "vae": ("VAE",)}, outputs={"IMAGE": "IMAGE"}),
    "SaveImage": core({"images": ("IMAGE",), "filename_prefix": ("STRING", {"default": "ComfyUI"})}),
    "PreviewImage": core({"images": ("IMAGE",)}),
    "CLIPLoader": core(
        {
            "clip_name": files("text_encoders"),
            "type": (
                [
                    "stable_diffusion",
                    "stable_cascade",
                    "sd3",
                    "stable_audio",
                    "mochi",
                    "ltxv",
                    "pixart",
                    "cosmos",
                    "lumina2",
                    "wan",
                    "hidream",
                    "chroma",
                    "ace",
                    "omnigen2",
                    "qwen_image",
                    "hunyuan_image",
                ],
            ),
        },
        {"device": (["default", "cpu"], {"advanced": True})},
        outputs={"CLIP": "CLIP"},
    ),
    "CLIPTextEncode": core(
        {"text": ("STRING", {"multiline": True, "dynamicPrompts": True}), "clip": ("CLIP",)},
        outputs={"CONDITIONING": "CONDITIONING"},
    ),
    "SaveAnimatedWEBP": core(
        {
            "images": ("IMAGE",),
            "filename_prefix": ("STRING", {"default": "ComfyUI"}),
            "fps": ("FLOAT", {"default": 6.0, "min": 0.01, "max": 1000.0, "step": 0.01}),
            "lossless": ("BOOLEAN", {"default": True}),
            "quality": ("INT", {"default": 80, "min": 0, "max": 100}),
            "method": (["default", "fastest", "slowest"],),
        }
    ),
    "ImageBatch": core({"image1": ("IMAGE",), "image2": ("IMAGE",)}, outputs={"IMAGE": "IMAGE"}),
    "VAEEncode": core({"pixels": ("IMAGE",), "vae": ("VAE",)}, outputs={"LATENT": "LATENT"}),
    "ImageScale": core(
        {
            "image": ("IMAGE",),
            "upscale_method": (["nearest-exact", "bilinear", "area", "bicubic", "lanczos"],),
            "width": ("INT", {"default": 512, "min": 0, "max": 16384, "step": 1}),
            "height": ("INT", {"default": 512, "min": 0, "max": 16384, "step": 1}),
            "crop": (["disabled", "center"],),
        },
        outputs={"IMAGE": "IMAGE"},
    ),
    "ImageFromBatch": core(
        {
            "image": ("IMAGE",),
            "batch_index": ("INT", {"default": 0, "min": 0, "max": 4095}),
            "length": ("INT", {"default": 1, "min": 1, "max": 4096}),
        },
        outputs={"IMAGE": "IMAGE"},
    ),
    "LoadImage": core(
        {"image": ([], {"model_files": "input", "image_upload": True})},
        outputs={"IMAGE": "IMAGE", "MASK": "MASK"},
    ),
    "EmptyImage": core(
        {
            "width": ("INT", {"default": 512, "min": 1, "max": 16384, "step": 1}),
            "height": ("INT", {"default": 512, "min": 1, "max": 16384, "step": 1}),
            "batch_size": ("INT", {"default": 1, "min": 1, "max": 4096}),
            "color": ("INT", {"default": 0, "min": 0, "max": 0xFFFFFF, "step": 1, "display": "color"}),
        },
        outputs={"IMAGE": "IMAGE"},
    ),
    "SaveLatent": core(
        {"samples": ("LATENT",), "filename_prefix": ("STRING", {"default": "latents/ComfyUI"})}
    ),
    "PreviewAny": core({"source": ("*", {})}),
    "LoadVideo": core(
        {"file": ([], {"model_files": "input", "video_upload": True})}, outputs={"VIDEO": "VIDEO"}
    ),
    "GetVideoComponents": core(
        {"video": ("VIDEO",)}, outputs={"images": "IMAGE", "audio": "AUDIO", "fps": "FLOAT"}
    ),
    "BasicGuider": core(
        {"model": ("MODEL",), "conditioning": ("CONDITIONING",)}, outputs={"GUIDER": "GUIDER"}
    ),
    "RandomNoise": core({"noise_seed": seed_int()}, outputs={"NOISE": "NOISE"}),
    "SamplerCustomAdvanced": core(
        {
            "noise": ("NOISE",),
            "guider": ("GUIDER",),
            "sampler": ("SAMPLER",),
            "sigmas": ("SIGMAS",),
            "latent_image": ("LATENT",),
        },
        outputs={"output": "LATENT", "denoised_output": "LATENT"},
    ),
}


# Core nodes and combo entries of ComfyUI releases after 0.3.64 (the version CI's server runs), as current
# ComfyUI declares them (comfy_extras/nodes_flux.py, nodes.py CLIPLoader). Only the real FLUX.2 workflows use
# them; their dummy twins stay on 0.3.64's nodes, so every dummy workflow still runs on the CI server.
NEWER_CORE_NODES = {
    "EmptyFlux2LatentImage": core(
        {
            "width": ("INT", {"default": 1024, "min": 16, "max": 16384, "step": 16}),
            "height": ("INT", {"default": 1024, "min": 16, "max": 16384, "step": 16}),
            "batch_size": ("INT", {"default": 1, "min": 1, "max": 4096}),
        },
        outputs={"LATENT": "LATENT"},
    ),
}


# (node, combo input) -> entries added after 0.3.64: CLIPLoader's "flux2" loads FLUX.2's Qwen3 / Mistral encoders.
NEWER_COMBO_OPTIONS = {("CLIPLoader", "type"): ("flux2",)}

# Deprecated core nodes the workflows keep on purpose, with the node that replaces each in newer ComfyUI.
# ComfyUI 0.8.0 flags ImageBatch DEPRECATED: /object_info says "deprecated": true and the frontend hides it from
# node search (setting Comfy.Node.ShowDeprecated, off by default), but execution ignores the flag, so a saved
# workflow still runs it; 0.30.0 still registers it, still flagged. Its replacement, BatchImagesNode, is not in
# 0.3.64 (the oldest ComfyUI the pack supports): switching would break the workflows there.
DEPRECATED_CORE_NODES = {"ImageBatch": "BatchImagesNode"}
IMAGE_BATCH_NOTE = (
    "Joining images uses core's Batch Images (ImageBatch): ComfyUI 0.8.0 and later mark it deprecated and hide it "
    "from node search, but it still runs; its replacement (BatchImagesNode) is missing from ComfyUI 0.3.64, so "
    "this workflow keeps it to run on both."
)


def with_newer_options(name: str, d: dict) -> dict:
    """A CORE_NODES entry with the combo entries of later ComfyUI releases appended."""
    d = {**d, "required": dict(d["required"]), "optional": dict(d["optional"])}
    for (node, inp), extra in NEWER_COMBO_OPTIONS.items():
        if node == name:
            section = "required" if inp in d["required"] else "optional"
            options, *rest = d[section][inp]
            d[section][inp] = (list(options) + list(extra), *rest)
    return d


def load_pack(root: Path = ROOT):
    """Import the pack the way ComfyUI imports a custom-node folder (a module named after the folder)."""
    if PACK_MODULE in sys.modules:
        return sys.modules[PACK_MODULE]
    spec = importlib.util.spec_from_file_location(
        PACK_MODULE, root / "__init__.py", submodule_search_locations=[str(root)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[PACK_MODULE] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[PACK_MODULE]
        raise
    return module


@functools.cache
def comfy_format():
    """The pack's model of ComfyUI's workflow formats (cli/comfy_client.py, imported with the pack): the one owner
    of the frontend's rules this builder follows too (the widget types, the seed names that get a control widget,
    the frontend-only node types)."""
    return importlib.import_module(f"{load_pack().__name__}.cli.comfy_client")


def node_specs() -> dict[str, NodeSpec]:
    specs = {name: spec_from_class(name, cls) for name, cls in load_pack().NODE_CLASS_MAPPINGS.items()}
    for name, d in {
        **CORE_NODES,
        **NEWER_CORE_NODES,
    }.items():  # core wins: ComfyUI drops a colliding pack node
        d = with_newer_options(name, d)
        specs[name] = spec_from_input_types(name, d, d["outputs"].items())
    return specs


def spec_from_object_info(name: str, info: dict) -> NodeSpec:
    order = info.get("input_order") or {s: list(info["input"].get(s, {})) for s in ("required", "optional")}
    ordered = {s: {n: info["input"][s][n] for n in order.get(s, [])} for s in ("required", "optional")}
    return spec_from_input_types(name, ordered, zip(info.get("output_name", []), info.get("output", [])))


def compare_object_info(spec: NodeSpec, info: dict) -> list[str]:
    """How ``spec`` disagrees with a server's /object_info entry for the same node."""
    server = spec_from_object_info(spec.name, info)
    errors = []
    ours = [(i.name, i.type, i.required) for i in spec.inputs]
    theirs = [(i.name, i.type, i.required) for i in server.inputs]
    if ours != theirs:
        errors.append(f"{spec.name}: inputs (name, type, required) {ours}, server {theirs}")
    for mine in spec.inputs:
        other = server.input(mine.name)
        if other is None or other.type != mine.type:
            continue
        for key in ("default", "min", "max", "control_after_generate", "forceInput"):
            if mine.opts.get(key) != other.opts.get(key):
                errors.append(
                    f"{spec.name}.{mine.name}: {key} {mine.opts.get(key)!r}, server {other.opts.get(key)!r}"
                )
        # File combos list what the machine has; only the fixed entries must agree.
        if mine.is_file_combo:
            if not set(mine.options) <= set(other.options):
                errors.append(
                    f"{spec.name}.{mine.name}: options {mine.options} not all on server {other.options}"
                )
        elif mine.options != other.options:
            # an older server (0.3.64 in CI) lacks the entries later releases added; a newer one has them
            newer = NEWER_COMBO_OPTIONS.get((spec.name, mine.name), ())
            if tuple(o for o in mine.options if o not in newer or o in other.options) != other.options:
                errors.append(f"{spec.name}.{mine.name}: options {mine.options}, server {other.options}")
    if spec.outputs != server.outputs:
        errors.append(f"{spec.name}: outputs {spec.outputs}, server {server.outputs}")
    return errors
