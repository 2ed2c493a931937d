"""Memory layouts for replacements: the fused ops return contiguous tensors, the ATen ops they
replace return the layout TensorIterator picks from their inputs (a transposed input gives a
transposed output).  A later ``view`` of the graph was traced against that layout, so a
replacement computes in the replaced value's *memory order*: permute the inputs so that memory
order is the dim order (a view, no copy), call the op, permute the contiguous result back.  The
result has exactly the strides the replaced value had; for contiguous inputs nothing is added.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch._prims_common import compute_elementwise_output_logical_to_physical_perm
from torch.fx.experimental.symbolic_shapes import statically_known_true


def memory_order(*tensors: torch.Tensor) -> list[int]:
    """The logical dims, outermost first, of the layout an elementwise ATen op over ``tensors``
    gives its output (TensorIterator's rule: the first input with an opinion decides)."""
    perm = compute_elementwise_output_logical_to_physical_perm(*tensors)
    return list(perm[0] if isinstance(perm, tuple) else perm)


def is_identity(order: Sequence[int]) -> bool:
    return list(order) == list(range(len(order)))


def to_frame(t: torch.Tensor, order: Sequence[int]) -> torch.Tensor:
    """``t`` with its dims in ``order``: a view, contiguous when ``t`` is laid out in ``order``
    (an input laid out otherwise is copied by the op itself, which accepts any strides)."""
    return t if is_identity(order) else t.permute(list(order))


def from_frame(t: torch.Tensor, order: Sequence[int]) -> torch.Tensor:
    """Undo ``to_frame``'s permutation: a contiguous ``t`` comes back laid out in ``order``."""
    if is_identity(order):
        return t
    inverse = [0] * len(order)
    for i, d in enumerate(order):
        inverse[d] = i
    return t.permute(inverse)


def strides_in_order(shape: Sequence[int], order: Sequence[int]) -> list[int]:
    """The strides of a dense tensor of ``shape`` laid out in ``order``."""
    strides = [0] * len(shape)
    step = 1
    for d in reversed(list(order)):
        strides[d] = step
        step = step * shape[d]
    return strides


def layout_difference(value: torch.Tensor, order: Sequence[int]) -> str | None:
    """None when ``value``'s strides are those of a dense tensor laid out in ``order`` (dims of
    size 1 ignored: their stride means nothing to a view), else a short description."""
    want = strides_in_order(value.shape, order)
    for size, have, need in zip(value.shape, value.stride(), want):
        if statically_known_true(size == 1):
            continue
        if not statically_known_true(have == need):
            return f"strides {tuple(value.stride())}, the replacement would give {tuple(want)}"
    return None


def outputs_keep(match_outputs: Sequence[object], order: Sequence[int]) -> str | None:
    """Why a replacement computed in ``order`` would not give the matched outputs' layout (the
    graph's ``meta["val"]`` of each output node), or None when it gives exactly that layout."""
    for node in match_outputs:
        value = getattr(node, "meta", {}).get("val")
        if isinstance(value, torch.Tensor) and (diff := layout_difference(value, order)) is not None:
            return (
                f"the replaced value's memory layout ({diff}) is not one the fused op can return "
                "and later views of the graph were traced against it"
            )
    return None


__all__ = [
    "from_frame",
    "is_identity",
    "layout_difference",
    "memory_order",
    "outputs_keep",
    "strides_in_order",
    "to_frame",
]
