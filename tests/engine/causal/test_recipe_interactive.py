"""A session's recipe (``engine.causal.recipe.SessionRecipe``) rebuilds an interactive session: its prefill and
its prompt switches with a KV re-cache replayed, the rebuilt session continues as the original one."""

from __future__ import annotations

import torch

from fewstep.engine import open_model
from fewstep.engine.causal import CausalConfig
from fewstep.engine.causal.recipe import SessionRecipe

H, W = 32, 48


def _ctx(seed=1, tokens=9):
    return torch.randn(1, tokens, 4096, generator=torch.Generator().manual_seed(seed))


def test_a_rebuild_replays_the_prefill_and_the_recache_switches():
    handle = open_model("dummy:wan-tiny", device="cpu", dtype=torch.float32, seed=2)
    config = CausalConfig(chunk_frames=2, window_frames=6, sink_frames=1, steps=2)
    start = torch.randn(1, 16, 3, H // 8, W // 8, generator=torch.Generator().manual_seed(5))
    recipe = SessionRecipe(handle, W, H, config, seed=3).with_prompt(0, _ctx(1)).with_start(start)
    session, _ = recipe.open(_ctx(1))
    session.prefill(start)
    session.run(1)
    recipe = recipe.with_prompt(session.frames_generated, _ctx(2), recache=True)
    session.set_prompt(_ctx(2), recache=True)
    session.run(1)
    recipe = recipe.with_prompt(session.frames_generated, _ctx(3))
    session.set_prompt(_ctx(3))
    position = session.frames_generated
    assert recipe.recache_at == (1,) and position == 3 + 2 * 2
    rebuilt = recipe.rebuild(position, "test")
    assert rebuilt.frames_generated == position
    for a, b in zip(session.run(2), rebuilt.run(2), strict=True):
        assert torch.equal(a.latents, b.latents)
    # without the recache flag the replay differs (the re-cache changed the window's K/V)
    plain = SessionRecipe(handle, W, H, config, seed=3, prompts=recipe.prompts, start=start).rebuild(
        position, "t"
    )
    other = plain.run(1)[0].latents
    again = recipe.rebuild(position, "test").run(1)[0].latents
    assert not torch.equal(other, again)
