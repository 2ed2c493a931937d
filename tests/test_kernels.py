"""The C++ CPU kernels (torch.ops.ascend_kernels.*) against the reference implementations, the
registration contract between them, and the fallback when the kernels are absent or disabled."""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from _helpers import cpu_flags, cpu_vendor, rerun_capped, run_with_memory_cap, skip_unless

import ascend_passes.ops as ops
from ascend_passes import kernels
from ascend_passes.ops import reference

# a failure instead of a skip under ASCEND_PASSES_CI_STRICT=1 (CI)
skip_unless(kernels.available(), "C++ kernels not built or disabled", allow_module_level=True)

K = torch.ops.ascend_kernels if kernels.available() else None
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def assert_same(got, expected, dtype):
    atol = {torch.float32: 2e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    for g, e in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(expected)):
        assert g.dtype == e.dtype and g.shape == e.shape
        if g.dtype.is_floating_point:
            torch.testing.assert_close(g.float(), e.float(), atol=atol, rtol=atol)
        else:
            assert torch.equal(g, e)


def test_schemas_match_between_ascend_and_ascend_kernels():
    for name in ops.KERNEL_OPS:
        ours = str(getattr(torch.ops.ascend, name).default._schema).replace("ascend::", "")
        cpp = str(getattr(K, name).default._schema).replace("ascend_kernels::", "")
        assert ours == cpp


def test_ascend_ops_dispatch_to_the_cpp_kernels_on_cpu():
    assert ops.kernel_backend() == "cpp"
    for name in ops.KERNEL_OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"ascend::{name}", "CPU")


@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_and_swiglu_large_rows(dtype):
    x, r = torch.randn(257, 1024).to(dtype), torch.randn(257, 1024).to(dtype)
    g = torch.rand(1024).to(dtype)
    assert_same(K.rms_norm(x, g, 1e-6), reference.rms_norm(x, g, 1e-6), dtype)
    assert_same(K.add_rms_norm(x, r, g, 1e-6), reference.add_rms_norm(x, r, g, 1e-6), dtype)
    assert_same(K.swiglu(x, -1), reference.swiglu(x, -1), dtype)
    long_rows = torch.randn(2, 3, 9000).to(dtype)  # split inside a row (dim=0)
    assert_same(K.swiglu(long_rows, 0), reference.swiglu(long_rows, 0), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [True, False])
def test_clipped_swiglu_kernel_equals_reference(dtype, interleaved):
    """Many short rows (split across rows), few long ones (split inside a row), another dim,
    a non-contiguous x and grouped rows: the C++ kernel equals the reference."""
    kw = dict(alpha=1.702, limit=7.0, bias=1.0, interleaved=interleaved)
    x = (torch.randn(257, 1024) * 8).to(dtype)  # both clamps bite
    assert_same(K.clipped_swiglu(x, **kw), reference.clipped_swiglu(x, **kw), dtype)
    long_rows = (torch.randn(2, 4, 9000) * 8).to(dtype)
    assert_same(K.clipped_swiglu(long_rows, dim=0, **kw), reference.clipped_swiglu(long_rows, dim=0, **kw), dtype)
    assert_same(K.clipped_swiglu(long_rows, dim=1, **kw), reference.clipped_swiglu(long_rows, dim=1, **kw), dtype)
    strided = (torch.randn(64, 40) * 8).to(dtype).t().contiguous().t()
    assert not strided.is_contiguous()
    assert_same(K.clipped_swiglu(strided, **kw), reference.clipped_swiglu(strided, **kw), dtype)
    groups = torch.tensor([100, 0, 57])  # 157 of 257 rows
    got = K.clipped_swiglu(x, group_index=groups, **kw)
    assert_same(got, reference.clipped_swiglu(x, group_index=groups, **kw), dtype)
    assert (got[157:] == 0).all()


def routing_case(tokens: int, experts: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)]).to(torch.int32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rng", [[], [8, 40]])
@pytest.mark.parametrize("count_type", [0, 1, 2])
@pytest.mark.parametrize("row_idx_type", [0, 1])
def test_init_routing_is_bitwise_equal(dtype, rng, count_type, row_idx_type):
    ids = routing_case(300, 64, 6)
    x, scale = torch.randn(300, 96).to(dtype), torch.rand(300)
    kw = dict(
        scale=scale,
        expert_num=64,
        expert_tokens_num_type=count_type,
        expert_tokens_num_flag=True,
        active_expert_range=rng,
        row_idx_type=row_idx_type,
    )
    got, expected = K.moe_init_routing_v2(x, ids, **kw), reference.moe_init_routing_v2(x, ids, **kw)
    for g, e in zip(got, expected):
        assert torch.equal(g, e)
    truncated = dict(kw, active_num=1000)  # fewer output rows than pairs
    for g, e in zip(K.moe_init_routing_v2(x, ids, **truncated), reference.moe_init_routing_v2(x, ids, **truncated)):
        assert torch.equal(g, e)


# Issue 14 items 5 and 6, run in a child process capped at 4 GiB of address space: before the fixes,
# the C++ kernels allocated 16 B x (largest expert id + 1) (2**31-1: 32 GB, the machine's OOM killer)
# and looped allocating work items for group counts whose int64 sum wrapped past the row check.
HUGE_VALUES_SCRIPT = textwrap.dedent(
    """
    import time, torch
    import ascend_passes.ops
    from ascend_passes.ops import reference
    K = torch.ops.ascend_kernels

    def outcome(f):
        try:
            return f()
        except ValueError as exc:
            return str(exc)

    start = time.perf_counter()
    x = torch.randn(3, 8)
    ids = torch.tensor([[2**31 - 1, 0], [5, 2**31 - 1], [7, 7]], dtype=torch.int32)
    for kw in (dict(), dict(row_idx_type=1, active_num=4), dict(expert_num=2**40),
               dict(expert_num=2**40, active_expert_range=[5, 2**40]), dict(expert_num=2**31, active_num=5)):
        got, expected = K.moe_init_routing_v2(x, ids, **kw), reference.moe_init_routing_v2(x, ids, **kw)
        assert all(torch.equal(g, e) for g, e in zip(got, expected)), kw
    expected = reference.moe_init_routing_v2(x, ids)[1]
    assert expected.tolist() == [4, 0, 1, 5, 2, 3], expected  # sorted by expert id: 0, 5, 7, 7, 2**31-1 x2
    negative = torch.tensor([[3, -2]], dtype=torch.int32)
    for impl in (K, reference):
        assert outcome(lambda: impl.moe_init_routing_v2(x[:1], negative)) == (
            "ascend.moe_init_routing_v2: expert id -2 must be >= 0 (expert_num=-1 sets no upper bound)")

    x, w = torch.randn(4, 8), torch.randn(4, 8, 3)
    for group_list, gl_type, total in (([2**62] * 4, 1, 2**64), ([2**63 - 1, 2**63 - 1, 3, 0], 1, 2**64 + 1),
                                       ([2**62, -2**62, 2, 2], 1, None), ([2, 2**63 - 1, 2**63 - 1, 4], 0, None)):
        for impl in (K, reference):
            message = outcome(lambda: impl.grouped_matmul([x], [w], group_list=torch.tensor(group_list),
                                                          group_type=0, group_list_type=gl_type))
            if total is None:
                assert "must be non-negative counts (type 1) or a non-decreasing cumsum (type 0)" in message
            else:
                assert message == f"ascend.grouped_matmul: group_list covers {total} rows but x[0] has only 4"
    print(f"bounded-ok {time.perf_counter() - start:.2f}")
    """
)


def test_huge_expert_ids_and_group_counts_stay_bounded_and_match_the_reference():
    run = run_with_memory_cap(HUGE_VALUES_SCRIPT, 4 << 30, timeout=120)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert "bounded-ok" in run.stdout


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 8, 400])
@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_grouped_matmul_against_reference(dtype, tokens, layout):
    ids = routing_case(tokens, 16, 4, seed=tokens)
    counts = torch.bincount(ids.flatten().long(), minlength=16)
    x = torch.randn(tokens * 4 + 3, 64).to(dtype)
    w = torch.randn(16, 64, 48) if layout == "kn" else torch.randn(16, 48, 64).transpose(1, 2)
    w = (w / 8).to(dtype)
    bias = torch.randn(16, 48).to(dtype)
    for act in (0, 5):
        kw = dict(bias=[bias], group_list=counts.cumsum(0), group_type=0, group_list_type=0, act_type=act)
        assert_same(K.grouped_matmul([x], [w], **kw), reference.grouped_matmul([x], [w], **kw), dtype)


@pytest.mark.parametrize("act", [0, 5])
@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_grouped_matmul_bf16_bias_enters_before_the_rounding(layout, act):
    """bf16 pieces of many rows (oneDNN's mm on CPUs without AMX for the [K, N] layout; every route by its own rule)
    add the bias to the product's fp32 sums and round once: where the bias cancels the product the result is the
    small residual to within an ulp, not the product's rounding error (up to tens of ulps of the residual when the
    product was rounded to bf16 first, session 29)."""
    torch.manual_seed(0)
    m, k, n = 100, 256, 48
    x = torch.randn(2 * m, k).bfloat16()
    w = torch.randn(2, k, n) / 2 if layout == "kn" else (torch.randn(2, n, k) / 2).transpose(1, 2)
    w = w.bfloat16()
    # each group's bias: minus its first row's product, rounded to bf16 (what is left: that rounding's residual)
    product = torch.stack([x[g * m].float() @ w[g].float() for g in range(2)])
    bias = (-product).bfloat16()
    kw = dict(bias=[bias], group_list=torch.tensor([m, 2 * m]), group_type=0, group_list_type=0, act_type=act)
    got = K.grouped_matmul([x], [w], **kw)[0].float()
    exact = torch.cat([x[g * m : (g + 1) * m].float() @ w[g].float() + bias[g].float() for g in range(2)])
    if act == 5:
        exact = torch.nn.functional.silu(exact)
    rows = [0, m]  # the cancelled rows
    ulp = exact[rows].abs().clamp_min(2**-30).log2().floor().exp2() * 2**-7
    # one rounding of the residual, plus what a different fp32 summation order may leave (~2^-20 of the terms' sum)
    terms = torch.stack([x[g * m].float().abs() @ w[g].float().abs() for g in range(2)])
    bound = ulp + 2**-20 * terms
    assert bool(((got[rows] - exact[rows]).abs() <= bound).all()), ((got[rows] - exact[rows]).abs() / bound).max()
    # the product's own bf16 rounding (half an ulp at its magnitude, what rounding it first could leave) is far larger
    assert (product.abs().log2().floor().exp2() * 2**-8 > 8 * bound).float().mean() > 0.5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", [0, 2])
def test_finalize_routing_against_reference(dtype, mode):
    n, k, h, e = 129, 6, 256, 64
    rows = torch.randn(n * k, h).to(dtype)
    dst = torch.randperm(n * k).to(torch.int32)
    dst[::7] = -1
    args = (
        rows,
        torch.randn(n, h).to(dtype),
        None,
        torch.randn(e, h).to(dtype),
        torch.rand(n, k),
        dst,
        torch.randint(0, e, (n, k), dtype=torch.int32),
        mode,
        k,
    )
    assert_same(K.moe_finalize_routing(*args), reference.moe_finalize_routing(*args), dtype)


def gating_logits(rows: int, experts: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    """Router logits on a 1/64 grid: equal logits tie exactly (same score bits in both
    implementations), distinct ones differ by far more than rounding, so the selected experts
    must agree exactly."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, experts, generator=g) * 2 * 64).round().div(64).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 300])
@pytest.mark.parametrize("k", [1, 2, 6, 12, 64])
@pytest.mark.parametrize("with_finished", [False, True])
def test_gating_top_k_softmax_against_reference(dtype, rows, k, with_finished):
    x = gating_logits(rows, 64, dtype, seed=rows + k)
    finished = torch.rand(rows, generator=torch.Generator().manual_seed(k)) < 0.3 if with_finished else None
    if with_finished:
        finished[0] = True
    got, expected = K.moe_gating_top_k_softmax(x, finished, k), reference.moe_gating_top_k_softmax(x, finished, k)
    assert_same(got, expected, dtype)
    if with_finished:
        assert (got[1][0] == 64).all()  # finished rows route to expert E


def test_gating_top_k_softmax_3d_with_finished():
    x = gating_logits(10, 16).view(2, 5, 16)
    finished = torch.tensor([[False, True, False, False, True], [True, False, False, False, False]])
    got, expected = K.moe_gating_top_k_softmax(x, finished, 3), reference.moe_gating_top_k_softmax(x, finished, 3)
    assert got[0].shape == (2, 5, 3)
    assert_same(got, expected, torch.float32)


@pytest.mark.parametrize("norm_type", [0, 1])
@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("k_group", [4, 8])  # 8 = group_count: no group selection
def test_gating_top_k_against_reference(norm_type, mode, with_bias, k_group):
    x = gating_logits(300, 64, seed=norm_type + 2 * mode)
    bias = torch.randn(64, generator=torch.Generator().manual_seed(1)) * 0.1 if with_bias else None
    for k in (6, 64 // 8 * k_group):  # DeepSeek-like, and every allowed expert
        kw = dict(
            bias=bias,
            k_group=k_group,
            group_count=8,
            group_select_mode=mode,
            norm_type=norm_type,
            routed_scaling_factor=2.5,
        )
        got, expected = K.moe_gating_top_k(x, k, **kw), reference.moe_gating_top_k(x, k, **kw)
        assert_same(got, expected, torch.float32)
        assert got[1].dtype == torch.int32 and got[2].dtype == torch.float32 and got[2].shape == (300, 64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 300])
def test_gating_top_k_dtypes_against_reference(dtype, rows):
    x = gating_logits(rows, 64, dtype, seed=rows)
    bias = (torch.randn(64, generator=torch.Generator().manual_seed(2)) * 0.1).to(dtype)
    kw = dict(
        bias=bias, k_group=4, group_count=8, group_select_mode=1, norm_type=1, routed_scaling_factor=2.5, eps=1e-3
    )
    got, expected = K.moe_gating_top_k(x, 6, **kw), reference.moe_gating_top_k(x, 6, **kw)
    assert got[0].dtype == dtype
    assert_same(got, expected, dtype)


def test_gating_ties_pick_the_lower_index_like_the_reference():
    # all-equal logits, and rows whose experts repeat a few values (ties within and across groups)
    base = gating_logits(40, 8, seed=3)
    dup = base[:, torch.randint(0, 8, (64,), generator=torch.Generator().manual_seed(4))]
    for x in (torch.zeros(3, 64), dup):
        for k in (1, 6, 64):
            got, expected = K.moe_gating_top_k_softmax(x, None, k), reference.moe_gating_top_k_softmax(x, None, k)
            assert torch.equal(got[1], expected[1])
        for mode, k_group, norm_type in ((0, 4, 1), (1, 4, 1), (1, 2, 0), (0, 8, 0)):
            kw = dict(k_group=k_group, group_count=8, group_select_mode=mode, norm_type=norm_type)
            got, expected = K.moe_gating_top_k(x, 6, **kw), reference.moe_gating_top_k(x, 6, **kw)
            assert torch.equal(got[1], expected[1])
            assert_same(got, expected, torch.float32)
    assert K.moe_gating_top_k_softmax(torch.zeros(1, 64), None, 3)[1].tolist() == [[0, 1, 2]]
    _, idx, _ = K.moe_gating_top_k(torch.zeros(1, 64), 3, k_group=2, group_count=8, group_select_mode=1, norm_type=1)
    assert idx.tolist() == [[0, 1, 2]]


def test_gating_top_k_masked_groups_and_non_finite_scores_like_the_reference():
    # kept groups 2 and 3 hold one finite expert each (bias -inf on the others): the third pick
    # is a -inf tie, which the reference's masked_fill(-inf) gives to expert 0 of a dropped group
    inf = float("inf")
    bias = torch.zeros(16)
    bias[[9, 10, 11, 13, 14, 15]] = -inf
    x = torch.full((2, 16), -3.0)
    x[:, 8], x[:, 12] = 4.0, 3.0
    kw = dict(bias=bias, k_group=2, group_count=4, group_select_mode=0, norm_type=1)
    got, expected = K.moe_gating_top_k(x, 3, **kw), reference.moe_gating_top_k(x, 3, **kw)
    assert expected[1][0].tolist() == [8, 12, 0]
    assert_same(got, expected, torch.float32)
    # NaN ranks first (torch.sort), +-inf logits, fully NaN / -inf rows
    x = gating_logits(5, 16)
    x[0, 3], x[1], x[2, 5], x[3, 7], x[4] = float("nan"), float("nan"), inf, -inf, -inf
    for k in (1, 3, 16):
        got, expected = K.moe_gating_top_k_softmax(x, None, k), reference.moe_gating_top_k_softmax(x, None, k)
        assert torch.equal(got[1], expected[1])
        torch.testing.assert_close(got[0], expected[0], equal_nan=True)
    for mode in (0, 1):
        kw = dict(k_group=2, group_count=4, group_select_mode=mode, norm_type=1)
        got, expected = K.moe_gating_top_k(x, 2, **kw), reference.moe_gating_top_k(x, 2, **kw)
        assert torch.equal(got[1], expected[1])
        torch.testing.assert_close(got[2], expected[2], equal_nan=True)


def test_gating_tiny_scores_keep_their_order():
    # logits down to -200: softmax / sigmoid scores underflow to denormals and 0; the order of
    # the tail (k = all) must still follow the values
    x = torch.linspace(-200, 0, 64)[torch.randperm(64, generator=torch.Generator().manual_seed(5))].repeat(2, 1)
    assert_same(K.moe_gating_top_k_softmax(x, None, 64), reference.moe_gating_top_k_softmax(x, None, 64), torch.float32)
    for norm_type in (0, 1):
        got, expected = (
            K.moe_gating_top_k(x, 64, norm_type=norm_type),
            reference.moe_gating_top_k(x, 64, norm_type=norm_type),
        )
        assert torch.equal(got[1], expected[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_type", [0, 1])
@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64])
def test_gating_top_k_hash_mode_against_reference(dtype, norm_type, table_dtype):
    """Hash mode (input_ids / tid2eid): random tables, rows, repeated experts, a strided table,
    bias and groups given (they select nothing here)."""
    g = torch.Generator().manual_seed(norm_type)
    for rows, k in ((1, 6), (300, 6), (37, 1), (0, 2)):
        x = gating_logits(rows, 64, dtype, seed=rows + k)
        tid2eid = torch.randint(0, 64, (64, 1000), generator=g).to(table_dtype).t()[:, :k]  # strided [1000, k]
        input_ids = torch.randint(0, 1000, (rows,), generator=g).to(table_dtype if rows % 2 else torch.int64)
        kw = dict(
            input_ids=input_ids,
            tid2eid=tid2eid,
            norm_type=norm_type,
            routed_scaling_factor=2.5,
            bias=(torch.randn(64, generator=g) * 0.1).to(dtype),
            k_group=4,
            group_count=8,
        )
        got, expected = K.moe_gating_top_k(x, k, **kw), reference.moe_gating_top_k(x, k, **kw)
        assert_same(got, expected, dtype)
        assert torch.equal(got[1], tid2eid[input_ids.long()].to(torch.int32))


GATING_BAD_INPUTS = [
    ("moe_gating_top_k_softmax", (torch.randn(2, 4).long(), None, 1), {}),
    ("moe_gating_top_k_softmax", (torch.randn(4), None, 1), {}),
    ("moe_gating_top_k_softmax", (torch.randn(2, 2, 2, 4), None, 1), {}),
    ("moe_gating_top_k_softmax", (torch.randn(2, 4), None, 0), {}),
    ("moe_gating_top_k_softmax", (torch.randn(2, 4), None, 5), {}),
    ("moe_gating_top_k_softmax", (torch.randn(2, 4), torch.zeros(2, dtype=torch.int32), 1), {}),
    ("moe_gating_top_k_softmax", (torch.randn(2, 3, 4), torch.zeros(3, dtype=torch.bool), 1), {}),
    ("moe_gating_top_k_softmax", (torch.randn(2, 4), torch.zeros((), dtype=torch.bool), 1), {}),
    ("moe_gating_top_k", (torch.randn(2, 8).double(), 2), {}),
    ("moe_gating_top_k", (torch.randn(2, 2, 8), 2), {}),
    ("moe_gating_top_k", (torch.randn(2, 8), 9), {}),
    ("moe_gating_top_k", (torch.randn(2, 8), 0), {}),
    ("moe_gating_top_k", (torch.randn(2, 16), 9), dict(k_group=2, group_count=4)),
    ("moe_gating_top_k", (torch.randn(2, 10), 2), dict(group_count=4, k_group=2)),
    ("moe_gating_top_k", (torch.randn(2, 8), 2), dict(group_count=0)),
    ("moe_gating_top_k", (torch.randn(2, 8), 2), dict(group_count=4, k_group=5)),
    ("moe_gating_top_k", (torch.randn(2, 8), 2), dict(group_count=4, k_group=0)),
    ("moe_gating_top_k", (torch.randn(2, 8), 2), dict(bias=torch.randn(8, dtype=torch.float64))),
    ("moe_gating_top_k", (torch.randn(2, 8), 2), dict(bias=torch.randn(2, 8))),
    ("moe_gating_top_k", (torch.randn(2, 8), 2), dict(bias=torch.randn(6))),
    ("moe_gating_top_k", (torch.randn(2, 8), 2), dict(norm_type=2)),
    ("moe_gating_top_k", (torch.randn(2, 8), 2), dict(group_select_mode=-1)),
    ("moe_gating_top_k", (torch.randn(2, 8), 2), dict(renorm=1)),
    # hash mode: both or neither, ranks, dtypes, sizes, then the ids' values (first bad one named)
    ("moe_gating_top_k", (torch.randn(2, 8), 2), dict(tid2eid=torch.zeros(4, 2, dtype=torch.int32))),
    (
        "moe_gating_top_k",
        (torch.randn(2, 8), 2),
        dict(input_ids=torch.zeros(2, 1, dtype=torch.int32), tid2eid=torch.zeros(4, 2, dtype=torch.int32)),
    ),
    (
        "moe_gating_top_k",
        (torch.randn(2, 8), 2),
        dict(input_ids=torch.zeros(2, dtype=torch.int32), tid2eid=torch.zeros(4, dtype=torch.int32)),
    ),
    (
        "moe_gating_top_k",
        (torch.randn(2, 8), 2),
        dict(input_ids=torch.zeros(2, dtype=torch.int16), tid2eid=torch.zeros(4, 2, dtype=torch.int32)),
    ),
    (
        "moe_gating_top_k",
        (torch.randn(2, 8), 2),
        dict(input_ids=torch.zeros(2, dtype=torch.int32), tid2eid=torch.zeros(4, 2)),
    ),
    (
        "moe_gating_top_k",
        (torch.randn(2, 8), 2),
        dict(input_ids=torch.zeros(3, dtype=torch.int32), tid2eid=torch.zeros(4, 2, dtype=torch.int32)),
    ),
    (
        "moe_gating_top_k",
        (torch.randn(2, 8), 2),
        dict(input_ids=torch.zeros(2, dtype=torch.int32), tid2eid=torch.zeros(4, 3, dtype=torch.int32)),
    ),
    (
        "moe_gating_top_k",
        (torch.randn(3, 8), 2),
        dict(input_ids=torch.tensor([1, -1, 9]), tid2eid=torch.zeros(4, 2, dtype=torch.int32)),
    ),
    (
        "moe_gating_top_k",
        (torch.randn(3, 8), 2),
        dict(
            input_ids=torch.tensor([1, 2, 3], dtype=torch.int32),
            tid2eid=torch.tensor([[0, 1], [2, 3], [4, -5], [8, 9]]),
        ),
    ),
    ("moe_gating_top_k", (torch.randn(1, 8), 2), dict(input_ids=torch.tensor([0]), tid2eid=torch.tensor([[7, 2**40]]))),
]


@pytest.mark.parametrize(
    "name,args,kwargs", GATING_BAD_INPUTS, ids=[f"{c[0]}-{i}" for i, c in enumerate(GATING_BAD_INPUTS)]
)
def test_gating_bad_input_raises_the_reference_message(name, args, kwargs):
    with pytest.raises(ValueError) as expected:
        getattr(reference, name)(*args, **kwargs)
    with pytest.raises(ValueError) as got:
        getattr(K, name)(*args, **kwargs)
    assert str(got.value) == str(expected.value)
    assert str(got.value).startswith(f"ascend.{name}: ")


def test_missing_library_logs_one_warning_and_falls_back(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(kernels, "__file__", str(tmp_path / "__init__.py"))
    monkeypatch.delenv("ASCEND_PASSES_KERNELS_LIB", raising=False)
    with caplog.at_level(logging.WARNING, logger="ascend_passes.kernels"):
        assert kernels._load.__wrapped__() is False
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "not built" in warnings[0].getMessage()


def test_library_that_does_not_load_logs_one_warning_and_falls_back(monkeypatch, tmp_path, caplog):
    """A half-built library (seen while a rebuild replaced it: undefined symbol) must not break
    ``import ascend_passes``: the ops fall back to the reference with one warning."""
    bad = tmp_path / "_C.broken.so"
    bad.write_bytes(b"not an ELF file")
    monkeypatch.setenv("ASCEND_PASSES_KERNELS_LIB", str(bad))
    with caplog.at_level(logging.WARNING, logger="ascend_passes.kernels"):
        assert kernels._load.__wrapped__() is False
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "do not load" in warnings[0].getMessage(), warnings
    assert str(bad) in warnings[0].getMessage()


FALLBACK_SCRIPT = textwrap.dedent(
    """
    import torch
    import ascend_passes.ops as ops
    assert ops.kernel_backend() == "reference"
    assert not hasattr(torch.ops.ascend_kernels, "grouped_matmul")  # library not loaded
    x = torch.randn(7, 16)
    ids = torch.stack([torch.randperm(8)[:2] for _ in range(7)]).to(torch.int32)
    ex, row_idx, counts, _ = torch.ops.ascend.moe_init_routing_v2(
        x, ids, expert_num=8, expert_tokens_num_type=1, expert_tokens_num_flag=True)
    w = torch.randn(8, 16, 4)
    (y,) = torch.ops.ascend.grouped_matmul([ex], [w], group_list=counts, group_type=0, group_list_type=1)
    out = torch.ops.ascend.moe_finalize_routing(y, None, None, None, None, row_idx, None, 2, 2)
    expected = torch.stack([sum(x[t] @ w[int(ids[t, j])] for j in range(2)) for t in range(7)])
    torch.testing.assert_close(out, expected)
    torch.library.opcheck(torch.ops.ascend.grouped_matmul.default, ([ex], [w]),
                          dict(group_list=counts, group_type=0, group_list_type=1))
    print("reference-ok")
    """
)


def test_environment_forces_reference_fallback():
    env = dict(os.environ, ASCEND_PASSES_KERNELS="reference")
    proc = subprocess.run([sys.executable, "-c", FALLBACK_SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "reference-ok" in proc.stdout


@pytest.mark.parametrize("grad_enabled", [True, False])
def test_grouped_matmul_with_parameter_weights_on_worker_threads(grad_enabled):
    """Regression: BLAS runs on at::parallel_for worker threads, which do not inherit the caller's
    no-autograd state; weights that are nn.Parameters (requires_grad) must not trip mm_out's
    autograd check there."""
    import ascend_passes.ops  # noqa: F401

    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4, 8, 6))
    x = torch.randn(300, 8)
    counts = torch.tensor([100, 100, 50, 50])
    with torch.set_grad_enabled(grad_enabled):
        y = torch.ops.ascend.grouped_matmul([x], [w], group_list=counts, split_item=2, group_type=0, group_list_type=1)[
            0
        ]
    expected = torch.cat([x[:100] @ w[0], x[100:200] @ w[1], x[200:250] @ w[2], x[250:] @ w[3]])
    torch.testing.assert_close(y.detach(), expected.detach(), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- weight-streaming (decode) paths
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 40])
@pytest.mark.parametrize("k", [1, 17, 64, 100])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_against_reference(dtype, rows, k, with_bias):
    """Rows <= 8 take the streaming kernel (every register-block shape of 1..8 rows, K tails that
    are not a multiple of the vector width), more rows the BLAS call."""
    torch.manual_seed(rows * 1000 + k)
    x = torch.randn(rows, k).to(dtype)
    w = (torch.randn(131, k) / math.sqrt(k)).to(dtype)  # 131 rows: blocks of 4 and 3 plus a tail
    b = torch.randn(131).to(dtype) if with_bias else None
    assert_same(K.linear(x, w, b), reference.linear(x, w, b), dtype)


@pytest.mark.parametrize("rows", [9, 192, 193, 400])
@pytest.mark.parametrize("n", [1, 255, 257, 600])
def test_fp32_linear_on_the_own_gemm(monkeypatch, rows, n):
    """fp32 linear of > 8 rows with ASCEND_PASSES_GEMM=own (the default on a CPU not of Intel's, where
    MKL's sgemm is not its tuned one): gemm.h's GEMM over blocks of at most 192 rows (cut equal: 193 rows
    are 97 + 96, 400 are 134 + 133 + 133) x 256 columns split over the threads; row and column block
    edges, K tails of the 128-deep panel, rows of x and w strided, bias added after; against the fp64
    product. The default route on a CPU not of Intel's is this one (bitwise) above 64 rows (9-64 rows: the swap
    kernel, test_swap_gemm.py), on Intel's BLAS."""
    torch.manual_seed(rows * 7 + n)
    for k in (1, 17, 300):
        x = torch.randn(rows, k + 3)[:, :k]
        w = (torch.randn(n, k + 5) / math.sqrt(k))[:, :k]
        b = torch.randn(n)
        want = (x.double() @ w.double().t() + b.double()).float()
        monkeypatch.setenv("ASCEND_PASSES_GEMM", "own")
        own = K.linear(x, w, b)
        torch.testing.assert_close(own, want, rtol=1e-4, atol=1e-4)
        monkeypatch.setenv("ASCEND_PASSES_GEMM", "")
        if cpu_vendor() != "GenuineIntel" and "avx512f" in cpu_flags() and rows > 64:  # 9-64: the swap kernel
            assert torch.equal(K.linear(x, w, b), own)


def test_linear_strided_operands_match_reference():
    x = torch.randn(8, 96)[:, ::2]  # rows 96 apart, columns 2 apart
    w_rows = torch.randn(70, 128)[:, :48]  # rows contiguous, 128 apart: streamed
    w_cols = torch.randn(48, 70).t()  # columns contiguous: BLAS
    for w in (w_rows, w_cols):
        torch.testing.assert_close(K.linear(x, w), x @ w.t(), rtol=1e-5, atol=1e-5)
    assert K.linear(torch.randn(0, 48), w_rows).shape == (0, 70)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("counts", [[1, 0, 0, 0], [0, 3, 0, 8], [8, 8, 8, 8], [9, 1, 0, 2], [2, 0, 1, 1]])
def test_grouped_matmul_decode_schedule_against_reference(dtype, counts):
    """Groups of at most 8 rows are scheduled as whole groups, or column slices of them when there
    are fewer groups than threads (N = 200 columns); a group of 9 rows switches to row chunks."""
    torch.manual_seed(sum(counts))
    group_list = torch.tensor(counts)
    x = torch.randn(int(group_list.sum()) + 2, 40).to(dtype)  # 2 rows no group owns: zero
    w = (torch.randn(4, 200, 40) / 6).transpose(1, 2).to(dtype)  # HF's [E, N, K] storage
    bias = torch.randn(4, 200).to(dtype)
    for act, b in ((0, None), (5, [bias])):
        kw = dict(bias=b, group_list=group_list, group_type=0, group_list_type=1, act_type=act)
        assert_same(K.grouped_matmul([x], [w], **kw), reference.grouped_matmul([x], [w], **kw), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias,act", [(False, 0), (True, 5)])
def test_grouped_matmul_prefill_gemm_against_reference(dtype, with_bias, act):
    """Prefill pieces with the weight's K contiguous take the AVX-512 GEMM where the CPU has it: K=300
    is two full depth blocks of 128 plus 44 (a tail that is not a multiple of 16), N=130 two full
    64-column panels plus 2 (masked), rows in blocks of 6 with tails; a group of 100 rows is cut in
    pieces; groups of <= 8 rows take the streaming kernel."""
    torch.manual_seed(7)
    group_list = torch.tensor([0, 13, 64, 9, 100, 1])
    x = torch.randn(int(group_list.sum()) + 3, 300).to(dtype)
    w = (torch.randn(6, 130, 300) / 17).transpose(1, 2).to(dtype)  # HF's [E, N, K] storage
    bias = [torch.randn(6, 130).to(dtype)] if with_bias else None
    kw = dict(bias=bias, group_list=group_list, group_type=0, group_list_type=1, act_type=act)
    assert_same(K.grouped_matmul([x], [w], **kw), reference.grouped_matmul([x], [w], **kw), dtype)


def test_grouped_matmul_single_matmul_gemm_against_formula():
    x = torch.randn(40, 300)
    w = torch.randn(130, 300).t()  # [K, N] with K contiguous
    (y,) = K.grouped_matmul([x], [w])
    torch.testing.assert_close(y, x @ w, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("isa", ["avx2", "baseline"])
def test_streaming_and_gemm_paths_of_narrower_instruction_sets(isa):
    """The hand-vectorised kernels pick AVX-512, AVX2+FMA or the baseline from the CPU; capped with
    ASCEND_PASSES_ISA, this machine runs the other code paths (the GEMM falls back to BLAS) through
    the same tests as above, in a fresh process (the level is read once)."""
    selection = "linear or decode_schedule or prefill_gemm or single_matmul_gemm or grouped_matmul_against"
    rerun_capped(__file__, selection, isa)


def test_bad_isa_setting_raises_a_clear_error():
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            "import torch, ascend_passes.ops; torch.ops.ascend.linear(torch.randn(2, 4), torch.randn(3, 4))",
        ],
        env={**os.environ, "ASCEND_PASSES_ISA": "sse9"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode != 0
    choices = "amx, avx512_bf16, avx512, avx2, baseline"
    assert f"ValueError: ASCEND_PASSES_ISA must be one of {choices}; got 'sse9'" in run.stderr


def cpu_has_amx_bf16() -> bool:
    return {"amx_bf16", "amx_tile", "avx512_bf16"} <= cpu_flags()


# bf16 prefill pieces (> 8 rows) on a CPU with AMX: torch's bf16 mm, which oneDNN runs on the tile units
# (ONEDNN_VERBOSE names the kernel); capped to avx512: the AVX-512 GEMM, no oneDNN bf16 call. Groups of
# 13, 64 (cut in pieces of 24), 9 and 100 rows take the matrix path, 1 row the streaming kernel; the
# weights are Hugging Face's [E, N, K] storage as transposed views; bias + SiLU run after the product.
AMX_SCRIPT = textwrap.dedent(
    """
    import torch, ascend_passes.ops
    from ascend_passes.ops import reference
    K = torch.ops.ascend_kernels
    torch.manual_seed(7)
    group_list = torch.tensor([0, 13, 64, 9, 100, 1])
    x = torch.randn(190, 300).bfloat16()
    w = (torch.randn(6, 130, 300) / 17).transpose(1, 2).bfloat16()
    bias = torch.randn(6, 130).bfloat16()
    results = []
    for act, b in ((0, None), (5, [bias])):
        kw = dict(bias=b, group_list=group_list, group_type=0, group_list_type=1, act_type=act)
        results.append((K.grouped_matmul([x], [w], **kw)[0], reference.grouped_matmul([x], [w], **kw)[0]))
    single = K.grouped_matmul([x[:40]], [w[2]])[0], reference.grouped_matmul([x[:40]], [w[2]])[0]
    print("MARK-END-OF-KERNELS", flush=True)
    for got, expected in results + [single]:
        torch.testing.assert_close(got.float(), expected.float(), atol=1e-2, rtol=1e-2)
    print("amx-case-ok", flush=True)
    """
)


@pytest.mark.parametrize("isa", ["amx", "avx512"])
def test_bf16_prefill_runs_on_amx_where_the_cpu_has_it(isa):
    """Issue 18 goal 1: bf16 grouped_matmul prefill pieces use the matrix units (AMX, via oneDNN) on a
    CPU that has them, and ASCEND_PASSES_ISA=avx512 caps that off (the AVX-512 GEMM); both paths equal
    the reference within the bf16 tolerance."""
    if not cpu_has_amx_bf16():
        pytest.skip("this CPU lacks amx_bf16/amx_tile/avx512_bf16 (/proc/cpuinfo): no AMX path to run")
    run = subprocess.run(
        [sys.executable, "-c", AMX_SCRIPT],
        capture_output=True,
        text=True,
        timeout=300,
        # blas: torch's bf16 mm (oneDNN) rather than the own tile kernel (test_bf16_amx_tile_kernel_*)
        env={**os.environ, "ASCEND_PASSES_ISA": isa, "ONEDNN_VERBOSE": "1", "ASCEND_PASSES_GEMM": "blas"},
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "amx-case-ok" in run.stdout
    kernels_out = run.stdout.split("MARK-END-OF-KERNELS")[0]
    bf16_calls = [line for line in kernels_out.splitlines() if ",exec," in line and "src:bf16" in line]
    if isa == "amx":
        assert bf16_calls and all("amx" in line for line in bf16_calls), kernels_out[-3000:]
    else:
        assert bf16_calls == [], bf16_calls[:3]


# The own AMX kernel for bf16 prefill pieces with the weight's K contiguous (ASCEND_PASSES_GEMM=own: the
# swapped-operand kernel of kernels/amx_swap.cpp since issue 18's second step; tests/test_amx_swap.py has
# its block edges; this test keeps the edges of the tile kernel's blocking, which the swap kernel shares):
# its edge cases against fp32 products rounded once to bf16 (what it computes: fp32 accumulation, one
# rounding) and the reference. Groups of 8 rows (streaming kernel) and 9 (tile kernel) straddle the row
# threshold; 32, 33 and 70 rows end in a full, a 1-row and a 6-row block of 32; K = 34, 290 (2 x odd),
# 33 (odd) and 2080 are not multiples of the 32-deep tile step (zero-padded copies), and 2080 x 200 packs
# in three chunks of N; N = 50, 130, 200 end in partial 32-column blocks; the weight rows sit ldw > K
# apart (odd ldw: the pair-by-pair packing); bias + SiLU / ReLU are applied in fp32 before the rounding.
# ASCEND_PASSES_GEMM (read per call) forces the tile kernel (own) or oneDNN (blas); the phases are
# marked so that the test can check with ONEDNN_VERBOSE which one ran. Which unit ran shows in a
# denormal probe: the tile units read a denormal bf16 as zero, the AVX-512 FMA path keeps it.
AMX_TILE_SCRIPT = textwrap.dedent(
    """
    import os, torch, ascend_passes.ops
    from ascend_passes.ops import reference
    K = torch.ops.ascend_kernels
    torch.manual_seed(11)
    counts = [8, 9, 0, 32, 33, 70]
    def check(k, n, pad, act, with_bias):
        rows = sum(counts) + 3  # 3 rows no group owns: zeros
        x = torch.randn(rows, k).bfloat16()
        store = (torch.randn(len(counts), n, k + pad) / k**0.5).bfloat16()
        w = store[:, :, :k].transpose(1, 2)  # HF [E, N, K] rows, k + pad apart, as [E, K, N] views
        bias = torch.randn(len(counts), n).bfloat16() if with_bias else None
        kw = dict(bias=[bias] if with_bias else None, group_list=torch.tensor(counts), group_type=0,
                  group_list_type=1, act_type=act)
        got = K.grouped_matmul([x], [w], **kw)[0]
        want = reference.grouped_matmul([x], [w], **kw)[0]
        torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)
        exact, r0 = torch.zeros(rows, n), 0
        for g, c in enumerate(counts):
            v = x[r0:r0 + c].float() @ w[g].float() + (bias[g].float() if with_bias else 0)
            exact[r0:r0 + c] = {0: v, 1: torch.relu(v), 5: torch.nn.functional.silu(v)}[act]
            r0 += c
        if os.environ["ASCEND_PASSES_GEMM"] == "own":  # (oneDNN rounds the product before bias/act)
            # one bf16 rounding of the fp32 result (summation order: at most one ulp more)
            torch.testing.assert_close(got.float(), exact.bfloat16().float(), atol=1e-4, rtol=2 ** -7)
        assert torch.equal(got[-3:], torch.zeros(3, n, dtype=torch.bfloat16))
    def probe():
        tiny = torch.full((9, 64), 1e-39).bfloat16()  # denormal bf16; 64 of them times 1e30: 6.4e-8
        big = torch.full((1, 16, 64), 1e30).bfloat16().transpose(1, 2)  # HF layout
        return K.grouped_matmul([tiny], [big], group_list=torch.tensor([9]), group_type=0,
                                group_list_type=1)[0][0, 0].float().item()
    for route in ("own", "blas"):
        os.environ["ASCEND_PASSES_GEMM"] = route
        print(f"MARK-BEGIN-{route}", flush=True)
        for k, n, pad, act, with_bias in ((64, 96, 0, 0, False), (34, 50, 6, 5, True), (33, 40, 4, 0, False),
                                          (290, 130, 0, 1, True), (2080, 200, 2, 0, False)):
            check(k, n, pad, act, with_bias)
        x, w = torch.randn(40, 70).bfloat16(), torch.randn(33, 70).bfloat16().t()  # no group_list
        torch.testing.assert_close(K.grouped_matmul([x], [w])[0].float(), (x.float() @ w.float()).bfloat16().float(),
                                   atol=1e-4, rtol=2 ** -7)
        value = probe()
        print(f"MARK-END-{route} probe {value:.3e}", flush=True)
    print("amx-tile-ok", flush=True)
    """
)


@pytest.mark.parametrize("isa", ["amx", "avx512"])
def test_bf16_amx_tile_kernel_edge_cases_equal_the_reference(isa):
    """Issue 18 goal 1: bf16 prefill pieces on the own AMX tile kernel (weight packed once per call into the
    tiles' VNNI layout) equal fp32 products rounded once, on every edge of its blocking, and the
    reference; ASCEND_PASSES_GEMM=own runs it, blas runs oneDNN instead; capped at avx512 neither runs (the
    AVX-512 GEMM: no oneDNN bf16 call, denormals kept)."""
    if isa == "amx" and not cpu_has_amx_bf16():
        pytest.skip("this CPU lacks amx_bf16/amx_tile/avx512_bf16 (/proc/cpuinfo): no AMX path to run")
    flags = cpu_flags()
    if isa == "avx512" and not {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        pytest.skip("this CPU lacks AVX-512: the capped path under test is the AVX-512 GEMM")
    run = subprocess.run(
        [sys.executable, "-c", AMX_TILE_SCRIPT],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "ASCEND_PASSES_ISA": isa, "ONEDNN_VERBOSE": "1"},
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "amx-tile-ok" in run.stdout
    for route in ("own", "blas"):
        phase = run.stdout.split(f"MARK-BEGIN-{route}")[1].split(f"MARK-END-{route}")[0]
        # oneDNN bf16 calls of the phase: the reference makes the same ones in both phases
        calls = [line for line in phase.splitlines() if ",exec," in line and "src:bf16" in line]
        probe = float(run.stdout.split(f"MARK-END-{route} probe ")[1].split()[0])
        if route == "own":
            own_calls = len(calls)
        else:
            blas_calls = len(calls)
        if isa == "amx":
            assert probe == 0.0, (route, probe)  # the tile units read the denormal as zero
        else:
            assert probe > 0.0, (route, probe)  # the AVX-512 FMA path keeps it
    if isa == "amx":
        assert blas_calls > own_calls, (own_calls, blas_calls)  # blas: the kernel's pieces go to oneDNN
    else:
        assert blas_calls == own_calls, (own_calls, blas_calls)  # capped: the route setting changes nothing


STALE_SCRIPT = textwrap.dedent("""
    import logging, sys
    import torch
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
    # a kernel the package has no op for: what a library built for other schemas looks like
    extra = torch.library.Library("ascend_kernels", "FRAGMENT")
    extra.define("zz_retired(Tensor x) -> Tensor")
    import ascend_passes.ops as ops
    from ascend_passes import kernels
    print("backend", ops.kernel_backend(), kernels.stale_schemas())
    x, g = torch.randn(3, 8), torch.ones(8)
    y, _ = torch.ops.ascend.rms_norm(x, g, 1e-6)
    torch.testing.assert_close(y, ops.reference.rms_norm(x, g, 1e-6)[0])
    print("ran")
""")


def test_library_built_for_other_schemas_falls_back_instead_of_aborting():
    """A stale library (built before an op's schema changed) used to abort the process while it
    loaded (a static registration against the new schema throws where nothing can catch it); now
    the schemas are compared first and the ops fall back to the reference with one warning."""
    assert kernels.stale_schemas() == []  # the library under test matches the package
    proc = subprocess.run(
        [sys.executable, "-c", STALE_SCRIPT],
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if k != "ASCEND_PASSES_KERNELS"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    warnings = [line for line in lines if line.startswith("WARNING:ascend_passes.kernels")]
    assert len(warnings) == 1 and "were built for other op schemas (zz_retired: not an ascend op)" in warnings[0]
    assert "backend reference ['zz_retired: not an ascend op']" in lines and lines[-1] == "ran"


# bf16 decode (issue 18 goal 3): bf16 x bf16 streaming takes AVX512_BF16 dot products (vdpbf16ps) where
# the CPU has them, the AVX-512F widening FMAs under ASCEND_PASSES_ISA=avx512; bf16 linear of 4-256 rows
# runs the swapped-operand AMX kernel (kernels/amx_swap.h, no oneDNN call) on an AMX CPU, and grouped_matmul
# decode pieces too. Which path ran shows in the result of denormal inputs:
# vdpbf16ps (and the tile units) read a denormal bf16 as zero, the widening FMA path keeps it.
BF16_DECODE_SCRIPT = textwrap.dedent(
    """
    import torch, ascend_passes.ops
    from ascend_passes.ops import reference
    K = torch.ops.ascend_kernels
    torch.manual_seed(3)
    # every row count of the streaming kernel, K tails of the 32- and 16-element steps, a bias
    for rows in (1, 2, 3, 5, 8):
        for k in (17, 100, 1024):
            x = torch.randn(rows, k).bfloat16()
            w = (torch.randn(131, k) / k**0.5).bfloat16()
            b = torch.randn(131).bfloat16()
            got, want = K.linear(x, w, b).float(), reference.linear(x, w, b).float()
            torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
    # grouped_matmul decode schedule: HF's [E, N, K] experts as transposed views, 1..8 rows per group
    group_list = torch.tensor([1, 0, 3, 8, 2])
    x = torch.randn(16, 100).bfloat16()
    w = (torch.randn(5, 200, 100) / 10).transpose(1, 2).bfloat16()
    for act, b in ((0, None), (5, [torch.randn(5, 200).bfloat16()])):
        kw = dict(bias=b, group_list=group_list, group_type=0, group_list_type=1, act_type=act)
        got, want = K.grouped_matmul([x], [w], **kw)[0], reference.grouped_matmul([x], [w], **kw)[0]
        torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)
    tiny = torch.full((8, 64), 1e-39).bfloat16()  # denormal; the sum of 64 of them is a normal float
    ones = torch.ones(16, 64).bfloat16()
    one_row = K.linear(tiny[:1], ones)[0, 0].float().item()
    gmm = K.grouped_matmul([tiny[:1]], [ones.t().unsqueeze(0)], group_list=torch.tensor([1]), group_type=0,
                           group_list_type=1)[0][0, 0].float().item()
    print("MARK-END-OF-STREAM", flush=True)
    eight_rows = K.linear(tiny, ones)[0, 0].float().item()
    print(f"one-row {one_row:.3e} gmm {gmm:.3e} eight-rows {eight_rows:.3e}", flush=True)
    """
)


@pytest.mark.parametrize("isa", ["amx", "avx512"])
def test_bf16_decode_streams_with_bf16_dot_products_where_the_cpu_has_them(isa):
    """bf16 linear and grouped_matmul decode equal the reference within the bf16 tolerance on both
    paths; uncapped on a CPU with avx512_bf16 the stream uses vdpbf16ps (denormal inputs read as 0),
    capped at avx512 the widening FMAs (they add up); with AMX, 8 bf16 rows go to the swapped-operand AMX
    kernel (not oneDNN)."""
    flags = cpu_flags()
    if not {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        pytest.skip("this CPU lacks AVX-512: the bf16 streaming paths under test are AVX-512 ones")
    dot = "avx512_bf16" in flags and isa == "amx"
    amx = cpu_has_amx_bf16() and isa == "amx"
    run = subprocess.run(
        [sys.executable, "-c", BF16_DECODE_SCRIPT],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "ASCEND_PASSES_ISA": isa, "ONEDNN_VERBOSE": "1"},
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rest = run.stdout.split("MARK-END-OF-STREAM")[1]  # before it: the reference's own oneDNN calls
    (line,) = [line for line in rest.splitlines() if line.startswith("one-row ")]
    sums = dict(zip(*[iter(line.split())] * 2))
    denormal_sum = 64 * 1e-39
    for path in ("one-row", "gmm"):
        got = float(sums[path])
        assert got == 0.0 if dot else got == pytest.approx(denormal_sum, rel=0.02), (path, sums)
    bf16_mm = [line for line in rest.splitlines() if ",exec," in line and "bf16" in line]
    if amx:  # 8 rows: the swapped-operand AMX kernel (tile units read denormals as zero too), no oneDNN
        assert bf16_mm == [], rest[-3000:]
        assert float(sums["eight-rows"]) == 0.0
    else:  # 8 rows stream through the widening FMAs
        assert float(sums["eight-rows"]) == pytest.approx(denormal_sum, rel=0.02), sums


# fp32 prefill pieces (> 8 rows, weight K contiguous): the AVX-512 GEMM for K <= 512, MKL's sgemm above
# (kernels/gemm.h, GemmRoute); ASCEND_PASSES_GEMM=own|blas forces one route. MKL_VERBOSE names every
# sgemm call, so the route shows in the output between the markers; every result equals the reference.
GEMM_ROUTE_SCRIPT = textwrap.dedent(
    """
    import os, torch, ascend_passes.ops
    from ascend_passes.ops import reference
    K = torch.ops.ascend_kernels
    torch.manual_seed(3)
    # groups at the streaming kernel's row bound + 1 and above; the 900-row group is cut into pieces of
    # ceil(932 / (4 * 2 threads)) = 117 rows, above swap_gemm's bound (96), so k=513 still reaches MKL
    group_list = torch.tensor([9, 900, 0, 23])
    for k in (512, 513):
        x = torch.randn(int(group_list.sum()), k)
        w = (torch.randn(4, 70, k) / 23).transpose(1, 2)  # HF's [E, N, K] storage
        kw = dict(group_list=group_list, group_type=0, group_list_type=1)
        expected = reference.grouped_matmul([x], [w], **kw)[0]
        for route in ("", "auto", "own", "blas"):
            os.environ["ASCEND_PASSES_GEMM"] = route
            print(f"MARK k={k} route={route or 'unset'}", flush=True)
            got = K.grouped_matmul([x], [w], **kw)[0]
            print("MARK-END", flush=True)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
    # linear of 40 rows (more than the stream's 8): BLAS on Intel's CPUs, the GEMM split over the
    # threads elsewhere (gemm_linear)
    x, w, b = torch.randn(40, 300), torch.randn(70, 300) / 17, torch.randn(70)
    for route in ("", "own", "blas"):
        os.environ["ASCEND_PASSES_GEMM"] = route
        print(f"MARK linear route={route or 'unset'}", flush=True)
        got = K.linear(x, w, b)
        print("MARK-END", flush=True)
        torch.testing.assert_close(got, reference.linear(x, w, b), rtol=1e-5, atol=1e-4)
    os.environ["ASCEND_PASSES_GEMM"] = "fast"
    try:
        K.grouped_matmul([x], [w], **kw)
    except ValueError as e:
        print("bad-route:", e)
    print("gemm-route-ok", flush=True)
    """
)


def test_fp32_prefill_gemm_route_switches_to_blas_above_the_depth_threshold():
    """Issue 18 (fp32 prefill regression): pieces with K <= 512 take the AVX-512 GEMM, deeper ones MKL
    on an Intel CPU (faster there on the AMX Xeon: 85 vs 64-71% of a dense mm at K = 1024), the GEMM on
    others (2.1x MKL at K = 1024 on an AMD EPYC: MKL's sgemm is not its tuned one), as fp32 linear of more
    than 8 rows; both sides of the boundary and both forced routes equal the reference; a bad
    ASCEND_PASSES_GEMM value raises naming the choices."""
    if not torch.backends.mkl.is_available():
        pytest.skip("torch is built without MKL: MKL_VERBOSE cannot show which route ran")
    run = subprocess.run(
        [sys.executable, "-c", GEMM_ROUTE_SCRIPT],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "MKL_VERBOSE": "1", "OMP_NUM_THREADS": "2"},
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "gemm-route-ok" in run.stdout
    assert "ASCEND_PASSES_GEMM must be one of auto, own, blas, stream, swap; got 'fast'" in run.stdout
    sgemm_calls = {}
    for block in run.stdout.split("MARK ")[1:]:
        name, body = block.split("\n", 1)
        sgemm_calls[name] = body.split("MARK-END")[0].count("SGEMM(")
    own_gemm = {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= cpu_flags()
    own_gemm = own_gemm and os.environ.get("ASCEND_PASSES_ISA", "") in ("", "amx", "avx512_bf16", "avx512")
    blas = {k: v > 0 for k, v in sgemm_calls.items()}
    intel = cpu_vendor() == "GenuineIntel"
    if own_gemm:
        # pieces of 9 rows (the streaming kernel takes <= 8) and more go to the GEMM of the route
        assert blas == {
            "k=512 route=unset": False,
            "k=512 route=auto": False,
            "k=512 route=own": False,
            "k=512 route=blas": True,
            # above K = 512 BLAS on Intel's CPUs; elsewhere MKL's sgemm is not its tuned one: the GEMM
            "k=513 route=unset": intel,
            "k=513 route=auto": intel,
            "k=513 route=own": False,
            "k=513 route=blas": True,
            "linear route=unset": intel,
            "linear route=own": False,
            "linear route=blas": True,
        }, sgemm_calls
    else:  # no AVX-512 GEMM here: every route is BLAS
        assert all(blas.values()), sgemm_calls
