"""FLUX.2 (dev, klein 4B / 9B): a rectified-flow MMDiT over the 128-channel patchified FLUX.2 latent.

``Flux2.forward(x, x_ids, timesteps, ctx, ctx_ids, guidance=None)`` has the semantics of the
black-forest-labs/flux2 reference (``src/flux2/model.py``): ``x [B, L_img, 128]`` latent tokens (the FLUX.2
autoencoder's 32 channels, 2x2-patchified and normalised, one token per latent pixel), ``x_ids [B, L_img, 4]``
and ``ctx_ids [B, L_txt, 4]`` positions (time, row, column, text index), ``ctx [B, L_txt, context_in_dim]``
stacked text-encoder hidden states, ``timesteps [B]`` flow time in [0, 1], ``guidance [B]`` distilled guidance
(dev only; klein has no guidance embedding). It returns the velocity ``[B, L_img, 128]``; text tokens come
first in the joint attention.

Unlike FLUX.1 there is no pooled vector, no bias, and the modulation is shared: three ``Modulation`` layers
at the top compute the adaLN parameters once per forward for all double-stream (image, text) and all
single-stream blocks. The forward is three stages, ``finish(run_blocks(embed(...)))``, as in ``flux``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import nn

from ..backends import DEFAULT_BACKENDS, Backends
from ..ops import Linear
from ..rope import rope_freqs
from .flux import FluxHidden, guidance_input, run_stream_block, time_guidance_vector
from .flux2_layers import DoubleStreamBlock, LastLayer, MLPEmbedder, Modulation, SingleStreamBlock
from .staged import StagedModel, check_head_split


@dataclass(frozen=True)
class Flux2Params:
    in_channels: int = 128
    context_in_dim: int = 15360
    hidden_size: int = 6144
    num_heads: int = 48
    depth: int = 8
    depth_single_blocks: int = 48
    axes_dim: tuple[int, ...] = (32, 32, 32, 32)
    theta: int = 2000
    mlp_ratio: float = 3.0
    guidance_embed: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def out_channels(self) -> int:
        return self.in_channels

    @property
    def latent_channels(self) -> int:
        """Channels of the model-space latent ``[B, 128, H/16, W/16]`` the model denoises (one token a pixel)."""
        return self.in_channels


# Official configurations. flux.2-dev: black-forest-labs/flux2 src/flux2/model.py ``Flux2Params`` defaults
# (util.py FLUX2_MODEL_INFO["flux.2-dev"]). klein: the same file's ``Klein4BParams`` / ``Klein9BParams``
# (hidden 3072 / 4096, 24 / 32 heads, 5 + 20 / 8 + 24 blocks, use_guidance_embed=False), whose
# context_in_dim is three stacked Qwen3 hidden states: 3 x 2560 (Qwen3-4B) and 3 x 4096 (Qwen3-8B); the same
# numbers as diffusers' Flux2Transformer2DModel configs of black-forest-labs/FLUX.2-klein-4B / -9B.
PRESETS: dict[str, Flux2Params] = {
    "flux.2-dev": Flux2Params(),
    "flux.2-klein-4b": Flux2Params(
        context_in_dim=7680,
        hidden_size=3072,
        num_heads=24,
        depth=5,
        depth_single_blocks=20,
        guidance_embed=False,
    ),
    "flux.2-klein-9b": Flux2Params(
        context_in_dim=12288,
        hidden_size=4096,
        num_heads=32,
        depth=8,
        depth_single_blocks=24,
        guidance_embed=False,
    ),
    # Tests: the real interface widths (128 latent channels, klein-4B / dev text widths) around a tiny trunk.
    "flux2-tiny": Flux2Params(
        context_in_dim=7680,
        hidden_size=64,
        num_heads=2,
        depth=2,
        depth_single_blocks=2,
        axes_dim=(8, 8, 8, 8),
        guidance_embed=False,
    ),
    "flux2-tiny-dev": Flux2Params(
        hidden_size=64,
        num_heads=2,
        depth=2,
        depth_single_blocks=2,
        axes_dim=(8, 8, 8, 8),
        guidance_embed=True,
    ),
    # Benchmarks on CPU: the FLUX.2 head size (128, axes 4 x 32) and klein's 1 : 4 double : single block mix
    # (klein-4B: 5 + 20) at a width a CPU runs in about a second, as flux-mid / zimage-mid.
    "flux2-mid": Flux2Params(
        context_in_dim=7680,
        hidden_size=1024,
        num_heads=8,
        depth=1,
        depth_single_blocks=4,
        guidance_embed=False,
    ),
}


def default_axes_dim(head_dim: int) -> tuple[int, ...] | None:
    """The FLUX.2 split of a head between (time, row, column, text index): four equal parts; 128 -> 4 x 32."""
    if head_dim % 8:
        return None
    return (head_dim // 4,) * 4


class Flux2(StagedModel):
    family = "flux2"
    block_stacks = ("double_blocks", "single_blocks")  # double-stream blocks, then single-stream ones

    def __init__(self, params: Flux2Params):
        super().__init__()
        check_head_split(params.hidden_size, params.num_heads, params.axes_dim)
        self.params = params
        hidden = params.hidden_size
        self.img_in = Linear(params.in_channels, hidden, bias=False)
        self.time_in = MLPEmbedder(256, hidden, bias=False)
        self.guidance_in = MLPEmbedder(256, hidden, bias=False) if params.guidance_embed else nn.Identity()
        self.txt_in = Linear(params.context_in_dim, hidden, bias=False)
        self.double_blocks = nn.ModuleList(
            DoubleStreamBlock(hidden, params.num_heads, params.mlp_ratio) for _ in range(params.depth)
        )
        self.single_blocks = nn.ModuleList(
            SingleStreamBlock(hidden, params.num_heads, params.mlp_ratio)
            for _ in range(params.depth_single_blocks)
        )
        self.double_stream_modulation_img = Modulation(hidden, double=True)
        self.double_stream_modulation_txt = Modulation(hidden, double=True)
        self.single_stream_modulation = Modulation(hidden, double=False)
        self.final_layer = LastLayer(hidden, 1, params.out_channels, bias=False)

    def embed(
        self,
        x: torch.Tensor,
        x_ids: torch.Tensor,
        timesteps: torch.Tensor,
        ctx: torch.Tensor,
        ctx_ids: torch.Tensor,
        guidance: torch.Tensor | None = None,
        backends: Backends = DEFAULT_BACKENDS,
    ) -> Flux2Hidden:
        """Inputs -> the residual stream before block 0 (tokens, conditioning vector, shared modulation, rotations)."""
        if x.ndim != 3 or ctx.ndim != 3:
            raise ValueError("x and ctx must be [batch, tokens, channels]")
        dtype = x.dtype
        vec = time_guidance_vector(self, timesteps, guidance, dtype, "FLUX.2")
        freqs = rope_freqs(torch.cat((ctx_ids, x_ids), dim=1), self.params.axes_dim, self.params.theta)
        return Flux2Hidden(
            img=self.img_in(x),
            txt=self.txt_in(ctx.to(dtype)),
            vec=vec,
            freqs=freqs,
            mod_img=self.double_stream_modulation_img(vec),
            mod_txt=self.double_stream_modulation_txt(vec),
            mod_single=self.single_stream_modulation(vec)[0],
            backends=backends,
        )

    def run_block(self, h: Flux2Hidden, index: int) -> None:
        run_stream_block(self, h, index)

    def finish(self, h: Flux2Hidden) -> torch.Tensor:
        """The final layer on the image tokens: velocity ``[B, L_img, 128]``."""
        return self.final_layer(h.stream, h.vec, h.backends)

    def forward(
        self,
        x: torch.Tensor,
        x_ids: torch.Tensor,
        timesteps: torch.Tensor,
        ctx: torch.Tensor,
        ctx_ids: torch.Tensor,
        guidance: torch.Tensor | None = None,
        block_runner=None,
        backends: Backends = DEFAULT_BACKENDS,
    ) -> torch.Tensor:
        """``block_runner(model, hidden) -> hidden``, when given, runs the block stack in place of
        ``run_blocks`` (a step cache's hook); without one this is the reference forward."""
        return self.run_stages(
            self.embed(x, x_ids, timesteps, ctx, ctx_ids, guidance, backends), block_runner
        )


@dataclass
class Flux2Hidden(FluxHidden):
    """:class:`flux.FluxHidden` plus the shared modulation every block reads (computed once per forward)."""

    mod_img: tuple = field(kw_only=True)
    mod_txt: tuple = field(kw_only=True)
    mod_single: tuple = field(kw_only=True)

    @property
    def double_mod(self) -> tuple:
        return (self.mod_img, self.mod_txt)

    @property
    def single_mod(self):
        return self.mod_single


def pack_latent(x: torch.Tensor) -> torch.Tensor:
    """``[B, C, H, W]`` model-space latent -> ``[B, H * W, C]`` tokens, row-major (the latent is already
    patchified: one token per latent pixel)."""
    return x.flatten(2).transpose(1, 2)


def unpack_latent(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Inverse of :func:`pack_latent`."""
    return tokens.transpose(1, 2).unflatten(2, (height, width))


def image_ids(batch: int, height: int, width: int, time: int = 0, device=None) -> torch.Tensor:
    """Position ids ``[B, H * W, 4]``: (time, row, column, 0); time 0 is the generated image (reference
    images take other times)."""
    ids = torch.zeros(height, width, 4, device=device)
    ids[..., 0] = time
    ids[..., 1] = torch.arange(height, device=device)[:, None]
    ids[..., 2] = torch.arange(width, device=device)[None, :]
    return ids.reshape(1, -1, 4).expand(batch, -1, -1)


def text_ids(batch: int, length: int, device=None) -> torch.Tensor:
    """Position ids ``[B, L, 4]`` of the text tokens: (0, 0, 0, index)."""
    ids = torch.zeros(length, 4, device=device)
    ids[:, 3] = torch.arange(length, device=device)
    return ids.reshape(1, -1, 4).expand(batch, -1, -1)


def random_inputs(
    params: Flux2Params, width: int, height: int, txt_tokens: int, batch: int = 1, seed: int = 0
) -> dict:
    """Keyword arguments of ``Flux2.forward`` for a ``width x height`` px image (16 px a token), seeded."""
    gen = torch.Generator().manual_seed(seed)
    lh, lw = height // 16, width // 16
    inputs = {
        "x": torch.randn(batch, lh * lw, params.in_channels, generator=gen),
        "x_ids": image_ids(batch, lh, lw),
        "timesteps": torch.full((batch,), 0.5),
        "ctx": torch.randn(batch, txt_tokens, params.context_in_dim, generator=gen),
        "ctx_ids": text_ids(batch, txt_tokens),
    }
    if params.guidance_embed:
        inputs["guidance"] = torch.full((batch,), DEFAULT_GUIDANCE)
    return inputs


def with_overrides(params: Flux2Params, **changes) -> Flux2Params:
    return dataclasses.replace(params, **changes)


# Which text encoder produces each conditioning width: three hidden layers stacked per token (BFL flux2
# text_encoder.py; diffusers Flux2Pipeline / Flux2KleinPipeline ``text_encoder_out_layers``).
TEXT_ENCODERS = {
    15360: "Mistral-Small-3.1-24B hidden states of layers 10, 20, 30 stacked (3 x 5120)",
    7680: "Qwen3-4B hidden states of layers 9, 18, 27 stacked (3 x 2560)",
    12288: "Qwen3-8B hidden states of layers 9, 18, 27 stacked (3 x 4096)",
}

# ComfyUI encodes Qwen3 for klein since release 0.9.2 (its commit "Flux2 Klein support", #11890, added the
# stacked-layer klein encoder behind CLIPLoader type flux2). 0.9.1 and older, 0.8.0 included, route every
# Qwen3-4B file to Z-Image's encoder whatever the type (one layer, 2560 wide) and load Qwen3-8B as a Llama,
# so a width error on klein usually means an older ComfyUI, not a wrong loader setting.
KLEIN_ENCODER_SINCE = "0.9.2"
COMFYUI_LOADERS = {
    15360: "CLIPLoader type flux2 with the Mistral-Small-3.1 file, CLIPTextEncode",
    7680: (
        f"CLIPLoader type flux2 with qwen_3_4b, CLIPTextEncode, on ComfyUI {KLEIN_ENCODER_SINCE} or newer; "
        "older ComfyUI, 0.8.0 included, encodes Qwen3-4B 2560 wide, as for Z-Image, whatever the type"
    ),
    12288: (
        f"CLIPLoader type flux2 with the Qwen3-8B file, CLIPTextEncode, on ComfyUI {KLEIN_ENCODER_SINCE} or "
        "newer; older ComfyUI has no klein encoder for Qwen3-8B"
    ),
}


def text_encoder_for(params: Flux2Params) -> str:
    """The text-encoder setup whose output this model's ``context_in_dim`` is, for error messages."""
    width = params.context_in_dim
    what = TEXT_ENCODERS.get(width, f"{width}-wide stacked text-encoder states")
    return f"{what} ({COMFYUI_LOADERS.get(width, 'CLIPLoader type flux2, CLIPTextEncode')})"


# FLUX.2-dev's default distilled guidance (black-forest-labs/flux2 scripts/cli.py: guidance 4.0); klein
# has no guidance embedding and ignores it.
DEFAULT_GUIDANCE = 4.0


def flux2_velocity(
    model: Flux2,
    x: torch.Tensor,
    sigma: torch.Tensor,
    cond,
    block_runner=None,
    backends: Backends = DEFAULT_BACKENDS,
) -> torch.Tensor:
    """Velocity ``dx/dsigma`` for a model-space latent ``x [B, 128, H/16, W/16]`` at noise level ``sigma [B]``.

    ``cond.context [B, L, context_in_dim]`` the stacked text-encoder states; ``cond.guidance`` the distilled
    guidance of dev (default :data:`DEFAULT_GUIDANCE`). ``block_runner``: see :meth:`Flux2.forward`."""
    b, c, h, w = x.shape
    if c != model.params.in_channels:
        raise ValueError(f"FLUX.2 latent must have {model.params.in_channels} channels, got {c}")
    if cond.context.shape[-1] != model.params.context_in_dim:
        raise ValueError(
            f"FLUX.2 conditioning must be {model.params.context_in_dim} wide, got {cond.context.shape[-1]}"
        )
    out = model(
        x=pack_latent(x),
        x_ids=image_ids(b, h, w, device=x.device),
        timesteps=sigma,
        ctx=cond.context,
        ctx_ids=text_ids(b, cond.context.shape[1], device=x.device),
        guidance=guidance_input(model, cond, DEFAULT_GUIDANCE, b, x.device),
        block_runner=block_runner,
        backends=backends,
    )
    return unpack_latent(out, h, w)
