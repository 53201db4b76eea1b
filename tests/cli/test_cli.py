"""CLI smoke tests on a tiny preset (a real subprocess, as a user runs it)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from fewstep.engine.units import format_bytes


def _cli(*args, cwd=None, env=None):
    env = None if env is None else {**os.environ, **env}
    return subprocess.run(
        [sys.executable, "-m", "fewstep", *args], capture_output=True, text=True, cwd=cwd, env=env
    )


def test_generate_writes_latent_and_timings(tmp_path):
    out = tmp_path / "gen"
    r = _cli(
        "generate",
        "--model",
        "flux-tiny",
        "--weights",
        "dummy",
        "--height",
        "64",
        "--width",
        "96",
        "--steps",
        "3",
        "--seed",
        "5",
        "--out",
        str(out),
    )
    assert r.returncode == 0, r.stderr
    latent = load_file(str(out / "latent.safetensors"))["latent"]
    assert latent.shape == (1, 16, 8, 12) and torch.isfinite(latent).all()
    info = json.loads((out / "timings.json").read_text())
    assert info["dit_forwards"] == 3 and info["sigmas"][-1] == 0.0
    assert set(info["timings"]) == {"load_s", "prepare_s", "sampling_s", "per_step_s", "save_s"}
    assert len(info["timings"]["per_step_s"]) == 3
    # every output file gets the mode open() gives (safetensors used to be 0600 beside a 0644 JSON)
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir() if p.is_file()}
    assert len(set(modes.values())) == 1 and "latent.safetensors" in modes and "timings.json" in modes, modes
    # same seed, same latent
    r2 = _cli(
        "generate",
        "--model",
        "flux-tiny",
        "--height",
        "64",
        "--width",
        "96",
        "--steps",
        "3",
        "--seed",
        "5",
        "--out",
        str(tmp_path / "gen2"),
    )
    assert r2.returncode == 0
    assert torch.equal(latent, load_file(str(tmp_path / "gen2" / "latent.safetensors"))["latent"])


def test_generate_bad_input_is_a_clear_error(tmp_path):
    r = _cli("generate", "--model", "flux-tiny", "--height", "72", "--out", str(tmp_path))
    assert r.returncode == 2 and "input '--height': 72 px is not a positive multiple of 16" in r.stderr
    assert "Traceback" not in r.stderr
    r = _cli("generate", "--weights", str(tmp_path / "missing.safetensors"), "--out", str(tmp_path))
    assert r.returncode == 2 and "input '--weights': weights file not found" in r.stderr


def test_help_lists_commands():
    r = _cli("--help")
    assert r.returncode == 0 and "generate" in r.stdout and "demo" in r.stdout


@pytest.mark.slow
def test_demo_writes_report(tmp_path):
    r = _cli(
        "demo", "--model", "flux-tiny", "--size", "64", "--repeats", "2", "--out", str(tmp_path / "demo")
    )
    assert r.returncode == 0, r.stderr
    report = json.loads((tmp_path / "demo" / "report.json").read_text())
    assert report["CFG"]["rows"] == {
        "no negative: forwards, rows": "4, 4",
        "no negative seconds": report["few-step vs many-step"]["rows"][
            "flux.1-schnell schedule, 4 steps (4 forwards)"
        ],
        "negative, cfg 1: forwards, rows": "4, 4 (negative skipped)",
        "negative, cfg 1 seconds": report["CFG"]["rows"]["negative, cfg 1 seconds"],
        "negative, cfg 3.5: forwards, rows": "4, 8",
        "negative, cfg 3.5 seconds": report["CFG"]["rows"]["negative, cfg 3.5 seconds"],
        "cfg 3.5 / no negative, medians": report["CFG"]["rows"]["cfg 3.5 / no negative, medians"],
    }
    assert report["CFG"]["rows"]["cfg 3.5 / no negative, medians"].endswith("(rows: 2x)")
    assert report["CFG"]["forwards"] == [4, 4, 4] and report["CFG"]["rows_evaluated"] == [4, 4, 8]
    assert len(report["causal video stream"]["seconds"]) == 5
    assert report["weight storage"]["bytes"][2] < report["weight storage"]["bytes"][1]
    assert (tmp_path / "demo" / "report.md").read_text().startswith("# fewstep demo report")
    assert (tmp_path / "demo" / "schnell_4step.safetensors").exists()
    families = report["FLUX.2 and Z-Image"]
    assert families["flux2-tiny"]["schedule"] == "flux.2-klein" and families["flux2-tiny"]["forwards"] == 4
    assert families["flux2-tiny"]["latent_shape"] == [1, 128, 4, 4]  # 64 px at 1/16
    assert families["zimage-tiny"]["schedule"] == "z-image-turbo" and families["zimage-tiny"]["forwards"] == 8
    assert families["zimage-tiny"]["latent_shape"] == [1, 16, 8, 8]
    assert (tmp_path / "demo" / "flux2-tiny_tiny.png").exists() and (
        tmp_path / "demo" / "zimage-tiny_tiny.png"
    ).exists()
    _demo_report_json_matches_md(report, (tmp_path / "demo" / "report.md").read_text())
    _demo_names_every_output(report, tmp_path / "demo", r.stdout)
    _demo_timings_are_medians_of_the_repeats(report, 2)
    _demo_states_the_machine(report, r.stdout)
    _demo_video_is_watchable(report, tmp_path / "demo")


def _md_sections(md: str) -> dict[str, dict[str, str]]:
    sections, title = {}, None
    for line in md.splitlines():
        if line.startswith("## "):
            title = line[3:]
            sections[title] = {}
        elif line.startswith("| ") and title is not None and line != "| | |":
            label, value = line[2:-2].split(" | ", 1)
            sections[title][label] = value
    return sections


def _demo_report_json_matches_md(report: dict, md: str) -> None:
    """Every figure report.md shows is in report.json, under the same section and label: a timing's median and
    range (and each run), any other value as the same text."""
    sections = _md_sections(md)
    assert list(sections) == list(report)
    for title, rows in sections.items():
        assert list(rows) == list(report[title]["rows"]), title
        for label, shown in rows.items():
            value = report[title]["rows"][label]
            if isinstance(value, dict):  # a timing
                runs = len(value["runs_s"])
                spread = (
                    f"({value['min_s']:.2f}-{value['max_s']:.2f}, {runs} runs)" if runs > 1 else "(1 run)"
                )
                assert shown == f"{value['median_s']:.2f} s {spread}", (title, label)
            else:
                assert shown == value, (title, label)


def _demo_names_every_output(report: dict, out, stdout: str) -> None:
    """The total section names every file the demo wrote (the four PNGs among them), and nothing else is in the
    folder; the KV cache row gives binary units, not raw bytes."""
    total = report["total"]["rows"]
    assert total["images"] == "decode_tiny.png, decode_full.png, flux2-tiny_tiny.png, zimage-tiny_tiny.png"
    assert total["video"] == "stream.mp4" and total["report"] == "report.md, report.json"
    named = [name for kind in ("images", "video", "latents", "report") for name in total[kind].split(", ")]
    assert sorted(named) == sorted(os.listdir(out))
    assert f"wrote {len(named)} files to {out}: the outputs rows above" in stdout.splitlines()
    kv = report["causal video stream"]["rows"]["KV cache"]
    used = report["causal video stream"]["kv_bytes_used"]
    assert kv.endswith("used per chunk: " + ", ".join(format_bytes(b) for b in used)), kv
    assert re.match(r"\d+\.\d\d (KiB|MiB|GiB) allocated \(flat\), ", kv), kv


def _demo_timings_are_medians_of_the_repeats(report: dict, repeats: int) -> None:
    import statistics

    timings = [v for section in report.values() for v in section["rows"].values() if isinstance(v, dict)]
    repeated = [t for t in timings if len(t["runs_s"]) == repeats]
    assert len(repeated) >= 12  # every sampling and decode figure; the stream's later chunks are 4 runs
    for t in timings:
        assert t["median_s"] == statistics.median(t["runs_s"])
        assert (t["min_s"], t["max_s"]) == (min(t["runs_s"]), max(t["runs_s"]))
    # one measurement quoted wherever the same run is shown, not a second run of it
    four = report["few-step vs many-step"]["rows"]["flux.1-schnell schedule, 4 steps (4 forwards)"]
    assert report["samplers (4 steps)"]["rows"]["euler seconds"] == four
    assert report["weight storage"]["rows"]["fp32 sampling seconds"] == four
    assert (
        report["decode: tiny vs full autoencoder"]["rows"]["4-step sampling seconds (the run above)"] == four
    )


def _demo_states_the_machine(report: dict, stdout: str) -> None:
    machine = report["machine"]
    assert set(machine["before"]) == set(machine["after"]) == {"cores", "torch_threads", "load_average"}
    assert (
        machine["after"]["cores"] == os.cpu_count()
        and machine["after"]["torch_threads"] == torch.get_num_threads()
    )
    loads = [machine["before"]["load_average"][0], machine["after"]["load_average"][0]]
    assert machine["busy"] == (max(loads) > os.cpu_count())
    assert machine["rows"]["busy machine"].startswith("yes: the load" if machine["busy"] else "no")
    assert ("warning: busy machine" in stdout) == machine["busy"]


def _demo_video_is_watchable(report: dict, out) -> None:
    stream = report["causal video stream"]
    assert stream["video_frames"] == 57 and stream["video"] == str(
        out / "stream.mp4"
    )  # 5 chunks x 3: 4 * 15 - 3
    av = pytest.importorskip("av")
    with av.open(stream["video"]) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(frames) == 57 and frames[0].shape == (64, 96, 3)


def test_stream_reports_chunks_and_kv_bytes(tmp_path):
    r = _cli("stream", "--model", "wan-tiny", "--height", "32", "--width", "48", "--chunks", "4",
             "--chunk-frames", "2", "--window-frames", "4", "--sink-frames", "1", "--json",
             "--tiny-vae", "dummy:taew2_1", "--out", str(tmp_path))  # fmt: skip
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    per_token = 2 * 64 * 2 * 4  # K and V x dim x layers x fp32
    assert report["kv_bytes_per_token"] == per_token and report["tokens_per_frame"] == 6
    sink_copy = (
        6 * per_token // 2
    )  # rope="cache": the sink frame's keys, unrotated (taken when chunk 1 begins)
    assert [c["kv_bytes"] for c in report["chunks"]] == [4 * 6 * per_token + sink_copy] * 4
    assert [c["kv_bytes_used"] for c in report["chunks"]] == [2 * 6 * per_token] + [
        4 * 6 * per_token + sink_copy
    ] * 3
    assert report["first_chunk_seconds"] == report["chunks"][0]["seconds"] > 0
    saved = load_file(str(tmp_path / "latents.safetensors"))
    assert saved["latent"].shape == (1, 16, 8, 4, 6) and saved["frames"].shape == (1, 29, 3, 32, 48)


def test_stream_bad_input():
    r = _cli("stream", "--latent-frames", "7", "--chunk-frames", "3")
    assert (
        r.returncode == 2
        and "input '--latent-frames': 7 latent frames is not a positive multiple of the chunk (3)" in r.stderr
    )
    r = _cli("stream", "--window-frames", "2")
    assert (
        r.returncode == 2
        and "fewstep stream: input '--window-frames': the window (2 latent frames) is smaller" in r.stderr
    )


def _generate(out, *args):
    return _cli("generate", "--height", "64", "--width", "96", "--out", str(out), *args)


def test_generate_zimage_uses_its_schedule_width_and_taef1(tmp_path):
    r = _generate(tmp_path, "--model", "zimage-tiny", "--steps", "2", "--decode", "tiny")
    assert r.returncode == 0, r.stderr
    info = json.loads((tmp_path / "timings.json").read_text())
    assert info["schedule"] == "z-image-turbo" and info["dit_forwards"] == 2
    assert info["latent_shape"] == [1, 16, 8, 12]  # FLUX.1's AE: 16 channels at 1/8
    assert info["model"].startswith("zimage [zimage-tiny]")
    assert (tmp_path / "image.png").exists()


def test_generate_flux2_writes_its_128_channel_latent_and_decodes_with_taef2(tmp_path):
    r = _generate(tmp_path, "--model", "flux2-tiny", "--steps", "2", "--decode", "tiny")
    assert r.returncode == 0, r.stderr
    info = json.loads((tmp_path / "timings.json").read_text())
    assert info["schedule"] == "flux.2-klein" and info["dit_forwards"] == 2
    latent = load_file(str(tmp_path / "latent.safetensors"))["latent"]
    assert latent.shape == (1, 128, 4, 6) and torch.isfinite(latent).all()  # ComfyUI's FLUX.2 LATENT: 1/16
    from PIL import Image

    assert Image.open(tmp_path / "image.png").size == (96, 64)


@pytest.mark.slow
def test_generate_flux2_refuses_a_decoder_of_another_latent_space(tmp_path):
    r = _generate(
        tmp_path, "--model", "flux2-tiny", "--steps", "1", "--decode", "tiny", "--tiny-vae", "dummy:taef1"
    )
    assert r.returncode == 2 and "input '--tiny-vae': taef1" in r.stderr and "[1, 128, 4, 6]" in r.stderr
    r = _generate(tmp_path, "--model", "flux2-tiny", "--steps", "1", "--decode", "full")
    assert r.returncode == 2
    assert "input '--decode': the engine's full autoencoder is FLUX.1's (Z-Image shares it)" in r.stderr
    assert "--decode tiny (taef2)" in r.stderr


def test_generate_guidance_distilled_models_default_to_their_many_step_schedule():
    from fewstep.cli.common import default_schedule, default_tiny_vae
    from fewstep.engine.models.registry import all_presets

    expected = {
        "flux.1-schnell": "flux.1-schnell", "flux.1-dev": "flux.1-dev", "flux-tiny": "flux.1-schnell",
        "flux-tiny-guidance": "flux.1-dev", "flux.2-klein-4b": "flux.2-klein", "flux.2-klein-9b": "flux.2-klein",
        "flux.2-dev": "flux.2-dev", "flux2-tiny": "flux.2-klein", "flux2-tiny-dev": "flux.2-dev",
        "z-image-turbo": "z-image-turbo", "zimage-tiny": "z-image-turbo",
    }  # fmt: skip
    presets = all_presets()
    assert {name: default_schedule(*presets[name]) for name in expected} == expected
    assert [default_tiny_vae(presets[n][0]) for n in ("flux-tiny", "flux2-tiny", "zimage-tiny")] == [
        "dummy:taef1", "dummy:taef2", "dummy:taef1",
    ]  # fmt: skip


def test_generate_synthetic_conditioning_has_the_model_widths():
    from fewstep.cli.common import synthetic_condition
    from fewstep.engine.models.registry import all_presets

    widths = {}
    for name in ("flux-tiny", "flux.2-klein-4b", "flux.2-klein-9b", "flux.2-dev", "z-image-turbo"):
        family, params = all_presets()[name]
        cond = synthetic_condition(family, params, 3, seed=1, guidance=None)
        widths[name] = (cond.context.shape[-1], None if cond.pooled is None else cond.pooled.shape[-1])
    assert widths == {
        "flux-tiny": (4096, 768), "flux.2-klein-4b": (7680, None), "flux.2-klein-9b": (12288, None),
        "flux.2-dev": (15360, None), "z-image-turbo": (2560, None),
    }  # fmt: skip


@pytest.mark.parametrize(
    ("preset", "weights", "tiny"),
    [("z-image-turbo", "22.93 GiB", "zimage-tiny"), ("flux.2-klein-4b", "14.44 GiB", "flux2-tiny")],
)
def test_generate_real_size_preset_is_refused_by_the_memory_preflight(tmp_path, preset, weights, tiny):
    """The published sizes in fp32 under an 8 GB budget: refused before allocating, suggesting the test size."""
    r = _cli("generate", "--model", preset, "--device", "cpu", "--out", str(tmp_path),
             env={"FEWSTEP_MEMORY_LIMIT_GB": "8"})  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert f"input '--model': this needs about {weights} (float32 weights {weights})" in r.stderr
    assert f"Try --model {tiny} (the same architecture at test size)" in r.stderr


# -- --compile / --compile-backend / --cuda-graph -------------------------------------------------------------------
COMPILE_KEYS = {"config", "frames_compiled", "compile_seconds", "recompiles", "recompile_reasons", "graph_breaks",
                "graph_breaks_total", "failures", "graph_mode", "graphs", "graph_hits", "graph_misses", "notes"}  # fmt: skip


@pytest.mark.slow
def test_generate_json_carries_the_compile_telemetry(tmp_path):
    common = ("generate", "--model", "flux-tiny", "--height", "64", "--width", "64", "--steps", "2")
    r = _cli(*common, "--compile", "regional", "--compile-backend", "aot_eager", "--json",
             "--out", str(tmp_path / "c"))  # fmt: skip
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    telemetry = report["compile"]
    assert set(telemetry) == COMPILE_KEYS
    assert telemetry["config"].startswith("compile regional; backend aot_eager")
    # one block class each for the double and the single blocks (regional), compiled once and reused by every
    # block and step: no recompiles, and the sampler's forward has no graph break
    assert telemetry["frames_compiled"] >= 1 and telemetry["compile_seconds"] > 0
    assert telemetry["recompiles"] == 0 and telemetry["failures"] == []
    assert telemetry["graph_mode"] == "off" and telemetry["graphs"] is None
    assert telemetry["graph_hits"] == telemetry["graph_misses"] == 0
    assert json.loads((tmp_path / "c" / "timings.json").read_text())["compile"] == telemetry
    eager = _cli(*common, "--json", "--out", str(tmp_path / "e"))
    assert eager.returncode == 0 and json.loads(eager.stdout)["compile"] is None
    compiled = load_file(str(tmp_path / "c" / "latent.safetensors"))["latent"]
    reference = load_file(str(tmp_path / "e" / "latent.safetensors"))["latent"]
    torch.testing.assert_close(compiled, reference, atol=1e-4, rtol=1e-4)  # the same ops, traced


@pytest.mark.parametrize("mode", ["regional", "full"])
@pytest.mark.slow
def test_stream_json_carries_the_compile_telemetry_past_the_window(mode):
    # 12 chunks of 3 frames through a 9-frame window (the defaults, 4 chunks in 21 frames, never fill it): the
    # cache fills, then rolls. The step (full) or the block (regional) compiles once masked, while the window
    # fills, and once unmasked: two frames, no recompile, no graph break
    r = _cli("stream", "--chunks", "12", "--window-frames", "9", "--compile", mode,
             "--compile-backend", "aot_eager", "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert len(report["chunks"]) == 12
    telemetry = report["compile"]
    assert set(telemetry) == COMPILE_KEYS
    assert telemetry["frames_compiled"] == 2 and telemetry["compile_seconds"] > 0
    assert telemetry["recompiles"] == 0 and telemetry["recompile_reasons"] == {}
    assert telemetry["graph_breaks"] == {} and telemetry["graph_breaks_total"] == 0
    assert telemetry["graphs"] is None and telemetry["graph_hits"] == telemetry["graph_misses"] == 0


@pytest.mark.parametrize("command", ["generate", "stream"])
@pytest.mark.parametrize(
    "flag,value,message",
    [
        ("--compile", "fast", "input '--compile': unknown compile mode 'fast'; expected one of off, regional, full"),
        ("--compile-backend", "tvm", "input '--compile-backend': unknown compile backend 'tvm'; expected one of "
         "inductor, aot_eager, eager"),
        ("--cuda-graph", "on", "input '--cuda-graph': unknown CUDA-graph mode 'on'; expected one of off, whole, "
         "breakable"),
    ],
)  # fmt: skip
@pytest.mark.slow
def test_compile_flags_bad_values_are_one_line_errors(tmp_path, command, flag, value, message):
    model = ("--model", "flux-tiny", "--out", str(tmp_path)) if command == "generate" else ()
    r = _cli(command, *model, flag, value)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and r.stderr.startswith(f"error: fewstep {command}: {message}")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA graphs run on this machine")
@pytest.mark.parametrize("command", ["generate", "stream"])
@pytest.mark.parametrize("mode", ["whole", "breakable"])
@pytest.mark.slow
def test_cuda_graph_without_a_gpu_is_refused_as_the_engine_refuses_it(tmp_path, command, mode):
    """The CLI keeps the engine's allow_fallback off: graphs asked for on a CPU are an error, not an eager run."""
    model = ("--model", "flux-tiny", "--height", "64", "--width", "64", "--out", str(tmp_path))
    r = _cli(command, *(model if command == "generate" else ("--chunks", "1")), "--cuda-graph", mode)
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert r.stderr.startswith(f"error: fewstep {command}: input '--cuda-graph': CUDA graphs need a CUDA GPU")
    assert "Set cuda_graph off, or allow_fallback to run eagerly without graphs" in r.stderr


def test_compile_flags_default_off_and_parse():
    from fewstep.cli import build_parser

    for command in ("generate", "stream"):
        args = build_parser().parse_args([command])
        assert (args.compile, args.compile_backend, args.cuda_graph) == ("off", "inductor", "off")
        args = build_parser().parse_args(
            [command, "--compile", "full", "--compile-backend", "eager", "--cuda-graph", "whole"]
        )
        assert (args.compile, args.compile_backend, args.cuda_graph) == ("full", "eager", "whole")
