"""Linear patterns: ``x @ weight.T (+ bias)`` on 2-D ``x`` → ``ascend.linear`` (torch_npu's
``npu_linear``).

The search functions are ``F.linear`` itself, so they trace to whatever form the graph has
(``mm``/``addmm`` of a transposed weight; a 3-D input reaches the same ``mm`` through a
``view``).  On CPU the op's kernel streams the weight for a few rows (decode), where BLAS packs
it first and reads it about twice; for more rows it makes the same BLAS call as the graph did.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import ascend_passes.ops  # noqa: F401  (registers torch.ops.ascend.*)
from ascend_passes.passes._pattern import Bindings, Rewrite

ascend = torch.ops.ascend


# ------------------------------------------------------------------------------ patterns
def linear_pattern(x, weight):
    return F.linear(x, weight)


def linear_replacement(x, weight):
    return ascend.linear(x, weight)


def linear_bias_pattern(x, weight, bias):
    return F.linear(x, weight, bias)


def linear_bias_replacement(x, weight, bias):
    return ascend.linear(x, weight, bias)


def _bias_is_a_vector(v: Bindings) -> str | None:
    """``addmm`` takes any bias that broadcasts to [rows, N] (Inductor's post-grad graphs fold a
    full-sized add into it); ``npu_linear``'s bias is a vector over the N output features."""
    weight, bias = v["weight"], v["bias"]
    if not isinstance(bias, torch.Tensor) or bias.dim() != 1 or bias.shape[0] != weight.shape[0]:
        shape = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
        return f"bias of shape {shape} is not a vector over the {weight.shape[0]} output features"
    return None


# ------------------------------------------------------------------------------ examples
def _plain(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    return torch.empty(4, 8, dtype=dtype), torch.empty(16, 8, dtype=dtype)


def _with_bias(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    return (*_plain(dtype), torch.empty(16, dtype=dtype))


# ------------------------------------------------------------------------------ the table
REWRITES: list[Rewrite] = [
    Rewrite("linear", linear_bias_pattern, linear_bias_replacement, _with_bias, check=_bias_is_a_vector),
    Rewrite("linear", linear_pattern, linear_replacement, _plain),
]
