"""Merging LoRA patches into a model's weights in place, and undoing it, without reloading the base file.

A model shared by several handles (ComfyUI caches the loader's output and every LoRA node's output refers to the
same model) can only hold one set of merged weights at a time. :class:`MergedWeights` is that set's explicit
owner, one per model: ``ensure(model, patches)`` makes the model's weights equal the base weights plus exactly
``patches`` (restoring what an earlier set changed), and is a no-op when they already are, so every run calls it
before its first forward (``engine.run``).

Why in place: the patched weights keep their tensors (storage and dtype), so a compiled model sees new values
through the same graph inputs (no recompile) and a captured CUDA graph reads them at the same addresses. The
base values of each patched weight are kept once, on the CPU (as ComfyUI keeps its backups on the offload
device); that host memory is checked before anything is copied and released when the model runs without LoRA.
fp8 weights are merged in float32 and rounded stochastically back to fp8 (``rounding``).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref

import torch
from torch import nn

from ..ops import is_fp8
from ..preflight import LEDGER, check_fits, device_key
from ..units import format_bytes
from .rounding import to_storage

log = logging.getLogger(__name__)


def _backup_bytes_on(state: MergedWeights, device: torch.device) -> int:
    return sum(t.nbytes for t in list(state.backups.values()) if device_key(t.device) == device)


class MergedWeights:
    """The LoRA state of one model: which patches are merged, and the base values of what they changed."""

    def __init__(self):
        self.signature: tuple = ()
        self.backups: dict[str, torch.Tensor] = {}
        self.merges = 0  # how many times weights were (re)computed: tests and telemetry
        self.seconds = 0.0
        self._lock = threading.Lock()
        # the base values kept count against FEWSTEP_MEMORY_LIMIT_GB while this state lives (the memory ledger)
        LEDGER.hold(self, "LoRA backup", _backup_bytes_on)

    def ensure(self, model: nn.Module, patches, input_name: str = "lora") -> bool:
        """Make ``model``'s weights base + ``patches``; True when anything had to change."""
        active = tuple(p for p in patches if p.strength != 0.0)
        signature = tuple(p.signature for p in active)
        with self._lock:
            if signature == self.signature:
                return False
            started = time.perf_counter()
            params = _tensors(model)
            keys = set().union(*(p.keys for p in active)) if active else set()
            new = [k for k in sorted(keys) if k not in self.backups]
            if new:  # refused before anything changes: the weights keep matching self.signature
                _check_backup_fits({k: params[k] for k in new}, input_name)
            # Until every patched weight is written the model is in between: a failure restores the base values.
            self.signature = ("partial",)
            try:
                for key in [k for k in self.backups if k not in keys]:
                    params[key].data.copy_(self.backups.pop(key))
                for key in new:
                    self.backups[key] = params[key].detach().to("cpu", copy=True)
                for key in sorted(keys):
                    param = params[key]
                    merged = self.backups[key].to(device=param.device, dtype=torch.float32, copy=True)
                    for patch in active:
                        for delta in patch.by_key.get(key, ()):
                            delta.add_to(merged, patch.strength)
                    param.data.copy_(to_storage(merged, param.dtype, key))
                    del merged
            except BaseException:
                self._restore(params)
                raise
            self.signature = signature
            self.merges += 1
            self.seconds += time.perf_counter() - started
            log.info(
                "LoRA: merged %d patch(es) into %d weights in %.2f s (%s of base values kept on the CPU)",
                len(active), len(keys), time.perf_counter() - started, format_bytes(self.backup_bytes()),
            )  # fmt: skip
            return True

    def restore(self, model: nn.Module) -> None:
        """Base weights back; backups released."""
        with self._lock:
            self._restore(_tensors(model))

    def _restore(self, params) -> None:
        for key, base in self.backups.items():
            params[key].data.copy_(base)
        self.backups.clear()
        self.signature = ()

    def backup_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.backups.values())

    def base_value(self, key: str, current: torch.Tensor) -> torch.Tensor:
        """The base (unpatched) value of a parameter, whatever is merged now."""
        return self.backups.get(key, current)


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    out = dict(model.named_parameters())
    out.update(model.named_buffers())
    return out


def _check_backup_fits(tensors: dict[str, torch.Tensor], input_name: str) -> None:
    need = sum(t.numel() * t.element_size() for t in tensors.values())
    # one weight at a time is merged in float32 where it lives; fp8 rounding needs a few more buffers of its size
    work = max(t.numel() * (24 if is_fp8(t.dtype) else 8) for t in tensors.values())
    device = next(iter(tensors.values())).device
    hint = "Use a LoRA that patches fewer layers, or free host memory"
    if device.type == "cpu":
        check_fits({"base values of the LoRA-patched weights": need, "merge buffers": work}, "cpu", input_name,
                   hint=hint)  # fmt: skip
        return
    check_fits({"base values of the LoRA-patched weights": need}, "cpu", input_name, hint=hint)
    check_fits(
        {"merge buffers": work}, device, input_name, hint="Free GPU memory or use a LoRA on fewer layers"
    )


_STATES: weakref.WeakKeyDictionary[nn.Module, MergedWeights] = weakref.WeakKeyDictionary()
_STATES_LOCK = threading.Lock()


def merged_weights(model: nn.Module) -> MergedWeights:
    """The one :class:`MergedWeights` of ``model`` (created on first use, gone with the model)."""
    with _STATES_LOCK:
        state = _STATES.get(model)
        if state is None:
            state = _STATES[model] = MergedWeights()
        return state


def ensure_patches(model: nn.Module, patches, input_name: str = "lora") -> bool:
    """``merged_weights(model).ensure(model, patches)``; nothing at all for a model that never had a LoRA."""
    if not patches and model not in _STATES:
        return False
    return merged_weights(model).ensure(model, patches, input_name)


def base_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with the base value of every LoRA-patched weight (what the file holds)."""
    sd = model.state_dict()
    state = _STATES.get(model)
    if state is None or not state.backups:
        return sd
    return {k: state.base_value(k, v) for k, v in sd.items()}
