"""``stream --init-latents``, ``--input-video --strength`` and ``--prompt-switch``, run as a user runs the CLI (in
process, through ``fewstep.cli.main``): the latents it writes equal the engine API's (``VideoSession.prefill``,
``feed`` / ``set_strength``, ``control("prompt", ...)``) chunk for chunk, and every bad input is one line naming
the flag."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from fewstep.cli import main
from fewstep.cli.stream import synthetic_prompt
from fewstep.cli.stream_interactive import parse_switch
from fewstep.engine.causal import CausalConfig
from fewstep.engine.causal.recipe import open_session
from fewstep.engine.causal.session import VideoSession
from fewstep.engine.causal.video_to_video import MAX_QUEUED_CHUNKS
from fewstep.engine.errors import InputError
from fewstep.engine.handle import open_model
from fewstep.engine.latent_formats import WAN21

# wan-tiny at 32x48 (4x6 latent pixels, 6 tokens a frame); chunks of 2 frames in a 4-frame window with a sink frame,
# so the window slides (and a re-cache keeps the sink) within a few chunks
H, W, CHUNK, WINDOW, SINKS, SEED = 32, 48, 2, 4, 1, 3
SMALL = ["stream", "--model", "wan-tiny", "--height", str(H), "--width", str(W), "--chunk-frames", str(CHUNK),
         "--window-frames", str(WINDOW), "--sink-frames", str(SINKS), "--seed", str(SEED)]  # fmt: skip


def _run(capsys, *args) -> str:
    assert main([*SMALL, *args]) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def _error(capsys, *args) -> str:
    assert main([*SMALL, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err  # one line
    return err


def _latent_file(path, frames: int, *, seed: int = 0, shape=None, key: str = "latent") -> str:
    shape = shape or (1, 16, frames, H // 8, W // 8)
    save_file({key: torch.randn(*shape, generator=torch.Generator().manual_seed(seed))}, str(path))
    return str(path)


def _cond_file(path, seed: int, width: int = 4096) -> str:
    save_file({"context": torch.randn(1, 8, width, generator=torch.Generator().manual_seed(seed))}, str(path))
    return str(path)


def _written(folder) -> torch.Tensor:
    return load_file(os.path.join(folder, "latents.safetensors"))["latent"]


def _engine_session() -> VideoSession:
    """The session the CLI opens for SMALL (dummy wan-tiny, fp32 on the CPU, the synthetic prompt of SEED)."""
    handle = open_model("dummy:wan-tiny", device="cpu")
    config = CausalConfig(chunk_frames=CHUNK, window_frames=WINDOW, sink_frames=SINKS, steps=4)
    prompt = synthetic_prompt(SEED, 64, handle.params.text_dim)
    session, _ = open_session(handle, prompt, H, W, config, SEED, None, "stream")
    return session


def _raw(path) -> torch.Tensor:
    return WAN21.process_in(load_file(path)["latent"])


@pytest.mark.parametrize("start_frames", [1, 4], ids=["image", "video-extension"])
def test_init_latents_and_prompt_switches_write_the_engine_sessions_latents(capsys, tmp_path, start_frames):
    init = _latent_file(tmp_path / "init.safetensors", start_frames)
    b, c = _cond_file(tmp_path / "b.safetensors", 1), _cond_file(tmp_path / "c.safetensors", 2)
    report = json.loads(_run(capsys, "--chunks", "5", "--init-latents", init, "--prompt-switch", f"2:{b}:recache",
                             "--prompt-switch", f"4:{c}", "--out", str(tmp_path / "out"), "--json"))  # fmt: skip
    session = _engine_session()
    started = session.prefill(_raw(init))
    expected = []
    for chunk in [None, None, (b, True), None, (c, False)]:
        if chunk is not None:
            session.control("prompt", load_file(chunk[0])["context"], recache=chunk[1])
        expected.append(next(iter(session.chunks(1))))
    written = _written(tmp_path / "out")
    assert written.shape == (1, 16, 5 * CHUNK, H // 8, W // 8)  # the generated chunks, after the start frames
    torch.testing.assert_close(written, torch.cat([e.raw for e in expected], dim=2), rtol=0, atol=1e-6)

    assert report["prefill"]["frames"] == start_frames and report["prefill"]["path"] == init
    assert report["prefill"]["blocks"] == list(started.blocks) == ([1] if start_frames == 1 else [2, 2])
    assert [r["start_frame"] for r in report["chunks"]] == [start_frames + CHUNK * i for i in range(5)]
    # each switch is reported at the chunk it took effect at; only the first re-cached
    assert [[a["kind"] for a in r["controls"]] for r in report["chunks"]] == [
        [],
        [],
        ["prompt"],
        [],
        ["prompt"],
    ]
    assert [a["chunk"] for r in report["chunks"] for a in r["controls"]] == [2, 4]
    recached = report["chunks"][2]["recache"]
    # past the window the ring frames are recomputed and the sink kept (LongLive's global sink)
    assert recached["frames"] == expected[2].recache.frames == WINDOW - SINKS
    assert [r["recache"] is None for r in report["chunks"]] == [True, True, False, True, True]
    switches = report["prompt_switches"]
    assert [(s["chunk"], s["cond"], s["recache"], s["recache_frames"]) for s in switches] == [
        (2, b, True, WINDOW - SINKS),
        (4, c, False, None),
    ]
    assert (
        switches[0]["recache_seconds"] > 0 and switches[0]["chunk_seconds"] == report["chunks"][2]["seconds"]
    )
    assert report["latent_frames"] == 5 * CHUNK and report["video_frames"] == 4 * 5 * CHUNK
    session.dispose()


def test_the_lines_give_the_start_and_each_switch_beside_its_chunk(capsys, tmp_path):
    init = _latent_file(tmp_path / "init.safetensors", 3)
    b = _cond_file(tmp_path / "b.safetensors", 1)
    lines = _run(capsys, "--chunks", "3", "--init-latents", init, "--prompt-switch", f"1:{b}:recache",
                 "--prompt-switch", f"2:{b}").splitlines()  # fmt: skip
    assert lines[0].startswith(f"start: 3 latent frames of {init} committed in 2 forwards (1 + 2), ")
    assert lines[0].endswith(" s a frame)")
    assert lines[1].startswith("chunk 0: latent frames 3-4, ") and "prompt switch" not in lines[1]
    assert lines[2].startswith("chunk 1: latent frames 5-6, ")
    assert f" s (prompt switch to {b}: re-cache of {WINDOW - SINKS} frames " in lines[2]
    assert f" s (prompt switch to {b}: cross-attention only), KV " in lines[3]


def test_input_video_is_fed_chunk_by_chunk_and_equals_the_engine_session(capsys, tmp_path, monkeypatch):
    video = _latent_file(tmp_path / "video.safetensors", 7)  # 3 whole chunks of 2, one frame left over
    queued = []  # the session's queue at each feed: a live source sends a chunk before it is due
    feed = VideoSession.feed

    def spy(self, latents):
        queued.append((len(self.inputs), latents.shape[2]))
        return feed(self, latents)

    monkeypatch.setattr(VideoSession, "feed", spy)
    report = json.loads(_run(capsys, "--input-video", video, "--strength", "0.6", "--out", str(tmp_path / "o"),
                             "--json"))  # fmt: skip
    assert queued == [(0, CHUNK)] * 3  # one chunk at a time, the queue empty each time (bound: 8 chunks)
    assert MAX_QUEUED_CHUNKS == 8
    monkeypatch.undo()
    session = _engine_session()
    session.set_strength(0.6)
    inputs = _raw(video)
    expected = []
    for i in range(3):
        session.feed(inputs[:, :, CHUNK * i : CHUNK * (i + 1)])
        expected.append(next(iter(session.chunks(1))))
    torch.testing.assert_close(
        _written(tmp_path / "o"), torch.cat([e.raw for e in expected], dim=2), rtol=0, atol=1e-6
    )
    assert [(r["mode"], r["strength"]) for r in report["chunks"]] == [("v2v", 0.6)] * 3
    assert report["input_video"] == {"path": video, "frames": 7, "strength": 0.6, "frames_used": 6,
                                     "frames_unused": 1}  # fmt: skip
    session.dispose()


def test_input_video_with_fewer_chunks_and_a_start(capsys, tmp_path):
    video = _latent_file(tmp_path / "video.safetensors", 6)
    init = _latent_file(tmp_path / "init.safetensors", 1, seed=5)
    out = _run(capsys, "--input-video", video, "--strength", "1.0", "--chunks", "2", "--init-latents", init)
    lines = out.splitlines()
    assert len(lines) == 3 and lines[0].startswith("start: 1 latent frames")
    assert lines[1].startswith("chunk 0: latent frames 1-2, video to video at strength 1, ")
    assert lines[2].startswith("chunk 1: latent frames 3-4, video to video at strength 1, ")


def test_a_prefilled_video_opens_with_the_start_frames(capsys, tmp_path):
    init = _latent_file(tmp_path / "init.safetensors", 1)
    report = json.loads(_run(capsys, "--chunks", "2", "--init-latents", init, "--tiny-vae", "dummy:taew2_1",
                             "--out", str(tmp_path / "o"), "--json"))  # fmt: skip
    assert report["prefill"]["video_frames"] == 1  # the image: a lone first latent frame decodes to one frame
    frames = load_file(str(tmp_path / "o" / "latents.safetensors"))["frames"]
    assert frames.shape[1] == report["video_frames"] == 4 * 2 * CHUNK  # the chunks' frames, none trimmed
    # the video: the start frame, then the chunks' frames
    out = _run(capsys, "--chunks", "2", "--init-latents", init, "--tiny-vae", "dummy:taew2_1", "--out",
               str(tmp_path / "p"))  # fmt: skip
    assert f"({1 + 4 * 2 * CHUNK} frames at 16 fps)" in out


def test_a_switch_of_a_resumed_stream_counts_from_the_runs_first_chunk(capsys, tmp_path):
    saved = str(tmp_path / "s.safetensors")
    _run(capsys, "--chunks", "2", "--save-session", saved)
    b = _cond_file(tmp_path / "b.safetensors", 1)
    # without a re-cache: a snapshot of this engine core does not hold the window's clean latents yet
    report = json.loads(
        _run(capsys, "--resume", saved, "--chunks", "2", "--prompt-switch", f"1:{b}", "--json")
    )
    assert [r["index"] for r in report["chunks"]] == [2, 3]
    assert [[a["chunk"] for a in r["controls"]] for r in report["chunks"]] == [[], [3]]
    assert report["prompt_switches"] == [
        {"chunk": 3, "cond": b, "recache": False, "recache_frames": None, "recache_seconds": None,
         "chunk_seconds": report["chunks"][1]["seconds"]}
    ]  # fmt: skip


def test_parse_switch():
    assert parse_switch("3:a.safetensors") == (3, "a.safetensors", False)
    assert parse_switch("0:C:/prompts/a.safetensors:recache") == (0, "C:/prompts/a.safetensors", True)
    with pytest.raises(InputError, match="expected CHUNK:CONDFILE or CHUNK:CONDFILE:recache"):
        parse_switch("a.safetensors")


@pytest.fixture
def files(tmp_path):
    d = tmp_path
    (d / "not.safetensors").write_text("not a safetensors file")
    (d / "folder").mkdir()
    return {
        "ok4": _latent_file(d / "ok4.safetensors", 4),
        "three": _latent_file(d / "three.safetensors", 3, shape=(1, 16, 3, H // 8, W // 8)),
        "one": _latent_file(d / "one.safetensors", 1),
        "two": _latent_file(d / "two.safetensors", 2),
        "key": _latent_file(d / "key.safetensors", 2, key="samples"),
        "ndim": _latent_file(d / "ndim.safetensors", 0, shape=(1, 16, H // 8, W // 8)),
        "channels": _latent_file(d / "channels.safetensors", 0, shape=(1, 48, 2, H // 8, W // 8)),
        "size": _latent_file(d / "size.safetensors", 0, shape=(1, 16, 2, 8, 8)),
        "batch2": _latent_file(d / "batch2.safetensors", 0, shape=(2, 16, 2, H // 8, W // 8)),
        "cond": _cond_file(d / "cond.safetensors", 1),
        "narrow": _cond_file(d / "narrow.safetensors", 1, width=32),
        "not": str(d / "not.safetensors"),
        "folder": str(d / "folder"),
        "missing": str(d / "missing.safetensors"),
    }


BAD = [
    (["--init-latents", "{missing}"], "input '--init-latents': file not found: {missing}"),
    (["--init-latents", "{folder}"], "input '--init-latents': {folder} is a folder, not a safetensors file"),
    (["--init-latents", "{not}"], "input '--init-latents': {not} is not a readable safetensors file ("),
    (["--init-latents", "{key}"], "input '--init-latents': {key} has no 'latent' tensor (found samples)"),
    (["--init-latents", "{ndim}"], "input '--init-latents': {ndim}: 'latent' is [1, 16, 4, 6]; expected "
     "ComfyUI's raw Wan 2.1 latent [batch, 16, frames, height / 8, width / 8]"),
    (["--input-video", "{channels}", "--strength", "0.5"], "input '--input-video': {channels}: 'latent' has 48 "
     "channels; Wan 2.1 latents have 16 (the Wan 2.1 VAE's; Wan 2.2's 48-channel VAE is another latent space)"),
    (["--init-latents", "{size}"], "input '--init-latents': {size}: latents of 8x8 latent pixels (64x64 px); "
     "this stream is 48x32 px (4x6 latent pixels): give --width 64 --height 64, or encode the video at 48x32"),
    (["--init-latents", "{three}", "--chunk-frames", "3", "--window-frames", "6"], None),  # 3 frames are one chunk of 3: accepted
    (["--init-latents", "{two}", "--chunk-frames", "3", "--window-frames", "6"], "input '--init-latents': 2 "
     "latent frames do not split into the session's chunks of 3"),
    (["--init-latents", "{batch2}"], "input '--init-latents': latents of batch 2; the stream's prompt has batch 1"),
    (["--init-latents", "{ok4}", "--resume", "{ok4}"], "input '--init-latents': starts a new stream from its "
     "frames; a resumed stream is past its start"),
    (["--input-video", "{ok4}"], "input '--strength': is required with --input-video"),
    (["--strength", "0.5"], "input '--strength': restyles an input video: give --input-video FILE"),
    (["--input-video", "{ok4}", "--strength", "0"], "input '--strength': 0.0 is not in (0, 1]"),
    (["--input-video", "{ok4}", "--strength", "1.5"], "input '--strength': 1.5 is not in (0, 1]"),
    (["--input-video", "{ok4}", "--strength", "nan"], "input '--strength': "),
    (["--input-video", "{one}", "--strength", "0.5"], "input '--input-video': {one} holds 1 latent frames, fewer "
     "than one chunk of 2 (--chunk-frames)"),
    (["--input-video", "{ok4}", "--strength", "0.5", "--chunks", "3"], "input '--input-video': {ok4} holds 4 "
     "latent frames: 2 chunks of 2; 3 chunks were asked for (give --chunks 2 or fewer"),
    (["--input-video", "{ok4}", "--strength", "0.5", "--latent-frames", "6"], "3 chunks were asked for"),
    (["--input-video", "{batch2}", "--strength", "0.5"], "input '--input-video': latents of batch 2; the "
     "stream's prompt has batch 1"),
    (["--prompt-switch", "two:{cond}"], "input '--prompt-switch': 'two:{cond}': expected CHUNK:CONDFILE or "
     "CHUNK:CONDFILE:recache"),
    (["--prompt-switch", "1:"], "input '--prompt-switch': '1:': expected CHUNK:CONDFILE"),
    (["--prompt-switch", "4:{cond}"], "input '--prompt-switch': '4:{cond}': chunk 4 is not a chunk of this run "
     "(0 to 3, 4 chunks)"),
    (["--prompt-switch=-1:{cond}"], "chunk -1 is not a chunk of this run (0 to 3, 4 chunks)"),
    (["--prompt-switch", "1:{cond}", "--prompt-switch", "1:{cond}:recache"], "input '--prompt-switch': "
     "'1:{cond}:recache': chunk 1 already switches to {cond} ('1:{cond}'); one prompt switch a chunk"),
    (["--prompt-switch", "1:{missing}"], "input '--prompt-switch': '1:{missing}': file not found: {missing}"),
    (["--prompt-switch", "1:{ok4}:recache"], "input '--prompt-switch': '1:{ok4}:recache': {ok4} has no "
     "'context' tensor (found latent)"),
    (["--prompt-switch", "1:{narrow}"], "input '--prompt-switch': '1:{narrow}': conditioning is [1, 8, 32]; "
     "Wan expects umT5 tokens [batch, tokens, 4096]"),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "message"), BAD, ids=[f"{i}-{a[0]}" for i, (a, _) in enumerate(BAD)])
def test_bad_input_is_one_line_naming_the_flag(capsys, files, argv, message):
    argv = [a.format(**files) for a in argv]
    if message is None:
        _run(capsys, "--chunks", "1", *argv)
        return
    err = _error(capsys, *argv)
    assert err.startswith("error: fewstep stream: input '"), err
    assert message.format(**files) in err, err


@pytest.mark.parametrize("kind", ["start-and-switches", "video-to-video"])
def test_each_pool_session_writes_what_a_single_stream_of_its_seed_writes(capsys, tmp_path, kind):
    if kind == "start-and-switches":
        init = _latent_file(tmp_path / "init.safetensors", 3)
        b = _cond_file(tmp_path / "b.safetensors", 1)
        flags = ["--chunks", "4", "--init-latents", init, "--prompt-switch", f"1:{b}:recache",
                 "--prompt-switch", f"3:{b}"]  # fmt: skip
    else:
        flags = ["--input-video", _latent_file(tmp_path / "video.safetensors", 6), "--strength", "0.5"]
    pool = tmp_path / "pool"
    report = json.loads(
        _run(capsys, *flags, "--sessions", "2", "--join-every", "1", "--out", str(pool), "--json")
    )
    for i in range(2):
        _run(capsys, *flags, "--seed", str(SEED + i), "--out", str(tmp_path / f"single_{i}"))
        torch.testing.assert_close(
            _written(pool / f"session_{i}"), _written(tmp_path / f"single_{i}"), rtol=0, atol=1e-5
        )
    for session in report["sessions"]:
        rows = session["chunks"]
        if kind == "start-and-switches":
            assert session["prefill"]["frames"] == 3 and [r["start_frame"] for r in rows] == [3, 5, 7, 9]
            assert [[a["chunk"] for a in r["controls"]] for r in rows] == [[], [1], [], [3]]
            assert [s["recache"] for s in session["prompt_switches"]] == [True, False]
        else:
            assert [(r["mode"], r["strength"]) for r in rows] == [("v2v", 0.5)] * 3


def test_a_pool_start_needs_a_slot_for_every_session(capsys, files):
    err = _error(capsys, "--init-latents", files["ok4"], "--sessions", "2", "--max-sessions", "1")
    assert (
        "input '--init-latents': a start is committed into a session's slot when it joins; --max-sessions 1"
        in err
    )
