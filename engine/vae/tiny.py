"""Tiny autoencoders behind one object: ``load_tiny_vae(path or "dummy:<variant>")``.

Image variants (TAESD family) and video variants (TAEHV) share the :class:`TinyVAE` interface:

* ``encode(images)`` / ``decode(latents)`` in the tiny AE's own latent space, which is the space the diffusion
  model works in. Images are RGB in [0, 1]: ``[N, 3, H, W]`` for image variants, ``[N, T, 3, H, W]`` for video;
  latents are ``[N, C, h, w]`` or ``[N, C, T, h, w]`` (ComfyUI's layout, channels at dim 1).
* ``raw_to_latent`` / ``latent_to_raw``: to and from ComfyUI's raw VAE latents (its ``LATENT``), with the
  family's scale and shift (per channel for Wan). For FLUX.2 this is also a change of layout: ComfyUI's LATENT is
  the 32-channel latent 2x2-patchified to 128 channels at 1/16, taef2 works on the 32 channels at 1/8, so the
  conversion un-patchifies / patchifies (a permutation of the values, nothing is computed), as ComfyUI's own
  taesd does. ``decode_raw`` / ``encode_raw`` are decode / encode on ComfyUI LATENTs.
* ``stream_decoder()`` (video): decode chunk by chunk, frame-exact with decoding all at once.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch
from torch import nn

from .. import latent_formats as lf
from ..checks import check_finite
from ..errors import CheckpointError, InputError
from ..loader import DUMMY_PREFIX, default_compute_dtype, resolve_device
from ..preflight.budget import check_fits
from ..preflight.ledger import LEDGER, tensor_bytes_on
from ..weights import check_keys, dummy_init_, read_state_dict, top_level_summary
from . import taehv, taesd


@dataclass(frozen=True)
class TinyVariant:
    name: str
    kind: str  # "image" | "video"
    latent_format: lf.LatentFormat  # ComfyUI raw latent <-> this AE's latent space
    spatial_factor: int
    temporal_factor: int
    models: str
    # ComfyUI's LATENT for this AE when it is not the AE's own latent, and the side of the patch it packs into
    # channels (FLUX.2: the 32-channel latent, 2x2 patches, 128 channels at 1/16); None: the AE's own latent
    comfy_latent: lf.LatentFormat | None = None
    latent_patch: int = 1

    @property
    def channels(self) -> int:
        """Channels of the AE's own latent (what ``encode`` returns and ``decode`` takes)."""
        return self.latent_format.channels

    @property
    def comfy_format(self) -> lf.LatentFormat:
        """The LatentFormat of ComfyUI's LATENT for this AE (what ``raw_to_latent`` takes)."""
        return self.comfy_latent or self.latent_format

    @property
    def raw_channels(self) -> int:
        """Channels of ComfyUI's LATENT for this AE (128 for taef2, else ``channels``)."""
        return self.channels * self.latent_patch**2

    @property
    def raw_downscale(self) -> int:
        """Image pixels per pixel of ComfyUI's LATENT along each side (16 for taef2)."""
        return self.spatial_factor * self.latent_patch


TINY_VARIANTS: dict[str, TinyVariant] = {
    v.name: v
    for v in (
        TinyVariant("taesd", "image", lf.SD15, 8, 1, "SD 1.x / 2.x"),
        TinyVariant("taesdxl", "image", lf.SDXL, 8, 1, "SDXL"),
        TinyVariant("taesd3", "image", lf.SD3, 8, 1, "SD3 / SD3.5"),
        TinyVariant("taef1", "image", lf.FLUX1, 8, 1, "FLUX.1, Z-Image, HiDream"),
        TinyVariant("taef2", "image", lf.FLUX2_RAW, 8, 1, "FLUX.2", comfy_latent=lf.FLUX2, latent_patch=2),
        TinyVariant("taesana", "image", lf.SANA_DCAE, 32, 1, "Sana (DC-AE f32c32)"),
        TinyVariant("taew2_1", "video", lf.WAN21, 8, 4, "Wan 2.1 (and Qwen-Image)"),
        # ComfyUI 0.8.0's VAELoader lists it from vae_approx by this name; it decodes the LATENT as it is
        TinyVariant(
            "lighttaew2_1", "video", lf.WAN21_RAW, 8, 4, "Wan 2.1, LightX2V LightTAE", comfy_latent=lf.WAN21
        ),
        TinyVariant("taew2_2", "video", lf.WAN22, 16, 4, "Wan 2.2 5B"),
        TinyVariant("taehv", "video", lf.HUNYUAN_VIDEO, 8, 4, "HunyuanVideo"),
    )
}


def patchify_latent(z: torch.Tensor, patch: int) -> torch.Tensor:
    """``[B, C, H, W] -> [B, C * patch^2, H / patch, W / patch]``, channel ``c * patch^2 + i * patch + j`` holding
    pixel ``(patch * y + i, patch * x + j)`` of channel c: the FLUX.2 autoencoder's 2x2 patchify (the order its
    128-channel latent and ComfyUI's FLUX.2 LATENT have)."""
    if patch == 1:
        return z
    b, c, h, w = z.shape
    z = z.reshape(b, c, h // patch, patch, w // patch, patch).permute(0, 1, 3, 5, 2, 4)
    return z.reshape(b, c * patch * patch, h // patch, w // patch)


def unpatchify_latent(x: torch.Tensor, patch: int) -> torch.Tensor:
    """The exact inverse of :func:`patchify_latent`: ``[B, C * patch^2, h, w] -> [B, C, h * patch, w * patch]``."""
    if patch == 1:
        return x
    b, cp, h, w = x.shape
    c = cp // (patch * patch)
    x = x.reshape(b, c, patch, patch, h, w).permute(0, 1, 4, 2, 5, 3)
    return x.reshape(b, c, h * patch, w * patch)


def variants_for(fmt: lf.LatentFormat, kind: str = "image") -> list[TinyVariant]:
    """The tiny AEs whose ComfyUI LATENT is ``fmt`` (``FLUX1``: taef1; ``FLUX2``: taef2)."""
    return [v for v in TINY_VARIANTS.values() if v.kind == kind and v.comfy_format == fmt]


def _taehv():
    return taehv


class TinyVAE:
    """A loaded tiny autoencoder (either part may be absent when only one file was given)."""

    def __init__(
        self, variant: TinyVariant, encoder: nn.Module | None, decoder: nn.Module | None, video=None
    ):
        self.variant = variant
        self.encoder = encoder
        self.decoder = decoder
        self.video = video  # the TAEHV module for video variants (holds both parts)

    @property
    def device(self) -> torch.device:
        return next(
            p for m in (self.encoder, self.decoder, self.video) if m is not None for p in m.parameters()
        ).device

    @property
    def dtype(self) -> torch.dtype:
        return next(
            p for m in (self.encoder, self.decoder, self.video) if m is not None for p in m.parameters()
        ).dtype

    def describe(self) -> str:
        parts = [p for p, m in (("encoder", self.encoder), ("decoder", self.decoder)) if m is not None]
        return f"{self.variant.name} ({self.variant.models}, {self.variant.channels} latent channels): {' + '.join(parts)}"

    # -- ComfyUI raw latents ---------------------------------------------------------------------------------
    def raw_to_latent(self, raw: torch.Tensor) -> torch.Tensor:
        """ComfyUI's LATENT -> this AE's latent (taef2: 128 channels at 1/16 -> 32 channels at 1/8)."""
        v = self.variant
        return v.latent_format.process_in(unpatchify_latent(raw, v.latent_patch))

    def latent_to_raw(self, latent: torch.Tensor) -> torch.Tensor:
        """This AE's latent -> ComfyUI's LATENT (taef2: 32 channels at 1/8 -> 128 channels at 1/16)."""
        v = self.variant
        return patchify_latent(v.latent_format.process_out(latent), v.latent_patch)

    @torch.inference_mode()
    def decode_raw(self, raw: torch.Tensor, input_name: str = "latent") -> torch.Tensor:
        """Decode a ComfyUI LATENT (what samplers output) to RGB in [0, 1]."""
        self.check_raw_latents(raw, input_name)
        return self.decode(self.raw_to_latent(raw.to(torch.float32)))

    @torch.inference_mode()
    def encode_raw(self, images: torch.Tensor) -> torch.Tensor:
        """Encode RGB in [0, 1] to a ComfyUI LATENT (float32, on the AE's device)."""
        self.check_images(images, multiple=self.variant.raw_downscale)
        return self.latent_to_raw(self.encode(images).float())

    # -- checks ----------------------------------------------------------------------------------------------
    def check_raw_latents(self, raw: torch.Tensor, input_name: str = "latent") -> None:
        """A ComfyUI LATENT this AE decodes: for taef2 FLUX.2's 128-channel one; else as :meth:`check_latents`."""
        v = self.variant
        if v.latent_patch == 1:
            return self.check_latents(raw, input_name)
        fmt = v.comfy_format
        if raw.ndim != 4 or raw.shape[1] != v.raw_channels:
            raise InputError(
                input_name,
                f"{v.name} ({v.models}) decodes {fmt.name} LATENTs [batch, {v.raw_channels}, height/"
                f"{v.raw_downscale}, width/{v.raw_downscale}] (its {v.channels}-channel latent, "
                f"{v.latent_patch}x{v.latent_patch}-patchified); got shape {list(raw.shape)}"
                + _decoded_by(raw, v.name),
            )
        if raw.numel() == 0:
            raise InputError(input_name, f"no latents to decode (shape {list(raw.shape)})")
        check_finite(raw, input_name, "the latents")

    def check_latents(self, latents: torch.Tensor, input_name: str = "latent") -> None:
        v = self.variant
        if v.kind == "image" and latents.ndim == 5:
            video = [n for n, t in TINY_VARIANTS.items() if t.kind == "video"]
            raise InputError(
                input_name,
                f"a video latent {list(latents.shape)} was given to the image-only tiny AE "
                f"{v.name}; decode video with a TAEHV variant ({', '.join(video)})",
            )
        want = 4 if v.kind == "image" else 5
        layout = (
            "[batch, channels, height, width]" if want == 4 else "[batch, channels, frames, height, width]"
        )
        if latents.ndim != want or latents.shape[1] != v.channels:
            raise InputError(
                input_name,
                f"{v.name} ({v.models}) decodes {v.channels}-channel latents {layout}; "
                f"got shape {list(latents.shape)}" + _decoded_by(latents, v.name),
            )
        if latents.numel() == 0:
            raise InputError(input_name, f"no latents to decode (shape {list(latents.shape)})")
        check_finite(latents, input_name, "the latents")

    def check_images(
        self, images: torch.Tensor, input_name: str = "images", multiple: int | None = None
    ) -> None:
        """RGB in [0, 1], height and width a multiple of the AE's downscale (``multiple``: of ComfyUI's LATENT's,
        16 for taef2, when encoding to it)."""
        v = self.variant
        want = 4 if v.kind == "image" else 5
        layout = "[N, 3, H, W]" if want == 4 else "[N, T, 3, H, W]"
        if images.ndim != want or images.shape[-3] != 3:
            hint = " (channels last? ComfyUI's IMAGE is [B, H, W, 3])" if images.shape[-1] == 3 else ""
            raise InputError(
                input_name, f"{v.name} encodes RGB images {layout}; got shape {list(images.shape)}{hint}"
            )
        if images.numel() == 0:
            raise InputError(input_name, f"no images to encode (shape {list(images.shape)})")
        if not images.is_floating_point():
            raise InputError(input_name, f"expected float images in [0, 1]; got {images.dtype}")
        check_finite(images, input_name, "the images")
        lo, hi = float(images.min()), float(images.max())
        if lo < -1e-3 or hi > 1 + 1e-3:
            raise InputError(
                input_name,
                f"image values must be in [0, 1]; got [{lo:.3f}, {hi:.3f}] "
                "(images in [-1, 1] need (x + 1) / 2)",
            )
        f = multiple or v.spatial_factor
        if images.shape[-1] % f or images.shape[-2] % f:
            raise InputError(
                input_name,
                f"{v.name} needs height and width divisible by {f}; "
                f"got {images.shape[-2]}x{images.shape[-1]}",
            )

    def _need(self, part: str) -> nn.Module:
        module = self.encoder if part == "encoder" else self.decoder
        if module is None:
            raise InputError(
                "vae",
                f"this {self.variant.name} was loaded without its {part} "
                f"(give the {self.variant.name}_{part} file too)",
            )
        return module

    # -- encode / decode ---------------------------------------------------------------------------------------
    @torch.inference_mode()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        self.check_latents(latents)
        f = self.variant.spatial_factor
        frames = 1 if self.variant.kind == "image" else latents.shape[2]
        self._check_fits(self.decode_bytes(latents.shape[0], frames, latents.shape[-2] * f, latents.shape[-1] * f),
                         "latent")  # fmt: skip
        decoder = self._need("decoder")
        z = latents.to(self.device, self.dtype)
        if self.variant.kind == "image":
            return decoder(z.contiguous(memory_format=torch.channels_last)).clamp(0, 1)
        return self.video.decode_video(z.transpose(1, 2))

    @torch.inference_mode()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        self.check_images(images)
        frames = 1 if self.variant.kind == "image" else images.shape[1]
        self._check_fits(
            self.encode_bytes(images.shape[0], frames, images.shape[-2], images.shape[-1]), "images"
        )
        encoder = self._need("encoder")
        x = images.to(self.device, self.dtype)
        if self.variant.kind == "image":
            return encoder(x.contiguous(memory_format=torch.channels_last))
        return self.video.encode_video(x).transpose(1, 2)

    # -- memory estimates (the preflight's input; the formulas belong to the modules that run the layers) --------
    def decode_bytes(self, batch: int, latent_frames: int, height: int, width: int) -> dict[str, int]:
        """Peak bytes of decoding ``batch`` latents (of ``latent_frames`` frames each, for video; 1 for an image)
        to ``height x width`` images, by part: the decoder's full-resolution activations and the RGB output. For
        video this is also one chunk of :class:`StreamDecoder` (``latent_frames`` = the chunk's): TAEHV decodes 4
        frames per latent frame before trimming the first ones, and counts all of them."""
        elt = torch.empty((), dtype=self.dtype).element_size()
        if self.variant.kind == "image":
            activations = taesd.activation_bytes(batch, height, width, elt)
            images = batch
        else:
            patch = self.video.patch_size
            activations = _taehv().decode_activation_bytes(batch, latent_frames, height, width, elt, patch)
            images = batch * 4 * latent_frames
        return {"decoder activations": activations, "RGB output": images * 3 * height * width * 4}

    def encode_bytes(self, batch: int, frames: int, height: int, width: int) -> dict[str, int]:
        """Peak bytes of encoding ``batch`` images (videos of ``frames`` frames) of ``height x width``, by part."""
        elt = torch.empty((), dtype=self.dtype).element_size()
        if self.variant.kind == "image":
            activations = taesd.activation_bytes(batch, height, width, elt) + batch * 3 * height * width * elt
        else:
            patch = self.video.patch_size
            activations = _taehv().encode_activation_bytes(batch, frames, height, width, elt, patch)
        return {"encoder activations": activations}

    def _check_fits(self, parts: dict[str, int], input_name: str) -> None:
        """Refuse before running when the activations cannot fit the device."""
        check_fits(parts, self.device, input_name, hint="Decode / encode fewer or smaller images at a time")

    def stream_decoder(self) -> StreamDecoder:
        if self.variant.kind != "video":
            raise InputError(
                "vae", f"{self.variant.name} is an image autoencoder; streaming decode is for video"
            )
        self._need("decoder")
        return StreamDecoder(self)


class StreamDecoder:
    """Chunk-by-chunk video decoding: ``push(latents [N, C, t, h, w]) -> frames [N, k, 3, H, W]``."""

    def __init__(self, vae: TinyVAE):
        self.vae = vae
        self.state = _taehv().TAEHVStreamDecoder(vae.video)

    @property
    def frames_decoded(self) -> int:
        return self.state.frames_decoded

    @torch.inference_mode()
    def push(self, latents: torch.Tensor) -> torch.Tensor:
        self.vae.check_latents(latents)
        return self.state.push(latents.to(self.vae.device, self.vae.dtype).transpose(1, 2))

    def reset(self) -> None:
        self.state.reset()

    def get_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """What the decoder carries between chunks: each MemBlock's last input (tensors, by index) and the frame
        count and latent shape (JSON). A swap or a snapshot of a video session saves it."""
        st = self.state
        memory = {} if st.memory is None else {str(i): m for i, m in enumerate(st.memory)}
        shape = None if st._latent_shape is None else list(st._latent_shape)
        return memory, {
            "frames_decoded": st.frames_decoded,
            "latent_shape": shape,
            "started": st.memory is not None,
        }

    def set_state(self, memory: dict[str, torch.Tensor], meta: dict) -> None:
        """The inverse of :meth:`get_state` (tensors moved to the decoder's device and dtype)."""
        st = self.state
        st.memory = (
            [memory[str(i)].to(self.vae.device, self.vae.dtype) for i in range(len(memory))]
            if meta["started"] else None
        )  # fmt: skip
        st.frames_decoded = int(meta["frames_decoded"])
        st._latent_shape = None if meta["latent_shape"] is None else tuple(meta["latent_shape"])


# -- loading -----------------------------------------------------------------------------------------------------


def _pick(candidates: list[str], filename: str, input_name: str, what: str) -> str:
    """Break a tie between variants that share tensor shapes by the file name (longest match wins)."""
    if len(candidates) == 1:
        return candidates[0]
    base = os.path.basename(filename).lower()
    named = sorted((c for c in candidates if c in base), key=len, reverse=True)
    if named:
        return named[0]
    raise InputError(
        input_name,
        f"{what} fits {' and '.join(candidates)} equally (same tensor shapes) and the file "
        f"name does not say which; rename the file to contain the variant name or pass variant=",
    )


def _sibling(path: str, part: str) -> str | None:
    other = "encoder" if part == "decoder" else "decoder"
    base = os.path.basename(path)
    if f"_{part}" not in base:
        return None
    candidate = os.path.join(os.path.dirname(path), base.replace(f"_{part}", f"_{other}"))
    return candidate if os.path.isfile(candidate) else None


def _split_prefixed(sd: dict) -> dict[str, dict]:
    """``{"encoder": {...}, "decoder": {...}}`` for files that hold both parts under a prefix, in the TAESD
    Sequential's own numbering (diffusers' ``encoder.layers.N`` layout renumbered, see :func:`_from_diffusers`)."""
    parts: dict[str, dict] = {}
    for key, value in sd.items():
        head, _, rest = key.partition(".")
        for part in ("encoder", "decoder"):
            if head in (part, f"taesd_{part}") or head.endswith(f"_{part}"):
                parts.setdefault(part, {})[rest] = value
    return {part: _from_diffusers(part, sub) for part, sub in parts.items()}


_DIFFUSERS_KEY = re.compile(r"layers\.(\d+)\.(.+)")  # diffusers AutoencoderTiny: layers.<index>.<rest>


def _from_diffusers(part: str, sd: dict) -> dict:
    """A part in diffusers' AutoencoderTiny layout (``layers.N.<rest>``: madebyollin's taef1 / taef2 safetensors on
    Hugging Face) renumbered as the TAESD Sequential: the decoder's soft clamp, index 0 of the Sequential, is no
    module in diffusers, so the decoder's indices there are one lower (the remap on the taef2 model card)."""
    numbered = [_DIFFUSERS_KEY.fullmatch(k) for k in sd]
    if not sd or not all(numbered):  # not that layout: the strict loader names what does not fit
        return sd
    shift = 1 if part == "decoder" else 0
    return {f"{int(m[1]) + shift}.{m[2]}": value for m, value in zip(numbered, sd.values())}


def _load_module(module: nn.Module, sd: dict, source: str, input_name: str) -> None:
    check_keys(module, sd, source, input_name)
    module.load_state_dict(sd, strict=True)


def load_tiny_vae(
    source: str | os.PathLike,
    variant: str | None = None,
    device=None,
    dtype: torch.dtype | None = None,
    seed: int = 0,
    input_name: str = "vae",
) -> TinyVAE:
    """A tiny VAE from a file (``.pth`` / ``.safetensors``, one part or both; both parts also in diffusers'
    AutoencoderTiny layout, as madebyollin's taef1 / taef2 Hugging Face files are) or ``dummy:<variant>``.

    The variant is inferred from the tensors (latent channels, 8x or 32x, the FLUX.2 pooling branch, TAEHV's
    memory blocks and patch size); the file name only breaks ties (taesd vs taesdxl, taesd3 vs taef1, taew2_1
    vs lighttaew2_1 vs taehv: the longest variant name the file name contains, so the names ComfyUI's own
    VAELoader reads from vae_approx, lighttaew2_1.* and taehv.*, load as those). Given one part of a TAESD pair (``taef1_decoder.pth``), the other part next to it is loaded too.
    """
    dev = resolve_device(device)
    dtype = dtype or default_compute_dtype(dev)
    source = os.fspath(source)
    if variant is not None and variant not in TINY_VARIANTS:
        raise InputError(
            "variant", f"unknown tiny VAE variant {variant!r}; known: {', '.join(TINY_VARIANTS)}"
        )
    if source.startswith(DUMMY_PREFIX):
        name = source[len(DUMMY_PREFIX) :]
        if name not in TINY_VARIANTS:
            raise InputError(
                input_name, f"unknown tiny VAE 'dummy:{name}'; known: {', '.join(TINY_VARIANTS)}"
            )
        vae = _build(TINY_VARIANTS[name], ("encoder", "decoder"))
        for module in (vae.encoder, vae.decoder):
            dummy_init_(module, seed)
        return _finish(vae, dev, dtype)

    sd = read_state_dict(source, input_name)
    name = os.path.basename(source)
    taehv = _taehv()
    video_candidates = taehv.detect_taehv(sd)
    if video_candidates:
        chosen = variant or _pick(video_candidates, source, input_name, f"{name} (a TAEHV video autoencoder)")
        _check_variant(chosen, video_candidates, name, input_name)
        vae = _build(TINY_VARIANTS[chosen], ("encoder", "decoder"))
        _load_module(vae.video, sd, name, input_name)
        return _finish(vae, dev, dtype)

    parts = _split_prefixed(sd) or {None: sd}
    found: dict[str, tuple[dict, list[str], str]] = {}
    for sub in parts.values():
        detected = taesd.detect_taesd(sub)
        if detected is None:
            raise CheckpointError(
                input_name,
                f"{name} is not a tiny autoencoder this pack knows.\n"
                f"  top-level keys found: {top_level_summary(sd)}\n  known: TAESD family "
                "(nn.Sequential keys 0.weight, 3.conv.0.weight, ...: taesd, taesdxl, taesd3, "
                "taef1, taef2, taesana) and TAEHV (encoder.*/decoder.* with memory blocks: "
                "taew2_1, lighttaew2_1, taew2_2, taehv)",
            )
        part, candidates = detected
        found[part] = (sub, candidates, name)
    if len(found) == 1:
        ((part, (sub, candidates, _)),) = found.items()
        sibling = _sibling(source, part)
        if sibling is not None:
            other_sd = read_state_dict(sibling, input_name)
            detected = taesd.detect_taesd(other_sd)
            if detected is not None and detected[0] != part:
                found[detected[0]] = (other_sd, detected[1], os.path.basename(sibling))
    candidates = sorted(set.intersection(*(set(c) for _, c, _ in found.values())))
    if not candidates:
        raise CheckpointError(
            input_name,
            f"{name}: encoder and decoder belong to different variants "
            f"({', '.join(f'{p}: {c}' for p, (_, c, _) in found.items())})",
        )
    chosen = variant or _pick(candidates, source, input_name, f"{name} (a TAESD {next(iter(found))})")
    _check_variant(chosen, candidates, name, input_name)
    vae = _build(TINY_VARIANTS[chosen], tuple(found))
    for part, (sub, _, fname) in found.items():
        _load_module(getattr(vae, part), sub, fname, input_name)
    return _finish(vae, dev, dtype)


def _decoded_by(latents: torch.Tensor, refused_by: str) -> str:
    """The hint for a latent given to the wrong tiny AE: which other variants decode a ComfyUI LATENT of its
    channels."""
    if latents.ndim not in (4, 5):
        return ""
    kind = "image" if latents.ndim == 4 else "video"
    fits = [
        v
        for v in TINY_VARIANTS.values()
        if v.kind == kind and v.raw_channels == latents.shape[1] and v.name != refused_by
    ]
    if not fits:
        return ""
    names = " or ".join(f"{v.name} ({v.models})" for v in fits)
    return f"; a {latents.shape[1]}-channel {kind} LATENT decodes with {names}"


def _check_variant(chosen: str, candidates: list[str], name: str, input_name: str) -> None:
    if chosen not in candidates:
        raise InputError(
            input_name,
            f"{name} holds a {'/'.join(candidates)} autoencoder, not {chosen} "
            f"({TINY_VARIANTS[chosen].channels} channels expected)",
        )


def _build(variant: TinyVariant, parts: tuple[str, ...]) -> TinyVAE:
    if variant.kind == "video":
        taehv = _taehv()
        video = taehv.TAEHV(taehv.TAEHV_CONFIGS[variant.name])
        return TinyVAE(variant, video.encoder, video.decoder, video=video)
    encoder = taesd.build_encoder(variant.name) if "encoder" in parts else None
    decoder = taesd.build_decoder(variant.name) if "decoder" in parts else None
    return TinyVAE(variant, encoder, decoder)


def _finish(vae: TinyVAE, device, dtype) -> TinyVAE:
    for module in (vae.encoder, vae.decoder, vae.video):
        if module is not None:
            # channels_last: the layout oneDNN (CPU) and cuDNN run convolutions fastest in (1.5x for TAESD on CPU)
            module.to(device=device, dtype=dtype, memory_format=torch.channels_last).eval().requires_grad_(
                False
            )
    # counted in the memory ledger while it is alive (the preflight's budget under FEWSTEP_MEMORY_LIMIT_GB)
    LEDGER.hold(vae, "model", _weight_bytes_on)
    return vae


def _weight_bytes_on(vae: TinyVAE, device: torch.device) -> int:
    modules = (
        [vae.video] if vae.video is not None else [m for m in (vae.encoder, vae.decoder) if m is not None]
    )
    return sum(tensor_bytes_on(m, device) for m in modules)
