"""Text prompts on the command line: ``encode``, ``generate --prompt`` / ``--negative-prompt``, ``stream --prompt``
/ ``--prompt-switch CHUNK:TEXT`` / ``--script`` with ``--text-encoder`` (tiny random encoders of the official
architectures, tests/tiny_text_encoders.py).

The whole ``generate`` from a text prompt is checked against the diffusers pipeline's own run from the same prompt
(FluxPipeline, Flux2KleinPipeline, ZImagePipeline: their text encoding, their sampling loop), on the same tiny
random transformer and text encoder and the same initial noise."""

from __future__ import annotations

import json
import os

import pytest
import tiny_text_encoders as tiny
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fewstep.cli import main
from fewstep.engine import FLUX1, noise_for
from fewstep.engine.models import flux2_checkpoint, zimage_checkpoint

pytest.importorskip("transformers", reason="transformers not installed (the text extra)")
PRESETS = tiny.presets()
FOX = "a red fox running through snow at dawn"
CAT = "portrait of a cat sitting on bench at night"


@pytest.fixture
def folders(encoder_folders):
    return encoder_folders


def _run(capsys, *argv):
    status = main([str(a) for a in argv])
    out = capsys.readouterr()
    return status, out.out, out.err


def _latent(folder) -> torch.Tensor:
    return load_file(os.path.join(folder, "latent.safetensors"))["latent"]


def test_encode_writes_what_cond_reads_and_generate_from_it_equals_generate_from_the_prompt(
    capsys, folders, tmp_path
):
    cond = tmp_path / "fox.safetensors"
    status, out, err = _run(capsys, "encode", "--model", "flux-tiny", "--text-encoder", folders["flux"],
                            "--prompt", FOX, "--out", cond)  # fmt: skip
    assert status == 0, err
    assert f"wrote {cond} (context [1, 256, 4096], pooled [1, 768]); use it as --cond {cond}" in out
    with safe_open(str(cond), "pt") as f:
        meta = f.metadata()
        assert set(f.keys()) == {"context", "pooled"}
    assert meta["prompt"] == FOX and meta["family"] == "flux" and meta["format"] == "fewstep.cond/1"
    assert json.loads(meta["settings"]) == {"max_sequence_length": 256}
    common = ("generate", "--model", "flux-tiny", "--height", 64, "--width", 64)
    assert _run(capsys, *common, "--cond", cond, "--out", tmp_path / "a")[0] == 0
    status, out, err = _run(capsys, *common, "--prompt", FOX, "--text-encoder", folders["flux"],
                            "--out", tmp_path / "b")  # fmt: skip
    assert status == 0, err
    assert torch.equal(_latent(tmp_path / "a"), _latent(tmp_path / "b"))
    assert out.startswith("text encoder: FLUX.1: CLIP-L (pooled 768) + T5-XXL (context 4096), 256 tokens (")
    report = json.loads((tmp_path / "b" / "timings.json").read_text())["text_encoder"]
    assert (
        report["family"] == "flux"
        and report["prompts"] == 1
        and report["settings"] == {"max_sequence_length": 256}
    )


def test_a_repeated_prompt_is_a_cache_hit_and_the_negative_prompt_drives_cfg(capsys, folders, tmp_path):
    lake = "quiet lake with mountains in background"  # encoded by no other test of this process
    common = ("generate", "--model", "flux-tiny", "--height", 64, "--width", 64, "--text-encoder", folders["flux"],
              "--prompt", lake, "--cfg", 3)  # fmt: skip
    status, out, err = _run(capsys, *common, "--negative-prompt", lake, "--json", "--out", tmp_path / "same")
    assert status == 0, err
    text = json.loads(out)["text_encoder"]
    assert (text["prompts"], text["cache_misses"], text["cache_hits"]) == (2, 1, 1)
    assert _run(capsys, *common, "--negative-prompt", CAT, "--out", tmp_path / "other")[0] == 0
    # CFG against the prompt itself is the prompt alone (cfg * c - (cfg - 1) * c); against another it is not
    assert _run(capsys, "generate", "--model", "flux-tiny", "--height", 64, "--width", 64, "--text-encoder",
                folders["flux"], "--prompt", lake, "--out", tmp_path / "plain")[0] == 0  # fmt: skip
    plain = _latent(tmp_path / "plain")
    assert torch.allclose(_latent(tmp_path / "same"), plain, atol=1e-4)
    assert not torch.allclose(_latent(tmp_path / "other"), plain, atol=1e-3)


def test_the_encoder_is_freed_before_the_model_loads(capsys, folders, tmp_path, monkeypatch):
    from fewstep.cli import generate
    from fewstep.engine.text_encoders import flux1

    events = []
    close, open_model = flux1.Flux1TextEncoder.close, generate.open_model
    monkeypatch.setattr(
        flux1.Flux1TextEncoder, "close", lambda self: (events.append("encoder closed"), close(self))
    )
    monkeypatch.setattr(
        generate, "open_model", lambda *a, **k: (events.append("model loaded"), open_model(*a, **k))[1]
    )
    status, _, err = _run(capsys, "generate", "--model", "flux-tiny", "--height", 64, "--width", 64,
                          "--text-encoder", folders["flux"], "--prompt", CAT, "--out", tmp_path)  # fmt: skip
    assert status == 0, err
    assert events == ["encoder closed", "model loaded"]


def _pipeline_check(name):
    diffusers = pytest.importorskip("diffusers", reason="diffusers not installed (optional cross-check)")
    try:
        getattr(diffusers, name)
    except (AttributeError, ImportError) as err:
        pytest.skip(f"diffusers {diffusers.__version__} has no {name} here: {str(err).strip()[:100]}")
    return diffusers


def _randomize(model, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for t in model.parameters():  # a trained model's scale, so every block changes the result
            t.normal_(0, 0.1) if t.ndim > 1 else t.normal_(1, 0.2)
    return model.eval()


def test_generate_from_a_prompt_equals_diffusers_flux_pipeline(capsys, folders, tmp_path):
    """FLUX.1-schnell: 4 steps, no CFG, 256 T5 tokens (``max_sequence_length=256``, BFL's schnell value)."""
    diffusers = _pipeline_check("FluxPipeline")
    tf = pytest.importorskip("transformers")
    p = PRESETS["flux-tiny"][1]
    ref = _randomize(diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=p.in_channels, num_layers=p.depth, num_single_layers=p.depth_single_blocks,
        attention_head_dim=p.hidden_size // p.num_heads, num_attention_heads=p.num_heads,
        joint_attention_dim=p.context_in_dim, pooled_projection_dim=p.vec_in_dim, guidance_embeds=False,
        axes_dims_rope=tuple(p.axes_dim),
    ), 1)  # fmt: skip
    weights = tmp_path / "flux-diffusers.safetensors"
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(weights))
    status, _, err = _run(capsys, "generate", "--weights", weights, "--height", 64, "--width", 64, "--seed", 7,
                          "--prompt", FOX, "--text-encoder", folders["flux"], "--out", tmp_path / "ours")  # fmt: skip
    assert status == 0, err
    ours = _latent(tmp_path / "ours")
    root = folders["flux"]
    pipe = diffusers.FluxPipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=False), vae=None,
        text_encoder=tf.CLIPTextModel.from_pretrained(f"{root}/text_encoder"),
        tokenizer=tf.AutoTokenizer.from_pretrained(f"{root}/tokenizer"),
        text_encoder_2=tf.T5EncoderModel.from_pretrained(f"{root}/text_encoder_2"),
        tokenizer_2=tf.AutoTokenizer.from_pretrained(f"{root}/tokenizer_2"), transformer=ref,
    )  # fmt: skip
    pipe.set_progress_bar_config(disable=True)
    noise = noise_for(torch.zeros(1, 16, 8, 8), 7)  # what generate draws for seed 7
    out = pipe(prompt=FOX, height=64, width=64, num_inference_steps=4, max_sequence_length=256,
               latents=pipe._pack_latents(noise, 1, 16, 8, 8), output_type="latent", return_dict=False)[0]  # fmt: skip
    expected = pipe._unpack_latents(out, 64, 64, pipe.vae_scale_factor)
    diff = (FLUX1.process_in(ours) - expected).abs().max().item()
    print(f"max abs diff vs diffusers FluxPipeline from the prompt (4 steps): {diff:.3g}")
    assert diff <= 1e-4


def test_generate_from_a_prompt_equals_diffusers_flux2_klein_pipeline(capsys, folders, tmp_path):
    """FLUX.2 klein: Qwen3 layers 9/18/27 stacked, 512 tokens, 4 steps, no CFG (is_distilled)."""
    diffusers = _pipeline_check("Flux2KleinPipeline")
    tf = pytest.importorskip("transformers")
    import types

    p = PRESETS["flux2-tiny"][1]
    ref = _randomize(diffusers.Flux2Transformer2DModel(**flux2_checkpoint.diffusers_config(p)), 4)
    weights = tmp_path / "klein.safetensors"
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(weights))
    status, _, err = _run(capsys, "generate", "--weights", weights, "--height", 96, "--width", 64, "--seed", 11,
                          "--prompt", FOX, "--text-encoder", folders["klein"], "--out", tmp_path / "ours")  # fmt: skip
    assert status == 0, err
    ours = _latent(tmp_path / "ours")
    pipe = diffusers.Flux2KleinPipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, time_shift_type="exponential"),
        vae=None, text_encoder=tf.Qwen3ForCausalLM.from_pretrained(folders["klein"]),
        tokenizer=tf.AutoTokenizer.from_pretrained(folders["klein"]), transformer=ref, is_distilled=True,
    )  # fmt: skip
    pipe.set_progress_bar_config(disable=True)
    bn = types.SimpleNamespace(running_mean=torch.zeros(128), running_var=torch.ones(128))
    pipe.vae = types.SimpleNamespace(
        bn=bn, config=types.SimpleNamespace(batch_norm_eps=0.0)
    )  # identity batch-norm
    noise = noise_for(torch.zeros(1, 128, 6, 4), 11)
    out = pipe(prompt=FOX, height=96, width=64, num_inference_steps=4, guidance_scale=1.0, latents=noise.clone(),
               output_type="latent", return_dict=False)[0]  # fmt: skip
    diff = (ours - pipe._patchify_latents(out)).abs().max().item()
    print(f"max abs diff vs diffusers Flux2KleinPipeline from the prompt (4 steps): {diff:.3g}")
    assert diff <= 1e-4


def test_generate_from_a_prompt_equals_diffusers_zimage_pipeline(capsys, folders, tmp_path):
    """Z-Image-Turbo: Qwen3 chat template, second-to-last layer, padding dropped; 8 steps, guidance 0."""
    diffusers = _pipeline_check("ZImagePipeline")
    tf = pytest.importorskip("transformers")
    p = PRESETS["zimage-tiny"][1]
    ref = _randomize(diffusers.ZImageTransformer2DModel(**zimage_checkpoint.diffusers_config(p)), 5)
    weights = tmp_path / "zimage.safetensors"
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(weights))
    status, _, err = _run(capsys, "generate", "--weights", weights, "--height", 80, "--width", 96, "--seed", 5,
                          "--steps", 8, "--prompt", CAT, "--text-encoder", folders["zimage"],
                          "--out", tmp_path / "ours")  # fmt: skip
    assert status == 0, err
    ours = _latent(tmp_path / "ours")
    pipe = diffusers.ZImagePipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0), vae=None,
        text_encoder=tf.Qwen3ForCausalLM.from_pretrained(folders["zimage"]),
        tokenizer=tf.AutoTokenizer.from_pretrained(folders["zimage"]), transformer=ref,
    )  # fmt: skip
    pipe.set_progress_bar_config(disable=True)
    noise = noise_for(torch.zeros(1, 16, 10, 12), 5)
    out = pipe(prompt=CAT, height=80, width=96, num_inference_steps=8, guidance_scale=0.0, latents=noise.clone(),
               output_type="latent", return_dict=False)[0]  # fmt: skip
    diff = (FLUX1.process_in(ours) - out).abs().max().item()
    print(f"max abs diff vs diffusers ZImagePipeline from the prompt (8 steps): {diff:.3g}")
    assert diff <= 1e-4


def _stream_latents(folder) -> torch.Tensor:
    return load_file(os.path.join(folder, "latents.safetensors"))["latent"]


@pytest.fixture(scope="module")
def wan_weights(tmp_path_factory):
    """wan-tiny's dummy weights as a checkpoint file: real weights as far as the CLI can tell."""
    from fewstep.engine import load_dit

    path = tmp_path_factory.mktemp("wan") / "wan-tiny.safetensors"
    save_file(
        {k: v.contiguous() for k, v in load_dit("dummy:wan-tiny", torch.float32).state_dict().items()},
        str(path),
    )
    return path


def test_stream_prompts_and_text_switches_equal_the_same_run_from_encoded_files(capsys, folders, tmp_path):
    files = {}
    for name, text in (("fox", FOX), ("cat", CAT)):
        files[name] = tmp_path / f"{name}.safetensors"
        assert _run(capsys, "encode", "--model", "wan-tiny", "--text-encoder", folders["wan"], "--prompt", text,
                    "--out", files[name])[0] == 0  # fmt: skip
    common = ("stream", "--model", "wan-tiny", "--chunks", 3, "--seed", 2)
    status, out, err = _run(capsys, *common, "--text-encoder", folders["wan"], "--prompt", FOX,
                            "--prompt-switch", f"1:{CAT}:recache", "--prompt-switch", f"2:{FOX}",
                            "--out", tmp_path / "text")  # fmt: skip
    assert status == 0, err
    assert "text encoder: Wan 2.1: umT5-XXL (context 4096), 512 tokens, zeros past the prompt (" in out
    assert _run(capsys, *common, "--cond", files["fox"], "--prompt-switch", f"1:{files['cat']}:recache",
                "--prompt-switch", f"2:{files['fox']}", "--out", tmp_path / "files")[0] == 0  # fmt: skip
    assert torch.equal(_stream_latents(tmp_path / "text"), _stream_latents(tmp_path / "files"))
    report = json.loads((tmp_path / "text" / "stream.json").read_text())
    assert report["text_encoder"]["prompts"] == 3 and report["text_encoder"]["cache_hits"] >= 1  # FOX twice
    assert [(s["chunk"], s["cond"], s["recache"]) for s in report["prompt_switches"]] == [
        (1, CAT, True),
        (2, FOX, False),
    ]


def test_a_script_runs_real_weights_with_a_text_encoder(capsys, folders, tmp_path, wan_weights):
    script = tmp_path / "s.json"
    script.write_text(json.dumps({"prompt": FOX, "seed": 3, "chunks": 3,
                                  "controls": [{"chunk": 1, "prompt": CAT, "recache": True}]}))  # fmt: skip
    common = ("stream", "--weights", wan_weights, "--text-encoder", folders["wan"])
    status, _, err = _run(capsys, *common, "--script", script, "--out", tmp_path / "script")
    assert status == 0, err
    assert _run(capsys, *common, "--prompt", FOX, "--seed", 3, "--chunks", 3, "--prompt-switch", f"1:{CAT}:recache",
                "--out", tmp_path / "flags")[0] == 0  # fmt: skip
    assert torch.equal(_stream_latents(tmp_path / "script"), _stream_latents(tmp_path / "flags"))
    # without an encoder, real weights still refuse the script's text (the synthetic embedding is for dummies)
    status, _, err = _run(capsys, "stream", "--weights", wan_weights, "--script", script)
    assert status == 2 and "script prompts are text: with real weights give --text-encoder DIR" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ("generate", "--prompt", FOX),
            "input '--prompt': a text prompt needs --text-encoder DIR (the family's text "
            "encoder folder); without one, pass embeddings made elsewhere as --cond FILE",
        ),
        (
            ("generate", "--text-encoder", "{flux}"),
            "input '--text-encoder': encodes --prompt (and --negative-prompt): give --prompt TEXT",
        ),
        (
            ("generate", "--prompt", FOX, "--text-encoder", "{flux}", "--cond", "x.safetensors"),
            "input '--prompt': give --prompt or --cond, not both",
        ),
        (
            (
                "generate",
                "--prompt",
                FOX,
                "--text-encoder",
                "{flux}",
                "--negative-prompt",
                "x",
                "--negative-seed",
                1,
            ),
            "input '--negative-prompt': give --negative-prompt or --negative-seed, not both",
        ),
        (
            ("generate", "--max-sequence-length", 8),
            "input '--max-sequence-length': applies to prompts encoded with --text-encoder",
        ),
        (
            ("generate", "--prompt", FOX, "--text-encoder", "{flux}", "--max-sequence-length", 100000000),
            "input '--max-sequence-length': expected an integer from 1 to 512 (the longest prompt the official "
            "pipelines encode), got 100000000",
        ),
        (
            ("stream", "--prompt", FOX, "--text-encoder", "{wan}", "--max-sequence-length", 0),
            "input '--max-sequence-length': expected an integer from 1 to 512 (the longest prompt the official "
            "pipelines encode), got 0",
        ),
        (
            ("generate", "--model", "flux-tiny", "--prompt", FOX, "--text-encoder", "{wan}"),
            "input '--text-encoder': {wan} holds no CLIP-L + T5-XXL pair: expected a pipeline folder with text_encoder/ "
            "(CLIP-L), tokenizer/, text_encoder_2/ (T5-XXL) and tokenizer_2/ (the diffusers layout of "
            "black-forest-labs/FLUX.1-schnell or FLUX.1-dev)",
        ),
        (
            ("generate", "--model", "zimage-tiny", "--prompt", FOX, "--text-encoder", "{wan}"),
            "input '--text-encoder': {wan} holds a umT5 (Wan 2.1's umT5-XXL) text encoder; this model needs Qwen3-4B "
            "(context 2560)",
        ),
        (
            ("stream", "--model", "wan-tiny", "--prompt", FOX, "--text-encoder", "{zimage}"),
            "input '--text-encoder': {zimage} holds a Qwen3 (Z-Image's Qwen3-4B, FLUX.2 klein's Qwen3-4B / 8B) text "
            "encoder; this model needs umT5-XXL (context 4096)",
        ),
        (
            ("stream", "--model", "wan-tiny", "--text-encoder", "{wan}", "--prompt-switch", "x"),
            "input '--prompt-switch': 'x': expected CHUNK:TEXT or CHUNK:TEXT:recache (a chunk number of this run, then "
            "the prompt --text-encoder encodes)",
        ),
        (
            ("stream", "--model", "wan-tiny", "--text-encoder", "{wan}"),
            "input '--text-encoder': encodes --prompt, "
            "--prompt-switch CHUNK:TEXT or a --script's prompts: give one of them",
        ),
        (
            ("encode", "--model", "wan-tiny", "--text-encoder", "{wan}", "--prompt", FOX, "--out", "x.pt"),
            "input '--out': x.pt: expected a .safetensors file name (the format --cond reads)",
        ),
        (
            (
                "encode",
                "--model",
                "wan-tiny",
                "--text-encoder",
                "/nonexistent/folder",
                "--prompt",
                FOX,
                "--out",
                "{zimage}/../p.safetensors",
            ),
            "input '--text-encoder': /nonexistent/folder does not exist; expected the folder of a text encoder download",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) and len(v) < 20 else None,
)
def test_prompt_flags_are_refused_with_the_flag_named(capsys, folders, tmp_path, argv, message):
    argv = [a.format(**folders) if isinstance(a, str) else a for a in argv]
    status, _, err = (
        _run(capsys, *argv, "--out", tmp_path / "o") if "--out" not in argv else _run(capsys, *argv)
    )
    lines = [line for line in err.splitlines() if line.strip()]
    command = argv[0]
    assert status == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0] == f"error: fewstep {command}: " + message.format(**folders)
