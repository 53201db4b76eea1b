"""Stream batch (StreamDiffusion's design) for realtime img2img and video-to-video on the engine's few-step DiTs.

from fewstep.engine import open_model, load_tiny_vae
from fewstep.engine.stream_batch import StreamBatch, StreamConfig

stream = StreamBatch(handle, load_tiny_vae("taef1_encoder.pth"), cond, height=512, width=512,  # taef2 for FLUX.2
                     config=StreamConfig(t_index_list=(16, 32), cfg_mode="self", guidance_scale=1.4))
out = stream.push(frame)      # None for the first T - 1 pushes, then the frame pushed T - 1 pushes earlier
clip = stream.run(frames)     # a whole clip: [N, 3, H, W] in, [N, 3, H, W] out
"""

from .config import CFG_MODES, STREAM_SAMPLERS, StreamConfig, parse_t_index_list
from .guidance import advance, guided_velocity, residual_velocity
from .pipeline import (
    FrameGeometry,
    StreamBatch,
    StreamOutput,
    StreamStats,
    check_frame_size,
    check_frames,
    check_tiny_vae,
    frame_geometry,
)
from .reference import denoise_sequential, run_sequential
from .similarity import SimilarityFilter, cosine_similarity, skip_probability

__all__ = [
    "CFG_MODES",
    "FrameGeometry",
    "STREAM_SAMPLERS",
    "SimilarityFilter",
    "StreamBatch",
    "StreamConfig",
    "StreamOutput",
    "StreamStats",
    "advance",
    "check_frame_size",
    "check_frames",
    "check_tiny_vae",
    "cosine_similarity",
    "frame_geometry",
    "denoise_sequential",
    "guided_velocity",
    "parse_t_index_list",
    "residual_velocity",
    "run_sequential",
    "skip_probability",
]
