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

Nothing is ever replaced: ``prepare`` and ``restore`` assign ``param.data`` in place, so every
parameter keeps its identity, its Python attributes (``weight_loader`` and whatever else a
framework hung on it) and ``requires_grad``, and compiled graphs — which read parameters as
inputs — read the live weights.  Which parameters change layout is what the passes decided: the
backend calls :func:`record_execution_weights` after the pipeline, which marks every parameter
that a fused ``ascend.grouped_matmul`` reads transposed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterator, Literal, Sequence

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
    if layout not in ("auto", "execution", "loadable"):
        raise ConfigError(f"layout={layout!r}: use 'auto', 'execution' or 'loadable'")
    if layout == "loadable":
        return restore(*models)
    marked = list(_marked(models))
    if not marked:
        _nothing_marked("prepare", models)
        return 0
    changed = 0
    with torch.no_grad():
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
    marked = list(_marked(models))
    if not marked:
        _nothing_marked("restore", models)
        return 0
    changed = 0
    with torch.no_grad():
        for _, param, _how in marked:
            if not param.is_contiguous():
                param.data = param.data.contiguous()
                changed += 1
    log.info("restore: %d of %d marked weights put back in the loadable layout", changed, len(marked))
    return changed


def _nothing_marked(what: str, models: Sequence[nn.Module]) -> None:
    names = ", ".join(type(m).__name__ for m in models) or "no model"
    log.info("%s: no weight of %s is read in another layout by an ascend_passes graph (never "
             "compiled with backend='ascend_passes', or nothing was fused); nothing to do", what, names)


# ----------------------------------------------------------------------------- loading
def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    """Copy a whole tensor into ``param`` (any layout); refuses a different shape."""
    if tuple(loaded_weight.shape) != tuple(param.shape):
        raise WeightLoadError(f"expects shape {tuple(param.shape)}, got {tuple(loaded_weight.shape)}")
    with torch.no_grad():
        param.copy_(loaded_weight)


def expert_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor, expert_id: int) -> None:
    """Copy one expert's weight (``[2I, H]`` or ``[H, I]``, Hugging Face layout) into
    ``param[expert_id]``; refuses a bad expert id or shape before writing anything."""
    if not 0 <= expert_id < param.shape[0]:
        raise WeightLoadError(f"expert_id {expert_id} outside [0, {param.shape[0]})")
    if tuple(loaded_weight.shape) != tuple(param.shape[1:]):
        raise WeightLoadError(
            f"expects one expert's weight of shape {tuple(param.shape[1:])}, got {tuple(loaded_weight.shape)}")
    with torch.no_grad():
        param[expert_id].copy_(loaded_weight)


def load_weight(model: nn.Module, name: str, loaded_weight: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    """Load ``loaded_weight`` into parameter ``name`` of ``model`` through its ``weight_loader``
    attribute (``weight_loader(param, loaded_weight, *args, **kwargs)``, vLLM's convention),
    or :func:`default_weight_loader` when it has none.

    A tensor that does not fit (wrong shape, bad expert id) raises :class:`WeightLoadError`
    naming the parameter and leaves its weights as they were: the loaders here check before
    they write, and ``Tensor.copy_`` refuses a mismatched shape before writing (a framework's
    own loader must do the same; no backup copy is taken, it would cost a copy per update).
    """
    params = dict(model.named_parameters())
    if name not in params:
        raise WeightLoadError(f"{type(model).__name__} has no parameter {name!r}")
    param = params[name]
    loader = getattr(param, "weight_loader", default_weight_loader)
    try:
        loader(param, loaded_weight, *args, **kwargs)
    except (RuntimeError, ValueError, IndexError) as exc:
        raise WeightLoadError(
            f"cannot load a tensor of shape {tuple(loaded_weight.shape)} into {name!r} "
            f"(shape {tuple(param.shape)}): {exc}; the old weights are kept") from exc
