"""ComfyUI node adapters: thin classes that turn widget values into engine calls.

Each module is registered separately: a node module whose optional dependency is missing is skipped with one
logged line and the rest of the pack still loads.
"""

from __future__ import annotations

import importlib
import logging

log = logging.getLogger(__name__)

# module -> node classes it defines (display names follow)
NODE_MODULES = {
    "loaders": ["FewStepDiTLoader"],
    "lora": ["FewStepLoraLoader", "FewStepLoraPreset"],
    "sampling": ["FewStepSampler", "FewStepSchedule", "FewStepSamplerSelect", "FewStepSyntheticConditioning"],
    "vae": ["FewStepTinyVAELoader", "FewStepTinyVAEDecode", "FewStepTinyVAEEncode"],
    "video": ["FewStepCausalVideoSampler", "FewStepCausalContinue"],
    "step_cache": ["FewStepCacheGate", "FewStepCacheGateNative"],
    "compile": ["FewStepCompile"],
    "parallel": ["FewStepParallelLauncher"],
    "stream_batch": ["FewStepStreamBatch"],
    "plan": ["FewStepCostPlan"],
    "live": ["FewStepLiveVideo"],
}
DISPLAY_NAMES = {
    "FewStepDiTLoader": "FewStep DiT Loader",
    "FewStepLoraLoader": "FewStep LoRA Loader",
    "FewStepLoraPreset": "FewStep LoRA Preset (distillation LoRA settings)",
    "FewStepSampler": "FewStep Sampler",
    "FewStepSchedule": "FewStep Schedule (SIGMAS)",
    "FewStepSamplerSelect": "FewStep Sampler Select (SAMPLER)",
    "FewStepSyntheticConditioning": "FewStep Synthetic Conditioning (testing)",
    "FewStepTinyVAELoader": "FewStep Tiny VAE Loader",
    "FewStepTinyVAEDecode": "FewStep Tiny VAE Decode",
    "FewStepTinyVAEEncode": "FewStep Tiny VAE Encode",
    "FewStepCausalVideoSampler": "FewStep Causal Video Sampler",
    "FewStepCausalContinue": "FewStep Causal Video Continue",
    "FewStepCacheGate": "FewStep Cache Gate",
    "FewStepCacheGateNative": "FewStep Cache Gate (native MODEL)",
    "FewStepCompile": "FewStep Compile / CUDA Graph",
    "FewStepParallelLauncher": "FewStep Parallel Launcher",
    "FewStepStreamBatch": "FewStep Stream Batch",
    "FewStepCostPlan": "FewStep Cost Plan",
    "FewStepLiveVideo": "FewStep Live Video",
}

NODE_CLASS_MAPPINGS: dict[str, type] = {}
NODE_DISPLAY_NAME_MAPPINGS: dict[str, str] = {}
SKIPPED_MODULES: dict[str, str] = {}

for _module, _names in NODE_MODULES.items():
    try:
        _mod = importlib.import_module(f".{_module}", __name__)
    except ImportError as _exc:
        SKIPPED_MODULES[_module] = str(_exc)
        log.warning("fewstep: skipped nodes %s (missing dependency: %s)", ", ".join(_names), _exc)
        continue
    for _name in _names:
        NODE_CLASS_MAPPINGS[_name] = getattr(_mod, _name)
        NODE_DISPLAY_NAME_MAPPINGS[_name] = DISPLAY_NAMES[_name]
