"""How a causal video session is opened from a run, and rebuilt to a position later.

:func:`open_session` is the one opener of a video session (:func:`open_session_pool` of a pool of them): it opens the session's run (``engine.run.open_run``:
its backends, the handle's step cache and compiled forward, and on a rank of a worker pool the sharding) and the
session from it, in this process and on every rank of a pool alike; or, when the run's options place it on a
worker pool (``RunOptions.pool``), it hands the whole session to the pool (``engine.run.placement``).
:class:`SessionRecipe` keeps what a deterministic rebuild needs (settings, seed, the prompts and the frames they
were switched at), so a caller holding an old reference to a session that has since moved on gets the same video
again.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from ..errors import InputError
from ..run import RunOptions, open_run, placement
from .session import CausalConfig, ForwardHook, VideoSession
from .session_pool import DEFAULT_BUCKETS, SessionPool


def open_session(handle, context: torch.Tensor, height: int, width: int, config: CausalConfig, seed: int,
                 tiny_vae=None, where: str | None = None, options: RunOptions | None = None):  # fmt: skip
    """(session, compile run or None): a session run as :func:`engine.run.open_run` composes it (``options``:
    the run's own choices), or the session the run's placement computes (a worker pool: a session with the same
    interface whose chunks come from the pool). A compile feature on the handle makes the session run the
    compiled forward (one entry point while the window fills, one once it is full: a stream never recompiles);
    ``finish()`` the compile run for its telemetry."""
    elsewhere = placement(options)
    if elsewhere is not None:
        return elsewhere.open_video_session(
            handle, context, height, width, config, seed, tiny_vae, where
        ), None
    run = open_run(handle, options)
    session = VideoSession(run.model, context, height, width, config, seed, tiny_vae, where=where, run=run)
    return session, run.compiled


def open_session_pool(handle, height: int, width: int, config: CausalConfig, max_sessions: int = 8,
                      buckets: tuple[int, ...] = DEFAULT_BUCKETS, tiny_vae=None, max_bytes: int | None = None,
                      where: str | None = None, options: RunOptions | None = None, **pool_options):  # fmt: skip
    """(pool, compile run or None): a :class:`SessionPool` on the run :func:`engine.run.open_run` composes
    (``options``: the run's own choices; a compile feature on the handle makes every batched step run the
    compiled forward, one entry point per bucket and phase). A pool runs in this process, on one device: a run
    placed on a worker pool is refused. ``pool_options``: the pool's own (``idle_timeout``, ``max_suspended``,
    ``max_waiting``, ``fps``)."""
    if placement(options) is not None:
        raise InputError("pool", "a session pool runs in this process on one device; it cannot be placed on a "
                         "worker pool", where)  # fmt: skip
    run = open_run(handle, options)
    pool = SessionPool(run.model, height, width, config, max_sessions, buckets, tiny_vae, max_bytes, where=where,
                       run=run, **pool_options)  # fmt: skip
    return pool, run.compiled


def _same_prompt(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b))


@dataclass(frozen=True)
class SessionRecipe:
    """Everything needed to rebuild a session deterministically."""

    model: object = field(repr=False)  # the ModelHandle
    width: int = 0
    height: int = 0
    config: CausalConfig = CausalConfig()
    seed: int = 0
    tiny_vae: object = field(default=None, repr=False)
    prompts: tuple = field(default=(), repr=False)  # ((first latent frame, context [B, L, 4096]), ...)
    max_prompts: int = 8  # different prompts kept; past it the recipe cannot rebuild (bounds the memory held)
    rebuildable: bool = True  # False once more than max_prompts different prompts were used (none are kept)
    # the session's run options (open_session), where it computes included (RunOptions.pool)
    options: RunOptions | None = field(default=None, repr=False)
    # the start latent it was prefilled with (model latent space, on the CPU; None: it started from noise)
    start: torch.Tensor | None = field(default=None, repr=False)
    recache_at: tuple[int, ...] = ()  # indices into ``prompts`` of the switches that re-cached the window

    @property
    def in_process(self) -> bool:
        """Whether this process computes the session (and so needs the model's weights loaded)."""
        return self.options is None or self.options.in_process

    def open(self, context: torch.Tensor, where: str | None = None):
        """:func:`open_session` with this recipe's settings and ``context`` as the first prompt."""
        return open_session(self.model, context, self.height, self.width, self.config, self.seed, self.tiny_vae,
                            where, self.options)  # fmt: skip

    def with_start(self, latents: torch.Tensor) -> SessionRecipe:
        """The recipe of a session prefilled with ``latents [B, C, F, h, w]`` (model latent space) before its
        first chunk (``VideoSession.prefill``): a rebuild prefills it again."""
        return dataclasses.replace(self, start=latents.detach().cpu())

    def with_prompt(self, frame: int, context: torch.Tensor, recache: bool = False) -> SessionRecipe:
        """The recipe after a prompt switch at ``frame`` (``recache``: with a KV re-cache); a prompt used before
        is kept once (the same tensor)."""
        if not self.rebuildable:
            return self
        kept = {id(c): c for _, c in self.prompts}
        context = next((c for c in kept.values() if _same_prompt(c, context)), context)
        kept[id(context)] = context
        if len(kept) > self.max_prompts:  # bound the memory a long chain of prompt switches holds
            return dataclasses.replace(self, prompts=(), recache_at=(), rebuildable=False)
        recache_at = (*self.recache_at, len(self.prompts)) if recache else self.recache_at
        return dataclasses.replace(self, prompts=(*self.prompts, (frame, context)), recache_at=recache_at)

    def rebuild(self, position: int, where: str, before_forward: ForwardHook | None = None) -> VideoSession:
        """A new session advanced to ``position`` latent frames, its prefill and prompt switches (with their
        re-caches) replayed; ``before_forward`` is called before every DiT forward of the replay (a caller's cancel
        check)."""
        if not self.rebuildable:
            raise InputError(
                "session",
                "this reference's session has moved on since it was made (another run continued it), and it "
                f"cannot be rebuilt: it switched between more than {self.max_prompts} different prompts, which "
                "are not kept, to bound memory (FEWSTEP_MAX_PROMPTS sets how many are); continue from the "
                "newest output, or run FewStepCausalVideoSampler again",
                where,
            )
        session, compiled = self.open(self.prompts[0][1], where)
        if self.start is not None:
            session.prefill(self.start, before_forward)
        for index, (frame, context) in enumerate((*self.prompts[1:], (position, None)), start=1):
            missing = frame - session.frames_generated
            if missing:
                for _ in session.chunks(missing // self.config.chunk_frames, before_forward=before_forward):
                    pass
            if context is not None:
                session.set_prompt(context, recache=index in self.recache_at)
        if compiled is not None:
            compiled.finish()
        return session
