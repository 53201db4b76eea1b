"""``python -m fewstep stream --sessions N``: N causal video streams of one model in one session pool, their chunks
batched into one forward per denoising step (``engine.causal.SessionPool``).

Session ``i`` has seed ``--seed + i`` and, without ``--cond``, the synthetic prompt a single ``stream --seed
<that seed>`` draws, so its latents are the ones that single run writes. ``--join-every K`` admits session ``i`` at
tick ``i * K``; ``--swap-every K`` suspends every session to host memory after each K-th chunk of its own and
resumes it before the next tick (the video goes on unchanged). The run ends when every session has its chunks.
"""

from __future__ import annotations

import json
import math
import os
import time
from types import SimpleNamespace

from ..engine.causal import open_session_pool
from ..engine.causal.session_pool import DEFAULT_BUCKETS, VIDEO_FPS
from ..engine.checks import check_seed
from ..engine.errors import InputError
from ..engine.units import format_bytes
from .common import (
    check_at_least,
    check_lora_files,
    compile_config,
    compile_report,
    load_condition,
    prepare_out,
    progress_bar,
    say,
    write_json,
)

BUCKETS_FLAG_DEFAULT = ",".join(str(b) for b in DEFAULT_BUCKETS)
# snapshot flags of a single stream (added beside these in cli/stream.py): a pool run has no single session to save
SINGLE_SESSION_FLAGS = {"save_session": "--save-session", "resume": "--resume"}


def add_arguments(p) -> None:
    p.add_argument(
        "--sessions",
        metavar="N",
        type=int,
        default=1,
        help="streams run together in one session pool, their chunks batched into one forward per denoising "
        "step; session i has seed --seed + i and (without --cond) the synthetic prompt of that seed, so it "
        "writes what a single stream of that seed writes; with --out each session writes "
        "DIR/session_<i>/latents.safetensors (and its video with --tiny-vae), DIR/stream.json the whole report",
    )
    p.add_argument(
        "--join-every",
        metavar="K",
        type=int,
        default=0,
        help="ticks between joins: session i joins the pool at tick i * K (0: every session joins at tick 0)",
    )
    p.add_argument(
        "--swap-every",
        metavar="K",
        type=int,
        default=0,
        help="suspend every session to host memory after each K-th chunk of its own and resume it before the "
        "next tick, reporting the bytes moved and the seconds of each swap (0: never)",
    )
    p.add_argument(
        "--max-sessions",
        metavar="N",
        type=int,
        default=None,
        help="slots of the session pool, each a KV window allocated once; sessions past it wait for a free slot "
        "(default: --sessions; fewer when the memory budget holds fewer)",
    )
    p.add_argument(
        "--buckets",
        metavar="SIZES",
        default=BUCKETS_FLAG_DEFAULT,
        help="batch sizes a pooled forward runs at, comma-separated (static shapes for compile and CUDA graphs; "
        "a batch is padded up to the next one)",
    )


def requested(args) -> bool:
    """Whether the stream is a session pool run: a pool flag differs from its default."""
    return (
        args.sessions != 1
        or args.join_every != 0
        or args.swap_every != 0
        or args.max_sessions is not None
        or args.buckets != BUCKETS_FLAG_DEFAULT
    )


def parse_buckets(text: str) -> tuple[int, ...]:
    try:
        buckets = tuple(int(part) for part in text.split(","))
    except ValueError:
        buckets = ()
    if not buckets or any(b < 1 for b in buckets):
        raise InputError(
            "--buckets", f"expected positive batch sizes separated by commas (1,2,4,8), got {text!r}"
        )
    return tuple(sorted(set(buckets)))


def check_pool_flags(args) -> tuple[int, ...]:
    """The pool flags' own checks, before anything is loaded; the buckets."""
    check_at_least(args, sessions=1, max_sessions=1)
    check_at_least(args, join_every=0, swap_every=0)
    for dest, flag in SINGLE_SESSION_FLAGS.items():
        if getattr(args, dest, None):
            raise InputError(flag, "saves or continues one stream; it cannot be combined with a session pool "
                             "(--sessions, --join-every, --swap-every, --max-sessions, --buckets)")  # fmt: skip
    check_seed(args.seed, "--seed")
    last = args.seed + args.sessions - 1
    if last != args.seed:
        try:
            check_seed(last)
        except InputError:
            raise InputError("--seed", f"session {args.sessions - 1}'s seed {args.seed} + {args.sessions - 1} = "
                             f"{last} is past 2^64 - 1; use a smaller --seed or fewer --sessions") from None  # fmt: skip
    return parse_buckets(args.buckets)


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile (a value that occurred: no interpolation over few chunks)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


class PoolStream:
    """One session of the run as the CLI sees it: its index, seed, pool handle, chunk rows, swaps and output."""

    def __init__(self, index: int, seed: int, join_tick: int):
        self.index, self.seed, self.join_tick = index, seed, join_tick
        self.session = None  # the PoolSession once it joined
        self.rows: list[dict] = []
        self.swaps: list[dict] = []
        self.output = None  # StreamOutput with --out
        self.driver = None  # stream_interactive.Driver with --init-latents / --input-video / --prompt-switch
        self.prefill: dict | None = None
        self.script = None  # the ControlScript it follows (stream --script)
        self.n_chunks: int | None = None  # its chunks when they differ per session (a script's)

    @property
    def done(self) -> bool:
        return self.session is not None and self.session.state == "closed"

    def summary(self) -> dict:
        latencies = [r["latency"] for r in self.rows]
        return {
            "session": self.index,
            "seed": self.seed,
            "join_tick": self.join_tick,
            "chunks": self.rows,
            "first_chunk_latency": latencies[0] if latencies else None,
            "latency_mean": sum(latencies) / len(latencies) if latencies else None,
            "latency_p50": percentile(latencies, 50) if latencies else None,
            "latency_p99": percentile(latencies, 99) if latencies else None,
            "waited_mean": sum(r["waited"] for r in self.rows) / len(self.rows) if self.rows else None,
            "deadlines_met": sum(r["deadline_met"] for r in self.rows),
            "swaps": self.swaps,
            **({} if self.prefill is None else {"prefill": self.prefill}),
            **(
                {"prompt_switches": self.driver.switch_rows}
                if self.driver and self.script is None and self.driver.inter.switches
                else {}
            ),
            **(
                {}
                if self.script is None
                else {"script": {"path": self.script.path, "controls": self.driver.switch_rows}}
            ),
        }


class PoolRun:
    """The loop of a pool run: joins at their ticks, resumes, one pool tick, then each chunk taken (written with
    --out), finished sessions closed and --swap-every's suspends."""

    def __init__(self, args, pool, n_chunks: int, prompt_of, streams: list[PoolStream], interactive=None):
        self.args, self.pool, self.n_chunks, self.prompt_of = args, pool, n_chunks, prompt_of
        self.interactive = interactive  # stream_interactive.Interactive: every session gets the same inputs
        self.streams = streams
        self.by_key: dict[str, PoolStream] = {}
        self.ticks: list[dict] = []
        self.embed = None  # stream_script.PromptTexts of a --script run

    def run(self, before_forward, chunk_done) -> None:
        while not all(s.done for s in self.streams):
            self.join_due()
            for s in self.streams:
                if s.session is not None and s.session.state == "suspended":
                    self.resume(s)
            report = self.pool.tick(before_forward)
            for key in report.failed:
                s = self.by_key[key]
                err = s.session.error
                problem = err.problem.removeprefix(f"{key}: ")  # the pool's key; the CLI names its own index
                raise InputError(err.input_name, f"session {s.index} (seed {s.seed}): {problem}") from None
            served = sorted((self.by_key[key] for key in report.chunks), key=lambda s: s.index)
            self.ticks.append({"tick": report.tick, "sessions": [s.index for s in served],
                               "batches": list(report.batches), "buckets": list(report.buckets),
                               "seconds": report.seconds})  # fmt: skip
            if not self.args.json:
                say(_tick_line(self.ticks[-1]))
            for s in served:
                self.take(s, report.chunks[s.session.key])
                chunk_done()

    def join_due(self) -> None:
        """Every session whose join tick has come joins (queued while no slot is free)."""
        for s in self.streams:
            if s.session is None and s.join_tick <= self.pool.ticks:
                if self.args.out:  # before joining: its chunk is due from the join on
                    s.output = self.open_output(s)
                s.session = self.pool.join(self.prompt_of(s), s.seed, self.chunks_of(s), wait=True)
                self.by_key[s.session.key] = s
                if s.script is not None:
                    self.start_script(s)
                elif self.interactive is not None:
                    self.start_interactive(s)

    def chunks_of(self, s: PoolStream) -> int:
        return self.n_chunks if s.n_chunks is None else s.n_chunks

    def start_script(self, s: PoolStream) -> None:
        """A joined session's script driver, and the controls its script sends before the first chunk."""
        from .stream_interactive import PoolSessionCalls, prefill_line, prefill_report
        from .stream_script import ScriptDriver, ScriptMedia

        a = self.args
        media = ScriptMedia(s.script, a.width, a.height)
        vae = self.pool.tiny_vae
        start = media.start_latents(vae) if s.script.start_image is not None else None
        if start is not None:  # the start image prefilled into its slot, as the live node does at the join
            started = self.pool.prefill(s.session, start)
            s.prefill = prefill_report(started, s.script.start_image)
            if s.output is not None:
                s.output.start(started.decoded)
            if not a.json:
                say(f"session {s.index}: " + prefill_line(s.prefill))
        s.driver = ScriptDriver(s.script, PoolSessionCalls(self.pool, s.session), self.embed, media, vae,
                                a.chunk_frames)  # fmt: skip
        s.driver.before_chunk(0)

    def start_interactive(self, s: PoolStream) -> None:
        """A joined session's start (committed into its slot now) and its first chunk's input and switch."""
        from .stream_interactive import Driver, PoolSessionCalls, prefill_line, prefill_report

        inter = self.interactive
        if inter.init_latents is not None:
            started = self.pool.prefill(s.session, inter.init_latents)
            s.prefill = prefill_report(started, self.args.init_latents)
            if s.output is not None:
                s.output.start(started.decoded)  # the start frames open its video
            if not self.args.json:
                say(f"session {s.index}: " + prefill_line(s.prefill))
        s.driver = Driver(inter, PoolSessionCalls(self.pool, s.session), self.args.chunk_frames)
        s.driver.before_chunk(0)

    def open_output(self, s: PoolStream):
        from .stream import StreamOutput

        a = self.args
        out = os.path.join(a.out, f"session_{s.index}")
        os.makedirs(out, exist_ok=True)
        # what StreamOutput reads of a session (a pool session starts a new stream: no frame before its first)
        start = self.interactive.init_latents if self.interactive is not None else None
        frames_before = 0 if start is None else start.shape[2]  # a prefilled session is past its first frame
        if s.script is not None:
            frames_before = 0 if s.script.start_image is None else 1  # a start image is one latent frame
        one = SimpleNamespace(batch=1, latent_hw=self.pool.latent_hw, frames_generated=frames_before)
        channels = self.pool.model.params.in_dim
        return StreamOutput(out, one, channels, self.chunks_of(s), a.chunk_frames, self.pool.tiny_vae is not None,
                            a.width, a.height)  # fmt: skip

    def take(self, s: PoolStream, chunk) -> None:
        """The consumer's side of a chunk: take it, record it, write it; close or suspend its session."""
        s.session.take()
        row = _chunk_row(s.session.stats.pool_recent[-1], chunk, self.args.chunk_frames)
        if s.driver is not None:
            fields, note = s.driver.chunk_fields(len(s.rows), chunk)
            row.update(fields)
            if note and not self.args.json:
                say(f"session {s.index}: chunk {chunk.index}, {chunk.seconds:.3f} s{note}")
        s.rows.append(row)
        if s.driver is not None and len(s.rows) < self.chunks_of(s):  # its next chunk's input and switch
            s.driver.before_chunk(len(s.rows))
        written = s.output.append(chunk) if s.output is not None else []
        if written and not self.args.json:
            say(f"session {s.index}: " + "; ".join(f"wrote {path}" for path in written))
        if s.session.chunks_left == 0:
            self.pool.leave(s.session, "done")
        elif self.args.swap_every and s.session.stats.chunks_generated % self.args.swap_every == 0:
            self.suspend(s)

    def suspend(self, s: PoolStream) -> None:
        after = s.session.stats.chunks_generated - 1
        started = time.perf_counter()
        state = self.pool.suspend(s.session, f"--swap-every {self.args.swap_every}: after chunk {after}")
        seconds = time.perf_counter() - started
        s.swaps.append({"after_chunk": after, "bytes": state.nbytes, "suspend_seconds": seconds,
                        "resume_seconds": None})  # fmt: skip
        if not self.args.json:
            say(f"session {s.index}: suspended after chunk {after}, {format_bytes(state.nbytes)} to host memory "
                f"in {seconds:.4f} s")  # fmt: skip

    def resume(self, s: PoolStream) -> None:
        started = time.perf_counter()
        resumed = self.pool.resume(s.session, wait=True)  # no free slot: queued, admitted when one frees
        s.swaps[-1]["resume_seconds"] = seconds = time.perf_counter() - started
        if not self.args.json:
            how = f"into slot {s.session.slot}" if resumed else "queued for a free slot"
            say(f"session {s.index}: resumed {how} in {seconds:.4f} s")


def run(args, scripts=None) -> int:
    """``scripts``: the ControlScripts of ``--script`` (one per session), or None."""
    from . import stream_interactive
    from .stream import chunk_count, encode_stream_prompts, open_stream_parts, synthetic_prompt
    from .stream_script import PromptTexts

    # --init-latents, --input-video, --prompt-switch: read and checked before loading; every session gets them
    interactive = stream_interactive.prepare(args)
    n_chunks = chunk_count(args)
    check_at_least(args, text_tokens=1, chunks=1)
    buckets = check_pool_flags(args)
    compiling = compile_config(args)  # a bad --compile / --cuda-graph fails before loading
    check_lora_files(args.lora)
    if args.out:
        prepare_out(args.out)
    # every prompt of the run encoded, the encoder freed, then the model loaded
    texts, text_report = encode_stream_prompts(args, scripts, interactive)
    handle, config, vae = open_stream_parts(args, compiling)
    text_dim = handle.params.text_dim
    if args.prompt is not None:
        shared = texts[args.prompt]
    else:
        shared = load_condition(args.cond, None).context if args.cond else None
    embed = PromptTexts(handle.params, texts)

    def prompt_of(s: PoolStream):
        """The script's prompt; else --cond for every session, else the synthetic prompt a single stream of its
        seed uses."""
        if s.script is not None:
            return embed(s.script.prompt)
        return shared if shared is not None else synthetic_prompt(s.seed, args.text_tokens, text_dim)

    wanted_slots = args.sessions if args.max_sessions is None else args.max_sessions
    # every session past the slots waits in the queue from tick 0 (the command's own sessions: no bound needed
    # beyond --sessions itself)
    pool, compiled = open_session_pool(handle, args.height, args.width, config, wanted_slots, buckets, vae,
                                       where="stream", max_waiting=args.sessions)  # fmt: skip
    if interactive is not None:
        try:
            stream_interactive.check_with_session(interactive, None, handle.params, batch=1)
            if interactive.init_latents is not None and pool.slots < args.sessions:
                raise InputError("--init-latents", f"a start is committed into a session's slot when it joins; the "
                                 f"memory budget holds {pool.slots} slots for {args.sessions} sessions, so some "
                                 "would wait for one (use fewer --sessions)")  # fmt: skip
        except BaseException:
            pool.close()
            raise
    if not args.json and pool.slots < args.sessions:
        say(
            f"the pool holds {pool.slots} slots for {args.sessions} sessions: the others wait for a free slot"
        )
    streams = [PoolStream(i, args.seed + i, i * args.join_every) for i in range(args.sessions)]
    for s, script in zip(streams, scripts or []):  # session i follows the i-th script: its seed and chunks
        s.script, s.seed, s.n_chunks = script, script.seed, script.chunks_to_run
    loop = PoolRun(args, pool, n_chunks, prompt_of, streams, interactive)
    loop.embed = embed
    steps_per_chunk = len(pool.sigmas) - 1
    try:
        with (
            progress_bar("chunks", sum(loop.chunks_of(s) for s in streams)) as chunk_bar,
            progress_bar("steps", steps_per_chunk, position=1) as step_bar,
        ):

            def before_forward(step):  # before every batched forward; step None: the commit pass
                if step == 0:
                    step_bar.reset(total=steps_per_chunk)
                elif step is not None:
                    step_bar.update(step - step_bar.n)

            loop.run(before_forward, chunk_bar.update)
        for s in streams:
            if s.output is not None:
                s.output.finish()
    finally:
        for s in streams:
            if s.output is not None:
                s.output.abandon()  # an interrupted run leaves no half-written file
        telemetry = compiled.finish() if compiled is not None else None
        slots, pool_buckets, pool_bytes, slot_bytes = (
            pool.slots,
            list(pool.buckets),
            pool.nbytes,
            pool.slot_bytes,
        )
        pool.close()
    sessions = [s.summary() for s in streams]
    swaps = [swap for s in streams for swap in s.swaps]
    report = {
        "model": handle.describe(),
        "sessions": sessions,
        "ticks": loop.ticks,
        "slots": slots,
        "buckets": pool_buckets,
        "pool_bytes": pool_bytes,
        "slot_bytes": slot_bytes,
        "swaps": {
            "count": len(swaps),
            "bytes": sum(w["bytes"] for w in swaps),
            "suspend_seconds": sum(w["suspend_seconds"] for w in swaps),
            "resume_seconds": sum(w["resume_seconds"] for w in swaps),
        },
        "kv_dtype": args.kv_dtype,
        # with --script each session makes its script's chunks: the largest count is reported
        "chunks_per_session": (n_chunks := max(loop.chunks_of(s) for s in streams)),
        "latent_frames": n_chunks * args.chunk_frames,
        "video_frames": 4 * n_chunks * args.chunk_frames
        - (0 if interactive is not None and interactive.init_latents is not None else 3),
        "fps": VIDEO_FPS,
        "compile": compile_report(telemetry),
    }
    if text_report is not None:
        report["text_encoder"] = text_report
    if args.out:
        for s, summary in zip(streams, sessions):
            summary["files"] = s.output.files
        write_json(os.path.join(args.out, "stream.json"), report)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    for summary in sessions:
        print(_session_line(summary))
    if swaps:
        print(f"{len(swaps)} swaps: {format_bytes(report['swaps']['bytes'] // len(swaps))} moved each way per swap, "
              f"{report['swaps']['suspend_seconds'] / len(swaps):.4f} s out and "
              f"{report['swaps']['resume_seconds'] / len(swaps):.4f} s in on average")  # fmt: skip
    print(f"pool: {slots} slots, buckets {','.join(map(str, pool_buckets))}, {format_bytes(pool_bytes)}")
    if args.out:
        for s in streams:
            print(f"session {s.index}: wrote {s.output.latents.path}" + "".join(
                f", {video}" for video in s.output.files["video"]))  # fmt: skip
        if vae is None:
            print(
                "no video: decoding frames needs --tiny-vae (taew2_1.pth; dummy:taew2_1 with dummy weights)"
            )
        print(f"wrote {os.path.join(args.out, 'stream.json')}")
    return 0


def _chunk_row(timing, chunk, chunk_frames: int) -> dict:
    """A chunk of a pool session as --json reports it (the pool's timing and the chunk's own figures)."""
    return {
        "index": chunk.index, "start_frame": chunk.start_frame, "tick": timing.tick, "batch": timing.batch,
        "bucket": timing.bucket, "waited": timing.waited, "latency": timing.latency,
        "deadline": (4 * chunk_frames - (3 if chunk.index == 0 else 0)) / VIDEO_FPS,
        "deadline_met": timing.deadline_met, "seconds": chunk.seconds, "commit_seconds": chunk.commit_seconds,
        "kv_bytes": chunk.kv_bytes, "kv_bytes_used": chunk.kv_bytes_used,
    }  # fmt: skip


def _tick_line(tick: dict) -> str:
    if not tick["batches"]:
        return f"tick {tick['tick']}: no session due, {tick['seconds']:.3f} s"
    batches = " + ".join(f"{b} (bucket {k})" for b, k in zip(tick["batches"], tick["buckets"]))
    return (
        f"tick {tick['tick']}: sessions {', '.join(map(str, tick['sessions']))}, "
        f"batch{'es' if len(tick['batches']) > 1 else ''} {batches}, {tick['seconds']:.3f} s"
    )


def _session_line(summary: dict) -> str:
    rows = summary["chunks"]
    if not rows:
        return f"session {summary['session']} (seed {summary['seed']}): no chunk"
    return (
        f"session {summary['session']} (seed {summary['seed']}): {len(rows)} chunks, first chunk "
        f"{summary['first_chunk_latency']:.3f} s, latency mean {summary['latency_mean']:.3f} / p50 "
        f"{summary['latency_p50']:.3f} / p99 {summary['latency_p99']:.3f} s, waited mean "
        f"{summary['waited_mean']:.3f} s, deadlines met {summary['deadlines_met']} of {len(rows)} "
        f"(chunk video frames at {VIDEO_FPS} fps)"
    )
