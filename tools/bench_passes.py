"""Times the whole pass pipeline on tiny-width DeepseekV3 graphs of 4, 16 and 61 layers, next to
the time Dynamo + AOT tracing takes for the same graph (issue 18, goal 4: the pipeline costs at
most 10% of tracing, warm and cold, and grows linearly with the node count).

    python tools/bench_passes.py                   # 4, 16, 61 layers, each in a fresh process
    python tools/bench_passes.py --layers 4 16     # fewer sizes
    python tools/bench_passes.py --json out.json   # also write the numbers
    python tools/bench_passes.py --dynamic         # dynamic=True compiles (symbolic sizes, as vLLM's)
    python tools/bench_passes.py --profile 61      # cProfile of one warm pipeline run, top functions
    python tools/bench_passes.py --profile 61 --profile-out p.prof   # ... also saved for pstats
    python tools/bench_passes.py --profile 4 --profile-run first   # ... of the first run of a process
                                                   # (cold with an empty ASCEND_PASSES_PATTERN_CACHE_DIR,
                                                   # disk with a filled one)

Each size runs in its own process so that "cold" is a real first compile, what a user's first
compile is: the search functions' traces loaded from the patterns shipped with the package
(``tools/gen_patterns.py``), an empty on-disk pattern cache (a fresh temporary
``ASCEND_PASSES_PATTERN_CACHE_DIR``), so the re-traces on the match's shapes and the replacement
graphs are made; "cold, unshipped" is the same with ``ASCEND_PASSES_SHIPPED_PATTERNS=0`` (every
pattern traced: the cold of sessions before 9); then a second process compiles the same model with
the cache the cold one wrote ("disk": the first compile of a process on a machine that has
compiled before, nothing traced); "warm" is the best of ``--warm`` further runs of a fresh
PassManager over a fresh copy of the same ATen graph in the first process (a second compile).
Times are CPU seconds of the process (``time.process_time``: the machine may be shared; wall
seconds are in the JSON), Dynamo + AOT tracing included.  Prints both ratios
to tracing, seconds per 1,000 graph nodes (per pass too, from the pass manager's own timing)
and the targets: pipeline time grows at most linearly with the node count (largest ≤
largest/smallest × smallest-time × 1.3) and stays ≤ 10% of the Dynamo + AOT tracing time.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def measure(
    num_layers: int, warm_runs: int, profile: str | None = None, dynamic: bool = False, profile_out: str | None = None
) -> dict[str, Any]:
    """One size, in this process: trace time, cold and warm pipeline times, per pass (the
    pass manager's CPU seconds per pass); with ``profile`` ("first": the process's first
    pipeline run, cold or disk as the cache directory makes it; "warm": the last run), a
    cProfile of that run goes to stderr (and to the file ``profile_out``, for ``pstats``)."""
    import torch
    import torch.fx as fx
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    from ascend_passes.config import AscendPassConfig
    from ascend_passes.models import deepseek_v3
    from ascend_passes.pass_manager import PassContext, PassManager, copy_graph

    config = AscendPassConfig()
    model, inputs = deepseek_v3("grouped_mm", num_layers=num_layers)
    # what the first compile of a process also pays, outside the pipeline timing below: importing
    # the passes (torch._inductor.pattern_matcher and its lowering module among them)
    i0 = time.process_time()
    from ascend_passes.passes import _pattern, build_passes

    build_passes(config)
    out: dict[str, Any] = {
        "layers": num_layers,
        "passes": list(config.pipeline()),
        "import_s": time.process_time() - i0,
    }
    start: list[float] = []

    def inference_compiler(gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        out["trace_s"] = time.process_time() - start[0]
        out["trace_wall_s"] = time.perf_counter() - start[1]
        out["nodes"] = len(gm.graph.nodes)
        runs = []
        for i in range(1 + warm_runs):
            copy = fx.GraphModule(gm, copy_graph(gm.graph))
            ctx = PassContext(config, example_inputs, None, "none", "cpu")
            profiled = (profile == "first" and i == 0) or (profile == "warm" and i == warm_runs)
            profiler = cProfile.Profile(time.process_time) if profiled else None
            t0, w0 = time.process_time(), time.perf_counter()
            if profiler is not None:
                profiler.enable()
            result = PassManager(config).run(copy, ctx)
            if profiler is not None:
                profiler.disable()
                if profile_out:
                    profiler.dump_stats(profile_out)
                stats = pstats.Stats(profiler, stream=sys.stderr)
                stats.sort_stats("cumulative").print_stats(60)
                stats.sort_stats("tottime").print_stats(30)
            runs.append(
                (
                    time.process_time() - t0,
                    time.perf_counter() - w0,
                    {name: r.cpu_seconds for name, r in result.passes.items()},
                    {name: r.status for name, r in result.passes.items()},
                    sum(r.num_matches for r in result.passes.values()),
                )
            )
            if i == 0:
                # this process's pattern preparation as of its first compile: the warm runs trace and
                # load nothing, but count the searches they skip again (``absent_anchor`` is per run)
                out["pattern_stats"] = dict(_pattern.STATS)
        out["cold_s"], out["cold_wall_s"], out["cold_pass_s"], out["status"], out["matches"] = runs[0]
        best = min(runs[1:], key=lambda r: r[0]) if warm_runs else runs[0]
        out["warm_s"], out["warm_wall_s"], out["warm_pass_s"] = best[0], best[1], best[2]
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=inference_compiler, inference_compiler=inference_compiler)
    torch._dynamo.reset()
    with torch.no_grad():
        start.extend((time.process_time(), time.perf_counter()))
        torch.compile(model, backend=backend, dynamic=dynamic)(*inputs)
    return out


def _child(
    num_layers: int, warm_runs: int, cache_dir: str, shipped: bool = True, dynamic: bool = False
) -> dict[str, Any]:
    env = {**os.environ, "ASCEND_PASSES_PATTERN_CACHE_DIR": cache_dir}
    env.pop("ASCEND_PASSES_PATTERN_CACHE", None)
    env["ASCEND_PASSES_SHIPPED_PATTERNS"] = "1" if shipped else "0"
    proc = subprocess.run(
        [sys.executable, __file__, "--one", str(num_layers), "--warm", str(warm_runs), *(["--dynamic"] * dynamic)],
        capture_output=True,
        text=True,
        env=env,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{num_layers} layers failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


TARGET = 0.10  # issue 18 goal 4: pipeline / (Dynamo + AOT tracing)


def precompile() -> str:
    """Byte-compile the package's modules in place, as ``pip install`` does for an installed package
    (torch and transformers come with theirs): a pass module first imported during a compile is then
    read from its ``.pyc``, not compiled from source.  Without it an editable install run under
    ``PYTHONDONTWRITEBYTECODE`` (or on a read-only tree) compiles every lazily imported pass module
    in each process and counts that in "cold" and "disk".  Returns the line the report prints."""
    import compileall
    import importlib

    for package in ("passes", "patterns", "ops", "inspect", "eplb"):  # where the pipeline's modules live
        importlib.import_module(f"ascend_passes.{package}")

    dirs = sorted(
        {
            str(Path(p))
            for name, m in sys.modules.items()
            if name.split(".")[0] == "ascend_passes"
            for p in getattr(m, "__path__", ())
        }
    )
    ok = all(compileall.compile_dir(d, quiet=1, maxlevels=0) for d in dirs)
    return (
        f"bytecode: the package's modules byte-compiled before the runs, as pip install does "
        f"({len(dirs)} directories{'' if ok else ', some failed'}; PYTHONDONTWRITEBYTECODE="
        f"{os.environ.get('PYTHONDONTWRITEBYTECODE', 'unset')})"
    )


def report(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "CPU seconds (time.process_time); ratios are pipeline / Dynamo+AOT tracing of the same process;",
        "cold: first compile of a process, shipped patterns, empty pattern cache; unshipped: the same with",
        "ASCEND_PASSES_SHIPPED_PATTERNS=0 (every pattern traced); disk: first compile of a second process,",
        "patterns loaded from the on-disk cache the cold one wrote; warm: a further compile in the first process",
        "",
        (
            f"{'layers':>6} {'nodes':>6} {'dynamo+aot s':>12} {'unship s':>8} {'cold s':>8} {'disk s':>8} "
            f"{'warm s':>8} {'unship/tr':>9} {'cold/trace':>10} {'disk/trace':>10} {'warm/trace':>10} "
            f"{'cold s/1k':>9} {'disk s/1k':>9} {'warm s/1k':>9} {'rewrites':>8}"
        ),
    ]
    nan = float("nan")
    for r in rows:
        k = r["nodes"] / 1000
        disk = r.get("disk_s", nan)
        unshipped = r.get("unshipped_s", nan)
        lines.append(
            f"{r['layers']:>6} {r['nodes']:>6} {r['trace_s']:>12.2f} {unshipped:>8.2f} {r['cold_s']:>8.2f} "
            f"{disk:>8.2f} {r['warm_s']:>8.2f} {unshipped / r.get('unshipped_trace_s', 1.0):>9.3f} "
            f"{r['cold_s'] / r['trace_s']:>10.3f} {disk / r.get('disk_trace_s', 1.0):>10.3f} "
            f"{r['warm_s'] / r['trace_s']:>10.3f} {r['cold_s'] / k:>9.3f} {disk / k:>9.3f} "
            f"{r['warm_s'] / k:>9.3f} {r['matches']:>8}"
        )
    for r in rows:
        for kind, stats in (("unshipped", "unshipped_stats"), ("cold", "pattern_stats"), ("disk", "disk_stats")):
            if stats not in r:
                continue
            s = r[stats]
            lines.append(
                f"patterns at {r['layers']} layers, {kind}: traced {s.get('traced', 0)} searches, "
                f"{s.get('specific_traced', 0)} shape re-traces, {s.get('replacement_traced', 0)} replacement graphs; "
                f"loaded {s.get('shipped_hits', 0)} shipped, {s.get('disk_hits', 0)} + {s.get('specific_hits', 0)} + "
                f"{s.get('replacement_hits', 0)} from disk; {s.get('absent_anchor', 0)} searches skipped (anchors)"
            )
    lines.append(
        "importing the passes (torch._inductor.pattern_matcher included; once per process, not in the "
        "times above): " + ", ".join(f"{r.get('import_s', float('nan')):.2f} s" for r in rows)
    )
    passes = [p for p in rows[0]["passes"] if any(p in r["warm_pass_s"] for r in rows)]
    for kind in ("warm", "disk", "cold"):
        if not all(f"{kind}_pass_s" in r for r in rows):
            continue
        lines.append("")
        lines.append(f"{kind} CPU milliseconds per pass (the pass manager's timing) and per 1,000 nodes:")
        lines.append(f"{'layers':>6} " + " ".join(f"{p[:11]:>11}" for p in passes))
        for r in rows:
            lines.append(
                f"{r['layers']:>6} " + " ".join(f"{r[f'{kind}_pass_s'].get(p, 0.0) * 1e3:>11.1f}" for p in passes)
            )
        for r in rows:
            k = r["nodes"] / 1000
            lines.append(
                f"{'/1k':>6} " + " ".join(f"{r[f'{kind}_pass_s'].get(p, 0.0) * 1e3 / k:>11.1f}" for p in passes)
            )
    for r in rows:
        for kind in ("disk", "unshipped"):
            if r.get(f"{kind}_matches", r["matches"]) != r["matches"]:
                lines.append(
                    f"REWRITES DIFFER at {r['layers']} layers: cold {r['matches']}, {kind} {r[f'{kind}_matches']}"
                )
    bad = {p for r in rows for p, s in r["status"].items() if s != "ok"}
    if bad:
        lines.append(f"passes rolled back: {', '.join(sorted(bad))}")
    lines.append("")
    if len(rows) >= 2:
        small, big = rows[0], rows[-1]
        ratio = big["nodes"] / small["nodes"]
        for kind in ("warm", "disk", "cold"):
            if not all(f"{kind}_s" in r for r in (small, big)):
                continue
            limit = ratio * small[f"{kind}_s"] * 1.3
            ok = big[f"{kind}_s"] <= limit
            lines.append(
                f"linear in nodes ({kind}): {big['nodes']} nodes {big[f'{kind}_s']:.2f} s <= "
                f"{ratio:.2f} x {small[f'{kind}_s']:.2f} s x 1.3 = {limit:.2f} s: "
                f"{'yes' if ok else 'NO'}"
            )
    for kind in ("warm", "disk", "cold", "unshipped"):
        if not all(f"{kind}_s" in r for r in rows):
            continue
        trace = f"{kind}_trace_s" if kind in ("disk", "unshipped") else "trace_s"
        worst = max(r[f"{kind}_s"] / r[trace] for r in rows)
        lines.append(
            f"pipeline <= {TARGET:.0%} of Dynamo+AOT tracing ({kind}): worst {worst:.1%}: "
            f"{'yes' if worst <= TARGET else 'NO'}"
        )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 16, 61])
    parser.add_argument("--warm", type=int, default=2, help="warm runs per size (best is kept)")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.add_argument(
        "--profile",
        type=int,
        default=None,
        metavar="LAYERS",
        help="cProfile one warm pipeline run at this many layers (to stderr)",
    )
    parser.add_argument(
        "--profile-run",
        choices=("warm", "first"),
        default="warm",
        help="which run --profile profiles: the last warm one, or the process's first (cold / disk)",
    )
    parser.add_argument("--profile-out", default=None, metavar="FILE", help="also save --profile's stats (pstats)")
    parser.add_argument(
        "--dynamic",
        action="store_true",
        help="compile with dynamic=True (symbolic sizes, as vLLM's piecewise graphs): every column then "
        "re-traces, once per compile, the matches whose form no shipped size-generic trace covers (symbols key "
        "no cache across compiles)",
    )
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(measure(args.one, args.warm, dynamic=args.dynamic)))
        return 0
    if args.profile is not None:
        row = measure(
            args.profile,
            max(args.warm, 1),
            profile=args.profile_run,
            dynamic=args.dynamic,
            profile_out=args.profile_out,
        )
        print("\n".join(report([row])))
        return 0
    bytecode = precompile()
    rows = []
    for n in args.layers:
        print(f"measuring {n} layers …", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory(prefix="bench_passes_patterns_") as cache:
            row = _child(n, args.warm, cache, dynamic=args.dynamic)  # shipped patterns, empty cache: cold, warm
            disk = _child(n, 0, cache, dynamic=args.dynamic)  # a second process: the rest from the disk cache
        with tempfile.TemporaryDirectory(prefix="bench_passes_patterns_") as cache:
            unshipped = _child(n, 0, cache, shipped=False, dynamic=args.dynamic)  # every pattern traced
        for name, child in (("unshipped", unshipped), ("disk", disk)):  # each a first compile of its process
            row.update(
                {
                    f"{name}_s": child["cold_s"],
                    f"{name}_wall_s": child["cold_wall_s"],
                    f"{name}_pass_s": child["cold_pass_s"],
                    f"{name}_trace_s": child["trace_s"],
                    f"{name}_stats": child["pattern_stats"],
                    f"{name}_matches": child["matches"],
                }
            )
        rows.append(row)
    print("\n".join(report(rows)))
    print(bytecode)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
