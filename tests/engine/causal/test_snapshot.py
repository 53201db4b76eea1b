"""Session snapshots (issue 31): a stream saved to a file and resumed in another process continues bit for bit;
a pool session's snapshot resumes solo and a solo one in a pool; a snapshot is untrusted input, refused before
any tensor is loaded when it is not one, or not one of this model, version or configuration."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import fewstep
from fewstep.engine import InputError, load_dit, load_tiny_vae
from fewstep.engine.causal import CausalConfig, SessionPool, VideoSession
from fewstep.engine.causal.snapshot import (
    HEADER_KEY,
    expected_tensors,
    join_from_snapshot,
    load_snapshot,
    resume_session,
    save_pool_session,
    save_session,
)
from fewstep.engine.weights import model_digest

H, W = 32, 48
INT8_SINKS = CausalConfig(
    chunk_frames=2, window_frames=8, sink_frames=1, kv_dtype="int8", keep_recent_chunks=0
)
BF16_SINKS = CausalConfig(chunk_frames=2, window_frames=5, sink_frames=1)
PACKAGE_PARENT = os.path.dirname(
    os.path.dirname(fewstep.__file__)
)  # what makes `import fewstep` this checkout


@pytest.fixture(scope="module")
def wan():
    return load_dit("dummy:wan-tiny", dtype=torch.float32, device="cpu", seed=2)


@pytest.fixture(scope="module")
def vae():
    return load_tiny_vae("dummy:taew2_1", device="cpu")


def _ctx(seed=1, tokens=9):
    return torch.randn(1, tokens, 4096, generator=torch.Generator().manual_seed(seed))


def _saved(model, path, config=INT8_SINKS, chunks=2, tiny_vae=None, seed=3):
    session = VideoSession(model, _ctx(), H, W, config, seed, tiny_vae)
    session.run(chunks)
    save_session(session, path)
    return session


# one process resumes every case's snapshot (one start-up of torch for the three)
RESUME_IN_A_NEW_PROCESS = """
import sys, torch
from safetensors.torch import save_file
from fewstep.engine import load_dit, load_tiny_vae
from fewstep.engine.causal.snapshot import resume_session
model = load_dit("dummy:wan-tiny", dtype=torch.float32, device="cpu", seed=2)
vae = load_tiny_vae("dummy:taew2_1", device="cpu")
for snapshot, out_path, with_vae in zip(*[iter(sys.argv[1:])] * 3):
    session, _ = resume_session(model, snapshot, tiny_vae=vae if with_vae == "vae" else None)
    chunks = session.run(3)
    out = {"latents": torch.cat([c.latents for c in chunks], 2), "index": torch.tensor([c.index for c in chunks])}
    if with_vae == "vae":
        out["frames"] = torch.cat([c.frames for c in chunks], 1)
    save_file(out, out_path)
"""
CASES = {
    "int8-sinks": (INT8_SINKS, False),
    "bf16-sinks": (BF16_SINKS, False),
    "int8-sinks-tiny-vae": (INT8_SINKS, True),
}


@pytest.fixture(scope="module")
def resumed_elsewhere(wan, vae, tmp_path_factory):
    """case -> (the uninterrupted 5 chunks, the file of the 3 chunks another process resumed after chunk 2)."""
    folder = tmp_path_factory.mktemp("snapshots")
    whole, argv = {}, []
    for case, (config, with_vae) in CASES.items():
        tiny = vae if with_vae else None
        whole[case] = VideoSession(wan, _ctx(), H, W, config, 3, tiny).run(5)
        saved = _saved(wan, folder / f"{case}.safetensors", config, 2, tiny)
        if config.kv_dtype == "int8":  # the quantized tier holds frames in the saved state already
            assert saved.cache.frames_quantized > 0
        argv += [str(folder / f"{case}.safetensors"), str(folder / f"{case}.out"), "vae" if with_vae else "-"]
    env = {**os.environ, "PYTHONPATH": PACKAGE_PARENT}
    r = subprocess.run([sys.executable, "-c", RESUME_IN_A_NEW_PROCESS, *argv], capture_output=True, text=True,
                       env=env, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return {case: (whole[case], folder / f"{case}.out") for case in CASES}


@pytest.mark.parametrize("case", list(CASES))
def test_a_snapshot_resumed_in_another_process_continues_bit_for_bit(resumed_elsewhere, case):
    whole, out = resumed_elsewhere[case]
    with safe_open(out, framework="pt") as f:
        assert f.get_tensor("index").tolist() == [2, 3, 4]
        assert torch.equal(f.get_tensor("latents"), torch.cat([c.latents for c in whole[2:]], 2))
        if CASES[case][1]:
            assert torch.equal(f.get_tensor("frames"), torch.cat([c.frames for c in whole[2:]], 1))


def test_the_int8_snapshot_holds_a_quantized_tier(wan, tmp_path):
    """The int8 case above saves frames already quantized (codes, scales, zero points) and sink copies."""
    session = _saved(wan, tmp_path / "s.safetensors")
    state, _ = load_snapshot(tmp_path / "s.safetensors", wan)
    assert session.cache.frames_quantized > 0 and state.meta["kv"]["frames_quantized"] > 0
    assert {"kv.kq0", "kv.kq0_scale", "kv.sink_k0"} <= set(state.tensors)


def test_a_snapshot_holds_exactly_the_tensors_the_model_and_settings_imply(wan, vae, tmp_path):
    _saved(wan, tmp_path / "s.safetensors", tiny_vae=vae)
    state, settings = load_snapshot(tmp_path / "s.safetensors", wan, tiny_vae=vae)
    expected = expected_tensors(wan, INT8_SINKS, H, W, vae, decoder_started=True)
    assert {n: (tuple(t.shape), t.dtype) for n, t in state.tensors.items()} == expected
    assert (settings.config, settings.height, settings.width, settings.seed, settings.tiny_vae) == (
        INT8_SINKS,
        H,
        W,
        3,
        "taew2_1",
    )
    # resumed without a tiny VAE: the decoder memory is not loaded, the latents continue
    state, _ = load_snapshot(tmp_path / "s.safetensors", wan)
    assert not any(n.startswith("decoder.") for n in state.tensors) and state.meta["decoder"] is None


def test_an_interrupted_save_leaves_no_partial_file(wan, tmp_path, monkeypatch):
    from fewstep.engine.causal import snapshot

    session = VideoSession(wan, _ctx(), H, W, INT8_SINKS, 3)
    session.run(1)

    def broken(tensors, path, metadata):
        with open(path, "wb") as f:
            f.write(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(snapshot, "save_file", broken)
    with pytest.raises(KeyboardInterrupt):
        save_session(session, tmp_path / "s.safetensors")
    assert os.listdir(tmp_path) == []


def test_a_pool_session_resumes_solo_and_a_solo_snapshot_joins_a_pool(wan, tmp_path):
    """A lone session in a pool runs bit-exact with its solo session: saved from the pool it continues solo bit
    for bit, and a solo snapshot joined into a pool continues there bit for bit too."""
    whole = torch.cat([c.latents for c in VideoSession(wan, _ctx(), H, W, INT8_SINKS, 3).run(5)], 2)
    pool = SessionPool(wan, H, W, INT8_SINKS, max_sessions=2)
    member = pool.join(_ctx(), seed=3)
    for _ in range(2):
        pool.tick()
        member.take()
    save_pool_session(pool, member, tmp_path / "pool.safetensors")
    solo, _ = resume_session(wan, tmp_path / "pool.safetensors")
    assert torch.equal(torch.cat([c.latents for c in solo.run(3)], 2), whole[:, :, 4:])
    # a suspended pool session saves its host copy
    pool.suspend(member)
    save_pool_session(pool, member, tmp_path / "suspended.safetensors")
    pool.leave(member)

    _saved(wan, tmp_path / "solo.safetensors")
    joined = join_from_snapshot(pool, tmp_path / "solo.safetensors")
    assert joined.state == "active" and joined.seed == 3
    got = []
    for _ in range(3):
        pool.tick()
        got.append(joined.take().latents)
    assert torch.equal(torch.cat(got, 2), whole[:, :, 4:])
    pool.close()


def test_a_pool_of_another_shape_group_refuses_the_snapshot(wan, tmp_path):
    _saved(wan, tmp_path / "s.safetensors")
    pool = SessionPool(wan, H, W, BF16_SINKS, max_sessions=1)
    with pytest.raises(InputError) as err:
        join_from_snapshot(pool, tmp_path / "s.safetensors")
    assert str(err.value) == (
        "input 'snapshot': s.safetensors: saved with other settings than asked: window_frames 8 (asked: 5); "
        "kv_dtype 'int8' (asked: 'bf16'); keep_recent_chunks 0 (asked: 1)"
    )
    assert pool.sessions == {} and len(pool._free_slots) == 1
    pool.close()


def test_the_model_digest_covers_the_weights_and_a_lora_merge(wan):
    digest = model_digest(wan)
    assert (
        digest == model_digest(wan) == model_digest(load_dit("dummy:wan-tiny", dtype=torch.float32, seed=2))
    )
    assert digest != model_digest(load_dit("dummy:wan-tiny", dtype=torch.float32, seed=5))
    assert digest != model_digest(load_dit("dummy:wan-tiny", dtype=torch.bfloat16, seed=2))
    weight = wan.blocks[0].self_attn.q.weight
    before = weight.detach().clone()
    try:
        weight.data.add_(1e-3)  # as a LoRA merge writes: through .data, no version counter bumped
        assert model_digest(wan) != digest
    finally:
        weight.data.copy_(before)
    assert model_digest(wan) == digest


# -- hostile and foreign files: each refused with its message, before any tensor is loaded -------------------------
def _rewrite(path, out, edit=None, tensors_edit=None):
    """``path``'s tensors and header, the header (a dict) passed through ``edit``, written to ``out``."""
    with safe_open(path, framework="pt") as f:
        header = json.loads(f.metadata()[HEADER_KEY])
        tensors = {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118 - safe_open is not iterable
    if edit is not None:
        edit(header)
    if tensors_edit is not None:
        tensors_edit(tensors)
    save_file(tensors, out, metadata={HEADER_KEY: json.dumps(header)})
    return out


def _refusal(path, model, **kwargs) -> str:
    with pytest.raises(InputError) as err:
        load_snapshot(path, model, **kwargs)
    assert err.value.input_name == kwargs.get("input_name", "snapshot")
    return str(err.value)


@pytest.fixture
def good(wan, tmp_path):
    _saved(wan, tmp_path / "good.safetensors")
    return tmp_path / "good.safetensors"


@pytest.fixture
def no_tensor_loads(monkeypatch):
    """Fails the test if a refused file got as far as loading a tensor."""
    from safetensors import safe_open as real

    from fewstep.engine.causal import snapshot

    class Guarded:
        def __init__(self, *args, **kwargs):
            self.inner = real(*args, **kwargs)

        def __enter__(self):
            self.handle = self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def __getattr__(self, name):
            if name == "get_tensor":
                raise AssertionError("a tensor was loaded from a refused file")
            return getattr(self.handle, name)

    monkeypatch.setattr(snapshot, "safe_open", Guarded)


def test_random_bytes_and_a_truncated_file_are_refused(wan, good, tmp_path, no_tensor_loads):
    (tmp_path / "noise.safetensors").write_bytes(os.urandom(4096))
    assert _refusal(tmp_path / "noise.safetensors", wan) == (
        "input 'snapshot': noise.safetensors: not a session snapshot: not a safetensors file (its first 8 bytes "
        "do not give the length of a header inside the file)"
    )
    data = good.read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) // 2])
    message = _refusal(tmp_path / "cut.safetensors", wan)
    assert message.startswith(
        "input 'snapshot': cut.safetensors: not a session snapshot: not a valid safetensors file ("
    )
    (tmp_path / "empty.safetensors").write_bytes(b"")
    assert "empty.safetensors: not a session snapshot: not a safetensors file" in _refusal(
        tmp_path / "empty.safetensors", wan
    )
    assert (
        _refusal(tmp_path / "absent.safetensors", wan)
        == f"input 'snapshot': {tmp_path / 'absent.safetensors'}: no such file"
    )


def test_a_pickle_is_never_unpickled(wan, tmp_path, no_tensor_loads):
    """A torch.save file (a pickle in a zip) under a snapshot's name, and a pickle stream: refused as not a
    safetensors file; nothing is unpickled (a payload that would run code when unpickled runs nothing)."""

    class Payload:
        def __reduce__(self):
            return (os.mkdir, (str(tmp_path / "pwned"),))

    torch.save({"kv.k0": torch.zeros(2), "x": Payload()}, tmp_path / "torch.safetensors")
    import pickle

    (tmp_path / "raw.safetensors").write_bytes(pickle.dumps(Payload()))
    for name in ("torch.safetensors", "raw.safetensors"):
        assert "not a session snapshot: not a" in _refusal(tmp_path / name, wan)
    assert not (tmp_path / "pwned").exists()


def test_huge_shapes_are_refused_before_allocating(wan, good, tmp_path, no_tensor_loads):
    def huge(header):
        header["tensors"]["kv.k0"]["shape"] = [2**40, 2, 32]

    assert _refusal(_rewrite(good, tmp_path / "huge.safetensors", huge), wan) == (
        "input 'snapshot': huge.safetensors: tensor 'kv.k0' is [18, 2, 32] F32 in the file but "
        "[1099511627776, 2, 32] F32 in its header"
    )

    def huge_in_both(header):  # header and file agree, on a shape the model does not make
        header["tensors"]["pending"]["shape"] = [1, 16, 2, 4, 12]

    def bigger(tensors):
        tensors["pending"] = torch.zeros(1, 16, 2, 4, 12)

    message = _refusal(_rewrite(good, tmp_path / "wide.safetensors", huge_in_both, bigger), wan)
    assert message == (
        "input 'snapshot': wide.safetensors: tensor 'pending' is [1, 16, 2, 4, 12] F32; this model and the "
        "snapshot's settings make it [1, 16, 2, 4, 6] F32"
    )

    def huge_window(header):  # settings whose expected shapes alone would be huge: bounded by the file first
        header["config"]["window_frames"] = 10**9

    message = _refusal(_rewrite(good, tmp_path / "window.safetensors", huge_window), wan)
    assert message.startswith("input 'snapshot': window.safetensors: its settings make a KV window of ")
    assert message.endswith(" (a window or size that was not saved here)")

    def many_steps(header):
        header["config"]["steps"] = 10**12

    assert _refusal(_rewrite(good, tmp_path / "steps.safetensors", many_steps), wan) == (
        "input 'snapshot': steps.safetensors: its saved steps 1000000000000 is not a count in [1, 1000]"
    )
    # a safetensors table claiming a huge tensor over a few bytes: refused by the format's own check
    header = json.dumps(
        {"kv.k0": {"dtype": "F32", "shape": [2**40, 2, 32], "data_offsets": [0, 16]}}
    ).encode()
    (tmp_path / "table.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(16))
    assert "table.safetensors: not a session snapshot: not a valid safetensors file (" in _refusal(
        tmp_path / "table.safetensors", wan
    )


def test_a_safetensors_file_without_the_header_is_refused(wan, tmp_path, no_tensor_loads):
    save_file({"latent": torch.zeros(1, 16, 2, 4, 6)}, tmp_path / "latents.safetensors")
    assert _refusal(tmp_path / "latents.safetensors", wan) == (
        "input 'snapshot': latents.safetensors: a safetensors file without a fewstep session header (no "
        "'fewstep.session' metadata): not a snapshot written by save_session / --save-session"
    )


def test_another_format_or_a_newer_version_is_refused(wan, good, tmp_path, no_tensor_loads):
    newer = _rewrite(good, tmp_path / "v3.safetensors", lambda h: h.update(version=3))
    assert _refusal(newer, wan) == (
        "input 'snapshot': v3.safetensors: snapshot format version 3 is newer than this fewstep reads (up to 2); "
        "update fewstep to resume it"
    )
    other = _rewrite(good, tmp_path / "other.safetensors", lambda h: h.update(format="something-else"))
    assert _refusal(other, wan) == (
        "input 'snapshot': other.safetensors: a 'something-else' file, not a 'fewstep-video-session' snapshot"
    )


def test_another_model_is_refused(wan, good, no_tensor_loads):
    other_weights = load_dit("dummy:wan-tiny", dtype=torch.float32, device="cpu", seed=5)
    message = _refusal(good, other_weights)
    assert message.startswith(
        "input 'snapshot': good.safetensors: saved from another model's weights (weights digest "
    )
    assert message.endswith("here): the same architecture with other weights or another LoRA")
    mid = load_dit("dummy:wan-mid", dtype=torch.float32, device="cpu", seed=2)
    assert _refusal(good, mid) == (
        "input 'snapshot': good.safetensors: saved from another model (dim 64 there, 512 here; ffn_dim 128 there, "
        "1536 here; num_heads 2 there, 4 here; num_layers 2 there, 4 here)"
    )
    half = load_dit("dummy:wan-tiny", dtype=torch.bfloat16, device="cpu", seed=2)
    assert _refusal(good, half) == (
        "input 'snapshot': good.safetensors: saved from a model computing in float32; this one computes in "
        "bfloat16 (open the model with the snapshot's dtype)"
    )


def test_settings_other_than_asked_are_refused(wan, vae, good, no_tensor_loads):
    assert _refusal(good, wan, config=BF16_SINKS, height=64) == (
        "input 'snapshot': good.safetensors: saved with other settings than asked: window_frames 8 (asked: 5); "
        "kv_dtype 'int8' (asked: 'bf16'); keep_recent_chunks 0 (asked: 1); height 32 (asked: 64)"
    )
    assert _refusal(good, wan, tiny_vae=vae, input_name="--resume") == (
        "input '--resume': good.safetensors: saved without a tiny VAE: it holds no stream decoder state to continue "
        "taew2_1's frames (resume it without a tiny VAE)"
    )


def test_a_tampered_state_or_config_is_refused(wan, good, tmp_path, no_tensor_loads):
    def slots(header):
        header["state"]["kv"]["full"] = ["x"]

    assert _refusal(_rewrite(good, tmp_path / "a.safetensors", slots), wan) == (
        "input 'snapshot': a.safetensors: its saved session state is invalid (kv.full is not a list of frame indices)"
    )

    def future(header):
        header["state"]["kv"]["full"][0] = 10**6

    assert _refusal(_rewrite(good, tmp_path / "f.safetensors", future), wan) == (
        "input 'snapshot': f.safetensors: its saved session state is invalid (kv.full is not a list of frame indices)"
    )

    def window(header):
        header["config"]["window_frames"] = 1

    message = _refusal(_rewrite(good, tmp_path / "b.safetensors", window), wan)
    assert message.startswith("input 'snapshot': b.safetensors: its saved config is invalid: ")

    def extra(tensors):
        tensors["extra"] = torch.zeros(2)

    def listed(header):
        header["tensors"]["extra"] = {"shape": [2], "dtype": "float32"}

    assert _refusal(_rewrite(good, tmp_path / "c.safetensors", listed, extra), wan) == (
        "input 'snapshot': c.safetensors: tensor 'extra' is not part of a session of this model"
    )


# -- format 2: the interactive state (issue 32) ------------------------------------------------------------------
def _latents(seed: int, frames: int) -> torch.Tensor:
    return torch.randn(1, 16, frames, H // 8, W // 8, generator=torch.Generator().manual_seed(seed))


def _interactive(model, config=BF16_SINKS):
    """A session after a prefill (image to video), a chunk, a prompt switch and a chunk; then queued for its
    next chunk: input frames, a strength and a prompt control with a re-cache."""
    session = VideoSession(model, _ctx(1), H, W, config, 3)
    session.prefill(_latents(5, 1 + config.chunk_frames))
    session.run(1)
    session.set_prompt(_ctx(2))
    session.run(1)
    session.feed(_latents(6, 2 * config.chunk_frames))
    session.control("strength", 0.6)
    session.control("prompt", _ctx(3), recache=True)
    return session


def _continue(session):
    """Two chunks, then a prompt switch with a re-cache and text to video again, then a chunk."""
    out = session.run(2)
    session.set_prompt(_ctx(4), recache=True)
    session.set_strength(None)
    return out + session.run(1)


def test_a_session_saved_after_a_prefill_and_a_switch_resumes_and_recaches_as_the_uninterrupted(
    wan, tmp_path
):
    reference = _continue(_interactive(wan))
    session = _interactive(wan)
    save_session(session, tmp_path / "s.safetensors")
    state, _ = load_snapshot(tmp_path / "s.safetensors", wan)
    assert {"clean.latents", "inputs.0", "inputs.3", "control.prompt"} <= set(state.tensors)
    assert [c["kind"] for c in state.meta["host"]["controls"]] == ["prompt", "strength"]
    resumed, _ = resume_session(wan, tmp_path / "s.safetensors")
    got = _continue(resumed)
    for chunk, ref in zip(got, reference, strict=True):
        assert torch.equal(chunk.latents, ref.latents), chunk.index
        assert (chunk.mode, chunk.strength, chunk.recache is None) == (
            ref.mode,
            ref.strength,
            ref.recache is None,
        )
        assert [(a.kind, a.sequence, a.chunk) for a in chunk.controls] == [
            (a.kind, a.sequence, a.chunk) for a in ref.controls
        ]
    assert got[0].recache.frames > 0 and got[2].mode == "t2v"
    assert resumed.control("seed", 9) == 3  # the control numbers go on from the saved ones


def test_a_version_1_snapshot_is_read_with_empty_interactive_parts(wan, tmp_path):
    session = _saved(wan, tmp_path / "v2.safetensors", BF16_SINKS)
    reference = session.run(2)

    def version_1(header):
        header["version"] = 1
        del header["state"]["clean_frames"], header["state"]["host"], header["tensors"]["clean.latents"]

    def no_clean(tensors):
        del tensors["clean.latents"]

    _rewrite(tmp_path / "v2.safetensors", tmp_path / "v1.safetensors", version_1, no_clean)
    resumed, _ = resume_session(wan, tmp_path / "v1.safetensors")
    assert resumed.clean.frames == [None] * BF16_SINKS.window_frames and len(resumed.inputs) == 0
    assert resumed.strength is None and resumed.controls.pending() == []
    # a re-cache needs the window's clean latents, which a version 1 file does not hold: refused when sent
    context = torch.randn(1, 4, resumed.model.params.text_dim)
    for send in (
        lambda: resumed.set_prompt(context, recache=True),
        lambda: resumed.control("prompt", context, True),
    ):
        with pytest.raises(InputError, match=r"input 'recache': the clean latents of frames .* are not kept"):
            send()
    assert resumed.controls.pending() == []
    got = resumed.run(2)
    assert all(torch.equal(a.latents, b.latents) for a, b in zip(got, reference, strict=True))


def test_tampered_interactive_parts_are_refused(wan, tmp_path, no_tensor_loads):
    good = tmp_path / "good.safetensors"
    save_session(_interactive(wan), good)

    def strength(header):
        header["state"]["host"]["strength"] = 2.0

    assert _refusal(_rewrite(good, tmp_path / "a.safetensors", strength), wan) == (
        "input 'snapshot': a.safetensors: its saved session state is invalid (strength 2.0)"
    )

    def fewer_inputs(header):
        header["state"]["host"]["inputs"] = 2

    assert _refusal(_rewrite(good, tmp_path / "b.safetensors", fewer_inputs), wan) == (
        "input 'snapshot': b.safetensors: its input frames ['inputs.0', 'inputs.1', 'inputs.2', 'inputs.3'] are "
        "not the 2 it says are queued"
    )

    def no_prompt(header):
        header["state"]["host"]["controls"] = header["state"]["host"]["controls"][1:]

    assert _refusal(_rewrite(good, tmp_path / "c.safetensors", no_prompt), wan) == (
        "input 'snapshot': c.safetensors: its queued prompt control and its control.prompt tensor do not come "
        "together"
    )

    def clean_frames(header):
        header["state"]["clean_frames"] = header["state"]["clean_frames"][:-1]

    assert _refusal(_rewrite(good, tmp_path / "d.safetensors", clean_frames), wan) == (
        "input 'snapshot': d.safetensors: its saved session state is invalid (clean_frames lists 4 frames, not "
        "one per window frame)"
    )
