"""Causal chunk-by-chunk video: the rolling KV cache, sessions, streaming output, the no-cache reference."""

from .kv_cache import ROPE_MODES, CrossAttentionCache, KVCache, WindowSpec
from .recipe import SessionRecipe, open_session
from .session import CausalConfig, ChunkResult, VideoSession
from .store import SessionStore

__all__ = [
    "ROPE_MODES",
    "CausalConfig",
    "ChunkResult",
    "CrossAttentionCache",
    "KVCache",
    "SessionRecipe",
    "SessionStore",
    "VideoSession",
    "WindowSpec",
    "open_session",
]
