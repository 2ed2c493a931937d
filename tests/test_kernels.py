"""The C++ CPU kernels (torch.ops.ascend_kernels.*) against the reference implementations, the
registration contract between them, and the fallback when the kernels are absent or disabled."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import ascend_passes.ops as ops
from ascend_passes import kernels
from ascend_passes.ops import reference

pytestmark = pytest.mark.skipif(not kernels.available(), reason="C++ kernels not built or disabled")

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
    kw = dict(scale=scale, expert_num=64, expert_tokens_num_type=count_type, expert_tokens_num_flag=True,
              active_expert_range=rng, row_idx_type=row_idx_type)
    got, expected = K.moe_init_routing_v2(x, ids, **kw), reference.moe_init_routing_v2(x, ids, **kw)
    for g, e in zip(got, expected):
        assert torch.equal(g, e)
    truncated = dict(kw, active_num=1000)  # fewer output rows than pairs
    for g, e in zip(K.moe_init_routing_v2(x, ids, **truncated), reference.moe_init_routing_v2(x, ids, **truncated)):
        assert torch.equal(g, e)


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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", [0, 2])
def test_finalize_routing_against_reference(dtype, mode):
    n, k, h, e = 129, 6, 256, 64
    rows = torch.randn(n * k, h).to(dtype)
    dst = torch.randperm(n * k).to(torch.int32)
    dst[::7] = -1
    args = (rows, torch.randn(n, h).to(dtype), None, torch.randn(e, h).to(dtype), torch.rand(n, k),
            dst, torch.randint(0, e, (n, k), dtype=torch.int32), mode, k)
    assert_same(K.moe_finalize_routing(*args), reference.moe_finalize_routing(*args), dtype)


def test_missing_library_logs_one_warning_and_falls_back(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(kernels, "__file__", str(tmp_path / "__init__.py"))
    with caplog.at_level(logging.WARNING, logger="ascend_passes.kernels"):
        assert kernels._load.__wrapped__() is False
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "not built" in warnings[0].getMessage()


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
    proc = subprocess.run([sys.executable, "-c", FALLBACK_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=120)
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
        y = torch.ops.ascend.grouped_matmul([x], [w], group_list=counts, split_item=2, group_type=0,
                                            group_list_type=1)[0]
    expected = torch.cat([x[:100] @ w[0], x[100:200] @ w[1], x[200:250] @ w[2], x[250:] @ w[3]])
    torch.testing.assert_close(y.detach(), expected.detach(), rtol=1e-5, atol=1e-5)
