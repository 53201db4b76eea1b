"""One live session's events on their way to its client: a bounded queue the generation thread fills and the
host's sender drains (``nodes/live_routes.py``: the websocket sender). The generation never waits for a reader."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from .protocol import EVENT_CHUNK, EVENT_STALL


class OutboxFullError(Exception):
    """The outbox was full of events that may not be dropped: its session must close."""


class SessionOutbox:
    """Bounded FIFO of ``(event, data)``.

    Full, and the new event droppable (a chunk event, a deadline miss): the OLDEST queued droppable event is
    dropped, and for a chunk event one coalesced ``fewstep.stall`` event (``{"dropped": n, "chunks": [indices]}``)
    becomes pending: it is handed out where the first dropped event was, counting every chunk event dropped since
    the last stall event handed out (a dropped deadline miss is not counted: its chunk event says the same). When
    no queued event is droppable, a droppable new event is itself dropped; an undroppable one then raises
    :class:`OutboxFullError` (the service closes the session: "its client reads too slowly").
    """

    def __init__(self, max_events: int = 16, tags: dict | None = None):
        if not isinstance(max_events, int) or isinstance(max_events, bool) or max_events < 1:
            raise ValueError(f"max_events: expected an integer >= 1, got {max_events!r}")
        self.max_events = max_events
        self.tags = dict(tags or {})  # merged into the stall events it makes (session, node, prompt_id)
        self._events: deque[tuple[str, dict, bool]] = deque()
        self._lock = threading.Lock()
        self._listener: Callable[[], None] | None = None
        self._closed = False
        self.dropped = 0  # chunk events dropped over the outbox's life
        self._stall: list[int] = []  # chunk indices dropped since the last stall event handed out
        self._stall_at = 0  # the stall event is handed out before the event at this queue position

    def put(self, event: str, data: dict, droppable: bool = False, force: bool = False) -> None:
        """Queue an event (never blocks). Raises :class:`OutboxFullError` when full of undroppable events; a put
        after :meth:`close` is ignored. ``force``: past the bound (a session's last events, as it closes)."""
        with self._lock:
            if self._closed:
                return
            listener = self._listener
            if len(self._events) >= self.max_events and not force:
                oldest = next((i for i, (_, _, d) in enumerate(self._events) if d), None)
                if oldest is None and not droppable:
                    raise OutboxFullError(f"{len(self._events)} events queued, none of them droppable")
                if oldest is None:  # nothing queued may go: the new event itself is the oldest droppable one
                    self._drop(event, data, len(self._events))
                else:
                    lost, dropped, _ = self._events[oldest]
                    del self._events[oldest]
                    self._drop(lost, dropped, oldest)
                    self._events.append((event, data, droppable))
            else:
                self._events.append((event, data, droppable))
        if listener is not None:
            listener()

    def _drop(self, event: str, data: dict, position: int) -> None:
        """Account for a dropped event that stood at ``position`` in the queue (under the lock)."""
        if event == EVENT_CHUNK:  # a viewer misses a chunk: announced by the stall event
            self._stall_at = position if not self._stall else min(self._stall_at, position)
            self._stall.append(data.get("chunk", -1))
            self.dropped += 1
        elif self._stall and position < self._stall_at:
            self._stall_at -= 1  # the stall keeps its place among the events that stay

    def pop(self) -> tuple[str, dict] | None:
        """The next event, or None (never blocks)."""
        with self._lock:
            if self._stall and self._stall_at <= 0:
                chunks, self._stall = self._stall, []
                return EVENT_STALL, {**self.tags, "dropped": len(chunks), "chunks": chunks}
            if not self._events:
                return None
            event, data, _ = self._events.popleft()
            if self._stall:
                self._stall_at -= 1
            return event, data

    def set_listener(self, listener: Callable[[], None] | None) -> None:
        """``listener()`` is called after each put, on the putting thread (a host wakes its sender with it)."""
        with self._lock:
            self._listener = listener

    def close(self) -> None:
        """No more puts; what is queued can still be popped."""
        with self._lock:
            self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    def __len__(self) -> int:
        with self._lock:
            return len(self._events) + bool(self._stall)
