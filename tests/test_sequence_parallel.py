"""Sequence parallelism and shared-expert data parallelism over real processes (torch.multiprocessing spawn +
gloo, world sizes 2 and 4): collective counts before/after, outputs against the TP run and the single-process
Hugging Face model, token counts that do not divide the world size from one dynamic graph, the MTP drafter,
the all-or-nothing refusal, and the config's warning and errors by their text."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from _helpers import rel_diff

import ascend_passes
from ascend_passes import ConfigError
from ascend_passes.spawn import free_port, run_on_ranks

NUM_LAYERS = 2  # layer 0 dense, layer 1 MoE
MOE_LAYERS = NUM_LAYERS - 1
JOIN_TIMEOUT_S = 240.0  # watchdog: a stuck rank fails the test instead of hanging the suite
TOL = 1e-4  # fp32, relative to the output scale

# the spawned worlds are module fixtures: keep this module on one xdist worker (pyproject: --dist loadgroup)
pytestmark = pytest.mark.xdist_group("sequence_parallel")

AR = "_c10d_functional.all_reduce"
RS = "_c10d_functional.reduce_scatter_tensor"
AG = "_c10d_functional.all_gather_into_tensor"


def _ids(tokens: int) -> torch.Tensor:
    return torch.randint(0, 256, (1, tokens), generator=torch.Generator().manual_seed(tokens))


def _summary(report: Any) -> dict[str, Any]:
    sp = report.passes.get("sequence_parallel")
    dp = report.passes.get("shared_expert_dp")
    return {
        "counts": {op: report.count(op) for op in (AR, RS, AG)},
        "sp": sp.counts() if sp else {},
        "sp_layers": sorted({(m.pattern, m.layer) for m in sp.matches}, key=str) if sp else [],
        "sp_near_misses": [nm.reason for nm in sp.near_misses] if sp else [],
        "dp": dp.counts() if dp else {},
        "dp_near_misses": [(nm.layer, nm.reason) for nm in dp.near_misses] if dp else [],
        "mtp_layers": len(report.facts.get("mtp_layers", [])),
    }


def _case_lm(rank: int, ws: int, name: str, shared: str, options: dict, tokens: list[int]) -> dict[str, Any]:
    """Compile the TP model once (token dim dynamic), run every token count; compare with the uncompiled TP
    model and the single-process model."""
    from ascend_passes import models, models_tp

    torch._dynamo.reset()
    model, _ = models_tp.deepseek_v3_tp(rank, ws, num_layers=NUM_LAYERS, shared_expert=shared)
    ref_model, _ = models.deepseek_v3("grouped_mm", num_layers=NUM_LAYERS)
    out: dict[str, Any] = {"case": name, "errors": {}}
    with torch.no_grad(), ascend_passes.capture() as reports:
        compiled = torch.compile(model, backend="ascend_passes", options={"compiler": "eager", **options})
        for t in tokens:
            ids = _ids(t)
            torch._dynamo.mark_dynamic(ids, 1)
            got = compiled(ids)
            out["errors"][t] = {"TP": rel_diff(got, model(ids)), "single process": rel_diff(got, ref_model(ids))}
            out.setdefault("graphs_after", {})[t] = len(reports)
    out.update(_summary(reports[0]))
    out["chunk_rows"] = {t: -(-t // ws) for t in tokens}
    return out


def _case_mtp(rank: int, ws: int, name: str, shared: str, options: dict) -> dict[str, Any]:
    from ascend_passes import models, models_tp

    torch._dynamo.reset()
    drafter, inputs = models_tp.deepseek_v3_mtp_tp(rank, ws, 2, shared_expert=shared, tokens=7)
    ref, ref_inputs = models.deepseek_v3_mtp(2, tokens=7)
    with torch.no_grad(), ascend_passes.capture() as reports:
        got = torch.compile(drafter, backend="ascend_passes", options={"compiler": "eager", **options})(*inputs)
        tp = drafter(*inputs)
        single = ref(*ref_inputs)
    out = {
        "case": name,
        "errors": {
            "logits": {"TP": rel_diff(got[0], tp[0]), "single process": rel_diff(got[0], single[0])},
            "hidden": {"TP": rel_diff(got[1], tp[1]), "single process": rel_diff(got[1], single[1])},
        },
    }
    out.update(_summary(reports[0]))
    return out


def _case_ep(rank: int, ws: int, name: str, options: dict, tokens: list[int]) -> dict[str, Any]:
    """Expert parallelism (each rank P/W expert slots) composed with SP and shared-expert DP: the EP
    all-reduce after the routed experts becomes a reduce-scatter like the TP ones."""
    from ascend_passes import models, models_tp
    from ascend_passes.eplb.state import attach

    torch._dynamo.reset()
    model, _ = models_tp.deepseek_v3_tp(rank, ws, num_layers=NUM_LAYERS, shared_expert="moe_replicated")
    ref_model, _ = models.deepseek_v3("grouped_mm", num_layers=NUM_LAYERS)
    eplb = {"num_redundant_experts": ws, "ep_size": ws}
    state = attach(model, eplb)
    out: dict[str, Any] = {"case": name, "errors": {}}
    with torch.no_grad(), ascend_passes.capture() as reports:
        compiled = torch.compile(
            model, backend="ascend_passes", options={"compiler": "eager", "eplb": {"enabled": True, **eplb}, **options}
        )
        for t in tokens:
            ids = _ids(t)
            torch._dynamo.mark_dynamic(ids, 1)
            got, ref = compiled(ids), ref_model(ids)
            # an EP rank cannot run the model uncompiled (it holds P/W slots): single process only
            out["errors"][t] = {"single process": rel_diff(got, ref)}
    out.update(_summary(reports[0]))
    out["expert_slots"] = state.slots_per_rank
    out["eplb"] = reports[0].passes["eplb"].counts()
    return out


_CASES = {"lm": _case_lm, "mtp": _case_mtp, "ep": _case_ep}


def _cases(rank: int, ws: int, cases: list[tuple]) -> list[dict[str, Any]]:  # one spawned rank
    return [_CASES[kind](rank, ws, *args) for kind, *args in cases]


def _spawn(ws: int, cases: list[tuple]) -> dict[str, dict[str, Any]]:
    rank0 = run_on_ranks(_cases, ws, cases, timeout_s=JOIN_TIMEOUT_S)[0]
    return {res["case"]: res for res in rank0}


SP = {"sequence_parallel": True, "strict": True}
SP_DP = {"sequence_parallel": True, "shared_expert_dp": True, "strict": True}
NO_NORM = {"sequence_parallel": True, "passes": "cleanup,mtp,moe,activation,mla,sequence_parallel"}
TOKENS = {2: [7, 64, 1], 4: [7, 64, 67, 1]}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda ws: f"world{ws}")
def world(request: Any) -> tuple[int, dict[str, dict[str, Any]]]:
    ws = request.param
    cases = [
        ("lm", "sp", "tp", SP, TOKENS[ws]),
        ("lm", "sp_dp", "replicated", SP_DP, [67] if ws == 4 else [7, 64]),
    ]
    if ws == 2:  # the MTP drafter and the refusals once, at world size 2 (each case is a compile per rank)
        cases += [
            ("mtp", "mtp_sp_dp", "replicated", SP_DP),
            ("lm", "no_norm", "tp", NO_NORM, [7]),
            ("mtp", "mtp_sp_tp_shared", "tp", SP_DP),
            ("ep", "ep_sp_dp", SP_DP, [7, 67]),
        ]
    return ws, _spawn(ws, cases)


def _at_world2(world: tuple[int, dict], case: str) -> dict[str, Any]:
    """The result of a case that only the world-size-2 fixture runs."""
    ws, res = world
    if ws != 2:
        pytest.skip("checked at world size 2")
    return res[case]


def _assert_close(errors: dict) -> None:
    for key, against in errors.items():
        assert against, key
        for what, err in against.items():
            assert err <= TOL, f"{key}: relative error vs {what} {err:.2e}"


def test_sp_collectives_match_the_layers(world) -> None:
    from ascend_passes.models_tp import expected_all_reduce_count

    ws, res = world
    r = res["sp"]
    expected = expected_all_reduce_count(NUM_LAYERS)  # embedding + (o_proj, MLP/MoE) per layer
    assert r["counts"] == {AR: 0, RS: expected, AG: expected + 1}  # + the LM head's logits gather
    assert r["sp"] == {
        "reduce_scatter": expected,
        "rms_norm_on_shard": 1,
        "add_rms_norm_on_shard": 2 * NUM_LAYERS,
        "all_gather": expected,
    }


def test_sp_outputs_equal_tp_and_single_process_for_every_token_count(world) -> None:
    ws, res = world
    r = res["sp"]
    _assert_close(r["errors"])
    assert set(r["errors"]) == set(TOKENS[ws])
    # one graph serves every token count > 1 (Dynamo specialises a size of 1, so 1 gets its own graph)
    assert [r["graphs_after"][t] for t in TOKENS[ws] if t != 1] == [1] * (len(TOKENS[ws]) - 1)


def test_shared_expert_dp_runs_the_shared_expert_on_the_token_shard(world) -> None:
    ws, res = world
    r = res["sp_dp"]
    _assert_close(r["errors"])
    assert r["dp"] == {"shared_expert_on_shard": MOE_LAYERS}
    assert r["counts"][AR] == 0
    assert res["sp"]["dp"] == {}


def test_mtp_layers_under_sp_and_shared_expert_dp(world) -> None:
    r = _at_world2(world, "mtp_sp_dp")
    _assert_close(r["errors"])
    assert r["mtp_layers"] == 2
    # per MTP layer: the embedding's all-reduce, o_proj and the MoE become reduce-scatters
    assert r["counts"][AR] == 0 and r["counts"][RS] == 3 * 2
    # each MTP layer's input (enorm of the reduce-scattered embedding) is normed on the shard, its output
    # gathered
    on_shard = {layer for pattern, layer in r["sp_layers"] if pattern == "rms_norm_on_shard"}
    gathered = {layer for pattern, layer in r["sp_layers"] if pattern == "all_gather"}
    assert {"mtp.0", "mtp.1"} <= on_shard and {"mtp.0", "mtp.1"} <= gathered
    assert r["dp"] == {"shared_expert_on_shard": 2}


def test_sp_is_all_or_nothing(world) -> None:
    r = _at_world2(world, "no_norm")
    _assert_close(r["errors"])
    assert r["counts"][RS] == 0 and r["counts"][AR] > 0  # the graph was left as it was
    assert r["sp"] == {}
    assert any("not a fused RMSNorm" in why for why in r["sp_near_misses"]), r["sp_near_misses"]


def test_shared_expert_dp_explains_a_tp_sharded_shared_expert(world) -> None:
    r = _at_world2(world, "mtp_sp_tp_shared")
    _assert_close(r["errors"])
    assert r["dp"] == {}
    layers = sorted(layer for layer, _ in r["dp_near_misses"])
    assert layers == ["mtp.0", "mtp.1"], layers
    assert all("shared_expert='replicated'" in why for _, why in r["dp_near_misses"])


def test_expert_parallelism_composes_with_sp_and_shared_expert_dp(world) -> None:
    r = _at_world2(world, "ep_sp_dp")
    _assert_close(r["errors"])
    assert r["expert_slots"] == (16 + 2) // 2
    assert r["eplb"]["ep_collectives"] == MOE_LAYERS
    # embedding + o_proj per layer + the dense MLP + the EP sum of each MoE layer: all reduce-scatters now
    assert r["counts"][AR] == 0 and r["counts"][RS] == 1 + NUM_LAYERS + 1 + MOE_LAYERS
    assert r["dp"] == {"shared_expert_on_shard": MOE_LAYERS}


# ------------------------------------------------------------------------------------- config, in-process
def test_sp_without_a_process_group_is_a_config_error() -> None:
    import torch.distributed as dist

    assert not dist.is_initialized()
    with pytest.raises(ConfigError, match="needs an initialised torch.distributed process group"):
        ascend_passes.PassManager(ascend_passes.AscendPassConfig.from_options({"sequence_parallel": True}))


def test_shared_expert_dp_turns_sp_on_with_a_warning(caplog: Any) -> None:
    with caplog.at_level(logging.WARNING, logger="ascend_passes.config"):
        with pytest.raises(ConfigError, match="needs an initialised torch.distributed process group"):
            ascend_passes.PassManager(ascend_passes.AscendPassConfig.from_options({"shared_expert_dp": True}))
    assert "shared_expert_dp needs sequence parallelism; turning sequence_parallel on" in caplog.text


def test_sp_over_one_rank_is_a_config_error() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        with pytest.raises(ConfigError, match="TP group of size 1 has nothing to split"):
            ascend_passes.PassManager(ascend_passes.AscendPassConfig.from_options({"sequence_parallel": True}))
        cfg = ascend_passes.AscendPassConfig.from_options({"sequence_parallel": False, "shared_expert_dp": False})
        assert not cfg.sequence_parallel.enabled
    finally:
        dist.destroy_process_group()


def test_padding_is_decided_symbolically() -> None:
    """Divisibility of a symbolic token count is proved, never read off the example's size."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from ascend_passes.passes.sequence_parallel import divides

    env = ShapeEnv()
    tokens = env.create_symintnode(env.create_symbol(8, ConstantSource("tokens")), hint=8)
    assert divides(64, 4) and not divides(67, 4)
    assert divides(tokens * 4, 4) and divides(tokens * 8, 4)
    assert not divides(tokens, 4)  # the example has 8 tokens, but the graph must serve 7 and 67 too
    assert not divides(tokens * 2, 4)
