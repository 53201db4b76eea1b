"""Our LoRA loader against ComfyUI's own (comfy.sd.load_lora_for_models), on the tiny FLUX.1 and Wan models.

The same seeded random LoRA file, in each naming, is applied by ComfyUI to ComfyUI's Flux / WanModel (built from
our tiny model's weights, in ComfyUI's venv: ``comfy_lora_reference.py``; its config and model class come from
ComfyUI's own detection of those weights, so every version gets the fields it requires, e.g. 0.8.0's FLUX
``txt_ids_dims``) and by ``apply_lora`` to ours; the merged
float32 weights must agree to 1e-6 (measured: 0.0, bit-identical, in every naming) and ComfyUI's forward output of
its patched model must agree with ours to 1e-4 (measured max abs diff, ComfyUI 0.3.64 / 0.8.0: FLUX.1 1.2e-6 /
1.4e-6, Wan 1.4e-5 on both; float32, CPU;
the difference of two implementations of the same forward, not of the merge).

Namings: FLUX.1 in ComfyUI / BFL names (lora_down / lora_up or lora.down / lora.up, alpha, plus ``linear1_qkv``,
``diff`` on a norm scale and ``diff_b`` on biases), kohya (``lora_unet_``), diffusers / PEFT (``transformer.``
lora_A / lora_B), OneTrainer (``lora_transformer_``) and SimpleTuner (``lycoris_``), every linear weight; Wan in ComfyUI names with alpha, ``diff``
(norms) and ``diff_b`` (biases), as the CausVid / lightx2v files carry them, without full deltas of the
modulation tables: lightx2v's ``blocks.N.diff_m`` ComfyUI 0.3.64 does not load ("lora key not loaded"), and
``blocks.N.modulation.diff`` / ``head.modulation.diff`` it loads but never merges (``ModelPatcher.load`` patches
only modules without child parameters; the tables sit on the block / head beside their children). We apply both
(test_lora_formats.py checks them against a hand-computed reference). ComfyUI 0.3.64 has no diffusers
key map for Wan (``model_lora_keys_unet``), so the diffusers-named Wan file is checked against ComfyUI's merge of
the same tensors in ComfyUI names. ComfyUI 0.3.64 reads XLabs names only for the 38-single-block USO files
(``lora_convert.convert_uso_lora``), so XLabs is covered by the hand-computed reference in test_lora_formats.py.

Needs ``COMFYUI_DIR`` (and ``COMFYUI_PYTHON``, default ``$COMFYUI_DIR/../venv/bin/python``), as the other e2e
tests; skipped otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fewstep.engine.handle import open_model
from fewstep.engine.lora import apply_lora
from fewstep.engine.models.flux import image_ids, pack_latent, text_ids, unpack_latent

COMFYUI_DIR = os.environ.get("COMFYUI_DIR")
pytestmark = pytest.mark.skipif(
    not COMFYUI_DIR or not (Path(COMFYUI_DIR) / "comfy" / "lora.py").exists(),
    reason="set COMFYUI_DIR to a ComfyUI checkout (see docs/testing.md: end-to-end tests) to compare with ComfyUI's LoRA code",
)
SCRIPT = Path(__file__).with_name("comfy_lora_reference.py")
RANK = 4
STRENGTH = 0.8
WEIGHT_TOLERANCE = 1e-6
OUTPUT_TOLERANCE = 1e-4


def _python() -> str:
    explicit = os.environ.get("COMFYUI_PYTHON")
    if explicit:
        return explicit
    sibling = Path(COMFYUI_DIR).parent / "venv" / "bin" / "python"
    return str(sibling) if sibling.exists() else sys.executable


def _flux_diffusers(hidden: int, mlp: int, double: int, single: int) -> dict[str, tuple[str, tuple | None]]:
    """diffusers FluxTransformer2DModel module -> (official weight, rows): written out here, not taken from ours."""
    out = {}
    for i in range(double):
        p, q = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        for n, c in enumerate("qkv"):
            out[f"{p}attn.to_{c}"] = (q + "img_attn.qkv.weight", (n * hidden, hidden))
            out[f"{p}attn.add_{c}_proj"] = (q + "txt_attn.qkv.weight", (n * hidden, hidden))
        for a, b in (
            ("attn.to_out.0", "img_attn.proj"),
            ("attn.to_add_out", "txt_attn.proj"),
            ("norm1.linear", "img_mod.lin"),
            ("norm1_context.linear", "txt_mod.lin"),
            ("ff.net.0.proj", "img_mlp.0"),
            ("ff.net.2", "img_mlp.2"),
            ("ff_context.net.0.proj", "txt_mlp.0"),
            ("ff_context.net.2", "txt_mlp.2"),
        ):
            out[p + a] = (f"{q}{b}.weight", None)
    for i in range(single):
        p, q = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        for n, c in enumerate("qkv"):
            out[f"{p}attn.to_{c}"] = (q + "linear1.weight", (n * hidden, hidden))
        out[p + "proj_mlp"] = (q + "linear1.weight", (3 * hidden, mlp))
        out[p + "proj_out"] = (q + "linear2.weight", None)
        out[p + "norm.linear"] = (q + "modulation.lin.weight", None)
    for a, b in (
        ("x_embedder", "img_in"),
        ("context_embedder", "txt_in"),
        ("time_text_embed.timestep_embedder.linear_1", "time_in.in_layer"),
        ("time_text_embed.timestep_embedder.linear_2", "time_in.out_layer"),
        ("time_text_embed.text_embedder.linear_1", "vector_in.in_layer"),
        ("time_text_embed.text_embedder.linear_2", "vector_in.out_layer"),
        ("proj_out", "final_layer.linear"),
        ("norm_out.linear", "final_layer.adaLN_modulation.1"),
    ):
        out[a] = (f"{b}.weight", None)
    return out


def _wan_to_diffusers(module: str) -> str:
    """Official Wan module -> diffusers WanTransformer3DModel module, written out here."""
    top = {
        "head.head": "proj_out",
        "head.modulation": "scale_shift_table",
        "patch_embedding": "patch_embedding",
        "time_embedding.0": "condition_embedder.time_embedder.linear_1",
        "time_embedding.2": "condition_embedder.time_embedder.linear_2",
        "text_embedding.0": "condition_embedder.text_embedder.linear_1",
        "text_embedding.2": "condition_embedder.text_embedder.linear_2",
        "time_projection.1": "condition_embedder.time_proj",
    }
    if module in top:
        return top[module]
    block, rest = module.split(".", 2)[:2], module.split(".", 2)[2]
    rest = {
        "ffn.0": "ffn.net.0.proj",
        "ffn.2": "ffn.net.2",
        "norm3": "norm2",
        "modulation": "scale_shift_table",
    }.get(rest, rest)
    for a, b in (("self_attn.", "attn1."), ("cross_attn.", "attn2.")):
        if rest.startswith(a):
            attn, leaf = rest[len(a) :], b
            attn = {"q": "to_q", "k": "to_k", "v": "to_v", "o": "to_out.0"}.get(attn, attn)
            rest = leaf + attn
    return ".".join(block) + "." + rest


def _pair(gen, rows: int, fan_in: tuple[int, ...]):
    return torch.randn(rows, RANK, generator=gen) * 0.1, torch.randn(RANK, *fan_in, generator=gen) * 0.1


def _flux_files(model, tmp: Path) -> dict[str, Path]:
    params = {k: v for k, v in model.named_parameters()}
    linear = [k[: -len(".weight")] for k, v in params.items() if k.endswith(".weight") and v.ndim == 2]
    gen = torch.Generator().manual_seed(19)
    files = {}

    comfy, kohya = {}, {}
    for n, m in enumerate(linear):
        up, down = _pair(gen, params[m + ".weight"].shape[0], params[m + ".weight"].shape[1:])
        alpha = torch.tensor(float(1 + n % 7))
        for sd, name in ((comfy, f"diffusion_model.{m}"), (kohya, "lora_unet_" + m.replace(".", "_"))):
            sd[name + ".lora_down.weight"], sd[name + ".lora_up.weight"], sd[name + ".alpha"] = (
                down,
                up,
                alpha,
            )
    for i in range(model.params.depth_single_blocks):  # ComfyUI's name for the attention rows of linear1
        up, down = _pair(gen, 3 * model.params.hidden_size, (model.params.hidden_size,))
        comfy[f"diffusion_model.single_blocks.{i}.linear1_qkv.lora_down.weight"] = down
        comfy[f"diffusion_model.single_blocks.{i}.linear1_qkv.lora_up.weight"] = up
    comfy["diffusion_model.double_blocks.0.img_attn.norm.query_norm.scale.diff"] = torch.randn(
        32, generator=gen
    )
    comfy["diffusion_model.img_in.diff_b"] = torch.randn(64, generator=gen)
    comfy["diffusion_model.single_blocks.1.linear1.diff_b"] = torch.randn(448, generator=gen)
    files["comfyui"], files["kohya"] = comfy, kohya
    # the same entries with the .lora.down / .lora.up spelling some BFL-trained files use
    files["comfyui-dot"] = {
        k.replace(".lora_down.weight", ".lora.down.weight").replace(".lora_up.weight", ".lora.up.weight"): v
        for k, v in comfy.items()
    }

    hidden = model.params.hidden_size
    table = _flux_diffusers(
        hidden, int(hidden * model.params.mlp_ratio), model.params.depth, model.params.depth_single_blocks
    )
    diffusers, onetrainer, lycoris = {}, {}, {}
    for n, (m, (key, rows)) in enumerate(table.items()):
        up, down = _pair(gen, rows[1] if rows else params[key].shape[0], params[key].shape[1:])
        diffusers[f"transformer.{m}.lora_A.weight"], diffusers[f"transformer.{m}.lora_B.weight"] = down, up
        name = "lora_transformer_" + m.replace(".", "_")
        onetrainer[name + ".lora_down.weight"], onetrainer[name + ".lora_up.weight"] = down, up
        onetrainer[name + ".alpha"] = torch.tensor(float(2 + n % 5))
        lycoris["lycoris_" + m.replace(".", "_") + ".lora_down.weight"] = down  # SimpleTuner
        lycoris["lycoris_" + m.replace(".", "_") + ".lora_up.weight"] = up
    files["diffusers"], files["onetrainer"], files["lycoris"] = diffusers, onetrainer, lycoris
    return _save(files, tmp)


def _wan_files(model, tmp: Path) -> dict[str, Path]:
    params = dict(model.named_parameters())
    gen = torch.Generator().manual_seed(21)
    comfy = {}
    for n, (k, v) in enumerate(params.items()):
        if k.endswith(".weight") and v.ndim >= 2:
            m = k[: -len(".weight")]
            up, down = _pair(gen, v.shape[0], v.shape[1:])
            if v.ndim == 5:  # a convolution LoRA stores up as [out, rank, 1, 1, 1]
                up = up.reshape(*up.shape, 1, 1, 1)
            comfy[f"diffusion_model.{m}.lora_down.weight"] = down
            comfy[f"diffusion_model.{m}.lora_up.weight"] = up
            comfy[f"diffusion_model.{m}.alpha"] = torch.tensor(float(1 + n % 5))
        elif k.endswith("modulation"):
            # ComfyUI 0.3.64 loads blocks.N.modulation.diff / head.modulation.diff (no "not loaded" warning) but
            # never merges them: ModelPatcher.load patches only modules without child parameters, and these tables
            # sit on the attention block / head beside their children. We apply them; compared without them.
            continue
        elif k.endswith(".bias"):
            comfy[f"diffusion_model.{k[: -len('.bias')]}.diff_b"] = torch.randn(v.shape, generator=gen) * 0.1
        else:  # norm weights (.weight, 1-D) and modulation tables: full deltas
            m = k[: -len(".weight")] if k.endswith(".weight") else k
            comfy[f"diffusion_model.{m}.diff"] = torch.randn(v.shape, generator=gen) * 0.1
    diffusers = {}
    for key, t in comfy.items():
        module, suffix = key[len("diffusion_model.") :].rsplit(".", 1)
        if suffix == "weight":  # lora_down.weight / lora_up.weight
            module, suffix = (
                module.rsplit(".", 1)[0],
                {"lora_down": "lora_A.weight", "lora_up": "lora_B.weight"}[module.rsplit(".", 1)[1]],
            )
        diffusers[f"transformer.{_wan_to_diffusers(module)}.{suffix}"] = t
    return _save({"comfyui": comfy, "diffusers": diffusers}, tmp)


def _save(files: dict, tmp: Path) -> dict[str, Path]:
    out = {}
    for name, sd in files.items():
        out[name] = tmp / f"{name}.safetensors"
        save_file({k: v.contiguous() for k, v in sd.items()}, str(out[name]))
    return out


def _comfy(tmp: Path, family: str, unet_config: dict, model, loras: list[Path], inputs: dict) -> list[dict]:
    base = tmp / "base.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(base))
    save_file({k: v.contiguous() for k, v in inputs.items()}, str(tmp / "inputs.safetensors"))
    job = {
        "family": family,
        "unet_config": unet_config,
        "base": str(base),
        "inputs": str(tmp / "inputs.safetensors"),
        "loras": [[str(p), STRENGTH, str(tmp / f"{p.stem}.comfy.safetensors")] for p in loras],
    }
    (tmp / "job.json").write_text(json.dumps(job))
    run = subprocess.run(
        [_python(), str(SCRIPT), str(tmp / "job.json")],
        cwd=COMFYUI_DIR, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    results = []
    for _, _, out in job["loras"]:
        results.append(
            {
                "weights": load_file(out),
                "out": load_file(out + ".out.safetensors")["out"],
                "not_loaded": json.loads(Path(out + ".json").read_text())["not_loaded"],
            }
        )
    return results


def _max_diff(ours: dict, theirs: dict) -> float:
    assert set(ours) == set(theirs)
    diffs = {k: (ours[k].float() - theirs[k]).abs().max().item() for k in ours}
    worst = max(diffs, key=diffs.get)
    assert diffs[worst] <= WEIGHT_TOLERANCE, (worst, diffs[worst])
    return diffs[worst]


MEASURED: dict[str, tuple[float, float]] = {}


def test_flux_lora_namings_match_comfyui(tmp_path):
    model = open_model("dummy:flux-tiny").model.float().eval()
    p = model.params
    # what ComfyUI's detection cannot read from the weights (it assumes FLUX.1's full size there); the rest of
    # the config, version-specific fields included, comes from the detection itself (comfy_lora_reference.py)
    unet_config = {
        "image_model": "flux", "hidden_size": p.hidden_size, "num_heads": p.num_heads, "mlp_ratio": p.mlp_ratio,
        "axes_dim": list(p.axes_dim), "theta": p.theta, "context_in_dim": p.context_in_dim,
    }  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    h, w, tokens = 4, 6, 5
    inputs = {
        "x": torch.randn(1, 16, h, w, generator=gen),
        "timestep": torch.tensor([0.6]),
        "context": torch.randn(1, tokens, 4096, generator=gen),
        "y": torch.randn(1, 768, generator=gen),
    }
    files = _flux_files(model, tmp_path)
    with torch.no_grad():
        base_out = model(
            pack_latent(inputs["x"]), image_ids(1, h, w), inputs["context"], text_ids(1, tokens),
            inputs["timestep"], inputs["y"],
        )  # fmt: skip
    results = _comfy(tmp_path, "flux", unet_config, model, list(files.values()), inputs)
    for (name, path), theirs in zip(files.items(), results):
        assert theirs["not_loaded"] == [], name
        merged = apply_lora(model, path, STRENGTH)
        weights = _max_diff(merged.state_dict(), theirs["weights"])
        with torch.no_grad():
            ours = merged(
                pack_latent(inputs["x"]), image_ids(1, h, w), inputs["context"], text_ids(1, tokens),
                inputs["timestep"], inputs["y"],
            )  # fmt: skip
        output = (unpack_latent(ours, h, w) - theirs["out"]).abs().max().item()
        MEASURED[f"flux {name}"] = (weights, output)
        assert (ours - base_out).abs().max().item() > 100 * OUTPUT_TOLERANCE, (
            f"{name} changes nothing measurable"
        )
        assert weights <= WEIGHT_TOLERANCE and output <= OUTPUT_TOLERANCE, (name, weights, output)
    print("max abs diff (weights, output):", MEASURED)


def test_wan_lora_namings_match_comfyui(tmp_path):
    model = open_model("dummy:wan-tiny").model.float().eval()
    p = model.params
    # detection reads the rest from the weights; it takes the head count as dim // 128 (0 for this tiny model)
    unet_config = {
        "image_model": "wan2.1",
        "num_heads": p.num_heads,
        "text_dim": p.text_dim,
        "freq_dim": p.freq_dim,
    }
    gen = torch.Generator().manual_seed(4)
    inputs = {
        "x": torch.randn(1, 16, 3, 4, 6, generator=gen),
        "timestep": torch.tensor([700.0]),
        # 512 tokens: ComfyUI embeds the context as given, ours zero-pads it to text_len first
        "context": torch.randn(1, p.text_len, 4096, generator=gen),
    }
    files = _wan_files(model, tmp_path)
    with torch.no_grad():
        base_out = model(inputs["x"], inputs["timestep"], inputs["context"])
    # ComfyUI merges the ComfyUI-named file; both of our namings must give its weights
    (theirs,) = _comfy(tmp_path, "wan", unet_config, model, [files["comfyui"]], inputs)
    assert theirs["not_loaded"] == []
    for name, path in files.items():
        merged = apply_lora(model, path, STRENGTH)
        weights = _max_diff(merged.state_dict(), theirs["weights"])
        with torch.no_grad():
            ours = merged(inputs["x"], inputs["timestep"], inputs["context"])
        output = (ours - theirs["out"]).abs().max().item()
        MEASURED[f"wan {name}"] = (weights, output)
        assert (ours - base_out).abs().max().item() > 100 * OUTPUT_TOLERANCE, (
            f"{name} changes nothing measurable"
        )
        assert weights <= WEIGHT_TOLERANCE and output <= OUTPUT_TOLERANCE, (name, weights, output)
    print("max abs diff (weights, output):", MEASURED)
