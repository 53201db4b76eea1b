"""The re-cache forward's view of a :class:`~.cache.KVCache` (LongLive's ``_recache_after_switch``).

After a prompt switch, the keys and values of the frames still in the window were computed under the old prompt.
A re-cache recomputes them from the frames' clean latents under the new prompt: one forward over those frames at
the clean-context timestep, whose every layer writes its new K/V into the slots the frames already hold (full
precision, or quantized again in the int8 / int4 ring). LongLive v1.0 (NVlabs/LongLive,
``pipeline/interactive_causal_inference.py`` with ``global_sink: true``, its inference configs) defines what that
forward sees, and this view does the same:

* **Which frames.** Every frame the cache holds (the sinks and the ring, at most ``window_frames``) while the
  stream is no longer than the window; after that the ring's frames only, and the sinks keep the K/V they were
  committed with (LongLive's global sink: its re-cache then protects the sink slots). LongLive also runs the
  queries of the ``sink_frames`` frames just before the ring through the forward; their keys are neither kept nor
  read, so nothing depends on them and they are not computed here.
* **Attention.** Every recomputed frame's queries see all recomputed frames and the kept sinks, with no causal
  mask among them (LongLive's re-cache attends to its whole cache).
* **RoPE.** Queries and recomputed keys at their absolute frame index (the cache's convention for every non-sink
  key, both modes); kept sinks as stored, which is where the last chunk read them (under ``rope="cache"`` their
  offset for the last chunk is the re-cache's: the ring's oldest frame sits right after the sinks).

What the engine calls it: ``engine.causal.prompt_switch``. Equal to LongLive's own pipeline run unchanged, within
1e-5 (``tests/engine/causal/test_recache_longlive.py``, with ``FEWSTEP_LONGLIVE_DIR``).
"""

from __future__ import annotations

import torch

from ...backends import Backends
from ...rope import RopeFreqs


class RecacheView:
    """The ``kv`` of one re-cache forward over ``frames`` (a ``range`` of absolute frame indices, consecutive) of
    ``cache``; ``rope_fn`` and ``grid_hw`` as for :meth:`KVCache.begin`."""

    def __init__(self, cache, frames: range, grid_hw: tuple[int, int], rope_fn):
        self.cache, self.frames = cache, frames
        held = {frame: (kind, slot) for frame, kind, slot in cache.slots.held()}
        missing = [f for f in frames if f not in held]
        if missing:
            raise ValueError(f"re-cache of frames the cache does not hold: {missing}")
        self.places = [held[f] for f in frames]
        s = cache.storage.window.sink_frames
        # the sinks the forward reads as stored (not recomputed): LongLive's global sink
        self.kept_sinks = s if frames.start > 0 else 0
        device = cache.key_visible.device
        self.freqs: RopeFreqs = rope_fn(torch.tensor(list(frames), device=device), grid_hw)

    def query_rope(self) -> RopeFreqs:
        return self.freqs

    def layer(self, index: int) -> _RecacheLayer:
        return _RecacheLayer(self, index)


class _RecacheLayer:
    def __init__(self, view: RecacheView, index: int):
        self.view, self.index = view, index

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backends: Backends) -> torch.Tensor:
        view, cache = self.view, self.view.cache
        keys, values = cache._layer_kv(self.index)
        k = backends.apply_rope(k, view.freqs)
        k_all, v_all = k, v
        if view.kept_sinks:
            rows = view.kept_sinks * cache.tokens_per_frame
            k_all = torch.cat((keys[:, :rows].to(k.dtype), k), dim=1)
            v_all = torch.cat((values[:, :rows].to(v.dtype), v), dim=1)
        out = backends.attention(q, k_all.to(q.dtype), v_all)
        self._write(k, v, keys, values, backends)
        return out

    def _write(self, k, v, keys, values, backends: Backends) -> None:
        """Each recomputed frame's K/V into the slot it holds (quantized again in the quantized ring)."""
        cache, t = self.view.cache, self.view.cache.tokens_per_frame
        quant = cache._layer_quant(self.index) if cache.slots.quant_ring else None
        for i, (kind, slot) in enumerate(self.view.places):
            src = slice(i * t, (i + 1) * t)
            dst = slice(slot * t, (slot + 1) * t)
            if kind == "full":
                keys[:, dst].copy_(k[:, src])
                values[:, dst].copy_(v[:, src])
                continue
            for new, quantized in zip((k, v), quant):
                parts = backends.quantize_kv(new[:, src].to(keys.dtype), cache.storage.bits)
                for buffer, part in zip(quantized.parts(), parts):
                    buffer[:, dst].copy_(part)


def recache_frames(cache, pending_frames: int = 0) -> range:
    """The frames a re-cache recomputes at this point of the stream (see the module docstring): every frame held
    while the stream is within the window, then the ring's frames (the sinks are kept). ``pending_frames``: a
    chunk to be committed first (a switch commits it under the old prompt before re-caching)."""
    window = cache.storage.window
    end = cache.frames_committed + pending_frames
    if end <= window.window_frames:
        return range(0, end)
    return range(end - window.ring_frames, end)
