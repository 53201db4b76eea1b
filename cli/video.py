"""Writing decoded video from the CLI (``stream --out``, the demo): MP4 through PyAV
(``pip install av``), or animated WebP through Pillow when PyAV is absent."""

from __future__ import annotations

import contextlib
import os

import torch

from ..engine.errors import InputError

VIDEO_FPS = 16  # Wan 2.1's frame rate (81 frames: 5 s)
# The Pillow fallback's bound: libwebp assembles an animation in memory, so the whole-stream WebP keeps its frames
# (8-bit RGB) until the end. Past this many bytes of frames video.webp stops growing; every frame is still in its
# chunk file. PyAV's MP4 has no such bound: it encodes each frame as it comes.
WEBP_MAX_BYTES = 256 * 2**20


def to_uint8_frames(frames: torch.Tensor):
    """``[T, 3, H, W]`` in [0, 1] -> numpy ``[T, H, W, 3]`` uint8 (what an 8-bit video stores)."""
    return (
        (frames.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    )


def video_backend() -> str:
    """``mp4`` when PyAV is installed (``pip install av``), else ``webp`` through Pillow."""
    try:
        import av  # noqa: F401
    except ImportError:
        return "webp"
    return "mp4"


class Mp4Writer:
    """H.264 MP4 (yuv420p: plays in browsers and players) through PyAV, each frame encoded as it is appended:
    the encoder holds only its look-ahead, so memory stays flat for a stream of any length. Written under a
    temporary name and renamed by :meth:`close`, so an interrupted run leaves no unplayable file."""

    suffix = ".mp4"

    def __init__(self, path: str, width: int, height: int, fps: int = VIDEO_FPS):
        import av

        self.path, self.frames, self._closed = path, 0, False
        self._tmp = path + ".partial"
        self._container = av.open(self._tmp, mode="w", format="mp4")
        codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
        self._stream = self._container.add_stream(codec, rate=fps)
        self._stream.width, self._stream.height, self._stream.pix_fmt = width, height, "yuv420p"
        if codec == "libx264":
            # crf 12: near-transparent (dummy weights give noise). Reproducible: the same frames make the same
            # file. One encoder thread, and no rate-control look-ahead or macroblock tree: with them x264 (as PyAV
            # ships it) encoded the same frames to a different file about once in 500 runs on a loaded machine,
            # even single-threaded (a flaky test); without them 4800 runs under the same load gave one file. It
            # also keeps fewer frames in the encoder, and still encodes 480p far faster than a stream makes it
            self._stream.options = {
                "crf": "12",
                "preset": "fast",
                "threads": "1",
                "x264-params": "rc-lookahead=0:mbtree=0:sync-lookahead=0",
            }

    def append(self, frames: torch.Tensor) -> None:
        import av

        for array in to_uint8_frames(frames):
            for packet in self._stream.encode(av.VideoFrame.from_ndarray(array, format="rgb24")):
                self._container.mux(packet)
            self.frames += 1

    def close(self) -> None:
        for packet in self._stream.encode(None):  # the encoder's look-ahead
            self._container.mux(packet)
        self._container.close()
        self._closed = True
        os.replace(self._tmp, self.path)

    def abandon(self) -> None:
        """Remove the temporary file unless :meth:`close` completed it."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):  # the container may be half-closed by a failed close()
            self._container.close()
        if os.path.exists(self._tmp):  # the muxer creates it with the first packet: maybe never
            os.remove(self._tmp)


class WebPWriter:
    """Lossless animated WebP through Pillow (the fallback without PyAV). Pillow encodes an animation in one call,
    so the frames are kept (8-bit RGB) until :meth:`close`, up to ``max_bytes``; later frames are counted in
    :attr:`dropped` and left out of this file (the stream's chunk files still hold them)."""

    suffix = ".webp"

    def __init__(
        self, path: str, width: int, height: int, fps: int = VIDEO_FPS, max_bytes: int = WEBP_MAX_BYTES
    ):
        self.path, self.fps, self.frames, self.dropped = path, fps, 0, 0
        self._max_frames = max(1, max_bytes // (3 * width * height))
        self._kept = []

    def append(self, frames: torch.Tensor) -> None:
        for array in to_uint8_frames(frames):
            if len(self._kept) < self._max_frames:
                self._kept.append(array)
                self.frames += 1
            else:
                self.dropped += 1

    def close(self) -> None:
        from PIL import Image

        images = [Image.fromarray(a) for a in self._kept]
        self._kept = []
        tmp = self.path + ".partial"
        images[0].save(tmp, format="WEBP", save_all=True, append_images=images[1:], lossless=True,
                       duration=1000 / self.fps, loop=0)  # fmt: skip
        os.replace(tmp, self.path)

    def abandon(self) -> None:
        self._kept = []


def open_video(stem: str, width: int, height: int, fps: int = VIDEO_FPS, backend: str | None = None):
    """A writer for ``<stem>.mp4`` (PyAV) or ``<stem>.webp`` (Pillow): ``append(frames [T, 3, H, W])`` as
    frames come, then ``close()`` (or ``abandon()``)."""
    kind = backend or video_backend()
    if kind == "webp":
        try:
            import PIL  # noqa: F401
        except ImportError as exc:
            raise InputError(
                "--out",
                "writing a video needs PyAV (pip install av) or Pillow (pip install pillow)",
            ) from exc
    cls = Mp4Writer if kind == "mp4" else WebPWriter
    return cls(stem + cls.suffix, width, height, fps)


def write_video(stem: str, frames: torch.Tensor, fps: int = VIDEO_FPS, backend: str | None = None) -> str:
    """``frames [T, 3, H, W]`` in [0, 1] -> one video file; its path."""
    writer = open_video(stem, frames.shape[-1], frames.shape[-2], fps, backend)
    try:
        writer.append(frames)
        writer.close()
    except BaseException:
        writer.abandon()
        raise
    return writer.path
