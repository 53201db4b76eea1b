"""Normalisations of the DiT blocks: PyTorch references (the Triton versions are in ``triton_kernels``).

* :func:`rms_norm`: the q/k RMSNorm of FLUX and Wan: statistics in float32, the normalised value cast back to
  ``x``'s dtype, then multiplied by the weight in ``x``'s dtype.
* :func:`adaln_modulate`: the adaLN step before attention and MLP, ``LayerNorm(x) * (1 + scale) + shift`` (no
  affine LayerNorm weights), with one ``shift, scale`` per group of consecutive tokens (FLUX: one group, the
  whole image; Wan: one per latent frame). The reference keeps the unfused arithmetic of the models (the
  LayerNorm result in ``x``'s dtype, then the modulation in the promoted dtype of ``x`` and ``scale``); the
  fused kernel computes everything in float32 and rounds once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm of ``x [..., N]`` over its last dimension, times ``weight [N]``."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return out.to(x.dtype) * weight.to(x.dtype)


def adaln_modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """``LayerNorm(x) * (1 + scale) + shift`` for ``x [B, L, C]`` and ``shift, scale [B, G, C]``.

    ``L`` is a multiple of ``G``: token ``l`` takes group ``l // (L // G)``.
    """
    b, n, c = x.shape
    g = shift.shape[1]
    normed = F.layer_norm(x, (c,), eps=eps)
    out = normed.unflatten(1, (g, n // g)) * (1 + scale.unsqueeze(2)) + shift.unsqueeze(2)
    return out.flatten(1, 2)
