"""Attention input layout: head-major q/k/v (this engine now) against the transposed ``[B, L, H, D]`` views it
handed SDPA before, per family, on the same weights and inputs in one process.

The old layout is the same code with ``engine.attention.SDPA_HEAD_MAJOR_DEVICES`` emptied: RoPE writes token-major,
FLUX's value concatenation and the causal KV cache's buffers are token-major, and ``local_attention`` passes SDPA
the transposed views, exactly as before the change. Per round each side runs one forward (the order alternating);
**ratio** = old time / new time per round, median (min-max): above 1x the head-major layout is faster. *diff* is
the max abs difference between the two sides' outputs (the same kernel on the same numbers: 0 expected).

    python bench/attention_layout.py                       # every case, 1 thread, 5 rounds
    python bench/attention_layout.py --threads 2 --cases flux,wan-causal --rounds 7
    python bench/attention_layout.py --cases flux --comfyui ~/.cache/fewstep-comfyui-0.8.0/ComfyUI   # + ComfyUI

``--comfyui DIR`` adds ComfyUI's own FLUX.1 (``comfy.ldm.flux.model.Flux`` from that checkout, SDPA attention as
``--use-pytorch-cross-attention`` sets it, fp32) with the same weights to the flux case: its ``forward_orig`` on the
same packed inputs alternates with ours (head-major) for ``--rounds`` more rounds; ratio = ComfyUI / ours.

Cases: ``flux`` (flux-mid, 8 heads x 128), ``flux2`` (flux2-mid), ``zimage`` (zimage-mid) at ``--size`` (default
1024x1024: 4096 image + 128 text tokens), ``wan`` (wan-mid, 4 heads x 128, one 832x480 frame, 1560 tokens,
bidirectional) and ``wan-causal`` (wan-mid, a stream of 3-frame chunks over a 9-frame window at 256x256 px: the
steady chunks' time, whose self-attention reads the whole KV window).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from fewstep.engine import attention
from fewstep.engine.causal import CausalConfig, VideoSession
from fewstep.engine.loader import load_dit

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _common import dit_inputs, header, parse_args, parse_px, save, setup_threads, summary_row  # noqa: E402

QUICK = {"rounds": 1, "size": "256x256", "cases": "flux,wan-causal"}


@contextmanager
def layout(head_major: bool):
    saved = attention.SDPA_HEAD_MAJOR_DEVICES
    attention.SDPA_HEAD_MAJOR_DEVICES = saved if head_major else frozenset()
    try:
        yield
    finally:
        attention.SDPA_HEAD_MAJOR_DEVICES = saved


def comfyui_flux(ours, comfy_dir: str, site: str | None):
    """ComfyUI's FLUX.1 (``comfy.ldm.flux.model.Flux``, from the checkout ``comfy_dir``, SDPA attention, fp32
    ``disable_weight_init`` layers) with our model's weights (BFL's key names, ComfyUI's too): (its
    ``forward_orig`` on our packed inputs, ComfyUI's version)."""
    import dataclasses

    from wan_vs_peers import import_comfy

    _, ops, version = import_comfy(Path(comfy_dir), site)
    import comfy.ldm.flux.model as flux_model

    p = ours.params
    kwargs = dict(in_channels=p.in_channels // 4, out_channels=p.out_channels // 4, vec_in_dim=p.vec_in_dim,
                  context_in_dim=p.context_in_dim, hidden_size=p.hidden_size, mlp_ratio=p.mlp_ratio,
                  num_heads=p.num_heads, depth=p.depth, depth_single_blocks=p.depth_single_blocks,
                  axes_dim=list(p.axes_dim), theta=p.theta, patch_size=2, qkv_bias=p.qkv_bias,
                  guidance_embed=p.guidance_embed)  # fmt: skip
    if "txt_ids_dims" in {f.name for f in dataclasses.fields(flux_model.FluxParams)}:
        kwargs["txt_ids_dims"] = []
    ref = flux_model.Flux(
        dtype=torch.float32, device=torch.device("cpu"), operations=ops.disable_weight_init, **kwargs
    )
    ref.load_state_dict(ours.state_dict(), strict=True)
    return ref.eval(), version


def image_case(preset: str, width: int, height: int, comfy=None):
    model = load_dit(f"dummy:{preset}", torch.float32, "cpu")
    inputs = dit_inputs(model, width, height, 128)
    if comfy is not None:
        ref, version = comfyui_flux(model, *comfy)

        def run_comfy():
            with torch.inference_mode():
                t0 = time.perf_counter()
                out = ref.forward_orig(**{k: v for k, v in inputs.items() if k != "guidance"})
                return time.perf_counter() - t0, out

        run_comfy.version = version

    def run(head_major: bool):
        with layout(head_major), torch.inference_mode():
            t0 = time.perf_counter()
            out = model(**inputs)
            return time.perf_counter() - t0, out

    run.comfy = run_comfy if comfy is not None else None
    return run


def wan_case():
    model = load_dit("dummy:wan-mid", torch.float32, "cpu")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 16, 1, 60, 104, generator=gen)
    ctx = torch.randn(1, 512, model.params.text_dim, generator=gen)
    t = torch.tensor([500.0])

    def run(head_major: bool):
        with layout(head_major), torch.inference_mode():
            t0 = time.perf_counter()
            out = model(x, t, ctx)
            return time.perf_counter() - t0, out

    return run


def wan_causal_case():
    model = load_dit("dummy:wan-mid", torch.float32, "cpu")
    ctx = torch.randn(1, 512, model.params.text_dim, generator=torch.Generator().manual_seed(0))
    cfg = CausalConfig(chunk_frames=3, window_frames=9, schedule="wan-dmd-4step")

    def run(head_major: bool):
        with (
            layout(head_major),
            torch.inference_mode(),
        ):  # the session allocates its KV buffers in this layout
            session = VideoSession(model, ctx, 256, 256, cfg, seed=0)
            chunks = list(session.chunks(5))
            session.dispose()
        steady = chunks[3:]  # the window is full from the fourth chunk on
        return sum(c.seconds for c in steady), torch.cat([c.latents for c in chunks], dim=2)

    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--size", default="1024x1024", help="image cases: width x height px")
    ap.add_argument("--cases", default="flux,flux2,zimage,wan,wan-causal")
    ap.add_argument(
        "--comfyui", default=None, help="a ComfyUI checkout: its FLUX.1 forward as a peer of the flux case"
    )
    ap.add_argument(
        "--comfyui-site", default=None, help="site-packages with ComfyUI's deps (default DIR/../venv)"
    )
    args = parse_args(ap, QUICK)
    setup_threads(args.threads or 1)  # 1 thread unless told: the steadiest on a shared machine
    env = header("attention input layout: head-major vs transposed token-major views")
    width, height = parse_px(args.size)
    builders = {
        "flux": lambda: image_case(
            "flux-mid", width, height, (args.comfyui, args.comfyui_site) if args.comfyui else None
        ),
        "flux2": lambda: image_case("flux2-mid", width, height),
        "zimage": lambda: image_case("zimage-mid", width, height),
        "wan": wan_case,
        "wan-causal": wan_causal_case,
    }
    print("| case | rounds | head-major s | old s | old / new (min-max) | diff |")
    print("|---|---|---|---|---|---|")
    results = {}
    for name in args.cases.split(","):
        run = builders[name]()
        run(True), run(False)  # warm-up: oneDNN primitives, allocator
        new, old, ratios, diff = [], [], [], 0.0
        for r in range(args.rounds):
            order = (True, False) if r % 2 == 0 else (False, True)
            times = {}
            for head_major in order:
                times[head_major], out = run(head_major)
                if head_major:
                    out_new = out
                else:
                    out_old = out
            diff = max(diff, (out_new.float() - out_old.float()).abs().max().item())
            new.append(times[True])
            old.append(times[False])
            ratios.append(times[False] / times[True])
        comfy = getattr(run, "comfy", None)
        if comfy is not None:  # a third side, in the same rounds: ComfyUI's time / ours (head-major)
            peer, peer_ratios, peer_diff = [], [], 0.0
            comfy()
            for _ in range(args.rounds):
                t_new, out_new = run(True)
                t_peer, out_peer = comfy()
                peer.append(t_peer)
                peer_ratios.append(t_peer / t_new)
                peer_diff = max(peer_diff, (out_peer.float() - out_new.float()).abs().max().item())
            print(
                f"| {name}: ComfyUI {comfy.version} / ours | {args.rounds} | - | {statistics.median(peer):.3f} | "
                f"**{statistics.median(peer_ratios):.3f}x** ({min(peer_ratios):.3f}-{max(peer_ratios):.3f}) | "
                f"{peer_diff:.1e} |"
            )
            results[f"{name} vs ComfyUI {comfy.version}"] = {"peer": peer, "ratios": peer_ratios,
                                                             "ratio": statistics.median(peer_ratios),
                                                             "max_abs_diff": peer_diff}  # fmt: skip
        med = statistics.median(ratios)
        print(
            f"| {name} | {args.rounds} | {statistics.median(new):.3f} | {statistics.median(old):.3f} | "
            f"**{med:.3f}x** ({min(ratios):.3f}-{max(ratios):.3f}) | {diff:.1e} |"
        )
        results[name] = {"new": new, "old": old, "ratios": ratios, "ratio": med, "max_abs_diff": diff}
    summary = (
        [
            summary_row(f"attention layout: old / head-major forward time, {name}", f"{r['ratio']:.3f}x")
            for name, r in results.items()
            if "peer" not in r
        ]
        + [
            summary_row(
                f"{name}: time / ours (head-major)", f"{r['ratio']:.3f}x (diff {r['max_abs_diff']:.1e})"
            )
            for name, r in results.items()
            if "peer" in r
        ]
        + [
            summary_row(
                "attention layout: max abs diff of the outputs, every case",
                f"{max(r['max_abs_diff'] for r in results.values() if 'peer' not in r):.1e}",
                "0",
                all(r["max_abs_diff"] == 0 for r in results.values() if "peer" not in r),
            )
        ]
    )
    save("attention_layout", {"environment": env, "size": args.size, "results": results, "summary": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
