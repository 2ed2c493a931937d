"""EPLB placement: replication, packing, hierarchical placement, validation and placement files."""

from __future__ import annotations

import json

import pytest
import torch

from ascend_passes.eplb import (
    Placement,
    balance_ratio,
    balanced_packing,
    check_expert_load,
    check_redundancy,
    check_topology,
    default_placement,
    expert_map_from_phy2log,
    export_placement,
    load_placement,
    log2phy_from_phy2log,
    logcnt_from_phy2log,
    rank_loads,
    rank_log2phy_from_phy2log,
    rebalance_experts,
    replicate_experts,
    validate_placement,
)
from ascend_passes.errors import ConfigError


def zipf_load(layers: int, experts: int, seed: int, s: float = 1.1, tokens: int = 1 << 14):
    """Token counts per expert: Zipf(s) popularity, experts shuffled per layer, sampled."""
    gen = torch.Generator().manual_seed(seed)
    base = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** s
    rows = []
    for _ in range(layers):
        probs = base[torch.randperm(experts, generator=gen)]
        picks = torch.multinomial(probs, tokens, replacement=True, generator=gen)
        rows.append(torch.bincount(picks, minlength=experts))
    return torch.stack(rows)


def check_consistent(phy2log, log2phy, logcnt, num_logical):
    """log2phy, phy2log and logcnt describe the same placement; no expert is lost."""
    layers, slots = phy2log.shape
    assert logcnt.shape == (layers, num_logical)
    assert (logcnt >= 1).all()
    assert (logcnt.sum(-1) == slots).all()
    assert torch.equal(logcnt, logcnt_from_phy2log(phy2log, num_logical))
    assert log2phy.shape == (layers, num_logical, int(logcnt.max()))
    for layer in range(layers):
        for expert in range(num_logical):
            phys = log2phy[layer, expert]
            valid = phys[phys >= 0]
            assert valid.numel() == logcnt[layer, expert]
            assert (phys[valid.numel() :] == -1).all()  # padding only at the end
            assert (phy2log[layer, valid] == expert).all()
            assert torch.equal(valid, valid.sort().values)


# ---------------------------------------------------------------------------------------------
# replication


def test_replication_goes_to_the_highest_load_per_replica():
    weight = torch.tensor([[90.0, 40.0, 10.0, 5.0]])
    phy2log, replica_rank, logcnt = replicate_experts(weight, 7)
    # extra slots: 90 -> 45 (2 copies), 45 vs 40 -> expert 0 again (30), then 40 -> expert 1
    assert logcnt.tolist() == [[3, 2, 1, 1]]
    assert phy2log.tolist() == [[0, 0, 0, 1, 1, 2, 3]]
    assert replica_rank.tolist() == [[0, 1, 2, 0, 1, 0, 0]]


def test_replication_without_redundancy_is_identity():
    weight = torch.rand(3, 6)
    phy2log, replica_rank, logcnt = replicate_experts(weight, 6)
    assert torch.equal(phy2log, torch.arange(6).expand(3, -1))
    assert (replica_rank == 0).all() and (logcnt == 1).all()


def test_replication_minimises_max_load_per_replica():
    weight = zipf_load(4, 32, seed=3).double()
    _, _, logcnt = replicate_experts(weight, 40)
    best = (weight / logcnt).max(-1).values
    # moving any one replica from one expert to another cannot lower the maximum
    for layer in range(4):
        for src in range(32):
            if logcnt[layer, src] < 2:
                continue
            for dst in range(32):
                if dst == src:
                    continue
                cnt = logcnt[layer].clone()
                cnt[src] -= 1
                cnt[dst] += 1
                assert (weight[layer] / cnt).max() >= best[layer] - 1e-9


# ---------------------------------------------------------------------------------------------
# packing


def test_packing_balances_a_hand_checked_case():
    weight = torch.tensor([[5.0, 4.0, 3.0, 3.0, 2.0, 1.0]])
    pack_index, rank_in_pack = balanced_packing(weight, 2)
    loads = torch.zeros(2).index_add_(0, pack_index[0], weight[0])
    assert loads.tolist() == [9.0, 9.0]
    assert torch.bincount(pack_index[0]).tolist() == [3, 3]
    # positions inside a pack are 0..2 and follow item order
    for pack in range(2):
        items = (pack_index[0] == pack).nonzero().flatten()
        assert rank_in_pack[0, items].tolist() == [0, 1, 2]


def test_refinement_fixes_a_case_greedy_gets_wrong():
    # greedy ends at {8, 5, 4} = 17 vs {7, 6, 0} = 13; the optimum is {8, 7, 0} vs {6, 5, 4}
    weight = torch.tensor([[8.0, 7.0, 6.0, 5.0, 4.0, 0.0]])
    greedy, _ = balanced_packing(weight, 2, refine=False)
    refined, _ = balanced_packing(weight, 2)

    def peak(idx):
        return torch.zeros(2, dtype=torch.float64).index_add_(0, idx[0], weight[0].double()).max()

    assert peak(greedy) == 17.0
    assert peak(refined) == 15.0


@pytest.mark.parametrize("seed", range(6))
def test_packing_properties_random(seed):
    gen = torch.Generator().manual_seed(seed)
    packs = 1 + seed % 4
    weight = torch.rand(5, packs * 6, generator=gen)
    pack_index, rank_in_pack = balanced_packing(weight, packs)
    for row in range(5):
        # every pack holds exactly N / packs items at distinct positions
        slots = pack_index[row] * 6 + rank_in_pack[row]
        assert sorted(slots.tolist()) == list(range(packs * 6))
    loads = torch.zeros(5, packs, dtype=torch.float64).scatter_add_(1, pack_index, weight.double())
    greedy_index, _ = balanced_packing(weight, packs, refine=False)
    greedy = torch.zeros(5, packs, dtype=torch.float64)
    greedy.scatter_add_(1, greedy_index, weight.double())
    assert (loads.max(-1).values <= greedy.max(-1).values + 1e-12).all()


def test_packing_rejects_uneven_split():
    with pytest.raises(ValueError, match="do not split evenly"):
        balanced_packing(torch.rand(1, 7), 2)


# ---------------------------------------------------------------------------------------------
# rebalance_experts


def test_global_placement_hand_checked():
    # 4 experts, 2 redundant, 3 ranks of 2 slots; expert 0 holds most of the load
    weight = torch.tensor([[12.0, 2.0, 2.0, 2.0]])
    phy2log, log2phy, logcnt = rebalance_experts(weight, 6, 1, 1, 3)
    check_consistent(phy2log, log2phy, logcnt, 4)
    assert logcnt[0, 0] == 3  # 12/3 = 4 per replica
    loads = rank_loads(phy2log, weight, 3)
    assert loads.tolist() == [[6.0, 6.0, 6.0]]  # each rank: one replica of 0 and one other expert


def test_hierarchical_keeps_each_group_on_one_node():
    weight = zipf_load(6, 32, seed=1).double()
    groups, nodes, ranks, slots = 8, 2, 8, 40
    phy2log, log2phy, logcnt = rebalance_experts(weight, slots, groups, nodes, ranks)
    check_consistent(phy2log, log2phy, logcnt, 32)
    per_node = slots // nodes
    for layer in range(6):
        node_of_slot = torch.arange(slots) // per_node
        for group in range(groups):
            in_group = (phy2log[layer] // (32 // groups)) == group
            assert node_of_slot[in_group].unique().numel() == 1, (layer, group)
        # every node holds whole groups: groups_per_node * group_size logical experts
        for node in range(nodes):
            experts = phy2log[layer, node * per_node : (node + 1) * per_node].unique()
            assert experts.numel() == 32 // nodes


def test_global_when_groups_do_not_divide_nodes():
    weight = zipf_load(3, 24, seed=2).double()
    # 3 groups on 2 nodes: hierarchical is impossible, so the placement is global
    assert check_topology(24, 32, 3, 2, 4) is False
    phy2log, log2phy, logcnt = rebalance_experts(weight, 32, 3, 2, 4)
    check_consistent(phy2log, log2phy, logcnt, 24)
    assert torch.equal(phy2log, rebalance_experts(weight, 32, 1, 1, 4)[0])


@pytest.mark.parametrize("seed", range(8))
def test_rebalance_properties_random(seed):
    gen = torch.Generator().manual_seed(seed)
    ranks = [2, 4, 8][seed % 3]
    experts = 16 * (1 + seed % 2)
    redundant = ranks * (seed % 3)
    weight = torch.randint(0, 1000, (3, experts), generator=gen)
    groups, nodes = (4, 2) if seed % 2 else (1, 1)
    phy2log, log2phy, logcnt = rebalance_experts(weight, experts + redundant, groups, nodes, ranks)
    assert phy2log.shape == (3, experts + redundant)
    validate_placement(phy2log, experts, ranks)
    check_consistent(phy2log, log2phy, logcnt, experts)
    # a placement never beats the two trivial bounds
    loads = rank_loads(phy2log, weight, ranks)
    mean = weight.double().sum(-1) / ranks
    assert (loads.max(-1).values >= mean - 1e-9).all()
    assert torch.allclose(loads.sum(-1), weight.double().sum(-1))


def test_zipf_at_test_scale_is_balanced():
    weight = zipf_load(8, 16, seed=0)
    phy2log, _, _ = rebalance_experts(weight, 20, 1, 1, 4)
    after = balance_ratio(rank_loads(phy2log, weight, 4))
    before = balance_ratio(rank_loads(default_placement(8, 16, 4, 4), weight, 4))
    assert after.max() <= 1.10
    assert (after <= before + 1e-12).all()
    assert after.mean() < before.mean()


def test_refine_beats_plain_greedy_on_a_hot_expert_node():
    # one node holds an expert with ~half of that node's load: greedy replication cuts it into
    # more hot replicas than the node has ranks; the retry with fewer replicas fixes that
    weight = torch.tensor([[660.0, 308.0, 59.0, 34.0] + [2.0] * 12])
    plain = rebalance_experts(weight, 20, 1, 1, 4, refine=False)[0]
    tuned = rebalance_experts(weight, 20, 1, 1, 4)[0]
    ratio_plain = balance_ratio(rank_loads(plain, weight, 4))
    ratio_tuned = balance_ratio(rank_loads(tuned, weight, 4))
    assert ratio_tuned < ratio_plain - 0.03  # 1.150 vs 1.198


def test_zero_load_and_no_layers():
    phy2log, log2phy, logcnt = rebalance_experts(torch.zeros(2, 8), 12, 1, 1, 4)
    check_consistent(phy2log, log2phy, logcnt, 8)
    assert balance_ratio(rank_loads(phy2log, torch.zeros(2, 8), 4)).tolist() == [1.0, 1.0]
    empty = rebalance_experts(torch.zeros(0, 8), 12, 1, 1, 4)
    assert empty[0].shape == (0, 12)


def test_deterministic():
    weight = zipf_load(4, 32, seed=5)
    original = weight.clone()
    first = rebalance_experts(weight, 40, 4, 2, 8)
    second = rebalance_experts(weight.double(), 40, 4, 2, 8)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert torch.equal(weight, original)  # the input is not modified


# ---------------------------------------------------------------------------------------------
# derived tables and helpers


def test_default_placement_and_expert_map():
    phy2log = default_placement(2, 16, 4, 4)
    assert phy2log[0].tolist() == list(range(16)) + [0, 1, 2, 3]
    placement = Placement.from_phy2log(phy2log, 16, 4)
    assert placement.slots_per_rank == 5 and placement.num_layers == 2
    assert placement.logcnt[0].tolist() == [2] * 4 + [1] * 12
    assert placement.log2phy[0, 0].tolist() == [0, 16]
    assert placement.log2phy[0, 5].tolist() == [5, -1]
    expert_map = placement.expert_map()
    assert expert_map.shape == (2, 4, 16)
    # rank 3 holds slots 15..19: experts 15, 0, 1, 2, 3 at local slots 0..4
    assert expert_map[0, 3, 15] == 0 and expert_map[0, 3, 0] == 1 and expert_map[0, 3, 4] == -1
    assert expert_map[0, 0].tolist() == [0, 1, 2, 3, 4] + [-1] * 11


def test_expert_map_picks_lowest_local_slot_for_duplicates():
    phy2log = torch.tensor([[0, 1, 0, 2, 3, 1]])  # rank 0 holds expert 0 twice
    expert_map = expert_map_from_phy2log(phy2log, 4, 2)
    assert expert_map[0, 0].tolist() == [0, 1, -1, -1]
    assert expert_map[0, 1].tolist() == [-1, 2, 0, 1]
    assert log2phy_from_phy2log(phy2log, 4)[0].tolist() == [[0, 2], [1, 5], [3, -1], [4, -1]]


def test_rank_log2phy_prefers_local_then_spreads():
    # 2 ranks of 3 slots: rank 0 = [0, 1, 2], rank 1 = [0, 3, 3]
    phy2log = torch.tensor([[0, 1, 2, 0, 3, 3]])
    table = rank_log2phy_from_phy2log(phy2log, 4, 2)
    assert table[0, 0].tolist() == [0, 1, 2, 4]  # expert 3 remote: replica 0 % 2 -> slot 4
    assert table[0, 1].tolist() == [3, 1, 2, 4]  # expert 0 local on rank 1 (slot 3)
    weight = zipf_load(3, 16, seed=9)
    placement = Placement.from_phy2log(rebalance_experts(weight, 24, 1, 1, 4)[0], 16, 4)
    routed = placement.rank_log2phy()
    assert routed.shape == (3, 4, 16)
    # every entry is a slot that holds that expert
    held = placement.phy2log.gather(1, routed.view(3, -1)).view(3, 4, 16)
    assert torch.equal(held, torch.arange(16).expand(3, 4, -1))


def test_rank_loads_split_evenly_over_replicas():
    phy2log = torch.tensor([[0, 1, 0, 2]])
    loads = rank_loads(phy2log, torch.tensor([[8.0, 3.0, 5.0]]), 2)
    assert loads.tolist() == [[7.0, 9.0]]
    assert balance_ratio(loads).tolist() == [pytest.approx(9.0 / 8.0)]


# ---------------------------------------------------------------------------------------------
# errors


def test_negative_redundancy():
    with pytest.raises(ConfigError, match=r"num_redundant_experts=-1 is negative; use 0 or more"):
        check_redundancy(16, -1, 4)


def test_redundancy_not_divisible_lists_valid_choices():
    with pytest.raises(ConfigError) as info:
        check_redundancy(16, 3, 4)
    message = str(info.value)
    assert "(num_experts 16 + num_redundant_experts 3) = 19" in message
    assert "not divisible by ep_size 4" in message
    assert "{0, 4, 8, ...}" in message
    with pytest.raises(ConfigError, match=r"\{2, 8, 14, \.\.\.\}"):
        check_redundancy(262, 3, 6)  # 262 + 2 = 264 = 44 * 6


def test_rebalance_rejects_bad_settings():
    weight = torch.ones(1, 16)
    with pytest.raises(ConfigError, match="not divisible by ep_size 3"):
        rebalance_experts(weight, 20, 1, 1, 3)
    with pytest.raises(ConfigError, match="num_redundant_experts=-4 is negative"):
        rebalance_experts(weight, 12, 1, 1, 4)
    with pytest.raises(ConfigError, match="num_groups=3 does not divide num_experts=16"):
        rebalance_experts(weight, 18, 3, 1, 3)
    with pytest.raises(ConfigError, match="num_nodes=4 does not divide num_ranks=6"):
        rebalance_experts(torch.ones(1, 24), 24, 8, 4, 6)
    with pytest.raises(ConfigError, match="negative"):
        rebalance_experts(-weight, 16, 1, 1, 4)
    with pytest.raises(ConfigError, match="NaN"):
        rebalance_experts(weight * float("nan"), 16, 1, 1, 4)
    with pytest.raises(ConfigError, match="shape"):
        check_expert_load(torch.ones(16))


def test_validate_placement_errors():
    good = default_placement(2, 8, 0, 4)
    validate_placement(good, 8, 4)
    lost = good.clone()
    lost[1, 3] = 0
    with pytest.raises(ConfigError, match=r"layer 1 has no replica of logical expert\(s\) \[3\]"):
        validate_placement(lost, 8, 4)
    out = good.clone()
    out[0, 5] = 8
    message = r"layer 0 slot 5 \(rank 2\) holds logical expert 8, outside \[0, 8\)"
    with pytest.raises(ConfigError, match=message):
        validate_placement(out, 8, 4)
    with pytest.raises(ConfigError, match="8 physical slots per layer do not split evenly over 3"):
        validate_placement(good, 8, 3)
    with pytest.raises(ConfigError, match="has 2 MoE layers but the model has 3"):
        validate_placement(good, 8, 4, num_layers=3)
    with pytest.raises(ConfigError, match="integer"):
        validate_placement(good.float(), 8, 4)
    with pytest.raises(ConfigError, match="no replica"):
        Placement.from_phy2log(lost, 8, 4)


# ---------------------------------------------------------------------------------------------
# placement files


def test_placement_file_round_trip(tmp_path):
    weight = zipf_load(5, 16, seed=4)  # e.g. 4 main MoE layers + 1 MTP layer
    phy2log, _, _ = rebalance_experts(weight, 20, 1, 1, 4)
    path = tmp_path / "placement.json"
    export_placement(phy2log, 4, path)
    record = json.loads(path.read_text())
    assert record["moe_layer_count"] == 5
    assert [layer["layer_id"] for layer in record["layer_list"]] == [0, 1, 2, 3, 4]
    layer4 = record["layer_list"][4]
    assert layer4["device_count"] == 4
    assert layer4["device_list"][2] == {"device_id": 2, "device_expert": phy2log[4, 10:15].tolist()}
    loaded = load_placement(path, num_layers=5, num_logical=16, num_ranks=4)
    assert loaded.dtype == torch.int64 and torch.equal(loaded, phy2log)


def test_placement_file_accepts_any_layer_and_device_order(tmp_path):
    phy2log = default_placement(2, 4, 0, 2)
    record = {
        "moe_layer_count": 2,
        "layer_list": [
            {
                "layer_id": 1,
                "device_count": 2,
                "device_list": [{"device_id": 1, "device_expert": [3, 2]}, {"device_id": 0, "device_expert": [0, 1]}],
            },
            {
                "layer_id": 0,
                "device_count": 2,
                "device_list": [{"device_id": 0, "device_expert": [0, 1]}, {"device_id": 1, "device_expert": [2, 3]}],
            },
        ],
    }
    path = tmp_path / "p.json"
    path.write_text(json.dumps(record))
    loaded = load_placement(path, num_layers=2, num_logical=4, num_ranks=2)
    assert loaded.tolist() == [[0, 1, 2, 3], [0, 1, 3, 2]]
    assert torch.equal(loaded[0], phy2log[0])


def _write(tmp_path, record) -> str:
    path = tmp_path / "bad.json"
    path.write_text(record if isinstance(record, str) else json.dumps(record))
    return str(path)


def _record(layers=2, devices=2, slots=3, experts=4):
    phy2log = default_placement(layers, experts, devices * slots - experts, devices)
    from ascend_passes.eplb.placement_file import placement_to_json

    return placement_to_json(phy2log, devices)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda r: r.__setitem__("moe_layer_count", 3), r"moe_layer_count is 3 but the model has 2 MoE layers"),
        (lambda r: r["layer_list"].pop(), r"moe_layer_count is 2 but layer_list has 1 entries"),
        (
            lambda r: r["layer_list"][1]["device_list"][0]["device_expert"].__setitem__(1, 7),
            r"layer 1: device 0 lists logical expert 7, outside \[0, 4\)",
        ),
        (
            lambda r: r["layer_list"][1]["device_list"][0]["device_expert"].__setitem__(0, -1),
            r"layer 1: device 0 lists logical expert -1",
        ),
        (
            lambda r: r["layer_list"][0]["device_list"][1]["device_expert"].__setitem__(0, 0),
            r"layer 0 has no replica of logical expert\(s\) \[3\]",
        ),
        (
            lambda r: r["layer_list"][0]["device_list"][1]["device_expert"].append(1),
            r"layer 0: device 1 has 4 expert slots but the first device in the file has 3",
        ),
        (lambda r: r["layer_list"][0].__setitem__("device_count", 4), r"layer 0: device_count is 4 but EP has 2 ranks"),
        (lambda r: r["layer_list"][1].__setitem__("layer_id", 0), r"layer_id 0 appears twice"),
        (lambda r: r["layer_list"][1].__setitem__("layer_id", 5), r"layer_id 5 is not in \[0, 2\)"),
        (
            lambda r: r["layer_list"][0]["device_list"][1].__setitem__("device_id", 0),
            r"layer 0: device_id 0 appears twice",
        ),
        (
            lambda r: r["layer_list"][0]["device_list"][1].__setitem__("device_expert", [1.5, 2, 3]),
            r"device_expert must be a list of integers",
        ),
        (lambda r: r.pop("layer_list"), r'missing key "layer_list"'),
    ],
)
def test_bad_placement_files(tmp_path, mutate, message):
    record = _record()
    mutate(record)
    path = _write(tmp_path, record)
    with pytest.raises(ConfigError, match=message) as info:
        load_placement(path, num_layers=2, num_logical=4, num_ranks=2)
    assert path in str(info.value)


def test_malformed_and_missing_files(tmp_path):
    path = _write(tmp_path, '{"moe_layer_count": 2, "layer_list": [')
    with pytest.raises(ConfigError, match=r"bad.json: not valid JSON .* line 1"):
        load_placement(path, num_layers=2, num_logical=4, num_ranks=2)
    with pytest.raises(ConfigError, match="cannot be read"):
        load_placement(tmp_path / "absent.json", num_layers=2, num_logical=4, num_ranks=2)
    path = _write(tmp_path, "[1, 2]")
    with pytest.raises(ConfigError, match="top level must be a JSON object"):
        load_placement(path, num_layers=2, num_logical=4, num_ranks=2)


def test_export_rejects_uneven_devices_and_keeps_old_file(tmp_path):
    path = tmp_path / "placement.json"
    export_placement(default_placement(1, 4, 0, 2), 2, path)
    before = path.read_text()
    with pytest.raises(ConfigError, match="do not split evenly over 3 devices"):
        export_placement(default_placement(1, 4, 0, 2), 3, path)
    assert path.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["placement.json"]


# issue 14 item 8: an endless or hostile file is refused with ConfigError, never read to the end
def test_endless_placement_file_is_refused_after_the_size_cap(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"^placement file /dev/zero: more than 64 MiB, the most "
        r"read of a placement file",
    ):
        load_placement("/dev/zero", num_layers=2, num_logical=4, num_ranks=2)


def test_deeply_nested_placement_file_is_a_config_error(tmp_path):
    path = _write(tmp_path, "[" * 100_000 + "]" * 100_000)
    with pytest.raises(
        ConfigError,
        match=r"bad.json: JSON nested 100000 levels deep; the placement "
        r"format nests 6 \(object, layer_list",
    ):
        load_placement(path, num_layers=2, num_logical=4, num_ranks=2)
    # brackets inside strings do not count, and the documented depth still loads
    record = _record()
    record["comment"] = "[[[[[[[[{{{{{{ \\" + '" ]]]'
    assert load_placement(_write(tmp_path, record), num_layers=2, num_logical=4, num_ranks=2).shape == (2, 6)


def test_placement_file_of_wrong_kind(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"placement file 123: must be a path \(str or "
        r"os.PathLike\), got int",
    ):
        load_placement(123, num_layers=2, num_logical=4, num_ranks=2)
    with pytest.raises(ConfigError, match=r"cannot be read \(Is a directory\)"):
        load_placement(tmp_path, num_layers=2, num_logical=4, num_ranks=2)
    path = tmp_path / "binary.json"
    path.write_bytes(b'{"a": "\xff"}')
    with pytest.raises(ConfigError, match=r"binary.json: not UTF-8 text \(byte 7\)"):
        load_placement(path, num_layers=2, num_logical=4, num_ranks=2)
    record = _record(devices=1, slots=4)
    record["layer_list"][0]["device_count"] = True  # a bool is not a count
    with pytest.raises(ConfigError, match=r"layer 0: device_count is True but EP has 1 ranks"):
        load_placement(_write(tmp_path, record), num_layers=2, num_logical=4, num_ranks=1)
