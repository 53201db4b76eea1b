"""Node contracts, with the pack loaded exactly as ComfyUI loads a custom-node folder."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import types

import pytest
import torch
from conftest import COMFY_MODULE_NAME, ROOT, fake_comfy_memory_manager

PRIMITIVES = {"INT", "FLOAT", "STRING", "BOOLEAN"}


def _inputs(cls):
    spec = cls.INPUT_TYPES()
    assert set(spec) <= {"required", "optional", "hidden"}, cls
    for section in ("required", "optional"):
        for name, entry in spec.get(section, {}).items():
            yield section, name, entry


def test_pack_loads_under_a_dashed_module_name(pack):
    assert pack.__name__ == COMFY_MODULE_NAME and "-" in pack.__name__
    assert sys.modules[f"{COMFY_MODULE_NAME}.nodes"].SKIPPED_MODULES == {}
    assert set(pack.NODE_CLASS_MAPPINGS) == set(pack.NODE_DISPLAY_NAME_MAPPINGS)
    assert {"FewStepDiTLoader", "FewStepSampler", "FewStepSchedule", "FewStepSamplerSelect"} <= set(
        pack.NODE_CLASS_MAPPINGS
    )


def test_every_node_follows_the_contract(pack):
    for node_id, cls in pack.NODE_CLASS_MAPPINGS.items():
        assert node_id.startswith("FewStep"), node_id
        assert cls.CATEGORY.startswith("FewStep/"), node_id
        assert isinstance(cls.DESCRIPTION, str) and len(cls.DESCRIPTION) > 20, node_id
        assert callable(getattr(cls, cls.FUNCTION)), node_id
        assert len(cls.RETURN_TYPES) == len(cls.RETURN_NAMES), node_id
        for _section, name, entry in _inputs(cls):
            assert isinstance(entry, tuple) and 1 <= len(entry) <= 2, (node_id, name)
            kind = entry[0]
            opts = entry[1] if len(entry) == 2 else {}
            assert isinstance(opts.get("tooltip"), str) and opts["tooltip"], (
                f"{node_id}.{name} has no tooltip"
            )
            if isinstance(kind, list):
                assert kind, f"{node_id}.{name}: empty combo"
                if "default" in opts:
                    assert opts["default"] in kind, (node_id, name)
            elif kind in ("INT", "FLOAT"):
                assert opts["min"] <= opts["default"] <= opts["max"], (node_id, name)
            else:
                assert isinstance(kind, str) and kind.isupper(), (node_id, name)


def test_inputs_several_nodes_take_are_declared_once(pack):
    """The model input, the FEWSTEP_MODEL output, denoise and custom_sigmas each have one declaration
    (nodes.base, nodes.sampling) that every node taking them uses: one name, type and wording everywhere."""
    base = sys.modules[f"{COMFY_MODULE_NAME}.nodes.base"]
    for node_id, cls in pack.NODE_CLASS_MAPPINGS.items():
        for _section, name, entry in _inputs(cls):
            if entry[0] == "FEWSTEP_MODEL":
                assert name == "model", (node_id, name)
                assert entry[1]["tooltip"].startswith("A model from FewStepDiTLoader"), node_id
                assert set(entry[1]) == {"tooltip"}, node_id
        if "FEWSTEP_MODEL" in cls.RETURN_TYPES:
            assert issubclass(cls, base.ReturnsModel), node_id
            assert (cls.RETURN_TYPES, cls.RETURN_NAMES) == (("FEWSTEP_MODEL",), ("model",)), node_id
    sampler, schedule = (
        pack.NODE_CLASS_MAPPINGS[n].INPUT_TYPES() for n in ("FewStepSampler", "FewStepSchedule")
    )
    assert sampler["required"]["denoise"] == schedule["required"]["denoise"]
    assert sampler["optional"]["custom_sigmas"] == schedule["optional"]["custom_sigmas"]


def _default_args(cls, **links):
    args = {}
    for section, name, entry in _inputs(cls):
        if name in links:
            args[name] = links[name]
        elif section == "required":
            kind, opts = entry[0], (entry[1] if len(entry) == 2 else {})
            args[name] = opts.get("default", kind[0] if isinstance(kind, list) else None)
    hidden = cls.INPUT_TYPES().get("hidden", {})
    args.update({k: v for k, v in links.items() if k in hidden})
    return args


def test_each_function_returns_its_return_types(pack, monkeypatch, tmp_path):
    m = pack.NODE_CLASS_MAPPINGS
    (model,) = _run(m["FewStepDiTLoader"], model_name="dummy:flux-tiny")
    (cond,) = _run(m["FewStepSyntheticConditioning"])
    latent = {"samples": torch.zeros(1, 16, 8, 8)}
    outputs = {
        "FewStepDiTLoader": (model,),
        "FewStepSyntheticConditioning": (cond,),
        "FewStepSampler": _run(m["FewStepSampler"], model=model, positive=cond, latent_image=latent),
        "FewStepSchedule": _run(m["FewStepSchedule"]),
        "FewStepSamplerSelect": _run(m["FewStepSamplerSelect"]),
    }
    (tiny,) = _run(m["FewStepTinyVAELoader"], vae_name="dummy:taef1")
    (image,) = _run(m["FewStepTinyVAEDecode"], tiny_vae=tiny, samples=latent)
    outputs.update(
        FewStepTinyVAELoader=(tiny,),
        FewStepTinyVAEDecode=(image,),
        FewStepTinyVAEEncode=_run(m["FewStepTinyVAEEncode"], tiny_vae=tiny, pixels=image),
    )
    assert image.shape == (1, 64, 64, 3) and float(image.min()) >= 0 and float(image.max()) <= 1
    assert outputs["FewStepTinyVAEEncode"][0]["samples"].shape == (1, 16, 8, 8)
    (wan,) = _run(m["FewStepDiTLoader"], model_name="dummy:wan-tiny")
    (video_vae,) = _run(m["FewStepTinyVAELoader"], vae_name="dummy:taew2_1")
    video = _run(m["FewStepCausalVideoSampler"], model=wan, positive=cond, width=48, height=32, num_chunks=2,
                 chunk_frames=2, window_frames=4, tiny_vae=video_vae)  # fmt: skip
    outputs.update(
        FewStepCausalVideoSampler=video,
        FewStepCausalContinue=_run(m["FewStepCausalContinue"], session=video[2], num_chunks=1),
    )
    assert video[0]["samples"].shape == (1, 16, 4, 4, 6) and video[1].shape == (13, 32, 48, 3)
    # the live node serves until a limit: half a second with no client (its report is also its UI text)
    live = _run(m["FewStepLiveVideo"], model=wan, width=48, height=32, chunk_frames=2, window_frames=4,
                max_seconds=0.5)  # fmt: skip
    assert live["ui"]["text"] == list(live["result"])
    outputs["FewStepLiveVideo"] = live["result"]
    assert outputs["FewStepCausalContinue"][1].shape == (8, 32, 48, 3)  # 4 video frames per latent frame
    from test_step_cache_native import CALC, DIFFUSION, OUTER, BaseModel, Patcher

    wrappers = types.SimpleNamespace(OUTER_SAMPLE=OUTER, CALC_COND_BATCH=CALC, DIFFUSION_MODEL=DIFFUSION)
    monkeypatch.setitem(sys.modules, "comfy.patcher_extension", types.SimpleNamespace(WrappersMP=wrappers))
    native = Patcher(BaseModel(model.model, {"image_model": "flux", "depth": 2}))
    outputs.update(
        FewStepCacheGate=_run(m["FewStepCacheGate"], model=model),
        FewStepCacheGateNative=_run(m["FewStepCacheGateNative"], model=native),
    )
    assert outputs["FewStepCacheGate"][0].feature("step_cache") is not None
    assert outputs["FewStepCacheGate"][0].model is model.model  # shared, not copied
    assert outputs["FewStepCacheGateNative"][0] is not native and native.wrappers == {}  # a clone was patched
    frames = torch.rand(3, 32, 32, 3)
    outputs.update(
        FewStepCompile=_run(m["FewStepCompile"], model=model, compile="off"),
        FewStepParallelLauncher=_run(m["FewStepParallelLauncher"], enabled=False),
        FewStepStreamBatch=_run(
            m["FewStepStreamBatch"], model=model, tiny_vae=tiny, frames=frames, positive=cond
        ),
        FewStepCostPlan=_run(m["FewStepCostPlan"], model=model),
    )
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the dummy LoRA is written outside ComfyUI
    outputs.update(
        FewStepLoraLoader=_run(m["FewStepLoraLoader"], model=model),
        FewStepLoraPreset=_run(m["FewStepLoraPreset"]),
    )
    assert [p.strength for p in outputs["FewStepLoraLoader"][0].loras] == [1.0] and model.loras == ()
    assert outputs["FewStepLoraPreset"][0] == 8  # the first preset: Hyper-FLUX, 8 steps
    assert outputs["FewStepCompile"][0].model is model.model
    assert outputs["FewStepParallelLauncher"][0] is None
    assert outputs["FewStepStreamBatch"][0].shape == (3, 32, 32, 3)
    assert "FLOPs" in outputs["FewStepCostPlan"][0]
    assert set(outputs) == set(m), "a new node needs a case here"
    for node_id, out in outputs.items():
        assert isinstance(out, tuple) and len(out) == len(m[node_id].RETURN_TYPES), node_id
    samples, report = outputs["FewStepSampler"]
    assert samples["samples"].shape == (1, 16, 8, 8) and "4 DiT forwards" in report
    assert outputs["FewStepSchedule"][0].tolist() == [1.0, 0.75, 0.5, 0.25, 0.0]
    assert cond[0][0].shape == (1, 16, 4096) and cond[0][1]["pooled_output"].shape == (1, 768)


def _run(cls, **links):
    return getattr(cls(), cls.FUNCTION)(**_default_args(cls, **links))


def test_node_errors_name_the_node_and_its_input(pack):
    m = pack.NODE_CLASS_MAPPINGS
    (model,) = _run(m["FewStepDiTLoader"], model_name="dummy:flux-tiny")
    (cond,) = _run(m["FewStepSyntheticConditioning"])
    sampler = m["FewStepSampler"]
    with pytest.raises(
        ValueError, match=r"^FewStepSampler: input 'latent_image': expected an image latent \[batch, 16"
    ):
        _run(sampler, model=model, positive=cond, latent_image={"samples": torch.zeros(1, 4, 8, 8)})
    with pytest.raises(ValueError, match=r"^FewStepSampler: input 'latent_image': image size 64x72 px"):
        _run(sampler, model=model, positive=cond, latent_image={"samples": torch.zeros(1, 16, 9, 8)})
    (narrow,) = _run(m["FewStepSyntheticConditioning"], width=2048)
    with pytest.raises(
        ValueError, match=r"^FewStepSampler: input 'positive': conditioning tokens are \[1, 16, 2048\]"
    ):
        _run(sampler, model=model, positive=narrow, latent_image={"samples": torch.zeros(1, 16, 8, 8)})
    with pytest.raises(ValueError, match=r"^FewStepSampler: input 'positive': entry 0 carries a ControlNet"):
        _run(
            sampler,
            model=model,
            positive=[[cond[0][0], {**cond[0][1], "control": object()}]],
            latent_image={"samples": torch.zeros(1, 16, 8, 8)},
        )
    with pytest.raises(ValueError, match=r"^FewStepSampler: input 'latent_image': carries a noise mask"):
        _run(
            sampler,
            model=model,
            positive=cond,
            latent_image={"samples": torch.zeros(1, 16, 8, 8), "noise_mask": torch.ones(1, 1, 8, 8)},
        )
    with pytest.raises(
        ValueError, match=r"^FewStepDiTLoader: input 'model_name': weights file not found: .*missing"
    ):
        _run(m["FewStepDiTLoader"], model_name="missing.safetensors")
    with pytest.raises(
        ValueError, match=r"^FewStepSchedule: input 'width': 1000x1024 is not a multiple of 16"
    ):
        _run(m["FewStepSchedule"], width=1000)


def test_sampler_keeps_other_latent_keys(pack):
    m = pack.NODE_CLASS_MAPPINGS
    (model,) = _run(m["FewStepDiTLoader"], model_name="dummy:flux-tiny")
    (cond,) = _run(m["FewStepSyntheticConditioning"])
    (out, _) = _run(
        m["FewStepSampler"],
        model=model,
        positive=cond,
        latent_image={"samples": torch.zeros(2, 16, 8, 8), "batch_index": [4, 7]},
    )
    assert out["batch_index"] == [4, 7]


def test_native_sampler_adapts_to_the_model_parametrisation(pack, monkeypatch):
    """Inside ComfyUI the SAMPLER reads model_sampling: CONST (flow) re-noises as (1-s) x0 + s n, else x0 + s n."""
    from fewstep.engine.sampling import FLOW, VE
    from fewstep.nodes.sampling import sigma_space_of

    fake = types.ModuleType("comfy.model_sampling")

    class CONST:  # stands for comfy.model_sampling.CONST
        pass

    fake.CONST = CONST
    monkeypatch.setitem(sys.modules, "comfy.model_sampling", fake)

    def model_k(sampling):
        return types.SimpleNamespace(
            inner_model=types.SimpleNamespace(inner_model=types.SimpleNamespace(model_sampling=sampling))
        )

    assert sigma_space_of(model_k(CONST())) is FLOW
    assert sigma_space_of(model_k(object())) is VE

    (spec,) = _run(pack.NODE_CLASS_MAPPINGS["FewStepSamplerSelect"], sampler="dmd")
    seen = []

    class Denoiser:
        inner_model = model_k(object()).inner_model

        def __call__(self, x, sigma, **kw):
            seen.append(float(sigma[0]))
            return torch.zeros_like(x)

    out = spec.sampler_function(
        Denoiser(), torch.ones(1, 2), torch.tensor([2.0, 1.0, 0.0]), extra_args={"seed": 0}, disable=True
    )
    assert seen == [2.0, 1.0] and out.abs().max() == 0


def test_loader_registers_with_comfyui_memory_manager(pack, monkeypatch):
    calls = {}

    class ModelPatcher:
        def __init__(self, model, load_device, offload_device):
            calls["patched"] = type(model).__name__
            self.model = model

    mm = types.SimpleNamespace(
        get_torch_device=lambda: torch.device("cpu"),
        unet_offload_device=lambda: torch.device("cpu"),
        load_models_gpu=lambda models, force_full_load=False: calls.update(
            loaded=models, full=force_full_load
        ),
        throw_exception_if_processing_interrupted=lambda: None,
    )
    monkeypatch.setitem(sys.modules, "comfy.model_management", mm)
    monkeypatch.setitem(sys.modules, "comfy.model_patcher", types.SimpleNamespace(ModelPatcher=ModelPatcher))
    m = pack.NODE_CLASS_MAPPINGS
    (model,) = _run(m["FewStepDiTLoader"], model_name="dummy:flux-tiny")
    assert calls["patched"] == "ManagedDiT" and model.host.model.diffusion_model is model.model
    assert not hasattr(model.model, "model_loaded_weight_memory")  # the engine model stays clean
    (cond,) = _run(m["FewStepSyntheticConditioning"])
    _run(m["FewStepSampler"], model=model, positive=cond, latent_image={"samples": torch.zeros(1, 16, 8, 8)})
    assert calls["loaded"] == [model.host] and calls["full"] is True


def test_importing_the_pack_changes_nothing_global():
    code = f"""
import importlib.util, json, logging, sys, torch
before = dict(
    handlers=len(logging.getLogger().handlers), level=logging.getLogger().level,
    sdpa=id(torch.nn.functional.scaled_dot_product_attention), linear=id(torch.nn.Linear.forward),
    rng=torch.get_rng_state().sum().item(), threads=torch.get_num_threads(), grad=torch.is_grad_enabled(),
    dtype=str(torch.get_default_dtype()))
spec = importlib.util.spec_from_file_location({COMFY_MODULE_NAME!r}, {str(ROOT / "__init__.py")!r},
                                              submodule_search_locations=[{str(ROOT)!r}])
mod = importlib.util.module_from_spec(spec); sys.modules[spec.name] = mod; spec.loader.exec_module(mod)
after = dict(
    handlers=len(logging.getLogger().handlers), level=logging.getLogger().level,
    sdpa=id(torch.nn.functional.scaled_dot_product_attention), linear=id(torch.nn.Linear.forward),
    rng=torch.get_rng_state().sum().item(), threads=torch.get_num_threads(), grad=torch.is_grad_enabled(),
    dtype=str(torch.get_default_dtype()))
print(json.dumps([before == after, sorted(k for k in sys.modules if k.split('.')[0] in ('comfy', 'folder_paths'))]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    same, comfy_modules = json.loads(out.stdout.strip().splitlines()[-1])
    assert same and comfy_modules == []


def test_step_previews_reach_the_progress_bar(pack, monkeypatch):
    previews = []

    class ProgressBar:
        def __init__(self, total):
            self.total = total

        def update_absolute(self, value, total=None, preview=None):
            previews.append((value, preview))

    monkeypatch.setitem(sys.modules, "comfy.utils", types.SimpleNamespace(ProgressBar=ProgressBar))
    m = pack.NODE_CLASS_MAPPINGS
    (model,) = _run(m["FewStepDiTLoader"], model_name="dummy:flux-tiny")
    (cond,) = _run(m["FewStepSyntheticConditioning"])
    (tiny,) = _run(m["FewStepTinyVAELoader"], vae_name="dummy:taef1")
    latent = {"samples": torch.zeros(1, 16, 8, 12)}
    _run(m["FewStepSampler"], model=model, positive=cond, latent_image=latent, preview_vae=tiny, preview=True)
    assert [v for v, _ in previews] == [1, 2, 3, 4]
    kind, image, size = previews[0][1]
    assert kind == "JPEG" and image.size == (96, 64) and size == 512
    previews.clear()
    _run(m["FewStepSampler"], model=model, positive=cond, latent_image=latent)  # off by default
    assert [p for _, p in previews] == [None] * 4
    (video_vae,) = _run(m["FewStepTinyVAELoader"], vae_name="dummy:taef2")
    with pytest.raises(ValueError, match=r"^FewStepSampler: input 'preview_vae': taef2 decodes 32-channel"):
        _run(
            m["FewStepSampler"],
            model=model,
            positive=cond,
            latent_image=latent,
            preview_vae=video_vae,
            preview=True,
        )
    with pytest.raises(
        ValueError, match=r"^FewStepSampler: input 'preview_vae': preview is on but no tiny VAE"
    ):
        _run(m["FewStepSampler"], model=model, positive=cond, latent_image=latent, preview=True)


def test_tiny_vae_node_errors(pack):
    m = pack.NODE_CLASS_MAPPINGS
    (tiny,) = _run(m["FewStepTinyVAELoader"], vae_name="dummy:taef1")
    with pytest.raises(
        ValueError, match=r"^FewStepTinyVAEDecode: input 'samples': taef1 .* decodes 16-channel"
    ):
        _run(m["FewStepTinyVAEDecode"], tiny_vae=tiny, samples={"samples": torch.zeros(1, 4, 8, 8)})
    with pytest.raises(
        ValueError, match=r"^FewStepTinyVAEEncode: input 'pixels': image values must be in \[0, 1\]"
    ):
        _run(m["FewStepTinyVAEEncode"], tiny_vae=tiny, pixels=torch.full((1, 16, 16, 3), 2.0))
    with pytest.raises(ValueError, match=r"^FewStepTinyVAELoader: input 'vae_name': weights file not found"):
        _run(m["FewStepTinyVAELoader"], vae_name="taef1_decoder.pth")


def test_video_latents_decode_to_stacked_frames(pack):
    m = pack.NODE_CLASS_MAPPINGS
    (tiny,) = _run(m["FewStepTinyVAELoader"], vae_name="dummy:taew2_1")
    latent = {"samples": torch.randn(1, 16, 2, 4, 6)}
    (frames,) = _run(m["FewStepTinyVAEDecode"], tiny_vae=tiny, samples=latent)
    assert frames.shape == (5, 32, 48, 3)  # 4T - 3 frames along the batch
    expected = tiny.decode(tiny.raw_to_latent(latent["samples"]))[0].permute(0, 2, 3, 1)
    assert torch.allclose(frames, expected, atol=1e-6)
    (encoded,) = _run(m["FewStepTinyVAEEncode"], tiny_vae=tiny, pixels=frames)
    assert encoded["samples"].shape == (1, 16, 2, 4, 6)  # 5 frames, padded to 8, 4 per latent frame
    (image_vae,) = _run(m["FewStepTinyVAELoader"], vae_name="dummy:taef1")
    with pytest.raises(ValueError, match="video latent .* image-only tiny AE taef1"):
        _run(m["FewStepTinyVAEDecode"], tiny_vae=image_vae, samples={"samples": torch.randn(1, 16, 2, 4, 4)})


def _video_nodes(pack):
    m = pack.NODE_CLASS_MAPPINGS
    (wan,) = _run(m["FewStepDiTLoader"], model_name="dummy:wan-tiny")
    (cond,) = _run(m["FewStepSyntheticConditioning"], pooled_width=0)
    return m, wan, cond


@pytest.mark.slow
def test_continue_from_a_stale_reference_rebuilds_the_same_video(pack):
    """ComfyUI re-runs a Continue on the sampler's cached output after the session has moved on."""
    m, wan, cond = _video_nodes(pack)
    (other,) = _run(m["FewStepSyntheticConditioning"], pooled_width=0, seed=5)
    sampler = _run(m["FewStepCausalVideoSampler"], model=wan, positive=cond, width=48, height=32, num_chunks=2,
                   chunk_frames=2, window_frames=4, sink_frames=1)  # fmt: skip
    first = _run(m["FewStepCausalContinue"], session=sampler[2], num_chunks=2, positive=other)
    again = _run(
        m["FewStepCausalContinue"], session=sampler[2], num_chunks=3, positive=other
    )  # num_chunks changed
    assert torch.allclose(again[0]["samples"][:, :, :4], first[0]["samples"], atol=1e-6)
    longer = _run(m["FewStepCausalContinue"], session=first[2], num_chunks=1)  # a chain of continues
    replayed = _run(
        m["FewStepCausalContinue"], session=first[2], num_chunks=1
    )  # stale again: rebuilt with the switch
    assert torch.allclose(longer[0]["samples"], replayed[0]["samples"], atol=1e-6)


def test_the_sampler_caches_like_any_node_and_a_freed_session_is_rebuilt(pack):
    """No IS_CHANGED: ComfyUI caches the sampler on its inputs, and a Continue on a cached reference whose
    session was freed (LRU, memory released) rebuilds it: the same frames as continuing the live session."""
    m, wan, cond = _video_nodes(pack)
    video_nodes = sys.modules[f"{pack.__name__}.nodes.video"]
    sampler_cls = m["FewStepCausalVideoSampler"]
    assert not hasattr(sampler_cls, "IS_CHANGED")
    args = dict(model=wan, positive=cond, width=48, height=32, num_chunks=1, chunk_frames=2, window_frames=4)
    live = _run(m["FewStepCausalContinue"], session=_run(sampler_cls, **args)[2], num_chunks=2)
    out = _run(sampler_cls, **args)
    video_nodes.SESSIONS.dispose(out[2].key)
    rebuilt = _run(m["FewStepCausalContinue"], session=out[2], num_chunks=2)
    assert torch.equal(rebuilt[0]["samples"], live[0]["samples"])
    assert rebuilt[2].key != out[2].key and video_nodes.SESSIONS.alive(rebuilt[2].key)
    assert rebuilt[2].position == out[2].position + 4


def test_sessions_are_freed_when_comfyui_unloads_the_model(pack, monkeypatch):
    callbacks = fake_comfy_memory_manager(monkeypatch)
    m, wan, cond = _video_nodes(pack)
    out = _run(m["FewStepCausalVideoSampler"], model=wan, positive=cond, width=48, height=32, num_chunks=1,
               chunk_frames=2, window_frames=4)  # fmt: skip
    (on_detach,) = callbacks[("on_detach_after", "fewstep-sessions")]
    store = sys.modules[f"{pack.__name__}.nodes.video"].SESSIONS
    on_detach(wan.host, False)  # ComfyUI re-loading an already loaded model: keep the sessions
    assert store.alive(out[2].key)
    on_detach(wan.host, True)  # a real unload (free memory)
    assert not store.alive(out[2].key)


def test_video_node_errors(pack):
    m, wan, cond = _video_nodes(pack)
    (flux,) = _run(m["FewStepDiTLoader"], model_name="dummy:flux-tiny")
    with pytest.raises(
        ValueError, match=r"^FewStepCausalVideoSampler: input 'model': .* runs Wan-family video models"
    ):
        _run(m["FewStepCausalVideoSampler"], model=flux, positive=cond, width=48, height=32)
    with pytest.raises(
        ValueError,
        match=r"^FewStepCausalVideoSampler: input 'window_frames': the window \(2 latent frames\) is smaller than a chunk \(3\)",
    ):
        _run(m["FewStepCausalVideoSampler"], model=wan, positive=cond, width=48, height=32, window_frames=2)
    with pytest.raises(
        ValueError, match=r"^FewStepCausalVideoSampler: input 'width': 40 px is not a positive multiple of 16"
    ):
        _run(m["FewStepCausalVideoSampler"], model=wan, positive=cond, width=40, height=32)
    (t5_short,) = _run(m["FewStepSyntheticConditioning"], width=2048, pooled_width=0)
    with pytest.raises(
        ValueError, match=r"^FewStepCausalVideoSampler: input 'positive': conditioning is \[1, 16, 2048\]"
    ):
        _run(m["FewStepCausalVideoSampler"], model=wan, positive=t5_short, width=48, height=32)
    with pytest.raises(
        ValueError,
        match=r"^FewStepSampler: input 'model': this sampler runs image DiTs \(FLUX.1, FLUX.2, Z-Image\)",
    ):
        _run(
            m["FewStepSampler"], model=wan, positive=cond, latent_image={"samples": torch.zeros(1, 16, 8, 8)}
        )


@pytest.mark.slow
def test_causal_video_runs_the_compiled_model_and_reports_it(pack):
    m = pack.NODE_CLASS_MAPPINGS
    (wan,) = _run(m["FewStepDiTLoader"], model_name="dummy:wan-tiny")
    (cond,) = _run(m["FewStepSyntheticConditioning"], pooled_width=0, guidance=0.0)
    (compiled,) = _run(m["FewStepCompile"], model=wan, compile="regional", backend="eager")
    runs = [
        _run(
            m["FewStepCausalVideoSampler"],
            model=model,
            positive=cond,
            width=48,
            height=32,
            num_chunks=2,
            chunk_frames=1,
            window_frames=2,
            sink_frames=0,
        )  # fmt: skip
        for model in (wan, compiled)
    ]
    eager, fast = (r[0]["samples"] for r in runs)
    assert (fast - eager).abs().max() <= 1e-4
    assert "compile: " not in runs[0][3]
    assert "compile: compile regional" in runs[1][3] and "not applied" not in runs[1][3], runs[1][3]
    more = _run(
        m["FewStepCausalContinue"], session=runs[1][2], num_chunks=1
    )  # the session keeps the compiled model
    assert more[0]["samples"].shape == (1, 16, 1, 4, 6)
    (tiny,) = _run(m["FewStepDiTLoader"], model_name="dummy:flux-tiny")
    (flux_compiled,) = _run(m["FewStepCompile"], model=tiny, compile="regional", backend="eager")
    (taef1,) = _run(m["FewStepTinyVAELoader"], vae_name="dummy:taef1")
    flux_cond = _run(m["FewStepSyntheticConditioning"])[0]
    frames = torch.rand(3, 32, 32, 3, generator=torch.Generator().manual_seed(0))
    streams = [
        _run(m["FewStepStreamBatch"], model=model, tiny_vae=taef1, frames=frames, positive=flux_cond)
        for model in (tiny, flux_compiled)
    ]
    assert (streams[1][0] - streams[0][0]).abs().max() <= 1e-4
    assert "compile: " not in streams[0][1] and "compile: compile regional" in streams[1][1], streams[1][1]
