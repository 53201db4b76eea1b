"""The cross-attention cache: every layer's text keys and values of one prompt."""

from __future__ import annotations

import torch

from ...backends import Backends
from ...errors import InputError


class CrossAttentionCache:
    """Per-layer text keys/values for one prompt, computed when the prompt is set (:meth:`fill`), outside any
    denoising step: a step only reads them, so it has no host branch on what is filled. :meth:`reset` (or a new
    :meth:`fill`) when the prompt changes."""

    def __init__(self):
        self._kv: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()

    def fill(self, blocks, context: torch.Tensor, backends: Backends) -> CrossAttentionCache:
        """Every layer's keys/values of ``context`` (the embedded prompt), from each block's ``cross_attn``,
        computed with the run's ``backends``. A new prompt of the same layout (``embed_context`` pads every prompt
        to ``text_len``) is copied into the tensors already held, so a captured step (whose graph holds their
        addresses) replays with it instead of being captured again."""
        fresh = tuple(block.cross_attn.context_kv(context, backends) for block in blocks)
        same = len(fresh) == len(self._kv) and all(
            old.shape == new.shape and old.dtype == new.dtype and old.device == new.device
            for pair_old, pair_new in zip(self._kv, fresh)
            for old, new in zip(pair_old, pair_new)
        )
        if not same:
            self._kv = fresh
            return self
        for (k, v), (new_k, new_v) in zip(self._kv, fresh):
            k.copy_(new_k)
            v.copy_(new_v)
        return self

    def layer(self, index: int):
        """Layer ``index``'s keys/values (filled before the step)."""
        if index >= len(self._kv):
            raise InputError(
                "cross_kv",
                f"the cross-attention cache holds {len(self._kv)} layers, not layer {index}: fill() it with the "
                "prompt before a step (a step never fills it)",
            )
        return self._kv[index]

    def reset(self) -> None:
        self._kv = ()

    def capture_state(self) -> tuple:
        """The host state a captured step depends on, hashable: the addresses of every layer's keys/values."""
        return tuple((k.data_ptr(), v.data_ptr()) for k, v in self._kv)

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self._kv)
