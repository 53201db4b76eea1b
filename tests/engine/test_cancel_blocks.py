"""Cancel between the transformer blocks of one forward (issue 28): the run option ``interrupt_check`` is called
before every block of every family (FLUX.1, FLUX.2, Z-Image, causal Wan), a check that raises stops the forward
before the next block with the host's own exception, a check that never raises leaves every output bit-equal, and
runs whose forward runs no Python between blocks (compiled whole, CUDA graphs, a pool's sharded ranks) keep the
per-step check and say so. The nodes pass ComfyUI's check into their runs."""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import fake_comfy_memory_manager, make_cond
from test_nodes import _run

from fewstep.engine import TextCondition, open_model, sample_latent
from fewstep.engine.causal import CausalConfig, VideoSession
from fewstep.engine.causal.recipe import open_session
from fewstep.engine.compile import attach_compile
from fewstep.engine.run import WHOLE_FORWARD_CANCEL_NOTE, RunOptions, open_run
from fewstep.engine.step_cache import STEP_CACHE_FEATURE, make_gate
from fewstep.engine.stream_batch import StreamBatch, StreamConfig


class Interrupted(Exception):  # noqa: N818 - stands for ComfyUI's InterruptProcessingException
    pass


def main_blocks(model) -> list[torch.nn.Module]:
    """The blocks of the residual stack in the order a forward runs them (the ones the check sits between)."""
    family = type(model).family
    if family in ("flux", "flux2"):
        return [*model.double_blocks, *model.single_blocks]
    if family == "zimage":
        return list(model.layers)
    return list(model.blocks)


class CancelAtBlock:
    """A host's cancel: a flag set from inside block ``at`` of forward ``forward`` (0-based, counted by block 0
    starts), and an ``interrupt_check`` that raises :class:`Interrupted` once the flag is set, as ComfyUI's
    ``throw_exception_if_processing_interrupted`` does. ``entered`` lists (forward, block) of every block started.
    ``at=None`` never sets the flag."""

    def __init__(self, model, at: int | None = None, forward: int = 0):
        self.at, self.forward = at, forward
        self.flag = False
        self.checks = 0
        self.entered: list[tuple[int, int]] = []
        self._forwards = -1
        self._hooks = [
            block.register_forward_pre_hook(lambda *_, i=i: self._enter(i))
            for i, block in enumerate(main_blocks(model))
        ]

    def _enter(self, i: int) -> None:
        if i == 0:
            self._forwards += 1
        self.entered.append((self._forwards, i))
        if (self._forwards, i) == (self.forward, self.at):
            self.flag = True  # the user pressed Cancel while this block runs

    def __call__(self) -> None:
        self.checks += 1
        if self.flag:
            self.flag = False
            raise Interrupted

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()


# -- image families: through engine.text_to_image.sample ------------------------------------------------------
IMAGE = {
    "flux": ("dummy:flux-tiny", 16, "flux.1-schnell"),
    "flux2": ("dummy:flux2-tiny", 128, "flux.2-klein"),
    "zimage": ("dummy:zimage-tiny", 16, "z-image-turbo"),
}


@pytest.fixture(scope="module", params=sorted(IMAGE))
def image(request):
    name, channels, schedule = IMAGE[request.param]
    handle = open_model(name, device="cpu", dtype=torch.float32)
    p = handle.params
    if request.param == "flux":
        cond = make_cond(p, seed=1)
    else:
        width = p.cap_feat_dim if request.param == "zimage" else p.context_in_dim
        cond = TextCondition(torch.randn(1, 7, width, generator=torch.Generator().manual_seed(1)))
    return handle, cond, torch.zeros(1, channels, 4, 4), schedule


def _sample(image, **options):
    handle, cond, latent, schedule = image
    return sample_latent(
        handle, [cond], latent, seed=3, steps=2, schedule=schedule, options=RunOptions(**options)
    )


def test_a_cancel_inside_a_block_stops_an_image_forward_before_the_next_block(image):
    model = image[0].model
    n = len(main_blocks(model))
    at = n - 2  # a block with one more after it
    cancel = CancelAtBlock(model, at=at, forward=1)  # inside the second step's forward
    try:
        with pytest.raises(Interrupted):
            _sample(image, interrupt_check=cancel)
    finally:
        cancel.remove()
    # the first forward ran whole; the second stopped right after block `at`: block at + 1 never started
    assert cancel.entered == [(0, i) for i in range(n)] + [(1, i) for i in range(at + 1)]
    assert cancel.checks == n + at + 2  # before every block started, and the one that raised


def test_an_image_run_whose_check_never_fires_is_bit_equal(image):
    model = image[0].model
    plain, _ = _sample(image)
    cancel = CancelAtBlock(model)
    try:
        checked, report = _sample(image, interrupt_check=cancel)
    finally:
        cancel.remove()
    assert torch.equal(checked, plain)
    assert cancel.checks == report.model_calls * len(main_blocks(model))  # it was on: before every block


def test_a_step_cache_that_runs_the_stack_in_pieces_is_checked_before_each_block(tiny_handle):
    handle = tiny_handle.with_feature(STEP_CACHE_FEATURE, make_gate("first_block", 0.9))
    cond, latent = make_cond(tiny_handle.params, seed=1), torch.zeros(1, 16, 8, 8)
    plain, _ = sample_latent(handle, [cond], latent, seed=3, steps=28, schedule="flux.1-dev")
    cancel = CancelAtBlock(handle.model)
    try:
        checked, report = sample_latent(handle, [cond], latent, seed=3, steps=28, schedule="flux.1-dev",
                                        options=RunOptions(interrupt_check=cancel))  # fmt: skip
    finally:
        cancel.remove()
    assert torch.equal(checked, plain)
    assert report.cache_probes > 0  # some forwards ran block 0 only and reused the rest
    # full forwards ran the 4 blocks (block 0, then blocks 1-3 as a second piece); served ones block 0 only
    assert len(cancel.entered) == report.model_calls * 4 + report.cache_probes
    assert cancel.checks == len(cancel.entered)  # every block the pieces ran was checked first


# -- causal Wan: a video session --------------------------------------------------------------------------------
H, W = 32, 48
CONFIG = CausalConfig(chunk_frames=2, window_frames=4, sink_frames=1)


@pytest.fixture(scope="module")
def wan():
    return open_model("dummy:wan-tiny", device="cpu", dtype=torch.float32)


def _context():
    return torch.randn(1, 9, 4096, generator=torch.Generator().manual_seed(1))


def test_a_cancel_inside_a_block_stops_a_causal_forward_and_the_session_continues_unchanged(wan):
    n = wan.model.num_blocks
    # forward 5: chunk 1's first denoising step (after chunk 0's four and chunk 1's clean-context pass)
    cancel = CancelAtBlock(wan.model, at=0, forward=5)
    try:
        session, _ = open_session(
            wan, _context(), H, W, CONFIG, 3, options=RunOptions(interrupt_check=cancel)
        )
        with pytest.raises(Interrupted):
            for _ in session.chunks(3):
                pass
    finally:
        cancel.remove()
    assert cancel.entered[-1] == (5, 0) and len(cancel.entered) == 5 * n + 1  # block 1 of forward 5 never ran
    # the chunk stopped inside a forward left the session as before it: continuing gives the uninterrupted video
    rest = [c.latents for c in session.chunks(2)]
    whole, _ = open_session(wan, _context(), H, W, CONFIG, 3)
    expected = [c.latents for c in whole.chunks(3)]
    assert torch.equal(torch.cat(rest, dim=2), torch.cat(expected[1:], dim=2))


def test_a_causal_session_whose_check_never_fires_is_bit_equal(wan):
    plain = [c.latents for c in VideoSession(wan.model, _context(), H, W, CONFIG, seed=3).chunks(2)]
    cancel = CancelAtBlock(wan.model)
    try:
        session, _ = open_session(
            wan, _context(), H, W, CONFIG, 3, options=RunOptions(interrupt_check=cancel)
        )
        checked = [c.latents for c in session.chunks(2)]
    finally:
        cancel.remove()
    assert torch.equal(torch.cat(checked, 2), torch.cat(plain, 2))
    assert (
        cancel.checks == len(cancel.entered) == (4 + 1 + 4) * wan.model.num_blocks
    )  # 4 steps, commit, 4 steps


# -- the stream batch -------------------------------------------------------------------------------------------
def _stream(handle, cond, **options):
    config = StreamConfig(t_index_list=(0, 2), frame_buffer_size=1, cfg_mode="none")
    return StreamBatch(handle, None, cond, height=32, width=32, config=config, seed=5,
                       options=RunOptions(step_cache=False, **options))  # fmt: skip


def test_a_cancel_inside_a_block_stops_a_stream_forward(tiny_handle):
    n = tiny_handle.model.num_blocks
    cond = make_cond(tiny_handle.params, seed=0)
    latents = torch.randn(3, 16, 4, 4, generator=torch.Generator().manual_seed(0))
    plain = _stream(tiny_handle, cond)
    expected = [plain.push_latents(latents[i : i + 1]) for i in range(3)]
    cancel = CancelAtBlock(tiny_handle.model)
    try:
        checked = _stream(tiny_handle, cond, interrupt_check=cancel)
        got = [checked.push_latents(latents[i : i + 1]) for i in range(3)]
        assert cancel.checks == len(cancel.entered) == 3 * n
        cancel.at, cancel.forward = 1, 3
        with pytest.raises(Interrupted):
            checked.push_latents(latents[:1])
    finally:
        cancel.remove()
    for a, b in zip(got, expected, strict=True):
        assert (a is None) == (b is None) and (a is None or torch.equal(a.latents, b.latents))
    assert cancel.entered[-2:] == [(3, 0), (3, 1)]  # block 2 of the stopped forward never ran


# -- where the check cannot run between blocks ------------------------------------------------------------------
def _never():
    raise AssertionError("a run without Python between its blocks must not be given the check")


@pytest.mark.parametrize(
    ("compile_args", "why"),
    [
        ({"mode": "full"}, "the forward is compiled whole (compile full)"),
        (
            {"mode": "off", "cuda_graph": "whole", "allow_fallback": True},
            "the forward is replayed from CUDA graphs (cuda_graph whole)",
        ),
    ],
)
def test_a_whole_forward_keeps_the_per_step_check_and_says_so(tiny_handle, compile_args, why):
    handle = attach_compile(tiny_handle, **compile_args)
    run = open_run(handle, RunOptions(interrupt_check=_never))
    try:
        assert run.interrupt_check is None and run.blocks(None) is None  # no runner: the forward stays whole
        assert WHOLE_FORWARD_CANCEL_NOTE.format(why=why) in run.compiled.notes
    finally:
        run.finish()


def test_regional_compilation_keeps_the_check_between_blocks(tiny_handle):
    run = open_run(attach_compile(tiny_handle, mode="regional"), RunOptions(interrupt_check=_never))
    try:
        assert run.interrupt_check is _never and run.blocks(None) is not None
        assert not any("Cancel" in note for note in run.compiled.notes)
    finally:
        run.finish()


def test_a_pool_rank_keeps_cancel_per_step(tiny_handle):
    class Sharding:  # a rank's layout: only its block runner matters here
        def block_runner(self, inner=None):
            return ("sharded", inner)

    run = open_run(tiny_handle, RunOptions(interrupt_check=_never, sharding=Sharding()))
    assert run.interrupt_check is None and run.blocks(None) == ("sharded", None)


# -- the nodes pass ComfyUI's check ----------------------------------------------------------------------------
@pytest.fixture
def comfy_cancel(pack, monkeypatch):
    """ComfyUI's interrupt check in sys.modules; ``arm(model, at, forward)`` makes it fire inside that block."""
    fake_comfy_memory_manager(monkeypatch)
    state = {}

    def arm(model, at, forward=0):
        if "cancel" in state:
            state["cancel"].remove()
        state["cancel"] = CancelAtBlock(model, at=at, forward=forward)
        return state["cancel"]

    def throw():
        if "cancel" in state:
            state["cancel"]()

    sys.modules["comfy.model_management"].throw_exception_if_processing_interrupted = throw
    yield arm
    if "cancel" in state:
        state["cancel"].remove()


def test_the_sampler_node_stops_within_one_block(pack, comfy_cancel):
    m = pack.NODE_CLASS_MAPPINGS
    (handle,) = _run(m["FewStepDiTLoader"], model_name="dummy:flux-tiny")
    (cond,) = _run(m["FewStepSyntheticConditioning"])
    cancel = comfy_cancel(handle.model, at=1)
    with pytest.raises(Interrupted):
        _run(
            m["FewStepSampler"],
            model=handle,
            positive=cond,
            latent_image={"samples": torch.zeros(1, 16, 4, 4)},
        )
    assert cancel.entered == [(0, 0), (0, 1)]  # the first forward stopped after its second block


def test_the_video_nodes_stop_within_one_block(pack, comfy_cancel):
    m = pack.NODE_CLASS_MAPPINGS
    (handle,) = _run(m["FewStepDiTLoader"], model_name="dummy:wan-tiny")
    (cond,) = _run(m["FewStepSyntheticConditioning"], pooled_width=0)
    video = {
        "model": handle,
        "positive": cond,
        "width": 48,
        "height": 32,
        "chunk_frames": 2,
        "window_frames": 4,
    }
    cancel = comfy_cancel(handle.model, at=0, forward=2)
    with pytest.raises(Interrupted):
        _run(m["FewStepCausalVideoSampler"], **video, num_chunks=1)
    assert (
        cancel.entered[-1] == (2, 0) and (2, 1) not in cancel.entered
    )  # the third step stopped after block 0
    cancel.remove()
    _, _, ref, _ = _run(m["FewStepCausalVideoSampler"], **video, num_chunks=1)
    cancel = comfy_cancel(handle.model, at=0, forward=1)  # the Continue's first denoising step
    with pytest.raises(Interrupted):
        _run(m["FewStepCausalContinue"], session=ref, num_chunks=1)
    assert cancel.entered[-1] == (1, 0) and (1, 1) not in cancel.entered


def test_the_stream_node_stops_within_one_block(pack, comfy_cancel):
    m = pack.NODE_CLASS_MAPPINGS
    (handle,) = _run(m["FewStepDiTLoader"], model_name="dummy:flux-tiny")
    (cond,) = _run(m["FewStepSyntheticConditioning"])
    (vae,) = _run(m["FewStepTinyVAELoader"], vae_name="dummy:taef1")
    cancel = comfy_cancel(handle.model, at=2)
    with pytest.raises(Interrupted):
        _run(
            m["FewStepStreamBatch"],
            model=handle,
            tiny_vae=vae,
            positive=cond,
            frames=torch.rand(2, 32, 32, 3),
        )
    assert cancel.entered == [(0, 0), (0, 1), (0, 2)]
