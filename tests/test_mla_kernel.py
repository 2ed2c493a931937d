"""The C++ CPU kernel of ``ascend.mla_prolog`` (kernels/mla.cpp) against the Python reference
(``ascend_passes.ops.reference.mla_prolog``, which the kernel replaces on the CPU): every form
(q_lora, absorbed query, interleaved RoPE), odd sizes (odd heads, D=0, one token, Dr=2, Dr/2 past one
RoPE chunk), 2-D and strided tokens, tables broadcast over the batch, fp32 / bf16 / fp16; the same error messages; no
per-call ATen elementwise calls; and the same results with the instruction set capped to AVX2."""

from __future__ import annotations

import itertools

import pytest
import torch
from _helpers import rerun_capped, skip_unless

from ascend_passes import kernels
from ascend_passes.ops import reference

skip_unless(kernels.available(), "C++ kernels not built or disabled", allow_module_level=True)

K = torch.ops.ascend_kernels if kernels.available() else None
OP = torch.ops.ascend.mla_prolog.default
# the kernel runs the reference's linear and rms_norm kernels and rounds RoPE as the reference does;
# fp32 differs by FMA contraction of RoPE's sum only, bf16 / fp16 by at most that rounded once
TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}

# (batch, tokens, heads N, nope D, rope Dr, Hckv, He, Hcq)
SIZES = [
    (2, 7, 3, 5, 6, 9, 17, 11),
    (1, 1, 1, 0, 2, 1, 4, 3),
    (1, 33, 8, 16, 8, 32, 64, 48),
    (1, 5, 2, 4, 134, 8, 16, 12),  # Dr/2 = 67: the kernel's RoPE runs in chunks of 64 pairs, then a tail of 3
]
FORMS = list(itertools.product((True, False), (True, False), (True, False)))  # q_lora, absorb, interleave


def _args(dtype, sizes, q_lora, absorb, seed=0):
    b, s, n, d, dr, hckv, he, hcq = sizes
    g = torch.Generator().manual_seed(seed)

    def t(*shape, offset=0.0):
        return (torch.randn(*shape, generator=g) * 0.3 + offset).to(dtype)

    return [
        t(b, s, he),
        t(he, hcq) if q_lora else None,
        t(hcq if q_lora else he, n * (d + dr)),
        t(n, d, hckv) if absorb else None,
        t(he, hckv + dr),
        t(hcq, offset=1.0) if q_lora else None,
        t(hckv, offset=1.0),
        t(b, s, dr),
        t(b, s, dr),
    ]


def _assert_equal_to_reference(args, dtype, **kw):
    got = K.mla_prolog(*args, **kw)
    want = reference.mla_prolog(*args, **kw)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype == dtype and g.shape == w.shape and g.is_contiguous()
        torch.testing.assert_close(g.float(), w.float(), rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("sizes", SIZES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("q_lora,absorb,interleave", FORMS)
def test_kernel_equals_reference(dtype, sizes, q_lora, absorb, interleave):
    args = _args(dtype, sizes, q_lora, absorb)
    n = sizes[2]
    kw = {"head_num": n, "rmsnorm_epsilon_cq": 1e-6, "rmsnorm_epsilon_ckv": 1e-5, "rope_interleave": interleave}
    _assert_equal_to_reference(args, dtype, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bench_model_sizes(dtype):
    """tools/bench_model.py's layer: He 1024, Hcq 256, 8 heads of 64 + 32, Hckv 128, 256 tokens."""
    args = _args(dtype, (1, 256, 8, 64, 32, 128, 1024, 256), q_lora=True, absorb=False)
    _assert_equal_to_reference(args, dtype, head_num=8, rmsnorm_epsilon_cq=1e-6, rope_interleave=True)


def test_two_dim_strided_tokens_and_broadcast_tables():
    args = _args(torch.float32, SIZES[0], q_lora=True, absorb=False)
    b, s, n, _, dr, _, he, _ = SIZES[0]
    wide = torch.randn(b * s, 2 * he)
    flat = [wide[:, ::2], *args[1:7], args[7].view(b * s, dr), args[8].view(b * s, dr)]
    assert not flat[0].is_contiguous()
    _assert_equal_to_reference(flat, torch.float32, head_num=n, rope_interleave=True)
    batched = list(args)
    batched[7] = args[7][:1].expand(b, s, dr)  # one table for every sequence: stride 0 over the batch
    batched[8] = args[8][:1].expand(b, s, dr)
    _assert_equal_to_reference(batched, torch.float32, head_num=n)


def test_cpu_op_is_the_kernel():
    """torch.ops.ascend.mla_prolog on CPU tensors runs the C++ kernel: RoPE and the query copy make
    no ATen elementwise call (the reference makes cat / mul / addcmul calls per RoPE)."""
    args = _args(torch.float32, SIZES[2], q_lora=True, absorb=False)
    with torch.profiler.profile() as prof:
        out = OP(*args, head_num=SIZES[2][2], rope_interleave=True)
    names = {e.key for e in prof.key_averages()}
    assert "ascend::mla_prolog" in names
    assert not names & {"aten::addcmul", "aten::cat", "aten::mul"}, names
    torch.testing.assert_close(out[1], reference.mla_prolog(*args, head_num=SIZES[2][2], rope_interleave=True)[1])


def _error(fn, *args, **kw):
    with pytest.raises(ValueError) as info:
        fn(*args, **kw)
    return str(info.value).splitlines()[0]


@pytest.mark.parametrize(
    "case",
    ["head_num", "gamma_cq_alone", "short_tables", "odd_rope", "weight_dkv", "weight_uk", "rank", "dtype"],
)
def test_errors_match_the_reference(case):
    args = _args(torch.float32, SIZES[0], q_lora=True, absorb=True)
    kw = {"head_num": SIZES[0][2]}
    if case == "head_num":
        kw["head_num"] = 2
    elif case == "gamma_cq_alone":
        args[1] = None
    elif case == "short_tables":
        args[7], args[8] = args[7][:, :3], args[8][:, :3]
    elif case == "odd_rope":
        args[7], args[8] = args[7][..., :5], args[8][..., :5]
    elif case == "weight_dkv":
        args[4] = args[4][:, :-1]
    elif case == "weight_uk":
        args[3] = args[3][:, :, :-1]
    elif case == "rank":
        args[0] = args[0][0, 0]
    elif case == "dtype":
        args[6] = args[6].double()
    want = _error(reference.mla_prolog, *args, **kw)
    assert want.startswith("ascend.mla_prolog: ")
    assert _error(K.mla_prolog, *args, **kw) == want
    assert _error(OP, *args, **kw) == want


def test_kernel_under_avx2_cap():
    """The projections and norms inside take their AVX2 paths under ASCEND_PASSES_ISA=avx2 (read
    once per process, so a fresh one): the kernel still equals the reference."""
    rerun_capped(__file__, "equals_reference", "avx2")
