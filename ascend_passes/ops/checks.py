"""The argument-check helpers every ``ascend`` op module uses (each op's own checks live in its
module, next to its schema).

Every check raises ``ValueError`` whose message starts with ``ascend.<op>:`` and names the
argument, what it got and what is allowed; the C++ kernels (kernels/*.cpp) raise the same messages
through ``TORCH_CHECK_VALUE``.  They look at attributes, ranks and dtypes only, so they also run
under FakeTensor with symbolic sizes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def fail(op: str, message: str) -> None:
    raise ValueError(f"ascend.{op}: {message}")


def check_float(op: str, name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        fail(op, f"{name} must be float32, bfloat16 or float16, got {t.dtype}")


def check_same_dtype(op: str, name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.dtype != ref.dtype:
        fail(op, f"{name} dtype {t.dtype} does not match {ref_name} dtype {ref.dtype}")


def check_dim(op: str, name: str, t: torch.Tensor, dims: Sequence[int]) -> None:
    if t.dim() not in dims:
        allowed = " or ".join(f"{d}-D" for d in dims)
        fail(op, f"{name} must be {allowed}, got {t.dim()}-D")


def check_choice(op: str, name: str, value: object, allowed: Sequence[object]) -> None:
    if value not in allowed:
        fail(op, f"{name} must be one of {list(allowed)}, got {value}")
