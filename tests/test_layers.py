"""Layer attribution (``passes/layers.py``): a node's layer is the first numbered child of a module
list on its module path, whatever the model calls the list (``layers``, ``blocks``, ``h``), read from
the model's root even in a graph Dynamo started inside a layer after a graph break (DBRX's
``DbrxFFN.forward``: paths relative to the frame's module, its own ops without a module stack)."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch import nn

from ascend_passes.passes.layers import layer_of, module_path, where


def _node(path: str | None, cls: type = nn.Linear) -> fx.Node:
    graph = fx.Graph()
    x = graph.placeholder("x")
    node = graph.call_function(torch.ops.aten.relu.default, (x,))
    if path is not None:
        node.meta["nn_module_stack"] = {"k": (path, cls)}
    graph.output(node)
    return node


@pytest.mark.parametrize(
    "path, layer",
    [
        ("L['self'].lm.model.layers.3.mlp.gate", "model.layers.3"),
        ("L['self'].transformer.blocks.3.ffn.router.layer", "transformer.blocks.3"),  # DBRX
        ("L['self'].model.decoder.layers.0.fc1", "decoder.layers.0"),  # encoder-decoder
        ("L['self'].transformer.h.2.mlp", "transformer.h.2"),  # GPT-2
        ("L['self'].h.2.attn", "h.2"),
        ("L['self'].model.layers.1.mlp.experts.5.up_proj", "model.layers.1"),  # the layer, not the expert
        ("L['self'].mtp.layers.0.eh_proj", "mtp.layers.0"),
        ("L['self'].experts.3.gate_proj", None),  # a MoE block compiled alone: an expert is no layer
        ("L['self'].mlp.local_experts.0.w1", None),
        ("L['self'].lm_head", None),
    ],
)
def test_layer_of_any_numbered_module_list(path, layer):
    assert layer_of(_node(path)) == layer


def test_where_names_the_module_outside_layers():
    assert where(_node("L['self'].mlp.experts.3.gate_proj", nn.Linear)) == "mlp.experts.3.gate_proj (Linear)"
    assert where(_node(None)) is None


# ----------------------------------------------------------------------------- after a graph break
class _FFN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(8, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()  # the next graph starts here, inside blocks.N.ffn
        logits = self.router(x)
        return x + logits.topk(2, dim=-1).values.sum(-1, keepdim=True)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.ffn = _FFN()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ffn(self.norm(x))


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.Module()
        self.transformer.blocks = nn.ModuleList([_Block(), _Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.transformer.blocks:
            x = block(x)
        return x


def test_layer_of_a_graph_started_inside_a_layer():
    """The graph Dynamo compiles for ``_FFN.forward`` (after its graph break) knows only ``router``
    (relative to the frame's ``self``) and has a top-k without any module stack: both are placed in
    ``transformer.blocks.0`` (the instance the graph was compiled for), read off the model being
    called while Dynamo compiles."""
    seen: list[tuple[str, str | None, str | None]] = []

    def backend(gm: fx.GraphModule, example_inputs: list) -> object:
        for node in gm.graph.nodes:
            if node.op in ("call_function", "call_method"):
                seen.append((str(node.target), layer_of(node), module_path(node)))
        return gm.forward

    torch._dynamo.reset()
    model = _Model().eval()
    x = torch.randn(3, 8)
    with torch.no_grad():
        ref = model(x)
        out = torch.compile(model, backend=backend)(x)
    torch.testing.assert_close(out, ref)
    ffn = [(target, layer, path) for target, layer, path in seen if "topk" in target]
    assert ffn, seen
    assert {layer for _, layer, _ in ffn} == {"transformer.blocks.0"}, ffn
    assert {path for _, _, path in ffn} == {"transformer.blocks.0.ffn"}, ffn
    routers = [(layer, path) for target, layer, path in seen if "linear" in target]
    assert ("transformer.blocks.0", "transformer.blocks.0.ffn.router") in routers, routers
    norms = [layer for target, layer, _ in seen if "layer_norm" in target]
    assert norms and set(norms) <= {"transformer.blocks.0", "transformer.blocks.1"}, norms


def test_no_prefix_outside_dynamo():
    """A graph traced without Dynamo (``make_fx``): paths as the stack says, nothing invented."""
    node = _node("L['self'].router")
    assert module_path(node) == "router"
    assert layer_of(node) is None
