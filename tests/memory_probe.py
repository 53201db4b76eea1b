"""Run one engine path in this (fresh) process and print, as JSON, its memory estimate and its measured peak.

``python memory_probe.py <path> <size> [<size> ...]``: for each size (ascending), the estimate the preflight
checks (bytes) and the peak RSS growth of running the path once. Used by tests/engine/preflight/test_memory_estimates.py.

The peak is measured as in the kernel: /proc/self/clear_refs (5) resets VmHWM to the current VmRSS, the path
runs, and VmHWM less that baseline is its peak growth. The caller runs this with glibc's mmap threshold fixed
(``MALLOC_MMAP_THRESHOLD_``) so that freed buffers go back to the kernel instead of staying in the heap, where
the next size would reuse them unmeasured. The path runs twice at 32 px first: one-time costs (oneDNN's kernel
caches, the allocator's arenas) are paid once per process, not per job.
"""

from __future__ import annotations

import ctypes.util
import gc
import json
import os
import sys

import torch


def settled_rss_mib() -> float:
    """Resident memory after handing freed heap memory back to the OS: live memory, whatever earlier tests in this
    process freed (glibc keeps freed pages otherwise, and would hide growth by reusing them)."""
    gc.collect()
    libc = ctypes.util.find_library("c")
    if libc:
        trim = getattr(ctypes.CDLL(libc), "malloc_trim", None)
        if trim is not None:
            trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def measure(run) -> int:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status("VmRSS")
    out = run()
    peak = _status("VmHWM") - base
    del out
    return peak


def video_path(tiny: bool, chunk_frames: int):
    from fewstep.engine.causal.session import CausalConfig, VideoSession, session_bytes
    from fewstep.engine.loader import load_dit
    from fewstep.engine.vae.tiny import load_tiny_vae

    model = load_dit("dummy:wan-tiny", device="cpu", dtype=torch.float32)
    vae = load_tiny_vae("dummy:taew2_1", device="cpu", dtype=torch.float32) if tiny else None
    context = torch.randn(1, 16, model.params.text_dim)
    config = CausalConfig(chunk_frames=chunk_frames, window_frames=chunk_frames, steps=1)
    p = model.params

    def run(size):
        session = VideoSession(model, context, size, size, config, tiny_vae=vae)
        return session, list(session.chunks(1))

    def estimate(size):
        tokens = (size // 8 // p.patch_size[1]) * (size // 8 // p.patch_size[2])
        return session_bytes(p, 1, size, size, config, torch.float32, tokens, p.num_heads, vae)

    return run, estimate


def image_path(tiny: bool):
    """Sampling with flux-tiny, then (``tiny``) decoding its result with taef1: the two run one after the other,
    so the peak of the pair is the larger of the two estimates."""
    from fewstep.engine import TextCondition, open_model
    from fewstep.engine.text_to_image import estimate_sample_bytes, sample_latent
    from fewstep.engine.vae.tiny import load_tiny_vae

    handle = open_model("dummy:flux-tiny", device="cpu", dtype=torch.float32)
    vae = load_tiny_vae("dummy:taef1", device="cpu", dtype=torch.float32) if tiny else None
    p = handle.params
    cond = [TextCondition(torch.randn(1, 8, p.context_in_dim), torch.randn(1, p.vec_in_dim), 3.5)]

    def run(size):
        latent, _report = sample_latent(handle, cond, torch.zeros(1, 16, size // 8, size // 8), steps=1)
        return latent if vae is None else vae.decode_raw(latent)

    def estimate(size):
        parts = estimate_sample_bytes(p, (1, 16, size // 8, size // 8), 8, 1, torch.float32)
        if vae is None:
            return parts
        decode = vae.decode_bytes(1, 1, size, size)
        return parts if sum(parts.values()) >= sum(decode.values()) else decode

    return run, estimate


def vae_path(name: str, part: str):
    from fewstep.engine.vae.flux_ae import load_flux_ae
    from fewstep.engine.vae.tiny import load_tiny_vae

    if name == "flux-ae":
        ae = load_flux_ae("dummy:flux1-ae-tiny", device="cpu", dtype=torch.float32)
        latent = lambda s: torch.randn(1, 16, s // 8, s // 8)  # noqa: E731
        images = lambda s: torch.rand(1, 3, s, s)  # noqa: E731
        estimate = lambda s: ae.activation_bytes(1, s, s, 4)  # noqa: E731
    else:
        ae = load_tiny_vae(f"dummy:{name}", device="cpu", dtype=torch.float32)
        video = ae.variant.kind == "video"
        latent = (
            (lambda s: torch.randn(1, 16, 3, s // 8, s // 8))
            if video
            else (lambda s: torch.randn(1, 16, s // 8, s // 8))
        )
        images = (lambda s: torch.rand(1, 9, 3, s, s)) if video else (lambda s: torch.rand(1, 3, s, s))
        if part == "decode":
            estimate = lambda s: ae.decode_bytes(1, 3 if video else 1, s, s)  # noqa: E731
        else:
            estimate = lambda s: ae.encode_bytes(1, 9 if video else 1, s, s)  # noqa: E731
    if part == "decode":
        return (lambda s: ae.decode(latent(s))), estimate
    return (lambda s: ae.encode(images(s))), estimate


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    path, sizes = argv[0], [int(s) for s in argv[1:]]
    kind, *options = path.split(":")
    if kind == "video":
        run, estimate = video_path(options[0] == "tiny", int(options[1]))
    elif kind == "image":
        run, estimate = image_path(options[0] == "tiny")
    else:
        run, estimate = vae_path(options[0], options[1])
    with torch.inference_mode():
        for _ in range(2):
            measure(lambda: run(32))
        rows = [{"size": s, "estimate": estimate(s), "measured": measure(lambda s=s: run(s))} for s in sizes]
    print(json.dumps(rows))


if __name__ == "__main__":
    main(sys.argv[1:])
