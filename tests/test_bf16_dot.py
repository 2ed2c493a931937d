"""The AVX512_BF16 kernels of bf16 prefill pieces on a CPU with avx512_bf16 but no AMX (Zen 4/5, Cooper Lake):
since session 14 swap_gemm.h's swapped-operand kernel (``swap_dp_nt``: x^T packed in pairs of bf16 pairs, the
weight read in place, vdpbf16ps) takes the pieces of 9-128 rows of ``grouped_matmul`` with an even K, gemm.h's
GEMM (``gemm_dp_nt``, vdpbf16ps on packed panels of bf16 pairs) only where forced
(``ASCEND_PASSES_BF16_KERNEL=dot``), larger pieces and odd K go to oneDNN. Run in a fresh process under
``ASCEND_PASSES_ISA=avx512_bf16``, which is that CPU's default level and, on a CPU with AMX, caps it to run
these paths too.

Which kernel ran shows three ways: ``ONEDNN_VERBOSE`` lists oneDNN's bf16 calls (none for the own kernels'
pieces, where the products are computed in fp32 only), a denormal probe (vdpbf16ps reads a denormal bf16 as
zero; the widened AVX-512 FMA GEMM, ``ASCEND_PASSES_GEMM=own``, keeps it), and the bits: the rule's result is
the forced swap kernel's, not the forced dot kernel's (another summation order)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from _helpers import cpu_flags

SCRIPT = textwrap.dedent(
    """
    import os, torch, ascend_passes.ops
    K = torch.ops.ascend_kernels
    torch.manual_seed(3)
    counts = [8, 9, 10, 11, 12, 13, 0, 40, 70]  # 8: the stream; 9-13: every tail of the 6-row block
    def check(k, n, pad, act, with_bias, off=0):
        rows = sum(counts) + 2  # 2 rows no group owns: zeros
        x = torch.randn(rows, k).bfloat16()
        store = (torch.randn(len(counts), n, k + pad) / k**0.5).bfloat16()
        w = store[:, :, off:off + k].transpose(1, 2)  # HF [E, N, K] rows, k + pad apart, as [E, K, N] views
        bias = torch.randn(len(counts), n).bfloat16() if with_bias else None
        kw = dict(bias=[bias] if with_bias else None, group_list=torch.tensor(counts), group_type=0,
                  group_list_type=1, act_type=act)
        got = K.grouped_matmul([x], [w], **kw)[0]
        exact, r0 = torch.zeros(rows, n), 0
        for g, c in enumerate(counts):
            v = x[r0:r0 + c].float() @ w[g].float() + (bias[g].float() if with_bias else 0)
            exact[r0:r0 + c] = {0: v, 1: torch.relu(v), 5: torch.nn.functional.silu(v)}[act]
            r0 += c
        # fp32 sums rounded once to bf16 (another summation order: at most one ulp more); oneDNN rounds
        # the product to bf16 before the bias and activation: once more
        tol = dict(atol=1e-4, rtol=2 ** -7) if once else dict(atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(got.float(), exact.bfloat16().float(), **tol)
        assert torch.equal(got[-2:], torch.zeros(2, n, dtype=torch.bfloat16))
    def probe():  # one 9-row product (a group_list would cut 9 rows into pieces the stream takes)
        tiny = torch.full((9, 64), 1e-39).bfloat16()  # denormal bf16; 64 of them times 1e30: 6.4e-8
        big = torch.full((16, 64), 1e30).bfloat16().t()  # HF layout
        return K.grouped_matmul([tiny], [big])[0][0, 0].float().item()
    def phase(name, cases, single_rows=40):
        global once
        once = name in ("rule", "swap", "dot", "own")
        print(f"MARK-BEGIN-{name}", flush=True)
        for case in cases:
            check(*case)
        x, w = torch.randn(single_rows, 70).bfloat16(), torch.randn(33, 70).bfloat16().t()  # no group_list
        torch.testing.assert_close(K.grouped_matmul([x], [w])[0].float(), (x.float() @ w.float()).bfloat16().float(),
                                   atol=1e-4, rtol=2 ** -7)
        print(f"MARK-END-{name} probe {probe():.3e}", flush=True)
    # K = 2 (one pair), 34 (a scalar pair tail), 290 (16-pair blocks + 1), 2082 (5 panels deep: 512-deep
    # blocks accumulate, then a 34-deep tail); N = 1, 50, 96, 130, 200 (partial 8-, 12-, 16- and 64-column
    # blocks); weight rows 6 / 2 / 0 elements past K (even strides), one weight starting at an odd element (its
    # pairs unaligned); bias and SiLU / ReLU in fp32 before the rounding; the pieces 8 (the stream), 9-13, 40
    # and 70 rows (one, two and odd numbers of the swap kernel's 8-row groups)
    even = ((2, 1, 0, 0, False), (64, 96, 0, 0, False), (34, 50, 6, 5, True), (290, 130, 0, 1, True),
            (2082, 200, 2, 0, False), (34, 40, 6, 0, True, 1))
    phase("rule", even + ((64, 40, 1, 0, True),))  # an odd weight row stride: pairs read unaligned
    phase("big", (), single_rows=200)  # one 200-row product: oneDNN (more than 128 rows)
    phase("odd", ((33, 40, 4, 0, False),))  # an odd K cannot be read as pairs: oneDNN
    for forced in ("swap", "dot", "onednn"):
        os.environ["ASCEND_PASSES_BF16_KERNEL"] = forced
        phase(forced, even[:3] if forced == "onednn" else even)
    os.environ["ASCEND_PASSES_BF16_KERNEL"] = ""
    os.environ["ASCEND_PASSES_GEMM"] = "own"
    phase("own", even[:3])  # the widened AVX-512 fp32 GEMM
    os.environ["ASCEND_PASSES_GEMM"] = ""
    x, w = torch.randn(24, 1030).bfloat16(), (torch.randn(512, 1030) / 32).bfloat16().t()
    bits = {}
    for forced in ("", "swap", "dot"):
        os.environ["ASCEND_PASSES_BF16_KERNEL"] = forced
        bits[forced or "rule"] = K.grouped_matmul([x], [w])[0]
    os.environ["ASCEND_PASSES_BF16_KERNEL"] = ""
    print("WHICH", torch.equal(bits["rule"], bits["swap"]), torch.equal(bits["rule"], bits["dot"]), flush=True)
    # ascend.linear: 9-64 rows on the swap kernel (the weight's rows split over the threads), 65 on oneDNN
    for m in (9, 24, 64, 65):
        x, b = torch.randn(m, 130).bfloat16(), torch.randn(70).bfloat16()
        w = (torch.randn(70, 136) / 12).bfloat16()[:, :130]  # rows 136 apart
        print(f"MARK-BEGIN-linear{m}", flush=True)
        got = K.linear(x, w, b)
        print(f"MARK-END-linear{m} probe 0", flush=True)
        tol = dict(atol=1e-4, rtol=2 ** -7) if m <= 64 else dict(atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(got.float(), (x.float() @ w.float().t() + b.float()).bfloat16().float(), **tol)
        os.environ["ASCEND_PASSES_BF16_KERNEL"] = "swap"
        print("LINEAR", m, torch.equal(got, K.linear(x, w, b)), flush=True)
        os.environ["ASCEND_PASSES_BF16_KERNEL"] = ""
    # ASCEND_PASSES_BF16_KERNEL=swap forces the swap kernel at any row count, the stream's 1-8 too (x^T padded). Which
    # kernel ran shows in the bits of an exactly cancelling product (x . w = 0: what is left is each summation order's
    # rounding): the forced rows equal the rows of a 9-row product (the swap kernel by the rule; a row's sums do not
    # depend on the other rows) and differ from the stream's
    v, u = torch.randn(9, 515), torch.randn(70, 515)
    x = torch.cat([v, -v.roll(1, 1)], 1).bfloat16()
    w = torch.cat([u, u.roll(1, 1)], 1).bfloat16()
    by_rule = K.linear(x, w, None)
    for m in (1, 3, 8):
        stream = K.linear(x[:m], w, None)
        os.environ["ASCEND_PASSES_BF16_KERNEL"] = "swap"
        forced = K.linear(x[:m], w, None)
        os.environ["ASCEND_PASSES_BF16_KERNEL"] = ""
        print("FORCED", m, torch.equal(forced, by_rule[:m]), torch.equal(forced, stream), flush=True)
        assert forced.abs().max().item() < 1e-3  # the product is 0 but for rounding
    print("bf16-dot-ok", flush=True)
    """
)


def test_bf16_dot_kernels_edges_routes_and_which_unit_ran():
    """The swap and dot kernels equal fp32 products rounded once on every edge of their blocking; by the rule,
    pieces of up to 128 rows take the swap kernel (no oneDNN call, denormals read as zero, the forced swap
    kernel's bits, not the dot kernel's), a 200-row product, an odd K and ASCEND_PASSES_BF16_KERNEL=onednn
    take oneDNN, ASCEND_PASSES_GEMM=own the widened GEMM (no oneDNN call, denormals kept); ascend.linear of
    9-64 rows runs the swap kernel (no oneDNN call, the forced kernel's bits, one rounding), 65 rows oneDNN;
    forced, the swap kernel takes 1-8 rows too (the bits of a 9-row product's rows, not the stream's)."""
    if "avx512_bf16" not in cpu_flags():
        pytest.skip("this CPU lacks avx512_bf16 (/proc/cpuinfo): the kernels under test cannot run here")
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "ASCEND_PASSES_ISA": "avx512_bf16", "ONEDNN_VERBOSE": "1", "ASCEND_PASSES_GEMM": ""},
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "bf16-dot-ok" in run.stdout
    calls, probes = {}, {}
    for name in ("rule", "big", "odd", "swap", "dot", "onednn", "own", "linear9", "linear24", "linear64", "linear65"):
        body = run.stdout.split(f"MARK-BEGIN-{name}")[1].split(f"MARK-END-{name}")[0]
        calls[name] = sum(1 for line in body.splitlines() if ",exec," in line and "src:bf16" in line)
        probes[name] = float(run.stdout.split(f"MARK-END-{name} probe ")[1].split()[0])
    assert calls["rule"] == calls["swap"] == calls["dot"] == calls["own"] == 0, calls
    assert calls["big"] >= 1 and calls["odd"] >= 1 and calls["onednn"] >= 3, calls
    assert probes["rule"] == probes["swap"] == probes["dot"] == 0.0 and probes["own"] > 0.0, probes
    assert "WHICH True False" in run.stdout, run.stdout.split("WHICH")[1][:40]
    assert calls["linear9"] == calls["linear24"] == calls["linear64"] == 0 and calls["linear65"] >= 1, calls
    assert all(f"LINEAR {m} True" in run.stdout for m in (9, 24, 64)), run.stdout.split("LINEAR")[1:]
    assert all(f"FORCED {m} True False" in run.stdout for m in (1, 3, 8)), run.stdout.split("FORCED")[1:]
