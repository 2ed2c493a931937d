"""Expert placement for EPLB: replicate hot experts, pack replicas onto ranks, all layers at once.

Conventions follow DeepSeek's EPLB: ``phy2log[L, P]`` is the logical expert held by each physical
slot, ``log2phy[L, E, X]`` lists the slots of each logical expert (``-1`` padded), ``logcnt[L, E]``
counts them, and physical slot ``p`` lives on rank ``p // (P // num_ranks)`` at local slot
``p % (P // num_ranks)``.  The public functions take and return CPU torch tensors; the inner loops
run on NumPy arrays, which stay single-threaded (torch's intra-op thread pool costs far more than
the arithmetic on tensors this small, up to 100x on a busy machine).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

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
    "default_placement",
    "expert_map_from_phy2log",
    "log2phy_from_phy2log",
    "logcnt_from_phy2log",
    "rank_loads",
    "rank_log2phy_from_phy2log",
    "rebalance_experts",
    "replicate_experts",
]

logger = logging.getLogger("ascend_passes.eplb")

# How many alternative replica counts a badly packed row tries (see ``_place_replicas``).
_REPLICATION_VARIANTS = 8
# A row within this fraction of its lower bound is not retried.
_GOOD_ENOUGH = 1e-3


def _as_float64(weight: torch.Tensor) -> np.ndarray:
    """A private float64 copy: the caller's tensor is never written through a shared buffer."""
    return np.array(weight.detach().to("cpu", torch.float64).numpy(), copy=True)


# --------------------------------------------------------------------------------------------
# NumPy core: rows are independent problems (layers, or layer x node)


def _replica_counts(load: np.ndarray, num_phy: int, prefixes: tuple[int, ...] = ()) -> list[np.ndarray]:
    """Greedy replica counts ``[B, E]`` for ``num_phy`` slots, plus one count table per prefix.

    Each extra slot goes to the expert with the highest load per replica (ties: lowest id).  For a
    prefix ``k`` the greedy stops after ``k`` extra slots and the slots left over become second
    copies of the lightest experts, which adds only small items to the packing.
    """
    rows, num_log = load.shape
    extras = num_phy - num_log
    counts = np.ones((rows, num_log), dtype=np.int64)
    row = np.arange(rows)
    snapshots: dict[int, np.ndarray] = {}
    for step in range(extras + 1):
        if step in prefixes:
            snapshots[step] = counts.copy()
        if step == extras:
            break
        counts[row, (load / counts).argmax(axis=1)] += 1
    results = [counts]
    if prefixes:
        lightness = np.argsort(np.argsort(load, axis=1, kind="stable"), axis=1, kind="stable")
        for k in prefixes:
            left = extras - k
            results.append(snapshots[k] + left // num_log + (lightness < left % num_log))
    return results


def _greedy_members(weight: np.ndarray, num_packs: int, capacity: int) -> np.ndarray:
    """Longest-processing-time greedy with a cardinality limit; ``members[B, K, C]`` item ids.

    Items go heaviest first to the lightest pack that still has room, one step per item for all
    rows at once.
    """
    rows, _ = weight.shape
    row = np.arange(rows)
    order = np.argsort(-weight, axis=1, kind="stable")
    sorted_weight = np.take_along_axis(weight, order, axis=1)
    members = np.empty((rows, num_packs, capacity), dtype=np.int64)
    members[:, :, 0] = order[:, :num_packs]  # the heaviest items open one pack each
    pack_load = sorted_weight[:, :num_packs].copy()
    pack_fill = np.ones((rows, num_packs), dtype=np.int64)
    for j in range(num_packs, order.shape[1]):
        pack = np.where(pack_fill < capacity, pack_load, np.inf).argmin(axis=1)
        fill = pack_fill[row, pack]
        members[row, pack, fill] = order[:, j]
        pack_load[row, pack] += sorted_weight[:, j]
        pack_fill[row, pack] = fill + 1
    return members


def _refine_members(weight: np.ndarray, members: np.ndarray, max_rounds: int, rtol: float = 1e-9) -> None:
    """Lower the heaviest pack by swapping one of its items with one item of another pack, in place.

    Each round, in every row still improving, tries every swap between the heaviest pack and every
    other pack and applies the one that makes the larger of the two new loads smallest, if that
    lowers the heaviest pack by more than ``rtol`` of it.  The sorted pack loads then decrease
    lexicographically, so it terminates; a row without such a swap drops out.
    """
    rows, num_packs, capacity = members.shape
    item_weight = np.take_along_axis(weight, members.reshape(rows, -1), axis=1)
    item_weight = item_weight.reshape(rows, num_packs, capacity)
    load = item_weight.sum(axis=2)
    active = np.arange(rows)
    for _ in range(max_rounds):
        w = item_weight[active]
        pack_load = load[active]
        local = np.arange(active.size)
        heavy = pack_load.argmax(axis=1)
        peak = pack_load[local, heavy]
        # delta[a, k, i, j]: load the heaviest pack sheds by giving its item i for item j of pack k
        delta = w[local, heavy][:, None, :, None] - w[:, :, None, :]
        new_max = np.maximum(peak[:, None, None, None] - delta, pack_load[:, :, None, None] + delta)
        flat = new_max.reshape(active.size, -1).argmin(axis=1)
        best = new_max.reshape(active.size, -1)[local, flat]
        better = best < peak * (1.0 - rtol)
        if not better.any():
            break
        r, flat, hp = active[better], flat[better], heavy[better]
        pack = flat // (capacity * capacity)
        mine = (flat // capacity) % capacity
        theirs = flat % capacity
        shift = delta.reshape(active.size, -1)[local[better], flat]
        for table in (members, item_weight):
            out = table[r, hp, mine].copy()
            table[r, hp, mine] = table[r, pack, theirs]
            table[r, pack, theirs] = out
        load[r, hp] -= shift
        load[r, pack] += shift
        active = r


def _pack(weight: np.ndarray, num_packs: int, refine: bool = True) -> np.ndarray:
    """Balanced packing of ``weight[B, N]`` into equal-count packs; ``members[B, K, N // K]``,
    item ids ascending inside each pack."""
    rows, num_items = weight.shape
    capacity = num_items // num_packs
    if capacity == 1 or num_packs == 1:
        return np.broadcast_to(np.arange(num_items).reshape(num_packs, capacity), (rows, num_packs, capacity)).copy()
    members = _greedy_members(weight, num_packs, capacity)
    if refine:
        _refine_members(weight, members, max_rounds=4 * num_items)
    members.sort(axis=2)
    return members


def _pack_replicas(
    load: np.ndarray, counts: np.ndarray, num_packs: int, refine: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """Pack the replicas given by ``counts[B, E]`` (equal totals) onto ``num_packs`` packs.

    Returns ``slot_expert[B, P]`` (pack-major; inside a pack, by expert id) and the heaviest
    pack load ``[B]``.
    """
    rows, num_log = load.shape
    num_phy = int(counts[0].sum())
    expert = np.repeat(np.tile(np.arange(num_log), rows), counts.ravel()).reshape(rows, num_phy)
    replica_load = np.take_along_axis(load / counts, expert, axis=1)
    members = _pack(replica_load, num_packs, refine).reshape(rows, num_phy)
    slot_expert = np.take_along_axis(expert, members, axis=1)
    pack_load = np.take_along_axis(replica_load, members, axis=1).reshape(rows, num_packs, -1)
    return slot_expert, pack_load.sum(axis=2).max(axis=1)


def _place_replicas(load: np.ndarray, num_phy: int, num_packs: int, refine: bool = True) -> np.ndarray:
    """Replicate and pack: ``slot_expert[B, num_phy]``, ``num_phy // num_packs`` slots per pack.

    First the greedy replication (min-max load per replica) is packed.  A row that ends more than
    ``_GOOD_ENOUGH`` above its lower bound ``max(mean pack load, max load per replica)`` is
    usually one where a few very hot experts were cut into more heavy replicas than there are
    packs; it is retried with fewer greedy replicas (the spare slots holding copies of the
    lightest experts) and keeps whichever packing has the lightest heaviest pack.  Without
    ``refine``: the greedy replication and greedy packing only (DeepSeek's EPLB).
    """
    rows, num_log = load.shape
    extras = num_phy - num_log
    prefixes = tuple(range(extras - 1, max(-1, extras - 1 - _REPLICATION_VARIANTS), -1))
    if not refine:
        prefixes = ()
    counts, *variants = _replica_counts(load, num_phy, prefixes)
    slot_expert, peak = _pack_replicas(load, counts, num_packs, refine)
    bound = np.maximum(load.sum(axis=1) / num_packs, (load / counts).max(axis=1))
    retry = np.nonzero(peak > bound * (1.0 + _GOOD_ENOUGH))[0]
    if retry.size == 0 or not variants:
        return slot_expert
    candidates, candidate_peak = _pack_replicas(
        np.concatenate([load[retry]] * len(variants)),
        np.concatenate([v[retry] for v in variants]),
        num_packs,
    )
    candidates = candidates.reshape(len(variants), retry.size, num_phy)
    candidate_peak = candidate_peak.reshape(len(variants), retry.size)
    pick = candidate_peak.argmin(axis=0)
    improved = candidate_peak[pick, np.arange(retry.size)] < peak[retry] * (1.0 - 1e-9)
    chosen = retry[improved]
    slot_expert[chosen] = candidates[pick[improved], np.nonzero(improved)[0]]
    return slot_expert


def _hierarchical_phy2log(
    load: np.ndarray,
    num_physical: int,
    num_groups: int,
    num_nodes: int,
    num_ranks: int,
    refine: bool = True,
) -> np.ndarray:
    """Groups onto nodes, then replicate and pack inside every node; ``phy2log[L, P]``."""
    layers, num_logical = load.shape
    group_size = num_logical // num_groups
    # 1. whole expert groups onto nodes, balancing tokens per node
    group_load = load.reshape(layers, num_groups, group_size).sum(axis=2)
    node_groups = _pack(group_load, num_nodes, refine)  # [L, N, G // N]
    # node-major list of logical experts: node 0's groups, then node 1's, ...
    logical_at = (node_groups[..., None] * group_size + np.arange(group_size)).reshape(layers, -1)
    # 2. + 3. replicate inside each node and pack onto that node's ranks
    node_load = np.take_along_axis(load, logical_at, axis=1).reshape(layers * num_nodes, -1)
    local = _place_replicas(node_load, num_physical // num_nodes, num_ranks // num_nodes, refine)
    phy2log = np.take_along_axis(
        logical_at.reshape(layers, num_nodes, -1), local.reshape(layers, num_nodes, -1), axis=2
    )
    return phy2log.reshape(layers, num_physical)


# --------------------------------------------------------------------------------------------
# building blocks (DeepSeek EPLB's API, on torch tensors)


def replicate_experts(weight: torch.Tensor, num_phy: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Give ``num_phy`` slots to ``E`` experts so that the heaviest load per replica is smallest.

    Every expert gets one slot; each extra slot goes, one at a time, to the expert whose load per
    replica is highest at that moment (ties: lowest id).  That greedy is optimal for the min-max
    load per replica.  Replicas of one expert are adjacent in the output.

    Args:
        weight: ``[B, E]`` load of each expert (B independent rows: layers, or layer x node).
        num_phy: number of physical slots per row, ``>= E``.

    Returns:
        phy2log: ``[B, num_phy]`` expert of each slot, ascending.
        replica_rank: ``[B, num_phy]`` index of the slot among its expert's replicas (0, 1, ...).
        logcnt: ``[B, E]`` number of replicas of each expert.
    """
    rows, num_log = weight.shape
    if num_phy < num_log:
        raise ValueError(f"num_phy={num_phy} is smaller than the {num_log} experts it must hold")
    (counts,) = _replica_counts(_as_float64(weight), num_phy)
    logcnt = torch.from_numpy(counts)
    phy2log = torch.repeat_interleave(torch.arange(num_log).repeat(rows), logcnt.flatten())
    phy2log = phy2log.view(rows, num_phy)
    first_slot = logcnt.cumsum(dim=-1) - logcnt
    replica_rank = torch.arange(num_phy).expand(rows, -1) - first_slot.gather(-1, phy2log)
    return phy2log, replica_rank, logcnt


def balanced_packing(weight: torch.Tensor, num_packs: int, *, refine: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack ``N`` weighted items into ``num_packs`` packs of exactly ``N / num_packs`` items each,
    keeping the heaviest pack as light as possible.

    Greedy (heaviest item to the lightest non-full pack), then, with ``refine``, pairwise swaps
    out of the heaviest pack while they lower it.  Items inside a pack are ordered by item index.

    Args:
        weight: ``[B, N]`` item weights, ``N`` a multiple of ``num_packs``.
        num_packs: number of packs.

    Returns:
        pack_index: ``[B, N]`` pack of each item.
        rank_in_pack: ``[B, N]`` position of each item inside its pack.
    """
    rows, num_items = weight.shape
    if num_packs < 1 or num_items % num_packs != 0:
        raise ValueError(f"{num_items} items do not split evenly into {num_packs} packs")
    capacity = num_items // num_packs
    members = _pack(_as_float64(weight), num_packs, refine).reshape(rows, num_items)
    pack_index = np.empty((rows, num_items), dtype=np.int64)
    rank_in_pack = np.empty((rows, num_items), dtype=np.int64)
    np.put_along_axis(pack_index, members, np.repeat(np.arange(num_packs), capacity)[None], axis=1)
    np.put_along_axis(rank_in_pack, members, np.tile(np.arange(capacity), num_packs)[None], axis=1)
    return torch.from_numpy(pack_index), torch.from_numpy(rank_in_pack)


# --------------------------------------------------------------------------------------------
# derived tables


def logcnt_from_phy2log(phy2log: torch.Tensor, num_logical: int) -> torch.Tensor:
    """``logcnt[L, E]``: number of physical slots holding each logical expert."""
    logcnt = torch.zeros(phy2log.shape[0], num_logical, dtype=torch.int64)
    return logcnt.scatter_add_(1, phy2log.long(), torch.ones_like(phy2log, dtype=torch.int64))


def log2phy_from_phy2log(phy2log: torch.Tensor, num_logical: int) -> torch.Tensor:
    """``log2phy[L, E, X]``: the physical slots of each logical expert, ascending, ``-1`` padded.

    ``X`` is the largest replica count over all layers and experts.
    """
    phy2log = phy2log.long()
    layers, slots = phy2log.shape
    logcnt = logcnt_from_phy2log(phy2log, num_logical)
    width = int(logcnt.max()) if logcnt.numel() else 0
    by_expert, phys = phy2log.sort(dim=-1, stable=True)  # slots grouped by expert, ascending
    first = logcnt.cumsum(dim=-1) - logcnt
    replica = torch.arange(slots).expand(layers, -1) - first.gather(-1, by_expert)
    log2phy = torch.full((layers, num_logical * width), -1, dtype=torch.int64)
    log2phy.scatter_(1, by_expert * width + replica, phys)
    return log2phy.view(layers, num_logical, width)


def expert_map_from_phy2log(phy2log: torch.Tensor, num_logical: int, num_ranks: int) -> torch.Tensor:
    """``expert_map[L, R, E]``: local slot of logical expert ``e`` on rank ``r``, or ``-1``.

    When a rank holds two replicas of one expert, the lower local slot is given.
    """
    layers, slots = phy2log.shape
    per_rank = slots // num_ranks
    local = torch.arange(slots) % per_rank
    rank = torch.arange(slots) // per_rank
    target = (rank * num_logical).expand(layers, -1) + phy2log.long()
    expert_map = torch.full((layers, num_ranks * num_logical), per_rank, dtype=torch.int64)
    expert_map.scatter_reduce_(1, target, local.expand(layers, -1), reduce="amin")
    expert_map[expert_map == per_rank] = -1
    return expert_map.view(layers, num_ranks, num_logical)


def rank_log2phy_from_phy2log(phy2log: torch.Tensor, num_logical: int, num_ranks: int) -> torch.Tensor:
    """``[L, R, E]``: the physical slot rank ``r`` sends expert ``e``'s tokens to.

    A replica on rank ``r`` itself when there is one (no traffic); otherwise replica
    ``r % logcnt[e]`` in ``log2phy`` order, so ranks without a local copy spread evenly over the
    replicas.  This is the per-rank ``log2phy`` that the router's ``topk_ids`` index.
    """
    layers, slots = phy2log.shape
    per_rank = slots // num_ranks
    log2phy = log2phy_from_phy2log(phy2log, num_logical)  # [L, E, X]
    logcnt = logcnt_from_phy2log(phy2log, num_logical)
    pick = torch.arange(num_ranks)[None, None, :] % logcnt[:, :, None]  # [L, E, R]
    remote = log2phy.gather(2, pick).transpose(1, 2)  # [L, R, E]
    local = expert_map_from_phy2log(phy2log, num_logical, num_ranks)
    own = torch.arange(num_ranks)[None, :, None] * per_rank + local
    return torch.where(local >= 0, own, remote)


def rank_loads(phy2log: torch.Tensor, weight: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """``[L, R]`` load of every rank, when each expert's load ``weight[L, E]`` splits evenly over
    its replicas."""
    layers, slots = phy2log.shape
    weight = weight.double()
    logcnt = logcnt_from_phy2log(phy2log, weight.shape[1])
    per_replica = weight / logcnt.clamp_min(1)
    return per_replica.gather(-1, phy2log.long()).view(layers, num_ranks, -1).sum(-1)


def balance_ratio(loads: torch.Tensor) -> torch.Tensor:
    """``[L]`` max over mean of per-rank loads ``[L, R]``; 1.0 for a layer without load."""
    mean = loads.mean(dim=-1)
    ratio = loads.max(dim=-1).values / mean.clamp_min(torch.finfo(loads.dtype).tiny)
    return torch.where(mean > 0, ratio, torch.ones_like(ratio))


# --------------------------------------------------------------------------------------------
# placements


def default_placement(num_layers: int, num_logical: int, num_redundant: int, num_ranks: int) -> torch.Tensor:
    """The placement before any statistics: logical experts in order, then redundant copies of
    experts ``0, 1, ...`` appended (slot ``p`` holds expert ``p % E``).

    Returns ``phy2log[L, E + R]``; raises ``ConfigError`` as ``check_redundancy`` does.
    """
    check_redundancy(num_logical, num_redundant, num_ranks)
    slots = torch.arange(num_logical + num_redundant) % num_logical
    return slots.expand(num_layers, -1).clone()


def rebalance_experts(
    weight: torch.Tensor,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_ranks: int,
    *,
    refine: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Compute a balanced expert placement from per-layer expert loads.

    Hierarchical when ``num_groups % num_nodes == 0``: whole expert groups are packed onto nodes,
    experts are replicated inside their node and the replicas packed onto that node's ranks, so an
    expert group never leaves its node.  Otherwise global: replication and packing over all ranks.

    Args:
        weight: ``[L, E]`` load (token count) of every logical expert in every MoE layer.
        num_replicas: physical slots per layer, ``P = E + num_redundant``, a multiple of num_ranks.
        num_groups: expert groups of the router (DeepSeek-V3: 8); 1 if it has none.
        num_nodes: server nodes; ranks inside a node share the fast interconnect.
        num_ranks: EP ranks, a multiple of ``num_nodes`` when hierarchical.
        refine: improve on the greedy steps (pairwise swaps out of the heaviest rank, and fewer
            hot replicas where the greedy replication packs badly); ``False`` gives DeepSeek's
            plain greedy, faster and less balanced.

    Returns:
        phy2log: ``[L, P]`` logical expert of every physical slot.
        log2phy: ``[L, E, X]`` slots of every logical expert, ascending, ``-1`` padded.
        logcnt: ``[L, E]`` replica count of every logical expert (always >= 1).

    Raises:
        ConfigError: for loads that are not finite and non-negative, or impossible counts.
    """
    check_expert_load(weight)
    layers, num_logical = weight.shape
    hierarchical = check_topology(num_logical, num_replicas, num_groups, num_nodes, num_ranks)
    load = _as_float64(weight)
    if not hierarchical:
        num_groups = num_nodes = 1
    if layers == 0:
        phy2log = torch.empty(0, num_replicas, dtype=torch.int64)
    else:
        phy2log = torch.from_numpy(_hierarchical_phy2log(load, num_replicas, num_groups, num_nodes, num_ranks, refine))
    logcnt = logcnt_from_phy2log(phy2log, num_logical)
    log2phy = log2phy_from_phy2log(phy2log, num_logical)
    if logger.isEnabledFor(logging.DEBUG):
        ratio = balance_ratio(rank_loads(phy2log, weight, num_ranks))
        logger.debug(
            "eplb placement (%s) for %d layers: %d experts -> %d slots on %d ranks, "
            "max/mean rank load %.4f (mean over layers), %.4f (worst layer)",
            "hierarchical" if hierarchical else "global",
            layers,
            num_logical,
            num_replicas,
            num_ranks,
            float(ratio.mean()) if layers else 1.0,
            float(ratio.max()) if layers else 1.0,
        )
    return phy2log, log2phy, logcnt


@dataclass(frozen=True)
class Placement:
    """A validated placement with its derived tables, for the runtime and the EPLB pass.

    Attributes:
        phy2log: ``[L, P]`` logical expert of every physical slot.
        log2phy: ``[L, E, X]`` physical slots of every logical expert, ascending, ``-1`` padded.
        logcnt: ``[L, E]`` replica count of every logical expert.
        num_ranks: EP ranks; rank ``r`` holds slots ``[r * S, (r + 1) * S)``, ``S = P // R``.
    """

    phy2log: torch.Tensor
    log2phy: torch.Tensor
    logcnt: torch.Tensor
    num_ranks: int

    @classmethod
    def from_phy2log(
        cls, phy2log: torch.Tensor, num_logical: int, num_ranks: int, *, source: str = "placement"
    ) -> Placement:
        """Validate ``phy2log[L, P]`` (``ConfigError`` if unusable) and derive the other tables."""
        validate_placement(phy2log, num_logical, num_ranks, source=source)
        phy2log = phy2log.to("cpu", torch.int64)
        return cls(
            phy2log=phy2log,
            log2phy=log2phy_from_phy2log(phy2log, num_logical),
            logcnt=logcnt_from_phy2log(phy2log, num_logical),
            num_ranks=num_ranks,
        )

    @property
    def num_layers(self) -> int:
        return self.phy2log.shape[0]

    @property
    def num_physical(self) -> int:
        return self.phy2log.shape[1]

    @property
    def num_logical(self) -> int:
        return self.logcnt.shape[1]

    @property
    def slots_per_rank(self) -> int:
        return self.num_physical // self.num_ranks

    def expert_map(self) -> torch.Tensor:
        """``[L, R, E]`` local slot of each logical expert on each rank, ``-1`` where absent."""
        return expert_map_from_phy2log(self.phy2log, self.num_logical, self.num_ranks)

    def rank_log2phy(self) -> torch.Tensor:
        """``[L, R, E]`` physical slot each rank routes each logical expert to (local first)."""
        return rank_log2phy_from_phy2log(self.phy2log, self.num_logical, self.num_ranks)

    def rank_loads(self, weight: torch.Tensor) -> torch.Tensor:
        """``[L, R]`` per-rank load for expert loads ``weight[L, E]``."""
        return rank_loads(self.phy2log, weight, self.num_ranks)
