"""The norm pass on vLLM's native fused-add RMSNorm form (``x = a.float() + b.float(); residual =
x.to(bf16); rms(x).to(bf16) * w``) with a symbolic hidden size (issue 17, found while chasing the
post-grad route's NaN).

Stage 0 rewrites the float32 norm unweighted, its gamma ``ones(x.shape[-1])`` sized by
``sym_size(x_sum, 1)``; stage 1 fuses ``a + b → rms_norm`` into ``add_rms_norm(a, b, gamma)``, whose
``x_sum`` output replaces the add, so gamma's size reads add_rms_norm's own output: a cycle.
``stable_topological_sort`` asserts, and the rollback (``restore_graph``) then raises a SystemError
on the corrupt graph, so the whole compile fails instead of compiling on without the pass.
"""

from __future__ import annotations

import pytest
import torch

import ascend_passes as ap


def _fused_add_norm(a, b, w, w2, w3):
    h = a.to(torch.float32)
    n0 = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16) * w
    x = (n0 @ w3).to(torch.float32) + b.to(torch.float32)  # vLLM's fused_add_rms_norm, native
    residual = x.to(torch.bfloat16)
    y = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16) * w2
    return y, residual


@pytest.mark.xfail(strict=True, reason="issue 17: add_rms_norm over an unweighted norm whose gamma is "
                   "sized from the sum builds a cycle under dynamic=True; the rollback then crashes")
def test_fused_add_norm_with_symbolic_hidden_size_compiles_and_matches() -> None:
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(7, 128, generator=gen).bfloat16() for _ in range(2))
    w, w2 = (torch.randn(128, generator=gen).bfloat16() for _ in range(2))
    w3 = (torch.randn(128, 128, generator=gen) / 11).bfloat16()
    ref = _fused_add_norm(a, b, w, w2, w3)
    torch._dynamo.reset()
    with ap.capture() as reports, torch.no_grad():
        out = torch.compile(_fused_add_norm, dynamic=True, backend="ascend_passes",
                            options={"compiler": "eager", "passes": "cleanup,norm"})(a, b, w, w2, w3)
    for o, r in zip(out, ref):
        torch.testing.assert_close(o.float(), r.float(), atol=0.07, rtol=0.02)
    assert reports[-1].count("ascend.add_rms_norm") == 1
