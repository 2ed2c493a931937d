"""ascend_passes inside vLLM: a post-grad pass vLLM accepts as its own, a ``CompilerInterface`` for
vLLM's piecewise backend, and a CPU platform plugin that routes vLLM's compile through it.

Importing this module does not import vLLM: the vLLM classes (``AscendCompiler``,
``AscendCpuPlatform``) are built on first access, the way vLLM resolves them by qualified name.

Three routes (README, "Serving with vLLM"):

1. ``compilation_config={"mode": 2, "backend": "ascend_passes"}`` — the Dynamo backend
   (``backend.py``); under vLLM's ahead-of-time compile it runs inside Inductor's ``compile_fx``.
2. ``compilation_config={"mode": 2, "inductor_passes": {"post_grad_custom_post_pass":
   "ascend_passes.vllm_pass"}}`` — ``VllmPostGradPass``: vLLM resolves the string to this object
   and, once the ``vllm.general_plugins`` entry point registered the class as a virtual subclass of
   vLLM's ``InductorPass``, uses its config-aware ``uuid()`` instead of wrapping it in
   ``CallableInductorPass`` (whose uuid hashes the class source: two configs, one cache entry).
3. ``ASCEND_PASSES_VLLM=1`` + ``compilation_config={"mode": 3}`` (vLLM's default mode) — the
   platform plugin ``AscendCpuPlatform`` keeps VLLM_COMPILE (vLLM's CPU platform turns it into
   mode 2) and names ``AscendCompiler`` as the compile backend: vLLM splits the graph at the
   attention ops and compiles every piece through it (Inductor's standalone compile with the
   passes in vLLM's post-grad pass manager); its artifacts load after a restart without compiling.

The config of routes 2 (the string form) and 3 comes from ``LLM(additional_config={"ascend_passes":
{...options...}})`` for route 3 and from the ``ASCEND_PASSES_OPTIONS`` environment variable (JSON)
for ``ascend_passes.vllm_pass``; both enter the cache keys.

On Ascend, vllm-ascend is the platform: its ``AscendCompiler`` (a ``CompilerInterface`` compiling
with torchair / npugraph_ex) would call ``ascend_passes.backend.run_pipeline`` on each piece before
its downstream compile (what ``AscendCompiler.compile`` here does through Inductor's post-grad
hook), and its ``GraphFusionPassManager`` (which asserts ``VllmInductorPass``) takes
``VllmPostGradPass`` as one more pass: its ``uuid()`` and ``is_applicable_for_range`` are the
interface that manager calls.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
from collections.abc import Iterable
from typing import Any

import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from .config import AscendPassConfig
from .errors import ConfigError

log = logging.getLogger("ascend_passes.vllm")

ENABLE_ENV = "ASCEND_PASSES_VLLM"  # "1": the platform plugin routes vLLM's compile through us
OPTIONS_ENV = "ASCEND_PASSES_OPTIONS"  # JSON options of the string-named ``ascend_passes.vllm_pass``
ADDITIONAL_CONFIG_KEY = "ascend_passes"  # LLM(additional_config={"ascend_passes": {...}})

# what AscendCompiler did in this process: artifacts compiled, artifacts loaded by their cache handle
# (tests and tools read it: a warm start compiles nothing)
STATS: dict[str, int] = {"compiles": 0, "loads": 0}


# --------------------------------------------------------------------------- the post-grad pass
class VllmPostGradPass(CustomGraphPass):
    """The pipeline as a post-grad pass for vLLM (``inductor_passes`` in mode 2, or one pass of
    vLLM's ``PostGradPassManager`` in mode 3).

    ``uuid()`` carries the config (and the pass code), so two configs never share a cache entry and
    equal configs give equal uuids in any process.  ``compile_ranges`` — ``[(first, last), ...]``
    token counts, both ends included — limits the pass to vLLM compile ranges inside one of them
    (``is_applicable_for_range``, which vLLM's pass manager calls per piece); None: every range.
    """

    def __init__(
        self,
        config: AscendPassConfig | dict[str, Any] | None = None,
        *,
        compile_ranges: Iterable[tuple[int, int]] | None = None,
        **options: Any,
    ) -> None:
        self.config = AscendPassConfig.from_options(config, **options)
        if compile_ranges is not None:
            ranges = tuple((int(lo), int(hi)) for lo, hi in compile_ranges)
            for lo, hi in ranges:
                if lo > hi:
                    raise ConfigError(
                        f"compile_ranges: ({lo}, {hi}) is empty; give (first, last) token counts with first <= last"
                    )
            self.compile_ranges: tuple[tuple[int, int], ...] | None = ranges
        else:
            self.compile_ranges = None
        self._inner: Any = None
        register_with_vllm(only_if_loaded=True)

    @property
    def inner(self) -> Any:
        """The ``AscendInductorPass`` doing the work (built on first use: its uuid reads the passes'
        sources, too slow for ``import ascend_passes``)."""
        if self._inner is None:
            from .backend import AscendInductorPass

            self._inner = AscendInductorPass(self.config)
        return self._inner

    def __call__(self, graph: fx.Graph) -> None:
        self.inner(graph)

    def uuid(self) -> str:
        h = hashlib.sha256(self.inner.uuid().encode())
        h.update(repr(self.compile_ranges).encode())
        return h.hexdigest()

    def is_applicable_for_range(self, compile_range: Any) -> bool:
        """vLLM's ``InductorPass`` hook: whether this pass runs for ``compile_range`` (a vLLM
        ``Range`` with ``start``/``end``, both included)."""
        if self.compile_ranges is None:
            return True
        return any(lo <= compile_range.start and compile_range.end <= hi for lo, hi in self.compile_ranges)

    def __repr__(self) -> str:
        return f"VllmPostGradPass(passes={','.join(self.config.pipeline())!r}, ranges={self.compile_ranges})"


def post_grad_pass(
    config: AscendPassConfig | dict[str, Any] | None = None,
    *,
    compile_ranges: Iterable[tuple[int, int]] | None = None,
    **options: Any,
) -> VllmPostGradPass:
    """A ``VllmPostGradPass`` for ``compilation_config={"inductor_passes":
    {"post_grad_custom_post_pass": <it>}}`` (vLLM takes the object itself, or a string naming a
    top-level attribute of a package)."""
    return VllmPostGradPass(config, compile_ranges=compile_ranges, **options)


class _LazyEnvPass(VllmPostGradPass):
    """``ascend_passes.vllm_pass``: a ``VllmPostGradPass`` whose options are read from
    ``ASCEND_PASSES_OPTIONS`` (JSON) on first use, so the package can create it at import."""

    def __init__(self) -> None:  # noqa: D107  (no config read yet)
        self._config: AscendPassConfig | None = None
        self.compile_ranges = None
        self._inner = None

    @property  # type: ignore[override]
    def config(self) -> AscendPassConfig:
        if self._config is None:
            from .backend import _env_options

            self._config = AscendPassConfig.from_options(_env_options() or {})
        return self._config


def default_pass() -> VllmPostGradPass:
    """The object behind ``ascend_passes.vllm_pass``."""
    return _LazyEnvPass()


# --------------------------------------------------------------------------- vLLM registration
def register_with_vllm(only_if_loaded: bool = False) -> None:
    """Make vLLM treat ``VllmPostGradPass`` as one of its ``InductorPass``es (a virtual subclass:
    vLLM then uses our ``uuid()``/``is_applicable_for_range`` instead of wrapping the pass).
    Changes nothing else in vLLM.  ``only_if_loaded``: do it only when vLLM is already imported."""
    name = "vllm.compilation.passes.inductor_pass"
    if only_if_loaded and name not in sys.modules:
        return
    try:
        from vllm.compilation.passes.inductor_pass import InductorPass
    except ImportError:  # vLLM absent or another layout: nothing to register with
        return
    if not issubclass(VllmPostGradPass, InductorPass):
        InductorPass.register(VllmPostGradPass)


def general_plugin() -> None:
    """``vllm.general_plugins`` entry point, loaded by vLLM in every process: registers the ascend
    ops (a cached compiled artifact calls them) and ``VllmPostGradPass`` as an ``InductorPass``.
    Neither changes what vLLM does unless a config names ascend_passes."""
    import ascend_passes.ops  # noqa: F401  (registers torch.ops.ascend.*, which artifacts call)

    register_with_vllm()


def platform_plugin() -> str | None:
    """``vllm.platform_plugins`` entry point: ``AscendCpuPlatform`` when ``ASCEND_PASSES_VLLM=1``
    and vLLM would run on its CPU platform; None otherwise (vLLM picks its platform as usual)."""
    if os.environ.get(ENABLE_ENV, "0").lower() not in ("1", "true", "yes"):
        return None
    from .npu import torch_npu_available

    if torch_npu_available():
        log.warning(
            "%s=1 is ignored on an Ascend NPU: vllm-ascend is the platform there "
            "(its AscendCompiler can run ascend_passes.backend.run_pipeline)",
            ENABLE_ENV,
        )
        return None
    from vllm.platforms import cpu_platform_plugin

    if cpu_platform_plugin() is None:
        log.warning("%s=1 is ignored: vLLM does not run on its CPU platform here", ENABLE_ENV)
        return None
    return "ascend_passes.vllm.AscendCpuPlatform"


def config_from_vllm(vllm_config: Any) -> AscendPassConfig:
    """The ascend_passes config of a vLLM run: ``additional_config["ascend_passes"]`` (options as
    for ``torch.compile(options=...)``), defaults otherwise."""
    extra = getattr(vllm_config, "additional_config", None)
    options = extra.get(ADDITIONAL_CONFIG_KEY) if isinstance(extra, dict) else None
    if options is not None and not isinstance(options, dict):
        raise ConfigError(
            f"additional_config[{ADDITIONAL_CONFIG_KEY!r}] must be a dict of ascend_passes "
            f"options, got {type(options).__name__}"
        )
    return AscendPassConfig.from_options(options or {})


# --------------------------------------------------------------------------- vLLM classes (lazy)
@functools.cache
def _compiler_class() -> type:
    from vllm.compilation.compiler_interface import InductorStandaloneAdaptor
    from vllm.config.vllm import get_current_vllm_config_or_none

    from .backend import resolve_compiler
    from .report import graph_id

    class AscendCompiler(InductorStandaloneAdaptor):
        """vLLM ``CompilerInterface`` of the piecewise backend: each piece runs the ascend_passes
        pipeline as a post-grad pass of Inductor's standalone compile, and Inductor's artifact is
        the cache handle (``load`` works after a restart; under vLLM's mega AOT artifact the pieces
        are stored in it).  One report per piece, named ``<prefix>.piece<i>.range<start>-<end>``."""

        name = "ascend_passes"

        def __init__(self) -> None:
            vllm_config = get_current_vllm_config_or_none()  # vLLM sets it; None outside an engine
            save_format = (
                vllm_config.compilation_config.compile_cache_save_format if vllm_config is not None else "binary"
            )
            super().__init__(save_format)
            self._use(config_from_vllm(vllm_config))
            self.prefix = ""

        def _use(self, config: AscendPassConfig) -> None:
            compiler = resolve_compiler(config, "cpu" if config.target == "auto" else config.target)
            if compiler != "inductor":
                raise ConfigError(
                    f"vLLM's piecewise route compiles each piece with Inductor; compiler={compiler!r} "
                    "is not available there: use compiler='inductor' (or 'auto'), or the mode-2 route "
                    "(compilation_config={'mode': 2, 'backend': 'ascend_passes'})"
                )
            self.config = config
            self.post_grad = VllmPostGradPass(config)

        def compute_hash(self, vllm_config: Any) -> str:
            self._use(config_from_vllm(vllm_config))
            text = super().compute_hash(vllm_config) + self.post_grad.uuid()
            return hashlib.sha256(text.encode()).hexdigest()[:10]

        def initialize_cache(self, cache_dir: str, disable_cache: bool = False, prefix: str = "") -> None:
            super().initialize_cache(cache_dir, disable_cache, prefix)
            self.prefix = prefix

        def _with_pass(self, compiler_config: dict[str, Any]) -> dict[str, Any]:
            from vllm.platforms import current_platform

            key = current_platform.pass_key
            manager = (compiler_config or {}).get(key)
            if manager is None:
                return {**(compiler_config or {}), key: self.post_grad}
            passes = getattr(manager, "passes", None)
            if not hasattr(manager, "add") or passes is None:
                raise ConfigError(
                    f"Inductor's {key} is {type(manager).__name__}, not a vLLM pass "
                    "manager: ascend_passes cannot add its pass to it"
                )
            if not any(isinstance(p, VllmPostGradPass) for p in passes):
                register_with_vllm()
                manager.add(self.post_grad)
            return compiler_config

        def compile(
            self,
            graph: fx.GraphModule,
            example_inputs: list[Any],
            compiler_config: dict[str, Any],
            compile_range: Any,
            key: str | None = None,
        ) -> tuple[Any, Any]:
            from . import inductor_fixes

            inductor_fixes.install()  # Inductor bugs that give wrong results on these graphs
            piece = (key or "").rpartition("_subgraph_")[2] or str(STATS["compiles"])
            name = f"{self.prefix or 'model'}.piece{piece}.range{compile_range.start}-{compile_range.end}"
            with graph_id(name):
                # vLLM stops a compile whose piece equals one it already has (a BaseException
                # through here): only an artifact made counts
                out = super().compile(graph, example_inputs, self._with_pass(compiler_config), compile_range, key)
            STATS["compiles"] += 1
            return out

        def load(
            self, handle: Any, graph: fx.GraphModule, example_inputs: list[Any], graph_index: int, compile_range: Any
        ) -> Any:
            STATS["loads"] += 1
            return super().load(handle, graph, example_inputs, graph_index, compile_range)

    AscendCompiler.__module__, AscendCompiler.__qualname__ = __name__, "AscendCompiler"
    return AscendCompiler


@functools.cache
def _platform_class() -> type:
    from vllm.platforms.cpu import CpuPlatform  # (vllm.config imports the platform: no config import here)

    class AscendCpuPlatform(CpuPlatform):
        """vLLM's CPU platform, except that VLLM_COMPILE (mode 3, piecewise) stays on and compiles
        every piece through ``AscendCompiler`` (vLLM's CPU platform turns mode 3 into mode 2)."""

        @classmethod
        def get_compile_backend(cls) -> str:
            return "ascend_passes.vllm.AscendCompiler"

        @classmethod
        def get_pass_manager_cls(cls) -> str:
            return "ascend_passes.vllm.AscendPostGradPassManager"

        @classmethod
        def check_and_update_config(cls, vllm_config: Any) -> None:
            from vllm.config import CompilationMode

            cc = vllm_config.compilation_config
            piecewise = cc.mode == CompilationMode.VLLM_COMPILE
            backend = cc.backend
            super().check_and_update_config(vllm_config)
            if piecewise and cc.mode == CompilationMode.DYNAMO_TRACE_ONCE:
                cc.mode = CompilationMode.VLLM_COMPILE
                cc.backend = backend or cls.get_compile_backend()
                if cc.compile_sizes is None:  # the piecewise backend looks ranges up only in a list
                    cc.compile_sizes = []
                log.info("ascend_passes platform: piecewise compile (mode 3) through %s", cc.backend)

    AscendCpuPlatform.__module__, AscendCpuPlatform.__qualname__ = __name__, "AscendCpuPlatform"
    return AscendCpuPlatform


@functools.cache
def _pass_manager_class() -> type:
    from vllm.compilation.passes.pass_manager import PostGradPassManager

    class _NoDefunctionalization:
        """Stands in for vLLM's ``FixFunctionalizationPass`` on CPU: that pass compares every
        ``auto_functionalized`` op with CUDA-only ``torch.ops._C`` kernels absent from the CPU build
        (AttributeError ``fused_add_rms_norm_static_fp8_quant``).  Leaving the nodes functional is
        correct: Inductor decomposes and re-inplaces ``auto_functionalized`` itself, as in mode 2."""

        def __call__(self, graph: fx.Graph) -> None:
            return None

        def uuid(self) -> str:
            return "ascend_passes.vllm:no-defunctionalization-on-cpu"

    class AscendPostGradPassManager(PostGradPassManager):
        """vLLM's post-grad pass manager on the CPU platform: vLLM's passes, then the ascend_passes
        pipeline (``VllmPostGradPass``, config from ``additional_config``), then vLLM's cleanups."""

        def configure(self, config: Any) -> None:
            super().configure(config)
            self.fix_functionalization = _NoDefunctionalization()
            register_with_vllm()
            self.add(VllmPostGradPass(config_from_vllm(config)))

    AscendPostGradPassManager.__module__ = __name__
    AscendPostGradPassManager.__qualname__ = "AscendPostGradPassManager"
    return AscendPostGradPassManager


def __getattr__(name: str) -> Any:
    if name == "AscendPostGradPassManager":
        return _pass_manager_class()
    if name == "AscendCompiler":
        return _compiler_class()
    if name == "AscendCpuPlatform":
        return _platform_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ADDITIONAL_CONFIG_KEY",
    "ENABLE_ENV",
    "OPTIONS_ENV",
    "STATS",
    "VllmPostGradPass",
    "config_from_vllm",
    "default_pass",
    "general_plugin",
    "platform_plugin",
    "post_grad_pass",
    "register_with_vllm",
]
