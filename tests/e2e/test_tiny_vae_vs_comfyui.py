"""ComfyUI's own VAE (0.8.0 and later) decodes the video tiny VAEs it lists in vae_approx (``lighttaew2_1``,
``taehv``) as FewStep Tiny VAE Loader / Decode do, on the same files written with the published key names.

Runs once per ComfyUI version with tests/e2e (``COMFYUI_DIR``); skipped with its reason on a ComfyUI that does not
list those names (0.3.64).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from comfy_server import COMFYUI_DIR
from comfy_server import _python as comfy_python
from test_core_video_tae_names import _weights, _write, vae_approx  # noqa: F401 - ``vae_approx`` is a fixture

# ruff: noqa: F811 - the test takes the imported ``vae_approx`` fixture as an argument


def _comfy_lists_video_taes() -> bool:
    return bool(COMFYUI_DIR) and "lighttaew2_1" in (Path(COMFYUI_DIR) / "nodes.py").read_text()


@pytest.mark.skipif(
    not COMFYUI_DIR or not (Path(COMFYUI_DIR) / "nodes.py").exists(),
    reason="set COMFYUI_DIR to a ComfyUI checkout (0.8.0 or later) to compare with its own decoder",
)
@pytest.mark.parametrize("file_name,variant,dtype", [
    ("lighttaew2_1.safetensors", "lighttaew2_1", torch.float32),
    ("taehv.safetensors", "taehv", torch.float16),  # ComfyUI tells taehv from lighttaew2_1 by its fp16 weights
])  # fmt: skip
def test_comfyuis_own_vae_decodes_the_same_files_equally(pack, vae_approx, file_name, variant, dtype):
    if not _comfy_lists_video_taes():
        pytest.skip(
            f"this ComfyUI ({COMFYUI_DIR}) does not load video tiny VAEs from vae_approx (0.8.0 does)"
        )
    sd = _weights(seed=9, dtype=dtype)
    _write(vae_approx / file_name, sd)
    raw = torch.randn(1, 16, 2, 4, 6, generator=torch.Generator().manual_seed(3))
    torch.save(raw, vae_approx / "latent.pt")
    script = (
        "import sys, torch\n"
        "sys.argv = [sys.argv[0], '--cpu']\n"
        f"sys.path.insert(0, {COMFYUI_DIR!r})\n"
        "import comfy.options\n"
        "comfy.options.enable_args_parsing()\n"
        "import comfy.sd, comfy.utils\n"
        f"vae = comfy.sd.VAE(sd=comfy.utils.load_torch_file({str(vae_approx / file_name)!r}))\n"
        "vae.throw_exception_if_invalid()\n"
        f"out = vae.decode(torch.load({str(vae_approx / 'latent.pt')!r}))\n"
        f"torch.save(out.float().cpu(), {str(vae_approx / 'comfy_frames.pt')!r})\n"
    )
    run = subprocess.run(
        [comfy_python(), "-c", script], capture_output=True, text=True, timeout=300, cwd=COMFYUI_DIR
    )
    assert run.returncode == 0, run.stderr[-3000:]
    # ComfyUI's TAEHV leaves values outside [0, 1] (random weights make many); ours clamps to the IMAGE range
    theirs = torch.load(vae_approx / "comfy_frames.pt").reshape(-1, 32, 48, 3).clamp(0, 1)
    (vae,) = pack.NODE_CLASS_MAPPINGS["FewStepTinyVAELoader"]().load(file_name, "fp32")
    assert vae.variant.name == variant
    (ours,) = pack.NODE_CLASS_MAPPINGS["FewStepTinyVAEDecode"]().decode(vae, {"samples": raw})
    assert theirs.shape == ours.shape
    torch.testing.assert_close(ours, theirs, atol=2e-3 if dtype == torch.float16 else 1e-4, rtol=0)
