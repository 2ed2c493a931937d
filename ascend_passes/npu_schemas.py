"""torch_npu's op schemas, meta (shape) kernels and torchair converter set, read from the real
torch_npu wheel — so a graph can be lowered to ``torch.ops.npu.*`` and checked on any machine.

Without the CANN toolkit ``import torch_npu`` fails (and an installed torch_npu even breaks plain
``import torch``, see README), so the wheel is used as *data*, never installed:

- ``load()`` defines every op of ``torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml``
  (its ``custom``/``autograd`` ``func:`` lines) with ``torch.library.Library("npu", "DEF")`` and
  registers the wheel's own meta kernels by executing ``torch_npu/op_plugin/meta/_meta_registrations.py``
  against them, with the stand-ins listed in ``STAND_INS`` for the torch_npu version queries it
  imports (they only choose branches; no shape rule is replaced).  Its two ``aten`` overrides
  (``matmul_backward``, ``_convolution``) are skipped: they would change torch's own ops.
  Where torch_npu imports, ``load()`` does nothing (the real ops are there).  Idempotent.
- ``converters()`` is the set of ``npu`` overloads torchair registers a GE converter for
  (``register_fx_node_ge_converter(torch.ops.npu.<op>.<overload>)`` under
  ``torch_npu/dynamo/torchair/_ge_concrete_graph/ge_converter/``), read from the files' text.

The wheel: ``$ASCEND_PASSES_TORCH_NPU_WHEEL`` when set, else ``torch_npu-2.13.0-*.whl`` in
``CACHE_DIR`` (``$XDG_CACHE_HOME/ascend_passes`` or ``~/.cache/ascend_passes``), which
``tools/setup.sh`` fills with ``pip download torch-npu==2.13.0 --no-deps``.  Defining the 420 ops
takes ~0.1 s; parsing the yaml ~0.4 s; the meta file ~0.3 s (measured on the CI machine).
"""

from __future__ import annotations

import ast
import functools
import logging
import os
import re
import time
import types
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.library import Library

from .errors import AscendPassesError
from .ops._define import defined

log = logging.getLogger("ascend_passes.npu_schemas")

TORCH_NPU_VERSION = "2.13.0"  # pairs with torch 2.13.0
WHEEL_ENV = "ASCEND_PASSES_TORCH_NPU_WHEEL"
SCHEMA_FILE = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"
META_FILE = "torch_npu/op_plugin/meta/_meta_registrations.py"
ERROR_CODE_FILE = "torch_npu/utils/_error_code.py"
DOCS_FILE = "torch_npu/_op_plugin_docs.py"
CONVERTER_DIR = "torch_npu/dynamo/torchair/_ge_concrete_graph/ge_converter/"

# What the meta file's torch_npu imports are replaced by.  They choose branches only:
# soc 250 = Atlas A3 / 800I A3 class (below the 950's 260, so no fp8/hifloat8 branches);
# CANN 9.2.0 (the 2.13.0 release's toolkit), so "CANN >= x" checks hold.
STAND_INS: dict[str, Any] = {
    "get_soc_version": 250,
    "get_cann_version": "9.2.0",
    "_is_gte_cann_version": True,
}
# torch_npu's own dtype numbers (torch_npu/_C's enum) for the dtypes that torch lacks
_NPU_DTYPES = {
    "int4": 285,
    "hifloat8": 290,
    "float8_e8m0fnu": 293,
    "float4_e2m1fn_x2": 296,
    "float4_e1m2fn_x2": 297,
    "float4_e2m1": 296,
    "float4_e1m2": 297,
}


class NpuSchemaError(AscendPassesError, RuntimeError):
    """The torch_npu wheel is missing, unreadable, or not the release this package pairs with."""


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ascend_passes"


def wheel_path() -> Path | None:
    """The torch_npu wheel to read: ``$ASCEND_PASSES_TORCH_NPU_WHEEL``, else the pinned wheel in
    ``cache_dir()``; None when there is none.  A set variable naming no file is an error."""
    env = os.environ.get(WHEEL_ENV)
    if env:
        path = Path(env).expanduser()
        if not path.is_file():
            raise NpuSchemaError(
                f"{WHEEL_ENV}={env} is not a file; point it at a torch_npu "
                f"{TORCH_NPU_VERSION} wheel (pip download torch-npu=={TORCH_NPU_VERSION} --no-deps)"
            )
        return path
    found = sorted(cache_dir().glob(f"torch_npu-{TORCH_NPU_VERSION}-*.whl"))
    return found[0] if found else None


def _require_wheel(wheel: str | os.PathLike[str] | None) -> Path:
    path = Path(wheel) if wheel is not None else wheel_path()
    if path is None:
        raise NpuSchemaError(
            f"no torch_npu {TORCH_NPU_VERSION} wheel found: run tools/setup.sh (it downloads it to "
            f"{cache_dir()}) or set {WHEEL_ENV} to the wheel's path"
        )
    return path


@functools.cache
def _read(path: Path, mtime: float, member: str) -> str:
    del mtime  # part of the cache key only
    try:
        with zipfile.ZipFile(path) as zf:
            return zf.read(member).decode("utf-8")
    except (OSError, zipfile.BadZipFile, KeyError) as exc:
        raise NpuSchemaError(
            f"cannot read {member} from {path} ({type(exc).__name__}: {exc}); download the wheel again (tools/setup.sh)"
        ) from exc


def wheel_text(member: str, wheel: str | os.PathLike[str] | None = None) -> str:
    """The text of one file of the wheel."""
    path = _require_wheel(wheel)
    try:
        mtime = path.stat().st_mtime
    except OSError as exc:
        raise NpuSchemaError(f"cannot read the torch_npu wheel {path}: {exc}") from exc
    return _read(path.resolve(), mtime, member)


def _wheel_names(path: Path) -> list[str]:
    try:
        with zipfile.ZipFile(path) as zf:
            return zf.namelist()
    except (OSError, zipfile.BadZipFile) as exc:
        raise NpuSchemaError(
            f"cannot read the torch_npu wheel {path} ({exc}); download it again (tools/setup.sh)"
        ) from exc


@functools.cache
def _schemas(path: Path, mtime: float) -> dict[str, str]:
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        table = yaml.load(_read(path, mtime, SCHEMA_FILE), Loader=loader)
        entries = [e for section in ("custom", "autograd") for e in table.get(section) or ()]
    except (yaml.YAMLError, AttributeError) as exc:
        raise NpuSchemaError(f"{SCHEMA_FILE} in {path} is not the expected yaml: {exc}") from exc
    out: dict[str, str] = {}
    for entry in entries:
        func = entry.get("func") if isinstance(entry, dict) else None
        if func:
            name = func.split("(", 1)[0]
            out[name if "." in name else name + ".default"] = func
    if not out:
        raise NpuSchemaError(f"{SCHEMA_FILE} in {path} lists no npu ops")
    return out


def schemas(wheel: str | os.PathLike[str] | None = None) -> dict[str, str]:
    """``{"npu_grouped_matmul.List": "npu_grouped_matmul.List(Tensor[] x, ...) -> Tensor[]", ...}``:
    every npu op schema of the wheel, keyed by ``op.overload``."""
    path = _require_wheel(wheel)
    return _schemas(path.resolve(), path.stat().st_mtime)


_CONVERTER = re.compile(r"register_fx_node_ge_converter\(\s*torch\.ops\.npu\.(\w+)\.(\w+)\s*\)")


@functools.cache
def _converters(path: Path, mtime: float) -> frozenset[str]:
    found: set[str] = set()
    with zipfile.ZipFile(path) as zf:
        for name in zf.namelist():
            if name.startswith(CONVERTER_DIR) and name.endswith(".py"):
                text = zf.read(name).decode("utf-8", "replace")
                found.update(f"{op}.{overload}" for op, overload in _CONVERTER.findall(text))
    return frozenset(found)


def converters(wheel: str | os.PathLike[str] | None = None) -> frozenset[str]:
    """``{"npu_grouped_matmul.default", ...}``: the npu overloads torchair converts to GE ops."""
    path = _require_wheel(wheel)
    _wheel_names(path)  # a clear error for a corrupt wheel
    return _converters(path.resolve(), path.stat().st_mtime)


# ----------------------------------------------------------------------------------- loading
@dataclass
class _Loaded:
    wheel: Path
    libraries: list[Library]
    meta_ops: int
    seconds: float


_STATE: dict[str, _Loaded] = {}


def loaded() -> bool:
    """True once ``load()`` defined the npu ops in this process (False where torch_npu works)."""
    return "npu" in _STATE


def _stub_module(name: str, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    return mod


def _exec_without_imports(source: str, filename: str, namespace: dict[str, Any], drop: tuple[str, ...]) -> None:
    """Execute ``source`` with its top-level imports of the modules in ``drop`` removed (the
    namespace provides those names)."""
    tree = ast.parse(source, filename)

    def dropped(stmt: ast.stmt) -> bool:
        if isinstance(stmt, ast.Import):
            return all(a.name.split(".")[0] in drop or a.name in drop for a in stmt.names)
        if isinstance(stmt, ast.ImportFrom):
            return (stmt.module or "").split(".")[0] in drop or stmt.module in drop
        return False

    tree.body = [s for s in tree.body if not dropped(s)]
    exec(compile(tree, filename, "exec"), namespace)  # noqa: S102  (the wheel's own source)


def _register_meta(path: Path, mtime: float) -> tuple[Library, int]:
    """Execute the wheel's meta registrations against the defined ops; returns the IMPL library."""
    err_ns: dict[str, Any] = {"__name__": "torch_npu.utils._error_code", "_is_interactive_command_line": lambda: True}
    _exec_without_imports(_read(path, mtime, ERROR_CODE_FILE), ERROR_CODE_FILE, err_ns, ("torch_npu",))
    npu_lib = Library("npu", "IMPL", "Meta")
    skipped = object()  # the meta file's aten Library: its overrides are not applied
    count = 0

    def library(ns: str, kind: str, key: str = "") -> Any:
        if ns == "npu" and kind == "IMPL" and key == "Meta":
            return npu_lib
        return skipped

    def impl(lib: Any, name: str, *args: Any, **kwargs: Any):
        def register(fn):
            nonlocal count
            if lib is not skipped:
                torch.library.impl(lib, name, *args, **kwargs)(fn)
                count += 1
            return fn

        return register

    utils = _stub_module(
        "torch_npu.npu.utils",
        get_cann_version=lambda *a, **k: STAND_INS["get_cann_version"],
        _is_gte_cann_version=lambda *a, **k: STAND_INS["_is_gte_cann_version"],
    )
    torch_npu = _stub_module(
        "torch_npu",
        npu=_stub_module("torch_npu.npu", utils=utils),
        uint8=torch.uint8,
        float8_e5m2=torch.float8_e5m2,
        float8_e4m3fn=torch.float8_e4m3fn,
        **_NPU_DTYPES,
    )
    namespace: dict[str, Any] = {
        "__name__": "torch_npu.op_plugin.meta._meta_registrations",
        "torch_npu": torch_npu,
        "Library": library,
        "impl": impl,
        "has_side_effect": torch.fx.node.has_side_effect,
        "ErrCode": err_ns["ErrCode"],
        "ops_error": err_ns["ops_error"],
        "get_cann_version": utils.get_cann_version,
        "get_soc_version": lambda *a, **k: STAND_INS["get_soc_version"],
    }
    try:
        _exec_without_imports(
            _read(path, mtime, META_FILE), META_FILE, namespace, ("torch_npu", "torch.library", "torch.fx.node")
        )
    except Exception:
        npu_lib._destroy()
        raise
    return npu_lib, count


def load(wheel: str | os.PathLike[str] | None = None) -> bool:
    """Make ``torch.ops.npu.*`` exist with the wheel's schemas and meta kernels.

    Returns True when the ops are (now) defined by this module, False when torch_npu itself works
    here (nothing is done).  Idempotent.  Raises ``NpuSchemaError`` when no usable wheel is found.
    """
    from .npu import torch_npu_available

    if torch_npu_available():
        return False
    if loaded():
        return True
    path = _require_wheel(wheel).resolve()
    mtime = path.stat().st_mtime
    t0 = time.perf_counter()
    table = _schemas(path, mtime)
    clash = [k for k in table if defined(k.split(".")[0], "npu")]
    if clash:
        raise NpuSchemaError(
            f"the npu namespace already defines {clash[0]} (and {len(clash) - 1} more) "
            "without torch_npu: something else registered npu ops"
        )
    lib = Library("npu", "DEF")
    try:
        for func in table.values():
            lib.define(func)
        meta_lib, count = _register_meta(path, mtime)
    except NpuSchemaError:
        lib._destroy()
        raise
    except Exception as exc:
        lib._destroy()
        raise NpuSchemaError(
            f"the torch_npu wheel {path.name} did not load ({type(exc).__name__}: {exc}); "
            f"this package pairs with torch_npu {TORCH_NPU_VERSION}"
        ) from exc
    seconds = time.perf_counter() - t0
    _STATE["npu"] = _Loaded(path, [meta_lib, lib], count, seconds)
    log.info("npu ops from %s: %d schemas, %d meta kernels in %.2f s", path.name, len(table), count, seconds)
    return True


def unload() -> None:
    """Undo ``load()`` (tests: the npu namespace is empty again for the next test module)."""
    state = _STATE.pop("npu", None)
    if state is None:
        return
    for lib in state.libraries:
        lib._destroy()


def schemas_available() -> bool:
    """True when ``torch.ops.npu``'s fused ops resolve here (torch_npu works, or ``load()`` ran)."""
    from .npu import torch_npu_available

    return loaded() or torch_npu_available()


__all__ = [
    "NpuSchemaError",
    "STAND_INS",
    "TORCH_NPU_VERSION",
    "WHEEL_ENV",
    "cache_dir",
    "converters",
    "load",
    "loaded",
    "schemas",
    "schemas_available",
    "unload",
    "wheel_path",
    "wheel_text",
]
