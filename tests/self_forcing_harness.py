"""Self-Forcing's causal pipeline (guandeh17/Self-Forcing) run on our weights, noise and prompt, as an outside reference.

The reference code is never part of this repository: ``FEWSTEP_SELF_FORCING_DIR`` (or a caller's path) names an
extracted checkout, imported at run time; without it :func:`reference_dir` returns None and callers skip. Used by
``tests/engine/causal/test_self_forcing_reference.py`` and ``bench/causal_vs_self_forcing.py`` (which puts ``tests/`` on its path).

What runs is theirs: ``pipeline/causal_inference.py``'s ``CausalInferencePipeline.inference`` (the per-chunk loop:
denoising steps, the scheduler's re-noising, the clean-context pass at ``context_noise``), ``WanDiffusionWrapper``'s
forward (flow prediction to x0 in float64) and ``wan/modules/causal_model.py``'s ``CausalWanModel`` with its rolling
KV cache (absolute RoPE, ``local_attn_size`` window, eviction by shifting the cache). What this module supplies
around it, at run time only (no file of theirs is changed):

* **Imports.** Their package ``__init__`` files import the whole Wan repository (``wan/__init__`` loads the configs,
  which need ``easydict``; ``pipeline/__init__`` every pipeline), so ``wan``, ``wan.modules``, ``pipeline``,
  ``utils`` and ``demo_utils`` are registered as bare packages over their folders and only the modules needed are
  imported. Three modules that cannot load without the real text encoder or a GPU are replaced by placeholders
  when their import fails: ``wan.modules.tokenizers`` and ``wan.modules.t5`` (``ftfy`` / umT5; the prompt comes as
  features) and ``demo_utils.memory`` (asks CUDA for its device at import; used only with ``low_memory=True``).
* **Attention on the CPU.** Their self-attention calls ``attention(q, k, v)`` whose fallback without flash-attn is
  torch SDPA but casts q/k/v to its default ``dtype=torch.bfloat16`` (its bf16 output then meets float32 linear
  weights); their cross-attention calls ``flash_attention``, which asserts CUDA. Both names are rebound (in
  ``causal_model`` and ``model``) to their own ``attention`` called with ``dtype=q.dtype``: the SDPA fallback in
  the model's dtype.
* **Construction.** ``CausalWanModel`` is built with our preset's configuration (t2v, patch (1, 2, 2), text_len
  512, ``qk_norm`` and ``cross_attn_norm`` as Wan 2.1, ``local_attn_size`` = our ``window_frames``, ``sink_size`` =
  our ``sink_frames``) and loads our model's ``state_dict`` unchanged: both use the official Wan key names, nothing
  is mapped (``load_state_dict(strict=True)``). ``WanDiffusionWrapper.__init__`` loads a checkpoint from
  ``wan_models/``, so the wrapper is made without it and given what that ``__init__`` sets (the model, the
  shift-5 ``FlowMatchScheduler`` of Self-Forcing's configs, ``seq_len``, ``post_init``). The pipeline's own
  ``__init__`` runs with a stub text encoder (returns our prompt features) and a stub VAE (identity decode; the
  latents are compared). Its KV-cache allocation hard-codes Wan-1.3B (30 blocks, 1560 tokens a frame, 12 heads x
  128, 512 text tokens); ``num_transformer_blocks`` and ``frame_seq_length`` are set to ours and the two
  ``_initialize_*_cache`` methods are overridden with the same dicts at our sizes. (Their self-attention also
  reads at most ``local_attn_size * 1560`` cached tokens, Wan-1.3B's frame at 480p: at fewer tokens a frame that
  bound exceeds the cache, so it attends to the whole cache, which holds the window, as at 480p.) Their loop's
  ``print`` lines go to a buffer.
* **Noise.** ``inference(noise)`` takes each chunk's starting noise; its re-noising draws ``torch.randn_like``.
  Both replay :class:`VideoSession`'s generator (per chunk: the starting noise, then one draw per re-noised step),
  the second through a ``torch`` proxy set on their pipeline module for the call (only ``randn_like`` differs).
* **Timing.** Hooks on the wrapper module (which their loop calls for every forward) record each forward's end
  (wall and process CPU time): a chunk's seconds run from the end of the previous chunk's last denoising forward
  to the end of its own, so they hold the previous chunk's clean-context pass and this chunk's denoising steps,
  as ``ChunkResult.seconds`` does on our side (our session defers that pass to the next chunk's start).
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import time
import types
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

ENV = "FEWSTEP_SELF_FORCING_DIR"
REQUIRED = ("pipeline/causal_inference.py", "wan/modules/causal_model.py", "utils/wan_wrapper.py")
PACKAGES = ("wan", "wan.modules", "pipeline", "utils", "demo_utils")
DENOISING_STEP_LIST = (1000, 750, 500, 250)  # configs/self_forcing_dmd.yaml, warped (warp_denoising_step)
TIMESTEP_SHIFT = 5.0  # configs/self_forcing_dmd.yaml model_kwargs


def reference_dir(path: str | os.PathLike | None = None) -> Path | None:
    """The extracted Self-Forcing checkout (``path``, else ``$FEWSTEP_SELF_FORCING_DIR``), or None if unset."""
    path = path or os.environ.get(ENV)
    return Path(path).expanduser().resolve() if path else None


def missing_files(root: Path) -> list[str]:
    return [f for f in REQUIRED if not (root / f).is_file()]


# -- importing their code --------------------------------------------------------------------------------------
def _placeholder(name: str, why: str, names: tuple[str, ...]) -> types.ModuleType:
    module = types.ModuleType(name)

    def unavailable(*_, **__):
        raise RuntimeError(f"{name} is a placeholder in this harness ({why})")

    for n in names:
        setattr(module, n, unavailable)
    return module


def _import_or_placeholder(name: str, why: str, names: tuple[str, ...]):
    import importlib

    try:
        return importlib.import_module(name)
    except (ImportError, AssertionError, RuntimeError):
        sys.modules[name] = _placeholder(name, why, names)
        return sys.modules[name]


@dataclass
class SelfForcing:
    """Their modules, imported once per process."""

    root: Path
    causal_inference: types.ModuleType
    causal_model: types.ModuleType
    wan_wrapper: types.ModuleType
    scheduler: types.ModuleType
    attention: types.ModuleType
    model: types.ModuleType


_LOADED: dict[Path, SelfForcing] = {}


def load(root: str | os.PathLike) -> SelfForcing:
    """Import Self-Forcing's pipeline from ``root`` (see the module docstring for what is bypassed)."""
    import importlib

    root = Path(root).resolve()
    if root in _LOADED:
        return _LOADED[root]
    if missing := missing_files(root):
        raise FileNotFoundError(f"{root} is not a Self-Forcing checkout: missing {', '.join(missing)}")
    for name in PACKAGES:
        folder = str(root.joinpath(*name.split(".")))
        held = sys.modules.get(name)
        if held is not None:
            if folder not in list(getattr(held, "__path__", [])):
                raise ImportError(
                    f"a module {name!r} from elsewhere is already imported; run in a fresh process"
                )
            continue
        package = types.ModuleType(name)
        package.__path__ = [folder]
        sys.modules[name] = package
    sys.path.insert(0, str(root))
    try:
        _import_or_placeholder(
            "wan.modules.tokenizers", "the umT5 tokenizer needs ftfy", ("HuggingfaceTokenizer",)
        )
        _import_or_placeholder("wan.modules.t5", "the umT5 text encoder is not used", ("umt5_xxl",))
        _import_or_placeholder(
            "demo_utils.memory",
            "it needs CUDA at import; only low_memory=True uses it",
            (
                "get_cuda_free_memory_gb",
                "DynamicSwapInstaller",
                "move_model_to_device_with_memory_preservation",
            ),
        )
        sys.modules["demo_utils.memory"].__dict__.setdefault("gpu", torch.device("cpu"))
        names = {
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
    sf = SelfForcing(root, **mods)
    _patch_attention(sf)
    _LOADED[root] = sf
    return sf


def _patch_attention(sf: SelfForcing) -> None:
    their_attention = sf.attention.attention

    def attention_in_input_dtype(q, k, v, q_lens=None, k_lens=None, **kwargs):
        kwargs.pop("version", None)  # flash_attention's name for attention's fa_version
        kwargs.pop("dtype", None)
        return their_attention(q, k, v, q_lens=q_lens, k_lens=k_lens, dtype=q.dtype, **kwargs)

    sf.causal_model.attention = attention_in_input_dtype  # causal self-attention
    sf.model.flash_attention = attention_in_input_dtype  # WanT2VCrossAttention


# -- building their pipeline on our model ----------------------------------------------------------------------
def reference_model(sf: SelfForcing, ours: nn.Module, window_frames: int, sink_frames: int = 0) -> nn.Module:
    """Their ``CausalWanModel`` with our model's configuration and weights (official key names on both sides)."""
    p = ours.params
    dtype = ours.patch_embedding.weight.dtype
    with contextlib.redirect_stdout(io.StringIO()):
        ref = sf.causal_model.CausalWanModel(
            model_type="t2v", patch_size=tuple(p.patch_size), text_len=p.text_len, in_dim=p.in_dim, dim=p.dim,
            ffn_dim=p.ffn_dim, freq_dim=p.freq_dim, text_dim=p.text_dim, out_dim=p.out_dim, num_heads=p.num_heads,
            num_layers=p.num_layers, local_attn_size=window_frames, sink_size=sink_frames, qk_norm=True,
            cross_attn_norm=True, eps=p.eps,
        )  # fmt: skip
    ref.load_state_dict(ours.state_dict(), strict=True)
    # nn.Module.to: diffusers' ModelMixin.to warns about from_pretrained's torch_dtype, which is not used here
    nn.Module.to(ref, device=ours.patch_embedding.weight.device, dtype=dtype)
    return ref.eval().requires_grad_(False)


def reference_wrapper(sf: SelfForcing, model: nn.Module) -> nn.Module:
    """``WanDiffusionWrapper`` around ``model``, as its ``__init__`` builds it minus the checkpoint load."""
    cls = sf.wan_wrapper.WanDiffusionWrapper
    wrapper = cls.__new__(cls)
    nn.Module.__init__(wrapper)
    wrapper.model = model
    wrapper.uniform_timestep = False  # is_causal
    wrapper.scheduler = sf.scheduler.FlowMatchScheduler(
        shift=TIMESTEP_SHIFT, sigma_min=0.0, extra_one_step=True
    )
    wrapper.scheduler.set_timesteps(1000, training=True)
    wrapper.seq_len = 32760
    wrapper.post_init()
    return wrapper


class _PromptFeatures:
    """Stands in for ``WanTextEncoder``: the prompt is given as umT5 features."""

    def __init__(self, context: torch.Tensor):
        self.context = context

    def __call__(self, text_prompts):
        return {"prompt_embeds": self.context}


class _IdentityVAE:
    """Stands in for ``WanVAEWrapper``: the latents are what is compared, decoding them is not timed."""

    def decode_to_pixel(self, latent, use_cache=False):
        return latent


def kv_cache_dicts(layers: int, shape: list[int], dtype, device, **extra) -> list[dict]:
    """Their self-attention cache (CausVid's layout, shared by Self-Forcing, LongLive and StreamDiffusionV2):
    per layer ``k`` / ``v`` of ``shape`` and the end indices (``extra``: fields a fork adds)."""
    return [
        {
            "k": torch.zeros(shape, dtype=dtype, device=device),
            "v": torch.zeros(shape, dtype=dtype, device=device),
            "global_end_index": torch.tensor([0], dtype=torch.long, device=device),
            "local_end_index": torch.tensor([0], dtype=torch.long, device=device),
            **extra,
        }
        for _ in range(layers)
    ]


def crossattn_cache_dicts(layers: int, shape: list[int], dtype, device) -> list[dict]:
    """Their cross-attention cache: per layer ``k`` / ``v`` of ``shape``, not yet filled."""
    return [
        {"k": torch.zeros(shape, dtype=dtype, device=device), "v": torch.zeros(shape, dtype=dtype, device=device),
         "is_init": False}
        for _ in range(layers)
    ]  # fmt: skip


def reference_pipeline(sf: SelfForcing, ours: nn.Module, context: torch.Tensor, chunk_frames: int,
                       window_frames: int, tokens_per_frame: int, sink_frames: int = 0, context_noise: float = 0.0,
                       independent_first_frame: bool = False):  # fmt: skip
    """Their ``CausalInferencePipeline`` on our weights and prompt, sized for our model (see the docstring)."""
    p = ours.params
    base = sf.causal_inference.CausalInferencePipeline

    class Sized(base):
        # theirs with Wan-1.3B's 12 heads x 128 and 512 text tokens replaced by this model's sizes
        def _initialize_kv_cache(self, batch_size, dtype, device):
            size = self.local_attn_size * self.frame_seq_length if self.local_attn_size != -1 else 32760
            shape = [batch_size, size, p.num_heads, p.head_dim]
            self.kv_cache1 = kv_cache_dicts(self.num_transformer_blocks, shape, dtype, device)

        def _initialize_crossattn_cache(self, batch_size, dtype, device):
            shape = [batch_size, p.text_len, p.num_heads, p.head_dim]
            self.crossattn_cache = crossattn_cache_dicts(self.num_transformer_blocks, shape, dtype, device)

    args = types.SimpleNamespace(
        denoising_step_list=list(DENOISING_STEP_LIST), warp_denoising_step=True, num_frame_per_block=chunk_frames,
        independent_first_frame=independent_first_frame, context_noise=context_noise, model_kwargs={"timestep_shift": TIMESTEP_SHIFT},
    )  # fmt: skip
    wrapper = reference_wrapper(sf, reference_model(sf, ours, window_frames, sink_frames))
    with contextlib.redirect_stdout(io.StringIO()):
        pipe = Sized(args, device=context.device, generator=wrapper, text_encoder=_PromptFeatures(context),
                     vae=_IdentityVAE())  # fmt: skip
    pipe.num_transformer_blocks = p.num_layers
    pipe.frame_seq_length = tokens_per_frame
    return pipe


# -- noise ---------------------------------------------------------------------------------------------------------
@dataclass
class StreamNoise:
    """What a ``VideoSession`` with ``seed`` draws, chunk by chunk: ``start [B, C, c, h, w]`` and ``renoise``."""

    start: list[torch.Tensor]
    renoise: list[list[torch.Tensor]]

    def video(self) -> torch.Tensor:
        """Every chunk's starting noise as their ``inference`` takes it: ``[B, F, C, h, w]``."""
        return torch.cat(self.start, dim=2).permute(0, 2, 1, 3, 4).contiguous()

    def draws(self) -> list[torch.Tensor]:
        """The re-noising draws in order, each as their loop asks for it (``[B * c, C, h, w]``)."""
        return [n.permute(0, 2, 1, 3, 4).flatten(0, 1) for chunk in self.renoise for n in chunk]


def session_noise(seed: int, shape: tuple[int, ...], n_chunks: int, steps: int, device="cpu") -> StreamNoise:
    """Replays :class:`VideoSession`'s generator: per chunk one starting draw, then one per re-noised step."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def draw():
        return torch.randn(shape, generator=gen, device=device, dtype=torch.float32)

    start, renoise = [], []
    for _ in range(n_chunks):
        start.append(draw())
        renoise.append([draw() for _ in range(steps - 1)])
    return StreamNoise(start, renoise)


class _TorchWithNoise:
    """``torch`` for their pipeline module, ``randn_like`` answered from a list of draws (checked in shape)."""

    def __init__(self, draws: list[torch.Tensor]):
        self._draws = list(draws)

    def randn_like(self, x, *args, **kwargs):
        if not self._draws:
            raise RuntimeError("their loop drew more re-noising noise than our session does")
        n = self._draws.pop(0)
        if n.shape != x.shape:
            raise RuntimeError(
                f"their loop asked for noise {list(x.shape)}, our next draw is {list(n.shape)}"
            )
        return n.to(device=x.device, dtype=x.dtype)

    def __getattr__(self, name):
        return getattr(torch, name)


# -- one run of theirs -----------------------------------------------------------------------------------------------
@dataclass
class ReferenceRun:
    latents: torch.Tensor  # [B, C, F, h, w] float32 on the CPU (our layout)
    chunk_seconds: list[float]
    chunk_cpu_seconds: list[float]  # process CPU time (all threads) over the same spans
    kv_bytes: int  # their self-attention cache (k and v of every block)
    cross_bytes: int  # their cross-attention cache once filled
    timesteps: list[float] = field(default_factory=list)  # their warped denoising_step_list


def _bytes(caches) -> int:
    return sum(c["k"].nbytes + c["v"].nbytes for c in caches)


def run_reference(
    sf: SelfForcing, pipe, noise: StreamNoise, steps: int, initial_latent: torch.Tensor | None = None
) -> ReferenceRun:
    """One stream of their ``inference`` loop on ``noise``; per-chunk seconds from hooks on the wrapper.
    ``initial_latent [B, C, F, h, w]`` (our layout): their prefill (image to video, video extension); the
    latents returned are then the generated frames only (theirs start with the given ones, checked equal)."""
    ends: list[tuple[float, float]] = []  # (wall, process CPU) at the end of each forward
    begin: list[tuple[float, float]] = []

    def stamp() -> tuple[float, float]:
        return time.perf_counter(), time.process_time()

    wrapper = pipe.generator
    pre = wrapper.register_forward_pre_hook(lambda *_: None if begin else begin.append(stamp()))
    post = wrapper.register_forward_hook(lambda *_: ends.append(stamp()))
    module = sf.causal_inference
    try:
        module.torch = _TorchWithNoise(noise.draws())
        start = None if initial_latent is None else initial_latent.permute(0, 2, 1, 3, 4).contiguous()
        with torch.inference_mode(), contextlib.redirect_stdout(io.StringIO()):
            _, out = pipe.inference(
                noise.video(), text_prompts=[""], initial_latent=start, return_latents=True
            )
        left = len(module.torch._draws)
    finally:
        module.torch = torch
        pre.remove()
        post.remove()
    if left:
        raise RuntimeError(f"their loop drew {left} re-noising draws fewer than our session does")
    prefill = 0
    if initial_latent is not None:
        given = out[:, : initial_latent.shape[2]].permute(0, 2, 1, 3, 4)
        if not torch.equal(given.float().cpu(), initial_latent.float().cpu()):
            raise RuntimeError("their output does not start with the initial latent")
        out = out[:, initial_latent.shape[2] :]
        f, c = initial_latent.shape[2], pipe.num_frame_per_block
        prefill = f // c + (f % c == 1 and c > 1)  # their blocks: a lone first frame, then whole blocks
    per_chunk = steps + 1  # denoising forwards, then the clean-context pass
    n = len(noise.start)
    if len(ends) != prefill + n * per_chunk:
        raise RuntimeError(
            f"expected {prefill + n * per_chunk} forwards of their generator, counted {len(ends)}"
        )
    ends = ends[prefill:]
    denoised = [begin[0]] + [ends[k * per_chunk + steps - 1] for k in range(n)]
    pairs = list(zip(denoised, denoised[1:]))
    return ReferenceRun(
        latents=out.permute(0, 2, 1, 3, 4).float().cpu(),
        chunk_seconds=[b[0] - a[0] for a, b in pairs],
        chunk_cpu_seconds=[b[1] - a[1] for a, b in pairs],
        kv_bytes=_bytes(pipe.kv_cache1),
        cross_bytes=_bytes(pipe.crossattn_cache),
        timesteps=[float(t) for t in pipe.denoising_step_list],
    )
