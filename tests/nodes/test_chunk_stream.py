"""Streamed chunks (nodes/chunk_stream.py): inside a ComfyUI run, every finished chunk of the video nodes is a
WebP clip in the temp folder and a ``fewstep.chunk`` websocket event; outside one, nothing is written or sent."""

from __future__ import annotations

import collections
import sys
import types

import numpy as np
import pytest
from PIL import Image
from test_nodes import _run

ExecutionContext = collections.namedtuple("ExecutionContext", "prompt_id node_id list_index")


class FakePromptServer:
    def __init__(self):
        self.client_id = "client-1"
        self.sent = []

    def send_sync(self, event, data, sid=None):
        self.sent.append((event, data, sid))


@pytest.fixture
def comfy_run(monkeypatch, tmp_path):
    """The parts of a running ComfyUI the stream uses: the executing node, the temp folder, the prompt server."""
    server = FakePromptServer()
    context = {"value": ExecutionContext("prompt-7", "12", None)}
    monkeypatch.setitem(sys.modules, "comfy_execution.utils",
                        types.SimpleNamespace(get_executing_context=lambda: context["value"]))  # fmt: skip
    monkeypatch.setitem(
        sys.modules, "folder_paths", types.SimpleNamespace(get_temp_directory=lambda: str(tmp_path))
    )
    monkeypatch.setitem(
        sys.modules, "server", types.SimpleNamespace(PromptServer=types.SimpleNamespace(instance=server))
    )
    return server, context, tmp_path


def _clip(path) -> np.ndarray:
    with Image.open(path) as im:
        frames = []
        for i in range(im.n_frames):
            im.seek(i)
            frames.append(np.asarray(im.convert("RGB"), dtype=np.float32) / 255)
    return np.stack(frames)


def _video(pack, **extra):
    m = pack.NODE_CLASS_MAPPINGS
    (wan,) = _run(m["FewStepDiTLoader"], model_name="dummy:wan-tiny")
    (cond,) = _run(m["FewStepSyntheticConditioning"], pooled_width=0)
    (vae,) = _run(m["FewStepTinyVAELoader"], vae_name="dummy:taew2_1")
    return m, dict(model=wan, positive=cond, width=48, height=32, chunk_frames=2, window_frames=4, tiny_vae=vae,
                   **extra)  # fmt: skip


def test_each_chunk_is_a_clip_and_an_event(pack, comfy_run):
    server, context, temp = comfy_run
    m, args = _video(pack)
    latent, frames, session, _ = _run(m["FewStepCausalVideoSampler"], num_chunks=3, **args)
    events = [d for e, d, sid in server.sent if e == "fewstep.chunk"]
    assert [e for e, _, _ in server.sent] == ["fewstep.chunk"] * 3
    assert {sid for _, _, sid in server.sent} == {"client-1"}
    assert [e["chunk"] for e in events] == [0, 1, 2] and {e["chunks"] for e in events} == {3}
    assert [e["frames"] for e in events] == [[0, 4], [5, 12], [13, 20]]  # 1 + 4 video frames per latent frame
    assert frames.shape[0] == 21
    for e in events:
        assert e["prompt_id"] == "prompt-7" and e["node"] == "12" and e["kv_bytes"] > 0 and e["seconds"] > 0
        assert e["first_chunk_seconds"] == events[0]["first_chunk_seconds"]
        (file,) = e["files"]
        assert file["subfolder"] == "fewstep" and file["type"] == "temp"
        clip = _clip(temp / "fewstep" / file["filename"])
        first, last = e["frames"]
        assert clip.shape == (last - first + 1, 32, 48, 3)
        # lossy WebP (quality 90): the clip shows the node's own frames
        assert np.abs(clip - frames[first : last + 1].numpy()).mean() < 0.04

    context["value"] = ExecutionContext("prompt-8", "13", None)
    server.sent.clear()
    _run(m["FewStepCausalContinue"], session=session, num_chunks=2)
    events = [d for _, d, _ in server.sent]
    assert [(e["node"], e["chunk"], e["chunks"], e["frames"]) for e in events] == [
        ("13", 3, 2, [21, 28]), ("13", 4, 2, [29, 36])
    ]  # fmt: skip  # the session's numbering goes on across a Continue


def test_only_the_newest_clips_stay_on_disk(pack, comfy_run, monkeypatch):
    server, _, temp = comfy_run
    chunk_stream = sys.modules[f"{pack.__name__}.nodes.chunk_stream"]
    monkeypatch.setattr(chunk_stream, "CHUNKS_KEPT", 2)
    monkeypatch.setattr(chunk_stream, "_CLIPS", collections.deque())
    m, args = _video(pack)
    _run(m["FewStepCausalVideoSampler"], num_chunks=4, **args)
    names = [d["files"][0]["filename"] for _, d, _ in server.sent]
    assert sorted(p.name for p in (temp / "fewstep").iterdir()) == sorted(names[-2:])


def test_without_a_tiny_vae_the_event_has_no_files(pack, comfy_run):
    server, _, temp = comfy_run
    m, args = _video(pack)
    del args["tiny_vae"]
    _run(m["FewStepCausalVideoSampler"], num_chunks=2, **args)
    assert [(d["frames"], d["files"]) for _, d, _ in server.sent] == [([0, 4], []), ([5, 12], [])]
    assert not (temp / "fewstep").exists()


def test_outside_a_comfyui_run_nothing_is_sent(pack, monkeypatch, tmp_path):
    server = FakePromptServer()
    monkeypatch.setitem(
        sys.modules, "server", types.SimpleNamespace(PromptServer=types.SimpleNamespace(instance=server))
    )
    m, args = _video(pack)
    frames = _run(m["FewStepCausalVideoSampler"], num_chunks=1, **args)[1]
    assert server.sent == [] and frames.shape == (5, 32, 48, 3)


def test_video_frame_span(pack):
    span = sys.modules[f"{pack.__name__}.nodes.chunk_stream"].video_frame_span
    assert [span(0, 3), span(3, 3), span(6, 3)] == [(0, 8), (9, 20), (21, 32)]
    assert span(0, 1) == (0, 0)


def test_a_clip_that_cannot_be_written_is_logged_and_the_stream_goes_on(pack, comfy_run, caplog):
    server, _, temp = comfy_run
    (temp / "fewstep").write_text("a file where the folder goes")
    m, args = _video(pack)
    frames = _run(m["FewStepCausalVideoSampler"], num_chunks=2, **args)[1]
    assert frames.shape[0] == 13
    assert [(d["chunk"], d["files"]) for _, d, _ in server.sent] == [(0, []), (1, [])]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 2 and all("could not write the clip of chunk" in w for w in warnings), warnings
