"""A video session saved to one file and continued later, in this process or another, bit for bit.

A snapshot is one safetensors file: the tensors of a :class:`~.session_state.SessionState` (the KV window with
its scales and sink copies, the prompt's cross-attention rows, the clean latents awaiting commit, the clean
latents of the window a re-cache recomputes from, the random generator, the stream decoder's memory, and the
interactive inputs: the queued input frames of video to video and the queued controls, a prompt as its tensor) and, under the metadata key ``fewstep.session``, a JSON header: the
format name and version, the model (its :func:`~..weights.model_digest`, its ``WanParams``, its compute dtype),
the :class:`~.session.CausalConfig`, the size, the seed, the tiny VAE variant, the state's JSON part and every
tensor's shape and dtype.

Format versions: 2 adds the clean latents of the window (``clean.latents``, ``state.clean_frames``) and the host
parts (``inputs.<i>``, ``control.prompt``, ``state.host``: strength, seed, queued and unreported controls). A
version 1 file is still read: its missing parts are empty (no clean latents kept: a prompt switch with re-cache is
refused, naming why, until a window of frames has been generated; no queued input or control; text to video).

The prompt itself (the umT5 tokens) is not saved: the cross-attention rows are everything the model reads of it,
so a resumed session opens on a one-token placeholder prompt whose rows :func:`~.session_state.restore_state`
then overwrites (the solo :class:`~.session.VideoSession` does not keep the tokens it was given either).

A snapshot is untrusted input. It is read with safetensors only (no pickle); the header is read first and every
check is made before any tensor is loaded: the format and version, the model (parameters, compute dtype, weights
digest), the settings the caller asked for, and every tensor's name, shape and dtype against what the model and
the saved settings imply (computed, never taken from the file), with the file's size bounded by them. A refusal
is an :class:`InputError` naming the input (``snapshot``; ``--resume`` for the CLI) and what differs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from dataclasses import dataclass

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import InputError
from ..lora.merge import ensure_patches
from ..run import placement
from ..vae.taehv import MemBlock
from ..weights import model_digest
from .controls import KINDS
from .kv_cache import KVCache, kv_cache_bytes
from .recipe import open_session
from .session import CausalConfig, VideoSession, check_size
from .session_state import SessionState, capture_state, restore_state
from .video_to_video import MAX_QUEUED_CHUNKS

FORMAT = "fewstep-video-session"
VERSION = 2  # 2: clean latents of the window, queued inputs and controls (version 1 files are read still)
HEADER_KEY = "fewstep.session"
MAX_HEADER_BYTES = 16 * 2**20  # a session's header is a few KiB per layer; the bound is read before parsing
MAX_STEPS = 1000  # a schedule's steps (the timestep scale): what a sane saved config can hold


@dataclass(frozen=True)
class SnapshotSettings:
    """What a snapshot says a session was opened with (the header's settings, checked)."""

    config: CausalConfig
    height: int
    width: int
    seed: int
    tiny_vae: str | None  # the variant whose decoder memory it holds (None: none)
    header: dict  # the whole header, as read


# -- writing ---------------------------------------------------------------------------------------------------------
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _model_header(model) -> dict:
    return {
        "digest": model_digest(model),
        "params": json.loads(json.dumps(dataclasses.asdict(model.params))),  # tuples as JSON lists
        "dtype": _dtype_name(model.patch_embedding.weight.dtype),
    }


def save_snapshot(path, state: SessionState, model, config: CausalConfig, height: int, width: int, seed: int,
                  tiny_vae: str | None = None) -> int:  # fmt: skip
    """Write ``state`` (a session of ``model`` opened with ``config``, ``height x width``, ``seed`` and the tiny
    VAE variant named ``tiny_vae``) to ``path`` as one safetensors file; returns its size in bytes. Written
    under a temporary name and renamed, so an interrupted save leaves no partial file (and an old file at
    ``path`` stays whole until the new one replaces it)."""
    tensors = {name: t.detach().cpu().contiguous() for name, t in state.tensors.items()}
    header = {
        "format": FORMAT,
        "version": VERSION,
        "model": _model_header(model),
        "config": dataclasses.asdict(config),
        "height": height,
        "width": width,
        "seed": seed,
        "tiny_vae": tiny_vae,
        "state": state.meta,
        "tensors": {
            name: {"shape": list(t.shape), "dtype": _dtype_name(t.dtype)} for name, t in tensors.items()
        },
    }
    path = os.fspath(path)
    partial = path + ".partial"
    try:
        save_file(tensors, partial, metadata={HEADER_KEY: json.dumps(header)})
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return os.path.getsize(path)


def save_session(session: VideoSession, path) -> int:
    """Snapshot a solo :class:`~.session.VideoSession` (batch 1) between chunks to ``path``; its bytes."""
    session._check_alive()
    session._claim()  # no chunk is being generated while its state is read
    try:
        session._ensure_weights()  # the digest is of the weights the session runs (its LoRA merged)
        state = capture_state(session)
        vae = None if session.tiny_vae is None else session.tiny_vae.variant.name
        h, w = session.latent_hw
        return save_snapshot(path, state, session.base_model, session.config, 8 * h, 8 * w, session.seed, vae)
    finally:
        session._release()


def save_pool_session(pool, session, path) -> int:
    """Snapshot a :class:`~.session_pool.PoolSession` (active between ticks, or suspended) to ``path``; it
    resumes solo (:func:`resume_session`) or in any pool of its shape group (:func:`join_from_snapshot`)."""
    state = pool.state_of(session)
    vae = None if pool.tiny_vae is None else pool.tiny_vae.variant.name
    return save_snapshot(
        path, state, pool.base_model, pool.config, pool.height, pool.width, session.seed, vae
    )


# -- reading -----------------------------------------------------------------------------------------------------------
def expected_tensors(model, config: CausalConfig, height: int, width: int, tiny_vae=None,
                     decoder_started: bool = False, inputs: int = 0) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:  # fmt: skip
    """name -> (shape, dtype) of every tensor a snapshot of a session of ``model`` with these settings holds
    (``pending`` included; it is absent from a session that has not generated a chunk; ``inputs`` queued input
    frames; ``control.prompt``, whose token count varies, is checked by :func:`_check_host_tensors`). Computed from the model
    and the settings alone: the KV buffers from a cache built on the meta device (no memory)."""
    p = model.params
    dtype = model.patch_embedding.weight.dtype
    device = next(model.parameters()).device
    latent_hw = (height // 8, width // 8)
    tokens = (latent_hw[0] // p.patch_size[1]) * (latent_hw[1] // p.patch_size[2])
    meta = KVCache(p.num_layers, 1, tokens, p.num_heads, p.head_dim, config.storage, dtype, "cpu", config.rope,
                   storage_of=lambda _name, shape, kind: torch.empty(shape, dtype=kind, device="meta"))  # fmt: skip
    out = {f"kv.{name}": (tuple(t.shape[1:]), t.dtype) for name, t in meta.named_storage().items()}
    for i in range(p.num_layers):
        for part in "kv":
            out[f"cross.{part}{i}"] = ((p.text_len, p.num_heads, p.head_dim), dtype)
    out["pending"] = ((1, p.in_dim, config.chunk_frames, *latent_hw), torch.float32)
    out["clean.latents"] = ((1, p.in_dim, config.window_frames, *latent_hw), torch.float32)
    for i in range(inputs):  # the queued input frames (at most the queue's bound, checked with the header)
        out[f"inputs.{i}"] = ((1, p.in_dim, *latent_hw), torch.float32)
    out["generator"] = (tuple(torch.Generator(device=device).get_state().shape), torch.uint8)
    if tiny_vae is not None and decoder_started:
        out.update(_decoder_memory(tiny_vae, latent_hw))
    return out


def _decoder_memory(tiny_vae, latent_hw) -> dict:
    """The stream decoder's memory: each MemBlock's input at the last frame, [1, channels, h, w] at its scale."""
    out, scale = {}, 1
    for block in tiny_vae.video.decoder:
        if isinstance(block, MemBlock):
            channels = block.conv[0].in_channels // 2
            out[f"decoder.{len(out)}"] = (
                (1, channels, latent_hw[0] * scale, latent_hw[1] * scale),
                tiny_vae.dtype,
            )
        elif isinstance(block, torch.nn.Upsample):
            scale *= int(block.scale_factor)
    return out


def _refuse(input_name: str, where: str | None, name: str, problem: str) -> InputError:
    return InputError(input_name, f"{name}: {problem}", where)


def _read_header(path: str, input_name: str, where: str | None) -> tuple[dict, list[str], dict, int]:
    """(header, tensor names, {name: (shape, dtype name)} as the file's own table says, file size)."""
    name = os.path.basename(path)
    if not os.path.isfile(path):
        raise InputError(input_name, f"{path}: no such file", where)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
    length = struct.unpack("<Q", head)[0] if len(head) == 8 else None
    if length is None or length > min(size - 8, MAX_HEADER_BYTES):
        raise _refuse(input_name, where, name, "not a session snapshot: not a safetensors file (its first 8 bytes "
                      "do not give the length of a header inside the file)")  # fmt: skip
    try:
        with safe_open(path, framework="pt") as f:
            metadata = f.metadata() or {}
            names = list(f.keys())
            table = {n: (tuple(f.get_slice(n).get_shape()), f.get_slice(n).get_dtype()) for n in names}
    except Exception as err:  # noqa: BLE001 - safetensors' parse errors: one line, the file refused
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise _refuse(
            input_name, where, name, f"not a session snapshot: not a valid safetensors file ({first})"
        ) from None
    raw = metadata.get(HEADER_KEY)
    if raw is None:
        raise _refuse(input_name, where, name, f"a safetensors file without a fewstep session header (no "
                      f"'{HEADER_KEY}' metadata): not a snapshot written by save_session / --save-session")  # fmt: skip
    try:
        header = json.loads(raw)
    except ValueError:
        header = None
    if not isinstance(header, dict):
        raise _refuse(input_name, where, name, "its session header is not a JSON object")
    return header, names, table, size


def _check_format(header: dict, name: str, input_name: str, where) -> None:
    fmt, version = header.get("format"), header.get("version")
    if fmt != FORMAT:
        raise _refuse(input_name, where, name, f"a {fmt!r} file, not a {FORMAT!r} snapshot")
    if not isinstance(version, int) or version < 1:
        raise _refuse(input_name, where, name, f"snapshot format version {version!r} is not a version")
    if version > VERSION:
        raise _refuse(input_name, where, name, f"snapshot format version {version} is newer than this fewstep "
                      f"reads (up to {VERSION}); update fewstep to resume it")  # fmt: skip


def _check_model(header: dict, model, name: str, input_name: str, where) -> None:
    saved, ours = header.get("model"), _model_header(model)
    saved = saved if isinstance(saved, dict) else {}
    saved_params = saved.get("params") if isinstance(saved.get("params"), dict) else {}
    differ = [f"{k} {saved_params.get(k)!r} there, {v!r} here" for k, v in ours["params"].items()
              if saved_params.get(k) != v]  # fmt: skip
    if differ:
        raise _refuse(input_name, where, name, "saved from another model (" + "; ".join(differ) + ")")
    if saved.get("dtype") != ours["dtype"]:
        raise _refuse(input_name, where, name, f"saved from a model computing in {saved.get('dtype')}; this one "
                      f"computes in {ours['dtype']} (open the model with the snapshot's dtype)")  # fmt: skip
    if saved.get("digest") != ours["digest"]:
        raise _refuse(input_name, where, name, f"saved from another model's weights (weights digest "
                      f"{str(saved.get('digest'))[:16]} there, {ours['digest'][:16]} here): the same architecture "
                      "with other weights or another LoRA")  # fmt: skip


def _settings(header: dict, name: str, input_name: str, where) -> SnapshotSettings:
    fields = {f.name for f in dataclasses.fields(CausalConfig)}
    saved = header.get("config")
    if not isinstance(saved, dict) or set(saved) != fields:
        raise _refuse(
            input_name, where, name, f"its header's config is not a CausalConfig ({sorted(fields)})"
        )
    try:
        config = CausalConfig(**saved)
    except (TypeError, ValueError) as err:  # InputError is a ValueError
        raise _refuse(input_name, where, name, f"its saved config is invalid: {err}") from None
    if config.steps is not None and (not isinstance(config.steps, int) or not 1 <= config.steps <= MAX_STEPS):
        raise _refuse(
            input_name, where, name, f"its saved steps {config.steps!r} is not a count in [1, {MAX_STEPS}]"
        )
    values = {k: header.get(k) for k in ("height", "width", "seed")}
    if any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in values.values()):
        raise _refuse(input_name, where, name, f"its height / width / seed are not integers: {values}")
    vae = header.get("tiny_vae")
    if vae is not None and not isinstance(vae, str):
        raise _refuse(input_name, where, name, "its tiny_vae is not a variant name")
    return SnapshotSettings(config, values["height"], values["width"], values["seed"], vae, header)


def _check_asked(
    settings: SnapshotSettings, config, height, width, name: str, input_name: str, where
) -> None:
    differ = []
    if config is not None:
        saved, asked = dataclasses.asdict(settings.config), dataclasses.asdict(config)
        differ += [f"{k} {saved[k]!r} (asked: {asked[k]!r})" for k in saved if saved[k] != asked[k]]
    for key, asked in (("height", height), ("width", width)):
        if asked is not None and asked != getattr(settings, key):
            differ.append(f"{key} {getattr(settings, key)} (asked: {asked})")
    if differ:
        raise _refuse(input_name, where, name, "saved with other settings than asked: " + "; ".join(differ))


def _check_state_meta(meta, settings: SnapshotSettings, name: str, input_name: str, where) -> None:
    def bad(why: str) -> InputError:
        return _refuse(input_name, where, name, f"its saved session state is invalid ({why})")

    if not isinstance(meta, dict) or not isinstance(meta.get("kv"), dict):
        raise bad("no KV state")
    kv = meta["kv"]
    for key in ("frames_committed", "frames_quantized", "sinks_copied", "sinks_offset"):
        if not isinstance(kv.get(key), int) or kv[key] < 0:
            raise bad(f"kv.{key} {kv.get(key)!r}")
    horizon = kv["frames_committed"] + settings.config.chunk_frames  # no slot holds a frame past the chunk
    for key in ("full", "quantized"):
        slots = kv.get(key)
        if not isinstance(slots, list) or any(
            s is not None and (not isinstance(s, int) or not 0 <= s < horizon) for s in slots
        ):
            raise bad(f"kv.{key} is not a list of frame indices")
    if kv["frames_quantized"] > kv["frames_committed"]:
        raise bad("more frames quantized than committed")
    if meta.get("chunk_frames") != settings.config.chunk_frames:
        raise bad(f"chunk_frames {meta.get('chunk_frames')!r}, the config's {settings.config.chunk_frames}")
    for key in ("chunks_generated", "frames_decoded"):
        if not isinstance(meta.get(key), int) or meta[key] < 0:
            raise bad(f"{key} {meta.get(key)!r}")
    decoder = meta.get("decoder")
    if decoder is not None and not (isinstance(decoder, dict) and isinstance(decoder.get("started"), bool)):
        raise bad("decoder state")
    if not isinstance(meta.get("generator_device"), str):
        raise bad("generator device")
    clean = meta.get("clean_frames")
    if clean is not None and (  # its length (one per window frame) is checked once the window is bounded
        not isinstance(clean, list)
        or any(f is not None and (not isinstance(f, int) or not 0 <= f < horizon) for f in clean)
    ):
        raise bad("clean_frames is not a list of frame indices")
    host = meta.get("host")
    if host is not None:
        _check_host_meta(host, settings, bad)


def _is_int(value, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _is_strength(value) -> bool:
    return value is None or (
        isinstance(value, float | int) and not isinstance(value, bool) and 0 < value <= 1
    )


def _check_host_meta(host, settings: SnapshotSettings, bad) -> None:
    """A snapshot's host parts (``session_state._host_meta``): their types and bounds."""
    if not isinstance(host, dict):
        raise bad("host parts")
    if not _is_strength(host.get("strength")):
        raise bad(f"strength {host.get('strength')!r}")
    if not _is_int(host.get("seed")) or host["seed"] >= 2**64:
        raise bad(f"seed {host.get('seed')!r}")
    if not _is_int(host.get("inputs")) or host["inputs"] > MAX_QUEUED_CHUNKS * settings.config.chunk_frames:
        raise bad(f"inputs {host.get('inputs')!r}")
    if not _is_int(host.get("control_sequence"), 1):
        raise bad(f"control_sequence {host.get('control_sequence')!r}")
    controls = host.get("controls")
    if not isinstance(controls, list) or len(controls) > len(KINDS):
        raise bad("controls")
    kinds = [c.get("kind") if isinstance(c, dict) else None for c in controls]
    if len(set(kinds)) != len(kinds) or any(k not in KINDS for k in kinds):
        raise bad("controls: a kind that is not a control, or one kind twice")
    for c in controls:
        ok = (
            _is_int(c.get("sequence"), 1)
            and _is_int(c.get("replaced"))
            and isinstance(c.get("recache"), bool)
        )
        value = c.get("value")
        if c["kind"] == "strength":
            ok = ok and _is_strength(value)
        elif c["kind"] == "seed":
            ok = ok and _is_int(value) and value < 2**64
        else:
            ok = ok and "value" not in c  # a prompt's value is the tensor control.prompt
        if not ok:
            raise bad(f"control {c!r}")
    unreported = host.get("unreported")
    fields = {"kind", "sequence", "chunk", "recache", "replaced", "detail"}
    if not isinstance(unreported, list) or len(unreported) > len(KINDS) * 2 or any(
        not isinstance(a, dict) or set(a) != fields or a["kind"] not in KINDS or not isinstance(a["detail"], str)
        or not all(_is_int(a[k]) for k in ("sequence", "chunk", "replaced")) or not isinstance(a["recache"], bool)
        for a in unreported
    ):  # fmt: skip
        raise bad("unreported controls")
    report = host.get("recache")
    if report is not None and not (
        isinstance(report, dict) and set(report) == {"frames", "start_frame", "seconds"}
        and _is_int(report["frames"]) and _is_int(report["start_frame"])
        and isinstance(report["seconds"], float | int)
    ):  # fmt: skip
        raise bad("recache report")


def read_snapshot_settings(path, where: str | None = None, input_name: str = "snapshot") -> SnapshotSettings:
    """The settings a snapshot was saved with, from its header alone (its format and version checked; the model
    and the tensors are checked by :func:`load_snapshot`). A command reads them before loading the model."""
    path = os.fspath(path)
    header = _read_header(path, input_name, where)[0]
    _check_format(header, os.path.basename(path), input_name, where)
    return _settings(header, os.path.basename(path), input_name, where)


def load_snapshot(path, model, where: str | None = None, *, config: CausalConfig | None = None,
                  height: int | None = None, width: int | None = None, tiny_vae=None,
                  input_name: str = "snapshot") -> tuple[SessionState, SnapshotSettings]:  # fmt: skip
    """Read a snapshot of a session of ``model`` (an untrusted file: see the module docstring). ``config``,
    ``height``, ``width``: what the caller needs (a pool's shape group), refused when the snapshot differs;
    None takes the snapshot's. ``tiny_vae``: the tiny VAE the resumed session decodes with (its variant must be
    the saved one; None: the saved decoder memory is not loaded). Every check runs before a tensor is loaded."""
    path = os.fspath(path)
    name = os.path.basename(path)
    header, names, table, size = _read_header(path, input_name, where)
    _check_format(header, name, input_name, where)
    _check_model(header, model, name, input_name, where)
    settings = _settings(header, name, input_name, where)
    _check_asked(settings, config, height, width, name, input_name, where)
    try:
        check_size(model.params, settings.height, settings.width)
    except InputError as err:
        raise _refuse(input_name, where, name, f"its saved size is invalid: {err.problem}") from None
    meta = header.get("state")
    _check_state_meta(meta, settings, name, input_name, where)
    device = next(model.parameters()).device
    if meta["generator_device"] != device.type:
        raise _refuse(input_name, where, name, f"its random generator is a {meta['generator_device']} generator; "
                      f"this model draws its noise on {device.type} (resume it on the device it was saved from)")  # fmt: skip
    decoder_meta = meta.get("decoder")
    started = decoder_meta is not None and decoder_meta["started"]
    if tiny_vae is not None:
        variant = tiny_vae.variant.name
        if decoder_meta is None or settings.tiny_vae is None:
            raise _refuse(input_name, where, name, f"saved without a tiny VAE: it holds no stream decoder state to "
                          f"continue {variant}'s frames (resume it without a tiny VAE)")  # fmt: skip
        if settings.tiny_vae != variant:
            raise _refuse(input_name, where, name, f"its frames were decoded by {settings.tiny_vae}, not "
                          f"{variant} (resume it with {settings.tiny_vae})")  # fmt: skip

    # the KV window's bytes by the one formula (arithmetic, nothing allocated) bound the settings by the file
    # before the expected shapes are built: a saved window or size far past what the file holds is refused here
    kv_bytes = _kv_window_bytes(model, settings)
    if kv_bytes > size:
        raise _refuse(input_name, where, name, f"its settings make a KV window of {kv_bytes} bytes; the file holds "
                      f"{size} (a window or size that was not saved here)")  # fmt: skip

    # every tensor: the file's own table, the header's list and what the model and the settings imply, all equal
    queued = (meta.get("host") or {}).get("inputs", 0)
    expected = expected_tensors(
        model, settings.config, settings.height, settings.width, tiny_vae, started, queued
    )
    listed = header.get("tensors")
    if not isinstance(listed, dict):
        raise _refuse(input_name, where, name, "its header lists no tensors")
    for tensor, entry in listed.items():
        shape = tuple(entry.get("shape", ())) if isinstance(entry, dict) else None
        if table.get(tensor) != (shape, _st_dtype(entry)):
            raise _refuse(input_name, where, name, f"tensor {tensor!r} is {_shown(*table[tensor]) if tensor in table else 'absent'} "
                          f"in the file but {_shown(shape, _st_dtype(entry))} in its header")  # fmt: skip
    for tensor in names:
        if tensor not in listed:
            raise _refuse(input_name, where, name, f"tensor {tensor!r} is not in its header")
    decoder_names = {n for n in names if n.startswith("decoder.")}
    wanted = {n for n in names if n not in decoder_names or tiny_vae is not None}
    _check_host_tensors(meta, names, table, model, name, input_name, where)
    optional = {"pending", "clean.latents"}  # clean latents: absent from a version 1 file (none kept)
    if "control.prompt" in table:
        expected["control.prompt"] = (table["control.prompt"][0], torch.float32)  # checked just above
    for tensor, (shape, dtype) in expected.items():
        if tensor not in table:
            if tensor in optional:
                continue
            raise _refuse(
                input_name, where, name, f"tensor {tensor!r} ({_shown(shape, _st_name(dtype))}) is missing"
            )
        if table[tensor] != (shape, _st_name(dtype)):
            raise _refuse(input_name, where, name, f"tensor {tensor!r} is {_shown(*table[tensor])}; this model and "
                          f"the snapshot's settings make it {_shown(shape, _st_name(dtype))}")  # fmt: skip
    for tensor in wanted - set(expected):
        raise _refuse(input_name, where, name, f"tensor {tensor!r} is not part of a session of this model")
    if (header.get("version") == 1) != ("clean_frames" not in meta):
        raise _refuse(input_name, where, name, "its clean latents do not match its format version")
    if ("clean.latents" in table) != ("clean_frames" in meta):
        raise _refuse(input_name, where, name, "its clean latents and their frame list do not come together")
    if "clean_frames" in meta and len(meta["clean_frames"]) != settings.config.window_frames:
        raise _refuse(input_name, where, name, f"its saved session state is invalid (clean_frames lists "
                      f"{len(meta['clean_frames'])} frames, not one per window frame)")  # fmt: skip
    # the size bound: nothing in the file but the header and the tensors it lists (each checked above)
    data = sum(_nbytes(*table[n]) for n in names)
    if size > 8 + MAX_HEADER_BYTES + data:
        raise _refuse(input_name, where, name, f"{size} bytes, more than its header and tensors account for")

    with safe_open(path, framework="pt") as f:
        tensors = {n: f.get_tensor(n) for n in sorted(wanted)}
    if tiny_vae is None:
        meta = {**meta, "decoder": None}  # the decoder memory was not loaded: a session without a tiny VAE
    return SessionState(tensors, meta), settings


def _check_host_tensors(meta: dict, names, table: dict, model, name: str, input_name: str, where) -> None:
    """The host parts' tensors against the header's JSON: ``inputs.0 .. inputs.<n-1>`` exactly for ``n`` queued
    frames, and ``control.prompt`` (a conditioning ``[1, 1..text_len, text_dim]``, float32) exactly when a prompt
    control is queued."""
    host = meta.get("host") or {}
    queued = host.get("inputs", 0)
    inputs = sorted(n for n in names if n.startswith("inputs."))
    if inputs != sorted(f"inputs.{i}" for i in range(queued)):
        raise _refuse(
            input_name, where, name, f"its input frames {inputs} are not the {queued} it says are queued"
        )
    prompts = any(c["kind"] == "prompt" for c in host.get("controls", ()))
    if prompts != ("control.prompt" in table):
        raise _refuse(input_name, where, name, "its queued prompt control and its control.prompt tensor do not "
                      "come together")  # fmt: skip
    if prompts:
        p = model.params
        shape, dtype = table["control.prompt"]
        if len(shape) != 3 or shape[0] != 1 or not 1 <= shape[1] <= p.text_len or shape[2] != p.text_dim or (
            dtype != "F32"
        ):  # fmt: skip
            raise _refuse(input_name, where, name, f"tensor 'control.prompt' is {_shown(shape, dtype)}; a queued "
                          f"prompt is [1, 1..{p.text_len}, {p.text_dim}] F32")  # fmt: skip


def _kv_window_bytes(model, settings: SnapshotSettings) -> int:
    p, config = model.params, settings.config
    tokens = (settings.height // 8 // p.patch_size[1]) * (settings.width // 8 // p.patch_size[2])
    dtype = model.patch_embedding.weight.dtype
    return kv_cache_bytes(p.num_layers, 1, tokens, p.num_heads, p.head_dim, config.window, dtype, config.kv_dtype,
                          config.keep_recent_chunks, config.rope).window  # fmt: skip


_ST_DTYPES = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64", torch.uint8: "U8",
    torch.int8: "I8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64", torch.bool: "BOOL",
}  # fmt: skip
_ST_SIZES = {
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F64": 8,
    "U8": 1,
    "I8": 1,
    "I16": 2,
    "I32": 4,
    "I64": 8,
    "BOOL": 1,
}


def _st_name(dtype: torch.dtype) -> str:
    return _ST_DTYPES.get(dtype, str(dtype))


def _st_dtype(entry) -> str | None:
    """The header's dtype name (torch's) as safetensors names it."""
    if not isinstance(entry, dict):
        return None
    dtype = getattr(torch, str(entry.get("dtype")), None)
    return _ST_DTYPES.get(dtype) if isinstance(dtype, torch.dtype) else None


def _shown(shape, dtype) -> str:
    return f"{list(shape) if shape is not None else '?'} {dtype}"


def _nbytes(shape, dtype: str) -> int:
    n = _ST_SIZES.get(dtype, 8)
    for d in shape:
        n *= d
    return n


# -- opening a session from a snapshot ---------------------------------------------------------------------------------
def _placeholder_prompt(model) -> torch.Tensor:
    """A one-token prompt a resumed session opens with; its cross-attention rows are overwritten by the saved."""
    return torch.zeros(1, 1, model.params.text_dim)


def resume_session(handle, path, tiny_vae=None, where: str | None = None, options=None, *,
                   config: CausalConfig | None = None, height: int | None = None, width: int | None = None,
                   input_name: str = "snapshot"):  # fmt: skip
    """(session, compile run or None): a solo :class:`~.session.VideoSession` continuing the snapshot at
    ``path`` exactly (its next chunk is the one the saved stream would have generated next). ``handle``: a
    ``ModelHandle`` (opened as :func:`.recipe.open_session` opens a session: its LoRA merged, its compile
    feature, ``options``) or a bare Wan model. ``config`` / ``height`` / ``width``: refused when the snapshot's
    differ (None: the snapshot's)."""
    if not isinstance(handle, torch.nn.Module):
        if placement(options) is not None:
            raise InputError(input_name, "a snapshot resumes in this process; it cannot be placed on a worker "
                             "pool", where)  # fmt: skip
        ensure_patches(handle.model, handle.loras)  # the digest is of the weights the session will run
        model = handle.model
    else:
        model = handle
    state, settings = load_snapshot(path, model, where, config=config, height=height, width=width,
                                    tiny_vae=tiny_vae, input_name=input_name)  # fmt: skip
    args = (
        _placeholder_prompt(model),
        settings.height,
        settings.width,
        settings.config,
        settings.seed,
        tiny_vae,
    )
    if isinstance(handle, torch.nn.Module):
        session, compiled = VideoSession(handle, *args, where=where), None
    else:
        session, compiled = open_session(handle, *args, where, options)
    restore_state(state, session)
    return session, compiled


def join_from_snapshot(
    pool, path, chunks: int | None = None, wait: bool = False, input_name: str = "snapshot"
):
    """A :class:`~.session_pool.PoolSession` of ``pool`` continuing the snapshot at ``path`` (of a pool or solo
    session of the pool's model and shape group: anything else is refused). It takes a free slot; when none is
    free it is refused, or with ``wait`` queued as a resume."""
    pool.check_open()
    pool.ensure_weights()  # the digest is of the weights the pool runs (its LoRA merged)
    state, settings = load_snapshot(path, pool.base_model, pool.where, config=pool.config, height=pool.height,
                                    width=pool.width, tiny_vae=pool.tiny_vae, input_name=input_name)  # fmt: skip
    return pool.join_saved(state, settings.seed, chunks, wait)
