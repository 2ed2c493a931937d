"""ascend_passes.allocator: which allocator the process runs with (from /proc/self/maps), and the one warning a
CPU compile that fused something gives under glibc's malloc (its large freed blocks go back to the operating
system, so the fused kernels' outputs fault in again on every forward)."""

from __future__ import annotations

import glob
import logging
import os
import subprocess
import sys

import pytest
import torch
from _helpers import compile_and_run

from ascend_passes import allocator

LIBC = "7f00-7f10 r-xp 00000000 08:01 123 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
TCMALLOC = "7f20-7f30 r-xp 00000000 08:01 456 /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4.5.9\n"
JEMALLOC = "7f40-7f50 r-xp 00000000 08:01 789 /usr/lib/x86_64-linux-gnu/libjemalloc.so.2\n"


@pytest.mark.parametrize(
    "maps,expected",
    [(LIBC, "glibc"), (LIBC + TCMALLOC, "tcmalloc"), (JEMALLOC + LIBC, "jemalloc"), ("", "unknown")],
)
def test_the_allocator_is_read_off_the_process_map(tmp_path, maps, expected):
    path = tmp_path / "maps"
    path.write_text(maps)
    assert allocator.current_allocator(str(path)) == expected


def test_an_unreadable_map_is_unknown(tmp_path):
    assert allocator.current_allocator(str(tmp_path / "missing")) == "unknown"


def test_this_process_is_told_apart_from_one_under_tcmalloc():
    """The real map: this test process's allocator, and a child with TCMalloc preloaded where the machine has it
    (tools/setup.sh installs it)."""
    assert allocator.current_allocator() in ("glibc", *allocator.REUSING)
    libs = sorted(glob.glob("/usr/lib/*/libtcmalloc_minimal.so.4"))
    if not libs:
        pytest.skip("libtcmalloc_minimal.so.4 is not installed here (tools/setup.sh installs it where apt-get works)")
    lib = libs[0]
    code = "from ascend_passes.allocator import current_allocator; print(current_allocator())"
    child = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, "LD_PRELOAD": lib}, capture_output=True, text=True, timeout=120
    )
    assert child.stdout.strip() == "tcmalloc", child.stderr[-2000:]


class _Norm(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + 1e-6))


class _Plain(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1


@pytest.fixture
def fresh_warning(monkeypatch):
    """warn_if_glibc's once-per-process memory cleared before and after the test."""
    allocator.warn_if_glibc.cache_clear()
    yield monkeypatch
    allocator.warn_if_glibc.cache_clear()


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "ascend_passes.allocator"]


def test_a_cpu_compile_under_glibc_warns_once(fresh_warning, caplog):
    fresh_warning.setattr(allocator, "current_allocator", lambda *a: "glibc")
    with caplog.at_level(logging.WARNING, logger="ascend_passes.allocator"):
        for _ in range(2):
            _, reports = compile_and_run(_Norm(), (torch.randn(4, 16),), target="cpu", compiler="eager")
            assert reports[-1].count("ascend.rms_norm") == 1
    messages = _warnings(caplog)
    assert len(messages) == 1
    assert (
        "glibc malloc" in messages[0] and allocator.TCMALLOC_HINT in messages[0] and allocator.GLIBC_HINT in messages[0]
    )


@pytest.mark.parametrize("name", allocator.REUSING)
def test_no_warning_under_an_allocator_that_reuses_blocks(fresh_warning, caplog, name):
    fresh_warning.setattr(allocator, "current_allocator", lambda *a: name)
    with caplog.at_level(logging.WARNING, logger="ascend_passes.allocator"):
        compile_and_run(_Norm(), (torch.randn(4, 16),), target="cpu", compiler="eager")
    assert _warnings(caplog) == []


def test_no_warning_for_a_graph_with_nothing_fused(fresh_warning, caplog):
    """Nothing rewritten: the graph allocates as the uncompiled model does, so nothing is said (and the once-only
    warning is kept for a graph that has fused kernels)."""
    fresh_warning.setattr(allocator, "current_allocator", lambda *a: "glibc")
    with caplog.at_level(logging.WARNING, logger="ascend_passes.allocator"):
        _, reports = compile_and_run(_Plain(), (torch.randn(4, 16),), target="cpu", compiler="eager")
    assert reports[-1].num_matches == 0
    assert _warnings(caplog) == []
    assert allocator.warn_if_glibc.cache_info().currsize == 0
