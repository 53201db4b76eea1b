"""LoRA on the engine's models: strength 0 is the base model exactly, chained LoRAs add up, fp8 storage keeps the
delta within a stated bound, the base handle is never changed, merges stay in place, bad input is refused.

The LoRA files are written here in ComfyUI's official naming (``diffusion_model.<module>.lora_up.weight`` /
``lora_down.weight`` / ``alpha``) on the tiny dummy presets, so the expected weights are computed by hand."""

from __future__ import annotations

import pytest
import torch
from conftest import make_cond
from safetensors.torch import save_file

from fewstep.engine import InputError, open_model, sample_latent
from fewstep.engine.causal import CausalConfig
from fewstep.engine.causal.recipe import open_session
from fewstep.engine.errors import CheckpointError
from fewstep.engine.lora import apply_lora, base_state_dict, merged_weights
from fewstep.engine.ops import Linear
from fewstep.engine.run import open_run

IMAGE_LATENTS = {
    "flux-tiny": torch.zeros(1, 16, 8, 8),
    "flux2-tiny": torch.zeros(1, 128, 4, 4),
    "zimage-tiny": torch.zeros(1, 16, 8, 8),
}
PRESETS = [*IMAGE_LATENTS, "wan-tiny"]
WAN_CONFIG = CausalConfig(chunk_frames=2, window_frames=5, sink_frames=1, steps=2)


def linear_modules(model) -> list[str]:
    return sorted(n for n, m in model.named_modules() if isinstance(m, Linear) and m.weight.ndim == 2)


def lora_tensors(model, rank=4, seed=0, scale=0.05, modules=None, alpha=None):
    """(file entries in official names, {weight key: the float32 delta at strength 1}) for ``modules`` (every
    linear by default): ``up`` / ``down`` scaled so the delta is ``scale`` times the weight's typical size."""
    g = torch.Generator().manual_seed(seed)
    entries, deltas = {}, {}
    for name in modules or linear_modules(model):
        weight = model.get_parameter(f"{name}.weight")
        out_dim, in_dim = weight.shape
        size = float(weight.detach().float().abs().mean()) * scale
        up = torch.randn(out_dim, rank, generator=g) * size**0.5
        down = torch.randn(rank, in_dim, generator=g) * size**0.5 / rank**0.5
        entries[f"diffusion_model.{name}.lora_up.weight"] = up
        entries[f"diffusion_model.{name}.lora_down.weight"] = down
        factor = 1.0
        if alpha is not None:
            entries[f"diffusion_model.{name}.alpha"] = torch.tensor(float(alpha))
            factor = alpha / rank
        deltas[f"{name}.weight"] = factor * (up @ down)
    return entries, deltas


def write_lora(path, model, **kwargs) -> dict[str, torch.Tensor]:
    """Write a LoRA file at ``path``; returns its float32 deltas by weight key."""
    entries, deltas = lora_tensors(model, **kwargs)
    save_file({k: v.contiguous() for k, v in entries.items()}, str(path))
    return deltas


def handle_for(preset, **kwargs):
    return open_model(f"dummy:{preset}", device="cpu", dtype=torch.float32, **kwargs)


def image_cond(handle, seed=1):
    from fewstep.engine import TextCondition

    if handle.family.name == "flux":
        return make_cond(handle.params, tokens=5, seed=seed)
    g = torch.Generator().manual_seed(seed)
    width = handle.family.image.context_dim(handle.params)
    return TextCondition(torch.randn(1, 5, width, generator=g), None, 4.0)


WAN_CONTEXT = torch.randn(1, 6, 4096, generator=torch.Generator().manual_seed(1))


def output(handle, preset):
    """What the handle computes: a 2-step image sample, or the first chunk of a causal video session."""
    if preset == "wan-tiny":
        session, _ = open_session(handle, WAN_CONTEXT, 32, 32, WAN_CONFIG, seed=3)
        return next(iter(session.chunks(1))).latents
    latent, _ = sample_latent(handle, [image_cond(handle)], IMAGE_LATENTS[preset], steps=2, seed=3)
    return latent


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def flux():
    return handle_for("flux-tiny")


# -- strength 0, chaining, the base handle --------------------------------------------------------------------------
@pytest.mark.parametrize("preset", PRESETS)
def test_strength_zero_is_the_base_model_exactly(preset, tmp_path):
    handle = handle_for(preset)
    base_out, base_weights = output(handle, preset), weights(handle.model)
    path = tmp_path / "a.safetensors"
    write_lora(path, handle.model)
    zero = apply_lora(handle, path, 0.0)
    out = output(zero, preset)
    assert torch.equal(out, base_out)
    assert all(torch.equal(v, base_weights[k]) for k, v in handle.model.state_dict().items())
    assert merged_weights(handle.model).backup_bytes() == 0  # nothing was even copied


@pytest.mark.parametrize("preset", PRESETS)
def test_two_chained_loras_equal_one_file_holding_both_and_the_manual_sum(preset, tmp_path):
    handle = handle_for(preset)
    base = weights(handle.model)
    d_a = write_lora(tmp_path / "a.safetensors", handle.model, seed=1, alpha=2.0)
    d_b = write_lora(tmp_path / "b.safetensors", handle.model, seed=2, rank=2)
    s_a, s_b = 0.7, -0.4
    chained = apply_lora(apply_lora(handle, tmp_path / "a.safetensors", s_a), tmp_path / "b.safetensors", s_b)
    # one file of rank 4 + 2 whose up @ down is s_a dA + s_b dB (no alpha: scale 1); from the base weights' sizes
    entries_a, _ = lora_tensors(handle.model, seed=1, alpha=2.0)
    entries_b, _ = lora_tensors(handle.model, seed=2, rank=2)
    chained_out = output(chained, preset)
    chained_weights = weights(handle.model)
    both = {}
    for key in entries_a:
        if key.endswith("lora_up.weight"):
            both[key] = torch.cat((entries_a[key] * (s_a * 2.0 / 4), entries_b[key] * s_b), dim=1)
        elif key.endswith("lora_down.weight"):
            both[key] = torch.cat((entries_a[key], entries_b[key]), dim=0)
    save_file(both, str(tmp_path / "both.safetensors"))
    one = apply_lora(handle, tmp_path / "both.safetensors", 1.0)
    one_out = output(one, preset)
    for key, w in handle.model.state_dict().items():
        manual = base[key] + s_a * d_a[key] + s_b * d_b[key] if key in d_a else base[key]
        assert (chained_weights[key] - manual).abs().max() <= 1e-6, key
        assert (w - chained_weights[key]).abs().max() <= 1e-6, key
    assert (one_out - chained_out).abs().max() <= 1e-4 * chained_out.abs().max()


def test_the_base_handle_is_unchanged_and_a_base_run_after_a_lora_run_is_a_fresh_base_run(flux, tmp_path):
    fresh_weights, fresh_out = weights(flux.model), output(flux, "flux-tiny")
    write_lora(tmp_path / "a.safetensors", flux.model)
    lora = apply_lora(flux, tmp_path / "a.safetensors", 1.0)
    assert flux.loras == () and len(lora.loras) == 1 and lora.model is flux.model
    assert all(
        torch.equal(v, fresh_weights[k]) for k, v in flux.model.state_dict().items()
    )  # nothing merged yet
    lora_out = output(lora, "flux-tiny")
    assert not torch.equal(lora_out, fresh_out)
    assert all(torch.equal(v, fresh_weights[k]) for k, v in base_state_dict(flux.model).items())
    assert torch.equal(output(flux, "flux-tiny"), fresh_out)
    assert all(torch.equal(v, fresh_weights[k]) for k, v in flux.model.state_dict().items())
    assert merged_weights(flux.model).backup_bytes() == 0  # the base run released the backups


def test_a_video_session_of_a_lora_handle_continued_after_a_base_run_equals_an_uninterrupted_one(tmp_path):
    wan = handle_for("wan-tiny")
    write_lora(tmp_path / "w.safetensors", wan.model, scale=0.3)
    lora = apply_lora(wan, tmp_path / "w.safetensors", 1.0)
    session, _ = open_session(lora, WAN_CONTEXT, 32, 32, WAN_CONFIG, seed=3)
    uninterrupted = [c.latents for c in session.chunks(2)]
    session, _ = open_session(lora, WAN_CONTEXT, 32, 32, WAN_CONFIG, seed=3)
    got = [c.latents for c in session.chunks(1)]
    base_chunk = output(wan, "wan-tiny")  # the base handle runs the shared model in between
    got += [c.latents for c in session.chunks(1)]
    assert torch.equal(torch.cat(got, 2), torch.cat(uninterrupted, 2))
    assert not torch.equal(base_chunk, uninterrupted[0])


def test_a_file_rewritten_at_the_same_path_is_merged_again_even_if_only_its_last_element_changed(tmp_path):
    handle = handle_for("flux-tiny")
    base = weights(handle.model)
    path = tmp_path / "a.safetensors"
    entries, _ = lora_tensors(handle.model, seed=1)
    save_file(entries, str(path))
    output(apply_lora(handle, path, 1.0), "flux-tiny")
    key = next(k for k in sorted(entries) if k.endswith("lora_down.weight"))
    entries[key] = entries[key].clone()
    entries[key].view(-1)[-1] += 0.5
    save_file(entries, str(path))
    output(apply_lora(handle, path, 1.0), "flux-tiny")
    name = key.removeprefix("diffusion_model.").removesuffix(".lora_down.weight")
    up = entries[f"diffusion_model.{name}.lora_up.weight"]
    expected = base[f"{name}.weight"] + up @ entries[key]
    assert (handle.model.get_parameter(f"{name}.weight") - expected).abs().max() <= 1e-6


# -- in place, restore, nn.Module -----------------------------------------------------------------------------------
def test_the_merge_is_in_place_and_restore_releases_the_backups(flux, tmp_path):
    before = {k: (p.data_ptr(), p.dtype) for k, p in flux.model.named_parameters()}
    base = weights(flux.model)
    deltas = write_lora(tmp_path / "a.safetensors", flux.model)
    lora = apply_lora(flux, tmp_path / "a.safetensors", 0.5)
    output(lora, "flux-tiny")
    state = merged_weights(flux.model)
    assert {k: (p.data_ptr(), p.dtype) for k, p in flux.model.named_parameters()} == before
    assert state.backup_bytes() == sum(base[k].numel() * 4 for k in deltas)
    assert all(state.backups[k].device.type == "cpu" for k in deltas)
    for key, p in flux.model.named_parameters():
        assert (p - (base[key] + 0.5 * deltas[key] if key in deltas else base[key])).abs().max() <= 1e-6
    merges = state.merges
    output(apply_lora(flux, tmp_path / "a.safetensors", 0.5), "flux-tiny")  # the same patches: no merge
    assert state.merges == merges
    state.restore(flux.model)
    assert state.backup_bytes() == 0 and state.backups == {}
    assert all(torch.equal(v, base[k]) for k, v in flux.model.state_dict().items())
    assert {k: (p.data_ptr(), p.dtype) for k, p in flux.model.named_parameters()} == before


def test_apply_lora_on_a_bare_module_returns_a_merged_copy_and_leaves_the_module(flux, tmp_path):
    base = weights(flux.model)
    deltas = write_lora(tmp_path / "a.safetensors", flux.model)
    merged = apply_lora(flux.model, tmp_path / "a.safetensors", 0.8)
    assert merged is not flux.model
    assert all(torch.equal(v, base[k]) for k, v in flux.model.state_dict().items())
    for key, w in merged.state_dict().items():
        assert (w - (base[key] + 0.8 * deltas[key] if key in deltas else base[key])).abs().max() <= 1e-6


@pytest.mark.parametrize("strength", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_strength_is_refused_for_a_file_and_for_a_patch(flux, tmp_path, strength):
    write_lora(tmp_path / "a.safetensors", flux.model)
    message = f"input 'strength': {strength} is not a finite number"
    with pytest.raises(CheckpointError, match=message):
        apply_lora(flux, tmp_path / "a.safetensors", strength)
    patch = apply_lora(flux, tmp_path / "a.safetensors", 1.0).loras[0]
    with pytest.raises(CheckpointError, match=message):
        apply_lora(flux, patch, strength)


def test_a_merge_whose_backups_do_not_fit_host_memory_is_refused_and_changes_nothing(tmp_path, monkeypatch):
    handle = handle_for("flux-tiny")
    modules = linear_modules(handle.model)
    write_lora(tmp_path / "a.safetensors", handle.model, modules=modules[:10], seed=1)
    write_lora(tmp_path / "b.safetensors", handle.model, modules=modules[10:], seed=2)
    a = apply_lora(handle, tmp_path / "a.safetensors", 1.0)
    b = apply_lora(handle, tmp_path / "b.safetensors", 1.0)
    a_out = output(a, "flux-tiny")
    a_weights = weights(handle.model)
    monkeypatch.setenv("FEWSTEP_MEMORY_LIMIT_GB", "0.000001")  # about 1 KiB of host memory
    with pytest.raises(InputError) as err:
        open_run(b)  # where every run merges (a sampler's own memory check would refuse first at this limit)
    assert str(err.value).startswith("input 'lora': this needs about ")
    assert "base values of the LoRA-patched weights" in str(err.value)
    assert "refused before allocating. Use a LoRA that patches fewer layers, or free host memory" in str(
        err.value
    )
    assert all(torch.equal(v, a_weights[k]) for k, v in handle.model.state_dict().items())  # A still merged
    monkeypatch.delenv("FEWSTEP_MEMORY_LIMIT_GB")
    assert torch.equal(output(a, "flux-tiny"), a_out)


# -- fp8 storage ---------------------------------------------------------------------------------------------------
def _fp8_errors(tmp_path):
    """Weights and outputs of flux-tiny in fp32 and fp8 (e4m3), each with and without the same LoRA."""
    fp32 = handle_for("flux-tiny")
    fp8 = handle_for("flux-tiny", weight_dtype=torch.float8_e4m3fn)
    deltas = write_lora(tmp_path / "a.safetensors", fp32.model, scale=0.05)
    keys = sorted(deltas)
    get = lambda h: {k: h.model.get_parameter(k).detach().float().clone() for k in keys}  # noqa: E731
    w32, w8, out32, out8 = get(fp32), get(fp8), output(fp32, "flux-tiny"), output(fp8, "flux-tiny")
    l32, l8 = (
        apply_lora(fp32, tmp_path / "a.safetensors", 1.0),
        apply_lora(fp8, tmp_path / "a.safetensors", 1.0),
    )
    lout32, lout8 = output(l32, "flux-tiny"), output(l8, "flux-tiny")
    lw32, lw8 = get(fp32), get(fp8)
    assert {fp8.model.get_parameter(k).dtype for k in keys} == {torch.float8_e4m3fn}  # stored as fp8 again

    def err(a, b):  # (mean, max) abs difference over every patched weight
        diff = torch.cat([(a[k] - b[k]).flatten() for k in keys]).abs()
        return float(diff.mean()), float(diff.max())

    delta = {k: lw32[k] - w32[k] for k in keys}
    return {
        "weights_base": err(w8, w32),  # fp8's own error
        "weights_added": err(lw8, {k: w8[k] + delta[k] for k in keys}),  # what the merge's rounding adds
        "weights_lora": err(lw8, lw32),  # fp8 + LoRA vs fp32 + LoRA
        "delta": err(delta, {k: torch.zeros_like(w32[k]) for k in keys}),
        "out_base": (float((out8 - out32).abs().mean()), float((out8 - out32).abs().max())),
        "out_lora": (float((lout8 - lout32).abs().mean()), float((lout8 - lout32).abs().max())),
    }  # fmt: skip


def test_fp8_with_a_lora_stays_within_the_quantization_error_of_fp8_itself(tmp_path):
    """The merge starts from the fp8 weights and rounds once more (stochastically), so fp8 + LoRA's error against
    fp32 + LoRA is fp8's own error plus that rounding's. Stochastic rounding's error is 4/3 of round-to-nearest's
    on average (gap/3 vs gap/4) and below one fp8 step at most (vs half a step): the rounding added is bound by
    1.5x the mean and 2x the max of fp8's own error, and the total by 2x its mean, weights and output alike
    (measured on flux-tiny: rounding added 1.13x mean / 1.89x max; total 1.52x mean on the weights, 1.50x mean /
    1.72x max on the output)."""
    e = _fp8_errors(tmp_path)
    base_mean, base_max = e["weights_base"]
    assert e["weights_added"][0] <= 1.5 * base_mean and e["weights_added"][1] <= 2.0 * base_max, e
    assert e["weights_lora"][0] <= 2.0 * base_mean, e
    assert e["out_lora"][0] <= 2.0 * e["out_base"][0] and e["out_lora"][1] <= 2.5 * e["out_base"][1], e
    assert e["delta"][0] > 0.5 * base_mean  # the LoRA is not negligible next to the quantization error


def test_fp8_stochastic_rounding_keeps_a_delta_below_one_step_in_expectation(tmp_path):
    """A constant delta of 1/8 of the typical fp8 step: round-to-nearest drops it, stochastic rounding keeps it
    in the mean over a weight's elements."""
    fp8 = handle_for("flux-tiny", weight_dtype=torch.float8_e4m3fn)
    name = "double_blocks.0.img_mlp.0"
    weight = fp8.model.get_parameter(f"{name}.weight")
    base = weight.detach().float().clone()
    step = float(base.abs().mean()) / 8  # e4m3: 3 mantissa bits, a step of 1/8 to 1/16 of the value
    c = step / 8
    out_dim, in_dim = weight.shape
    entries = {
        f"diffusion_model.{name}.lora_up.weight": torch.full((out_dim, 1), c**0.5),
        f"diffusion_model.{name}.lora_down.weight": torch.full((1, in_dim), c**0.5),
    }
    save_file(entries, str(tmp_path / "c.safetensors"))
    output(apply_lora(fp8, tmp_path / "c.safetensors", 1.0), "flux-tiny")
    stochastic = float((weight.detach().float() - base).mean())
    nearest = float(((base + c).to(torch.float8_e4m3fn).float() - base).mean())
    assert abs(stochastic - c) <= 0.1 * c, (stochastic, c)
    assert abs(nearest) <= 0.5 * c, (nearest, c)


# -- compile and CUDA graphs (emulated on the CPU) -------------------------------------------------------------------
def _run_flux(handle):
    return sample_latent(
        handle, [make_cond(handle.params, tokens=6, seed=1)], torch.zeros(1, 16, 8, 8), seed=2
    )


@pytest.mark.parametrize(
    "weight_dtype", [None, pytest.param(torch.float8_e4m3fn, marks=pytest.mark.slow)], ids=["fp32", "fp8"]
)
def test_a_compiled_handle_runs_a_lora_and_strength_changes_without_recompiling(tmp_path, weight_dtype):
    """The merge writes the same tensors in their dtype (fp8 too: rounded back): dynamo guards on their shapes
    and dtypes only (weights are graph inputs), so applying, changing and removing a LoRA after the first
    compiled run compiles nothing."""
    from fewstep.engine.compile import attach_compile

    torch._dynamo.reset()  # counts independent of other tests' compilations
    handle = handle_for("flux-tiny", weight_dtype=weight_dtype)
    write_lora(tmp_path / "a.safetensors", handle.model, scale=0.2)
    compiled = attach_compile(handle, "regional", backend="aot_eager")
    _, first = _run_flux(compiled)
    assert first.compile.frames_compiled > 0
    refs = {}
    for strength in (1.0, -0.5, 0.0):  # apply, change the strength, strength 0 (the base weights)
        refs[strength], _ = _run_flux(apply_lora(handle, tmp_path / "a.safetensors", strength))  # eager
        out, report = _run_flux(apply_lora(compiled, tmp_path / "a.safetensors", strength))
        assert (out - refs[strength]).abs().max() <= 1e-4, strength
        assert (report.compile.frames_compiled, report.compile.recompiles) == (0, 0), report.summary()
    assert (refs[1.0] - refs[0.0]).abs().max() > 1e-2  # the LoRA matters
    base_ref, _ = _run_flux(handle)
    base_out, report = _run_flux(compiled)  # the LoRA removed: the compiled base handle
    assert (base_out - base_ref).abs().max() <= 1e-4 and report.compile.recompiles == 0


def test_a_captured_graph_replays_the_merged_weights_without_recapture(tmp_path):
    """A CUDA graph reads the weights at their addresses: the in-place merge is seen by the next replay."""
    from compile_doubles import EMULATED

    from fewstep.engine.compile import attach_compile

    handle = handle_for("flux-tiny")
    write_lora(tmp_path / "a.safetensors", handle.model, scale=0.2)
    graphed = attach_compile(handle, "off", "whole", graph_segments=EMULATED)
    _run_flux(graphed)
    for strength in (1.0, 0.3):
        ref, _ = _run_flux(apply_lora(handle, tmp_path / "a.safetensors", strength))
        out, report = _run_flux(apply_lora(graphed, tmp_path / "a.safetensors", strength))
        g = report.compile.graphs
        assert torch.equal(out, ref), strength
        assert (g.captures, g.invalidations, g.hits) == (0, 0, 4), report.summary()
    base_ref, _ = _run_flux(handle)
    assert torch.equal(_run_flux(graphed)[0], base_ref)


def test_a_stored_video_session_does_not_keep_the_handles_host_object_alive(tmp_path):
    """A session kept in the node's store holds the model and its patches, not the handle: dropping it inside
    ComfyUI's unload loop (the ON_DETACH callback) must not free the host's ModelPatcher there, which would run
    ComfyUI's cleanup_models in the middle of the loop (IndexError in free_memory)."""
    import gc
    import weakref

    class Host:  # stands in for ComfyUI's ModelPatcher
        pass

    wan = handle_for("wan-tiny")
    write_lora(tmp_path / "w.safetensors", wan.model, scale=0.3)
    host = Host()
    handle = apply_lora(wan, tmp_path / "w.safetensors", 1.0).replace(host=host)
    session, _ = open_session(handle, WAN_CONTEXT, 32, 32, WAN_CONFIG, seed=3)
    first = next(iter(session.chunks(1))).latents
    alive = weakref.ref(host)
    del handle, host
    gc.collect()
    assert alive() is None
    # and the session still merges its LoRA: it equals a fresh session of the same handle
    again, _ = open_session(
        apply_lora(wan, tmp_path / "w.safetensors", 1.0), WAN_CONTEXT, 32, 32, WAN_CONFIG, seed=3
    )
    assert torch.equal(next(iter(again.chunks(1))).latents, first)


def test_a_lora_file_larger_than_host_memory_is_refused_before_it_is_read(flux, tmp_path, monkeypatch):
    write_lora(tmp_path / "big.safetensors", flux.model, seed=4)
    monkeypatch.setenv("FEWSTEP_MEMORY_LIMIT_GB", "0.000001")  # about 1 KiB of host memory
    with pytest.raises(InputError) as err:
        apply_lora(flux, tmp_path / "big.safetensors", 1.0)
    assert str(err.value).startswith("input 'lora': this needs about ")
    assert "(LoRA file " in str(err.value)
    assert "refused before allocating. Free host memory or use a smaller LoRA file" in str(err.value)
