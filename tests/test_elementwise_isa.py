"""The row kernels outside the GEMMs (rms_norm, add_rms_norm, swiglu, moe_finalize_routing) on each
instruction set: AVX-512 builds picked from the CPU's feature bits and the AVX2 / baseline clones
under ``ASCEND_PASSES_ISA``, all against the reference, on widths that leave a vector tail, rows
fewer than the threads, and finalize's dropped pairs, biases and skips."""

from __future__ import annotations

import os

import pytest
import torch
from _helpers import rerun_capped, skip_unless

from ascend_passes import kernels
from ascend_passes.ops import reference

skip_unless(kernels.available(), "C++ kernels not built or disabled", allow_module_level=True)

K = torch.ops.ascend_kernels if kernels.available() else None
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: 2e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def assert_close(got, expected, dtype):
    for g, e in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(expected)):
        assert g.dtype == e.dtype and g.shape == e.shape
        torch.testing.assert_close(g.float(), e.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, width", [(1, 7), (1, 1031), (3, 16), (37, 1024 + 9)])
def test_norms_and_swiglu_equal_the_reference(dtype, rows, width):
    g = torch.Generator().manual_seed(rows * 10007 + width)
    x = torch.randn(rows, width, generator=g).to(dtype)
    r = torch.randn(rows, width, generator=g).to(dtype)
    gamma = torch.rand(width, generator=g).to(dtype)
    assert_close(K.rms_norm(x, gamma, 1e-6), reference.rms_norm(x, gamma, 1e-6), dtype)
    assert_close(K.add_rms_norm(x, r, gamma, 1e-6), reference.add_rms_norm(x, r, gamma, 1e-6), dtype)
    both = torch.cat([x, r], -1)
    assert_close(K.swiglu(both, -1), reference.swiglu(both, -1), dtype)
    assert_close(K.swiglu(both.t().contiguous(), 0), reference.swiglu(both.t().contiguous(), 0), dtype)


def test_swiglu_keeps_torch_silu_at_infinities_and_nan():
    a = torch.tensor([float("-inf"), float("inf"), float("nan"), -100.0, 100.0, 0.0] * 5)
    b = torch.ones_like(a)
    got = K.swiglu(torch.cat([a, b]).view(1, -1), -1)[0]
    torch.testing.assert_close(got, torch.nn.functional.silu(a) * b, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [5, 1024 + 3])
def test_finalize_routing_equals_the_reference(dtype, hidden):
    g = torch.Generator().manual_seed(hidden)
    tokens, k, experts = 3, 4, 6
    ids = torch.randint(0, experts, (tokens, k), generator=g, dtype=torch.int32)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    # experts [1, 5) only: the pairs of experts 0 and 5 are dropped (-1 in the map)
    rows, src_to_dst, _, _ = K.moe_init_routing_v2(
        x, ids, expert_num=experts, expert_tokens_num_type=1, expert_tokens_num_flag=True, active_expert_range=[1, 5]
    )
    assert (src_to_dst < 0).any()
    expanded = torch.randn(rows.shape, generator=g).to(dtype)
    scales = torch.rand(tokens, k, generator=g)
    skip1, skip2 = (torch.randn(tokens, hidden, generator=g).to(dtype) for _ in range(2))
    bias = torch.randn(experts, hidden, generator=g).to(dtype)
    args = (expanded, skip1, skip2, bias, scales, src_to_dst, ids, 0, k)
    assert_close(K.moe_finalize_routing(*args), reference.moe_finalize_routing(*args), dtype)
    plain = (expanded, None, None, None, None, src_to_dst, None, 0, k)
    assert_close(K.moe_finalize_routing(*plain), reference.moe_finalize_routing(*plain), dtype)


@pytest.mark.parametrize("isa", ["avx2", "baseline"])
def test_narrower_instruction_sets(isa):
    """The same tests in a fresh process with ``ASCEND_PASSES_ISA`` capped (the level is read once)."""
    if os.environ.get("ASCEND_PASSES_ISA"):
        pytest.skip("already capped")
    rerun_capped(__file__, "not narrower", isa)
