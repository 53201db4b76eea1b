"""Test doubles of engine.compile: CUDA graphs emulated on the CPU.

Production code keeps only the seam (``cuda_graph(..., segments=...)``, ``attach_compile(...,
graph_segments=...)``): a factory of segment backends. :class:`EmulatedSegments` is such a backend with the
contract of a CUDA graph, so the graph logic (keys, LRU, static buffers, what is baked in) is tested without a GPU.
"""

from __future__ import annotations

import torch

from fewstep.engine.compile.capture import SegmentTracer, _TracedSegments


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return a is b


class EmulatedSegments(_TracedSegments):
    """A CPU stand-in for CUDA graphs with the same contract: a segment is the tape of its torch calls, replayed
    into the very tensors the capture produced (static addresses, Python not re-run, host values baked in).
    Not faster than eager: it exists to test the graph logic."""

    def begin(self, tracer: SegmentTracer | None):
        tape: list = []
        tracer.record = lambda func, args, kwargs, out: tape.append((func, args, kwargs, out))
        return tape

    def replay(self, tape) -> None:
        with torch._C.DisableTorchFunction():
            for func, args, kwargs, out in tape:
                new = func(*args, **kwargs)
                self._write_back(out, new)

    def _write_back(self, out, new) -> None:
        if isinstance(out, torch.Tensor) and isinstance(new, torch.Tensor):
            if not _shares_storage(out, new):  # views and in-place results already hold the new values
                out.copy_(new)
        elif isinstance(out, (tuple, list)) and isinstance(new, (tuple, list)):
            for o, n in zip(out, new):
                self._write_back(o, n)


# what tests pass as ``segments=`` / ``graph_segments=``: a new backend per captured key, as CUDA graphs get
EMULATED = EmulatedSegments
