"""A session started from clean latents (``VideoSession.prefill``: image to video, video extension) against
Self-Forcing's own ``CausalInferencePipeline.inference(initial_latent=...)`` (guandeh17/Self-Forcing), same
weights, prompt, noise and timesteps, float32 on the CPU.

Runs only when ``FEWSTEP_SELF_FORCING_DIR`` names an extracted checkout (``tests/self_forcing_harness.py`` runs
their loop unchanged). Their two prefills: with ``independent_first_frame`` the first given frame is committed
alone, then whole blocks (1 frame: image to video; 1 + 3 frames); without it whole blocks only (6 frames). The
streams run past the window, so frames given at the start are evicted (and kept as sinks in one case).
"""

from __future__ import annotations

import pytest
import self_forcing_harness as sfh
import torch

ROOT = sfh.reference_dir()
if ROOT is None:
    pytest.skip(
        f"set {sfh.ENV} to an extracted guandeh17/Self-Forcing checkout to compare prefills with its "
        "CausalInferencePipeline(initial_latent=...)",
        allow_module_level=True,
    )
if sfh.missing_files(ROOT) if ROOT.is_dir() else True:
    pytest.skip(f"{sfh.ENV}={ROOT} is not an extracted Self-Forcing checkout", allow_module_level=True)
pytest.importorskip("diffusers", reason="Self-Forcing's CausalWanModel is a diffusers ModelMixin")

from fewstep.engine import load_dit  # noqa: E402
from fewstep.engine.causal import CausalConfig, VideoSession  # noqa: E402

TOL = 1e-5
HEIGHT = WIDTH = 64
CHUNK, CHUNKS, STEPS, SEED = 3, 3, 4, 0


@pytest.fixture(scope="module")
def sf():
    return sfh.load(ROOT)


@pytest.fixture(scope="module")
def model():
    return load_dit("dummy:wan-tiny", dtype=torch.float32, device="cpu")


@pytest.fixture(scope="module")
def context(model):
    return torch.randn(1, 16, model.params.text_dim, generator=torch.Generator().manual_seed(1))


def start_latents(model, frames: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randn(1, model.params.in_dim, frames, HEIGHT // 8, WIDTH // 8, generator=g)


@pytest.mark.parametrize(
    "given, window, sinks, rope",
    [
        (1, 6, 0, "absolute"),  # image to video: the first frame alone
        (4, 6, 0, "absolute"),  # 1 + a block: the first frame alone, then a block
        (6, 6, 0, "absolute"),  # whole blocks (their independent_first_frame off)
        (1, 9, 3, "absolute"),  # the image and the first two generated frames are the sinks
        (6, 6, 0, "cache"),  # without sinks cache RoPE is absolute RoPE
    ],
)
def test_prefill_equals_self_forcing_initial_latent(sf, model, context, given, window, sinks, rope):
    x0 = start_latents(model, given)
    _, _, ph, pw = (None, *model.params.patch_size)
    tokens = (HEIGHT // 8 // ph) * (WIDTH // 8 // pw)
    pipe = sfh.reference_pipeline(
        sf, model, context, CHUNK, window, tokens, sink_frames=sinks,
        independent_first_frame=given % CHUNK == 1,
    )  # fmt: skip
    noise = sfh.session_noise(SEED, (1, model.params.in_dim, CHUNK, HEIGHT // 8, WIDTH // 8), CHUNKS, STEPS)
    want = sfh.run_reference(sf, pipe, noise, STEPS, initial_latent=x0).latents

    session = VideoSession(model, context, HEIGHT, WIDTH, CausalConfig(CHUNK, window, sinks, rope=rope), SEED)
    result = session.prefill(x0)
    assert result.frames == given and sum(result.blocks) == given
    chunks = list(session.chunks(CHUNKS))
    assert [c.start_frame for c in chunks] == [given + k * CHUNK for k in range(CHUNKS)]
    got = torch.cat([c.latents for c in chunks], dim=2)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= TOL
