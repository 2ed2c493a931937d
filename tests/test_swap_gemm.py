"""grouped_matmul's fp32 swapped-operand kernel (kernels/swap_gemm.cpp: y^T = W x^T on AVX-512 FMAs, x packed
as x^T in pairs of k, 8 rows per vector, chunks of 16 or 24 rows, the weight read in place; issue 18 goal 2)
against fp64 references: every edge of its 12- and 8-row weight blocks, 8-row groups and chunks, odd K,
strided weights, bias/activation, skewed and empty groups, the next-weight prefetch, the route rule
(MKL_VERBOSE shows which pieces went to BLAS) and the same results with the instruction set capped below
AVX-512."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from _gemm_cases import TOL, UNCAPPED, grouped_reference, hf_weight
from _helpers import cpu_vendor, skip_unless

from ascend_passes import kernels

skip_unless(kernels.available(), "C++ kernels not built or disabled", allow_module_level=True)

K = torch.ops.ascend_kernels if kernels.available() else None


# rows: one 8-row group (1..8), one chunk of two (9..16), of three (17..24: 8-row weight blocks), two chunks
# (25..32), three and two (33..40), and each edge between; columns: each remainder of the 12- and 8-row weight
# blocks; depths: one k, odd and even tails of a pair, below, at and past a 16-step of K
@pytest.mark.parametrize("m", [1, 7, 8, 9, 16, 17, 23, 24, 25, 32, 33, 40, 41, 48, 49, 97])
@pytest.mark.parametrize("n,k", [(1, 1), (7, 3), (8, 2), (9, 33), (11, 15), (12, 16), (13, 17), (25, 100), (70, 1030)])
def test_swap_piece_edges_against_fp64(gemm_route, m, n, k):
    torch.manual_seed(m * 1000 + n + k)
    gemm_route("swap")
    x = torch.randn(m, k)
    w = hf_weight(1, n, k)[0]
    got = K.grouped_matmul([x], [w])[0]
    torch.testing.assert_close(got, (x.double() @ w.double()).float(), **TOL)


def test_swap_strided_weight_bias_silu_and_empty_groups(gemm_route):
    """Weight rows further apart than K, bias and SiLU after the product, empty groups between skewed
    pieces of 9..90 rows, rows no group owns (zeros), for the swap route and the rule."""
    torch.manual_seed(5)
    counts = [0, 13, 90, 0, 40, 1, 24, 0, 61]
    e, n, k = len(counts), 37, 300
    x = torch.randn(sum(counts) + 3, k)
    w = hf_weight(e, n, k, pad=21)
    assert w.stride(1) == 1 and w.stride(2) == k + 21
    bias = torch.randn(e, n)
    expected = grouped_reference(x, w, counts, bias, act=5)
    kw = dict(group_list=torch.tensor(counts), group_type=0, group_list_type=1, act_type=5)
    for route in ("swap", "auto"):
        gemm_route(route)
        got = K.grouped_matmul([x], [w], bias=[bias], **kw)[0]
        torch.testing.assert_close(got[: sum(counts)], expected, **TOL)
        assert torch.equal(got[sum(counts) :], torch.zeros(3, n))


def test_swap_next_weight_prefetch_across_groups(gemm_route):
    """Many groups (the prefill schedule prefetches the next group's weight under this one's last block),
    weights of 13 rows (one full and one 1-row block) at K = 1024 and K = 7 (shallower than one prefetch
    step): equal to fp64."""
    torch.manual_seed(6)
    gemm_route("swap")
    counts = [12, 30, 9, 25, 16, 0, 21, 33]
    for k in (1024, 7):
        x = torch.randn(sum(counts), k)
        w = hf_weight(len(counts), 13, k)
        got = K.grouped_matmul([x], [w], group_list=torch.tensor(counts), group_type=0, group_list_type=1)[0]
        torch.testing.assert_close(got, grouped_reference(x, w, counts), **TOL)


def test_swap_nan_and_inf_rows_stay_in_their_rows(gemm_route):
    """A NaN in one row of x and an Inf in another reach only their own output rows (the zero padding of
    the last chunk and the transposes mix no rows)."""
    gemm_route("swap")
    torch.manual_seed(7)
    x = torch.randn(21, 64)
    x[3, 5] = float("nan")
    x[18, 0] = float("inf")
    w = hf_weight(1, 14, 64)[0].abs() + 0.1  # positive: the Inf row stays +Inf
    got = K.grouped_matmul([x], [w])[0]
    assert got[3].isnan().all() and got[18].isinf().all()
    rest = [r for r in range(21) if r not in (3, 18)]
    torch.testing.assert_close(got[rest], (x[rest].double() @ w.double()).float(), **TOL)


# which pieces the default rule (and each forced route) sends to MKL: MKL_VERBOSE prints every SGEMM call
ROUTE_SCRIPT = textwrap.dedent(
    """
    import os, torch
    from ascend_passes import kernels
    assert kernels.available()
    K = torch.ops.ascend_kernels
    torch.manual_seed(0)
    for k, m in ((1024, 96), (1024, 97), (256, 64), (256, 65), (1024, 12)):
        x = torch.randn(m, k)
        w = (torch.randn(70, k) / k ** 0.5).t()
        for route in ("auto", "swap", "blas"):
            os.environ["ASCEND_PASSES_GEMM"] = route
            print(f"MARK k={k} m={m} route={route}", flush=True)
            got = K.grouped_matmul([x], [w])[0]
            print("MARK-END", flush=True)
            torch.testing.assert_close(got, (x.double() @ w.double()).float(), rtol=1e-5, atol=1e-4)
    print("routes-ok", flush=True)
    """
)


def test_swap_route_rule_and_forced_route():
    """kAuto: K > 512 pieces of 9..96 rows take the swap kernel (no SGEMM), 97 rows go to MKL (on Intel's
    CPUs; the packing kernel elsewhere); K <= 512
    pieces up to 64 rows too, 65 rows go to the packing kernel (no SGEMM either); swap never calls MKL,
    blas always; without AVX-512 (or capped below it) every route is MKL."""
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
        for shape in ("k=1024 m=96", "k=1024 m=97", "k=256 m=64", "k=256 m=65", "k=1024 m=12"):
            assert not blas[f"{shape} route=swap"] and blas[f"{shape} route=blas"], blas
        # 97 rows: MKL on Intel's CPUs; elsewhere MKL's sgemm is not its tuned one: gemm.h's GEMM
        assert not blas["k=1024 m=96 route=auto"] and blas["k=1024 m=97 route=auto"] == (cpu_vendor() == "GenuineIntel")
        assert not blas["k=256 m=64 route=auto"] and not blas["k=256 m=65 route=auto"], blas
        assert not blas["k=1024 m=12 route=auto"], blas  # the swap kernel from 9 rows
    else:
        assert all(blas.values()), blas


CAPPED_SCRIPT = textwrap.dedent(
    """
    import os, sys, torch
    from ascend_passes import kernels
    assert kernels.available()
    K = torch.ops.ascend_kernels
    torch.manual_seed(1)
    counts = [17, 0, 40, 13, 96, 5]
    x = torch.randn(sum(counts), 1000)
    w = (torch.randn(len(counts), 29, 1000) / 32).transpose(1, 2)
    os.environ["ASCEND_PASSES_GEMM"] = "swap"
    y = K.grouped_matmul([x], [w], group_list=torch.tensor(counts), group_type=0, group_list_type=1)[0]
    torch.save(dict(x=x, w=w, y=y), sys.argv[1])
    """
)


def test_swap_capped_and_uncapped_agree(tmp_path, gemm_route):
    """The same grouped call (ASCEND_PASSES_GEMM=swap) with ASCEND_PASSES_ISA=avx2 in a subprocess (MKL: the
    swap kernel is AVX-512 only) and here, uncapped: both equal fp64 and each other."""
    out = tmp_path / "capped.pt"
    env = {**os.environ, "ASCEND_PASSES_ISA": "avx2", "OMP_NUM_THREADS": "2"}
    run = subprocess.run(
        [sys.executable, "-c", CAPPED_SCRIPT, str(out)], capture_output=True, text=True, timeout=300, env=env
    )
    assert run.returncode == 0, run.stderr[-3000:]
    capped = torch.load(out)
    x, w, counts = capped["x"], capped["w"], [17, 0, 40, 13, 96, 5]
    gemm_route("swap")
    here = K.grouped_matmul([x], [w], group_list=torch.tensor(counts), group_type=0, group_list_type=1)[0]
    expected = grouped_reference(x, w, counts)
    torch.testing.assert_close(capped["y"], expected, **TOL)
    torch.testing.assert_close(here, expected, **TOL)
    torch.testing.assert_close(here, capped["y"], **TOL)


@pytest.mark.parametrize("m", [9, 12, 13])
def test_the_rule_takes_pieces_from_nine_rows(gemm_route, m):
    """kAuto gives a piece of 9-12 rows (the stream kernel's until session 14) to the swap kernel: the rule's
    bits are the forced swap kernel's, which differ from the forced stream kernel's (another summation
    order) on this input."""
    torch.manual_seed(m)
    x, w = torch.randn(m, 1030), hf_weight(1, 70, 1030)[0]
    results = {}
    for route in ("swap", "stream", ""):
        gemm_route(route)
        results[route or "auto"] = K.grouped_matmul([x], [w])[0]
    torch.testing.assert_close(results["swap"], (x.double() @ w.double()).float(), **TOL)
    if UNCAPPED:
        assert not torch.equal(results["swap"], results["stream"])
        assert torch.equal(results["auto"], results["swap"])


@pytest.mark.parametrize("m", [9, 17, 24, 41, 64, 65])
@pytest.mark.parametrize("n,k", [(1, 3), (25, 100), (70, 1030), (600, 64)])
def test_fp32_linear_on_the_swap_kernel(gemm_route, m, n, k):
    """ascend.linear of 9-64 fp32 rows on the swapped-operand kernel, the weight's rows split over the threads
    (kernels/linear.cpp swap_linear_cpu): forced (ASCEND_PASSES_GEMM=swap, any row count) it equals the fp64
    product, bias added after; by the rule on a CPU not of Intel's with AVX-512 it is the forced kernel's result
    bit for bit up to 64 rows and the packing GEMM's (ASCEND_PASSES_GEMM=own) at 65; strided rows of x and w."""
    torch.manual_seed(m * 100 + n + k)
    x = torch.randn(m, k + 3)[:, :k]
    w = (torch.randn(n, k + 5) / k**0.5)[:, :k]
    b = torch.randn(n)
    gemm_route("swap")
    swap = K.linear(x, w, b)
    torch.testing.assert_close(swap, (x.double() @ w.double().t() + b.double()).float(), **TOL)
    gemm_route("own")
    own = K.linear(x, w, b)
    gemm_route("")
    rule = K.linear(x, w, b)
    if UNCAPPED and cpu_vendor() != "GenuineIntel":
        assert torch.equal(rule, swap if m <= 64 else own)


@pytest.mark.parametrize("m,n,k", [(8, 512, 1024), (8, 520, 1030), (8, 256, 1024), (7, 512, 1024)])
def test_fp32_decode_linear_of_eight_rows(gemm_route, m, n, k):
    """An fp32 linear of at most 8 rows (a decode batch) takes the weight stream by the rule at every weight size
    (session 15 sent 8-row weights of >= 2^19 elements to the swapped-operand kernel; the stream beats it since its
    x loads stopped being folded into every FMA, kernels/linear.cpp); ASCEND_PASSES_GEMM=swap / stream force either
    at 8 rows. Each forced result equals the fp64 product; the two differ in their bits (another summation order),
    so the rule's bits say which kernel it took."""
    torch.manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k + 3)[:, :k]
    w = torch.randn(n, k) / k**0.5
    b = torch.randn(n)
    expected = (x.double() @ w.double().t() + b.double()).float()
    results = {}
    for route in ("swap", "stream", ""):
        gemm_route(route)
        results[route or "auto"] = K.linear(x, w, b)
    torch.testing.assert_close(results["stream"], expected, **TOL)
    if m == 8:
        torch.testing.assert_close(results["swap"], expected, **TOL)
    if UNCAPPED:
        if m == 8:
            assert not torch.equal(results["swap"], results["stream"])
        assert torch.equal(results["auto"], results["stream"])
