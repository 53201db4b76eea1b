"""A bounded LRU of live video sessions (by count and by bytes), for hosts that keep sessions between requests.

The byte bound is ``max_bytes`` when given; otherwise ``DEFAULT_SESSION_FRACTION`` of the memory of the device
the first session runs on (GPU memory, or host RAM; ``FEWSTEP_MEMORY_LIMIT_GB`` caps it), decided when that
session is added. The newest session is always kept, even when it alone is over the bound.
A session counts its ``nbytes``: its caches, or for a session on a worker pool the KV caches of all its ranks
(``RemoteVideoSession.nbytes``, the KV cache's one formula).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import OrderedDict

from ..errors import InputError
from ..preflight.budget import total_bytes
from ..units import format_bytes
from .session import VideoSession

log = logging.getLogger(__name__)

# Sessions' KV caches live next to the model on its device: half of it leaves room for the model and its work.
DEFAULT_SESSION_FRACTION = 0.5


class SessionStore:
    def __init__(self, max_sessions: int = 4, max_bytes: int | None = None):
        self.max_sessions = max_sessions
        self.explicit_max_bytes = max_bytes  # None: the default bound, from the first session's device
        self._default_max_bytes: int | None = None
        self._sessions: OrderedDict[str, VideoSession] = OrderedDict()
        self._ids = itertools.count(1)
        self._lock = threading.RLock()  # hosts may add and free sessions from several threads

    @property
    def max_bytes(self) -> int | None:
        """The byte bound in force (None until the default one is decided by the first session)."""
        return self.explicit_max_bytes if self.explicit_max_bytes is not None else self._default_max_bytes

    def _decide_default_bound(self, session: VideoSession) -> None:
        if self.explicit_max_bytes is not None or self._default_max_bytes is not None:
            return
        device = getattr(session, "device", None)
        self._default_max_bytes = int(DEFAULT_SESSION_FRACTION * total_bytes(device))
        log.info(
            "fewstep: video sessions kept up to %s in all (%.0f%% of %s memory; FEWSTEP_SESSION_GB sets it)",
            format_bytes(self._default_max_bytes), 100 * DEFAULT_SESSION_FRACTION, device or "host",
        )  # fmt: skip

    def add(self, session: VideoSession) -> str:
        with self._lock:
            self._decide_default_bound(session)
            key = f"session-{next(self._ids)}"
            self._sessions[key] = session
            self._evict(keep=key)
            return key

    def get(self, key: str, where: str | None = None) -> VideoSession:
        with self._lock:
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
        with self._lock:
            self._evict(keep=key)

    def dispose(self, key: str) -> None:
        with self._lock:
            session = self._sessions.pop(key, None)
        if session is not None:
            session.dispose()

    def dispose_where(self, predicate) -> int:
        with self._lock:
            keys = [k for k, s in self._sessions.items() if predicate(s)]
            for k in keys:
                self.dispose(k)
            return len(keys)

    def clear(self) -> None:
        self.dispose_where(lambda s: True)

    @property
    def nbytes(self) -> int:
        with self._lock:
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
