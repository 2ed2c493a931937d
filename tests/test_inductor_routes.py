"""EPLB, expert parallelism and sequence parallelism with Inductor downstream (the CPU default), not
only ``compiler="eager"`` (issue 14 item 15).

The eplb pass puts a mutating op (``ascend.eplb_record_load``: ``load[slot] += tokens``) into a
functional graph; Inductor must neither drop it (no output depends on it), reorder it nor count
twice.  Checked: numerics against the model without EPLB / the uncompiled TP model, and the recorded
loads against what the eager-downstream compile records (and the eager router's counts), after one
forward and after two (each forward adds its tokens once).  Routes: ``torch.compile(backend=
"ascend_passes", options={"compiler": "inductor"})`` and Inductor's post-grad custom pass
(``torch._inductor.config.post_grad_custom_post_pass = ascend_passes.inductor_pass(...)``).
One MoE block (router, 16 experts top-4, shared expert) keeps the Inductor compiles short."""

from __future__ import annotations

import copy
import traceback
from typing import Any

import pytest
import torch
from _helpers import rel_diff, router_counts
from torch._inductor import config as inductor_config

import ascend_passes as ap
from ascend_passes.spawn import run_on_ranks

NUM_EXPERTS = 16
JOIN_TIMEOUT_S = 600.0  # watchdog for the spawned world (two runs of Inductor compiles on 2 shared cores)
TOL = 1e-5  # fp32, relative to the output scale

# the single-process module fixture compiles twice: keep this module on one xdist worker
pytestmark = pytest.mark.xdist_group("inductor_routes")


def _moe_block(tokens: int = 16) -> tuple[torch.nn.Module, torch.Tensor]:
    """The MoE block of the bundled DeepSeek-V3 model and a hidden-state input (same on every rank)."""
    from ascend_passes import models

    base, _ = models.deepseek_v3("grouped_mm", num_layers=2)
    block = next(m for _, m in base.named_modules() if hasattr(m, "gate") and hasattr(m, "experts"))
    hidden = torch.randn(1, tokens, block.experts.gate_up_proj.shape[-1], generator=torch.Generator().manual_seed(1))
    return block, hidden


def _eplb_run(block: torch.nn.Module, hidden: torch.Tensor, eplb: dict[str, Any], route: str) -> dict[str, Any]:
    """Attach a copy of ``block``, compile it by ``route`` ("eager" / "inductor": the backend with that
    downstream compiler; "inductor_pass": Inductor with our post-grad pass), run it twice."""
    from ascend_passes.eplb.state import attach

    model = copy.deepcopy(block)
    state = attach(model, eplb)
    options = {"strict": True, "eplb": {"enabled": True, **eplb}}
    torch._dynamo.reset()
    with torch.no_grad(), ap.capture() as reports:
        if route == "inductor_pass":
            custom = ap.inductor_pass(compiler="inductor", **options)
            with inductor_config.patch(post_grad_custom_post_pass=custom, fx_graph_cache=False):
                compiled = torch.compile(model)
                out = compiled(hidden)
                once = state.physical_load()
                out_again = compiled(hidden)
        else:
            compiled = torch.compile(model, backend="ascend_passes", options={"compiler": route, **options})
            out = compiled(hidden)
            once = state.physical_load()
            out_again = compiled(hidden)
    (report,) = reports
    return {
        "out": out,
        "out_again": out_again,
        "physical_once": once,
        "physical_twice": state.physical_load(),
        "global_twice": state.global_expert_load(),
        "compiler": report.compiler,
        "ops": [
            report.count(op) for op in ("ascend.eplb_map", "ascend.eplb_record_load", "ascend.moe_init_routing_v2")
        ],
    }


# ------------------------------------------------------------------------------ single process
@pytest.fixture(scope="module")
def single_process():
    block, hidden = _moe_block()
    with torch.no_grad():
        ref = block(hidden)
    counts = router_counts(block, (hidden,), NUM_EXPERTS)
    eplb = {"num_redundant_experts": 4, "ep_size": 4}  # 20 slots, replicas of the 4 first experts
    return ref, counts, {route: _eplb_run(block, hidden, eplb, route) for route in ("eager", "inductor")}


def test_eplb_with_inductor_downstream_matches_and_counts_like_eager(single_process):
    ref, counts, runs = single_process
    eager, inductor = runs["eager"], runs["inductor"]
    assert inductor["compiler"] == "inductor"
    assert inductor["ops"] == [1, 1, 1]  # map, record, the fused routing: all in the graph Inductor got
    assert rel_diff(inductor["out"], ref) <= TOL and rel_diff(inductor["out_again"], ref) <= TOL
    # the load Inductor's code records is the eager downstream's, slot by slot: not dropped, not doubled
    assert torch.equal(inductor["physical_once"], eager["physical_once"])
    assert torch.equal(inductor["physical_twice"], eager["physical_twice"])
    assert torch.equal(inductor["physical_twice"], 2 * inductor["physical_once"])
    assert torch.equal(inductor["global_twice"], 2 * counts)  # = the eager router's counts, per forward
    assert int(inductor["physical_once"].sum()) == 16 * 4  # tokens x top-k


def test_eplb_through_inductor_pass_counts_like_eager(single_process):
    ref, counts, runs = single_process
    block, hidden = _moe_block()
    run = _eplb_run(block, hidden, {"num_redundant_experts": 4, "ep_size": 4}, "inductor_pass")
    assert rel_diff(run["out"], ref) <= TOL and rel_diff(run["out_again"], ref) <= TOL
    assert run["ops"] == [1, 1, 1]
    assert torch.equal(run["physical_once"], runs["eager"]["physical_once"])
    assert torch.equal(run["global_twice"], 2 * counts)


# ------------------------------------------------------------------------------ expert parallel, world 2
def _ep_rank(rank: int, world_size: int) -> dict[str, Any]:  # a spawned rank
    block, hidden = _moe_block()
    with torch.no_grad():
        ref = block(hidden)
    counts = router_counts(block, (hidden,), NUM_EXPERTS)
    eplb = {"num_redundant_experts": 2, "ep_size": world_size}  # 18 slots, 9 per rank
    run = _eplb_run(block, hidden, eplb, "inductor")
    return {
        "out": rel_diff(run["out"], ref),
        "out_again": rel_diff(run["out_again"], ref),
        "ops": run["ops"],
        "compiler": run["compiler"],
        "slots": run["physical_once"].shape[1],
        "physical_once": run["physical_once"].tolist(),
        "physical_twice": run["physical_twice"].tolist(),
        "global_twice": run["global_twice"].tolist(),
        "counts": counts.tolist(),
    }


def test_expert_parallel_world_2_with_inductor_downstream(world2):
    ranks = _results(world2, "ep")
    for res in ranks:
        assert res["compiler"] == "inductor" and res["ops"] == [1, 1, 1]
        assert res["out"] <= TOL and res["out_again"] <= TOL, res
        assert res["global_twice"] == [[2 * c for c in row] for row in res["counts"]]
        assert res["physical_twice"] == [[2 * c for c in row] for row in res["physical_once"]]
    # every token's k choices land on exactly one rank's slots: the ranks' loads add up to T x k
    assert sum(sum(row) for res in ranks for row in res["physical_once"]) == 16 * 4


# ------------------------------------------------------------------------------ sequence parallel, world 2
def _sp_rank(rank: int, world_size: int, tokens: int) -> dict[str, Any]:  # a spawned rank
    from ascend_passes import models, models_tp

    torch._dynamo.reset()
    model, _ = models_tp.deepseek_v3_tp(rank, world_size, num_layers=2)
    ref_model, _ = models.deepseek_v3("grouped_mm", num_layers=2)
    ids = torch.randint(0, 256, (1, tokens), generator=torch.Generator().manual_seed(tokens))
    custom = ap.inductor_pass(compiler="inductor", sequence_parallel=True, strict=True)
    with (
        inductor_config.patch(post_grad_custom_post_pass=custom, fx_graph_cache=False),
        torch.no_grad(),
        ap.capture() as reports,
    ):
        got = torch.compile(model)(ids)
        tp, single = model(ids), ref_model(ids)
    (report,) = reports
    sp = report.passes["sequence_parallel"]
    return {
        "tp": rel_diff(got, tp),
        "single": rel_diff(got, single),
        "sp": sp.counts(),
        "near_misses": [nm.reason for nm in sp.near_misses],
        "collectives": [
            report.count(f"_c10d_functional.{op}")
            for op in ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor")
        ],
    }


def test_sequence_parallel_through_inductor_pass(world2):
    for res in _results(world2, "sp"):
        assert res["tp"] <= 1e-4 and res["single"] <= 1e-4, res
        assert res["sp"] and res["near_misses"] == [], res
        all_reduce, reduce_scatter, all_gather = res["collectives"]
        assert all_reduce == 0 and reduce_scatter >= 1 and all_gather >= 1, res


# ------------------------------------------------------------------------------ one spawned world for both
def _world2_rank(rank: int, world_size: int) -> dict[str, Any]:  # a spawned rank
    """Both world-2 runs in one world (the rank processes start, import and warm up Inductor once): the EP
    run, then the SP run (7 tokens: not a multiple of the world size, so the pass pads and un-pads); a run
    that raises is reported as its traceback, so the other test still gets its result."""
    results: dict[str, Any] = {}
    for name, run, args in (("ep", _ep_rank, ()), ("sp", _sp_rank, (7,))):
        try:
            results[name] = run(rank, world_size, *args)
        except Exception:
            results[name] = {"raised": traceback.format_exc()}
    return results


@pytest.fixture(scope="module")
def world2() -> list[dict[str, Any]]:
    return run_on_ranks(_world2_rank, 2, timeout_s=JOIN_TIMEOUT_S)


def _results(world2: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    """Every rank's result of run ``name``; a run that raised on a rank fails here with its traceback."""
    for rank, res in enumerate(world2):
        assert "raised" not in res[name], f"rank {rank}: {res[name]['raised']}"
    return [res[name] for res in world2]
