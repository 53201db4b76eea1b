"""One run of a model: the single place where a run's choices are composed.

A *run* is one sampling job (``text_to_image.sample``), one causal video session (``causal.recipe.open_session``)
or one stream batch (``stream.pipeline.StreamBatch``). Each opens a :class:`Run` with :func:`open_run`; nothing
else decides how the model computes:

* ``backends`` (``engine.backends.Backends``): the attention backend (the options', else the handle's) and the
  kernel mode (the options', else ``FEWSTEP_KERNELS``, else ``auto``); handed to every forward, so the models read
  no process-global or thread-local switch;
* ``loras``: the handle's LoRA patches are merged into the model's weights before anything else reads them
  (``engine.lora.merge``), and a handle without patches gets the base weights back; :attr:`Run.weights_keeper`
  repeats that at the entry of every later call of a run that spans several;
* ``pool``: where the run computes. None: this process, composed as below. Otherwise the placement that
  computes it instead (``engine.parallel.client.OnPool``: a launcher's worker pool, started if needed); the entry
  points ask :func:`placement` once and hand the whole run to it (``text_to_image.sample``,
  ``causal.recipe.open_session``), so a node or command only puts the pool into its options (a stream batch
  runs in this process only: :func:`open_run` refuses options that place the run elsewhere);
* ``sharding``: this rank's sequence-parallel layout in a worker pool (``engine.parallel.sharding``): its block
  runner shards the tokens and puts the mesh's plan into the blocks' backends (``Backends.with_parallel``), around
  the run's own block runner (a step cache's); :attr:`Run.blocks` composes them, and a worker's video session
  takes its cache layout from it (each rank holds its share of the tokens and heads);
* ``model``: what to call, the plain model, or the compiled one with its CUDA graphs when the handle carries a
  compile feature (``engine.compile``; ``compile=False`` in the options leaves it out);
* ``step_cache``: the handle's step-cache gate (``engine.step_cache``), started for this run's schedule when the run
  has one (image sampling); a run that samples in chunks (a causal video session) gets the gate's verdict on its
  chunk schedule once, and a fresh step-cache run per chunk, from :meth:`Run.chunk_step_cache`;
* ``interrupt_check``: the host's cancel check (ComfyUI: ``throw_exception_if_processing_interrupted``), called
  before every transformer block of a forward, so a long forward (one FLUX step at 2048 px) stops within one
  block; :attr:`Run.blocks` puts it on the hidden state the model's block loop reads (see
  :func:`interruptible_blocks`). Only where the block loop runs in Python: not when the forward is compiled whole
  (``compile full``) or replayed from CUDA graphs (a captured graph runs no Python), and not in a worker pool's
  sharded run (the ranks agree on a cancel before each forward: one rank stopping inside a forward would leave
  the others waiting in a collective). Those runs keep the host's per-step check, and the compile run's report
  says so;
* the KV storage of a causal session (bf16 / int8 / int4, recent chunks kept in full precision) is the session's
  ``CausalConfig``, which the session builds its cache from; the run gives the cache its kernel mode.

A video session is opened from a run (``causal.recipe.open_session``: the same opener in this process and on each
rank of a worker pool) and starts no feature itself. Nodes only build options: they put features on the handle
(``with_feature``, as ComfyUI patches a model) and a pool into :class:`RunOptions`, and the engine composes them
here, each switchable off on its own.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .. import kernels
from .attention import check_backend
from .backends import Backends
from .compile.feature import start_compile_run
from .lora.merge import ensure_patches
from .settings import env_choice
from .step_cache import STEP_CACHE_FEATURE, causal_chunk_decision


def environment_kernel_mode() -> str:
    """``FEWSTEP_KERNELS``, tolerantly (a bad value is logged once and ``auto`` used): the kernel mode of a run
    whose options name none."""
    return env_choice("FEWSTEP_KERNELS", "auto", kernels.MODES)


@dataclass(frozen=True)
class RunOptions:
    """A run's own choices; None means "what the handle (or the environment) says"."""

    attention_backend: str | None = None  # None: handle.attention_backend
    kernel_mode: str | None = None  # None: FEWSTEP_KERNELS, else auto
    # this rank's sequence-parallel layout (a worker pool's ImageSequenceSharding / CausalSharding; None: one process)
    sharding: object = None
    compile: bool = True  # run the handle's compile feature, if it has one
    step_cache: bool = True  # run the handle's step-cache gate, if it has one
    # the host's cancel check, called before every transformer block; it raises the host's own interruption to
    # stop the run. It must only read a flag (no tensor read, no device sync: it runs between queued kernels).
    # None: checks between blocks off (the host still checks between forwards, in its step callbacks)
    interrupt_check: Callable[[], None] | None = None
    # where the run computes: None, this process; or a placement that computes it instead (a worker pool:
    # ``engine.parallel.client.OnPool``), which :func:`placement` hands the run to
    pool: object = None

    @property
    def in_process(self) -> bool:
        """Whether this process computes the run (and so holds the model's weights for it)."""
        return self.pool is None

    def backends_for(self, handle) -> Backends:
        attention = self.attention_backend or handle.attention_backend
        mode = self.kernel_mode or environment_kernel_mode()
        return Backends(check_backend(attention, "attention"), kernels.check_mode(mode))


@dataclass(frozen=True)
class RunBlocks:
    """``blocks(inner) -> block_runner``: the ``block_runner`` a forward of a run takes, composed around
    ``inner`` (a step cache's, or None): the sharding's runner, then the cancel check between blocks around both.
    It holds no handle, so a video session may keep it (see :attr:`Run.weights_keeper` for why that matters)."""

    sharding: object = None
    interrupt_check: Callable[[], None] | None = None

    def __call__(self, inner=None):
        runner = inner if self.sharding is None else self.sharding.block_runner(inner)
        if self.interrupt_check is None:
            return runner
        return functools.partial(interruptible_blocks, check=self.interrupt_check, inner=runner)


@dataclass
class ChunkStepCache:
    """The step cache of a run that samples in chunks (a causal video session): the gate's verdict on the chunk
    schedule, decided once, and a fresh step-cache run for each chunk while it is enabled (a gate normally
    refuses a causal chunk: its few DMD steps re-noise every step)."""

    gate: object = field(repr=False)
    model: object = field(repr=False)
    sigmas: torch.Tensor = field(repr=False)
    sampler: str
    decision: object  # engine.step_cache.GateDecision (its line() goes into the report)

    def start_chunk(self):
        """The step-cache run of the next chunk, or None when the gate is off for chunks."""
        if not self.decision.enabled:
            return None
        return self.gate.start_run(self.model, self.sigmas, self.sampler, context="causal chunk")


@dataclass
class Run:
    """What one run uses; :meth:`finish` it (or :meth:`abort` it on an error) exactly once."""

    handle: object = field(repr=False)
    backends: Backends
    model: object = field(repr=False)  # the forward to call (plain, or compiled / graphed)
    compiled: object = None  # the compile feature's CompileRun (telemetry), or None
    gate: object = None  # the handle's step-cache gate, or None
    step_cache: object = None  # the gate's run for this run's schedule, when it is active
    sharding: object = None  # this rank's sequence-parallel layout, or None
    interrupt_check: Callable[[], None] | None = None  # called before every block (None: off, or impossible)
    _cache_run: object = field(default=None, repr=False)  # started, active or not (its telemetry says why)

    @property
    def weights_keeper(self):
        """A call that merges the handle's LoRA patches into the shared model (or restores its base weights) if
        another run changed them since, and does nothing otherwise. Runs that span several calls (a video
        session's chunks, a stream's frames) call it at each entry, since another handle on the same model may have run in between. It holds the
        model and the patches, not the handle: a session kept in a store must not keep the handle's host object
        (ComfyUI's ModelPatcher) alive, or dropping the session while ComfyUI unloads models would free that
        object in the middle of ComfyUI's unload loop."""
        return functools.partial(ensure_patches, self.handle.model, self.handle.loras)

    @property
    def base_model(self):
        """The engine model itself (what ``model`` stands for when it is a compiled wrapper)."""
        return self.handle.model

    @property
    def blocks(self) -> RunBlocks:
        """``blocks(inner) -> block_runner``: what a forward of this run takes (see :class:`RunBlocks`)."""
        return RunBlocks(self.sharding, self.interrupt_check)

    def chunk_step_cache(self, sigmas: torch.Tensor, sampler: str = "dmd") -> ChunkStepCache | None:
        """The step cache of this run's chunks on the ``sigmas`` schedule (None without a gate). It holds the
        model and the gate, not the handle (a session keeps it: see :attr:`weights_keeper`)."""
        if self.gate is None:
            return None
        decision = causal_chunk_decision(self.gate, sigmas, sampler)
        return ChunkStepCache(self.gate, self.model, sigmas, sampler, decision)

    def finish(self) -> tuple[object, object]:
        """(step-cache telemetry or None, compile telemetry or None)."""
        cache = self._cache_run.finish() if self._cache_run is not None else None
        compiled = self.compiled.finish() if self.compiled is not None else None
        return cache, compiled

    def abort(self) -> None:
        """After an error: drop what the step cache kept and close the compile run."""
        if self._cache_run is not None:
            self._cache_run.reset()
        if self.compiled is not None:
            self.compiled.finish()


def interruptible_blocks(model, hidden, *, check: Callable[[], None], inner=None):
    """A ``block_runner``: ``inner`` (or the model's own block stack) with ``check`` called before every block.

    The check travels on the hidden state (its ``interrupt_check`` field), which every family's ``run_blocks``
    reads, so a step cache that runs the stack in pieces (block 0, decide, then the rest) is checked before each
    of its blocks too. The model's arithmetic is untouched: a check that never raises leaves the output equal."""
    hidden = dataclasses.replace(hidden, interrupt_check=check)
    return model.run_blocks(hidden) if inner is None else inner(model, hidden)


WHOLE_FORWARD_CANCEL_NOTE = (
    "Cancel checked once per forward, not between blocks: {why}, so no Python runs between the blocks"
)


def _between_blocks_problem(compiled, sharding) -> str | None:
    """Why this run cannot check for a cancel between blocks (None: it can)."""
    if sharding is not None:
        return "the ranks of a worker pool agree on a cancel before each forward"
    if compiled is not None:
        return compiled.whole_forward
    return None


def placement(options: RunOptions | None):
    """Where a run with ``options`` computes: None for this process (:func:`open_run` composes it there), or the
    placement that computes the whole run instead (``RunOptions.pool``: ``engine.parallel.client.OnPool``, with
    ``sample(handle, request)`` and ``open_video_session(...)``). The one place that decides local or pool."""
    return None if options is None else options.pool


def open_run(
    handle,
    options: RunOptions | None = None,
    *,
    sigmas: torch.Tensor | None = None,
    sampler: str | None = None,
    uses_cfg: bool = False,
) -> Run:
    """The run of ``handle`` with ``options``. ``sigmas`` / ``sampler`` / ``uses_cfg``: the schedule of an image
    sampling run, for the step-cache gate to decide on (without them the gate is passed on unstarted)."""
    options = options or RunOptions()
    if not options.in_process:
        raise ValueError("open_run composes a run in this process; hand a pool's run to placement(options)")
    backends = options.backends_for(handle)
    ensure_patches(handle.model, handle.loras)
    gate = handle.feature(STEP_CACHE_FEATURE) if options.step_cache else None
    cache_run = None
    if gate is not None and sigmas is not None:
        cache_run = gate.start_run(handle.model, sigmas, sampler, uses_cfg=uses_cfg)
    step_cache = cache_run if cache_run is not None and cache_run.active else None
    step_cache_on = step_cache is not None if sigmas is not None else gate is not None
    compiled = start_compile_run(handle, step_cache_active=step_cache_on) if options.compile else None
    model = handle.model if compiled is None else compiled.model
    interrupt_check = options.interrupt_check
    if interrupt_check is not None:
        problem = _between_blocks_problem(compiled, options.sharding)
        if problem is not None:
            interrupt_check = None
            if compiled is not None and options.sharding is None:
                compiled.notes.append(WHOLE_FORWARD_CANCEL_NOTE.format(why=problem))
    return Run(
        handle, backends, model, compiled, gate, step_cache, options.sharding, interrupt_check, cache_run
    )


__all__ = [
    "WHOLE_FORWARD_CANCEL_NOTE",
    "ChunkStepCache",
    "Run",
    "RunBlocks",
    "RunOptions",
    "environment_kernel_mode",
    "interruptible_blocks",
    "open_run",
    "placement",
]
