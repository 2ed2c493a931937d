"""The pass pipeline keeps the objects that exist when it starts out of the garbage collector's full
collections while it runs (``pass_manager._heap_frozen``) and leaves the collector as it found it: nothing
frozen afterwards, and a heap someone else froze (vLLM does after start-up) still frozen."""

from __future__ import annotations

import gc

import torch
import torch.fx as fx

from ascend_passes.config import AscendPassConfig
from ascend_passes.pass_manager import PassContext, PassManager, _heap_frozen


def _graph() -> fx.GraphModule:
    def f(x):
        return torch.relu(x) + 1

    return fx.symbolic_trace(f)


def test_heap_frozen_only_while_running():
    assert gc.get_freeze_count() == 0
    with _heap_frozen():
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0


def test_pipeline_freezes_the_heap_and_leaves_a_frozen_one_frozen():
    config = AscendPassConfig()
    gm = _graph()
    ctx = PassContext(config, [torch.randn(4)], None, "none", "cpu")
    during: list[int] = []
    PassManager(config).run(gm, ctx, hooks=[lambda name, stage, gm, result: during.append(gc.get_freeze_count())])
    assert during and min(during) > 0  # frozen while the passes ran
    assert gc.get_freeze_count() == 0
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        fresh = [[] for _ in range(1000)]  # tracked objects, not frozen: a second freeze would add them
        with _heap_frozen():
            # left as it is: the count may only fall (frozen objects freed meanwhile: CI saw 2 fewer, from
            # pytest's own threads), where a second freeze would add the 1,000 lists and an unfreeze empty it
            assert frozen - 500 < gc.get_freeze_count() <= frozen
        del fresh
        PassManager(config).run(_graph(), ctx)
        # still frozen (objects freed since leave the count; an unfreeze would empty it)
        assert gc.get_freeze_count() > frozen // 2
    finally:
        gc.unfreeze()


def test_final_code_generation_runs_in_the_frozen_heap(monkeypatch):
    """The pipeline's one ``recompile`` (the code of the whole graph: many allocations at 61 layers, enough to
    start full collections that walked the 1.3-million-object heap, +0.45 s per warm 61-layer compile) runs
    before the heap is unfrozen."""
    config = AscendPassConfig()
    gm = _graph()
    ctx = PassContext(config, [torch.randn(4)], None, "none", "cpu")
    seen: list[int] = []
    original = fx.GraphModule.recompile

    def recompile(self):
        seen.append(gc.get_freeze_count())
        return original(self)

    monkeypatch.setattr(fx.GraphModule, "recompile", recompile)
    PassManager(config).run(gm, ctx)
    assert seen and seen[-1] > 0
    assert gc.get_freeze_count() == 0
