"""A C++ compiler cache for the processes the tests start (vLLM engines): Inductor's ``g++`` calls
(kernels, the C++ wrapper, the precompiled header) are answered from a folder of this pytest
session when the same command line compiled the same sources before, so every engine does not
compile again the kernels (and the precompiled header) an earlier engine compiled.

Transparent: the key is the real compiler, every argument, and the content of every input file
named on the command line (the output path only by its suffix); only a successful compile is
stored; a command without one ``-o`` (``--version``, ``-v``) goes straight to the compiler.  The
sources Inductor writes include only torch's installed headers, which do not change within a
session.  Nothing about what Inductor, vLLM or ascend_passes compile changes: the passes run and
Inductor generates the same code, only ``g++``'s answer to an identical question is reused.

``compiler_env(folder)`` gives the environment (``CXX``) of a child process; run as a script this
module is the compiler.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REAL_ENV = "ASCEND_PASSES_TEST_REAL_CXX"
STORE_ENV = "ASCEND_PASSES_TEST_CXX_CACHE"


def compiler_env(folder: str | os.PathLike[str]) -> dict[str, str]:
    """Environment entries that make a child's Inductor compile through this cache in ``folder``
    (created; a launcher named ``g++``, as Inductor recognises GCC by the compiler's name)."""
    folder = Path(folder)
    launcher = folder / "bin" / "g++"
    if not launcher.exists():
        (folder / "store").mkdir(parents=True, exist_ok=True)
        launcher.parent.mkdir(parents=True, exist_ok=True)
        tmp = launcher.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "{Path(__file__).resolve()}" "$@"\n')
        tmp.chmod(0o755)
        os.replace(tmp, launcher)
    real = os.environ.get(REAL_ENV) or shutil.which(os.environ.get("CXX", "g++")) or "g++"
    return {"CXX": str(launcher), REAL_ENV: real, STORE_ENV: str(folder / "store")}


def _file_digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _key(real: str, args: list[str], out_index: int) -> str:
    st = os.stat(real)
    h = hashlib.sha256(f"{os.path.realpath(real)}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    for i, arg in enumerate(args):
        if i == out_index:
            part = "out" + "".join(Path(arg).suffixes[-2:])  # .so, .h.gch, .o: what is made
        elif os.path.isfile(arg):
            part = "file" + Path(arg).suffix + ":" + _file_digest(arg)
        else:
            part = "arg:" + arg
        h.update(part.encode() + b"\0")
    return h.hexdigest()


def _copy_atomically(src: str, dst: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(dst) or ".", prefix=".cxx_cache_")
    os.close(fd)
    try:
        shutil.copyfile(src, tmp)
        os.chmod(tmp, 0o755)
        os.replace(tmp, dst)
    except BaseException:
        os.unlink(tmp)
        raise


def main(args: list[str]) -> int:
    real, store = os.environ[REAL_ENV], os.environ[STORE_ENV]
    outs = [i + 1 for i, a in enumerate(args) if a == "-o"]
    if len(outs) != 1 or outs[0] >= len(args):
        return subprocess.call([real, *args])
    out = args[outs[0]]
    stored = os.path.join(store, _key(real, args, outs[0]))
    if os.path.isfile(stored):
        _copy_atomically(stored, out)
        return 0
    rc = subprocess.call([real, *args])
    if rc == 0 and os.path.isfile(out):
        _copy_atomically(out, stored)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
