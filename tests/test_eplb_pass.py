"""The eplb pass and the EPLB runtime state: compiled outputs equal the model without EPLB (R = 0
and R = 4), mapping ops in every MoE layer (MTP layers included), recorded loads equal the eager
router's counts (target and drafter apart), rebalance() balances a Zipf load without changing
outputs or recompiling, and every user error is a ConfigError that changes nothing."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from _helpers import router_counts

import ascend_passes as ap
import ascend_passes.ops  # noqa: F401  (registers torch.ops.ascend)
from ascend_passes import models
from ascend_passes.config import AscendPassConfig
from ascend_passes.eplb import export_placement
from ascend_passes.eplb.state import attach, find_moe_blocks, state_of
from ascend_passes.errors import ConfigError
from ascend_passes.pass_manager import PassContext
from ascend_passes.passes.eplb import EplbPass

# one xdist worker runs the module: its ``deepseek`` fixture (three DeepSeek-V3 compiles) is built once, not
# once per worker as when the tests are spread over both
pytestmark = pytest.mark.xdist_group("eplb_pass")

ops = torch.ops.ascend
EAGER = {"compiler": "eager", "strict": True}
EPLB = {**EAGER, "eplb": {"enabled": True}}


def _compile(model, inputs, options):
    with torch.no_grad(), ap.capture() as reports:
        compiled = torch.compile(model, backend="ascend_passes", options=options)
        out = compiled(*inputs)
    return compiled, out, reports


# --------------------------------------------------------------------------------- ops
def test_map_spreads_tokens_evenly_over_replicas():
    # expert 0 has slots {0, 3}, expert 1 slot {1}, expert 2 slots {2, 4, 5}
    log2phy = torch.tensor([[0, 3, -1], [1, -1, -1], [2, 4, 5]])
    count = torch.tensor([2, 1, 3])
    ids = torch.tensor([[0, 2]] * 6, dtype=torch.int32)
    phys = ops.eplb_map(ids, log2phy, count)
    assert phys.dtype == torch.int32
    assert phys[:, 0].tolist() == [0, 3, 0, 3, 0, 3]  # (t + 0) % 2
    assert phys[:, 1].tolist() == [5, 2, 4, 5, 2, 4]  # (t + 2) % 3
    assert ops.eplb_map(ids, log2phy, count, rank=1)[:, 0].tolist() == [3, 0, 3, 0, 3, 0]
    load = torch.zeros(6, dtype=torch.int64)
    ops.eplb_record_load(load, phys, torch.tensor(True))
    assert load.tolist() == [3, 0, 2, 3, 2, 2]
    ops.eplb_record_load(load, phys, torch.tensor(False))  # switched off: unchanged
    assert load.tolist() == [3, 0, 2, 3, 2, 2]
    weight = torch.arange(6.0).view(6, 1, 1)
    assert ops.eplb_logical_weight(weight, log2phy, count, load, torch.tensor(True)).flatten().tolist() == [0, 1, 2]


# --------------------------------------------------------------------------------- main model
@pytest.fixture(scope="module")
def deepseek():
    """deepseek_v3 (2 MoE layers, 16 experts top-4): compiled without EPLB, and attached and
    compiled with EPLB for R = 0 and R = 4 (ep_size 4)."""
    torch._dynamo.reset()
    base, inputs = models.deepseek_v3("grouped_mm")
    runs = {"base": (base, None) + _compile(base, inputs, EAGER)}
    for r in (0, 4):
        model = copy.deepcopy(base)
        counts = router_counts(model, inputs, 16)
        state = attach(model, {"num_redundant_experts": r, "ep_size": 4})
        runs[r] = (model, state) + _compile(model, inputs, EPLB) + (counts,)
    return inputs, runs


@pytest.mark.parametrize("r", [0, 4])
def test_outputs_equal_model_without_eplb(deepseek, r):
    inputs, runs = deepseek
    _, _, _, base_out, _ = runs["base"]
    model, state, _, out, (report,), _ = runs[r]
    assert (out - base_out).abs().max().item() <= 1e-5
    with torch.no_grad():  # the attached model's eager forward is unchanged too
        assert (model(*inputs) - base_out).abs().max().item() <= 1e-4
    assert state.num_physical == 16 + r
    assert report.passes["eplb"].counts() == {"eplb_indirection": 2}
    assert report.count("ascend.eplb_map") == 2 and report.count("ascend.eplb_record_load") == 2
    assert report.count("ascend.eplb_logical_weight") == 0  # the eager weight view is gone
    inits = [n for n in report.graph.graph.nodes if n.target is ops.moe_init_routing_v2.default]
    assert all(n.kwargs["expert_num"] == 16 + r and n.kwargs["active_expert_range"] == [0, 16 + r] for n in inits)
    assert sorted(f["layer"] for f in report.facts["eplb_layers"]) == ["model.layers.1", "model.layers.2"]
    # weights live once, in physical layout
    names = {n for n, _ in model.named_parameters()}
    assert not any(n.endswith("experts.gate_up_proj") for n in names)
    (_, experts), _ = find_moe_blocks(model)
    assert experts.eplb_gate_up_proj.shape[0] == 16 + r


@pytest.mark.parametrize("r", [0, 4])
def test_recorded_load_equals_router_counts(deepseek, r):
    _, runs = deepseek
    _, state, _, _, _, counts = runs[r]
    assert torch.equal(state.expert_load(), counts)
    assert int(state.physical_load().sum()) == 2 * 16 * 4


def test_rebalance_balances_zipf_load_without_recompiling(deepseek):
    inputs, runs = deepseek
    _, _, _, base_out, _ = runs["base"]
    model, state, compiled, _, _, _ = runs[4]
    gen = torch.Generator().manual_seed(0)
    share = 1.0 / torch.arange(1, 17, dtype=torch.float64) ** 1.2
    zipf = torch.stack([(share[torch.randperm(16, generator=gen)] * 10_000).long() for _ in range(2)])
    for layer, row in zip(state.layers, zipf):  # as if recorded: expert e's tokens on its first slot
        layer.expert_load.zero_().index_add_(0, layer.log2phy[:, 0], row)
    assert torch.equal(state.expert_load(), zipf)
    before = state.rank_balance().max().item()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    old = state.phy2log
    placement = state.rebalance()
    after = state.rank_balance(zipf).max().item()
    print(f"max/mean rank load before {before:.3f}, after {after:.3f}")
    assert before > 1.3 and after <= 1.10
    assert not torch.equal(placement.phy2log, old) and int(state.physical_load().sum()) == 0
    with torch.no_grad(), ap.capture() as reports:
        out = compiled(*inputs)
    assert reports == [] and torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert (out - base_out).abs().max().item() <= 1e-5
    # the new maps are in use: loads land on the new slots, summing to the same logical counts
    assert torch.equal(state.expert_load(), runs[4][5])
    # counting switches off at run time, again without recompiling
    state.set_recording(False)
    state.reset_load()
    with torch.no_grad(), ap.capture() as reports:
        compiled(*inputs)
    assert reports == [] and int(state.physical_load().sum()) == 0
    state.set_recording(True)


def test_placement_file_round_trip_and_bad_files_leave_placement_intact(deepseek, tmp_path):
    _, runs = deepseek
    _, state, _, _, _, _ = runs[4]
    before = state.phy2log
    with torch.no_grad():
        logical = [layer.experts.gate_up_proj.clone() for layer in state.layers]  # [E, 2I, H]
    good = tmp_path / "good.json"
    state.export_placement(good)
    assert state.load_placement_file(good) == 0  # same placement: nothing moves
    rolled = torch.roll(before, 1, dims=1)
    export_placement(rolled, 4, tmp_path / "rolled.json")
    assert state.load_placement_file(tmp_path / "rolled.json") > 0
    assert torch.equal(state.phy2log, rolled)
    for layer, w, row in zip(state.layers, logical, rolled):  # every slot holds its expert's weights
        assert torch.equal(layer.experts.eplb_gate_up_proj.detach(), w[row])
    state.apply_placement(before)
    lost = before.clone()
    lost[0, lost[0] == 3] = 4  # expert 3 has no slot left
    export_placement(lost, 4, tmp_path / "lost.json")
    out_of_range = json.loads(good.read_text())
    out_of_range["layer_list"][1]["device_list"][0]["device_expert"][0] = 16
    (tmp_path / "range.json").write_text(json.dumps(out_of_range))
    export_placement(before[:1], 4, tmp_path / "layers.json")
    for name, message in (
        ("lost", "no replica of logical expert"),
        ("range", "outside \\[0, 16\\)"),
        ("layers", "moe_layer_count is 1 but the model has 2"),
    ):
        with pytest.raises(ConfigError, match=message):
            state.load_placement_file(tmp_path / f"{name}.json")
        assert torch.equal(state.phy2log, before)


def test_attach_errors_leave_model_unchanged():
    model, _ = models.deepseek_v3("grouped_mm", num_layers=2)
    with pytest.raises(ConfigError, match="not divisible by ep_size 4"):
        attach(model, {"num_redundant_experts": 3, "ep_size": 4})
    with pytest.raises(ConfigError, match="negative"):
        attach(model, {"num_redundant_experts": -1})
    assert state_of(model) is None and len(find_moe_blocks(model)) == 1
    assert "gate_up_proj" in dict(find_moe_blocks(model)[0][1].named_parameters())


def test_enabled_without_attach_is_a_config_error(deepseek):
    _, runs = deepseek
    base_report = runs["base"][4][0]
    cfg = AscendPassConfig.from_options({"eplb": True})
    assert not EplbPass(AscendPassConfig()).enabled(PassContext(AscendPassConfig()))
    ctx = PassContext(cfg, real_inputs=[torch.zeros(2)], facts=dict(base_report.facts))
    with pytest.raises(ConfigError, match=r"ascend_passes.eplb.attach\(model"):
        EplbPass(cfg).enabled(ctx)
    ctx = PassContext(cfg, real_inputs=None, facts=dict(base_report.facts))
    with pytest.raises(ConfigError, match=r"ascend_passes.eplb.attach\(model"):
        EplbPass(cfg).run(copy.deepcopy(base_report.graph), ctx)


# --------------------------------------------------------------------------------- MTP
@pytest.mark.parametrize("num_mtp", [1, 2])
def test_mtp_layers_mapped_and_counted_apart_from_target(num_mtp):
    torch._dynamo.reset()
    drafter, inputs = models.deepseek_v3_mtp(num_mtp, tokens=8, seed=num_mtp)
    main, main_inputs = drafter.main_model, drafter.main_example_inputs
    with torch.no_grad():
        ref = drafter(*inputs)
    main_counts, draft_counts = router_counts(main, main_inputs, 16), router_counts(drafter, inputs, 16)
    target = attach(main, {"num_redundant_experts": 4}, num_mtp_layers=num_mtp)
    draft = attach(drafter, {}, main=target)  # the drafter's layers get the target's redundancy
    assert draft.num_redundant == 4 and draft.first_layer == 1 and draft.total_layers == 1 + num_mtp
    if num_mtp == 1:
        _, _, (main_report,) = _compile(main, main_inputs, EPLB)
        assert main_report.count("ascend.eplb_map") == 1
    _, out, (report,) = _compile(drafter, inputs, EPLB)
    assert report.count("ascend.eplb_map") == num_mtp and report.count("ascend.eplb_record_load") == num_mtp
    assert sorted(f["layer"] for f in report.facts["eplb_layers"]) == [f"mtp.{i}" for i in range(num_mtp)]
    for o, r in zip(out, ref):
        assert (o - r).abs().max().item() <= 1e-4
    assert torch.equal(draft.expert_load(), draft_counts)
    if num_mtp == 1:
        assert torch.equal(target.expert_load(), main_counts)
        assert not torch.equal(target.expert_load(), draft.expert_load())
    else:
        assert int(target.physical_load().sum()) == 0  # the target did not run: nothing recorded


# --------------------------------------------------------------------------------- issue 14 item 9
@pytest.mark.parametrize("shape", [(16,), (2, 20), (3, 16), (1, 16)])
def test_rebalance_with_a_load_of_the_wrong_shape_names_both_shapes(deepseek, shape):
    _, runs = deepseek
    state = runs[4][1]
    before = state.phy2log
    message = (
        f"expert load must have shape [2, 16] (one row per MoE layer of this model, one "
        f"column per logical expert), got shape {list(shape)}"
    )
    for call in (state.rebalance, state.rank_balance):
        with pytest.raises(ConfigError) as err:
            call(torch.ones(shape))
        assert str(err.value) == message
    assert torch.equal(state.phy2log, before)


def test_export_placement_to_a_directory_names_the_path_and_leaves_no_temp_file(deepseek, tmp_path):
    _, runs = deepseek
    state = runs[4][1]
    for export in (state.export_placement, lambda path: export_placement(state.phy2log, 4, path)):
        with pytest.raises(ConfigError) as err:
            export(tmp_path)
        assert str(err.value) == (
            f"export_placement: {tmp_path} is a directory; pass a file path, e.g. {tmp_path / 'placement.json'}"
        )
    missing = tmp_path / "nowhere" / "placement.json"
    with pytest.raises(ConfigError) as err:
        state.export_placement(missing)
    assert str(err.value) == (
        f"export_placement: cannot write {missing}: its directory "
        f"{tmp_path / 'nowhere'} does not exist; create it first"
    )
    assert list(tmp_path.iterdir()) == []  # no temporary file left behind
    state.export_placement(tmp_path / "placement.json")
    assert [p.name for p in tmp_path.iterdir()] == ["placement.json"]


@pytest.mark.parametrize(
    "field, value, attached",
    [
        ("num_redundant_experts", 8, 4),
        ("ep_size", 2, 4),
        ("record_load", False, True),
        ("placement_file", "placement.json", None),
    ],
)
def test_compile_options_contradicting_attach_are_config_errors(deepseek, field, value, attached):
    _, runs = deepseek
    state, base_report = runs[4][1], runs["base"][4][0]
    tables = [layer.expert_load for layer in state.layers]
    cfg = AscendPassConfig.from_options({"eplb": {"enabled": True, field: value}})
    ctx = PassContext(cfg, real_inputs=tables, facts=dict(base_report.facts))
    with pytest.raises(ConfigError) as err:
        EplbPass(cfg).enabled(ctx)
    assert str(err.value) == (
        f"eplb.{field}={value!r} in the compile options, but attach() set this model up with "
        f"{field}={attached!r}; the compiled graph follows the attached state, so leave "
        f"eplb.{field} unset or set it to {attached!r} (attach again to change it)"
    )
    # the attached values, or the options left unset, are accepted
    for options in ({field: attached} if attached is not None else {}, {}):
        cfg = AscendPassConfig.from_options({"eplb": {"enabled": True, **options}})
        assert EplbPass(cfg).enabled(PassContext(cfg, real_inputs=tables, facts=dict(base_report.facts)))


def test_contradicting_redundancy_is_found_from_the_graph_without_real_inputs(deepseek, monkeypatch):
    """The Inductor-pass route has no real inputs: the redundancy is read off the table shapes
    (in run(), so strict mode raises it; otherwise the pass is rolled back with that WARNING)."""
    import ascend_passes.backend as backend

    inputs, runs = deepseek
    model = runs[4][0]
    monkeypatch.setattr(backend, "_real_inputs_for", lambda *args: None)
    torch._dynamo.reset()
    options = {"compiler": "eager", "strict": True, "eplb": {"enabled": True, "num_redundant_experts": 8}}
    with torch.no_grad(), pytest.raises(Exception) as err:
        torch.compile(model, backend="ascend_passes", options=options)(*inputs)
    inner = getattr(err.value, "inner_exception", err.value)
    assert isinstance(inner, ap.PassError), repr(err.value)
    assert str(inner) == (
        "pass 'eplb' failed: ConfigError: eplb.num_redundant_experts=8 in the compile options, but "
        "attach() set this model up with num_redundant_experts=4; the compiled graph follows the "
        "attached state, so leave eplb.num_redundant_experts unset or set it to 4 (attach again to "
        "change it)"
    )
