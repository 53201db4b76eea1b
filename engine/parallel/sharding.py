"""Running a plain model on a shard of its tokens: block runners that shard the residual stream and gather it.

The models know nothing of parallelism. Their forward is ``finish(run_blocks(embed(...)))`` and takes a
``block_runner`` hook; the runners here take the embedded stream (every rank embeds the whole, identical input),
keep this rank's image / video tokens and their RoPE rotations, run the blocks with attention going through the
mesh (the hidden state's ``backends`` with the plan: ``Backends.with_parallel``), then all-gather the stream so the head runs on every token
and every rank returns the same velocity. The sampler loop around the forward is therefore replicated exactly.

* FLUX.1 and FLUX.2: the image tokens are split into ``world`` contiguous parts; the text stream stays whole
  on every rank and the blocks tell attention that the first ``len(txt)`` tokens are replicated.
* Z-Image: the joint sequence is ``[caption, image]``, each padded to a multiple of 32 tokens by the model; the
  padded image tokens are split into ``world`` contiguous parts behind the replicated caption (the layers tell
  attention that the first ``txt_tokens`` are replicated). Both refiners run in ``embed``, before the block
  runner, on every rank whole: the context refiner is caption-only, and the noise refiner (2 of Z-Image-Turbo's
  32 image-token layers) is inside the model's embed stage, which a block runner does not reach.
* Wan: each latent frame's tokens are split into ``world`` parts (so per-frame modulation applies to a shard
  as it is); cross-attention reads the whole prompt locally.
* Causal Wan (:class:`CausalSharding`, a rank's ``RunOptions(sharding=...)`` for its video session): each
  rank's KV cache holds its ring part of every frame's tokens for its ``heads / ulysses`` heads. The cache view
  does the Ulysses exchange before writing the chunk's K/V (so the cache stores whole frames of the ring part,
  frame by frame, as it expects), attends through the ring, and exchanges back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from ..models.registry import FAMILIES
from ..models.zimage import padded_length
from ..rope import RopeFreqs
from .mesh import SequenceMesh, shard
from .sequence import SequenceParallelPlan


def shard_freqs(freqs: RopeFreqs, index: int, parts: int, prefix: int = 0, frames: int = 1) -> RopeFreqs:
    """The rotations of this rank's tokens: the first ``prefix`` (replicated) whole, then part ``index``."""
    if parts == 1:
        return freqs

    def one(t: torch.Tensor) -> torch.Tensor:
        rest = shard(t[:, prefix:], index, parts, dim=1, frames=frames)
        return torch.cat((t[:, :prefix], rest), dim=1) if prefix else rest

    return RopeFreqs(one(freqs.cos), one(freqs.sin))


def flux_block_runner(mesh: SequenceMesh, inner=None):
    """``block_runner`` for :meth:`Flux.forward` that runs the blocks on this rank's image tokens."""

    def run(model, h):
        if h.joint is not None:
            raise ValueError("the sharded block runner starts from the double-stream blocks")
        txt_tokens = h.txt.shape[1]
        local = dataclasses.replace(
            h,
            img=mesh.shard(h.img, dim=1),
            freqs=shard_freqs(h.freqs, mesh.rank, mesh.world, prefix=txt_tokens),
            backends=h.backends.with_parallel(SequenceParallelPlan(mesh)),
        )
        out = model.run_blocks(local) if inner is None else inner(model, local)
        return dataclasses.replace(
            out, img=mesh.gather(out.stream, dim=1), joint=None, freqs=h.freqs, backends=h.backends
        )

    return run


def zimage_block_runner(mesh: SequenceMesh, inner=None):
    """``block_runner`` for :meth:`ZImage.forward` that runs the layers on this rank's padded image tokens."""

    def run(model, h):
        prefix = h.txt_tokens
        local = dataclasses.replace(
            h,
            joint=torch.cat((h.joint[:, :prefix], mesh.shard(h.stream, dim=1)), dim=1),
            freqs=shard_freqs(h.freqs, mesh.rank, mesh.world, prefix=prefix),
            backends=h.backends.with_parallel(SequenceParallelPlan(mesh)),
        )
        out = model.run_blocks(local) if inner is None else inner(model, local)
        joint = torch.cat((out.joint[:, :prefix], mesh.gather(out.stream, dim=1)), dim=1)
        return dataclasses.replace(out, joint=joint, freqs=h.freqs, backends=h.backends)

    return run


def wan_block_runner(mesh: SequenceMesh, inner=None):
    """``block_runner`` for :meth:`Wan.forward` on this rank's part of every frame's tokens; a causal KV cache
    in the stream is wrapped in :class:`ShardedKV` (the session built it with :class:`CausalSharding`)."""

    def run(model, h):
        frames = h.grid[0]
        if h.kv is not None:
            kv = ShardedKV(h.kv, mesh, frames)
            freqs = kv.query_rope()
        else:
            kv, freqs = None, shard_freqs(h.freqs, mesh.rank, mesh.world, frames=frames)
        plan = SequenceParallelPlan(mesh)
        local = dataclasses.replace(
            h, tokens=mesh.shard(h.tokens, dim=1, frames=frames), freqs=freqs, kv=kv,
            backends=h.backends.with_parallel(plan),
        )  # fmt: skip
        out = model.run_blocks(local) if inner is None else inner(model, local)
        tokens = mesh.gather(out.tokens, dim=1, frames=frames)
        return dataclasses.replace(out, tokens=tokens, freqs=h.freqs, kv=h.kv, backends=h.backends)

    return run


class ShardedKV:
    """A causal KV cache as the sharded blocks see it: Ulysses exchange around the per-rank cache."""

    def __init__(self, cache, mesh: SequenceMesh, frames: int):
        self.cache, self.mesh, self.frames = cache, mesh, frames

    def query_rope(self) -> RopeFreqs:
        # the cache's rotations cover its ring part of each frame; this rank's queries are a Ulysses part of it
        m = self.mesh
        return shard_freqs(self.cache.query_rope(), m.ulysses_index, m.ulysses_degree, frames=self.frames)

    def layer(self, index: int) -> _ShardedLayer:
        return _ShardedLayer(self, index)


class _ShardedLayer:
    def __init__(self, kv: ShardedKV, index: int):
        self.kv, self.index = kv, index

    def attend(self, q, k, v, backends):
        """``q, k, v [B, F * T / world, H, D]`` (q rotated, k not) -> attention output of the same shape:
        the Ulysses exchange here, the ring part of the plan inside the per-rank cache's attention."""
        mesh, frames = self.kv.mesh, self.kv.frames
        q, k, v = mesh.sequence_to_heads([q, k, v], frames=frames)  # [B, F * T / ring, H / ulysses, D]
        ring = backends.with_parallel(SequenceParallelPlan(mesh).ring_only())
        out = self.kv.cache.layer(self.index).attend(q, k, v, ring)
        return mesh.heads_to_sequence(out, frames=frames)


class CausalSharding:
    """A rank's video-session sharding (``RunOptions.sharding``): the per-rank cache layout and the sharded block
    runner."""

    def __init__(self, mesh: SequenceMesh):
        self.mesh = mesh

    def kv_layout(self, tokens_per_frame: int, heads: int) -> tuple[int, int]:
        """(tokens per frame, heads) this rank's cache holds: its ring part, its Ulysses heads."""
        m = self.mesh
        return tokens_per_frame // m.ring_degree, heads // m.ulysses_degree

    def frame_rope(self, rope_fn):
        """``rope_fn(frame_positions, grid_hw)`` restricted to this rank's ring part of every frame."""
        m = self.mesh

        def rope(positions, grid_hw):
            freqs = rope_fn(positions, grid_hw)
            return shard_freqs(freqs, m.ring_index, m.ring_degree, frames=positions.shape[0])

        return rope

    def block_runner(self, inner=None):
        return wan_block_runner(self.mesh, inner)


@dataclasses.dataclass(frozen=True)
class ImageSharding:
    """How an image family is sharded: its block runner, its attention heads (what the Ulysses degree must
    divide) and the tokens its runner splits over every rank for a ``latent_h x latent_w`` LATENT."""

    block_runner: Callable
    heads: Callable[[object], int]
    sharded_tokens: Callable[[object, int, int], int]
    # how the sharded tokens are described in an error message
    tokens_described: str


def _image_tokens(family: str):
    def tokens(params, latent_h: int, latent_w: int) -> int:
        return FAMILIES[family].image.image_tokens(latent_h, latent_w)

    return tokens


def _zimage_padded_tokens(params, latent_h: int, latent_w: int) -> int:
    """The image tokens Z-Image's layers see: the real ones, padded to a multiple of ``seq_multiple`` (32)."""
    return padded_length(FAMILIES["zimage"].image.image_tokens(latent_h, latent_w), params.seq_multiple)


IMAGE_SHARDING: dict[str, ImageSharding] = {
    "flux": ImageSharding(
        flux_block_runner, lambda p: p.num_heads, _image_tokens("flux"), "image tokens (16x16 px each)"
    ),
    "flux2": ImageSharding(
        flux_block_runner, lambda p: p.num_heads, _image_tokens("flux2"), "image tokens (16x16 px each)"
    ),
    "zimage": ImageSharding(
        zimage_block_runner,
        lambda p: p.n_heads,
        _zimage_padded_tokens,
        "image tokens (16x16 px each, padded by Z-Image to a multiple of 32)",
    ),
}


def image_sharding(family: str) -> ImageSharding:
    if family not in IMAGE_SHARDING:
        raise ValueError(f"no sequence-parallel sharding for {family} image models")
    return IMAGE_SHARDING[family]


class ImageSequenceSharding:
    """What ``RunOptions(sharding=...)`` takes for image sampling in a worker: the family's block runner on
    ``mesh`` (this rank's image tokens, attention over the mesh) around the run's own runner (a step cache's)."""

    def __init__(self, family: str, mesh: SequenceMesh):
        self.runner, self.mesh = image_sharding(family).block_runner, mesh

    def block_runner(self, inner=None):
        return self.runner(self.mesh, inner)
