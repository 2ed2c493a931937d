"""EPLB runtime state of one model: expert weights in physical layout, the per-layer expert maps
and load counters, and ``rebalance()`` — all as tensors the compiled graph reads, so changing
them never recompiles.

``attach(model, config)`` rewrites every MoE block of ``model`` in place (before
``torch.compile``): the experts' ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``
parameters become ``eplb_gate_up_proj [P, 2I, H]`` / ``eplb_down_proj [P, H, I]`` (slot ``p``
holds logical expert ``phy2log[p]``; memory grows by the redundant slots only) — only the first
dimension, the expert, is indexed, so weights stored in × out (``[E, H, 2I]`` / ``[E, I, H]``:
gpt-oss, Llama 4) are laid out the same way, and so are per-expert biases
(``gate_up_proj_bias [E, 2I]`` / ``down_proj_bias [E, H]``: gpt-oss → ``eplb_gate_up_proj_bias
[P, 2I]`` / ``eplb_down_proj_bias [P, H]``) — and the experts module gets the buffers

    eplb_log2phy [E, R + 1] int64   physical slots of each logical expert, -1 padded
    eplb_replica_count [E] int64    replicas of each logical expert
    eplb_phy2log [P] int64          logical expert of each slot
    eplb_load [P] int64             tokens routed to each slot since the last reset
    eplb_record [] bool             load counting on/off

Hugging Face's expert code still reads ``experts.gate_up_proj``: on an attached module that is a
property returning ``ascend.eplb_logical_weight(...)`` (the first replica of every expert), so
the eager model computes exactly what it did, and in a compiled graph that op carries the tables
to the ``eplb`` pass, which routes the fused MoE chain over the physical slots.  The replica
table is ``R + 1`` wide (the most replicas one expert can get), so every placement has the same
shapes and a new one is a few in-place copies.

Expert parallelism across processes (``ep_size > 1`` with ``torch.distributed`` initialised):
the EP group (``eplb.ep_group``, default the world group) must have ``ep_size`` ranks, and rank
``r`` keeps only its ``L = P / ep_size`` slots ``[r*L, (r+1)*L)`` of the physical weights
(``eplb_gate_up_proj [L, 2I, H]``) — memory ``L`` slots per rank — while the maps stay global
(``log2phy`` / ``phy2log`` / ``replica_count`` identical on every rank, ``eplb_load [P]`` counting
only this rank's slots, zeros elsewhere, so the ranks' loads sum to the global one).  There is no
logical view of the weights then, so the attached model runs only compiled (the ``eplb`` pass
computes the local experts and sums the ranks' partial outputs with an ``all_reduce``).
``rebalance()`` / ``apply_placement()`` are collective: every rank calls them with the same
placement; the global load is all-reduced first, and a slot that changes gets its expert's
weights from the rank holding that expert's old first replica (point-to-point send/recv, only
for the slots that change).  Without an initialised process group ``ep_size`` only shapes the
placement and one process holds and computes every slot.

Threads (``eplb/sync.py``): ``rebalance()`` / ``apply_placement()`` may run in a background
thread while forwards run in others.  Compiled forwards (``backend="ascend_passes"``) and the eager
attached model read tables and weights under the read side of one process-wide lock; an update
prepares each layer's moved weights while forwards run and publishes the layer (weights + tables)
under the write side, so every forward sees each layer whole, in the old or the new placement —
the same logical output.  Under expert parallelism the collective ``rebalance()`` must instead be
called on every rank between forwards from the thread that runs them (else ``ConfigError``).

A target model and its MTP drafter are attached separately and keep separate statistics;
``attach(drafter, config, main=target_state)`` gives the drafter's layers the same redundancy
and numbers them after the target's MoE layers in placement files.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ascend_passes.eplb.placement import (
    Placement,
    balance_ratio,
    default_placement,
    rank_loads,
    rebalance_experts,
)
from ascend_passes.eplb.placement_file import export_placement, load_placement
from ascend_passes.eplb.sync import FORWARD_LOCK
from ascend_passes.eplb.validate import check_expert_load, check_redundancy, validate_placement
from ascend_passes.errors import ConfigError
from ascend_passes.process_group import resolve_group

log = logging.getLogger("ascend_passes.eplb")

__all__ = ["EplbLayer", "EplbState", "attach", "find_moe_blocks", "state_of"]

_STATE_ATTR = "_ascend_eplb_state"
_TABLE_MARK = "_ascend_eplb_table"
_STATE_REF = "_ascend_eplb_state_ref"  # on each layer's eplb_load: a weakref to its EplbState
_WEIGHTS = (("gate_up_proj", "eplb_gate_up_proj"), ("down_proj", "eplb_down_proj"))
# per-expert biases (gpt-oss), laid out with their weights when the experts have them
_BIASES = (("gate_up_proj_bias", "eplb_gate_up_proj_bias"), ("down_proj_bias", "eplb_down_proj_bias"))
_ROUTERS = ("gate", "router")  # the router module's name: DeepSeek / Qwen3 / V4, and gpt-oss / Llama 4


# --------------------------------------------------------------------------------- discovery
def _is_experts(module: nn.Module) -> bool:
    params = module._parameters
    return all(isinstance(params.get(name), torch.Tensor) and params[name].dim() == 3 for name, _ in _WEIGHTS)


def _biases(module: nn.Module) -> tuple[tuple[str, str], ...]:
    """The ``_BIASES`` pairs ``module`` holds (all of them or none: ``attach`` checks)."""
    return tuple(pair for pair in _BIASES if isinstance(module._parameters.get(pair[0]), torch.Tensor))


def find_moe_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(path, experts module)`` of every MoE block of ``model`` in module order: a module with a
    router (``gate``: DeepseekV3/V4, Qwen3-MoE, their MTP layers; ``router``: gpt-oss, Llama 4) and
    ``experts`` holding one fused 3-D ``gate_up_proj`` and ``down_proj`` (Hugging Face's
    fused-experts layout, out × in or in × out) and, optionally, per-expert biases."""
    found = []
    for path, module in model.named_modules():
        experts = getattr(module, "experts", None)
        if (
            isinstance(experts, nn.Module)
            and any(isinstance(getattr(module, name, None), nn.Module) for name in _ROUTERS)
            and (_is_experts(experts) or isinstance(getattr(experts, _STATE_ATTR, None), EplbLayer))
        ):
            found.append((f"{path}.experts" if path else "experts", experts))
    return found


def _unfused_blocks(model: nn.Module, found: set[str]) -> list[str]:
    """Paths of the ``experts`` of router + experts blocks that ``find_moe_blocks`` did not take
    (experts as a list of per-expert modules, or weights of another shape)."""
    return [
        f"{path}.experts" if path else "experts"
        for path, module in model.named_modules()
        if isinstance(getattr(module, "experts", None), nn.Module)
        and any(isinstance(getattr(module, name, None), nn.Module) for name in _ROUTERS)
        and (f"{path}.experts" if path else "experts") not in found
    ]


# --------------------------------------------------------------------------------- the layer
@dataclass(eq=False)
class EplbLayer:
    """One MoE layer's runtime tables (the tensors are the experts module's buffers)."""

    name: str
    experts: nn.Module

    def _get(self, name: str) -> torch.Tensor:
        return getattr(self.experts, name)

    @property
    def log2phy(self) -> torch.Tensor:
        return self._get("eplb_log2phy")

    @property
    def replica_count(self) -> torch.Tensor:
        return self._get("eplb_replica_count")

    @property
    def phy2log(self) -> torch.Tensor:
        return self._get("eplb_phy2log")

    @property
    def expert_load(self) -> torch.Tensor:
        return self._get("eplb_load")

    @property
    def record(self) -> torch.Tensor:
        return self._get("eplb_record")

    def weights(self) -> Iterator[torch.Tensor]:
        """The physical ``[P or L, ...]`` tensors a placement moves: weights, then any biases."""
        for _, phy in _WEIGHTS + _BIASES:
            if phy in self.experts._parameters:
                yield self._get(phy)


def _eplb_logical(self: nn.Module, phy_name: str) -> torch.Tensor:
    import ascend_passes.ops  # noqa: F401  (registers torch.ops.ascend.eplb_*)

    return torch.ops.ascend.eplb_logical_weight(
        getattr(self, phy_name), self.eplb_log2phy, self.eplb_replica_count, self.eplb_load, self.eplb_record
    )


@functools.cache
def _attached_class(cls: type, pairs: tuple[tuple[str, str], ...] = _WEIGHTS) -> type:
    """``cls`` with ``gate_up_proj`` / ``down_proj`` (and the biases in ``pairs``) read through the
    physical layout."""
    namespace = {
        logical: property(
            functools.partial(lambda self, phy: _eplb_logical(self, phy), phy=phy),
            doc=f"[E, ...] logical view of ``{phy}`` (first replica of each expert)",
        )
        for logical, phy in pairs
    }
    namespace["__module__"] = cls.__module__
    return type(f"Eplb{cls.__name__}", (cls,), namespace)


def _tables(phy2log: torch.Tensor, num_logical: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``log2phy [E, width]`` (-1 padded) and ``replica_count [E]`` of one layer's ``phy2log [P]``."""
    count = torch.bincount(phy2log, minlength=num_logical)
    order = torch.argsort(phy2log, stable=True)  # slots grouped by expert, ascending
    first = torch.cumsum(count, 0) - count
    rank_in_expert = torch.arange(phy2log.numel()) - first[phy2log[order]]
    log2phy = torch.full((num_logical, width), -1, dtype=torch.int64)
    log2phy[phy2log[order], rank_in_expert] = order
    return log2phy, count


# --------------------------------------------------------------------------------- the state
class EplbState:
    """EPLB state of one model (a target model, or an MTP drafter): its MoE layers' tables,
    the expert weights in physical layout, load statistics, placement and ``rebalance()``.

    Layer ``i`` of ``layers`` is row ``first_layer + i`` of placement files (``first_layer`` is
    the target's MoE layer count for a drafter attached with ``main=``, else 0).
    """

    def __init__(
        self,
        layers: list[EplbLayer],
        num_logical: int,
        num_redundant: int,
        ep_size: int,
        *,
        first_layer: int = 0,
        total_layers: int | None = None,
        rank: int = 0,
        group: Any = None,
        config: Any = None,
    ) -> None:
        self.layers = layers
        self.num_logical = num_logical
        self.num_redundant = num_redundant
        self.ep_size = ep_size
        self.first_layer = first_layer
        self.total_layers = total_layers if total_layers is not None else first_layer + len(layers)
        self.rank = rank
        # the EP process group when this rank holds only its own slots, else None
        self.group = group
        # the EplbConfig attach() used (the eplb pass checks compile options against it)
        self.config = config

    @property
    def expert_parallel(self) -> bool:
        """True when this process holds only its ``slots_per_rank`` slots (EP across processes)."""
        return self.group is not None

    @property
    def local_slots(self) -> range:
        """The physical slots whose weights this process holds."""
        if not self.expert_parallel:
            return range(self.num_physical)
        return range(self.rank * self.slots_per_rank, (self.rank + 1) * self.slots_per_rank)

    # ----------------------------------------------------------------------------- sizes
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_physical(self) -> int:
        return self.num_logical + self.num_redundant

    @property
    def slots_per_rank(self) -> int:
        return self.num_physical // self.ep_size

    def layer(self, name: str) -> EplbLayer:
        for layer in self.layers:
            if layer.name == name or layer.name.startswith(name + "."):
                return layer
        raise KeyError(f"no MoE layer {name!r}; layers: {[layer.name for layer in self.layers]}")

    # ----------------------------------------------------------------------------- placement
    @property
    def phy2log(self) -> torch.Tensor:
        """``[L, P]`` current placement (a copy; every row as published, never half-copied)."""
        with FORWARD_LOCK.reading(forward=False):
            return torch.stack([layer.phy2log.clone() for layer in self.layers])

    def placement(self) -> Placement:
        return Placement.from_phy2log(self.phy2log, self.num_logical, self.ep_size)

    def apply_placement(self, phy2log: torch.Tensor, *, source: str = "placement") -> int:
        """Switch to placement ``phy2log[L, P]``: copy into a slot only the expert weights that
        change, then update the maps in place (no recompilation).  Validates first: an unusable
        placement raises ``ConfigError`` and leaves everything as it was.  Resets the load
        counters (their slots now mean other experts).  Returns the number of slots moved."""
        validate_placement(phy2log, self.num_logical, self.ep_size, num_layers=self.num_layers, source=source)
        if phy2log.shape[1] != self.num_physical:
            raise ConfigError(
                f"{source}: {phy2log.shape[1]} physical slots per layer, but the model was "
                f"attached with {self.num_logical} experts + {self.num_redundant} redundant = "
                f"{self.num_physical}; use num_redundant_experts={phy2log.shape[1] - self.num_logical}"
                " when attaching, or a placement for this redundancy"
            )
        phy2log = phy2log.to("cpu", torch.int64)
        if self.expert_parallel:
            return self._apply_placement_ep(phy2log)
        moved = 0
        # thread safety (eplb/sync.py): everything a layer needs is prepared while forwards run
        # (reading the current tables and weights is safe: only an update writes them, and
        # updating() admits one at a time), then published under writing(): forwards wait for
        # one layer's in-place copies at most, and every forward sees each layer whole, old or new
        with FORWARD_LOCK.updating(), torch.no_grad():
            for layer, new in zip(self.layers, phy2log):
                old = layer.phy2log
                changed = (new != old.cpu()).nonzero().flatten()
                staged = []
                if changed.numel():
                    # the source of each changed slot: the old first replica of its new expert
                    source_slot = layer.log2phy[:, 0].cpu()[new[changed]]
                    staged = [
                        (weight, changed.to(weight.device), weight.index_select(0, source_slot.to(weight.device)))
                        for weight in layer.weights()
                    ]
                    moved += changed.numel()
                self._publish(layer, new, staged)
        log.info("eplb: new placement for %d layers, %d expert slots moved", self.num_layers, moved)
        return moved

    def _publish(
        self, layer: EplbLayer, new: torch.Tensor, staged: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    ) -> None:
        """Write one layer's new weights (``staged``: weight, slots, their new rows) and tables
        ``new`` (its phy2log row) in place, with no forward running."""
        log2phy, count = _tables(new, self.num_logical, layer.log2phy.shape[1])
        with FORWARD_LOCK.writing(what="apply an EPLB placement"):
            for weight, slots, rows in staged:
                weight.index_copy_(0, slots, rows)
            layer.log2phy.copy_(log2phy)
            layer.replica_count.copy_(count)
            layer.phy2log.copy_(new)
            layer.expert_load.zero_()

    def _apply_placement_ep(self, phy2log: torch.Tensor) -> int:
        """``apply_placement`` under expert parallelism (collective: every rank, same placement).
        A changed slot gets its new expert's weights from the slot holding that expert's old
        first replica — a local copy, or a send/recv between the two ranks; only changed slots
        move.  Returns the number of slots moved on all ranks.

        It must run between forwards in the thread that runs them (the forwards' collectives and
        these send/recvs share the EP group, and every rank must switch at the same forward):
        called from another thread, or while a forward runs, it raises ``ConfigError``."""
        import threading

        import torch.distributed as dist

        last = FORWARD_LOCK.last_reader
        if last is not None and last != threading.get_ident():
            raise ConfigError(
                "under expert parallelism rebalance() / apply_placement() are collective: call "
                "them on every rank between forwards, from the thread that runs the forwards "
                "(this process's forwards run in another thread)"
            )
        per_rank, me = self.slots_per_rank, self.rank
        moved = 0
        # the write side for the whole switch, taken before any communication (a forward in flight
        # here raises on this rank instead of leaving it half-switched)
        with FORWARD_LOCK.writing(what="apply an EPLB placement", wait=False), torch.no_grad():
            for layer, new in zip(self.layers, phy2log):
                old = layer.phy2log.cpu()
                changed = (new != old).nonzero().flatten().tolist()
                moved += len(changed)
                weights = list(layer.weights())
                incoming: list[tuple[int, list[torch.Tensor]]] = []  # (local slot, new weights)
                ops = []
                first = layer.log2phy[:, 0].cpu()
                for slot in changed:  # the same order on every rank: sends and recvs pair up
                    src = int(first[new[slot]])
                    dst_rank, src_rank = slot // per_rank, src // per_rank
                    if dst_rank == me and src_rank == me:
                        incoming.append((slot - me * per_rank, [w[src - me * per_rank].clone() for w in weights]))
                    elif dst_rank == me:
                        bufs = [torch.empty_like(w[0]) for w in weights]
                        ops += [dist.P2POp(dist.irecv, b, group=self.group, group_peer=src_rank) for b in bufs]
                        incoming.append((slot - me * per_rank, bufs))
                    elif src_rank == me:
                        ops += [
                            dist.P2POp(
                                dist.isend, w[src - me * per_rank].contiguous(), group=self.group, group_peer=dst_rank
                            )
                            for w in weights
                        ]
                if ops:
                    for work in dist.batch_isend_irecv(ops):
                        work.wait()
                # written after every read of the old weights
                staged = []
                if incoming:
                    slots = torch.tensor([local for local, _ in incoming], dtype=torch.int64)
                    staged = [
                        (w, slots.to(w.device), torch.stack([bufs[i] for _, bufs in incoming]))
                        for i, w in enumerate(weights)
                    ]
                self._publish(layer, new, staged)
        log.info("eplb: rank %d: new placement for %d layers, %d expert slots moved", me, self.num_layers, moved)
        return moved

    def load_placement_file(self, path: str | Path) -> int:
        """Read a placement file (rows ``first_layer ..`` of ``total_layers``) and apply it."""
        phy2log = load_placement(
            path, num_layers=self.total_layers, num_logical=self.num_logical, num_ranks=self.ep_size
        )
        rows = phy2log[self.first_layer : self.first_layer + self.num_layers]
        return self.apply_placement(rows, source=f"placement file {path}")

    def export_placement(self, path: str | Path, *, after: EplbState | None = None) -> None:
        """Write the placement (this model's layers, then ``after``'s — e.g. a drafter's)."""
        rows = [self.phy2log] + ([after.phy2log] if after is not None else [])
        export_placement(torch.cat(rows), self.ep_size, path)  # a bad path: ConfigError naming it

    # ----------------------------------------------------------------------------- load
    def physical_load(self) -> torch.Tensor:
        """``[L, P]`` tokens routed to every physical slot since the last reset."""
        return torch.stack([layer.expert_load.detach().cpu().clone() for layer in self.layers])

    def expert_load(self) -> torch.Tensor:
        """``[L, E]`` tokens routed to every logical expert (its replicas summed); under expert
        parallelism, this rank's share (the tokens its slots computed)."""
        out = torch.zeros(self.num_layers, self.num_logical, dtype=torch.int64)
        return out.scatter_add_(1, self.phy2log, self.physical_load())

    def global_expert_load(self) -> torch.Tensor:
        """``[L, E]`` load summed over the EP ranks (collective under expert parallelism: an
        ``all_reduce`` of the per-rank loads); ``expert_load()`` in a single process."""
        load = self.expert_load()
        if self.expert_parallel:
            import torch.distributed as dist

            dist.all_reduce(load, group=self.group)
        return load

    def reset_load(self) -> None:
        with torch.no_grad():
            for layer in self.layers:
                layer.expert_load.zero_()

    @property
    def recording(self) -> bool:
        return bool(self.layers and self.layers[0].record.item())

    def set_recording(self, on: bool) -> None:
        """Switch load counting on or off (a tensor the graph reads: no recompilation)."""
        with torch.no_grad():
            for layer in self.layers:
                layer.record.fill_(bool(on))

    def rank_balance(self, weight: torch.Tensor | None = None) -> torch.Tensor:
        """``[L]`` max/mean per-rank load of the current placement for loads ``weight[L, E]``
        (default: the recorded load, summed over the EP ranks — collective under EP)."""
        if weight is None:
            weight = self.global_expert_load()
        else:
            self._check_load(weight)
        return balance_ratio(rank_loads(self.phy2log, weight, self.ep_size))

    # ----------------------------------------------------------------------------- rebalance
    def _check_load(self, weight: Any) -> None:
        """A user's load ``[L, E]``: one row per MoE layer of this model, one column per logical
        expert (``ConfigError`` naming the expected and the given shape)."""
        if not isinstance(weight, torch.Tensor):
            raise ConfigError(
                f"expert load must be a tensor of shape [{self.num_layers}, "
                f"{self.num_logical}], got {type(weight).__name__}"
            )
        if tuple(weight.shape) != (self.num_layers, self.num_logical):
            raise ConfigError(
                f"expert load must have shape [{self.num_layers}, {self.num_logical}] (one row "
                f"per MoE layer of this model, one column per logical expert), got shape "
                f"{list(weight.shape)}"
            )
        check_expert_load(weight, self.num_logical)

    def rebalance(self, weight: torch.Tensor | None = None, *, num_groups: int = 1, num_nodes: int = 1) -> Placement:
        """Compute a placement from the recorded load (or ``weight[L, E]``), move the expert
        weights that change and update the maps in place; returns the new placement.  Under
        expert parallelism it is collective: the load is summed over the EP ranks first (every
        rank then computes the same placement) and weights move between ranks.  Safe to call
        from a background thread while forwards run (single process; module docstring)."""
        if weight is None:
            weight = self.global_expert_load()
        else:
            self._check_load(weight)
        phy2log, _, _ = rebalance_experts(weight, self.num_physical, num_groups, num_nodes, self.ep_size)
        self.apply_placement(phy2log, source="rebalance")
        return self.placement()


# --------------------------------------------------------------------------------- attach
def state_of(model: nn.Module) -> EplbState | None:
    """The state ``attach`` gave ``model``, or None."""
    return model.__dict__.get(_STATE_ATTR)


def _eplb_config(config: Any) -> Any:
    from ascend_passes.config import AscendPassConfig, EplbConfig

    if config is None:
        return EplbConfig(enabled=True)
    if isinstance(config, AscendPassConfig):
        return config.eplb
    if isinstance(config, EplbConfig):
        return config
    if isinstance(config, dict):
        return AscendPassConfig.from_options({"eplb": {"enabled": True, **config}}).eplb
    raise ConfigError(f"attach() takes an EplbConfig, an AscendPassConfig or a dict, got {type(config).__name__}")


def _ep_group(cfg: Any, ep_size: int) -> tuple[Any, int]:
    """``(EP process group, rank in it)`` when this process takes part in expert parallelism
    (``ep_size > 1`` and ``torch.distributed`` initialised), else ``(None, 0)``."""
    import torch.distributed as dist

    if ep_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return None, 0
    group = resolve_group(cfg.ep_group)
    size = dist.get_world_size(group)
    if size != ep_size:
        raise ConfigError(
            f"eplb.ep_size={ep_size} but the EP process group has {size} ranks; set "
            f"eplb.ep_size to the group's size (or eplb.ep_group to a group of "
            f"{ep_size} ranks)"
        )
    return group, dist.get_rank(group)


def attach(
    model: nn.Module, config: Any = None, *, main: EplbState | None = None, num_mtp_layers: int = 0
) -> EplbState:
    """Put every MoE block of ``model`` into physical layout with runtime EPLB tables (see the
    module docstring); call before ``torch.compile``.  Returns the model's ``EplbState``.

    ``config``: ``EplbConfig`` / ``AscendPassConfig`` / ``{"num_redundant_experts": 4, ...}``.
    ``main``: the target model's state when ``model`` is its MTP drafter — the drafter then uses
    the target's redundancy and EP size, and its layers follow the target's in placement files.
    ``num_mtp_layers``: for a target, the drafter layers that follow its own in placement files.
    With ``ep_size > 1`` and ``torch.distributed`` initialised, this rank keeps only its slots'
    weights (module docstring); the EP group is ``eplb.ep_group`` (default: the world group).
    Raises ``ConfigError`` (model unchanged) for impossible settings or a bad placement file.
    """
    cfg = _eplb_config(config)
    if state_of(model) is not None:
        raise ConfigError(
            "this model is already attached to EPLB; use its state "
            "(ascend_passes.eplb.state_of(model)) instead of attaching again"
        )
    blocks = find_moe_blocks(model)
    unfused = _unfused_blocks(model, {path for path, _ in blocks})
    if blocks and unfused:  # never some layers attached and others silently not
        raise ConfigError(
            f"MoE blocks {unfused} do not hold their experts as one fused [num_experts, ...] "
            f"gate_up_proj/down_proj pair like {blocks[0][0]}, so EPLB cannot cover them and would "
            "cover only some layers; attach a model whose every MoE layer has fused expert weights"
        )
    if not blocks:
        raise ConfigError(
            f"{type(model).__name__} has no MoE block with fused expert weights "
            "(a module with a router `gate` or `router` and `experts.gate_up_proj/down_proj`, 3-D "
            "[num_experts, ...]); nothing to attach"
        )
    num_redundant, ep_size = cfg.num_redundant_experts, cfg.ep_size
    first_layer = 0
    if main is not None:
        if (num_redundant, ep_size) != (main.num_redundant, main.ep_size) and (num_redundant, ep_size) != (0, 1):
            raise ConfigError(
                f"the drafter's EPLB settings (num_redundant_experts={num_redundant}, ep_size="
                f"{ep_size}) differ from the target's ({main.num_redundant}, {main.ep_size}); "
                "MTP layers get the target's redundancy, so leave them unset or equal"
            )
        num_redundant, ep_size = main.num_redundant, main.ep_size
        first_layer = main.first_layer + main.num_layers
    if main is not None and main.expert_parallel:
        group, rank = main.group, main.rank
    else:
        group, rank = _ep_group(cfg, ep_size)
    shapes = {tuple(e.gate_up_proj.shape[:1]) for _, e in blocks}
    if len(shapes) != 1:
        raise ConfigError(f"MoE blocks with different expert counts {sorted(shapes)}; EPLB needs one")
    num_logical = blocks[0][1].gate_up_proj.shape[0]
    if main is not None and num_logical != main.num_logical:
        raise ConfigError(
            f"the drafter has {num_logical} experts per layer, the target {main.num_logical}; they must match"
        )
    check_redundancy(num_logical, num_redundant, ep_size)
    for path, experts in blocks:
        _check_experts(path, experts, num_logical)
    total = first_layer + len(blocks) + num_mtp_layers
    if main is not None:
        total = max(total, main.total_layers)
    phy2log = default_placement(len(blocks), num_logical, num_redundant, ep_size)
    if cfg.placement_file is not None:  # validated before anything changes
        phy2log = load_placement(cfg.placement_file, num_layers=total, num_logical=num_logical, num_ranks=ep_size)[
            first_layer : first_layer + len(blocks)
        ]
    per_rank = (num_logical + num_redundant) // ep_size
    local = slice(rank * per_rank, (rank + 1) * per_rank) if group is not None else slice(None)
    layers = []
    for (path, experts), row in zip(blocks, phy2log):
        _convert(experts, row, num_logical, num_redundant, cfg.record_load, local)
        layers.append(EplbLayer(path, experts))
        experts.__dict__[_STATE_ATTR] = layers[-1]
    state = EplbState(
        layers,
        num_logical,
        num_redundant,
        ep_size,
        first_layer=first_layer,
        total_layers=total,
        rank=rank,
        group=group,
        config=cfg,
    )
    model.__dict__[_STATE_ATTR] = state
    for layer in layers:  # lets the eplb pass check compile options against this state
        setattr(layer.expert_load, _STATE_REF, weakref.ref(state))
    log.info(
        "eplb: attached %d MoE layers (%d experts + %d redundant, ep_size %d%s)",
        len(layers),
        num_logical,
        num_redundant,
        ep_size,
        f", rank {rank} holds slots [{local.start}, {local.stop})" if group is not None else "",
    )
    return state


def _check_experts(path: str, experts: nn.Module, num_logical: int) -> None:
    """``ConfigError`` (before anything changes) for experts whose every expert tensor is not
    indexed by the expert on its first dimension: biases of another layout, or only one of the
    two, or biases the module says it has but does not hold under the names EPLB moves."""
    biases = _biases(experts)
    if getattr(experts, "has_bias", False) and len(biases) != len(_BIASES):
        held = sorted(n for n, p in experts.named_parameters(recurse=False) if n.endswith("bias"))
        raise ConfigError(
            f"{path}: experts with biases, but not as {' and '.join(n for n, _ in _BIASES)} "
            f"(it holds {held or 'none'}); EPLB moves a slot's weights and biases together and "
            "knows only those names"
        )
    for name, _ in biases:
        shape = tuple(experts._parameters[name].shape)
        if len(shape) != 2 or shape[0] != num_logical:
            raise ConfigError(
                f"{path}.{name} has shape {list(shape)}; EPLB needs per-expert biases "
                f"[num_experts={num_logical}, features] to move them with their expert's weights"
            )


def _convert(
    experts: nn.Module,
    phy2log: torch.Tensor,
    num_logical: int,
    num_redundant: int,
    record: bool,
    local: slice = slice(None),
) -> None:
    """Replace the logical expert weights by physical ones (only the ``local`` slots) and add the
    tables (in place)."""
    device = experts.gate_up_proj.device
    pairs = _WEIGHTS + _biases(experts)
    for logical, phy in pairs:
        weight = experts._parameters.pop(logical)
        physical = weight.detach().index_select(0, phy2log[local].to(weight.device))
        new = nn.Parameter(physical, requires_grad=weight.requires_grad)
        new.__dict__.update({k: v for k, v in weight.__dict__.items() if k not in new.__dict__})
        experts.register_parameter(phy, new)
    log2phy, count = _tables(phy2log, num_logical, num_redundant + 1)
    experts.register_buffer("eplb_log2phy", log2phy.to(device), persistent=False)
    experts.register_buffer("eplb_replica_count", count.to(device), persistent=False)
    experts.register_buffer("eplb_phy2log", phy2log.clone().to(device), persistent=False)
    experts.register_buffer(
        "eplb_load", torch.zeros(phy2log.numel(), dtype=torch.int64, device=device), persistent=False
    )
    experts.register_buffer("eplb_record", torch.tensor(bool(record), device=device), persistent=False)
    for name in ("eplb_log2phy", "eplb_replica_count", "eplb_phy2log", "eplb_load", "eplb_record"):
        setattr(getattr(experts, name), _TABLE_MARK, True)  # lets the eplb pass see it is attached
    experts.__class__ = _attached_class(type(experts), pairs)
