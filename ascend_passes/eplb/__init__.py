"""Expert-parallel load balancing (EPLB): expert placement, its validation and placement files."""

from ascend_passes.eplb.placement import (
    Placement,
    balance_ratio,
    balanced_packing,
    default_placement,
    expert_map_from_phy2log,
    log2phy_from_phy2log,
    logcnt_from_phy2log,
    rank_loads,
    rank_log2phy_from_phy2log,
    rebalance_experts,
    replicate_experts,
)
from ascend_passes.eplb.placement_file import export_placement, load_placement
from ascend_passes.eplb.validate import (
    check_expert_load,
    check_redundancy,
    check_topology,
    validate_placement,
)

__all__ = [
    "Placement",
    "balance_ratio",
    "balanced_packing",
    "check_expert_load",
    "check_redundancy",
    "check_topology",
    "default_placement",
    "expert_map_from_phy2log",
    "export_placement",
    "load_placement",
    "log2phy_from_phy2log",
    "logcnt_from_phy2log",
    "rank_loads",
    "rank_log2phy_from_phy2log",
    "rebalance_experts",
    "replicate_experts",
    "validate_placement",
]
