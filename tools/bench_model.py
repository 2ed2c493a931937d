"""End-to-end benchmark: a DeepSeek-V3-style model under eager, Inductor and ascend_passes.

Config (issue "MoE, RMSNorm and SwiGLU rewrites"): H=1024, moe_intermediate=256, 64 routed experts,
top-6, 4 layers (1 dense), n_group=8, topk_group=4, q_lora_rank=256, kv_lora_rank=128, one shared
expert; experts via Hugging Face ``grouped_mm``.  Shapes: prefill 1×256 and 1×1024 tokens, decode
8×1; float32 and bfloat16.  Columns: eager, ``torch.compile`` (Inductor), ascend_passes with
``compiler="eager"`` and with ``compiler="inductor"`` — median time per forward, the ratio
against eager and against Inductor, and the compile time (first call).  All in one run.

    python tools/bench_model.py                 # everything (several minutes on 2 cores)
    python tools/bench_model.py --quick         # fp32 only, fewer repetitions
    python tools/bench_model.py --shapes decode --dtypes float32 --variants eager,ascend_eager
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import _allocator  # tools/_allocator.py: this script's folder is on sys.path
import torch

import ascend_passes as ap
from ascend_passes import models

CONFIG = dict(
    hidden_size=1024, intermediate_size=2048, moe_intermediate_size=256, n_routed_experts=64,
    num_experts_per_tok=6, n_group=8, topk_group=4, q_lora_rank=256, kv_lora_rank=128,
    num_attention_heads=8, num_key_value_heads=8, qk_nope_head_dim=64, qk_rope_head_dim=32,
    v_head_dim=64, vocab_size=4096, first_k_dense_replace=1, n_shared_experts=1,
)
SHAPES = {"prefill256": (1, 256), "prefill1024": (1, 1024), "decode": (8, 1)}
VARIANTS = ("eager", "inductor", "ascend_eager", "ascend_inductor")


@dataclass
class Row:
    shape: str
    dtype: str
    variant: str
    median_ms: float
    compile_s: float
    rewrites: str = ""


def _compiled(model: torch.nn.Module, variant: str) -> Callable[..., Any]:
    if variant == "eager":
        return model
    if variant == "inductor":
        return torch.compile(model)
    compiler = variant.split("_", 1)[1]
    return torch.compile(model, backend="ascend_passes", options={"compiler": compiler})


def _time(fn: Callable[[], Any], reps: int, budget_s: float) -> float:
    times = []
    start = time.perf_counter()
    while len(times) < reps or (time.perf_counter() - start < budget_s and len(times) < 4 * reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def bench(shapes: list[str], dtypes: list[str], variants: list[str], reps: int, budget_s: float) -> list[Row]:
    rows: list[Row] = []
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        for shape in shapes:
            batch, tokens = SHAPES[shape]
            model, (ids,) = models.deepseek_v3("grouped_mm", num_layers=4, tokens=tokens, batch=batch,
                                               dtype=dtype, **CONFIG)
            reference = None
            for variant in variants:
                torch._dynamo.reset()
                fn = _compiled(model, variant)
                with torch.no_grad(), ap.capture() as reports:
                    t0 = time.perf_counter()
                    out = fn(ids)
                    compile_s = time.perf_counter() - t0
                    if reference is None:
                        reference = out
                    err = ((out.float() - reference.float()).abs().max() / reference.float().abs().max()).item()
                    ms = _time(lambda: fn(ids), reps, budget_s)
                rewrites = ""
                if reports:
                    ops = reports[0].rewritten_ops()
                    rewrites = f"{sum(ops.values())} fused ops, rel err {err:.1e}"
                rows.append(Row(shape, dtype_name, variant, ms, compile_s if variant != "eager" else 0.0,
                                rewrites))
                print(f"  {shape:12s} {dtype_name:9s} {variant:16s} {ms:9.2f} ms  compile {compile_s:6.1f} s  {rewrites}",
                      flush=True)
    return rows


def print_table(rows: list[Row]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="DeepSeek-V3-style model (4 layers, H=1024, 64 experts top-6): median ms per forward")
    for col in ("shape", "dtype", "variant", "ms", "vs eager", "vs inductor", "compile s", "notes"):
        table.add_column(col, justify="right" if col in ("ms", "vs eager", "vs inductor", "compile s") else "left")
    base = {(r.shape, r.dtype, r.variant): r.median_ms for r in rows}
    for r in rows:
        eager = base.get((r.shape, r.dtype, "eager"))
        inductor = base.get((r.shape, r.dtype, "inductor"))
        table.add_row(r.shape, r.dtype, r.variant, f"{r.median_ms:.2f}",
                      f"{eager / r.median_ms:.2f}x" if eager else "-",
                      f"{inductor / r.median_ms:.2f}x" if inductor else "-",
                      f"{r.compile_s:.1f}", r.rewrites)
    Console(width=160).print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--budget", type=float, default=3.0, help="seconds of timing per cell")
    parser.add_argument("--quick", action="store_true", help="float32 only, 5 repetitions")
    parser.add_argument("--allocator", choices=_allocator.CHOICES, default="tcmalloc",
                        help="memory allocator of the run (default: TCMalloc when installed; see tools/_allocator.py)")
    args = parser.parse_args()
    allocator = _allocator.ensure(args.allocator)
    dtypes = ["float32"] if args.quick else args.dtypes.split(",")
    reps = 5 if args.quick else args.reps
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, ascend kernels: "
          f"{__import__('ascend_passes.kernels', fromlist=['available']).available()}; {allocator}")
    rows = bench(args.shapes.split(","), dtypes, args.variants.split(","), reps, args.budget)
    print_table(rows)


if __name__ == "__main__":
    main()
