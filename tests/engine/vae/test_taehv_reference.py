"""Our TAEHV against madebyollin's taehv.py: same random weights, same tiny inputs, the same frames out.

Skipped unless FEWSTEP_TAEHV_REF_DIR names a folder holding madebyollin's ``taehv.py``
(https://github.com/madebyollin/taehv; the file alone, no weights are read). It is imported from there.
Their model is built with ``checkpoint_path=None`` and the constructor arguments its file-name rules give the
variant (``taew2_1``: the defaults; ``taew2_2``: patch 2, 48 latent channels) and loads our state dict strictly,
no key renamed. Ours runs channels-last as the pack loads it. CPU fp32, latents 4x6.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from fewstep.engine.vae.taehv import TAEHV, TAEHV_CONFIGS, TAEHVStreamDecoder
from fewstep.engine.weights import dummy_init_

REF_DIR = os.environ.get("FEWSTEP_TAEHV_REF_DIR")
REFERENCE_KWARGS = {"taew2_1": {}, "taew2_2": {"patch_size": 2, "latent_channels": 48}}
TOL = 1e-5

pytestmark = pytest.mark.skipif(
    not REF_DIR, reason="set FEWSTEP_TAEHV_REF_DIR to a folder holding madebyollin's taehv.py to run"
)


@pytest.fixture(scope="module")
def ref_module():
    path = Path(REF_DIR) / "taehv.py"
    if not path.is_file():
        pytest.fail(f"FEWSTEP_TAEHV_REF_DIR is set but {path} does not exist")
    spec = importlib.util.spec_from_file_location("taehv_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module", params=sorted(REFERENCE_KWARGS))
def pair(request, ref_module):
    ours = TAEHV(TAEHV_CONFIGS[request.param]).eval()
    dummy_init_(ours, seed=5)
    ours.to(memory_format=torch.channels_last).requires_grad_(False)
    ref = (
        ref_module.TAEHV(checkpoint_path=None, **REFERENCE_KWARGS[request.param]).eval().requires_grad_(False)
    )
    ref.load_state_dict(ours.state_dict(), strict=True)
    return ours, ref


def _latents(ours: TAEHV, frames: int, batch: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(frames)
    return torch.randn(batch, frames, ours.latent_channels, 4, 6, generator=g) * 2


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= TOL


def test_the_same_configuration(pair):
    ours, ref = pair
    assert (ref.patch_size, ref.latent_channels) == (ours.patch_size, ours.latent_channels)
    assert (ref.t_upscale, ref.t_downscale, ref.frames_to_trim) == (
        ours.t_upscale,
        ours.t_downscale,
        ours.frames_to_trim,
    )
    assert ref.state_dict().keys() == ours.state_dict().keys()


@pytest.mark.parametrize("frames", [1, 5])
def test_decode_video_equals_theirs(pair, frames):
    ours, ref = pair
    latents = _latents(ours, frames)
    with torch.inference_mode():
        got = ours.decode_video(latents)
        assert got.shape == (2, 4 * frames - 3, 3, 4 * ours.spatial_scale, 6 * ours.spatial_scale)
        _close(got, ref.decode_video(latents, parallel=True, show_progress_bar=False))
        _close(got, ref.decode_video(latents, parallel=False, show_progress_bar=False))


@pytest.mark.parametrize("chunk", [1, 2])
def test_stream_equals_their_streaming_decoder(pair, ref_module, chunk):
    ours, ref = pair
    latents = _latents(ours, 5, batch=1)
    with torch.inference_mode():
        stream = TAEHVStreamDecoder(ours)
        streaming = ref_module.StreamingTAEHV(ref)
        for part in latents.split(chunk, 1):
            got = stream.push(part)
            theirs = []
            for latent in part.split(1, 1):
                frame = streaming.decode(latent)
                while frame is not None:
                    theirs.append(frame)
                    frame = streaming.decode()
            _close(got, torch.cat(theirs, 1))  # frame for frame, push by push


@pytest.mark.parametrize("frames", [4, 7])
def test_encode_video_equals_theirs(pair, frames):
    ours, ref = pair
    s = ours.spatial_scale
    video = torch.rand(1, frames, 3, 4 * s, 6 * s, generator=torch.Generator().manual_seed(frames))
    with torch.inference_mode():
        got = ours.encode_video(video)
        _close(got, ref.encode_video(video, parallel=True, show_progress_bar=False))
        _close(got, ref.encode_video(video, parallel=False, show_progress_bar=False))
