"""fp32 prefill pieces of few rows (issue 18 goal 2): grouped_matmul's routes side by side.

For each m (rows per expert) at the DeepSeek-V3-medium expert shapes, up (K=1024, N=512) and down
(K=256, N=1024), HF-layout weights ([E, N, K] passed as the [E, K, N] transpose view, K contiguous), it times
in one run, round-robin, the medians of:
  * ``grouped``: ``ascend_kernels.grouped_matmul`` over E experts of m rows each (all threads, each piece
    single-threaded inside), with ``ASCEND_PASSES_GEMM`` = blas (MKL), own (kernels/gemm.cpp, packs W),
    stream (kernels/stream_gemm.cpp, no packing) and auto (the rule);
  * ``piece``: one call per expert of m rows (one thread), the same routes, the experts cycled so that
    every weight is cold, plus torch.mm on the same views (MKL, one thread);
and prints GFLOP/s and each route's ratio to blas in the same rounds, plus a dense mm's GFLOP/s
([2048, 1024] x [1024, 4096], all threads) for scale. The machine may be shared: read the ratios.

    python tools/bench_small_m.py [--rows 8,16,24,...] [--rounds 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from ascend_passes import kernels  # the C++ kernels (ASCEND_PASSES_KERNELS_LIB overrides the library)

assert kernels.available(), "the C++ kernels are not built"
K = torch.ops.ascend_kernels
E = 64
ROUTES = ("blas", "own", "stream", "auto")


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="8,16,24,32,48,64,96,128,192")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--shapes", default="up,down")
    args = parser.parse_args()
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    rows = [int(r) for r in args.rows.split(",")]
    print(f"dense fp32 mm [2048,1024]x[1024,4096]: {dense_rate(threads):.0f} GFLOP/s ({threads} threads), "
          f"{dense_rate(1):.0f} GFLOP/s (1 thread)")
    torch.set_num_threads(threads)
    print("cells: GFLOP/s (speed-up over blas in the same rounds)")
    with torch.no_grad():
        for shape in args.shapes.split(","):
            k, n = {"up": (1024, 512), "down": (256, 1024)}[shape]
            bench(shape, k, n, rows, args.rounds, threads)


if __name__ == "__main__":
    main()
