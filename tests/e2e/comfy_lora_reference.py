"""Run inside ComfyUI's own Python (cwd = a ComfyUI checkout): ComfyUI's LoRA loader as a reference.

``python comfy_lora_reference.py JOB.json``; the job names a family (``flux`` / ``wan``), the ``unet_config``
entries of the tiny model that ComfyUI's detection cannot read from its weights (the rest, and the model class,
come from ComfyUI's own detection, as when it loads a checkpoint; written to ``BASE.config.json``), the base
state dict (official names, safetensors) and a list of
``[lora_file, strength, out_file]``. For each LoRA, ComfyUI builds its own model from the base weights, applies the
file with ``comfy.sd.load_lora_for_models`` (its key maps, alpha scaling and strength), merges the patches with
``ModelPatcher.patch_model`` and writes the patched diffusion-model state dict (float32) to ``out_file``, and the
entries ComfyUI did not load (its ``lora key not loaded`` warnings) to ``out_file + ".json"``; with ``inputs`` (a
safetensors file of ``x``, ``timestep``, ``context`` and, for FLUX, ``y``) also ComfyUI's forward output of the
patched model to ``out_file + ".out.safetensors"``.

Not part of the package: it imports ComfyUI, which the engine never does.
"""

from __future__ import annotations

import json
import logging
import sys

import torch


class _NotLoaded(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.keys: list[str] = []

    def emit(self, record):
        text = record.getMessage()
        if text.startswith("lora key not loaded: "):
            self.keys.append(text[len("lora key not loaded: ") :])


def main(job_path: str) -> None:
    sys.path.insert(0, ".")
    import comfy.cli_args

    comfy.cli_args.args.cpu = (
        True  # float32 on the CPU, as the test runs ours; read before model_management loads
    )
    import comfy.model_detection
    import comfy.model_patcher
    import comfy.sd
    import comfy.utils
    from safetensors.torch import load_file, save_file

    with open(job_path) as f:
        job = json.load(f)
    base = load_file(job["base"])
    # The model config as ComfyUI derives it when it loads a checkpoint: its detection reads the layout from the
    # state dict and fills every field its model class needs in that version (0.8.0's FLUX needs txt_ids_dims,
    # which 0.3.64 does not know); the job overrides only what the weights cannot show for a tiny model (head
    # count, RoPE axes...: detection assumes the full-size models there). The class is picked by ComfyUI too.
    detected = comfy.model_detection.detect_unet_config(base, "")
    if detected is None or detected.get("image_model") != job["unet_config"]["image_model"]:
        raise SystemExit(f"ComfyUI's detection did not read the base weights as {job['family']}: {detected}")
    unet_config = {**detected, **job["unet_config"]}
    matched = comfy.model_detection.model_config_from_unet_config(unet_config, base)
    if matched is None:
        raise SystemExit(f"no ComfyUI model class matches {unet_config}")
    config_class = type(matched)
    with open(job["base"] + ".config.json", "w") as f:
        json.dump({"unet_config": unet_config, "class": config_class.__name__}, f, default=list)
    cpu = torch.device("cpu")
    not_loaded = _NotLoaded()
    logging.getLogger().addHandler(not_loaded)
    for lora_file, strength, out_file in job["loras"]:
        model_config = config_class(dict(unet_config))
        model_config.set_inference_dtype(torch.float32, torch.float32)
        model = model_config.get_model(base, "", device=cpu)
        model.diffusion_model.load_state_dict(base, strict=True)
        patcher = comfy.model_patcher.ModelPatcher(model, load_device=cpu, offload_device=cpu)
        lora = comfy.utils.load_torch_file(lora_file, safe_load=True)
        not_loaded.keys = []
        patched, _ = comfy.sd.load_lora_for_models(patcher, None, lora, strength, 0)
        patched.patch_model(device_to=cpu)
        merged = {
            k: v.detach().float().contiguous() for k, v in patched.model.diffusion_model.state_dict().items()
        }
        save_file(merged, out_file)
        if job.get("inputs"):
            # ComfyUI's own forward with the patched weights, on the test's fixed inputs
            inputs = load_file(job["inputs"])
            with torch.no_grad():
                if job["family"] == "flux":
                    out = patched.model.diffusion_model(
                        inputs["x"], inputs["timestep"], inputs["context"], inputs["y"]
                    )
                else:
                    out = patched.model.diffusion_model(inputs["x"], inputs["timestep"], inputs["context"])
            save_file({"out": out.float().contiguous()}, out_file + ".out.safetensors")
        with open(out_file + ".json", "w") as f:
            json.dump({"not_loaded": not_loaded.keys}, f)


if __name__ == "__main__":
    main(sys.argv[1])
