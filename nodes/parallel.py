"""FewStepParallelLauncher: a worker pool (sequence or data parallel) that the samplers run on.

The FEWSTEP_PARALLEL value is the pool's configuration; the pool itself lives in ``engine.parallel.pool``'s
registry, is started by the launcher (so start-up errors show on this node) and restarted by a sampler's run when
it was stopped in between: a sampler only puts the pool into its run options (:func:`run_options`), and the engine
hands the run to it (``engine.run.placement``). It stops when the launcher is switched off, on interpreter exit,
after a worker failure, and when ComfyUI frees memory: the pool is registered with ComfyUI's memory manager as a
model of its own, whose unload (``POST /free``, the Manager's "Unload models", or memory needed elsewhere) shuts
the workers down.
"""

from __future__ import annotations

from torch import nn

from ..engine.parallel import BACKENDS, MODES, ParallelConfig, shutdown_pool
from ..engine.parallel.client import OnPool
from ..engine.run import RunOptions
from .base import CATEGORY, reports_input_errors
from .host import check_interrupt, comfy_module, interrupt_check
from .inputs import register_object_type
from .model_management import make_patcher

FEWSTEP_PARALLEL = "FEWSTEP_PARALLEL"
register_object_type(
    FEWSTEP_PARALLEL,
    ParallelConfig,
    "a FEWSTEP_PARALLEL from FewStepParallelLauncher",
)

_PATCHERS: dict[ParallelConfig, object] = {}  # one host-memory entry per pool configuration


class FewStepParallelLauncher:
    DESCRIPTION = (
        "Starts a pool of worker processes on torch.distributed (gloo on CPU, NCCL on GPUs) for FewStepSampler and "
        "FewStepCausalVideoSampler. sp: every rank runs each forward on a shard of the image / video tokens "
        "(Ulysses all-to-all over heads x ring attention; text replicated), for resolutions and video lengths one "
        "device cannot hold or run fast enough. dp: each rank runs a whole model on a share of the batch. The "
        "model is loaded once per worker and kept; a dead or hung worker is an error naming the rank."
    )
    CATEGORY = f"{CATEGORY}/parallel"
    RETURN_TYPES = (FEWSTEP_PARALLEL, "STRING")
    RETURN_NAMES = ("parallel", "report")
    FUNCTION = "launch"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "mode": (
                    list(MODES),
                    {
                        "default": "sp",
                        "tooltip": "sp: sequence parallel (ulysses_degree x ring_degree ranks share each "
                        "forward). dp: data parallel (dp_degree ranks, each a whole model, the batch split).",
                    },
                ),
                "ulysses_degree": (
                    "INT",
                    {
                        "default": 2,
                        "min": 1,
                        "max": 64,
                        "tooltip": "sp: ranks that exchange heads for tokens (all-to-all); must divide the "
                        "model's attention heads (FLUX.1 24; FLUX.2 klein-4B 24, klein-9B 32, dev 48; Z-Image 30; "
                        "Wan-1.3B 12). Best within one machine.",
                    },
                ),
                "ring_degree": (
                    "INT",
                    {
                        "default": 1,
                        "min": 1,
                        "max": 64,
                        "tooltip": "sp: ranks that pass K/V blocks around a ring (no head limit; suits slower "
                        "links). The pool has ulysses_degree x ring_degree ranks.",
                    },
                ),
                "dp_degree": (
                    "INT",
                    {"default": 2, "min": 1, "max": 64, "tooltip": "dp: number of replicas (ranks)."},
                ),
                "backend": (
                    list(BACKENDS),
                    {
                        "default": "auto",
                        "tooltip": "auto: nccl when this machine has a GPU per local rank, else gloo (CPU "
                        "workers). nccl without GPUs is an error.",
                    },
                ),
                "timeout": (
                    "FLOAT",
                    {
                        "default": 120.0,
                        "min": 1.0,
                        "max": 86400.0,
                        "step": 1.0,
                        "tooltip": "Seconds a collective, or a worker's silence during a job (one step or "
                        "chunk), may last before the pool is stopped with an error naming the rank.",
                    },
                ),
            },
            "optional": {
                "enabled": (
                    "BOOLEAN",
                    {
                        "default": True,
                        "tooltip": "Off: stop this pool's workers and output nothing (the samplers then run in "
                        "this process).",
                    },
                ),
                "local_ranks": (
                    "INT",
                    {
                        "default": 0,
                        "min": 0,
                        "max": 256,
                        "tooltip": "Ranks started on this machine (0 = all; at most its cores, or the "
                        "administrator's FEWSTEP_POOL_MAX_LOCAL_RANKS). The others join from other "
                        "machines with `python -m fewstep worker` (the console prints the command); that needs "
                        "FEWSTEP_POOL_TOKEN set in ComfyUI's environment and the same value on each worker.",
                    },
                ),
                "master_addr": (
                    "STRING",
                    {
                        "default": "127.0.0.1",
                        "tooltip": "The one address the pool's store listens on: 127.0.0.1, ::1 or localhost "
                        "(this machine only). For ranks on other machines, this machine's address on a trusted "
                        "network, accepted only when the administrator lists it in FEWSTEP_POOL_ALLOWED_ADDRS. "
                        "Payloads are sealed with the pool's secret; ranks that join need FEWSTEP_POOL_TOKEN.",
                    },
                ),
                "master_port": (
                    "INT",
                    {
                        "default": 0,
                        "min": 0,
                        "max": 65535,
                        "tooltip": "Store port: 0 = any free port. An explicit port must be listed by the "
                        "administrator in FEWSTEP_POOL_ALLOWED_PORTS; ports below 1024 are refused.",
                    },
                ),
                "threads_per_rank": (
                    "INT",
                    {
                        "default": 0,
                        "min": 0,
                        "max": 1024,
                        "tooltip": "torch CPU threads per worker (0 = this machine's cores / local ranks; at most "
                        "that many).",
                    },
                ),
            },
        }

    @reports_input_errors("FewStepParallelLauncher")
    def launch(self, mode, ulysses_degree, ring_degree, dp_degree, backend, timeout, enabled=True, local_ranks=0,
               master_addr="127.0.0.1", master_port=0, threads_per_rank=0):  # fmt: skip
        config = ParallelConfig(
            mode=mode, ulysses_degree=ulysses_degree, ring_degree=ring_degree, dp_degree=dp_degree,
            backend=backend, timeout=float(timeout), master_addr=master_addr, master_port=master_port,
            local_ranks=local_ranks or None, threads_per_rank=threads_per_rank or None,
        ).check()  # fmt: skip
        if not enabled:
            shutdown_pool(config)
            return (None, "parallel: off (workers stopped; the samplers run in this process)")
        pool = pool_placement(config, None).pool()
        return (config, pool.describe())


def pool_placement(config, where: str | None) -> OnPool:
    """``RunOptions.pool`` for a node's ``parallel`` input: the launcher's pool, started when a run needs it
    (ComfyUI's cancel stops a slow start) and kept in ComfyUI's list of loaded models while in use."""
    return OnPool(config, where, interrupt=check_interrupt, on_use=_track_with_comfyui)


def run_options(parallel, where: str) -> RunOptions:
    """A sampler node's run options: in this process with ComfyUI's cancel check between the blocks of every
    forward, or on the connected pool (whose ranks agree on a cancel per forward instead)."""
    if parallel is None:
        return RunOptions(interrupt_check=interrupt_check())
    return RunOptions(pool=pool_placement(parallel, where))


def _track_with_comfyui(config: ParallelConfig) -> None:
    """Keep the pool in ComfyUI's list of loaded models, so freeing memory there stops its workers."""
    mm, ext = comfy_module("comfy.model_management"), comfy_module("comfy.patcher_extension")
    if mm is None:
        return
    patcher = _PATCHERS.get(config)
    if patcher is None:
        patcher = make_patcher(nn.Module())  # no weights in this process: the memory is the workers'
        if patcher is None:
            return
        if ext is not None:

            def on_detach(_patcher, unpatch_all=True, *_):
                if unpatch_all:  # a real unload, not a re-load of an already loaded model
                    shutdown_pool(config)

            patcher.add_callback_with_key(ext.CallbacksMP.ON_DETACH, "fewstep-parallel", on_detach)
        _PATCHERS[config] = patcher
    mm.load_models_gpu([patcher])
