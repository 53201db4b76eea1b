# ruff: noqa: N803  (Triton convention: compile-time constants and sizes in capitals)
"""The Triton kernels: each public function here has the signature of its PyTorch reference.

| function | reference |
|---|---|
| :func:`quantize_kv`, :func:`dequantize_kv` | ``kv_quant.quantize_kv``, ``kv_quant.dequantize_kv`` |
| :func:`quantized_attention` | ``kv_quant.quantized_attention`` (dequantization inside the kernel, tile by tile) |
| :func:`rms_norm`, :func:`adaln_modulate` | ``norms.rms_norm``, ``norms.adaln_modulate`` |
| :func:`apply_rope` | ``rope.apply_rope`` |

This module imports Triton, so it is imported only when a kernel is about to run (``dispatch``). Whether
``@triton.jit`` compiles for the GPU or runs through Triton's interpreter (``TRITON_INTERPRET=1``, any device,
how the tests run them on the CPU) is decided when this module is imported; ``dispatch.load_triton_kernels``
re-imports it when the setting changed.

Arithmetic follows the references: float32 statistics and accumulation, IEEE division where the reference
divides (``div_rn``), float16 rounding of the quantization parameters before the codes are computed.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import kv_quant
from .rope import head_major_empty


def _interpreted() -> bool:
    return bool(triton.knobs.runtime.interpret)


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def _rows_per_program(block: int, budget: int = 4096) -> int:
    return max(1, min(64, budget // block))


def _warps(tile_elements: int) -> int:
    """Warps for a program working on ``tile_elements`` values (at most ~32 per thread)."""
    return min(16, max(4, tile_elements // 1024))


# -- KV quantization -------------------------------------------------------------------------------------------
@triton.jit
def _quantize_kv_kernel(
    x_ptr, data_ptr, scale_ptr, zero_ptr, rows, D,
    BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    # Every row is read as its even and odd elements ([BLOCK_M, BLOCK_H] each, BLOCK_H >= D / 2): the int4
    # codes of one byte are an even and the following odd element.
    TOP: tl.constexpr = (1 << BITS) - 1
    row = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    j = tl.arange(0, BLOCK_H)
    row_ok = row < rows
    even_ok = row_ok[:, None] & (2 * j[None, :] < D)
    odd_ok = row_ok[:, None] & (2 * j[None, :] + 1 < D)
    base = row.to(tl.int64)[:, None] * D
    xe = tl.load(x_ptr + base + 2 * j[None, :], mask=even_ok, other=0.0).to(tl.float32)
    xo = tl.load(x_ptr + base + 2 * j[None, :] + 1, mask=odd_ok, other=0.0).to(tl.float32)
    lo = tl.minimum(
        tl.min(tl.where(even_ok, xe, float("inf")), 1), tl.min(tl.where(odd_ok, xo, float("inf")), 1)
    )
    hi = tl.maximum(
        tl.max(tl.where(even_ok, xe, -float("inf")), 1), tl.max(tl.where(odd_ok, xo, -float("inf")), 1)
    )
    zero16 = lo.to(tl.float16)
    z = zero16.to(tl.float32)
    scale16 = tl.math.div_rn(hi - z, tl.full(hi.shape, TOP, tl.float32)).to(tl.float16)
    s = scale16.to(tl.float32)
    positive = s > 0
    s_safe = tl.where(positive, s, 1.0)
    qe = tl.floor(tl.math.div_rn(xe - z[:, None], tl.broadcast_to(s_safe[:, None], xe.shape)) + 0.5)
    qo = tl.floor(tl.math.div_rn(xo - z[:, None], tl.broadcast_to(s_safe[:, None], xo.shape)) + 0.5)
    qe = tl.where(positive[:, None], tl.minimum(tl.maximum(qe, 0.0), TOP), 0.0).to(tl.uint8)
    qo = tl.where(positive[:, None], tl.minimum(tl.maximum(qo, 0.0), TOP), 0.0).to(tl.uint8)
    if BITS == 8:
        tl.store(data_ptr + base + 2 * j[None, :], qe, mask=even_ok)
        tl.store(data_ptr + base + 2 * j[None, :] + 1, qo, mask=odd_ok)
    else:
        packed = qe | (qo << 4)
        tl.store(data_ptr + row.to(tl.int64)[:, None] * (D // 2) + j[None, :], packed, mask=odd_ok)
    tl.store(scale_ptr + row, scale16, mask=row_ok)
    tl.store(zero_ptr + row, zero16, mask=row_ok)


def quantize_kv(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d = x.shape[-1]
    kv_quant.check_bits(bits, d)
    x = x.contiguous()
    rows = x.numel() // d if d else 0
    data = torch.empty((*x.shape[:-1], kv_quant.packed_dim(d, bits)), dtype=torch.uint8, device=x.device)
    scale = torch.empty(x.shape[:-1], dtype=torch.float16, device=x.device)
    zero = torch.empty(x.shape[:-1], dtype=torch.float16, device=x.device)
    if rows:
        block_h = _pow2((d + 1) // 2)
        block_m = _rows_per_program(block_h)
        _quantize_kv_kernel[(triton.cdiv(rows, block_m),)](
            x, data, scale, zero, rows, d, BITS=bits, BLOCK_M=block_m, BLOCK_H=block_h
        )
    return data, scale, zero


@triton.jit
def _dequantize_kv_kernel(
    data_ptr, scale_ptr, zero_ptr, out_ptr, rows, D,
    BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    j = tl.arange(0, BLOCK_H)
    row_ok = row < rows
    even_ok = row_ok[:, None] & (2 * j[None, :] < D)
    odd_ok = row_ok[:, None] & (2 * j[None, :] + 1 < D)
    base = row.to(tl.int64)[:, None] * D
    if BITS == 8:
        qe = tl.load(data_ptr + base + 2 * j[None, :], mask=even_ok, other=0)
        qo = tl.load(data_ptr + base + 2 * j[None, :] + 1, mask=odd_ok, other=0)
    else:
        byte = tl.load(data_ptr + row.to(tl.int64)[:, None] * (D // 2) + j[None, :], mask=odd_ok, other=0)
        qe = byte & 15
        qo = byte >> 4
    s = tl.load(scale_ptr + row, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    z = tl.load(zero_ptr + row, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    out_ty = out_ptr.dtype.element_ty
    tl.store(out_ptr + base + 2 * j[None, :], (qe.to(tl.float32) * s + z).to(out_ty), mask=even_ok)
    tl.store(out_ptr + base + 2 * j[None, :] + 1, (qo.to(tl.float32) * s + z).to(out_ty), mask=odd_ok)


def dequantize_kv(
    data: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, dtype: torch.dtype
) -> torch.Tensor:
    d = data.shape[-1] * (1 if bits == 8 else 2)
    kv_quant.check_bits(bits, d)
    data, scale, zero = data.contiguous(), scale.contiguous(), zero.contiguous()
    out = torch.empty((*data.shape[:-1], d), dtype=dtype, device=data.device)
    rows = scale.numel()
    if rows and d:
        block_h = _pow2((d + 1) // 2)
        block_m = _rows_per_program(block_h)
        _dequantize_kv_kernel[(triton.cdiv(rows, block_m),)](
            data, scale, zero, out, rows, d, BITS=bits, BLOCK_M=block_m, BLOCK_H=block_h
        )
    return out


# -- attention over a quantized cache ----------------------------------------------------------------------------
@triton.jit
def _rounded(x, dtype: tl.constexpr):
    """``x`` (float32) rounded to ``dtype`` and held in float32 again (a no-op for float32)."""
    return x.to(dtype).to(tl.float32)


@triton.jit
def _dot(a, b, dtype: tl.constexpr, DOT_FP32: tl.constexpr):
    # a, b: float32 tiles holding values of ``dtype``; the product accumulates in float32
    if DOT_FP32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a.to(dtype), b.to(dtype))


@triton.jit
def _online_softmax_step(
    s, m_i, l_i, acc_e, acc_o, ve, vo, key_ok, dtype: tl.constexpr, DOT_FP32: tl.constexpr
):
    s = tl.where(key_ok[None, :], s, -float("inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    p = _rounded(p, dtype)
    acc_e = acc_e * alpha[:, None] + _dot(p, ve, dtype, DOT_FP32)
    acc_o = acc_o * alpha[:, None] + _dot(p, vo, dtype, DOT_FP32)
    return m_new, l_i, acc_e, acc_o


@triton.jit
def _quantized_attention_kernel(
    q_ptr, k_ptr, v_ptr, kd_ptr, ks_ptr, kz_ptr, vd_ptr, vs_ptr, vz_ptr, cos_ptr, sin_ptr, out_ptr,
    Lq, Nf, Nq, H, HALF, sm_scale,
    sqb, sql, sqh, skb, skl, skh, svb, svl, svh,
    sdb, sdl, sdh, spb, spl, sph, sob, sol, soh,
    BITS: tl.constexpr, ROPE: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    # Heads are split into even and odd elements throughout (q, keys, values, the output accumulators): RoPE
    # rotates (even, odd) pairs, and the two int4 codes of a byte are an even and the next odd element. Scores are
    # q_even . k_even + q_odd . k_odd. Tiles are float32 holding values rounded to q's dtype (as the reference
    # rounds them); DOT_FP32 multiplies them in float32 (float32 inputs, and Triton's interpreter, which has no
    # bfloat16 arithmetic), otherwise in q's dtype on the tensor cores. Last dimensions are contiguous.
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    dtype: tl.constexpr = q_ptr.dtype.element_ty
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    j = tl.arange(0, BLOCK_H)
    j_ok = j < HALF
    q_ok = (rows < Lq)[:, None] & j_ok[None, :]
    q_base = q_ptr + b * sqb + h * sqh + rows.to(tl.int64)[:, None] * sql
    qe = tl.load(q_base + 2 * j[None, :], mask=q_ok, other=0.0).to(tl.float32)
    qo = tl.load(q_base + 2 * j[None, :] + 1, mask=q_ok, other=0.0).to(tl.float32)
    m_i = tl.full((BLOCK_M,), -float("inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc_e = tl.zeros((BLOCK_M, BLOCK_H), tl.float32)
    acc_o = tl.zeros((BLOCK_M, BLOCK_H), tl.float32)

    # full-precision keys and values (keys already rotated)
    for start in range(0, Nf, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        key_ok = n < Nf
        ok = key_ok[:, None] & j_ok[None, :]
        k_base = k_ptr + b * skb + h * skh + n.to(tl.int64)[:, None] * skl
        v_base = v_ptr + b * svb + h * svh + n.to(tl.int64)[:, None] * svl
        ke = _rounded(tl.load(k_base + 2 * j[None, :], mask=ok, other=0.0).to(tl.float32), dtype)
        ko = _rounded(tl.load(k_base + 2 * j[None, :] + 1, mask=ok, other=0.0).to(tl.float32), dtype)
        ve = _rounded(tl.load(v_base + 2 * j[None, :], mask=ok, other=0.0).to(tl.float32), dtype)
        vo = _rounded(tl.load(v_base + 2 * j[None, :] + 1, mask=ok, other=0.0).to(tl.float32), dtype)
        s = (_dot(qe, tl.trans(ke), dtype, DOT_FP32) + _dot(qo, tl.trans(ko), dtype, DOT_FP32)) * sm_scale
        m_i, l_i, acc_e, acc_o = _online_softmax_step(
            s, m_i, l_i, acc_e, acc_o, ve, vo, key_ok, dtype, DOT_FP32
        )

    # quantized keys and values, dequantized tile by tile (as the reference: to q's dtype, then RoPE)
    for start in range(0, Nq, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        key_ok = n < Nq
        ok = key_ok[:, None] & j_ok[None, :]
        p_off = b * spb + h * sph + n.to(tl.int64) * spl
        d_base = b * sdb + h * sdh + n.to(tl.int64)[:, None] * sdl
        ks = tl.load(ks_ptr + p_off, mask=key_ok, other=0.0).to(tl.float32)[:, None]
        kz = tl.load(kz_ptr + p_off, mask=key_ok, other=0.0).to(tl.float32)[:, None]
        vs = tl.load(vs_ptr + p_off, mask=key_ok, other=0.0).to(tl.float32)[:, None]
        vz = tl.load(vz_ptr + p_off, mask=key_ok, other=0.0).to(tl.float32)[:, None]
        if BITS == 8:
            kqe = tl.load(kd_ptr + d_base + 2 * j[None, :], mask=ok, other=0)
            kqo = tl.load(kd_ptr + d_base + 2 * j[None, :] + 1, mask=ok, other=0)
            vqe = tl.load(vd_ptr + d_base + 2 * j[None, :], mask=ok, other=0)
            vqo = tl.load(vd_ptr + d_base + 2 * j[None, :] + 1, mask=ok, other=0)
        else:
            kb = tl.load(kd_ptr + d_base + j[None, :], mask=ok, other=0)
            vb = tl.load(vd_ptr + d_base + j[None, :], mask=ok, other=0)
            kqe, kqo, vqe, vqo = kb & 15, kb >> 4, vb & 15, vb >> 4
        ke = _rounded(kqe.to(tl.float32) * ks + kz, dtype)
        ko = _rounded(kqo.to(tl.float32) * ks + kz, dtype)
        ve = _rounded(vqe.to(tl.float32) * vs + vz, dtype)
        vo = _rounded(vqo.to(tl.float32) * vs + vz, dtype)
        if ROPE:
            t_off = n.to(tl.int64)[:, None] * HALF + j[None, :]
            c = tl.load(cos_ptr + t_off, mask=ok, other=0.0)
            sn = tl.load(sin_ptr + t_off, mask=ok, other=0.0)
            xe = ke.to(c.dtype)
            xo = ko.to(c.dtype)
            ke = _rounded((c * xe - sn * xo).to(tl.float32), dtype)
            ko = _rounded((sn * xe + c * xo).to(tl.float32), dtype)
        s = (_dot(qe, tl.trans(ke), dtype, DOT_FP32) + _dot(qo, tl.trans(ko), dtype, DOT_FP32)) * sm_scale
        m_i, l_i, acc_e, acc_o = _online_softmax_step(
            s, m_i, l_i, acc_e, acc_o, ve, vo, key_ok, dtype, DOT_FP32
        )

    out_base = out_ptr + b * sob + h * soh + rows.to(tl.int64)[:, None] * sol
    tl.store(out_base + 2 * j[None, :], (acc_e / l_i[:, None]).to(dtype), mask=q_ok)
    tl.store(out_base + 2 * j[None, :] + 1, (acc_o / l_i[:, None]).to(dtype), mask=q_ok)


def _last_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def quantized_attention(inputs: kv_quant.QuantizedAttentionInputs) -> torch.Tensor:
    q, k, v, cos, sin, bits = inputs.q, inputs.k, inputs.v, inputs.cos, inputs.sin, inputs.bits
    (k_data, k_scale, k_zero), (v_data, v_scale, v_zero) = inputs.k_quant, inputs.v_quant
    b, lq, h, d = q.shape
    kv_quant.check_bits(bits, d)
    if d % 2 or d // 2 < 16:
        raise ValueError(f"the quantized attention kernel needs an even head_dim >= 32, got {d}")
    nf, nq = k.shape[1], k_data.shape[1]
    if nf + nq == 0:
        raise ValueError("attention over no keys")
    q, k, v, k_data, v_data = (_last_contiguous(t) for t in (q, k, v, k_data, v_data))
    if v.stride() != k.stride() or v_data.stride() != k_data.stride():
        k, v, k_data, v_data = k.contiguous(), v.contiguous(), k_data.contiguous(), v_data.contiguous()
    params = [t.contiguous() for t in (k_scale, k_zero, v_scale, v_zero)]
    rope = cos is not None
    if rope:
        cos, sin = cos.reshape(nq, d // 2).contiguous(), sin.reshape(nq, d // 2).contiguous()
    else:
        cos = sin = params[0]  # not read
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    block_h = _pow2(d // 2)
    block_m = 64 if lq >= 64 else 16
    block_n = 64 if block_h <= 64 else 32
    grid = (triton.cdiv(lq, block_m), b * h)
    _quantized_attention_kernel[grid](
        q, k, v, k_data, params[0], params[1], v_data, params[2], params[3], cos, sin, out,
        lq, nf, nq, h, d // 2, 1 / math.sqrt(d),
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        k_data.stride(0), k_data.stride(1), k_data.stride(2),
        params[0].stride(0), params[0].stride(1), params[0].stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        BITS=bits, ROPE=rope, DOT_FP32=q.dtype == torch.float32 or _interpreted(),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_H=block_h,
    )  # fmt: skip
    return out


# -- norms ---------------------------------------------------------------------------------------------------------
@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, rows, N, eps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    col = tl.arange(0, BLOCK_N)
    ok = (row < rows)[:, None] & (col < N)[None, :]
    offs = row.to(tl.int64)[:, None] * N + col[None, :]
    x = tl.load(x_ptr + offs, mask=ok, other=0.0)
    xf = x.to(tl.float32)
    rrms = tl.math.rsqrt(tl.sum(xf * xf, 1) / N + eps)
    # as the reference: normalised value rounded to x's dtype, times the weight in x's dtype (the product of two
    # values of a 16-bit float is exact in float32, so rounding it once equals the 16-bit multiply)
    w = tl.load(w_ptr + col, mask=col < N, other=0.0).to(tl.float32).to(x.dtype).to(tl.float32)
    y = (xf * rrms[:, None]).to(x.dtype).to(tl.float32) * w[None, :]
    tl.store(out_ptr + offs, y.to(x.dtype), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    n = x.shape[-1]
    x = x.contiguous()
    out = torch.empty_like(x)
    rows = x.numel() // n if n else 0
    if rows:
        block_n = _pow2(n)
        block_m = _rows_per_program(block_n)
        _rms_norm_kernel[(triton.cdiv(rows, block_m),)](
            x, weight.contiguous(), out, rows, n, eps, BLOCK_M=block_m, BLOCK_N=block_n,
            num_warps=_warps(block_m * block_n),
        )  # fmt: skip
    return out


@triton.jit
def _adaln_kernel(
    x_ptr, shift_ptr, scale_ptr, out_ptr, rows, L, C, per_group, G, eps,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    col = tl.arange(0, BLOCK_C)
    row_ok = row < rows
    col_ok = col < C
    ok = row_ok[:, None] & col_ok[None, :]
    offs = row.to(tl.int64)[:, None] * C + col[None, :]
    x = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    mean = tl.sum(x, 1) / C
    xc = tl.where(ok, x - mean[:, None], 0.0)
    rstd = tl.math.rsqrt(tl.sum(xc * xc, 1) / C + eps)
    group = (row // L) * G + (row % L) // per_group  # batch * G + group in the batch
    g_offs = group.to(tl.int64)[:, None] * C + col[None, :]
    shift = tl.load(shift_ptr + g_offs, mask=ok, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr + g_offs, mask=ok, other=0.0).to(tl.float32)
    out = xc * rstd[:, None] * (1.0 + scale) + shift
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=ok)


def adaln_modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    b, n, c = x.shape
    g = shift.shape[1]
    if shift.shape != (b, g, c) or scale.shape != (b, g, c) or n % g:
        raise ValueError(f"adaLN: x {list(x.shape)} needs shift/scale [B, G, C] with L % G == 0")
    dtype = torch.promote_types(x.dtype, torch.promote_types(shift.dtype, scale.dtype))
    x, shift, scale = x.contiguous(), shift.contiguous(), scale.contiguous()
    out = torch.empty((b, n, c), dtype=dtype, device=x.device)
    rows = b * n
    if rows and c:
        block_c = _pow2(c)
        block_m = _rows_per_program(block_c)
        _adaln_kernel[(triton.cdiv(rows, block_m),)](
            x, shift, scale, out, rows, n, c, n // g, g, eps, BLOCK_M=block_m, BLOCK_C=block_c,
            num_warps=_warps(block_m * block_c),
        )  # fmt: skip
    return out


# -- RoPE ------------------------------------------------------------------------------------------------------------
@triton.jit
def _rope_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr, rows, L, H, HALF,
    sxb, sxl, sxh, scb, scl, sob, sol, soh,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    # one row per (token, head), BLOCK_R rows per program; the tables are per token (heads share them)
    row = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    j = tl.arange(0, BLOCK_H)
    ok = (row < rows)[:, None] & (j < HALF)[None, :]
    token = (row // H).to(tl.int64)
    head = (row % H).to(tl.int64)
    b = token // L
    pos = token % L
    t_off = (b * scb + pos * scl)[:, None] + j[None, :]
    c = tl.load(cos_ptr + t_off, mask=ok, other=0.0)
    s = tl.load(sin_ptr + t_off, mask=ok, other=0.0)
    x_base = x_ptr + (b * sxb + pos * sxl + head * sxh)[:, None]
    xe = tl.load(x_base + 2 * j[None, :], mask=ok, other=0.0)
    xo = tl.load(x_base + 2 * j[None, :] + 1, mask=ok, other=0.0)
    out_ty = xe.dtype
    # through float32: Triton's interpreter converts 16-bit floats only to and from float32
    xe = xe.to(tl.float32).to(c.dtype)
    xo = xo.to(tl.float32).to(c.dtype)
    out_base = out_ptr + (b * sob + pos * sol + head * soh)[:, None]
    tl.store(out_base + 2 * j[None, :], (c * xe - s * xo).to(tl.float32).to(out_ty), mask=ok)
    tl.store(out_base + 2 * j[None, :] + 1, (s * xe + c * xo).to(tl.float32).to(out_ty), mask=ok)


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_major: bool = False
) -> torch.Tensor:
    b, n, h, d = x.shape
    half = d // 2
    x = _last_contiguous(x)
    # [B, L, 1, D/2] tables (batch broadcast allowed) -> [B, L, D/2] with stride 0 over a broadcast batch
    cos = cos.expand(b, n, 1, half).squeeze(2)
    sin = sin.expand(b, n, 1, half).squeeze(2)
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    out = head_major_empty(x) if head_major else torch.empty((b, n, h, d), dtype=x.dtype, device=x.device)
    rows = b * n * h
    if rows and half:
        block_h = _pow2(half)
        block_r = _rows_per_program(block_h)
        _rope_kernel[(triton.cdiv(rows, block_r),)](
            x, cos, sin, out, rows, n, h, half,
            x.stride(0), x.stride(1), x.stride(2), cos.stride(0), cos.stride(1),
            out.stride(0), out.stride(1), out.stride(2),
            BLOCK_R=block_r, BLOCK_H=block_h,
        )  # fmt: skip
    return out
