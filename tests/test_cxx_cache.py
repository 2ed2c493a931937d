"""tests/_cxx_cache.py, the compiler cache of the vLLM tests' engines, is transparent: an identical
command on identical sources (at another path) is answered with the stored binary; another source,
another flag or a failed compile reaches the real compiler, and a failure is never stored."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from _cxx_cache import REAL_ENV, compiler_env

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")


def _compiler(tmp_path: Path) -> tuple[dict[str, str], Path, Path]:
    """The cache's environment with a real compiler that logs each call it gets."""
    log = tmp_path / "real_calls.log"
    real = tmp_path / "real" / "g++"
    real.parent.mkdir()
    real.write_text(f'#!/bin/sh\necho "$@" >> "{log}"\nexec "{shutil.which("g++")}" "$@"\n')
    real.chmod(0o755)
    env = {**os.environ, **compiler_env(tmp_path / "cache"), REAL_ENV: str(real)}
    return env, log, tmp_path / "cache" / "store"


def _compile(env: dict[str, str], folder: Path, source: str, *flags: str) -> tuple[subprocess.CompletedProcess, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    src, out = folder / "kernel.cpp", folder / "kernel.so"
    src.write_text(source)
    run = subprocess.run(
        [env["CXX"], str(src), "-shared", "-fPIC", *flags, "-o", str(out)], env=env, capture_output=True, text=True
    )
    return run, out


def _calls(log: Path) -> int:
    return len(log.read_text().splitlines()) if log.exists() else 0


def test_identical_compile_elsewhere_is_answered_from_the_store(tmp_path: Path) -> None:
    env, log, store = _compiler(tmp_path)
    assert Path(env["CXX"]).name == "g++"  # Inductor tells GCC by the compiler's name
    source = 'extern "C" int answer() { return 42; }\n'
    first, out1 = _compile(env, tmp_path / "a", source, "-O2")
    assert first.returncode == 0, first.stderr
    assert _calls(log) == 1 and len(list(store.iterdir())) == 1

    again, out2 = _compile(env, tmp_path / "b", source, "-O2")  # another folder, same source and flags
    assert again.returncode == 0, again.stderr
    assert _calls(log) == 1  # the real compiler was not called
    assert out2.read_bytes() == out1.read_bytes()

    import ctypes

    assert ctypes.CDLL(str(out2)).answer() == 42

    other, out3 = _compile(env, tmp_path / "c", source.replace("42", "7"), "-O2")  # another source
    flag, _ = _compile(env, tmp_path / "d", source, "-O1")  # another flag
    assert other.returncode == 0 and flag.returncode == 0
    assert _calls(log) == 3 and len(list(store.iterdir())) == 3
    assert ctypes.CDLL(str(out3)).answer() == 7


def test_failed_compile_is_not_stored_and_other_commands_pass_through(tmp_path: Path) -> None:
    env, log, store = _compiler(tmp_path)
    for folder in ("a", "b"):
        run, out = _compile(env, tmp_path / folder, "int broken( {\n")
        assert run.returncode != 0 and "error" in run.stderr
        assert not out.exists()
    assert _calls(log) == 2 and list(store.iterdir()) == []  # both reached the compiler, none stored

    version = subprocess.run([env["CXX"], "--version"], env=env, capture_output=True, text=True)
    assert version.returncode == 0 and version.stdout.strip()
    assert _calls(log) == 3
