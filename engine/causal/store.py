"""A bounded LRU of live video sessions (by count and by bytes), for hosts that keep sessions between requests."""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict

from ..errors import InputError
from .session import VideoSession

log = logging.getLogger(__name__)


class SessionStore:
    def __init__(self, max_sessions: int = 4, max_bytes: int | None = None):
        self.max_sessions, self.max_bytes = max_sessions, max_bytes
        self._sessions: OrderedDict[str, VideoSession] = OrderedDict()
        self._ids = itertools.count(1)

    def add(self, session: VideoSession) -> str:
        key = f"session-{next(self._ids)}"
        self._sessions[key] = session
        self._evict(keep=key)
        return key

    def get(self, key: str, where: str | None = None) -> VideoSession:
        session = self._sessions.get(key)
        if session is None or session.disposed:
            raise InputError(
                "session",
                f"{key} is no longer available: it was disposed, evicted (at most "
                f"{self.max_sessions} sessions are kept) or freed when memory was released; run the "
                "video sampler again",
                where,
            )
        self._sessions.move_to_end(key)
        return session

    def alive(self, key: str) -> bool:
        session = self._sessions.get(key)
        return session is not None and not session.disposed

    def touch(self, key: str) -> None:
        """Re-check the limits after a session grew (its caches are allocated lazily per prompt)."""
        self._evict(keep=key)

    def dispose(self, key: str) -> None:
        session = self._sessions.pop(key, None)
        if session is not None:
            session.dispose()

    def dispose_where(self, predicate) -> int:
        keys = [k for k, s in self._sessions.items() if predicate(s)]
        for k in keys:
            self.dispose(k)
        return len(keys)

    def clear(self) -> None:
        self.dispose_where(lambda s: True)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self._sessions.values())

    def __len__(self) -> int:
        return len(self._sessions)

    def _evict(self, keep: str) -> None:
        def over() -> bool:
            too_many = len(self._sessions) > self.max_sessions
            too_big = self.max_bytes is not None and self.nbytes > self.max_bytes
            return (too_many or too_big) and len(self._sessions) > 1

        while over():
            oldest = next(k for k in self._sessions if k != keep)
            log.info("fewstep: evicting video %s (LRU)", oldest)
            self.dispose(oldest)
