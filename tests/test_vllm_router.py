"""vLLM's plain-torch DeepSeek router seen by the passes (issue 17 item 4), without starting vLLM.

What vLLM 0.32 (CPU) shows the passes for the tiny DeepSeek-V3 of tests/test_vllm.py (dumped once from a
real ``LLM`` on each route): the MoE layer is traced (vLLM's CPU platform calls it directly, not through
``vllm.moe_forward``); its router is ``CPURouter``'s ``_grouped_topk`` in plain torch
(``gating_output.float().sigmoid()``, ``+ bias.unsqueeze(0)``, group top-2 sum, group top-k,
``zeros_like(..).scatter_(1, idx, 1)`` mask, ``masked_fill(-inf)``, top-k, gather, division by the plain
sum, no routed-scaling multiply: vLLM's DeepSeek applies the factor to the experts' output), then
``ids.to(int32)`` and ``_C.cpu_fused_moe`` (fp32 weights, int32 ids: opaque).  Every route hands the
passes Inductor's decompositions: the ahead-of-time mode-2 route before Inductor's post-grad passes
(views), the post-grad and piecewise routes after them (reshapes); with ``topk_group=1`` Inductor's
joint-graph pass has made the mask's scatter a one-hot ``where``.

``vllm_grouped_topk`` below is that router copied in form; it is compiled as each route compiles it and
compared with the uncompiled function.  The last test runs it in front of vLLM's real
``_C.cpu_fused_moe`` (vLLM imported, no ``LLM`` started).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
from _helpers import rel_diff
from torch._inductor import config as inductor_config

import ascend_passes as ap


def vllm_grouped_topk(
    gating_output: torch.Tensor,
    topk: int,
    renormalize: bool,
    num_expert_group: int,
    topk_group: int,
    routed_scaling_factor: float,
    e_score_correction_bias: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """vllm/model_executor/layers/fused_moe/router/cpu_router.py ``_grouped_topk`` (vLLM 0.32), sigmoid."""
    gating_output = gating_output.float()
    scores = gating_output.sigmoid()
    num_token = scores.shape[0]
    original_scores = scores
    scores = scores + e_score_correction_bias.unsqueeze(0)
    group_scores = scores.view(num_token, num_expert_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = (
        group_mask.unsqueeze(-1)
        .expand(num_token, num_expert_group, scores.shape[-1] // num_expert_group)
        .reshape(num_token, -1)
    )
    tmp_scores = scores.masked_fill(~score_mask.bool(), float("-inf"))
    topk_ids = torch.topk(tmp_scores, k=topk, dim=-1, sorted=False)[1]
    topk_weights = original_scores.gather(1, topk_ids)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    if routed_scaling_factor != 1.0:
        topk_weights = topk_weights * routed_scaling_factor
    return topk_weights, topk_ids.to(torch.int32)


class VllmRouter(torch.nn.Module):
    """The router as vLLM's layer holds it: constants are attributes (static in the graph), the
    correction bias a fp32 parameter, the logits bf16 or fp32 [tokens, experts]."""

    def __init__(
        self,
        num_experts: int = 8,
        groups: int = 2,
        topk_group: int = 1,
        top_k: int = 2,
        renormalize: bool = True,
        scale: float = 1.0,
    ) -> None:
        super().__init__()
        self.top_k, self.renormalize, self.groups, self.topk_group, self.scale = (
            top_k,
            renormalize,
            groups,
            topk_group,
            scale,
        )
        g = torch.Generator().manual_seed(1)
        self.bias = torch.nn.Parameter(torch.randn(num_experts, generator=g) * 0.1, requires_grad=False)

    def forward(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return vllm_grouped_topk(
            logits, self.top_k, self.renormalize, self.groups, self.topk_group, self.scale, self.bias
        )


def _compile(module: torch.nn.Module, x: torch.Tensor, route: str, passes: str = "cleanup,moe") -> Any:
    """``module(x)`` compiled the way a vLLM route hands its graph to the passes (token dim dynamic):
    ``eager``: the Dynamo backend's AOT graph (no decompositions); ``aot``: vLLM's default mode 2,
    torch's ahead-of-time compile (the pipeline in Inductor's ``inner_compile``); ``post_grad``: the
    Inductor post-grad pass (vLLM's Inductor and piecewise routes)."""
    torch._dynamo.reset()
    torch._dynamo.mark_dynamic(x, 0)
    options = {"passes": passes, "compiler": "eager" if route == "eager" else "inductor", "strict": True}
    if route == "eager":
        return torch.compile(module, backend="ascend_passes", options=options)(x)
    if route == "aot":
        with torch._functorch.config.patch(bundled_autograd_cache=True), inductor_config.patch(fx_graph_cache=False):
            return torch.compile(module, backend="ascend_passes", options=options)(x)
    with inductor_config.patch(post_grad_custom_post_pass=ap.inductor_pass(**options), fx_graph_cache=False):
        return torch.compile(module)(x)


def _assert_same_routing(out: Any, ref: Any) -> None:
    """Same experts per token (top-k order may differ), same weights per expert, vLLM's dtypes."""
    (weights, ids), (ref_weights, ref_ids) = out, ref
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32, (weights.dtype, ids.dtype)
    assert torch.equal(ids.sort(-1).values, ref_ids.sort(-1).values)
    by_expert = weights.gather(1, ids.long().argsort(-1)), ref_weights.gather(1, ref_ids.long().argsort(-1))
    assert rel_diff(*by_expert) <= 1e-6


@pytest.mark.parametrize(
    "route,dtype,groups",
    [
        ("eager", torch.float32, (2, 1)),
        ("eager", torch.bfloat16, (4, 2)),
        ("aot", torch.bfloat16, (2, 1)),
        ("aot", torch.float32, (4, 2)),
        ("post_grad", torch.float32, (2, 1)),
        ("post_grad", torch.bfloat16, (4, 2)),
    ],
)
def test_vllm_grouped_topk_fused_on_every_route(route: str, dtype: torch.dtype, groups: tuple[int, int]) -> None:
    """vLLM's router becomes one moe_gating_top_k on each route (views or reshapes; with one group
    kept, Inductor's one-hot mask), with its constants read off the graph (eps 0: the plain sum;
    factor 1.0: no multiply), the same experts and weights as vLLM's function, fp32 / int32 out."""
    n_group, topk_group = groups
    num_experts = 4 * n_group  # 4 experts per group (the op needs more than 2)
    router = VllmRouter(num_experts, n_group, topk_group).eval()
    x = torch.randn(11, num_experts, generator=torch.Generator().manual_seed(0)).to(dtype)
    with torch.no_grad(), ap.capture() as reports:
        ref = router(x)
        out = _compile(router, x.clone(), route)
    _assert_same_routing(out, ref)
    (report,) = reports
    assert report.count("ascend.moe_gating_top_k") == 1, report.rewritten_ops()
    (match,) = report.passes["moe"].matches
    assert match.pattern == "deepseek_router"
    details = {k: match.details[k] for k in ("num_groups", "topk_groups", "top_k", "eps", "routed_scaling_factor")}
    assert details == {"num_groups": n_group, "topk_groups": topk_group, "top_k": 2, "eps": 0.0,
                       "routed_scaling_factor": 1.0}  # fmt: skip


def test_vllm_grouped_topk_with_scaling_in_the_router() -> None:
    """A model that hands vLLM's router its scaling factor (the multiply in the router): read, not
    defaulted."""
    router = VllmRouter(16, 4, 2, scale=2.5).eval()
    x = torch.randn(7, 16, generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), ap.capture() as reports:
        ref = router(x)
        out = _compile(router, x.clone(), "eager")
    _assert_same_routing(out, ref)
    (match,) = reports[0].passes["moe"].matches
    assert match.details["routed_scaling_factor"] == 2.5 and match.details["eps"] == 0.0


@pytest.mark.parametrize(
    "kwargs,why",
    [
        ({"num_experts": 8, "groups": 4, "topk_group": 2}, "2 experts per group (the op needs more than 2)"),
        ({"renormalize": False}, "the weights are not renormalised"),
    ],
)
def test_vllm_grouped_topk_outside_the_op_is_a_near_miss(kwargs: dict[str, Any], why: str) -> None:
    """A vLLM router the op cannot compute stays as it is, with a near-miss saying why."""
    router = VllmRouter(**kwargs).eval()
    x = torch.randn(5, router.bias.numel(), generator=torch.Generator().manual_seed(4))
    with torch.no_grad(), ap.capture() as reports:
        ref = router(x)
        out = _compile(router, x.clone(), "eager")
    assert torch.equal(out[1], ref[1]) and torch.equal(out[0], ref[0])
    (report,) = reports
    assert report.count("ascend.moe_gating_top_k") == 0 and not report.passes["moe"].matches
    reasons = [nm.reason for nm in report.passes["moe"].near_misses]
    assert any(r.startswith("router not fused into moe_gating_top_k: ") and why in r for r in reasons), reasons


# ------------------------------------------------------------------------------ with vLLM's fused experts
_HAVE_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.mark.skipif(not _HAVE_VLLM, reason="vLLM is not installed (bash tools/setup.sh --vllm)")
@pytest.mark.parametrize("route", ["eager", "aot"])
def test_vllm_moe_block_router_fused_experts_named(route: str) -> None:
    """vLLM's CPU MoE block (router → ids.to(int32) → ``_C.cpu_fused_moe`` writing into ``empty`` →
    × routed scaling): the router is fused, vLLM's op gets the fp32 weights and int32 ids it reads,
    the output equals the uncompiled block's, and the experts are named as vLLM's opaque op (by
    vllm_opaque and by the moe pass, never "no expert pattern matched")."""
    from vllm import _custom_ops as ops

    num_experts, hidden, inter = 8, 64, 32
    g = torch.Generator().manual_seed(5)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.1).to(torch.bfloat16)
    w2 = (torch.randn(num_experts, hidden, inter, generator=g) * 0.1).to(torch.bfloat16)

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = torch.nn.Linear(hidden, num_experts, bias=False).to(torch.bfloat16)
            self.router = VllmRouter(num_experts, 2, 1)
            self.w13 = torch.nn.Parameter(ops.cpu_prepack_moe_weight(w13, "vec"), requires_grad=False)
            self.w2 = torch.nn.Parameter(ops.cpu_prepack_moe_weight(w2, "vec"), requires_grad=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            weights, ids = self.router(self.gate(x))
            out = torch.empty_like(x)
            ops.cpu_fused_moe(out, x, self.w13, self.w2, None, None, weights, ids, "silu", "vec")
            return out * 2.5

    block = Block().eval()
    torch.nn.init.normal_(block.gate.weight, 0, hidden**-0.5, generator=g)
    x = torch.randn(9, hidden, generator=g).to(torch.bfloat16)
    with torch.no_grad(), ap.capture() as reports:
        ref = block(x)
        out = _compile(block, x.clone(), route, passes="cleanup,vllm_opaque,moe")
    assert torch.equal(out, ref) or rel_diff(out.float(), ref.float()) <= 1e-2
    (report,) = reports
    assert report.count("ascend.moe_gating_top_k") == 1, report.rewritten_ops()
    near = [f"{nm.pattern}: {nm.reason}" for p in report.passes.values() for nm in p.near_misses]
    assert any(nm.startswith("moe: MoE runs inside _C.cpu_fused_moe, an opaque vLLM op") for nm in near), near
    assert any(
        nm.startswith("moe_block: MoE block: the router is fused, its experts run inside _C.cpu_fused_moe")
        for nm in near
    ), near
    assert not any("no expert pattern matched" in nm or "leave this graph" in nm for nm in near), near


# ------------------------------------------------------------------------------ vLLM's TP all-reduce
@pytest.mark.skipif(not _HAVE_VLLM, reason="vLLM is not installed (bash tools/setup.sh --vllm)")
@pytest.mark.parametrize("tokens", [6, 5])
def test_vllm_all_reduce_is_the_tp_all_reduce_of_sequence_parallelism(tokens: int) -> None:
    """``torch.ops.vllm.all_reduce(x, group_name="tp:0")`` → add_rms_norm is planned like torch's
    functional all-reduce, and the rewrite emits vLLM's own ``reduce_scatter`` / ``all_gather`` over
    the same vLLM group (rows, dim 0; no wait_tensor), so the graph runs inside vLLM; an odd token
    count is padded.  Graph-level only (world size 2, rank 1): vLLM's collectives need vLLM's group
    registry, which a test without an ``LLM`` does not have."""
    import vllm.distributed.parallel_state  # noqa: F401  (registers torch.ops.vllm.all_reduce & co.)
    from torch.fx.experimental.proxy_tensor import make_fx

    import ascend_passes.ops  # noqa: F401
    from ascend_passes.pass_manager import PassResult
    from ascend_passes.passes import sequence_parallel as sp

    def layer(x: torch.Tensor, residual: torch.Tensor, gamma: torch.Tensor, w: torch.Tensor) -> Any:
        reduced = torch.ops.vllm.all_reduce(x, group_name="tp:0")
        y, _, new_residual = torch.ops.ascend.add_rms_norm(reduced, residual, gamma, 1e-6)
        return y @ w, new_residual

    hidden = 16
    inputs = (torch.randn(tokens, hidden), torch.randn(tokens, hidden), torch.ones(hidden), torch.randn(16, 8))
    gm = make_fx(layer, tracing_mode="fake")(*inputs)
    assert sp.is_tp_all_reduce(next(n for n in gm.graph.nodes if sp.vllm_group_of(n)), "tp:0")
    plan = sp.plan(gm, "tp:0")
    assert plan.vllm_group == "tp:0" and len(plan.all_reduces) == 1 and len(plan.norms) == 1
    result = PassResult("sequence_parallel")
    sp._rewrite(gm, plan, 2, 1, "tp:0", result)
    gm.graph.lint()
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count("vllm.reduce_scatter.default") == 1
    assert targets.count("vllm.all_gather.default") == 2  # y for the matmul, the residual for the output
    assert "vllm.all_reduce.default" not in targets and not any("_c10d_functional" in t for t in targets)
    assert ("aten.constant_pad_nd.default" in targets) == (tokens % 2 == 1)
    for n in gm.graph.nodes:
        if str(n.target) in ("vllm.reduce_scatter.default", "vllm.all_gather.default"):
            assert n.args[1:] == (0, 2) and n.kwargs == {"group_name": "tp:0"}, (n.args, n.kwargs)
    assert sorted(m.pattern for m in result.matches) == ["add_rms_norm_on_shard", "all_gather", "all_gather",
                                                        "reduce_scatter"]  # fmt: skip
