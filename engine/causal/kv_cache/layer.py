"""One layer's attention over the cache during a forward: write the chunk's keys and values into their slots,
read the whole window (full-precision slots, then the quantized ones dequantized), attend. Fixed shapes: the
slots written and the slots hidden come from the cache's per-chunk tensors, rewritten in place between chunks."""

from __future__ import annotations

import torch

from ....kernels.kv_quant import QuantizedAttentionInputs
from ...backends import DEFAULT_BACKENDS, Backends
from .quantized import QuantizedKV


class LayerView:
    """The cache as one layer's self-attention sees it during a forward: that layer's storage (K/V buffers and
    quantized parts) and references to the per-chunk tensors every layer shares (slots written, visibility,
    rotations). It holds no layer index and no cache: a block compiled once traces the ``attend`` of every layer
    with the same guards (tensors of the same shapes), so regional compilation needs no eager attend."""

    def __init__(self, cache, keys: torch.Tensor, values: torch.Tensor, quant):
        self.keys, self.values = keys, values
        self.quant: tuple[QuantizedKV, QuantizedKV] | None = quant  # None without quantized storage
        self.write_index, self.mask = cache.write_index, cache.key_mask()
        self.query_freqs, self.bits = cache.query_rope(), cache.storage.bits
        # read() only (inspection): never called in a forward
        self._slots, self._tokens_per_frame = cache.slots, cache.tokens_per_frame

    def key_mask(self) -> torch.Tensor | None:
        """As :meth:`KVCache.key_mask` for this chunk (None: the window is full, unmasked)."""
        return self.mask

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backends: Backends) -> torch.Tensor:
        """Write the chunk's ``k, v [B, C*T, H, D]`` (k unrotated) into its slots and attend to the whole
        window, computed with the run's ``backends``. Every tensor here has the same shape for every chunk: the
        slots written come from the ``write_index`` buffer, the slots hidden (empty, or out of the window) from
        ``key_visible``."""
        keys, values = self.keys, self.values
        # rotated once, here: at the chunk's absolute frame positions in both RoPE modes (see the package docstring)
        k = backends.apply_rope(k, self.query_freqs)
        keys.index_copy_(1, self.write_index, k.to(keys.dtype))
        values.index_copy_(1, self.write_index, v.to(values.dtype))
        mask = self.mask
        # the fused kernel takes no mask; it only runs once every slot is visible (the window is full)
        if self.quant is not None and mask is None and backends.uses_fused_quantized_attention(q):
            return self._fused_quantized_attention(q, backends)
        k_read, v_read = self.read_window(backends)
        return backends.attention(q, k_read.to(q.dtype), v_read, mask=mask)

    def read_window(self, backends: Backends = DEFAULT_BACKENDS) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (stored rotated: as this chunk reads them) and values of every slot, visible or not, in slot
        order: full-precision slots, then the quantized ones dequantized into transient tensors. Fixed shapes.
        Without quantized storage these are the cache's own buffers (no copy)."""
        k_read, v_read = self.keys, self.values
        if self.quant is not None:
            kq, vq = self.quant
            k_read = torch.cat((k_read, backends.dequantize_kv(*kq.parts(), self.bits, k_read.dtype)), dim=1)
            v_read = torch.cat((v_read, backends.dequantize_kv(*vq.parts(), self.bits, v_read.dtype)), dim=1)
        return k_read, v_read

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The visible slots only, in the order of ``SlotRing.read_frames`` (for inspection and tests: the forward
        reads :meth:`read_window` under the visibility mask, which needs no shape that changes)."""
        k_read, v_read = self.read_window()
        tokens = self._slots.visible_tokens(self._tokens_per_frame)
        rows = torch.tensor(tokens, dtype=torch.long, device=k_read.device)
        return k_read.index_select(1, rows), v_read.index_select(1, rows)

    def _fused_quantized_attention(self, q: torch.Tensor, backends: Backends) -> torch.Tensor:
        """As ``attention(q, *read_window())``, the quantized slots dequantized in the kernel (stored rotated:
        the kernel rotates nothing)."""
        k, v = self.keys, self.values
        kq, vq = self.quant
        inputs = QuantizedAttentionInputs(q, k.to(q.dtype), v, kq.parts(), vq.parts(), None, None, self.bits)
        return backends.quantized_attention(inputs)
