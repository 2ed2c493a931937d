"""Expert weights in the execution layout that the rewritten graphs read, and back in the loadable
layout for weight updates — for a target model and its MTP drafter alike.

The fused MoE chain reads Hugging Face's ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``
as ``weight.transpose(1, 2)`` (``ascend.grouped_matmul`` wants ``[E, K, N]``, in × out).  The
*execution layout* stores exactly that view contiguously; the parameter the model sees keeps its
Hugging Face shape (it becomes a non-contiguous view of the ``[E, K, N]`` storage), so eager
Hugging Face code, the weight loaders and the compiled graph all keep working.

A serving loop for RL::

    compiled = torch.compile(model, backend="ascend_passes"); compiled(x)   # marks the weights
    weights.prepare(target, drafter)
    for update in trainer:
        weights.restore(target, drafter)                 # loadable layout
        for name, tensor, *args in update:
            weights.load_weight(target, name, tensor, *args)  # param.weight_loader(param, ...)
        weights.prepare(target, drafter)                 # execution layout
        compiled(x)                                      # reads the new weights, no recompile

On a model attached to EPLB (``ascend_passes.eplb.attach``) the loop is the same and the expert
weights keep their logical names (``...experts.gate_up_proj``, logical expert id): ``load_weight``
writes every replica of the expert (see there).

Nothing is ever replaced: ``prepare`` and ``restore`` assign ``param.data`` in place, so every
parameter keeps its identity, its Python attributes (``weight_loader`` and whatever else a
framework hung on it) and ``requires_grad``, and compiled graphs — which read parameters as
inputs — read the live weights.  Which parameters change layout is what the passes decided: the
backend calls :func:`record_execution_weights` after the pipeline, which marks every parameter
that a fused ``ascend.grouped_matmul`` reads transposed.
"""

from __future__ import annotations

import contextlib
import logging
import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.fx as fx
from torch import nn

from .errors import AscendPassesError, ConfigError

log = logging.getLogger("ascend_passes.weights")
aten = torch.ops.aten

LAYOUT_ATTR = "_ascend_layout"
"""Attribute the backend sets on a parameter that a rewritten graph reads in another layout."""

Layout = Literal["auto", "execution", "loadable"]


class WeightLoadError(AscendPassesError, ValueError):
    """A weight update that does not fit its parameter; the parameter is left as it was."""


@dataclass(frozen=True)
class WeightLayout:
    """A rewritten graph reads this parameter as ``param.transpose(*dims)`` (by ``reader``); its
    execution layout stores that view contiguously."""

    dims: tuple[int, int]
    reader: str = "ascend.grouped_matmul"


# ----------------------------------------------------------------------------- compile side
def _transposed_input(node: Any) -> tuple[fx.Node, tuple[int, int]] | None:
    """``(placeholder, dims)`` when ``node`` is ``placeholder.transpose(*dims)`` (or the same
    two-axis ``permute``), else None."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    src = node.args[0] if node.args else None
    if not isinstance(src, fx.Node) or src.op != "placeholder":
        return None
    if node.target is aten.transpose.int:
        ndim = src.meta["val"].dim() if "val" in src.meta else 3
        a, b = sorted(d % ndim for d in node.args[1:3])
        return src, (a, b)
    if node.target is aten.permute.default:
        perm = list(node.args[1])
        moved = [i for i, p in enumerate(perm) if p != i]
        if len(moved) == 2 and perm[moved[0]] == moved[1]:
            return src, (moved[0], moved[1])
    return None


def record_execution_weights(gm: fx.GraphModule, real_inputs: Sequence[Any] | None) -> int:
    """Mark the parameters that ``gm`` (a rewritten ATen graph) hands transposed to a fused
    ``ascend.grouped_matmul``: they get ``param._ascend_layout = WeightLayout(dims)``.

    ``real_inputs`` are the tensors behind ``gm``'s placeholders, one to one (the backend's
    ``PassContext.real_inputs``); without them nothing can be marked.  Returns how many
    parameters were marked.  Called by the backend after the pass pipeline.
    """
    gmm = getattr(getattr(torch.ops, "ascend", None), "grouped_matmul", None)
    if gmm is None or real_inputs is None:
        return 0
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(real_inputs):
        return 0
    position = {n: i for i, n in enumerate(placeholders)}
    marked = 0
    for node in gm.graph.find_nodes(op="call_function", target=gmm.default):
        weight_list = node.kwargs.get("weight", node.args[1] if len(node.args) > 1 else ())
        for w in weight_list:
            found = _transposed_input(w)
            if found is None:
                continue
            placeholder, dims = found
            param = real_inputs[position[placeholder]]
            if isinstance(param, nn.Parameter):
                param.__dict__[LAYOUT_ATTR] = WeightLayout(dims)
                marked += 1
    if marked:
        log.debug("%d parameters are read transposed by ascend.grouped_matmul", marked)
    return marked


# ----------------------------------------------------------------------------- runtime side
def _marked(models: Sequence[nn.Module]) -> Iterator[tuple[str, nn.Parameter, WeightLayout]]:
    """Marked parameters of ``models`` (each once, even when models share modules)."""
    seen: set[int] = set()
    for model in models:
        for name, param in model.named_parameters():
            layout = param.__dict__.get(LAYOUT_ATTR)
            if layout is not None and id(param) not in seen:
                seen.add(id(param))
                yield name, param, layout


def execution_layout_pays(param: torch.Tensor) -> bool:
    """Whether ``layout="auto"`` stores ``param`` in the execution layout: on accelerators
    (NPU ``npu_grouped_matmul`` wants ``[E, K, N]``), not on CPU.

    Measured with ``tools/bench_weights.py`` (C++ CPU ``grouped_matmul``): the kernel alone runs
    bf16 decode 1.35-1.7x faster on a contiguous ``[E, K, N]`` but fp32 decode 0.7-0.85x slower
    (its dot-product path suits Hugging Face's ``[E, N, K]``), prefill equal within noise (BLAS
    takes either); the whole DeepSeek-style model (``--model``) shows no gain (bf16 decode 0.91x,
    prefill 1.05x, fp32 decode slower), and the execution layout costs a recompile.  So on CPU
    the loadable layout is kept and ``prepare`` is layout-neutral unless asked for "execution".
    """
    return param.device.type != "cpu"


def _is_execution(param: torch.Tensor, layout: WeightLayout) -> bool:
    return param.transpose(*layout.dims).is_contiguous() and not param.is_contiguous()


def prepare(*models: nn.Module, layout: Layout = "auto") -> int:
    """Put the weights that compiled ascend_passes graphs read in another layout into that
    execution layout, in place (``param.data``): identity, attributes and ``requires_grad`` of
    every parameter are kept.  Pass the target and its MTP drafter in one call, or call once
    each.  ``layout``: ``"auto"`` where :func:`execution_layout_pays`, ``"execution"`` always,
    ``"loadable"`` never (same as :func:`restore`).  Idempotent.  Returns how many parameters
    changed layout.

    The first ``prepare`` that changes a layout costs one recompile of the graphs reading those
    weights (Dynamo guards on strides); after that both layouts' graphs stay cached.  A model
    never compiled with ascend_passes has nothing marked: INFO, no-op.
    """
    for model in models:
        _check_module(model, "prepare()")
    if layout not in ("auto", "execution", "loadable"):
        raise ConfigError(f"layout={layout!r}: use 'auto', 'execution' or 'loadable'")
    if layout == "loadable":
        return restore(*models)
    marked = list(_marked(models))
    if not marked:
        _nothing_marked("prepare", models)
        return 0
    changed = 0
    with _layout_lock(models), torch.no_grad():
        for _, param, how in marked:
            if _is_execution(param, how) or (layout == "auto" and not execution_layout_pays(param)):
                continue
            param.data = param.data.transpose(*how.dims).contiguous().transpose(*how.dims)
            changed += 1
    kept = "" if layout == "execution" else " (the others stay loadable where the execution layout does not pay)"
    log.info("prepare: %d of %d marked weights in the execution layout now%s", changed, len(marked), kept)
    return changed


def restore(*models: nn.Module) -> int:
    """Bring the weights :func:`prepare` changed back to the loadable layout (Hugging Face's,
    contiguous), in place; for the target and the MTP drafter alike.  Idempotent.  Returns how
    many parameters changed layout."""
    for model in models:
        _check_module(model, "restore()")
    marked = list(_marked(models))
    if not marked:
        _nothing_marked("restore", models)
        return 0
    changed = 0
    with _layout_lock(models), torch.no_grad():
        for _, param, _how in marked:
            if not param.is_contiguous():
                param.data = param.data.contiguous()
                changed += 1
    log.info("restore: %d of %d marked weights put back in the loadable layout", changed, len(marked))
    return changed


def _layout_lock(models: Sequence[nn.Module]) -> Any:
    """The EPLB forward lock's exclusive side when one of ``models`` is EPLB-attached: a layout
    change of physical expert weights must not race a forward or a ``rebalance()``."""
    from ascend_passes.eplb.state import state_of

    if any(state_of(m) is not None for m in models):
        return _expert_update_lock()
    return contextlib.nullcontext()


def _nothing_marked(what: str, models: Sequence[nn.Module]) -> None:
    names = ", ".join(type(m).__name__ for m in models) or "no model"
    log.info(
        "%s: no weight of %s is read in another layout by an ascend_passes graph (never "
        "compiled with backend='ascend_passes', or nothing was fused); nothing to do",
        what,
        names,
    )


# ----------------------------------------------------------------------------- loading
def _as_index(expert_id: Any) -> int:
    """``expert_id`` as an int (a Python or NumPy int, a 0-d integer tensor), else
    :class:`WeightLoadError`."""
    try:
        if isinstance(expert_id, bool):
            raise TypeError
        return operator.index(expert_id)
    except TypeError:
        raise WeightLoadError(f"expert_id must be an int, got {type(expert_id).__name__} {expert_id!r:.60}") from None


def _check_index(expert_id: Any, num_experts: int) -> int:
    """``expert_id`` as an int in ``[0, num_experts)``, else :class:`WeightLoadError`."""
    index = _as_index(expert_id)
    if not 0 <= index < num_experts:
        raise WeightLoadError(f"expert_id {index} outside [0, {num_experts})")
    return index


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    """Copy a whole tensor into ``param`` (any layout); refuses a different shape."""
    if tuple(loaded_weight.shape) != tuple(param.shape):
        raise WeightLoadError(f"expects shape {tuple(param.shape)}, got {tuple(loaded_weight.shape)}")
    with torch.no_grad():
        param.copy_(loaded_weight)


def expert_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor, expert_id: int) -> None:
    """Copy one expert's weight (``[2I, H]`` or ``[H, I]``, Hugging Face layout) into
    ``param[expert_id]``; refuses a bad expert id or shape before writing anything."""
    expert_id = _check_index(expert_id, param.shape[0])
    if tuple(loaded_weight.shape) != tuple(param.shape[1:]):
        raise WeightLoadError(
            f"expects one expert's weight of shape {tuple(param.shape[1:])}, got {tuple(loaded_weight.shape)}"
        )
    with torch.no_grad():
        param[expert_id].copy_(loaded_weight)


def _check_tensor(name: str, loaded_weight: Any, target_dtype: torch.dtype) -> None:
    """Refuse what a ``copy_`` would take silently but wrongly: a non-tensor, a tensor without data,
    and a dtype whose cast changes the values (integer / bool / complex into floating point, ...).
    Floating point into floating point (a bf16 checkpoint into fp32 weights) is a cast, allowed."""
    if not isinstance(loaded_weight, torch.Tensor):
        raise WeightLoadError(
            f"cannot load a {type(loaded_weight).__name__} into {name!r}: loaded_weight must "
            "be a torch.Tensor (convert it with torch.as_tensor); the old weights are kept"
        )
    if loaded_weight.is_meta:
        raise WeightLoadError(f"cannot load a meta tensor (no data) into {name!r}; the old weights are kept")
    have = loaded_weight.dtype
    if (
        have == target_dtype
        or (have.is_floating_point and target_dtype.is_floating_point)
        or (have.is_complex and target_dtype.is_complex)
    ):
        return
    kind = (
        "floating-point"
        if target_dtype.is_floating_point
        else "complex"
        if target_dtype.is_complex
        else f"{target_dtype}"
    )
    raise WeightLoadError(
        f"cannot load a {have} tensor into {name!r} ({target_dtype}): a {kind} parameter takes "
        f"{kind} tensors only, a cast would change the values silently; convert the tensor first "
        f"(e.g. tensor.to({target_dtype})) if that is meant; the old weights are kept"
    )


def _check_module(model: Any, what: str) -> None:
    if not isinstance(model, nn.Module):
        raise WeightLoadError(
            f"{what} takes models (torch.nn.Module: a target and its MTP drafter), "
            f"got {type(model).__name__} {model!r:.60}"
        )


def load_weight(model: nn.Module, name: str, loaded_weight: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    """Load ``loaded_weight`` into parameter ``name`` of ``model`` through its ``weight_loader``
    attribute (``weight_loader(param, loaded_weight, *args, **kwargs)``, vLLM's convention),
    or :func:`default_weight_loader` when it has none.

    On an EPLB-attached model (``ascend_passes.eplb.attach``) the expert weights keep their
    logical names: ``"<...>.experts.gate_up_proj"`` / ``"<...>.experts.down_proj"`` with a
    logical ``expert_id`` (first extra argument, or ``expert_id=``) writes that expert into every
    physical slot holding a replica of it — under expert parallelism the replicas this rank holds
    (every rank is given the update; a rank holding none writes nothing) — and without an expert id
    a whole logical tensor ``[E, ...]`` is scattered to every (local) slot.  The parameter's own
    ``weight_loader`` writes each slot (it gets the local slot index as the expert id).  The
    physical names (``eplb_gate_up_proj``) take whole physical tensors only: one slot written on
    its own would leave the expert's other replicas stale.  Weight updates and
    ``EplbState.rebalance()`` exclude each other when the state has a lock.

    A tensor that does not fit (wrong shape or dtype, bad expert id, not a tensor) raises
    :class:`WeightLoadError` naming the parameter and leaves its weights as they were: the
    loaders here check before they write, and ``Tensor.copy_`` refuses a mismatched shape before
    writing (a framework's own loader must do the same; no backup copy is taken, it would cost a
    copy per update — except for the few replica slots of one EPLB expert, restored if a
    framework's loader fails on a later replica).
    """
    _check_module(model, "load_weight()")
    if not isinstance(name, str):
        raise WeightLoadError(
            f"load_weight() takes the parameter's name as a str, got {type(name).__name__} {name!r:.60}"
        )
    param = _parameter(model, name)
    if param is None:
        eplb = _eplb_target(model, name)
        if eplb is not None:
            _load_eplb(name, *eplb, loaded_weight, args, kwargs)
            return
        raise WeightLoadError(f"{type(model).__name__} has no parameter {name!r}")
    _check_tensor(name, loaded_weight, param.dtype)
    physical = _refuse_one_replica(model, name, param, one_slot=bool(args) or "expert_id" in kwargs)
    loader = getattr(param, "weight_loader", default_weight_loader)
    with _expert_update_lock() if physical else contextlib.nullcontext():
        _call_loader(name, param, loader, loaded_weight, args, kwargs)


def _parameter(model: nn.Module, name: str) -> nn.Parameter | None:
    """``model``'s parameter ``name`` (a path of registered parameters, as ``named_parameters``
    names it), or None; looked up along the path, not by listing every parameter, and without
    reading attributes (an EPLB-attached experts module computes ``gate_up_proj``)."""
    prefix, _, attr = name.rpartition(".")
    try:
        module = model.get_submodule(prefix)
    except AttributeError:
        return None
    param = module._parameters.get(attr)
    return param if isinstance(param, nn.Parameter) else None


def _call_loader(
    name: str, param: nn.Parameter, loader: Any, loaded_weight: torch.Tensor, args: tuple, kwargs: dict
) -> None:
    try:
        if "expert_id" in kwargs:
            _as_index(kwargs["expert_id"])  # a str / float / bool id raises here, whatever the loader
        loader(param, loaded_weight, *args, **kwargs)
    except (RuntimeError, ValueError, IndexError, TypeError) as exc:
        raise WeightLoadError(
            f"cannot load a tensor of shape {tuple(loaded_weight.shape)} into {name!r} "
            f"(shape {tuple(param.shape)}): {exc}; the old weights are kept"
        ) from exc


# ----------------------------------------------------------------------------- EPLB-attached experts
def _eplb_target(model: nn.Module, name: str) -> tuple[Any, Any, nn.Parameter] | None:
    """``(layer, state, physical parameter)`` when ``name`` is the logical name of an expert weight
    of an EPLB-attached MoE block of ``model`` (``state`` None when ``model`` does not hold it)."""
    from ascend_passes.eplb import state as eplb_state

    prefix, _, attr = name.rpartition(".")
    physical = dict(eplb_state._WEIGHTS + eplb_state._BIASES).get(attr)
    if physical is None:
        return None
    try:
        experts = model.get_submodule(prefix)
    except AttributeError:
        return None
    layer = experts.__dict__.get(eplb_state._STATE_ATTR)
    if not isinstance(layer, eplb_state.EplbLayer) or physical not in experts._parameters:
        return None
    parts = prefix.split(".") if prefix else []
    ancestors = (model.get_submodule(".".join(parts[:i])) for i in range(len(parts) + 1))
    state = next(
        (s for m in ancestors if (s := eplb_state.state_of(m)) is not None and any(lay is layer for lay in s.layers)),
        None,
    )
    return layer, state, experts._parameters[physical]


def _refuse_one_replica(model: nn.Module, name: str, param: nn.Parameter, *, one_slot: bool) -> bool:
    """Whether ``name`` is an EPLB physical expert weight; a per-slot write into one
    (``one_slot``) would update one replica of an expert: refused."""
    from ascend_passes.eplb import state as eplb_state

    prefix, _, attr = name.rpartition(".")
    logical = {phy: log for log, phy in eplb_state._WEIGHTS + eplb_state._BIASES}.get(attr)
    if logical is None:
        return False
    experts = model.get_submodule(prefix) if prefix else model
    if not isinstance(experts.__dict__.get(eplb_state._STATE_ATTR), eplb_state.EplbLayer):
        return False
    if one_slot:
        raise WeightLoadError(
            f"{name!r} holds the physical slots of EPLB-attached experts (a redundant expert has several); "
            f"load expert weights through the logical name {f'{prefix}.{logical}'!r} with the logical "
            "expert id (every replica is updated); the old weights are kept"
        )
    return True


def _expert_update_lock() -> Any:
    """Held while EPLB expert weights are written: the process-wide lock that keeps forwards and
    ``EplbState.rebalance()`` apart (``eplb/sync.py``), on its exclusive side — no forward reads
    half-updated experts, and no re-balancing copies a slot between the tables read here and the
    writes (it would carry the old weights into a new replica)."""
    from ascend_passes.eplb.sync import FORWARD_LOCK

    return FORWARD_LOCK.writing(what="load EPLB expert weights or change their layout")


def _load_eplb(
    name: str, layer: Any, state: Any, param: nn.Parameter, loaded_weight: Any, args: tuple, kwargs: dict
) -> None:
    """:func:`load_weight` of a logical expert weight of an EPLB-attached block (see there)."""
    _check_tensor(name, loaded_weight, param.dtype)
    args, kwargs = list(args), dict(kwargs)
    by_keyword = "expert_id" in kwargs
    expert_id = kwargs.pop("expert_id") if by_keyword else (args.pop(0) if args else None)
    with _expert_update_lock():
        phy2log = layer.phy2log.detach().cpu()
        num_logical = layer.log2phy.shape[0]
        if state is not None:
            local = state.local_slots
        elif param.shape[0] == phy2log.numel():
            local = range(phy2log.numel())
        else:
            raise WeightLoadError(
                f"cannot load {name!r}: this process holds {param.shape[0]} of {phy2log.numel()} physical "
                "slots (expert parallelism) and the model passed is not the one eplb.attach() was called "
                "on; pass that model (or one containing it)"
            )
        loader = getattr(param, "weight_loader", None)
        one = tuple(param.shape[1:])
        try:
            if expert_id is None:  # a whole logical tensor [E, ...]: every local slot gets its expert
                want = (num_logical, *one)
                if tuple(loaded_weight.shape) != want:
                    raise WeightLoadError(
                        f"expects the logical shape {want} (or one expert's weight {one} "
                        f"with an expert id), got {tuple(loaded_weight.shape)}"
                    )
                slots = torch.arange(local.start, local.stop)
                physical = loaded_weight.index_select(0, phy2log[slots].to(loaded_weight.device))
                (loader or default_weight_loader)(param, physical, *args, **kwargs)
                written = len(slots)
            else:
                expert = _check_index(expert_id, num_logical)
                if tuple(loaded_weight.shape) != one:
                    raise WeightLoadError(
                        f"expects one expert's weight of shape {one}, got {tuple(loaded_weight.shape)}"
                    )
                count = int(layer.replica_count[expert])
                slots = [s - local.start for s in layer.log2phy[expert, :count].cpu().tolist() if s in local]
                written = _write_replicas(param, loaded_weight, slots, loader, args, kwargs, by_keyword)
        except WeightLoadError as exc:
            raise WeightLoadError(
                f"cannot load a tensor of shape {tuple(loaded_weight.shape)} into {name!r}: "
                f"{exc}; the old weights are kept"
            ) from None
        except (RuntimeError, ValueError, IndexError, TypeError) as exc:
            raise WeightLoadError(
                f"cannot load a tensor of shape {tuple(loaded_weight.shape)} into {name!r} "
                f"(EPLB physical slots {tuple(param.shape)}): {exc}; the old weights are "
                "kept"
            ) from exc
    log.debug(
        "load_weight %s%s: %d physical slots written",
        name,
        "" if expert_id is None else f" expert {expert_id}",
        written,
    )


def _write_replicas(
    param: nn.Parameter,
    loaded_weight: torch.Tensor,
    slots: list[int],
    loader: Any,
    args: list,
    kwargs: dict,
    by_keyword: bool,
) -> int:
    """Write one expert's weight into the local ``slots`` of ``param`` (all of them or none)."""
    if not slots:
        return 0
    index = torch.tensor(slots, device=param.device)
    if loader is None:
        with torch.no_grad():
            rows = loaded_weight.to(param.device, param.dtype).unsqueeze(0).expand(len(slots), *param.shape[1:])
            param.index_copy_(0, index, rows)
        return len(slots)
    backup = param.detach().index_select(0, index)  # one expert's replicas: small
    try:
        for slot in slots:
            if by_keyword:
                loader(param, loaded_weight, *args, **kwargs, expert_id=slot)
            else:
                loader(param, loaded_weight, slot, *args, **kwargs)
    except BaseException:
        with torch.no_grad():
            param.index_copy_(0, index, backup)
        raise
    return len(slots)
