"""Semantics of the torch.ops.ascend IR ops: each op against a straightforward loop formula,
edge cases, bad-input errors, opcheck and torch.compile, with the C++ kernels and the reference.

The ``backend`` fixture runs every test twice: "cpp" (the C++ kernels registered for CPU) and
"reference" (the plain-PyTorch implementation, swapped in for the CPU key for the test).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from _helpers import skip_unless

import ascend_passes.ops as ops
from ascend_passes import kernels
from ascend_passes.ops import reference

A = torch.ops.ascend


@pytest.fixture(params=["cpp", "reference"])
def backend(request):
    if request.param == "cpp":
        # a failure instead of a skip under ASCEND_PASSES_CI_STRICT=1 (CI)
        skip_unless(kernels.available(), "C++ kernels not loaded (not built or ASCEND_PASSES_KERNELS=reference)")
        yield "cpp"
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
        with torch.library._scoped_library("ascend", "IMPL") as lib:
            for name in ops.KERNEL_OPS:
                lib.impl(name, getattr(reference, name), "CPU")
            yield "reference"


def tol(dtype: torch.dtype) -> dict:
    return {
        torch.float32: dict(atol=1e-5, rtol=1e-5),
        torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
        torch.float16: dict(atol=2e-3, rtol=2e-3),
    }[dtype]


def distinct_topk_ids(tokens: int, experts: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)]).to(torch.int32)


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# ---------------------------------------------------------------- norms and activation


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_row_formula(backend, dtype):
    x = torch.randn(3, 5, 64).to(dtype)
    gamma = torch.randn(64).to(dtype)
    y, rstd = A.rms_norm(x, gamma, 1e-5)
    assert y.dtype == dtype and rstd.dtype == torch.float32 and rstd.shape == (3, 5, 1)
    for i in range(3):
        for j in range(5):
            row = x[i, j].double()
            r = 1.0 / math.sqrt(float((row * row).mean()) + 1e-5)
            assert rstd[i, j, 0].item() == pytest.approx(r, rel=1e-5)
            torch.testing.assert_close(y[i, j].double(), (row * r * gamma.double()).to(dtype).double(), **tol(dtype))


def test_rms_norm_two_dim_gamma(backend):
    x, gamma = torch.randn(4, 3, 8), torch.randn(3, 8)
    y, rstd = A.rms_norm(x, gamma)
    assert rstd.shape == (4, 1, 1)
    expected = x / torch.sqrt(x.pow(2).mean(dim=(1, 2), keepdim=True) + 1e-6) * gamma
    torch.testing.assert_close(y, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_returns_rounded_residual(backend, dtype):
    x1, x2 = torch.randn(6, 32).to(dtype), torch.randn(6, 32).to(dtype)
    gamma = torch.rand(32).to(dtype)
    y, rstd, x_sum = A.add_rms_norm(x1, x2, gamma, 1e-6)
    assert torch.equal(x_sum, x1 + x2)  # the new residual, in the input dtype
    s = x_sum.double()
    expected = s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * gamma.double()
    torch.testing.assert_close(y.double(), expected, **tol(dtype))
    assert rstd.shape == (6, 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("x_shape,gamma_shape", [((3, 0), (0,)), ((2, 4, 0), (4, 0)), ((0,), (0,))])
def test_norms_of_empty_rows_give_nan_rstd_like_torch(backend, dtype, x_shape, gamma_shape):
    """Issue 14 item 7: a hidden size of 0 gave uninitialised memory as rstd in the C++ kernels.
    Defined as torch's own aten._fused_rms_norm (and the reference) give it: NaN, the mean of nothing."""
    x, gamma = torch.randn(x_shape).to(dtype), torch.randn(gamma_shape).to(dtype)
    _, torch_rstd = torch.ops.aten._fused_rms_norm(x.float(), list(gamma_shape), gamma.float(), 1e-6)
    for _ in range(3):  # fresh buffers each time: garbage would not be NaN every time
        y, rstd = A.rms_norm(x, gamma, 1e-6)
        y2, rstd2, x_sum = A.add_rms_norm(x, x, gamma, 1e-6)
        for out in (y, y2, x_sum):
            assert out.shape == x.shape and out.dtype == dtype
        for r in (rstd, rstd2):
            assert r.shape == torch_rstd.shape and r.dtype == torch.float32
            assert r.isnan().all() and torch_rstd.isnan().all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [-1, 0, 1])
def test_swiglu_halves(backend, dtype, dim):
    x = torch.randn(4, 6, 10).to(dtype)
    out = A.swiglu(x, dim)
    h = x.shape[dim] // 2
    a, b = x.double().narrow(dim, 0, h), x.double().narrow(dim, h, h)
    torch.testing.assert_close(out.double(), a * torch.sigmoid(a) * b, **tol(dtype))
    assert out.dtype == dtype


def clipped_formula(x: torch.Tensor, dim: int, alpha: float, limit: float, bias: float, interleaved: bool, rows=None):
    """torch_npu's npu_clipped_swiglu formula, element by element in float64: fold x to
    [pre, cut * after], split each row (even/odd columns or halves), clamp, gate, reshape."""
    dim = dim % x.dim()
    pre = math.prod(x.shape[:dim])
    folded = x.double().reshape(pre, -1).tolist()
    out = []
    for r, row in enumerate(folded):
        h = len(row) // 2
        pairs = [(row[2 * j], row[2 * j + 1]) if interleaved else (row[j], row[h + j]) for j in range(h)]
        values = []
        for a, b in pairs:
            a, b = min(a, limit), min(max(b, -limit), limit)
            values.append(a / (1 + math.exp(-alpha * a)) * (b + bias))
        out.append(values if rows is None or r < rows else [0.0] * h)
    shape = list(x.shape)
    shape[dim] //= 2
    return torch.tensor(out, dtype=torch.float64).reshape(shape)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("dim", [-1, 1, 0])
def test_clipped_swiglu_matches_npu_formula(backend, dtype, interleaved, dim):
    x = (torch.randn(4, 6, 10) * 6).to(dtype)  # wide enough that both clamps bite
    out = A.clipped_swiglu(x, dim=dim, alpha=1.702, limit=7.0, bias=1.0, interleaved=interleaved)
    assert out.dtype == dtype and out.is_contiguous()
    torch.testing.assert_close(out.double(), clipped_formula(x, dim, 1.702, 7.0, 1.0, interleaved), **tol(dtype))
    # DeepSeek-V4's form: silu(gate.clamp(max=l)) * up.clamp(-l, l) over the halves
    v4 = A.clipped_swiglu(x, dim=dim, alpha=1.0, limit=3.0, bias=0.0, interleaved=False)
    gate, up = x.double().chunk(2, dim=dim)
    want = torch.nn.functional.silu(gate.clamp(max=3.0)) * up.clamp(-3.0, 3.0)
    torch.testing.assert_close(v4.double(), want, **tol(dtype))


@pytest.mark.parametrize("interleaved", [True, False])
def test_clipped_swiglu_group_index_computes_the_first_rows_only(backend, interleaved):
    x = torch.randn(2, 5, 8) * 5  # folded around dim -1: 10 rows
    group_index = torch.tensor([3, 0, 4])  # 7 rows computed, the last 3 zero
    out = A.clipped_swiglu(x, group_index=group_index, limit=4.0, bias=0.5, interleaved=interleaved)
    want = clipped_formula(x, -1, 1.702, 4.0, 0.5, interleaved, rows=7)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    assert (out.reshape(10, 4)[7:] == 0).all() and (out.reshape(10, 4)[:7] != 0).any()
    everything = A.clipped_swiglu(x, group_index=torch.tensor([20]), limit=4.0, bias=0.5, interleaved=interleaved)
    torch.testing.assert_close(everything, A.clipped_swiglu(x, limit=4.0, bias=0.5, interleaved=interleaved))


# ---------------------------------------------------------------- routers


def loop_softmax_topk(logits: torch.Tensor, k: int):
    ys, ids = [], []
    for row in logits.double().tolist():
        m = max(row)
        e = [math.exp(v - m) for v in row]
        p = [v / sum(e) for v in e]
        order = sorted(range(len(p)), key=lambda i: (-p[i], i))[:k]
        ys.append([p[i] for i in order])
        ids.append(order)
    return torch.tensor(ys, dtype=torch.float64), torch.tensor(ids, dtype=torch.int32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [1, 3, 8])
def test_gating_top_k_softmax(dtype, k):
    logits = torch.randn(7, 8).to(dtype)
    y, idx, row_idx = A.moe_gating_top_k_softmax(logits, None, k)
    ey, eidx = loop_softmax_topk(logits, k)
    assert torch.equal(idx, eidx) and idx.dtype == torch.int32
    torch.testing.assert_close(y.double(), ey.to(dtype).double(), **tol(dtype))
    assert y.dtype == dtype
    # row_idx = arange(N*K).reshape(K, N).T
    assert torch.equal(row_idx, torch.arange(7 * k, dtype=torch.int32).view(k, 7).t())


def test_gating_top_k_softmax_ties_finished_and_3d():
    logits = torch.zeros(2, 3, 6)  # all tied: lower expert index first
    finished = torch.tensor([[False, True, False], [False, False, True]])
    y, idx, row_idx = A.moe_gating_top_k_softmax(logits, finished, k=2)
    assert idx.shape == (2, 3, 2)
    assert idx[0, 0].tolist() == [0, 1] and idx[0, 1].tolist() == [6, 6]  # finished rows -> E
    torch.testing.assert_close(y, torch.full((2, 3, 2), 1 / 6))
    assert torch.equal(row_idx.reshape(6, 2), torch.arange(12, dtype=torch.int32).view(2, 6).t())


def loop_deepseek_router(logits, bias, k, k_group, groups, mode, norm_type, scale, eps=1e-20):
    """DeepSeek-V3 noaux_tc routing written per token."""
    ys, ids = [], []
    for row in logits.double().tolist():
        if norm_type == 1:
            s = [1 / (1 + math.exp(-v)) for v in row]
        else:
            m = max(row)
            e = [math.exp(v - m) for v in row]
            s = [v / sum(e) for v in e]
        v = [s[i] + (float(bias[i]) if bias is not None else 0.0) for i in range(len(s))]
        size = len(v) // groups
        gscores = []
        for g in range(groups):
            members = sorted(v[g * size : (g + 1) * size], reverse=True)
            gscores.append(members[0] if mode == 0 else sum(members[:2]))
        kept = sorted(range(groups), key=lambda g: (-gscores[g], g))[:k_group]
        cand = [i for i in range(len(v)) if i // size in kept]
        chosen = sorted(cand, key=lambda i: (-v[i], i))[:k]
        w = [s[i] for i in chosen]
        if norm_type == 1:
            total = sum(w) + eps
            w = [x / total for x in w]
        ys.append([x * scale for x in w])
        ids.append(chosen)
    return torch.tensor(ys, dtype=torch.float64), torch.tensor(ids, dtype=torch.int32)


@pytest.mark.parametrize("norm_type", [0, 1])
@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gating_top_k_grouped(norm_type, mode, with_bias):
    logits = torch.randn(9, 32)
    bias = torch.randn(32) * 0.1 if with_bias else None
    y, idx, norm_out = A.moe_gating_top_k(
        logits,
        4,
        bias=bias,
        k_group=2,
        group_count=8,
        group_select_mode=mode,
        renorm=0,
        norm_type=norm_type,
        out_flag=True,
        routed_scaling_factor=2.5,
        eps=1e-20,
    )
    ey, eidx = loop_deepseek_router(logits, bias, 4, 2, 8, mode, norm_type, 2.5)
    assert torch.equal(idx, eidx)
    torch.testing.assert_close(y.double(), ey, atol=1e-6, rtol=1e-5)
    expected_norm = torch.sigmoid(logits) if norm_type == 1 else torch.softmax(logits, -1)
    torch.testing.assert_close(norm_out, expected_norm)
    assert norm_out.dtype == torch.float32


@pytest.mark.parametrize("dtype", DTYPES)
def test_gating_top_k_dtypes_k_equals_all(dtype):
    logits = torch.randn(3, 16).to(dtype)
    y, idx, _ = A.moe_gating_top_k(logits, 16, norm_type=1)
    assert sorted(idx[0].tolist()) == list(range(16))
    torch.testing.assert_close(y.float().sum(-1), torch.ones(3), **tol(dtype))
    assert y.dtype == dtype and idx.dtype == torch.int32


def test_gating_top_k_ties_pick_lower_group_and_expert():
    logits = torch.zeros(1, 16)
    _, idx, _ = A.moe_gating_top_k(logits, 3, k_group=2, group_count=4, group_select_mode=1, norm_type=1)
    assert idx.tolist() == [[0, 1, 2]]


def loop_hash_router(logits, input_ids, tid2eid, norm_type, scale, eps=1e-20):
    """Hash routing (DeepSeek-V4's first layers) per token: experts tid2eid[input_ids[t]], weights
    their unbiased scores, renormalised over the k with sigmoid, times the scale."""
    ys = []
    for t, row in enumerate(logits.double().tolist()):
        if norm_type == 1:
            s = [1 / (1 + math.exp(-v)) for v in row]
        else:
            m = max(row)
            s = [math.exp(v - m) / sum(math.exp(u - m) for u in row) for v in row]
        w = [s[int(e)] for e in tid2eid[int(input_ids[t])]]
        total = sum(w) + eps if norm_type == 1 else 1.0
        ys.append([x / total * scale for x in w])
    return torch.tensor(ys, dtype=torch.float64), tid2eid[input_ids.long()].to(torch.int32)


@pytest.mark.parametrize("norm_type", [0, 1])
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_gating_top_k_hash_mode(backend, norm_type, ids_dtype):
    """input_ids / tid2eid (torch_npu's hash mode): the experts are looked up, not selected, so
    bias and groups change nothing; the weights are the looked-up experts' scores."""
    logits = torch.randn(9, 32)
    input_ids = torch.tensor([5, 0, 99, 5, 17, 3, 3, 64, 1], dtype=ids_dtype)
    tid2eid = torch.randint(0, 32, (100, 4), generator=torch.Generator().manual_seed(7)).to(ids_dtype)
    tid2eid[5] = torch.tensor([31, 31, 0, 2])  # a repeated expert is taken twice
    ey, eidx = loop_hash_router(logits, input_ids, tid2eid, norm_type, 2.5)
    for kw in (dict(), dict(bias=torch.randn(32), k_group=2, group_count=8, group_select_mode=1)):
        y, idx, norm_out = A.moe_gating_top_k(
            logits, 4, input_ids=input_ids, tid2eid=tid2eid, norm_type=norm_type, routed_scaling_factor=2.5, **kw
        )
        assert idx.dtype == torch.int32 and torch.equal(idx, eidx)
        torch.testing.assert_close(y.double(), ey, atol=1e-6, rtol=1e-5)
        expected_norm = torch.sigmoid(logits) if norm_type == 1 else torch.softmax(logits, -1)
        torch.testing.assert_close(norm_out, expected_norm)
    # the table is read in its own strides (a transposed [E, V] table viewed as [V, k])
    y, idx, _ = A.moe_gating_top_k(
        logits,
        4,
        input_ids=input_ids,
        tid2eid=tid2eid.t().contiguous().t(),
        norm_type=norm_type,
        routed_scaling_factor=2.5,
    )
    assert torch.equal(idx, eidx)


# ---------------------------------------------------------------- routing and experts


def loop_init_routing(x, expert_idx, start, end):
    """Sort (token, k) pairs by expert, stable in token-major order; drop experts outside [start, end)."""
    n, k = expert_idx.shape
    order = [(r * k + j) for e in range(start, end) for r in range(n) for j in range(k) if int(expert_idx[r, j]) == e]
    rows = torch.zeros(n * k, x.shape[1], dtype=x.dtype)
    row_idx = torch.full((n * k,), -1, dtype=torch.int32)
    for dst, src in enumerate(order):
        rows[dst] = x[src // k]
        row_idx[src] = dst
    counts = torch.tensor([int((expert_idx == e).sum()) for e in range(start, end)])
    return rows, row_idx, counts, order


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,experts,k", [(13, 8, 2), (1, 8, 3), (5, 4, 4), (4, 32, 1)])
def test_init_routing_matches_loop(backend, dtype, tokens, experts, k):
    x = torch.randn(tokens, 16).to(dtype)
    ids = distinct_topk_ids(tokens, experts, k)
    scale = torch.rand(tokens)
    expanded_x, row_idx, counts, expanded_scale = A.moe_init_routing_v2(
        x,
        ids,
        scale=scale,
        expert_num=experts,
        expert_tokens_num_type=1,
        expert_tokens_num_flag=True,
    )
    e_rows, e_row_idx, e_counts, order = loop_init_routing(x, ids, 0, experts)
    assert torch.equal(expanded_x, e_rows)
    assert torch.equal(row_idx, e_row_idx) and row_idx.dtype == torch.int32
    assert torch.equal(counts, e_counts) and counts.dtype == torch.int64
    torch.testing.assert_close(expanded_scale, torch.tensor([float(scale[s // k]) for s in order]))
    cumsum = A.moe_init_routing_v2(x, ids, expert_num=experts, expert_tokens_num_type=0, expert_tokens_num_flag=True)[2]
    assert torch.equal(cumsum, e_counts.cumsum(0))


def test_init_routing_expert_parallel_slice(backend):
    x = torch.randn(10, 8)
    ids = distinct_topk_ids(10, 16, 4, seed=3)
    expanded_x, row_idx, counts, _ = A.moe_init_routing_v2(
        x,
        ids,
        expert_num=16,
        expert_tokens_num_type=1,
        expert_tokens_num_flag=True,
        active_expert_range=[4, 8],
    )
    e_rows, e_row_idx, e_counts, order = loop_init_routing(x, ids, 4, 8)
    assert counts.shape == (4,) and torch.equal(counts, e_counts)
    assert torch.equal(row_idx, e_row_idx)  # -1 for pairs routed to other ranks
    assert torch.equal(expanded_x, e_rows)  # rows past the local ones are zero
    assert int((row_idx >= 0).sum()) == len(order)
    # key-value counts: (expert, count) for experts with tokens, then zero pairs
    kv = A.moe_init_routing_v2(
        x, ids, expert_num=16, expert_tokens_num_type=2, expert_tokens_num_flag=True, active_expert_range=[4, 8]
    )[2]
    pairs = [[4 + e, c] for e, c in enumerate(e_counts.tolist()) if c]
    assert kv.shape == (16, 2) and kv[: len(pairs)].tolist() == pairs and not kv[len(pairs) :].any()
    # scatter-type index: source (token * k + j) of each expanded row
    scatter = A.moe_init_routing_v2(x, ids, expert_num=16, active_expert_range=[4, 8], row_idx_type=1)[1]
    assert scatter[: len(order)].tolist() == order and (scatter[len(order) :] == -1).all()


def test_init_routing_experts_without_tokens_and_flag_off(backend):
    x = torch.randn(2, 4)
    ids = torch.tensor([[5], [5]], dtype=torch.int32)
    out = A.moe_init_routing_v2(x, ids, expert_num=8, expert_tokens_num_type=1, expert_tokens_num_flag=True)
    assert out[2].tolist() == [0, 0, 0, 0, 0, 2, 0, 0]
    no_counts = A.moe_init_routing_v2(x, ids, expert_num=8)
    assert no_counts[2].dim() == 0  # like torch_npu: no counts when expert_tokens_num_flag=False


def loop_grouped_matmul(x, w, counts, bias=None):
    y = torch.zeros(x.shape[0], w.shape[2], dtype=torch.float64)
    row = 0
    for e, n in enumerate(counts):
        for _ in range(n):
            y[row] = x[row].double() @ w[e].double() + (bias[e].double() if bias is not None else 0)
            row += 1
    return y


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 0, 9, 0], [1, 1, 1, 1], [20, 1, 0, 12]])
def test_grouped_matmul_matches_loop(backend, dtype, counts):
    m = sum(counts) + 2  # two trailing rows no group owns -> zeros
    x = torch.randn(m, 24).to(dtype)
    w = (torch.randn(4, 24, 10) / 5).to(dtype)
    bias = torch.randn(4, 10).to(dtype)
    expected = loop_grouped_matmul(x, w, counts, bias)
    for group_list, gl_type in ((torch.tensor(counts), 1), (torch.tensor(counts).cumsum(0), 0)):
        (y,) = A.grouped_matmul(
            [x], [w], bias=[bias], group_list=group_list, group_type=0, group_list_type=gl_type, split_item=2
        )
        assert y.dtype == dtype and y.shape == (m, 10)
        torch.testing.assert_close(y.double(), expected, atol=tol(dtype)["atol"] * 10, rtol=tol(dtype)["rtol"])


def test_grouped_matmul_transposed_weight_and_list_form(backend):
    x = torch.randn(7, 16)
    w_hf = torch.randn(3, 5, 16)  # Hugging Face [E, N, K]; pass its [E, K, N] view
    (y,) = A.grouped_matmul(
        [x], [w_hf.transpose(1, 2)], group_list=torch.tensor([2, 4, 1]), group_type=0, group_list_type=1
    )
    torch.testing.assert_close(y, loop_grouped_matmul(x, w_hf.transpose(1, 2), [2, 4, 1]).float())
    xs, ws = [torch.randn(3, 4), torch.randn(2, 4)], [torch.randn(4, 6), torch.randn(4, 6)]
    outs = A.grouped_matmul(xs, ws)
    assert len(outs) == 2 and torch.allclose(outs[1], xs[1] @ ws[1])


def loop_finalize(rows, skip1, skip2, bias, scales, dst_of, experts, n, k):
    out = torch.zeros(n, rows.shape[1], dtype=torch.float64)
    for i in range(n):
        out[i] = skip1[i].double() + skip2[i].double()
        for j in range(k):
            d = dst_of(i, j)
            if d >= 0:
                out[i] += float(scales[i, j]) * (rows[d].double() + bias[int(experts[i, j])].double())
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("drop_pad_mode", [0, 2])
def test_finalize_routing_matches_loop(backend, dtype, drop_pad_mode):
    n, k, h, e = 6, 3, 16, 5
    rows = torch.randn(n * k, h).to(dtype)
    skip1, skip2 = torch.randn(n, h).to(dtype), torch.randn(n, h).to(dtype)
    bias = torch.randn(e, h).to(dtype)
    scales = torch.rand(n, k).to(dtype)
    experts = torch.randint(0, e, (n, k), dtype=torch.int32)
    perm = torch.randperm(n * k).to(torch.int32)
    perm[4] = -1  # a pair dropped by init_routing contributes nothing
    out = A.moe_finalize_routing(rows, skip1, skip2, bias, scales, perm, experts, drop_pad_mode, k)
    if drop_pad_mode == 2:

        def dst_of(i, j):
            return int(perm[i * k + j])
    else:

        def dst_of(i, j):
            return int(perm[j * n + i])

    expected = loop_finalize(rows, skip1, skip2, bias, scales, dst_of, experts, n, k)
    assert out.dtype == dtype and out.shape == (n, h)
    torch.testing.assert_close(out.double(), expected, atol=tol(dtype)["atol"] * 5, rtol=tol(dtype)["rtol"])


def test_finalize_routing_without_scales_uses_k(backend):
    rows = torch.randn(8, 4)
    out = A.moe_finalize_routing(rows, None, None, None, None, torch.arange(8, dtype=torch.int32), None, 0, 2)
    torch.testing.assert_close(out, rows[:4] + rows[4:])


def moe_chain(x, logits, w13, w2, k):
    """Router -> init_routing -> gmm -> swiglu -> gmm -> finalize, as the moe pass emits it."""
    num_experts = logits.shape[1]
    weights, ids, _ = A.moe_gating_top_k_softmax(logits, None, k)
    ex, row_idx, counts, _ = A.moe_init_routing_v2(
        x, ids, expert_num=num_experts, expert_tokens_num_type=1, expert_tokens_num_flag=True
    )
    (h,) = A.grouped_matmul([ex], [w13], group_list=counts, group_type=0, group_list_type=1, split_item=2)
    (y,) = A.grouped_matmul([A.swiglu(h)], [w2], group_list=counts, group_type=0, group_list_type=1, split_item=2)
    return A.moe_finalize_routing(y, None, None, None, weights, row_idx, ids, 2, k)


def loop_moe(x, logits, w13, w2, k):
    out = torch.zeros(x.shape, dtype=torch.float64)
    weights, ids = loop_softmax_topk(logits, k)
    for t in range(x.shape[0]):
        for j in range(k):
            e = int(ids[t, j])
            h = x[t].double() @ w13[e].double()
            a, b = h.chunk(2)
            out[t] += float(weights[t, j]) * ((a * torch.sigmoid(a) * b) @ w2[e].double())
    return out


@pytest.mark.parametrize("tokens", [1, 11])
def test_moe_chain_matches_per_token_loop(backend, tokens):
    x, logits = torch.randn(tokens, 16), torch.randn(tokens, 6)
    w13, w2 = torch.randn(6, 16, 2 * 8) / 4, torch.randn(6, 8, 16) / 3
    torch.testing.assert_close(
        moe_chain(x, logits, w13, w2, 2).double(), loop_moe(x, logits, w13, w2, 2), atol=1e-5, rtol=1e-5
    )


# ---------------------------------------------------------------- bad input


BAD_INPUTS = [
    (
        "init_routing id out of range",
        lambda: A.moe_init_routing_v2(torch.randn(2, 4), torch.tensor([[0], [9]], dtype=torch.int32), expert_num=8),
        r"expert id 9 out of range \[0, expert_num=8\)",
    ),
    (
        "init_routing negative id",
        lambda: A.moe_init_routing_v2(torch.randn(2, 4), torch.tensor([[0], [-3]], dtype=torch.int32), expert_num=8),
        r"expert id -3 out of range",
    ),
    (
        "init_routing k > experts",
        lambda: A.moe_init_routing_v2(torch.randn(2, 4), torch.zeros(2, 5, dtype=torch.int32), expert_num=4),
        r"k=5 \(expert_idx.size\(1\)\) must be <= expert_num=4",
    ),
    (
        "init_routing int64 ids",
        lambda: A.moe_init_routing_v2(torch.randn(2, 4), torch.zeros(2, 1, dtype=torch.int64), expert_num=4),
        r"expert_idx must be int32, got torch.int64",
    ),
    (
        "init_routing bad range",
        lambda: A.moe_init_routing_v2(
            torch.randn(2, 4), torch.zeros(2, 1, dtype=torch.int32), expert_num=4, active_expert_range=[2, 9]
        ),
        r"active_expert_range=\[2, 9\] must satisfy 0 <= start < end <= expert_num=4",
    ),
    (
        "init_routing drop_pad",
        lambda: A.moe_init_routing_v2(
            torch.randn(2, 4), torch.zeros(2, 1, dtype=torch.int32), expert_num=4, drop_pad_mode=1
        ),
        r"drop_pad_mode must be one of \[0\], got 1",
    ),
    (
        "topk_softmax k > experts",
        lambda: A.moe_gating_top_k_softmax(torch.randn(2, 4), None, 5),
        r"k=5 must be in \[1, number of experts=4\]",
    ),
    (
        "gating_top_k k > experts",
        lambda: A.moe_gating_top_k(torch.randn(2, 8), 9),
        r"k=9 must be in \[1, experts per group \* k_group = 8\]",
    ),
    (
        "gating_top_k group_count",
        lambda: A.moe_gating_top_k(torch.randn(2, 10), 2, group_count=4, k_group=2),
        r"group_count=4 must be >= 1 and divide the number of experts=10",
    ),
    (
        "gating_top_k bias dtype",
        lambda: A.moe_gating_top_k(torch.randn(2, 8), 2, bias=torch.randn(8, dtype=torch.float64)),
        r"bias dtype torch.float64 does not match x dtype torch.float32",
    ),
    (
        "gating_top_k hash mode without tid2eid",
        lambda: A.moe_gating_top_k(torch.randn(2, 8), 2, input_ids=torch.tensor([0, 1])),
        r"input_ids and tid2eid must be given together \(hash mode\) or both be None",
    ),
    (
        "gating_top_k hash table width",
        lambda: A.moe_gating_top_k(
            torch.randn(2, 8), 2, input_ids=torch.tensor([0, 1]), tid2eid=torch.zeros(4, 3, dtype=torch.int32)
        ),
        r"tid2eid has 3 columns, must equal k=2",
    ),
    (
        "gating_top_k hash ids per row",
        lambda: A.moe_gating_top_k(
            torch.randn(2, 8), 2, input_ids=torch.tensor([0, 1, 2]), tid2eid=torch.zeros(4, 2, dtype=torch.int32)
        ),
        r"input_ids has 3 entries, x has 2 rows",
    ),
    (
        "gating_top_k hash ids dtype",
        lambda: A.moe_gating_top_k(
            torch.randn(2, 8), 2, input_ids=torch.tensor([0.0, 1.0]), tid2eid=torch.zeros(4, 2, dtype=torch.int32)
        ),
        r"input_ids must be int32 or int64, got torch.float32",
    ),
    (
        "gating_top_k hash token id out of range",
        lambda: A.moe_gating_top_k(
            torch.randn(3, 8), 2, input_ids=torch.tensor([0, 4, -1]), tid2eid=torch.zeros(4, 2, dtype=torch.int32)
        ),
        r"input_ids value 4 out of range \[0, tid2eid rows=4\)",
    ),
    (
        "gating_top_k hash expert id out of range",
        lambda: A.moe_gating_top_k(
            torch.randn(2, 8), 2, input_ids=torch.tensor([0, 3]), tid2eid=torch.tensor([[0, 1], [2, 3], [4, 5], [6, 8]])
        ),
        r"tid2eid\[3\] holds expert id 8 out of range \[0, number of experts=8\)",
    ),
    (
        "eplb_map expert id out of range",
        lambda: A.eplb_map(torch.tensor([[0, 1], [5, 0]]), torch.tensor([[0, -1], [1, 2]]), torch.tensor([1, 2])),
        r"ascend.eplb_map: expert_idx holds logical expert id 5 out of range \[0, 2\)",
    ),
    (
        "eplb_record_load slot out of range",
        lambda: A.eplb_record_load(
            torch.zeros(3, dtype=torch.int64), torch.tensor([[0, -1]]), torch.ones(1, dtype=torch.bool)
        ),
        r"ascend.eplb_record_load: expert_idx holds physical slot -1 out of range \[0, 3\)",
    ),
    (
        "eplb_logical_weight slot out of range",
        lambda: A.eplb_logical_weight(
            torch.randn(3, 2),
            torch.tensor([[0], [4]]),
            torch.tensor([1, 1]),
            torch.zeros(3, dtype=torch.int64),
            torch.ones(1, dtype=torch.bool),
        ),
        r"ascend.eplb_logical_weight: log2phy\[:, 0\] holds physical slot 4 out of range \[0, 3\)",
    ),
    (
        "rms_norm gamma dtype",
        lambda: A.rms_norm(torch.randn(2, 8), torch.randn(8, dtype=torch.bfloat16)),
        r"gamma dtype torch.bfloat16 does not match x dtype torch.float32",
    ),
    (
        "rms_norm gamma shape",
        lambda: A.rms_norm(torch.randn(2, 8), torch.randn(4)),
        r"gamma shape \(4,\) must equal the trailing dims of x \(2, 8\)",
    ),
    (
        "add_rms_norm dtypes",
        lambda: A.add_rms_norm(torch.randn(2, 8), torch.randn(2, 8, dtype=torch.float16), torch.randn(8)),
        r"x2 dtype torch.float16 does not match x1 dtype torch.float32",
    ),
    ("swiglu odd", lambda: A.swiglu(torch.randn(2, 7)), r"x.shape\[1\]=7 must be even"),
    ("clipped_swiglu odd", lambda: A.clipped_swiglu(torch.randn(2, 7)), r"clipped_swiglu: x.shape\[1\]=7 must be even"),
    (
        "clipped_swiglu dtype",
        lambda: A.clipped_swiglu(torch.ones(2, 8, dtype=torch.int32)),
        r"clipped_swiglu: x must be float32, bfloat16 or float16, got torch.int32",
    ),
    (
        "clipped_swiglu group_index rank",
        lambda: A.clipped_swiglu(torch.randn(4, 8), group_index=torch.ones(2, 2, dtype=torch.int64)),
        r"clipped_swiglu: group_index must be 1-D \(tokens per group\), got 2-D",
    ),
    (
        "clipped_swiglu group_index dtype",
        lambda: A.clipped_swiglu(torch.randn(4, 8), group_index=torch.ones(2, dtype=torch.int32)),
        r"clipped_swiglu: group_index must be int64, got torch.int32",
    ),
    (
        "gmm weight dtype",
        lambda: A.grouped_matmul(
            [torch.randn(4, 8)],
            [torch.randn(2, 8, 3, dtype=torch.bfloat16)],
            group_list=torch.tensor([2, 2]),
            group_type=0,
            group_list_type=1,
        ),
        r"weight\[0\] dtype torch.bfloat16 does not match x\[0\] dtype torch.float32",
    ),
    (
        "gmm group_list too long",
        lambda: A.grouped_matmul(
            [torch.randn(4, 8)],
            [torch.randn(2, 8, 3)],
            group_list=torch.tensor([3, 2]),
            group_type=0,
            group_list_type=1,
        ),
        r"group_list covers 5 rows but x\[0\] has only 4",
    ),
    (
        "gmm cumsum past the rows",
        lambda: A.grouped_matmul(
            [torch.randn(4, 8)],
            [torch.randn(2, 8, 3)],
            group_list=torch.tensor([2, 2**63 - 1]),
            group_type=0,
            group_list_type=0,
        ),
        r"group_list covers 9223372036854775807 rows but x\[0\] has only 4",
    ),
    (
        "init_routing negative id without expert_num",
        lambda: A.moe_init_routing_v2(torch.randn(2, 4), torch.tensor([[1], [-1]], dtype=torch.int32)),
        r"expert id -1 must be >= 0 \(expert_num=-1 sets no upper bound\)",
    ),
    (
        "gmm group_list not monotone",
        lambda: A.grouped_matmul(
            [torch.randn(4, 8)],
            [torch.randn(2, 8, 3)],
            group_list=torch.tensor([3, 2]),
            group_type=0,
            group_list_type=0,
        ),
        r"non-decreasing cumsum",
    ),
    (
        "gmm experts mismatch",
        lambda: A.grouped_matmul(
            [torch.randn(4, 8)], [torch.randn(2, 8, 3)], group_list=torch.tensor([4]), group_type=0, group_list_type=1
        ),
        r"group_list has 1 entries but weight has 2 experts",
    ),
    (
        "finalize dst out of range",
        lambda: A.moe_finalize_routing(
            torch.randn(4, 2),
            None,
            None,
            None,
            torch.rand(2, 2),
            torch.tensor([0, 1, 2, 7], dtype=torch.int32),
            None,
            2,
            2,
        ),
        r"expanded_src_to_dst_row value 7 out of range \[-1, 4\)",
    ),
    (
        "linear 3-D input",
        lambda: A.linear(torch.randn(2, 3, 8), torch.randn(4, 8)),
        r"ascend.linear: input must be 2-D, got 3-D",
    ),
    (
        "linear K mismatch",
        lambda: A.linear(torch.randn(3, 8), torch.randn(4, 6)),
        r"ascend.linear: input has K=8 columns but weight \[N, K\] has K=6",
    ),
    (
        "linear bias shape",
        lambda: A.linear(torch.randn(3, 8), torch.randn(4, 8), torch.randn(5)),
        r"ascend.linear: bias must have shape \[4\], got \(5,\)",
    ),
    (
        "linear dtype mismatch",
        lambda: A.linear(torch.randn(3, 8), torch.randn(4, 8).to(torch.bfloat16)),
        r"ascend.linear: weight dtype torch.bfloat16 does not match input dtype torch.float32",
    ),
    (
        "linear integer input",
        lambda: A.linear(torch.ones(3, 8, dtype=torch.int32), torch.ones(4, 8, dtype=torch.int32)),
        r"ascend.linear: input must be float32, bfloat16 or float16, got torch.int32",
    ),
    (
        "finalize bias without experts",
        lambda: A.moe_finalize_routing(
            torch.randn(4, 2),
            None,
            None,
            torch.randn(3, 2),
            torch.rand(2, 2),
            torch.arange(4, dtype=torch.int32),
            None,
            2,
            2,
        ),
        r"bias needs export_for_source_row",
    ),
    (
        "finalize scales dtype",
        lambda: A.moe_finalize_routing(
            torch.randn(4, 2),
            None,
            None,
            None,
            torch.rand(2, 2, dtype=torch.float64),
            torch.arange(4, dtype=torch.int32),
            None,
            2,
            2,
        ),
        r"scales dtype torch.float64 must be float32 or match expanded_permuted_rows",
    ),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_raises_clear_value_error(backend, case):
    _, call, message = case
    with pytest.raises(ValueError, match=message):
        call()


# ---------------------------------------------------------------- linear


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 8, 33])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_dot_product_formula(backend, dtype, rows, with_bias):
    x = torch.randn(rows, 24).to(dtype)
    w = (torch.randn(7, 24) / 5).to(dtype)
    b = torch.randn(7).to(dtype) if with_bias else None
    y = A.linear(x, w, b)
    assert y.dtype == dtype and y.shape == (rows, 7)
    expected = torch.empty(rows, 7)
    for i in range(rows):
        for n in range(7):
            expected[i, n] = sum(float(x[i, j]) * float(w[n, j]) for j in range(24)) + (
                float(b[n]) if b is not None else 0.0
            )
    torch.testing.assert_close(y.float(), expected, **tol(dtype))


# ---------------------------------------------------------------- opcheck and torch.compile


def sample_calls():
    """(op name, args, kwargs) covering every op; small enough for opcheck."""
    x = torch.randn(6, 16)
    ids = distinct_topk_ids(6, 8, 2)
    counts = torch.bincount(ids.flatten().long(), minlength=8)
    return [
        ("rms_norm", (x, torch.randn(16), 1e-6), {}),
        ("add_rms_norm", (x, torch.randn(6, 16), torch.randn(16), 1e-6), {}),
        ("swiglu", (x, -1), {}),
        ("clipped_swiglu", (x * 4,), dict(limit=3.0)),
        ("clipped_swiglu", (x * 4,), dict(group_index=torch.tensor([2, 3]), alpha=1.0, bias=0.0, interleaved=False)),
        ("moe_gating_top_k_softmax", (torch.randn(6, 8), None, 2), {}),
        (
            "moe_gating_top_k",
            (torch.randn(6, 16), 4),
            dict(
                bias=torch.randn(16),
                k_group=2,
                group_count=4,
                group_select_mode=1,
                norm_type=1,
                routed_scaling_factor=2.0,
            ),
        ),
        (
            "moe_gating_top_k",
            (torch.randn(6, 16), 3),
            dict(
                input_ids=torch.tensor([3, 0, 9, 3, 1, 2]),
                tid2eid=torch.randint(0, 16, (10, 3)),
                norm_type=1,
                routed_scaling_factor=2.0,
            ),
        ),
        (
            "moe_init_routing_v2",
            (x, ids),
            dict(
                scale=torch.rand(6),
                expert_num=8,
                expert_tokens_num_type=1,
                expert_tokens_num_flag=True,
                active_expert_range=[2, 6],
            ),
        ),
        (
            "grouped_matmul",
            ([torch.randn(12, 16)], [torch.randn(8, 16, 4)]),
            dict(bias=[torch.randn(8, 4)], group_list=counts, group_type=0, group_list_type=1),
        ),
        (
            "moe_finalize_routing",
            (
                torch.randn(12, 16),
                torch.randn(6, 16),
                None,
                torch.randn(8, 16),
                torch.rand(6, 2),
                torch.randperm(12).to(torch.int32),
                ids,
                2,
                2,
            ),
            {},
        ),
        ("linear", (x, torch.randn(5, 16), torch.randn(5)), {}),
    ]


def call_ids(calls) -> list[str]:
    """Test ids of ``sample_calls()``: the op name, ``-hash`` for moe_gating_top_k's hash mode,
    ``-group_index`` for clipped_swiglu's grouped rows."""
    return [
        name + ("-hash" if "tid2eid" in kwargs else "") + ("-group_index" if "group_index" in kwargs else "")
        for name, _, kwargs in calls
    ]


@pytest.mark.parametrize("name,args,kwargs", sample_calls(), ids=call_ids(sample_calls()))
def test_opcheck(backend, name, args, kwargs):
    torch.library.opcheck(getattr(A, name).default, args, kwargs)


def non_contiguous(value):
    """``value`` with every tensor re-laid out non-contiguously (same values): matrices and up
    transposed in memory, vectors strided by 2; lists element by element."""
    if isinstance(value, (list, tuple)):
        return type(value)(non_contiguous(v) for v in value)
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    if value.dim() == 1:
        return torch.stack([value, torch.zeros_like(value)], -1)[:, 0]
    return value.transpose(-1, -2).contiguous().transpose(-1, -2)


@pytest.mark.parametrize("name,args,kwargs", sample_calls(), ids=call_ids(sample_calls()))
def test_opcheck_non_contiguous_inputs(backend, name, args, kwargs):
    """The fake promises the strides the kernel returns (contiguous) whatever the inputs'
    strides, and the values do not depend on them (a q/k norm after ``transpose(1, 2)``)."""
    args, kwargs = non_contiguous(args), non_contiguous(kwargs)
    assert any(
        not t.is_contiguous() for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
    )
    op = getattr(A, name).default
    torch.library.opcheck(op, args, kwargs)
    for out in torch.utils._pytree.tree_leaves(op(*args, **kwargs)):
        assert out.is_contiguous()


@pytest.mark.parametrize("name,args,kwargs", sample_calls(), ids=call_ids(sample_calls()))
def test_op_in_compiled_graph_dynamic(backend, name, args, kwargs):
    op = getattr(A, name).default
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a, **kw: op(*a, **kw), fullgraph=True, dynamic=True, backend="aot_eager")
    expected = op(*args, **kwargs)
    got = compiled(*args, **kwargs)
    for e, g in zip(torch.utils._pytree.tree_leaves(expected), torch.utils._pytree.tree_leaves(got)):
        torch.testing.assert_close(g, e)


def test_moe_chain_under_inductor_with_symbolic_tokens(backend):
    torch._dynamo.reset()
    w13, w2 = torch.randn(6, 16, 16) / 4, torch.randn(6, 8, 16) / 3
    compiled = torch.compile(moe_chain, fullgraph=True, dynamic=True)  # default backend: inductor
    for tokens in (5, 9, 1):  # one graph serves every token count
        x, logits = torch.randn(tokens, 16), torch.randn(tokens, 6)
        torch.testing.assert_close(compiled(x, logits, w13, w2, 2), moe_chain(x, logits, w13, w2, 2))


# ---------------------------------------------------------------- NPU mapping


def test_npu_table_covers_every_op_with_matching_argument_names():
    from ascend_passes import npu

    # ours: no torch_npu counterpart (attention: a CPU op, emitted for target cpu only)
    eplb_ops = {"eplb_map", "eplb_record_load", "eplb_logical_weight", "attention"}
    assert set(npu.NPU_OPS) == set(ops.OPS) - eplb_ops
    assert all(npu.NPU_OPS[name] is op.npu for name, op in ops.OPS.items() if op.npu)
    for name in set(ops.OPS) - eplb_ops - {"mla_prolog"}:  # mla_prolog: tests/test_lower.py
        entry = npu.NPU_OPS[name]
        assert entry.npu_name == "npu_" + name
        for arg in getattr(A, name).default._schema.arguments:
            assert arg.name in entry.doc, f"{name}: argument {arg.name} not in {entry.doc}"


def test_npu_lowering_is_lazy_without_torch_npu():
    from ascend_passes import npu

    assert npu.torch_npu_available() is False  # no CANN here
    assert npu.npu_overload("grouped_matmul") is None
    with pytest.raises(RuntimeError, match="needs torch_npu"):
        npu.lowered_call("rms_norm", (), {})
    _, kwargs = npu.NPU_OPS["moe_init_routing_v2"].adapt((), {"expert_num": 8})
    assert kwargs == {"expert_num": 8, "quant_mode": -1, "expert_tokens_num_type": 0}


def test_import_twice_keeps_ops_registered():
    import importlib

    again = importlib.reload(ops)
    assert again.SCHEMAS is not None
    x = torch.randn(2, 8)
    torch.testing.assert_close(A.swiglu(x), reference.swiglu(x))


def test_init_routing_active_num_under_dynamic_compile(backend):
    torch._dynamo.reset()

    def f(x, ids):
        return A.moe_init_routing_v2(x, ids, active_num=10, expert_num=8)

    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend="aot_eager")
    for tokens in (3, 9):  # 3*2 < 10 rows, 9*2 > 10 rows
        x, ids = torch.randn(tokens, 4), distinct_topk_ids(tokens, 8, 2)
        got, expected = compiled(x, ids), f(x, ids)
        assert got[0].shape == (min(10, tokens * 2), 4)
        for g, e in zip(got, expected):
            assert torch.equal(g, e)


def test_clipped_swiglu_lowers_to_npu_clipped_swiglu_inside_its_limits():
    """The NPU row: a contiguous x lowers to ``npu.npu_clipped_swiglu`` with every argument by its
    name; a non-contiguous x (the NPU takes contiguous x only) is decomposed with a near-miss."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from ascend_passes import npu, npu_schemas
    from ascend_passes.config import AscendPassConfig
    from ascend_passes.pass_manager import PassContext
    from ascend_passes.passes.lower import LowerPass

    skip_unless(npu_schemas.wheel_path() is not None, "no torch_npu wheel (tools/setup.sh)")
    assert npu.npu_overload("clipped_swiglu") is None  # nothing defined before: unload afterwards
    npu_schemas.load()
    try:

        def lower(fn, x):
            gm = make_fx(fn, tracing_mode="fake")(x)
            result = LowerPass(AscendPassConfig()).run(gm, PassContext(AscendPassConfig(), target="npu"))
            return gm, result

        kw = dict(alpha=1.0, limit=3.0, bias=0.0, interleaved=False)
        gm, result = lower(lambda x: A.clipped_swiglu(x, **kw), torch.randn(4, 8))
        (call,) = [n for n in gm.graph.nodes if str(n.target).startswith("npu.")]
        assert call.target is torch.ops.npu.npu_clipped_swiglu.default and not result.near_misses
        assert {k: call.kwargs[k] for k in kw} == kw
        gm, result = lower(lambda x: A.clipped_swiglu(x.t(), **kw), torch.randn(8, 4))
        assert not [n for n in gm.graph.nodes if str(n.target).startswith(("npu.", "ascend."))]
        (nm,) = result.near_misses
        assert "non-contiguous x (npu_clipped_swiglu takes contiguous x only)" in nm.reason
    finally:
        npu_schemas.unload()
