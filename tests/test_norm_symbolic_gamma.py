"""The norm pass on vLLM's native fused-add RMSNorm form (``x = a.float() + b.float(); residual =
x.to(bf16); rms(x).to(bf16) * w``) with a symbolic hidden size (issue 17, found while chasing the
post-grad route's NaN).

Stage 0 rewrites the float32 norm unweighted, its gamma ``ones(x.shape[-1])`` sized by
``sym_size(x_sum, 1)``; stage 1 fuses ``a + b → rms_norm`` into ``add_rms_norm(a, b, gamma)``, whose
``x_sum`` output replaces the add, so gamma's size reads add_rms_norm's own output: a cycle.
``stable_topological_sort`` asserted, and the rollback (``restore_graph``) then raised a SystemError
on the corrupt graph, so the whole compile failed.  Now a match one of whose inputs is computed from
the matched nodes is refused with a near-miss (``_pattern._input_from_match``), and the rollback
works on an inconsistent graph.
"""

from __future__ import annotations

import operator

import torch

import ascend_passes as ap


def _fused_add_norm(a, b, w, w2, w3):
    h = a.to(torch.float32)
    n0 = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16) * w
    x = (n0 @ w3).to(torch.float32) + b.to(torch.float32)  # vLLM's fused_add_rms_norm, native
    residual = x.to(torch.bfloat16)
    y = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16) * w2
    return y, residual


def test_fused_add_norm_with_symbolic_hidden_size_compiles_and_matches() -> None:
    """The add + norm whose gamma is sized from the sum is left as it is (near-miss naming the
    cycle), the norms are still fused, and nothing is rolled back."""
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(7, 128, generator=gen).bfloat16() for _ in range(2))
    w, w2 = (torch.randn(128, generator=gen).bfloat16() for _ in range(2))
    w3 = (torch.randn(128, 128, generator=gen) / 11).bfloat16()
    ref = _fused_add_norm(a, b, w, w2, w3)
    torch._dynamo.reset()
    with ap.capture() as reports, torch.no_grad():
        out = torch.compile(
            _fused_add_norm,
            dynamic=True,
            backend="ascend_passes",
            options={"compiler": "eager", "passes": "cleanup,norm"},
        )(a, b, w, w2, w3)
    for o, r in zip(out, ref):
        torch.testing.assert_close(o.float(), r.float(), atol=0.07, rtol=0.02)
    report = reports[-1]
    norm = report.passes["norm"]
    assert norm.status == "ok", norm.error
    assert report.count("ascend.rms_norm") == 2
    assert report.count("ascend.add_rms_norm") == 0
    reasons = [nm.reason for nm in norm.near_misses if nm.pattern == "add_rms_norm"]
    assert reasons and all("replacing it would make a cycle" in r for r in reasons), norm.near_misses


def test_restore_graph_repairs_a_graph_left_with_a_cycle() -> None:
    """A pass that raised after leaving a use before its definition (a cycle) is rolled back: the
    graph object is refilled from the snapshot instead of failing inside erase_node."""
    from ascend_passes.pass_manager import restore_graph

    def f(x):
        return (x + 1).relu() * 2

    gm = torch.fx.symbolic_trace(f)
    saved = torch.fx.Graph()
    out = saved.graph_copy(gm.graph, {}, return_output_node=True)
    saved.output(out[0] if isinstance(out, tuple) else out)
    add, relu = (n for n in gm.graph.nodes if n.op in ("call_function", "call_method") and n.target is not operator.mul)
    add.args = (relu, 1)  # add now reads relu, which reads add: a cycle
    restore_graph(gm.graph, saved)
    gm.graph.lint()
    gm.recompile()
    x = torch.randn(5)
    torch.testing.assert_close(gm(x), f(x))
