"""``ModelHandle``: a loaded model plus how to run it (the ``FEWSTEP_MODEL`` that flows between nodes).

The handle owns no run state. Speed features (a step-cache gate, compilation, parallelism) are recorded in
``features`` and applied by the code that runs the model, so each one is composable and can be switched off
on its own; ``with_feature`` returns a new handle and never mutates the shared model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import nn

from .attention import check_backend
from .loader import default_compute_dtype, load_dit, preset_of, resolve_device
from .models.registry import Family, family_of
from .ops import weight_bytes


@dataclass(frozen=True)
class ModelHandle:
    model: nn.Module = field(repr=False)
    source: str
    dtype: torch.dtype
    attention_backend: str = "auto"
    features: tuple[tuple[str, object], ...] = field(default=())
    # LoRA patches (engine.lora.LoraPatch), in order: merged into the shared model by each run that uses this
    # handle, never by building the handle (apply_lora); a handle without them runs the base weights.
    loras: tuple = field(default=())
    # Opaque to the engine: the host application's memory-manager object for this model (ComfyUI's
    # ModelPatcher), shared by every handle derived from this one.
    host: object = field(default=None, compare=False, repr=False)

    @property
    def family(self) -> Family:
        return family_of(self.model)

    @property
    def params(self):
        return self.model.params

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def preset(self) -> str | None:
        return preset_of(self.model)

    def feature(self, name: str, default=None):
        return dict(self.features).get(name, default)

    def with_feature(self, name: str, value) -> ModelHandle:
        kept = tuple((k, v) for k, v in self.features if k != name)
        return dataclasses.replace(self, features=kept + ((name, value),))

    def replace(self, **changes) -> ModelHandle:
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        p = self.params
        name = self.preset or "custom"
        mb = weight_bytes(self.model) / 2**20
        lora = "".join(f"; LoRA {p.describe()}" for p in self.loras)
        wdt = {str(t.dtype).replace("torch.", "") for t in self.model.state_dict().values()}
        layout = getattr(self.model, "checkpoint_layout", None)
        where = f"{self.source} ({layout} layout)" if layout else self.source
        # FLUX.1 / FLUX.2 name their width hidden_size / num_heads, Wan and Z-Image dim / num_heads / n_heads
        width = getattr(p, "hidden_size", None) or p.dim
        heads = getattr(p, "num_heads", None) or p.n_heads
        return (
            f"{self.family.name} [{name}] from {where}: hidden {width}, heads {heads}, "
            f"{mb:.1f} MiB weights ({'/'.join(sorted(wdt))}), compute {str(self.dtype).replace('torch.', '')}, "
            f"attention {self.attention_backend}, device {self.device}{lora}"
        )


def open_model(
    source: str,
    weight_dtype: torch.dtype | None = None,
    dtype: torch.dtype | None = None,
    device=None,
    attention_backend: str = "auto",
    seed: int = 0,
    input_name: str = "weights",
    memory_hint: str = "",
) -> ModelHandle:
    """``load_dit`` plus the run settings, as one handle (``memory_hint``: see ``load_dit``)."""
    check_backend(attention_backend, "attention")
    dev = resolve_device(device)
    dtype = dtype or default_compute_dtype(dev)
    model = load_dit(
        source, dtype=dtype, device=dev, weight_dtype=weight_dtype, seed=seed, input_name=input_name,
        memory_hint=memory_hint,
    )  # fmt: skip
    return ModelHandle(model=model, source=str(source), dtype=dtype, attention_backend=attention_backend)
