"""Triton kernels against their PyTorch references, the dispatcher, and the engine calling them.

The Triton kernels run through Triton's interpreter on the CPU (``TRITON_INTERPRET=1``, set here before any
kernel is compiled; ``kernels.enable_triton_interpreter`` re-imports the kernels if they were built without it).
Tolerances, as the largest absolute difference over the largest absolute reference value:

| kernel | float32 | float16 | bfloat16 |
|---|---|---|---|
| quantize_kv (codes, scales, zero points) | identical | identical | identical |
| dequantize_kv, apply_rope | identical | identical | 2**-5 |
| rms_norm | 1e-6 | identical | 2**-5 |
| adaln_modulate (fused: one rounding instead of the reference's three) | 1e-6 | 2e-3 | 2**-5 |
| quantized_attention (online softmax, another summation order) | 4e-6 | 2e-3 | 5e-2 |

bfloat16 is looser because the interpreter truncates float32 to bfloat16 where a GPU rounds to nearest (Triton
3.x ``_convert_float``), and it has no bfloat16 arithmetic: the kernels compute in float32 and convert only when
loading and storing, as they do on a GPU.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import logging  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from unittest import mock  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from fewstep import kernels  # noqa: E402
from fewstep.engine.backends import Backends  # noqa: E402
from fewstep.engine.causal import CausalConfig, open_session  # noqa: E402
from fewstep.engine.handle import open_model  # noqa: E402
from fewstep.engine.run import open_run  # noqa: E402
from fewstep.kernels import dispatch, kv_quant, norms, rope  # noqa: E402

pytest.importorskip(
    "triton", reason="the Triton kernels are tested with Triton's interpreter (pip install triton)"
)

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TOL = {  # kernel -> tolerance per dtype (max |triton - reference| / max |reference|)
    "dequantize_kv": {torch.float32: 0.0, torch.float16: 0.0, torch.bfloat16: 2**-5},
    "apply_rope": {torch.float32: 0.0, torch.float16: 0.0, torch.bfloat16: 2**-5},
    "rms_norm": {torch.float32: 1e-6, torch.float16: 0.0, torch.bfloat16: 2**-5},
    "adaln_modulate": {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 2**-5},
    "quantized_attention": {torch.float32: 4e-6, torch.float16: 2e-3, torch.bfloat16: 5e-2},
}


@pytest.fixture(scope="module")
def tk():
    kernels.enable_triton_interpreter()
    module = kernels.load_triton_kernels()
    assert type(module._rms_norm_kernel).__name__ == "InterpretedFunction"
    return module


def _rand(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _assert_matches(kernel, out, ref):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    err = (out.double() - ref.double()).abs().max().item() / ref.double().abs().max().item()
    assert err <= TOL[kernel][ref.dtype], f"{kernel} {ref.dtype}: relative error {err:.2e}"


# -- each Triton kernel equals its reference -------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("table_dtype", (torch.float32, torch.float64))
def test_apply_rope_writes_head_major(tk, dtype, table_dtype):
    """``head_major=True``: the same values, laid out [B, H, L, D] in memory (its transpose is contiguous), from
    the Triton kernel and from both paths of the reference (complex multiply, and the real one under compile)."""
    x = _rand(2, 9, 3, 32, seed=10).to(dtype)[:, 1:7]
    angles = (3 * _rand(1, 6, 1, 16, seed=11)).to(table_dtype)
    cos, sin = angles.cos(), angles.sin()
    token_major = rope.apply_rope(x, cos, sin)
    assert not rope.is_head_major(token_major)
    reference = rope.apply_rope(x, cos, sin, True)
    assert rope.is_head_major(reference) and torch.equal(reference, token_major)  # bit for bit
    with mock.patch.object(rope, "_complex_path", return_value=False):  # the real formulation
        real, real_token_major = rope.apply_rope(x, cos, sin, True), rope.apply_rope(x, cos, sin)
    assert rope.is_head_major(real) and torch.equal(real, real_token_major)
    triton_out = tk.apply_rope(x, cos, sin, True)
    assert triton_out.shape == x.shape and triton_out.dtype == x.dtype and rope.is_head_major(triton_out)
    _assert_matches("apply_rope", triton_out, token_major)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize("head_dim", (32, 40, 6))
def test_quantize_and_dequantize_kv(tk, dtype, bits, head_dim):
    x = (_rand(2, 5, 3, head_dim, seed=head_dim, scale=2.0) + _rand(2, 5, 3, 1, seed=1)).to(dtype)
    x[0, 0, 0] = 0.7  # a constant row: scale 0
    ref = kv_quant.quantize_kv(x, bits)
    out = tk.quantize_kv(x, bits)
    for o, r in zip(out, ref):
        assert o.dtype == r.dtype and torch.equal(o, r)
    _assert_matches(
        "dequantize_kv", tk.dequantize_kv(*ref, bits, dtype), kv_quant.dequantize_kv(*ref, bits, dtype)
    )


def test_int8_rows_of_odd_width(tk):
    x = _rand(4, 3, 7, seed=5)
    for o, r in zip(tk.quantize_kv(x, 8), kv_quant.quantize_kv(x, 8)):
        assert torch.equal(o, r)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 7, 3, 40), (1, 12, 64)])
def test_rms_norm(tk, dtype, shape):
    x = _rand(*shape, seed=2, scale=3.0).to(dtype)
    weight = 1 + 0.1 * _rand(shape[-1], seed=3)
    _assert_matches("rms_norm", tk.rms_norm(x, weight, 1e-6), norms.rms_norm(x, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("groups", (1, 3))
def test_adaln_modulate(tk, dtype, groups):
    x = _rand(2, 12, 48, seed=4, scale=2.0).to(dtype)
    shift = _rand(2, groups, 48, seed=5).to(dtype)
    scale = (0.3 * _rand(2, groups, 48, seed=6)).to(dtype)
    _assert_matches(
        "adaln_modulate",
        tk.adaln_modulate(x, shift, scale, 1e-6),
        norms.adaln_modulate(x, shift, scale, 1e-6),
    )


def test_adaln_modulate_float32_modulation_of_bf16_tokens(tk):
    """Wan modulates in float32: the output takes the promoted dtype."""
    x = _rand(1, 6, 32, seed=7).to(torch.bfloat16)
    shift, scale = _rand(1, 2, 32, seed=8), _rand(1, 2, 32, seed=9)
    out, ref = tk.adaln_modulate(x, shift, scale, 1e-6), norms.adaln_modulate(x, shift, scale, 1e-6)
    assert out.dtype == ref.dtype == torch.float32
    assert (
        out - ref
    ).abs().max() <= 2**-7 * ref.abs().max()  # LayerNorm rounded once to bf16 by the reference


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("table_dtype", (torch.float32, torch.float64))
@pytest.mark.parametrize("table_batch", (1, 2))
def test_apply_rope(tk, dtype, table_dtype, table_batch):
    x = _rand(2, 9, 3, 32, seed=10).to(dtype)[:, 1:7]  # a view (strided over the batch)
    angles = (3 * _rand(table_batch, 6, 1, 16, seed=11)).to(table_dtype)
    cos, sin = angles.cos(), angles.sin()
    _assert_matches("apply_rope", tk.apply_rope(x, cos, sin), rope.apply_rope(x, cos, sin))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize("head_dim,full,rotate", [(32, 19, True), (64, 19, False), (32, 0, True)])
def test_quantized_attention(tk, dtype, bits, head_dim, full, rotate):
    """Dequantization (and RoPE of the quantized keys) inside the kernel equals dequantizing first."""
    q = _rand(2, 21, 3, head_dim, seed=12).to(dtype)
    k, v = _rand(2, full, 3, head_dim, seed=13).to(dtype), _rand(2, full, 3, head_dim, seed=14).to(dtype)
    k_quant = kv_quant.quantize_kv(_rand(2, 37, 3, head_dim, seed=15), bits)
    v_quant = kv_quant.quantize_kv(_rand(2, 37, 3, head_dim, seed=16), bits)
    cos = sin = None
    if rotate:
        angles = 3 * _rand(37, head_dim // 2, seed=17).double()
        cos, sin = angles.cos(), angles.sin()
    inputs = kv_quant.QuantizedAttentionInputs(q, k, v, k_quant, v_quant, cos, sin, bits)
    _assert_matches(
        "quantized_attention", tk.quantized_attention(inputs), kv_quant.quantized_attention(inputs)
    )


# -- custom ops: opaque to torch.compile, fake implementations ----------------------------------------------------
def _op_inputs():
    x = _rand(2, 5, 3, 32, seed=20)
    kq, vq = kv_quant.quantize_kv(x, 4), kv_quant.quantize_kv(x * 2, 4)
    angles = _rand(1, 5, 1, 16, seed=21)
    return {
        "quantize_kv": (x, 8),
        "dequantize_kv": (*kq, 4, torch.float32),
        "quantized_attention": (x, x[:, :2], x[:, :2], *kq, *vq, None, None, 4),
        "rms_norm": (x, _rand(32, seed=22), 1e-6),
        "adaln_modulate": (x[0], _rand(5, 1, 32, seed=23), _rand(5, 1, 32, seed=24), 1e-6),
        "apply_rope": (x, angles.cos(), angles.sin()),
    }


@pytest.mark.parametrize("name", ["quantize_kv", "dequantize_kv", "quantized_attention", "rms_norm",
                                  "adaln_modulate", "apply_rope"])  # fmt: skip
def test_custom_ops_pass_opcheck(tk, name):
    kernels.dispatch.load_ops()
    torch.library.opcheck(
        getattr(torch.ops.fewstep, name), _op_inputs()[name], test_utils=("test_schema", "test_faketensor")
    )


def test_torch_compile_keeps_each_kernel_as_one_opaque_call(tk):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def block(x, weight, shift, scale, cos, sin):
        h = kernels.adaln_modulate(x.flatten(2), shift, scale, 1e-6, mode="triton").unflatten(2, (3, 32))
        return (
            kernels.apply_rope(kernels.rms_norm(h, weight, 1e-6, mode="triton"), cos, sin, mode="triton") * 2
        )

    x = _rand(2, 5, 3, 32, seed=30)
    angles = _rand(1, 5, 1, 16, seed=31)
    args = (
        x,
        _rand(32, seed=32),
        _rand(2, 1, 96, seed=33),
        _rand(2, 1, 96, seed=34),
        angles.cos(),
        angles.sin(),
    )
    eager = block(*args)
    torch._dynamo.reset()
    compiled = torch.compile(block, backend=backend, fullgraph=True)(*args)
    assert len(graphs) == 1
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert [t.removesuffix(".default") for t in targets if t.startswith("fewstep.")] == [
        "fewstep.adaln_modulate",
        "fewstep.rms_norm",
        "fewstep.apply_rope",
    ]
    assert torch.equal(compiled, eager)


# -- the dispatcher ------------------------------------------------------------------------------------------------
def test_cpu_uses_the_references_and_importing_does_not_import_triton():
    code = (
        "import sys, torch; import fewstep.kernels as k; from fewstep.engine.run import environment_kernel_mode; "
        "x = torch.randn(2, 4, 8); w = torch.ones(8); "
        "print(environment_kernel_mode(), k.uses_triton('rms_norm', 'auto', x), torch.equal(k.rms_norm(x, w, 1e-6), "
        "k.norms.rms_norm(x, w, 1e-6)), 'triton' in sys.modules)"
    )
    env = {**os.environ, "FEWSTEP_KERNELS": "reference"}
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["reference", "False", "True", "False"]
    assert not kernels.uses_triton("rms_norm", "auto", torch.zeros(1))  # auto: Triton only on CUDA


def test_modes_and_a_failing_kernel_falling_back_to_its_reference_for_the_rest_of_the_run(
    monkeypatch, caplog
):
    with pytest.raises(ValueError, match="unknown kernel mode 'fast'"):
        kernels.check_mode("fast")
    assert kernels.uses_triton("rms_norm", "triton", torch.zeros(1))
    assert not kernels.uses_triton("rms_norm", "reference", torch.zeros(1))

    calls = []

    class Broken:
        def rms_norm(self, *args):
            calls.append(args)
            raise RuntimeError("no kernel image for this GPU")

    monkeypatch.setattr(dispatch, "_warned", set())
    monkeypatch.setattr(dispatch, "load_ops", Broken)
    monkeypatch.setattr(dispatch, "triton_device", lambda tensor: True)  # as on a GPU with Triton
    x, w = _rand(2, 8, seed=40), _rand(8, seed=41)
    caplog.set_level(logging.DEBUG, logger=dispatch.log.name)
    first, second = Backends(), Backends()  # two runs (open_run builds each run's Backends)
    for _ in range(3):  # auto mode tries the kernel once in a run, then uses the reference for the rest of it
        assert torch.equal(first.rms_norm(x, w, 1e-6), norms.rms_norm(x, w, 1e-6))
    assert len(calls) == 1
    assert first.kernel_fallbacks.failed == {"rms_norm": "RuntimeError: no kernel image for this GPU"}
    assert first.kernel_fallbacks.notes() == [
        "Triton kernel rms_norm failed (RuntimeError: no kernel image for this GPU); this run used its PyTorch "
        "reference"
    ]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage() for r in warnings] == [
        "Triton kernel rms_norm failed (RuntimeError: no kernel image for this GPU); this run uses its PyTorch "
        "reference"
    ]
    # the next run decides afresh: it tries the kernel again; the process logged the warning once already
    assert torch.equal(second.rms_norm(x, w, 1e-6), norms.rms_norm(x, w, 1e-6))
    assert len(calls) == 2 and "rms_norm" in second.kernel_fallbacks
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    assert first == second and hash(first) == hash(
        second
    )  # the record is not a choice: equal backends stay equal
    with pytest.raises(RuntimeError, match="no kernel image"):
        kernels.rms_norm(x, w, 1e-6, mode="triton")


def test_a_failing_kv_quantization_in_a_sessions_cache_falls_back_in_that_run(monkeypatch):
    """The KV cache quantizes the frames that age out (in ``begin``, outside any forward) with the run's backends:
    a kernel that fails there lands in that run's record, and the next run's record starts empty."""

    class Broken:  # every Triton kernel fails, as on a GPU the build does not support
        def __getattr__(self, kernel):
            def failing(*args):
                raise RuntimeError("no kernel image for this GPU")

            return failing

    monkeypatch.setattr(dispatch, "_warned", set())
    monkeypatch.setattr(dispatch, "load_ops", Broken)
    monkeypatch.setattr(dispatch, "triton_device", lambda tensor: True)  # as on a GPU with Triton
    wan = open_model("dummy:wan-tiny", dtype=torch.float32, device="cpu", seed=2)
    config = CausalConfig(chunk_frames=1, window_frames=3, steps=2, kv_dtype="int8", keep_recent_chunks=0)
    first, _ = open_session(wan, _rand(1, 5, 4096, seed=62), 32, 48, config, 3)
    first.run(3)
    assert (
        first.cache.frames_quantized == 2
    )  # frames 0 and 1, quantized by the cache when chunks 2 and 3 begin
    assert first.cache.backends is first.backends  # the run's
    record = first.backends.kernel_fallbacks
    assert record.failed["quantize_kv"] == "RuntimeError: no kernel image for this GPU"
    second, _ = open_session(wan, _rand(1, 5, 4096, seed=62), 32, 48, config, 3)
    assert "quantize_kv" not in second.backends.kernel_fallbacks  # a new run decides afresh


def test_each_run_starts_with_no_kernel_fallbacks():
    handle = open_model("dummy:flux-tiny")
    first, second = open_run(handle), open_run(handle)
    assert first.backends.kernel_fallbacks is not second.backends.kernel_fallbacks
    assert first.backends.kernel_fallbacks.failed == {}


# -- the engine through the dispatcher -----------------------------------------------------------------------------
def test_references_are_the_engine_formulas_bit_for_bit():
    """On the CPU the engine runs the references: the arithmetic the models had before the dispatcher."""
    from fewstep.engine.models.flux_layers import modulate
    from fewstep.engine.models.wan_layers import WanLayerNorm, modulate_frames

    for dtype in (torch.float32, torch.bfloat16):
        x, w = _rand(2, 6, 3, 64, seed=50, scale=3.0).to(dtype), 1 + 0.1 * _rand(64, seed=51)
        xf = x.float()
        flux_rms = (xf * torch.rsqrt(torch.mean(xf * xf, dim=-1, keepdim=True) + 1e-6)).to(dtype) * w.to(
            dtype
        )
        wan_rms = (xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + 1e-6)).type_as(x) * w.to(dtype)
        assert torch.equal(norms.rms_norm(x, w, 1e-6), flux_rms) and torch.equal(flux_rms, wan_rms)
        angles = _rand(1, 6, 1, 32, seed=52).double()
        pairs = x.double().unflatten(-1, (-1, 2))
        rotated = torch.stack(
            (angles.cos() * pairs[..., 0] - angles.sin() * pairs[..., 1],
             angles.sin() * pairs[..., 0] + angles.cos() * pairs[..., 1]), dim=-1,
        ).flatten(-2).to(dtype)  # fmt: skip
        assert torch.equal(rope.apply_rope(x, angles.cos(), angles.sin()), rotated)
        tokens, shift, scale = x.flatten(2), _rand(2, 1, 192, seed=53).to(dtype), _rand(2, 1, 192, seed=54)
        norm = torch.nn.LayerNorm(192, elementwise_affine=False, eps=1e-6)
        scale = scale.to(dtype)
        assert torch.equal(
            norms.adaln_modulate(tokens, shift, scale, 1e-6), modulate(norm(tokens), shift, scale)
        )
    x = _rand(2, 12, 64, seed=55)
    shift, scale = _rand(2, 3, 1, 64, seed=56), _rand(2, 3, 1, 64, seed=57)
    assert torch.equal(
        norms.adaln_modulate(x, shift.squeeze(2), scale.squeeze(2), 1e-6),
        modulate_frames(WanLayerNorm(64, 1e-6)(x), shift, scale, 3),
    )


def test_models_with_triton_kernels_equal_the_references(tk):
    from fewstep.engine import load_dit

    wan = load_dit("dummy:wan-tiny", dtype=torch.float32, device="cpu", seed=2)
    x, t = _rand(1, 16, 2, 4, 6, seed=60), torch.full((1,), 700.0)
    ctx = _rand(1, 5, 4096, seed=61)
    fast = wan(x, t, ctx, backends=Backends(kernel_mode="triton"))
    assert (fast - wan(x, t, ctx, backends=Backends(kernel_mode="reference"))).abs().max() <= 1e-5


@pytest.mark.slow
def test_causal_stream_with_triton_kernels_equals_the_references(tk):
    """The whole int8 stream through the Triton kernels: RMSNorm, adaLN, RoPE, KV quantization and the attention
    that dequantizes (and rotates) the quantized keys inside the kernel."""
    from fewstep.engine import open_model
    from fewstep.engine.causal import CausalConfig, open_session
    from fewstep.engine.run import RunOptions

    wan = open_model("dummy:wan-tiny", dtype=torch.float32, device="cpu", seed=2)
    ctx = _rand(1, 5, 4096, seed=62)
    config = CausalConfig(chunk_frames=1, window_frames=3, steps=2, kv_dtype="int8", keep_recent_chunks=0)

    def stream(mode: str):
        session, _ = open_session(wan, ctx, 32, 48, config, 3, options=RunOptions(kernel_mode=mode))
        return torch.cat([c.latents for c in session.run(3)], dim=2), session

    reference, _ = stream("reference")
    fast, session = stream("triton")
    assert session.cache.frames_quantized == 2  # frames 0 and 1, read quantized by chunks 1 and 2
    assert (fast - reference).abs().max() <= 1e-5
