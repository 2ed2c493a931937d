"""EPLB expert parallelism across processes: real processes (torch.multiprocessing spawn + gloo),
world sizes 2 and 4.  Every rank holds only its P/W physical slots; the compiled graph computes
the local experts and all-reduces the partial sums.  Checked: outputs equal the single-process
uncompiled model, the weight shapes, the collectives in the graph, recorded loads summed over the
ranks equal the eager router's counts, and a collective rebalance() (weights sent between ranks)
keeps outputs unchanged without recompiling; at world 2 also the sharded-token form
(``eplb.ep_tokens="sharded"``: all_gather → local experts → reduce_scatter) on one MoE block."""

from __future__ import annotations

import pytest
import torch
from _helpers import rel_diff, router_counts

from ascend_passes.spawn import run_on_ranks

# layer 0 dense, then MoE layers of 16 experts, top-4: 2 of them at world 2, 1 at world 4 (compiling on 4
# ranks at once on a 2-core CI box is the slow part)
NUM_EXPERTS = 16
JOIN_TIMEOUT_S = 120.0  # watchdog: a stuck rank (e.g. a collective mismatch) fails the test instead of hanging


def _zipf(num_layers: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    share = 1.0 / torch.arange(1, NUM_EXPERTS + 1, dtype=torch.float64) ** 1.2
    return torch.stack([(share[torch.randperm(NUM_EXPERTS, generator=gen)] * 10_000).long() for _ in range(num_layers)])


def _sharded_block(rank: int, world_size: int, redundant: int, base: torch.nn.Module) -> dict:
    """``eplb.ep_tokens="sharded"``: one MoE block fed this rank's token shard (as under sequence
    parallelism): all_gather → local experts → reduce_scatter gives this rank's rows of the
    single-process block's output."""
    import copy

    import ascend_passes as ap
    from ascend_passes.eplb.state import attach

    block = copy.deepcopy(next(m for _, m in base.named_modules() if hasattr(m, "gate") and hasattr(m, "experts")))
    hidden = torch.randn(
        1, 8 * world_size, block.experts.gate_up_proj.shape[-1], generator=torch.Generator().manual_seed(1)
    )
    counts = router_counts(block, (hidden,), NUM_EXPERTS)
    with torch.no_grad():
        ref = block(hidden)
    shard = hidden[:, 8 * rank : 8 * (rank + 1)]
    eplb = {"num_redundant_experts": redundant, "ep_size": world_size, "ep_tokens": "sharded"}
    state = attach(block, eplb)
    with torch.no_grad(), ap.capture() as reports:
        out = torch.compile(
            block,
            backend="ascend_passes",
            options={"compiler": "eager", "strict": True, "eplb": {"enabled": True, **eplb}},
        )(shard)
    c10d = torch.ops._c10d_functional
    (report,) = reports
    return {
        "sharded_vs_ref": rel_diff(out, ref[:, 8 * rank : 8 * (rank + 1)]),
        "sharded_shape": tuple(out.shape),
        "sharded_ops": [
            report.count(op)
            for op in (c10d.all_gather_into_tensor.default, c10d.reduce_scatter_tensor.default, c10d.all_reduce.default)
        ],
        "sharded_counts_ok": bool(torch.equal(state.global_expert_load(), counts)),
    }


def _rank(rank: int, world_size: int, redundant: int, num_layers: int) -> dict:  # a spawned rank
    import copy

    import ascend_passes as ap
    from ascend_passes import models
    from ascend_passes.eplb.state import attach

    c10d = torch.ops._c10d_functional
    base, inputs = models.deepseek_v3("grouped_mm", num_layers=num_layers)
    with torch.no_grad():
        ref = base(*inputs)  # the single-process, uncompiled model (same seed on every rank)
    counts = router_counts(base, inputs, NUM_EXPERTS)
    logical = [
        (m.gate_up_proj.detach().clone(), m.down_proj.detach().clone())
        for _, m in base.named_modules()
        if hasattr(m, "gate_up_proj") and m.gate_up_proj.dim() == 3
    ]

    model = copy.deepcopy(base)
    eplb = {"num_redundant_experts": redundant, "ep_size": world_size}
    state = attach(model, eplb)
    try:  # no logical view of the weights on an EP rank: the eager model refuses to run
        with torch.no_grad():
            model(*inputs)
        eager_error = None
    except ValueError as exc:
        eager_error = str(exc)

    options = {"compiler": "eager", "strict": True, "eplb": {"enabled": True, **eplb}}
    torch._dynamo.reset()
    with torch.no_grad(), ap.capture() as reports:
        compiled = torch.compile(model, backend="ascend_passes", options=options)
        out = compiled(*inputs)
    (report,) = reports
    nodes = list(report.graph.graph.nodes)
    inits = [n for n in nodes if n.target is torch.ops.ascend.moe_init_routing_v2.default]
    records = [n for n in nodes if n.target is torch.ops.ascend.eplb_record_load.default]
    maps = [n for n in nodes if n.target is torch.ops.ascend.eplb_map.default]
    physical_load = state.physical_load()
    rank_counts = state.expert_load()
    global_counts = state.global_expert_load()  # collective

    # collective rebalance on a Zipf load: weights move between ranks, outputs unchanged
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    zipf = _zipf(state.num_layers)
    before = state.rank_balance(zipf).max().item()
    old = state.phy2log
    state.rebalance(zipf)
    after = state.rank_balance(zipf).max().item()
    slots_ok = all(
        torch.equal(layer.experts.eplb_gate_up_proj.detach(), gu[layer.phy2log[state.local_slots]])
        and torch.equal(layer.experts.eplb_down_proj.detach(), dn[layer.phy2log[state.local_slots]])
        for layer, (gu, dn) in zip(state.layers, logical)
    )
    with torch.no_grad(), ap.capture() as reports_after:
        out_after = compiled(*inputs)
    result = {
        "rank": rank,
        "eager_error": eager_error,
        "out_vs_ref": rel_diff(out, ref),
        "out_after_vs_ref": rel_diff(out_after, ref),
        "recompiled": len(reports_after) + torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs,
        "weight_shapes": [
            (tuple(layer.experts.eplb_gate_up_proj.shape), tuple(layer.experts.eplb_down_proj.shape))
            for layer in state.layers
        ],
        "logical_shapes": [(tuple(gu.shape), tuple(dn.shape)) for gu, dn in logical],
        "table_shapes": [
            (tuple(layer.log2phy.shape), tuple(layer.phy2log.shape), tuple(layer.expert_load.shape))
            for layer in state.layers
        ],
        "local_slots": (state.local_slots.start, state.local_slots.stop),
        "all_reduce": report.count(c10d.all_reduce.default),
        "wait_tensor": report.count(c10d.wait_tensor.default),
        "eplb_map": len(maps),
        "map_ranks": [n.kwargs.get("rank", 0) for n in maps],
        "active_ranges": [list(n.kwargs["active_expert_range"]) for n in inits],
        "record_ranges": [list(n.kwargs.get("active_expert_range", [])) for n in records],
        "expert_num": [n.kwargs["expert_num"] for n in inits],
        "physical_load": physical_load,
        "rank_counts": rank_counts,
        "global_counts": global_counts,
        "counts": counts,
        "moved": int((state.phy2log != old).sum()),
        "old_phy2log": old,
        "new_phy2log": state.phy2log,
        "balance": (before, after),
        "slots_ok": slots_ok,
        "load_after": state.global_expert_load(),
    }
    if world_size == 2:
        result.update(_sharded_block(rank, world_size, redundant, base))
    # plain lists: tensors through a Queue are shared-memory handles that die with the process
    return {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in result.items()}


def _run(world_size: int, redundant: int, num_layers: int) -> list[dict]:
    return run_on_ranks(_rank, world_size, redundant, num_layers, timeout_s=JOIN_TIMEOUT_S)


@pytest.mark.parametrize(("world_size", "redundant", "num_layers"), [(2, 2, 3), (4, 4, 2)])
def test_expert_parallel_matches_single_process(world_size: int, redundant: int, num_layers: int) -> None:
    results = _run(world_size, redundant, num_layers)
    assert [r["rank"] for r in results] == list(range(world_size))
    num_physical = NUM_EXPERTS + redundant
    per_rank = num_physical // world_size
    num_moe = num_layers - 1
    for r in results:
        r.update(
            {k: torch.tensor(r[k]) for k in ("physical_load", "rank_counts", "global_counts", "counts", "load_after")}
        )
        rank = r["rank"]
        # outputs equal the single-process uncompiled model, before and after rebalance()
        assert r["out_vs_ref"] <= 1e-5, r
        assert r["out_after_vs_ref"] <= 1e-5, r
        assert r["recompiled"] == 0, r
        # memory: P/W slots per rank; the maps stay global
        assert r["weight_shapes"] == [((per_rank, *gu[1:]), (per_rank, *dn[1:])) for gu, dn in r["logical_shapes"]], r
        assert r["table_shapes"] == [((NUM_EXPERTS, redundant + 1), (num_physical,), (num_physical,))] * num_moe
        assert r["local_slots"] == (rank * per_rank, (rank + 1) * per_rank)
        # the graph: one all_reduce (+ wait) per MoE layer, routing over this rank's slots only
        assert r["all_reduce"] == num_moe and r["wait_tensor"] == num_moe, r
        assert r["eplb_map"] == num_moe and r["map_ranks"] == [0] * num_moe
        assert r["active_ranges"] == [[rank * per_rank, (rank + 1) * per_rank]] * num_moe
        assert r["record_ranges"] == r["active_ranges"]
        assert r["expert_num"] == [num_physical] * num_moe
        # each rank counts only its own slots ...
        outside = torch.ones(num_physical, dtype=torch.bool)
        outside[rank * per_rank : (rank + 1) * per_rank] = False
        assert int(r["physical_load"][:, outside].sum()) == 0
        # ... and the ranks' loads sum to the eager router's counts (locally and by all_reduce)
        assert torch.equal(r["global_counts"], r["counts"])
        assert torch.equal(r["load_after"], r["counts"])  # after rebalance, on the new slots
        # rebalance moved weights (between ranks too) into exactly the new placement
        assert r["moved"] > 0 and r["slots_ok"], r
        assert r["eager_error"] is not None and "expert parallelism across processes" in r["eager_error"]
    # some slots got their weights from another rank (send/recv), not only by local copies
    old, new = torch.tensor(results[0]["old_phy2log"]), torch.tensor(results[0]["new_phy2log"])
    assert all(torch.equal(torch.tensor(r["new_phy2log"]), new) for r in results)  # one placement
    remote = sum(
        1
        for o, n in zip(old, new)
        for s in (n != o).nonzero().flatten().tolist()
        if int((o == n[s]).nonzero()[0]) // per_rank != s // per_rank
    )
    assert remote > 0
    assert torch.equal(sum(r["rank_counts"] for r in results), results[0]["counts"])
    assert all(int(r["rank_counts"].sum()) > 0 for r in results)  # every rank computed tokens
    if world_size == 2:  # sharded tokens: all_gather ×3 (tokens, ids, weights), one reduce_scatter
        for r in results:
            assert r["sharded_vs_ref"] <= 1e-5 and r["sharded_shape"] == (1, 8, r["logical_shapes"][0][0][-1]), r
            assert r["sharded_ops"] == [3, 1, 0] and r["sharded_counts_ok"], r
    before, after = results[0]["balance"]
    print(f"EP={world_size}, R={redundant}: Zipf max/mean rank load before {before:.3f}, after {after:.3f}")
    assert after < before


def test_indivisible_slots_and_wrong_group_size_are_config_errors() -> None:
    from ascend_passes import models
    from ascend_passes.config import AscendPassConfig
    from ascend_passes.eplb.state import attach, state_of
    from ascend_passes.errors import ConfigError

    model, _ = models.deepseek_v3("grouped_mm", num_layers=2)
    with pytest.raises(
        ConfigError, match=r"\(num_experts 16 \+ num_redundant_experts 2\) = 18 is not divisible by ep_size 4"
    ):
        attach(model, {"num_redundant_experts": 2, "ep_size": 4})
    assert state_of(model) is None
    with pytest.raises(ConfigError, match="eplb.ep_group"):
        AscendPassConfig.from_options({"eplb": {"ep_group": 3}})


def test_record_load_counts_only_this_ranks_slots() -> None:
    import ascend_passes.ops  # noqa: F401  (registers torch.ops.ascend)

    ops = torch.ops.ascend
    phys = torch.tensor([[0, 5], [2, 3], [4, 1]], dtype=torch.int32)
    loads = []
    for start in (0, 3):  # two ranks of 3 slots: each counts its own, together everything
        load = torch.zeros(6, dtype=torch.int64)
        ops.eplb_record_load(load, phys, torch.tensor(True), active_expert_range=[start, start + 3])
        loads.append(load)
    assert loads[0].tolist() == [1, 1, 1, 0, 0, 0] and loads[1].tolist() == [0, 0, 0, 1, 1, 1]
    with pytest.raises(ValueError, match="active_expert_range"):
        ops.eplb_record_load(torch.zeros(6, dtype=torch.int64), phys, torch.tensor(True), active_expert_range=[3, 7])
    # no logical view of weights a rank holds only some slots of
    log2phy, count = torch.tensor([[0], [1]]), torch.tensor([1, 1])
    with pytest.raises(ValueError, match="holds 1 of 2 physical expert slots"):
        ops.eplb_logical_weight(
            torch.zeros(1, 2, 2), log2phy, count, torch.zeros(2, dtype=torch.int64), torch.tensor(True)
        )


def test_all_reduce_takes_finalize_skips_out_so_they_count_once() -> None:
    import torch.fx as fx

    import ascend_passes.ops  # noqa: F401
    from ascend_passes.passes.eplb import EplbPass

    graph = fx.Graph()
    rows, skip, scales, idx, expert = (graph.placeholder(n) for n in ("rows", "skip", "scales", "idx", "expert"))
    fin = graph.call_function(
        torch.ops.ascend.moe_finalize_routing.default,
        (rows, skip, None, None, scales, idx, expert),
        {"drop_pad_mode": 2, "k": 2},
    )
    shared = graph.call_function(torch.ops.aten.add.Tensor, (fin, rows))
    graph.output(shared)
    nodes = EplbPass._all_reduce(graph, fin, "0")
    c10d = torch.ops._c10d_functional
    assert [n.target for n in nodes] == [c10d.all_reduce.default, c10d.wait_tensor.default, torch.ops.aten.add.Tensor]
    assert fin.args[1] is None  # the skip is no longer summed on every rank ...
    assert nodes[2].args == (nodes[1], skip)  # ... but added once, after the all_reduce
    assert shared.args[0] is nodes[2] and list(fin.users) == [nodes[0]]
    graph.lint()
