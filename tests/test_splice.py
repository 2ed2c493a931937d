"""How a replacement is spliced into the graph (``_pattern.replace`` / ``_splice``) and how dead
nodes are removed (``_nodes.eliminate_dead_code``): the work each does is bounded by the match, not
the graph (issue 18, goal 4), and the graphs they leave are the ones torch's own
``replace_with_graph`` + ``stable_topological_sort`` and ``Graph.eliminate_dead_code`` leave."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch._inductor import pattern_matcher as pm
from torch.fx.experimental.proxy_tensor import make_fx

from ascend_passes.pass_manager import lint
from ascend_passes.passes._nodes import eliminate_dead_code
from ascend_passes.passes._pattern import _move_inputs_before, replace

aten = torch.ops.aten


def _search(x, r, w):
    s = x + r
    return s, s * w


def _fused(x, r, w):  # the same two outputs, computed another way (so the splice is visible)
    s = torch.add(r, x)
    return s, torch.addcmul(torch.zeros_like(s), s, w)


def _late_weight(x, r, p):
    """The multiply's weight is computed after the match's first output (the add)."""
    s = x + r
    w = p * 3.0
    y = s * w
    return s.sum(0) + y


def _weight_from_match(x, r, p):
    """The weight is computed from the match's own first output: no order can feed it."""
    s = x + r
    w = s.sum(0) + p
    return s.relu() + s * w


def _inputs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(4, 8, generator=g) for _ in range(2)] + [torch.randn(8, generator=g)]


def _apply(fn) -> tuple[fx.GraphModule, list[list[fx.Node]]]:
    """``fn`` in ATen, its ``_search`` matches replaced by ``_fused`` through ``replace``."""
    inputs = _inputs()
    gm = make_fx(fn, tracing_mode="fake")(*inputs)
    pattern = pm.gen_pattern(_search, [torch.empty(4, 8), torch.empty(4, 8), torch.empty(8)], pm.fwd_only)
    spliced: list[list[fx.Node]] = []

    def handler(match: pm.Match, *args, **kwargs) -> None:
        spliced.append(replace(match, _fused, [kwargs["x"], kwargs["r"], kwargs["w"]]))

    matcher = pm.PatternMatcherPass(pass_name="test_splice")
    pm.GraphPatternEntry(pattern=pattern, extra_check=lambda m: True, handler=handler).register(matcher)
    matcher.apply(gm)
    return gm, spliced


def test_a_late_input_moves_before_the_replacement_and_the_result_is_unchanged():
    gm, spliced = _apply(_late_weight)
    assert len(spliced) == 1
    lint(gm.graph)  # def before use holds without a sort of the whole graph
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert aten.addcmul.default in targets and aten.add.Tensor in targets
    mul_scalar = next(n for n in gm.graph.nodes if n.target == aten.mul.Tensor and not isinstance(n.args[1], fx.Node))
    first_new = min(spliced[0])
    assert mul_scalar < first_new, "the weight's multiply was not moved before the replacement"
    gm.recompile()
    inputs = _inputs()
    torch.testing.assert_close(gm(*inputs), _late_weight(*inputs), rtol=0, atol=0)
    # every inserted node carries a value for the later passes
    assert all(isinstance(n.meta.get("val"), torch.Tensor) for n in spliced[0])


def test_an_input_computed_from_its_own_match_raises_before_changing_the_graph():
    """The replacement would read its own output: no order can feed it, and nothing moves."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    first = graph.call_function(aten.add.Tensor, (x, x))  # the match's first output
    other = graph.call_function(aten.cos.default, (x,))  # after it, not from the match: may move
    w = graph.call_function(aten.mul.Tensor, (first, other))  # from the match: may not
    graph.output((first, w))
    before = [n.name for n in graph.nodes]
    with pytest.raises(RuntimeError, match=rf"^input {w.name} of a replacement is computed from its own match$"):
        _move_inputs_before(first, [x, w], [first])
    assert [n.name for n in graph.nodes] == before
    _move_inputs_before(first, [x, other], [first])
    assert [n.name for n in graph.nodes] == [x.name, other.name, first.name, w.name, "output"]


def _with_dead_code(x):
    unused = x.cos() * 2  # dead chain of two
    del unused
    torch.rand(3)  # dead but random: impure, kept as torch keeps it
    y = x.sin()
    x.exp()  # dead
    return y + 1


@pytest.mark.parametrize("tracing", [False, True])
def test_eliminate_dead_code_removes_what_torch_removes(tracing):
    ours, theirs = make_fx(_with_dead_code)(torch.randn(5)), make_fx(_with_dead_code)(torch.randn(5))
    before = len(ours.graph.nodes)
    ctx = torch._guards.tracing(torch._guards.TracingContext(None)) if tracing else torch._guards.tracing(None)
    with ctx:
        removed = eliminate_dead_code(ours.graph)
        theirs.graph.eliminate_dead_code()
    assert [n.format_node() for n in ours.graph.nodes] == [n.format_node() for n in theirs.graph.nodes]
    rand_kept = any(n.target == aten.rand.default for n in ours.graph.nodes)
    # a random op counts as impure unless a compile is tracing and Inductor may replace its numbers
    assert rand_kept == (not tracing or torch._inductor.config.fallback_random)
    assert removed == before - len(ours.graph.nodes) == (3 if rand_kept else 4)
