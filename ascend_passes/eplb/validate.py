"""Checks that EPLB settings, expert loads and placements are usable, raising ``ConfigError``.

Every check either passes silently or raises one ``ConfigError`` whose message names the value
that is wrong and what to change; nothing is modified, so a failed check leaves no partial state.
"""

from __future__ import annotations

import torch

from ascend_passes.errors import ConfigError

__all__ = [
    "check_expert_load",
    "check_redundancy",
    "check_topology",
    "validate_placement",
]


def _short_list(values: list[int], limit: int = 8) -> str:
    """``[1, 2, 3]``, or the first ``limit`` values and a count of the rest."""
    if len(values) <= limit:
        return str(values)
    shown = ", ".join(str(v) for v in values[:limit])
    return f"[{shown}, ... ({len(values) - limit} more)]"


def check_redundancy(num_logical: int, num_redundant: int, ep_size: int) -> None:
    """Check that ``num_logical + num_redundant`` physical experts split evenly over ``ep_size``.

    Raises ``ConfigError`` for a negative redundancy, a non-positive expert count or EP size, or a
    physical expert count that ``ep_size`` does not divide (the message lists valid redundancies).
    """
    if ep_size < 1:
        raise ConfigError(f"ep_size={ep_size} must be 1 or more")
    if num_logical < 1:
        raise ConfigError(f"num_experts={num_logical} must be 1 or more")
    if num_redundant < 0:
        raise ConfigError(f"eplb.num_redundant_experts={num_redundant} is negative; use 0 or more")
    total = num_logical + num_redundant
    if total % ep_size != 0:
        first = (-num_logical) % ep_size
        choices = ", ".join(str(first + k * ep_size) for k in range(3))
        raise ConfigError(
            f"(num_experts {num_logical} + num_redundant_experts {num_redundant}) = {total} "
            f"is not divisible by ep_size {ep_size}, so ranks would hold unequal expert slots; "
            f"choose num_redundant_experts in {{{choices}, ...}}"
        )


def check_topology(num_logical: int, num_physical: int, num_groups: int, num_nodes: int, num_ranks: int) -> bool:
    """Check the shape arguments of the placement algorithm; return True when it is hierarchical.

    The placement is hierarchical (expert groups packed onto nodes first) when ``num_groups`` is a
    multiple of ``num_nodes``, and global otherwise.  Raises ``ConfigError`` for counts below 1,
    fewer physical than logical experts, slots that do not split evenly over ranks, and, for a
    hierarchical placement, groups that do not split the experts or nodes that do not split the
    ranks.
    """
    for name, value in (
        ("num_experts", num_logical),
        ("num_groups", num_groups),
        ("num_nodes", num_nodes),
        ("num_ranks", num_ranks),
    ):
        if value < 1:
            raise ConfigError(f"{name}={value} must be 1 or more")
    check_redundancy(num_logical, num_physical - num_logical, num_ranks)
    hierarchical = num_groups % num_nodes == 0
    if hierarchical:
        if num_logical % num_groups != 0:
            raise ConfigError(
                f"num_groups={num_groups} does not divide num_experts={num_logical}; expert "
                f"groups must be equal, so use a num_groups that divides {num_logical}"
            )
        if num_ranks % num_nodes != 0:
            raise ConfigError(
                f"num_nodes={num_nodes} does not divide num_ranks={num_ranks}; every node must "
                f"hold the same number of ranks, so use a num_nodes that divides {num_ranks}"
            )
    return hierarchical


def check_expert_load(weight: torch.Tensor, num_logical: int | None = None) -> None:
    """Check an expert load table ``weight[L, E]``: two dimensions, finite, non-negative."""
    if weight.dim() != 2:
        raise ConfigError(f"expert load must have shape [layers, experts], got shape {tuple(weight.shape)}")
    if num_logical is not None and weight.shape[1] != num_logical:
        raise ConfigError(
            f"expert load has {weight.shape[1]} experts per layer but the model has "
            f"{num_logical}; pass logical-expert loads, not physical-slot loads"
        )
    if weight.numel() and not torch.isfinite(weight.double()).all():
        raise ConfigError("expert load contains NaN or infinite values; pass finite token counts")
    if weight.numel() and (weight < 0).any():
        layer = int((weight < 0).any(dim=1).nonzero()[0, 0])
        raise ConfigError(f"expert load of layer {layer} is negative; loads are token counts >= 0")


def validate_placement(
    phy2log: torch.Tensor,
    num_logical: int,
    num_ranks: int,
    *,
    num_layers: int | None = None,
    source: str = "placement",
) -> None:
    """Check a placement ``phy2log[L, P]`` (logical expert id of every physical slot).

    Raises ``ConfigError`` when the table is not an integer ``[L, P]`` tensor, has the wrong layer
    count, has a slot count that ``num_ranks`` does not divide, holds a logical id outside
    ``[0, num_logical)``, or loses a logical expert (no replica in some layer).  ``source`` names
    where the table came from (a file path, say) in the message.
    """
    if phy2log.dim() != 2:
        raise ConfigError(
            f"{source}: phy2log must have shape [layers, physical slots], got shape {tuple(phy2log.shape)}"
        )
    if phy2log.dtype.is_floating_point or phy2log.dtype.is_complex or phy2log.dtype == torch.bool:
        raise ConfigError(f"{source}: phy2log must hold integer expert ids, got {phy2log.dtype}")
    layers, slots = phy2log.shape
    if num_layers is not None and layers != num_layers:
        raise ConfigError(
            f"{source}: has {layers} MoE layers but the model has {num_layers} "
            "(main MoE layers first, then MTP layers); regenerate it for this model"
        )
    if num_ranks < 1:
        raise ConfigError(f"{source}: num_ranks={num_ranks} must be 1 or more")
    if slots == 0 or slots % num_ranks != 0:
        raise ConfigError(
            f"{source}: {slots} physical slots per layer do not split evenly over {num_ranks} "
            f"ranks; use a multiple of {num_ranks} slots (num_experts + num_redundant_experts)"
        )
    if slots < num_logical:
        raise ConfigError(
            f"{source}: {slots} physical slots cannot hold {num_logical} logical experts; "
            f"use at least {num_logical} slots"
        )
    bad = (phy2log < 0) | (phy2log >= num_logical)
    if bad.any():
        layer, slot = (int(v) for v in bad.nonzero()[0])
        raise ConfigError(
            f"{source}: layer {layer} slot {slot} (rank {slot // (slots // num_ranks)}) holds "
            f"logical expert {int(phy2log[layer, slot])}, outside [0, {num_logical}); "
            f"logical ids must be below num_experts={num_logical}"
        )
    present = torch.zeros(layers, num_logical, dtype=torch.bool)
    present.scatter_(1, phy2log.long().cpu(), True)
    if not present.all():
        layer = int((~present).any(dim=1).nonzero()[0, 0])
        lost = (~present[layer]).nonzero().flatten().tolist()
        raise ConfigError(
            f"{source}: layer {layer} has no replica of logical expert(s) {_short_list(lost)}; "
            "every logical expert needs at least one physical slot in every layer"
        )
