"""Sequence-parallel attention: Ulysses, ring and their product (USP), with a replicated text prefix.

Each rank holds ``q, k, v [B, T + S, H, D]``: ``T`` replicated text tokens (FLUX's joint attention; 0 for video)
followed by its ``S`` tokens of the sharded sequence. For one attention call:

* **Ulysses** (degree ``u``, ``all_to_all.py``): one all-to-all in the Ulysses group scatters heads and gathers the sequence, so
  a rank holds the group's ``u * S`` image tokens for ``H / u`` heads; the text tokens need no communication, a
  rank just takes its ``H / u`` heads of them. After attention the reverse all-to-all returns the image rows to
  their owners, and an all-gather of the text rows over heads leaves every rank with the whole text output.
  Bytes a rank sends: ``(u - 1) / u x 4 x B S H D`` (q, k, v out; the output back) ``+ (u - 1) x B T (H/u) D``.
* **Ring** (degree ``r``): the queries stay; K/V blocks of ``S`` tokens travel around the ring (``r - 1``
  hops, the next transfer overlapping the current block's attention) and the partial results are merged with
  their log-sum-exp (online softmax). The text K/V are attended once, with the rank's own block; every rank
  computes the text queries against all keys, so its text output is whole. Bytes: ``(r - 1) x 2 x B S H D``.
* **USP**: Ulysses inside a group of ``u`` consecutive ranks, then the ring over the ``r`` groups with
  ``H / u`` heads and ``u * S`` tokens per block.

Merging in float32 makes the result equal single-process attention up to the order of the sums.
"""

from __future__ import annotations

import torch

from .all_to_all import ulysses_attention
from .mesh import SequenceMesh


def attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention ``[B, L, H, D]`` and its log-sum-exp ``[B, H, L]`` (float32, natural log).
    ``key_mask``: boolean, broadcastable to ``[B, H, L, N]``, True where a key may be attended to."""
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    bias = None
    if key_mask is not None:
        bias = torch.zeros(key_mask.shape, dtype=q.dtype, device=q.device).masked_fill(
            ~key_mask, float("-inf")
        )
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qt, kt, vt, attn_mask=bias)[:2]
    elif q.is_cuda and bias is None and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(qt, kt, vt)[:2]
    elif q.is_cuda:
        if bias is not None:
            bias = bias.expand(q.shape[0], q.shape[2], q.shape[1], k.shape[1])
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(qt, kt, vt, bias, True)[:2]
        lse = lse[..., : q.shape[1]]
    else:
        scores = (qt.float() @ kt.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
        if bias is not None:
            scores = scores + bias.float()
        lse = scores.logsumexp(-1)
        out = ((scores - lse[..., None]).exp() @ vt.float()).to(q.dtype)
    return out.transpose(1, 2), lse.float()


def merge_partial(acc, acc_lse, out, lse):
    """Online softmax: combine two attention results over disjoint key sets by their log-sum-exps."""
    if acc is None:
        return out.float(), lse
    new_lse = torch.logaddexp(acc_lse, lse)
    old_w = torch.exp(acc_lse - new_lse).transpose(1, 2).unsqueeze(-1)
    new_w = torch.exp(lse - new_lse).transpose(1, 2).unsqueeze(-1)
    return acc * old_w + out.float() * new_w, new_lse


def ring_attention(mesh: SequenceMesh, q, k, v, k_prefix=None, v_prefix=None, key_mask=None) -> torch.Tensor:
    """Attention of ``q`` against the K/V blocks of every rank of the ring (plus ``k_prefix``, ``v_prefix``,
    attended once). All blocks must have one shape (the shard sizes are equal by construction). ``key_mask``
    applies to every block alike: the causal KV cache's blocks share one slot layout (each rank holds its part
    of every slot), so a slot hidden on one rank is hidden on all (no prefix with it)."""
    r = mesh.ring_degree
    buffers = [torch.stack((k, v)).contiguous(), None]
    current = buffers[0]
    acc = acc_lse = None
    for step in range(r):
        pending = None
        if step + 1 < r:  # start the next hop before computing on this block
            if buffers[1] is None:
                buffers[1] = torch.empty_like(current)
            receive = buffers[1] if current is buffers[0] else buffers[0]
            pending = mesh.ring_exchange(current, receive)
        kb, vb = current[0], current[1]
        if step == 0 and k_prefix is not None:
            kb, vb = torch.cat((k_prefix, kb), dim=1), torch.cat((v_prefix, vb), dim=1)
        acc, acc_lse = merge_partial(acc, acc_lse, *attention_with_lse(q, kb, vb, key_mask))
        if pending is not None:
            for request in pending:
                request.wait()
            current = receive
    return acc.to(q.dtype)


def sequence_parallel_attention(
    mesh: SequenceMesh,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    replicated_prefix: int,
    local,
    ulysses: bool = True,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """USP attention on this rank's shard (see the module docstring); ``ulysses=False`` skips the all-to-all
    (a caller that already exchanged heads for sequence, like the causal KV cache)."""
    u = mesh.ulysses_degree if ulysses else 1
    r = mesh.ring_degree
    if u == 1 and r == 1:
        return local(q, k, v) if key_mask is None else local(q, k, v, mask=key_mask)

    def attend(queries, sk, sv, tk, tv):
        if r > 1:
            return ring_attention(mesh, queries, sk, sv, tk, tv, key_mask)
        if tk is None:
            return local(queries, sk, sv) if key_mask is None else local(queries, sk, sv, mask=key_mask)
        return local(queries, torch.cat((tk, sk), dim=1), torch.cat((tv, sv), dim=1))

    if u > 1:
        return ulysses_attention(mesh, q, k, v, replicated_prefix, attend)
    t = replicated_prefix
    return attend(q, k[:, t:], v[:, t:], k[:, :t] if t else None, v[:, :t] if t else None)


class SequenceParallelPlan:
    """What ``Backends(parallel=...)`` holds (``engine.backends``): attention over the mesh's sharded sequence."""

    def __init__(self, mesh: SequenceMesh, ulysses: bool = True):
        self.mesh, self.ulysses = mesh, ulysses

    def attention(self, q, k, v, *, mask=None, replicated_prefix: int = 0, local):
        if mask is not None and (self.ulysses or replicated_prefix):
            raise ValueError(
                "masked attention over a sharded sequence is supported only as the causal KV cache uses it (after "
                "its own Ulysses exchange, a key mask every ring block shares); the engine's other models run "
                "unmasked attention"
            )
        return sequence_parallel_attention(
            self.mesh,
            q,
            k,
            v,
            replicated_prefix=replicated_prefix,
            local=local,
            ulysses=self.ulysses,
            key_mask=mask,
        )

    def ring_only(self) -> SequenceParallelPlan | None:
        """The plan for callers that did the Ulysses exchange themselves (None when no ring is left)."""
        return SequenceParallelPlan(self.mesh, ulysses=False) if self.mesh.ring_degree > 1 else None
