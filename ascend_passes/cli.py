"""``ascend-passes``: compile bundled or user models and show what every pass did.

ascend-passes demo                      compile the bundled DeepSeek-V3-style model (+ MTP)
ascend-passes dump MODULE:FACTORY|NAME  graph before/after each pass, diffs, summary
                                        (--format html: also a report page with pictures)
ascend-passes passes                    the passes, in pipeline order
ascend-passes models                    the bundled models
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .config import AscendPassConfig
from .errors import AscendPassesError
from .report import CompileReport, capture

# The demo: the DeepSeek-V3-style target model and its MTP drafter, compiled in one process.
DEMO_MODELS = ("deepseek_v3_grouped_mm", "deepseek_v3_mtp1")


def _console() -> Any:
    import shutil

    from rich.console import Console

    # a pipe or CI log has no terminal width: use a wide default instead of rich's 80 columns
    return Console(highlight=False, width=shutil.get_terminal_size((160, 40)).columns)


# --------------------------------------------------------------------------- targets
def load_target(spec: str) -> tuple[torch.nn.Module, tuple[Any, ...]]:
    """``MODULE:FACTORY`` (a function returning ``(model, example_inputs)``) or a bundled name.

    Raises ``AscendPassesError`` (one line for the CLI) for a spec that names nothing, a factory
    that is not callable or raises, and a result that is not ``(nn.Module, tuple/list of inputs)``.
    """
    if ":" in spec:
        module_name, _, attr = spec.partition(":")
        if not module_name or not attr:
            raise AscendPassesError(
                f"target {spec!r} names no factory; give MODULE:FACTORY (e.g. my_models:build) or a bundled model name"
            )
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError, ValueError) as exc:
            raise AscendPassesError(f"cannot load factory {spec!r}: {exc}") from exc
        if not callable(factory):
            raise AscendPassesError(
                f"factory {spec!r} is not callable (type {type(factory).__name__}); "
                "give a function returning (model, example_inputs)"
            )
    else:
        from . import models

        if spec not in models.BUNDLED:
            raise AscendPassesError(
                f"unknown model {spec!r}; bundled models: {', '.join(models.BUNDLED)} (or give MODULE:FACTORY)"
            )
        factory = models.BUNDLED[spec]
    try:
        result = factory()
    except Exception as exc:  # the user's code: one line that names it (the traceback is theirs)
        raise AscendPassesError(f"factory {spec!r} raised {type(exc).__name__}: {exc}") from exc
    if not (isinstance(result, (tuple, list)) and len(result) == 2):
        got = (
            f"a {len(result)}-tuple"
            if isinstance(result, (tuple, list))
            else "None"
            if result is None
            else f"a {type(result).__name__} object"
        )
        raise AscendPassesError(
            f"factory {spec!r} returned {got}; it must return (model, example_inputs), e.g. return model, (x,)"
        )
    model, inputs = result
    if not isinstance(model, torch.nn.Module):
        raise AscendPassesError(
            f"factory {spec!r} returned a {type(model).__name__} as the model; "
            "it must return (torch.nn.Module, example_inputs)"
        )
    if not isinstance(inputs, (tuple, list)):
        raise AscendPassesError(
            f"factory {spec!r} returned a {type(inputs).__name__} as "
            "example_inputs; return a tuple of the model's inputs, e.g. (x,)"
        )
    return model, tuple(inputs)


def check_out_dir(out: Path) -> None:
    """Create ``out`` and check a file can be written in it, before anything is compiled."""
    if out.exists() and not out.is_dir():
        raise AscendPassesError(f"--out {out} is an existing file; give a folder (it is created if missing)")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as exc:
        raise AscendPassesError(
            f"--out {out} cannot be written ({exc.strerror or exc}); give a folder you can write to"
        ) from exc


@dataclass
class CompileRun:
    name: str
    reports: list[CompileReport]
    max_abs_diff: float
    output_scale: float
    compile_seconds: float


def _flat_tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        out = list(out.values())
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _flat_tensors(o)]
    return []


def _ours(exc: BaseException) -> AscendPassesError | None:
    """Our error inside the exception Dynamo wrapped it in (``BackendCompilerFailed``)."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, AscendPassesError):
            return cur
        seen.add(id(cur))
        cur = getattr(cur, "inner_exception", None) or cur.__cause__ or cur.__context__
    return None


def compile_and_compare(
    name: str,
    model: torch.nn.Module,
    inputs: Sequence[Any],
    config: AscendPassConfig,
    *,
    hooks: Sequence[Any] = (),
    pipeline: Sequence[Any] | None = None,
) -> CompileRun:
    """Compile ``model`` with ``config`` (``hooks`` see every pass; ``pipeline`` replaces the
    configured pass objects), run it once, and compare with the uncompiled model."""
    from .backend import make_backend
    from .npu import torch_npu_available
    from .passes.lower import npu_inspection_backend

    torch._dynamo.reset()
    with torch.no_grad():
        expected = _flat_tensors(model(*inputs))
        with capture() as reports:
            t0 = time.perf_counter()
            backend = make_backend(config, hooks=hooks, pipeline=pipeline)
            if config.target == "npu" and not torch_npu_available():  # lowered for inspection, run on CPU
                backend = npu_inspection_backend(config, hooks=hooks, pipeline=pipeline)
            compiled = torch.compile(model, backend=backend)
            try:
                got = _flat_tensors(compiled(*inputs))
            except Exception as exc:
                ours = _ours(exc)
                if ours is None:
                    raise
                raise ours from exc
            seconds = time.perf_counter() - t0
    diff = max(((a.double() - b.double()).abs().max().item() for a, b in zip(expected, got)), default=0.0)
    scale = max((a.double().abs().max().item() for a in expected), default=0.0)
    return CompileRun(name, list(reports), diff, scale, seconds)


# --------------------------------------------------------------------------- printing
def print_run(run: CompileRun, console: Any) -> None:
    from rich.table import Table

    for report in run.reports:
        table = Table(title=f"{run.name}: graph {report.graph_id} → {report.compiler} ({report.target})")
        for col, just in (
            ("pass", "left"),
            ("status", "left"),
            ("matches", "right"),
            ("near-misses", "right"),
            ("nodes", "right"),
            ("ms", "right"),
            ("rewrites", "left"),
        ):
            table.add_column(col, justify=just)  # type: ignore[arg-type]
        for r in report.passes.values():
            counts = ", ".join(f"{k}×{v}" for k, v in sorted(r.counts().items())) or "-"
            table.add_row(
                r.name,
                r.status,
                str(r.num_matches),
                str(len(r.near_misses)),
                f"{r.nodes_before}→{r.nodes_after}",
                f"{r.seconds * 1e3:.1f}",
                counts,
            )
        console.print(table)
        lower = report.passes.get("lower")
        if lower is not None and lower.status == "ok":
            decomposed = sum(1 for m in lower.matches if m.pattern.endswith("->aten"))
            console.print(
                f"  lowered to torch_npu: {lower.num_matches - decomposed} npu ops, {decomposed} "
                "ascend ops decomposed to ATen (outside the NPU limits: see the near-misses)"
            )
        else:
            console.print(f"  not lowered to torch_npu (target {report.target}: the ascend ops stay)")
        ops = report.rewritten_ops()
        if ops:
            console.print("  fused ops in the final graph: " + ", ".join(f"{k}×{v}" for k, v in ops.items()))
        for r in report.passes.values():
            for nm in r.near_misses:
                console.print(f"  near-miss [{r.name}] {nm.pattern} at {nm.layer or nm.node}: {nm.reason}")
            if r.error:
                console.print(f"  [{r.name}] rolled back: {r.error}")
    console.print(
        f"  {run.name}: max |compiled - eager| = {run.max_abs_diff:.3g} "
        f"(output scale {run.output_scale:.3g}); compile + first run {run.compile_seconds:.1f} s\n"
    )


# --------------------------------------------------------------------------- commands
def _config(args: argparse.Namespace, **extra: Any) -> AscendPassConfig:
    options: dict[str, Any] = {"compiler": args.compiler, **extra}
    if getattr(args, "device_target", None):
        options["target"] = args.device_target
    if getattr(args, "passes", None):
        options["passes"] = args.passes
    return AscendPassConfig.from_options(options)


def cmd_demo(args: argparse.Namespace) -> int:
    console = _console()
    config = _config(args)
    names = list(DEMO_MODELS) if not args.model else [args.model]
    console.print(f"ascend_passes demo: compiler={config.compiler}, passes={','.join(config.pipeline())}\n")
    worst = 0.0
    for name in names:
        model, inputs = load_target(name)
        hooks: list[Any] = []
        with _progress(args, list(config.pipeline()), hooks):
            run = compile_and_compare(name, model, inputs, config, hooks=hooks)
        print_run(run, console)
        worst = max(worst, run.max_abs_diff / max(run.output_scale, 1e-12))
    if worst > 1e-3:
        console.print(f"[red]outputs differ from eager (relative {worst:.3g})[/red]")
        return 1
    return 0


def load_pass(spec: str, config: AscendPassConfig) -> Any:
    """``MODULE:CLASS`` → an instance of that ``Pass`` subclass built with ``config``."""
    from .pass_manager import Pass

    module_name, _, attr = spec.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise AscendPassesError(f"cannot load pass {spec!r} (give MODULE:CLASS): {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, Pass)):
        raise AscendPassesError(f"{spec!r} is not a subclass of ascend_passes.Pass")
    return cls(config)


def _pipeline(args: argparse.Namespace, config: AscendPassConfig) -> list[Any] | None:
    extra = getattr(args, "pipeline_extra", None) or []
    if not extra:
        return None
    from .passes import build_passes

    return build_passes(config) + [load_pass(spec, config) for spec in extra]


@contextlib.contextmanager
def _progress(args: argparse.Namespace, names: Sequence[str], hooks: list[Any]) -> Iterator[None]:
    if not getattr(args, "progress", False):
        yield
        return
    from .inspect.progress import PassProgress

    with PassProgress(names) as bar:
        hooks.append(bar)
        yield


def cmd_dump(args: argparse.Namespace) -> int:
    from . import models_tp

    check_out_dir(Path(args.out))
    if args.target in models_tp.BUNDLED_TP:
        return _dump_tp(args)
    model, inputs = load_target(args.target)
    return _dump(args, model, inputs)


def _dump_tp(args: argparse.Namespace) -> int:
    """A tensor-parallel bundled model: one gloo rank per process on this machine; rank 0 dumps."""
    from . import models_tp
    from .spawn import run_on_ranks

    world_size = models_tp.BUNDLED_TP[args.target][0]
    return max(run_on_ranks(_dump_tp_rank, world_size, args, timeout_s=600.0))


def _dump_tp_rank(rank: int, world_size: int, args: argparse.Namespace) -> int:  # a spawned rank
    from . import models_tp

    _, factory, options, _ = models_tp.BUNDLED_TP[args.target]
    logging.basicConfig(
        level=logging.WARNING if rank == 0 else logging.ERROR, format=f"%(levelname)s rank{rank} %(name)s: %(message)s"
    )
    model, inputs = factory(rank, world_size)
    return _dump(args, model, inputs, rank=rank, **options)


def _dump(
    args: argparse.Namespace, model: torch.nn.Module, inputs: Sequence[Any], *, rank: int = 0, **options: Any
) -> int:
    """Compile ``model`` with the dump hooks and print / write what every pass did (only rank 0 of a TP
    run prints and writes; the other ranks compile the same graphs so that the collectives match)."""
    console = _console()
    out = Path(args.out)
    config = _config(
        args, dump_dir=str(out) if rank == 0 else None, verify_each=args.verify_each, strict=args.strict, **options
    )
    pipeline = _pipeline(args, config)
    names = [p.name for p in pipeline] if pipeline is not None else list(config.pipeline())
    hooks: list[Any] = []
    recorder = None
    if args.format == "html" and rank == 0:
        from .inspect.subgraphs import SubgraphRecorder

        recorder = SubgraphRecorder()
        hooks.append(recorder)
    with _progress(args if rank == 0 else argparse.Namespace(), names, hooks):
        run = compile_and_compare(args.target, model, inputs, config, hooks=hooks, pipeline=pipeline)
    if rank != 0:
        return 0
    print_run(run, console)
    if args.print_after_all:
        for path in sorted(out.rglob("*.after.py")):
            console.rule(str(path))
            console.print(path.read_text(), markup=False)
    console.print(f"graphs, diffs and summary written to {out}/")
    if recorder is not None:
        from .inspect.html import write_html

        page = write_html(
            out / "report.html",
            [(args.target, r) for r in run.reports],
            recorder,
            title=f"ascend_passes: {args.target}",
        )
        console.print(f"HTML report written to {page}")
    rolled_back = [
        f"{r.name} ({r.error})" for report in run.reports for r in report.passes.values() if r.status != "ok"
    ]
    if rolled_back:
        console.print("[red]rolled back: " + "; ".join(rolled_back) + "[/red]")
        return 1
    return 0


def cmd_passes(args: argparse.Namespace) -> int:
    from rich.table import Table

    from .config import DEFAULT_PIPELINE
    from .passes import pass_class

    table = Table(title="ascend_passes pipeline (default order)")
    table.add_column("#", justify="right")
    table.add_column("pass")
    table.add_column("rewrite")
    for i, name in enumerate(DEFAULT_PIPELINE, 1):
        table.add_row(str(i), name, pass_class(name).summary)
    _console().print(table)
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from rich.table import Table

    from . import models, models_tp

    table = Table(title="bundled models")
    table.add_column("name")
    table.add_column("what")
    for name in models.BUNDLED:
        table.add_row(name, models.DESCRIPTIONS.get(name, ""))
    for name, (_, _, _, what) in models_tp.BUNDLED_TP.items():
        table.add_row(name, what)
    _console().print(table)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ascend-passes", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="log INFO (-v) or DEBUG (-vv) lines of the passes"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--compiler",
            default="eager",
            choices=["eager", "inductor", "auto"],
            help="downstream compiler after the passes (default: eager)",
        )
        p.add_argument("--passes", default=None, help="pipeline, e.g. 'cleanup,norm,moe'")
        p.add_argument("--progress", action="store_true", help="show a progress bar across the passes")

    demo = sub.add_parser("demo", help="compile the bundled DeepSeek-V3-style model (+ MTP drafter)")
    common(demo)
    demo.add_argument(
        "--model",
        default=None,
        help="one bundled model instead of the demo set "
        "(`ascend-passes models` lists them, e.g. deepseek_v4_grouped_mm)",
    )
    demo.set_defaults(func=cmd_demo)

    dump = sub.add_parser("dump", help="write the graph before/after each pass, diffs and a summary")
    dump.add_argument("target", help="MODULE:FACTORY returning (model, example_inputs), or a bundled name")
    dump.add_argument("--out", default="ascend_passes_dump", help="output folder")
    dump.add_argument("--print-after-all", action="store_true", help="also print each graph after each pass")
    dump.add_argument(
        "--verify-each", action="store_true", help="run the graph after every pass and compare with the original"
    )
    dump.add_argument(
        "--strict",
        action="store_true",
        help="stop at the first failing pass (error, exit status 2) instead of rolling it back",
    )
    dump.add_argument(
        "--target",
        dest="device_target",
        choices=["auto", "cpu", "npu"],
        default=None,
        help="npu: also lower to torch_npu ops (works on CPU with the torch_npu wheel as data; "
        "the compiled model then runs the graph before lowering)",
    )
    dump.add_argument(
        "--format",
        choices=["txt", "html"],
        default="txt",
        help="txt: .py/.diff/summary.txt per graph; html: those and OUT/report.html "
        "(passes, per-layer rewrites, near-misses, before/after pictures)",
    )
    dump.add_argument(
        "--pipeline-extra",
        action="append",
        default=[],
        metavar="MODULE:CLASS",
        help="append a Pass subclass of your own to the pipeline (repeatable)",
    )
    common(dump)
    dump.set_defaults(func=cmd_dump)

    sub.add_parser("passes", help="list the passes").set_defaults(func=cmd_passes)
    sub.add_parser("models", help="list the bundled models").set_defaults(func=cmd_models)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.verbose:  # else leave the level alone: TORCH_LOGS="+ascend_passes" may have set it
        logging.getLogger("ascend_passes").setLevel(logging.INFO if args.verbose == 1 else logging.DEBUG)
    try:
        return int(args.func(args))
    except AscendPassesError as exc:
        print(f"ascend-passes: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
