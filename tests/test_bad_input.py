"""Bad input is refused before any work, with one clear line naming where, the input and what was expected.

Engine functions name their own arguments, nodes their inputs, the CLI its flags (one mapping in
``cli/__init__.py``); a job that cannot fit in memory is refused before allocating; non-finite inputs and
outputs are errors, never a silent NaN result; empty work is an error, not an empty result.
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import ROOT, make_cond
from safetensors.torch import save_file

from fewstep.cli import main
from fewstep.engine import TextCondition, open_model
from fewstep.engine.errors import InputError
from fewstep.engine.loader import load_dit
from fewstep.engine.sampling import explicit_sigmas
from fewstep.engine.text_to_image import sample_latent
from fewstep.engine.vae import load_tiny_vae
from fewstep.engine.vae.flux_ae import load_flux_ae


def _cli(capsys, *argv):
    """Run the CLI in this process; returns (exit status, stderr)."""
    status = main(list(argv))
    return status, capsys.readouterr().err


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# -- non-finite values ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["nan,0", "1, nan, 0", "nan"])
def test_nan_sigmas_are_refused(text):
    with pytest.raises(InputError, match=r"input 'custom_sigmas': .*not a finite number"):
        explicit_sigmas(text, "custom_sigmas")


def test_nan_latent_is_refused_naming_the_input(tiny_handle):
    latent = torch.zeros(1, 16, 8, 8)
    latent[0, 3, 2, 1] = float("nan")
    with pytest.raises(InputError, match=r"input 'latent': .*1 of 1024 values are NaN or infinite"):
        sample_latent(tiny_handle, [make_cond(tiny_handle.params)], latent, steps=2)


def test_inf_conditioning_and_nan_cfg_are_refused(tiny_handle):
    cond = make_cond(tiny_handle.params)
    cond.context[0, 0, 0] = float("inf")
    with pytest.raises(InputError, match=r"input 'positive': .*context.*NaN or infinite"):
        sample_latent(tiny_handle, [cond], torch.zeros(1, 16, 8, 8), steps=2)
    neg = make_cond(tiny_handle.params, seed=1)
    neg.pooled[0, 0] = float("nan")
    with pytest.raises(InputError, match=r"input 'negative': .*pooled.*NaN or infinite"):
        sample_latent(
            tiny_handle, [make_cond(tiny_handle.params)], torch.zeros(1, 16, 8, 8), negative=[neg], cfg=2.0
        )
    with pytest.raises(InputError, match=r"input 'cfg': expected a finite number, got nan"):
        sample_latent(
            tiny_handle, [make_cond(tiny_handle.params)], torch.zeros(1, 16, 8, 8), cfg=float("nan")
        )


def test_nan_weights_give_an_error_naming_the_model_and_the_first_step():
    handle = open_model("dummy:flux-tiny", device="cpu", dtype=torch.float32)
    handle.model.final_layer.linear.bias[0] = float("nan")
    with pytest.raises(InputError, match=r"input 'model': the sampled latent is not finite .*step 1 of 3"):
        sample_latent(handle, [make_cond(handle.params)], torch.zeros(1, 16, 8, 8), steps=3)


def test_nan_weights_in_a_file_are_refused_at_load(tmp_path):
    sd = {k: v.clone() for k, v in load_dit("dummy:flux-tiny").state_dict().items()}
    sd["double_blocks.0.img_mlp.0.weight"][1, 2] = float("inf")
    save_file(sd, str(tmp_path / "bad.safetensors"))
    with pytest.raises(
        InputError, match=r"input 'weights': .*double_blocks\.0\.img_mlp\.0\.weight holds NaN"
    ):
        load_dit(str(tmp_path / "bad.safetensors"))


def test_node_reports_non_finite_input_and_sigmas(pack):
    m = pack.NODE_CLASS_MAPPINGS
    (model,) = m["FewStepDiTLoader"]().load("dummy:flux-tiny")
    (cond,) = m["FewStepSyntheticConditioning"]().make(16, 4096, 768, 3.5, 0)
    args = dict(seed=0, steps=4, schedule="custom", sampler="euler", cfg=1.0, denoise=1.0)
    latent = {"samples": torch.zeros(1, 16, 8, 8)}
    with pytest.raises(ValueError, match=r"^FewStepSampler: input 'custom_sigmas': .*not a finite number"):
        m["FewStepSampler"]().sample(model, cond, latent, **args, custom_sigmas="nan,0")
    with pytest.raises(ValueError, match=r"^FewStepSchedule: input 'custom_sigmas': .*not a finite number"):
        m["FewStepSchedule"]().schedule("custom", 4, 1.0, 64, 64, custom_sigmas="1,nan,0")
    bad = {"samples": torch.full((1, 16, 8, 8), float("nan"))}
    args["schedule"] = "flux.1-schnell"
    with pytest.raises(ValueError, match=r"^FewStepSampler: input 'latent_image': .*NaN or infinite"):
        m["FewStepSampler"]().sample(model, cond, bad, **args)


# -- empty work ---------------------------------------------------------------------------------------------------
def test_empty_work_is_an_error(tiny_handle):
    cond = [make_cond(tiny_handle.params)]
    with pytest.raises(InputError, match=r"input 'latent': the latent batch is empty \(0 images\)"):
        sample_latent(tiny_handle, cond, torch.zeros(0, 16, 8, 8))
    with pytest.raises(InputError, match=r"input 'latent': image size 0x0 px: nothing to sample"):
        sample_latent(tiny_handle, cond, torch.zeros(1, 16, 0, 0))
    with pytest.raises(InputError, match=r"input 'positive': the conditioning has 0 text tokens"):
        sample_latent(tiny_handle, [make_cond(tiny_handle.params, tokens=0)], torch.zeros(1, 16, 8, 8))


def test_pooled_and_token_batch_mismatch_is_refused(tiny_handle):
    p = tiny_handle.params
    cond = TextCondition(torch.randn(2, 8, p.context_in_dim), torch.randn(1, p.vec_in_dim))
    with pytest.raises(InputError, match=r"input 'positive': .*2 token rows but 1 pooled"):
        sample_latent(tiny_handle, [cond], torch.zeros(2, 16, 8, 8))


def test_tiny_vae_refuses_empty_and_nan_images(pack):
    m = pack.NODE_CLASS_MAPPINGS
    (vae,) = m["FewStepTinyVAELoader"]().load("dummy:taef1")
    with pytest.raises(ValueError, match=r"^FewStepTinyVAEEncode: input 'pixels': no images to encode"):
        m["FewStepTinyVAEEncode"]().encode(vae, torch.zeros(0, 16, 16, 3))
    with pytest.raises(ValueError, match=r"^FewStepTinyVAEEncode: input 'pixels': .*NaN or infinite"):
        m["FewStepTinyVAEEncode"]().encode(vae, torch.full((1, 16, 16, 3), float("nan")))
    with pytest.raises(ValueError, match=r"^FewStepTinyVAEDecode: input 'samples': no latents to decode"):
        m["FewStepTinyVAEDecode"]().decode(vae, {"samples": torch.zeros(0, 16, 2, 2)})


# -- weights files --------------------------------------------------------------------------------------------
def test_folder_and_empty_file_as_weights(tmp_path):
    (tmp_path / "folder.safetensors").mkdir()
    with pytest.raises(
        InputError, match=r"input 'weights': .*folder.safetensors is a folder, not a weights file"
    ):
        load_dit(str(tmp_path / "folder.safetensors"))
    (tmp_path / "empty.pt").write_bytes(b"")
    with pytest.raises(InputError, match=r"input 'weights': .*empty.pt is empty \(0 bytes\)") as err:
        load_dit(str(tmp_path / "empty.pt"))
    assert "refused it: )" not in str(err.value)
    (tmp_path / "junk.pt").write_bytes(b"not a zip")
    with pytest.raises(InputError, match=r"refused it: [A-Za-z]+Error: \S"):
        load_dit(str(tmp_path / "junk.pt"))


def test_wrong_shape_is_blamed_on_the_right_key(tmp_path):
    sd = {k: v.clone() for k, v in load_dit("dummy:flux-tiny").state_dict().items()}
    sd["final_layer.linear.weight"] = torch.zeros(5, sd["final_layer.linear.weight"].shape[1])
    save_file(sd, str(tmp_path / "bad.safetensors"))
    with pytest.raises(InputError, match=r"wrong shapes: final_layer\.linear\.weight \(5, 64\)") as err:
        load_dit(str(tmp_path / "bad.safetensors"))
    assert "bias" not in str(err.value)


def test_wrong_wan_head_shape_is_blamed_on_the_weight(tmp_path):
    sd = {k: v.clone() for k, v in load_dit("dummy:wan-tiny").state_dict().items()}
    sd["head.head.weight"] = torch.zeros(5, sd["head.head.weight"].shape[1])
    save_file(sd, str(tmp_path / "bad.safetensors"))
    with pytest.raises(InputError, match=r"wrong shapes: head\.head\.weight \(5, ") as err:
        load_dit(str(tmp_path / "bad.safetensors"))
    assert "bias" not in str(err.value)


# -- memory preflight ---------------------------------------------------------------------------------------------
def test_model_that_cannot_fit_is_refused_before_allocating(monkeypatch):
    monkeypatch.setenv("FEWSTEP_MEMORY_LIMIT_GB", "0.05")
    with pytest.raises(
        InputError, match=r"input 'weights': this needs about .*weights.* refused before allocating"
    ):
        load_dit("dummy:flux-mid")


def test_model_file_that_cannot_fit_is_refused(tmp_path, monkeypatch):
    save_file(load_dit("dummy:flux-tiny").state_dict(), str(tmp_path / "m.safetensors"))
    monkeypatch.setenv("FEWSTEP_MEMORY_LIMIT_GB", str(1e-4))
    with pytest.raises(InputError, match=r"input 'weights': this needs about .*weights file"):
        load_dit(str(tmp_path / "m.safetensors"))


def test_sampling_that_cannot_fit_is_refused_before_running(tiny_handle, monkeypatch):
    cond = [make_cond(tiny_handle.params)]
    monkeypatch.setenv("FEWSTEP_MEMORY_LIMIT_GB", "0.01")
    with pytest.raises(InputError, match=r"input 'latent': this needs about .*activations.*refused before"):
        sample_latent(tiny_handle, cond, torch.zeros(1, 16, 64, 64), steps=1)
    # FLUX-sized at 16384 px: refused at once (the latent itself is small; the activations are not)
    monkeypatch.setenv("FEWSTEP_MEMORY_LIMIT_GB", "4")
    with pytest.raises(InputError, match=r"input 'latent': this needs about"):
        sample_latent(tiny_handle, cond, torch.zeros(1, 16, 2048, 2048), steps=1)


def test_sample_estimate_grows_with_tokens_and_rows():
    from fewstep.engine.models.flux import PRESETS
    from fewstep.engine.text_to_image import estimate_sample_bytes

    schnell = PRESETS["flux.1-schnell"]
    small = estimate_sample_bytes(schnell, (1, 16, 128, 128), text_tokens=256, rows=1, dtype=torch.bfloat16)
    huge = estimate_sample_bytes(schnell, (1, 16, 2048, 2048), text_tokens=256, rows=1, dtype=torch.bfloat16)
    cfg = estimate_sample_bytes(schnell, (1, 16, 128, 128), text_tokens=256, rows=2, dtype=torch.bfloat16)
    assert sum(small.values()) < 4 * 2**30  # 1024 px fits next to the weights on a 24 GB GPU
    assert sum(huge.values()) > 141 * 2**30  # 16384 px does not fit even an H200
    assert cfg["activations"] == 2 * small["activations"]


# -- the CLI ------------------------------------------------------------------------------------------------------
def test_generate_default_model_is_refused_with_the_estimate_and_a_hint(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("FEWSTEP_MEMORY_LIMIT_GB", "24")
    status, err = _cli(capsys, "generate", "--dtype", "fp32", "--out", str(tmp_path))
    line = _one_error_line(err)
    assert status == 2 and line.startswith("error: fewstep generate: input '--model': this needs about 44.")
    assert "--model flux-tiny" in line and not (tmp_path / "latent.safetensors").exists()


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["--model", "wan-tiny"],
            "input '--model': wan-tiny is a wan video model, which `python -m fewstep stream --model wan-tiny` runs",
        ),
        (["--batch", "-1"], "input '--batch': expected at least 1, got -1"),
        (["--batch", "0"], "input '--batch': expected at least 1, got 0"),
        (["--text-tokens", "0"], "input '--text-tokens': expected at least 1, got 0"),
        (
            ["--seed", str(2**64)],
            "input '--seed': expected an integer in [0, 2^64 - 1], got 18446744073709551616",
        ),
        (["--schedule", "custom", "--sigmas", "nan,0"], "input '--sigmas': sigma 0 is nan"),
        (["--schedule", "custom", "--sigmas", "1,1"], "input '--sigmas': sigmas must be strictly decreasing"),
        (["--device", "nonsense"], "input '--device': 'nonsense' is not a device"),
    ],
)
def test_generate_bad_options_are_one_line_errors(capsys, tmp_path, argv, expected):
    status, err = _cli(capsys, "generate", "--model", "flux-tiny", "--height", "32", "--width", "32",
                       "--out", str(tmp_path), *argv)  # fmt: skip
    assert status == 2 and expected in _one_error_line(err)
    assert _one_error_line(err).startswith("error: fewstep generate: ")


def test_generate_cfg_without_a_negative_is_refused(capsys, tmp_path):
    """CFG needs a negative to guide against; running at cfg 1 instead (what it did, with a note) would hand back
    an image the user did not ask for."""
    status, err = _cli(capsys, "generate", "--model", "flux-tiny", "--cfg", "3.5", "--out", str(tmp_path))
    assert status == 2 and _one_error_line(err) == (
        "error: fewstep generate: input '--cfg': CFG 3.5 needs a negative prompt: add --negative-prompt TEXT (with "
        "--text-encoder), or --negative-seed N (seeded synthetic negative embeddings), or leave --cfg at 1 (the "
        "few-step models are distilled to run without CFG; the distilled guidance of FLUX.1-dev / FLUX.2-dev is "
        "--guidance)"
    )
    assert not (tmp_path / "latent.safetensors").exists()


def test_generate_cfg_with_a_negative_runs_cfg(capsys, tmp_path):
    status = main(["generate", "--model", "flux-tiny", "--height", "16", "--width", "16", "--steps", "1",
                   "--cfg", "3.5", "--negative-seed", "7", "--out", str(tmp_path)])  # fmt: skip
    assert status == 0 and "1 DiT forwards (2 rows), CFG on" in capsys.readouterr().out.splitlines()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without CUDA")
def test_generate_cuda_on_a_cpu_torch(capsys, tmp_path):
    status, err = _cli(capsys, "generate", "--model", "flux-tiny", "--device", "cuda", "--out", str(tmp_path))
    assert status == 2 and "input '--device': CUDA is not available" in _one_error_line(err)


def test_generate_largest_seed_runs(capsys, tmp_path):
    status, _ = _cli(capsys, "generate", "--model", "flux-tiny", "--height", "16", "--width", "16", "--steps",
                     "1", "--seed", str(2**64 - 1), "--out", str(tmp_path))  # fmt: skip
    assert status == 0 and (tmp_path / "latent.safetensors").exists()


def test_stream_cond_file_errors(capsys, tmp_path):
    status, err = _cli(capsys, "stream", "--cond", str(tmp_path / "missing.safetensors"))
    assert status == 2 and "fewstep stream: input '--cond': file not found" in _one_error_line(err)
    save_file({"pooled": torch.zeros(1, 4)}, str(tmp_path / "nocontext.safetensors"))
    status, err = _cli(capsys, "stream", "--cond", str(tmp_path / "nocontext.safetensors"))
    assert status == 2 and "input '--cond': " in _one_error_line(err) and "no 'context' tensor" in err
    (tmp_path / "junk.safetensors").write_bytes(b"junk")
    status, err = _cli(capsys, "stream", "--cond", str(tmp_path / "junk.safetensors"))
    assert status == 2 and "input '--cond': " in _one_error_line(err) and "not a readable safetensors" in err


@pytest.mark.parametrize(
    "argv,expected",
    [
        (["generate", "--guidance", "nan"], "input '--guidance': expected a finite number, got nan"),
        (
            ["generate", "--negative-seed", "-1"],
            "input '--negative-seed': expected an integer in [0, 2^64 - 1]",
        ),
        (["generate", "--negative-seed", str(2**64)], "input '--negative-seed': expected an integer in"),
        (["generate", "--out", "README.md"], "input '--out': README.md exists and is not a folder"),
        (["stream", "--seed", str(2**64)], "input '--seed': expected an integer in [0, 2^64 - 1]"),
        (["stream", "--text-tokens", "0"], "input '--text-tokens': expected at least 1, got 0"),
        (["stream", "--chunks", "0"], "input '--chunks': expected at least 1, got 0"),
        (["stream", "--context-noise", "nan"], "input '--context-noise': expected a finite number, got nan"),
        (
            ["stream", "--context-noise", "5000"],
            "input '--context-noise': 5000.0 is not a timestep in [0, 1000]",
        ),
        (["stream", "--out", "README.md"], "input '--out': README.md exists and is not a folder"),
    ],
)
def test_more_cli_options_are_one_line_errors_naming_the_flag(capsys, monkeypatch, argv, expected):
    monkeypatch.chdir(ROOT)
    extra = ["--model", "flux-tiny", "--height", "16", "--width", "16"] if argv[0] == "generate" else []
    status, err = _cli(capsys, *argv[:1], *extra, *argv[1:])
    assert status == 2 and expected in _one_error_line(err)
    assert _one_error_line(err).startswith(f"error: fewstep {argv[0]}: ")


def test_stream_largest_seed_runs_and_its_conditioning_errors_name_cond(capsys, tmp_path):
    status, _ = _cli(capsys, "stream", "--chunks", "1", "--seed", str(2**64 - 1))
    assert status == 0
    for name, context in (("nan", torch.full((1, 4, 4096), float("nan"))), ("ints", torch.ones(1, 4, 4096).long()),
                          ("empty", torch.zeros(1, 0, 4096))):  # fmt: skip
        save_file({"context": context}, str(tmp_path / f"{name}.safetensors"))
        status, err = _cli(capsys, "stream", "--cond", str(tmp_path / f"{name}.safetensors"))
        assert status == 2 and _one_error_line(err).startswith("error: fewstep stream: input '--cond': "), err


def test_video_node_errors_name_its_inputs(pack):
    m = pack.NODE_CLASS_MAPPINGS
    (model,) = m["FewStepDiTLoader"]().load("dummy:wan-tiny")
    args = dict(width=48, height=32, num_chunks=1, chunk_frames=2, window_frames=4, sink_frames=0,
                schedule="wan-dmd-4step", steps=4, seed=0)  # fmt: skip
    bad = [[torch.full((1, 4, 4096), float("nan")), {}]]
    with pytest.raises(
        ValueError, match=r"^FewStepCausalVideoSampler: input 'positive': conditioning: .* NaN"
    ):
        m["FewStepCausalVideoSampler"]().generate(model, bad, **args)
    good = [[torch.zeros(1, 4, 4096), {}]]
    with pytest.raises(
        ValueError,
        match=r"^FewStepCausalVideoSampler: input 'context_noise': expected a finite number in \[0.0, 1000.0\], got nan",
    ):
        m["FewStepCausalVideoSampler"]().generate(model, good, **args, context_noise=float("nan"))


def test_cli_errors_name_the_flag_not_the_engine_argument(capsys):
    status, err = _cli(capsys, "stream", "--window-frames", "2")
    assert status == 2 and "fewstep stream: input '--window-frames': the window" in _one_error_line(err)
    status, err = _cli(capsys, "stream", "--kv-dtype", "int8", "--keep-recent-chunks", "9")
    assert status == 2
    assert "fewstep stream: input '--keep-recent-chunks': 9 recent chunks" in _one_error_line(err)
    status, err = _cli(capsys, "plan", "--model", "wan-tiny", "--window-frames", "2")
    assert status == 2 and "fewstep plan: input '--window-frames':" in _one_error_line(err)


def test_unexpected_failure_is_one_line_and_verbose_shows_the_traceback(capsys, monkeypatch):
    import fewstep.cli as cli

    def boom(args):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(cli.COMMANDS["generate"], "run", boom)
    status, err = _cli(capsys, "generate")
    line = _one_error_line(err)
    assert status == 1 and line == (
        "error: fewstep generate: RuntimeError: disk on fire (an internal error; -v shows the traceback)"
    )
    status, err = _cli(capsys, "-v", "generate")
    assert status == 1 and "Traceback" in err and "disk on fire" in err


def test_engine_names_its_own_arguments():
    with pytest.raises(InputError, match=r"^input 'device': 'nonsense' is not a device"):
        open_model("dummy:flux-tiny", device="nonsense")
    assert os.environ.get("FEWSTEP_MEMORY_LIMIT_GB") is None


def test_conditioning_with_a_non_number_is_refused(pack):
    m = pack.NODE_CLASS_MAPPINGS
    (model,) = m["FewStepDiTLoader"]().load("dummy:flux-tiny")
    (cond,) = m["FewStepSyntheticConditioning"]().make(16, 4096, 768, 3.5, 0)
    bad = [[cond[0][0], {**cond[0][1], "guidance": "abc"}]]
    args = dict(seed=0, steps=1, schedule="flux.1-schnell", sampler="euler", cfg=1.0, denoise=1.0)
    with pytest.raises(
        ValueError, match=r"^FewStepSampler: input 'positive': entry 0: guidance is 'abc', not a"
    ):
        m["FewStepSampler"]().sample(model, bad, {"samples": torch.zeros(1, 16, 8, 8)}, **args)


def test_decoding_what_cannot_fit_is_refused_before_running(monkeypatch):
    tiny = load_tiny_vae("dummy:taef1", device="cpu", dtype=torch.float32)
    ae = load_flux_ae("dummy:flux1-ae-tiny", device="cpu", dtype=torch.float32)
    monkeypatch.setenv("FEWSTEP_MEMORY_LIMIT_GB", "0.01")
    with pytest.raises(
        InputError, match=r"input 'latent': this needs about 4\.05 GiB \(decoder activations 4\.00 GiB"
    ):
        tiny.decode(torch.zeros(1, 16, 256, 256))
    with pytest.raises(InputError, match=r"input 'images': this needs about .* refused before allocating"):
        tiny.encode(torch.zeros(1, 3, 2048, 2048))
    with pytest.raises(
        InputError, match=r"input 'latent': .*mid-block attention .* refused before allocating"
    ):
        ae.decode(torch.zeros(1, 16, 256, 256))
    with pytest.raises(InputError, match=r"input 'image': .* refused before allocating"):
        ae.encode(torch.zeros(1, 3, 2048, 2048))
