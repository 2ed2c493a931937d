"""The decode weight stream's schedules side by side (kernels/skinny.h): GB/s of cold expert weight read.

For each dtype (bf16, fp32; ``--caps`` adds the kernels of narrower CPUs, each in a child process under
``ASCEND_PASSES_ISA``: ``avx512`` = bf16 widened to fp32, the AVX-512 CPUs without AVX512_BF16; ``avx2`` = fp32 and
bf16 on 8-lane FMAs) and each m (rows per expert), ``ascend_kernels.grouped_matmul`` over the active experts of m
rows each, HF-layout weights (K contiguous), both threads, every call on the next of enough copies that it reads its
weights from memory (the copies read in between exceed twice the last-level cache; until session 25 all schedules of
a round shared one copy, so that the second and third found part of it in L3, and a 300 MB L3 held all six copies).
``--model medium`` (default): 37 of 64 experts at the DeepSeek-V3-medium expert shapes of tools/bench_model.py, up
([E, 512, 1024]) and down ([E, 1024, 256]); ``--model v3``: 4 experts at DeepSeek-V3's own (671B) shapes, up [E,
4096, 7168] and down [E, 7168, 2048], where a few rows of x no longer fit L1 (fp32 at 2 rows of K = 7168: 57 KB) —
the case of the ``chunks`` schedule; the same kernel serves ``ascend.linear``'s decode rows. Per round each schedule
runs once, alternated (``ASCEND_PASSES_DECODE_SCHEDULE``, read per call): ``row`` (one weight row at a time,
kAheadBytes prefetched ahead), ``chunks`` (the kernel's own stream — row, or blocks for the bf16 kernels without
AVX512_BF16 — and x beyond 24 KB in chunks of K that stay in L1, the weight in blocks of rows prefetched into L2;
session 27, the default), ``blocks`` (blocks of 3-4 weight rows, each row prefetched kAheadBytes ahead), ``v23``
(session 23's blocks, the next block prefetched) and ``v28`` (session 28's row: one-row pieces prefetched too,
which row leaves to the hardware prefetcher since session 29); the table prints the medians, each against row
(kernels/skinny.h).
Same bits either way (tests/test_decode_stream.py). The machine may be shared and its memory speed drifts: read the
ratios.

    python tools/bench_decode_stream.py [--model medium|v3] [--rows 1,2,3,4,5,6,8] [--rounds 30] [--caps avx512,avx2]

"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import _allocator  # tools/_allocator.py: this script's folder is on sys.path
import torch
from _machine import cold_copy_count, cpu_features_line, cpu_vendor, last_level_cache_bytes
from rich.console import Console
from rich.table import Table

from ascend_passes import kernels

# --model: (experts, active experts, {weight: (N, K)})
MODELS = {
    "medium": (64, 37, {"up": (512, 1024), "down": (1024, 256)}),
    "v3": (4, 4, {"up": (4096, 7168), "down": (7168, 2048)}),
}
SCHEDULES = ("row", "chunks", "blocks", "v23", "v28")
# --caps: the dtypes worth timing under each ASCEND_PASSES_ISA cap (fp32 under avx512 is the default's kernel)
CAPPED = {
    "avx512": (("bf16-widened", torch.bfloat16),),
    "avx2": (("fp32-avx2", torch.float32), ("bf16-avx2", torch.bfloat16)),
}


def measure(model: str, dtype: torch.dtype, rows: list[int], rounds: int) -> list[tuple]:
    """(shape, m, GB/s of each of SCHEDULES) for each shape and m."""
    ops = torch.ops.ascend_kernels
    E, ACTIVE, shapes = MODELS[model]
    out = []
    for shape, (n, k) in shapes.items():
        # enough copies that the others' bytes read between two uses of one copy exceed the last-level cache
        # twice over (a 16-core VM's 300 MB L3 holds six copies of these experts), and each call of a round
        # (one per schedule) on a copy of its own
        read = ACTIVE * n * k * torch.empty((), dtype=dtype).element_size()
        copies = cold_copy_count(read, at_least=len(SCHEDULES) + 1)
        weights = [torch.randn(E, n, k).to(dtype).transpose(1, 2) for _ in range(copies)]
        calls = 0
        for m in rows:
            counts = torch.zeros(E, dtype=torch.long)
            counts[torch.randperm(E)[:ACTIVE]] = m
            x = torch.randn(int(counts.sum()), k).to(dtype)
            times: dict[str, list[float]] = {s: [] for s in SCHEDULES}
            for r in range(rounds + 4):
                for schedule in SCHEDULES:
                    os.environ["ASCEND_PASSES_DECODE_SCHEDULE"] = schedule
                    w = weights[calls % copies]
                    calls += 1
                    t0 = time.perf_counter()
                    ops.grouped_matmul([x], [w], group_list=counts, group_type=0, group_list_type=1)
                    if r >= 4:  # the first rounds warm the code and the allocator
                        times[schedule].append(time.perf_counter() - t0)
            os.environ.pop("ASCEND_PASSES_DECODE_SCHEDULE", None)
            out.append((shape, m, *(read / statistics.median(times[s]) / 1e9 for s in SCHEDULES)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="medium", help="expert shapes (docstring)")
    parser.add_argument("--rows", default="1,2,3,4,5,6,8", help="rows per expert (comma-separated)")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--caps", default="", help="ASCEND_PASSES_ISA caps to time too: avx512 and/or avx2")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)  # a cap: print rows, no table
    args = parser.parse_args()
    if not kernels.available():
        sys.exit("bench_decode_stream: the C++ kernels are not built (tools/setup.sh builds them)")
    rows = [int(v) for v in args.rows.split(",")]
    torch.manual_seed(0)
    if args.child:
        for label, dtype in CAPPED[args.child]:
            for shape, m, *rates in measure(args.model, dtype, rows, args.rounds):
                print(f"ROW {label} {shape} {m} " + " ".join(str(r) for r in rates), flush=True)
        return
    caps = [c for c in args.caps.split(",") if c]
    if any(c not in CAPPED for c in caps):
        sys.exit(f"bench_decode_stream: --caps takes {', '.join(CAPPED)}, got {args.caps!r}")
    allocator = _allocator.ensure("tcmalloc")
    console = Console(width=132)
    console.print(
        f"{cpu_features_line()}; {torch.get_num_threads()} threads; allocator {allocator}; vendor {cpu_vendor()}; "
        f"last-level cache {last_level_cache_bytes() / 2**20:.0f} MiB"
    )
    results = []
    for label, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        results += [(label, *r) for r in measure(args.model, dtype, rows, args.rounds)]
        console.print(f"  {label} done", highlight=False)
    for cap in caps:
        env = dict(os.environ, ASCEND_PASSES_ISA=cap)
        cmd = [sys.executable, __file__, "--child", cap, "--model", args.model, "--rows", args.rows]
        cmd += ["--rounds", str(args.rounds)]
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        for line in run.stdout.splitlines():
            if line.startswith("ROW "):
                label, shape, m, *rates = line.split()[1:]
                results.append((label, shape, int(m), *(float(r) for r in rates)))
    table = Table(
        title=f"decode weight stream ({args.model}): GB/s of cold expert weight, medians of alternated rounds "
        "(the default: chunks)",
        width=132,
    )
    others = SCHEDULES[1:]
    cols = ("dtype", "weight", "m", *SCHEDULES, *(f"{s} / row" for s in others))
    for col in cols:
        table.add_column(col, justify="right" if col not in ("dtype", "weight") else "left")
    shapes = MODELS[args.model][2]
    for label, shape, m, row, *rest in results:
        n, k = shapes[shape]
        table.add_row(
            label,
            f"{shape} [E,{n},{k}]",
            str(m),
            *(f"{r:.1f}" for r in (row, *rest)),
            *(f"{r / row:.2f}x" for r in rest),
        )
    console.print(table)


if __name__ == "__main__":
    main()
