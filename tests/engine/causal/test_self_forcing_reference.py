"""Our causal stream against Self-Forcing's own ``CausalInferencePipeline`` (guandeh17/Self-Forcing), same weights,
prompt, noise and timesteps, float32 on the CPU.

Runs only when ``FEWSTEP_SELF_FORCING_DIR`` names an extracted checkout (``git archive`` of the repository); the
reference code is imported from there at run time (``tests/self_forcing_harness.py`` says what is bypassed around
their loop). The stream is long enough that the window evicts frames: chunk 3, window 6, 4 chunks (12 latent
frames), so chunks 2 and 3 attend to a window that has dropped the first frames.
"""

from __future__ import annotations

import pytest
import self_forcing_harness as sfh
import torch

ROOT = sfh.reference_dir()
MISSING = sfh.missing_files(ROOT) if ROOT is not None and ROOT.is_dir() else None

if ROOT is None:
    pytest.skip(
        f"set {sfh.ENV} to an extracted guandeh17/Self-Forcing checkout to compare the causal stream with its "
        "CausalInferencePipeline",
        allow_module_level=True,
    )
if MISSING is None or MISSING:
    pytest.skip(
        f"{sfh.ENV}={ROOT} is not an extracted Self-Forcing checkout (missing: "
        f"{', '.join(MISSING or sfh.REQUIRED)})",
        allow_module_level=True,
    )
pytest.importorskip("diffusers", reason="Self-Forcing's CausalWanModel is a diffusers ModelMixin")

from fewstep.engine import load_dit  # noqa: E402
from fewstep.engine.causal import CausalConfig, VideoSession  # noqa: E402
from fewstep.engine.sampling import schedule_sigmas  # noqa: E402

TOL = 1e-5  # float32 on both sides; they differ by rounding (their RoPE and x0 conversion run in float64)
HEIGHT = WIDTH = 64  # 8x8 latent, 16 tokens a frame
CHUNK, WINDOW, CHUNKS, STEPS, SEED = 3, 6, 4, 4, 0


@pytest.fixture(scope="module")
def sf():
    return sfh.load(ROOT)


@pytest.fixture(scope="module")
def model():
    return load_dit("dummy:wan-tiny", dtype=torch.float32, device="cpu")


@pytest.fixture(scope="module")
def context(model):
    return torch.randn(1, 16, model.params.text_dim, generator=torch.Generator().manual_seed(1))


def tokens_per_frame(model) -> int:
    _, ph, pw = model.params.patch_size
    return (HEIGHT // 8 // ph) * (WIDTH // 8 // pw)


def theirs(sf, model, context, window: int, sinks: int = 0) -> sfh.ReferenceRun:
    noise = sfh.session_noise(SEED, (1, model.params.in_dim, CHUNK, HEIGHT // 8, WIDTH // 8), CHUNKS, STEPS)
    pipe = sfh.reference_pipeline(
        sf, model, context, CHUNK, window, tokens_per_frame(model), sink_frames=sinks
    )
    return sfh.run_reference(sf, pipe, noise, STEPS)


def ours(model, context, window: int, rope: str, sinks: int = 0):
    session = VideoSession(model, context, HEIGHT, WIDTH, CausalConfig(CHUNK, window, sinks, rope=rope), SEED)
    chunks = list(session.chunks(CHUNKS))
    return torch.cat([c.latents for c in chunks], dim=2), chunks


@pytest.fixture(scope="module")
def reference(sf, model, context):
    return theirs(sf, model, context, WINDOW)


def test_timesteps_are_ours(reference):
    """Their warped denoising_step_list is our wan-dmd-4step schedule on the 0..1000 scale."""
    want = (schedule_sigmas("wan-dmd-4step")[:-1] * 1000).tolist()
    assert reference.timesteps == pytest.approx(want, abs=1e-3)


@pytest.mark.parametrize("rope", ["absolute", "cache"])
def test_stream_equals_self_forcing(model, context, reference, rope):
    got, chunks = ours(model, context, WINDOW, rope)
    assert got.shape == reference.latents.shape == (1, 16, CHUNK * CHUNKS, HEIGHT // 8, WIDTH // 8)
    assert (got - reference.latents).abs().max().item() <= TOL
    if rope == "absolute":  # both allocate window x tokens x heads x head_dim for k and v of every block
        assert all(c.kv_bytes == reference.kv_bytes for c in chunks)


def test_cache_rope_is_absolute_rope_without_sinks(model, context):
    """Without sinks, positions in the cache differ from absolute ones by a constant per chunk: same video."""
    a, _ = ours(model, context, WINDOW, "absolute")
    c, _ = ours(model, context, WINDOW, "cache")
    assert (a - c).abs().max().item() <= TOL


def test_sinks_with_absolute_rope_equal_self_forcing_sink_size(sf, model, context):
    """Their ``sink_size`` keeps the first frames when the cache rolls, at absolute positions: ours with
    ``rope="absolute"`` (with sinks, ``rope="cache"`` renumbers positions after an eviction, by design)."""
    window, sinks = 9, 3
    got, _ = ours(model, context, window, "absolute", sinks)
    want = theirs(sf, model, context, window, sinks).latents
    assert (got - want).abs().max().item() <= TOL


def test_the_window_matters(sf, model, context, reference):
    """Control: their stream with a window that never evicts agrees with ours until our window first drops a
    frame (frame 6 on), then differs by far more than the tolerance (the comparison sees the eviction)."""
    wide = theirs(sf, model, context, CHUNK * CHUNKS).latents
    got, _ = ours(model, context, WINDOW, "absolute")
    assert (got[:, :, :WINDOW] - wide[:, :, :WINDOW]).abs().max().item() <= TOL
    assert (got[:, :, WINDOW:] - wide[:, :, WINDOW:]).abs().max().item() > 100 * TOL
