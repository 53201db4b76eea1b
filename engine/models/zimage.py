"""Z-Image (S3-DiT, Z-Image-Turbo and its fine-tunes): a single-stream DiT over 2x2 patches of a 16-channel
latent (the FLUX.1 autoencoder's space), conditioned on Qwen3 caption features (width 2560).

``ZImage.forward(x, t, cap_feats)`` has the semantics of Tongyi-MAI/Z-Image ``src/zimage/transformer.py``
(``ZImageTransformer2DModel``) for one image per batch row: ``x [B, 16, H, W]`` (the reference's
``[C, F=1, H, W]`` items), ``t [B]`` the reference's time, 0 = pure noise and 1 = clean (``1 - sigma``),
``cap_feats [B, L, 2560]`` caption features of equal length ``L`` (no padding mask: every row's tokens are all
real). It returns the reference's output ``[B, 16, H, W]``, which is ``-dx/dsigma`` (the pipeline negates it
before its Euler step); :func:`zimage_velocity` turns both conventions into the engine's.

Token layout, as in the reference: the caption is padded to a multiple of 32 tokens (``SEQ_MULTI_OF``) with the
learnt ``cap_pad_token`` and the image tokens likewise with ``x_pad_token``; padding tokens take part in the
attention. Positions (3-axis RoPE, theta 256, axes 32/48/48): caption token ``i`` is at ``(1 + i, 0, 0)``, the
image patch at row ``r``, column ``c`` at ``(L_cap_padded + 1, r, c)``, image padding at ``(0, 0, 0)``. The noise
refiner (modulated) runs on the image tokens, the context refiner (unmodulated) on the caption, then the
single-stream ``layers`` on both. The reference orders that joint sequence ``[image, caption]``; here it is
``[caption, image]`` (text first, as FLUX), which is the same computation - attention is unmasked and positions
travel with the tokens - and lets sequence parallelism shard the image tokens behind a replicated caption.

The forward is three stages, ``finish(run_blocks(embed(...)))``, as FLUX's: ``embed`` includes both refiners,
``run_blocks`` runs the single-stream ``layers`` (a step cache's unit), ``finish`` the final layer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from einops import rearrange
from torch import nn

from ..backends import DEFAULT_BACKENDS, Backends
from ..ops import Linear
from ..rope import RopeFreqs, axis_angles
from .norms import RMSNorm
from .staged import StagedHidden, StagedModel, check_head_split, replace_after_prefix
from .zimage_layers import (
    TIME_MID_SIZE,
    FinalLayer,
    TimestepEmbedder,
    ZImageTransformerBlock,
    adaln_dim,
)


@dataclass(frozen=True)
class ZImageParams:
    in_channels: int = 16
    patch_size: int = 2
    f_patch_size: int = 1
    dim: int = 3840
    n_layers: int = 30
    n_refiner_layers: int = 2
    n_heads: int = 30
    n_kv_heads: int = 30
    norm_eps: float = 1e-5
    qk_norm: bool = True
    cap_feat_dim: int = 2560
    rope_theta: float = 256.0
    t_scale: float = 1000.0
    axes_dims: tuple[int, ...] = (32, 48, 48)
    # Lengths of the reference's precomputed RoPE tables: the largest position + 1 it supports per axis.
    axes_lens: tuple[int, ...] = (1536, 512, 512)
    seq_multiple: int = 32  # SEQ_MULTI_OF: caption and image token counts are padded to a multiple of it

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def patch_key(self) -> str:
        """The key of the reference's ``all_x_embedder`` / ``all_final_layer`` ModuleDicts: ``"2-1"``."""
        return f"{self.patch_size}-{self.f_patch_size}"

    @property
    def patch_channels(self) -> int:
        return self.f_patch_size * self.patch_size * self.patch_size * self.in_channels

    @property
    def latent_channels(self) -> int:
        return self.in_channels


# Official configuration: Tongyi-MAI/Z-Image src/config/model.py (DEFAULT_TRANSFORMER_*, ROPE_*, SEQ_MULTI_OF),
# the same values as the Tongyi-MAI/Z-Image-Turbo transformer/config.json (dim 3840, 30 layers, 2 refiner
# layers, 30 heads, 30 kv heads, cap_feat_dim 2560, rope_theta 256, axes_dims [32, 48, 48], axes_lens
# [1536, 512, 512], t_scale 1000); about 6.15e9 parameters ("6B").
PRESETS: dict[str, ZImageParams] = {
    "z-image-turbo": ZImageParams(),
    # Tests: the real interface widths (Qwen3 2560, 16-channel latent, 2x2 patches) around a tiny trunk.
    "zimage-tiny": ZImageParams(
        dim=64, n_heads=2, n_kv_heads=2, n_layers=2, n_refiner_layers=1, axes_dims=(8, 12, 12)
    ),
    # Benchmarks on CPU: the Z-Image head size (128, axes 32/48/48) at a width a CPU runs in a second.
    "zimage-mid": ZImageParams(dim=1024, n_heads=8, n_kv_heads=8, n_layers=4, n_refiner_layers=1),
}


def zimage_rope(ids: torch.Tensor, axes_dims: tuple[int, ...], theta: float) -> RopeFreqs:
    """``ids [B, L, 3]`` -> rotations, as the reference computes them: angles in float64, rounded to float32,
    then cos / sin in float32 (its ``torch.polar`` on a complex64 table)."""
    if ids.shape[-1] != len(axes_dims):
        raise ValueError(f"position ids have {ids.shape[-1]} axes, RoPE is configured for {len(axes_dims)}")
    ids = ids.to(torch.float64)
    angles = torch.cat([axis_angles(ids[..., i], d, theta) for i, d in enumerate(axes_dims)], dim=-1)
    angles = angles.float().unsqueeze(2)
    return RopeFreqs(torch.cos(angles), torch.sin(angles))


def padded_length(n: int, multiple: int) -> int:
    return n + (-n) % multiple


def caption_ids(batch: int, length: int, device=None) -> torch.Tensor:
    """Positions ``[B, length, 3]`` of the (padded) caption: ``(1 + i, 0, 0)``."""
    ids = torch.zeros(length, 3, dtype=torch.int64, device=device)
    ids[:, 0] = torch.arange(1, length + 1, device=device)
    return ids[None].expand(batch, -1, -1)


def image_ids(batch: int, rows: int, cols: int, frame: int, padded: int, device=None) -> torch.Tensor:
    """Positions ``[B, padded, 3]`` of ``rows x cols`` patches at index ``frame`` (``L_cap_padded + 1``), then
    ``padded - rows * cols`` padding tokens at ``(0, 0, 0)``."""
    ids = torch.zeros(padded, 3, dtype=torch.int64, device=device)
    n = rows * cols
    ids[:n, 0] = frame
    ids[:n, 1] = torch.arange(rows, device=device).repeat_interleave(cols)
    ids[:n, 2] = torch.arange(cols, device=device).repeat(rows)
    return ids[None].expand(batch, -1, -1)


def patchify(x: torch.Tensor, patch_size: int) -> torch.Tensor:
    """``[B, C, H, W]`` -> ``[B, (H/p)(W/p), p*p*C]``: features run (row-in-patch, col-in-patch, channel), the
    reference's order (channels last, unlike FLUX.1's packing)."""
    return rearrange(x, "b c (h ph) (w pw) -> b (h w) (ph pw c)", ph=patch_size, pw=patch_size)


def unpatchify(tokens: torch.Tensor, height: int, width: int, patch_size: int) -> torch.Tensor:
    """Inverse of :func:`patchify` for a latent of ``height x width``."""
    p = patch_size
    return rearrange(
        tokens, "b (h w) (ph pw c) -> b c (h ph) (w pw)", h=height // p, w=width // p, ph=p, pw=p
    )


@dataclass
class ZImageHidden(StagedHidden):
    """The single-stream sequence ``joint [B, txt_tokens + img_padded, dim]`` (caption first) between stages."""

    joint: torch.Tensor
    vec: torch.Tensor
    freqs: RopeFreqs
    txt_tokens: int  # padded caption tokens at the front
    img_tokens: int  # real image tokens (before the image padding)
    height: int  # latent height and width, for unpatchify
    width: int

    @property
    def stream(self) -> torch.Tensor:
        """The image tokens (padding included) ``[B, img_padded, dim]``."""
        return self.joint[:, self.txt_tokens :]

    def with_stream(self, img: torch.Tensor) -> ZImageHidden:
        """The same state with other image tokens (a step cache's reused result)."""
        return dataclasses.replace(self, joint=replace_after_prefix(self.joint, self.txt_tokens, img))


class ZImage(StagedModel):
    family = "zimage"
    block_stacks = ("layers",)  # the refiners run inside embed: a step cache sees the single-stream layers

    def __init__(self, params: ZImageParams):
        super().__init__()
        check_head_split(
            params.dim, params.n_heads, params.axes_dims, width_name="dim", axes_name="axes_dims"
        )
        if params.f_patch_size != 1:
            raise ValueError("only image models (f_patch_size 1) are supported")
        self.params = params
        dim, key = params.dim, params.patch_key
        self.all_x_embedder = nn.ModuleDict({key: Linear(params.patch_channels, dim, bias=True)})
        self.all_final_layer = nn.ModuleDict({key: FinalLayer(dim, params.patch_channels)})
        block = dict(
            dim=dim,
            n_heads=params.n_heads,
            n_kv_heads=params.n_kv_heads,
            norm_eps=params.norm_eps,
            qk_norm=params.qk_norm,
        )
        self.noise_refiner = nn.ModuleList(
            ZImageTransformerBlock(**block, modulation=True) for _ in range(params.n_refiner_layers)
        )
        self.context_refiner = nn.ModuleList(
            ZImageTransformerBlock(**block, modulation=False) for _ in range(params.n_refiner_layers)
        )
        self.t_embedder = TimestepEmbedder(adaln_dim(dim), TIME_MID_SIZE, params.t_scale)
        self.cap_embedder = nn.Sequential(
            RMSNorm(params.cap_feat_dim, eps=params.norm_eps), Linear(params.cap_feat_dim, dim, bias=True)
        )
        self.x_pad_token = nn.Parameter(torch.zeros(1, dim))
        self.cap_pad_token = nn.Parameter(torch.zeros(1, dim))
        self.layers = nn.ModuleList(
            ZImageTransformerBlock(**block, modulation=True) for _ in range(params.n_layers)
        )

    def embed(
        self, x: torch.Tensor, t: torch.Tensor, cap_feats: torch.Tensor, backends: Backends = DEFAULT_BACKENDS
    ) -> ZImageHidden:
        """Inputs -> the joint sequence before ``layers[0]`` (both refiners included)."""
        p = self.params
        if x.ndim != 4 or x.shape[1] != p.in_channels:
            raise ValueError(f"x must be [batch, {p.in_channels}, height, width], got {list(x.shape)}")
        b, _, h, w = x.shape
        if h % p.patch_size or w % p.patch_size:
            raise ValueError(f"latent {h}x{w} is not a multiple of the patch size {p.patch_size}")
        if cap_feats.ndim != 3 or cap_feats.shape[0] != b or cap_feats.shape[2] != p.cap_feat_dim:
            raise ValueError(
                f"caption features must be [{b}, tokens, {p.cap_feat_dim}] (Qwen3 hidden states), "
                f"got {list(cap_feats.shape)}"
            )
        if cap_feats.shape[1] == 0:
            raise ValueError("caption features have no tokens")
        dtype, dev = x.dtype, x.device
        vec = self.t_embedder(t, dtype)

        cap_len = cap_feats.shape[1]
        txt_tokens = padded_length(cap_len, p.seq_multiple)
        cap_norm, cap_linear = self.cap_embedder
        cap = cap_linear(cap_norm(cap_feats.to(dtype), backends))
        if txt_tokens > cap_len:
            cap = torch.cat((cap, self.cap_pad_token.to(dtype).expand(b, txt_tokens - cap_len, -1)), dim=1)

        rows, cols = h // p.patch_size, w // p.patch_size
        img_tokens = rows * cols
        img_padded = padded_length(img_tokens, p.seq_multiple)
        img = self.all_x_embedder[p.patch_key](patchify(x, p.patch_size))
        if img_padded > img_tokens:
            img = torch.cat((img, self.x_pad_token.to(dtype).expand(b, img_padded - img_tokens, -1)), dim=1)

        cap_freqs = zimage_rope(caption_ids(b, txt_tokens, dev), p.axes_dims, p.rope_theta)
        img_freqs = zimage_rope(
            image_ids(b, rows, cols, txt_tokens + 1, img_padded, dev), p.axes_dims, p.rope_theta
        )
        for layer in self.noise_refiner:
            img = layer(img, img_freqs, vec, backends=backends)
        for layer in self.context_refiner:
            cap = layer(cap, cap_freqs, replicated=True, backends=backends)
        freqs = RopeFreqs(
            torch.cat((cap_freqs.cos, img_freqs.cos), dim=1), torch.cat((cap_freqs.sin, img_freqs.sin), dim=1)
        )
        return ZImageHidden(
            joint=torch.cat((cap, img), dim=1),
            vec=vec,
            freqs=freqs,
            txt_tokens=txt_tokens,
            img_tokens=img_tokens,
            height=h,
            width=w,
            backends=backends,
        )

    def run_block(self, h: ZImageHidden, index: int) -> None:
        """Single-stream layer ``index`` (the caption prefix is replicated under sequence parallelism)."""
        h.joint = self.layers[index](
            h.joint, h.freqs, h.vec, replicated_prefix=h.txt_tokens, backends=h.backends
        )

    def finish(self, h: ZImageHidden) -> torch.Tensor:
        """The final layer on the real image tokens -> the reference output ``[B, C, H, W]``."""
        img = h.stream[:, : h.img_tokens]
        out = self.all_final_layer[self.params.patch_key](img, h.vec, h.backends)
        return unpatchify(out, h.height, h.width, self.params.patch_size)

    def forward(
        self,
        x: torch.Tensor,
        t: torch.Tensor,
        cap_feats: torch.Tensor,
        block_runner=None,
        backends: Backends = DEFAULT_BACKENDS,
    ) -> torch.Tensor:
        """``block_runner(model, hidden) -> hidden``, when given, runs the single-stream stack in place of
        ``run_blocks`` (a step cache's hook); without one this is the reference forward. ``backends``: how this
        run computes attention, norms and RoPE (``engine.backends``)."""
        return self.run_stages(self.embed(x, t, cap_feats, backends), block_runner)


def random_inputs(
    params: ZImageParams, width: int, height: int, txt_tokens: int, batch: int = 1, seed: int = 0
) -> dict:
    """Keyword arguments of ``ZImage.forward`` for a ``width x height`` px image (8x VAE), seeded values."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(batch, params.in_channels, height // 8, width // 8, generator=gen),
        "t": torch.full((batch,), 0.5),
        "cap_feats": torch.randn(batch, txt_tokens, params.cap_feat_dim, generator=gen),
    }


def zimage_velocity(
    model: ZImage,
    x: torch.Tensor,
    sigma: torch.Tensor,
    cond,
    block_runner=None,
    backends: Backends = DEFAULT_BACKENDS,
) -> torch.Tensor:
    """Velocity ``dx/dsigma`` for a latent ``x [B, 16, H, W]`` (model space: the FLUX.1 AE latent after its
    shift and scale) at noise level ``sigma [B]``; ``cond.context [B, L, 2560]`` the Qwen3 caption features.

    The reference pipeline feeds ``t = (1000 - timestep) / 1000 = 1 - sigma`` and steps with ``-output``
    (``latents = step(-out)``, an Euler step of ``dx/dsigma``), so the velocity is ``-model(x, 1 - sigma)``.
    """
    t = 1.0 - sigma.to(torch.float32)
    return -model(x, t, cond.context, block_runner=block_runner, backends=backends)
