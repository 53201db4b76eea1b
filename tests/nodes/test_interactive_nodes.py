"""Interactive inputs of the causal video nodes (issue 32): a start latent (image to video, video extension), an
input video restyled chunk by chunk (video to video) and a prompt switch with a KV re-cache, each equal to the
engine's session API driven by hand, and their bad inputs refused naming the node and the input."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from test_nodes import _run

SIZE = dict(width=48, height=32)  # latent 6 x 4 (wan-tiny: 2x2 patches)


def _engine(pack, name: str):
    return sys.modules[f"{pack.__name__}.engine.{name}"]


@pytest.fixture(scope="module")
def video(pack):
    m = pack.NODE_CLASS_MAPPINGS
    (wan,) = _run(m["FewStepDiTLoader"], model_name="dummy:wan-tiny")
    (cond,) = _run(m["FewStepSyntheticConditioning"], pooled_width=0)
    (other,) = _run(m["FewStepSyntheticConditioning"], pooled_width=0, seed=5)
    (vae,) = _run(m["FewStepTinyVAELoader"], vae_name="dummy:taew2_1")
    return m, wan, cond, other, vae


def _raw(frames: int, seed: int = 0, channels: int = 16, h: int = 4, w: int = 6) -> torch.Tensor:
    """A ComfyUI Wan 2.1 LATENT's samples (raw VAE space)."""
    return torch.randn(1, channels, frames, h, w, generator=torch.Generator().manual_seed(seed))


def _session(pack, wan, cond, chunk_frames=2, window_frames=4, sink_frames=0, tiny_vae=None):
    """The session the sampler opens for these inputs, opened through the engine API."""
    causal = _engine(pack, "causal.session")
    config = causal.CausalConfig(chunk_frames=chunk_frames, window_frames=window_frames, sink_frames=sink_frames,
                                 schedule="wan-dmd-4step", steps=4)  # fmt: skip
    open_session = _engine(pack, "causal.recipe").open_session
    session, _ = open_session(wan, cond[0][0], SIZE["height"], SIZE["width"], config, 0, tiny_vae)
    return session


def _raw_out(pack, chunks) -> torch.Tensor:
    return torch.cat([c.raw for c in chunks], dim=2)


@pytest.mark.parametrize("frames", [1, 3, 4])  # an image; 1 + a chunk; two whole chunks (video extension)
def test_start_latent_equals_the_engine_prefill_and_leads_the_outputs(pack, video, frames):
    m, wan, cond, _, vae = video
    wan21 = _engine(pack, "latent_formats").WAN21
    raw = _raw(frames)
    out = _run(m["FewStepCausalVideoSampler"], model=wan, positive=cond, num_chunks=2, chunk_frames=2,
               window_frames=4, sink_frames=1, tiny_vae=vae, start_latent={"samples": raw}, **SIZE)  # fmt: skip
    session = _session(pack, wan, cond, sink_frames=1, tiny_vae=vae)
    prefill = session.prefill(wan21.process_in(raw))
    chunks = session.run(2)
    expected = torch.cat([wan21.process_out(prefill.latents), _raw_out(pack, chunks)], dim=2)
    assert torch.equal(out[0]["samples"], expected)
    assert out[0]["samples"].shape[2] == frames + 4
    assert torch.allclose(out[0]["samples"][:, :, :frames], raw, atol=1e-5)  # the video starts at the image
    decoded = torch.cat([prefill.decoded, *(c.frames for c in chunks)], dim=1)
    assert torch.equal(out[1], decoded.flatten(0, 1).permute(0, 2, 3, 1))
    assert out[2].position == frames + 4
    assert f"prefill: {frames} start latent frame{'s' if frames > 1 else ''} in " in out[3]


def test_input_latent_equals_the_engine_feed_and_makes_the_chunks_it_covers(pack, video):
    m, wan, cond, _, _ = video
    wan21 = _engine(pack, "latent_formats").WAN21
    raw = _raw(5, seed=3)  # 2 whole chunks of 2 frames; the fifth frame is left over
    out = _run(m["FewStepCausalVideoSampler"], model=wan, positive=cond, num_chunks=7, chunk_frames=2,
               window_frames=4, input_latent={"samples": raw}, strength=0.5, **SIZE)  # fmt: skip
    session = _session(pack, wan, cond)
    session.set_strength(0.5)
    session.feed(wan21.process_in(raw)[:, :, :4])
    chunks = session.run(2)
    assert [c.mode for c in chunks] == ["v2v", "v2v"]
    assert torch.equal(out[0]["samples"], _raw_out(pack, chunks))
    assert "video to video: 2 chunks restyled at strength 0.5 (1 step each), 4 of the input's 5" in out[3]
    # fewer chunks asked for than the input covers: num_chunks wins
    one = _run(m["FewStepCausalVideoSampler"], model=wan, positive=cond, num_chunks=1, chunk_frames=2,
               window_frames=4, input_latent={"samples": raw}, strength=0.5, **SIZE)  # fmt: skip
    assert torch.equal(one[0]["samples"], out[0]["samples"][:, :, :2])


def test_input_images_are_encoded_by_the_tiny_vae(pack, video):
    m, wan, cond, _, vae = video
    wan21 = _engine(pack, "latent_formats").WAN21
    images = torch.rand(16, 32, 48, 3, generator=torch.Generator().manual_seed(2))  # 4 latent frames
    out = _run(m["FewStepCausalVideoSampler"], model=wan, positive=cond, num_chunks=2, chunk_frames=2,
               window_frames=4, tiny_vae=vae, input_images=images, **SIZE)  # fmt: skip
    raw = vae.encode_raw(images.permute(0, 3, 1, 2).unsqueeze(0)).float().cpu()
    assert raw.shape[2] == 4
    session = _session(pack, wan, cond, tiny_vae=vae)
    session.set_strength(0.7)  # the default
    session.feed(wan21.process_in(raw))
    assert torch.equal(out[0]["samples"], _raw_out(pack, session.run(2)))


def test_continue_with_recache_equals_the_engine_switch(pack, video):
    m, wan, cond, other, _ = video
    sampler = _run(m["FewStepCausalVideoSampler"], model=wan, positive=cond, num_chunks=3, chunk_frames=2,
                   window_frames=4, sink_frames=1, **SIZE)  # fmt: skip
    out = _run(m["FewStepCausalContinue"], session=sampler[2], num_chunks=2, positive=other, recache=True)
    session = _session(pack, wan, cond, sink_frames=1)
    session.run(3)
    report = session.set_prompt(other[0][0], recache=True)
    assert report.frames > 0
    assert torch.equal(out[0]["samples"], _raw_out(pack, session.run(2)))
    assert f"re-cache: {report.frames} window frames recomputed under the new prompt in " in out[3]
    # recache off (the default) keeps today's switch: only the cross-attention cache changes
    plain = _run(m["FewStepCausalContinue"], session=sampler[2], num_chunks=2, positive=other)
    session = _session(pack, wan, cond, sink_frames=1)
    session.run(3)
    session.set_prompt(other[0][0])
    assert torch.equal(plain[0]["samples"], _raw_out(pack, session.run(2)))
    assert not torch.equal(plain[0]["samples"], out[0]["samples"])


def test_continue_restyles_an_input_video(pack, video):
    m, wan, cond, _, _ = video
    wan21 = _engine(pack, "latent_formats").WAN21
    raw = _raw(4, seed=9)
    sampler = _run(m["FewStepCausalVideoSampler"], model=wan, positive=cond, num_chunks=1, chunk_frames=2,
                   window_frames=4, **SIZE)  # fmt: skip
    out = _run(m["FewStepCausalContinue"], session=sampler[2], num_chunks=5, input_latent={"samples": raw},
               strength=0.8)  # fmt: skip
    session = _session(pack, wan, cond)
    session.run(1)
    session.set_strength(0.8)
    session.feed(wan21.process_in(raw))
    assert torch.equal(out[0]["samples"], _raw_out(pack, session.run(2)))
    # the session is back to text to video afterwards: a plain Continue equals the engine's next chunk
    after = _run(m["FewStepCausalContinue"], session=out[2], num_chunks=1)
    session.set_strength(None)
    assert torch.equal(after[0]["samples"], _raw_out(pack, session.run(1)))


def test_a_stale_interactive_reference_is_rebuilt_by_replaying_its_runs(pack, video):
    """ComfyUI re-runs a Continue on a cached output whose session has moved on: the prefill, the restyled
    chunks and the re-cache switch are replayed, so the video is the same as the first run's."""
    m, wan, cond, other, vae = video
    video_nodes = sys.modules[f"{pack.__name__}.nodes.video"]
    sampler = _run(m["FewStepCausalVideoSampler"], model=wan, positive=cond, num_chunks=1, chunk_frames=2,
                   window_frames=4, sink_frames=1, tiny_vae=vae, start_latent={"samples": _raw(1, seed=4)},
                   **SIZE)  # fmt: skip
    restyled = _run(m["FewStepCausalContinue"], session=sampler[2], num_chunks=2,
                    input_latent={"samples": _raw(4, seed=6)}, strength=0.6)  # fmt: skip
    switched = _run(
        m["FewStepCausalContinue"], session=restyled[2], num_chunks=2, positive=other, recache=True
    )
    assert switched[2].interactive
    again = _run(m["FewStepCausalContinue"], session=restyled[2], num_chunks=2, positive=other, recache=True)
    assert torch.equal(again[0]["samples"], switched[0]["samples"])  # rebuilt: the session had moved on
    video_nodes.SESSIONS.dispose(again[2].key)  # freed: rebuilt with the switch too
    longer = _run(m["FewStepCausalContinue"], session=switched[2], num_chunks=1)
    replayed = _run(m["FewStepCausalContinue"], session=again[2], num_chunks=1)
    assert torch.equal(longer[0]["samples"], replayed[0]["samples"])


def _refused(node, match, **args):
    with pytest.raises(ValueError, match=match):
        _run(node, **args)


def test_interactive_input_errors_name_the_node_and_the_input(pack, video):
    m, wan, cond, _, vae = video
    sampler = m["FewStepCausalVideoSampler"]
    base = dict(model=wan, positive=cond, num_chunks=1, chunk_frames=3, window_frames=6, **SIZE)
    start = "^FewStepCausalVideoSampler: input 'start_latent': "
    _refused(sampler, start + r"4 latent channels \(an SD 1.x / SDXL image latent\); this Wan 2.1 model takes "
             r"the Wan 2.1 VAE's 16-channel latents \(VAEEncode with the Wan 2.1 VAE, or FewStepTinyVAEEncode with "
             r"taew2_1\)$", start_latent={"samples": _raw(1, channels=4)}, **base)  # fmt: skip
    _refused(sampler, start + r"48 latent channels \(a Wan 2.2 VAE latent\)",
             start_latent={"samples": _raw(1, channels=48)}, **base)  # fmt: skip
    _refused(sampler, start + r"a LATENT of shape \[1, 16, 4, 6\]; expected a Wan 2.1 video LATENT",
             start_latent={"samples": torch.zeros(1, 16, 4, 6)}, **base)  # fmt: skip
    _refused(sampler, start + r"a latent of 64x32 px \(8x4 latent pixels\); this video is 48x32 px",
             start_latent={"samples": _raw(1, w=8)}, **base)  # fmt: skip
    _refused(sampler, start + r"2 latent frames do not split into the session's chunks of 3",
             start_latent={"samples": _raw(2)}, **base)  # fmt: skip
    _refused(sampler, start + "the latent must hold finite floating-point values",
             start_latent={"samples": torch.full((1, 16, 1, 4, 6), float("nan"))}, **base)  # fmt: skip
    inputs = "^FewStepCausalVideoSampler: input 'input_latent': "
    _refused(sampler, inputs + "2 latent frames do not fill one chunk of 3", input_latent={"samples": _raw(2)},
             **base)  # fmt: skip
    _refused(sampler, inputs + "4 latent channels", input_latent={"samples": _raw(3, channels=4)}, **base)
    images = "^FewStepCausalVideoSampler: input 'input_images': "
    frames = torch.rand(12, 32, 48, 3)
    _refused(sampler, images + r"IMAGE frames are encoded by the tiny VAE \(taew2_1\): connect tiny_vae",
             input_images=frames, **base)  # fmt: skip
    _refused(sampler, images + r"frames of 64x32 px; this video is 48x32 px", tiny_vae=vae,
             input_images=torch.rand(12, 32, 64, 3), **base)  # fmt: skip
    _refused(sampler, images + r"image values must be in \[0, 1\]; got \[2.000, 2.000\]", tiny_vae=vae,
             input_images=torch.full((12, 32, 48, 3), 2.0), **base)  # fmt: skip
    _refused(sampler, images + "give the input video once: input_latent or input_images, not both", tiny_vae=vae,
             input_images=frames, input_latent={"samples": _raw(3)}, **base)  # fmt: skip
    _refused(sampler, r"^FewStepCausalVideoSampler: input 'strength': expected a finite number in \[0.01, 1.0\]",
             input_latent={"samples": _raw(3)}, strength=0.0, **base)  # fmt: skip
    session = _run(sampler, **base)[2]
    _refused(m["FewStepCausalContinue"], "^FewStepCausalContinue: input 'input_images': IMAGE frames are encoded",
             session=session, num_chunks=1, input_images=frames)  # fmt: skip
    _refused(m["FewStepCausalContinue"], r"^FewStepCausalContinue: input 'input_latent': a latent of 48x64 px",
             session=session, num_chunks=1, input_latent={"samples": _raw(3, h=8)})  # fmt: skip


def test_interactive_inputs_are_refused_on_a_worker_pool(pack):
    """A session placed on a worker pool (parallel) takes a start latent of whole chunks and an input video, but
    no re-cache and no lone first frame (its sharded workers run only a chunk's shape): refused before the pool
    is asked for anything."""
    video_nodes = sys.modules[f"{pack.__name__}.nodes.video"]
    errors = sys.modules[f"{pack.__name__}.engine.errors"]
    on_pool, here = types.SimpleNamespace(in_process=False), types.SimpleNamespace(in_process=True)
    image, chunks = torch.zeros(1, 16, 1, 4, 6), torch.zeros(1, 16, 4, 4, 6)
    video_nodes._refuse_on_pool(here, image, 2, True)  # in this process: all taken
    video_nodes._refuse_on_pool(on_pool, None, 2, False)  # nothing interactive: the pool runs it
    video_nodes._refuse_on_pool(on_pool, chunks, 2, False)  # whole chunks: the pool's start job commits them
    with pytest.raises(errors.InputError, match=r"^input 'parallel': recache runs in this process only: a session "
                       r"on a worker pool switches the prompt without it"):  # fmt: skip
        video_nodes._refuse_on_pool(on_pool, None, 2, True)
    with pytest.raises(errors.InputError, match=r"^input 'start_latent': 1 latent frame: on a worker pool a start "
                       r"takes whole chunks of 2 \(2, 4, \.\.\. frames\); a lone first frame \(an image, or one "
                       r"frame more than whole chunks\) runs in this process only \(disconnect parallel\)$"):  # fmt: skip
        video_nodes._refuse_on_pool(on_pool, image, 2, False)
