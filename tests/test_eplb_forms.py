"""EPLB over every fused-experts form the moe pass builds (issue 19): Llama 4 (router ``router``, weights
in × out, scores applied to the experts' input, top-1 sigmoid), gpt-oss (router ``router``, weights in ×
out, per-expert biases), DeepSeek-V4 top-k and hash layers (``tid2eid`` gives logical experts; EPLB maps
them to replicas after the table) — and the refusals where EPLB cannot indirect a layer.

Each model is attached with redundant experts and given a placement that moves experts (``rebalance``
on a skewed load), compiled with ``eplb`` on, and checked: output equal to the un-attached, uncompiled
model (fp32 ≤ 1e-4 relative), one ``eplb_map`` / ``eplb_record_load`` per MoE layer and no logical
weight view left, every slot holding its expert's weights (biases too), and the placement honoured slot
by slot: the recorded per-slot load equals ``eplb_map`` of the eager router's ids over the state's
tables.  A second placement is then applied without recompiling.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _helpers import compile_and_run, forward_with_hooks, rel_diff, router_counts, tiny_gpt_oss_block, tiny_llama4

import ascend_passes as ap
import ascend_passes.ops  # noqa: F401  (registers torch.ops.ascend)
from ascend_passes.eplb.state import attach, find_moe_blocks, state_of
from ascend_passes.errors import ConfigError

transformers = pytest.importorskip("transformers")

ops = torch.ops.ascend
TOL = 1e-4
EPLB = {"compiler": "eager", "strict": True, "eplb": {"enabled": True}}


# ----------------------------------------------------------------------------- shared checks
def _ids(model, inputs, routers, pick) -> list[torch.Tensor]:
    """The eager routers' logical expert ids ``[T, k]`` per MoE layer (``pick(output)`` reads them)."""
    seen: dict[int, torch.Tensor] = {}
    forward_with_hooks(model, inputs, routers, lambda i, mod, args, out: seen.__setitem__(i, pick(out)))
    return [seen[i] for i in range(len(routers))]


def _move(state, seed: int = 0) -> torch.Tensor:
    """A placement from a skewed load (hot experts replicated, experts packed onto other slots);
    returns it after checking that it moves experts in every layer."""
    gen = torch.Generator().manual_seed(seed)
    share = 1.0 / torch.arange(1, state.num_logical + 1, dtype=torch.float64) ** 1.5
    load = torch.stack([(share[torch.randperm(state.num_logical, generator=gen)] * 1000).long() for _ in state.layers])
    state.rebalance(load)
    phy2log = state.phy2log
    default = torch.arange(state.num_physical) % state.num_logical
    assert all((row != default).any() for row in phy2log)
    return phy2log


def _assert_slots_hold_their_experts(state, logical: list[dict[str, torch.Tensor]]) -> None:
    """Slot ``p`` of every physical tensor (weights and biases) holds logical expert ``phy2log[p]``'s."""
    for layer, tensors, row in zip(state.layers, logical, state.phy2log):
        for name, w in tensors.items():
            assert torch.equal(getattr(layer.experts, f"eplb_{name}").detach(), w[row]), (layer.name, name)


def _assert_placement_honoured(state, ids: list[torch.Tensor]) -> None:
    """The compiled graph routed every (token, expert) pair to the slot the state's tables give it:
    the recorded per-slot load is ``eplb_map`` of the eager router's ids, slot by slot."""
    for layer, layer_ids in zip(state.layers, ids):
        phys = ops.eplb_map(layer_ids.to(torch.int32), layer.log2phy, layer.replica_count)
        want = torch.bincount(phys.flatten().long(), minlength=state.num_physical)
        assert torch.equal(layer.expert_load, want), layer.name


def _assert_eplb_graph(report, layers: int, num_physical: int) -> None:
    assert report.passes["eplb"].counts() == {"eplb_indirection": layers}
    assert report.passes["eplb"].near_misses == []
    assert report.count("ascend.eplb_map") == layers and report.count("ascend.eplb_record_load") == layers
    assert report.count("ascend.eplb_logical_weight") == 0  # every grouped matmul reads the physical slots
    inits = [n for n in report.graph.graph.nodes if n.target is ops.moe_init_routing_v2.default]
    assert len(inits) == layers
    assert all(n.kwargs["expert_num"] == num_physical for n in inits)


def _run_moved(model, inputs, ids, logical):
    """Attach (4 redundant slots over 4 ranks), move experts, compile with EPLB; then a second
    placement without recompiling.  Returns the state, the first report and both outputs."""
    state = attach(model, {"num_redundant_experts": 4, "ep_size": 4})
    _move(state)
    _assert_slots_hold_their_experts(state, logical)
    compiled = torch.compile(model, backend="ascend_passes", options=EPLB)
    torch._dynamo.reset()
    with torch.no_grad(), ap.capture() as reports:
        out = compiled(*inputs)
    (report,) = reports
    _assert_placement_honoured(state, ids)
    _move(state, seed=1)  # another placement: tables and weights copied in place
    _assert_slots_hold_their_experts(state, logical)
    with torch.no_grad(), ap.capture() as again:
        out2 = compiled(*inputs)
    assert again == []  # no recompilation
    _assert_placement_honoured(state, ids)
    return state, report, out, out2


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


# ----------------------------------------------------------------------------- Llama 4
class _Blocks(torch.nn.Module):
    """Every decoder layer's MoE block (``feed_forward`` / ``mlp``) on one hidden state: the graph the
    moe and eplb passes work on, without the attention whose tracing dominates a full-model compile;
    module paths stay ``lm.model.layers.<i>...`` so reports name the model's layers."""

    def __init__(self, lm: torch.nn.Module, block: str) -> None:
        super().__init__()
        self.lm, self.block = lm, block

    def forward(self, hidden: torch.Tensor, *args: torch.Tensor) -> list[torch.Tensor]:
        outs = [getattr(layer, self.block)(hidden, *args) for layer in self.lm.model.layers]
        return [o[0] if isinstance(o, tuple) else o for o in outs]


def _llama4(top_k: int = 1):
    """The MoE blocks of a tiny 2-layer Llama 4 text model (4 experts) on 16 tokens."""
    model, _ = tiny_llama4(top_k, torch.float32, tokens=16)
    hidden = torch.randn(1, 16, 32, generator=torch.Generator().manual_seed(1))
    return _Blocks(model.lm, "feed_forward").eval(), (hidden,)


def _llama4_routers(model):
    return [layer.feed_forward.router for layer in model.lm.model.layers]


def test_llama4_experts_indirected_with_moved_placement():
    """Llama 4's MoE block has ``router`` (not ``gate``) and in × out weights ``[E, H, 2I]``: attached,
    its fused chain routes over the physical slots, the router's scores still scale the rows."""
    model, inputs = _llama4(top_k=1)
    with torch.no_grad():
        ref = model(*inputs)
    k = model.lm.config.num_experts_per_tok
    ids = _ids(model, inputs, _llama4_routers(model), lambda out: torch.topk(out[1], k, dim=1).indices)
    assert all(len(set(i.flatten().tolist())) == 4 for i in ids)  # every expert gets tokens
    logical = [
        {"gate_up_proj": b.gate_up_proj.detach().clone(), "down_proj": b.down_proj.detach().clone()}
        for _, b in find_moe_blocks(model)
    ]
    state, report, out, out2 = _run_moved(model, inputs, ids, logical)
    assert [layer.name for layer in state.layers] == [f"lm.model.layers.{i}.feed_forward.experts" for i in range(2)]
    assert state.num_physical == 8 and state.layers[0].experts.eplb_gate_up_proj.shape == (8, 32, 32)
    for o, o2, r in zip(out, out2, ref):
        assert rel_diff(o, r) <= TOL and rel_diff(o2, r) <= TOL
    _assert_eplb_graph(report, 2, 8)
    assert sorted(m.layer for m in report.passes["moe"].matches if m.pattern == "llama4_moe") == [
        "model.layers.0",
        "model.layers.1",
    ]
    # the grouped matmuls read the physical in × out weights as they are (no transpose)
    gmms = [n for n in report.graph.graph.nodes if n.target is ops.grouped_matmul.default]
    assert all(g.args[1][0].op == "placeholder" for g in gmms), [g.args[1][0].format_node() for g in gmms]


def test_llama4_graph_reads_the_slot_the_map_picks():
    """Zeroing the weights of one slot that the map sends tokens to changes the compiled output: the
    graph computes the physical slots, not a logical copy."""
    model, inputs = _llama4(top_k=1)
    state = attach(model, {"num_redundant_experts": 4, "ep_size": 4})
    _move(state)
    compiled = torch.compile(model, backend="ascend_passes", options=EPLB)
    torch._dynamo.reset()
    with torch.no_grad():
        before = compiled(*inputs)
    layer = state.layers[0]
    slot = int(layer.expert_load.argmax())
    with torch.no_grad():
        layer.experts.eplb_down_proj[slot].zero_()
        after = compiled(*inputs)
    assert rel_diff(after[0], before[0]) > 1e-3 and torch.equal(after[1], before[1])


# ----------------------------------------------------------------------------- gpt-oss
def _gpt_oss(experts: str):
    block = tiny_gpt_oss_block(experts)  # nonzero biases: a bias left in logical order is visible
    return block, (torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(1)),)


@pytest.mark.parametrize("experts", ["grouped_mm", "batched_mm"])
def test_gpt_oss_experts_and_biases_indirected(experts):
    block, inputs = _gpt_oss(experts)
    with torch.no_grad():
        ref = block(*inputs)[0]
    ids = _ids(block, inputs, [block.router], lambda out: out[2])
    names = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")
    logical = [{n: getattr(block.experts, n).detach().clone() for n in names}]
    state, report, out, out2 = _run_moved(block, inputs, ids, logical)
    assert rel_diff(out[0], ref) <= TOL and rel_diff(out2[0], ref) <= TOL
    _assert_eplb_graph(report, 1, 12)
    assert block.experts.eplb_gate_up_proj_bias.shape == (12, 64)
    assert block.experts.eplb_down_proj_bias.shape == (12, 64)
    logical_names = ("experts.gate_up_proj_bias", "experts.down_proj_bias")
    assert not any(n.endswith(logical_names) for n, _ in block.named_parameters())
    # both grouped matmuls add the physical biases
    gmms = [n for n in report.graph.graph.nodes if n.target is ops.grouped_matmul.default]
    assert len(gmms) == 2 and all(g.kwargs["bias"][0].op == "placeholder" for g in gmms)
    # the attached module's eager view of a bias is the logical one
    with torch.no_grad():
        assert torch.equal(block.experts.gate_up_proj_bias, logical[0]["gate_up_proj_bias"])


def test_gpt_oss_bias_update_by_logical_name_reaches_every_replica():
    """``load_weight`` of one expert's bias under its logical name writes every replica's slot; the
    compiled model then equals the un-attached model given the same bias (no recompilation)."""
    from ascend_passes.weights import WeightLoadError, load_weight

    block, inputs = _gpt_oss("grouped_mm")
    plain = copy.deepcopy(block)
    state = attach(block, {"num_redundant_experts": 4, "ep_size": 4})
    _move(state)
    hot = int(state.layers[0].replica_count.argmax())  # an expert with several replicas
    assert int(state.layers[0].replica_count[hot]) > 1
    compiled = torch.compile(block, backend="ascend_passes", options=EPLB)
    torch._dynamo.reset()
    with torch.no_grad():
        compiled(*inputs)
        new = torch.randn(64, generator=torch.Generator().manual_seed(2))
        load_weight(block, "experts.gate_up_proj_bias", new, expert_id=hot)
        plain.experts.gate_up_proj_bias[hot] = new
        slots = state.layers[0].log2phy[hot, : int(state.layers[0].replica_count[hot])]
        assert all(torch.equal(block.experts.eplb_gate_up_proj_bias[s], new) for s in slots.tolist())
        with ap.capture() as reports:
            out = compiled(*inputs)
        assert reports == [] and rel_diff(out[0], plain(*inputs)[0]) <= TOL
    with pytest.raises(WeightLoadError, match="load expert weights through the logical name"):
        load_weight(block, "experts.eplb_gate_up_proj_bias", new, expert_id=int(slots[0]))


def test_experts_bias_of_another_shape_is_refused_before_anything_changes():
    block, _ = _gpt_oss("grouped_mm")
    block.experts.down_proj_bias = torch.nn.Parameter(torch.zeros(64))  # one bias for all experts
    with pytest.raises(ConfigError) as err:
        attach(block, {"num_redundant_experts": 0})
    assert str(err.value) == (
        "experts.down_proj_bias has shape [64]; EPLB needs per-expert biases [num_experts=8, features] "
        "to move them with their expert's weights"
    )
    assert state_of(block) is None and "gate_up_proj" in dict(block.experts.named_parameters())


# ----------------------------------------------------------------------------- DeepSeek-V4
class _V4Blocks(torch.nn.Module):
    """Every ``DeepseekV4SparseMoeBlock`` on one hidden state (the graph the moe pass works on)."""

    def __init__(self, lm: torch.nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor) -> list[torch.Tensor]:
        return [layer.mlp(hidden, input_ids=input_ids) for layer in self.lm.model.layers]


def _v4(**overrides):
    from ascend_passes import models

    model, (ids,) = models.deepseek_v4("grouped_mm", num_layers=2, num_hash_layers=1, **overrides)
    hidden = torch.randn(1, ids.shape[1], model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    return _V4Blocks(model.lm).eval(), (hidden, ids)


@pytest.mark.parametrize("scoring", ["sigmoid", "sqrtsoftplus"])
def test_v4_topk_and_hash_layers_indirected_after_the_table(scoring):
    """Layer 0 is hash-routed: ``tid2eid[input_ids]`` picks *logical* experts (with sigmoid scoring the
    router is ``moe_gating_top_k``'s hash mode, reading the table at run time); EPLB maps those ids to
    replicas after the table, as for the top-k layer 1.  The placement moves experts in both."""
    module, inputs = _v4(scoring_func=scoring)
    with torch.no_grad():
        ref = module(*inputs)
    gates = [layer.mlp.gate for layer in module.lm.model.layers]
    ids = _ids(module, inputs, gates, lambda out: out[2])
    assert torch.equal(ids[0], gates[0].tid2eid[inputs[1].flatten()])  # the hash layer's ids are the table's
    logical = [
        {"gate_up_proj": b.gate_up_proj.detach().clone(), "down_proj": b.down_proj.detach().clone()}
        for _, b in find_moe_blocks(module)
    ]
    state, report, out, out2 = _run_moved(module, inputs, ids, logical)
    for o, o2, r in zip(out, out2, ref):
        assert rel_diff(o, r) <= TOL and rel_diff(o2, r) <= TOL
    _assert_eplb_graph(report, 2, 20)
    assert torch.equal(state.expert_load(), router_counts(module, inputs, 16))
    maps = [n for n in report.graph.graph.nodes if n.target is ops.eplb_map.default]
    if scoring == "sigmoid":  # the hash layer's map reads the hash-mode gating's logical ids
        gating = [n for n in report.graph.graph.nodes if n.target is ops.moe_gating_top_k.default]
        hashed = [n for n in gating if n.kwargs.get("tid2eid") is not None]
        assert len(hashed) == 1

        def gating_of(node):  # through the id casts
            while node.target is not ops.moe_gating_top_k.default and node.args:
                node = node.args[0]
            return node

        assert hashed[0] in {gating_of(m.args[0]) for m in maps}


# ----------------------------------------------------------------------------- refusals
class _RouterFillZero(torch.nn.Module):
    """``Llama4Router`` with the unselected experts' logits 0 instead of -inf: the moe pass leaves
    the experts unfused (every expert weighs in), so EPLB cannot route them over slots."""

    def __init__(self, router: torch.nn.Module) -> None:
        super().__init__()
        self.weight, self.top_k = router.weight, router.top_k

    def forward(self, hidden_states):
        logits = torch.nn.functional.linear(hidden_states, self.weight)
        top_value, top_idx = torch.topk(logits, self.top_k, dim=1)
        scores = torch.full_like(logits, 0.0).scatter_(1, top_idx, top_value)
        return torch.sigmoid(scores.float()).to(scores.dtype), logits


def test_unfused_layer_is_a_near_miss_naming_it_and_computes_exactly():
    """Layer 1's experts are not fused (its router is not Llama 4's): layer 0 is indirected, layer 1
    stays on the first replica of each expert, and the eplb pass says which layer and why."""
    model, inputs = _llama4(top_k=1)
    ff = model.lm.model.layers[1].feed_forward
    ff.router = _RouterFillZero(ff.router)
    with torch.no_grad():
        ref = model(*inputs)
    state = attach(model, {"num_redundant_experts": 4, "ep_size": 4})
    _move(state)
    out, (report,) = compile_and_run(model, inputs, **EPLB)
    for o, r in zip(out, ref):
        assert rel_diff(o, r) <= TOL
    eplb = report.passes["eplb"]
    assert eplb.counts() == {"eplb_indirection": 1}
    assert [m.layer for m in eplb.matches] == ["model.layers.0"]
    (miss,) = eplb.near_misses
    assert miss.layer == "model.layers.1" and miss.pattern == "eplb_indirection"
    assert miss.reason.startswith(
        "its experts read their weights through eplb_logical_weight but are not the fused chain "
        "(init_routing → grouped_matmul) EPLB routes over physical slots (the moe pass: "
    )
    assert miss.reason.endswith(
        "; this layer computes with the first replica of each expert, records no load and uses no redundant slot"
    )
    assert int(state.layers[1].expert_load.sum()) == 0 and int(state.layers[0].expert_load.sum()) == 16


def test_llama4_under_expert_parallelism_is_refused_naming_the_layer(monkeypatch):
    """Llama 4's scores reach the rows through ``expanded_row_idx``, which init_routing sets to -1 for
    other ranks' rows: under expert parallelism the pass refuses (ConfigError, graph unchanged)
    instead of a graph that fails at run time.  The EP group is faked (rank 0 of 2 holding its 4
    slots): the refusal happens while the graph is read, before any collective would run."""
    import ascend_passes.eplb.state as eplb_state
    from ascend_passes.passes.eplb import EplbPass

    model, inputs = _llama4(top_k=1)
    monkeypatch.setattr(eplb_state, "_ep_group", lambda cfg, ep_size: (object(), 0))
    monkeypatch.setattr(EplbPass, "_ep_for", lambda self, layer, num_physical, per_rank: ("fake_ep", 0))
    state = attach(model, {"num_redundant_experts": 4, "ep_size": 2})
    assert state.layers[0].experts.eplb_gate_up_proj.shape[0] == 4  # this rank's 4 of 8 slots
    torch._dynamo.reset()
    options = {"compiler": "eager", "strict": True, "eplb": {"enabled": True, "ep_size": 2}}
    with torch.no_grad(), pytest.raises(Exception) as err:
        torch.compile(model, backend="ascend_passes", options=options)(*inputs)
    inner = getattr(err.value, "inner_exception", err.value)
    assert isinstance(inner, ap.PassError), repr(err.value)
    assert isinstance(inner.__cause__, ConfigError)
    assert str(inner.__cause__) == (
        "MoE layers ['model.layers.0', 'model.layers.1']: their router scores scale the dispatched rows "
        "through init_routing's expanded_row_idx (Llama 4 applies the scores to the "
        "experts' input); under expert parallelism that index is -1 for the rows of other ranks' slots, so "
        "these layers take EPLB in one process only: attach and compile with eplb.ep_size=1"
    )


def test_model_with_some_experts_unfused_is_refused_at_attach():
    """A model whose MoE layers do not all hold fused expert weights: attach names the others and
    changes nothing (EPLB over some layers only would be silent about the rest)."""
    model, _ = _llama4(top_k=1)
    ff = model.lm.model.layers[1].feed_forward
    ff.experts = torch.nn.ModuleList([torch.nn.Linear(32, 32) for _ in range(4)])
    with pytest.raises(ConfigError) as err:
        attach(model, {"num_redundant_experts": 4, "ep_size": 4})
    assert str(err.value) == (
        "MoE blocks ['lm.model.layers.1.feed_forward.experts'] do not hold their experts as one fused "
        "[num_experts, ...] gate_up_proj/down_proj pair like lm.model.layers.0.feed_forward.experts, so "
        "EPLB cannot cover them and would cover only some layers; attach a model whose every MoE layer "
        "has fused expert weights"
    )
    assert state_of(model) is None
    assert "gate_up_proj" in dict(model.lm.model.layers[0].feed_forward.experts.named_parameters())
