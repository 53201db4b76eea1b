"""The memory preflight: work that cannot fit is refused before anything is allocated.

The engine's ground floor for memory: it imports nothing of the engine but its errors, settings and units, so
every module that allocates (the loader, the tiny VAEs, LoRA merges, video sessions, the worker pool, image
sampling) can ask it without importing the cost planner above them.

* ``budget.py``: how many bytes a device can still take (:func:`available_bytes`: free memory, a cgroup limit,
  ``FEWSTEP_MEMORY_LIMIT_GB`` less what the pack holds) and :func:`check_fits`, the refusal that names the input
  and the estimate by part;
* ``ledger.py``: what the pack holds (:data:`LEDGER`: loaded models, live video sessions, worker pools), so a
  limit counts them and a refusal lists them.

The estimates themselves live with what they estimate: a KV cache's bytes with the KV cache
(``engine.causal.kv_cache.bytes``), a model's parameters and activations with the models
(``engine.models.sizes``).
"""

from .budget import USABLE_FRACTION, available_bytes, check_fits, device_free_bytes, total_bytes
from .ledger import LEDGER, MemoryLedger, device_key, tensor_bytes_on

__all__ = [
    "LEDGER",
    "USABLE_FRACTION",
    "MemoryLedger",
    "available_bytes",
    "check_fits",
    "device_free_bytes",
    "device_key",
    "tensor_bytes_on",
    "total_bytes",
]
