"""Each finished chunk of a video node, handed to API clients while the node still runs.

ComfyUI shows a node's frames only when the node returns; a realtime stream wants them as they are made. After
every chunk a :class:`ChunkStream` writes the chunk's decoded frames as one short animated WebP clip into ComfyUI's
temp folder (subfolder ``fewstep``, served by ``/view?type=temp``) and sends a ``fewstep.chunk`` websocket event
to the client that queued the prompt (docs/streaming-api.md). Only the newest ``FEWSTEP_STREAM_CHUNKS_KEPT``
clips stay on disk (default 64, across runs), so a stream of any length holds a bounded amount of disk; a
client fetches each clip when its event arrives. A batch of several videos streams its first. Outside a ComfyUI run (tests, CLI) nothing is written or sent.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..engine.causal.session import ChunkResult
from ..engine.settings import env_int
from .host import executing_node, send_to_client, temp_directory

log = logging.getLogger(__name__)

EVENT = "fewstep.chunk"
SUBFOLDER = "fewstep"
CLIP_FPS = 16  # Wan 2.1's frame rate
# a clip is a few hundred KB: 4096 of them is a few GB of temp disk, more than a client ever falls behind by
CHUNKS_KEPT = env_int("FEWSTEP_STREAM_CHUNKS_KEPT", 64, minimum=1, maximum=4096)
PENDING_CLIPS = 2  # chunks waiting for their clip; one more makes the generation wait
_CLIPS: deque[str] = deque()  # the clips on disk, oldest first, across runs
_CLIPS_LOCK = threading.Lock()


def video_frame_span(first_latent: int, latent_frames: int) -> tuple[int, int]:
    """First and last video frame (inclusive) of ``latent_frames`` latent frames from ``first_latent``: Wan's
    VAE makes one frame of the first latent frame and four of every later one."""

    def start(latent: int) -> int:
        return 0 if latent == 0 else 4 * latent - 3

    return start(first_latent), start(first_latent + latent_frames) - 1


class ChunkStream:
    """One node run's chunks, published as they finish (a no-op when this is not a ComfyUI run); ``close()``
    waits for the clips still being written."""

    def __init__(self, chunks: int, chunk_frames: int):
        running = executing_node()
        folder = temp_directory()
        self.enabled = running is not None and folder is not None
        self.prompt_id, self.node = running if running is not None else ("", "")
        self.chunks, self.chunk_frames = chunks, chunk_frames
        self.folder = os.path.join(folder, SUBFOLDER) if folder is not None else ""
        self.run_id = uuid.uuid4().hex[:8]  # file names of one run never collide with another's
        self._first_chunk_seconds: float | None = None  # this node run's first chunk
        self._writer: ThreadPoolExecutor | None = None
        self._pending: deque[Future] = deque()

    def publish(self, chunk: ChunkResult, frames_before: int) -> None:
        """Announce ``chunk`` (after writing its clip, on the writer thread). ``frames_before``: video frames the
        session had decoded before this chunk (its clip's first frame number)."""
        if self._first_chunk_seconds is None:
            self._first_chunk_seconds = chunk.seconds
        if not self.enabled:
            return
        if chunk.frames is not None:
            first, last = frames_before, frames_before + chunk.frames.shape[1] - 1
        else:
            first, last = video_frame_span(chunk.start_frame, self.chunk_frames)
        event = {
            "prompt_id": self.prompt_id, "node": self.node, "chunk": chunk.index, "chunks": self.chunks,
            "frames": [first, last], "files": [], "seconds": round(chunk.seconds, 4),
            "first_chunk_seconds": round(self._first_chunk_seconds, 4), "kv_bytes": chunk.kv_bytes,
        }  # fmt: skip
        frames = chunk.frames[0] if chunk.frames is not None and chunk.frames.shape[1] else None
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="fewstep-chunk-clips")
        while len(self._pending) >= PENDING_CLIPS:  # the encoder is behind: wait, holding a bounded backlog
            self._pending.popleft().result()
        self._pending.append(self._writer.submit(self._write_and_send, chunk.index, frames, event))

    def close(self) -> None:
        """Wait for the clips still being written (their events are sent when each is on disk)."""
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None
        self._pending.clear()

    def _write_and_send(self, index: int, frames: torch.Tensor | None, event: dict) -> None:
        if frames is not None:
            try:
                event["files"] = [self._write_clip(index, frames)]
            except (OSError, ValueError) as exc:  # a full or read-only temp folder: the stream goes on
                log.warning(
                    "fewstep: could not write the clip of chunk %d to %s: %s", index, self.folder, exc
                )
        send_to_client(EVENT, event)

    def _write_clip(self, index: int, frames: torch.Tensor) -> dict:
        """``frames [k, 3, H, W]`` as an animated WebP; its /view parameters."""
        from PIL import Image

        os.makedirs(self.folder, exist_ok=True)
        name = f"fewstep_{self.run_id}_{index:05d}.webp"
        array = (frames.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
        images = [Image.fromarray(a) for a in array]
        path = os.path.join(self.folder, name)
        images[0].save(path, save_all=True, append_images=images[1:], duration=1000 // CLIP_FPS, loop=0,
                       quality=90, method=0)  # fmt: skip  # method 0: the fastest encoder
        with _CLIPS_LOCK:
            _CLIPS.append(path)
            stale = [_CLIPS.popleft() for _ in range(len(_CLIPS) - CHUNKS_KEPT)]
        for old in stale:
            try:
                os.remove(old)
            except OSError as exc:  # already gone (a user emptied temp): nothing to bound
                log.debug("fewstep: could not remove %s: %s", old, exc)
        return {"filename": name, "subfolder": SUBFOLDER, "type": "temp"}
