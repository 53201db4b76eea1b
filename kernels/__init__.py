"""Triton kernels, each beside its PyTorch reference (the engine calls them through a dispatcher).

| kernel | reference | Triton | what |
|---|---|---|---|
| ``quantize_kv`` / ``dequantize_kv`` | ``kv_quant`` | ``triton_kernels`` | int8 / int4 KV per (token, head) group, float16 scale and zero point (layout: ``kv_quant``) |
| ``quantized_attention`` | ``kv_quant`` | ``triton_kernels`` | attention over full-precision + quantized keys/values, dequantized (and RoPE-rotated) inside the kernel |
| ``rms_norm`` | ``norms`` | ``triton_kernels`` | the q/k RMSNorm |
| ``adaln_modulate`` | ``norms`` | ``triton_kernels`` | fused ``LayerNorm(x) * (1 + scale) + shift`` |
| ``apply_rope`` | ``rope`` | ``triton_kernels`` | the engine's multi-axis RoPE tables applied to ``[B, L, H, D]`` (optionally written head-major) |

The functions exported here are the dispatchers (``dispatch``): Triton on CUDA when it is importable, the
reference elsewhere; ``mode="reference"`` (a run's ``Backends(kernels="reference")``, or ``FEWSTEP_KERNELS=reference``
for runs that name no mode) forces the references.
Importing this package does not import Triton. Nothing here imports the engine or ComfyUI.
"""

from . import kv_quant, norms, rope
from .dispatch import (
    MODES,
    KernelFallbacks,
    adaln_modulate,
    apply_rope,
    check_mode,
    dequantize_kv,
    enable_triton_interpreter,
    load_triton_kernels,
    quantize_kv,
    quantized_attention,
    quantized_attention_supported,
    rms_norm,
    triton_importable,
    uses_fused_quantized_attention,
    uses_triton,
)

__all__ = [
    "MODES",
    "KernelFallbacks",
    "check_mode",
    "adaln_modulate",
    "apply_rope",
    "dequantize_kv",
    "enable_triton_interpreter",
    "kv_quant",
    "load_triton_kernels",
    "norms",
    "quantize_kv",
    "quantized_attention",
    "quantized_attention_supported",
    "rms_norm",
    "rope",
    "triton_importable",
    "uses_fused_quantized_attention",
    "uses_triton",
]
