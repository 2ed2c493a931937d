"""Micro-benchmark: does ``ascend.grouped_matmul`` run faster on expert weights stored in the
execution layout (``[E, K, N]`` contiguous, in × out) than on Hugging Face's loadable layout
(``[E, N, K]`` contiguous, out × in, passed as its ``.transpose(1, 2)`` view, as the fused MoE
replacement does)?  The answer decides what ``ascend_passes.weights.prepare`` does to expert weights.

Shape: a DeepSeek-like layer, H=1024, I=256, E=64 experts, top-6: the up projection
(``gate_up_proj`` [E, 2I, H] → K=H, N=2I) and the down projection (``down_proj`` [E, H, I] → K=I,
N=H), at decode (8 tokens → 48 rows, ≤ 8 rows per expert: the kernel's streaming path) and
prefill (256 / 1024 tokens: its BLAS path), float32 and bfloat16.  Both layouts are timed
alternately (minimum over repetitions) so load from other processes hits both alike.

A second table (``--model``) times the whole DeepSeek-V3-style model of ``tools/bench_model.py``
compiled with ascend_passes (``compiler="eager"``), before and after ``weights.prepare(model,
layout="execution")`` — the end-to-end effect of the layout.

    python tools/bench_weights.py            # C++ kernels (ASCEND_PASSES_KERNELS unset)
    python tools/bench_weights.py --quick
    python tools/bench_weights.py --model --shapes decode --dtypes bfloat16,float32
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import ascend_passes.kernels as kernels
import torch
from bench_kernels import paired_best  # same folder: one paired timer for both benches

import ascend_passes.ops  # noqa: F401  (registers torch.ops.ascend)

H, I, E, TOP_K = 1024, 256, 64, 6
A = torch.ops.ascend


def tokens_per_expert(tokens: int, generator: torch.Generator) -> torch.Tensor:
    ids = torch.stack([torch.randperm(E, generator=generator)[:TOP_K] for _ in range(tokens)]).reshape(-1)
    return torch.bincount(ids, minlength=E).to(torch.int64)


def bench_model(shapes: list[str], dtypes: list[str], budget: float) -> None:
    """Whole model, ascend_passes + eager downstream: loadable vs execution expert layout."""
    import statistics
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_model import CONFIG, SHAPES

    import ascend_passes as ap
    from ascend_passes import models, weights

    print(f"{'shape':12s} {'dtype':9s} {'loadable ms':>12s} {'execution ms':>13s} {'speedup':>8s} {'rel diff':>9s}")
    for dtype_name in dtypes:
        for shape in shapes:
            batch, tokens = SHAPES[shape]
            model, (ids,) = models.deepseek_v3(
                "grouped_mm", num_layers=4, tokens=tokens, batch=batch, dtype=getattr(torch, dtype_name), **CONFIG
            )
            torch._dynamo.reset()
            fn = torch.compile(model, backend="ascend_passes", options={"compiler": "eager"})
            with torch.no_grad(), ap.capture() as reports:
                y_loadable = fn(ids)
                assert reports and reports[0].count("ascend.grouped_matmul") == 6
                # mark the expert weights as the backend does (weights.record_execution_weights)
                experts = [p for n, p in model.named_parameters() if n.endswith(("gate_up_proj", "down_proj"))]
                for p in experts:
                    p.__dict__[weights.LAYOUT_ATTR] = weights.WeightLayout((1, 2))

                def timed() -> float:
                    times = []
                    start = time.perf_counter()
                    while len(times) < 5 or time.perf_counter() - start < budget:
                        t0 = time.perf_counter()
                        fn(ids)
                        times.append(time.perf_counter() - t0)
                    return statistics.median(times)

                loadable_s = []
                execution_s = []
                for _ in range(2):  # alternate layouts so both see the same machine load
                    weights.restore(model)
                    loadable_s.append(timed())
                    weights.prepare(model, layout="execution")
                    y_execution = fn(ids)
                    execution_s.append(timed())
            t_l, t_e = min(loadable_s), min(execution_s)
            diff = ((y_execution.float() - y_loadable.float()).abs().max() / y_loadable.float().abs().max()).item()
            print(
                f"{shape:12s} {dtype_name:9s} {t_l * 1e3:12.2f} {t_e * 1e3:13.2f} {t_l / t_e:7.2f}x {diff:9.1e}",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="shorter timing budget")
    parser.add_argument("--model", action="store_true", help="time the whole model instead of the kernel")
    parser.add_argument("--shapes", default="decode,prefill256", help="--model shapes (tools/bench_model.py)")
    parser.add_argument("--dtypes", default="bfloat16,float32", help="--model dtypes")
    args = parser.parse_args()
    budget = 0.5 if args.quick else 1.5
    if args.model:
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, C++ kernels: {kernels.available()}")
        bench_model(args.shapes.split(","), args.dtypes.split(","), 2 * budget)
        return
    g = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, C++ kernels: {kernels.available()}")
    print(
        f"{'shape':12s} {'dtype':9s} {'proj':5s} {'rows':>5s} {'loadable ms':>12s} "
        f"{'execution ms':>13s} {'speedup':>8s}"
    )
    for dtype in (torch.float32, torch.bfloat16):
        for shape, tokens in (("decode", 8), ("prefill256", 256), ("prefill1024", 1024)):
            counts = tokens_per_expert(tokens, g)
            rows = int(counts.sum())
            for proj, (n, k) in (("up", (2 * I, H)), ("down", (H, I))):
                loadable = torch.randn(E, n, k, generator=g).to(dtype)  # HF: [E, out, in]
                as_loaded = loadable.transpose(1, 2)  # [E, K, N] view, column-major per expert
                execution = as_loaded.contiguous()  # [E, K, N] row-major per expert
                x = torch.randn(rows, k, generator=g).to(dtype)

                def run(w: torch.Tensor) -> Callable[[], object]:
                    return lambda: A.grouped_matmul(
                        [x], [w], group_list=counts, split_item=2, group_type=0, group_list_type=1
                    )

                y_l, y_e = run(as_loaded)()[0], run(execution)()[0]
                torch.testing.assert_close(y_l, y_e, rtol=2e-2, atol=2e-2)
                t_l, t_e = paired_best(run(as_loaded), run(execution), budget)
                print(
                    f"{shape:12s} {str(dtype)[6:]:9s} {proj:5s} {rows:5d} {t_l * 1e3:12.3f} {t_e * 1e3:13.3f} "
                    f"{t_l / t_e:7.2f}x",
                    flush=True,
                )


if __name__ == "__main__":
    main()
