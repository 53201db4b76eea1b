"""Shared fixtures. Tests use tiny presets of the real architectures and run on the CPU in fp32."""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from pathlib import Path

# Triton's kernels run through its interpreter on the CPU (test_kernels.py and the engine tests in kernel mode
# "triton"). Set before anything imports Triton: a test module that imports it earlier (through torch.compile,
# say) would otherwise leave its language half-patched for the interpreter, whatever order the files run in.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"


# The pool refuses more local ranks than cores (FEWSTEP_POOL_MAX_LOCAL_RANKS lifts that); the correctness tests
# start up to 4 tiny ranks, oversubscribed on smaller CI machines on purpose. Tests of the refusal unset it.
os.environ.setdefault("FEWSTEP_POOL_MAX_LOCAL_RANKS", "4")

# ComfyUI names a custom-node package after its folder path with "." replaced by "_x_" (nodes.load_custom_node)
COMFY_MODULE_NAME = str(ROOT.parent / "custom_nodes" / "ComfyUI-FewStep").replace(".", "_x_")


def load_pack_as_comfyui(module_name: str = COMFY_MODULE_NAME):
    """Import the repository the way ComfyUI imports a custom-node folder (a module named after its path)."""
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(
        module_name, ROOT / "__init__.py", submodule_search_locations=[str(ROOT)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def pack():
    return load_pack_as_comfyui()


@pytest.fixture(autouse=True)
def _no_grad_deterministic():
    with torch.no_grad():
        yield


@pytest.fixture(scope="session")
def tiny_handle():
    from fewstep.engine import open_model

    return open_model("dummy:flux-tiny", device="cpu", dtype=torch.float32)


@pytest.fixture(scope="session")
def tiny_guidance_handle():
    from fewstep.engine import open_model

    return open_model("dummy:flux-tiny-guidance", device="cpu", dtype=torch.float32)


def make_cond(params, tokens: int = 8, seed: int = 0, batch: int = 1, guidance: float | None = 3.5):
    from fewstep.engine import TextCondition

    g = torch.Generator().manual_seed(seed)
    return TextCondition(
        torch.randn(batch, tokens, params.context_in_dim, generator=g),
        torch.randn(batch, params.vec_in_dim, generator=g),
        guidance,
    )


def fake_comfy_memory_manager(monkeypatch, loaded: list | None = None) -> dict:
    """Install the parts of ComfyUI's memory manager the pack uses (ModelPatcher callbacks, load_models_gpu) in
    sys.modules; returns the callbacks registered, by (kind, key). ``loaded`` collects what load_models_gpu got."""
    callbacks: dict = {}

    class Patcher:
        def __init__(self, model, load_device, offload_device):
            self.model = model

        def get_callbacks(self, kind, key):
            return callbacks.get((kind, key), [])

        def add_callback_with_key(self, kind, key, fn):
            callbacks.setdefault((kind, key), []).append(fn)

    mm = types.SimpleNamespace(
        get_torch_device=lambda: torch.device("cpu"), unet_offload_device=lambda: torch.device("cpu"),
        load_models_gpu=lambda models, force_full_load=False: (loaded if loaded is not None else []).extend(models),
        throw_exception_if_processing_interrupted=lambda: None,
    )  # fmt: skip
    ext = types.SimpleNamespace(CallbacksMP=types.SimpleNamespace(ON_DETACH="on_detach_after"))
    monkeypatch.setitem(sys.modules, "comfy.model_management", mm)
    monkeypatch.setitem(sys.modules, "comfy.model_patcher", types.SimpleNamespace(ModelPatcher=Patcher))
    monkeypatch.setitem(sys.modules, "comfy.patcher_extension", ext)
    return callbacks


@pytest.fixture(scope="session")
def encoder_folders(tmp_path_factory):
    """Tiny random text encoders of every family in Hugging Face folders (tests/tiny_text_encoders.py), written once
    per session; skips where transformers is not installed (the text extra)."""
    pytest.importorskip("transformers", reason="transformers not installed (the text extra)")
    import tiny_text_encoders as tiny

    root = tmp_path_factory.mktemp("text_encoders")
    p = {name: params for name, (_, params) in tiny.presets().items()}
    return {
        "flux": tiny.write_flux1_folder(str(root / "flux1"), p["flux-tiny"]),
        "wan": tiny.write_wan_folder(str(root / "wan"), p["wan-tiny"]),
        "klein": tiny.write_klein_folder(str(root / "klein"), p["flux2-tiny"]),
        "zimage": tiny.write_zimage_folder(str(root / "zimage"), p["zimage-tiny"]),
    }
