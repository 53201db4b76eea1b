"""Sequence and data parallelism on torch.distributed: Ulysses, ring and USP attention, and a worker pool.

Host side (this process, e.g. ComfyUI)::

    from fewstep.engine.parallel import ParallelConfig, get_pool, parallel_sample

    pool = get_pool(ParallelConfig(mode="sp", ulysses_degree=2, backend="gloo"))  # 2 local workers
    latent, report = parallel_sample(pool, handle, [cond], torch.zeros(1, 16, 64, 64), steps=4)
    pool.shutdown()  # also on interpreter exit, or when ComfyUI frees memory

Workers on other machines join with ``MASTER_ADDR=... MASTER_PORT=... WORLD_SIZE=... RANK=... python -m fewstep
worker`` and the pool's secret in ``FEWSTEP_POOL_TOKEN`` (see ``transport``: every payload is sealed with it). Modules: ``config`` (what a pool is, preflight), ``mesh`` (process groups, token collectives),
``sequence`` (the attention algorithms), ``sharding`` (block runners that shard a model's tokens), ``pool`` (host
side: start, watch, stop), ``worker`` / ``jobs`` (worker side), ``client`` (sampling and video on a pool),
``transport`` (payloads through the store), ``tasks`` (diagnostics).
"""

from .client import (
    RemoteVideoSession,
    check_image_sequence_parallel,
    check_sequence_parallel,
    model_spec,
    parallel_sample,
)
from .config import BACKENDS, MODES, ParallelConfig
from .mesh import CommStats, SequenceMesh
from .pool import ParallelError, WorkerPool, get_pool, shutdown_all, shutdown_pool
from .sequence import SequenceParallelPlan, attention_with_lse, ring_attention, sequence_parallel_attention
from .sharding import (
    IMAGE_SHARDING,
    CausalSharding,
    ImageSequenceSharding,
    ShardedKV,
    flux_block_runner,
    image_sharding,
    wan_block_runner,
    zimage_block_runner,
)

__all__ = [
    "BACKENDS",
    "MODES",
    "CausalSharding",
    "IMAGE_SHARDING",
    "CommStats",
    "ParallelConfig",
    "ParallelError",
    "RemoteVideoSession",
    "SequenceMesh",
    "SequenceParallelPlan",
    "ImageSequenceSharding",
    "ShardedKV",
    "WorkerPool",
    "attention_with_lse",
    "check_image_sequence_parallel",
    "check_sequence_parallel",
    "flux_block_runner",
    "get_pool",
    "image_sharding",
    "model_spec",
    "parallel_sample",
    "ring_attention",
    "sequence_parallel_attention",
    "shutdown_all",
    "shutdown_pool",
    "wan_block_runner",
    "zimage_block_runner",
]
