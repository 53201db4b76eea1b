"""The predicted realtime metrics of live sessions (issue 33): what the clients of a live node would measure.

A live node hosts one session pool and ticks it for as long as it runs; the live service takes each session's
chunk as soon as it is made, so in the steady state every open session is due at every tick and runs in it.
Everything below follows from the per-tick model of ``sessions.py`` (:func:`~.sessions.plan_session_tick`) and
the tiny VAE's decode FLOPs (``vae.py``), at the same peak x MFU:

* **inter-chunk interval** of every session = one steady tick of N sessions (``steps`` + 1 clean-context pass,
  batched as the pool cuts and pads them) + N tiny-VAE decodes of a chunk (the pool decodes each session's chunk
  after its batch, one session after the other; none without a tiny VAE). The model has no noise: its p50 and
  p99 are both the interval.
* **realtime factor** = video seconds a chunk holds (``4 x chunk_frames`` frames at 16 fps) / the interval.
* **deadline attainment**: the pool's deadline of a chunk is its own video duration after it became due, so the
  steady chunks meet it all (interval <= a chunk's video seconds) or none. A viewer playing the chunks as they
  arrive then waits ``interval - video seconds`` before every chunk (a stall at every chunk) or never.
* **time to first chunk** (TTFC), N sessions opened together on an idle pool: the DiT's per-prompt work of the N
  prompts (text embedding + every layer's cross-attention K/V, :func:`~.flops.wan_prompt_flops`), one tick
  without a clean pass (a first chunk has nothing to commit: ``steps`` forwards, each as costly as a steady one,
  since the static cache reads every slot) and the N decodes. **The text encoder is left out**: a prompt already
  in the live node's embedding cache costs nothing there, a new one adds the encoder's time (umT5-XXL in a real
  workflow; not in this planner). A session that joins a pool already running N - 1 others waits, at worst, for
  the tick in flight (their interval) and then runs a steady tick of N: ``first_chunk_seconds_joining``.
* **sessions that stay realtime**: the most sessions whose steady interval still meets the deadline (the interval
  never falls as sessions are added: more rows, more decodes), and the most whose memory fits the GPU: weights +
  N x (KV window + cross-attention K/V), activations not counted.

Not modelled: the host's work per chunk (WebP / JPEG encoding, websocket sends, on the CPU), the Python of a tick
and the network.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..causal.session_pool import DEFAULT_BUCKETS, VIDEO_FPS
from ..errors import InputError
from ..models.wan import WanParams
from .flops import wan_prompt_flops
from .hardware import DEFAULT_MFU, GpuSpec, check_mfu, gpu_spec
from .sessions import plan_session_tick
from .vae import taehv_decode_flops

LIVE_SESSIONS = (1, 2, 4, 8)  # the session counts `plan --live` predicts by default
MAX_SCAN = 1024  # the realtime / memory scans stop here (far past any GPU's memory at 480p)


@dataclass(frozen=True)
class LivePrediction:
    """The predicted metrics of every session of a live pool running ``sessions`` sessions (seconds)."""

    sessions: int
    batches: tuple[int, ...]  # the bucketed rows of each batched forward of a tick
    tick_seconds: float  # the DiT part of a steady tick
    decode_seconds: float  # one session's tiny-VAE decode of a chunk (0 without a tiny VAE)
    interval_seconds: float  # inter-chunk interval of every session (p50 = p99)
    chunk_video_seconds: float  # video a steady chunk holds
    first_chunk_seconds: float  # TTFC, the sessions opened together on an idle pool (no text encoder)
    first_chunk_seconds_joining: float  # TTFC of one joining a pool running sessions - 1 others, worst case
    first_chunk_video_seconds: float  # video the first chunk holds (its deadline)
    memory_bytes: int
    fits_gpu_memory: bool

    @property
    def realtime_factor(self) -> float:
        return self.chunk_video_seconds / self.interval_seconds

    @property
    def deadline_met(self) -> bool:
        return self.interval_seconds <= self.chunk_video_seconds

    @property
    def first_chunk_deadline_met(self) -> bool:
        return self.first_chunk_seconds <= self.first_chunk_video_seconds

    @property
    def stall_seconds_per_chunk(self) -> float:
        """What a viewer playing chunks as they arrive waits before each steady chunk."""
        return max(0.0, self.interval_seconds - self.chunk_video_seconds)

    def as_dict(self) -> dict:
        out = asdict(self)
        out["batches"] = list(self.batches)
        out |= {
            "inter_chunk_p50_seconds": self.interval_seconds,
            "inter_chunk_p99_seconds": self.interval_seconds,
            "realtime_factor": self.realtime_factor,
            "deadline_met": self.deadline_met,
            "deadline_attainment": 1.0 if self.deadline_met else 0.0,
            "first_chunk_deadline_met": self.first_chunk_deadline_met,
            "stall_seconds_per_chunk": self.stall_seconds_per_chunk,
            "viewer_stalls_per_chunk": 0 if self.deadline_met else 1,
        }
        return out


def plan_live(
    p: WanParams,
    height: int,
    width: int,
    sessions: tuple[int, ...] = LIVE_SESSIONS,
    chunk_frames: int = 3,
    window_frames: int = 21,
    steps: int = 4,
    gpu: str | GpuSpec = "h100",
    mfu: float = DEFAULT_MFU,
    buckets: tuple[int, ...] | None = DEFAULT_BUCKETS,
    tiny_vae: str | None = "taew2_1",
    weight_bytes: int = 0,
    session_bytes: int = 0,
    fps: float = VIDEO_FPS,
) -> dict:
    """The live metrics of ``sessions`` (each count a prediction; see the module docstring) and the session
    counts that stay realtime and that fit the GPU's memory. ``weight_bytes`` / ``session_bytes``: the model's
    weights and one session's KV window + cross K/V (the memory check; 0: not checked). ``tiny_vae``: the TAEHV
    variant decoding each chunk (None: the live node runs without one, no decode)."""
    spec = gpu if isinstance(gpu, GpuSpec) else gpu_spec(gpu)
    check_mfu(mfu)
    if not sessions or any(not isinstance(n, int) or n < 1 for n in sessions):
        raise InputError("live", f"expected session counts >= 1, got {list(sessions)!r}")
    tpf = (height // 8 // p.patch_size[1]) * (width // 8 // p.patch_size[2])
    rate = spec.peak_flops * mfu
    decode = 0.0
    if tiny_vae is not None:
        decode = taehv_decode_flops(tiny_vae, chunk_frames, height // 8, width // 8) / rate
    prompt = wan_prompt_flops(p).total / rate
    capacity = spec.memory_gb * 1e9

    def interval(n: int) -> float:
        tick = plan_session_tick(p, n, tpf, chunk_frames, window_frames, steps, spec, mfu, buckets)
        return tick.seconds + n * decode

    def predict(n: int) -> LivePrediction:
        tick = plan_session_tick(p, n, tpf, chunk_frames, window_frames, steps, spec, mfu, buckets)
        first_tick = tick.seconds * steps / tick.forwards  # a first chunk has no clean pass to run
        memory = weight_bytes + n * session_bytes
        together = n * prompt + first_tick + n * decode
        # joining: the tick in flight of the n - 1 others, then a steady tick of all n (theirs carry clean passes)
        joining = interval(n - 1) + prompt + tick.seconds + n * decode if n > 1 else together
        return LivePrediction(
            sessions=n,
            batches=tick.batches,
            tick_seconds=tick.seconds,
            decode_seconds=decode,
            interval_seconds=tick.seconds + n * decode,
            chunk_video_seconds=4 * chunk_frames / fps,
            first_chunk_seconds=together,
            first_chunk_seconds_joining=joining,
            first_chunk_video_seconds=(4 * chunk_frames - 3) / fps,
            memory_bytes=memory,
            fits_gpu_memory=memory <= capacity,
        )

    deadline = 4 * chunk_frames / fps
    realtime = 0
    while realtime < MAX_SCAN and interval(realtime + 1) <= deadline:
        realtime += 1
    fit = None
    if session_bytes:
        fit = max(0, min(MAX_SCAN, int((capacity - weight_bytes) // session_bytes)))
    return {
        "gpu": spec.name,
        "height": height,
        "width": width,
        "tokens_per_frame": tpf,
        "chunk_frames": chunk_frames,
        "window_frames": window_frames,
        "steps": steps,
        "fps": fps,
        "tiny_vae": tiny_vae,
        "prompt_seconds": prompt,
        "text_encoder": "not modelled (a prompt in the embedding cache costs nothing; a new one adds the text "
        "encoder's time to its first chunk)",
        "predictions": [predict(n).as_dict() for n in sessions],
        "realtime_sessions": realtime,
        "sessions_that_fit": fit,
        "realtime_sessions_that_fit": realtime if fit is None else min(realtime, fit),
    }


def live_rows(live: dict) -> list[tuple[str, str]]:
    """The planner table's rows of a :func:`plan_live` result."""
    decode = f" + {live['tiny_vae']} decodes" if live["tiny_vae"] else ""
    rows = []
    for r in live["predictions"]:
        n = r["sessions"]
        verdict = "meets" if r["deadline_met"] else "MISSES"
        rows.append((
            f"live, {n} session{'s' if n > 1 else ''}",
            f"chunk every {_ms(r['interval_seconds'])} (tick {_ms(r['tick_seconds'])}{decode}; p50 = p99), "
            f"{r['realtime_factor']:.2f}x realtime: {verdict} the {_ms(r['chunk_video_seconds'])} deadline"
            + ("" if r["deadline_met"] else f", a viewer stalls {_ms(r['stall_seconds_per_chunk'])} a chunk")
            + f"; TTFC {_ms(r['first_chunk_seconds'])} opened together, {_ms(r['first_chunk_seconds_joining'])} "
            f"joining (text encoder not counted); batches {'+'.join(map(str, r['batches']))}"
            + ("" if r["fits_gpu_memory"] else "; does NOT fit the GPU's memory"),
        ))  # fmt: skip
    fit = live["sessions_that_fit"]
    rows.append((
        "live sessions that stay realtime",
        f"{live['realtime_sessions']} by compute"
        + ("" if fit is None else f", {fit} fit the memory: {live['realtime_sessions_that_fit']}"),
    ))  # fmt: skip
    return rows


def _ms(s: float) -> str:
    return f"{s * 1e3:.0f} ms"


__all__ = ["LIVE_SESSIONS", "LivePrediction", "live_rows", "plan_live"]
