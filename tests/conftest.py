"""Session settings for the tests: the on-disk pattern cache (``ascend_passes.passes._pattern``)
goes to a temporary folder of this session, never to the user's cache directory (subprocesses the
tests start inherit it)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest

if not os.environ.get("ASCEND_PASSES_PATTERN_CACHE_DIR"):
    _cache = tempfile.mkdtemp(prefix="ascend_passes_patterns_")
    os.environ["ASCEND_PASSES_PATTERN_CACHE_DIR"] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)


@pytest.fixture
def gemm_route(monkeypatch):
    """``gemm_route("swap")`` forces a grouped-matmul GEMM route (ASCEND_PASSES_GEMM) for this test."""

    def set_route(route: str) -> None:
        monkeypatch.setenv("ASCEND_PASSES_GEMM", route)

    return set_route
