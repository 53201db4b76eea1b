"""FewStep Live Video: a causal video session pool served to clients while they steer it (issue 33).

Queued once, the node opens a :class:`~..engine.causal.SessionPool` on its model (the memory preflight refuses a
pool that cannot fit before anything is allocated), hosts a :class:`~..engine.live.LiveService` on it and serves
until it is stopped: ComfyUI's Cancel (``POST /interrupt``, checked before every forward and between the blocks of
each), ``POST /fewstep/live/stop``, or a limit (``max_seconds``, ``max_chunks``, ``idle_seconds`` with no session
open). Clients open sessions, steer them and read their chunks through the routes of ``nodes/live_routes.py``;
their events go to their own websocket only. The node then returns its report (per session metrics), frees the
pool and unregisters.

While it runs ComfyUI's prompt worker is busy with it (ComfyUI runs one prompt at a time): prompts queued meanwhile
wait in the queue and run once the live node returns. For the same reason at most one live node runs at a time;
``LIVE_HOSTS`` is the registry the routes read.

Prompts arrive as text. With ``clip`` connected (core CLIPLoader, umT5-XXL, type wan) they are encoded on the
server, on the generation thread, through the service's prompt cache (a repeated prompt is not encoded twice).
Without it only dummy weights are accepted and a prompt is
``engine.prompt_embeddings.synthetic_text_embedding(text, text_tokens=model.params.text_len)``, the embedding
``python -m fewstep stream --script`` uses, so a live run and an engine run of the same script agree.
"""

from __future__ import annotations

import logging

import torch

from ..engine.causal import CausalConfig, open_session_pool
from ..engine.causal.session import check_context
from ..engine.errors import InputError
from ..engine.live import LiveLimits, LiveService
from ..engine.loader import DUMMY_PREFIX
from ..engine.prompt_embeddings import synthetic_text_embedding
from ..engine.run import RunOptions
from .base import CATEGORY, model_input, reports_input_errors, single_prompt
from .host import check_interrupt, executing_node, interrupt_check, prompt_server
from .inputs import register_object_type
from .live_routes import LiveHosts, WebsocketTransport, register_routes
from .model_management import load_for_run
from .vae import FEWSTEP_TINY_VAE
from .video import FewStepCausalVideoSampler, _check_wan

log = logging.getLogger(__name__)

NODE = "FewStepLiveVideo"
LIVE_HOSTS = LiveHosts()  # the live services running now (at most one inside ComfyUI); the routes read it


def _is_clip(value) -> bool:
    # duck-typed: nodes/ never imports ComfyUI; a core CLIP tokenizes text and encodes the tokens
    return callable(getattr(value, "tokenize", None)) and callable(
        getattr(value, "encode_from_tokens_scheduled", None)
    )


register_object_type("CLIP", _is_clip, "a CLIP text encoder (CLIPLoader with umt5_xxl, type wan)")

# the shape group, declared once by the causal sampler: the same names, ranges and defaults
_SHAPE_REQUIRED = ("width", "height", "chunk_frames", "window_frames", "sink_frames", "schedule", "steps")
_SHAPE_OPTIONAL = ("context_noise", "rope", "kv_dtype", "keep_recent_chunks")
MAX_SLOTS = 64


def _sampler_inputs(section: str, names: tuple[str, ...]) -> dict:
    declared = FewStepCausalVideoSampler.INPUT_TYPES()[section]
    return {name: declared[name] for name in names}


class OfflineTransport:
    """The transport outside a ComfyUI server (scripts, tests): no client is ever connected, nothing is sent."""

    def connected(self, client_id: str) -> bool:
        return False

    def attach(self, session_id: str, client_id: str, outbox) -> None:
        pass

    def detach(self, session_id: str) -> None:
        pass

    def close(self) -> None:
        pass


def make_transport():
    """Where the sessions' events go: the websockets of ComfyUI's server, or nowhere outside one."""
    server = prompt_server()
    return OfflineTransport() if server is None else WebsocketTransport(server)


def prompt_encoder(model, clip, where: str = NODE):
    """``text -> context [1, tokens, 4096]`` (float32, CPU): the connected CLIP, or the synthetic embedding that
    only dummy weights accept."""
    if clip is None:
        if not model.source.startswith(DUMMY_PREFIX):
            raise InputError(
                "clip",
                f"the model is {model.source}, not dummy weights: connect a text encoder (CLIPLoader with "
                "umt5_xxl_fp8_e4m3fn_scaled.safetensors, type wan) so that clients' prompts are encoded; without "
                "one, prompts become synthetic embeddings, which only dummy: models take",
                where,
            )
        text_tokens = model.params.text_len

        def synthetic(text: str) -> torch.Tensor:
            return synthetic_text_embedding(text, text_tokens=text_tokens)

        return synthetic

    def encode(text: str) -> torch.Tensor:
        try:
            conditioning = clip.encode_from_tokens_scheduled(clip.tokenize(text))
            refusal = "the text encoder gave several entries for one prompt; a live session takes one"
            context = single_prompt(conditioning, "prompt", refusal).context.float().cpu()
        except Exception as exc:  # noqa: BLE001 - one client's prompt must not end the run of every client
            if isinstance(exc, InputError):
                raise
            detail = " ".join(str(exc).split())[:300]
            raise InputError(
                "prompt", f"the text encoder failed on it ({type(exc).__name__}: {detail})"
            ) from exc
        finally:
            # ComfyUI loads the text encoder for this, and may have offloaded the video model to make room for
            # it: the model goes back on its device before the next forward (a no-op when it stayed loaded)
            load_for_run(model)
        return context

    return encode


def _check_text_encoder(model, encode) -> None:
    """A CLIP of another model (CLIP-L, T5 of FLUX...) is refused before serving, not at the first client's open:
    one probe prompt encoded and checked as the pool checks a session's prompt."""
    try:
        check_context(model.params, encode("a probe prompt"), 1)
    except InputError as err:
        raise InputError(
            "clip", f"not the Wan text encoder (umT5-XXL, CLIPLoader type wan): {err.problem}"
        ) from None


def _none_if_zero(value):
    return None if value == 0 else value


class FewStepLiveVideo:
    DESCRIPTION = (
        "Live video (Wan 2.1 causal students): queued once, serves a pool of video sessions to clients until "
        "stopped (Cancel, POST /fewstep/live/stop, or a limit). Clients open sessions and steer them while they "
        "run through the routes under /fewstep/live (prompt switch with or without re-cache, seed, strength, "
        "input frames for video to video, stop) and get each chunk as it finishes on their own websocket. While "
        "it runs ComfyUI's queue is busy: prompts queued meanwhile wait until this node returns. Outputs the "
        "run's report (per session: time to first chunk, inter-chunk p50 / p99, real-time factor, deadlines, "
        "viewer stalls, batch sizes)."
    )
    CATEGORY = f"{CATEGORY}/video"
    FUNCTION = "serve"
    OUTPUT_NODE = True  # runs when queued on its own; its report is shown on the node
    RETURN_TYPES = ("STRING",)
    RETURN_NAMES = ("report",)

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": model_input("a Wan 2.1 causal student"),
                **_sampler_inputs("required", _SHAPE_REQUIRED),
                "max_sessions": (
                    "INT",
                    {
                        "default": 4,
                        "min": 1,
                        "max": MAX_SLOTS,
                        "tooltip": "Sessions served at once (the pool's slots; fewer when the memory budget holds "
                        "fewer). Their chunks are batched into one forward per denoising step.",
                    },
                ),
                "max_sessions_per_client": (
                    "INT",
                    {
                        "default": 2,
                        "min": 1,
                        "max": MAX_SLOTS,
                        "tooltip": "Sessions one client (websocket clientId) may hold open; more are refused (429).",
                    },
                ),
                "max_seconds": (
                    "FLOAT",
                    {
                        "default": 3600.0,
                        "min": 0.0,
                        "max": 604800.0,
                        "step": 1.0,
                        "tooltip": "The node stops after this many seconds of serving (0: no limit; Cancel or "
                        "POST /fewstep/live/stop stop it any time). ComfyUI's queue waits for it meanwhile.",
                    },
                ),
                "max_chunks": (
                    "INT",
                    {
                        "default": 0,
                        "min": 0,
                        "max": 1000000000,
                        "tooltip": "The node stops once its sessions made this many chunks together (0: no limit).",
                    },
                ),
                "idle_seconds": (
                    "FLOAT",
                    {
                        "default": 300.0,
                        "min": 0.0,
                        "max": 604800.0,
                        "step": 1.0,
                        "tooltip": "The node stops when no session has been open for this long (0: never for "
                        "idleness).",
                    },
                ),
                "disconnect_seconds": (
                    "FLOAT",
                    {
                        "default": 30.0,
                        "min": 1.0,
                        "max": 86400.0,
                        "step": 1.0,
                        "tooltip": "A client whose websocket is gone has its sessions suspended (to host memory); "
                        "they resume when it reconnects with the same clientId, and are closed after this many "
                        "seconds.",
                    },
                ),
            },
            "optional": {
                "tiny_vae": (
                    FEWSTEP_TINY_VAE,
                    {
                        "tooltip": "taew2_1: each chunk decoded as it finishes (its clip as animated WebP, JPEG "
                        "frames when a client asks); needed for start images and input frames (video to "
                        "video). Without it chunk events carry latents only."
                    },
                ),
                "clip": (
                    "CLIP",
                    {
                        "tooltip": "umT5-XXL (CLIPLoader, type wan): clients' prompts are encoded with it on the "
                        "server (a repeated prompt is encoded once). Without it only dummy weights run, with "
                        "synthetic prompt embeddings."
                    },
                ),
                **_sampler_inputs("optional", _SHAPE_OPTIONAL),
            },
        }

    @classmethod
    def IS_CHANGED(cls, **_inputs):
        # a live run is never a cached result: NaN equals nothing, so ComfyUI runs the node every time it is queued
        return float("nan")

    @reports_input_errors(NODE)
    def serve(self, model, width, height, chunk_frames, window_frames, sink_frames, schedule, steps,
              max_sessions, max_sessions_per_client, max_seconds, max_chunks, idle_seconds, disconnect_seconds,
              tiny_vae=None, clip=None, context_noise=0.0, rope="cache", kv_dtype="bf16",
              keep_recent_chunks=1):  # fmt: skip
        _check_wan(model, NODE)
        config = CausalConfig(chunk_frames=chunk_frames, window_frames=window_frames, sink_frames=sink_frames,
                              schedule=schedule, steps=steps, context_noise=context_noise, rope=rope,
                              kv_dtype=kv_dtype, keep_recent_chunks=keep_recent_chunks)  # fmt: skip
        encode = prompt_encoder(model, clip)
        if clip is not None:
            _check_text_encoder(model, encode)
        limits = LiveLimits(
            max_sessions_per_client=max_sessions_per_client,
            max_seconds=_none_if_zero(max_seconds),
            max_chunks=_none_if_zero(max_chunks),
            idle_seconds=_none_if_zero(idle_seconds),
            disconnect_seconds=float(disconnect_seconds),
        )
        prompt_id, node = executing_node() or ("", "")
        load_for_run(model)
        # the memory preflight sizes the slots (and refuses a pool of none) before anything is allocated
        pool, compiled = open_session_pool(model, height, width, config, max_sessions=max_sessions,
                                           tiny_vae=tiny_vae, where=NODE,
                                           options=RunOptions(interrupt_check=interrupt_check()))  # fmt: skip
        transport = make_transport()
        try:
            service = LiveService(pool, transport, encode, limits, tiny_vae=tiny_vae,
                                  tags={"node": node, "prompt_id": prompt_id}, where=NODE)  # fmt: skip
            with LIVE_HOSTS.hosting(service):
                report = service.serve(check_cancel=check_interrupt)
        finally:
            transport.close()
            pool.close()
            telemetry = compiled.finish() if compiled is not None else None
        text = report.text()
        if telemetry is not None:
            text += "\n" + "\n".join(telemetry.summary_lines())
        return {"ui": {"text": [text]}, "result": (text,)}


def _register_routes() -> None:
    """The routes go onto ComfyUI's server when the pack is imported by one (before it adds its routes)."""
    server = prompt_server()
    if server is None:
        return
    try:
        register_routes(server, LIVE_HOSTS)
    except Exception:  # noqa: BLE001 - the rest of the pack must load; the node then has no clients to serve
        log.exception("fewstep: could not add the /fewstep/live routes to ComfyUI's server")


_register_routes()
