"""What the CLI writes and shows a user: stream --out's video and chunk files (PyAV MP4, or Pillow's animated WebP
without PyAV), generate's file messages, and progress bars on a terminal only."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import struct
import subprocess
import sys
import termios

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from fewstep.cli import video
from fewstep.cli.video import WebPWriter, open_video, to_uint8_frames, video_backend, write_video

av = pytest.importorskip("av")


def _cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "fewstep", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )


def _mp4_frames(path) -> np.ndarray:
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        assert stream.average_rate == video.VIDEO_FPS
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(stream)])


def _webp_frames(path) -> np.ndarray:
    with Image.open(path) as im:
        frames = []
        for i in range(getattr(im, "n_frames", 1)):
            im.seek(i)
            frames.append(np.asarray(im.convert("RGB")))
    return np.stack(frames)


def _as_yuv420(frames: torch.Tensor) -> np.ndarray:
    """The frames as an 8-bit yuv420p video stores them before compression (chroma at half resolution)."""
    return np.stack(
        [
            av.VideoFrame.from_ndarray(a, format="rgb24")
            .reformat(format="yuv420p")
            .to_ndarray(format="rgb24")
            for a in to_uint8_frames(frames)
        ]
    )


def _assert_mp4_matches(decoded: np.ndarray, frames: torch.Tensor) -> None:
    """H.264 at crf 12 against the same frames in yuv420p: the compression's own error only (measured on
    white noise, the hardest content: mean 2.6 levels of 255)."""
    reference = _as_yuv420(frames).astype(np.int16)
    assert decoded.shape == reference.shape
    assert np.abs(decoded.astype(np.int16) - reference).mean() < 4.0


def _hide_av(monkeypatch):
    monkeypatch.setitem(
        sys.modules, "av", None
    )  # `import av` raises ImportError, as when it is not installed


def test_mp4_writer_has_every_frame_at_its_size(tmp_path):
    frames = torch.rand(9, 3, 32, 48, generator=torch.Generator().manual_seed(0))
    path = write_video(str(tmp_path / "clip"), frames)
    assert path == str(tmp_path / "clip.mp4") and os.listdir(tmp_path) == ["clip.mp4"]
    decoded = _mp4_frames(path)
    assert decoded.shape == (9, 32, 48, 3)
    _assert_mp4_matches(decoded, frames)


def test_mp4_is_encoded_as_frames_are_appended(tmp_path):
    """Chunks appended one by one give the file one call with all the frames gives (the encoder is fed frame by
    frame, nothing is gathered)."""
    frames = torch.rand(7, 3, 16, 32, generator=torch.Generator().manual_seed(1))
    writer = open_video(str(tmp_path / "parts"), 32, 16)
    for part in (frames[:1], frames[1:4], frames[4:]):
        writer.append(part)
    assert writer.frames == 7 and not os.path.exists(writer.path)  # playable only once closed
    writer.close()
    np.testing.assert_array_equal(
        _mp4_frames(writer.path), _mp4_frames(write_video(str(tmp_path / "one"), frames))
    )


def test_an_abandoned_video_leaves_no_file(tmp_path):
    writer = open_video(str(tmp_path / "gone"), 32, 16)
    writer.append(torch.rand(3, 3, 16, 32))
    writer.abandon()
    assert os.listdir(tmp_path) == []


def test_without_pyav_the_video_is_a_lossless_webp(tmp_path, monkeypatch):
    _hide_av(monkeypatch)
    assert video_backend() == "webp"
    frames = torch.rand(5, 3, 32, 48, generator=torch.Generator().manual_seed(2))
    path = write_video(str(tmp_path / "clip"), frames)
    assert path.endswith("clip.webp")
    with Image.open(path) as im:
        assert (im.n_frames, im.size) == (5, (48, 32))
        im.load()  # a frame's duration is read with the frame
        assert im.info["duration"] == round(1000 / video.VIDEO_FPS)
    np.testing.assert_array_equal(_webp_frames(path), to_uint8_frames(frames))


def test_the_webp_fallback_keeps_a_bounded_number_of_frames(tmp_path):
    """Pillow assembles an animation in memory: the writer keeps at most max_bytes of frames and counts the rest."""
    frames = torch.rand(10, 3, 16, 16, generator=torch.Generator().manual_seed(3))
    writer = WebPWriter(str(tmp_path / "bounded.webp"), 16, 16, max_bytes=4 * 3 * 16 * 16)
    writer.append(frames[:3])
    writer.append(frames[3:])
    assert (writer.frames, writer.dropped) == (4, 6)
    writer.close()
    np.testing.assert_array_equal(_webp_frames(writer.path), to_uint8_frames(frames[:4]))


STREAM = ("stream", "--height", "32", "--width", "48", "--chunks", "3", "--chunk-frames", "2", "--window-frames",
          "4", "--tiny-vae", "dummy:taew2_1")  # fmt: skip


def test_stream_out_writes_a_video_and_each_chunk(tmp_path):
    r = _cli(*STREAM, "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    saved = load_file(str(tmp_path / "latents.safetensors"))["frames"][0]  # [T, 3, H, W], 4 * 6 - 3 frames
    assert saved.shape == (21, 3, 32, 48)
    _assert_mp4_matches(_mp4_frames(tmp_path / "video.mp4"), saved)
    # chunk 0 decodes 4 * 2 - 3 frames, every later chunk 4 * 2
    chunk_files = sorted(os.listdir(tmp_path / "chunks"))
    assert chunk_files == ["chunk_0000.mp4", "chunk_0001.mp4", "chunk_0002.mp4"]
    starts = [0, 5, 13, 21]
    for i, name in enumerate(chunk_files):
        _assert_mp4_matches(_mp4_frames(tmp_path / "chunks" / name), saved[starts[i] : starts[i + 1]])
    lines = r.stdout.splitlines()
    assert lines[0].startswith("chunk 0: latent frames 0-1, ") and lines[0].endswith(
        f"; wrote {tmp_path / 'chunks' / 'chunk_0000.mp4'}"
    )
    assert f"wrote {tmp_path / 'video.mp4'} (21 frames at 16 fps)" in lines
    assert (
        f"wrote {tmp_path / 'latents.safetensors'}" in lines and f"wrote {tmp_path / 'stream.json'}" in lines
    )
    assert sorted(os.listdir(tmp_path)) == ["chunks", "latents.safetensors", "stream.json", "video.mp4"]


def test_stream_out_without_pyav_writes_webp(tmp_path):
    hide = tmp_path / "hide_av" / "av"
    hide.mkdir(parents=True)
    (hide / "__init__.py").write_text("raise ImportError('PyAV hidden by the test')\n")
    path = os.pathsep.join([str(hide.parent), os.environ.get("PYTHONPATH", "")])
    out = tmp_path / "out"
    r = _cli(*STREAM, "--out", str(out), env={"PYTHONPATH": path})
    assert r.returncode == 0, r.stderr
    saved = load_file(str(out / "latents.safetensors"))["frames"][0]
    np.testing.assert_array_equal(_webp_frames(out / "video.webp"), to_uint8_frames(saved))
    assert sorted(os.listdir(out / "chunks")) == ["chunk_0000.webp", "chunk_0001.webp", "chunk_0002.webp"]
    np.testing.assert_array_equal(
        _webp_frames(out / "chunks" / "chunk_0001.webp"), to_uint8_frames(saved[5:13])
    )
    assert f"wrote {out / 'video.webp'} (21 frames at 16 fps)" in r.stdout.splitlines()


def test_stream_out_without_a_tiny_vae_says_why_there_is_no_video(tmp_path):
    r = _cli("stream", "--height", "32", "--width", "48", "--chunks", "1", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert (
        "no video: decoding frames needs --tiny-vae (taew2_1.pth; dummy:taew2_1 with dummy weights)"
        in r.stdout
    )
    assert sorted(os.listdir(tmp_path)) == ["latents.safetensors", "stream.json"]


def test_generate_says_every_file_it_wrote(tmp_path):
    r = _cli("generate", "--model", "flux-tiny", "--height", "64", "--width", "96", "--steps", "1", "--decode",
             "tiny", "--out", str(tmp_path))  # fmt: skip
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[-3].startswith(f"wrote {tmp_path / 'latent.safetensors'} [1, 16, 8, 12]; load ")
    assert lines[-2:] == [f"wrote {tmp_path / 'image.png'} (96x64 px, tiny decode)",
                          f"wrote {tmp_path / 'timings.json'}"]  # fmt: skip
    with Image.open(tmp_path / "image.png") as im:
        assert im.size == (96, 64)


# -- progress bars ------------------------------------------------------------------------------------------------
def _run_on_a_terminal(*args) -> tuple[int, str, str]:
    """The command with stderr on a pseudo-terminal (120 columns: tqdm draws nothing on a 0-column one)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "fewstep", *args], stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    err = b""
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        err += data
    os.close(master)
    out = proc.stdout.read().decode()
    return proc.wait(), out, err.decode(errors="replace")


GENERATE = ("generate", "--model", "flux-tiny", "--height", "64", "--width", "64", "--steps", "3")


def test_progress_bars_show_steps_and_chunks_on_a_terminal(tmp_path):
    code, out, err = _run_on_a_terminal(*GENERATE, "--out", str(tmp_path / "g"))
    assert code == 0, err
    # tqdm redraws at most every 0.1 s and a finished bar is cleared: the totals show, not every update
    assert "steps:" in err and "/3 [" in err
    assert "steps:" not in out and "\r" not in out  # the bar is on stderr, the results on stdout
    code, out, err = _run_on_a_terminal("stream", "--height", "32", "--width", "48", "--chunks", "2",
                                        "--chunk-frames", "2", "--window-frames", "4")  # fmt: skip
    assert code == 0, err
    assert "chunks:" in err and "/2 [" in err and "steps:" in err and "/4 [" in err
    assert out.splitlines()[0].startswith("chunk 0: latent frames 0-1, ")


def test_no_progress_bar_when_stderr_is_not_a_terminal(tmp_path):
    r = _cli(*GENERATE, "--out", str(tmp_path / "g"))
    assert r.returncode == 0 and r.stderr == ""
    r = _cli("stream", "--height", "32", "--width", "48", "--chunks", "2", "--chunk-frames", "2")
    assert r.returncode == 0 and r.stderr == ""


def test_stream_chunk_lines_give_kv_sizes_in_binary_units(capsys):
    """The chunk lines read "KV 36.00 KiB of 72.00 KiB" (engine.units.format_bytes), not raw byte counts; the
    --json report keeps the exact bytes."""
    from fewstep.cli import main
    from fewstep.engine.units import format_bytes

    argv = ["stream", "--height", "32", "--width", "48", "--chunks", "2", "--chunk-frames", "2",
            "--window-frames", "4"]  # fmt: skip
    assert main([*argv, "--json"]) == 0
    chunks = json.loads(capsys.readouterr().out)["chunks"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    for line, chunk in zip(lines, chunks):
        kv = f"KV {format_bytes(chunk['kv_bytes_used'])} of {format_bytes(chunk['kv_bytes'])}"
        assert line.startswith(f"chunk {chunk['index']}: latent frames ") and line.endswith(f" s, {kv}"), line
        assert " B" not in kv or chunk["kv_bytes"] < 1024
