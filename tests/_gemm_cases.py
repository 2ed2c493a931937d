"""What the fp32 piece-kernel tests (test_small_m.py: the stream kernel; test_swap_gemm.py: the swapped
kernel) share: the CPU's AVX-512 bits, the fp32 tolerance, Hugging Face-layout weights and the fp64
grouped reference (the ``gemm_route`` fixture is in conftest.py)."""

from __future__ import annotations

import os

import torch
from _helpers import cpu_flags

AVX512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= cpu_flags()
UNCAPPED = AVX512 and os.environ.get("ASCEND_PASSES_ISA", "") in ("", "amx", "avx512")
TOL = dict(rtol=1e-5, atol=1e-4)  # the fp32 tolerance of the kernel tests (test_kernels.py)


def hf_weight(e: int, n: int, k: int, pad: int = 0) -> torch.Tensor:
    """[E, K, N] view of an [E, N, K + pad] tensor: K contiguous, weight rows K + pad apart."""
    return (torch.randn(e, n, k + pad) / (k**0.5))[..., :k].transpose(1, 2)


def grouped_reference(x, w, counts, bias=None, act=0):
    out, r = [], 0
    for g, c in enumerate(counts):
        y = x[r : r + c].double() @ w[g].double()
        if bias is not None:
            y = y + bias[g].double()
        if act == 5:
            y = torch.nn.functional.silu(y)
        out.append(y)
        r += c
    return torch.cat(out).float()
