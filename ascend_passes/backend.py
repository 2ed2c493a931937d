"""The ``torch.compile`` backend: Dynamo graph → AOT ATen inference graph → pass pipeline →
downstream compiler (eager, Inductor, or torchair / npugraph_ex on Ascend NPUs).

Also the two entry points serving engines import: ``make_backend(config)`` and
``inductor_pass(config)`` (an Inductor ``CustomGraphPass`` with a cache-stable ``uuid()``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from . import inductor_fixes
from .allocator import warn_if_glibc
from .config import AscendPassConfig
from .errors import ConfigError
from .inspect.trace import trace_pass_graphs
from .npu import torch_npu_available
from .pass_manager import Pass, PassContext, PassHook, PassManager
from .report import CompileReport, compiling_graph, publish
from .weights import record_execution_weights

log = logging.getLogger("ascend_passes.backend")

Compiled = Callable[[list[Any]], Any]


# --------------------------------------------------------------------------- environment
def resolve_target(config: AscendPassConfig, example_inputs: Sequence[Any]) -> str:
    """``target="auto"``: npu where torch_npu works, else the device of the example inputs."""
    if config.target != "auto":
        if config.target == "npu" and not torch_npu_available():
            raise ConfigError(
                "target='npu' needs torch_npu with the CANN toolkit (import torch_npu failed); "
                "use target='cpu' or 'auto' here"
            )
        return config.target
    if torch_npu_available():
        return "npu"
    for x in example_inputs:
        if isinstance(x, torch.Tensor) and x.device.type == "cuda":
            return "cuda"
    return "cpu"


def resolve_compiler(config: AscendPassConfig, target: str) -> str:
    """``compiler="auto"``: torchair on NPU, else Inductor."""
    compiler = config.compiler
    if compiler == "auto":
        return "torchair" if target == "npu" else "inductor"
    if compiler in ("torchair", "npugraph_ex") and target != "npu":
        raise ConfigError(
            f"compiler={compiler!r} runs only on Ascend NPUs (target 'npu', torch_npu importable); "
            f"this compile targets {target!r}: use compiler='inductor' or 'eager'"
        )
    return compiler


# --------------------------------------------------------------------------- downstream
def _boxed(fn: Callable[..., Any]) -> Compiled:
    def call(args: list[Any]) -> Any:
        return fn(*args)

    call._boxed_call = True  # type: ignore[attr-defined]
    return call


def compile_downstream(
    compiler: str, gm: fx.GraphModule, example_inputs: Sequence[Any], *, decompose: Sequence[str] = ()
) -> Compiled:
    """Hand the rewritten ATen graph to the downstream compiler; returns a boxed callable.

    ``decompose`` names ascend ops that Inductor receives as their ATen decomposition (added to
    its own table) instead of opaque calls; other compilers ignore it.
    """
    if compiler == "eager":
        return _boxed(gm)
    if compiler == "inductor":
        from torch._inductor.compile_fx import compile_fx

        inductor_fixes.install()
        with _symbolic_inputs_kept(gm, example_inputs):
            return _compile_inductor(compile_fx, gm, example_inputs, decompose)
    if compiler in ("torchair", "npugraph_ex"):
        _ensure_lowered(gm)
    if compiler == "torchair":
        import torch_npu  # noqa: F401  (registers the NPU device, torch.ops.npu and torchair)
        import torchair

        cfg = torchair.CompilerConfig()
        cfg.mode = "max-autotune"  # GE graph mode: every op needs a GE converter (the npu.* ops have them)
        # the graph is already AOT-traced ATen: hand it to the compiler that
        # torchair.get_npu_backend(compiler_config=cfg) runs after its own AOT step
        return _boxed(torchair.get_compiler(compiler_config=cfg)(gm, list(example_inputs)))
    if compiler == "npugraph_ex":
        import torch_npu  # noqa: F401

        return _boxed(torch.npu.npugraph_ex.compile_fx(gm, list(example_inputs)))
    raise ConfigError(f"unknown compiler {compiler!r}")


def _compile_inductor(
    compile_fx: Callable[..., Any], gm: fx.GraphModule, example_inputs: Sequence[Any], decompose: Sequence[str]
) -> Compiled:
    if not decompose:
        return _boxed(compile_fx(gm, list(example_inputs)))
    from torch._inductor.decomposition import select_decomp_table

    from .ops import decompositions

    table = {**select_decomp_table(), **decompositions(decompose)}
    # AOTAutograd's cache keys on the graph handed in (ascend ops and all), not on the
    # decomposition table, so it would hand back a graph compiled with other decompositions;
    # Inductor's own FX-graph cache keys on the decomposed graph and stays on
    with torch._functorch.config.patch(enable_autograd_cache=False):
        return _boxed(compile_fx(gm, list(example_inputs), decompositions=table))


@contextlib.contextmanager
def _symbolic_inputs_kept(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Iterator[None]:
    """Inductor's ``compile_fx`` under ``cpp_wrapper`` (torch 2.13) takes a graph's example inputs from
    its placeholders' ``meta["val"]`` when they have one, as it does for an exported graph, and puts
    ``None`` where that value is not a tensor; Dynamo's graphs carry no ``val`` there, ours (AOT-traced
    ATen) do. Under dynamic shapes the symbolic token count is such an input: AOTAutograd then traced
    ``arange(None)`` and the recompile for a second prompt length failed. Hidden while Inductor
    compiles, the values it reads are the example inputs AOTAutograd handed us, SymInts included."""
    import torch._inductor.config as inductor_config

    hide = (
        inductor_config.cpp_wrapper
        and not inductor_config.fx_wrapper
        and any(not isinstance(x, torch.Tensor) for x in example_inputs)
    )
    hidden = {}
    if hide:
        for node in gm.graph.find_nodes(op="placeholder"):
            if "val" in node.meta:
                hidden[node] = node.meta.pop("val")
    try:
        yield
    finally:
        for node, val in hidden.items():
            node.meta["val"] = val


def _ensure_lowered(gm: fx.GraphModule) -> None:
    """The NPU compilers know torch.ops.npu.*, not ascend.*: lower what the pipeline left (the
    ``lower`` pass normally ran last; this covers a pipeline without it)."""
    if not any(n.op == "call_function" and getattr(n.target, "namespace", None) == "ascend" for n in gm.graph.nodes):
        return
    from .passes.lower import LowerPass

    cfg = AscendPassConfig()
    log.info("the graph still holds ascend ops: lowering them to torch_npu ops before the NPU compiler")
    LowerPass(cfg).run(gm, PassContext(cfg, target="npu"))


# --------------------------------------------------------------------------- pipeline
def _real_inputs_for(aten_inputs: Sequence[Any], real: Sequence[Any] | None) -> list[Any] | None:
    """The Dynamo-level real inputs when they line up one to one with the ATen placeholders."""
    if real is None or len(real) != len(aten_inputs):
        return None
    for fake, value in zip(aten_inputs, real):
        if isinstance(fake, torch.Tensor):
            if not isinstance(value, torch.Tensor) or fake.dim() != value.dim():
                return None
            if fake.dtype != value.dtype:
                return None
        elif isinstance(value, torch.Tensor):
            return None
    return list(real)


def run_pipeline(
    config: AscendPassConfig,
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    real_inputs: Sequence[Any] | None = None,
    target: str = "cpu",
    compiler: str = "eager",
    decompositions: str = "none",
    hooks: Sequence[PassHook] = (),
    pipeline: Sequence[Pass] | None = None,
) -> CompileReport:
    """Run the configured passes (or the ``pipeline`` pass objects) over ``gm`` in place and
    publish a ``CompileReport``."""
    manager = PassManager(config, pipeline)
    ctx = PassContext(config, example_inputs, real_inputs, decompositions, target)
    all_hooks = [trace_pass_graphs, *hooks]  # TORCH_TRACE artifacts (a no-op when unset)
    with compiling_graph() as gid:  # distinct in this process: reports and dump folders never collide
        if config.dump_dir:
            from .inspect.dump import GraphDumper

            all_hooks.append(GraphDumper(config.dump_dir, graph_name=gid))
        result = manager.run(gm, ctx, all_hooks)
    # mark the parameters the rewritten graph reads through fused kernels (weights.prepare/restore)
    ctx.facts["execution_weights"] = record_execution_weights(gm, ctx.real_inputs)
    report = CompileReport(
        graph_id=gid,
        passes=result.passes,
        graph=gm,
        compiler=compiler,
        target=target,
        config_hash=config.hash(),
        seconds=result.seconds,
        verified=result.verified,
        facts=ctx.facts,
    )
    log.info(
        "ascend_passes: graph %s, %d passes, %d rewrites in %.1f ms -> %s",
        report.graph_id,
        len(report.passes),
        report.num_matches,
        report.seconds * 1e3,
        compiler,
    )
    if target == "cpu" and report.rewritten_ops():
        warn_if_glibc()  # once per process: the fused kernels' large outputs fault in again under glibc
    publish(report)
    return report


def make_backend(
    config: AscendPassConfig | dict[str, Any] | None = None,
    *,
    pipeline: Sequence[Pass] | None = None,
    hooks: Sequence[PassHook] = (),
    **options: Any,
) -> Callable[[fx.GraphModule, list[Any]], Compiled]:
    """A Dynamo backend running ``config``'s pipeline: ``torch.compile(m, backend=make_backend(cfg))``.

    ``pipeline`` replaces the configured passes with pass objects of your own (for example a
    serving engine's extra pass); ``hooks`` see the graph before and after every pass.
    """
    cfg = AscendPassConfig.from_options(config, **options)
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    def backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Compiled:
        target = resolve_target(cfg, example_inputs)
        compiler = resolve_compiler(cfg, target)
        dynamo_inputs = list(example_inputs)
        if _aot_precompiling():
            return _precompile_with_inductor(
                cfg, gm, example_inputs, target=target, compiler=compiler, hooks=hooks, pipeline=pipeline
            )

        def inference_compiler(aten_gm: fx.GraphModule, aten_inputs: list[Any]) -> Compiled:
            real = _real_inputs_for(aten_inputs, dynamo_inputs)
            report = run_pipeline(
                cfg,
                aten_gm,
                aten_inputs,
                real_inputs=real,
                target=target,
                compiler=compiler,
                hooks=hooks,
                pipeline=pipeline,
            )
            compiled = compile_downstream(compiler, aten_gm, aten_inputs, decompose=cfg.decompose_ops())
            if report.facts.get("eplb_layers"):  # reads EPLB tables: runs under the forward lock
                from .eplb.sync import guarded

                compiled = guarded(compiled)
            return compiled

        def training_compiler(aten_gm: fx.GraphModule, aten_inputs: list[Any]) -> Compiled:
            log.warning(
                "ascend_passes rewrites inference graphs only; this graph needs autograd, so it "
                "runs without rewrites. Call the model under torch.no_grad() or "
                "torch.inference_mode() to get the fused kernels."
            )
            return make_boxed_func(aten_gm.forward)

        def backward_compiler(aten_gm: fx.GraphModule, aten_inputs: list[Any]) -> Compiled:
            return make_boxed_func(aten_gm.forward)

        return aot_autograd(
            fw_compiler=training_compiler, bw_compiler=backward_compiler, inference_compiler=inference_compiler
        )(gm, example_inputs)

    backend.config = cfg  # type: ignore[attr-defined]
    return backend


def _aot_precompiling() -> bool:
    """True inside torch's ahead-of-time compile (``torch.compile(...).aot_compile(...)``, which
    vLLM uses by default on torch >= 2.10): AOTAutograd then bundles the compiled forward into a
    serializable artifact and needs an Inductor ``OutputCode`` from the compiler, not a function."""
    from torch._functorch._aot_autograd.autograd_cache import should_bundle_autograd_cache

    return should_bundle_autograd_cache()


def _precompile_with_inductor(
    cfg: AscendPassConfig,
    gm: fx.GraphModule,
    example_inputs: list[Any],
    *,
    target: str,
    compiler: str,
    hooks: Sequence[PassHook],
    pipeline: Sequence[Pass] | None,
) -> Any:
    """The ahead-of-time route: Inductor's own ``compile_fx`` (its AOTAutograd, decompositions and
    bundled, serializable output code) with the pipeline run on the inference graph between
    AOTAutograd and Inductor's lowering (``inner_compile``).  Inductor's FX-graph cache keys on
    the rewritten graph, so a cached artifact always holds the rewrites of its config."""
    if compiler != "inductor":
        raise ConfigError(
            "ahead-of-time compile (torch.compile(...).aot_compile, vLLM's default on torch >= 2.10) "
            f"stores Inductor's compiled code; compiler={compiler!r} produces a Python callable it "
            "cannot store: use compiler='inductor', or switch the ahead-of-time compile off "
            "(VLLM_USE_AOT_COMPILE=0 for vLLM)"
        )
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    inductor_fixes.install()
    dynamo_inputs = list(example_inputs)

    def inner_compile(aten_gm: fx.GraphModule, aten_inputs: Sequence[Any], **kwargs: Any) -> Any:
        if kwargs.get("is_inference") and not kwargs.get("is_backward"):
            real = _real_inputs_for(aten_inputs, dynamo_inputs)
            report = run_pipeline(
                cfg,
                aten_gm,
                aten_inputs,
                real_inputs=real,
                target=target,
                compiler=compiler,
                decompositions="inductor",
                hooks=hooks,
                pipeline=pipeline,
            )
            _refresh_eager_input_vals(aten_gm.graph)
            if report.facts.get("eplb_layers"):
                raise ConfigError(
                    "EPLB graphs run under a forward lock that an ahead-of-time compiled artifact "
                    "cannot carry: switch the ahead-of-time compile off (VLLM_USE_AOT_COMPILE=0 for "
                    "vLLM) or disable eplb"
                )
        elif not kwargs.get("is_backward"):
            log.warning(
                "ascend_passes rewrites inference graphs only; this graph needs autograd, so it "
                "runs without rewrites. Call the model under torch.no_grad() or "
                "torch.inference_mode() to get the fused kernels."
            )
        return compile_fx_inner(aten_gm, aten_inputs, **kwargs)

    log.info("ahead-of-time compile: the passes run inside Inductor's compile_fx (inner_compile)")
    return compile_fx(gm, example_inputs, inner_compile=inner_compile)


def ascend_passes_backend(
    gm: fx.GraphModule, example_inputs: list[Any], options: dict[str, Any] | None = None
) -> Compiled:
    """The ``backend="ascend_passes"`` entry point (``torch_dynamo_backends`` group).

    Without ``options`` (an engine that names the backend by string, e.g. vLLM's
    ``compilation_config={"backend": "ascend_passes"}``), the options come from the
    ``ASCEND_PASSES_OPTIONS`` environment variable (a JSON object), else the defaults."""
    if options is None:
        options = _env_options()
    return make_backend(options)(gm, example_inputs)


def _env_options() -> dict[str, Any] | None:
    import json
    import os

    text = os.environ.get("ASCEND_PASSES_OPTIONS", "")
    if not text:
        return None
    try:
        options = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(
            "ASCEND_PASSES_OPTIONS must be a JSON object of ascend_passes options "
            f'(e.g. \'{{"passes": "cleanup,norm"}}\'): {e}'
        ) from None
    if not isinstance(options, dict):
        raise ConfigError(
            f"ASCEND_PASSES_OPTIONS must be a JSON object of ascend_passes options, got {type(options).__name__}"
        )
    return options


# --------------------------------------------------------------------------- Inductor pass
class AscendInductorPass(CustomGraphPass):
    """Runs the pipeline as an Inductor post-grad pass::

        torch._inductor.config.post_grad_custom_post_pass = ascend_passes.inductor_pass(cfg)

    ``uuid()`` depends only on the config and the passes' code, so it is equal across processes
    for equal configs and Inductor's FX graph cache keeps working.
    """

    def __init__(self, config: AscendPassConfig) -> None:
        self.config = config
        self._uuid = PassManager(config).uuid()
        inductor_fixes.install()

    def __call__(self, graph: fx.Graph) -> None:
        # again here: an instance unpickled in another process (vLLM's engine core) skipped
        # __init__, and Inductor schedules this graph in this process right after the pass
        inductor_fixes.install()
        gm = graph.owning_module
        if gm is None:
            gm = fx.GraphModule(torch.nn.Module(), graph)
        inputs = [n.meta.get("val") for n in graph.nodes if n.op == "placeholder"]
        target = "cpu" if self.config.target == "auto" else self.config.target
        run_pipeline(self.config, gm, inputs, target=target, compiler="inductor", decompositions="inductor")
        _refresh_eager_input_vals(graph)

    def uuid(self) -> str:
        return self._uuid


def _refresh_eager_input_vals(graph: fx.Graph) -> None:
    """Inductor lowers an op with exact stride needs (our ``ascend.*`` ops) by forcing its inputs
    to the strides in ``meta["eager_input_vals"]``, recorded when the replacement was traced; a
    pass that re-wires such a node (sequence parallelism feeds a norm the 2-D reduce-scattered
    shard instead of the 3-D activation) leaves those stale and the lowering fails.  Record the
    inputs' current values instead, as Inductor's own pattern replacement does."""

    def current(arg: Any) -> Any:
        return arg.meta.get("val") if isinstance(arg, fx.Node) else None

    for node in graph.nodes:
        if "eager_input_vals" in node.meta:
            node.meta["eager_input_vals"] = fx.node.map_aggregate((node.args, node.kwargs), current)


def inductor_pass(config: AscendPassConfig | dict[str, Any] | None = None, **options: Any) -> AscendInductorPass:
    """An Inductor ``CustomGraphPass`` running ``config``'s pipeline (for
    ``post_grad_custom_post_pass``)."""
    return AscendInductorPass(AscendPassConfig.from_options(config, **options))
