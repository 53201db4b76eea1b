"""FLUX.1 (dev, schnell and their fine-tunes): a rectified-flow MMDiT over 2x2 patches of a 16-channel latent.

``Flux.forward(img, img_ids, txt, txt_ids, timesteps, y, guidance=None)`` has the semantics of the
black-forest-labs reference: ``img [B, L_img, 64]`` packed latent patches, ``txt [B, L_txt, 4096]`` T5 tokens,
``y [B, 768]`` pooled CLIP vector, ``timesteps [B]`` flow time in [0, 1], ``guidance [B]`` distilled guidance
(models with a guidance embedding only). It returns the velocity ``[B, L_img, 64]``; text tokens come first
in the joint attention.

The forward is three stages, ``finish(run_blocks(embed(...)))`` on a :class:`FluxHidden` state, so code outside
the model (a step cache) can run part of the block stack and decide about the rest; the model imports none of it.
``backends=`` (``engine.backends``) is how this run computes attention, norms and RoPE; the hidden state carries it
to every block.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from einops import rearrange
from torch import nn

from ..backends import DEFAULT_BACKENDS, Backends
from ..ops import Linear
from ..rope import rope_freqs
from .flux_layers import DoubleStreamBlock, LastLayer, MLPEmbedder, SingleStreamBlock, timestep_embedding
from .staged import StagedHidden, StagedModel, check_head_split, replace_after_prefix


@dataclass(frozen=True)
class FluxParams:
    in_channels: int = 64
    out_channels: int = 64
    vec_in_dim: int = 768
    context_in_dim: int = 4096
    hidden_size: int = 3072
    mlp_ratio: float = 4.0
    num_heads: int = 24
    depth: int = 19
    depth_single_blocks: int = 38
    axes_dim: tuple[int, ...] = (16, 56, 56)
    theta: int = 10_000
    qkv_bias: bool = True
    guidance_embed: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def latent_channels(self) -> int:
        """Channels of the (unpacked) latent the model denoises: 64 packed = 16 x 2 x 2."""
        return self.out_channels // 4


# Official configurations (black-forest-labs/flux, src/flux/util.py) plus small ones of the same architecture.
PRESETS: dict[str, FluxParams] = {
    "flux.1-dev": FluxParams(guidance_embed=True),
    "flux.1-schnell": FluxParams(guidance_embed=False),
    # Tests: the real interface widths (T5 4096, CLIP 768, 16-channel latent) around a tiny trunk.
    "flux-tiny": FluxParams(
        hidden_size=64, num_heads=2, depth=2, depth_single_blocks=2, axes_dim=(4, 14, 14)
    ),
    "flux-tiny-guidance": FluxParams(
        hidden_size=64, num_heads=2, depth=2, depth_single_blocks=2, axes_dim=(4, 14, 14), guidance_embed=True
    ),
    # Benchmarks on CPU: FLUX head size (128) and block mix at a width a CPU runs in a second.
    "flux-mid": FluxParams(hidden_size=1024, num_heads=8, depth=2, depth_single_blocks=4),
}


def default_axes_dim(head_dim: int) -> tuple[int, ...] | None:
    """The FLUX split of a head between (index, row, column): 1/8 then halves; 128 -> (16, 56, 56)."""
    first = head_dim // 8
    rest = (head_dim - first) // 2
    axes = (first, rest, rest)
    if sum(axes) != head_dim or any(a % 2 for a in axes) or first == 0:
        return None
    return axes


class Flux(StagedModel):
    family = "flux"
    block_stacks = ("double_blocks", "single_blocks")  # double-stream blocks, then single-stream ones

    def __init__(self, params: FluxParams):
        super().__init__()
        check_head_split(params.hidden_size, params.num_heads, params.axes_dim)
        self.params = params
        hidden = params.hidden_size
        self.img_in = Linear(params.in_channels, hidden, bias=True)
        self.time_in = MLPEmbedder(256, hidden)
        self.vector_in = MLPEmbedder(params.vec_in_dim, hidden)
        self.guidance_in = MLPEmbedder(256, hidden) if params.guidance_embed else nn.Identity()
        self.txt_in = Linear(params.context_in_dim, hidden)
        self.double_blocks = nn.ModuleList(
            DoubleStreamBlock(hidden, params.num_heads, params.mlp_ratio, params.qkv_bias)
            for _ in range(params.depth)
        )
        self.single_blocks = nn.ModuleList(
            SingleStreamBlock(hidden, params.num_heads, params.mlp_ratio)
            for _ in range(params.depth_single_blocks)
        )
        self.final_layer = LastLayer(hidden, 1, params.out_channels)

    # -- stages (engine.models.staged): a step cache runs block 0, decides, then either runs the remaining blocks
    # or reuses a residual it kept (engine.step_cache), without the model knowing about it ------------------------
    def embed(
        self,
        img: torch.Tensor,
        img_ids: torch.Tensor,
        txt: torch.Tensor,
        txt_ids: torch.Tensor,
        timesteps: torch.Tensor,
        y: torch.Tensor,
        guidance: torch.Tensor | None = None,
        backends: Backends = DEFAULT_BACKENDS,
    ) -> FluxHidden:
        """Inputs -> the residual stream before block 0 (token embeddings, conditioning vector, rotations)."""
        if img.ndim != 3 or txt.ndim != 3:
            raise ValueError("img and txt must be [batch, tokens, channels]")
        dtype = img.dtype
        img = self.img_in(img)
        vec = time_guidance_vector(self, timesteps, guidance, dtype, "FLUX")
        vec = vec + self.vector_in(y.to(dtype))
        txt = self.txt_in(txt.to(dtype))
        freqs = rope_freqs(torch.cat((txt_ids, img_ids), dim=1), self.params.axes_dim, self.params.theta)
        return FluxHidden(img=img, txt=txt, vec=vec, freqs=freqs, backends=backends)

    def run_block(self, h: FluxHidden, index: int) -> None:
        run_stream_block(self, h, index)

    def finish(self, h: FluxHidden) -> torch.Tensor:
        """The final layer on the image tokens: velocity ``[B, L_img, out_channels]``."""
        return self.final_layer(h.stream, h.vec, h.backends)

    def forward(
        self,
        img: torch.Tensor,
        img_ids: torch.Tensor,
        txt: torch.Tensor,
        txt_ids: torch.Tensor,
        timesteps: torch.Tensor,
        y: torch.Tensor,
        guidance: torch.Tensor | None = None,
        block_runner=None,
        backends: Backends = DEFAULT_BACKENDS,
    ) -> torch.Tensor:
        """``block_runner(model, hidden) -> hidden``, when given, runs the block stack in place of
        ``run_blocks`` (a step cache's hook); without one this is the reference forward."""
        return self.run_stages(
            self.embed(img, img_ids, txt, txt_ids, timesteps, y, guidance, backends), block_runner
        )


@dataclass
class FluxHidden(StagedHidden):
    """The residual stream between two stages of one forward.

    ``img``/``txt`` are the two streams of the double-stream phase; once a single-stream block ran, ``joint``
    holds ``[txt, img]`` and ``img``/``txt`` keep their values from before the single-stream blocks.
    """

    img: torch.Tensor
    txt: torch.Tensor
    vec: torch.Tensor
    freqs: object
    joint: torch.Tensor | None = None

    @property
    def double_mod(self) -> tuple:
        """What a double-stream block reads besides the streams and RoPE (FLUX.1: the conditioning vector)."""
        return (self.vec,)

    @property
    def single_mod(self):
        return self.vec

    @property
    def stream(self) -> torch.Tensor:
        """The image tokens ``[B, L_img, C]`` (what the final layer reads)."""
        return self.img if self.joint is None else self.joint[:, self.txt.shape[1] :]

    def with_stream(self, img: torch.Tensor) -> FluxHidden:
        """The same state with other image tokens (a step cache's reused result)."""
        if self.joint is None:
            return dataclasses.replace(self, img=img)
        return dataclasses.replace(self, joint=replace_after_prefix(self.joint, self.txt.shape[1], img))


def run_stream_block(model: StagedModel, h: FluxHidden, index: int) -> None:
    """Block ``index`` of a FLUX-style stack (FLUX.1, FLUX.2), in place on ``h``: ``model.double_blocks`` on the
    two streams, then ``model.single_blocks`` on ``[txt, img]``; each block reads ``h.double_mod`` /
    ``h.single_mod``."""
    n_double = len(model.double_blocks)
    if index < n_double:
        if h.joint is not None:
            raise ValueError(f"block {index} is a double-stream block but the stream is already joint")
        h.img, h.txt = model.double_blocks[index](h.img, h.txt, *h.double_mod, h.freqs, backends=h.backends)
        return
    if h.joint is None:
        h.joint = torch.cat((h.txt, h.img), dim=1)
    h.joint = model.single_blocks[index - n_double](
        h.joint, h.single_mod, h.freqs, h.txt.shape[1], backends=h.backends
    )


def time_guidance_vector(
    model: StagedModel, timesteps: torch.Tensor, guidance: torch.Tensor | None, dtype: torch.dtype, name: str
) -> torch.Tensor:
    """The conditioning vector of a FLUX-style model (FLUX.1, FLUX.2: ``model.time_in``, ``model.guidance_in``)
    from the flow time and, for a model with a guidance embedding, the distilled guidance (``name`` for the
    error when it is missing)."""
    vec = model.time_in(timestep_embedding(timesteps, 256).to(dtype))
    if model.params.guidance_embed:
        if guidance is None:
            raise ValueError(f"this {name} model has a guidance embedding: pass guidance")
        vec = vec + model.guidance_in(timestep_embedding(guidance, 256).to(dtype))
    return vec


def guidance_input(model: StagedModel, cond, default: float, batch: int, device) -> torch.Tensor | None:
    """The ``guidance [B]`` input of a FLUX-style forward: the conditioning's distilled guidance (``default``
    where it carries none), or None for a model without a guidance embedding."""
    if not model.params.guidance_embed:
        return None
    g = default if cond.guidance is None else cond.guidance
    return torch.full((batch,), float(g), device=device, dtype=torch.float32)


def pack_latent(x: torch.Tensor) -> torch.Tensor:
    """``[B, C, H, W]`` latent -> ``[B, (H/2)(W/2), 4C]`` tokens of 2x2 patches (reference order)."""
    return rearrange(x, "b c (h ph) (w pw) -> b (h w) (c ph pw)", ph=2, pw=2)


def unpack_latent(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Inverse of :func:`pack_latent` for a latent of ``height x width`` (latent pixels)."""
    return rearrange(
        tokens, "b (h w) (c ph pw) -> b c (h ph) (w pw)", h=height // 2, w=width // 2, ph=2, pw=2
    )


def image_ids(batch: int, height: int, width: int, device=None) -> torch.Tensor:
    """Position ids ``[B, (H/2)(W/2), 3]``: axis 0 is 0 for the generated image, then row and column."""
    ids = torch.zeros(height // 2, width // 2, 3, device=device)
    ids[..., 1] = torch.arange(height // 2, device=device)[:, None]
    ids[..., 2] = torch.arange(width // 2, device=device)[None, :]
    return ids.reshape(1, -1, 3).expand(batch, -1, -1)


def text_ids(batch: int, length: int, device=None) -> torch.Tensor:
    return torch.zeros(batch, length, 3, device=device)


def random_inputs(
    params: FluxParams, width: int, height: int, txt_tokens: int, batch: int = 1, seed: int = 0
) -> dict:
    """Keyword arguments of ``Flux.forward`` for a ``width x height`` px image, seeded random values (benchmarks
    and FLOP counts need the shapes, not a prompt)."""
    gen = torch.Generator().manual_seed(seed)
    lh, lw = height // 8, width // 8
    inputs = {
        "img": torch.randn(batch, (lh // 2) * (lw // 2), params.in_channels, generator=gen),
        "img_ids": image_ids(batch, lh, lw),
        "txt": torch.randn(batch, txt_tokens, params.context_in_dim, generator=gen),
        "txt_ids": text_ids(batch, txt_tokens),
        "timesteps": torch.full((batch,), 0.5),
        "y": torch.randn(batch, params.vec_in_dim, generator=gen),
    }
    if params.guidance_embed:
        inputs["guidance"] = torch.full((batch,), 3.5)
    return inputs


def with_overrides(params: FluxParams, **changes) -> FluxParams:
    return dataclasses.replace(params, **changes)


DEFAULT_GUIDANCE = 3.5  # what ComfyUI's Flux model uses when the conditioning carries no "guidance"


def flux_velocity(
    model: Flux,
    x: torch.Tensor,
    sigma: torch.Tensor,
    cond,
    block_runner=None,
    backends: Backends = DEFAULT_BACKENDS,
) -> torch.Tensor:
    """Velocity ``dx/dsigma`` for a latent ``x [B, 16, H, W]`` (model space) at noise level ``sigma [B]``.

    ``block_runner``: see :meth:`Flux.forward`."""
    b, _, h, w = x.shape
    out = model(
        img=pack_latent(x),
        img_ids=image_ids(b, h, w, device=x.device),
        txt=cond.context,
        txt_ids=text_ids(b, cond.context.shape[1], device=x.device),
        timesteps=sigma,
        y=cond.pooled,
        guidance=guidance_input(model, cond, DEFAULT_GUIDANCE, b, x.device),
        block_runner=block_runner,
        backends=backends,
    )
    return unpack_latent(out, h, w)
