"""The Ulysses all-to-all: trade a shard of the sequence for a share of the heads, attend, trade back.

Each rank of a Ulysses group of ``u`` ranks holds ``q, k, v [B, T + S, H, D]``: ``T`` replicated text tokens
followed by its ``S`` tokens of the sharded sequence. One all-to-all (``SequenceMesh.sequence_to_heads``)
scatters heads and gathers the sequence, so a rank holds the group's ``u * S`` tokens for ``H / u`` heads and
attention over them is exact; the text tokens need no communication (a rank takes its ``H / u`` heads of them).
The reverse all-to-all (``heads_to_sequence``) returns the rows to their owners, and an all-gather of the text
rows over heads leaves every rank with the whole text output. Bytes a rank sends:
``(u - 1) / u x 4 x B S H D`` (q, k, v out; the output back) ``+ (u - 1) x B T (H/u) D``.

The causal KV cache does its own exchange before writing K/V (``sharding.ShardedKV``: the cache stores whole
frames of this rank's heads), with the same ``sequence_to_heads`` / ``heads_to_sequence``.
"""

from __future__ import annotations

import torch

from .mesh import SequenceMesh


def ulysses_attention(
    mesh: SequenceMesh, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, replicated_prefix: int, attend
) -> torch.Tensor:
    """Attention of this rank's shard through the Ulysses all-to-all (see the module docstring).

    ``attend(queries, seq_k, seq_v, text_k, text_v)`` runs on this rank's heads: the queries are the text
    queries then the group's whole sequence; ``text_k, text_v`` are None without a text prefix."""
    t = replicated_prefix
    tq, tk, tv = q[:, :t], k[:, :t], v[:, :t]
    sq, sk, sv = q[:, t:], k[:, t:], v[:, t:]
    if sq.shape == sk.shape:  # one all-to-all for all three
        sq, sk, sv = mesh.sequence_to_heads([sq, sk, sv])
    else:
        (sq,) = mesh.sequence_to_heads([sq])
        sk, sv = mesh.sequence_to_heads([sk, sv])
    tq, tk, tv = mesh.head_slice(tq), mesh.head_slice(tk), mesh.head_slice(tv)
    queries = torch.cat((tq, sq), dim=1) if t else sq
    out = attend(queries, sk, sv, tk if t else None, tv if t else None)
    seq_out = mesh.heads_to_sequence(out[:, t:])
    return torch.cat((mesh.gather_heads(out[:, :t]), seq_out), dim=1) if t else seq_out
