"""Live video sessions served to clients while they steer them (issue 33): the engine side.

``LiveService`` hosts a :class:`~engine.causal.session_pool.SessionPool` for live clients; ``protocol`` holds the
routes, events and body validation the ComfyUI adapter (``nodes/live_routes.py``) and the CLI client share.
"""

from .metrics import RealtimeMetrics
from .outbox import OutboxFullError, SessionOutbox
from .protocol import PROTOCOL, ControlRequest, LiveError, OpenRequest
from .service import LiveLimits, LiveReport, LiveService, LiveTransport

__all__ = [
    "PROTOCOL",
    "ControlRequest",
    "LiveError",
    "LiveLimits",
    "LiveReport",
    "LiveService",
    "LiveTransport",
    "OpenRequest",
    "OutboxFullError",
    "RealtimeMetrics",
    "SessionOutbox",
]
