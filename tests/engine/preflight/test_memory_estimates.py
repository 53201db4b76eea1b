"""The memory preflight: its estimates cover the measured peaks, and what the pack holds counts against the limit.

* Every path's estimate is at least the peak RSS growth measured when the path runs (in a fresh subprocess,
  tests/memory_probe.py), and at most ``FACTOR`` times it plus ``SLACK``: image sampling with and without the
  tiny VAE's decode, the causal video session with and without its stream decoder, tiny VAE and FLUX.1 AE decode
  and encode, each at two sizes (slow: a subprocess per path).
* wan-tiny at 4096 x 4096 with the tiny VAE (one chunk of one frame, one step) is refused under a limit it does
  not fit, instead of failing in the tiny VAE's convolution (issue 28).
* The ledger: loaded models and live sessions count against ``FEWSTEP_MEMORY_LIMIT_GB``; dropped, they stop
  counting; without the limit nothing is subtracted from what the device reports free.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from test_nodes import _run

from fewstep.engine.causal.session import CausalConfig, VideoSession, session_bytes
from fewstep.engine.errors import InputError
from fewstep.engine.loader import load_dit
from fewstep.engine.preflight import budget as preflight
from fewstep.engine.preflight import ledger as ledger_module
from fewstep.engine.preflight.ledger import LEDGER
from fewstep.engine.vae.tiny import load_tiny_vae

ROOT = Path(__file__).resolve().parents[3]
PROBE = Path(__file__).resolve().parents[2] / "memory_probe.py"

# An estimate may be above the measured peak by at most this factor (docs/planner.md: "Memory preflight")...
FACTOR = 2.5
# ... plus this much: at the smallest sizes the allocator's page granularity and the interpreter's own small
# allocations are of the order of the estimate itself
SLACK = 8 * 2**20


def _held_models() -> int:
    return sum(h.count for h in LEDGER.holdings("cpu") if h.kind == "model")


# -- 1. estimates against measured peaks -------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize(
    "path, sizes",
    [
        ("image:none", (256, 512)),
        ("image:tiny", (128, 256)),
        ("video:none:3", (128, 256)),
        ("video:tiny:1", (128, 256)),
        ("video:tiny:3", (64, 128)),
        ("vae:taef1:decode", (128, 256)),
        ("vae:taef1:encode", (128, 256)),
        ("vae:taew2_1:decode", (64, 128)),
        ("vae:taew2_1:encode", (64, 128)),
        ("vae:flux-ae:decode", (128, 256)),
        ("vae:flux-ae:encode", (128, 256)),
    ],
)
def test_each_estimate_covers_the_measured_peak_within_the_stated_factor(path, sizes):
    # glibc's mmap threshold fixed: freed buffers go back to the kernel, so each size's peak is its own
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    env.pop("FEWSTEP_MEMORY_LIMIT_GB", None)
    result = subprocess.run(
        [sys.executable, str(PROBE), path, *map(str, sizes)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads(result.stdout.strip().splitlines()[-1])
    for row in rows:
        estimate, measured = sum(row["estimate"].values()), row["measured"]
        detail = (
            f"{path} at {row['size']} px: estimate {row['estimate']} ({estimate}), measured {measured}: "
            f"{estimate / max(measured, 1):.2f}x"
        )
        assert estimate >= measured, detail
        assert estimate <= FACTOR * measured + SLACK, detail


# -- 2. the stream decoder in the session estimate ---------------------------------------------------------------
@pytest.fixture(scope="module")
def wan():
    return load_dit("dummy:wan-tiny", device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def taew():
    return load_tiny_vae("dummy:taew2_1", device="cpu", dtype=torch.float32)


def _context(wan):
    return torch.randn(1, 8, wan.params.text_dim)


ONE_FRAME_ONE_STEP = CausalConfig(chunk_frames=1, window_frames=1, steps=1)


def test_the_session_estimate_counts_the_stream_decoder_as_the_vae_does(wan, taew):
    p = wan.params
    tokens = (2048 // 16) ** 2
    parts = session_bytes(p, 1, 2048, 2048, ONE_FRAME_ONE_STEP, torch.float32, tokens, p.num_heads, taew)
    decode = taew.decode_bytes(1, 1, 2048, 2048)  # the VAE's own formula, one chunk of one latent frame
    assert parts["stream decoder activations"] == decode["decoder activations"]
    assert parts["decoded frames"] == decode["RGB output"] == 4 * 3 * 2048 * 2048 * 4
    # issue 28 measured a 12.4 GiB peak for this run; the estimate was 0.24 GiB
    assert sum(parts.values()) >= 12.4 * 2**30


def test_a_4096_video_with_the_tiny_vae_is_refused_before_allocating(wan, taew, monkeypatch):
    monkeypatch.setenv("FEWSTEP_MEMORY_LIMIT_GB", "8")
    with pytest.raises(
        InputError,
        match=r"^test: input 'width': this needs about 6\d\.\d\d GiB \(.*stream decoder activations 64\.00 GiB, "
        r"decoded frames 768\.00 MiB\) but only .* of available host memory can be used on cpu; refused before "
        r"allocating.* Use a smaller width / height or fewer chunk_frames \(the tiny VAE decodes a whole chunk",
    ):
        VideoSession(wan, _context(wan), 4096, 4096, ONE_FRAME_ONE_STEP, tiny_vae=taew, where="test")


def test_the_node_refuses_a_4096_video_with_the_tiny_vae(pack, monkeypatch):
    def stop():
        raise RuntimeError("ran without a preflight")

    m = pack.NODE_CLASS_MAPPINGS
    (handle,) = _run(m["FewStepDiTLoader"], model_name="dummy:wan-tiny")
    (cond,) = _run(m["FewStepSyntheticConditioning"], pooled_width=0)
    (tiny,) = _run(m["FewStepTinyVAELoader"], vae_name="dummy:taew2_1")
    monkeypatch.setitem(
        sys.modules,
        "comfy.model_management",
        types.SimpleNamespace(throw_exception_if_processing_interrupted=stop),
    )
    monkeypatch.setenv("FEWSTEP_MEMORY_LIMIT_GB", "8")
    with pytest.raises(
        ValueError, match=r"^FewStepCausalVideoSampler: input 'width': .*stream decoder activations"
    ):
        _run(m["FewStepCausalVideoSampler"], model=handle, positive=cond, width=4096, height=4096, num_chunks=1,
             chunk_frames=1, window_frames=1, steps=1, tiny_vae=tiny)  # fmt: skip


# -- 3. what the pack holds --------------------------------------------------------------------------------------
def test_loaded_models_count_against_the_limit_until_they_are_dropped(monkeypatch):
    one = load_dit("dummy:flux-tiny", device="cpu", dtype=torch.float32)
    model_bytes = ledger_module.tensor_bytes_on(one, torch.device("cpu"))
    del one
    gc.collect()
    # room for what this process already holds and two more models, not three: the budget is the usable
    # fraction of what the limit leaves, 2.4 models before the first load, 1.5 before the second, 0.6 then
    limit = LEDGER.held_bytes("cpu") + model_bytes + 1.5 * model_bytes / preflight.USABLE_FRACTION
    monkeypatch.setenv("FEWSTEP_MEMORY_LIMIT_GB", str(limit / 2**30))
    held_before = _held_models()
    first = load_dit("dummy:flux-tiny", device="cpu", dtype=torch.float32)
    second = load_dit("dummy:flux-tiny", device="cpu", dtype=torch.float32)
    assert _held_models() == held_before + 2
    with pytest.raises(
        InputError,
        match=r"^input 'weights': this needs about 2\.96 MiB \(float32 weights 2\.96 MiB\) but only .* of available "
        r"host memory can be used on cpu; refused before allocating\. Use a smaller preset .*\. "
        r"FEWSTEP_MEMORY_LIMIT_GB allows the pack .* in "
        rf"all and it already holds .* on cpu \({held_before + 2} models .*\): free some of it",
    ):
        load_dit("dummy:flux-tiny", device="cpu", dtype=torch.float32)
    assert _held_models() == held_before + 2  # refused before anything was built
    del first, second
    gc.collect()
    assert _held_models() == held_before
    again = [load_dit("dummy:flux-tiny", device="cpu", dtype=torch.float32) for _ in range(2)]
    assert _held_models() == held_before + len(again)


def test_tiny_vaes_and_sessions_are_held_and_a_disposed_session_is_not(wan, taew):
    cpu = torch.device("cpu")
    kinds = {h.kind: h for h in LEDGER.holdings("cpu")}
    both = ledger_module.tensor_bytes_on(wan, cpu) + ledger_module.tensor_bytes_on(taew.video, cpu)
    assert kinds["model"].nbytes >= both > 0
    sessions_before = kinds.get("session", ledger_module.Holding("session", 0, 0))
    session = VideoSession(wan, _context(wan), 64, 64, ONE_FRAME_ONE_STEP, tiny_vae=taew)
    list(session.chunks(1))
    held = {h.kind: h for h in LEDGER.holdings("cpu")}["session"]
    assert held.count == sessions_before.count + 1
    assert held.nbytes == sessions_before.nbytes + session.nbytes > sessions_before.nbytes
    session.dispose()
    after = {h.kind: h for h in LEDGER.holdings("cpu")}.get("session", ledger_module.Holding("session", 0, 0))
    assert (after.count, after.nbytes) == (sessions_before.count, sessions_before.nbytes)


def test_worker_pools_are_held_by_their_ranks_resident_memory(monkeypatch):
    pool_module = types.ModuleType("pool")
    rank = types.SimpleNamespace(closed=False, pids=lambda: [os.getpid()])
    pool_module._LIVE = [rank, types.SimpleNamespace(closed=True, pids=lambda: [os.getpid()])]
    monkeypatch.setitem(sys.modules, "fewstep.engine.parallel.pool", pool_module)
    (pools,) = [h for h in LEDGER.holdings("cpu") if h.kind == "worker pool"]
    assert pools.count == 1 and pools.nbytes > 0
    assert pools.nbytes == pytest.approx(ledger_module.process_resident_bytes(os.getpid()), rel=0.2)
    assert not [h for h in LEDGER.holdings("cuda:0") if h.kind == "worker pool"]


def test_the_budget_subtracts_what_is_held_only_under_the_limit(monkeypatch):
    monkeypatch.setattr(preflight, "_host_available_bytes", lambda: 10 * 2**30)
    held = LEDGER.held_bytes("cpu")
    assert held > 0  # this module's models
    # MemAvailable already excludes what the pack holds: nothing is subtracted again
    monkeypatch.delenv("FEWSTEP_MEMORY_LIMIT_GB", raising=False)
    assert preflight.available_bytes("cpu") == 10 * 2**30
    monkeypatch.setenv("FEWSTEP_MEMORY_LIMIT_GB", "1")
    assert preflight.available_bytes("cpu") == 2**30 - held
    # still capped by what the device reports free
    monkeypatch.setenv("FEWSTEP_MEMORY_LIMIT_GB", "100")
    assert preflight.available_bytes("cpu") == 10 * 2**30


def test_a_refusal_states_the_figures_its_decision_used(monkeypatch):
    """One budget per check: the ledger (worker pools are measured live) is read once, and the refusal's limit,
    held bytes and usable budget are the ones the decision compared with."""
    monkeypatch.setattr(preflight, "_host_available_bytes", lambda: 10 * 2**30)
    monkeypatch.setenv("FEWSTEP_MEMORY_LIMIT_GB", "1")
    reads = []

    def holdings(device=None):  # what the pack holds grows between two reads, as a pool's resident memory can
        reads.append(device)
        return [ledger_module.Holding("model", 1, (len(reads) * 256) << 20)]

    monkeypatch.setattr(LEDGER, "holdings", holdings)
    budget = preflight.memory_budget("cpu")
    assert (budget.free, budget.limit, budget.held) == (10 * 2**30, 2**30, 256 << 20)
    assert budget.available == 768 << 20 and budget.usable == int((768 << 20) * preflight.USABLE_FRACTION)
    reads.clear()
    with pytest.raises(InputError) as refused:
        preflight.check_fits({"weights": 2**30}, "cpu", "model")
    assert len(reads) == 1
    assert str(refused.value) == (
        "input 'model': this needs about 1.00 GiB (weights 1.00 GiB) but only 691.20 MiB of available host memory "
        "can be used on cpu; refused before allocating. FEWSTEP_MEMORY_LIMIT_GB allows the pack 1.00 GiB in all "
        "and it already holds 256.00 MiB on cpu (1 model 256.00 MiB): free some of it (unload models, end video "
        "sessions) or raise the limit"
    )
    monkeypatch.delenv("FEWSTEP_MEMORY_LIMIT_GB")
    reads.clear()
    assert preflight.memory_budget("cpu").available == 10 * 2**30 and not reads  # no limit: the ledger unread


def test_lora_backups_are_held_while_their_state_lives():
    from fewstep.engine.lora.merge import MergedWeights

    def backups():
        return [h for h in LEDGER.holdings("cpu") if h.kind == "LoRA backup"]

    before = backups()
    state = MergedWeights()
    state.backups["w"] = torch.zeros(1000)
    (held,) = backups()
    assert held.nbytes == 4000 + sum(h.nbytes for h in before)
    del state
    gc.collect()
    assert backups() == before


def test_the_sampler_counts_its_preview_decode_before_it_starts(pack, monkeypatch):
    steps_run = []

    class ProgressBar:
        def __init__(self, total):
            pass

        def update_absolute(self, value, total=None, preview=None):
            steps_run.append(value)

    monkeypatch.setitem(sys.modules, "comfy.utils", types.SimpleNamespace(ProgressBar=ProgressBar))
    m = pack.NODE_CLASS_MAPPINGS
    (model,) = _run(m["FewStepDiTLoader"], model_name="dummy:flux-tiny")
    (cond,) = _run(m["FewStepSyntheticConditioning"])
    (tiny,) = _run(m["FewStepTinyVAELoader"], vae_name="dummy:taef1")
    latent = {
        "samples": torch.zeros(1, 16, 64, 64)
    }  # 512 px: sampling about 15 MiB, a preview decode 259 MiB
    pack_ledger = sys.modules[f"{pack.__name__}.engine.preflight.ledger"].LEDGER
    monkeypatch.setenv("FEWSTEP_MEMORY_LIMIT_GB", str((pack_ledger.held_bytes("cpu") + 100 * 2**20) / 2**30))
    args = dict(model=model, positive=cond, latent_image=latent, steps=1)
    _run(m["FewStepSampler"], **args)  # fits without previews
    steps_run.clear()
    with pytest.raises(
        ValueError,
        match=r"^FewStepSampler: input 'latent_image': this needs about .*preview decode 259\.00 MiB\) .* refused "
        r"before allocating\. Use a smaller image or batch, or run without the per-step preview",
    ):
        _run(m["FewStepSampler"], **args, preview_vae=tiny, preview=True)
    assert steps_run == []  # refused before the first step, not by the preview's own decode at its end
