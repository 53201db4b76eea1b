"""TAESD family: tiny convolutional autoencoders for image latent spaces (madebyollin/taesd).

The modules are ``nn.Sequential`` stacks whose indices are the published state-dict keys (``0.weight``,
``3.conv.0.weight``, ``3.pool.0.weight``...), so the ``*_encoder.pth`` / ``*_decoder.pth`` files and ComfyUI's
``models/vae_approx/*`` files load directly. Images are RGB in [0, 1]; latents are in the space the diffusion
model works in (TAESD has no scale or shift of its own).
"""

from __future__ import annotations

import torch
from torch import nn

from .fused_conv import conv_add_relu, conv_relu

# 64-channel feature maps alive at once at full resolution at the peak, for the memory preflight: a Block keeps
# its input (the skip), the conv chain's intermediate (measured when its ReLUs were not yet in place: an upper
# bound now) and the copy the CPU's oneDNN
# convolution reorders its input into. Measured peak RSS growth on the CPU in fp32 (tests/engine/preflight/test_memory_estimates.py):
# 3.0 maps for the decoder, 3.1 for the encoder; 4 keeps a margin above both.
FULL_RESOLUTION_MAPS = 4
FULL_RESOLUTION_WIDTH = 64


def activation_bytes(images: int, height: int, width: int, dtype_bytes: int) -> int:
    """Peak activation bytes of encoding or decoding ``images`` images of ``height x width`` pixels (the RGB output
    not included: the caller counts it in the dtype it keeps it in)."""
    return images * height * width * FULL_RESOLUTION_MAPS * FULL_RESOLUTION_WIDTH * dtype_bytes


# Variants: latent channels, 32x downscaling (Sana's DC-AE) or 8x, and the mid-block pooling branch (FLUX.2).
TAESD_VARIANTS: dict[str, tuple[int, bool, bool]] = {
    "taesd": (4, False, False),
    "taesdxl": (4, False, False),
    "taesd3": (16, False, False),
    "taef1": (16, False, False),
    "taef2": (32, False, True),
    "taesana": (32, True, False),
}


def conv(n_in: int, n_out: int, **kwargs) -> nn.Conv2d:
    return nn.Conv2d(n_in, n_out, 3, padding=1, **kwargs)


class Clamp(nn.Module):
    """Soft clamp of decoder inputs to (-3, 3)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x / 3) * 3


class Block(nn.Module):
    """Residual block; ``pool`` is FLUX.2's extra branch (1x1 conv, GroupNorm(4), ReLU, 1x1 conv)."""

    def __init__(self, n_in: int, n_out: int, pooled: bool = False):
        super().__init__()
        self.conv = nn.Sequential(
            conv(n_in, n_out), nn.ReLU(), conv(n_out, n_out), nn.ReLU(), conv(n_out, n_out)
        )
        self.skip = nn.Conv2d(n_in, n_out, 1, bias=False) if n_in != n_out else nn.Identity()
        self.pool = None
        if pooled:
            wide = n_in * 4
            self.pool = nn.Sequential(
                nn.Conv2d(n_in, wide, 1, bias=False),
                nn.GroupNorm(4, wide),
                nn.ReLU(),
                nn.Conv2d(wide, n_in, 1, bias=False),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pool is not None:
            x = x + self.pool(x)
        # self.conv's ReLUs in place, the residual add inside the last convolution, then the ReLU (fused_conv.py)
        h = conv_relu(self.conv[2], conv_relu(self.conv[0], x))
        return conv_add_relu(self.conv[4], h, self.skip(x))


def _down(n: int = 64) -> nn.Conv2d:
    return conv(n, n, stride=2, bias=False)


def _up(n_in: int, n_out: int) -> list[nn.Module]:
    return [nn.Upsample(scale_factor=2), conv(n_in, n_out, bias=False)]


def build_encoder(variant: str) -> nn.Sequential:
    channels, f32, pooled = TAESD_VARIANTS[variant]
    if f32:
        return nn.Sequential(
            conv(3, 32, stride=2), nn.ReLU(), conv(32, 64, stride=2), nn.ReLU(), Block(64, 64),
            _down(), Block(64, 64), Block(64, 64), Block(64, 64),
            _down(), Block(64, 64), Block(64, 64), Block(64, 64),
            _down(), Block(64, 64), Block(64, 64), Block(64, 64),
            conv(64, channels),
        )  # fmt: skip
    deep = [Block(64, 64, pooled) for _ in range(3)]
    return nn.Sequential(
        conv(3, 64), Block(64, 64),
        _down(), Block(64, 64), Block(64, 64), Block(64, 64),
        _down(), Block(64, 64), Block(64, 64), Block(64, 64),
        _down(), *deep,
        conv(64, channels),
    )  # fmt: skip


def build_decoder(variant: str) -> nn.Sequential:
    channels, f32, pooled = TAESD_VARIANTS[variant]
    if f32:
        return nn.Sequential(
            Clamp(), conv(channels, 256), nn.ReLU(),
            Block(256, 256), Block(256, 256), Block(256, 256), *_up(256, 128),
            Block(128, 128), Block(128, 128), Block(128, 128), *_up(128, 64),
            Block(64, 64), Block(64, 64), Block(64, 64), *_up(64, 64),
            Block(64, 64), Block(64, 64), Block(64, 64), *_up(64, 64),
            Block(64, 64), Block(64, 64), Block(64, 64), *_up(64, 64),
            Block(64, 64), conv(64, 3),
        )  # fmt: skip
    deep = [Block(64, 64, pooled) for _ in range(3)]
    return nn.Sequential(
        Clamp(), conv(channels, 64), nn.ReLU(),
        *deep, *_up(64, 64),
        Block(64, 64), Block(64, 64), Block(64, 64), *_up(64, 64),
        Block(64, 64), Block(64, 64), Block(64, 64), *_up(64, 64),
        Block(64, 64), conv(64, 3),
    )  # fmt: skip


def detect_taesd(sd: dict[str, torch.Tensor]) -> tuple[str, list[str]] | None:
    """``("encoder" | "decoder", candidate variants)`` from tensor shapes, or None if not a TAESD file.

    The encoder starts with a conv from RGB (``0.weight`` [n, 3, 3, 3]); the decoder with the clamp, so its
    first conv is ``1.weight`` [n, latent_channels, 3, 3]. 32x variants start 32 (encoder) or 256 (decoder)
    wide; FLUX.2's has the pooling branch.
    """
    pooled = any(".pool." in k for k in sd)
    first_enc, first_dec = sd.get("0.weight"), sd.get("1.weight")
    if first_enc is not None and first_enc.ndim == 4 and first_enc.shape[1] == 3:
        part, f32 = "encoder", first_enc.shape[0] == 32
        last = max((int(k.split(".")[0]) for k in sd if k.split(".")[0].isdigit()), default=-1)
        channels = sd.get(f"{last}.weight", torch.empty(0, 0)).shape[0]
    elif first_dec is not None and first_dec.ndim == 4 and "0.weight" not in sd:
        part, f32, channels = "decoder", first_dec.shape[0] == 256, first_dec.shape[1]
    else:
        return None
    found = [name for name, spec in TAESD_VARIANTS.items() if spec == (channels, f32, pooled)]
    return (part, found) if found else None
