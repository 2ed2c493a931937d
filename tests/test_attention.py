"""The attention pass: SDPA's math fallback (v head dim ≠ q/k head dim) becomes CPU flash
attention with v zero-padded; a provably causal constant mask becomes ``is_causal``, any other
mask stays explicit; shapes the flash kernel does not take are left alone with a near-miss.  For
target cpu, a flash call then becomes ``ascend.attention`` on the unpadded value (kernels/attention.cpp),
its mask (if any) passed on."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _helpers import compile_and_run, rel_diff

import ascend_passes as ap
import ascend_passes.ops  # noqa: F401 - torch.ops.ascend
from ascend_passes import models
from ascend_passes.report import count_ops

aten = torch.ops.aten
FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default
OWN = torch.ops.ascend.attention.default
NUM_LAYERS = 3  # models.deepseek_v3's default


def _flash_nodes(report):
    return list(report.graph.graph.find_nodes(op="call_function", target=FLASH))


def _own_nodes(report):
    return list(report.graph.graph.find_nodes(op="call_function", target=OWN))


def _is_causal(node) -> bool:
    return bool(node.args[4] if len(node.args) > 4 else node.kwargs.get("is_causal", False))


# ------------------------------------------------------------------------------ DeepSeek MLA
@pytest.mark.parametrize("compiler", ["eager", "inductor"])
@pytest.mark.parametrize("batch,tokens", [(1, 16), (2, 1)])
def test_deepseek_attention_becomes_causal_flash(compiler, batch, tokens):
    model, inputs = models.deepseek_v3("grouped_mm", batch=batch, tokens=tokens)
    with torch.no_grad():
        ref = model(*inputs)
    out, reports = compile_and_run(model, inputs, compiler=compiler)
    (report,) = reports
    result = report.passes["attention"]
    assert result.status == "ok"
    patterns = [m.pattern for m in result.matches]
    assert patterns.count("sdpa_flash[mask]") == NUM_LAYERS
    assert patterns.count("causal_mask") == NUM_LAYERS
    assert patterns.count("cpu_attention") == NUM_LAYERS
    # every flash call (causal, no mask) became ascend.attention, on v as it is (16 columns: no padding)
    assert not _flash_nodes(report)
    nodes = _own_nodes(report)
    assert len(nodes) == NUM_LAYERS
    assert all(_is_causal(n) for n in nodes)
    assert all(n.args[2].meta["val"].shape[-1] == 16 and n.meta["val"].shape[-1] == 16 for n in nodes)
    assert report.count("aten._safe_softmax") == 0 and report.count("aten.bmm") == 0
    assert report.count("aten.constant_pad_nd") == 0
    # the key [k_nope | k_rope], written into new_empty by two copy_ (two slice_scatter, each a copy
    # of the whole key), is one cat; the output is copied to contiguous once, not twice
    assert report.count("aten.slice_scatter") == 0 and report.count("aten.new_empty") == 0
    for n in nodes:  # attention → transpose → [clone]: one clone (at S=1 a no-op)
        (after,) = n.users
        chain = [after, *after.users, *(x for u in after.users for x in u.users)]
        assert [c.target for c in chain].count(aten.clone.default) == 1, chain
    assert rel_diff(out, ref) <= 1e-4


def test_the_flash_form_before_the_cpu_kernel():
    """What the pass makes of the math path before the CPU step (the form an NPU graph keeps): flash on v
    zero-padded to the q/k head dim (24 + 8), its output sliced back, causal; checked on the graph of the
    pass run with the CPU step undone by hand (target npu would also run the lowering)."""
    from ascend_passes.passes import attention as attention_pass

    model, inputs = models.deepseek_v3("grouped_mm", batch=1, tokens=16)
    with torch.no_grad():
        ref = model(*inputs)
    seen = []
    original = attention_pass.to_cpu_attention
    try:
        attention_pass.to_cpu_attention = lambda node: seen.append(node) or "kept for this test"
        out, reports = compile_and_run(model, inputs, compiler="eager")
    finally:
        attention_pass.to_cpu_attention = original
    (report,) = reports
    nodes = _flash_nodes(report)
    assert len(nodes) == len(seen) == NUM_LAYERS and not _own_nodes(report)
    assert all(_is_causal(n) and "attn_mask" not in n.kwargs for n in nodes)
    assert report.count("aten.constant_pad_nd") == NUM_LAYERS
    assert [m.reason for m in report.passes["attention"].near_misses] == ["kept for this test"] * NUM_LAYERS
    for n in nodes:  # flash → slice → [clone] → transpose → [clone]: one clone (at S=1 the second is a no-op)
        (out0,) = [u for u in n.users if u.args[1] == 0]
        (sliced,) = out0.users
        (after,) = sliced.users
        chain = [after, *after.users, *(x for u in after.users for x in u.users)]
        assert [c.target for c in chain].count(aten.clone.default) == 1, chain
    assert rel_diff(out, ref) <= 1e-4


def _functional_graph(fn, *inputs):
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(torch.func.functionalize(fn, remove="mutations_and_views"), tracing_mode="fake")(*inputs)


@pytest.mark.parametrize(
    "pieces, folded",
    [
        ([(0, 4), (4, None)], True),  # covers the last dim: one cat
        ([(4, None), (0, 4)], True),  # in any order
        ([(0, 4), (5, None)], False),  # a gap: the buffer's own (uninitialised) values stay visible
        ([(0, 5), (4, None)], False),  # an overlap: the later write wins
    ],
)
def test_slice_writes_of_a_fresh_buffer_become_one_cat(pieces, folded):
    from ascend_passes.passes.attention import assemble_by_cat

    a, b = torch.randn(2, 3, 5, 6), torch.randn(2, 1, 5, 1)

    def key(a, b):
        out = a.new_empty(2, 3, 5, 10)
        out.zero_()  # defined values everywhere, so that the refused forms can be compared too
        for (start, end), src in zip(pieces, (a, b) if pieces[0][0] == 0 else (b, a)):
            width = (end or 10) - start
            out[..., start:end].copy_(src[..., :width] if src is a else src)
        return out

    gm = _functional_graph(key, a, b)
    want = gm(a, b)
    (last,) = [n for n in gm.graph.nodes if n.op == "output"][0].all_input_nodes
    assert last.target is aten.slice_scatter.default
    assert assemble_by_cat(last) is folded
    gm.graph.eliminate_dead_code()
    gm.recompile()
    assert gm.graph.find_nodes(op="call_function", target=aten.slice_scatter.default) == [] or not folded
    assert torch.equal(gm(a, b), want)


def test_without_the_pass_attention_stays_on_the_math_path():
    model, inputs = models.deepseek_v3("grouped_mm")
    _, reports = compile_and_run(model, inputs, compiler="eager", disable=("attention",))
    assert reports[0].count("aten._safe_softmax") == NUM_LAYERS
    assert not _flash_nodes(reports[0]) and not _own_nodes(reports[0])


def test_deepseek_bf16_flash_runs_on_bf16():
    """The math path upcasts bf16 to float32; the flash kernel takes bf16 as it is (float32
    accumulation inside): no float32 copies of q, k, v around it."""
    model, inputs = models.deepseek_v3("grouped_mm", dtype=torch.bfloat16)
    _, ref_reports = compile_and_run(model, inputs, compiler="eager", disable=("attention",))
    out, reports = compile_and_run(model, inputs, compiler="eager")
    (report,) = reports
    nodes = _own_nodes(report)
    assert len(nodes) == NUM_LAYERS and all(_is_causal(n) for n in nodes) and not _flash_nodes(report)
    assert [m.pattern for m in report.passes["attention"].matches].count("sdpa_flash[mask, upcast]") == NUM_LAYERS
    assert all(a.meta["val"].dtype == torch.bfloat16 for n in nodes for a in n.args[:3])
    assert all(n.meta["val"].dtype == torch.bfloat16 for n in nodes)
    # against the same pipeline without the attention rewrite (eager bf16 differs from any
    # compiled bf16 by routing flips on this random model, see README)
    with torch.no_grad():
        ref = torch.compile(model, backend="ascend_passes", options={"compiler": "eager", "disable": ("attention",)})(
            *inputs
        )
    assert rel_diff(out, ref) <= 2e-2


def test_equal_head_dims_flash_already_only_the_mask_goes():
    model, inputs = models.deepseek_v3("grouped_mm", v_head_dim=32)  # = 24 + 8
    with torch.no_grad():
        ref = model(*inputs)
    _, plain = compile_and_run(model, inputs, compiler="eager", disable=("attention",))
    assert all("attn_mask" in n.kwargs for n in _flash_nodes(plain[0]))  # SDPA's own flash path
    out, reports = compile_and_run(model, inputs, compiler="eager")
    patterns = [m.pattern for m in reports[0].passes["attention"].matches]
    assert patterns == ["causal_mask"] * NUM_LAYERS + ["cpu_attention"] * NUM_LAYERS  # no math path to rewrite
    assert reports[0].count("aten.constant_pad_nd") == 0
    assert not _flash_nodes(reports[0]) and len(_own_nodes(reports[0])) == NUM_LAYERS
    assert all(_is_causal(n) for n in _own_nodes(reports[0]))
    assert rel_diff(out, ref) <= 1e-4


# ------------------------------------------------------------------------------ masks
class Attention(torch.nn.Module):
    """q/k head dim 12, v head dim 6: SDPA takes its math path."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.q = torch.nn.Linear(16, 4 * 12)
        self.k = torch.nn.Linear(16, 4 * 12)
        self.v = torch.nn.Linear(16, 4 * 6)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, 4, 12).transpose(1, 2)
        k = self.k(x).view(b, s, 4, 12).transpose(1, 2)
        v = self.v(x).view(b, s, 4, 6).transpose(1, 2)
        if self.mode == "causal":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif self.mode == "input_mask":
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        elif self.mode == "window":  # constant, but a sliding window, not the causal mask
            i = torch.arange(s)
            keep = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < 3)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        elif self.mode == "none":
            out = F.scaled_dot_product_attention(q, k, v)
        elif self.mode == "strided_q":  # q's last dim strided (head-major features): not for the flash kernel
            q = self.q(x).view(b, s, 12, 4).permute(0, 3, 1, 2)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif self.mode == "mask_3d":
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[1])
        else:
            raise ValueError(self.mode)
        return out.transpose(1, 2).reshape(b, s, 4 * 6)


def _attention_inputs(padded: bool = True):
    torch.manual_seed(0)
    x = torch.randn(2, 8, 16)
    mask = torch.zeros(2, 1, 8, 8)
    if padded:  # left padding of the second sequence: its first query rows are fully masked
        mask[1, :, :, :3] = float("-inf")
    return x, mask


def _compiled_attention(mode: str):
    """``Attention(mode)`` compiled (eager compiler): its output, the uncompiled output and the report."""
    torch.manual_seed(0)
    model = Attention(mode).eval()
    inputs = _attention_inputs()
    with torch.no_grad():
        ref = model(*inputs)
    out, reports = compile_and_run(model, inputs, compiler="eager")
    (report,) = reports
    return out, ref, report


@pytest.mark.parametrize("mode,causal", [("causal", True), ("input_mask", False), ("window", False), ("none", False)])
def test_masks(mode, causal):
    out, ref, report = _compiled_attention(mode)
    masked = mode not in ("causal", "none")
    (node,) = _own_nodes(report)  # every one, masked or not, on the CPU kernel
    assert not _flash_nodes(report)
    assert _is_causal(node) is causal
    assert (len(node.args) > 5 and node.args[5] is not None) is masked
    assert not report.passes["attention"].near_misses
    assert report.count("aten._safe_softmax") == 0
    assert torch.isfinite(out).all()
    assert rel_diff(out, ref) <= 1e-4


def test_a_3d_mask_is_not_rewritten():
    out, ref, report = _compiled_attention("mask_3d")
    assert not _flash_nodes(report)
    assert report.count("aten._safe_softmax") == 1 and report.count("aten.bmm") == 2
    (miss,) = report.passes["attention"].near_misses
    assert "2-D or 4-D" in miss.reason
    assert torch.equal(out, ref) or rel_diff(out, ref) <= 1e-6


def test_a_strided_last_dim_stays_on_the_math_path():
    """torch 2.13's CPU flash kernel reads wrong values from an input whose last dim is strided (measured:
    tests/test_attention_kernel.py): such an attention is left as it is, with a near-miss saying why."""
    out, ref, report = _compiled_attention("strided_q")
    assert not _flash_nodes(report) and not _own_nodes(report)
    assert report.count("aten._safe_softmax") == 1
    reasons = [m.reason for m in report.passes["attention"].near_misses]
    assert any("q with a strided last dim" in r for r in reasons), reasons
    assert rel_diff(out, ref) <= 1e-5


def test_count_ops_sees_the_attention():
    model, inputs = models.deepseek_v3("grouped_mm", num_layers=1, first_k_dense_replace=1)
    _, reports = compile_and_run(model, inputs, compiler="eager")
    assert count_ops(reports[0].graph, OWN) == 1 and count_ops(reports[0].graph, FLASH) == 0


def test_dynamic_lengths_keep_the_key_assembly_folded():
    """Under dynamic shapes (a second prompt length: Dynamo recompiles with a symbolic token count; vLLM always
    compiles so) the key written piece by piece into a fresh buffer still becomes one ``cat``: only the
    concatenated dim (the head dim) must be static. Hugging Face's mask, built from ``arange``s of the symbolic
    length (and its packed-sequence check on the position ids), is proven causal symbolically: no mask input."""
    model, (ids,) = models.deepseek_v3("grouped_mm")
    longer = torch.randint(0, 256, (ids.shape[0], ids.shape[1] + 5))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="ascend_passes", options={"compiler": "eager"})
    with torch.no_grad(), ap.capture() as reports:
        compiled(ids)
        out = compiled(longer)
        want = model(longer)
    static, dynamic = reports
    inputs = [n.meta.get("val") for n in dynamic.graph.graph.find_nodes(op="placeholder")]
    assert any(isinstance(v, torch.SymInt) for v in inputs)  # the token count
    for report in (static, dynamic):
        assert report.count("aten.slice_scatter") == 0
        assert report.count("ascend.attention") == NUM_LAYERS
        assert all(_is_causal(n) and (len(n.args) < 6 or n.args[5] is None) for n in _own_nodes(report))
    assert rel_diff(out, want) < 1e-4


# ------------------------------------------------------------------------------ masks of a symbolic length
class ArangeMask(torch.nn.Module):
    """An additive mask built inside the model from ``arange(s)`` of the token count: under ``dynamic=True``
    its size is a symbol, so the pass can only prove it causal symbolically (``passes/_symbolic_mask.py``)."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.qkv = Attention("none")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        a = self.qkv
        q = a.q(x).view(b, s, 4, 12).transpose(1, 2)
        k = a.k(x).view(b, s, 4, 12).transpose(1, 2)
        v = a.v(x).view(b, s, 4, 6).transpose(1, 2)
        i = torch.arange(s)
        q_idx, kv_idx = i[:, None], i[None, :]
        if self.mode == "causal":
            keep = kv_idx <= q_idx
        elif self.mode == "window":  # causal while s <= 3, a sliding window beyond
            keep = (kv_idx <= q_idx) & (q_idx - kv_idx < 3)
        elif self.mode == "shifted":  # one key past the diagonal
            keep = kv_idx <= q_idx + 1
        elif self.mode == "wrapped":  # i[i - 1]: index -1 wraps to the last position (torch's negative indexing)
            j = i[i - 1]
            keep = j[None, :] <= j[:, None]
        else:
            raise ValueError(self.mode)
        mask = torch.where(keep, torch.tensor(0.0), torch.tensor(float("-inf")))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out.transpose(1, 2).reshape(b, s, 4 * 6)


@pytest.mark.parametrize("mode,causal", [("causal", True), ("window", False), ("shifted", False), ("wrapped", False)])
def test_masks_of_a_symbolic_length(mode, causal):
    """Only the mask that is causal at every length becomes ``is_causal``: a sliding window (causal at lengths up to
    its width), a shifted diagonal and a mask read through a wrapping negative index stay masks, and every
    compiled output equals the model's at lengths past the window."""
    torch.manual_seed(0)
    model = ArangeMask(mode).eval()
    torch._dynamo.reset()
    compiled = torch.compile(model, dynamic=True, backend="ascend_passes", options={"compiler": "eager"})
    with torch.no_grad(), ap.capture() as reports:
        outs = [(compiled(x), model(x)) for x in (torch.randn(1, 8, 16), torch.randn(1, 13, 16))]
    (report,) = reports  # one graph for both lengths
    (node,) = _own_nodes(report)
    assert _is_causal(node) is causal
    assert (len(node.args) > 5 and node.args[5] is not None) is not causal
    for out, ref in outs:
        assert torch.isfinite(out).all() and rel_diff(out, ref) <= 1e-4


def test_sliding_window_layers_keep_their_mask_at_every_length():
    """Hugging Face Qwen3 with a sliding-window layer (window 4) and a full-attention layer, called at lengths 6,
    11 and 13 (the last two: Dynamo's recompile with a symbolic length): only the full layer's mask becomes
    ``is_causal``, in the static and the symbolic graph alike; the window's mask, causal at lengths up to 4, stays,
    and the logits equal the model's."""
    import transformers  # a test dependency (pyproject's [test]): not skipped when missing

    config = transformers.Qwen3Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        use_sliding_window=True,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = models.CausalLMLogits(transformers.Qwen3ForCausalLM(config).eval())
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="ascend_passes", options={"compiler": "eager"})
    with torch.no_grad(), ap.capture() as reports:
        for tokens in (6, 11, 13):
            ids = torch.randint(0, 128, (1, tokens))
            assert rel_diff(compiled(ids), model(ids)) <= 1e-5
    static, dynamic = reports
    assert any(isinstance(n.meta.get("val"), torch.SymInt) for n in dynamic.graph.graph.find_nodes(op="placeholder"))
    for report in (static, dynamic):
        attentions = _own_nodes(report)
        assert len(attentions) == 2
        assert sorted(_is_causal(n) for n in attentions) == [False, True]
