"""How long a Cancel can wait: one transformer block of a forward, against the whole forward (issue 28).

    python bench/cancel_latency.py                                  # dummy:flux-mid, 512x512 and 1024x1024 px
    python bench/cancel_latency.py --sizes 2048x2048 --rounds 1     # the size of the issue (minutes on a CPU)
    python bench/cancel_latency.py --quick                          # 256x256, 2 rounds (bench/run_all)

With ``RunOptions(interrupt_check=...)`` the engine calls the host's cancel check before every block of a forward
(``engine.run``), so a Cancel waits at most for the block that is running, instead of the rest of the forward.
Per size this times one eager forward of the preset (the median of ``--rounds``) and each of its blocks (forward
pre- and post-hooks on the CPU, where every kernel has finished when the hook runs), and prints the slowest
block's share of the forward: the worst wait for a Cancel, as a fraction of what a per-forward check waits.
It also times the check itself, written as ComfyUI's (a flag read under a lock), per call and per forward
(``check on`` vs ``check off``, interleaved), and the largest difference of the outputs (0: bit-equal).
"""

from __future__ import annotations

import argparse
import threading
import time

import torch
from _common import (
    describe_dit,
    dit_inputs,
    header,
    median,
    parse_args,
    parse_px,
    save,
    setup_threads,
    summary_row,
)

from fewstep.engine import RunOptions, open_model
from fewstep.engine.run import open_run

QUICK = {"sizes": "256x256", "rounds": 2}


def comfy_like_check():
    """A cancel check as ComfyUI's ``throw_exception_if_processing_interrupted``: a flag read under an RLock."""
    lock, state = threading.RLock(), {"interrupted": False}

    def check() -> None:
        with lock:
            if state["interrupted"]:
                state["interrupted"] = False
                raise InterruptedError

    return check


def block_list(model) -> list[torch.nn.Module]:
    return (
        [*model.double_blocks, *model.single_blocks]
        if hasattr(model, "double_blocks")
        else list(model.layers)
    )


def measure(preset: str, size: str, txt: int, rounds: int) -> dict:
    handle = open_model(f"dummy:{preset}")
    model = handle.model
    w, h = parse_px(size)
    inputs = dit_inputs(model, w, h, txt)
    check = comfy_like_check()
    plain = open_run(handle, RunOptions())
    checked = open_run(handle, RunOptions(interrupt_check=check))

    starts: dict[int, float] = {}
    seconds: dict[int, list[float]] = {i: [] for i in range(len(block_list(model)))}
    hooks = []
    for i, block in enumerate(block_list(model)):
        hooks.append(
            block.register_forward_pre_hook(lambda *_, i=i: starts.__setitem__(i, time.perf_counter()))
        )
        hooks.append(
            block.register_forward_hook(lambda *_, i=i: seconds[i].append(time.perf_counter() - starts[i]))
        )

    def forward(run):
        with torch.inference_mode():
            return model(**inputs, block_runner=run.blocks(None), backends=run.backends)

    forward(checked)  # warm-up (allocator, thread pool)
    for i in seconds:
        seconds[i].clear()
    off_s, on_s, diff = [], [], 0.0
    for _ in range(rounds):
        for run, times in ((plain, off_s), (checked, on_s)):
            t0 = time.perf_counter()
            out = forward(run)
            times.append(time.perf_counter() - t0)
            if run is plain:
                reference = out
            else:
                diff = max(diff, float((out - reference).abs().max()))
    for hook in hooks:
        hook.remove()

    calls = 200_000
    t0 = time.perf_counter()
    for _ in range(calls):
        check()
    check_us = (time.perf_counter() - t0) / calls * 1e6

    block_s = {i: median(v) for i, v in seconds.items()}
    slowest = max(block_s, key=block_s.get)
    forward_s = median(on_s)
    return {
        "preset": preset, "size": size, "tokens": inputs["img"].shape[1] if "img" in inputs else None,
        "txt": txt, "rounds": rounds, "forward_s": forward_s, "forward_off_s": median(off_s),
        "block_s": block_s, "slowest_block": slowest, "slowest_block_s": block_s[slowest],
        "slowest_share": block_s[slowest] / forward_s, "blocks": len(block_s), "check_us": check_us,
        "check_share": check_us * 1e-6 * len(block_s) / forward_s, "max_abs_diff": diff,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="flux-mid")
    parser.add_argument("--sizes", default="512x512,1024x1024")
    parser.add_argument("--txt", type=int, default=512, help="text tokens (FLUX.1's T5 length, 512)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parse_args(parser, QUICK)
    setup_threads(args.threads)
    env = header("Cancel latency: one block vs one forward")
    handle = open_model(f"dummy:{args.preset}")
    print(f"dummy:{args.preset}: {describe_dit(handle.params)}; {args.txt} text tokens\n")
    print("| size | forward s (check on / off) | slowest block s | slowest block / forward | check us/call | "
          "checks / forward | max abs diff |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    rows = []
    for size in args.sizes.split(","):
        r = measure(args.preset, size, args.txt, args.rounds)
        rows.append(r)
        print(
            f"| {size} | {r['forward_s']:.3f} / {r['forward_off_s']:.3f} | {r['slowest_block_s']:.3f} "
            f"(block {r['slowest_block']}) | {r['slowest_share']:.1%} | {r['check_us']:.2f} | "
            f"{r['check_share']:.1e} | {r['max_abs_diff']:.1e} |"
        )
    last = rows[-1]
    summary = [
        summary_row(f"slowest block / forward ({last['size']})", f"{last['slowest_share']:.1%}"),
        summary_row("outputs with the check on", f"max abs diff {last['max_abs_diff']:.1e}", "0", last["max_abs_diff"] == 0),
    ]  # fmt: skip
    save("cancel_latency", {"environment": env, "rows": rows, "summary": summary})


if __name__ == "__main__":
    main()
