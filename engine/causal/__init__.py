"""Causal chunk-by-chunk video: the rolling KV cache, sessions, a pool that batches many sessions per step, swap
and snapshots, streaming output, the no-cache reference."""

from .kv_cache import ROPE_MODES, CrossAttentionCache, KVCache, WindowSpec
from .recipe import SessionRecipe, open_session, open_session_pool
from .session import CausalConfig, ChunkResult, VideoSession
from .session_pool import PoolSession, SessionPool, TickReport
from .session_state import SessionState, capture_state, restore_state
from .snapshot import join_from_snapshot, load_snapshot, resume_session, save_pool_session, save_session
from .store import SessionStore

__all__ = [
    "ROPE_MODES",
    "CausalConfig",
    "ChunkResult",
    "CrossAttentionCache",
    "KVCache",
    "PoolSession",
    "SessionPool",
    "SessionState",
    "TickReport",
    "SessionRecipe",
    "SessionStore",
    "VideoSession",
    "WindowSpec",
    "capture_state",
    "join_from_snapshot",
    "load_snapshot",
    "open_session",
    "open_session_pool",
    "restore_state",
    "resume_session",
    "save_pool_session",
    "save_session",
]
