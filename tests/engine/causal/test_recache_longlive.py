"""A prompt switch with a KV re-cache (``VideoSession.set_prompt(context, recache=True)`` and the
``control("prompt", context, recache=True)`` path) against LongLive v1.0's own
``InteractiveCausalInferencePipeline.inference`` (NVlabs/LongLive, ``global_sink: true`` as its inference configs),
same weights, prompts, noise and timesteps, float32 on the CPU, within 1e-5.

Runs only when ``FEWSTEP_LONGLIVE_DIR`` names an extracted checkout (``tests/longlive_harness.py`` runs their loop
unchanged). Switches at chunk boundaries while the stream is within the window (every frame held re-cached, the
sinks included) and after it (the ring's frames re-cached, the sinks kept), without sinks and with 3 sinks
(LongLive's config: a window of 12 frames, 3 sinks, chunks of 3), one and two switches, absolute RoPE (theirs) and
one cache-RoPE stream without sinks (the same attention as absolute RoPE there).

The model is wan-tiny's widths with three layers (:func:`model`). The control case: without a re-cache (the
CausVid switch) our video equals theirs up to the switch and leaves it after by far more than the tolerance
(> 1e-2 where the next chunks read re-cached sinks or a ring of three chunks; ~3e-4 to ~7e-4 where they read,
besides the sinks, only the chunk just before the switch, whose K/V both switches compute under the new prompt).

The switch without a re-cache has no LongLive reference. Their ``SwitchCausalInferencePipeline``
(``pipeline/switch_causal_inference.py``) runs the same ``_recache_after_switch`` (one switch; with ``global_sink``
false it zeroes the cached K/V first): LongLive has no switch that leaves the self-attention cache as it is. And
the two differ in one more point: every LongLive loop runs a chunk's clean-context pass with the prompt the chunk
was generated with, while our CausVid switch defers it (as every chunk's) to the next chunk's start, so the chunk
just before the switch is committed under the new prompt (a switch with a re-cache commits it under the old one
first, as LongLive does).
"""

from __future__ import annotations

from dataclasses import replace

import longlive_harness as llh
import pytest
import self_forcing_harness as sfh
import torch

ROOT = llh.reference_dir()
if ROOT is None:
    pytest.skip(
        f"set {llh.ENV} to an extracted NVlabs/LongLive v1.0 checkout to compare prompt switches with a KV "
        "re-cache with its InteractiveCausalInferencePipeline",
        allow_module_level=True,
    )
if llh.missing_files(ROOT) if ROOT.is_dir() else True:
    pytest.skip(f"{llh.ENV}={ROOT} is not an extracted LongLive v1.0 checkout", allow_module_level=True)
pytest.importorskip("diffusers", reason="LongLive's CausalWanModel is a diffusers ModelMixin")

from fewstep.engine.causal import CausalConfig, VideoSession  # noqa: E402
from fewstep.engine.models.wan import PRESETS, Wan  # noqa: E402
from fewstep.engine.weights import dummy_init_  # noqa: E402

TOL = 1e-5
HEIGHT = WIDTH = 64
CHUNK, STEPS, SEED = 3, 4, 0
LAYERS = 3

# (window, sinks, switch frames, chunks, rope): the switch frames are where their switch_frame_indices start
# the next prompt, at chunk boundaries; frames committed <= window: every frame held is re-cached
CASES = {
    "w6-within": (6, 0, (6,), 4, "absolute"),
    "w6-after": (6, 0, (12,), 5, "absolute"),
    "w9-two": (9, 0, (6, 15), 7, "absolute"),  # within, then after the window
    "w9s3-within": (9, 3, (9,), 5, "absolute"),  # the sinks re-cached (frames committed == window)
    "w9s3-after": (9, 3, (15,), 6, "absolute"),  # the sinks kept
    "w12s3-two": (12, 3, (9, 15), 6, "absolute"),  # LongLive's config: within, then after the window
    "w9-cache-rope": (9, 0, (6, 15), 7, "cache"),
}


@pytest.fixture(scope="module")
def ll():
    return llh.load(ROOT)


@pytest.fixture(scope="module")
def model():
    """wan-tiny's widths with three layers. A layer's K/V see the prompt only through the layers before it (the
    first layer's not at all): with two layers, re-cached frames differ from their commit only in the last
    layer's K/V, which no layer of theirs reads, so where the next chunk reads besides the sinks only the chunk
    just before the switch a re-cache and the CausVid switch give the same video; with three they differ."""
    model = Wan(replace(PRESETS["wan-tiny"], num_layers=LAYERS)).to(torch.float32)
    dummy_init_(model, 0)
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def contexts(model):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(1, 16, model.params.text_dim, generator=g) for _ in range(3)]


def tokens_per_frame(model) -> int:
    _, ph, pw = model.params.patch_size
    return (HEIGHT // 8 // ph) * (WIDTH // 8 // pw)


_REFERENCE: dict[str, llh.ReferenceRun] = {}


def reference(ll, model, contexts, name: str) -> llh.ReferenceRun:
    """Their run of case ``name`` (once per module: the control case and the control path reuse it)."""
    if name not in _REFERENCE:
        window, sinks, switches, chunks, _ = CASES[name]
        pipe = llh.reference_pipeline(
            ll,
            model,
            contexts[: len(switches) + 1],
            CHUNK,
            window,
            tokens_per_frame(model),
            sink_frames=sinks,
        )
        shape = (1, model.params.in_dim, CHUNK, HEIGHT // 8, WIDTH // 8)
        noise = sfh.session_noise(SEED, shape, chunks, STEPS)
        _REFERENCE[name] = llh.run_reference(ll, pipe, noise, STEPS, list(switches))
    return _REFERENCE[name]


def ours(model, contexts, name: str, recache: bool = True, via: str = "set_prompt"):
    """Our session on case ``name``: the i-th switch between ``chunks()`` calls at the same frames (``via``
    ``set_prompt``), or queued as a control before the chunk that starts there (``via`` ``control``)."""
    window, sinks, switches, chunks, rope = CASES[name]
    session = VideoSession(
        model, contexts[0], HEIGHT, WIDTH, CausalConfig(CHUNK, window, sinks, rope=rope), SEED
    )
    bounds = [0, *(f // CHUNK for f in switches), chunks]
    results, reports = [], []
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        if i and via == "set_prompt":
            reports.append(session.set_prompt(contexts[i], recache=recache))
        elif i:
            session.control("prompt", contexts[i], recache=recache)
        got = list(session.chunks(b - a))
        if i and via == "control":
            applied = got[0].controls
            assert [(c.kind, c.chunk, c.recache) for c in applied] == [("prompt", a, recache)]
            reports.append(got[0].recache)
        results += got
    assert [r.start_frame for r in results] == [k * CHUNK for k in range(chunks)]
    return torch.cat([r.latents for r in results], dim=2), reports


@pytest.mark.parametrize("name", list(CASES))
def test_recache_equals_longlive(ll, model, contexts, name):
    window, sinks, switches, _, _ = CASES[name]
    want = reference(ll, model, contexts, name)
    got, reports = ours(model, contexts, name)
    assert got.shape == want.latents.shape
    assert (got - want.latents).abs().max().item() <= TOL
    # theirs re-runs min(window, frames) frames; after the window the first `sinks` of them are the frames
    # just before the ring, whose queries run but whose K/V are neither kept nor read: ours skips them
    assert len(want.recaches) == len(switches) == len(reports)
    for frame, theirs, report in zip(switches, want.recaches, reports):
        assert theirs.start_frame + theirs.frames == frame
        skipped = sinks if theirs.start_frame > 0 else 0
        assert (report.start_frame, report.frames) == (theirs.start_frame + skipped, theirs.frames - skipped)
        assert report.frames == (frame if frame <= window else window - sinks)


def test_recache_by_control_equals_longlive(ll, model, contexts):
    """The same switches queued as controls (applied at the chunk boundary) give the same video."""
    want = reference(ll, model, contexts, "w12s3-two")
    got, reports = ours(model, contexts, "w12s3-two", via="control")
    assert (got - want.latents).abs().max().item() <= TOL
    assert [(r.start_frame, r.frames) for r in reports] == [(0, 9), (6, 9)]


# how far the CausVid switch leaves theirs after the switch: far where the next chunks read frames whose K/V
# it committed under the old prompt (re-cached sinks, a ring of three chunks), less where they read besides the
# sinks only the chunk just before the switch, whose K/V both switches compute under the new prompt (the
# re-cache's differ from the third layer on, through the re-cached earlier frames: ~7e-4 and ~3e-4 here)
APART = {"w6-within": 20, "w6-after": 20, "w9s3-after": 20}


@pytest.mark.parametrize("name", list(CASES))
def test_switch_without_recache_leaves_longlive(ll, model, contexts, name):
    """The test has teeth: the CausVid switch (cross-attention only) equals theirs up to the first switch and
    leaves it after, by far more than the tolerance."""
    want = reference(ll, model, contexts, name).latents
    got, reports = ours(model, contexts, name, recache=False)
    assert reports == [None] * len(reports)
    first = CASES[name][2][0]
    assert (got[:, :, :first] - want[:, :, :first]).abs().max().item() <= TOL
    assert (got[:, :, first:] - want[:, :, first:]).abs().max().item() > APART.get(name, 1000) * TOL
