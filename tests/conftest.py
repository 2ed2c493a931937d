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


# --------------------------------------------------------------------------- xdist scheduling
# ``--dist loadgroup`` (pyproject) hands an unmarked test to whichever worker asks next, so a module's
# tests are spread over both workers and a module- or class-scoped fixture of the module (a compiled
# model, a CLI dump) is built once per worker.  A test using such a fixture joins the group named after
# its module: one worker runs the module and builds each fixture once.
FIRST_GROUP = "vllm"  # tests/test_vllm*.py: ~11 min on one worker; handed out last it would be the tail


def _module_fixture_group(item: pytest.Item) -> str | None:
    """``item``'s module path when ``item`` uses a module- or class-scoped fixture its own module
    defines (parametrized ones included), else None."""
    module = item.nodeid.split("::", 1)[0]
    info = getattr(item, "_fixtureinfo", None)
    for defs in info.name2fixturedefs.values() if info else ():
        if any(d.scope in ("module", "class") and d.baseid == module for d in defs):
            return module
    return None


def _group(item: pytest.Item) -> str | None:
    mark = item.get_closest_marker("xdist_group")
    if mark is None:
        return None
    return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))


def pytest_configure(config: pytest.Config) -> None:
    # xdist >= 3.6 hands out the groups by their number of tests (largest first); the order below
    # (the vLLM group first) is by time instead
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]):
    for item in items:
        if _group(item) is None and (module := _module_fixture_group(item)) is not None:
            item.add_marker(pytest.mark.xdist_group(module))
    result = yield
    if hasattr(config, "workerinput"):  # an xdist worker: its collection order is the order of the work units
        items.sort(key=_work_order(items))
    return result


def _work_order(items: list[pytest.Item]):
    """Sort key: the vLLM group, the other groups (more tests first), then the single tests in
    collection order (they fill in, so the workers end together)."""
    sizes: dict[str, int] = {}
    for item in items:
        if (group := _group(item)) is not None:
            sizes[group] = sizes.get(group, 0) + 1

    def key(item: pytest.Item) -> tuple[int, int]:
        group = _group(item)
        if group is None:
            return (2, 0)
        return (0, 0) if group == FIRST_GROUP else (1, -sizes[group])

    return key
