"""Issue 18, session 10: the fp32 weight-streaming kernel (kernels/skinny.cpp, decode: ascend.linear and grouped_matmul
pieces of at most 8 rows) prefetches the weight rows ahead of it in software, and both the fp32 and the bf16 stream
prefetch further ahead (up to 4 blocks) for rows shorter than 2 KB; ASCEND_PASSES_DECODE_SCHEDULE=v9 (read per call)
runs session 9's schedule (fp32: none; bf16: the next block). Session 24: every piece reads one weight row at a time
(one stream, prefetched into L2 a fixed distance ahead); ASCEND_PASSES_DECODE_SCHEDULE=v23 runs session 23's blocks
of 3-4 weight rows. Session 25: =blocks reads blocks of rows, each row prefetched a fixed distance ahead; =row
forces the one-row stream everywhere (session 26: the AVX512_BF16 kernel's row stream takes two adjacent weight rows
from 5 rows of x on, and a last single row where N is odd). Session 27: =chunks (the default: each kernel's own
stream) cuts K in chunks where x outgrows L1 (x packed per chunk, the weight in blocks of rows, accumulators kept
between chunks: fp32 [257, 1030] at 8 rows and [130, 4099], bf16 [130, 8195] from 2 rows (widened to fp32 under the
avx512 cap), the grouped [72, 4100] pieces and [256, 1024]'s of 8 rows; the chunks' sizes follow the CPU's L1d and
L2). Session 29: the one-row stream leaves one-row pieces to the hardware prefetcher; =v28 prefetches them as
session 28 did. The arithmetic order is the same, so all must give bitwise the same results, and all must equal
fp64 products at every edge: rows 1..8, weight rows not a multiple of the 3- / 4-row register blocks, K below, at and
past a 16-lane step, weight rows further apart than K (NaN in the gap: never read into a result), empty and unequal
groups, rows no group owns, one and two threads."""

from __future__ import annotations

import os

import pytest
import torch
from _gemm_cases import TOL, grouped_reference, hf_weight
from _helpers import cpu_flags, rerun_capped, skip_unless

from ascend_passes import kernels

skip_unless(kernels.available(), "C++ kernels not built or disabled", allow_module_level=True)

K = torch.ops.ascend_kernels if kernels.available() else None
ENV = "ASCEND_PASSES_DECODE_SCHEDULE"


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def all_schedules(monkeypatch, call):
    """The default schedule's result (chunks: skinny.h), asserted bitwise equal to chunks' named explicitly (so
    they stay compared if the default moves), the one-row stream's, the prefetched blocks', session 9's and
    session 23's and session 28's (one-row pieces prefetched too)."""
    monkeypatch.delenv(ENV, raising=False)
    new = call()
    for old_schedule in ("chunks", "row", "blocks", "v9", "v23", "v28"):
        monkeypatch.setenv(ENV, old_schedule)
        old = call()
        assert torch.equal(_bits(new), _bits(old)), old_schedule
    monkeypatch.delenv(ENV)
    return new


def nan_gap_weight(n: int, k: int, pad: int = 5) -> torch.Tensor:
    """[N, K] weight whose rows are K + pad apart, the pad holding NaN."""
    store = torch.randn(n, k + pad) / k**0.5
    store[:, k:] = float("nan")
    return store[:, :k]


@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("n,k", [(1, 1), (2, 15), (4, 16), (7, 17), (64, 100), (257, 1030), (130, 4099)])
@pytest.mark.parametrize("nt", [1, 2])
def test_linear_stream_schedules_bitwise_and_against_fp64(monkeypatch, threads, m, n, k, nt):
    threads(nt)
    torch.manual_seed(m * 10000 + n * 10 + k)
    x = torch.randn(m, k)
    w = nan_gap_weight(n, k)
    bias = torch.randn(n)
    new = all_schedules(monkeypatch, lambda: K.linear(x, w, bias))
    want = (x.double() @ w.double().T + bias.double()).float()
    torch.testing.assert_close(new, want, **TOL)


@pytest.mark.parametrize(
    "counts",
    [[3], [1, 0, 2, 0, 0, 8, 1], [0, 0, 5, 0], [2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2]],
    ids=["one-piece", "unequal-and-empty", "one-of-four", "many-equal"],
)
@pytest.mark.parametrize("n,k", [(7, 33), (256, 1024), (1030, 48), (72, 4100)])
@pytest.mark.parametrize("nt", [1, 2])
def test_grouped_decode_stream_schedules_bitwise_and_against_fp64(monkeypatch, threads, counts, n, k, nt):
    threads(nt)
    torch.manual_seed(sum(counts) * 1000 + n + k)
    rows = sum(counts) + 2  # two rows no group owns: zeros
    x = torch.randn(rows, k)
    w = hf_weight(len(counts), n, k, pad=3)
    gl = torch.tensor(counts)

    def call():
        return K.grouped_matmul([x], [w], group_list=gl, group_type=0, group_list_type=1)[0]

    new = all_schedules(monkeypatch, call)
    torch.testing.assert_close(new[: rows - 2], grouped_reference(x, w, counts), **TOL)
    assert torch.equal(new[rows - 2 :], torch.zeros(2, n))


@pytest.mark.parametrize("m", [1, 3, 4, 5, 8])
@pytest.mark.parametrize("n,k", [(5, 31), (64, 256), (130, 512), (33, 1030), (130, 8195)])
@pytest.mark.parametrize("nt", [1, 2])
def test_bf16_linear_stream_prefetch_distance_bitwise_and_against_fp64(monkeypatch, threads, m, n, k, nt):
    """bf16 rows shorter than 2 KB prefetch up to 4 blocks ahead (v9: the next block): same results bitwise,
    and fp32 sums of exact bf16 products, rounded once, within bf16 rounding of fp64 (on a CPU with AMX,
    8 rows take the swapped AMX kernel, which the switch leaves alone)."""
    threads(nt)
    torch.manual_seed(m * 10000 + n * 10 + k)
    x = torch.randn(m, k).bfloat16()
    w = nan_gap_weight(n, k).bfloat16()
    new = all_schedules(monkeypatch, lambda: K.linear(x, w, None))
    want = (x.double() @ w.double().T).float()
    torch.testing.assert_close(new.float(), want, atol=1e-2, rtol=2**-7)


def test_unknown_schedule_is_a_value_error(monkeypatch):
    """A misspelt A/B knob must not time the default schedule under another name."""
    x, w = torch.randn(2, 64), torch.randn(32, 64)
    monkeypatch.setenv(ENV, "v10")
    with pytest.raises(
        ValueError, match="ASCEND_PASSES_DECODE_SCHEDULE must be unset, chunks, row, blocks, v9, v23 or v28; got 'v10'"
    ):
        K.linear(x, w, None)
    with pytest.raises(ValueError, match="got 'v10'"):
        K.grouped_matmul([x], [w.T.unsqueeze(0)], group_list=torch.tensor([2]), group_type=0, group_list_type=1)


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_capped_isa_streams_bitwise_and_against_fp64(isa):
    """The schedule tests above again under ASCEND_PASSES_ISA caps, where the one-row stream runs the narrower
    kernels (avx512: bf16 widened to fp32; avx2: 8-lane fp32 and widened bf16): bits equal under every schedule,
    values within the dtype's tolerance of fp64."""
    flags = cpu_flags()
    need = {"avx512f", "avx512bw", "avx512vl", "avx512dq"} if isa == "avx512" else {"avx2", "fma"}
    if not need <= flags:
        # the machine's CPU, not a missing component: a skip with its reason even under CI_STRICT
        pytest.skip(f"this CPU lacks {sorted(need - flags)} (/proc/cpuinfo): no {isa} path to run")
    if os.environ.get("ASCEND_PASSES_ISA"):
        pytest.skip("already capped")
    rerun_capped(__file__, "schedules_bitwise or prefetch_distance_bitwise", isa)
