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
            libs[0], exc,
        )
        return False
    return True


def available() -> bool:
    """True when the C++ kernel library is loaded and not disabled by the environment."""
    return _load()
