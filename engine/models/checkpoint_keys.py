"""Key patterns the checkpoint layouts of every family share (block numbering, fused projections, halves).

Each family's ``*_checkpoint`` module holds its own names and tables; what they do alike with those names is here.
"""

from __future__ import annotations

import re

import torch

from ..errors import CheckpointError

StateDict = dict[str, torch.Tensor]


def block_indices(keys, prefix: str) -> list[int]:
    """The block numbers ``N`` of keys ``{prefix}N.…``, sorted (``block_indices(sd, "double_blocks.")``)."""
    pattern = re.compile(re.escape(prefix) + r"(\d+)\.")
    return sorted({int(m.group(1)) for k in keys if (m := pattern.match(k))})


def swap_halves(t: torch.Tensor) -> torch.Tensor:
    """``[a; b]`` -> ``[b; a]`` along the rows: diffusers' final adaLN emits (scale, shift), the official (shift,
    scale)."""
    first, second = t.chunk(2, dim=0)
    return torch.cat((second, first), dim=0)


def fuse_rows(src: StateDict, out: StateDict, dst: str, parts: list[str], layout: str) -> None:
    """``out[dst]`` = the ``parts`` of ``src`` stacked along the rows (a fused qkv of separate q, k, v), taken out
    of ``src``; all of them or none (a partial set is a :class:`CheckpointError` naming ``layout``)."""
    present = [p for p in parts if p in src]
    if present and len(present) != len(parts):
        missing = sorted(set(parts) - set(present))
        raise CheckpointError("weights", f"{layout}: {dst} needs {missing}")
    if present:
        out[dst] = torch.cat([src.pop(p) for p in parts], dim=0)


MODULE_ENDS = (".weight", ".bias")  # a renamed module's tensors


def move_renamed(
    src: StateDict, out: StateDict, renames: dict[str, str], src_prefix: str = "", dst_prefix: str = "",
    ends: tuple[str, ...] = ("",),
) -> None:  # fmt: skip
    """Move ``src[src_prefix + a + end]`` to ``out[dst_prefix + b + end]`` for each ``a -> b`` of ``renames`` and
    each of ``ends`` (:data:`MODULE_ENDS` for module names; ``""`` for whole keys), where ``src`` has it."""
    for a, b in renames.items():
        for end in ends:
            if src_prefix + a + end in src:
                out[dst_prefix + b + end] = src.pop(src_prefix + a + end)
