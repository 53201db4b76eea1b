"""A video-to-video session (``VideoSession.set_strength`` / ``feed`` / ``chunks``) against StreamDiffusionV2's own
``CausalStreamInferencePipeline`` (chenfengxu714/StreamDiffusionV2: ``prepare`` for the first chunk,
``inference_wo_batch`` for each next one), same weights, prompt, input latents, noise and timesteps, float32 on the
CPU.

Runs only when ``FEWSTEP_STREAMDIFFUSIONV2_DIR`` names an extracted checkout (``tests/streamdiffusionv2_harness.py``
runs their loop unchanged). Their settings are ``configs/wan_causal_dmd_v2v.yaml``'s with
``warp_denoising_step: true`` (the yaml's ``false`` feeds the model the raw timesteps 700, 500, ... while the
scheduler noises and converts at the nearest point of the shift-8 table: a timestep that is not ``1000 * sigma``,
which no sigma list represents), a fixed noise scale (no motion-aware ``compute_noise_scale_and_step``), the
adaptive sink refresh off, no stream batch. Our side: the ``wan-v2v-4step`` schedule at ``strength`` = its first
sigma, absolute RoPE (and cache RoPE, the same without sinks), no sinks.

Equal while their cache holds the whole stream: their ``num_kv_cache`` must exceed the stream's frames (a cache
exactly full already takes their eviction path); our window holds the stream. With eviction the two differ by
design (:func:`test_their_eviction_writes_a_chunks_first_step_over_the_previous_chunk`).
"""

from __future__ import annotations

import pytest
import self_forcing_harness as sfh
import streamdiffusionv2_harness as sdh
import torch

ROOT = sdh.reference_dir()
if ROOT is None:
    pytest.skip(
        f"set {sdh.ENV} to an extracted chenfengxu714/StreamDiffusionV2 checkout to compare video to video with "
        "its CausalStreamInferencePipeline",
        allow_module_level=True,
    )
if sdh.missing_files(ROOT) if ROOT.is_dir() else True:
    pytest.skip(f"{sdh.ENV}={ROOT} is not an extracted StreamDiffusionV2 checkout", allow_module_level=True)
pytest.importorskip("diffusers", reason="StreamDiffusionV2's CausalWanModel is a diffusers ModelMixin")
pytest.importorskip(
    "einops", reason="StreamDiffusionV2's Wan VAE module (imported by its wrapper) needs einops"
)

from fewstep.engine import load_dit  # noqa: E402
from fewstep.engine.causal import CausalConfig, VideoSession  # noqa: E402
from fewstep.engine.sampling import schedule_sigmas  # noqa: E402

TOL = 1e-5
HEIGHT = WIDTH = 64
SEED = 0
SCHEDULE = "wan-v2v-4step"


@pytest.fixture(scope="module")
def sd():
    return sdh.load(ROOT)


@pytest.fixture(scope="module")
def model():
    return load_dit("dummy:wan-tiny", dtype=torch.float32, device="cpu")


@pytest.fixture(scope="module")
def context(model):
    return torch.randn(1, 16, model.params.text_dim, generator=torch.Generator().manual_seed(1))


def input_latents(model, frames: int) -> torch.Tensor:
    """An encoded input video stands in as random latents (the model's latent space)."""
    g = torch.Generator().manual_seed(3)
    return torch.randn(1, model.params.in_dim, frames, HEIGHT // 8, WIDTH // 8, generator=g)


def ours(model, context, inputs, chunk, window, sinks, steps, rope="absolute"):
    """Our session restyling ``inputs`` chunk by chunk at the preset's first sigma; (latents, forwards)."""
    config = CausalConfig(chunk, window, sinks, schedule=SCHEDULE, steps=steps, rope=rope)
    session = VideoSession(model, context, HEIGHT, WIDTH, config, SEED)
    session.set_strength(float(schedule_sigmas(SCHEDULE, steps)[0]))
    forwards = []
    out = []
    for k in range(inputs.shape[2] // chunk):
        session.feed(inputs[:, :, k * chunk : (k + 1) * chunk])  # a live input: one chunk at a time
        (result,) = session.chunks(1, before_forward=lambda c, s: forwards.append((c, s)))
        assert (result.mode, result.start_frame) == ("v2v", k * chunk)
        out.append(result.latents)
    return torch.cat(out, dim=2), forwards


def theirs(sd, model, context, inputs, chunk, kv_cache_frames, sinks, steps):
    pipe = sdh.reference_pipeline(sd, model, context, HEIGHT, WIDTH, chunk, kv_cache_frames, sinks, steps)
    chunks = inputs.shape[2] // chunk
    noise = sfh.session_noise(SEED, (1, model.params.in_dim, chunk, HEIGHT // 8, WIDTH // 8), chunks, steps)
    return sdh.run_reference(sd, pipe, inputs, noise, float(schedule_sigmas(SCHEDULE, steps)[0]))


@pytest.mark.parametrize("steps", [4, 2])
def test_their_warped_list_is_wan_v2v_4step(sd, model, context, steps):
    """Their warped ``denoising_step_list`` (``--step 4`` and their driver's default ``--step 2``) is our preset
    on the 0..1000 scale, and their scheduler's sigma at each timestep is our sigma: so ``strength`` = our first
    sigma is their noise scale, and ``v2v_sigmas`` gives the preset back."""
    pipe = sdh.reference_pipeline(sd, model, context, HEIGHT, WIDTH, 1, 2, 0, steps)
    want = schedule_sigmas(SCHEDULE, steps)
    got = torch.tensor([float(t) for t in pipe.denoising_step_list]) / 1000
    assert len(got) == steps
    assert (got - want[:-1]).abs().max().item() <= 1e-6
    assert abs(sdh.first_sigma(pipe) - float(want[0])) <= 1e-6
    assert (
        torch.tensor(sdh._sigmas_at(pipe, pipe.denoising_step_list)) - want[:-1]
    ).abs().max().item() <= 1e-6


@pytest.mark.parametrize(
    "chunk, chunks, steps, rope",
    [
        (1, 5, 4, "absolute"),  # their yaml's num_frame_per_block 1
        (2, 3, 4, "absolute"),  # blocks of 2 frames
        (1, 4, 2, "absolute"),  # their driver's default --step 2
        (1, 4, 4, "cache"),  # without sinks cache RoPE is absolute RoPE
    ],
)
def test_v2v_equals_streamdiffusionv2(sd, model, context, chunk, chunks, steps, rope):
    frames = chunk * chunks
    inputs = input_latents(model, frames)
    # their cache one frame larger than the stream: a cache exactly full takes their eviction path
    ref = theirs(sd, model, context, inputs, chunk, frames + 1, 0, steps)
    got, forwards = ours(model, context, inputs, chunk, frames, 0, steps, rope)
    assert got.shape == ref.latents.shape
    assert (got - ref.latents).abs().max().item() <= TOL
    # no clean-context pass on either side: each chunk is its denoising steps, whose K/V stay in the chunk's
    # own slots (the last step's are what the next chunks read)
    assert ref.forwards == chunks * steps and len(forwards) == chunks * steps
    assert all(step is not None for _, step in forwards)
    assert ref.writes == [
        list(range(k * chunk, (k + 1) * chunk)) for k in range(chunks) for _ in range(steps)
    ]


def test_their_eviction_writes_a_chunks_first_step_over_the_previous_chunk(sd, model, context):
    """With eviction the two differ, by design: their yaml's ring (num_kv_cache 6, num_sink_tokens 3, one frame a
    chunk, 4 steps) on an 8-chunk stream, our window of 6 with 3 sinks.

    Their eviction path is taken by every forward once the cache is full, including the chunk that just filled
    it; each layer's ``evict_idx`` queue holds the ring slots 3, 4, 5 and ``kv_cache['current_step']`` pops it
    once every ``total_steps`` forwards, after the write. So the chunk that fills the cache (frame 5) writes its
    first step into slot 5 and its other steps into slot 3 (frame 3 is gone while frame 5's first-step K/V stay
    in slot 5); from then on each chunk writes its first step over the slot holding the previous chunk's last
    step, and its other steps into the next slot. A chunk never reads the previous chunk's final K/V: the non-sink
    context is the previous chunk's first-step (noisiest) K/V and a stale first-step copy of itself. Ours evicts
    the oldest non-sink frame when a chunk needs its slot and keeps every chunk's last-step K/V until then."""
    inputs = input_latents(model, 8)
    ref = theirs(sd, model, context, inputs, 1, 6, 3, 4)
    got, _ = ours(model, context, inputs, 1, 6, 3, 4)
    per_chunk = [ref.writes[k * 4 : (k + 1) * 4] for k in range(8)]
    assert per_chunk[:5] == [[[k]] * 4 for k in range(5)]
    assert per_chunk[5:] == [[[5], [3], [3], [3]], [[3], [4], [4], [4]], [[4], [5], [5], [5]]]
    diff = (got - ref.latents).abs().amax(dim=(0, 1, 3, 4))
    assert diff[:5].max().item() <= TOL  # the frames before their cache is full: equal
    assert diff[5:].min().item() > 1e-3  # from the chunk that fills it on: their ring, not a window
