"""The staged forward every model family shares: ``forward = finish(run_blocks(embed(...)))``.

A family (FLUX.1, FLUX.2, Z-Image, Wan) fills in its own stages on a :class:`StagedModel`:

* ``embed(...)``: its inputs -> its hidden state before block 0 (a :class:`StagedHidden`);
* ``run_block(hidden, index)``: block ``index`` of its residual stack, updating ``hidden``;
* ``finish(hidden)``: the final layer -> the model's output.

What is the same for every family is here, once: ``num_blocks`` over the stacks a family names, the block loop
(with the host's Cancel check before each block) and the composition with a ``block_runner``, the hook through
which code outside the model (a step cache, sequence parallelism, Cancel) runs part of the stack and decides
about the rest. The model imports none of that code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..backends import DEFAULT_BACKENDS, Backends


@dataclass(kw_only=True)
class StagedHidden:
    """The residual stream between two stages of one forward: a family adds its tensors, these two fields travel
    with them to every block."""

    backends: Backends = DEFAULT_BACKENDS  # how this run computes attention, norms and RoPE
    interrupt_check: Callable[[], None] | None = None  # the host's Cancel check, before each block

    @property
    def stream(self) -> torch.Tensor:
        """The tokens the final layer reads (what a step cache compares and reuses)."""
        raise NotImplementedError

    def with_stream(self, stream: torch.Tensor) -> StagedHidden:
        """The same state with other :attr:`stream` tokens (a step cache's reused result)."""
        raise NotImplementedError


# block_runner(model, hidden) -> hidden: runs the block stack in place of ``model.run_blocks`` (a step cache's hook)
BlockRunner = Callable[[nn.Module, StagedHidden], StagedHidden]


class StagedModel(nn.Module):
    """A DiT whose forward is ``finish(run_blocks(embed(...)))``; see the module docstring."""

    # the nn.ModuleList attributes that form the residual stack, in the order its blocks run
    block_stacks: tuple[str, ...] = ()

    @property
    def num_blocks(self) -> int:
        """Blocks of the residual stack (the unit a step cache and Cancel see)."""
        return sum(len(getattr(self, name)) for name in self.block_stacks)

    def run_block(self, hidden: StagedHidden, index: int) -> None:
        """Block ``index`` of the stack on ``hidden``, in place (``hidden`` is :meth:`run_blocks`'s own copy)."""
        raise NotImplementedError

    def finish(self, hidden: StagedHidden) -> torch.Tensor:
        raise NotImplementedError

    def run_blocks(self, hidden: StagedHidden, start: int = 0, stop: int | None = None) -> StagedHidden:
        """Blocks ``start`` to ``stop - 1`` of the stack; the state given is left as it was."""
        stop = self.num_blocks if stop is None else stop
        # one copy per call, whatever the depth: the blocks replace its tensors, the caller's state keeps its own
        hidden = dataclasses.replace(hidden)
        for index in range(start, stop):
            if hidden.interrupt_check is not None:  # the host's Cancel: a flag read, no device sync
                hidden.interrupt_check()
            self.run_block(hidden, index)
        return hidden

    def run_stages(self, hidden: StagedHidden, block_runner: BlockRunner | None = None) -> torch.Tensor:
        """The forward after ``embed``: the block stack (through ``block_runner`` when given; without one this is
        the reference forward), then ``finish``."""
        hidden = self.run_blocks(hidden) if block_runner is None else block_runner(self, hidden)
        return self.finish(hidden)


def check_head_split(
    width: int,
    heads: int,
    axes: tuple[int, ...],
    width_name: str = "hidden size",
    axes_name: str = "axes_dim",
) -> None:
    """A model width must split into ``heads`` equal heads, and RoPE's per-axis sizes must fill one head."""
    if width % heads:
        raise ValueError(f"{width_name} {width} is not divisible by {heads} heads")
    if sum(axes) != width // heads:
        raise ValueError(f"{axes_name} {axes} does not sum to the head size {width // heads}")


def replace_after_prefix(joint: torch.Tensor, prefix: int, stream: torch.Tensor) -> torch.Tensor:
    """``joint [B, prefix + L, C]`` with its tokens after the first ``prefix`` (the text) replaced by ``stream``."""
    return torch.cat((joint[:, :prefix], stream), dim=1)
