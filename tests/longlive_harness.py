"""LongLive's interactive pipeline (NVlabs/LongLive, branch v1.0) run on our weights, noise and prompts, as an
outside reference for a prompt switch with a KV re-cache.

The reference code is never part of this repository: ``FEWSTEP_LONGLIVE_DIR`` (or a caller's path) names an
extracted checkout, imported at run time; without it :func:`reference_dir` returns None and callers skip. Used by
``tests/engine/causal/test_recache_longlive.py``.

What runs is theirs: ``pipeline/interactive_causal_inference.py``'s ``InteractiveCausalInferencePipeline.inference``
(the per-chunk loop with prompt switches at given frames, ``_recache_after_switch``: the cross-attention cache
reset, one forward over the window's clean latents under the new prompt, with ``global_sink`` from the arguments
as their inference configs set it: true), ``utils/wan_wrapper.py``'s ``WanDiffusionWrapper`` forward and
``wan/modules/causal_model.py``'s ``CausalWanModel`` with its rolling KV cache (absolute RoPE, ``local_attn_size``
window, ``sink_size`` sinks, the re-cache's protection of the sink slots). What this module supplies around it, at
run time only (no file of theirs is changed):

* **Imports.** As in ``self_forcing_harness``: their packages' ``__init__`` files import the whole repository, so
  ``wan``, ``wan.modules``, ``pipeline`` and ``utils`` are registered as bare packages over their folders and only
  the modules needed are imported. Modules that cannot load here are replaced by placeholders when their import
  fails: ``wan.modules.tokenizers`` (``ftfy``), ``wan.modules.t5`` (the umT5 encoder; the prompts come as
  features) and ``utils.memory`` (asks CUDA for its device at import; used only with ``low_memory=True``). Their
  module names (``wan``, ``utils``, ``pipeline``: Self-Forcing's too) are registered only while importing: the
  modules imported are kept here, and whatever held those names before (Self-Forcing's, from
  ``self_forcing_harness``) is put back, so both references load in one process.
* **Attention on the CPU.** Their self-attention's ``attention`` (an SDPA fallback without flash-attn that casts
  to bfloat16 by default) and their cross-attention's ``flash_attention`` (CUDA only) are rebound to their own
  ``attention`` called with ``dtype=q.dtype``: the SDPA fallback in the model's dtype (``self_forcing_harness``).
* **The re-cache's block mask.** ``_recache_after_switch`` builds a blockwise causal ``BlockMask``
  (``_prepare_blockwise_causal_attn_mask``, flex attention's ``create_block_mask`` with ``_compile=False``) and sets
  it on the model; it runs on the CPU, so it runs as it is. Nothing reads it on the KV-cache path the pipeline
  takes (the self-attention with a ``kv_cache`` attends with ``attention``, without a mask): the re-cache forward
  attends to its whole cache.
* **Construction.** ``CausalWanModel`` and the wrapper as ``self_forcing_harness`` builds them (our preset's
  configuration, ``load_state_dict(ours.state_dict(), strict=True)``, the shift-5 scheduler of their configs). The
  pipeline's ``__init__`` runs with a stub text encoder (maps each prompt string to our prompt features, so their
  ``inference(noise, text_prompts_list, switch_frame_indices)`` takes prompts named ``"prompt 0"``, ``"prompt 1"``,
  ...) and a stub VAE (identity decode; the latents are compared). Its arguments are their interactive config's
  (``denoising_step_list`` 1000/750/500/250 warped, ``num_frame_per_block``, ``model_kwargs.local_attn_size`` /
  ``sink_size`` / ``timestep_shift``, ``global_sink``, ``context_noise``) at our sizes. Their cache allocation
  hard-codes Wan-1.3B (30 blocks, 1560 tokens a frame, 12 heads x 128, 512 text tokens): ``num_transformer_blocks``
  and ``frame_seq_length`` are set to ours (their loop sizes the KV cache and every layer's attention bound,
  ``max_attention_size``, from ``frame_seq_length``) and the two ``_initialize_*_cache`` methods are overridden
  with the same dicts at our sizes. Their loop's ``print`` lines go to a buffer.
* **Noise.** As ``self_forcing_harness``: each chunk's starting noise is passed in, their re-noising's
  ``torch.randn_like`` answered from :class:`VideoSession`'s generator replayed (a ``torch`` proxy set on their
  pipeline module for the call).
* **What ran.** A pre-hook on the wrapper records every forward (start frame, frames): the re-cache forwards are
  told apart from the chunks' (:attr:`ReferenceRun.recaches`, with their wall seconds).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import sys
import time
import types
from dataclasses import dataclass, field
from pathlib import Path

import self_forcing_harness as sfh
import torch
from torch import nn

ENV = "FEWSTEP_LONGLIVE_DIR"
REQUIRED = (
    "pipeline/interactive_causal_inference.py",
    "pipeline/causal_inference.py",
    "wan/modules/causal_model.py",
    "utils/wan_wrapper.py",
)
PACKAGES = ("wan", "wan.modules", "pipeline", "utils")
DENOISING_STEP_LIST = (1000, 750, 500, 250)  # configs/longlive_interactive_inference.yaml, warped
TIMESTEP_SHIFT = 5.0  # configs/longlive_interactive_inference.yaml model_kwargs
# their interactive config: local_attn_size 12, sink_size 3, num_frame_per_block 3, global_sink true
CONFIG_WINDOW, CONFIG_SINKS, CONFIG_CHUNK = 12, 3, 3


def reference_dir(path: str | os.PathLike | None = None) -> Path | None:
    """The extracted LongLive checkout (``path``, else ``$FEWSTEP_LONGLIVE_DIR``), or None if unset."""
    path = path or os.environ.get(ENV)
    return Path(path).expanduser().resolve() if path else None


def missing_files(root: Path) -> list[str]:
    return [f for f in REQUIRED if not (root / f).is_file()]


# -- importing their code --------------------------------------------------------------------------------------
@dataclass
class LongLive:
    """Their modules, imported once per process (the names ``self_forcing_harness`` reads are the same)."""

    root: Path
    interactive: types.ModuleType
    causal_inference: types.ModuleType
    causal_model: types.ModuleType
    wan_wrapper: types.ModuleType
    scheduler: types.ModuleType
    attention: types.ModuleType
    model: types.ModuleType


_LOADED: dict[Path, LongLive] = {}


def _theirs(name: str) -> bool:
    return name.split(".")[0] in {p.split(".")[0] for p in PACKAGES}


def _import_or_placeholder(name: str, why: str, names: tuple[str, ...]) -> None:
    try:
        importlib.import_module(name)
    except (ImportError, AssertionError, RuntimeError):
        sys.modules[name] = sfh._placeholder(name, why, names)


def load(root: str | os.PathLike) -> LongLive:
    """Import LongLive's interactive pipeline from ``root`` (see the module docstring for what is bypassed)."""
    root = Path(root).resolve()
    if root in _LOADED:
        return _LOADED[root]
    if missing := missing_files(root):
        raise FileNotFoundError(f"{root} is not a LongLive checkout: missing {', '.join(missing)}")
    # their top-level names are Self-Forcing's too: set aside whatever holds them, put it back afterwards
    held = {name: sys.modules.pop(name) for name in list(sys.modules) if _theirs(name)}
    for name in PACKAGES:
        package = types.ModuleType(name)
        package.__path__ = [str(root.joinpath(*name.split(".")))]
        sys.modules[name] = package
    sys.path.insert(0, str(root))
    try:
        _import_or_placeholder(
            "wan.modules.tokenizers", "the umT5 tokenizer needs ftfy", ("HuggingfaceTokenizer",)
        )
        _import_or_placeholder("wan.modules.t5", "the umT5 text encoder is not used", ("umt5_xxl",))
        _import_or_placeholder(
            "utils.memory",
            "it needs CUDA at import; only low_memory=True uses it",
            ("get_cuda_free_memory_gb", "DynamicSwapInstaller", "move_model_to_device_with_memory_preservation",
             "log_gpu_memory"),
        )  # fmt: skip
        sys.modules["utils.memory"].__dict__.setdefault("gpu", torch.device("cpu"))
        names = {
            "interactive": "pipeline.interactive_causal_inference",
            "causal_inference": "pipeline.causal_inference",
            "causal_model": "wan.modules.causal_model",
            "wan_wrapper": "utils.wan_wrapper",
            "scheduler": "utils.scheduler",
            "attention": "wan.modules.attention",
            "model": "wan.modules.model",
        }
        with contextlib.redirect_stdout(io.StringIO()):
            mods = {k: importlib.import_module(v) for k, v in names.items()}
    finally:
        sys.path.remove(str(root))
        for name in [n for n in sys.modules if _theirs(n)]:
            del sys.modules[name]
        sys.modules.update(held)
    ll = LongLive(root, **mods)
    sfh._patch_attention(ll)
    _LOADED[root] = ll
    return ll


# -- building their pipeline on our model ----------------------------------------------------------------------
class _PromptsByName:
    """Stands in for ``WanTextEncoder``: each prompt string names one of our prompt features."""

    def __init__(self, contexts: dict[str, torch.Tensor]):
        self.contexts = contexts

    def __call__(self, text_prompts):
        return {"prompt_embeds": torch.cat([self.contexts[p] for p in text_prompts])}


def prompt_name(index: int) -> str:
    return f"prompt {index}"


def reference_pipeline(
    ll: LongLive, ours: nn.Module, contexts: list[torch.Tensor], chunk_frames: int, window_frames: int,
    tokens_per_frame: int, sink_frames: int = 0, context_noise: float = 0.0, global_sink: bool = True,
):  # fmt: skip
    """Their ``InteractiveCausalInferencePipeline`` on our weights, with ``contexts[i]`` as ``prompt_name(i)``."""
    p = ours.params
    base = ll.interactive.InteractiveCausalInferencePipeline

    class Sized(base):
        # theirs with Wan-1.3B's 12 heads x 128 and 512 text tokens replaced by this model's sizes
        def _initialize_kv_cache(self, batch_size, dtype, device, kv_cache_size_override=None):
            if kv_cache_size_override is not None:
                size = kv_cache_size_override
            else:
                size = self.local_attn_size * self.frame_seq_length if self.local_attn_size != -1 else 32760
            shape = [batch_size, size, p.num_heads, p.head_dim]
            self.kv_cache1 = sfh.kv_cache_dicts(self.num_transformer_blocks, shape, dtype, device)

        def _initialize_crossattn_cache(self, batch_size, dtype, device):
            shape = [batch_size, p.text_len, p.num_heads, p.head_dim]
            self.crossattn_cache = sfh.crossattn_cache_dicts(
                self.num_transformer_blocks, shape, dtype, device
            )

    model_kwargs = types.SimpleNamespace(
        local_attn_size=window_frames, sink_size=sink_frames, timestep_shift=TIMESTEP_SHIFT
    )
    args = types.SimpleNamespace(
        denoising_step_list=list(DENOISING_STEP_LIST), warp_denoising_step=True, num_frame_per_block=chunk_frames,
        context_noise=context_noise, global_sink=global_sink, model_kwargs=model_kwargs,
    )  # fmt: skip
    wrapper = sfh.reference_wrapper(ll, sfh.reference_model(ll, ours, window_frames, sink_frames))
    encoder = _PromptsByName({prompt_name(i): c for i, c in enumerate(contexts)})
    device = contexts[0].device
    with contextlib.redirect_stdout(io.StringIO()):
        pipe = Sized(args, device=device, generator=wrapper, text_encoder=encoder, vae=sfh._IdentityVAE())
    pipe.num_transformer_blocks = p.num_layers
    pipe.frame_seq_length = tokens_per_frame
    return pipe


# -- one run of theirs -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Recache:
    """One re-cache forward of theirs: the frames it ran over and its wall seconds."""

    start_frame: int
    frames: int
    seconds: float


@dataclass
class ReferenceRun:
    latents: torch.Tensor  # [B, C, F, h, w] float32 on the CPU (our layout)
    recaches: list[Recache] = field(default_factory=list)
    log: str = ""  # what their loop printed


def run_reference(
    ll: LongLive, pipe, noise: sfh.StreamNoise, steps: int, switch_frames: list[int]
) -> ReferenceRun:
    """One stream of their ``inference`` loop on ``noise``: ``prompt_name(0)`` from the start, then
    ``prompt_name(i + 1)`` from frame ``switch_frames[i]`` on (their ``switch_frame_indices``)."""
    calls: list[list] = []  # [start frame, frames, wall start, wall end] per forward of the wrapper
    fsl = pipe.frame_seq_length

    def before(_module, _args, kwargs):
        frames = kwargs["noisy_image_or_video"].shape[1]
        calls.append([kwargs["current_start"] // fsl, frames, time.perf_counter(), None])

    def after(*_):
        calls[-1][3] = time.perf_counter()

    wrapper = pipe.generator
    pre = wrapper.register_forward_pre_hook(before, with_kwargs=True)
    post = wrapper.register_forward_hook(after)
    module = ll.interactive
    log = io.StringIO()
    prompts = [[prompt_name(i)] for i in range(len(switch_frames) + 1)]
    try:
        module.torch = sfh._TorchWithNoise(noise.draws())
        with torch.inference_mode(), contextlib.redirect_stdout(log):
            _, out = pipe.inference(
                noise.video(), text_prompts_list=prompts, switch_frame_indices=list(switch_frames),
                return_latents=True,
            )  # fmt: skip
        left = len(module.torch._draws)
    finally:
        module.torch = torch
        pre.remove()
        post.remove()
    if left:
        raise RuntimeError(f"their loop drew {left} re-noising draws fewer than our session does")
    return ReferenceRun(
        out.permute(0, 2, 1, 3, 4).float().cpu(), _recaches(calls, pipe, steps), log.getvalue()
    )


def _recaches(calls: list[list], pipe, steps: int) -> list[Recache]:
    """The re-cache forwards among ``calls``: each chunk runs ``steps`` denoising forwards and one clean-context
    forward over its own frames; a re-cache runs before a chunk and ends where that chunk starts."""
    c, chunk, in_chunk, found = pipe.num_frame_per_block, 0, 0, []
    for start, frames, t0, t1 in calls:
        if start == chunk * c and frames == c:
            in_chunk += 1
            if in_chunk == steps + 1:
                chunk, in_chunk = chunk + 1, 0
        elif in_chunk == 0 and start + frames == chunk * c:
            found.append(Recache(start, frames, t1 - t0))
        else:
            raise RuntimeError(f"unexpected forward of their loop over frames {start}..{start + frames - 1}")
    return found
