"""``Backends``: how one run computes a model's primitive operations, handed to every forward.

A model's forward takes ``backends=`` (a frozen value, default :data:`DEFAULT_BACKENDS`) and every layer calls its
attention, norms, RoPE and KV quantization through it. Which attention backend, which kernel mode and which
sequence-parallel plan are therefore per-run choices (``engine.run.open_run`` builds them from a run's options),
never a process-global or thread-local switch: two runs in one process, in two threads or one after the other,
each compute the way they were asked to, and ``torch.compile`` guards on the value it was traced with.

* ``attention_backend``: ``auto`` / ``sdpa`` / ``flash-attn`` (``engine.attention``);
* ``kernel_mode``: ``auto`` / ``reference`` / ``triton`` (``kernels.dispatch``);
* ``kernel_fallbacks``: the run's record of kernels that failed in auto mode and run as their references for the
  rest of the run (``kernels.dispatch.KernelFallbacks``; each ``open_run`` starts an empty one, so the decision is
  per run, not per process). Not a choice: equality, hashing and capture ignore it;
* ``parallel``: None, or a sequence-parallel plan (``engine.parallel.sequence.SequenceParallelPlan``) whose
  ``attention(q, k, v, mask=, replicated_prefix=, local=)`` exchanges this rank's shard of the sequence with the
  other ranks (Ulysses all-to-all, ring K/V passing) around the local attention. Callers say which tokens every
  rank holds whole: ``replicated_prefix`` leading tokens of q, k and v (FLUX's text tokens), or all of k and v
  (``replicated_kv``: Wan's cross-attention to the prompt, which needs no communication).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from .. import kernels
from ..kernels.kv_quant import QuantizedAttentionInputs
from .attention import BACKENDS, local_attention, reads_head_major
from .rope import RopeFreqs, apply_rope


@dataclass(frozen=True)
class Backends:
    attention_backend: str = "auto"
    kernel_mode: str = "auto"
    parallel: object = None
    kernel_fallbacks: kernels.KernelFallbacks = field(
        default_factory=kernels.KernelFallbacks, compare=False, repr=False
    )

    def __post_init__(self):
        if self.attention_backend not in BACKENDS:
            raise ValueError(
                f"attention backend {self.attention_backend!r}: expected one of {', '.join(BACKENDS)}"
            )
        kernels.check_mode(self.kernel_mode)

    def capture_state(self) -> tuple:
        """What a captured forward (a CUDA graph) was specialised on: the backend, the mode, and the plan (a graph
        of one plan is not replayed under another)."""
        return (
            self.attention_backend,
            self.kernel_mode,
            None if self.parallel is None else id(self.parallel),
        )

    def with_parallel(self, plan) -> Backends:
        """The same backends with attention exchanged over ``plan`` (a sharded block stack's view)."""
        return dataclasses.replace(self, parallel=plan)

    # -- attention --------------------------------------------------------------------------------------------------
    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        mask: torch.Tensor | None = None,
        replicated_prefix: int = 0,
        replicated_kv: bool = False,
    ) -> torch.Tensor:
        """Softmax attention, ``q [B, Lq, H, D]``, ``k, v [B, Lk, H, D]`` -> ``[B, Lq, H, D]``; ``mask`` boolean
        ``[Lq, Lk]`` (or broadcastable to ``[B, H, Lq, Lk]``), True = may attend. Under a parallel plan q, k, v
        are this rank's shard (see the module docstring); without one the two replication hints are ignored."""
        if self.parallel is not None and not replicated_kv:
            return self.parallel.attention(
                q, k, v, mask=mask, replicated_prefix=replicated_prefix, local=self.local_attention
            )
        return self.local_attention(q, k, v, mask=mask)

    def local_attention(self, q, k, v, *, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The single-process attention of this run's backend (what a parallel plan runs between collectives)."""
        return local_attention(q, k, v, mask=mask, backend=self.attention_backend)

    # -- kernels (kernels.dispatch in this run's mode) ---------------------------------------------------------------
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return kernels.rms_norm(x, weight, eps, mode=self.kernel_mode, fallbacks=self.kernel_fallbacks)

    def adaln_modulate(self, x, shift, scale, eps: float) -> torch.Tensor:
        """``LayerNorm(x) * (1 + scale) + shift``, fused."""
        return kernels.adaln_modulate(
            x, shift, scale, eps, mode=self.kernel_mode, fallbacks=self.kernel_fallbacks
        )

    def apply_rope(self, x: torch.Tensor, freqs: RopeFreqs, head_major: bool | None = None) -> torch.Tensor:
        """``x [B, L, H, D]`` rotated by ``freqs`` (``engine.rope.apply_rope``), laid out head-major in memory when
        ``head_major`` (None: when this run's local attention reads its inputs that way, ``engine.attention``)."""
        if head_major is None:
            head_major = self.reads_head_major(x)
        return apply_rope(x, freqs, self.kernel_mode, self.kernel_fallbacks, head_major)

    def reads_head_major(self, x: torch.Tensor) -> bool:
        """Whether this run's attention over tensors like ``x`` wants them head-major in memory: its backend's
        choice (``engine.attention.reads_head_major``) when attention runs here, not under a sequence-parallel
        plan (whose exchange makes new tensors of its own layout)."""
        return self.parallel is None and reads_head_major(self.attention_backend, x)

    def quantize_kv(self, x: torch.Tensor, bits: int):
        return kernels.quantize_kv(x, bits, mode=self.kernel_mode, fallbacks=self.kernel_fallbacks)

    def dequantize_kv(self, data, scale, zero, bits: int, dtype: torch.dtype) -> torch.Tensor:
        return kernels.dequantize_kv(
            data, scale, zero, bits, dtype, mode=self.kernel_mode, fallbacks=self.kernel_fallbacks
        )

    def uses_fused_quantized_attention(self, q: torch.Tensor) -> bool:
        return kernels.uses_fused_quantized_attention(q, self.kernel_mode, self.kernel_fallbacks)

    def quantized_attention(self, inputs: QuantizedAttentionInputs) -> torch.Tensor:
        return kernels.quantized_attention(inputs, mode=self.kernel_mode, fallbacks=self.kernel_fallbacks)


DEFAULT_BACKENDS = Backends()

__all__ = ["DEFAULT_BACKENDS", "Backends"]
