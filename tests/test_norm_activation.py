"""The norm and activation passes: RMSNorm → ascend.rms_norm / add_rms_norm, SwiGLU → ascend.swiglu,
on tiny Hugging Face DeepseekV3 / Qwen3-MoE and on small hand-written blocks; near-misses; the
Inductor post-grad path; the shared pattern-pass machinery."""

from __future__ import annotations

import collections

import pytest
import torch
import torch.nn.functional as F
from _helpers import forward_with_hooks
from torch import nn

import ascend_passes as ap
from ascend_passes import models
from ascend_passes.passes import activation as activation_pass
from ascend_passes.passes import norm as norm_pass
from ascend_passes.passes._pattern import PatternPass, Rewrite

PASSES = "cleanup,norm,activation"  # independent of the passes after them (moe, ...)
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def _compile(model, inputs, **options):
    torch._dynamo.reset()
    options = {"passes": PASSES, "compiler": "eager", **options}
    with torch.no_grad(), ap.capture() as reports:
        out = torch.compile(model, backend="ascend_passes", options=options)(*inputs)
    assert len(reports) == 1
    return out, reports[0]


def _assert_close(out, ref, dtype):
    out, ref = out.double(), ref.double()
    scale = ref.abs().max().item()
    diff = (out - ref).abs().max().item()
    assert diff <= TOL[dtype] * max(scale, 1.0), f"max abs diff {diff:.3g} at output scale {scale:.3g}"


def _executed(model, inputs, predicate) -> collections.Counter:
    """Forward calls per module class name, for modules where ``predicate(module)``."""
    calls: collections.Counter = collections.Counter()
    forward_with_hooks(
        model,
        inputs,
        [m for m in model.modules() if predicate(m)],
        lambda i, mod, args, out: calls.update([type(mod).__name__]),
    )
    return calls


# ----------------------------------------------------------------------------- HF models
HF_CASES = {
    # (factory, dtype, compiler): a fp32 and a bf16 compile for each model, each compiler once
    "deepseek_v3-fp32-eager": (
        lambda dt: models.deepseek_v3("grouped_mm", num_layers=2, dtype=dt),
        torch.float32,
        "eager",
    ),
    "deepseek_v3-bf16-inductor": (
        lambda dt: models.deepseek_v3("grouped_mm", num_layers=2, dtype=dt),
        torch.bfloat16,
        "inductor",
    ),
    "qwen3_moe-bf16-eager": (
        lambda dt: models.qwen3_moe("grouped_mm", num_layers=2, dtype=dt),
        torch.bfloat16,
        "eager",
    ),
    "qwen3_moe-fp32-inductor": (
        lambda dt: models.qwen3_moe("grouped_mm", num_layers=1, dtype=dt),
        torch.float32,
        "inductor",
    ),
}


@pytest.fixture(scope="module", params=list(HF_CASES))
def hf(request):
    factory, dtype, compiler = HF_CASES[request.param]
    model, inputs = factory(dtype)
    with torch.no_grad():
        ref = model(*inputs)
    norms = _executed(model, inputs, lambda m: type(m).__name__.endswith("RMSNorm"))
    mlps = _executed(model, inputs, lambda m: type(m).__name__.endswith("MLP"))  # dense + shared
    moe_experts = _executed(model, inputs, lambda m: type(m).__name__.endswith("Experts"))
    out, report = _compile(model, inputs, compiler=compiler, strict=True)
    return dict(
        name=request.param,
        model=model,
        dtype=dtype,
        ref=ref,
        out=out,
        report=report,
        norms=sum(norms.values()),
        mlps=sum(mlps.values()),
        experts=sum(moe_experts.values()),
    )


def test_hf_every_rmsnorm_rewritten(hf):
    report = hf["report"]
    rms, add_rms = report.count("ascend.rms_norm"), report.count("ascend.add_rms_norm")
    assert hf["norms"] > 0 and rms + add_rms == hf["norms"]
    assert report.count("aten.rsqrt") == 0
    norm = report.passes["norm"]
    assert norm.status == "ok" and norm.near_misses == []
    assert norm.counts() == {"rms_norm": hf["norms"], "add_rms_norm": add_rms}
    # every decoder layer but the first starts with residual add + norm, every layer has a
    # post-attention add + norm, and the final norm follows the last residual add
    layers = hf["model"].config.num_hidden_layers
    assert add_rms == 2 * layers


def test_hf_every_dense_mlp_and_shared_expert_is_swiglu(hf):
    report = hf["report"]
    act = report.passes["activation"]
    assert act.counts().get("swiglu", 0) == hf["mlps"]
    # with the moe pass out of the pipeline, the experts' fused gate_up halves become swiglu too
    assert act.counts().get("swiglu_halves", 0) == hf["experts"]
    assert report.count("ascend.swiglu") == hf["mlps"] + hf["experts"]
    assert report.count("aten.silu") == 0


def test_hf_outputs_match_uncompiled(hf):
    _assert_close(hf["out"], hf["ref"], hf["dtype"])


def test_hf_matches_name_their_layers_and_keep_metadata(hf):
    report = hf["report"]
    matches = report.passes["norm"].matches + report.passes["activation"].matches
    layers = {m.layer for m in matches}
    # passes.layers.layer_of: "model.layers.<i>" (how much of the prefix is kept is its business)
    expected = {str(i) for i in range(hf["model"].config.num_hidden_layers)}
    assert {layer.rsplit("layers.", 1)[-1] for layer in layers if layer} == expected
    assert None in layers  # the final norm sits outside the decoder layers
    assert all(m.details["module"] and m.nodes for m in matches)
    modules = {m.details["module"].rsplit(".", 1)[-1] for m in report.passes["norm"].matches}
    expected = {"input_layernorm", "post_attention_layernorm", "norm"}
    # DeepseekV3's MLA norms; Qwen3's per-head q/k norms (last dim of [B, S, heads, head_dim])
    expected |= {"q_a_layernorm", "kv_a_layernorm"} if "deepseek" in hf["name"] else {"q_norm", "k_norm"}
    assert modules == expected
    for node in report.graph.graph.nodes:
        if node.op == "call_function" and str(node.target).startswith("ascend."):
            assert "val" in node.meta and "nn_module_stack" in node.meta
            assert "modeling_" in node.meta["stack_trace"]  # the model's source, not the pattern's


# ----------------------------------------------------------------------------- small blocks
class RMSNorm(nn.Module):
    """Hugging Face's RMSNorm (fp32 upcast), optionally without the weight."""

    def __init__(self, width: int, eps: float = 1e-6, weight: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(width)) if weight else None
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + self.eps)
        return self.weight * h.to(dtype) if self.weight is not None else h.to(dtype)


class MLP(nn.Module):
    def __init__(self, width: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(width, inter, bias=False)
        self.up_proj = nn.Linear(width, inter, bias=False)
        self.down_proj = nn.Linear(inter, width, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, width: int, eps: float, weight: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(width, eps, weight)
        self.attn = nn.Linear(width, width)
        self.post_attention_layernorm = RMSNorm(width, eps, weight)
        self.mlp = MLP(width, 2 * width)

    def forward(self, hidden):
        residual = hidden
        hidden = residual + self.attn(self.input_layernorm(hidden))
        residual = hidden
        return residual + self.mlp(self.post_attention_layernorm(hidden))


class Tiny(nn.Module):
    def __init__(self, width: int = 32, layers: int = 2, eps: float = 1e-6, weight: bool = True):
        super().__init__()
        self.layers = nn.ModuleList(Block(width, eps, weight) for _ in range(layers))
        self.norm = RMSNorm(width, eps, weight)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight", [True, False], ids=["weight", "no_weight"])
def test_block_norms_with_and_without_weight(dtype, weight):
    torch.manual_seed(0)
    model = Tiny(eps=1e-5, weight=weight).to(dtype).eval()
    x = torch.randn(2, 5, 32, dtype=dtype)
    out, report = _compile(model, (x,))
    with torch.no_grad():
        _assert_close(out, model(x), dtype)
    # 5 norms: layers.0.input (plain), then four residual add + norm
    assert report.count("ascend.rms_norm") == 1 and report.count("ascend.add_rms_norm") == 4
    assert report.count("ascend.swiglu") == 2
    matches = report.passes["norm"].matches
    assert {m.details["eps"] for m in matches} == {1e-5}  # captured, not the op's default
    assert {m.layer for m in matches} == {"layers.0", "layers.1", None}  # None: the final norm


@pytest.mark.parametrize("eps", [1e-6, 3e-4])
def test_eps_and_width_come_from_the_graph(eps):
    """eps equal to the op default (dropped from the traced call) and any other; widths 24/40."""
    torch.manual_seed(0)
    for width in (24, 40):
        model = Tiny(width=width, layers=1, eps=eps).eval()
        x = torch.randn(3, width)
        out, report = _compile(model, (x,))
        with torch.no_grad():
            _assert_close(out, model(x), torch.float32)
        assert report.count("ascend.add_rms_norm") == 2 and report.count("ascend.rms_norm") == 1
        for node in report.graph.graph.nodes:
            if str(node.target).startswith("ascend.") and "rms_norm" in str(node.target):
                got = node.args[-1] if isinstance(node.args[-1], float) else 1e-6
                assert got == eps


def test_dynamic_token_count():
    """A symbolic token dim (vLLM marks it dynamic) is matched like a static one."""
    torch.manual_seed(0)
    model = Tiny(eps=1e-5).eval()
    torch._dynamo.reset()
    options = {"passes": PASSES, "compiler": "eager", "strict": True}
    with torch.no_grad(), ap.capture() as reports:
        compiled = torch.compile(model, backend="ascend_passes", options=options)
        for tokens in (3, 7):
            x = torch.randn(tokens, 5, 32)
            torch._dynamo.mark_dynamic(x, 0)
            _assert_close(compiled(x), model(x), torch.float32)
    (report,) = reports  # one graph for both token counts
    assert report.count("ascend.rms_norm") == 1 and report.count("ascend.add_rms_norm") == 4


def test_rms_norm_over_head_dim_of_4d_tensor():
    """Qwen3's q_norm / k_norm normalise the last dim of [B, S, heads, head_dim]."""

    class HeadNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_norm = RMSNorm(8)

        def forward(self, q):
            return self.q_norm(q.view(*q.shape[:-1], 4, 8)).flatten(-2)

    model = HeadNorm().eval()
    x = torch.randn(2, 3, 32)
    out, report = _compile(model, (x,))
    with torch.no_grad():
        _assert_close(out, model(x), torch.float32)
    assert report.count("ascend.rms_norm") == 1


def test_swiglu_operand_orders_and_fused_halves():
    class Variants(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up = nn.Linear(16, 48)

        def forward(self, x):
            gu = self.gate_up(x)
            a, b, c = gu[..., :16], gu[..., 16:32], gu[..., 32:]
            halves_gate, halves_up = self.gate_up(x * 2)[..., :32].chunk(2, dim=-1)
            return (
                F.silu(a) * b,
                c * F.silu(b),  # both operand orders
                F.silu(halves_gate) * halves_up,  # split of one tensor: no copy
                F.silu(c) * a[..., :1],
            )  # broadcasting: not a swiglu

    model = Variants().eval()
    x = torch.randn(4, 16)
    out, report = _compile(model, (x,))
    with torch.no_grad():
        for o, r in zip(out, model(x)):
            _assert_close(o, r, torch.float32)
    counts = report.passes["activation"].counts()
    assert counts.get("swiglu") == 2
    assert report.count("ascend.swiglu") == 2 + counts.get("swiglu_halves", 0)
    assert report.count("aten.silu") >= 1  # the broadcasting one stays
    assert any("broadcast" in nm.reason for nm in report.passes["activation"].near_misses)


# ----------------------------------------------------------------------------- near-misses
class AlmostRMSNorm(nn.Module):
    def __init__(self, width: int, kind: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(width))
        self.register_buffer("eps_tensor", torch.tensor(1e-6))
        self.kind = kind

    def forward(self, x):
        dtype = x.dtype
        h = x.to(torch.float32)
        if self.kind == "mean_over_dim0":
            h = h * torch.rsqrt(h.pow(2).mean(0, keepdim=True) + 1e-6)
        elif self.kind == "eps_after_rsqrt":
            h = h * (torch.rsqrt(h.pow(2).mean(-1, keepdim=True)) + 1e-6)
        elif self.kind == "eps_tensor":
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps_tensor)
        elif self.kind == "weight_before_cast":
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
            return (self.weight.float() * h).to(dtype)
        return self.weight * h.to(dtype)


class AlmostModel(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.ModuleDict({"proj": nn.Linear(16, 16), "norm": AlmostRMSNorm(16, kind)})])

    def forward(self, x):
        layer = self.layers[0]
        return layer["norm"](layer["proj"](x))


@pytest.mark.parametrize(
    "kind, dtype, reason",
    [
        ("mean_over_dim0", torch.float32, "reduction over a non-last dim"),
        ("eps_after_rsqrt", torch.float32, "eps is added after the rsqrt"),
        ("eps_tensor", torch.float32, "eps is not a constant"),
        ("weight_before_cast", torch.bfloat16, "weight applied before the cast"),
    ],
)
def test_almost_rmsnorm_is_a_near_miss(kind, dtype, reason):
    torch.manual_seed(0)
    model = AlmostModel(kind).to(dtype).eval()
    x = torch.randn(4, 16, dtype=dtype)
    out, report = _compile(model, (x,))
    with torch.no_grad():
        _assert_close(out, model(x), dtype)
    assert report.count("ascend.rms_norm") == report.count("ascend.add_rms_norm") == 0
    norm = report.passes["norm"]
    assert norm.matches == []
    (miss,) = norm.near_misses
    assert miss.pattern == "rms_norm" and reason in miss.reason
    assert miss.layer == "layers.0" and miss.node


def test_model_without_norms_or_swiglu_is_unchanged():
    model = nn.Sequential(nn.Linear(8, 8), nn.SiLU(), nn.Linear(8, 8)).eval()
    x = torch.randn(2, 8)
    out, report = _compile(model, (x,))
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), rtol=0, atol=1e-6)
    for name in ("norm", "activation"):
        result = report.passes[name]
        assert result.status == "ok" and not result.matches and not result.near_misses
        assert result.nodes_before == result.nodes_after


# ----------------------------------------------------------------------------- inductor pass
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inductor_post_grad_pass_rewrites_norms(dtype):
    torch.manual_seed(0)
    model = Tiny(eps=1e-5).to(dtype).eval()
    x = torch.randn(2, 5, 32, dtype=dtype)
    torch._dynamo.reset()
    custom = ap.inductor_pass(passes=PASSES, strict=True)
    with (
        torch._inductor.config.patch(post_grad_custom_post_pass=custom, fx_graph_cache=False),
        torch.no_grad(),
        ap.capture() as reports,
    ):
        out = torch.compile(model, backend="inductor")(x)
        ref = model(x)
    _assert_close(out, ref, dtype)
    (report,) = reports
    assert report.count("ascend.rms_norm") == 1 and report.count("ascend.add_rms_norm") == 4
    assert report.count("ascend.swiglu") == 2
    assert report.passes["norm"].near_misses == []


# ----------------------------------------------------------------------------- machinery
def test_uuid_covers_pattern_sources_and_is_stable():
    cfg = ap.AscendPassConfig()
    norm, act = norm_pass.NormPass(cfg), activation_pass.ActivationPass(cfg)
    assert norm.uuid() == norm_pass.NormPass(cfg).uuid()
    other = norm_pass.NormPass(cfg)
    other.patterns = "ascend_passes.patterns.activation"  # same pass code, other pattern table
    assert other.uuid() != norm.uuid() and act.uuid() != norm.uuid()


def test_pattern_pass_from_a_table_reports_matches_and_check_reasons():
    """What a new pattern pass (moe, mla) does: declare a table, get matches and near-misses."""

    def relu_add_pattern(x, y):
        return torch.relu(x) + y

    def relu_add_replacement(x, y):
        return torch.clamp_min(x, 0) + y

    def only_square(v):
        return None if v["x"].shape[-1] == v["x"].shape[-2] else "not square"

    table = [
        Rewrite(
            "relu_add",
            relu_add_pattern,
            relu_add_replacement,
            lambda dt: (torch.empty(3, 3, dtype=dt), torch.empty(3, 3, dtype=dt)),
            check=only_square,
        )
    ]

    class ReluAdd(PatternPass):
        name = "relu_add"

        def rewrites(self, ctx):
            return table

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 6)])

        def forward(self, x):
            a = self.layers[0](x)
            b = self.layers[1](x)
            return torch.relu(a) + a, torch.relu(b) + b

    cfg = ap.AscendPassConfig(compiler="eager")
    torch._dynamo.reset()
    with torch.no_grad(), ap.capture() as reports:
        model = M().eval()
        x = torch.randn(4, 4)
        out = torch.compile(model, backend=ap.make_backend(cfg, pipeline=[ReluAdd(cfg)]))(x)
    ref = model(x)
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r)
    result = reports[0].passes["relu_add"]
    assert result.counts() == {"relu_add": 1} and result.matches[0].details["dtype"] == "float32"
    (miss,) = result.near_misses
    assert miss.reason == "not square"
    assert reports[0].count("aten.clamp_min") == 1 and reports[0].count("aten.relu") == 1


def test_two_runs_share_nothing():
    """Two compiles in one process (target + drafter) each get their own matcher state."""
    torch.manual_seed(0)
    a, b = Tiny(width=16, layers=1).eval(), Tiny(width=24, layers=1, eps=1e-5).eval()
    for model, width in ((a, 16), (b, 24), (a, 16)):
        _, report = _compile(model, (torch.randn(2, width),))
        assert report.passes["norm"].counts() == {"rms_norm": 3, "add_rms_norm": 2}


@pytest.mark.parametrize("decompose", [None, ()])
def test_inductor_gets_decompositions_of_the_fused_norms(decompose):
    """compiler="inductor": by default Inductor receives rms_norm / add_rms_norm / swiglu as ATen
    (its generated code calls no ascend norm op) while the rewritten graph still holds the fused
    ops; ``inductor_decompose=()`` hands them over as opaque calls instead. Same numbers both ways."""
    from torch._inductor.utils import run_and_get_code

    model, inputs = models.deepseek_v3("grouped_mm", num_layers=2)
    with torch.no_grad():
        ref = model(*inputs)
    torch._dynamo.reset()
    options = {"passes": PASSES, "compiler": "inductor"}
    if decompose is not None:
        options["inductor_decompose"] = decompose
    with torch.no_grad(), ap.capture() as reports:
        out, code = run_and_get_code(torch.compile(model, backend="ascend_passes", options=options), *inputs)
    _assert_close(out, ref, torch.float32)
    rewritten = reports[0].rewritten_ops()
    assert rewritten["ascend.rms_norm"] + rewritten["ascend.add_rms_norm"] > 0 and rewritten["ascend.swiglu"] > 0
    source = "\n".join(code)
    called = {op for op in ("rms_norm", "add_rms_norm", "swiglu") if f"torch.ops.ascend.{op}" in source}
    assert called == (set() if decompose is None else {"rms_norm", "add_rms_norm", "swiglu"}), called


def test_inductor_decompose_rejects_ops_without_a_decomposition():
    with pytest.raises(ap.ConfigError, match="'grouped_matmul', which is not an ascend op with a decomposition"):
        ap.PassManager(ap.AscendPassConfig.from_options({"inductor_decompose": "rms_norm,grouped_matmul"}))
