"""The FLUX.1 autoencoder (``ae.safetensors``): a KL-VAE with an 8x spatial factor and a 16-channel latent.

Module attribute names are the official black-forest-labs/flux key names (``encoder.down.0.block.0.norm1``,
``decoder.up.1.upsample.conv``, ``decoder.mid.attn_1.q``...), so the released file loads without renaming.

Latent convention: :meth:`FluxAutoencoder.decode` and :meth:`FluxAutoencoder.encode` work in ComfyUI's *raw*
latent space (what a ComfyUI ``LATENT`` holds). The reference ``AutoEncoder`` instead takes and returns the
normalised space ``scale * (raw - shift)``; that mapping lives in :data:`fewstep.engine.latent_formats.FLUX1`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import CheckpointError, InputError
from ..loader import DUMMY_PREFIX, default_compute_dtype, resolve_device
from ..preflight.budget import check_fits
from ..preflight.ledger import LEDGER
from ..weights import StateDict, check_keys, dummy_init_, materialize_, read_state_dict, top_level_summary

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AutoEncoderParams:
    resolution: int = 256  # only the reference's nominal training size; any multiple of 8 works
    in_channels: int = 3
    ch: int = 128
    out_ch: int = 3
    ch_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    z_channels: int = 16
    # The normalisation of the diffusion model's latent space. decode/encode do NOT apply it (raw latents).
    scale_factor: float = 0.3611
    shift_factor: float = 0.1159

    @property
    def spatial_factor(self) -> int:
        return 2 ** (len(self.ch_mult) - 1)


AE_PRESETS: dict[str, AutoEncoderParams] = {
    # black-forest-labs/flux src/flux/util.py (ae_params of flux-dev / flux-schnell)
    "flux1-ae": AutoEncoderParams(),
    # Tests: the same four levels and block structure (hence the same key set) at a quarter of the width.
    "flux1-ae-tiny": AutoEncoderParams(ch=32),
}


def _group_norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(num_groups=32, num_channels=channels, eps=1e-6, affine=True)


class ResnetBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.norm1 = _group_norm(in_channels)
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, padding=1)
        self.norm2 = _group_norm(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1)
        # The official file has this key only where the channel count changes.
        self.nin_shortcut = nn.Conv2d(in_channels, out_channels, 1) if in_channels != out_channels else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        skip = x if self.nin_shortcut is None else self.nin_shortcut(x)
        return skip + h


class AttnBlock(nn.Module):
    """Single-head self-attention over all pixels, head size = channels."""

    def __init__(self, channels: int):
        super().__init__()
        self.norm = _group_norm(channels)
        self.q = nn.Conv2d(channels, channels, 1)
        self.k = nn.Conv2d(channels, channels, 1)
        self.v = nn.Conv2d(channels, channels, 1)
        self.proj_out = nn.Conv2d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        normed = self.norm(x)

        def tokens(conv: nn.Conv2d) -> torch.Tensor:  # [b, c, h, w] -> [b, 1 head, h*w, c]
            return conv(normed).reshape(b, 1, c, h * w).transpose(-1, -2)

        out = F.scaled_dot_product_attention(tokens(self.q), tokens(self.k), tokens(self.v))
        return x + self.proj_out(out.transpose(-1, -2).reshape(b, c, h, w))


class Downsample(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, stride=2, padding=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The trained weights expect padding on the right and bottom only.
        return self.conv(F.pad(x, (0, 1, 0, 1)))


class Upsample(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class MidBlock(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.block_1 = ResnetBlock(channels, channels)
        self.attn_1 = AttnBlock(channels)
        self.block_2 = ResnetBlock(channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block_2(self.attn_1(self.block_1(x)))


class Level(nn.Module):
    """One resolution: ``block.<i>`` residual blocks, then an optional ``downsample`` / ``upsample``."""

    def __init__(self, in_channels: int, out_channels: int, blocks: int, resample: str | None):
        super().__init__()
        self.block = nn.ModuleList(
            ResnetBlock(in_channels if i == 0 else out_channels, out_channels) for i in range(blocks)
        )
        if resample == "down":
            self.downsample = Downsample(out_channels)
        elif resample == "up":
            self.upsample = Upsample(out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.block:
            x = block(x)
        if hasattr(self, "downsample"):
            x = self.downsample(x)
        if hasattr(self, "upsample"):
            x = self.upsample(x)
        return x


class Encoder(nn.Module):
    """Image in [-1, 1] -> posterior moments ``[B, 2 * z_channels, H/8, W/8]`` (mean, then log-variance)."""

    def __init__(self, p: AutoEncoderParams):
        super().__init__()
        widths = [p.ch * m for m in p.ch_mult]
        last = len(widths) - 1
        self.conv_in = nn.Conv2d(p.in_channels, p.ch, 3, padding=1)
        self.down = nn.ModuleList(
            Level(
                p.ch if i == 0 else widths[i - 1],
                widths[i],
                p.num_res_blocks,
                "down" if i != last else None,
            )
            for i in range(len(widths))
        )
        self.mid = MidBlock(widths[-1])
        self.norm_out = _group_norm(widths[-1])
        self.conv_out = nn.Conv2d(widths[-1], 2 * p.z_channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(x)
        for level in self.down:
            h = level(h)
        h = self.mid(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class Decoder(nn.Module):
    """Latent ``[B, z_channels, h, w]`` -> image ``[B, out_ch, 8h, 8w]`` in about [-1, 1].

    ``up.<i>`` is indexed by resolution level (0 = full resolution) as in the official file, and runs from the
    last level down to 0; every level but 0 ends with an upsample.
    """

    def __init__(self, p: AutoEncoderParams):
        super().__init__()
        widths = [p.ch * m for m in p.ch_mult]
        last = len(widths) - 1
        self.conv_in = nn.Conv2d(p.z_channels, widths[-1], 3, padding=1)
        self.mid = MidBlock(widths[-1])
        self.up = nn.ModuleList(
            Level(widths[min(i + 1, last)], widths[i], p.num_res_blocks + 1, "up" if i != 0 else None)
            for i in range(len(widths))
        )
        self.norm_out = _group_norm(widths[0])
        self.conv_out = nn.Conv2d(widths[0], p.out_ch, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.mid(self.conv_in(z))
        for level in reversed(self.up):
            h = level(h)
        return self.conv_out(F.silu(self.norm_out(h)))


# ``ch``-channel maps alive at once at full resolution at the peak of a decode or an encode (see
# FluxAutoencoder.activation_bytes)
FULL_RESOLUTION_MAPS = 8


class FluxAutoencoder(nn.Module):
    """Encoder + decoder; ``encoder`` is ``None`` when only decoder weights were loaded."""

    def __init__(self, params: AutoEncoderParams, with_encoder: bool = True, input_name: str = "vae"):
        super().__init__()
        self.params = params
        self.input_name = input_name  # the input this VAE came from, named in its errors
        self.encoder = Encoder(params) if with_encoder else None
        self.decoder = Decoder(params)

    def _first_param(self) -> torch.Tensor:
        return next(self.decoder.parameters())

    def activation_bytes(self, batch: int, height: int, width: int, dtype_bytes: int) -> dict[str, int]:
        """Peak bytes of decoding or encoding ``batch`` images of ``height x width``, by part (the memory preflight's
        input). An estimate: at full resolution the decoder's last level reads the previous level's upsampled
        ``2 ch`` maps and its GroupNorm / SiLU / convolutions each write new ``ch``-channel maps (none in place),
        besides the copy the CPU's oneDNN convolution reorders its input into; the encoder's first level the same.
        Measured peak RSS growth on the CPU in fp32 (tests/engine/preflight/test_memory_estimates.py): 6.0 ``ch`` maps for the
        decoder, 5.3 for the encoder; :data:`FULL_RESOLUTION_MAPS` keeps a margin. The mid-block attention at 1/8
        resolution keeps a tokens x tokens score matrix when the backend has no fused kernel."""
        p = self.params
        pixels = batch * height * width
        tokens = (height // p.spatial_factor) * (width // p.spatial_factor)
        return {
            "activations": FULL_RESOLUTION_MAPS * p.ch * pixels * dtype_bytes,
            "mid-block attention": batch * tokens * tokens * dtype_bytes,
            "RGB output": 3 * pixels * 4,
        }

    def _check_fits(self, batch: int, height: int, width: int, w: torch.Tensor, input_name: str) -> None:
        """Refuse before running when the activations cannot fit the device."""
        check_fits(
            self.activation_bytes(batch, height, width, w.element_size()), w.device, input_name,
            hint="Decode / encode fewer or smaller images at a time (or use a tiny VAE)",
        )  # fmt: skip

    @torch.no_grad()
    def decode(self, raw_latent: torch.Tensor) -> torch.Tensor:
        """Raw (unscaled) latent ``[B, z, h, w]`` -> float32 RGB ``[B, 3, 8h, 8w]`` in [0, 1] (clamped)."""
        p = self.params
        _check_nchw(
            raw_latent, "latent", p.z_channels, 1, f"a raw FLUX.1 VAE latent [B, {p.z_channels}, h, w]"
        )
        w = self._first_param()
        b, _, h, wd = raw_latent.shape
        self._check_fits(b, h * p.spatial_factor, wd * p.spatial_factor, w, "latent")
        z = raw_latent.to(device=w.device, dtype=w.dtype).contiguous(memory_format=torch.channels_last)
        out = self.decoder(z)
        return ((out.float() + 1.0) / 2.0).clamp_(0.0, 1.0)

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """RGB ``[B, 3, H, W]`` in [0, 1] -> float32 raw latent ``[B, z, H/8, W/8]``.

        Returns the posterior *mean* (no sampling), so the same image always gives the same latent; it is in
        ComfyUI's raw space, not scaled or shifted.
        """
        if self.encoder is None:
            raise CheckpointError(
                self.input_name,
                "this VAE was loaded from a decoder-only file and cannot encode; "
                "load a file with the encoder.* weights too (e.g. the full ae.safetensors)",
            )
        p = self.params
        f = p.spatial_factor
        _check_nchw(images, "image", p.in_channels, f, f"RGB images [B, {p.in_channels}, H, W] in [0, 1]")
        w = self._first_param()
        self._check_fits(images.shape[0], images.shape[2], images.shape[3], w, "image")
        x = images.to(device=w.device, dtype=w.dtype).contiguous(memory_format=torch.channels_last)
        moments = self.encoder(x * 2.0 - 1.0)
        return moments[:, : p.z_channels].float().contiguous()  # the mean; the log-variance is dropped


def _check_nchw(x, name: str, channels: int, multiple: int, expected: str) -> None:
    if not isinstance(x, torch.Tensor) or x.ndim != 4 or x.shape[1] != channels:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        hint = (
            " (channels last? ComfyUI's IMAGE is [B, H, W, 3])"
            if name == "image" and got[-1:] == (3,)
            else ""
        )
        raise InputError(name, f"expected {expected}, got {got}{hint}")
    if x.shape[-2] % multiple or x.shape[-1] % multiple:
        raise InputError(
            name, f"height and width must be multiples of {multiple}, got {x.shape[-2]}x{x.shape[-1]}"
        )


# Full checkpoints keep the VAE under one of these prefixes (SD-style files, ComfyUI's own saves).
VAE_PREFIXES = ("first_stage_model.", "vae.")
# Keys every official-layout FLUX.1 VAE file has; diffusers' AutoencoderKL names them differently.
DECODER_MARKERS = ("decoder.conv_in.weight", "decoder.mid.block_1.conv1.weight", "decoder.conv_out.weight")


def load_flux_ae(
    source: str | os.PathLike,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    seed: int = 0,
    input_name: str = "vae",
) -> FluxAutoencoder:
    """Build the FLUX.1 VAE from a file or from ``"dummy:<preset>"`` (one of :data:`AE_PRESETS`).

    Files: the official ``ae.safetensors`` layout, bare or under ``first_stage_model.`` / ``vae.`` (full
    checkpoints; other keys are ignored). A file with only ``decoder.*`` keys gives a decoder-only VAE
    (``encode`` then raises). The configuration is read from tensor shapes and the load is strict.
    ``dtype`` defaults to fp32 on CPU, bf16/fp16 on CUDA; ``seed`` seeds dummy weights.
    """
    dev = resolve_device(device)
    dtype = dtype or default_compute_dtype(dev)
    source = os.fspath(source)
    if source.startswith(DUMMY_PREFIX):
        return _load_dummy(source[len(DUMMY_PREFIX) :], dtype, dev, seed, input_name)

    name = os.path.basename(source)
    sd = _vae_keys(read_state_dict(source, input_name))
    if not all(k in sd for k in DECODER_MARKERS):
        raise CheckpointError(
            input_name,
            f"{name} is not a FLUX.1 VAE in the official layout (expected keys such as "
            f"{', '.join(DECODER_MARKERS)}, bare or under {' / '.join(VAE_PREFIXES)}).\n"
            f"  top-level keys found: {top_level_summary(sd)}",
        )
    with_encoder = any(k.startswith("encoder.") for k in sd)
    try:
        params = _params_from_state_dict(sd, with_encoder)
    except (KeyError, ValueError) as exc:
        raise CheckpointError(
            input_name, f"{name}: cannot read the FLUX.1 VAE configuration, key {exc} is missing or malformed"
        ) from exc
    with torch.device("meta"):
        model = FluxAutoencoder(params, with_encoder, input_name)
    check_keys(model, sd, name, input_name)
    model.load_state_dict({k: v.to(dtype) for k, v in sd.items()}, assign=True, strict=True)
    log.info("loaded %s as the FLUX.1 VAE (%s) on %s", name, "full" if with_encoder else "decoder only", dev)
    return _ready(model.to(dev))


def _vae_keys(sd: StateDict) -> StateDict:
    for prefix in VAE_PREFIXES:
        if any(k.startswith(prefix) for k in sd):
            return {k[len(prefix) :]: v for k, v in sd.items() if k.startswith(prefix)}
    return sd


def _params_from_state_dict(sd: StateDict, with_encoder: bool) -> AutoEncoderParams:
    """Widths, depth and latent size from tensor shapes; anything inconsistent fails the strict key check."""
    levels = 1 + max(int(k.split(".")[2]) for k in sd if k.startswith("decoder.up."))
    blocks = 1 + max(int(k.split(".")[4]) for k in sd if k.startswith("decoder.up.0.block."))
    ch = sd["decoder.conv_out.weight"].shape[1]
    widths = [sd[f"decoder.up.{i}.block.0.conv1.weight"].shape[0] for i in range(levels)]
    return AutoEncoderParams(
        in_channels=sd["encoder.conv_in.weight"].shape[1] if with_encoder else 3,
        ch=ch,
        out_ch=sd["decoder.conv_out.weight"].shape[0],
        ch_mult=tuple(w // ch for w in widths),
        num_res_blocks=blocks - 1,
        z_channels=sd["decoder.conv_in.weight"].shape[1],
    )


def _load_dummy(preset: str, dtype, dev, seed: int, input_name: str) -> FluxAutoencoder:
    if preset not in AE_PRESETS:
        raise InputError(
            input_name, f"unknown VAE preset 'dummy:{preset}'; known presets: {', '.join(sorted(AE_PRESETS))}"
        )
    with torch.device("meta"):
        model = FluxAutoencoder(AE_PRESETS[preset], input_name=input_name)
    materialize_(model, dev)
    model = model.to(dtype)
    dummy_init_(model, seed)
    return _ready(model)


def _ready(model: FluxAutoencoder) -> FluxAutoencoder:
    # channels_last: the layout oneDNN (CPU) and cuDNN (tensor cores) run convolutions fastest in
    # counted in the memory ledger while it is alive (the preflight's budget under FEWSTEP_MEMORY_LIMIT_GB)
    return LEDGER.hold_model(model.to(memory_format=torch.channels_last).eval().requires_grad_(False))


__all__ = ["AE_PRESETS", "AutoEncoderParams", "FluxAutoencoder", "load_flux_ae"]
