"""Layouts (strides) of rewrites: a compiled model never crashes where the uncompiled one runs.

The fused ops return contiguous tensors; the ATen ops they replace returned their inputs' layout,
and later views were traced against it.  Regression tests of issue 19 item 1 — Hugging Face
``hunyuan_v1_moe`` (q/k RMSNorm after ``transpose(1, 2)``) and ``jamba`` (Mamba's
``up * silu(gate)`` on transposed ``[B, D, S]`` tensors) crashed in their first forward with
"view size is not compatible with input tensor's size and stride" — then small graphs for the
layout-keeping replacements, the near-miss when a layout cannot be kept, and the pass manager's
check that rolls back a rewrite breaking a later view.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import transformers
from _helpers import rel_diff
from torch.fx.experimental.proxy_tensor import make_fx

import ascend_passes as ap
from ascend_passes.config import AscendPassConfig
from ascend_passes.errors import PassError
from ascend_passes.pass_manager import Pass, PassContext, PassManager, PassResult

aten = torch.ops.aten


def _compile(fn, inputs, **options):
    torch._dynamo.reset()
    with torch.no_grad(), ap.capture() as reports:
        out = torch.compile(fn, backend="ascend_passes", options=options)(*inputs)
    return out, reports


# ----------------------------------------------------------------------------- HF models
def hunyuan_v1_moe(experts: str) -> tuple[torch.nn.Module, torch.Tensor]:
    config = transformers.HunYuanMoEV1Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        moe_topk=2,
        max_position_embeddings=64,
    )
    config._experts_implementation = experts
    torch.manual_seed(0)
    return transformers.HunYuanMoEV1ForCausalLM(config).eval(), torch.randint(0, 128, (2, 5))


def jamba(experts: str) -> tuple[torch.nn.Module, torch.Tensor]:
    # layer 0: attention + dense MLP; layer 1: Mamba + MoE (4 experts)
    config = transformers.JambaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        expert_layer_period=2,
        expert_layer_offset=1,
        attn_layer_period=2,
        attn_layer_offset=0,
        use_mamba_kernels=False,
        mamba_d_state=8,
        mamba_expand=2,
        max_position_embeddings=64,
    )
    config._experts_implementation = experts
    torch.manual_seed(0)
    return transformers.JambaForCausalLM(config).eval(), torch.randint(0, 128, (2, 4))


# model -> (factory, final-graph op counts, layers of the activation pass's swiglu rewrites)
MODELS = {
    # 2 x (input, post-attention, q, k) norms + the final one; q/k norms follow RoPE's add, so
    # all but the first norm take their residual add: 1 rms_norm + 8 add_rms_norm
    "hunyuan_v1_moe": (
        hunyuan_v1_moe,
        {
            "ascend.rms_norm": 1,
            "ascend.add_rms_norm": 8,
            "ascend.moe_gating_top_k_softmax": 2,
            "ascend.grouped_matmul": 4,
        },
        None,
    ),
    # layer 0: input + pre-ff norms, dense SwiGLU MLP; layer 1: Mamba's dt/B/C norms and its
    # gate (up * silu(gate) on [B, D, S]), input + pre-ff norms, MoE; the final norm
    "jamba": (
        jamba,
        {
            "ascend.rms_norm": 4,
            "ascend.add_rms_norm": 4,
            "ascend.swiglu": 3,
            "ascend.moe_gating_top_k_softmax": 1,
            "ascend.grouped_matmul": 2,
        },
        ["model.layers.0", "model.layers.1"],
    ),
}

# every model with both experts implementations, each downstream compiler with both models
CASES = [
    ("hunyuan_v1_moe", "grouped_mm", "eager"),
    ("hunyuan_v1_moe", "batched_mm", "inductor"),
    ("jamba", "grouped_mm", "inductor"),
    ("jamba", "batched_mm", "eager"),
]


@pytest.mark.parametrize("name,experts,compiler", CASES, ids=["-".join(c) for c in CASES])
def test_hf_model_with_transposed_operands_runs_fused(name, experts, compiler):
    factory, counts, swiglu_layers = MODELS[name]
    model, ids = factory(experts)
    with torch.no_grad():
        ref = model(ids, use_cache=False).logits
    out, reports = _compile(model, (ids,), compiler=compiler)
    assert rel_diff(out.logits, ref) <= 1e-4
    (report,) = reports
    assert {p: r.status for p, r in report.passes.items() if r.status != "ok"} == {}
    assert {op: report.count(op) for op in counts} == counts
    assert report.passes["norm"].near_misses == []
    if swiglu_layers is not None:
        assert sorted(m.layer for m in report.passes["activation"].matches) == swiglu_layers


# ----------------------------------------------------------------------------- small graphs
def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def qk_norm_attention(x, wq, wo, gamma):
    """q = norm(proj(x) as [B, H, S, D] after transpose); SDPA keeps q's layout; the output's
    ``transpose(1, 2).view(B, S, -1)`` is valid only for q laid out [B, S, H, D]."""
    b, s, _ = x.shape
    q = (x @ wq).view(b, s, 4, 8).transpose(1, 2)
    q = _rms(q, gamma)
    o = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    return o.transpose(1, 2).view(b, s, -1) @ wo


def mamba_gate(x, w_in, w_out):
    """Mamba's gate: ``up * silu(gate)`` on [B, D, S] views of [B, S, D] projections, then a
    ``transpose(1, 2)`` and a view valid only for that layout."""
    projected = (x @ w_in).transpose(1, 2)
    up, gate = projected.chunk(2, dim=1)
    y = up * torch.nn.functional.silu(gate)
    b, _, s = y.shape
    return y.transpose(1, 2).view(b * s, -1) @ w_out


def halves_gate(x, w_in, w_out):
    """A fused gate_up projection laid out [B, 2I, S], split along its last (non-innermost) dim
    by ``chunk(2, -1)``: swiglu halves along a dim that is not innermost in memory."""
    gate_up = (x @ w_in).transpose(1, 2)
    gate, up = gate_up.chunk(2, dim=-1)
    y = torch.nn.functional.silu(gate) * up
    return y.transpose(1, 2).view(-1, y.shape[1]) @ w_out


def norm_over_non_innermost_dim(x, gamma):
    """RMSNorm over the last dim of a transposed tensor, whose innermost dim is another one: the
    fused norm cannot return that layout, so the norm stays (near-miss) and the view runs."""
    h = _rms(x.transpose(1, 2), gamma)
    return h.transpose(1, 2).view(x.shape[0], -1)


SMALL = {
    "qk_norm": (
        qk_norm_attention,
        lambda: (torch.randn(2, 5, 32), torch.randn(32, 32) / 6, torch.randn(32, 16) / 6, torch.rand(8) + 0.5),
        {"ascend.rms_norm": 1},
    ),
    "mamba_gate": (
        mamba_gate,
        lambda: (torch.randn(2, 5, 16), torch.randn(16, 24) / 4, torch.randn(12, 16) / 4),
        {"ascend.swiglu": 1},
    ),
    "halves_gate": (
        halves_gate,
        lambda: (torch.randn(2, 6, 16), torch.randn(16, 5) / 4, torch.randn(5, 8) / 4),
        {"ascend.swiglu": 1},
    ),
}


@pytest.mark.parametrize("name", SMALL)
@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_replacement_keeps_the_replaced_layout(name, compiler):
    fn, make_inputs, counts = SMALL[name]
    torch.manual_seed(0)
    inputs = make_inputs()
    out, (report,) = _compile(fn, inputs, passes="cleanup,norm,activation", compiler=compiler)
    assert rel_diff(out, fn(*inputs)) <= 1e-5
    assert all(r.status == "ok" for r in report.passes.values())
    assert {op: report.count(op) for op in counts} == counts


def test_norm_whose_normalised_dim_is_not_innermost_is_a_near_miss():
    torch.manual_seed(0)
    x, gamma = torch.randn(2, 8, 5), torch.rand(8) + 0.5
    out, (report,) = _compile(norm_over_non_innermost_dim, (x, gamma), passes="cleanup,norm", compiler="eager")
    assert rel_diff(out, norm_over_non_innermost_dim(x, gamma)) <= 1e-5
    norm = report.passes["norm"]
    assert norm.status == "ok" and report.count("ascend.rms_norm") == 0
    (miss,) = norm.near_misses
    assert miss.pattern == "rms_norm"
    assert miss.reason.startswith("the normalised dim is not innermost in memory (memory order of dims [0, 2, 1])")


# ----------------------------------------------------------------------------- the pass manager
def _transposed_then_viewed(a):
    t = a.transpose(0, 1) * 2  # laid out as a: t.transpose(0, 1) is contiguous
    return t.transpose(0, 1).view(-1) + 1


class _Relayout(Pass):
    """Puts a ``clone`` after the ``mul``: contiguous (breaks the later view) or preserving."""

    name = "relayout"

    def __init__(self, config: AscendPassConfig, memory_format: torch.memory_format) -> None:
        super().__init__(config)
        self.memory_format = memory_format

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        result = PassResult(self.name)
        (mul,) = gm.graph.find_nodes(op="call_function", target=aten.mul.Tensor)
        with gm.graph.inserting_after(mul):
            clone = gm.graph.call_function(aten.clone.default, (mul,), {"memory_format": self.memory_format})
        with mul.meta["val"].fake_mode:
            clone.meta["val"] = aten.clone.default(mul.meta["val"], memory_format=self.memory_format)
        mul.replace_all_uses_with(clone, delete_user_cb=lambda user: user is not clone)
        result.match("relayout", nodes=[mul])
        return result


def _graph() -> tuple[fx.GraphModule, torch.Tensor]:
    a = torch.randn(3, 4)
    return make_fx(_transposed_then_viewed, tracing_mode="fake")(a), a


@pytest.mark.parametrize("strict", [False, True])
def test_rewrite_that_breaks_a_later_view_is_rolled_back(strict):
    gm, a = _graph()
    targets = [n.target for n in gm.graph.nodes]
    config = AscendPassConfig(strict=strict)
    manager = PassManager(config, [_Relayout(config, torch.contiguous_format)])
    ctx = PassContext(config, [gm.graph.find_nodes(op="placeholder")[0].meta["val"]])
    if strict:
        with pytest.raises(
            PassError,
            match=r"pass 'relayout' failed: LayoutChangeError: view\w* "
            r"\(aten\.view\.default\) can no longer run",
        ):
            manager.run(gm, ctx)
        assert [n.target for n in gm.graph.nodes] == targets  # put back before raising
        return
    result = manager.run(gm, ctx).passes["relayout"]
    assert result.status == "rolled_back" and result.matches == []
    assert result.error.startswith("LayoutChangeError: view")
    assert "mul (strides (1, 4)) replaced by clone_default (aten.clone.default, strides (3, 1))" in result.error
    assert "view size is not compatible" in result.error or "Cannot view" in result.error
    assert [n.target for n in gm.graph.nodes] == targets  # the graph as it was, and it runs
    torch.testing.assert_close(gm(a), _transposed_then_viewed(a))


def test_rewrite_that_keeps_the_layout_passes_the_check():
    gm, a = _graph()
    config = AscendPassConfig()
    manager = PassManager(config, [_Relayout(config, torch.preserve_format)])
    result = manager.run(gm, PassContext(config, None)).passes["relayout"]
    assert result.status == "ok" and result.num_matches == 1
    assert len(gm.graph.find_nodes(op="call_function", target=aten.clone.default)) == 1
    torch.testing.assert_close(gm(a), _transposed_then_viewed(a))
