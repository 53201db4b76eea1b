"""Realtime metrics of one live session, as its viewer experiences them.

Times are ``time.perf_counter()`` seconds (injectable, for tests). The session records when it was opened and,
per chunk, when the chunk was done, the video seconds it holds, its latency (from due to done, the pool's
measure: ``PoolTiming.latency``), whether it met its deadline and the batch size it ran in.

* ``time_to_first_chunk_s``: first chunk done - opened;
* ``inter_chunk_p50_s`` / ``inter_chunk_p99_s``: percentiles (linear interpolation) of the intervals between
  consecutive chunks done, over the newest :data:`RECENT_INTERVALS`;
* ``realtime_factor``: video seconds made / wall seconds since opened (>= 1: generation keeps up with playback);
* ``deadline_attainment``: chunks that met their deadline / chunks;
* ``viewer_stalls`` / ``viewer_stall_seconds``: a viewer that starts playing at the first chunk and plays each
  chunk's video seconds in order stalls whenever the next chunk arrives after the buffered video ran out (it then
  resumes at that arrival); the count and the seconds it waited;
* ``batch_sizes``: ``{str(batch size): chunks}``.
"""

from __future__ import annotations

import time
from collections import deque

RECENT_INTERVALS = 256  # inter-chunk intervals kept for the percentiles (bounded memory over any run)


def percentile(values, q: float) -> float | None:
    """The ``q``-th percentile (0..100) by linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    if not ordered:
        return None
    rank = (len(ordered) - 1) * q / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


class RealtimeMetrics:
    """One session's realtime metrics (see the module docstring); memory bounded over any run."""

    def __init__(self, fps: float = 16.0, opened_at: float | None = None):
        self.fps = fps
        self.opened_at = time.perf_counter() if opened_at is None else opened_at
        self.closed_at: float | None = None
        self.first_chunk_at: float | None = None
        self.last_chunk_at: float | None = None
        self.intervals: deque[float] = deque(maxlen=RECENT_INTERVALS)
        self.chunks = 0
        self.video_seconds = 0.0
        self.deadlines_met = 0
        self.batch_sizes: dict[int, int] = {}
        self.viewer_stalls = 0
        self.viewer_stall_seconds = 0.0
        self._played_until: float | None = None  # when the viewer's buffered video runs out

    def record_chunk(self, video_seconds: float, latency: float, deadline_met: bool, batch: int,
                     done_at: float | None = None) -> None:  # fmt: skip
        """A chunk of ``video_seconds`` done at ``done_at`` (now by default)."""
        done_at = time.perf_counter() if done_at is None else done_at
        if self.first_chunk_at is None:
            self.first_chunk_at = done_at
            self._played_until = done_at + video_seconds
        else:
            self.intervals.append(done_at - self.last_chunk_at)
            if done_at > self._played_until:  # the buffer ran dry before this chunk came
                self.viewer_stalls += 1
                self.viewer_stall_seconds += done_at - self._played_until
                self._played_until = done_at
            self._played_until += video_seconds
        self.last_chunk_at = done_at
        self.chunks += 1
        self.video_seconds += video_seconds
        self.deadlines_met += bool(deadline_met)
        self.batch_sizes[batch] = self.batch_sizes.get(batch, 0) + 1

    def close(self, at: float | None = None) -> None:
        """The session ended: the realtime factor counts wall seconds up to here from now on."""
        if self.closed_at is None:
            self.closed_at = time.perf_counter() if at is None else at

    def as_dict(self, now: float | None = None) -> dict:
        """The metrics at ``now`` (default: now, or when the session closed)."""
        if now is None:
            now = self.closed_at if self.closed_at is not None else time.perf_counter()
        wall = now - self.opened_at
        return {
            "time_to_first_chunk_s": _rounded(
                None if self.first_chunk_at is None else self.first_chunk_at - self.opened_at
            ),
            "inter_chunk_p50_s": _rounded(percentile(self.intervals, 50)),
            "inter_chunk_p99_s": _rounded(percentile(self.intervals, 99)),
            "realtime_factor": _rounded(self.video_seconds / wall if wall > 0 else None),
            "deadline_attainment": _rounded(self.deadlines_met / self.chunks if self.chunks else None),
            "viewer_stalls": self.viewer_stalls,
            "viewer_stall_seconds": _rounded(self.viewer_stall_seconds),
            "batch_sizes": {str(n): c for n, c in sorted(self.batch_sizes.items())},
            "chunks": self.chunks,
            "video_seconds": _rounded(self.video_seconds),
            "seconds": _rounded(wall),
        }
