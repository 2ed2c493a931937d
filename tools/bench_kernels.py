"""Benchmark of the ascend MoE kernels on a DeepSeek-like layer, against the machine's limits.

Shape: H=1024, I=256 (w13 is [E, H, 2I], w2 is [E, I, H], as transposed views of
Hugging Face's [E, 2I, H] / [E, H, I] storage, which is what the moe pass passes; the prefill fp32
grouped matmuls are also shown with row-major [E, K, N] weights), E=64 experts, top-k=6, at prefill
(T=2048 tokens) and decode (T=8), in float32 and bfloat16.  For each op: the C++ kernel, the
plain-PyTorch reference and, for the whole layer, a naive per-expert PyTorch loop.  Limits are
measured in the same run: the throughput of one dense ``torch.mm`` with the FLOPs of the up
projection in the kernel's dtype (compute limit: on a CPU with AMX torch's bf16 mm runs on the tile
units through oneDNN, ~7x its float32 rate, and so do the bf16 prefill pieces of grouped_matmul; issue
18 target: bf16 prefill >= 60% of it) and a large tensor copy (memory limit, read + write bytes).
The header prints the CPU's feature bits (AVX-512, avx512_bf16, AMX) and the kernels' level
(``ASCEND_PASSES_ISA=avx512`` caps AMX off: compare both runs).  fp32 prefill pieces take the
AVX-512 GEMM for K <= 512 and MKL above (kernels/gemm.h); on a CPU with AMX, bf16 pieces take the
swapped-operand AMX kernel (kernels/amx_swap.h: W's rows loaded as tiles in place, x packed once per
call). The fp32 prefill projections are also timed with each route forced (``ASCEND_PASSES_GEMM=own|blas``)
and the bf16 ones with each bf16 kernel forced (``ASCEND_PASSES_BF16_KERNEL=swap|tile|onednn``: the
swapped kernel, the tile kernel of kernels/amx_gemm.h that packs W per call, oneDNN), read per call, each
paired with the dense mm of its dtype, so the rule can be checked on the machine at hand (the bf16 rows
print the % of the dense bf16 mm). A short bf16 prefill (T=256, ~24 rows per expert) is memory-bound:
its rows print the % of a copy's bandwidth over the expert weights read, per bf16 kernel.
``ASCEND_PASSES_BF16_SCHEDULE=v8`` rows time session 8's bf16 schedules and route in the same run (prefill
projections, T=256, the decode MoE layer) against the default ones: an A/B of session 9's change;
``ASCEND_PASSES_DECODE_SCHEDULE=v9`` rows time session 9's fp32 decode stream (the MoE layer and the
linear) against the default one: an A/B of session 10's change; ``ASCEND_PASSES_DECODE_SCHEDULE=v23`` rows
session 23's (blocks of weight rows for every piece), both dtypes: an A/B of session 24's one-row stream.

Run: ``python tools/bench_kernels.py [--quick]``.  Timings are the minimum over repetitions,
interleaved so that load from other processes affects kernels and limits alike.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import _allocator  # tools/_allocator.py: this script's folder is on sys.path
import torch
import torch.nn.functional as F
from _machine import cold_copy_count, cpu_features_line, has_amx

import ascend_passes.ops as ops
from ascend_passes.ops import reference

H, I, E, TOP_K = 1024, 256, 64, 6
A = torch.ops.ascend


def best_time(
    fn: Callable[[], object], budget_s: float = 0.6, max_reps: int = 20, min_reps: int = 2, warmup: bool = True
) -> float:
    if warmup:
        fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_reps or (len(times) < max_reps and time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def paired_best(fn: Callable[[], object], limit_fn: Callable[[], object], budget_s: float) -> tuple[float, float]:
    """Minimum times of ``fn`` and ``limit_fn`` called alternately, so both see the same machine load."""
    fn(), limit_fn()
    best, best_limit = float("inf"), float("inf")
    start, reps = time.perf_counter(), 0
    while reps < 3 or time.perf_counter() - start < budget_s:
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        limit_fn()
        t2 = time.perf_counter()
        best, best_limit, reps = min(best, t1 - t0), min(best_limit, t2 - t1), reps + 1
    return best, best_limit


@contextlib.contextmanager
def env_set(name: str, value: str):
    """os.environ[name] = value for the calls inside (the kernels read ASCEND_PASSES_GEMM and
    ASCEND_PASSES_BF16_KERNEL at every grouped_matmul / linear call)."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def gemm_route(route: str):
    """ASCEND_PASSES_GEMM=route for the calls inside."""
    return env_set("ASCEND_PASSES_GEMM", route)


# the bf16 kernels ASCEND_PASSES_BF16_KERNEL forces on a CPU with AMX (kernels/amx_swap.h), for the
# rows that compare them in one run; without AMX the setting changes nothing
BF16_KERNELS = (
    ("swap", "swapped-operand AMX kernel, W read in place"),
    ("tile", "AMX tile kernel, W packed per call"),
    ("onednn", "oneDNN bf16 mm, W reordered per call"),
)


# session 8's bf16 schedules and route (kernels/amx_swap.h bf16_schedule_v8), timed in the same run as the
# default ones: the swapped kernel's epilogue, output-line and weight prefetch, the stream's row prefetch, and
# the stream for every expert piece of 1-3 rows
BF16_V8 = ("ASCEND_PASSES_BF16_SCHEDULE", "v8", "session 8's schedules and route")
# without AMX: the bf16 prefill pieces on gemm.h's AVX-512 fp32 GEMM (bf16 widened), the route before oneDNN
BF16_OWN = ("ASCEND_PASSES_GEMM", "own", "AVX-512 fp32 GEMM, bf16 widened")


def bf16_forced() -> tuple[tuple[str, str, str], ...]:
    """The (variable, value, name) of each bf16 prefill route timed beside the rule: with AMX, session 8's
    schedules and each kernel forced; without AMX (where the AMX kernels cannot run) gemm.h's widening GEMM,
    its vdpbf16ps GEMM (the rule's kernel for 9-128 rows before session 14's swapped-operand one) and oneDNN."""
    if has_amx():
        return (BF16_V8, *(("ASCEND_PASSES_BF16_KERNEL", k, n) for k, n in BF16_KERNELS))
    return (
        BF16_OWN,
        ("ASCEND_PASSES_BF16_KERNEL", "dot", "gemm.h's vdpbf16ps GEMM, the rule before session 14"),
        ("ASCEND_PASSES_BF16_KERNEL", "onednn", "oneDNN's bf16 brgemm"),
    )


# session 9's fp32 decode stream (kernels/skinny.h decode_schedule_v9: no software prefetch of the next
# weight rows), timed in the same run as the default one: the fp32 decode MoE layer and linear
DECODE_V9 = ("ASCEND_PASSES_DECODE_SCHEDULE", "v9", "session 9's fp32 stream, no row prefetch")
# session 23's decode stream (blocks of 3-4 weight rows; since session 24 every piece reads one weight row at a
# time): an A/B of session 24's change, both dtypes
DECODE_V23 = ("ASCEND_PASSES_DECODE_SCHEDULE", "v23", "session 23's stream, blocks of weight rows")


@dataclass
class Layer:
    x: torch.Tensor
    logits: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    weights: torch.Tensor = field(init=False)
    ids: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.weights, self.ids, _ = A.moe_gating_top_k_softmax(self.logits, None, TOP_K)


def hf_layout(w: torch.Tensor) -> torch.Tensor:
    """The same [E, K, N] values laid out as Hugging Face stores expert weights ([E, N, K]) and the
    moe pass hands them to grouped_matmul: a transposed view."""
    return w.transpose(1, 2).contiguous().transpose(1, 2)


def make_layer(tokens: int, dtype: torch.dtype, seed: int = 0) -> Layer:
    g = torch.Generator().manual_seed(seed)
    return Layer(
        x=torch.randn(tokens, H, generator=g).to(dtype),
        logits=torch.randn(tokens, E, generator=g).to(dtype),
        w13=hf_layout((torch.randn(E, H, 2 * I, generator=g) / 32).to(dtype)),
        w2=hf_layout((torch.randn(E, I, H, generator=g) / 16).to(dtype)),
    )


def moe_steps(impl) -> dict[str, Callable]:
    """The five steps of the fused MoE layer, for ``impl`` = torch.ops.ascend or the reference module."""

    def init(L: Layer):
        return impl.moe_init_routing_v2(L.x, L.ids, expert_num=E, expert_tokens_num_type=1, expert_tokens_num_flag=True)

    def gmm(x, w, counts):
        return impl.grouped_matmul([x], [w], group_list=counts, group_type=0, group_list_type=1, split_item=2)[0]

    def finalize(L: Layer, y, row_idx):
        return impl.moe_finalize_routing(y, None, None, None, L.weights, row_idx, L.ids, 2, TOP_K)

    def layer(L: Layer):
        ex, row_idx, counts, _ = init(L)
        h = gmm(ex, L.w13, counts)
        y = gmm(impl.swiglu(h, -1), L.w2, counts)
        return finalize(L, y, row_idx)

    return {"init": init, "gmm": gmm, "swiglu": lambda h: impl.swiglu(h, -1), "finalize": finalize, "layer": layer}


def naive_loop(L: Layer, experts: int = E) -> torch.Tensor:
    """What model code does without fused kernels: one masked matmul pair per expert."""
    out = torch.zeros_like(L.x)
    for e in range(experts):
        token, slot = torch.where(L.ids == e)
        if token.numel() == 0:
            continue
        h = L.x[token] @ L.w13[e]
        a, b = h.chunk(2, dim=-1)
        y = (F.silu(a) * b) @ L.w2[e]
        out.index_add_(0, token, y * L.weights[token, slot, None])
    return out


def copy_bandwidth() -> float:
    src = torch.empty(64 * 1024 * 1024, dtype=torch.float32).fill_(1.0)  # 256 MiB
    dst = torch.empty_like(src)
    t = best_time(lambda: dst.copy_(src), budget_s=1.0)
    return 2 * src.numel() * src.element_size() / t


def dense_mm_flops(rows: int, dtype: torch.dtype, budget_s: float = 0.6) -> float:
    a, b = torch.randn(rows, H).to(dtype), torch.randn(H, 2 * I).to(dtype)
    out = torch.empty(rows, 2 * I, dtype=dtype)  # preallocated: the limit excludes allocation
    t = best_time(lambda: torch.mm(a, b, out=out), budget_s=budget_s, max_reps=10, min_reps=1)
    return 2 * rows * H * 2 * I / t


@dataclass
class Row:
    shape: str
    dtype: str
    step: str
    cpp_ms: float | None
    ref_ms: float | None
    naive_ms: float | None
    kind: str = ""  # "compute": work is FLOPs; "memory": work is weight bytes; "routing": work is a share
    work: float = 0.0
    label: str = ""
    limit: float = 0.0  # the limit measured alternately with this kernel (FLOP/s or B/s); 0: global
    metric: str = ""
    fraction: str = ""

    def score(self, mm_flops: dict[str, float], copy_bw: float) -> None:
        """Fill metric and fraction against the limits (known only once every case has run);
        ``mm_flops``: the best dense mm rate per dtype name."""
        seconds = (self.cpp_ms or 0.0) / 1e3
        if self.kind in ("compute", "memory"):
            rate = self.work / seconds
            best = mm_flops.get(self.dtype, 0.0) if self.kind == "compute" else copy_bw
            name = f"dense {self.dtype} mm" if self.kind == "compute" else "copy BW"
            unit = "GFLOP/s" if self.kind == "compute" else "GB/s weights"
            self.metric = f"{rate / 1e9:.1f} {unit}{self.label}"
            if self.limit:  # paired limit first; the run's best limit (a quieter moment) in brackets
                self.fraction = f"{100 * rate / self.limit:.0f}% of {name} [{100 * rate / max(best, self.limit):.0f}%]"
            else:
                self.fraction = f"{100 * rate / best:.0f}% of {name}"
        elif self.kind == "routing":
            self.metric = self.label
            self.fraction = f"routing {100 * self.work:.1f}% of layer"


def bench_case(tokens: int, dtype: torch.dtype, quick: bool) -> list[Row]:
    L = make_layer(tokens, dtype)
    cpp, ref = moe_steps(A), moe_steps(reference)
    shape = f"prefill T={tokens}" if tokens > 64 else f"decode T={tokens}"
    dname = str(dtype).replace("torch.", "")
    budget = 0.3 if quick else 0.8
    ex, row_idx, counts, _ = cpp["init"](L)
    h = cpp["gmm"](ex, L.w13, counts)
    act = cpp["swiglu"](h)
    y = cpp["gmm"](act, L.w2, counts)
    pairs = tokens * TOP_K
    up_flops, down_flops = 2 * pairs * H * 2 * I, 2 * pairs * I * H
    experts_touched = int(torch.unique(L.ids).numel())
    per_expert = (L.w13[0].numel() + L.w2[0].numel()) * L.w13.element_size()
    slow = tokens > 64  # reference and naive loop take seconds at prefill: time them once or twice

    # Decode is memory-bound: rotate over copies of the expert weights (as consecutive layers of a
    # model would), so that repeated calls do not find them in the last-level cache.
    n_copies = 1 if slow else cold_copy_count(experts_touched * per_expert)
    copies = [L] + [replace(L, w13=L.w13.clone(), w2=L.w2.clone()) for _ in range(n_copies - 1)]
    turn = itertools.count()

    def pick() -> Layer:
        return copies[next(turn) % len(copies)]

    def timed(step: str, *args) -> tuple[float, float]:
        def call(impl: dict[str, Callable]):
            layer = pick()
            real = [layer.w13 if a is L.w13 else layer.w2 if a is L.w2 else layer if a is L else a for a in args]
            return impl[step](*real)

        return (
            best_time(lambda: call(cpp), budget, min_reps=3),
            best_time(lambda: call(ref), budget if not slow else 0.1, max_reps=5, min_reps=1, warmup=not slow),
        )

    t_init = timed("init", L)
    t_up = timed("gmm", ex, L.w13, counts)
    t_act = timed("swiglu", h)
    t_down = timed("gmm", act, L.w2, counts)
    t_fin = timed("finalize", L, y, row_idx)
    t_layer = timed("layer", L)
    if dtype != torch.float32 and slow:
        # the naive loop is slow in bf16 (per-expert gathers, and bf16 mm without avx512_bf16 ~1 GFLOP/s):
        # time 8 of the 64 experts and scale
        t_naive = best_time(lambda: naive_loop(L, 8), 0.1, max_reps=1, min_reps=1, warmup=False) * E / 8
        naive_note = " (naive: 8/64 experts x8)"
    else:
        t_naive = best_time(
            lambda: naive_loop(pick()), budget if not slow else 0.1, max_reps=5, min_reps=1, warmup=not slow
        )
        naive_note = ""

    def row(step: str, t: tuple[float, float], kind: str = "", work: float = 0.0, label: str = "") -> Row:
        return Row(shape, dname, step, t[0] * 1e3, t[1] * 1e3, None, kind, work, label)

    def gemm(step: str, t: tuple[float, float], flops: int, weight: torch.Tensor, x: torch.Tensor) -> Row:
        if slow:  # compute-bound: against a dense mm of the same shape and dtype, timed alternately
            a, b = x, weight[0].contiguous()
            out = torch.empty(a.shape[0], b.shape[1], dtype=x.dtype)
            t_kernel, t_mm = paired_best(lambda: cpp["gmm"](x, weight, counts), lambda: torch.mm(a, b, out=out), budget)
            r = row(step, (t_kernel, t[1]), "compute", flops)
            r.limit = flops / t_mm
            return r
        return row(step, t, "memory", experts_touched * weight[0].numel() * weight.element_size())

    rows = [
        row("init_routing", t_init),
        gemm("grouped_matmul up", t_up, up_flops, L.w13, ex),
        row("swiglu", t_act),
        gemm("grouped_matmul down", t_down, down_flops, L.w2, act),
        row("finalize_routing", t_fin),
    ]
    if slow and dtype == torch.bfloat16:
        # each bf16 kernel forced on a CPU with AMX (the rows above: the default rule, the swapped-operand
        # kernel); without AMX the rows above are oneDNN (AVX512_BF16) and the one forced route is
        # gemm.h's fp32 GEMM with bf16 widened, the route before it (the AMX kernels cannot run there)
        for env, kernel, name in bf16_forced():
            for step, flops, weight, x in (("up", up_flops, L.w13, ex), ("down", down_flops, L.w2, act)):
                with env_set(env, kernel):
                    label = f"grouped_matmul {step}, {env}={kernel} ({name})"
                    r = gemm(label, (0.0, 0.0), flops, weight, x)
                r.ref_ms = None
                rows.append(r)
    if slow and dtype == torch.float32:
        # each fp32 GEMM route forced (the rows above: the default rule, K <= 512 -> own GEMM, else BLAS)
        for route in ("own", "blas"):
            for step, flops, weight, x in (("up", up_flops, L.w13, ex), ("down", down_flops, L.w2, act)):
                with gemm_route(route):
                    r = gemm(f"grouped_matmul {step}, ASCEND_PASSES_GEMM={route}", (0.0, 0.0), flops, weight, x)
                r.ref_ms = None
                rows.append(r)
        # the other weight layout, [E, K, N] row-major: MKL runs a slower path for these short-K
        # pieces when an expert has fewer than ~192 rows (measured: ~140 vs ~155 GFLOP/s per core)
        for step, flops, weight, x in (("up", up_flops, L.w13, ex), ("down", down_flops, L.w2, act)):
            r = gemm(f"grouped_matmul {step} [E,K,N] weights", (0.0, 0.0), flops, weight.contiguous(), x)
            r.ref_ms = None
            rows.append(r)
    if not slow:
        # a decode linear (the dense layers and lm head around the MoE): ascend.linear streams the
        # weight; its reference is F.linear (BLAS, which packs the weight first for so few rows)
        one = 4 * H * H * torch.empty((), dtype=dtype).element_size()
        weights = [(torch.randn(4 * H, H) / 32).to(dtype) for _ in range(cold_copy_count(one))]  # not cached
        x_lin = torch.randn(tokens, H).to(dtype)
        t_lin = tuple(
            best_time(lambda impl=impl: impl.linear(x_lin, weights[next(turn) % len(weights)]), budget, min_reps=3)
            for impl in (A, reference)
        )
        rows.append(
            row(
                f"linear [{tokens},{H}]x[{4 * H},{H}]^T",
                t_lin,
                "memory",
                weights[0].numel() * weights[0].element_size(),
            )
        )
    if slow:
        layer = row(
            "MoE layer" + naive_note,
            t_layer,
            "routing",
            (t_init[0] + t_fin[0]) / t_layer[0],
            f"{(up_flops + down_flops) / t_layer[0] / 1e9:.1f} GFLOP/s",
        )
    else:  # memory-bound: against a 256 MiB copy, timed alternately with the layer
        src = torch.ones(64 * 1024 * 1024)
        dst = torch.empty_like(src)
        t_kernel, t_copy = paired_best(lambda: cpp["layer"](pick()), lambda: dst.copy_(src), 2 * budget)
        layer = row(
            "MoE layer", (t_kernel, t_layer[1]), "memory", experts_touched * per_expert, f" ({experts_touched} experts)"
        )
        layer.limit = 2 * src.numel() * src.element_size() / t_copy
    layer.naive_ms = t_naive * 1e3
    rows.append(layer)
    if not slow:  # the same layer (and the linear) under earlier sessions' decode schedules
        for old in (BF16_V8 if dtype == torch.bfloat16 else DECODE_V9, DECODE_V23):
            with env_set(old[0], old[1]):
                t_kernel, t_copy = paired_best(lambda: cpp["layer"](pick()), lambda: dst.copy_(src), 2 * budget)
                shows_linear = dtype == torch.float32 or old is DECODE_V23
                if shows_linear:
                    t_old_lin = best_time(
                        lambda: A.linear(x_lin, weights[next(turn) % len(weights)]), budget, min_reps=3
                    )
            v8 = row(
                f"MoE layer, {old[0]}={old[1]} ({old[2]})",
                (t_kernel, 0.0),
                "memory",
                experts_touched * per_expert,
                f" ({experts_touched} experts)",
            )
            v8.ref_ms = None
            v8.limit = 2 * src.numel() * src.element_size() / t_copy
            rows.append(v8)
            if shows_linear:
                lin = row(
                    f"linear [{tokens},{H}]x[{4 * H},{H}]^T, {old[0]}={old[1]}",
                    (t_old_lin, 0.0),
                    "memory",
                    weights[0].numel() * weights[0].element_size(),
                )
                lin.ref_ms = None
                rows.append(lin)
    return rows


def bench_small_prefill(tokens: int, quick: bool) -> list[Row]:
    """bf16 grouped matmuls of a short prefill (T=256: ~24 rows per expert): each cold expert weight is
    read once for a few dozen rows, so the limit is memory: the % of a copy's bandwidth (timed alternately)
    over the weight bytes read. Each bf16 kernel forced in turn (ASCEND_PASSES_BF16_KERNEL) and the rule."""
    dtype = torch.bfloat16
    L = make_layer(tokens, dtype)
    cpp = moe_steps(A)
    ex, _, counts, _ = cpp["init"](L)
    act = cpp["swiglu"](cpp["gmm"](ex, L.w13, counts))
    experts = int((counts > 0).sum())
    n_copies = cold_copy_count(experts * (L.w13[0].numel() + L.w2[0].numel()) * L.w13.element_size())
    copies = [L] + [replace(L, w13=L.w13.clone(), w2=L.w2.clone()) for _ in range(n_copies - 1)]
    turn = itertools.count()
    src = torch.ones(16 * 1024 * 1024)
    dst = torch.empty_like(src)
    rows = []
    for env, kernel, name in (("ASCEND_PASSES_BF16_KERNEL", "", "rule"), *bf16_forced()):
        for step, x, attr in (("up", ex, "w13"), ("down", act, "w2")):
            weight = getattr(L, attr)
            with env_set(env, kernel):
                t_kernel, t_copy = paired_best(
                    lambda x=x, attr=attr: cpp["gmm"](x, getattr(copies[next(turn) % n_copies], attr), counts),
                    lambda: dst.copy_(src),
                    0.3 if quick else 0.8,
                )
            label = f"grouped_matmul {step}" + (f", {env}={kernel} ({name})" if kernel else "")
            r = Row(
                f"prefill T={tokens}",
                "bfloat16",
                label,
                t_kernel * 1e3,
                None,
                None,
                "memory",
                experts * weight[0].numel() * weight.element_size(),
                f" ({tokens * TOP_K // E} rows/expert)",
            )
            r.limit = 2 * src.numel() * src.element_size() / t_copy
            rows.append(r)
    return rows


def bench_attention(quick: bool) -> list[Row]:
    """ascend.attention (kernels/attention.cpp) against its reference, torch's CPU flash kernel on v padded to
    the q/k head dim (what the graph ran before), at the bench model's attention (8 heads, q/k 96 = 64 + 32
    rope, v 64), causal: the FLOPs are those of the causal half (q·kᵀ and p·v of the seen columns)."""
    from ascend_passes.ops.attention import attention as flash_padded

    rows = []
    for length, dtype in itertools.product((256, 1024), (torch.float32, torch.bfloat16)):
        torch.manual_seed(length)
        q = torch.randn(1, length, 8, 96).transpose(1, 2).to(dtype)
        k = torch.randn(1, 8, length, 96).to(dtype)
        v = torch.randn(1, length, 8, 64).transpose(1, 2).to(dtype)
        budget = 0.3 if quick else 0.8
        own = best_time(lambda: A.attention(q, k, v, 96**-0.5, True), budget)
        ref = best_time(lambda: flash_padded(q, k, v, 96**-0.5, True), budget)
        flops = 2 * 8 * (length * (length + 1) // 2) * (96 + 64)
        dname = str(dtype).replace("torch.", "")
        rows.append(
            Row(f"prefill T={length}", dname, "attention (causal)", own * 1e3, ref * 1e3, None, "compute", flops)
        )
    return rows


def render(rows: list[Row], header: list[str]) -> None:
    cols = ["shape", "dtype", "step", "C++ ms", "reference ms", "naive loop ms", "throughput", "vs limit"]

    def fmt(v: float | None) -> str:
        return "" if v is None else f"{v:.3f}"

    cells = [
        [r.shape, r.dtype, r.step, fmt(r.cpp_ms), fmt(r.ref_ms), fmt(r.naive_ms), r.metric, r.fraction] for r in rows
    ]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # plain text
        for line in header:
            print(line)
        widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
        print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
        for row in cells:
            print("  ".join(v.ljust(w) for v, w in zip(row, widths)))
        return
    console = Console(width=160)
    for line in header:
        console.print(line)
    table = Table(title=f"ascend MoE kernels: H={H} I={I} E={E} k={TOP_K}")
    for c in cols:
        table.add_column(c, justify="right" if c.endswith("ms") else "left")
    for row in cells:
        table.add_row(*row)
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter timing budgets")
    parser.add_argument(
        "--allocator",
        choices=_allocator.CHOICES,
        default="tcmalloc",
        help="memory allocator of the run (default: TCMalloc when installed; see tools/_allocator.py)",
    )
    parser.add_argument(
        "--huge-pages",
        choices=_allocator.HUGE_PAGES,
        default="on",
        help="torch's THP_MEM_ALLOC_ENABLE for the run (default: on; see tools/_allocator.py)",
    )
    args = parser.parse_args()
    allocator = _allocator.ensure(args.allocator, args.huge_pages)
    torch.manual_seed(0)
    start = time.perf_counter()
    copy_bw, mm_fp32 = [], []
    rows: list[Row] = []
    for tokens in (2048, 8):
        for dtype in (torch.float32, torch.bfloat16):
            # limits measured between the cases; the best of them is the machine's limit
            copy_bw.append(copy_bandwidth())
            mm_fp32.append(dense_mm_flops(2048 * TOP_K, torch.float32))
            rows += bench_case(tokens, dtype, args.quick)
            if tokens == 2048 and dtype == torch.bfloat16:
                rows += bench_small_prefill(256, args.quick)
                rows += bench_attention(args.quick)
    copy_bw.append(copy_bandwidth())
    mm_fp32.append(dense_mm_flops(2048 * TOP_K, torch.float32))
    mm_bf16 = [dense_mm_flops(2048 * TOP_K, torch.bfloat16) for _ in range(3)]
    best_bw = max(copy_bw)
    best_mm = {"float32": max(mm_fp32), "bfloat16": max(mm_bf16)}
    for r in rows:
        r.score(best_mm, best_bw)
    header = [
        f"kernels: {ops.kernel_backend()}, threads: {torch.get_num_threads()}, {allocator}",
        cpu_features_line(),
        "fractions of the MoE layer (decode) and grouped_matmul (prefill) use a limit timed alternately "
        "with that kernel (the bracketed figure: against the best limit of the whole run); "
        "other rows use the best limit:",
        f"memory limit: copy {best_bw / 1e9:.1f} GB/s (read + write; best of "
        f"{', '.join(f'{b / 1e9:.1f}' for b in copy_bw)})",
        f"compute limit: dense torch.mm [{2048 * TOP_K}x{H}]@[{H}x{2 * I}] float32 {best_mm['float32'] / 1e9:.1f} "
        f"GFLOP/s (best of {', '.join(f'{m / 1e9:.0f}' for m in mm_fp32)}), bfloat16 "
        f"{best_mm['bfloat16'] / 1e9:.1f} GFLOP/s (best of {', '.join(f'{m / 1e9:.0f}' for m in mm_bf16)}, and of "
        "the mm paired with each prefill row); each dtype's kernels are compared with that dtype's mm "
        "(issue 18 target: bf16 grouped_matmul prefill >= 60%)",
    ]
    render(rows, header)
    print(f"total bench time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
