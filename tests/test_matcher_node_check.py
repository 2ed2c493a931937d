"""``passes._nodes.matcher_node_check``: inside it torch's pattern matcher answers its per-node type
check (``fallback_node_due_to_unsupported_type``) without a fake-mode dispatch per tensor, and
every answer is the one torch's function gives (CPU / meta / sparse / complex / float8 values,
with and without C++ codegen)."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch._inductor import config as inductor_config
from torch._inductor import lowering
from torch._inductor import pattern_matcher as pm
from torch._subclasses.fake_tensor import FakeTensorMode

from ascend_passes.passes import _nodes

aten = torch.ops.aten


def _graph() -> fx.Graph:
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    g = fx.Graph()
    with mode:
        values = {
            "f32": torch.empty(4, 8),
            "bf16": torch.empty(4, 8, dtype=torch.bfloat16),
            "i64": torch.empty(4, dtype=torch.int64),
            "meta": torch.empty(4, 8, device="meta"),
            "c64": torch.empty(4, 8, dtype=torch.complex64),
            "f8": torch.empty(4, 8, dtype=torch.float8_e4m3fn),
            "e8m0": torch.empty(4, 8, dtype=torch.float8_e8m0fnu),
            "sparse": torch.empty(4, 8).to_sparse(),
        }
    nodes = {}
    for name, val in values.items():
        n = g.placeholder(name)
        n.meta["val"] = val
        nodes[name] = n
    with mode:
        for n in list(nodes.values()):
            v = n.meta["val"]
            for target, args in (
                (aten.clone.default, (n,)),
                (aten.view.dtype, (n, v.dtype)),
                (aten.cat.default, ([n, n],)),
            ):
                try:
                    out = target(*fx.node.map_arg(args, lambda a: a.meta["val"]))
                except Exception:  # noqa: BLE001  (an op a dtype / layout lacks: not a case)
                    continue
                m = g.call_function(target, args)
                m.meta["val"] = out
        # a CPU value read by a node whose own value is on meta, and a multi-output node
        both = g.call_function(aten.add.Tensor, (nodes["f32"], nodes["meta"]))
        both.meta["val"] = torch.empty(4, 8, device="meta")
        split = g.call_function(aten.split.Tensor, (nodes["bf16"], 2))
        split.meta["val"] = list(torch.split(values["bf16"], 2))
        plain = g.call_function(aten.mul.Tensor, (nodes["f32"], 2.0))  # no value
    g.output((both, split, plain))
    return g


@pytest.mark.parametrize("disable_cpp", [False, True])
def test_answers_are_torchs(disable_cpp, monkeypatch):
    monkeypatch.setattr(inductor_config, "disable_cpp_codegen", disable_cpp)
    # torch's own check installed (a process that imported vLLM has vLLM's: see the last test)
    monkeypatch.setattr(pm, "fallback_node_due_to_unsupported_type", lowering.fallback_node_due_to_unsupported_type)
    g = _graph()
    with _nodes.matcher_node_check():
        torchs = _nodes._INSTALLED[0]
        assert pm.fallback_node_due_to_unsupported_type is _nodes._fallback_node
        ours = {n.name: pm.fallback_node_due_to_unsupported_type(n, allow_cpu_inputs=False) for n in g.nodes}
    expected = {n.name: torchs(n, allow_cpu_inputs=False) for n in g.nodes}
    assert ours == expected
    assert any(expected.values()) and not all(expected.values())  # both answers occur
    # outside the context the installed function is torch's
    assert {n.name: pm.fallback_node_due_to_unsupported_type(n, allow_cpu_inputs=False) for n in g.nodes} == expected


def test_no_fake_dispatch_per_tensor(monkeypatch):
    """The point of it: ``is_meta`` / ``is_cpu`` of a fake tensor dispatch to the fake mode;
    inside the context a plain-dtype node asks none."""
    g = _graph()
    calls = []
    real = torch._subclasses.fake_tensor.FakeTensor.__torch_dispatch__.__func__

    def counting(cls, func, types, args=(), kwargs=None):
        calls.append(func)
        return real(cls, func, types, args, kwargs)

    monkeypatch.setattr(pm, "fallback_node_due_to_unsupported_type", lowering.fallback_node_due_to_unsupported_type)
    monkeypatch.setattr(torch._subclasses.fake_tensor.FakeTensor, "__torch_dispatch__", classmethod(counting))
    plain = [
        n for n in g.nodes if n.op == "call_function" and {a.name for a in n.all_input_nodes} <= {"f32", "bf16", "i64"}
    ]
    assert plain
    with _nodes.matcher_node_check():
        for n in plain:
            pm.fallback_node_due_to_unsupported_type(n, allow_cpu_inputs=False)
    assert calls == []
    for n in plain:
        _nodes._INSTALLED[0](n, allow_cpu_inputs=False)
    assert calls  # torch's own function dispatches (the test can see a dispatch)


def test_another_librarys_check_stays_in_place(monkeypatch):
    """A check another library installed (vLLM's ``env_override`` wraps torch's so that custom ops
    are always matchable) is neither replaced nor bypassed inside the context, and torch's own
    check comes back after it (found by CI: a worker that had imported vLLM)."""
    seen = []

    def libraries_check(node, allow_cpu_inputs=True):
        seen.append(node)
        return False

    monkeypatch.setattr(pm, "fallback_node_due_to_unsupported_type", libraries_check)
    g = _graph()
    with _nodes.matcher_node_check():
        assert pm.fallback_node_due_to_unsupported_type is libraries_check
        assert not any(pm.fallback_node_due_to_unsupported_type(n) for n in g.nodes)
    assert len(seen) == len(g.nodes)
    assert pm.fallback_node_due_to_unsupported_type is libraries_check

    monkeypatch.setattr(pm, "fallback_node_due_to_unsupported_type", lowering.fallback_node_due_to_unsupported_type)
    with _nodes.matcher_node_check():
        assert pm.fallback_node_due_to_unsupported_type is _nodes._fallback_node
    assert pm.fallback_node_due_to_unsupported_type is lowering.fallback_node_due_to_unsupported_type
