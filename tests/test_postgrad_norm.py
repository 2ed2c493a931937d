"""Issue 17's NaN outside vLLM: the post-grad route (``inductor_pass(compiler="inductor",
passes="cleanup,norm")`` as Inductor's ``post_grad_custom_post_pass``) on the graph shape vLLM's
DeepSeek-V3 decoder gives.

vLLM writes every linear layer as an in-place custom op into a ``torch.empty`` buffer
(``weight_packed_linear(out=empty, ...)``, ``auto_functionalized`` in the graph), its RMSNorm with
residual in float32 (``x = x.float() + residual.float()``: the unweighted-norm row and the stage-1
``add_rms_norm`` rewrite it into ``add_rms_norm(f32, f32, ones)``), and the router as
``sigmoid(logits.float()) + e_score_correction_bias``.  On CPU, Inductor fuses the router's flat
sigmoid with the 2-D bias add and, doing so, drops the dependency of the sigmoid on the in-place
write of the logits (pytorch#185509, see ``ascend_passes.inductor_fixes``).  Whether the write then
lands after the read depends on Inductor's peak-memory reordering, i.e. on buffer sizes: the
``norm`` rewrite changed them in vLLM and the router read uninitialised memory (NaN in some runs,
wrong tokens in all).  Here the schedule is made adversarial on purpose, and legal: in-place
writers run as late as the dependencies Inductor recorded allow, so a lost dependency always shows.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch
import torch._inductor.config as inductor_config
from torch._inductor.ir import NoneLayout
from torch._inductor.scheduler import SchedulerNode

import ascend_passes as ap
from ascend_passes import inductor_fixes

H, E, LAYERS, EPS = 128, 8, 1, 1e-6

_LIB = torch.library.Library("ap_test_postgrad", "DEF")
_LIB.define("linear_out(Tensor(a!) out, Tensor x, Tensor w) -> ()")


def _linear_out(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    torch.mm(x, w.t(), out=out)


_LIB.impl("linear_out", _linear_out, "CPU")
_LIB.impl("linear_out", lambda out, x, w: None, "Meta")


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """vLLM's CPU linear: ``out = torch.empty(...); weight_packed_linear(out, x, w)``."""
    out = torch.empty((*x.shape[:-1], w.shape[0]), dtype=x.dtype, device=x.device)
    torch.ops.ap_test_postgrad.linear_out(out, x, w)
    return out


def _fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor):
    """vLLM's ``fused_add_rms_norm`` in plain torch (vllm/ir/ops/layernorm.py)."""
    orig = x.dtype
    x = x.to(torch.float32) + residual.to(torch.float32)
    residual = x.to(orig)
    x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + EPS)
    return x.to(orig) * weight, residual


class _Decoder(torch.nn.Module):
    """DeepSeek-V3's decoder as vLLM's CPU graph shows it: attention and experts reduced to
    in-place linears, the sigmoid router with its correction bias kept."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)

        def param(*shape: int, scale: float = 1.0, dtype: torch.dtype = torch.bfloat16):
            return torch.nn.Parameter((torch.randn(*shape, generator=g) * scale).to(dtype))

        self.attn = torch.nn.ParameterList([param(H, H, scale=H**-0.5) for _ in range(LAYERS)])
        self.gate = torch.nn.ParameterList([param(E, H, scale=H**-0.5) for _ in range(LAYERS)])
        # a correction bias 1 apart per expert decides the top-2 whatever the sigmoid scores (in
        # (0, 1)) are: no expert choice flips on bf16 rounding; the scores still weight the two
        self.bias = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.randperm(E, generator=g).float()) for _ in range(LAYERS)]
        )
        self.expert = torch.nn.ParameterList([param(E * H, H, scale=H**-0.5) for _ in range(LAYERS)])
        self.norms = torch.nn.ParameterList(
            [
                torch.nn.Parameter((1 + 0.1 * torch.randn(H, generator=g)).to(torch.bfloat16))
                for _ in range(2 * LAYERS + 1)
            ]
        )

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        residual = h
        for i in range(LAYERS):
            h, residual = _fused_add_rms_norm(h, residual, self.norms[2 * i])
            h = _linear(h, self.attn[i])
            h, residual = _fused_add_rms_norm(h, residual, self.norms[2 * i + 1])
            scores = _linear(h, self.gate[i]).float().sigmoid()
            choice = scores.view(-1, E) + self.bias[i].unsqueeze(0)
            ids = choice.topk(2, dim=-1).indices
            weights = scores.gather(1, ids)
            weights = weights / weights.sum(-1, keepdim=True)
            experts = _linear(h, self.expert[i]).view(-1, E, H)  # every expert on every token
            picked = experts.gather(1, ids[..., None].expand(-1, -1, H))
            h = (picked.float() * weights[..., None]).sum(1).to(h.dtype)
        return _fused_add_rms_norm(h, residual, self.norms[-1])[0]


def _late_writers(nodes: list) -> list:
    """A legal schedule that runs every in-place extern op (a writer with no output of its own)
    as late as the dependencies Inductor recorded allow: a reader that lost its dependency on the
    write then reads the ``empty`` buffer before it is written."""
    producer = {name: node for node in nodes for name in node.get_buffer_names()}

    def deferrable(node) -> bool:
        return node.is_extern() and all(isinstance(buf.node.layout, NoneLayout) for buf in node.get_outputs())

    order: list = []
    placed: set[int] = set()

    def place(node) -> None:
        if id(node) in placed:
            return
        placed.add(id(node))
        for dep in node.unmet_dependencies:
            pred = producer.get(dep.name)
            if pred is not None and pred is not node:
                place(pred)
        order.append(node)

    for node in nodes:
        if not deferrable(node):
            place(node)
    for node in nodes:
        place(node)
    return order


def _compile_and_compare(model: torch.nn.Module, token_counts: tuple[int, ...]) -> list:
    passes = ap.inductor_pass(compiler="inductor", passes="cleanup,norm")
    compiled = torch.compile(model)  # the token dim marked dynamic below, as vLLM does
    with (
        ap.capture() as reports,
        inductor_config.patch(
            post_grad_custom_post_pass=passes,
            fx_graph_cache=False,
            size_asserts=False,
            enable_auto_functionalized_v2=False,
            reorder_for_peak_memory=False,
            _post_fusion_custom_pass=_late_writers,
        ),
        torch.no_grad(),
    ):
        g = torch.Generator().manual_seed(1)
        for n in token_counts:
            x = torch.randn(n, H, generator=g).to(torch.bfloat16)
            torch._dynamo.mark_dynamic(x, 0)
            ref, out = model(x), compiled(x)
            assert not out.isnan().any(), f"{n} tokens: NaN"
            err = (out.float() - ref.float()).abs().max().item()
            assert err < 0.1, f"{n} tokens: max error {err} against eager"
    return reports


def test_post_grad_norm_route_keeps_inplace_writes_before_their_readers() -> None:
    """The vLLM graph shape through the post-grad pass: every run (new token count, new inputs)
    equals eager; the fp32 residual norms became add_rms_norm."""
    torch._dynamo.reset()
    reports = _compile_and_compare(_Decoder().eval(), (5, 17, 3, 33))
    ops = {k: v for r in reports for k, v in r.rewritten_ops().items()}
    assert ops.get("ascend.add_rms_norm", 0) == 2 * LAYERS + 1, ops
    assert math.isfinite(sum(ops.values()))


def test_inductor_fix_is_installed_once_by_the_inductor_pass() -> None:
    ap.inductor_pass(compiler="inductor", passes="cleanup")
    fixed = SchedulerNode.recompute_size_and_body
    assert getattr(fixed, inductor_fixes._MARK, False)
    inductor_fixes.install()
    assert SchedulerNode.recompute_size_and_body is fixed  # not wrapped twice


def test_without_the_fix_the_router_reads_uninitialised_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """The adversarial schedule is what exposes the Inductor bug: with the original
    ``recompute_size_and_body`` the router runs before its logits are written."""
    fixed = SchedulerNode.recompute_size_and_body
    original = getattr(fixed, "__wrapped__", fixed)
    if "if fake_deps:" not in inspect.getsource(original):
        pytest.skip("this torch re-applies mutation renames itself (pytorch#185873)")
    monkeypatch.setattr(SchedulerNode, "recompute_size_and_body", original)
    monkeypatch.setattr(inductor_fixes, "install", lambda: None)
    torch._dynamo.reset()
    with pytest.raises(AssertionError, match="NaN|max error"):
        _compile_and_compare(_Decoder().eval(), (5, 17, 3, 33))
