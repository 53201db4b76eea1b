"""LiveService: a session pool served to live clients (issue 33).

The host (ComfyUI's live node, a test, the bench) builds a :class:`~engine.causal.session_pool.SessionPool` and a
:class:`LiveTransport`, then runs :meth:`LiveService.serve` on its generation thread until it is stopped or a
limit is reached. Request threads (routes) call :meth:`open`, :meth:`control`, :meth:`feed_frames`,
:meth:`payload`, :meth:`close`, :meth:`status` and :meth:`stop`: thread-safe and non-blocking (they validate and
put a request into an inbox; the serve loop applies the inbox between ticks, in arrival order).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from torch import Tensor

from ..causal.session_pool import SessionPool
from .outbox import SessionOutbox


@dataclass(frozen=True)
class LiveLimits:
    max_sessions_per_client: int = 2
    max_seconds: float | None = None  # the whole live run
    max_chunks: int | None = None  # chunks of all sessions together; the run stops when reached
    idle_seconds: float | None = 300.0  # no open session for this long -> stop
    disconnect_seconds: float = 30.0  # a suspended session of a gone client is closed after this
    max_events_queued: int = 16  # per session outbox
    chunks_kept: int = 8  # per session payloads kept for GET (clip / latents)
    metrics_seconds: float = 2.0


class LiveTransport(Protocol):
    """What the host provides: whether a client is connected, and the delivery of a session's outbox."""

    def connected(self, client_id: str) -> bool: ...

    def attach(self, session_id: str, client_id: str, outbox: SessionOutbox) -> None: ...

    def detach(self, session_id: str) -> None: ...


@dataclass
class LiveReport:
    why_stopped: str
    seconds: float
    chunks: int
    sessions: list[dict] = field(default_factory=list)  # newest 64: index, seed, chunks, metrics, why closed

    def text(self) -> str:
        raise NotImplementedError


class LiveService:
    def __init__(
        self,
        pool: SessionPool,
        transport: LiveTransport,
        encode_prompt: Callable[[str], Tensor],
        limits: LiveLimits = LiveLimits(),
        tiny_vae=None,
        tags: dict | None = None,
        where: str = "FewStep Live Video",
        prompt_cache_entries: int = 32,
    ):
        raise NotImplementedError

    def open(self, body: dict) -> dict:
        raise NotImplementedError

    def control(self, session_id: str, secret: str, body: dict) -> dict:
        raise NotImplementedError

    def feed_frames(self, session_id: str, secret: str, images: list[bytes]) -> dict:
        raise NotImplementedError

    def payload(self, session_id: str, secret: str, chunk: int, kind: str) -> tuple[bytes, str]:
        raise NotImplementedError

    def close(self, session_id: str, secret: str) -> dict:
        raise NotImplementedError

    def status(self) -> dict:
        raise NotImplementedError

    def stop(self, why: str = "stopped by a client") -> None:
        raise NotImplementedError

    def serve(self, check_cancel: Callable[[], None] | None = None) -> LiveReport:
        raise NotImplementedError
