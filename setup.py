"""Build and install ``ascend_passes``.

``patterns/`` and ``kernels/`` are top-level folders in the repository and are installed as
``ascend_passes.patterns`` and ``ascend_passes.kernels``.  The optional C++ CPU kernels in
``kernels/`` are built by ``CMakeLists.txt`` against the installed torch; install with
``pip install --no-build-isolation`` so the build sees the pinned torch instead of fetching
another one.  A failed kernel build is reported and skipped: the ops then run their reference
implementations (under ``ASCEND_PASSES_CI_STRICT=1``, which ``.ci/run`` sets, it fails the install).
``ASCEND_PASSES_BUILD_KERNELS=0`` skips the build on purpose.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name: str, source_dir: Path) -> None:
        super().__init__(name, sources=[])
        self.source_dir = source_dir


class CMakeBuild(build_ext):
    """Configure and build ``CMakeLists.txt``; place the library where ``ext.name`` imports.

    A skipped or failed (non-strict) kernel build drops the extension from this command's
    extensions, so nothing later (the editable install's copy into the source tree, the list
    of outputs) looks for a library that was never built."""

    def build_extensions(self) -> None:
        self._not_built: list[Extension] = []
        super().build_extensions()
        self.extensions = [ext for ext in self.extensions if ext not in self._not_built]

    def build_extension(self, ext: Extension) -> None:
        if not isinstance(ext, CMakeExtension):
            return super().build_extension(ext)
        if os.environ.get("ASCEND_PASSES_BUILD_KERNELS", "1") == "0":
            print("ascend_passes: ASCEND_PASSES_BUILD_KERNELS=0, skipping the C++ kernels")
            self._not_built.append(ext)
            return
        try:
            self._cmake_build(ext)
        except Exception as exc:  # the package works without the kernels
            if os.environ.get("ASCEND_PASSES_CI_STRICT") == "1":  # CI (.ci/run): a failed build fails
                raise
            print(
                f"ascend_passes: WARNING: building the C++ kernels failed ({exc}); "
                "the ascend ops will use their reference implementations",
                file=sys.stderr,
            )
            self._not_built.append(ext)

    def _cmake_build(self, ext: CMakeExtension) -> None:
        if shutil.which("cmake") is None:
            raise RuntimeError("cmake not found")
        import torch  # the build needs the torch it will run with (no build isolation)

        target = Path(self.get_ext_fullpath(ext.name)).resolve()
        build_dir = ROOT / "build" / "kernels"  # persistent: re-installs rebuild incrementally
        build_dir.mkdir(parents=True, exist_ok=True)
        cfg = "Release"
        subprocess.check_call(
            [
                "cmake",
                str(ext.source_dir),
                f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
                f"-DPython_EXECUTABLE={sys.executable}",
                f"-DCMAKE_BUILD_TYPE={cfg}",
                f"-DASCEND_PASSES_OUTPUT={target}",
            ],
            cwd=build_dir,
        )
        jobs = str(os.cpu_count() or 2)
        subprocess.check_call(["cmake", "--build", ".", "--config", cfg, "-j", jobs], cwd=build_dir)
        if not target.exists():
            raise RuntimeError(f"cmake did not produce {target}")


setup(
    packages=[
        "ascend_passes",
        "ascend_passes.passes",
        "ascend_passes.eplb",
        "ascend_passes.inspect",
        "ascend_passes.ops",
        "ascend_passes.patterns",
        "ascend_passes.kernels",
    ],
    package_dir={
        "ascend_passes": "ascend_passes",
        "ascend_passes.patterns": "patterns",
        "ascend_passes.kernels": "kernels",
    },
    package_data={"ascend_passes.kernels": ["*.cpp", "*.h"]},
    ext_modules=[CMakeExtension("ascend_passes.kernels._C", ROOT)],
    cmdclass={"build_ext": CMakeBuild},
)
