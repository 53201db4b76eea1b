"""TAEHVStreamEncoder: a live client's input frames encoded chunk by chunk equal the whole video encoded at once.

Bit for bit on the CPU in fp32 when every push holds at least 8 frames (batch x frames: a live session pushes
4 x chunk_frames, 8 or more from 2 latent frames a chunk): the chunks run the same per-frame convolutions and only
each MemBlock's previous frame is carried over. Pushes of 4 frames of one video differ in the last bits (1e-6
here): oneDNN picks its convolution kernel by the number of frames a call holds."""

from __future__ import annotations

import pytest
import torch

from fewstep.engine.errors import InputError
from fewstep.engine.vae.taehv import TAEHV, TAEHV_CONFIGS, TAEHVStreamEncoder
from fewstep.engine.weights import dummy_init_

H, W = 32, 48


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny convolutions: a second intra-op thread only spins on a loaded machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=["taew2_1", "taew2_2"])
def model(request) -> TAEHV:
    taehv = TAEHV(TAEHV_CONFIGS[request.param]).eval()
    dummy_init_(taehv, seed=5)
    return taehv


def frames(count: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.rand(batch, count, 3, H, W, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("chunks", [[4, 4, 4], [8, 4]])
def test_chunks_pushed_one_after_the_other_equal_the_whole_video_encoded_at_once(model, chunks):
    video = frames(sum(chunks), batch=2)
    whole = model.encode_video(video)
    encoder = TAEHVStreamEncoder(model)
    parts, start = [], 0
    for n in chunks:
        part = encoder.push(video[:, start : start + n])
        assert part.shape[1] == n // 4
        parts.append(part)
        start += n
    assert torch.equal(torch.cat(parts, 1), whole)
    assert encoder.frames_encoded == sum(chunks)
    s = model.spatial_scale
    assert whole.shape == (2, sum(chunks) // 4, model.latent_channels, H // s, W // s)


def test_reset_starts_a_new_video(model):
    encoder = TAEHVStreamEncoder(model)
    encoder.push(frames(4, seed=1))
    encoder.reset()
    video = frames(16, seed=2)
    parts = torch.cat([encoder.push(video[:, :8]), encoder.push(video[:, 8:])], 1)
    assert torch.equal(parts, model.encode_video(video))


def test_pushes_of_4_frames_of_one_video_agree_within_float_rounding(model):
    video = frames(12, seed=4)
    encoder = TAEHVStreamEncoder(model)
    parts = torch.cat([encoder.push(video[:, i : i + 4]) for i in range(0, 12, 4)], 1)
    torch.testing.assert_close(parts, model.encode_video(video), rtol=0, atol=1e-5)


def test_a_push_whose_frame_count_is_no_multiple_of_4_is_refused_before_anything_changes(model):
    encoder = TAEHVStreamEncoder(model)
    with pytest.raises(InputError) as err:
        encoder.push(frames(6))
    assert str(err.value) == (
        "input 'frames': a chunk of 6 frames; a stream is encoded 4 frames per latent frame, so each push takes a "
        "multiple of 4 frames (4 x the chunk's latent frames)"
    )
    assert encoder.memory is None and encoder.frames_encoded == 0


def test_a_push_of_another_size_mid_video_is_refused(model):
    encoder = TAEHVStreamEncoder(model)
    encoder.push(frames(4))
    with pytest.raises(InputError, match=r"call reset\(\) before encoding another video"):
        encoder.push(frames(4, batch=2))
