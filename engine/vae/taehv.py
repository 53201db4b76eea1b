"""TAEHV: tiny temporal autoencoders for Wan 2.1, Wan 2.2 5B and HunyuanVideo latents (madebyollin/taehv).

Both halves are stacks of 2-D layers applied to every frame, with three exceptions along time: a
:class:`MemBlock` also reads its own input at the previous frame (zeros before the first frame), a
:class:`TPool` merges consecutive frames into one (encoder) and a :class:`TGrow` splits each frame into
several (decoder). Nothing reads a later frame, so a video can be run through a stack chunk by chunk, all frames
of a chunk at once, if every MemBlock's last input frame is carried over: that is :class:`TAEHVStreamDecoder`.

``encoder`` and ``decoder`` are ``nn.Sequential`` stacks laid out as in the original, so the published files
(``encoder.0.weight``, ``decoder.3.conv.0.weight``, ...) load strictly without renaming. Frames are RGB in [0, 1],
``[N, T, 3, H, W]``; latents are ``[N, T, C, h, w]`` in the video model's latent space.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import InputError
from .fused_conv import conv_add_relu, conv_relu

IMAGE_CHANNELS = 3
ENCODER_WIDTH = 64
DECODER_WIDTHS = (256, 128, 64, 64)  # per decoder stage, then the width before the output conv

# Feature maps of the last (full-resolution) width alive at once per frame at the peak, for the memory preflight.
# The decoder's last stage holds the time-split frames, the output of the 64 -> 64 conv and the copy the CPU's
# oneDNN convolution reorders its input into (3 maps); the encoder's first convolutions the same. Measured peak
# RSS growth on the CPU in fp32 (tests/engine/preflight/test_memory_estimates.py): 2.8 to 3.0 maps per decoded frame for the
# decoder (chunks of 1 to 3 latent frames), 2.6 per (padded) input frame for the encoder; 4 keeps a margin.
FULL_RESOLUTION_MAPS = 4


@dataclass(frozen=True)
class TAEHVConfig:
    name: str
    latent_channels: int
    patch_size: int  # frames are pixel-unshuffled by this before the encoder (and shuffled after the decoder)
    encoder_time_downscale: tuple[bool, bool, bool] = (True, True, False)
    decoder_time_upscale: tuple[bool, bool, bool] = (False, True, True)

    @property
    def spatial_scale(self) -> int:
        return 8 * self.patch_size


TAEHV_CONFIGS: dict[str, TAEHVConfig] = {
    c.name: c
    for c in (
        TAEHVConfig("taew2_1", latent_channels=16, patch_size=1),
        # LightX2V's LightTAE for Wan 2.1: taew2_1's layout (every key and shape), trained on un-normalized latents
        TAEHVConfig("lighttaew2_1", latent_channels=16, patch_size=1),
        TAEHVConfig("taew2_2", latent_channels=48, patch_size=2),
        TAEHVConfig("taehv", latent_channels=16, patch_size=1),
    )
}


def decode_activation_bytes(
    batch: int, latent_frames: int, height: int, width: int, dtype_bytes: int, patch_size: int = 1
) -> int:
    """Peak activation bytes of decoding ``latent_frames`` latent frames at once to ``height x width`` frames
    (the whole video in ``decode_video``, one chunk in :class:`TAEHVStreamDecoder`): every latent frame is
    decoded to ``4`` frames before the first ones are trimmed, each holding :data:`FULL_RESOLUTION_MAPS` maps of
    the last decoder width at the resolution before the pixel shuffle. The decoded RGB frames are not included
    (the caller counts them in the dtype it keeps them in)."""
    frames = batch * 4 * latent_frames
    pixels = (height // patch_size) * (width // patch_size)
    return frames * pixels * FULL_RESOLUTION_MAPS * DECODER_WIDTHS[-1] * dtype_bytes


def encode_activation_bytes(
    batch: int, frames: int, height: int, width: int, dtype_bytes: int, patch_size: int = 1
) -> int:
    """Peak activation bytes of encoding ``frames`` RGB frames (padded to a multiple of 4, as ``encode_video``
    does): :data:`FULL_RESOLUTION_MAPS` encoder-width maps per frame at the resolution after the pixel unshuffle,
    plus the frames' copy in the compute dtype."""
    padded = batch * (frames + (-frames % 4))
    pixels = (height // patch_size) * (width // patch_size)
    return (
        padded
        * pixels
        * (FULL_RESOLUTION_MAPS * ENCODER_WIDTH + IMAGE_CHANNELS * patch_size**2)
        * dtype_bytes
    )


def _conv3x3(n_in: int, n_out: int, stride: int = 1, bias: bool = True) -> nn.Conv2d:
    return nn.Conv2d(n_in, n_out, 3, stride=stride, padding=1, bias=bias)


class SoftClamp(nn.Module):
    """Squashes decoder inputs smoothly into (-3, 3), so outlier latents cannot blow up the decode."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(x / 3) * 3


class MemBlock(nn.Module):
    """Residual block whose convs see the frame and the block's input at the previous frame."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Sequential(
            _conv3x3(2 * channels, channels), nn.ReLU(inplace=True),
            _conv3x3(channels, channels), nn.ReLU(inplace=True),
            _conv3x3(channels, channels),
        )  # fmt: skip

    def forward(self, x: Tensor, previous: Tensor) -> Tensor:
        # self.conv's ReLUs in place, the residual add inside the last convolution, then the ReLU (fused_conv.py)
        h = conv_relu(self.conv[2], conv_relu(self.conv[0], torch.cat((x, previous), 1)))
        return conv_add_relu(self.conv[4], h, x)


class TPool(nn.Module):
    """Merges every ``stride`` consecutive frames into one (a 1x1 conv over their stacked channels)."""

    def __init__(self, channels: int, stride: int):
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv2d(channels * stride, channels, 1, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        frames, channels, height, width = x.shape
        if self.stride == 1:
            return self.conv(x)
        # frame n * stride + k -> channels [k * C, (k + 1) * C) of frame n, written straight into a channels-last
        # tensor (a reshape would copy to the contiguous layout, and the conv would convert it back)
        merged = _channels_last_empty(x, (frames // self.stride, self.stride * channels, height, width))
        merged.view(-1, self.stride, channels, height, width).copy_(
            x.view(-1, self.stride, channels, height, width)
        )
        return self.conv(merged)


class TGrow(nn.Module):
    """Splits every frame into ``stride`` consecutive frames (a 1x1 conv to ``stride`` times the channels)."""

    def __init__(self, channels: int, stride: int):
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv2d(channels, channels * stride, 1, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        frames, channels, height, width = x.shape
        grown = self.conv(x)
        if self.stride == 1:
            return grown
        # channels [k * C, (k + 1) * C) of frame n -> frame n * stride + k, kept channels-last (as in TPool)
        split = _channels_last_empty(grown, (frames * self.stride, channels, height, width))
        split.view(frames, self.stride, channels, height, width).copy_(
            grown.view(frames, self.stride, channels, height, width)
        )
        return split


def _channels_last_empty(like: Tensor, shape: tuple[int, int, int, int]) -> Tensor:
    return torch.empty(shape, dtype=like.dtype, device=like.device, memory_format=torch.channels_last)


Memory = list[Tensor]  # per MemBlock of a stack, in order: its input at the last frame seen, [N, C, H, W]


def run_frames(blocks: nn.Sequential, x: Tensor, memory: Memory | None) -> tuple[Tensor, Memory]:
    """Apply ``blocks`` to the frames ``x`` [N, T, C, H, W], all frames at once, one block after the other.

    ``memory`` continues a video after its earlier frames (None starts one). Returns the output frames and the
    memory after ``x``. Each TPool needs the frame count at its input to be a multiple of its stride.

    The frames run in the channels-last layout, as the weights are stored (``tiny._finish``): the layout oneDNN
    (CPU) and cuDNN run these convolutions fastest in (``bench/taehv_layout.py``); the output is
    returned contiguous.
    """
    batch = x.shape[0]
    h = x.flatten(0, 1).contiguous(memory_format=torch.channels_last)
    new_memory: Memory = []
    for block in blocks:
        if isinstance(block, MemBlock):
            frames = h.unflatten(0, (batch, -1))
            # each frame's previous frame, written into a tensor of h's layout (a cat of the 5-D views would
            # come out contiguous and the conv would convert it back)
            previous = torch.empty_like(h)
            shifted = previous.unflatten(0, (batch, -1))
            if memory is None:
                shifted[:, 0].zero_()
            else:
                shifted[:, 0].copy_(memory[len(new_memory)])
            shifted[:, 1:].copy_(frames[:, :-1])
            # a copy, so the state holds one frame per block instead of keeping the whole chunk alive
            new_memory.append(frames[:, -1].clone())
            h = block(h, previous)
        else:
            h = block(h)
    return h.contiguous().unflatten(0, (batch, -1)), new_memory


class TAEHV(nn.Module):
    def __init__(self, config: TAEHVConfig):
        super().__init__()
        self.config = config
        self.latent_channels = config.latent_channels
        self.patch_size = config.patch_size
        pixel_channels = IMAGE_CHANNELS * config.patch_size**2

        encoder: list[nn.Module] = [_conv3x3(pixel_channels, ENCODER_WIDTH), nn.ReLU(inplace=True)]
        for downscale in config.encoder_time_downscale:
            encoder += [
                TPool(ENCODER_WIDTH, 2 if downscale else 1),
                _conv3x3(ENCODER_WIDTH, ENCODER_WIDTH, stride=2, bias=False),
                *(MemBlock(ENCODER_WIDTH) for _ in range(3)),
            ]
        encoder.append(_conv3x3(ENCODER_WIDTH, config.latent_channels))
        self.encoder = nn.Sequential(*encoder)

        decoder: list[nn.Module] = [
            SoftClamp(),
            _conv3x3(config.latent_channels, DECODER_WIDTHS[0]),
            nn.ReLU(inplace=True),
        ]
        stages = zip(DECODER_WIDTHS, DECODER_WIDTHS[1:], config.decoder_time_upscale)
        for width, next_width, upscale in stages:
            decoder += [
                *(MemBlock(width) for _ in range(3)),
                nn.Upsample(scale_factor=2),
                TGrow(width, 2 if upscale else 1),
                _conv3x3(width, next_width, bias=False),
            ]
        decoder += [nn.ReLU(inplace=True), _conv3x3(DECODER_WIDTHS[-1], pixel_channels)]
        self.decoder = nn.Sequential(*decoder)

        self.t_downscale = 2 ** sum(config.encoder_time_downscale)
        self.t_upscale = 2 ** sum(config.decoder_time_upscale)
        # The decoder emits t_upscale frames for the first latent, which stands for one frame only.
        self.frames_to_trim = self.t_upscale - 1

    @property
    def spatial_scale(self) -> int:
        return self.config.spatial_scale

    def _to_weights(self, x: Tensor) -> Tensor:
        weight = self.decoder[1].weight
        return x.to(device=weight.device, dtype=weight.dtype)

    def check_latents(self, latents: Tensor, input_name: str = "latents") -> None:
        if latents.ndim != 5 or latents.shape[2] != self.latent_channels:
            raise InputError(
                input_name,
                f"{self.config.name} decodes {self.latent_channels}-channel latent videos "
                f"[batch, frames, {self.latent_channels}, height, width]; got shape {list(latents.shape)}",
            )

    def check_frames(self, frames: Tensor, input_name: str = "frames") -> None:
        if frames.ndim != 5 or frames.shape[2] != IMAGE_CHANNELS:
            raise InputError(
                input_name,
                f"{self.config.name} encodes RGB videos [batch, frames, 3, height, width]; "
                f"got shape {list(frames.shape)}",
            )
        scale = self.spatial_scale
        if frames.shape[1] == 0 or frames.shape[-2] % scale or frames.shape[-1] % scale:
            raise InputError(
                input_name,
                f"{self.config.name} needs at least one frame and height and width divisible by {scale}; "
                f"got {frames.shape[1]} frames of {frames.shape[-2]}x{frames.shape[-1]}",
            )

    @torch.no_grad()
    def encode_video(self, frames: Tensor) -> Tensor:
        """``[N, T, 3, H, W]`` in [0, 1] -> latents ``[N, ceil(T / 4), C, H / (8p), W / (8p)]``.

        The frame count is padded at the end to a multiple of 4 by repeating the last frame.
        """
        self.check_frames(frames)
        x = self._to_weights(frames)
        if self.patch_size > 1:
            x = F.pixel_unshuffle(x, self.patch_size)
        missing = -x.shape[1] % self.t_downscale
        if missing:
            x = torch.cat((x, x[:, -1:].expand(-1, missing, -1, -1, -1)), 1)
        return run_frames(self.encoder, x, None)[0]

    @torch.no_grad()
    def decode_video(self, latents: Tensor) -> Tensor:
        """Latents ``[N, T, C, h, w]`` -> frames ``[N, 4T - 3, 3, 8p h, 8p w]`` in [0, 1]."""
        self.check_latents(latents)
        if latents.shape[1] == 0:
            raise InputError("latents", "a latent video needs at least one frame; got 0")
        return self.decode_frames(latents, None)[0][:, self.frames_to_trim :]

    def decode_frames(self, latents: Tensor, memory: Memory | None) -> tuple[Tensor, Memory]:
        """All ``t_upscale * T`` decoder frames of ``latents`` (none trimmed), after those ``memory`` has seen."""
        x, memory = run_frames(self.decoder, self._to_weights(latents), memory)
        if self.patch_size > 1:
            x = F.pixel_shuffle(x, self.patch_size)
        return x.clamp_(0, 1), memory


class TAEHVStreamDecoder:
    """Decodes a latent video chunk by chunk (as causal video generation produces it) and returns exactly the
    frames ``decode_video`` would give for the whole video: ``push(chunk)`` returns the frames that chunk completes.

    Each chunk is decoded with all its frames at once; the state between chunks is ``memory``, each decoder
    MemBlock's input at the last frame so far. The model itself is only read, so several streams can share it.
    """

    def __init__(self, taehv: TAEHV):
        self.taehv = taehv
        self.reset()

    def reset(self) -> None:
        """Start a new video."""
        self.memory: Memory | None = None
        self.frames_decoded = 0
        self._latent_shape: tuple[int, int, int] | None = None  # batch, height, width of the video

    @torch.no_grad()
    def push(self, latents: Tensor) -> Tensor:
        """Latents ``[N, t, C, h, w]`` that follow the ones pushed before -> the frames they complete,
        ``[N, k, 3, 8p h, 8p w]``: ``k = 4t``, less the 3 startup frames for the first chunk of a video."""
        taehv = self.taehv
        taehv.check_latents(latents)
        batch, count, _, height, width = latents.shape
        if self._latent_shape not in (None, (batch, height, width)):
            raise InputError(
                "latents",
                f"this chunk has batch {batch} and {height}x{width} latents, but the video being decoded has "
                f"batch {self._latent_shape[0]} and {self._latent_shape[1]}x{self._latent_shape[2]}; "
                "call reset() before decoding another video",
            )
        if count == 0:
            scale = taehv.spatial_scale
            weight = taehv.decoder[1].weight
            shape = (batch, 0, IMAGE_CHANNELS, height * scale, width * scale)
            return torch.empty(shape, dtype=weight.dtype, device=weight.device)
        starting = self.memory is None
        frames, self.memory = taehv.decode_frames(latents, self.memory)
        self._latent_shape = (batch, height, width)
        if starting:
            frames = frames[:, taehv.frames_to_trim :]
        self.frames_decoded += frames.shape[1]
        return frames


class TAEHVStreamEncoder:
    """Encodes a video chunk by chunk (a live client's input frames): ``push(frames [N, 4k, 3, H, W])`` returns
    ``[N, k, C, h, w]``, and the chunks pushed one after the other equal ``encode_video`` of the whole video.

    Each TPool merges groups of frames that never straddle a multiple of 4, so only the encoder MemBlocks' last
    input frames carry over between chunks (``memory``). The model is only read: several streams can share it.
    """

    def __init__(self, taehv: TAEHV):
        self.taehv = taehv
        self.reset()

    def reset(self) -> None:
        """Start a new video."""
        self.memory: Memory | None = None
        self.frames_encoded = 0
        self._frame_shape: tuple[int, int, int] | None = None  # batch, height, width of the video

    @torch.no_grad()
    def push(self, frames: Tensor) -> Tensor:
        """RGB frames ``[N, 4k, 3, H, W]`` in [0, 1] that follow the ones pushed before -> their latents
        ``[N, k, C, H / (8p), W / (8p)]``. The frame count must be a multiple of 4 (a latent frame is made of 4
        frames; ``encode_video`` pads only the end of a whole video)."""
        taehv = self.taehv
        taehv.check_frames(frames)
        batch, count, _, height, width = frames.shape
        group = taehv.t_downscale
        if count % group:
            raise InputError(
                "frames",
                f"a chunk of {count} frames; a stream is encoded {group} frames per latent frame, so each push "
                f"takes a multiple of {group} frames (4 x the chunk's latent frames)",
            )
        if self._frame_shape not in (None, (batch, height, width)):
            raise InputError(
                "frames",
                f"this chunk has batch {batch} and {height}x{width} frames, but the video being encoded has batch "
                f"{self._frame_shape[0]} and {self._frame_shape[1]}x{self._frame_shape[2]}; call reset() before "
                "encoding another video",
            )
        x = taehv._to_weights(frames)
        if taehv.patch_size > 1:
            x = F.pixel_unshuffle(x, taehv.patch_size)
        latents, self.memory = run_frames(taehv.encoder, x, self.memory)
        self._frame_shape = (batch, height, width)
        self.frames_encoded += count
        return latents


@functools.cache
def _layout(name: str) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        model = TAEHV(TAEHV_CONFIGS[name])
    return {key: tuple(value.shape) for key, value in model.state_dict().items()}


def detect_taehv(sd: dict[str, Tensor]) -> list[str]:
    """Variants whose exact layout (every key and shape) ``sd`` has; [] if it is not a base TAEHV file.

    Latent channels show in ``decoder.1.weight`` [256, C, 3, 3] and the patch size in ``encoder.0.weight``
    [64, 3 p^2, 3, 3]. Wan 2.1's (taew2_1, lighttaew2_1) and HunyuanVideo's files share a layout, so all three
    are returned for 16 channels; the caller breaks the tie (by file name).
    """
    if "encoder.0.weight" not in sd or "decoder.1.weight" not in sd:
        return []
    shapes = {key: tuple(value.shape) for key, value in sd.items()}
    return [name for name in TAEHV_CONFIGS if shapes == _layout(name)]
