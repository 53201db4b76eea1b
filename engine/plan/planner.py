"""The cost planner: FLOPs, forwards, bytes and predicted seconds of one job, before it is queued.

``plan_preset("flux.2-klein-4b", height=1024, width=1024)`` or ``plan_cost(params, ...)`` (any configuration of
a family the planner knows: FLUX.1, FLUX.2, Z-Image, Wan; e.g. a loaded model's ``params``) returns a
:class:`CostPlan`: ``plan.fields`` is the JSON record, ``plan.table()`` the readable bill.

Images (every image family of the registry: FLUX.1, FLUX.2, Z-Image): ``steps x rows`` forwards, where a CFG step
(cfg != 1 with a negative prompt) runs the positive and the negative as 2 rows (one batched call, twice the FLOPs
of one row), each forward over the image tokens and the text tokens (Z-Image: each padded to a multiple of 32).
The default step count is the family's default schedule preset's (``Family.image.schedule``; the guidance-
embedded dev models take their dev preset: FLUX.1-dev 28, FLUX.2-dev 50), the default text-token count the one
the family's pipelines feed (:data:`IMAGE_COSTS`).

Causal video (Wan): the video is cut into chunks of ``chunk_frames`` latent frames; each chunk runs ``steps``
denoising forwards and one clean-context pass (the pass that commits its K/V; the engine defers it until the next
chunk starts, so the last chunk's never runs: ``chunks x steps + chunks - 1`` forwards). Every forward of chunk
``k`` attends to the whole ``window`` of latent frames of keys: the static-shape KV cache reads every slot at
every chunk (empty slots are masked while it fills), so a forward costs the same before and after the window
fills; and to the prompt's 512 padded tokens; the text embedding and cross-attention K/V are computed once per prompt.
With ``sessions=N`` the bill adds a session pool's steady tick of N such streams batched into one forward per step
(``sessions.py``: its FLOPs, GEMM sizes and predicted seconds against N solo chunks).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..causal.kv_cache import KV_LAYOUTS, WindowSpec, check_kv_storage, kv_cache_bytes, kv_layout
from ..checks import check_image_size
from ..errors import InputError
from ..models.registry import FAMILIES, Family, all_presets
from ..models.sizes import WEIGHT_DTYPE_BYTES, ParameterCount, preset_parameters
from ..models.wan import Wan, WanParams
from ..models.zimage import padded_length
from ..sampling.schedules import SCHEDULES
from .flops import (
    ForwardFlops,
    flux2_forward_flops,
    flux_forward_flops,
    wan_forward_flops,
    wan_prompt_flops,
    wan_tokens_per_frame,
    zimage_forward_flops,
)
from .hardware import DEFAULT_MFU, GpuSpec, check_mfu, gpu_spec
from .live import live_rows, plan_live
from .sessions import SCAN_SESSIONS, plan_session_tick, session_scan
from .vae import flux2_ae_decode_flops, flux_ae_decode_flops, taehv_decode_flops, taesd_decode_flops

WAN_FPS = 16  # Wan 2.1 (and its causal students) make 16 frames per second of video
VIDEO_ONLY = (
    "frames",
    "latent_frames",
    "chunk_frames",
    "window_frames",
    "sink_frames",
    "kv_dtype",
    "keep_recent_chunks",
    "sessions",
    "live",
)


def _params(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


# -- image families ------------------------------------------------------------------------------------------------
def _flux1_decoders(height: int, width: int, batch: int) -> dict[str, int]:
    lh, lw = height // 8, width // 8
    return {
        "full (FLUX.1 AE)": flux_ae_decode_flops(lh, lw, batch),
        "tiny (taef1)": taesd_decode_flops("taef1", lh, lw, batch),
    }


def _flux2_decoders(height: int, width: int, batch: int) -> dict[str, int]:
    lh, lw = height // 8, width // 8  # the 32-channel raw latent both decoders read
    return {
        "full (FLUX.2 AE)": flux2_ae_decode_flops(lh, lw, batch),
        "tiny (taef2)": taesd_decode_flops("taef2", lh, lw, batch),
    }


def _no_padding(params, image_tokens: int, text_tokens: int) -> tuple[int, int]:
    return image_tokens, text_tokens


def _zimage_padding(params, image_tokens: int, text_tokens: int) -> tuple[int, int]:
    return padded_length(image_tokens, params.seq_multiple), padded_length(text_tokens, params.seq_multiple)


@dataclass(frozen=True)
class ImageCost:
    """The planner's side of an image family (the registry's :class:`ImageSpec` gives the geometry and the
    default schedule).

    ``forward_flops(params, image_tokens, text_tokens, batch)``: one DiT forward (``flops.py``);
    ``text_tokens(params)``: the tokens per prompt its pipelines feed; ``guided_schedule``: the schedule preset
    of the guidance-embedded (dev) variant, None when the family has none; ``decoders(height, width, batch)``:
    decode FLOPs by decoder, the full autoencoder first; ``sequence(params, image, text)``: the token counts the
    blocks run over (Z-Image pads both)."""

    architecture: str
    forward_flops: Callable[..., ForwardFlops]
    text_tokens: Callable[[object], int]
    text_note: str
    guided_schedule: str | None
    decoders: Callable[[int, int, int], dict[str, int]]
    sequence: Callable[[object, int, int], tuple[int, int]] = _no_padding


IMAGE_COSTS: dict[str, ImageCost] = {
    # black-forest-labs/flux src/flux/cli.py: load_t5(max_length=256 if name == "flux-schnell" else 512)
    "flux": ImageCost(
        "FLUX.1 MMDiT",
        flux_forward_flops,
        lambda p: 512 if p.guidance_embed else 256,
        "T5 tokens (256 schnell-like, 512 dev-like)",
        "flux.1-dev",
        _flux1_decoders,
    ),
    # diffusers Flux2Pipeline / Flux2KleinPipeline: the prompt is tokenized with padding="max_length" at
    # max_sequence_length=512 and the hidden states of all 512 positions are fed
    "flux2": ImageCost(
        "FLUX.2 MMDiT",
        flux2_forward_flops,
        lambda p: 512,
        "stacked text-encoder states, padded to 512",
        "flux.2-dev",
        _flux2_decoders,
    ),
    # diffusers ZImagePipeline: the chat-templated prompt is truncated at max_sequence_length=512 and its padding
    # dropped, so 512 caption tokens is the most a prompt feeds (the model pads them to a multiple of 32)
    "zimage": ImageCost(
        "Z-Image S3-DiT",
        zimage_forward_flops,
        lambda p: 512,
        "Qwen3 caption tokens: at most 512, the pipeline's max_sequence_length",
        None,
        _flux1_decoders,
        _zimage_padding,
    ),
}


def schedule_steps(schedule: str) -> int:
    """The default step count of a schedule preset (``engine.sampling.schedules``)."""
    return SCHEDULES[schedule].steps


def image_defaults(family: Family, params) -> dict:
    """The family's default ``schedule`` (its few-step preset, or the dev preset of a guidance-embedded model),
    that preset's ``steps``, and the ``text_tokens`` its pipelines feed."""
    cost = IMAGE_COSTS[family.name]
    guided = family.image.guidance(params) and cost.guided_schedule is not None
    schedule = cost.guided_schedule if guided else family.image.schedule
    return {"schedule": schedule, "steps": schedule_steps(schedule), "text_tokens": cost.text_tokens(params)}


def family_of_params(params) -> Family | None:
    """The registry family whose presets are of ``params``'s type."""
    for fam in FAMILIES.values():
        if any(type(params) is type(p) for p in fam.presets.values()):
            return fam
    return None


def _planned(fam: Family) -> bool:
    return fam.name in IMAGE_COSTS or fam.name == "wan"


@dataclass
class CostPlan:
    fields: dict
    rows: list[tuple[str, str]] = field(repr=False)
    title: str = ""

    def __getitem__(self, key: str):
        return self.fields[key]

    def table(self) -> str:
        width = max(len(k) for k, _ in self.rows)
        lines = [self.title, "", f"| {'item'.ljust(width)} | value", f"|{'-' * (width + 2)}|------"]
        lines += [f"| {k.ljust(width)} | {v}" for k, v in self.rows]
        return "\n".join(lines)


# -- public entry points -----------------------------------------------------------------------------------------
def known_models() -> list[str]:
    return sorted(name for name, (fam, _) in all_presets().items() if _planned(fam))


def plan_preset(model: str, **settings) -> CostPlan:
    """:func:`plan_cost` for a preset name (``flux.2-klein-4b``, ``z-image-turbo``, ``wan2.1-1.3b``...)."""
    name = model[len("dummy:") :] if model.startswith("dummy:") else model
    presets = all_presets()
    if name not in presets or name not in known_models():
        raise InputError(
            "model",
            f"unknown model {model!r}; known models: {', '.join(known_models())}",
            settings.get("where"),
        )
    return plan_cost(presets[name][1], name=name, **settings)


def plan_cost(
    params,
    *,
    name: str | None = None,
    height: int | None = None,
    width: int | None = None,
    steps: int | None = None,
    cfg: float = 1.0,
    batch: int = 1,
    text_tokens: int | None = None,
    frames: int | None = None,
    latent_frames: int | None = None,
    chunk_frames: int | None = None,
    window_frames: int | None = None,
    sink_frames: int | None = None,
    kv_dtype: str | None = None,
    keep_recent_chunks: int | None = None,
    sessions: int | None = None,
    live: tuple[int, ...] | None = None,
    weight_dtype: str = "bf16",
    gpu: str = "h100",
    mfu: float = DEFAULT_MFU,
    vae: bool = True,
    loaded_weight_bytes: int | None = None,
    where: str | None = None,
) -> CostPlan:
    """The bill of one job on ``params`` (the params of a FLUX.1, FLUX.2, Z-Image or Wan model); see the module
    docstring.

    ``sessions`` (Wan): also the bill of a session-pool tick of that many sessions' chunks batched into one
    forward per step (``sessions.py``: FLOPs, GEMM rows, predicted seconds against solo chunks, the session
    counts past which batching stops paying). ``live`` (Wan): session counts whose live metrics to predict (``live.py``:
    chunk interval, TTFC, realtime factor, deadline, the sessions that stay realtime). ``None`` settings take the family's defaults. ``loaded_weight_bytes``: the bytes a loaded model actually
    holds, reported beside the by-dtype table. Bad input raises :class:`InputError` naming the setting.
    """
    try:
        spec = gpu_spec(gpu)
        check_mfu(mfu)
        _positive(batch, "batch")
        if weight_dtype not in WEIGHT_DTYPE_BYTES:
            raise InputError(
                "weight_dtype",
                f"unknown weight dtype {weight_dtype!r}; known: {', '.join(WEIGHT_DTYPE_BYTES)}",
            )
        common = dict(name=name, batch=batch, gpu=spec, mfu=mfu, weight_dtype=weight_dtype, vae=vae,
                      loaded_weight_bytes=loaded_weight_bytes)  # fmt: skip
        family = family_of_params(params)
        if family is None or not _planned(family):
            raise InputError(
                "model",
                f"no cost model for {type(params).__name__}; the planner knows FLUX.1, FLUX.2, Z-Image and Wan",
            )
        if family.is_image:
            video = {k: v for k, v in zip(VIDEO_ONLY, (frames, latent_frames, chunk_frames, window_frames,
                                                       sink_frames, kv_dtype, keep_recent_chunks, sessions, live)) if v is not None}  # fmt: skip
            if video:
                raise InputError(
                    next(iter(video)),
                    f"{name or f'this {family.image.description} model'} makes images: "
                    f"{', '.join(VIDEO_ONLY)} apply to Wan video models",
                )
            return _plan_image(family, params, height, width, steps, cfg, text_tokens, **common)
        return _plan_wan(params, height, width, steps, cfg, text_tokens, frames, latent_frames, chunk_frames,
                         window_frames, sink_frames, kv_dtype, keep_recent_chunks, sessions, live, **common)  # fmt: skip
    except InputError as err:
        if where:
            err.located(where)
        raise


# -- images ----------------------------------------------------------------------------------------------------------
def _token_geometry(family: Family) -> str:
    patch, down = family.image.token_patch, family.latent_format.downscale
    if patch == 1:
        return f"pixels of the 1/{down} latent"
    return f"{patch}x{patch} patches of the 1/{down} latent"


def _plan_image(family: Family, p, height, width, steps, cfg, text_tokens, *, name, batch, gpu: GpuSpec, mfu,
                weight_dtype, vae, loaded_weight_bytes) -> CostPlan:  # fmt: skip
    cost, spec = IMAGE_COSTS[family.name], family.image
    defaults = image_defaults(family, p)
    height, width = height or 1024, width or 1024
    steps = defaults["steps"] if steps is None else steps
    text_tokens = defaults["text_tokens"] if text_tokens is None else text_tokens
    down = family.latent_format.downscale
    multiple = down * spec.token_patch
    why = f"{down}x VAE downscaling" + (
        f" and {spec.token_patch}x{spec.token_patch} patches"
        if spec.token_patch > 1
        else ", one token a latent pixel"
    )
    _check_size(height, width, multiple, why)
    _positive(steps, "steps")
    _positive(text_tokens, "text_tokens")
    image_tokens = spec.image_tokens(height // down, width // down)
    seq_image, seq_text = cost.sequence(p, image_tokens, text_tokens)
    rows_per_step = 2 if cfg != 1 else 1
    forward = cost.forward_flops(p, image_tokens, text_tokens, batch)
    forwards = steps * rows_per_step
    dit = forward.times(forwards)
    seconds = _seconds(dit.total, gpu, mfu)
    count = preset_parameters(family.model_class, p)
    fields = _header(
        name, family.name, count, batch, steps, cfg, gpu, mfu, weight_dtype, loaded_weight_bytes
    ) | {
        "architecture": cost.architecture,
        "schedule": defaults["schedule"],
        "height": height,
        "width": width,
        "image_tokens": image_tokens,
        "text_tokens": text_tokens,
        "sequence_tokens": seq_image + seq_text,
        "tokens_per_frame": image_tokens,
        "tokens_per_chunk": None,
        "cfg_rows": rows_per_step,
        "flops_per_forward": forward.total,
        "flops_per_forward_parts": forward.as_dict(),
        "forwards": forwards,
        "dit_flops": dit.total,
        "predicted_dit_seconds": seconds,
        "kv_bytes_per_token": None,
        "kv_bytes_per_chunk": None,
        "kv_bytes_window": None,
    }
    decode = cost.decoders(height, width, batch) if vae else {}
    fields |= _vae_fields(decode, gpu, mfu)
    full = next(iter(fields["predicted_vae_seconds"].values()), 0.0)  # the full AE comes first
    fields["predicted_total_seconds"] = seconds + full
    fields |= _memory(fields["weight_bytes"], 0, gpu)

    title = (
        f"Cost plan: {name or f'{spec.description} model'} ({cost.architecture}, {_params(count.total)} "
        f"parameters), {width}x{height} px, batch {batch}, {steps} steps, cfg {cfg:g}\n"
        f"on {gpu.label}: {gpu.dense_bf16_tflops} TFLOPS dense bf16 x MFU {mfu:g}"
    )
    padded = (
        f"; padded to {seq_image} + {seq_text} (multiples of {p.seq_multiple})"
        if cost.sequence is not _no_padding
        else ""
    )
    step_source = f"; the {defaults['schedule']} preset's step count" if steps == defaults["steps"] else ""
    rows = [
        ("tokens per forward", f"{image_tokens} image ({_token_geometry(family)}) + {text_tokens} text "
         f"({cost.text_note}){padded}"),
        ("FLOPs per forward", _parts(forward)),
        ("DiT forwards", f"{forwards} = {steps} steps x {rows_per_step} row{'s' if rows_per_step > 1 else ''}"
         + (" (CFG: positive + negative)" if rows_per_step > 1 else " (no CFG)") + step_source),
        ("DiT FLOPs", _flops(dit.total)),
        ("predicted DiT time", f"{_secs(seconds)} ({_secs(seconds / forwards)} per forward)"),
        *_vae_rows(fields),
        ("predicted total (DiT + full VAE)" if vae else "predicted total (DiT only)",
         _secs(fields["predicted_total_seconds"])),
        *_weight_rows(fields),
        ("GPU memory", _memory_row(fields, gpu)),
    ]  # fmt: skip
    return CostPlan(fields, rows, title)


# -- Wan (causal) --------------------------------------------------------------------------------------------------
def _plan_wan(p: WanParams, height, width, steps, cfg, text_tokens, frames, latent_frames, chunk_frames,
              window_frames, sink_frames, kv_dtype, keep_recent_chunks, sessions, live, *, name, batch, gpu: GpuSpec,
              mfu, weight_dtype, vae, loaded_weight_bytes) -> CostPlan:  # fmt: skip
    height, width = height or 480, width or 832
    steps = 4 if steps is None else steps
    chunk = 3 if chunk_frames is None else chunk_frames
    window = 21 if window_frames is None else window_frames
    sinks = 0 if sink_frames is None else sink_frames
    layout = kv_layout(kv_dtype or "bf16")
    keep_recent = 1 if keep_recent_chunks is None else keep_recent_chunks
    step = 8 * p.patch_size[1]
    _check_size(height, width, step, f"8x VAE downscaling and {p.patch_size[1]}x{p.patch_size[2]} patches")
    _positive(steps, "steps")
    if cfg != 1:
        raise InputError(
            "cfg",
            f"{cfg:g}: causal video sessions run without CFG (the students are guidance-distilled); use 1",
        )
    if text_tokens is not None and not 1 <= text_tokens <= p.text_len:
        raise InputError("text_tokens", f"{text_tokens}: Wan reads 1 to {p.text_len} prompt tokens")
    if sessions is not None:
        _positive(sessions, "sessions")
        if batch != 1:
            raise InputError("sessions", f"a pool's sessions are streams of batch 1 each; got batch {batch} with "
                             f"{sessions} sessions (use one of them)")  # fmt: skip
    if live is not None and batch != 1:
        raise InputError("live", f"live sessions are streams of batch 1 each; got batch {batch}")
    spec = WindowSpec(chunk, window, sinks)
    check_kv_storage(layout.name, keep_recent, spec, p.head_dim)
    latent = _latent_frames(frames, latent_frames, chunk)
    n_chunks = latent // chunk
    tpf = wan_tokens_per_frame(p, height, width)
    per_chunk_tokens = chunk * tpf

    chunk_forwards, chunk_rows = [], []
    total = wan_prompt_flops(p, batch)  # text embedding + cross K/V, once per prompt
    for k in range(n_chunks):
        keys = window  # the static cache reads every slot, visible or not (engine/causal/kv_cache.py)
        forward = wan_forward_flops(p, chunk, tpf, keys * tpf, batch)
        passes = steps + (1 if k < n_chunks - 1 else 0)  # the last chunk's clean pass is deferred, never run
        chunk_forwards.append(forward)
        total = total + forward.times(passes)
        if k == 0 or keys != chunk_rows[-1]["key_frames"]:
            chunk_rows.append({"chunk": k, "key_frames": keys, "flops_per_forward": forward.total})
    forwards = n_chunks * steps + n_chunks - 1
    last = chunk_forwards[-1]
    first = chunk_forwards[0]
    seconds = _seconds(total.total, gpu, mfu)
    steady = last.times(steps + 1)
    first_chunk = first.times(steps) + wan_prompt_flops(p, batch)

    kv = {  # a GPU stream computes, and keeps its unquantized K/V, in bf16
        n: kv_cache_bytes(
            p.num_layers, batch, tpf, p.num_heads, p.head_dim, spec, torch.bfloat16, n, keep_recent
        )
        for n, lay in KV_LAYOUTS.items()
        if lay.bits is None or keep_recent * chunk + chunk <= spec.ring_frames
    }
    chosen = kv[layout.name]
    cross_kv = batch * p.num_layers * 2 * p.text_len * p.dim * 2  # bf16 K and V of the padded prompt
    count = preset_parameters(Wan, p)
    video_frames = 4 * latent - 3
    fields = _header(name, "wan", count, batch, steps, cfg, gpu, mfu, weight_dtype, loaded_weight_bytes) | {
        "height": height,
        "width": width,
        "video_frames": video_frames,
        "latent_frames": latent,
        "chunks": n_chunks,
        "chunk_frames": chunk,
        "window_frames": window,
        "sink_frames": sinks,
        "text_tokens_padded": p.text_len,
        "tokens_per_frame": tpf,
        "tokens_per_chunk": per_chunk_tokens,
        "flops_per_forward": last.total,
        "flops_per_forward_parts": last.as_dict(),
        "flops_per_forward_first_chunk": first.total,
        "per_prompt_flops": wan_prompt_flops(p, batch).total,
        "chunk_key_frames": chunk_rows,
        "forwards_per_chunk": steps + 1,
        "forwards": forwards,
        "dit_flops": total.total,
        "dit_flops_parts": total.as_dict(),
        "predicted_dit_seconds": seconds,
        "predicted_first_chunk_seconds": _seconds(first_chunk.total, gpu, mfu),
        "predicted_chunk_seconds": _seconds(steady.total, gpu, mfu),
        "kv_dtype": layout.name,
        "keep_recent_chunks": keep_recent if layout.bits else None,
        "kv_bytes_per_token": chosen.per_token,
        "kv_bytes_per_chunk": chosen.per_chunk,
        "kv_bytes_window": chosen.window,
        "kv_bytes_by_dtype": {n: b.as_dict() for n, b in kv.items()},
        "cross_kv_bytes": cross_kv,
    }
    decode = {}
    if vae:
        decode = {"tiny (taew2_1)": taehv_decode_flops("taew2_1", latent, height // 8, width // 8, batch)}
    fields |= _vae_fields(decode, gpu, mfu)
    fields["vae_note"] = "full Wan 2.1 VAE not counted (not in this engine)"
    tiny_s = fields["predicted_vae_seconds"].get("tiny (taew2_1)") or 0.0
    fields["predicted_total_seconds"] = seconds + tiny_s
    fields["predicted_video_fps"] = video_frames / fields["predicted_total_seconds"]
    fields["realtime_factor"] = fields["predicted_video_fps"] / WAN_FPS
    fields |= _memory(fields["weight_bytes"], chosen.window + cross_kv, gpu)

    pool_rows = []
    if sessions is not None:
        fields |= _session_fields(p, sessions, tpf, chunk, window, steps, gpu, mfu, chosen.window + cross_kv,
                                  fields["weight_bytes"])  # fmt: skip
        pool_rows = _session_rows(fields, gpu)
    if live is not None:
        fields["live"] = plan_live(p, height, width, tuple(live), chunk, window, steps, gpu, mfu,
                                   tiny_vae="taew2_1" if vae else None, weight_bytes=fields["weight_bytes"],
                                   session_bytes=chosen.window + cross_kv)  # fmt: skip
        pool_rows = pool_rows + live_rows(fields["live"])
    title = (
        f"Cost plan: {name or 'Wan model'} (Wan 2.1 DiT, {_params(count.total)} parameters), causal, "
        f"{width}x{height} px, {video_frames} frames = {latent} latent frames = {n_chunks} chunks of {chunk}, "
        f"window {window} (sinks {sinks}), batch {batch}, {steps} steps + clean pass\n"
        f"on {gpu.label}: {gpu.dense_bf16_tflops} TFLOPS dense bf16 x MFU {mfu:g}"
    )
    growing = ", ".join(f"chunk {r['chunk']}: {r['key_frames']}" for r in chunk_rows)
    rows = [
        ("tokens", f"{tpf} per latent frame, {per_chunk_tokens} per chunk; prompt padded to {p.text_len}"),
        ("key frames read per chunk", f"{growing} (then constant)" if len(chunk_rows) > 1 else growing),
        ("FLOPs per forward (last chunk)", _parts(last)),
        ("FLOPs per forward (first chunk)", _flops(first.total)),
        ("per prompt (text embed + cross K/V)", _flops(fields["per_prompt_flops"])),
        ("DiT forwards", f"{forwards} = {n_chunks} chunks x ({steps} steps + 1 clean pass) - 1 (the last chunk's "
         "clean pass waits for the next chunk)"),
        ("DiT FLOPs", _flops(total.total)),
        ("predicted DiT time", f"{_secs(seconds)}; first chunk {_secs(fields['predicted_first_chunk_seconds'])}, "
         f"a full-window chunk {_secs(fields['predicted_chunk_seconds'])}"),
        *_vae_rows(fields),
        ("predicted total (DiT + tiny VAE)" if vae else "predicted total (DiT only)",
         f"{_secs(fields['predicted_total_seconds'])}: "
         f"{fields['predicted_video_fps']:.1f} frames/s, {fields['realtime_factor']:.2f}x realtime ({WAN_FPS} fps)"),
        (f"KV cache, {layout.name}", f"{chosen.per_token:,} B per token, {_bytes(chosen.per_chunk)} per chunk, "
         f"{_bytes(chosen.window)} per window of {window} frames ({layout.note}"
         + (f"; {chosen.full_frames} frames unquantized: sinks, current chunk, {keep_recent} recent)"
            if layout.bits else ")")),
        ("KV window by dtype", ", ".join(f"{n} {_bytes(b.window)}" for n, b in kv.items())
         + (f" (int8/int4 keep {keep_recent} recent chunk{'s' if keep_recent != 1 else ''} unquantized)"
            if len(kv) > 1 else "")),
        ("cross-attention K/V (bf16)", _bytes(cross_kv)),
        *_weight_rows(fields),
        ("GPU memory", _memory_row(fields, gpu)),
        *pool_rows,
    ]  # fmt: skip
    return CostPlan(fields, rows, title)


def _session_fields(p: WanParams, sessions: int, tpf: int, chunk: int, window: int, steps: int, gpu: GpuSpec,
                    mfu: float, per_session_bytes: int, weight_bytes: int) -> dict:  # fmt: skip
    tick = plan_session_tick(p, sessions, tpf, chunk, window, steps, gpu, mfu)
    counts = tuple(sorted({*SCAN_SESSIONS, sessions}))
    scan = session_scan(p, tpf, chunk, window, steps, gpu, mfu, counts)
    pool_bytes = weight_bytes + sessions * per_session_bytes
    return {
        "sessions": sessions,
        "session_tick": tick.as_dict(),
        "session_scan": scan,
        "pool_memory_bytes": pool_bytes,
        "pool_fits_gpu_memory": pool_bytes <= gpu.memory_gb * 1e9,
    }


def _session_rows(fields: dict, gpu: GpuSpec) -> list[tuple[str, str]]:
    tick, scan, n = fields["session_tick"], fields["session_scan"], fields["sessions"]
    by_n = ", ".join(f"{t['sessions']}: {t['gain']:.3f}x" for t in scan["ticks"])
    widths = ", ".join(f"{r} rows at width {w}" for w, r in scan["fill_rows_by_width"].items())
    verdict = "fits" if fields["pool_fits_gpu_memory"] else "does NOT fit"
    return [
        (f"pool tick, {n} session{'s' if n > 1 else ''}",
         f"{tick['forwards']} x (steps + clean pass) batched forwards of {' + '.join(map(str, tick['batches']))} "
         f"rows (buckets {'/'.join(map(str, scan['buckets']))}; padded rows computed and dropped), GEMM M up to "
         f"{tick['gemm_rows']} = {max(tick['batches'])} x {tick['tokens_per_chunk']} tokens; "
         f"{_flops(tick['flops'])} = {tick['computed_rows']} x {_flops(tick['flops_per_row'])}"),
        ("predicted tick",
         f"{_secs(tick['seconds'])}, {_secs(tick['seconds_per_session_chunk'])} per session-chunk against "
         f"{_secs(tick['solo_seconds_per_chunk'])} solo: {tick['gain']:.3f}x (linear GEMMs at "
         f"{tick['linear_efficiency']:.0%} of the SMs' waves)"),
        ("GEMM size that fills the GPU",
         f"{widths} ({scan['sms']} SMs x {scan['tile']}x{scan['tile']} tiles, one wave); compute-bound past "
         f"{scan['ridge_rows']} rows ({gpu.memory_tb_s:g} TB/s); a chunk is {scan['tokens_per_chunk']} rows"),
        ("batched / solo gain by sessions", f"{by_n}; batching stops paying (within 1 % of the best) at "
         f"{scan['pays_until']}"),
        ("pool memory", f"{_bytes(fields['pool_memory_bytes'])} (weights + {n} x (KV window + cross K/V)) {verdict} "
         f"in {gpu.memory_gb:g} GB"),
    ]  # fmt: skip


def _latent_frames(frames: int | None, latent_frames: int | None, chunk: int) -> int:
    if frames is not None and latent_frames is not None:
        raise InputError("frames", "give frames (video frames) or latent_frames, not both")
    if latent_frames is None:
        frames = 81 if frames is None else frames
        if frames < 1 or (frames - 1) % 4:
            raise InputError(
                "frames",
                f"{frames} video frames: the Wan VAE makes 4k + 1 frames (1 + 4 per latent frame after the "
                "first), e.g. 81 = 21 latent frames",
            )
        latent_frames = (frames - 1) // 4 + 1
        input_name = "frames"
    else:
        input_name = "latent_frames"
    if latent_frames < 1 or latent_frames % chunk:
        raise InputError(
            input_name,
            f"{latent_frames} latent frames do not split into chunks of {chunk} (chunk_frames); "
            f"the nearest are {max(chunk, latent_frames // chunk * chunk)} and {(latent_frames // chunk + 1) * chunk}",
        )
    return latent_frames


# -- shared pieces ------------------------------------------------------------------------------------------------
def _header(name, family, count: ParameterCount, batch, steps, cfg, gpu: GpuSpec, mfu, weight_dtype,
            loaded_weight_bytes) -> dict:  # fmt: skip
    return {
        "model": name,
        "family": family,
        "parameters": count.total,
        "batch": batch,
        "steps": steps,
        "cfg": cfg,
        "gpu": gpu.name,
        "gpu_label": gpu.label,
        "gpu_peak_tflops": gpu.dense_bf16_tflops,
        "gpu_memory_gb": gpu.memory_gb,
        "mfu": mfu,
        "weight_dtype": weight_dtype,
        "weight_bytes": count.bytes(weight_dtype),  # stored as weight_dtype
        "weight_bytes_by_dtype": count.bytes_by_dtype(),
        "loaded_weight_bytes": loaded_weight_bytes,
    }


def _vae_fields(decode: dict[str, int], gpu: GpuSpec, mfu: float) -> dict:
    return {
        "vae_decode_flops": decode,
        "predicted_vae_seconds": {k: _seconds(v, gpu, mfu) for k, v in decode.items()},
    }


def _vae_rows(fields: dict) -> list[tuple[str, str]]:
    return [
        (f"VAE decode, {k}", f"{_flops(v)}, {_secs(fields['predicted_vae_seconds'][k])}")
        for k, v in fields["vae_decode_flops"].items()
    ]


def _weight_rows(fields: dict) -> list[tuple[str, str]]:
    rows = [
        (
            "weights by storage dtype",
            ", ".join(f"{k} {_bytes(v)}" for k, v in fields["weight_bytes_by_dtype"].items())
            + " (fp8: linear weights only)",
        )
    ]
    if fields["loaded_weight_bytes"] is not None:
        rows.append(("weights as loaded", _bytes(fields["loaded_weight_bytes"])))
    return rows


def _memory(weights: int, cache: int, gpu: GpuSpec) -> dict:
    total = weights + cache
    return {"memory_bytes": total, "fits_gpu_memory": total <= gpu.memory_gb * 1e9}


def _memory_row(fields: dict, gpu: GpuSpec) -> str:
    what = f"{fields['weight_dtype']} weights" + (
        " + KV window + cross K/V" if fields["family"] == "wan" else ""
    )
    verdict = "fits" if fields["fits_gpu_memory"] else "does NOT fit"
    return f"{_bytes(fields['memory_bytes'])} ({what}; activations not counted) {verdict} in {gpu.memory_gb:g} GB"


def _seconds(flops: int, gpu: GpuSpec, mfu: float) -> float:
    return flops / (gpu.peak_flops * mfu)


def _check_size(height: int, width: int, multiple: int, why: str) -> None:
    check_image_size(height, width, multiple, why)


def _positive(v: int, input_name: str) -> None:
    if v is None or v < 1:
        raise InputError(input_name, f"expected a positive integer, got {v}")


def _flops(f: float) -> str:
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if f >= scale:
            return f"{f / scale:.3g} {unit}"
    return f"{f:.0f} FLOP"


def _parts(f: ForwardFlops) -> str:
    parts = [("linear", f.linear), ("attention", f.attention), ("per-sample", f.per_sample)]
    if f.per_prompt:
        parts.append(("per-prompt", f.per_prompt))
    return f"{_flops(f.total)} = " + " + ".join(f"{n} {_flops(v)}" for n, v in parts)


def _bytes(b: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= scale:
            return f"{b / scale:.3g} {unit}"
    return f"{b:.0f} B"


def _secs(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


__all__ = [
    "IMAGE_COSTS",
    "WAN_FPS",
    "CostPlan",
    "ImageCost",
    "family_of_params",
    "image_defaults",
    "known_models",
    "plan_cost",
    "plan_preset",
    "schedule_steps",
]
