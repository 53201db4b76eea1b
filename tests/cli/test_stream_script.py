"""``python -m fewstep stream --script FILE``: a stream that follows a control script gives the latents of the
equivalent ``--cond`` / ``--prompt-switch`` run where the two overlap, a pool of scripted sessions gives each
single ``--script`` run's latents, and the flags a script replaces are refused."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from fewstep.cli import main
from fewstep.engine.models.wan import WanParams
from fewstep.engine.prompt_embeddings import synthetic_text_embedding

# wan-tiny at 32x48 (6 tokens per frame); a 4-frame window with a sink frame slides from the third chunk on
SMALL = ["stream", "--model", "wan-tiny", "--height", "32", "--width", "48", "--chunk-frames", "2",
         "--window-frames", "4", "--sink-frames", "1"]  # fmt: skip
TOLERANCE = 1e-5  # the batched GEMMs round differently from batch 1 (fp32 on the CPU)
TEXT_LEN, TEXT_DIM = WanParams().text_len, WanParams().text_dim


def _run(capsys, *args) -> str:
    assert main([*SMALL, *args]) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def _error(capsys, *args) -> str:
    assert main([*SMALL, *args]) == 2
    return capsys.readouterr().err.strip()


def _latent(folder) -> torch.Tensor:
    return load_file(os.path.join(folder, "latents.safetensors"))["latent"]


def _script(tmp_path, name: str, **fields) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(fields))
    return str(path)


def _cond(tmp_path, text: str) -> str:
    """A --cond file holding the embedding a script's ``text`` gets."""
    path = tmp_path / f"cond_{abs(hash(text))}.safetensors"
    save_file({"context": synthetic_text_embedding(text, TEXT_LEN, TEXT_DIM)}, str(path))
    return str(path)


SWITCHES = [
    {"chunk": 1, "prompt": "a fox in a forest", "recache": True},
    {"chunk": 3, "prompt": "a fox at night"},
    {"chunk": 4, "stop": True},
]


def test_a_script_gives_the_latents_of_the_same_cond_and_prompt_switch_run(capsys, tmp_path):
    script = _script(tmp_path, "a.json", prompt="a fox in snow", seed=5, chunks=6, controls=SWITCHES)
    out = _run(capsys, "--script", script, "--out", str(tmp_path / "script"))
    _run(capsys, "--cond", _cond(tmp_path, "a fox in snow"), "--seed", "5", "--chunks", "4",
         "--prompt-switch", f"1:{_cond(tmp_path, 'a fox in a forest')}:recache",
         "--prompt-switch", f"3:{_cond(tmp_path, 'a fox at night')}", "--out", str(tmp_path / "flags"))  # fmt: skip
    scripted, flags = _latent(tmp_path / "script"), _latent(tmp_path / "flags")
    assert scripted.shape == (1, 16, 8, 4, 6)  # the stop at chunk 4: 4 chunks of 2 latent frames
    assert torch.equal(scripted, flags)
    assert "prompt switch to 'a fox in a forest': re-cache of" in out
    assert "prompt switch to 'a fox at night': cross-attention only" in out
    report = json.loads((tmp_path / "script" / "stream.json").read_text())
    assert report["script"]["path"] == script
    assert [(c["chunk"], c["kind"], c["recache"]) for c in report["script"]["controls"]] == [
        (1, "prompt", True),
        (3, "prompt", False),
    ]
    assert [[c["kind"] for c in row["controls"]] for row in report["chunks"]] == [
        [],
        ["prompt"],
        [],
        ["prompt"],
    ]


def test_a_seed_control_changes_the_noise_from_its_chunk_on(capsys, tmp_path):
    plain = _script(tmp_path, "plain.json", prompt="a fox", seed=1, chunks=4)
    reseeded = _script(tmp_path, "seeded.json", prompt="a fox", seed=1, chunks=4,
                       controls=[{"chunk": 2, "seed": 9}])  # fmt: skip
    _run(capsys, "--script", plain, "--out", str(tmp_path / "plain"))
    _run(capsys, "--script", reseeded, "--out", str(tmp_path / "seeded"))
    a, b = _latent(tmp_path / "plain"), _latent(tmp_path / "seeded")
    assert torch.equal(a[:, :, :4], b[:, :, :4])  # chunks 0 and 1: before the control
    assert not torch.allclose(a[:, :, 4:6], b[:, :, 4:6])  # chunk 2 on: the new seed's noise


def test_scripted_sessions_of_a_pool_write_what_each_single_script_run_writes(capsys, tmp_path):
    a = _script(tmp_path, "a.json", prompt="a fox in snow", seed=5, chunks=4, controls=SWITCHES[:2])
    b = _script(tmp_path, "b.json", prompt="a cat on a roof", seed=8, chunks=3,
                controls=[{"chunk": 1, "seed": 2}, {"chunk": 2, "prompt": "a cat in rain", "recache": True}])  # fmt: skip
    _run(
        capsys,
        "--sessions",
        "2",
        "--join-every",
        "1",
        "--script",
        a,
        "--script",
        b,
        "--out",
        str(tmp_path / "pool"),
    )
    for i, script in enumerate((a, b)):
        _run(capsys, "--script", script, "--out", str(tmp_path / f"single_{i}"))
        pooled, single = _latent(tmp_path / "pool" / f"session_{i}"), _latent(tmp_path / f"single_{i}")
        assert pooled.shape == single.shape
        torch.testing.assert_close(pooled, single, rtol=0, atol=TOLERANCE)
    report = json.loads((tmp_path / "pool" / "stream.json").read_text())
    assert [s["seed"] for s in report["sessions"]] == [5, 8]
    assert [len(s["chunks"]) for s in report["sessions"]] == [4, 3]
    assert [s["script"]["path"] for s in report["sessions"]] == [a, b]


def test_the_flags_a_script_replaces_and_a_wrong_count_are_refused(capsys, tmp_path):
    script = _script(tmp_path, "a.json", prompt="a fox", chunks=2)
    cond = _cond(tmp_path, "x")
    assert _error(capsys, "--script", script, "--cond", cond) == (
        "error: fewstep stream: input '--cond': cannot be combined with --script, which gives the script's 'prompt'"
    )
    assert _error(capsys, "--script", script, "--chunks", "3") == (
        "error: fewstep stream: input '--chunks': cannot be combined with --script, which gives the script's "
        "'chunks'"
    )
    assert _error(capsys, "--script", script, "--prompt-switch", f"1:{cond}").startswith(
        "error: fewstep stream: input '--prompt-switch': cannot be combined with --script"
    )
    assert _error(capsys, "--script", script, "--sessions", "2") == (
        "error: fewstep stream: input '--script': 1 scripts for --sessions 2: give one --script per session "
        "(session i follows the i-th)"
    )
    assert _error(capsys, "--script", script, "--weights", str(tmp_path / "w.safetensors")).startswith(
        "error: fewstep stream: input '--script': script prompts are text: with real weights give --text-encoder DIR"
    )
    no_chunks = _script(tmp_path, "n.json", prompt="a fox")
    assert _error(capsys, "--script", no_chunks) == (
        f"error: fewstep stream: input '--script': {no_chunks}: 'chunks' is missing: the number of chunks the "
        "session makes (an integer >= 1)"
    )
    bad = _script(tmp_path, "b.json", prompt="a fox", chunks=2, controls=[{"chunk": -1, "seed": 1}])
    assert _error(capsys, "--script", bad) == (
        f"error: fewstep stream: input '--script': {bad}: controls[0]: 'chunk' must be an integer >= 0, got -1"
    )


# -- a start image and an input video, encoded as the live node encodes them -----------------------------------------


def _png(path, seed: int, size=(60, 40)) -> str:
    """A PNG of noise, larger than the stream (48x32) and of another aspect: scaled to cover and cropped."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return str(path)


def _node_vae():
    from fewstep.engine.vae import load_tiny_vae

    return load_tiny_vae("dummy:taew2_1", device="cpu")


def test_a_start_image_is_prefilled_as_the_node_encodes_it(capsys, tmp_path):
    from fewstep.engine.live.media import decode_image

    image = _png(tmp_path / "start.png", 1)
    script = _script(tmp_path, "s.json", prompt="a fox", seed=2, chunks=3, start_image="start.png",
                     controls=[{"chunk": 1, "prompt": "a fox at night"}])  # fmt: skip
    out = _run(capsys, "--script", script, "--tiny-vae", "dummy:taew2_1", "--out", str(tmp_path / "script"))
    assert "start: 1 latent frames of " in out
    # the reference: the node's decode (cover + crop) and encode_raw, given as --init-latents
    with open(image, "rb") as f:
        frame = decode_image(f.read(), 48, 32, "start_image")
    raw = _node_vae().encode_raw(frame[None, None].clamp(0, 1))
    assert raw.shape == (1, 16, 1, 4, 6)
    save_file({"latent": raw.float().contiguous()}, str(tmp_path / "start.safetensors"))
    _run(capsys, "--cond", _cond(tmp_path, "a fox"), "--seed", "2", "--chunks", "3", "--init-latents",
         str(tmp_path / "start.safetensors"), "--prompt-switch", f"1:{_cond(tmp_path, 'a fox at night')}",
         "--tiny-vae", "dummy:taew2_1", "--out", str(tmp_path / "flags"))  # fmt: skip
    assert torch.equal(_latent(tmp_path / "script"), _latent(tmp_path / "flags"))


def test_an_input_video_is_fed_chunk_by_chunk_as_the_node_encodes_it(capsys, tmp_path):
    from fewstep.engine.live.media import decode_image
    from fewstep.engine.vae.taehv import TAEHVStreamEncoder

    (tmp_path / "frames").mkdir()
    paths = [
        _png(tmp_path / "frames" / f"{i:03d}.png", 10 + i) for i in range(8 * 3 + 5)
    ]  # 3 chunks + a rest
    script = _script(tmp_path, "v.json", prompt="a fox", seed=4, chunks=3, input_video="frames", strength=0.6,
                     controls=[{"chunk": 2, "strength": 1.0}])  # fmt: skip
    out = _run(capsys, "--script", script, "--tiny-vae", "dummy:taew2_1", "--out", str(tmp_path / "script"))
    assert "video to video at strength 0.6" in out and "video to video at strength 1" in out
    # the reference: every frame decoded as the node decodes it, encoded by one stream encoder, chunk by chunk
    vae = _node_vae()
    encoder = TAEHVStreamEncoder(vae.video)
    chunks = []
    for c in range(3):
        frames = torch.stack([decode_image(Path(p).read_bytes(), 48, 32) for p in paths[8 * c : 8 * c + 8]])
        with torch.inference_mode():
            chunks.append(vae.latent_to_raw(encoder.push(frames[None]).transpose(1, 2).float()))
    save_file({"latent": torch.cat(chunks, dim=2).contiguous()}, str(tmp_path / "in.safetensors"))
    _run(capsys, "--cond", _cond(tmp_path, "a fox"), "--seed", "4", "--chunks", "2", "--input-video",
         str(tmp_path / "in.safetensors"), "--strength", "0.6", "--out", str(tmp_path / "flags"))  # fmt: skip
    scripted = _latent(tmp_path / "script")
    assert torch.equal(scripted[:, :, :4], _latent(tmp_path / "flags"))  # the two chunks at strength 0.6
    assert scripted.shape == (1, 16, 6, 4, 6)


def test_scripted_starts_and_inputs_in_a_pool_write_what_single_runs_write(capsys, tmp_path):
    _png(tmp_path / "start.png", 1)
    (tmp_path / "frames").mkdir()
    for i in range(8 * 3):
        _png(tmp_path / "frames" / f"{i:03d}.png", 10 + i)
    a = _script(tmp_path, "a.json", prompt="a fox", seed=2, chunks=3, start_image="start.png")
    b = _script(tmp_path, "b.json", prompt="a cat", seed=6, chunks=3, input_video="frames", strength=0.5,
                controls=[{"chunk": 1, "prompt": "a cat at night", "recache": True}])  # fmt: skip
    _run(capsys, "--sessions", "2", "--script", a, "--script", b, "--tiny-vae", "dummy:taew2_1",
         "--out", str(tmp_path / "pool"))  # fmt: skip
    for i, script in enumerate((a, b)):
        _run(
            capsys, "--script", script, "--tiny-vae", "dummy:taew2_1", "--out", str(tmp_path / f"single_{i}")
        )
        torch.testing.assert_close(
            _latent(tmp_path / "pool" / f"session_{i}"),
            _latent(tmp_path / f"single_{i}"),
            rtol=0,
            atol=TOLERANCE,
        )


def test_media_need_the_tiny_vae_and_enough_input(capsys, tmp_path):
    _png(tmp_path / "start.png", 1)
    script = _script(tmp_path, "s.json", prompt="a fox", chunks=2, start_image="start.png")
    assert _error(capsys, "--script", script) == (
        f"error: fewstep stream: input '--script': {script}: 'start_image' is encoded with the tiny VAE, as the live "
        "node encodes it: give --tiny-vae (dummy:taew2_1 with dummy weights, taew2_1.pth)"
    )
    (tmp_path / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    bad = _script(tmp_path, "b.json", prompt="a fox", chunks=2, start_image="bad.png")
    assert _error(capsys, "--script", bad, "--tiny-vae", "dummy:taew2_1").startswith(
        f"error: fewstep stream: input '--script': {bad}: 'start_image': "
    )
    (tmp_path / "frames").mkdir()
    for i in range(12):
        _png(tmp_path / "frames" / f"{i:03d}.png", i)
    short = _script(tmp_path, "v.json", prompt="a fox", chunks=3, input_video="frames", strength=0.5)
    assert _error(capsys, "--script", short, "--tiny-vae", "dummy:taew2_1") == (
        f"error: fewstep stream: input '--script': {short}: 'input_video' holds 12 frames: 1 chunks of 8 (4 x "
        "--chunk-frames); the script makes 3 chunks (chunk 1 has no input)"
    )
