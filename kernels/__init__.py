"""CPU kernels of the ``torch.ops.ascend`` ops: loads the C++ library built from this folder.

``available()`` says whether ``torch.ops.ascend_kernels`` is loaded; ops fall back to their
reference implementations when it is not, or when ``ASCEND_PASSES_KERNELS=reference``.
``ASCEND_PASSES_KERNELS_LIB=<path>`` loads that library instead of this folder's (a build under test).
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger("ascend_passes.kernels")


@functools.cache
def _load() -> bool:
    if os.environ.get("ASCEND_PASSES_KERNELS", "").lower() == "reference":
        log.info("ASCEND_PASSES_KERNELS=reference: using the reference implementations")
        return False
    here = Path(__file__).resolve().parent
    override = os.environ.get("ASCEND_PASSES_KERNELS_LIB", "")
    libs = [Path(override)] if override else sorted(here.glob("_C*.so"))
    if not libs:
        log.warning(
            "ascend_passes C++ kernels are not built (no %s/_C*.so); the ascend ops use their "
            "reference implementations. Reinstall with `pip install --no-build-isolation -e .`.",
            here,
        )
        return False
    try:
        torch.ops.load_library(str(libs[0]))
    except OSError as exc:  # a half-built or mismatched library (undefined symbol, wrong torch)
        log.warning(
            "ascend_passes C++ kernels in %s do not load (%s); the ascend ops use their reference "
            "implementations. Rebuild with `pip install --no-build-isolation -e .`.",
            libs[0],
            exc,
        )
        return False
    # The library defines only torch.ops.ascend_kernels.*; its kernels become the CPU kernels of
    # torch.ops.ascend.* below, once their schemas are known to equal the Python records (a stale
    # library, built before a schema changed, would otherwise abort the process).
    import ascend_passes.ops  # noqa: F401  (defines torch.ops.ascend; its import calls available())

    stale = stale_schemas()
    if stale:
        log.warning(
            "ascend_passes C++ kernels in %s were built for other op schemas (%s); the ascend ops "
            "use their reference implementations. Rebuild with `pip install --no-build-isolation -e .`.",
            libs[0],
            "; ".join(stale),
        )
        return False
    if not hasattr(torch.ops.ascend_kernels, "register_cpu_impls"):  # a library older than this check
        log.warning(
            "ascend_passes C++ kernels in %s are older than this package (no register_cpu_impls); the "
            "ascend ops use their reference implementations. Rebuild with `pip install --no-build-isolation -e .`.",
            libs[0],
        )
        return False
    missing = missing_kernels()
    if missing:
        log.warning(
            "ascend_passes C++ kernels in %s are older than this package (no kernel for %s); those ops "
            "use their reference implementations. Rebuild with `pip install --no-build-isolation -e .`.",
            libs[0],
            ", ".join(missing),
        )
    torch.ops.ascend_kernels.register_cpu_impls()
    return True


_NOT_KERNELS = ("version", "register_cpu_impls")


def _signature(schema: torch._C.FunctionSchema) -> str:
    return str(schema).split("::", 1)[1]


def stale_schemas() -> list[str]:
    """``"op: library schema != package schema"`` for every kernel of the loaded library whose
    schema differs from ``torch.ops.ascend``'s (or that is no ascend op); empty when they agree."""
    names = sorted(
        n.split("::", 1)[1]
        for n in torch._C._dispatch_get_all_op_names()
        if n.startswith("ascend_kernels::") and n.split("::", 1)[1] not in _NOT_KERNELS
    )
    stale = []
    for name in names:
        built = _signature(getattr(torch.ops.ascend_kernels, name).default._schema)
        try:
            expected = _signature(getattr(torch.ops.ascend, name).default._schema)
        except (AttributeError, RuntimeError):
            stale.append(f"{name}: not an ascend op")
            continue
        if built != expected:
            stale.append(f"{name}: library {built} != package {expected}")
    return stale


def missing_kernels() -> list[str]:
    """The ops whose record says the library implements them (``Op.cpp_kernel``) but the loaded
    library does not (built before they were added); empty when none is missing."""
    import ascend_passes.ops as ops  # (mid-import when ops/__init__ loads us: OPS is set, KERNEL_OPS not yet)

    built = {n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("ascend_kernels::")}
    return [name for name, op in ops.OPS.items() if op.cpp_kernel and name not in built]


def available() -> bool:
    """True when the C++ kernel library is loaded and not disabled by the environment."""
    return _load()
