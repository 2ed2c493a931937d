"""Never silence: every MoE block the moe pass sees and does not fuse (router or experts) has a
near-miss with its layer and the difference, whatever the model; blocks are found by structure
(``passes/moe_candidates.py``: a router's expert ids feeding an experts computation), not by the
patterns.  Targets: tiny gpt-oss, Llama 4 and DeepSeek-V4 from transformers, a toy MoE the
patterns cannot know, and the bundled DeepSeek-V3 (no false alarm)."""

from __future__ import annotations

import pytest
import torch
from _helpers import compile_and_run, rel_diff, tiny_llama4
from torch import nn

from ascend_passes import models
from ascend_passes.passes import moe as moe_pass
from ascend_passes.passes import moe_candidates

transformers = pytest.importorskip("transformers")


# ----------------------------------------------------------------------------- tiny models
def _gpt_oss(impl: str):
    config = transformers.GptOssConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        use_cache=False,
        layer_types=["full_attention"] * 2,
    )
    config._attn_implementation = "eager"  # gpt-oss has no sdpa path
    config._experts_implementation = impl
    return models._seeded_lm(
        transformers.GptOssForCausalLM, config, "gpt_oss", torch.float32, batch=1, tokens=8, seed=0
    )


def _llama4():
    return tiny_llama4(1, torch.float32, tokens=8)  # no _experts_implementation: one bmm form


def _deepseek_v4(impl: str):
    # layer 0: hash-routed (tid2eid[input_ids]) under compressed sparse attention, whose indexer
    # has a top-k of its own (no router: must not be a candidate); layer 1: top-k routed
    config = transformers.DeepseekV4Config(
        vocab_size=128,
        hidden_size=32,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        q_lora_rank=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        use_cache=False,
        mlp_layer_types=["hash_moe", "moe"],
        layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
        o_groups=2,
        o_lora_rank=8,
        index_n_heads=2,
        index_head_dim=8,
        index_topk=4,
        sliding_window=8,
        hc_mult=2,
        hc_sinkhorn_iters=3,
    )
    config._attn_implementation = "eager"
    config._experts_implementation = impl
    model, inputs = models._seeded_lm(
        transformers.DeepseekV4ForCausalLM, config, "deepseek_v4", torch.float32, batch=1, tokens=8, seed=0
    )
    gen = torch.Generator().manual_seed(1)
    for name, table in model.named_buffers():
        if name.endswith("tid2eid"):  # distinct experts per token id (zeros route everything to expert 0)
            table.copy_(torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(table.shape[0])]))
    return model, inputs


class _ToyExperts(nn.Module):
    """A MoE block no pattern knows: tanh router scores, top-2, per-token expert weights gathered
    by id (bmm), ReLU-gated experts; optionally a graph break between router and experts."""

    def __init__(self, hidden: int = 16, inter: int = 8, experts: int = 4, graph_break: bool = False):
        super().__init__()
        self.router = nn.Linear(hidden, experts, bias=False)
        self.gate_up = nn.Parameter(torch.randn(experts, hidden, 2 * inter) / hidden**0.5)
        self.down = nn.Parameter(torch.randn(experts, inter, hidden) / inter**0.5)
        self.graph_break = graph_break

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens, hidden = x.shape
        weights, ids = torch.tanh(self.router(x)).topk(2, dim=-1)
        if self.graph_break:
            torch._dynamo.graph_break()
        ids = ids.reshape(-1)
        rows = x.repeat_interleave(2, dim=0).unsqueeze(1)
        gate, up = torch.bmm(rows, self.gate_up[ids]).chunk(2, dim=-1)
        out = torch.bmm(torch.relu(gate) * up, self.down[ids]).view(tokens, 2, hidden)
        return (out * weights.unsqueeze(-1)).sum(1)


class _Toy(nn.Module):
    def __init__(self, graph_break: bool = False):
        super().__init__()
        self.layers = nn.ModuleList([_ToyExperts(graph_break=graph_break) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


# ----------------------------------------------------------------------------- helpers
@pytest.fixture
def seen(monkeypatch):
    """What ``moe_candidates`` finds in the graph the moe pass receives, before any rewrite:
    ``(layer, kind, num_experts, reason for a wholly unfused block)`` per candidate."""
    found: list[tuple] = []
    run = moe_pass.MoePass.run

    def spy(self, gm, ctx):
        found.extend(
            (c.layer, c.kind, c.num_experts, moe_candidates.explain(c, {"router", "experts"}))
            for c in moe_candidates.find(gm.graph)
        )
        return run(self, gm, ctx)

    monkeypatch.setattr(moe_pass.MoePass, "run", spy)
    return found


def _silent_parts(report, layers: list[str]) -> list[tuple[str, str]]:
    """``(layer, part)`` for each router / experts part of a MoE layer that is neither fused nor
    named by a near-miss of the moe pass."""
    entries = {e.layer: e for e in report.facts["moe_layers"]}
    misses = report.passes["moe"].near_misses
    silent = []
    for layer in layers:
        entry = entries.get(layer)
        said = " ".join(nm.reason for nm in misses if nm.layer == layer)
        if (entry is None or entry.gating is None) and "router" not in said:
            silent.append((layer, "router"))
        if (entry is None or entry.init_routing is None) and "experts" not in said:
            silent.append((layer, "experts"))
    return silent


def _check(model, inputs, seen, expected: dict[str, tuple[str, int, list[str]]]):
    """Compile; the output equals the model's; the candidates before the rewrite are exactly the
    ``expected`` layers (kind, experts, reason fragments); after it no MoE part is silent."""
    with torch.no_grad():
        ref = model(*inputs)
    out, reports = compile_and_run(model, inputs, compiler="eager")
    assert rel_diff(out, ref) <= 1e-4
    (report,) = reports
    assert report.passes["moe"].status == "ok"
    assert sorted(c[0] for c in seen) == sorted(expected)
    for layer, kind, experts, reason in seen:
        want_kind, want_experts, fragments = expected[layer]
        assert (kind, experts) == (want_kind, want_experts), layer
        for fragment in fragments:
            assert fragment in reason, (layer, fragment, reason)
    assert _silent_parts(report, list(expected)) == []
    return report


GPT_OSS_EXPERTS = [
    "router not fused: it takes the top-2 of the raw logits, then a softmax over the 2 values",
    "gate and up are interleaved columns (::2 and 1::2), not the two halves of gate_up",
    "the activation is `(up + 1) * gate * sigmoid(1.702 * gate)` with gate/up clamped to [-inf, 7.0] and "
    "[-7.0, 7.0] (a swiglu_limit), not SwiGLU `up * silu(gate)`",
    "the expert matmuls add per-expert biases (the fused chain takes them in gpt-oss's form only)",
]
V4_EXPERTS = (
    "experts not fused: the SwiGLU's inputs are clamped first: gate/up clamped to [-inf, 10.0] and "
    "[-10.0, 10.0] (a swiglu_limit)"
)


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_gpt_oss_every_block_fused_or_explained(impl, seen):
    report = _check(*_gpt_oss(impl), seen, {f"model.layers.{i}": ("topk", 4, GPT_OSS_EXPERTS) for i in (0, 1)})
    entries = {e.layer: e for e in report.facts["moe_layers"]}
    for layer in ("model.layers.0", "model.layers.1"):  # experts fused (patterns/moe_gptoss.py), router too
        assert entries[layer].init_routing is not None and entries[layer].gating is not None, layer
    assert report.count("ascend.moe_init_routing_v2") == 2 and report.count("ascend.grouped_matmul") == 4


def test_llama4_every_block_fused_or_explained(seen):
    # before the rewrite, the structural search describes the unfused Llama 4 form
    fragments = [
        "router not fused: it scatters its top-1 logits into a dense [T, 4] matrix of -inf and applies sigmoid",
        "experts not fused: the router scores multiply the experts' INPUT (before the first expert matmul), "
        "in a form no pattern matched (Llama 4's own is fused: patterns/moe_llama4.py)",
        "every expert runs on every token (the input repeated 4 times, one batched matmul)",
    ]
    report = _check(*_llama4(), seen, {f"model.layers.{i}": ("topk", 4, fragments) for i in (0, 1)})
    # after it: the experts of both layers fused (patterns/moe_llama4.py), the router an explained near-miss
    assert report.count("ascend.moe_init_routing_v2") == 2 and report.count("ascend.grouped_matmul") == 4
    misses = report.passes["moe"].near_misses
    assert not [nm for nm in misses if "experts not fused" in nm.reason]
    routers = [nm for nm in misses if nm.reason.startswith("router not fused")]
    assert sorted(nm.layer for nm in routers) == ["model.layers.0", "model.layers.1"]
    assert all("without renormalising" in nm.reason and "its experts are fused" in nm.reason for nm in routers)


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_deepseek_v4_every_block_fused_or_explained(impl, seen):
    # the CSA layer's indexer top-k is no router: exactly the two MoE blocks are candidates
    _check(
        *_deepseek_v4(impl),
        seen,
        {
            "model.layers.0": (
                "lookup",
                None,
                ["router not fused: the expert ids come from a fixed table (", "hash routing", V4_EXPERTS],
            ),
            "model.layers.1": (
                "topk",
                8,
                [
                    "router not fused: it computes sqrtsoftplus scores (sqrt(softplus(logits))) "
                    "+ a per-expert correction bias before its top-2",
                    V4_EXPERTS,
                ],
            ),
        },
    )


def test_unknown_moe_form_is_explained_per_layer(seen):
    torch.manual_seed(0)
    model, x = _Toy().eval(), torch.randn(6, 16)
    report = _check(model, (x,), seen, {f"layers.{i}": ("topk", 4, []) for i in (0, 1)})
    misses = report.passes["moe"].near_misses
    assert [(nm.pattern, nm.layer) for nm in misses] == [("moe_block", "layers.0"), ("moe_block", "layers.1")]
    assert all(
        nm.reason
        == (
            "MoE block not fused: router not fused: no router pattern matched its scores: linear → tanh → top-2; "
            "experts not fused: the activation is `up * relu(gate)`, not SwiGLU `up * silu(gate)`"
        )
        for nm in misses
    )
    layers = {e.layer: e for e in report.facts["moe_layers"]}
    assert layers["layers.0"].num_experts == 4 and layers["layers.0"].unsupported == misses[0].reason


def test_router_split_from_its_experts_by_a_graph_break_is_explained():
    torch.manual_seed(0)
    model, x = _Toy(graph_break=True).eval(), torch.randn(6, 16)
    with torch.no_grad():
        ref = model(x)
    out, reports = compile_and_run(model, (x,), compiler="eager")
    assert rel_diff(out, ref) <= 1e-4
    # the block is split: the router's graph and the experts' graph (Dynamo compiles each frame
    # once; both layers run the same two graphs)
    assert [bool(r.count("aten.topk")) for r in reports] == [True, False]
    (router,), (experts,) = (r.passes["moe"].near_misses for r in reports)  # one each: never silence
    assert router.reason.startswith("MoE block not fused: the router's expert ids leave this graph"), router.reason
    assert "_experts_implementation" in router.reason
    assert router.reason.endswith("router: no router pattern matched its scores: linear → tanh → top-2")
    assert experts.reason.startswith("MoE experts not fused: their expert ids are a graph input ("), experts.reason
    assert "the router is in another graph (a Dynamo graph break" in experts.reason
    assert experts.reason.endswith(
        "experts not fused: the activation is `up * relu(gate)`, not SwiGLU `up * silu(gate)`"
    )


def test_bundled_deepseek_v3_no_false_alarm(seen):
    model, inputs = models.deepseek_v3("grouped_mm")
    with torch.no_grad():
        ref = model(*inputs)
    out, reports = compile_and_run(model, inputs, compiler="eager")
    assert rel_diff(out, ref) <= 1e-4
    moe = reports[0].passes["moe"]
    assert moe.near_misses == []
    # the finder sees both MoE blocks before the rewrite, and both fused after it
    assert sorted((c[0], c[1], c[2]) for c in seen) == [("model.layers.1", "topk", 16), ("model.layers.2", "topk", 16)]
    after = moe_candidates.find(reports[0].graph.graph)
    assert [(c.layer, c.router_fused, c.experts_fused) for c in after] == [
        ("model.layers.1", True, True),
        ("model.layers.2", True, True),
    ]


class _TwoExpertSigmoidRouter(nn.Module):
    """MiniMax-M2's router (sigmoid + correction bias, no groups, renormalised) over 2 experts:
    outside ``moe_gating_top_k``'s limits (E / group_count > 2), so the router is refused."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(16, 2, bias=False)
        self.bias = nn.Parameter(torch.randn(2))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.gate(x).sigmoid()
        ids = torch.topk(scores + self.bias, 1, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        return weights / weights.sum(dim=-1, keepdim=True), ids


def test_refused_renormalising_router_has_one_near_miss():
    """The ``_no_renorm`` variant of a refused router matches the router's first part (it ends at
    the gather): it must not add a second near-miss for the same router."""
    torch.manual_seed(0)
    model, x = _TwoExpertSigmoidRouter().eval(), torch.randn(5, 16)
    with torch.no_grad():
        ref = model(x)
    out, (report,) = compile_and_run(model, (x,), compiler="eager")
    assert all(rel_diff(o.float(), r.float()) <= 1e-6 for o, r in zip(out, ref))
    misses = report.passes["moe"].near_misses
    routers = [nm for nm in misses if nm.pattern in moe_pass._ROUTERS]
    assert [(nm.pattern, nm.reason) for nm in routers] == [
        ("sigmoid_router", "router not fused into moe_gating_top_k: 2 experts per group (the op needs more than 2)")
    ]
    assert all(nm.node == routers[0].node for nm in misses)  # one candidate: every near-miss names its top-k
