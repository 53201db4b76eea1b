"""The Triton kernels as ``torch.library`` custom ops (``torch.ops.fewstep.*``), each with a fake implementation.

``torch.compile`` sees one opaque call per kernel (the fake gives it output shapes and dtypes without running
anything), and the ops run on any device (on the CPU only under Triton's interpreter). Registered on first
import; a second copy of the package in the same process (ComfyUI imports the folder under its own module name)
reuses the ops the first one registered. Not differentiable: the dispatcher uses the references when autograd
is recording.
"""

import torch

from . import kv_quant
from .rope import head_major_empty

NAMESPACE = "fewstep"


def _triton():
    from .dispatch import load_triton_kernels

    return load_triton_kernels()


def _registered(name: str):
    try:
        return getattr(getattr(torch.ops, NAMESPACE), name)
    except AttributeError:
        return None


def _define(name: str, impl, fake):
    if _registered(name) is None:
        torch.library.custom_op(f"{NAMESPACE}::{name}", impl, mutates_args=()).register_fake(fake)
    return _registered(name)


# -- implementations (annotated: the schema is read from the annotations) ------------------------------------------
def _quantize_kv(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _triton().quantize_kv(x, bits)


def _quantize_kv_fake(x, bits):
    params = x.shape[:-1]
    data = x.new_empty((*params, kv_quant.packed_dim(x.shape[-1], bits)), dtype=torch.uint8)
    return data, x.new_empty(params, dtype=torch.float16), x.new_empty(params, dtype=torch.float16)


def _dequantize_kv(
    data: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, dtype: torch.dtype
) -> torch.Tensor:
    return _triton().dequantize_kv(data, scale, zero, bits, dtype)


def _dequantize_kv_fake(data, scale, zero, bits, dtype):
    return data.new_empty((*data.shape[:-1], data.shape[-1] * (1 if bits == 8 else 2)), dtype=dtype)


def _quantized_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_data: torch.Tensor,
    k_scale: torch.Tensor,
    k_zero: torch.Tensor,
    v_data: torch.Tensor,
    v_scale: torch.Tensor,
    v_zero: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    bits: int,
) -> torch.Tensor:
    # the one flat spelling of kv_quant.QuantizedAttentionInputs: an op schema takes tensors, not objects
    return _triton().quantized_attention(
        kv_quant.QuantizedAttentionInputs.from_flat(
            q, k, v, k_data, k_scale, k_zero, v_data, v_scale, v_zero, cos, sin, bits
        )
    )


def _quantized_attention_fake(q, *_):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _triton().rms_norm(x, weight, eps)


def _rms_norm_fake(x, weight, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _adaln_modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    return _triton().adaln_modulate(x, shift, scale, eps)


def _adaln_modulate_fake(x, shift, scale, eps):
    dtype = torch.promote_types(x.dtype, torch.promote_types(shift.dtype, scale.dtype))
    return x.new_empty(x.shape, dtype=dtype)


def _apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_major: bool = False
) -> torch.Tensor:
    return _triton().apply_rope(x, cos, sin, head_major)


def _apply_rope_fake(x, cos, sin, head_major=False):
    # the real kernel's layout, which the compiled graph's strides must match
    return head_major_empty(x) if head_major else x.new_empty(x.shape)


quantize_kv = _define("quantize_kv", _quantize_kv, _quantize_kv_fake)
dequantize_kv = _define("dequantize_kv", _dequantize_kv, _dequantize_kv_fake)
quantized_attention = _define("quantized_attention", _quantized_attention, _quantized_attention_fake)
rms_norm = _define("rms_norm", _rms_norm, _rms_norm_fake)
adaln_modulate = _define("adaln_modulate", _adaln_modulate, _adaln_modulate_fake)
apply_rope = _define("apply_rope", _apply_rope, _apply_rope_fake)
