"""``pass_manager.lint``: the pass manager's lint after each pass accepts what ``graph.lint()``
accepts and fails with torch's message where it fails (use before definition, a foreign node,
a duplicate name, a node missing from the side table, a missing attribute or submodule)."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

from ascend_passes.pass_manager import lint


class _M(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x):
        return torch.relu(self.lin(x) * self.scale).sum(-1)


def _gm() -> fx.GraphModule:
    return fx.symbolic_trace(_M())


def _use_before_def(gm):
    relu = next(n for n in gm.graph.nodes if n.target is torch.relu)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    out.prepend(relu.args[0])  # the mul now after its user relu
    out.prepend(relu)


def _foreign(gm):
    other = fx.Graph()
    x = other.placeholder("y")
    relu = next(n for n in gm.graph.nodes if n.target is torch.relu)
    relu.args = (x,)


def _duplicate_name(gm):
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    nodes[1].name = nodes[0].name


def _not_in_side_table(gm):
    relu = next(n for n in gm.graph.nodes if n.target is torch.relu)
    gm.graph._find_nodes_lookup_table.remove(relu)


def _missing_attr(gm):
    del gm._buffers["scale"]


def _missing_module(gm):
    del gm._modules["lin"]


@pytest.mark.parametrize(
    "break_it", [_use_before_def, _foreign, _duplicate_name, _not_in_side_table, _missing_attr, _missing_module]
)
def test_fails_where_torch_lint_fails(break_it):
    gm = _gm()
    lint(gm.graph)  # the intact graph passes
    break_it(gm)
    with pytest.raises(Exception) as torchs:
        gm.graph.lint()
    with pytest.raises(type(torchs.value)) as ours:
        lint(gm.graph)
    assert str(ours.value) == str(torchs.value)


def test_side_table_key_is_checked():
    """A node filed under another target's key is not in the side table for torch: nor for us."""
    g = fx.Graph()
    x = g.placeholder("x")
    a = g.call_function(torch.relu, (x,))
    g.output(a)
    table = g._find_nodes_lookup_table.table
    table[("call_function", torch.relu)].pop(a)
    table[("call_function", torch.sigmoid)][a] = None
    with pytest.raises(RuntimeError, match="not added to the side table"):
        g.lint()
    with pytest.raises(RuntimeError, match="not added to the side table"):
        lint(g)
