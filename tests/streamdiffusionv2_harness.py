"""StreamDiffusionV2's video-to-video loop (chenfengxu714/StreamDiffusionV2) run on our weights, input latents,
noise and prompt, as an outside reference for a :class:`VideoSession` in video to video.

The reference code is never part of this repository: ``FEWSTEP_STREAMDIFFUSIONV2_DIR`` (or a caller's path) names
an extracted checkout, imported at run time; without it :func:`reference_dir` returns None and callers skip. Used
by ``tests/engine/causal/test_v2v_streamdiffusionv2.py``.

What runs is theirs: ``models/wan/causal_stream_inference.py``'s ``CausalStreamInferencePipeline`` (its
``__init__``, which builds the denoising list, ``prepare`` for the first chunk and ``inference_wo_batch`` for each
next one: the denoising steps and the scheduler's re-noising, no clean-context pass), ``wan_wrapper.py``'s
``CausalWanDiffusionWrapper.forward`` (flow prediction to x0 in float64 on their shift-8 ``FlowMatchScheduler``)
and ``causal_model.py``'s ``CausalWanModel`` with its KV cache (absolute RoPE at ``current_start``, the ring of
``num_kv_cache`` frames with ``num_sink_tokens`` sink frames and its per-layer ``evict_idx`` queue). What this
module supplies around it, at run time only (no file of theirs is changed):

* **Imports.** ``models/wan/wan_base/modules/tokenizers.py`` needs ``ftfy`` (the umT5 tokenizer; the prompt comes
  as features here): when it cannot be imported it is replaced by a placeholder before their packages load.
* **Attention.** Their cross-attention calls ``flash_attention``, which asserts a half dtype and, with flash-attn,
  CUDA; it is rebound (in ``wan_base.modules.model``) to their own SDPA fallback called in the model's dtype. Their
  causal self-attention is left as it is (without flash-attn it is their SDPA fallback, in the input dtype); its
  per-forward "flash_attn is not installed" warnings are silenced.
* **Construction.** Their ``__init__`` builds the generator, text encoder and VAE through the registry functions
  imported into ``causal_stream_inference``; for the call these return: their ``CausalWanDiffusionWrapper`` made
  without its checkpoint load (given what its ``__init__`` sets: the model, the shift-8 scheduler, ``seq_len``,
  ``post_init``) around their ``CausalWanModel`` built with our preset's configuration and loading our model's
  ``state_dict`` unchanged (official Wan key names on both sides, ``strict=True``); a stub text encoder (our
  prompt features) and a stub VAE (never called: the driver's encode and decode are not run, latents are given
  and compared). Their KV allocation hard-codes Wan-1.3B's heads (12 or 40 x 128, 30 or 40 blocks, 512 text
  tokens); ``num_transformer_blocks`` / ``num_heads`` are set to ours and the two ``_initialize_*_cache`` methods
  are overridden with the same dicts at our head size. Their ``frame_seq_length`` (``(H // 16) * (W // 16)``) is
  the token count of a frame of our model (patch 1x2x2) and checked to be.
* **The driver.** ``streamv2v/inference_wo_batch.py``'s ``run_inference`` needs the real VAE, casts the encoded
  latents to bfloat16 and always runs the motion-aware noise (``compute_noise_scale_and_step``); its per-chunk
  logic is replayed here, with a fixed noise scale: each chunk's input latents ``x`` are noised as their driver
  does, ``noise * noise_scale + x * (1 - noise_scale)``, the first chunk goes through ``prepare`` (at tokens
  ``[0, c * frame_seq_length)``; their real first chunk is ``1 + c`` latent frames, the VAE's lone first frame and a
  chunk: here it is one chunk of ``c``, as our session's) and every next one through ``inference_wo_batch`` at the
  next ``c`` frames' tokens with ``current_step`` = their first denoising timestep (what the fixed noise scale
  means; the motion-aware driver passes ``int(1000 * noise_scale) - 100``). Their position refresh (back to
  ``num_kv_cache - 1`` once ``current_start`` reaches 50 frames) is not reached by these short streams.
* **Noise.** The starting noise of each chunk is given (our session's first draw of the chunk); their re-noising
  draws ``torch.randn_like``, answered from our session's next draws through a ``torch`` proxy set on their
  module for the call (``self_forcing_harness``'s, only ``randn_like`` differs).
* **What their cache wrote.** Hooks on the wrapper record, per forward, which frame slots of the first layer's
  key cache changed (:attr:`ReferenceRun.writes`): the trace of their eviction path.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import os
import sys
import types
import warnings
from dataclasses import dataclass
from pathlib import Path

import self_forcing_harness as sfh
import torch
from self_forcing_harness import StreamNoise, _TorchWithNoise
from torch import nn

ENV = "FEWSTEP_STREAMDIFFUSIONV2_DIR"
REQUIRED = (
    "models/wan/causal_stream_inference.py",
    "models/wan/causal_model.py",
    "models/wan/wan_wrapper.py",
    "models/wan/flow_match.py",
)
DENOISING_STEP_LIST = (700, 500, 400, 200, 0)  # configs/wan_causal_dmd_v2v.yaml
TIMESTEP_SHIFT = 8.0  # their WanDiffusionWrapper's FlowMatchScheduler (and the yaml's timestep_shift)
TOKENIZERS = "models.wan.wan_base.modules.tokenizers"


def reference_dir(path: str | os.PathLike | None = None) -> Path | None:
    """The extracted StreamDiffusionV2 checkout (``path``, else ``$FEWSTEP_STREAMDIFFUSIONV2_DIR``), or None."""
    path = path or os.environ.get(ENV)
    return Path(path).expanduser().resolve() if path else None


def missing_files(root: Path) -> list[str]:
    return [f for f in REQUIRED if not (root / f).is_file()]


@dataclass
class StreamDiffusionV2:
    """Their modules, imported once per process."""

    root: Path
    stream_inference: types.ModuleType
    causal_model: types.ModuleType
    wan_wrapper: types.ModuleType
    wan_model: types.ModuleType
    attention: types.ModuleType


_LOADED: dict[Path, StreamDiffusionV2] = {}


def _tokenizer_placeholder() -> types.ModuleType:
    module = types.ModuleType(TOKENIZERS)

    class HuggingfaceTokenizer:
        def __init__(self, *_, **__):
            raise RuntimeError("the umT5 tokenizer is a placeholder in this harness (it needs ftfy)")

    module.HuggingfaceTokenizer = HuggingfaceTokenizer
    return module


def load(root: str | os.PathLike) -> StreamDiffusionV2:
    """Import StreamDiffusionV2's pipeline from ``root`` (see the module docstring for what is bypassed)."""
    root = Path(root).resolve()
    if root in _LOADED:
        return _LOADED[root]
    if missing := missing_files(root):
        raise FileNotFoundError(f"{root} is not a StreamDiffusionV2 checkout: missing {', '.join(missing)}")
    held = sys.modules.get("models")
    if held is not None and str(root / "models") not in list(getattr(held, "__path__", [])):
        raise ImportError("a module 'models' from elsewhere is already imported; run in a fresh process")
    if importlib.util.find_spec("ftfy") is None:
        sys.modules.setdefault(TOKENIZERS, _tokenizer_placeholder())
    sys.path.insert(0, str(root))
    try:
        names = {
            "stream_inference": "models.wan.causal_stream_inference",
            "causal_model": "models.wan.causal_model",
            "wan_wrapper": "models.wan.wan_wrapper",
            "wan_model": "models.wan.wan_base.modules.model",
            "attention": "models.wan.wan_base.modules.attention",
        }
        with contextlib.redirect_stdout(io.StringIO()):
            mods = {k: importlib.import_module(v) for k, v in names.items()}
    finally:
        sys.path.remove(str(root))
    sd = StreamDiffusionV2(root, **mods)
    fallback = sd.attention._sdpa_attention_fallback

    def cross_attention_in_input_dtype(q, k, v, q_lens=None, k_lens=None, **kwargs):
        kwargs.pop("version", None)
        kwargs.pop("dtype", None)
        return fallback(q, k, v, q_lens=q_lens, k_lens=k_lens, dtype=q.dtype, **kwargs)

    sd.wan_model.flash_attention = cross_attention_in_input_dtype  # WanT2VCrossAttention
    _LOADED[root] = sd
    return sd


# -- building their pipeline on our model ----------------------------------------------------------------------
def reference_model(sd: StreamDiffusionV2, ours: nn.Module) -> nn.Module:
    """Their ``CausalWanModel`` with our model's configuration and weights (official key names on both sides)."""
    p = ours.params
    dtype = ours.patch_embedding.weight.dtype
    with contextlib.redirect_stdout(io.StringIO()):
        ref = sd.causal_model.CausalWanModel(
            model_type="t2v", patch_size=tuple(p.patch_size), text_len=p.text_len, in_dim=p.in_dim, dim=p.dim,
            ffn_dim=p.ffn_dim, freq_dim=p.freq_dim, text_dim=p.text_dim, out_dim=p.out_dim, num_heads=p.num_heads,
            num_layers=p.num_layers, qk_norm=True, cross_attn_norm=True, eps=p.eps,
        )  # fmt: skip
    ref.load_state_dict(ours.state_dict(), strict=True)
    nn.Module.to(ref, device=ours.patch_embedding.weight.device, dtype=dtype)
    return ref.eval().requires_grad_(False)


def reference_wrapper(sd: StreamDiffusionV2, model: nn.Module) -> nn.Module:
    """``CausalWanDiffusionWrapper`` around ``model``, as its ``__init__`` builds it minus the checkpoint load."""
    cls = sd.wan_wrapper.CausalWanDiffusionWrapper
    wrapper = cls.__new__(cls)
    nn.Module.__init__(wrapper)
    wrapper.model = model
    wrapper.uniform_timestep = False  # CausalWanDiffusionWrapper's
    wrapper.scheduler = sd.wan_wrapper.FlowMatchScheduler(
        shift=TIMESTEP_SHIFT, sigma_min=0.0, extra_one_step=True
    )
    wrapper.scheduler.set_timesteps(1000, training=True)
    wrapper.seq_len = 32760
    wrapper.post_init()
    return wrapper


class _PromptFeatures(nn.Module):
    """Stands in for ``WanTextEncoder``: the prompt is given as umT5 features."""

    def __init__(self, context: torch.Tensor):
        super().__init__()
        self.context = context

    def forward(self, text_prompts):
        return {"prompt_embeds": self.context.clone()}


class _NoVAE(nn.Module):
    """Stands in for ``WanVAEWrapper``: the driver's encode and decode are not run (latents are compared)."""


@contextlib.contextmanager
def _registry(sd: StreamDiffusionV2, generator, text_encoder):
    """Their ``__init__``'s three registry lookups answer our stand-ins for the call."""
    module = sd.stream_inference
    saved = {
        n: getattr(module, n)
        for n in ("get_diffusion_wrapper", "get_text_encoder_wrapper", "get_vae_wrapper")
    }
    module.get_diffusion_wrapper = lambda model_name: lambda model_type: generator
    module.get_text_encoder_wrapper = lambda model_name: lambda model_type: text_encoder
    module.get_vae_wrapper = lambda model_name: lambda model_type: _NoVAE()
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def reference_pipeline(sd: StreamDiffusionV2, ours: nn.Module, context: torch.Tensor, height: int, width: int,
                       chunk_frames: int, kv_cache_frames: int, sink_frames: int = 0, steps: int = 4,
                       adapt_sink_threshold: float = -1.0):  # fmt: skip
    """Their ``CausalStreamInferencePipeline`` on our weights and prompt (see the module docstring): the
    ``wan_causal_dmd_v2v.yaml`` settings with ``warp_denoising_step: true``, ``num_frame_per_block`` =
    ``chunk_frames``, ``num_kv_cache`` = ``kv_cache_frames``, ``num_sink_tokens`` = ``sink_frames`` (frames, despite
    the name) and the first ``steps`` timesteps (their ``--step``)."""
    p = ours.params
    head_dim = p.dim // p.num_heads
    base = sd.stream_inference.CausalStreamInferencePipeline

    class Sized(base):
        # theirs with Wan-1.3B's 128-wide heads and 512 text tokens replaced by this model's sizes
        def _initialize_kv_cache(self, batch_size, dtype, device):
            for block in self.generator.model.blocks[: self.num_transformer_blocks]:
                block.self_attn.sink_size = self.num_sink_tokens
                block.self_attn.adapt_sink_thr = self.adapt_sink_threshold
            shape = [batch_size, self.kv_cache_length, self.num_heads, head_dim]
            steps = len(self.denoising_step_list)
            self.kv_cache1 = sfh.kv_cache_dicts(
                self.num_transformer_blocks, shape, dtype, device, total_steps=steps, current_step=steps
            )

        def _initialize_crossattn_cache(self, batch_size, dtype, device):
            shape = [batch_size, p.text_len, self.num_heads, head_dim]
            self.crossattn_cache = sfh.crossattn_cache_dicts(
                self.num_transformer_blocks, shape, dtype, device
            )

    # their --step N: the first N non-zero timesteps, then the 0 that t2v: false drops again
    step_list = [t for t in DENOISING_STEP_LIST if t][:steps] + [0]
    args = types.SimpleNamespace(
        model_type="T2V-1.3B", model_name="wan", generator_name="causal_wan", denoising_step_list=step_list,
        t2v=False, warp_denoising_step=True, height=height, width=width, num_kv_cache=kv_cache_frames,
        num_sink_tokens=sink_frames, adapt_sink_threshold=adapt_sink_threshold, num_frame_per_block=chunk_frames,
    )  # fmt: skip
    wrapper = reference_wrapper(sd, reference_model(sd, ours))
    device = ours.patch_embedding.weight.device
    with _registry(sd, wrapper, _PromptFeatures(context)), contextlib.redirect_stdout(io.StringIO()):
        pipe = Sized(args, device=device)
    tokens = (height // 8 // p.patch_size[1]) * (width // 8 // p.patch_size[2])
    if pipe.frame_seq_length != tokens:
        raise RuntimeError(
            f"their frame_seq_length {pipe.frame_seq_length} is not this model's {tokens} tokens a frame"
        )
    pipe.num_transformer_blocks, pipe.num_heads = p.num_layers, p.num_heads
    return pipe


# -- one run of theirs -----------------------------------------------------------------------------------------------
@dataclass
class ReferenceRun:
    latents: torch.Tensor  # [B, C, F, h, w] float32 on the CPU (our layout)
    timesteps: list[float]  # their warped denoising_step_list (0..1000)
    sigmas: list[float]  # their scheduler's sigma at each of those timesteps
    forwards: int  # generator forwards over the whole stream
    writes: list[list[int]]  # per forward: the frame slots of layer 0's key cache it changed


def first_sigma(pipe) -> float:
    """The sigma their scheduler holds at their first denoising timestep: the noise scale that matches it."""
    return _sigmas_at(pipe, pipe.denoising_step_list[:1])[0]


def _sigmas_at(pipe, timesteps) -> list[float]:
    table, grid = pipe.scheduler.sigmas.cpu(), pipe.scheduler.timesteps.cpu()
    ids = [int(torch.argmin((grid - float(t)).abs())) for t in timesteps]
    return [float(table[i]) for i in ids]


def run_reference(
    sd: StreamDiffusionV2, pipe, inputs: torch.Tensor, noise: StreamNoise, noise_scale: float
) -> ReferenceRun:
    """One stream of their loop: ``inputs [B, C, F, h, w]`` (our layout, ``F`` whole chunks) restyled chunk by
    chunk at ``noise_scale`` (fixed) with ``noise`` (our session's draws, see the module docstring)."""
    c, fs = pipe.num_frame_per_block, pipe.frame_seq_length
    chunks = inputs.shape[2] // c
    if len(noise.start) != chunks:
        raise ValueError(f"{len(noise.start)} chunks of noise for {chunks} input chunks")
    timesteps = [float(t) for t in pipe.denoising_step_list]
    current_step = pipe.denoising_step_list[0].clone()  # fixed noise: their first timestep, every chunk
    writes: list[list[int]] = []
    before: list[torch.Tensor] = []

    def snapshot(*_):
        before.append(pipe.kv_cache1[0]["k"].clone() if pipe.kv_cache1 is not None else None)

    def changed(*_):
        old, new = before.pop(), pipe.kv_cache1[0]["k"]
        frames = new.shape[1] // fs
        diff = (new != old) if old is not None else torch.ones_like(new, dtype=torch.bool)
        per_frame = diff.reshape(new.shape[0], frames, fs, -1).any(dim=(0, 2, 3))
        writes.append([i for i in range(frames) if bool(per_frame[i])])

    wrapper = pipe.generator
    hooks = [wrapper.register_forward_pre_hook(snapshot), wrapper.register_forward_hook(changed)]
    for block in wrapper.model.blocks:
        block.self_attn.evict_idx = None  # their ring queue lives on the module: a fresh stream starts empty
    module = sd.stream_inference
    outs = []
    try:
        module.torch = _TorchWithNoise(noise.draws())
        their = inputs.permute(0, 2, 1, 3, 4)  # [B, F, C, h, w]
        with torch.inference_mode(), warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            for k in range(chunks):
                latents = their[:, k * c : (k + 1) * c].to(wrapper.model.patch_embedding.weight)
                start_noise = noise.start[k].permute(0, 2, 1, 3, 4).to(latents)
                noisy = start_noise * noise_scale + latents * (1 - noise_scale)  # their driver's noising
                start, end = k * c * fs, (k + 1) * c * fs
                if k == 0:
                    out = pipe.prepare(
                        text_prompts=[""], device=latents.device, dtype=latents.dtype, noise=noisy,
                        current_start=start, current_end=end, batch_denoise=False,
                    )  # fmt: skip
                else:
                    out = pipe.inference_wo_batch(
                        noise=noisy, current_start=start, current_end=end, current_step=current_step
                    )
                outs.append(out)
        left = len(module.torch._draws)
    finally:
        module.torch = torch
        for h in hooks:
            h.remove()
    if left:
        raise RuntimeError(f"their loop drew {left} re-noising draws fewer than our session does")
    return ReferenceRun(
        latents=torch.cat(outs, dim=1).permute(0, 2, 1, 3, 4).float().cpu(),
        timesteps=timesteps,
        sigmas=_sigmas_at(pipe, timesteps),
        forwards=len(writes),
        writes=writes,
    )
