"""Times the whole pass pipeline on tiny-width DeepseekV3 graphs of 4, 16 and 61 layers, next to
the time Dynamo + AOT tracing takes for the same graph.

    python tools/bench_passes.py                   # 4, 16, 61 layers, each in a fresh process
    python tools/bench_passes.py --layers 4 16     # fewer sizes
    python tools/bench_passes.py --json out.json   # also write the numbers

Each size runs in its own process so that "cold" is a real first compile (the moe pass traces
its patterns once per process); "warm" is the best of ``--warm`` further runs of a fresh
PassManager over a fresh copy of the same ATen graph in that process.  Prints seconds per 1,000
graph nodes, per pass too, and checks the done-when targets: pipeline time grows at most
linearly with the layer count (largest ≤ largest/smallest × smallest-time × 1.3) and stays below
the Dynamo + AOT tracing time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def measure(num_layers: int, warm_runs: int) -> dict[str, Any]:
    """One size, in this process: trace time, cold and warm pipeline times, per pass."""
    import torch
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    import torch.fx as fx

    from ascend_passes.config import AscendPassConfig
    from ascend_passes.models import deepseek_v3
    from ascend_passes.pass_manager import PassContext, PassManager, copy_graph

    config = AscendPassConfig()
    model, inputs = deepseek_v3("grouped_mm", num_layers=num_layers)
    out: dict[str, Any] = {"layers": num_layers, "passes": list(config.pipeline())}
    start: list[float] = []

    def inference_compiler(gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        out["trace_s"] = time.perf_counter() - start[0]
        out["nodes"] = len(gm.graph.nodes)
        runs = []
        for _ in range(1 + warm_runs):
            copy = fx.GraphModule(gm, copy_graph(gm.graph))
            ctx = PassContext(config, example_inputs, None, "none", "cpu")
            t0 = time.perf_counter()
            result = PassManager(config).run(copy, ctx)
            runs.append((time.perf_counter() - t0,
                         {name: r.seconds for name, r in result.passes.items()},
                         {name: r.status for name, r in result.passes.items()},
                         sum(r.num_matches for r in result.passes.values())))
        out["cold_s"], out["cold_pass_s"], out["status"], out["matches"] = runs[0]
        best = min(runs[1:], key=lambda r: r[0]) if warm_runs else runs[0]
        out["warm_s"], out["warm_pass_s"] = best[0], best[1]
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=inference_compiler, inference_compiler=inference_compiler)
    torch._dynamo.reset()
    with torch.no_grad():
        start.append(time.perf_counter())
        torch.compile(model, backend=backend)(*inputs)
    return out


def _child(num_layers: int, warm_runs: int) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, __file__, "--one", str(num_layers), "--warm", str(warm_runs)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{num_layers} layers failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def report(rows: list[dict[str, Any]]) -> list[str]:
    lines = [f"{'layers':>6} {'nodes':>6} {'dynamo+aot s':>12} {'cold s':>8} {'warm s':>8} "
             f"{'cold s/1k':>9} {'warm s/1k':>9} {'warm/trace':>10} {'rewrites':>8}"]
    for r in rows:
        k = r["nodes"] / 1000
        lines.append(f"{r['layers']:>6} {r['nodes']:>6} {r['trace_s']:>12.2f} {r['cold_s']:>8.2f} "
                     f"{r['warm_s']:>8.2f} {r['cold_s'] / k:>9.3f} {r['warm_s'] / k:>9.3f} "
                     f"{r['warm_s'] / r['trace_s']:>10.2f} {r['matches']:>8}")
    lines.append("")
    lines.append("warm seconds per 1,000 nodes, per pass:")
    passes = rows[0]["passes"]
    lines.append(f"{'layers':>6} " + " ".join(f"{p:>11}" for p in passes))
    for r in rows:
        k = r["nodes"] / 1000
        lines.append(f"{r['layers']:>6} " + " ".join(
            f"{r['warm_pass_s'].get(p, 0.0) / k:>11.4f}" for p in passes))
    bad = {p for r in rows for p, s in r["status"].items() if s != "ok"}
    if bad:
        lines.append(f"passes rolled back: {', '.join(sorted(bad))}")
    if len(rows) >= 2:
        small, big = rows[0], rows[-1]
        ratio = big["layers"] / small["layers"]
        lines.append("")
        for kind in ("warm", "cold"):
            limit = ratio * small[f"{kind}_s"] * 1.3
            ok = big[f"{kind}_s"] <= limit
            lines.append(f"linear ({kind}): {big['layers']} layers {big[f'{kind}_s']:.2f} s <= "
                         f"{ratio:.2f} x {small[f'{kind}_s']:.2f} s x 1.3 = {limit:.2f} s: "
                         f"{'yes' if ok else 'NO'}")
        for kind in ("warm", "cold"):
            ok = all(r[f"{kind}_s"] < r["trace_s"] for r in rows)
            lines.append(f"below Dynamo+AOT tracing ({kind}): {'yes' if ok else 'NO'}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 16, 61])
    parser.add_argument("--warm", type=int, default=2, help="warm runs per size (best is kept)")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(measure(args.one, args.warm)))
        return 0
    rows = []
    for n in args.layers:
        print(f"measuring {n} layers …", file=sys.stderr, flush=True)
        rows.append(_child(n, args.warm))
    print("\n".join(report(rows)))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
