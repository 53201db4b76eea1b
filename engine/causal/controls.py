"""A session's control channel: what a client changes between chunks (SGLang's realtime sessions take control
signals between chunks the same way).

Controls queue and take effect at the next chunk boundary, in the order of their kinds below, never in the
middle of a chunk. A newer control of a kind replaces a queued older one of that kind (a stale prompt is never
applied after a newer one: the failure of realtime apps whose queues are not flushed on a prompt change). Each
applied control is reported with the chunk it took effect at (:class:`AppliedControl`, on the chunk's
``ChunkResult.controls`` and in the session's bounded log).

Kinds:

* ``prompt``: a new conditioning, with ``recache`` or not (``engine.causal.prompt_switch``);
* ``strength``: the video-to-video strength of the next chunks (``engine.causal.video_to_video``);
* ``seed``: the random generator reseeded (the noise of the next chunks).

Thread-safe: a live server's request threads put controls while the generation thread takes them.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from dataclasses import dataclass

KINDS = ("prompt", "strength", "seed")  # also the order they are applied in at a boundary
RECENT_CONTROLS = 64  # applied controls a session remembers


@dataclass(frozen=True)
class Control:
    kind: str
    value: object  # prompt: the conditioning tensor; strength: float; seed: int
    recache: bool = False  # prompt only
    sequence: int = 0  # the order it was sent in (set by the queue)


@dataclass(frozen=True)
class AppliedControl:
    """A control that took effect: its kind, its sequence number, the chunk it first shaped and what it did."""

    kind: str
    sequence: int
    chunk: int
    recache: bool = False
    replaced: int = 0  # older queued controls of the same kind it replaced (never applied)
    detail: str = ""


class ControlQueue:
    def __init__(self):
        self._lock = threading.Lock()
        self._queued: dict[str, tuple[Control, int]] = {}  # kind -> (newest control, older ones it replaced)
        self._sequence = itertools.count(1)
        self.applied: deque[AppliedControl] = deque(maxlen=RECENT_CONTROLS)

    def put(self, kind: str, value, recache: bool = False) -> int:
        """Queue a control; returns its sequence number. Replaces a queued control of the same kind."""
        if kind not in KINDS:
            raise ValueError(f"unknown control {kind!r}; expected one of {', '.join(KINDS)}")
        with self._lock:
            sequence = next(self._sequence)
            _, replaced = self._queued.get(kind, (None, -1))
            self._queued[kind] = (Control(kind, value, recache, sequence), replaced + 1)
        return sequence

    def pending(self) -> list[Control]:
        with self._lock:
            return [self._queued[k][0] for k in KINDS if k in self._queued]

    def take(self) -> list[tuple[Control, int]]:
        """Every queued control (with the count of older ones each replaced), in the order of :data:`KINDS`;
        the queue is emptied."""
        with self._lock:
            taken = [self._queued.pop(k) for k in KINDS if k in self._queued]
        return taken

    def requeue(self, taken: list[tuple[Control, int]]) -> None:
        """Put back controls whose chunk was interrupted before they took effect, unless a newer control of the
        same kind has arrived meanwhile."""
        with self._lock:
            for control, replaced in taken:
                newer = self._queued.get(control.kind)
                if newer is None:
                    self._queued[control.kind] = (control, replaced)
                else:
                    self._queued[control.kind] = (newer[0], newer[1] + replaced + 1)

    def record(self, applied: AppliedControl) -> None:
        self.applied.append(applied)
