"""grouped_matmul's fp32 small-piece kernel (kernels/stream_gemm.cpp: dot products along K over the
weight as stored, no packing; issue 18 goal 2) against fp64 references: every edge of its 4 x 4 register
blocks, K tails, strided weights, bias/activation, empty groups, the route rule (MKL_VERBOSE shows which
pieces went to BLAS) and the same results with the instruction set capped below AVX-512."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from _gemm_cases import TOL, UNCAPPED, grouped_reference, hf_weight
from _helpers import skip_unless

from ascend_passes import kernels

skip_unless(kernels.available(), "C++ kernels not built or disabled", allow_module_level=True)

K = torch.ops.ascend_kernels if kernels.available() else None


# rows: each remainder of the 4-row blocks below and above 8 (the decode kernel's bound); columns: each
# remainder of the 4-row weight blocks; depths: below, at and past a 16-lane step
@pytest.mark.parametrize("m", [9, 10, 11, 12, 13, 24, 47])
@pytest.mark.parametrize("n,k", [(1, 1), (3, 17), (6, 16), (70, 100), (33, 1030)])
def test_stream_piece_edges_against_fp64(gemm_route, m, n, k):
    torch.manual_seed(m * 1000 + n + k)
    gemm_route("stream")
    x = torch.randn(m, k)
    w = hf_weight(1, n, k)[0]
    got = K.grouped_matmul([x], [w])[0]
    torch.testing.assert_close(got, (x.double() @ w.double()).float(), **TOL)


def test_stream_strided_weight_bias_silu_and_empty_groups(gemm_route):
    """Weight rows further apart than K (a slice of a wider tensor), bias and SiLU after the product,
    groups of 0 rows between pieces of 9..40 rows, rows no group owns (zeros), for every fp32 route."""
    torch.manual_seed(5)
    counts = [0, 9, 17, 0, 40, 24, 0]
    e, n, k = len(counts), 37, 300
    x = torch.randn(sum(counts) + 3, k)
    w = hf_weight(e, n, k, pad=21)
    assert w.stride(1) == 1 and w.stride(2) == k + 21
    bias = torch.randn(e, n)
    expected = grouped_reference(x, w, counts, bias, act=5)
    kw = dict(group_list=torch.tensor(counts), group_type=0, group_list_type=1, act_type=5)
    for route in ("stream", "auto", "own", "blas"):
        gemm_route(route)
        got = K.grouped_matmul([x], [w], bias=[bias], **kw)[0]
        torch.testing.assert_close(got[: sum(counts)], expected, **TOL)
        assert torch.equal(got[sum(counts) :], torch.zeros(3, n))


def test_stream_next_weight_prefetch_across_groups(gemm_route):
    """Many groups of few rows (the prefill schedule prefetches the next group's weight past the last
    rows of this one): exact against fp64 whether the next weight is wider, narrower or the same."""
    torch.manual_seed(6)
    gemm_route("stream")
    counts = [12, 30, 9, 25, 16, 0, 21]
    x = torch.randn(sum(counts), 1024)
    w = hf_weight(len(counts), 13, 1024)
    got = K.grouped_matmul([x], [w], group_list=torch.tensor(counts), group_type=0, group_list_type=1)[0]
    torch.testing.assert_close(got, grouped_reference(x, w, counts), **TOL)


# which pieces the default rule (and each forced route) sends to MKL: MKL_VERBOSE prints every SGEMM call
ROUTE_SCRIPT = textwrap.dedent(
    """
    import os, torch
    from ascend_passes import kernels
    assert kernels.available()
    K = torch.ops.ascend_kernels
    torch.manual_seed(0)
    for k, m in ((1024, 48), (1024, 49), (256, 24), (256, 25)):
        x = torch.randn(m, k)
        w = (torch.randn(70, k) / k ** 0.5).t()
        for route in ("auto", "stream", "own", "blas"):
            os.environ["ASCEND_PASSES_GEMM"] = route
            print(f"MARK k={k} m={m} route={route}", flush=True)
            got = K.grouped_matmul([x], [w])[0]
            print("MARK-END", flush=True)
            torch.testing.assert_close(got, (x.double() @ w.double()).float(), rtol=1e-5, atol=1e-4)
    print("routes-ok", flush=True)
    """
)


def test_stream_route_rule_and_forced_routes():
    """kAuto: K > 512 pieces of 9..48 rows run an own kernel (no SGEMM), 49 rows too (swap_gemm); K <= 512
    pieces of 24 and 25 rows likewise; stream / own never call MKL, blas always; without AVX-512 (or capped
    below it) every route is MKL."""
    if not torch.backends.mkl.is_available():
        pytest.skip("torch is built without MKL: MKL_VERBOSE cannot show which route ran")
    run = subprocess.run(
        [sys.executable, "-c", ROUTE_SCRIPT],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "MKL_VERBOSE": "1", "OMP_NUM_THREADS": "1"},
    )
    assert run.returncode == 0 and "routes-ok" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
    blas = {}
    for block in run.stdout.split("MARK ")[1:]:
        name, body = block.split("\n", 1)
        blas[name] = body.split("MARK-END")[0].count("SGEMM(") > 0
    if UNCAPPED:
        for shape in ("k=1024 m=48", "k=1024 m=49", "k=256 m=24", "k=256 m=25"):
            assert not blas[f"{shape} route=stream"] and not blas[f"{shape} route=own"], blas
            assert blas[f"{shape} route=blas"], blas
        # 49 rows: past the stream's bound, swap_gemm's (test_swap_gemm.py) since issue 18's session 9
        assert not blas["k=1024 m=48 route=auto"] and not blas["k=1024 m=49 route=auto"], blas
        assert not blas["k=256 m=24 route=auto"] and not blas["k=256 m=25 route=auto"], blas
    else:
        assert all(blas.values()), blas


CAPPED_SCRIPT = textwrap.dedent(
    """
    import os, sys, torch
    from ascend_passes import kernels
    assert kernels.available()
    K = torch.ops.ascend_kernels
    torch.manual_seed(1)
    counts = [9, 0, 24, 13, 32, 5]
    x = torch.randn(sum(counts), 1000)
    w = (torch.randn(len(counts), 19, 1000) / 32).transpose(1, 2)
    os.environ["ASCEND_PASSES_GEMM"] = "stream"
    y = K.grouped_matmul([x], [w], group_list=torch.tensor(counts), group_type=0, group_list_type=1)[0]
    torch.save(dict(x=x, w=w, y=y), sys.argv[1])
    """
)


def test_stream_capped_and_uncapped_agree(tmp_path, gemm_route):
    """The same grouped call (ASCEND_PASSES_GEMM=stream) with ASCEND_PASSES_ISA=avx2 in a subprocess (MKL:
    the stream kernel is AVX-512 only) and here, uncapped (the stream kernel where the CPU has AVX-512):
    both equal fp64 and each other."""
    out = tmp_path / "capped.pt"
    env = {**os.environ, "ASCEND_PASSES_ISA": "avx2", "OMP_NUM_THREADS": "2"}
    run = subprocess.run(
        [sys.executable, "-c", CAPPED_SCRIPT, str(out)], capture_output=True, text=True, timeout=300, env=env
    )
    assert run.returncode == 0, run.stderr[-3000:]
    capped = torch.load(out)
    x, w, counts = capped["x"], capped["w"], [9, 0, 24, 13, 32, 5]
    gemm_route("stream")
    here = K.grouped_matmul([x], [w], group_list=torch.tensor(counts), group_type=0, group_list_type=1)[0]
    expected = grouped_reference(x, w, counts)
    torch.testing.assert_close(capped["y"], expected, **TOL)
    torch.testing.assert_close(here, expected, **TOL)
    torch.testing.assert_close(here, capped["y"], **TOL)
