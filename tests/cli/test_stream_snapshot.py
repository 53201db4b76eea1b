"""``stream --save-session FILE`` / ``stream --resume FILE --chunks M`` (issue 31): a stream saved after its last
chunk and resumed by another process writes the chunks the uninterrupted stream would have; flags that conflict
with the snapshot, and another model, are refused naming the flag."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import fewstep
from fewstep.cli import main

SETTINGS = ["--model", "wan-tiny", "--height", "32", "--width", "48", "--chunk-frames", "2", "--window-frames", "8",
            "--sink-frames", "1", "--kv-dtype", "int8", "--keep-recent-chunks", "0", "--seed", "4"]  # fmt: skip
PACKAGE_PARENT = os.path.dirname(os.path.dirname(fewstep.__file__))


def _cli(*args):
    env = {**os.environ, "PYTHONPATH": PACKAGE_PARENT}
    r = subprocess.run(
        [sys.executable, "-m", "fewstep", "stream", *args], capture_output=True, text=True, env=env
    )
    assert r.returncode == 0, r.stderr
    return r


def test_a_stream_saved_and_resumed_in_another_process_writes_the_uninterrupted_chunks(tmp_path, capsys):
    vae = ["--tiny-vae", "dummy:taew2_1"]
    assert main(["stream", *SETTINGS, *vae, "--chunks", "5", "--out", str(tmp_path / "whole"), "--json"]) == 0
    capsys.readouterr()
    assert (
        main(["stream", *SETTINGS, *vae, "--chunks", "2", "--save-session", str(tmp_path / "s.safetensors")])
        == 0
    )
    assert f"saved the session to {tmp_path / 's.safetensors'}" in capsys.readouterr().out
    # another process; the settings come from the snapshot: only the model flags, the tiny VAE and the chunks
    r = _cli("--model", "wan-tiny", *vae, "--resume", str(tmp_path / "s.safetensors"), "--chunks", "3", "--json",
             "--out", str(tmp_path / "rest"))  # fmt: skip
    report = json.loads(r.stdout)
    assert [c["index"] for c in report["chunks"]] == [2, 3, 4]
    assert report["resumed"]["from_chunk"] == 2 and report["resumed"]["from_latent_frame"] == 4
    assert report["resumed"]["bytes"] == os.path.getsize(tmp_path / "s.safetensors")
    assert report["latent_frames"] == 6 and report["video_frames"] == 24
    whole = load_file(str(tmp_path / "whole" / "latents.safetensors"))
    rest = load_file(str(tmp_path / "rest" / "latents.safetensors"))
    assert torch.equal(rest["latent"], whole["latent"][:, :, 4:])
    assert torch.equal(rest["frames"], whole["frames"][:, 4 * 4 - 3 :])


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory):
    path = tmp_path_factory.mktemp("snap") / "s.safetensors"
    assert main(["stream", *SETTINGS, "--chunks", "1", "--save-session", str(path), "--json"]) == 0
    return path


def _refused(capsys, *args) -> str:
    capsys.readouterr()
    assert main(["stream", *args]) == 2
    return capsys.readouterr().err.strip()


def test_save_then_resume_json_fields(snapshot, tmp_path, capsys):
    capsys.readouterr()
    again = tmp_path / "again.safetensors"
    args = ["--model", "wan-tiny", "--resume", str(snapshot), "--chunks", "1", "--save-session", str(again)]
    assert main(["stream", *args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["snapshot"]["path"] == str(again) and report["snapshot"]["next_chunk"] == 2
    assert report["snapshot"]["bytes"] == os.path.getsize(again)
    assert report["resumed"]["path"] == str(snapshot) and report["resumed"]["from_chunk"] == 1


def test_flags_that_conflict_with_the_snapshot_are_refused(snapshot, capsys):
    resume = ["--model", "wan-tiny", "--resume", str(snapshot), "--chunks", "1"]
    assert _refused(capsys, *resume, "--window-frames", "9") == (
        "error: fewstep stream: input '--window-frames': 9 conflicts with s.safetensors, saved with 8 (a resumed "
        "stream keeps the settings it was saved with; leave the flag out)"
    )
    assert _refused(capsys, *resume, "--seed", "1") == (
        "error: fewstep stream: input '--seed': 1 conflicts with s.safetensors, saved with 4 (a resumed stream "
        "keeps the settings it was saved with; leave the flag out)"
    )
    assert _refused(capsys, *resume, "--cond", "prompt.safetensors") == (
        "error: fewstep stream: input '--cond': a resumed stream continues its saved prompt; leave the flag out "
        "with --resume"
    )
    # a flag given with the saved value is no conflict
    assert main(["stream", *resume, "--height", "32", "--kv-dtype", "int8", "--json"]) == 0


def test_another_model_is_refused(snapshot, tmp_path, capsys):
    resume = ["--resume", str(snapshot), "--chunks", "1"]
    assert _refused(capsys, "--model", "wan-mid", *resume) == (
        "error: fewstep stream: input '--resume': s.safetensors: saved from another model (dim 64 there, 512 here; "
        "ffn_dim 128 there, 1536 here; num_heads 2 there, 4 here; num_layers 2 there, 4 here)"
    )
    assert _refused(capsys, "--model", "wan-tiny", "--dtype", "bf16", *resume) == (
        "error: fewstep stream: input '--resume': s.safetensors: saved from a model computing in float32; this one "
        "computes in bfloat16 (open the model with the snapshot's dtype)"
    )
    other = fewstep.engine.load_dit("dummy:wan-tiny", dtype=torch.float32, device="cpu", seed=9)
    save_file({k: v.contiguous() for k, v in other.state_dict().items()}, tmp_path / "other.safetensors")
    message = _refused(
        capsys, "--model", "wan-tiny", "--weights", str(tmp_path / "other.safetensors"), *resume
    )
    assert message.startswith(
        "error: fewstep stream: input '--resume': s.safetensors: saved from another model's weights"
    )


def test_bad_snapshot_paths_are_refused(tmp_path, capsys):
    assert _refused(capsys, "--model", "wan-tiny", "--resume", str(tmp_path / "absent"), "--chunks", "1") == (
        f"error: fewstep stream: input '--resume': {tmp_path / 'absent'}: no such file"
    )
    (tmp_path / "latents.safetensors").write_bytes(b"not a snapshot at all")
    assert "input '--resume': latents.safetensors: not a session snapshot" in _refused(
        capsys, "--model", "wan-tiny", "--resume", str(tmp_path / "latents.safetensors")
    )
    target = tmp_path / "missing" / "s.safetensors"
    assert _refused(capsys, "--model", "wan-tiny", "--chunks", "1", "--save-session", str(target)) == (
        f"error: fewstep stream: input '--save-session': {target}: expected a file path in an existing folder"
    )


def test_a_lora_is_part_of_the_model_a_snapshot_was_saved_from(tmp_path, capsys):
    """The digest is of the weights the session ran, its LoRA merged: resumed without it (or with it) it is refused
    (or continues)."""
    from fewstep.engine.lora.dummy import dummy_lora_tensors

    model = fewstep.engine.load_dit("dummy:wan-tiny", dtype=torch.float32, device="cpu")
    save_file(dummy_lora_tensors(model, scale=0.05), tmp_path / "style.safetensors")
    lora = ["--lora", str(tmp_path / "style.safetensors")]
    path = str(tmp_path / "s.safetensors")
    assert main(["stream", *SETTINGS, *lora, "--chunks", "1", "--save-session", path, "--json"]) == 0
    message = _refused(capsys, "--model", "wan-tiny", "--resume", path, "--chunks", "1")
    assert message.startswith(
        "error: fewstep stream: input '--resume': s.safetensors: saved from another model's weights"
    )
    assert main(["stream", "--model", "wan-tiny", *lora, "--resume", path, "--chunks", "1", "--json"]) == 0
