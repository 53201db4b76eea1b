"""A convolution and what follows it in a tiny autoencoder's block, without the extra passes: the ReLU in place,
the residual add inside the convolution (one oneDNN call on the CPU).

The tiny decoders are chains of 64-channel 3x3 convolutions at up to full image resolution, each followed by a ReLU
and, at a block's end, a residual add: cheap per pixel, so each elementwise pass over a full-resolution feature map
(256 MB at 1024x1024 px in fp32) weighs against the convolution before it (TAEF1 at 1024 px, 1 thread: 4.14 s of
convolutions, 0.58 s of ReLUs, 0.22 s of adds under ``torch.profiler``), and every pass that makes a new tensor
also pays the page faults of a fresh allocation. So:

* the ReLU runs in place on the convolution's fresh output (``relu_``: no new tensor);
* the residual add runs as oneDNN's ``sum`` post-op of the convolution (``torch.ops.mkldnn._convolution_pointwise``,
  what ``torch.compile``'s CPU backend emits for the pattern), then the ReLU in place.

The ReLU itself is not fused: oneDNN's ReLU post-op maps NaN to 0, which would turn a decode of a broken latent or
broken weights into a plausible image instead of the NaN the callers refuse ("the decoded frames hold NaN");
PyTorch's ``relu_`` keeps NaN. The fused add is exact (the add in float32 after the convolution's accumulation,
NaN and infinities propagate), so outputs are bit for bit the plain modules' (``tests/engine/vae/test_fused_conv.py``).
It is used where it has been checked to exist and to match: float32 on the CPU, outside autograd, ``torch.compile``
(which fuses by itself) and dispatch modes (FLOP counting, fake tensors: they see the plain ops), and only where
PyTorch's own convolution runs oneDNN too: a batch-1 3x3 convolution over at most 20480 input elements runs
PyTorch's own kernel instead (``ConvParams::use_mkldnn``), whose summation order differs in the last bit. Everywhere
else, and if the op is missing or differs (checked once per process), the plain modules run.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

log = logging.getLogger(__name__)

# the largest batch-1 input PyTorch convolves with its own kernel rather than oneDNN (see the module docstring)
ONEDNN_MIN_ELEMENTS = 20480


def conv_relu(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """``relu(conv(x))``, the ReLU in place on the convolution's fresh output."""
    return torch.relu_(conv(x))


def conv_add_relu(conv: nn.Conv2d, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """``relu(conv(x) + residual)`` (a residual block's end): the add inside the convolution where it applies."""
    if _fusable(conv, x) and residual.dtype == x.dtype and residual.shape[1] == conv.out_channels:
        return (
            _pointwise()
            .binary(x, residual, conv.weight, conv.bias, *_geometry(conv), "add", 1.0, None, [], "")
            .relu_()
        )
    return (conv(x) + residual).relu_()


def _geometry(conv: nn.Conv2d) -> tuple[list[int], list[int], list[int], int]:
    return list(conv.padding), list(conv.stride), list(conv.dilation), conv.groups


def _fusable(conv: nn.Conv2d, x: torch.Tensor) -> bool:
    return (
        (x.shape[0] > 1 or x.numel() > ONEDNN_MIN_ELEMENTS)
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and conv.weight.dtype == torch.float32
        and conv.padding_mode == "zeros"
        and not isinstance(conv.padding, str)
        and not (torch.is_grad_enabled() and (x.requires_grad or conv.weight.requires_grad))
        and not torch.compiler.is_compiling()
        and not is_in_torch_dispatch_mode()
        and fused_available()
    )


def _pointwise():
    return torch.ops.mkldnn._convolution_pointwise


@functools.cache
def fused_available() -> bool:
    """Whether this PyTorch has the fused op and it matches the plain modules bit for bit (checked once)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        conv = nn.Conv2d(16, 16, 3, padding=1).requires_grad_(False)
        x = torch.randn(1, 16, 40, 36, generator=gen).contiguous(memory_format=torch.channels_last)
        residual = torch.randn(1, 16, 40, 36, generator=gen)
        with torch.no_grad():
            fused = _pointwise().binary(
                x, residual, conv.weight, conv.bias, *_geometry(conv), "add", 1.0, None, [], ""
            )
            same = torch.equal(fused, conv(x) + residual)
    except (AttributeError, RuntimeError) as err:
        log.info("fused oneDNN convolutions unavailable (%s); the tiny VAEs run plain modules", err)
        return False
    if not same:
        log.warning(
            "fused oneDNN convolutions differ from the plain modules here; the tiny VAEs run plain modules"
        )
    return same
