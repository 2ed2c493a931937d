"""``ascend.attention`` (kernels/attention.cpp): softmax(q·kᵀ·scale [causal])·v against the float64 product,
within the tolerance of the flash kernel it replaces (its reference: flash on the padded inputs), over row
counts around the 64-row blocks, odd key counts (bf16 pairs), head dims of any width, strided inputs; the
output has the flash output's strides; bad input raises the op's ValueError."""

from __future__ import annotations

import os
import re

import pytest
import torch
import torch.nn.functional as F
from _helpers import cpu_flags, rerun_capped

import ascend_passes.ops  # noqa: F401 - torch.ops.ascend
from ascend_passes.ops.attention import attention as reference

A = torch.ops.ascend
TOL = {torch.float32: 2e-5, torch.bfloat16: 1.5e-2}


def _exact(q, k, v, scale, causal):
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal, scale=scale)


def _rel(a, b):
    return ((a.double() - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("length", [1, 5, 63, 64, 65, 130])
@pytest.mark.parametrize("d,dv", [(96, 64), (12, 6), (32, 48), (24, 24)])
def test_matches_the_exact_product(dtype, causal, length, d, dv):
    torch.manual_seed(length * 7 + d + dv)
    b, n = 2, 3
    q = torch.randn(b, length, n, d).transpose(1, 2).to(dtype)  # the graph's [B, S, N, D] seen as [B, N, S, D]
    k = torch.randn(b, n, length, d).to(dtype)
    v = torch.randn(b, length, n, dv + 5)[..., :dv].transpose(1, 2).to(dtype)  # rows strided
    scale = d**-0.5
    out = A.attention(q, k, v, scale, causal)
    ref = reference(q, k, v, scale, causal)
    exact = _exact(q, k, v, scale, causal)
    assert out.dtype == dtype and out.shape == (b, n, length, dv)
    assert out.stride() == ref.stride() == (length * n * dv, dv, n * dv, 1)
    assert _rel(out, exact) <= TOL[dtype]
    assert _rel(out, exact) <= max(2 * _rel(ref, exact), TOL[dtype] / 4)


@pytest.mark.parametrize(
    "dtype,d,dv",
    [
        (torch.float32, 8, 4),  # the kernel
        (torch.bfloat16, 7, 4),  # odd head dim: the flash kernel on v padded to 7, sliced back
        (torch.float16, 8, 4),  # the flash kernel on v padded to 8
        (torch.float16, 4, 8),  # ... on q and k padded to 8
    ],
)
@pytest.mark.parametrize("length", [0, 7])
def test_every_path_has_the_fake_strides(dtype, d, dv, length):
    """The kernel, its fallback to the flash kernel (padded inputs, the output sliced back) and the empty path
    all return the fake implementation's strides, which the compiled graph (Inductor's checks included)
    assumes; so does the reference."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k = torch.randn(1, 2, length, d).to(dtype), torch.randn(1, 2, length, d).to(dtype)
    v = torch.randn(1, 2, length, dv).to(dtype)
    with FakeTensorMode() as mode:
        fake = A.attention(mode.from_tensor(q), mode.from_tensor(k), mode.from_tensor(v), 0.3, True)
    for real in (A.attention(q, k, v, 0.3, True), reference(q, k, v, 0.3, True)):
        assert real.shape == fake.shape and real.stride() == fake.stride()


def test_causal_rows_see_only_their_past():
    """Changing a later key or value leaves every earlier query row's output as it was."""
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 2, 70, 16), torch.randn(1, 2, 70, 16), torch.randn(1, 2, 70, 8)
    out = A.attention(q, k, v, 0.25, True)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 40:] += 5.0
    v2[:, :, 40:] -= 3.0
    out2 = A.attention(q, k2, v2, 0.25, True)
    assert torch.equal(out[:, :, :40], out2[:, :, :40])
    assert not torch.equal(out[:, :, 40:], out2[:, :, 40:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", ["2d", "4d", "heads", "batch_f32"])
@pytest.mark.parametrize("d,dv", [(16, 8), (32, 32)])  # bf16 32/32 on an AMX CPU: the tile kernel
def test_additive_masks(dtype, form, d, dv):
    """A mask broadcast to the scores (2-D [L, S], 4-D [B, N, L, S], [1, N, L, S], a float32 [B, 1, L, S] for
    bf16 inputs), with rows it hides entirely (batch row 1, query row 7): those rows give zeros, the others
    the exact product, as the reference (the flash kernel) does."""
    torch.manual_seed(3)
    b, n, length, kv = 2, 3, 70, 66
    q, k = torch.randn(b, n, length, d).to(dtype), torch.randn(b, n, kv, d).to(dtype)
    v = torch.randn(b, n, kv, dv).to(dtype)
    shape = {"2d": (length, kv), "4d": (b, n, length, kv), "heads": (1, n, length, kv)}
    mask = torch.randn(shape.get(form, (b, 1, length, kv)))
    if form in ("4d", "batch_f32"):
        mask[1, ..., :5] = float("-inf")  # batch row 1: the first 5 keys hidden ...
        mask[1, ..., 7, :] = float("-inf")  # ... and query row 7 entirely
    mask = mask.to(dtype if form != "batch_f32" else torch.float32)
    scale = 0.3
    out = A.attention(q, k, v, scale, False, mask)
    exact = _exact_masked(q, k, v, scale, False, mask)
    assert _rel(out, exact) <= TOL[dtype]
    if form in ("4d", "batch_f32"):
        assert torch.equal(out[1, :, 7], torch.zeros_like(out[1, :, 7]))
    ref = reference(q, k, v, scale, False, mask)
    assert _rel(ref, exact) <= TOL[dtype]


@pytest.mark.parametrize("dtype,d,dv", [(torch.float32, 16, 8), (torch.bfloat16, 32, 32)])
def test_a_nan_or_inf_score_makes_its_row_nan(dtype, d, dv):
    """The kernel's semantics of special values (tests/test_fuzz_ops.py fuzzes finite inputs only: torch's flash
    kernel gives per-column patterns there): a NaN or +Inf score makes the row NaN, nothing else (bf16 32/32: the
    tile kernel on an AMX CPU, the vdpbf16ps one elsewhere)."""
    torch.manual_seed(4)
    q, k, v = (torch.randn(1, 1, 70, w).to(dtype) for w in (d, d, dv))
    mask = torch.zeros(70, 70)
    mask[3, 10], mask[40, 2] = float("nan"), float("inf")
    out = A.attention(q, k, v, 0.25, False, mask)
    assert out[0, 0, [3, 40]].isnan().all()
    others = [i for i in range(70) if i not in (3, 40)]
    assert out[0, 0, others].isfinite().all()
    q2 = q.clone()
    q2[0, 0, 5, 0] = float("nan")  # a NaN query: its row's every score
    out2 = A.attention(q2, k, v, 0.25, True)
    assert out2[0, 0, 5].isnan().all() and out2[0, 0, :5].isfinite().all() and out2[0, 0, 6:].isfinite().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("length,kv", [(1, 1), (1, 9), (1, 300), (2, 33), (4, 4), (4, 130), (8, 130)])
@pytest.mark.parametrize("d,dv", [(96, 64), (7, 5), (24, 40)])
def test_few_query_rows_against_a_longer_cache(dtype, length, kv, d, dv):
    """Up to 4 query rows (decode: new tokens against their cached keys) read the keys and values in place, odd
    head dims included: the exact product within the tolerance, no worse than the flash kernel's (the reference);
    the causal mask where there are as many keys as queries."""
    torch.manual_seed(length * 31 + kv + d)
    b, n = 2, 3
    q = torch.randn(b, length, n, d).transpose(1, 2).to(dtype)
    k = torch.randn(b, kv, n, d + 3)[..., :d].transpose(1, 2).to(dtype)  # a cache's strided rows
    v = torch.randn(b, n, kv, dv).to(dtype)
    causal = length == kv
    scale = d**-0.5
    out = A.attention(q, k, v, scale, causal)
    exact = _exact(q, k, v, scale, causal)
    assert out.shape == (b, n, length, dv) and out.stride() == (length * n * dv, dv, n * dv, 1)
    assert _rel(out, exact) <= TOL[dtype]
    assert _rel(out, exact) <= max(2 * _rel(reference(q, k, v, scale, causal), exact), TOL[dtype] / 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_few_query_rows_with_masks_and_special_scores(dtype):
    """The few-rows path keeps the kernel's semantics: an additive mask (a row it hides entirely gives zeros),
    a NaN or +Inf score makes its row NaN and nothing else."""
    torch.manual_seed(6)
    b, n, length, kv = 2, 2, 3, 40
    q, k = torch.randn(b, n, length, 16).to(dtype), torch.randn(b, n, kv, 16).to(dtype)
    v = torch.randn(b, n, kv, 8).to(dtype)
    mask = torch.randn(b, 1, length, kv)
    mask[1, :, 2, :] = float("-inf")  # batch 1, query row 2: every key hidden
    mask[0, :, 1, :30] = float("-inf")
    out = A.attention(q, k, v, 0.3, False, mask)
    assert _rel(out, _exact_masked(q, k, v, 0.3, False, mask)) <= TOL[dtype]
    assert torch.equal(out[1, :, 2], torch.zeros_like(out[1, :, 2]))
    special = torch.zeros(length, kv)
    special[0, 5], special[2, 39] = float("nan"), float("inf")
    out = A.attention(q, k, v, 0.3, False, special)
    assert out[:, :, [0, 2]].isnan().all() and out[:, :, 1].isfinite().all()


def test_few_query_rows_capped_to_avx512():
    """On a CPU with avx512_bf16, the few-rows tests again capped to avx512: bf16 then rounds p without
    vcvtne2ps2bf16 (softmax_row + round_row), the path of an AVX-512 CPU without bf16 instructions."""
    if "avx512_bf16" not in cpu_flags():
        pytest.skip("this CPU lacks avx512_bf16: the uncapped run already took the avx512 path")
    if os.environ.get("ASCEND_PASSES_ISA"):
        pytest.skip("already capped")
    rerun_capped(__file__, "few_query_rows and not capped", "avx512")


def _exact_masked(q, k, v, scale, causal, mask):
    s = (q.double() @ k.double().transpose(-1, -2)) * scale + mask.double()
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)  # a fully hidden row: zeros
    return p @ v.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_a_strided_last_dim_is_read_right(dtype, which):
    """An input whose last dim is strided: the kernel (fp16: the reference, made contiguous first) gives the
    exact product; torch 2.13's flash kernel called on it directly does not (measured on the 2-core Zen 5:
    O(1) errors, NaN for bf16 / fp16 q; why the reference makes its inputs contiguous and the attention pass
    leaves such inputs on the math path)."""
    torch.manual_seed(5)
    t = {name: torch.randn(1, 2, 64, 8).to(dtype) for name in "qkv"}
    t[which] = t[which].transpose(-1, -2).contiguous().transpose(-1, -2)
    exact = _exact(t["q"], t["k"], t["v"], 0.25, True)
    tol = TOL.get(dtype, 4e-3)
    assert _rel(A.attention(t["q"], t["k"], t["v"], 0.25, True), exact) <= tol
    assert _rel(reference(t["q"], t["k"], t["v"], 0.25, True), exact) <= tol


def test_odd_bf16_head_dim_takes_the_reference():
    """bf16 pairs need an even q/k head dim: an odd one computes as the reference, bit for bit."""
    torch.manual_seed(2)
    q, k, v = (torch.randn(1, 2, 9, 7).bfloat16() for _ in range(3))
    assert torch.equal(A.attention(q, k, v, 0.4, True), reference(q, k, v, 0.4, True))


def _amx_cpu() -> bool:
    return {"amx_bf16", "amx_tile", "avx512_bf16"} <= cpu_flags()


def _amx_uncapped() -> bool:
    return _amx_cpu() and os.environ.get("ASCEND_PASSES_ISA", "amx") == "amx"


@pytest.mark.parametrize(
    "length,d,dv,route",
    [
        (70, 96, 64, "tiles"),
        (16, 32, 32, "tiles"),
        (15, 96, 64, "flash"),
        (5, 96, 64, "flash"),
        (70, 48, 64, "flash"),
        (70, 96, 40, "flash"),
    ],
)
def test_bf16_routes_on_an_amx_cpu(length, d, dv, route):
    """On a CPU with AMX (uncapped) bf16 attention runs on the tile units: the own tile kernel for 16 or more query
    rows and head dims that are multiples of 32 (within the tolerance; its sums in another order than the flash
    kernel's, so other bits), up to 4 rows the few-rows kernel (at these sizes its bits can equal the flash
    kernel's: not asserted), else the flash kernel on v padded to q's head dim, bit for bit (5 rows: just past the
    few-rows kernel). (Capped to avx512_bf16 the vdpbf16ps kernel runs: test_bf16_capped_below_amx.)"""
    if not _amx_uncapped():
        pytest.skip("this CPU lacks AMX (amx_bf16/amx_tile in /proc/cpuinfo) or the level is capped: no AMX route")
    torch.manual_seed(length + d + dv)
    q, k = (torch.randn(1, length, 4, d).bfloat16().transpose(1, 2) for _ in range(2))
    v = torch.randn(1, length, 4, dv).bfloat16().transpose(1, 2)
    width = max(d, dv)

    def pad(t):
        return F.pad(t, (0, width - t.shape[-1]))

    flash = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), is_causal=True, scale=0.3)[..., :dv]
    out = A.attention(q, k, v, 0.3, True)
    assert _rel(out, _exact(q, k, v, 0.3, True)) <= TOL[torch.bfloat16]
    assert torch.equal(out, flash) == (route == "flash")


def test_bf16_capped_below_amx():
    """On a CPU with AMX, the bf16 tests again in a fresh process capped to avx512_bf16: the own kernel's bf16
    path, which such a CPU runs only when capped, stays tested there."""
    if not _amx_cpu():
        pytest.skip("this CPU lacks AMX: the uncapped run already ran the vdpbf16ps kernel")
    if os.environ.get("ASCEND_PASSES_ISA"):
        pytest.skip("already capped")
    rerun_capped(__file__, "dtype1 or odd_bf16", "avx512_bf16")  # dtype1: bf16 in every dtype list here


@pytest.mark.parametrize(
    "shapes,causal,scale,message",
    [
        (((1, 2, 4, 8), (1, 3, 4, 8), (1, 3, 4, 8)), False, 0.5, "differ in batch or heads"),
        (((1, 2, 4, 8), (1, 2, 4, 6), (1, 2, 4, 8)), False, 0.5, "key has head dim 6, query 8"),
        (((1, 2, 4, 8), (1, 2, 5, 8), (1, 2, 4, 8)), False, 0.5, "value has 4 positions, key 5"),
        (((1, 2, 4, 8), (1, 2, 5, 8), (1, 2, 5, 8)), True, 0.5, "is_causal needs as many queries (4) as keys (5)"),
        (((1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8)), False, 0.0, "scale must be positive"),
        (((2, 4, 8), (2, 4, 8), (2, 4, 8)), False, 0.5, "query must be 4-D, got 3-D"),
        (((1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8), (2, 4, 4)), False, 0.5, "attn_mask must be 2-D or 4-D, got 3-D"),
        (((1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8), (4, 4)), True, 0.5, "attn_mask and is_causal together"),
        (
            ((1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8), (4, 3)),
            False,
            0.5,
            "attn_mask [4, 3] does not broadcast to the scores",
        ),
    ],
)
def test_bad_input_raises_the_op_error(shapes, causal, scale, message):
    q, k, v, *mask = (torch.randn(s) for s in shapes)
    for fn in (A.attention, reference):
        with pytest.raises(ValueError, match="^ascend.attention: .*" + re.escape(message)):
            fn(q, k, v, scale, causal, *mask)


def test_a_mask_of_another_dtype_raises():
    q = torch.randn(1, 2, 4, 8)
    for fn in (A.attention, reference):
        with pytest.raises(ValueError, match="attn_mask dtype torch.float16 is neither float32 nor the query's"):
            fn(q, q, q, 0.5, False, torch.zeros(4, 4, dtype=torch.float16))


def _untrimmable(mask: torch.Tensor) -> torch.Tensor:
    """The same mask with each row's last hidden column -1e30 instead of -inf where the row shows another column:
    the same probabilities (exp(-1e30) is 0), but no row of it ends in -inf columns, so the kernel computes every
    key."""
    out = mask.clone()
    last = out[..., -1]
    shown = (out != float("-inf")).any(-1)
    out[..., -1] = torch.where(torch.isinf(last) & shown, torch.tensor(-1e30), last)
    return out


def _same_as_full(out, full, dtype):
    """The trimmed product against the full one: the same bits on the tile kernel (its key blocks summed in the
    same order either way), within rounding on the GEMM paths (p.v's K split otherwise)."""
    if dtype == torch.bfloat16 and _amx_uncapped():
        torch.testing.assert_close(out, full, rtol=0, atol=0, equal_nan=True)
    else:
        torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-6 if dtype == torch.float32 else 1e-2, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", ["causal", "window", "padding", "hidden_row", "offset", "all_hidden"])
@pytest.mark.parametrize("length", [70, 130, 256])
def test_an_inf_mask_leaves_out_the_keys_it_hides(dtype, form, length):
    """An explicit mask: each row's keys end after its last column that is not -inf (a causal mask handed in as a
    tensor, as Hugging Face's under dynamic shapes, costs what is_causal does), with the values of the full product
    (the same mask, made untrimmable) and of the exact one."""
    torch.manual_seed(length)
    kv = length + (9 if form == "offset" else 0)
    q = torch.randn(2, 3, length, 96).to(dtype)
    k, v = torch.randn(2, 3, kv, 96).to(dtype), torch.randn(2, 3, kv, 64).to(dtype)
    hide = torch.full((length, kv), float("-inf"))
    causal = hide.triu(1 + kv - length)
    mask = {
        "causal": causal,
        "offset": causal,
        "window": causal + hide.tril(-40 - (kv - length)),
        "padding": torch.zeros(2, 1, 1, kv).masked_fill(torch.arange(kv) >= kv - 13, float("-inf")),
        "hidden_row": causal.index_fill(0, torch.tensor([3, length - 1]), float("-inf")),
        "all_hidden": hide,
    }[form]
    out = A.attention(q, k, v, 96**-0.5, False, mask)
    _same_as_full(out, A.attention(q, k, v, 96**-0.5, False, _untrimmable(mask)), dtype)
    if form == "all_hidden":
        assert torch.equal(out, torch.zeros_like(out))
        return
    assert _rel(out, _exact_masked(q, k, v, 96**-0.5, False, mask)) <= TOL[dtype]
    if form == "hidden_row":
        assert torch.equal(out[:, :, [3, length - 1]], torch.zeros_like(out[:, :, [3, length - 1]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("special", ["nan_key", "inf_value", "overflow", "overflow_unscaled"])
def test_hidden_keys_stay_in_where_their_scores_are_not_inf(dtype, special):
    """Keys are left out only where that is exact: a NaN key, an infinite value or scores that overflow under the
    mask poison the rows as the full product does (the same mask made untrimmable; torch's flash kernel, the
    reference, agrees on the NaN key and the infinite value)."""
    torch.manual_seed(5)
    q, k, v = (torch.randn(1, 2, 64, w).to(dtype) for w in (96, 96, 64))
    if special == "nan_key":
        k[0, 0, 63, 5] = float("nan")  # the last key: hidden from every row but the last
    elif special == "inf_value":
        v[0, 0, 63, 5] = float("inf")
    else:  # |q . k| past FLT_MAX: inf + -inf is NaN (also where the scale would bring it back: sums are unscaled)
        q[0, 0, :, 0], k[0, 0, 63, 0] = 1e20, 1e20
    scale = 1e-10 if special == "overflow_unscaled" else 96**-0.5
    mask = torch.full((64, 64), float("-inf")).triu(1)
    out = A.attention(q, k, v, scale, False, mask)
    _same_as_full(out, A.attention(q, k, v, scale, False, _untrimmable(mask)), dtype)
    assert out[0, 0, :63].isnan().any(-1).all()  # the rows it is hidden from: a NaN score, or 0 * inf
    assert out[0, 1].isfinite().all()
    if not special.startswith("overflow"):  # (an overflowing score: torch's flash kernel leaves its row finite)
        assert torch.equal(out.isnan(), reference(q, k, v, scale, False, mask).isnan())
