"""A rank's place in the ``ulysses x ring`` grid, its process groups, and the collectives that move tokens.

Global rank ``g = ring_index * ulysses + ulysses_index``: the Ulysses groups are runs of consecutive ranks and
the ring groups take every ``ulysses``-th rank. A sequence of ``N`` sharded tokens is split into ``world``
contiguous parts and rank ``g`` holds part ``g``, so after the all-to-all of its Ulysses group a rank holds the
contiguous ``N / ring`` tokens of its ring index. Video tokens are sharded *within each latent frame* (part ``g``
of every frame's tokens), so the per-frame modulation of the Wan blocks applies to a shard unchanged; the
``frames`` argument of the helpers below keeps that layout.

Every collective counts the bytes this rank sends (``CommStats``), which the benchmark compares with the formula.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class CommStats:
    """Bytes this rank sent, and calls, per kind of collective."""

    bytes_sent: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def add(self, kind: str, nbytes: int) -> None:
        self.bytes_sent[kind] += int(nbytes)
        self.calls[kind] += 1

    @property
    def total(self) -> int:
        return sum(self.bytes_sent.values())

    def snapshot(self) -> dict:
        return {"bytes_sent": dict(self.bytes_sent), "calls": dict(self.calls), "total": self.total}

    def reset(self) -> None:
        self.bytes_sent.clear()
        self.calls.clear()


def split_parts(x: torch.Tensor, dim: int, frames: int, parts: int) -> torch.Tensor:
    """``x`` with ``dim`` (``frames`` equal blocks of tokens) viewed as ``[..., frames, parts, L, ...]``."""
    shape = list(x.shape)
    n = shape[dim]
    if n % (frames * parts):
        raise ValueError(f"{n} tokens do not split into {frames} frame(s) x {parts} parts")
    return x.reshape(*shape[:dim], frames, parts, n // (frames * parts), *shape[dim + 1 :])


def shard(x: torch.Tensor, index: int, parts: int, dim: int = 1, frames: int = 1) -> torch.Tensor:
    """Part ``index`` of ``parts`` of every frame's tokens along ``dim`` (contiguous when ``frames == 1``)."""
    if parts == 1:
        return x
    y = split_parts(x, dim, frames, parts).select(dim + 1, index)
    return y.reshape(*x.shape[:dim], -1, *x.shape[dim + 1 :]).contiguous()


class SequenceMesh:
    """Process groups and token collectives of one rank (built collectively by every rank of the world)."""

    def __init__(self, ulysses: int, ring: int, rank: int, groups: dict, device: torch.device):
        self.ulysses_degree, self.ring_degree = ulysses, ring
        self.world, self.rank = ulysses * ring, rank
        self.ulysses_index, self.ring_index = rank % ulysses, rank // ulysses
        self.ulysses_ranks = [self.ring_index * ulysses + j for j in range(ulysses)]
        self.ring_ranks = [i * ulysses + self.ulysses_index for i in range(ring)]
        self.ulysses_group = groups.get("ulysses")
        self.ring_group = groups.get("ring")
        self.device = device
        self.stats = CommStats()

    @classmethod
    def build(cls, ulysses: int, ring: int, device: torch.device) -> SequenceMesh:
        """Collective: every rank of the default group calls this with the same degrees."""
        world, rank = dist.get_world_size(), dist.get_rank()
        if ulysses * ring != world:
            raise ValueError(f"ulysses {ulysses} x ring {ring} != world size {world}")
        groups = {}
        # every rank creates every group, in the same order (new_group is collective over the world)
        for i in range(ring):
            ranks = [i * ulysses + j for j in range(ulysses)]
            group = dist.new_group(ranks) if ulysses > 1 else None
            if rank in ranks:
                groups["ulysses"] = group
        for j in range(ulysses):
            ranks = [i * ulysses + j for i in range(ring)]
            group = dist.new_group(ranks) if ring > 1 else None
            if rank in ranks:
                groups["ring"] = group
        return cls(ulysses, ring, rank, groups, device)

    def describe(self) -> str:
        return (
            f"rank {self.rank} of {self.world}: ulysses {self.ulysses_index}/{self.ulysses_degree}, "
            f"ring {self.ring_index}/{self.ring_degree}"
        )

    # -- the residual stream: this rank's tokens and back ----------------------------------------------------------
    def shard(self, x: torch.Tensor, dim: int = 1, frames: int = 1) -> torch.Tensor:
        return shard(x, self.rank, self.world, dim, frames)

    def gather(self, x: torch.Tensor, dim: int = 1, frames: int = 1) -> torch.Tensor:
        """Inverse of :meth:`shard`: every rank's part, in rank order, on every rank."""
        if self.world == 1:
            return x
        pieces = self._all_gather(x, None, self.world, "gather_stream")
        per_rank = [split_parts(p, dim, frames, 1) for p in pieces]  # [..., frames, 1, L, ...]
        whole = torch.cat(per_rank, dim=dim + 1)
        return whole.reshape(*x.shape[:dim], -1, *x.shape[dim + 1 :])

    # -- Ulysses ---------------------------------------------------------------------------------------------------
    def sequence_to_heads(self, xs: list[torch.Tensor], frames: int = 1) -> list[torch.Tensor]:
        """``[B, S, H, D]`` shards -> ``[B, ulysses * S, H / ulysses, D]``: the Ulysses group's whole sequence
        (frame by frame), this rank's heads. Tensors of one shape travel in one all-to-all."""
        u = self.ulysses_degree
        if u == 1:
            return list(xs)
        x = torch.stack(xs)  # [n, B, S, H, D]
        n, b, s, h, d = x.shape
        send = x.reshape(n, b, s, u, h // u, d).permute(3, 0, 1, 2, 4, 5).contiguous()  # [u, n, B, S, H/u, D]
        recv = self._all_to_all(send)  # recv[j]: rank j's tokens, this rank's heads
        out = recv.reshape(u, n, b, frames, s // frames, h // u, d).permute(1, 2, 3, 0, 4, 5, 6)
        return list(out.reshape(n, b, u * s, h // u, d).unbind(0))

    def heads_to_sequence(self, x: torch.Tensor, frames: int = 1) -> torch.Tensor:
        """Inverse of :meth:`sequence_to_heads` for one tensor: ``[B, u*S, H/u, D]`` -> ``[B, S, H, D]``."""
        u = self.ulysses_degree
        if u == 1:
            return x
        b, us, hu, d = x.shape
        s = us // u
        send = x.reshape(b, frames, u, s // frames, hu, d).permute(2, 0, 1, 3, 4, 5).contiguous()
        recv = self._all_to_all(send)  # recv[j]: this rank's tokens, head group j
        return recv.permute(1, 2, 3, 0, 4, 5).reshape(b, s, u * hu, d)

    def head_slice(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's heads of a replicated ``[B, L, H, D]`` (no communication)."""
        u = self.ulysses_degree
        if u == 1:
            return x
        per = x.shape[2] // u
        return x[:, :, self.ulysses_index * per : (self.ulysses_index + 1) * per]

    def gather_heads(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, L, H/u, D]`` (this rank's heads) -> ``[B, L, H, D]`` on every rank of the Ulysses group."""
        if self.ulysses_degree == 1:
            return x
        return torch.cat(self._all_gather(x, self.ulysses_group, self.ulysses_degree, "gather_heads"), dim=2)

    # -- ring ------------------------------------------------------------------------------------------------------
    def ring_exchange(self, send: torch.Tensor, recv: torch.Tensor) -> list:
        """Start sending ``send`` to the next rank of the ring and receiving the previous rank's into ``recv``."""
        i, r = self.ring_index, self.ring_degree
        ops = [
            dist.P2POp(dist.isend, send, self.ring_ranks[(i + 1) % r], self.ring_group),
            dist.P2POp(dist.irecv, recv, self.ring_ranks[(i - 1) % r], self.ring_group),
        ]
        self.stats.add("ring", send.numel() * send.element_size())
        return dist.batch_isend_irecv(ops)

    # -- whole world -----------------------------------------------------------------------------------------------
    def agree(self, flag: bool) -> bool:
        return agree(flag, self.device, self.stats)

    # -- primitives ------------------------------------------------------------------------------------------------
    def _all_to_all(self, send: torch.Tensor) -> torch.Tensor:
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.ulysses_group)
        u = self.ulysses_degree
        self.stats.add("all_to_all", send.numel() * send.element_size() * (u - 1) // u)
        return recv

    def _all_gather(self, x: torch.Tensor, group, size: int, kind: str) -> list[torch.Tensor]:
        x = x.contiguous()
        pieces = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(pieces, x, group=group)
        self.stats.add(kind, x.numel() * x.element_size() * (size - 1))
        return pieces


def agree(flag: bool, device: torch.device, stats: CommStats | None = None) -> bool:
    """True on every rank when it is True on any rank (one small all-reduce over the world)."""
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if stats is not None:
        stats.add("all_reduce", t.element_size())
    return bool(t.item())
