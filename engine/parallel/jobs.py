"""What workers do with a job, and the model cache that lets them keep a model across jobs.

Job ``n`` (a dict, ``kind`` plus arguments; see ``engine.parallel.client`` for the host side) is read by every
rank. Ranks report to the store: ``step/<n>/<rank>`` counts each unit of progress (the model being ready, each
sampling step, each video chunk), rank 0 also bumps ``progress/<n>`` per step or chunk and writes ``chunk/<n>/<i>`` (video) and
``result/<n>``. A failure writes ``error/<n>/<rank>`` and bumps ``failed/<n>``; every rank bumps
``finished/<n>`` when it is done with the job, whatever happened. Each of these writes is followed by a bump of
``events/<n>``, the one counter the host polls while it waits. Each rank bumps ``read/<n>`` once it has read the
job; the last one deletes the job's payload from the store (the host deletes the rest when the job ends).
``cancel/<n>``, set by the host, stops every rank at the same step: sequence-parallel ranks agree on it with one
all-reduce per step.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import math
import time
from collections import OrderedDict
from datetime import timedelta

import torch

from ..causal import CausalConfig, VideoSession, open_session
from ..conditioning import TextCondition
from ..errors import InputError
from ..handle import ModelHandle, open_model
from ..lora import LoraPatch, base_state_dict, read_lora
from ..preflight.budget import check_fits
from ..run import RunOptions
from ..text_to_image import SampleRequest, sample
from . import transport
from .config import ParallelConfig
from .mesh import SequenceMesh
from .rank import JobCancelledError, error_record
from .sharding import CausalSharding, ImageSequenceSharding
from .tasks import TASKS

log = logging.getLogger(__name__)

MAX_SESSIONS = 8
JOB_WAIT = 30.0  # s an idle worker blocks on the store before checking for shutdown on its own
SHUTDOWN = b"shutdown"  # written by the host in place of the next job's header when it stops the pool


def fingerprint(model: torch.nn.Module) -> float:
    """A cheap checksum of the base weights (the first elements of every tensor): two processes that loaded the
    same file in the same dtypes agree on it, whatever LoRA either has merged at the moment (the values a LoRA
    merge replaced count, from its backups); a different file or dummy seed does not."""
    items = sorted(base_state_dict(model).items())
    if not items:
        return 0.0
    # summed where the weights live, read once: one device sync per call, not one per tensor (a LoRA's backups
    # are on the CPU: their few elements join the others)
    device = items[0][1].device
    parts = [
        t.detach().flatten()[:32].to(device=device, dtype=torch.float64).sum() * (1.0 + 0.01 * (i % 97))
        for i, (_, t) in enumerate(items)
    ]
    return float(torch.stack(parts).sum()) + 1e-3 * sum(len(name) for name, _ in items)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise InputError("model", f"unknown dtype {name!r}")
    return dtype


class WorkerContext:
    """One rank's state between jobs: process groups per (ulysses, ring), the loaded model, video sessions."""

    def __init__(
        self, store, config: ParallelConfig, rank: int, world: int, device: torch.device, backend: str
    ):
        self.store, self.config, self.rank, self.world = store, config, rank, world
        self.device, self.backend = device, backend
        self.meshes: dict[tuple[int, int], SequenceMesh] = {}
        self.model_key = None
        self.model_fingerprint: float | None = None
        self.handle: ModelHandle | None = None
        self.sessions: OrderedDict[str, VideoSession] = OrderedDict()
        self.models_loaded = 0
        self.lora_patches: dict[tuple[str, float], LoraPatch] = {}  # (path, host digest): read once per model
        self.loras_read = 0
        self.job = 0

    # -- the job loop ----------------------------------------------------------------------------------------------
    def serve(self) -> None:
        n = 1
        while True:
            if self._wait_for_job(n):
                if self.store.get(f"job/{n}") == SHUTDOWN:
                    break
                self.run(n)
                n += 1
            elif self.store.check(["shutdown"]):
                break
        log.info("rank %d: shutting down", self.rank)

    def _wait_for_job(self, n: int) -> bool:
        """Block until job ``n`` is there (the store wakes us at once; the host writes a shutdown marker in its
        place when it stops the pool). False after ``JOB_WAIT`` seconds without one."""
        t0 = time.monotonic()
        try:
            self.store.wait([f"job/{n}"], timedelta(seconds=JOB_WAIT))
            return True
        except RuntimeError:  # DistStoreError: the wait timed out, or the store is failing
            if time.monotonic() - t0 < 0.1 * JOB_WAIT:
                time.sleep(0.1)  # failing fast: the next check raises if the host's store is gone
            return False

    def run(self, n: int) -> None:
        self.job = n
        try:
            job = transport.get(self.store, f"job/{n}", transport.MAX_MESSAGE_BYTES)
            if self.store.add(f"read/{n}", 1) == self.world:  # every rank has it: no copy left in the store
                transport.delete(self.store, f"job/{n}")
            for key in job.get("drop_sessions", ()):
                session = self.sessions.pop(key, None)
                if session is not None:
                    session.dispose()
            handler = HANDLERS.get(job["kind"])
            if handler is None:
                raise InputError("job", f"unknown job kind {job['kind']!r}")
            result = handler(self, job)
            if self.rank == 0:
                transport.put(self.store, f"result/{n}", result if result is not None else {})
        except JobCancelledError:
            self.store.set(f"cancelled/{n}/{self.rank}", "1")
        except Exception as err:  # noqa: BLE001 - every failure is reported to the host, which decides
            log.error("rank %d: job %d failed: %s", self.rank, n, err)
            transport.put(self.store, f"error/{n}/{self.rank}", error_record(err, self.rank))
            self.store.add(f"failed/{n}", 1)
        finally:
            self.store.set(f"done/{n}/{self.rank}", "1")
            self.store.add(f"finished/{n}", 1)
            self.event()

    # -- helpers for handlers --------------------------------------------------------------------------------------
    def progress(self, step: bool = True) -> None:
        """A unit of progress for the host's watch; ``step``: also a step (or chunk) the caller reports."""
        self.store.add(f"step/{self.job}/{self.rank}", 1)
        if step and self.rank == 0:
            self.store.add(f"progress/{self.job}", 1)
            self.event()

    def event(self) -> None:
        """Tell the host that something of this job changed (it polls this one counter; written last)."""
        self.store.add(f"events/{self.job}", 1)

    def cancel_requested(self) -> bool:
        return self.store.check([f"cancel/{self.job}"])

    def mesh(self, degrees=None) -> SequenceMesh:
        u, r = tuple(degrees) if degrees else self.config.degrees
        if u * r != self.world:
            raise InputError("parallel", f"ulysses {u} x ring {r} does not use the pool's {self.world} ranks")
        key = (u, r)
        if key not in self.meshes:  # collective: every rank gets the same job, so every rank builds it
            self.meshes[key] = SequenceMesh.build(u, r, self.device)
        mesh = self.meshes[key]
        mesh.stats.reset()
        return mesh

    def model(self, spec: dict) -> ModelHandle:
        key = (spec["source"], spec["dtype"], spec["weight_dtype"], spec["attention"], spec.get("seed", 0))
        if key != self.model_key:
            self.handle = self.model_key = self.model_fingerprint = None
            self.sessions.clear()
            self.lora_patches.clear()
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self.check_model_fits(spec)
            self.handle = open_model(
                spec["source"], weight_dtype=dtype_of(spec["weight_dtype"]), dtype=dtype_of(spec["dtype"]),
                device=self.device, attention_backend=spec["attention"], seed=spec.get("seed", 0),
                input_name="model",
            )  # fmt: skip
            self.model_key = key
            self.models_loaded += 1
        expected = spec.get("fingerprint")
        if expected is not None:
            if self.model_fingerprint is None:  # once per loaded model (reading every tensor syncs a GPU)
                self.model_fingerprint = fingerprint(self.handle.model)
            got = self.model_fingerprint
            if not math.isclose(got, expected, rel_tol=1e-9, abs_tol=1e-9):
                raise InputError(
                    "model",
                    f"rank {self.rank} loaded {spec['source']} but its weights differ from the model on the host "
                    "(weights patched in place on the host outside a LoRA, which the workers cannot load: apply "
                    "LoRAs with apply_lora, which pools receive; the file changed since the host loaded it; a "
                    "different file at that path on this machine; or dummy weights with another seed)",
                )
        handle = self.handle
        loras = spec.get("loras") or ()
        if loras:
            handle = handle.replace(loras=tuple(self._lora(item) for item in loras))
        self.progress(step=False)  # the model is ready: the host's startup timeout ends here
        return handle  # a run of it merges its LoRAs in place (engine.run), or restores the base weights

    def _lora(self, item: dict) -> LoraPatch:
        """The host's LoRA as this rank reads it: the same file, checked to hold the same deltas."""
        path, digest = item["path"], float(item["digest"])
        patch = self.lora_patches.get((path, digest))
        if patch is None:
            patch = read_lora(path, self.handle.model, 1.0, "lora")
            self.loras_read += 1
            if not math.isclose(patch.digest, digest, rel_tol=1e-9, abs_tol=1e-9):
                raise InputError(
                    "lora",
                    f"rank {self.rank} read the LoRA {path} but it differs from the one on the host (the file "
                    "changed since the host read it, or a different file at that path on this machine); load "
                    "the LoRA again, or put the same file at that path on every machine of the pool",
                )
            self.lora_patches[(path, digest)] = patch
        return patch.with_strength(item["strength"])

    def check_model_fits(self, spec: dict) -> None:
        """Refuse a model whose weights do not fit this rank's device, before loading them.

        The memory preflight's check (``check_fits``: one margin, the cgroup cap and ``FEWSTEP_MEMORY_LIMIT_GB``),
        made in this process on its own device: the budget is what this process can still allocate there, less,
        under the limit, what this process's ledger holds (its previous model is dropped before this check, so
        it holds nothing of it). The host checks the sum over its local workers on its own memory
        (``client.check_local_workers_fit``); this check covers every rank, remote and GPU ones included."""
        need = int(spec.get("weight_bytes", 0))
        check_fits(
            {"model weights": need},
            self.device,
            "model",
            hint=f"Rank {self.rank} holds a whole copy of the model: use fewer ranks per machine or a smaller "
            "dtype",
        )


# -- job kinds --------------------------------------------------------------------------------------------------
def _cond_dict(c: TextCondition) -> dict:
    # the padding mask travels too: Z-Image drops the masked tokens (engine.conditioning.for_family), so a worker
    # without it would attend to them and return another image than the single-process run
    return {"context": c.context.cpu(), "pooled": None if c.pooled is None else c.pooled.cpu(),
            "guidance": None if c.guidance is None else float(c.guidance),
            "mask": None if c.mask is None else c.mask.cpu()}  # fmt: skip


def _conds(items) -> list[TextCondition]:
    return [
        TextCondition(c["context"], c.get("pooled"), c.get("guidance"), c.get("mask")) for c in items or []
    ]


def request_to_job(request: SampleRequest) -> dict:
    """A sampling request as a job's plain data (the transport loads only tensors, numbers, strings and
    containers); the schedule travels as ``sigmas``, already built, so every rank runs the same one."""
    return {
        "positive": [_cond_dict(c) for c in request.positive],
        "negative": [_cond_dict(c) for c in request.negative] if request.negative else None,
        "latent": request.latent.float().cpu(), "seed": int(request.seed), "sampler": request.sampler,
        "cfg": float(request.cfg), "sigmas": request.sigmas.float().cpu(),
        "batch_index": list(request.batch_index) if request.batch_index is not None else None,
        "sampler_options": dict(request.sampler_options or {}),
    }  # fmt: skip


def request_from_job(data: dict) -> SampleRequest:
    """The :class:`SampleRequest` that :func:`request_to_job` wrote (without a callback: each rank sets its own)."""
    return SampleRequest(
        _conds(data["positive"]), data["latent"], negative=_conds(data.get("negative")) or None,
        seed=data["seed"], sampler=data["sampler"], cfg=data["cfg"], sigmas=data["sigmas"],
        batch_index=data.get("batch_index"), sampler_options=data.get("sampler_options") or None,
    )  # fmt: skip


def _report_dict(report) -> dict:
    return {
        "sigmas": report.sigmas, "sampler": report.sampler, "steps": report.steps,
        "model_calls": report.model_calls, "rows_evaluated": report.rows_evaluated, "cfg_used": report.cfg_used,
        "seconds_total": report.seconds_total, "seconds_per_step": report.seconds_per_step, "notes": report.notes,
    }  # fmt: skip


def run_sample(ctx: WorkerContext, job: dict) -> dict | None:
    """Text-to-image sampling: sequence parallel (every rank, every step) or data parallel (rows per rank)."""
    handle = ctx.model(job["model"])
    request = request_from_job(job["request"])
    if job.get("mode", ctx.config.mode) == "dp":
        return _sample_rows(ctx, handle, request)
    mesh = ctx.mesh(job.get("degrees"))

    def on_step(info):
        ctx.progress()
        if mesh.agree(ctx.cancel_requested()):
            raise JobCancelledError

    # this rank's share of every step: the run composes the family's sharded block runner (engine.run)
    options = RunOptions(sharding=ImageSequenceSharding(handle.family.name, mesh))
    latent, report = sample(handle, dataclasses.replace(request, callback=on_step, options=options))
    if ctx.rank != 0:
        return None
    return {"latent": latent, "report": _report_dict(report), "comm": mesh.stats.snapshot()}


def row_split(batch: int, world: int) -> list[range]:
    """Contiguous rows per rank, the first ``batch % world`` ranks one row more."""
    base, extra = divmod(batch, world)
    out, start = [], 0
    for r in range(world):
        n = base + (r < extra)
        out.append(range(start, start + n))
        start += n
    return out


def _sample_rows(ctx: WorkerContext, handle, request: SampleRequest) -> dict | None:
    """Data parallel: this rank's rows with the noise they have in the whole batch; rank 0 collects the rows
    through the store (no collective, so a rank with fewer rows never waits inside a timed collective)."""
    latent = request.latent
    batch = latent.shape[0]
    rows = list(row_split(batch, ctx.world)[ctx.rank])
    part: dict = {"rows": rows, "cancelled": False}
    if rows:
        index = request.batch_index or list(range(batch))

        def pick(conds):
            picked = []
            for c in conds or []:
                c = c.repeat_to(batch)
                pooled = None if c.pooled is None else c.pooled[rows]
                mask = None if c.mask is None else c.mask[rows]
                picked.append(TextCondition(c.context[rows], pooled, c.guidance, mask))
            return picked or None

        def on_step(info):
            ctx.progress()
            if ctx.cancel_requested():
                raise JobCancelledError

        try:
            rows_request = dataclasses.replace(
                request, positive=pick(request.positive), latent=latent[rows], negative=pick(request.negative),
                batch_index=[index[i] for i in rows], callback=on_step,
            )  # fmt: skip
            out, report = sample(handle, rows_request)
            part.update(latent=out, report=_report_dict(report))
        except JobCancelledError:
            part["cancelled"] = True
    transport.put(ctx.store, f"dp/{ctx.job}/{ctx.rank}", part)
    if ctx.rank != 0:
        if part["cancelled"]:
            raise JobCancelledError
        return None
    # a rank's rows of the latent, sampled: never more than the whole latent (and its report)
    limit = transport.RECORD_BYTES + 4 * latent.numel() * latent.element_size()
    parts = [part] + [_wait_part(ctx, r, limit) for r in range(1, ctx.world)]
    if any(p["cancelled"] for p in parts):
        raise JobCancelledError
    done = [p for p in parts if p["rows"]]
    out = torch.cat([p["latent"] for p in done], dim=0)
    report = dict(done[0]["report"])
    report["rows_evaluated"] = sum(p["report"]["rows_evaluated"] for p in done)
    report["seconds_total"] = max(p["report"]["seconds_total"] for p in done)
    return {"latent": out, "report": report, "comm": {"bytes_sent": {}, "calls": {}, "total": 0}}


def _wait_part(ctx: WorkerContext, rank: int, limit: int) -> dict:
    # no deadline here: the host watches every rank's heartbeat and progress and stops the pool if one is lost
    key = f"dp/{ctx.job}/{rank}"
    poll = transport.Poll(longest=0.05)
    while not transport.ready(ctx.store, key):
        if ctx.store.check(["shutdown"]):
            raise JobCancelledError
        poll.wait()
    part = transport.get(ctx.store, key, limit)
    transport.delete(ctx.store, key)
    return part


def run_video(ctx: WorkerContext, job: dict) -> dict | None:
    """Causal video on a sequence-parallel session: ``start`` a session (with ``prefill``: its clean start
    frames, whole chunks), or continue one (``key``), optionally with a new prompt; then ``chunks`` chunks (none: a
    prefill alone) with the job's ``strength``, ``inputs`` (video to video) and ``controls``; rank 0 streams each
    chunk to the host as soon as it is denoised."""
    handle = ctx.model(job["model"])
    mesh = ctx.mesh(job.get("degrees"))
    key = job["key"]
    if job.get("start"):
        old = ctx.sessions.pop(key, None)
        if old is not None:
            old.dispose()
        # this rank's share of the session, opened as in one process (causal.recipe.open_session): its run
        # (engine.run) composes the backends, the LoRA kept merged and this rank's sharding; workers run eagerly
        options = RunOptions(compile=False, step_cache=False, sharding=CausalSharding(mesh))
        session, _ = open_session(
            handle, job["context"].to(ctx.device), job["height"], job["width"], CausalConfig(**job["config"]),
            job["seed"], options=options,
        )  # fmt: skip
        ctx.sessions[key] = session
        while len(ctx.sessions) > MAX_SESSIONS:
            ctx.sessions.popitem(last=False)[1].dispose()
    else:
        session = ctx.sessions.get(key)
        if session is None or session.disposed:
            raise InputError(
                "session",
                f"{key} is no longer held by the workers (evicted or freed); run the video sampler again",
            )
        ctx.sessions.move_to_end(key)
        if job.get("context") is not None:
            session.set_prompt(job["context"].to(ctx.device))
    t0 = time.perf_counter()

    def before_forward(chunk: int, step: int | None) -> None:
        # every rank runs the same loop, so the agreement below is a collective every rank reaches: a cancel
        # stops the job within one forward (denoising step or clean-context pass), not at the next chunk
        ctx.progress()  # a progress event per forward: the host checks its own interrupt on each
        if mesh.agree(ctx.cancel_requested()):
            raise JobCancelledError

    result = {}
    if job.get("prefill") is not None:  # the start job of a session that starts from clean frames
        prefill = session.prefill(job["prefill"], before_forward=before_forward)
        result["prefill"] = {
            "frames": prefill.frames,
            "blocks": list(prefill.blocks),
            "seconds": prefill.seconds,
        }
    if job["chunks"]:
        _generate_video(ctx, mesh, session, job, before_forward)
    if ctx.rank != 0:
        return None
    return {
        **result, "frames_generated": session.frames_generated, "seconds": time.perf_counter() - t0,
        "comm": mesh.stats.snapshot(), "kv_bytes_per_token": session.cache.bytes_per_token(),
        "kv_tokens_per_frame": session.cache.tokens_per_frame,
    }  # fmt: skip


def _generate_video(ctx: WorkerContext, mesh, session: VideoSession, job: dict, before_forward) -> None:
    """The job's chunks: its strength and controls first, its input chunks (video to video) fed one ahead so the
    session's bounded queue holds at most two; rank 0 streams each chunk to the host."""
    session.inputs.clear()  # an earlier job that stopped with an error may have left its input queued
    session.set_strength(job.get("strength"))
    for control in job.get("controls") or ():
        value = control["value"]
        session.control(control["kind"], value.to(ctx.device) if control["kind"] == "prompt" else value,
                        control["recache"])  # fmt: skip
    inputs, c = job.get("inputs"), session.config.chunk_frames
    if inputs is not None:
        session.feed(inputs[:, :, :c])
    for i, chunk in enumerate(session.chunks(job["chunks"], before_forward=before_forward)):
        if inputs is not None and (i + 1) * c < inputs.shape[2]:
            session.feed(inputs[:, :, (i + 1) * c : (i + 2) * c])
        ctx.progress(step=False)
        if ctx.rank == 0:
            transport.put(ctx.store, f"chunk/{ctx.job}/{i}", {
                "index": chunk.index, "start_frame": chunk.start_frame, "latents": chunk.latents,
                "seconds": chunk.seconds, "commit_seconds": chunk.commit_seconds, "kv_bytes": chunk.kv_bytes,
                "kv_bytes_used": chunk.kv_bytes_used, "mode": chunk.mode, "strength": chunk.strength,
                "controls": [{"kind": a.kind, "chunk": a.chunk, "detail": a.detail} for a in chunk.controls],
            })  # fmt: skip
            ctx.event()
        if mesh.agree(ctx.cancel_requested()):
            raise JobCancelledError


def run_task(ctx: WorkerContext, job: dict):
    task = TASKS.get(job["name"])
    if task is None:
        raise InputError("task", f"unknown task {job['name']!r}; known: {', '.join(TASKS)}")
    return task(ctx, **job.get("args", {}))


def run_drop(ctx: WorkerContext, job: dict) -> None:
    """Only the ``drop_sessions`` every job carries (handled before dispatch)."""


HANDLERS = {"sample": run_sample, "video": run_video, "task": run_task, "drop": run_drop}
