"""``ascend.mla_prolog``: the MLA pre-attention computation of DeepSeek-V2/V3 attention (q down/up
projection + RMSNorm + RoPE, kv down projection + RMSNorm + RoPE) as one op, mirroring
``torch_npu.npu_mla_prolog_v3`` on the subset a graph without kv cache can express.

This module is the op's record (``OPS``): schema, reference, fake, checks, NPU row and limits;
``ascend_passes.ops`` registers it.

Schema (names and order follow ``npu_mla_prolog_v3``)::

    mla_prolog(Tensor token_x, Tensor? weight_dq, Tensor weight_uq_qr, Tensor? weight_uk,
               Tensor weight_dkv_kr, Tensor? rmsnorm_gamma_cq, Tensor rmsnorm_gamma_ckv,
               Tensor rope_sin, Tensor rope_cos, *, int head_num,
               float rmsnorm_epsilon_cq=1e-05, float rmsnorm_epsilon_ckv=1e-05,
               bool rope_interleave=False) -> (Tensor query, Tensor query_rope, Tensor kv, Tensor k_rope)

What it computes (``x`` is ``(T, He)`` or ``(B, S, He)``, ``*`` the token dims; N heads, D nope
dim, Dr rope dim, Hcq q latent, Hckv kv latent; weights are ``in × out``, i.e. ``x @ W``)::

    cQ         = rms_norm(x @ weight_dq, rmsnorm_gamma_cq, eps_cq)       (Hcq)    [x when weight_dq is None]
    q          = (cQ @ weight_uq_qr).view(*, N, D + Dr)                   head-major, [nope | rope] per head
    query      = q[..., :D] @ weight_uk  -> (*, N, Hckv)                  [(*, N, D) without weight_uk]
    query_rope = rope(q[..., D:])        -> (*, N, Dr)
    ckv        = x @ weight_dkv_kr                                        (Hckv + Dr)
    kv         = rms_norm(ckv[..., :Hckv], rmsnorm_gamma_ckv, eps_ckv) -> (*, Hckv)
    k_rope     = rope(ckv[..., Hckv:])   -> (*, Dr)

    rope(v)    = v' * cos + rotate_half(v') * sin,  rotate_half(v') = cat(-v'[Dr/2:], v'[:Dr/2])
                 v' = v, or with rope_interleave the pairs de-interleaved: cat(v[0::2], v[1::2])
                 (npu_interleave_rope); cos/sin are (*, Dr) and broadcast over the heads.

RMSNorms compute in float32 and return x's dtype (they are ``ascend.rms_norm``); matmuls and RoPE run
in x's dtype (RoPE's ``v' * cos`` rounded, then its sum with ``rotate_half(v') * sin`` rounded once).

The subset, and why:
- **No kv cache writes.** ``npu_mla_prolog_v3`` scatters ``kv``/``k_rope`` into ``kv_cache``/
  ``kr_cache`` (paged, ``cache_index``) in place; the graphs we rewrite have no cache (HF prefill
  / MTP drafting without ``past_key_values``), so the op returns ``kv`` and ``k_rope`` instead —
  what ``npu_mla_prolog_v3_functional`` would write at ``cache_index``:
  ``kv_cache.view(-1, Hckv)[cache_index.flatten()] == kv.reshape(-1, Hckv)`` (same for kr).
- **Weight absorption only when the graph has it.** The NPU op always absorbs ``W_UK`` into the
  query (``query`` is in the kv latent space, ``(*, N, Hckv)``). Hugging Face's attention expands
  k/v with ``kv_b_proj`` instead and needs the query per head (``(*, N, D)``), so the rewrite
  passes ``weight_uk=None``. The op supports ``weight_uk`` (``(N, D, Hckv)``) for graphs that
  absorb.
- **q_lora_rank=None** (DeepSeek-V2-Lite form: one q projection): ``weight_dq`` and
  ``rmsnorm_gamma_cq`` are None and ``weight_uq_qr`` is ``(He, N*(D+Dr))``. Not in torch_npu.
- **Plain layouts, any size, float dtypes.** ND weights (the NPU wants FRACTAL_NZ and DeepSeek
  sizes He 7168, Hcq 1536, Hckv 512, D 128, Dr 64); fp32/bf16/fp16. No quantisation arguments
  (``dequant_scale_*``, ``quant_scale_*``, ``smooth_scales_cq``), no ``qc_qr_scale``/``kc_scale``
  (the lowering passes 1.0), no ``query_norm`` / dequant-scale outputs.
- **rope_interleave** (not a torch_npu argument): DeepSeek checkpoints lay the rope dims out in
  pairs. torch_npu users permute the rope rows of ``W_QR`` and ``W_KR`` once at load time
  (vllm-ascend's ``trans_rope_weight``: ``cat(rows[0::2], rows[1::2])`` within each head's rope
  block), after which the op's half-split RoPE is exact; the lowering must do that permutation at
  weight preparation and pass the permuted weights.
- **head_num** (keyword, not in torch_npu, where N is ``weight_uk.size(0)``): needed because
  ``weight_uk`` may be None.

CPU path: the C++ kernel of kernels/mla.cpp (``cpp_kernel``): the three projections through
``ascend.linear``'s kernel, the two norms through ``ascend.rms_norm``'s, the absorbed query through
``bmm``, and RoPE of q and k plus the per-head query copy in one loop over the tokens, rounded as the
reference below (bf16 results bitwise equal to it in tests/test_mla_kernel.py).  The reference
(registered for every backend, ``CompositeExplicitAutograd``) makes ~25 ATen calls per layer outside
the matmuls; measured at tools/bench_model.py's sizes, one thread, CPU time of the op outside its three
matmuls (session 10, under load): fp32 T=256 693 -> 162 us, T=8 84 -> 9 us; bf16 T=256 561 -> 268 us,
T=8 144 -> 23 us.  Under Inductor the op is decomposed (the reference) and fused.

torch_npu mapping for the ``lower`` pass (``torch.ops.npu.npu_mla_prolog_v3(...)``)::

    token_x            ← token_x                    (B, S, He) or (T, He)
    weight_dq          ← weight_dq                  (He, Hcq); npu_format_cast to NZ at weight prep
    weight_uq_qr       ← weight_uq_qr               (Hcq, N*(D+Dr)); rope rows de-interleaved if rope_interleave
    weight_uk          ← weight_uk, or when None: kv_b_proj.weight.view(N, D+Dv, Hckv)[:, :D]
                         — and then attention must consume the absorbed query (a different
                         attention rewrite; not done here)
    weight_dkv_kr      ← weight_dkv_kr              (He, Hckv+Dr); rope rows de-interleaved if rope_interleave
    rmsnorm_gamma_cq   ← rmsnorm_gamma_cq
    rmsnorm_gamma_ckv  ← rmsnorm_gamma_ckv
    rope_sin, rope_cos ← rope_sin, rope_cos         (*, Dr)
    kv_cache, kr_cache ← the engine's paged caches; cache_index ← slot mapping;
                         our kv / k_rope = what the op writes there
    rmsnorm_epsilon_cq / rmsnorm_epsilon_ckv ← same; cache_mode="PA_BSND"; qc_qr_scale=kc_scale=1.0
    outputs: query ↔ query (absorbed), query_rope ↔ query_rope
    not lowerable: weight_dq None (q_lora_rank=None), sizes outside the NPU's limits.
"""

from __future__ import annotations

from typing import Any

import torch

from ..npu import DOCS, Limit, NpuOp, arg_dtype
from ._define import Op
from .checks import check_dim, check_float, check_same_dtype, fail

NAME = "mla_prolog"
SCHEMA = (
    "mla_prolog(Tensor token_x, Tensor? weight_dq, Tensor weight_uq_qr, Tensor? weight_uk, "
    "Tensor weight_dkv_kr, Tensor? rmsnorm_gamma_cq, Tensor rmsnorm_gamma_ckv, Tensor rope_sin, "
    "Tensor rope_cos, *, int head_num, float rmsnorm_epsilon_cq=1e-05, "
    "float rmsnorm_epsilon_ckv=1e-05, bool rope_interleave=False) -> (Tensor, Tensor, Tensor, Tensor)"
)
TORCH_NPU_NAME = "npu_mla_prolog_v3"


# ------------------------------------------------------------------------------------ checks
def _sizes(
    token_x,
    weight_dq,
    weight_uq_qr,
    weight_uk,
    weight_dkv_kr,
    rmsnorm_gamma_cq,
    rmsnorm_gamma_ckv,
    rope_sin,
    rope_cos,
    head_num,
) -> tuple[int, int, int, int]:
    """Check the arguments (ranks, dtypes, static widths) and return ``(N, D, Dr, Hckv)``."""
    op = NAME
    check_dim(op, "token_x", token_x, (2, 3))
    check_float(op, "token_x", token_x)
    he = token_x.shape[-1]
    named = [
        ("weight_uq_qr", weight_uq_qr),
        ("weight_dkv_kr", weight_dkv_kr),
        ("rmsnorm_gamma_ckv", rmsnorm_gamma_ckv),
        ("rope_sin", rope_sin),
        ("rope_cos", rope_cos),
    ]
    named += [
        (n, t)
        for n, t in (("weight_dq", weight_dq), ("weight_uk", weight_uk), ("rmsnorm_gamma_cq", rmsnorm_gamma_cq))
        if t is not None
    ]
    for name, t in named:
        check_same_dtype(op, name, t, "token_x", token_x)
    if (weight_dq is None) != (rmsnorm_gamma_cq is None):
        fail(op, "weight_dq and rmsnorm_gamma_cq must be given together (q_lora_rank set) or both be None")
    q_in = he
    if weight_dq is not None:
        check_dim(op, "weight_dq", weight_dq, (2,))
        check_dim(op, "rmsnorm_gamma_cq", rmsnorm_gamma_cq, (1,))
        if weight_dq.shape[0] != he or rmsnorm_gamma_cq.shape[0] != weight_dq.shape[1]:
            fail(
                op,
                f"weight_dq {tuple(weight_dq.shape)} and rmsnorm_gamma_cq "
                f"{tuple(rmsnorm_gamma_cq.shape)} do not fit token_x's width {he}",
            )
        q_in = weight_dq.shape[1]
    check_dim(op, "weight_uq_qr", weight_uq_qr, (2,))
    check_dim(op, "weight_dkv_kr", weight_dkv_kr, (2,))
    check_dim(op, "rmsnorm_gamma_ckv", rmsnorm_gamma_ckv, (1,))
    for name, t in (("rope_sin", rope_sin), ("rope_cos", rope_cos)):
        if t.dim() != token_x.dim():
            fail(op, f"{name} must have token_x's rank {token_x.dim()} ((*, Dr)), got {t.dim()}-D")
        static = [(a, b) for a, b in zip(t.shape[:-1], token_x.shape[:-1]) if isinstance(a, int) and isinstance(b, int)]
        if any(a != b for a, b in static):
            fail(
                op,
                f"{name} {tuple(t.shape)} must have one row per token of token_x {tuple(token_x.shape)} "
                "(broadcast the tables over the batch first)",
            )
    dr = rope_sin.shape[-1]
    if rope_cos.shape[-1] != dr or dr % 2:
        fail(op, f"rope_sin/rope_cos widths {rope_sin.shape[-1]}/{rope_cos.shape[-1]} must be one even Dr")
    if head_num < 1:
        fail(op, f"head_num must be >= 1, got {head_num}")
    if weight_uq_qr.shape[0] != q_in or weight_uq_qr.shape[1] % head_num:
        fail(op, f"weight_uq_qr {tuple(weight_uq_qr.shape)} must be ({q_in}, head_num*(D+Dr)) with head_num={head_num}")
    d = weight_uq_qr.shape[1] // head_num - dr
    if d < 0:
        fail(op, f"weight_uq_qr gives {weight_uq_qr.shape[1] // head_num} per head, less than Dr={dr}")
    hckv = rmsnorm_gamma_ckv.shape[0]
    if weight_dkv_kr.shape[0] != he or weight_dkv_kr.shape[1] != hckv + dr:
        fail(op, f"weight_dkv_kr {tuple(weight_dkv_kr.shape)} must be ({he}, Hckv+Dr) = ({he}, {hckv + dr})")
    if weight_uk is not None:
        check_dim(op, "weight_uk", weight_uk, (3,))
        if tuple(weight_uk.shape) != (head_num, d, hckv):
            fail(op, f"weight_uk {tuple(weight_uk.shape)} must be (N, D, Hckv) = ({head_num}, {d}, {hckv})")
    return head_num, d, dr, hckv


# ------------------------------------------------------------------------------------ reference
# The reference is the CPU path where the C++ kernels are not built (and what Inductor decomposes):
# each ATen call from Python costs microseconds, so it makes few calls and calls the overloads
# directly.  kernels/mla.cpp rounds exactly as this does.
def _rms_norm(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
    """``ascend.rms_norm`` (float32 math, rounded once to x's dtype; its C++ kernel on the CPU)."""
    return torch.ops.ascend.rms_norm.default(x, gamma, eps)[0]


def _rope(v: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, interleave: bool) -> torch.Tensor:
    """``v' * cos + rotate_half(v') * sin`` with ``sin_signed = cat(-sin[:Dr/2], sin[Dr/2:])``, so that
    ``rotate_half(v') * sin == cat(v'[Dr/2:], v'[:Dr/2]) * sin_signed``; one rounding for the sum."""
    if interleave:  # v' = cat(v[0::2], v[1::2]); rotate_half(v') = cat(-v[1::2], v[0::2])
        first, second = v[..., 0::2], v[..., 1::2]
    else:
        half = v.shape[-1] // 2
        first, second = v[..., :half], v[..., half:]
    return torch.addcmul(torch.cat([first, second], -1) * cos, torch.cat([second, first], -1), sin_signed)


def _mm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``a @ w`` for an ``in × out`` weight, as ``ascend.linear(a, w.T)``: the weights are
    transposed views of ``nn.Linear`` ``[out, in]`` weights, whose CPU kernel streams them at
    decode (plain ``F.linear`` on other devices)."""
    return torch.ops.ascend.linear.default(a, w.t())


def mla_prolog(
    token_x,
    weight_dq,
    weight_uq_qr,
    weight_uk,
    weight_dkv_kr,
    rmsnorm_gamma_cq,
    rmsnorm_gamma_ckv,
    rope_sin,
    rope_cos,
    *,
    head_num,
    rmsnorm_epsilon_cq=1e-05,
    rmsnorm_epsilon_ckv=1e-05,
    rope_interleave=False,
):
    """Reference implementation (plain PyTorch; the CPU path)."""
    n, d, dr, hckv = _sizes(
        token_x,
        weight_dq,
        weight_uq_qr,
        weight_uk,
        weight_dkv_kr,
        rmsnorm_gamma_cq,
        rmsnorm_gamma_ckv,
        rope_sin,
        rope_cos,
        head_num,
    )
    lead = token_x.shape[:-1]
    x = token_x.reshape(-1, token_x.shape[-1])
    cos = rope_cos.reshape(-1, 1, dr)
    sin = rope_sin.reshape(-1, 1, dr)
    sin = torch.cat([-sin[..., : dr // 2], sin[..., dr // 2 :]], -1)  # rotate_half's sign, for q and k
    cq = x if weight_dq is None else _rms_norm(_mm(x, weight_dq), rmsnorm_gamma_cq, rmsnorm_epsilon_cq)
    q = _mm(cq, weight_uq_qr).view(-1, n, d + dr)
    q_nope, q_pe = q[..., :d], q[..., d:]
    if weight_uk is not None:  # absorbed: (N, T, D) @ (N, D, Hckv)
        query = torch.bmm(q_nope.transpose(0, 1), weight_uk).transpose(0, 1).contiguous()
    else:
        query = q_nope.contiguous()
    query_rope = _rope(q_pe, cos, sin, rope_interleave)
    ckv = _mm(x, weight_dkv_kr)
    kv = _rms_norm(ckv[:, :hckv], rmsnorm_gamma_ckv, rmsnorm_epsilon_ckv)
    k_rope = _rope(ckv[:, hckv:].unsqueeze(1), cos, sin, rope_interleave).squeeze(1)
    return (
        query.reshape(*lead, n, query.shape[-1]),
        query_rope.reshape(*lead, n, dr),
        kv.reshape(*lead, hckv),
        k_rope.reshape(*lead, dr),
    )


# ------------------------------------------------------------------------------------ fake
def mla_prolog_fake(
    token_x,
    weight_dq,
    weight_uq_qr,
    weight_uk,
    weight_dkv_kr,
    rmsnorm_gamma_cq,
    rmsnorm_gamma_ckv,
    rope_sin,
    rope_cos,
    *,
    head_num,
    rmsnorm_epsilon_cq=1e-05,
    rmsnorm_epsilon_ckv=1e-05,
    rope_interleave=False,
):
    """Shapes only; the token dims may be symbolic (weights give every other size)."""
    n, d, dr, hckv = _sizes(
        token_x,
        weight_dq,
        weight_uq_qr,
        weight_uk,
        weight_dkv_kr,
        rmsnorm_gamma_cq,
        rmsnorm_gamma_ckv,
        rope_sin,
        rope_cos,
        head_num,
    )
    lead = list(token_x.shape[:-1])
    q_width = hckv if weight_uk is not None else d
    return (
        token_x.new_empty([*lead, n, q_width]),
        token_x.new_empty([*lead, n, dr]),
        token_x.new_empty([*lead, hckv]),
        token_x.new_empty([*lead, dr]),
    )


# ------------------------------------------------------------------------------------ NPU limits
def _mla_required(a: dict[str, Any]) -> str | None:
    missing = [n for n in ("weight_dq", "rmsnorm_gamma_cq", "weight_uk") if a[n] is None]
    if not missing:
        return None
    why = (
        " (the graph's attention takes the per-head query: npu_mla_prolog_v3 always absorbs W_UK)"
        if "weight_uk" in missing
        else " (q_lora_rank=None)"
    )
    return f"{', '.join(missing)} None{why}"


def _mla_dtype(a: dict[str, Any]) -> str | None:
    dt = arg_dtype(a["token_x"])
    return None if dt == torch.bfloat16 else f"token_x dtype {dt} (npu_mla_prolog_v3: bfloat16 or int8)"


def _mla_sizes(a: dict[str, Any]) -> str | None:
    he, hckv, n = a["token_x"].shape[-1], a["rmsnorm_gamma_ckv"].shape[0], a["head_num"]
    bad = []
    if he not in (7168, 7680, 6144):
        bad.append(f"He={he} (7168, 7680 or 6144)")
    if hckv != 512:
        bad.append(f"Hckv={hckv} (512)")
    if n not in (1, 2, 4, 8, 16, 32, 64, 128):
        bad.append(f"N={n} (1, 2, 4, ..., 128)")
    return ", ".join(bad) or None


def _mla_rope(a: dict[str, Any]) -> str | None:
    return (
        "rope_interleave=True (the rope rows of weight_uq_qr / weight_dkv_kr must be de-interleaved at "
        "weight load, which lower does not do)"
        if a["rope_interleave"]
        else None
    )


# ------------------------------------------------------------------------------------ record
OPS = (
    Op(
        schema=SCHEMA,
        reference=mla_prolog,
        fake=mla_prolog_fake,
        decomposable=True,
        cpp_kernel=True,
        npu=NpuOp(
            "npu_mla_prolog_v3_functional",
            "torch_npu.npu_mla_prolog_v3_functional(token_x, weight_dq, weight_uq_qr, weight_uk, weight_dkv_kr, "
            "rmsnorm_gamma_cq, rmsnorm_gamma_ckv, rope_sin, rope_cos, kv_cache, kr_cache, *, cache_index=None, "
            "..., rmsnorm_epsilon_cq=1e-05, rmsnorm_epsilon_ckv=1e-05, cache_mode='PA_BSND', ...) "
            "-> (query, query_rope, dequant_scale_q_nope, query_norm, dequant_scale_q_norm, kv_cache, kr_cache)",
            note="the graph has no kv cache: lower allocates one cache row per token (BlockNum=T, BlockSize=1, "
            "Nkv=1) with cache_index=arange(T), so the returned caches are exactly our kv / k_rope.",
            limits=(
                Limit(
                    f"{DOCS} npu_mla_prolog_v3: weight_dq, rmsnorm_gamma_cq, weight_uk 必选参数 (required)",
                    _mla_required,
                ),
                Limit(f"{DOCS} npu_mla_prolog_v3: token_x dtype支持bfloat16和int8", _mla_dtype),
                Limit(f"{DOCS} npu_mla_prolog_v3: He 7168/7680/6144, Hckv 512, N 1..128 (powers of two)", _mla_sizes),
                Limit("torch_npu rotates the halves of the rope dims (rope_interleave is not an argument)", _mla_rope),
            ),
        ),
    ),
)

__all__ = ["NAME", "OPS", "SCHEMA", "TORCH_NPU_NAME", "mla_prolog", "mla_prolog_fake"]
