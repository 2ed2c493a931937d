"""fp32 prefill pieces of few rows (issue 18 goal 2): grouped_matmul's routes side by side.

For each m (rows per expert) at the DeepSeek-V3-medium expert shapes, up (K=1024, N=512) and down
(K=256, N=1024), HF-layout weights ([E, N, K] passed as the [E, K, N] transpose view, K contiguous), it times
in one run, round-robin, the medians of:
  * ``grouped``: ``ascend_kernels.grouped_matmul`` over E experts of m rows each (all threads, each piece
    single-threaded inside), with ``ASCEND_PASSES_GEMM`` = blas (MKL), own (kernels/gemm.cpp, packs W),
    stream (kernels/stream_gemm.cpp, no packing), swap (kernels/swap_gemm.cpp, x^T packed, W read in place)
    and auto (the rule);
  * ``piece``: one call per expert of m rows (one thread), the same routes, the experts cycled so that
    every weight is cold, plus torch.mm on the same views (MKL, one thread);
and prints GFLOP/s and each route's ratio to blas in the same rounds, plus a dense mm's GFLOP/s
([2048, 1024] x [1024, 4096], all threads) for scale. The machine may be shared: read the ratios.

``--model TOKENS``: instead, the expert matmuls of tools/bench_model.py's DeepSeek-V3 model at a prefill of
TOKENS (its routers' real, skewed counts per expert, read by hooks on the gates of one eager forward; up
and down projection of each MoE layer), all threads, per route plus ``old`` (the rule before stream_gemm:
own for K <= 512, blas above), as process CPU time and the fraction of the dense mm's CPU-time rate.
With ``--dtype bfloat16`` (``--model`` only) the routes are ``ASCEND_PASSES_BF16_KERNEL`` = onednn, dot
(kernels/gemm.cpp's vdpbf16ps GEMM), swap (swap_gemm.cpp's vdpbf16ps form) and the rule, against a dense
bf16 mm (on a CPU with AMX the rule takes the AMX kernels, which none of the forced ones is).

    python tools/bench_small_m.py [--rows 8,16,24,...] [--rounds 7]
    python tools/bench_small_m.py --model 256 --rounds 15
    python tools/bench_small_m.py --model 256 --rounds 15 --dtype bfloat16
    python tools/bench_small_m.py --linear --rows 9,16,32,64,96,128
    python tools/bench_small_m.py --linear --cold --rows 4,7,8,9,16

``--linear``: ``ascend.linear`` of m rows on [N, K] weights (4096 x 1024, 512 x 1024, 1024 x 256), fp32 and
bf16, all threads, best of --rounds x 10 calls (ms): the route before session 14 (fp32: the packing GEMM,
ASCEND_PASSES_GEMM=own; bf16: ASCEND_PASSES_BF16_KERNEL=onednn; at 8 rows or fewer the weight stream), the
swap kernel forced, and the rule. ``--cold`` rotates copies of each weight past the cache (a decode forward
reads every weight from memory once).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from ascend_passes import kernels  # the C++ kernels (ASCEND_PASSES_KERNELS_LIB overrides the library)

assert kernels.available(), "the C++ kernels are not built"
K = torch.ops.ascend_kernels
E = 64
ROUTES = ("blas", "own", "stream", "swap", "auto")
# --model --dtype bfloat16: ASCEND_PASSES_BF16_KERNEL's kernels ("" is the rule)
BF16_ROUTES = ("onednn", "dot", "swap", "")


def timed(fn, calls: int, clock=time.perf_counter) -> float:
    t0 = clock()
    for _ in range(calls):
        fn()
    return (clock() - t0) / calls


def with_route(route: str, fn):
    def run():
        os.environ["ASCEND_PASSES_GEMM"] = route
        return fn()

    return run


def dense_rate(threads: int) -> float:
    torch.set_num_threads(threads)
    a, b = torch.randn(2048, 1024), torch.randn(1024, 4096)
    torch.mm(a, b)
    t = min(timed(lambda: torch.mm(a, b), 3) for _ in range(3))
    return 2 * 2048 * 1024 * 4096 / t / 1e9


def bench(name: str, k: int, n: int, rows: list[int], rounds: int, threads: int) -> None:
    w = (torch.randn(E, n, k) / k**0.5).transpose(1, 2)  # [E, K, N] view of HF's [E, N, K]
    print(f"\n{name}: K={k} N={n}, E={E} HF-layout experts ({E * n * k * 4 / 2**20:.0f} MB of fp32 weights)")
    print(f"{'m':>4} {'kind':>7} " + " ".join(f"{r:>14}" for r in ROUTES + ("torch.mm",)))
    for m in rows:
        x = torch.randn(E * m, k)
        group_list = torch.full((E,), m, dtype=torch.long)
        xs = [x[g * m : (g + 1) * m] for g in range(E)]
        flops = 2 * E * m * k * n
        variants = {}
        for route in ROUTES:
            variants[("grouped", route)] = with_route(
                route, lambda: K.grouped_matmul([x], [w], group_list=group_list, group_type=0, group_list_type=1)
            )

            def pieces():
                for g in range(E):
                    K.grouped_matmul([xs[g]], [w[g]])

            variants[("piece", route)] = with_route(route, pieces)

        def mm_pieces():
            for g in range(E):
                torch.mm(xs[g], w[g])

        variants[("piece", "torch.mm")] = mm_pieces
        times: dict = {key: [] for key in variants}
        for _ in range(rounds):
            for key, fn in variants.items():
                # CPU time (the machine may be shared): of this thread for pieces, of the process for grouped
                torch.set_num_threads(threads if key[0] == "grouped" else 1)
                times[key].append(timed(fn, 1, time.process_time if key[0] == "grouped" else time.thread_time))
        os.environ.pop("ASCEND_PASSES_GEMM", None)
        torch.set_num_threads(threads)
        for kind in ("grouped", "piece"):
            base = statistics.median(times[(kind, "blas")])
            cells = []
            for route in ROUTES + ("torch.mm",):
                if (kind, route) not in times:
                    cells.append(f"{'':>14}")
                    continue
                t = statistics.median(times[(kind, route)])
                cells.append(f"{flops / t / 1e9:6.1f} ({base / t:4.2f}x)")
            print(f"{m:>4} {kind:>7} " + " ".join(cells), flush=True)


def routed_counts(tokens: int) -> list[torch.Tensor]:
    """Tokens per expert of each MoE layer of bench_model's DeepSeek-V3 model at a 1 x tokens prefill."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_model

    factory, config, _ = bench_model.MODELS["deepseek_v3"]
    model, (ids,) = factory("grouped_mm", num_layers=4, tokens=tokens, batch=1, dtype=torch.float32, **config)
    counts = []
    for name, module in model.named_modules():
        if name.endswith("mlp.gate"):  # returns (router logits, top-k weights, top-k expert ids)
            module.register_forward_hook(lambda m, i, o: counts.append(torch.bincount(o[2].flatten(), minlength=E)))
    with torch.no_grad():
        model(ids)
    return counts


def bench_model_experts(tokens: int, rounds: int, dtype: torch.dtype = torch.float32) -> None:
    counts = routed_counts(tokens)
    calls, flops = [], 0
    for c in counts:
        print(
            f"layer counts: min {int(c.min())} median {int(c.median())} max {int(c.max())}, "
            f"{int((c > 8).sum())} experts above 8 rows, {int((c > 48).sum())} above 48"
        )
        for n, k in ((512, 1024), (1024, 256)):  # up (gate + up), down
            w = (torch.randn(E, n, k) / k**0.5).to(dtype).transpose(1, 2)
            calls.append((torch.randn(int(c.sum()), k).to(dtype), w, c))
            flops += 2 * int(c.sum()) * k * n
    bf16 = dtype == torch.bfloat16
    routes = BF16_ROUTES if bf16 else ("old",) + ROUTES
    variable = "ASCEND_PASSES_BF16_KERNEL" if bf16 else "ASCEND_PASSES_GEMM"
    times: dict = {r: [] for r in routes}
    with torch.no_grad():
        for _ in range(rounds):
            for r in routes:
                t0 = time.process_time()
                for x, w, c in calls:
                    old = "own" if w.shape[1] <= 512 else "blas"
                    os.environ[variable] = old if r == "old" else r
                    K.grouped_matmul([x], [w], group_list=c, group_type=0, group_list_type=1)
                times[r].append(time.process_time() - t0)
    os.environ.pop(variable, None)
    a, b = torch.randn(2048, 1024).to(dtype), torch.randn(1024, 4096).to(dtype)
    torch.mm(a, b)
    dense = 2 * 2048 * 1024 * 4096 / min(timed(lambda: torch.mm(a, b), 3, time.process_time) for _ in range(3))
    print(
        f"1x{tokens} prefill, {dtype}: {flops / 1e9:.2f} GFLOP of expert matmuls; "
        f"dense mm {dense / 1e9:.0f} GFLOP per CPU-second"
    )
    base = statistics.median(times[routes[0]])
    for r in routes:
        t = statistics.median(times[r])
        print(
            f"  {r or 'rule':6s} {t * 1e3:8.1f} ms CPU ({base / t:4.2f}x {routes[0]})  "
            f"{flops / t / dense:4.0%} of the dense mm rate"
        )


def bench_linear(rows: list[int], rounds: int, cold: bool) -> None:
    def best(fn) -> float:
        fn()
        return min(timed(fn, 10) for _ in range(rounds))

    for dtype, variable, before in (
        (torch.float32, "ASCEND_PASSES_GEMM", "own"),
        (torch.bfloat16, "ASCEND_PASSES_BF16_KERNEL", "onednn"),
    ):
        print(
            f"\nlinear {dtype}: ms per call, {before} (the route before; at <= 8 rows the stream) / swap / the rule"
            + (" (weights rotated past the cache)" if cold else "")
        )
        for n, k in ((4096, 1024), (512, 1024), (1024, 256)):
            # --cold: as many copies of the weight as fill 256 MB, one per call, as a forward reads each weight once
            copies = max(2, (256 << 20) // (n * k * dtype.itemsize)) if cold else 1
            ws = [torch.randn(n, k).to(dtype) for _ in range(copies)]
            cells = []
            for m in rows:
                x = torch.randn(m, k).to(dtype)
                t = {}
                first = "stream" if m <= 8 else before
                for route in (first, "swap", ""):
                    os.environ[variable] = route
                    turn = itertools.count()
                    t[route] = best(lambda: K.linear(x, ws[next(turn) % copies], None))
                os.environ.pop(variable, None)
                cells.append(f"m={m} {1e3 * t[first]:.3f}/{1e3 * t['swap']:.3f}/{1e3 * t['']:.3f}")
            print(f"  [m,{k}]x[{n},{k}]^T: " + "  ".join(cells), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="8,16,24,32,48,64,96,128,192")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--shapes", default="up,down")
    parser.add_argument("--model", type=int, default=0, metavar="TOKENS")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="--model only")
    parser.add_argument("--linear", action="store_true", help="ascend.linear's routes instead")
    parser.add_argument("--cold", action="store_true", help="--linear: a weight read from memory in every call")
    args = parser.parse_args()
    if args.linear:
        with torch.no_grad():
            bench_linear([int(r) for r in args.rows.split(",")], args.rounds, args.cold)
        return
    if args.dtype != "float32" and not args.model:
        parser.error("--dtype bfloat16 needs --model TOKENS")
    if args.model:
        torch.manual_seed(0)
        bench_model_experts(args.model, args.rounds, getattr(torch, args.dtype))
        return
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    rows = [int(r) for r in args.rows.split(",")]
    print(
        f"dense fp32 mm [2048,1024]x[1024,4096]: {dense_rate(threads):.0f} GFLOP/s ({threads} threads), "
        f"{dense_rate(1):.0f} GFLOP/s (1 thread)"
    )
    torch.set_num_threads(threads)
    print("cells: GFLOP/s (speed-up over blas in the same rounds)")
    with torch.no_grad():
        for shape in args.shapes.split(","):
            k, n = {"up": (1024, 512), "down": (256, 1024)}[shape]
            bench(shape, k, n, rows, args.rounds, threads)


if __name__ == "__main__":
    main()
