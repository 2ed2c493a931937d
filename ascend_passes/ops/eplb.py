"""``ascend.eplb_*``: the EPLB expert indirection as ops — logical→physical expert ids, per-slot
load counting, and the logical view of physically laid-out expert weights.

This module holds their records (``OPS``): schema, reference, fake, checks; ``ascend_passes.ops``
registers them.
They are ours (no torch_npu counterpart); on an NPU they lower to the same small gather /
scatter-add ATen kernels they run here.

Schemas and what they compute (``E`` logical experts, ``P`` physical slots, ``X`` the width of
the replica table, ``T`` tokens, ``K`` top-k)::

    eplb_map(Tensor expert_idx, Tensor log2phy, Tensor replica_count, *, int rank=0) -> Tensor
        expert_idx [T, K] logical ids (any integer dtype), log2phy [E, X] int64 physical slots
        of each expert (-1 padded), replica_count [E] int64 (>= 1).  Returns [T, K] physical
        slots, expert_idx's dtype:  e = expert_idx[t, k],
        out[t, k] = log2phy[e, (t + rank + e) % replica_count[e]]
        — deterministic, and consecutive tokens of one expert go round-robin over its replicas
        (the ``+ e`` spreads the experts of one token).  ``rank`` is for data-parallel serving,
        where every rank routes different tokens; the ``eplb`` pass always passes 0: under its
        expert parallelism every rank maps the *same* (replicated or all-gathered) tokens, and
        a token must pick the same replica on every rank, or it would be computed twice or never.

    eplb_record_load(Tensor(a!) expert_load, Tensor expert_idx, Tensor record, *,
                     int[] active_expert_range=[]) -> ()
        expert_load [P] int64 += bincount(expert_idx, P) * record   (in place; record a 1-element
        bool/int tensor, so counting switches on and off at run time without a sync or a branch).
        With ``active_expert_range=[start, end]`` only ids in ``[start, end)`` are counted (this
        rank's slots under expert parallelism: the loads of all ranks then sum to the global load).

    eplb_logical_weight(Tensor phy_weight, Tensor log2phy, Tensor replica_count,
                        Tensor expert_load, Tensor record) -> Tensor
        phy_weight [P, ...] -> [E, ...]: the first replica of every logical expert,
        phy_weight.index_select(0, log2phy[:, 0]).  This is how an attached model's *eager*
        forward sees its logical weights (Hugging Face code indexes experts by logical id); it
        also carries the layer's EPLB tables, so that Dynamo lifts them as graph inputs and the
        ``eplb`` pass finds them next to the weights.  After the pass the grouped matmuls read
        ``phy_weight`` directly and this node is dead code.  Under expert parallelism a rank
        holds only its slots (``phy_weight.shape[0] < expert_load.shape[0]``): there is no logical
        view then (the fake impl still gives its shape, for tracing), and running it is an error.
        It reads the tables and the weights under the EPLB forward lock (``eplb/sync.py``), so a
        ``rebalance()`` in another thread never shows it a half-moved expert.

CPU path: the reference implementations below (one gather / scatter-add each), registered for
every backend (``CompositeExplicitAutograd``); a C++ kernel would gain nothing on ops this small.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

from ascend_passes.eplb.sync import FORWARD_LOCK

from ._define import Op
from .checks import check_dim, fail


# ------------------------------------------------------------------------------------ checks
def _check_tables(op: str, log2phy: torch.Tensor, replica_count: torch.Tensor) -> None:
    check_dim(op, "log2phy", log2phy, (2,))
    check_dim(op, "replica_count", replica_count, (1,))
    if log2phy.dtype != torch.int64 or replica_count.dtype != torch.int64:
        fail(op, f"log2phy and replica_count must be int64, got {log2phy.dtype} and {replica_count.dtype}")
    if log2phy.shape[0] != replica_count.shape[0]:
        fail(op, f"log2phy has {log2phy.shape[0]} experts but replica_count {replica_count.shape[0]}")


def _check_ids(op: str, expert_idx: torch.Tensor) -> None:
    if expert_idx.dtype.is_floating_point or expert_idx.dtype == torch.bool:
        fail(op, f"expert_idx must hold integer expert ids, got {expert_idx.dtype}")


def _check_id_values(op: str, name: str, ids: torch.Tensor, bound: int, what: str) -> None:
    """Every value of ``ids`` in ``[0, bound)``, else the first bad one (flat order) named.  A value
    check of the reference (real tensors only: a fake or traced call has no values to read)."""
    if is_fake(ids) or ids.numel() == 0:
        return
    bad = (ids < 0) | (ids >= bound)
    if bad.any():
        fail(op, f"{name} holds {what} {int(ids[bad].reshape(-1)[0])} out of range [0, {bound})")


# ------------------------------------------------------------------------------------ reference
def eplb_map(
    expert_idx: torch.Tensor, log2phy: torch.Tensor, replica_count: torch.Tensor, *, rank: int = 0
) -> torch.Tensor:
    """Reference implementation (the CPU path): logical → physical expert ids."""
    _check_tables("eplb_map", log2phy, replica_count)
    _check_ids("eplb_map", expert_idx)
    check_dim("eplb_map", "expert_idx", expert_idx, (2,))
    _check_id_values("eplb_map", "expert_idx", expert_idx, log2phy.shape[0], "logical expert id")
    expert = expert_idx.long()
    token = torch.arange(expert.shape[0], device=expert.device).unsqueeze(1)
    replica = (token + rank + expert) % replica_count.index_select(0, expert.flatten()).view_as(expert)
    return log2phy[expert, replica].to(expert_idx.dtype)


def _check_range(op: str, active_expert_range, num_slots: int) -> tuple[int, int]:
    if len(active_expert_range) == 0:
        return 0, num_slots
    if len(active_expert_range) != 2 or not 0 <= active_expert_range[0] < active_expert_range[1] <= num_slots:
        fail(
            op,
            f"active_expert_range={list(active_expert_range)} must be [start, end] with "
            f"0 <= start < end <= {num_slots}",
        )
    return int(active_expert_range[0]), int(active_expert_range[1])


def eplb_record_load(
    expert_load: torch.Tensor, expert_idx: torch.Tensor, record: torch.Tensor, *, active_expert_range=()
) -> None:
    """Reference implementation: ``expert_load += bincount(expert_idx) * record`` in place
    (ids outside ``active_expert_range``, when given, are not counted)."""
    _check_ids("eplb_record_load", expert_idx)
    check_dim("eplb_record_load", "expert_load", expert_load, (1,))
    if expert_load.dtype != torch.int64:
        fail("eplb_record_load", f"expert_load must be int64, got {expert_load.dtype}")
    if record.numel() != 1:
        fail("eplb_record_load", f"record must hold one value, got shape {tuple(record.shape)}")
    start, end = _check_range("eplb_record_load", active_expert_range, expert_load.shape[0])
    _check_id_values("eplb_record_load", "expert_idx", expert_idx, expert_load.shape[0], "physical slot")
    ids = expert_idx.reshape(-1).long()
    on = record.reshape(1).to(torch.int64).expand(ids.numel())
    if (start, end) != (0, expert_load.shape[0]):
        on = on * ((ids >= start) & (ids < end))
    expert_load.scatter_add_(0, ids, on)


def eplb_logical_weight(
    phy_weight: torch.Tensor,
    log2phy: torch.Tensor,
    replica_count: torch.Tensor,
    expert_load: torch.Tensor,
    record: torch.Tensor,
) -> torch.Tensor:
    """Reference implementation: the first replica of every logical expert, ``[E, ...]``."""
    _check_tables("eplb_logical_weight", log2phy, replica_count)
    if phy_weight.shape[0] != expert_load.shape[0]:
        fail(
            "eplb_logical_weight",
            f"this rank holds {phy_weight.shape[0]} of {expert_load.shape[0]} physical expert slots "
            "(expert parallelism across processes): the logical expert weights are not all here, so "
            "the attached model runs only compiled, with eplb enabled (torch.compile(model, "
            "backend='ascend_passes', options={'eplb': {...}}))",
        )
    _check_id_values("eplb_logical_weight", "log2phy[:, 0]", log2phy[:, 0], phy_weight.shape[0], "physical slot")
    # the eager attached model's read of tables + weights: one consistent gather even while
    # rebalance() runs in another thread (re-entrant inside a compiled forward, which holds it)
    with FORWARD_LOCK.reading():
        return phy_weight.index_select(0, log2phy[:, 0])


# ------------------------------------------------------------------------------------ fake
def eplb_map_fake(expert_idx, log2phy, replica_count, *, rank=0):
    _check_tables("eplb_map", log2phy, replica_count)
    _check_ids("eplb_map", expert_idx)
    check_dim("eplb_map", "expert_idx", expert_idx, (2,))
    return torch.empty_like(expert_idx)


def eplb_record_load_fake(expert_load, expert_idx, record, *, active_expert_range=()):
    _check_ids("eplb_record_load", expert_idx)
    _check_range("eplb_record_load", active_expert_range, expert_load.shape[0])
    return None


def eplb_logical_weight_fake(phy_weight, log2phy, replica_count, expert_load, record):
    _check_tables("eplb_logical_weight", log2phy, replica_count)
    return phy_weight.new_empty([log2phy.shape[0], *phy_weight.shape[1:]])


# ------------------------------------------------------------------------------------ records
OPS = (
    Op(
        schema="eplb_map(Tensor expert_idx, Tensor log2phy, Tensor replica_count, *, int rank=0) -> Tensor",
        reference=eplb_map,
        fake=eplb_map_fake,
    ),
    Op(
        schema="eplb_record_load(Tensor(a!) expert_load, Tensor expert_idx, Tensor record, *, "
        "int[] active_expert_range=[]) -> ()",
        reference=eplb_record_load,
        fake=eplb_record_load_fake,
    ),
    Op(
        schema="eplb_logical_weight(Tensor phy_weight, Tensor log2phy, Tensor replica_count, "
        "Tensor expert_load, Tensor record) -> Tensor",
        reference=eplb_logical_weight,
        fake=eplb_logical_weight_fake,
    ),
)
SCHEMAS: dict[str, str] = {op.name: op.schema for op in OPS}

__all__ = ["OPS", "SCHEMAS", "eplb_logical_weight", "eplb_map", "eplb_record_load"]
