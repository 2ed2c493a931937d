"""The ``lower`` pass (ascend.* → torch.ops.npu.*), checked against the real torch_npu 2.13.0 wheel
used as data: its schemas, its meta kernels (FakeTensor shapes) and torchair's converter set.

The npu ops are defined in this process for this module only (``npu_schemas.load()`` in a module
fixture, ``unload()`` after it), so other test modules in the same worker see an empty ``npu``
namespace.  Without the wheel the module is skipped (a failure under ASCEND_PASSES_CI_STRICT=1).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
from _helpers import skip_unless
from torch._dynamo.backends.common import aot_autograd
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

import ascend_passes.ops  # noqa: F401  (registers the ascend ops)
from ascend_passes import models, npu, npu_schemas
from ascend_passes.backend import run_pipeline
from ascend_passes.config import AscendPassConfig
from ascend_passes.pass_manager import PassContext
from ascend_passes.passes.lower import GRAPH_ADAPT, LowerPass

A = torch.ops.ascend

skip_unless(
    npu_schemas.wheel_path() is not None,
    f"no torch_npu {npu_schemas.TORCH_NPU_VERSION} wheel (run tools/setup.sh or set {npu_schemas.WHEEL_ENV})",
    allow_module_level=True,
)


@pytest.fixture(scope="module", autouse=True)
def npu_ops():
    assert npu.torch_npu_available() is False  # no CANN here: the wheel is data
    assert npu.npu_overload("rms_norm") is None  # nothing defined before this module
    npu_schemas.load()
    yield
    npu_schemas.unload()
    assert npu.npu_overload("rms_norm") is None  # the namespace is empty again for other modules
    assert npu.torch_npu_available() is False


# ------------------------------------------------------------------------------ capture
def _capture(name: str, dynamic: bool = False):
    """Compile bundled model ``name`` with target npu on CPU: [(graph lower received, lowered graph,
    report)] per graph; the compiled model runs the graph lower received (the lowered one needs an NPU)."""
    model, inputs = models.build(name)
    return _capture_model(model, inputs, dynamic=dynamic)


def _capture_model(model, inputs, options=None, dynamic: bool = False):
    cfg = AscendPassConfig.from_options(options or {}, strict=True)
    records = []

    def backend(gm, example_inputs):
        def inference(agm, ainp):
            saved = {}

            def hook(pass_name, stage, g, result):
                if pass_name == "lower" and stage == "before":
                    saved["before"] = copy.deepcopy(g)

            report = run_pipeline(cfg, agm, ainp, target="npu", compiler="eager", hooks=[hook])
            records.append((saved["before"], agm, report))
            return saved["before"]

        return aot_autograd(fw_compiler=inference, inference_compiler=inference)(gm, example_inputs)

    torch._dynamo.reset()
    if dynamic:  # only the token dim (dynamic=True would turn the norms' eps into graph inputs)
        for t in inputs:  # (batch, tokens, ...): input ids, and the drafter's hidden states
            torch._dynamo.mark_dynamic(t, 1)
    with torch.no_grad():
        torch.compile(model, backend=backend)(*inputs)
    return records


MODELS = [
    "deepseek_v3_grouped_mm",
    "deepseek_v3_batched_mm",
    "qwen3_moe_grouped_mm",
    "deepseek_v3_mtp1",
    "deepseek_v3_mtp2",
]
_CACHE: dict = {}


def _records(name: str, dynamic: bool = False):
    if (name, dynamic) not in _CACHE:
        _CACHE[(name, dynamic)] = _capture(name, dynamic)
    return _CACHE[(name, dynamic)]


def _npu_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [
        n
        for n in gm.graph.nodes
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "npu"
    ]


def _shape_dtype(v):
    if isinstance(v, torch.Tensor):
        return (tuple(v.shape), v.dtype)
    if isinstance(v, (list, tuple)):
        return [_shape_dtype(x) for x in v]
    return v


def _check_lowered(before: fx.GraphModule, gm: fx.GraphModule) -> None:
    ascend_before = [n for n in before.graph.nodes if str(n.target).startswith("ascend.")]
    assert ascend_before, "the passes found nothing: the test would prove nothing"
    assert not [
        n
        for n in gm.graph.nodes
        if "ascend::" in str(getattr(n.target, "_schema", "")) or str(n.target).startswith("ascend.")
    ]
    gm.graph.lint()
    wheel_ops = npu_schemas.schemas()
    converters = npu_schemas.converters()
    nodes = _npu_nodes(gm)
    assert nodes
    for n in nodes:
        overload = f"{n.target._opname}.{n.target._overloadname}"
        assert overload in wheel_ops, overload
        assert overload in converters, f"torchair has no converter for {overload}"
        names = {a.name for a in n.target._schema.arguments}
        assert set(n.kwargs) <= names, (n.target, set(n.kwargs) - names)
    # FakeTensorProp with the wheel's meta kernels: every replacement has the ascend node's shapes
    inputs = [p.meta["val"] for p in gm.graph.nodes if p.op == "placeholder"]
    mode = detect_fake_mode([v for v in inputs if isinstance(v, torch.Tensor)])
    marked = [n for n in gm.graph.nodes if "ascend_val" in n.meta]
    for n in marked:
        n.meta.pop("val", None)
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*inputs)
    assert marked
    for n in marked:
        assert str(_shape_dtype(n.meta["val"])) == str(_shape_dtype(n.meta["ascend_val"])), n.format_node()


@pytest.mark.parametrize("name", MODELS)
def test_bundled_model_lowers_completely(name):
    records = _records(name)
    assert records
    for before, gm, report in records:
        _check_lowered(before, gm)
        lower = report.passes["lower"]
        assert lower.status == "ok"
        # the tiny models' MLA is outside the NPU limits (fp32, He 64, Hckv 32, query not absorbed)
        mla = [nm for nm in lower.near_misses if nm.pattern.startswith("mla_prolog")]
        if name.startswith("deepseek"):
            assert mla and all(
                "decomposed to ATen" in nm.reason
                and "weight_uk None" in nm.reason
                and "Hckv=32" in nm.reason
                and nm.layer
                for nm in mla
            )
            assert any(n.target is torch.ops.npu.npu_moe_finalize_routing.default for n in gm.graph.nodes)


def _tp2_rank_lowers(rank: int, world_size: int):  # a spawned gloo rank
    from ascend_passes import models_tp

    npu_schemas.load()
    _, factory, options, _ = models_tp.BUNDLED_TP["deepseek_v3_tp2"]
    model, inputs = factory(rank, world_size)
    records = _capture_model(model, inputs, options)
    if rank == 0:  # rank 0's graph, as the CLI shows it
        for before, gm, _ in records:
            _check_lowered(before, gm)
    targets = [str(n.target) for _, gm, _ in records for n in gm.graph.nodes if n.op == "call_function"]
    return (
        len(records),
        sorted({t for t in targets if t.startswith("npu.")}),
        sum(t.startswith("_c10d_functional.reduce_scatter") for t in targets),
        [nm.pattern for _, _, r in records for nm in r.passes["shared_expert_dp"].near_misses],
    )


def test_tp2_sequence_parallel_and_shared_expert_dp_graph_lowers_completely():
    """The TP-2 DeepSeek-V3 with sequence parallelism and shared-expert DP (rank 0's graph): no
    ascend op left, every npu op in the wheel with a torchair converter, the wheel's meta kernels
    give the shapes the ascend ops had; the collectives stay torch's functional ones."""
    from ascend_passes.spawn import run_on_ranks

    (graphs, ops, reduce_scatters, _), _ = run_on_ranks(_tp2_rank_lowers, 2, timeout_s=600.0)
    assert graphs == 1
    assert reduce_scatters >= 4  # SP applied: one per TP all-reduce
    assert {
        "npu.npu_add_rms_norm.default",
        "npu.npu_grouped_matmul.default",
        "npu.npu_moe_gating_top_k.default",
        "npu.npu_moe_init_routing_v2.default",
        "npu.npu_moe_finalize_routing.default",
        "npu.npu_swiglu.default",
    } <= set(ops), ops


def test_dynamic_token_dim_lowers_with_symbolic_shapes():
    records = _records("deepseek_v3_mtp1", dynamic=True)
    symbolic = False
    for before, gm, report in records:
        _check_lowered(before, gm)
        assert report.passes["norm"].matches and report.passes["moe"].matches
        for n in _npu_nodes(gm):
            v = n.meta.get("val")
            vals = v if isinstance(v, (list, tuple)) else [v]
            symbolic |= any(isinstance(s, torch.SymInt) for t in vals if isinstance(t, torch.Tensor) for s in t.shape)
    assert symbolic


def test_every_row_passes_only_schema_keywords():
    added = {"mla_prolog": {"kv_cache", "kr_cache", "cache_index", "cache_mode"}}
    dropped = {"mla_prolog": {"head_num", "rope_interleave"}}
    for name, row in npu.NPU_OPS.items():
        op = npu.npu_overload(name)
        assert op is not None, name
        schema = getattr(A, name).default._schema
        _, kw = row.adapt((), {a.name: None for a in schema.arguments})
        names = (set(kw) | added.get(name, set())) - dropped.get(name, set())
        npu_names = {a.name for a in op._schema.arguments}
        assert names <= npu_names, (name, names - npu_names)
        assert name in GRAPH_ADAPT or not added.get(name)
        for lim in row.limits:
            assert lim.doc


def test_ascend_argument_types_are_torch_npus_with_sizes_as_symint():
    """An argument both schemas have has torch_npu's type; ours says ``SymInt`` where torch_npu says
    ``int`` only for sizes of the inputs (the expert count, active range and top-k), so that a trace on
    symbolic sizes records them as sizes instead of fixing them to numbers (one shipped experts
    replacement for every expert count); the NPU graph receives the numbers."""
    symint, other_types = set(), {}
    for name in npu.NPU_OPS:
        npu_args = {a.name: a for a in npu.npu_overload(name)._schema.arguments}
        for arg in getattr(A, name).default._schema.arguments:
            if arg.name not in npu_args:
                continue
            ours, theirs = arg.real_type.str(), npu_args[arg.name].real_type.str()
            if ours == theirs:
                continue
            if ours.replace("SymInt", "int") == theirs:
                symint.add(f"{name}.{arg.name}")
            else:
                other_types[f"{name}.{arg.name}"] = (ours, theirs)
    assert symint == {
        "moe_init_routing_v2.expert_num",
        "moe_init_routing_v2.active_expert_range",
        "moe_finalize_routing.k",
    }
    # the other differences: arguments ours requires where torch_npu's yaml makes them optional (the
    # values our adapters always pass), ours optional where the MLA prolog variants need None
    assert other_types == {
        "grouped_matmul.split_item": ("int", "int?"),
        "grouped_matmul.group_list_type": ("int", "int?"),
        "grouped_matmul.act_type": ("int", "int?"),
        "grouped_matmul.output_dtype": ("ScalarType?", "int?"),
        "mla_prolog.weight_dq": ("Tensor?", "Tensor"),
        "mla_prolog.weight_uk": ("Tensor?", "Tensor"),
        "mla_prolog.rmsnorm_gamma_cq": ("Tensor?", "Tensor"),
    }


# ------------------------------------------------------------------------------ limits
def _lower(fn, *inputs):
    gm = make_fx(fn, tracing_mode="fake")(*inputs)
    result = LowerPass(AscendPassConfig()).run(gm, PassContext(AscendPassConfig(), target="npu"))
    assert not [n for n in gm.graph.nodes if str(n.target).startswith("ascend.")]
    gm.graph.lint()
    return gm, result


def test_bf16_linear_is_decomposed_with_near_miss():
    x, w, b = (
        torch.randn(4, 8, dtype=torch.bfloat16),
        torch.randn(6, 8, dtype=torch.bfloat16),
        torch.randn(6, dtype=torch.bfloat16),
    )
    gm, result = _lower(lambda x, w, b: A.linear(x, w, b), x, w, b)
    assert not _npu_nodes(gm)
    assert [nm.reason for nm in result.near_misses] == [
        "decomposed to ATen: input dtype torch.bfloat16 (npu_linear: float32/float16 only)"
    ]
    torch.testing.assert_close(gm(x, w, b), A.linear(x, w, b))
    gm32, result32 = _lower(lambda x, w, b: A.linear(x, w, b), x.float(), w.float(), b.float())
    assert [n.target for n in _npu_nodes(gm32)] == [torch.ops.npu.npu_linear.default] and not result32.near_misses


def _routing(tokens=6, k=2, experts=4, hidden=8):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=g)
    idx = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)]).int()
    ex, row_idx, counts, _ = A.moe_init_routing_v2(
        x,
        idx,
        expert_num=experts,
        expert_tokens_num_type=1,
        expert_tokens_num_flag=True,
        active_expert_range=[0, experts],
    )
    scales = torch.rand(tokens, k, generator=g)
    return ex * 2 + 1, row_idx, idx, scales


def test_fp32_scales_with_bf16_rows_finalize_is_decomposed():
    rows, row_idx, idx, scales = _routing()
    rows = rows.bfloat16()

    def f(rows, scales, row_idx, idx):
        return A.moe_finalize_routing(rows, None, None, None, scales, row_idx, idx, 2, 2)

    gm, result = _lower(f, rows, scales, row_idx, idx)
    assert not _npu_nodes(gm)
    (nm,) = result.near_misses
    assert nm.pattern == "moe_finalize_routing->npu_moe_finalize_routing"
    assert "scales dtype torch.float32 differs from the rows' torch.bfloat16" in nm.reason
    torch.testing.assert_close(gm(rows, scales, row_idx, idx), f(rows, scales, row_idx, idx))


def test_finalize_after_a_partial_expert_range_is_decomposed():
    x, idx = torch.randn(5, 8), torch.randint(0, 4, (5, 2), dtype=torch.int32)
    scales = torch.rand(5, 2)

    def f(x, idx, scales):  # expert parallelism: this rank holds experts [0, 2) of 4
        ex, row_idx, _, _ = A.moe_init_routing_v2(
            x, idx, expert_num=4, expert_tokens_num_type=1, expert_tokens_num_flag=True, active_expert_range=[0, 2]
        )
        return A.moe_finalize_routing(ex, None, None, None, scales, row_idx, idx, 2, 2)

    gm, result = _lower(f, x, idx, scales)
    assert [n.target for n in _npu_nodes(gm)] == [torch.ops.npu.npu_moe_init_routing_v2.default]
    (nm,) = result.near_misses
    assert "may hold -1 (init_routing_v2 with a partial active_expert_range)" in nm.reason


def _mla_inputs(dtype, he=6144, hcq=32, n=2, d=8, dr=8, hckv=512, tokens=3):
    g = torch.Generator().manual_seed(0)

    def r(*s):
        return (torch.randn(*s, generator=g) / s[0] ** 0.5).to(dtype)

    ang = torch.randn(tokens, dr // 2, generator=g)
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(dtype), torch.cat([ang.sin()] * 2, -1).to(dtype)
    return (
        r(tokens, he),
        r(he, hcq),
        r(hcq, n * (d + dr)),
        r(n, d, hckv),
        r(he, hckv + dr),
        (1 + r(hcq)),
        (1 + r(hckv)),
        sin,
        cos,
    )


def _mla(*a):
    return A.mla_prolog(*a, head_num=2)


def test_mla_outside_limits_is_decomposed_and_inside_lowers_to_v3_functional():
    small = _mla_inputs(torch.bfloat16, he=64)
    gm, result = _lower(_mla, *small)
    assert not _npu_nodes(gm)
    (nm,) = result.near_misses
    assert nm.reason == "decomposed to ATen: He=64 (7168, 7680 or 6144)"
    torch.testing.assert_close(gm(*small), _mla(*small))
    full = _mla_inputs(torch.bfloat16)
    gm, result = _lower(_mla, *full)
    assert not result.near_misses
    (call,) = _npu_nodes(gm)
    assert call.target is torch.ops.npu.npu_mla_prolog_v3_functional.default
    assert call.kwargs["cache_mode"] == "PA_BSND" and "cache_index" in call.kwargs
    out = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
    expected = _mla(*full)
    assert [(tuple(o.meta["val"].shape), o.meta["val"].dtype) for o in out] == [
        (tuple(e.shape), e.dtype) for e in expected
    ]


# ------------------------------------------------------------------------------ numerics
# Test-only CPU implementations of the npu ops whose arguments lower adapts, written from
# torch_npu/_op_plugin_docs.py (not from our reference), registered for this module's tests only.
def _npu_finalize_cpu(
    expanded_permuted_rows,
    skip1,
    skip2,
    bias,
    scales,
    expanded_src_to_dst_row,
    export_for_source_row,
    drop_pad_mode=0,
    k=1,
):
    # docs: out(i,j) = skip1 + skip2 + sum_k scales[i,k] * (rows[src2dst[i + k*num_rows], j] + bias[expert[i,k], j])
    assert drop_pad_mode == 0
    num_rows = scales.shape[0]
    out = torch.zeros(num_rows, expanded_permuted_rows.shape[1], dtype=torch.float32)
    for i in range(num_rows):
        for kk in range(scales.shape[1]):
            row = expanded_permuted_rows[expanded_src_to_dst_row[i + kk * num_rows]].float()
            if bias is not None:
                row = row + bias[export_for_source_row[i, kk]].float()
            out[i] += scales[i, kk].float() * row
    for s in (skip1, skip2):
        if s is not None:
            out += s.float()
    return out.to(expanded_permuted_rows.dtype)


def _npu_grouped_matmul_cpu(
    x,
    weight,
    *,
    bias=None,
    scale=None,
    offset=None,
    antiquant_scale=None,
    antiquant_offset=None,
    per_token_scale=None,
    group_list=None,
    activation_input=None,
    activation_quant_scale=None,
    activation_quant_offset=None,
    split_item=0,
    group_type=None,
    group_list_type=0,
    act_type=0,
    tuning_config=None,
    output_dtype=None,
    x_dtype=None,
    weight_dtype=None,
    scale_dtype=None,
    per_token_scale_dtype=None,
):
    # docs: group_type 0 splits x's rows by group_list (type 0 cumsum, 1 counts); y_g = x_g @ w_g
    assert group_type == 0 and len(x) == 1 and split_item in (2, 3)
    counts = (
        group_list.tolist()
        if group_list_type == 1
        else torch.diff(group_list, prepend=group_list.new_zeros(1)).tolist()
    )
    y = torch.zeros(x[0].shape[0], weight[0].shape[2], dtype=x[0].dtype)
    begin = 0
    for g, c in enumerate(counts):
        y[begin : begin + c] = x[0][begin : begin + c] @ weight[0][g]
        begin += c
    return [y]


def _npu_init_routing_cpu(
    x,
    expert_idx,
    *,
    scale=None,
    offset=None,
    active_num=-1,
    expert_capacity=-1,
    expert_num=-1,
    drop_pad_mode=0,
    expert_tokens_num_type=0,
    expert_tokens_num_flag=False,
    quant_mode=-1,
    active_expert_range=(),
    row_idx_type=0,
    x_dtype=None,
):
    # docs (dropless, full range): rows sorted stably by expert; expanded_row_idx[src] = position;
    # expert_tokens_num_type 1: tokens per expert (int64)
    assert drop_pad_mode == 0 and expert_tokens_num_type == 1 and row_idx_type == 0
    k = expert_idx.shape[1]
    order = torch.sort(expert_idx.flatten(), stable=True).indices
    expanded_x = x[order // k]
    row_idx = torch.empty_like(order, dtype=torch.int32)
    row_idx[order] = torch.arange(order.numel(), dtype=torch.int32)
    counts = torch.bincount(expert_idx.flatten().long(), minlength=expert_num)
    return expanded_x, row_idx, counts, torch.zeros(order.numel(), dtype=torch.float32)


def _npu_mla_prolog_v3_functional_cpu(
    token_x,
    weight_dq,
    weight_uq_qr,
    weight_uk,
    weight_dkv_kr,
    rmsnorm_gamma_cq,
    rmsnorm_gamma_ckv,
    rope_sin,
    rope_cos,
    kv_cache,
    kr_cache,
    *,
    cache_index=None,
    dequant_scale_x=None,
    dequant_scale_w_dq=None,
    dequant_scale_w_uq_qr=None,
    dequant_scale_w_dkv_kr=None,
    quant_scale_ckv=None,
    quant_scale_ckr=None,
    smooth_scales_cq=None,
    rmsnorm_epsilon_cq=1e-05,
    rmsnorm_epsilon_ckv=1e-05,
    cache_mode="PA_BSND",
    qc_qr_scale=1.0,
    kc_scale=1.0,
):
    # docs (npu_mla_prolog_v3, non-quantised): path 1/2: cq = RmsNorm(x @ W_DQ); q = cq @ W_UQ_QR, per head
    # [D | Dr] (the docs give W_UQ_QR as (Hcq, N*(D+Dr)) without the per-head split; DeepSeek's
    # q_b_proj layout assumed); query = q_nope @ W_UK (N, D, Hckv); query_rope = ROPE(q_rope) (halves
    # rotated: rope_interleave is not an argument). Path 3/4: ckv = x @ W_DKV_KR; RmsNorm(ckv[:Hckv])
    # written into kv_cache and ROPE(ckv[Hckv:]) into kr_cache at cache_index (PA_BSND: (BlockNum,
    # BlockSize, Nkv, H), slot = block * BlockSize + offset). Outputs: query, query_rope,
    # dequant_scale_q_nope (1,), query_norm (1,), dequant_scale_q_norm (1,), kv_cache, kr_cache.
    assert cache_mode == "PA_BSND" and qc_qr_scale == 1.0 and kc_scale == 1.0
    assert all(
        t is None
        for t in (
            dequant_scale_x,
            dequant_scale_w_dq,
            dequant_scale_w_uq_qr,
            dequant_scale_w_dkv_kr,
            quant_scale_ckv,
            quant_scale_ckr,
            smooth_scales_cq,
        )
    )

    def rms(v, gamma, eps):
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * gamma.float()

    def rope(v, cos, sin):
        half = v.shape[-1] // 2
        return v * cos + torch.cat([-v[..., half:], v[..., :half]], -1) * sin

    lead, he = token_x.shape[:-1], token_x.shape[-1]
    x = token_x.reshape(-1, he).float()
    n, d, hckv = weight_uk.shape
    dr = rope_sin.shape[-1]
    cos, sin = rope_cos.reshape(-1, 1, dr).float(), rope_sin.reshape(-1, 1, dr).float()
    cq = rms(x @ weight_dq.float(), rmsnorm_gamma_cq, rmsnorm_epsilon_cq)
    q = (cq @ weight_uq_qr.float()).view(-1, n, d + dr)
    query = torch.einsum("tnd,ndh->tnh", q[..., :d], weight_uk.float())
    query_rope = rope(q[..., d:], cos, sin)
    ckv = x @ weight_dkv_kr.float()
    kv = rms(ckv[:, :hckv], rmsnorm_gamma_ckv, rmsnorm_epsilon_ckv)
    kr = rope(ckv[:, hckv:].unsqueeze(1), cos, sin).squeeze(1)
    kv_out, kr_out = kv_cache.clone(), kr_cache.clone()
    slots = cache_index.reshape(-1)
    kv_out.view(-1, kv_out.shape[-2], hckv)[slots] = kv.to(kv_out.dtype).unsqueeze(1)
    kr_out.view(-1, kr_out.shape[-2], dr)[slots] = kr.to(kr_out.dtype).unsqueeze(1)
    dt = token_x.dtype
    zeros = token_x.new_zeros(1)
    return (
        query.to(dt).reshape(*lead, n, hckv),
        query_rope.to(dt).reshape(*lead, n, dr),
        zeros.float(),
        zeros,
        zeros.float(),
        kv_out,
        kr_out,
    )


@pytest.fixture
def npu_cpu_impls():
    lib = torch.library.Library("npu", "IMPL", "CPU")
    lib.impl("npu_moe_finalize_routing", _npu_finalize_cpu)
    lib.impl("npu_grouped_matmul", _npu_grouped_matmul_cpu)
    lib.impl("npu_moe_init_routing_v2", _npu_init_routing_cpu)
    lib.impl("npu_mla_prolog_v3_functional", _npu_mla_prolog_v3_functional_cpu)
    yield
    lib._destroy()


def test_adapted_finalize_and_grouped_matmul_equal_the_unlowered_graph(npu_cpu_impls):
    rows, row_idx, idx, scales = _routing(tokens=7, k=3, experts=5)
    bias = torch.randn(5, rows.shape[1])
    skip = torch.randn(7, rows.shape[1])

    def fin(rows, skip, bias, scales, row_idx, idx):  # drop_pad_mode 2 → 0 with the index transposed
        return A.moe_finalize_routing(rows, skip, None, bias, scales, row_idx, idx, 2, 3)

    gm, result = _lower(fin, rows, skip, bias, scales, row_idx, idx)
    (call,) = _npu_nodes(gm)
    assert call.args[7] == 0 and not result.near_misses
    torch.testing.assert_close(gm(rows, skip, bias, scales, row_idx, idx), fin(rows, skip, bias, scales, row_idx, idx))
    # without the transposition the NPU op reads other rows: the check can fail
    assert not torch.allclose(
        _npu_finalize_cpu(rows, skip, None, bias, scales, row_idx, idx, 0, 3),
        fin(rows, skip, bias, scales, row_idx, idx),
    )

    x, w = torch.randn(9, 4), torch.randn(3, 4, 5)
    counts = torch.tensor([2, 0, 7])

    def gmm(x, w, counts):  # keyword-only arguments by name: group_list_type 1 (counts) must reach the op
        return A.grouped_matmul([x], [w], group_list=counts, split_item=2, group_type=0, group_list_type=1)[0]

    gm, _ = _lower(gmm, x, w, counts)
    (call,) = _npu_nodes(gm)
    assert call.kwargs["group_type"] == 0 and call.kwargs["group_list_type"] == 1
    torch.testing.assert_close(gm(x, w, counts), gmm(x, w, counts))


def test_init_routing_cumsum_counts_are_lowered_as_counts_plus_cumsum(npu_cpu_impls):
    x, idx = torch.randn(6, 4), torch.randint(0, 5, (6, 2), dtype=torch.int32)

    def f(x, idx):  # expert_tokens_num_type 0 (cumsum) is not documented on the NPU: 1 + cumsum
        return A.moe_init_routing_v2(
            x, idx, expert_num=5, expert_tokens_num_type=0, expert_tokens_num_flag=True, active_expert_range=[0, 5]
        )[:3]

    gm, result = _lower(f, x, idx)
    (call,) = _npu_nodes(gm)
    assert call.kwargs["expert_tokens_num_type"] == 1 and call.kwargs["quant_mode"] == -1 and not result.near_misses
    assert any(n.target is torch.ops.aten.cumsum.default for n in gm.graph.nodes)
    for got, want in zip(gm(x, idx), f(x, idx)):
        torch.testing.assert_close(got, want)


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


@pytest.mark.parametrize("batched", [False, True], ids=["T_He", "B_S_He"])
def test_adapted_mla_prolog_equals_the_unlowered_graph(npu_cpu_impls, batched):
    # the added caches (one block of one row per token, cache_index = arange(T)) and the outputs
    # read back from them (kv_cache → kv, kr_cache → k_rope) are checked by value, not by shape
    inputs = list(_mla_inputs(torch.bfloat16, tokens=6))
    if batched:  # (B, S, He): token_x, rope_sin, rope_cos get the batch dims
        for i in (0, 7, 8):
            inputs[i] = inputs[i].reshape(2, 3, -1)
    gm, result = _lower(_mla, *inputs)
    (call,) = _npu_nodes(gm)
    assert call.target is torch.ops.npu.npu_mla_prolog_v3_functional.default and not result.near_misses
    got, want = gm(*inputs), _mla(*inputs)
    assert len(got) == len(want) == 4
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert _rel(g, w) < 2e-2, (_rel(g, w), g.shape)
    # sin and cos have the same type and shape: a swap shows only in the values
    bad = list(inputs)
    bad[7], bad[8] = inputs[8], inputs[7]
    assert _rel(gm(*bad)[1], want[1]) > 0.1


def test_missing_or_corrupt_wheel_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv(npu_schemas.WHEEL_ENV, str(tmp_path / "nope.whl"))
    with pytest.raises(npu_schemas.NpuSchemaError, match="is not a file"):
        npu_schemas.wheel_path()
    bad = tmp_path / "torch_npu-2.13.0-bad.whl"
    bad.write_bytes(b"not a zip")
    with pytest.raises(npu_schemas.NpuSchemaError, match="download"):
        npu_schemas.schemas(bad)
    assert npu_schemas.load() is True  # already loaded: idempotent, the wheel is not read again


def test_npu_compilers_receive_a_lowered_graph():
    from ascend_passes.backend import _ensure_lowered

    x, g = torch.randn(3, 8), torch.randn(8)
    gm = make_fx(lambda x, g: A.rms_norm(x, g, 1e-6)[0], tracing_mode="fake")(x, g)
    _ensure_lowered(gm)  # what compile_downstream("torchair" / "npugraph_ex") does first
    assert [n.target for n in _npu_nodes(gm)] == [torch.ops.npu.npu_rms_norm.default]
    assert not [n for n in gm.graph.nodes if str(n.target).startswith("ascend.")]


def test_cli_dump_target_npu_writes_the_lowered_graph(tmp_path, capsys):
    from ascend_passes import cli

    assert cli.main(["dump", "deepseek_v3_mtp1", "--target", "npu", "--format", "html", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "lowered to torch_npu: 12 npu ops, 1 ascend ops decomposed to ATen" in printed
    assert "mla_prolog->npu_mla_prolog_v3_functional at mtp.0: decomposed to ATen" in " ".join(printed.split())
    (after,) = tmp_path.glob("*/*_lower.after.py")
    text = after.read_text()
    assert "torch.ops.npu.npu_grouped_matmul.default" in text and "torch.ops.ascend." not in text
    assert (tmp_path / "report.html").is_file()
