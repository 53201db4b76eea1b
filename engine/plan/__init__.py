"""The cost planner: FLOPs per DiT forward, forwards per job, KV and weight bytes, predicted seconds on a GPU.

    from fewstep.engine.plan import plan_preset
    plan = plan_preset("wan2.1-1.3b", height=480, width=832, frames=81, gpu="h200")
    print(plan.table()); plan.fields["kv_bytes_window"]
    plan_preset("flux.2-klein-4b", height=1024, width=1024)["predicted_total_seconds"]

Families: FLUX.1, FLUX.2 (dev, klein) and Z-Image images, Wan causal video; ``plan_session_tick`` /
``session_scan`` (``sessions.py``) predict a session pool's batched tick against solo chunks
(``plan_preset("wan2.1-1.3b", sessions=8)`` adds it to the bill).

See ``flops.py`` for the FLOP convention, ``hardware.py`` for the GPU presets and their sources, ``engine.models.sizes``
for weight and activation bytes, ``engine.causal.kv_cache.bytes`` for the KV cache's.
"""

from ..causal.kv_cache import KV_LAYOUTS, kv_bytes_per_token, kv_layout
from ..models.sizes import WEIGHT_DTYPE_BYTES, count_parameters
from .flops import (
    ForwardFlops,
    MeasuredFlops,
    flux2_forward_flops,
    flux_forward_flops,
    measure_flops,
    wan_forward_flops,
    wan_prompt_flops,
    wan_tokens_per_frame,
    zimage_forward_flops,
)
from .hardware import DEFAULT_MFU, GPUS, GpuSpec, gpu_spec
from .planner import CostPlan, image_defaults, known_models, plan_cost, plan_preset
from .sessions import SessionTick, plan_session_tick, session_scan

__all__ = [
    "DEFAULT_MFU",
    "GPUS",
    "KV_LAYOUTS",
    "WEIGHT_DTYPE_BYTES",
    "CostPlan",
    "ForwardFlops",
    "GpuSpec",
    "MeasuredFlops",
    "SessionTick",
    "count_parameters",
    "flux2_forward_flops",
    "flux_forward_flops",
    "gpu_spec",
    "image_defaults",
    "known_models",
    "kv_bytes_per_token",
    "kv_layout",
    "measure_flops",
    "plan_cost",
    "plan_preset",
    "plan_session_tick",
    "session_scan",
    "wan_forward_flops",
    "wan_prompt_flops",
    "wan_tokens_per_frame",
    "zimage_forward_flops",
]
