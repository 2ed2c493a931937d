"""The mla pass and the ``ascend.mla_prolog`` op: every DeepseekV3 attention layer's prolog is one
fused op in all four attention forms, outputs equal to the model; the op against opcheck and an
independent formula."""

from __future__ import annotations

import math

import pytest
import torch
from _helpers import compile_and_run, rel_diff

import ascend_passes.ops.mla  # noqa: F401  (registers ascend.mla_prolog)
from ascend_passes import models
from ascend_passes.inspect.layers import ops_by_layer

OP = torch.ops.ascend.mla_prolog.default
NUM_LAYERS = 3  # models.deepseek_v3's default


# ------------------------------------------------------------------------------ the pass
FORMS = [(48, True), (48, False), (None, True), (None, False)]


@pytest.fixture(scope="module", params=FORMS, ids=lambda f: f"q_lora={f[0]}-interleave={f[1]}")
def compiled(request):
    q_lora_rank, rope_interleave = request.param
    model, inputs = models.deepseek_v3("grouped_mm", q_lora_rank=q_lora_rank, rope_interleave=rope_interleave)
    with torch.no_grad():
        ref = model(*inputs)
    out, reports = compile_and_run(model, inputs, compiler="eager")
    return request.param, ref, out, reports


def test_every_attention_prolog_fused(compiled):
    (q_lora_rank, rope_interleave), ref, out, reports = compiled
    (report,) = reports
    assert report.count("ascend.mla_prolog") == NUM_LAYERS
    mla = report.passes["mla"]
    assert mla.status == "ok" and mla.near_misses == []
    assert sorted(m.layer for m in mla.matches) == [f"model.layers.{i}" for i in range(NUM_LAYERS)]
    assert all(m.details["rope_interleave"] is rope_interleave for m in mla.matches)
    assert all(m.details["q_lora"] is (q_lora_rank is not None) for m in mla.matches)
    assert all(m.details["head_num"] == 4 for m in mla.matches)
    facts = report.facts["mla_layers"]
    assert len(facts) == NUM_LAYERS and all(f["node"] for f in facts)
    # the q and kv RMSNorms went into the fused op: only the input/post-attention/final norms remain
    assert report.count("ascend.rms_norm") + report.count("ascend.add_rms_norm") == 2 * NUM_LAYERS + 1
    per_layer = ops_by_layer(report)
    assert all(per_layer[f"model.layers.{i}"]["ascend.mla_prolog"] == 1 for i in range(NUM_LAYERS))
    assert rel_diff(out, ref) <= 1e-4


@pytest.mark.parametrize("interleave", [True, False])
def test_batch_of_sequences(interleave):
    """HF's RoPE tables are [1, S, Dr] for a batch of B sequences: the op gets one row per token."""
    model, inputs = models.deepseek_v3("grouped_mm", batch=2, tokens=8, rope_interleave=interleave)
    with torch.no_grad():
        ref = model(*inputs)
    out, (report,) = compile_and_run(model, inputs, compiler="eager", strict=True)
    assert report.count("ascend.mla_prolog") == NUM_LAYERS
    assert rel_diff(out, ref) <= 1e-4


def test_tables_with_too_few_rows_are_a_clear_error():
    x = torch.randn(2, 4, 16)
    args = (
        x,
        torch.randn(16, 8),
        torch.randn(8, 2 * 12),
        None,
        torch.randn(16, 8 + 4),
        torch.ones(8),
        torch.ones(8),
        torch.randn(1, 4, 4),
        torch.randn(1, 4, 4),
    )
    with pytest.raises(ValueError, match="ascend.mla_prolog: rope_sin .* must have one row per token of token_x"):
        OP(*args, head_num=2)


def test_bf16_model():
    model, inputs = models.deepseek_v3("grouped_mm", dtype=torch.bfloat16, num_layers=2)
    with torch.no_grad():
        ref = model(*inputs)
    out, reports = compile_and_run(model, inputs, compiler="eager")
    assert reports[0].count("ascend.mla_prolog") == 2
    assert rel_diff(out, ref) <= 3e-2


def test_mla_pass_alone_matches_inline_norms():
    """Without the norm pass the RMSNorms are still Hugging Face's inline math: still fused."""
    model, inputs = models.deepseek_v3("grouped_mm", num_layers=1, first_k_dense_replace=1)
    with torch.no_grad():
        ref = model(*inputs)
    out, reports = compile_and_run(model, inputs, compiler="eager", passes="cleanup,mla")
    assert reports[0].count("ascend.mla_prolog") == 1
    assert rel_diff(out, ref) <= 1e-4


def test_unmatched_form_is_a_near_miss():
    """attention_bias=True makes the projections addmm: no form covers it, reported, graph kept."""
    model, inputs = models.deepseek_v3("grouped_mm", num_layers=1, attention_bias=True)
    with torch.no_grad():
        ref = model(*inputs)
    out, reports = compile_and_run(model, inputs, compiler="eager")
    mla = reports[0].passes["mla"]
    assert reports[0].count("ascend.mla_prolog") == 0
    assert [nm.layer for nm in mla.near_misses] == ["model.layers.0"]
    assert rel_diff(out, ref) <= 1e-4


# ------------------------------------------------------------------------------ the op
B, S, HE, HCQ, N, D, DR, HCKV = 2, 3, 16, 12, 2, 6, 4, 8


def _args(dtype, q_lora=True, absorb=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    return (
        t(B, S, HE),
        t(HE, HCQ) if q_lora else None,
        t(HCQ if q_lora else HE, N * (D + DR)),
        t(N, D, HCKV) if absorb else None,
        t(HE, HCKV + DR),
        t(HCQ) if q_lora else None,
        t(HCKV),
        t(B, S, DR),
        t(B, S, DR),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "q_lora,absorb,interleave", [(True, False, True), (True, True, False), (False, False, False), (False, True, True)]
)
def test_opcheck(dtype, q_lora, absorb, interleave):
    torch.library.opcheck(
        OP, _args(dtype, q_lora, absorb), {"head_num": N, "rmsnorm_epsilon_cq": 1e-6, "rope_interleave": interleave}
    )


def _formula(x, w_dq, w_uq_qr, w_uk, w_dkv_kr, g_cq, g_ckv, theta, eps, interleave):
    """Token by token, head by head, with RoPE as a complex rotation of (x_j, x_j') pairs."""

    def rms(v, g):
        return v / math.sqrt(float((v * v).mean()) + eps) * g

    def rope(v):
        h = DR // 2
        pairs = (v[0::2], v[1::2]) if interleave else (v[:h], v[h:])
        z = torch.complex(*pairs) * torch.polar(torch.ones(h, dtype=v.dtype), theta_t)
        return torch.cat([z.real, z.imag])

    q_out, qr_out, kv_out, kr_out = [], [], [], []
    for b in range(x.shape[0]):
        for s in range(x.shape[1]):
            theta_t = theta[b, s]
            xt = x[b, s]
            cq = rms(xt @ w_dq, g_cq) if w_dq is not None else xt
            q = (cq @ w_uq_qr).view(N, D + DR)
            heads_q = [q[n, :D] @ w_uk[n] if w_uk is not None else q[n, :D] for n in range(N)]
            q_out.append(torch.stack(heads_q))
            qr_out.append(torch.stack([rope(q[n, D:]) for n in range(N)]))
            ckv = xt @ w_dkv_kr
            kv_out.append(rms(ckv[:HCKV], g_ckv))
            kr_out.append(rope(ckv[HCKV:]))
    shape = lambda ts: torch.stack(ts).view(B, S, *ts[0].shape)  # noqa: E731
    return shape(q_out), shape(qr_out), shape(kv_out), shape(kr_out)


@pytest.mark.parametrize(
    "q_lora,absorb,interleave", [(True, False, True), (True, True, False), (False, False, False), (True, False, False)]
)
def test_against_independent_formula(q_lora, absorb, interleave):
    x, w_dq, w_uq_qr, w_uk, w_dkv_kr, g_cq, g_ckv, _, _ = _args(torch.float32, q_lora, absorb)
    theta = torch.rand(B, S, DR // 2) * 6.0
    cos = torch.cat([theta.cos(), theta.cos()], -1)  # the op's (*, Dr) tables
    sin = torch.cat([theta.sin(), theta.sin()], -1)
    got = OP(
        x,
        w_dq,
        w_uq_qr,
        w_uk,
        w_dkv_kr,
        g_cq,
        g_ckv,
        sin,
        cos,
        head_num=N,
        rmsnorm_epsilon_cq=1e-5,
        rmsnorm_epsilon_ckv=1e-5,
        rope_interleave=interleave,
    )
    want = _formula(x, w_dq, w_uq_qr, w_uk, w_dkv_kr, g_cq, g_ckv, theta, 1e-5, interleave)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_two_dim_tokens_and_symbolic_token_count():
    args = list(_args(torch.float32))
    flat = [args[0].view(B * S, HE), *args[1:7], args[7].view(B * S, DR), args[8].view(B * S, DR)]
    full = OP(*args, head_num=N)
    two_d = OP(*flat, head_num=N)
    for a, b in zip(full, two_d):
        torch.testing.assert_close(a.reshape(b.shape), b)

    def fn(x, sin, cos):
        return OP(x, *args[1:7], sin, cos, head_num=N)

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager", dynamic=True, fullgraph=True)
    for tokens in (5, 9):
        x, sin, cos = torch.randn(tokens, HE), torch.randn(tokens, DR), torch.randn(tokens, DR)
        for a, b in zip(compiled(x, sin, cos), fn(x, sin, cos)):
            torch.testing.assert_close(a, b)


def test_bad_arguments_raise():
    args = list(_args(torch.float32))
    with pytest.raises(ValueError, match="head_num"):
        OP(*args, head_num=3)
    args[5] = None  # gamma_cq without weight_dq
    with pytest.raises(ValueError, match="together"):
        OP(*args, head_num=N)


@pytest.mark.parametrize("q_lora,absorb,interleave", [(True, False, True), (False, True, False)])
def test_bf16_op_matches_float32(q_lora, absorb, interleave):
    """bf16 inputs: every output within bf16 rounding of the float32 op on the same values (norms
    and the RoPE sum in float32, rounded once; matmuls accumulate in float32)."""
    args = _args(torch.bfloat16, q_lora, absorb, seed=1)
    kw = {"head_num": N, "rmsnorm_epsilon_cq": 1e-6, "rope_interleave": interleave}
    got = OP(*args, **kw)
    want = OP(*[a.float() if a is not None else None for a in args], **kw)
    for g, w in zip(got, want):
        assert g.dtype == torch.bfloat16 and g.shape == w.shape and g.is_contiguous()
        assert rel_diff(g.float(), w) <= 1e-2
