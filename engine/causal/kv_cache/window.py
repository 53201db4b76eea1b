"""The window and its slots: which latent frames a chunk sees (:class:`WindowSpec`) and which frame each slot of
the cache holds (:class:`SlotRing`, host integers only).

Slots: the first ``sink_frames`` latent frames keep slots ``[0, S)`` forever; the other frames share a ring of
``full_ring`` full-precision frame slots, and with quantized storage the frames that age out of it move to a
second ring of ``quant_ring`` quantized slots (``quantized.py``). Slot order everywhere (visibility, reads): the
full-precision slots, then the quantized ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import InputError

ROPE_MODES = ("cache", "absolute")


def check_window(c: int, w: int, s: int) -> None:
    """Whether a chunk of ``c`` latent frames, a window of ``w`` and ``s`` sinks fit together (``WindowSpec``)."""
    if c < 1:
        raise InputError("chunk_frames", f"expected at least 1 latent frame per chunk, got {c}")
    if w < c:
        raise InputError(
            "window_frames",
            f"the window ({w} latent frames) is smaller than a chunk ({c}); a chunk must see at least itself",
        )
    if s < 0 or s >= w:
        raise InputError(
            "sink_frames", f"{s} sink frames do not fit a window of {w} frames (need 0 <= sink < window)"
        )
    if s + c > w:
        raise InputError(
            "window_frames",
            f"the window ({w}) must hold the {s} sink frames and a chunk of {c} (at least {s + c})",
        )


@dataclass(frozen=True)
class WindowSpec:
    """How many latent frames a chunk sees: ``window_frames`` in all, the first ``sink_frames`` kept forever.

    Checked once, when it is built (an :class:`InputError` naming the input; the node or command that built it
    locates it): every holder of a ``WindowSpec`` may rely on it."""

    chunk_frames: int
    window_frames: int
    sink_frames: int = 0

    def __post_init__(self):
        check_window(self.chunk_frames, self.window_frames, self.sink_frames)

    @property
    def ring_frames(self) -> int:
        return self.window_frames - self.sink_frames

    def cache_offset(self, chunk_start: int, frames: int | None = None) -> int:
        """``o``: absolute frame index - cache position of the non-sink frames the chunk starting at
        ``chunk_start`` reads (its own and the retained ones): the oldest retained non-sink frame - sinks, >= 0.
        ``frames``: the forward's frame count when it is not a whole chunk (a prefill's lone first frame)."""
        s = self.sink_frames
        end = chunk_start + (self.chunk_frames if frames is None else frames)
        return max(s, end - self.ring_frames) - s

    def cache_position(self, frame: int, chunk_start: int) -> int:
        """The cache-relative RoPE frame position (``rope="cache"``) of ``frame`` as the chunk starting at
        ``chunk_start`` reads it: sinks at their index, the other frames contiguously after them."""
        return frame if frame < self.sink_frames else frame - self.cache_offset(chunk_start)

    def visible(self, chunk_start: int, key_frame: int, frames: int | None = None) -> bool:
        """Whether a query in the chunk starting at ``chunk_start`` (``frames`` long, a whole chunk when None)
        sees ``key_frame``."""
        end = chunk_start + (self.chunk_frames if frames is None else frames)
        return key_frame < end and (key_frame < self.sink_frames or key_frame >= end - self.ring_frames)


@dataclass(frozen=True)
class AgedRun:
    """``frames`` consecutive frames moving from full-precision slot ``full_slot`` on to quantized slot
    ``quant_slot`` on (one copy per layer instead of one per frame)."""

    full_slot: int
    quant_slot: int
    frames: int


class SlotRing:
    """Which frame each slot holds, as plain host integers (never read back from the device: no sync)."""

    def __init__(self, window: WindowSpec, full_ring: int, quant_ring: int):
        self.window, self.full_ring, self.quant_ring = window, full_ring, quant_ring
        self.full: list[int | None] = [None] * (window.sink_frames + full_ring)  # per full-precision slot
        self.quantized: list[int | None] = [None] * quant_ring  # per quantized slot
        self.visible_slots: list[int] = []  # of the current chunk, in slot order
        self.all_visible = False

    def slot_of(self, frame: int) -> int:
        """The full-precision slot of ``frame``."""
        s = self.window.sink_frames
        return frame if frame < s else s + (frame - s) % self.full_ring

    def quant_slot_of(self, frame: int) -> int:
        """The quantized slot of a (non-sink) ``frame`` once it aged out of the full-precision ring."""
        return (frame - self.window.sink_frames) % self.quant_ring

    def age_out(self, chunk: range) -> list[AgedRun]:
        """Free the full-precision slots ``chunk`` is about to take; the completed frames they held that are still
        in its window move to their quantized slots (each frame once: it never returns to a full-precision slot).
        Returns the moves, merged into runs of consecutive slots, for the caller to quantize."""
        runs: list[AgedRun] = []
        for frame in chunk:
            slot = self.slot_of(frame)
            old = self.full[slot]
            if old is None or old == frame:
                continue
            self.full[slot] = None
            if not self.window.visible(chunk.start, old, len(chunk)):
                continue
            quant = self.quant_slot_of(old)
            self.quantized[quant] = old
            last = runs[-1] if runs else None
            if last and last.full_slot + last.frames == slot and last.quant_slot + last.frames == quant:
                runs[-1] = AgedRun(last.full_slot, last.quant_slot, last.frames + 1)
            else:
                runs.append(AgedRun(slot, quant, 1))
        return runs

    def place(self, chunk: range) -> list[int]:
        """Give ``chunk``'s frames their full-precision slots; returns the slots, in frame order."""
        written = []
        for frame in chunk:
            slot = self.slot_of(frame)
            self.full[slot] = frame
            written.append(slot)
        return written

    def see(self, chunk_start: int, frames: int | None = None) -> list[bool]:
        """Whether the chunk starting at ``chunk_start`` (``frames`` long, a whole chunk when None) sees each slot
        (full precision, then quantized)."""
        visible = [
            f is not None and self.window.visible(chunk_start, f, frames) for f in self.frames_by_slot()
        ]
        self.visible_slots = [i for i, seen in enumerate(visible) if seen]
        self.all_visible = all(visible)
        return visible

    def frames_by_slot(self) -> list[int | None]:
        return self.full + self.quantized

    def read_frames(self) -> list[int]:
        """The frames the current chunk reads, in slot order (the order of ``LayerView.read``'s tokens)."""
        by_slot = self.frames_by_slot()
        return [by_slot[i] for i in self.visible_slots]

    def visible_tokens(self, tokens_per_frame: int) -> list[int]:
        """Token indices (into ``LayerView.read_window``) of the current chunk's visible slots, in slot order."""
        t = tokens_per_frame
        return [slot * t + token for slot in self.visible_slots for token in range(t)]

    def held(self) -> list[tuple[int, str, int]]:
        """``(frame, "full" | "quantized", slot)`` of every frame the cache holds, in frame order."""
        full = [(f, "full", i) for i, f in enumerate(self.full) if f is not None]
        quantized = [(f, "quantized", i) for i, f in enumerate(self.quantized) if f is not None]
        return sorted(full + quantized)

    def filled(self) -> tuple[int, int]:
        """Occupied (full-precision, quantized) slots."""
        return sum(f is not None for f in self.full), sum(f is not None for f in self.quantized)
