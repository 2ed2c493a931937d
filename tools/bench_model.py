"""End-to-end benchmark: a DeepSeek-V3-style (or, ``--model deepseek_v4``, V4-style) model under eager,
Inductor and ascend_passes.

Config (issue "MoE, RMSNorm and SwiGLU rewrites"): H=1024, moe_intermediate=256, 64 routed experts,
top-6, 4 layers (1 dense), n_group=8, topk_group=4, q_lora_rank=256, kv_lora_rank=128, one shared
expert; experts via Hugging Face ``grouped_mm``.  Shapes: prefill 1×256 and 1×1024 tokens, decode
8×1; float32 and bfloat16.  Peers (what a CPU user would pick): eager, ``torch.compile``
(Inductor), Inductor with ``freezing=True`` (weights folded as constants, oneDNN-prepacked), the same
with ``cpp_wrapper=True`` (``inductor_freezing_cpp``: a C++ wrapper calls the kernels, no Python per op),
and the Hugging Face ``batched_mm`` experts under Inductor; then ascend_passes with ``compiler="eager"``,
``compiler="inductor"`` and the latter under ``cpp_wrapper`` (``ascend_inductor_cpp``) — median time
per forward, the ratio against eager and against the best of all peers of that shape and dtype, and the
compile time (first call).  Each (dtype, shape) cell runs in a process of its own (``--in-process``: all
in this one), so that a full run fits 24 GiB; this process prints the one table.  Below the table, the limits measured
in the same run: the model's matmul FLOPs (the sum of ``matmul_census``: FlopCounterMode's formulas, an
expert's product per routed row), a dense [2048,1024]x[1024,4096] product in each dtype (the faster of ``torch.mm``
and ``ascend.linear``: the best GEMM of the machine) and the fraction of that roofline each prefill
reaches; for decode, the bytes the forward must read (all weights but the experts no token routes to
and the embedding rows not looked up) and the fraction of copy bandwidth (issue 18's measure; below the
table also of read bandwidth, a sum over 256 MiB, which need not equal a copy's read + write; each compiled
decode row's share of Dynamo's guard evaluation noted as "guards" (calls alternated with and without it), the best
ascend row's fraction without it printed too: what a serving engine that calls the compiled code directly pays);
and issue 18's ratios (bf16 prefill vs fp32 prefill and vs the best bf16 peer).  For prefill a "limits" line adds what a
FLOP-only roofline leaves out: per matmul (``matmul_census``) its FLOPs at the dense mm rate and its
weight bytes at copy bandwidth, summed as max(both) (the honest limit: at 1x256 an
expert gets ~24 rows and its weight takes about as long to read as to multiply) and as their sum (no overlap).

``--model deepseek_v4`` (issue 19): Hugging Face DeepseekV4 at the same sizes where they apply (H=1024,
moe_intermediate=256, 64 routed experts top-6, one shared expert, 4 layers: 1 hash-routed + 3
sqrtsoftplus top-k, all MoE), V4's own parts at V4's proportions (mHC 4 streams, 20 Sinkhorn
iterations; shared-KV MQA, 8 heads of 128, q_lora_rank 256; layers sliding / CSA (rate 4, indexer
top-64) / HCA (rate 128) / sliding; swiglu_limit 10); same shapes, dtypes and peers.  Its routers stay
ATen (sqrtsoftplus is no gating mode), its experts are the fused chain.

    python tools/bench_model.py                 # everything, one process per (dtype, shape) (~20 min on 2 cores)
    python tools/bench_model.py --quick         # fp32 only, fewer repetitions
    python tools/bench_model.py --shapes decode --dtypes float32 --variants eager,ascend_eager
    python tools/bench_model.py --model deepseek_v4 --quick
    python tools/bench_model.py --shapes decode --cold-cache   # decode with the weights out of the caches

``--cold-cache`` cycles the timed forwards over copies of the model whose reads exceed the last-level cache
(``cold_copies``): the bench model's decode weights fit a large L3, a real model's never do.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _allocator  # tools/_allocator.py: this script's folder is on sys.path
import torch
import torch._inductor.config
from _machine import cold_copy_count, cpu_features_line, last_level_cache_bytes
from torch._dynamo.utils import counters

import ascend_passes as ap
import ascend_passes.ops  # noqa: F401  (registers torch.ops.ascend.*, for the dense rate)
from ascend_passes import models

CONFIG = dict(
    hidden_size=1024,
    intermediate_size=2048,
    moe_intermediate_size=256,
    n_routed_experts=64,
    num_experts_per_tok=6,
    n_group=8,
    topk_group=4,
    q_lora_rank=256,
    kv_lora_rank=128,
    num_attention_heads=8,
    num_key_value_heads=8,
    qk_nope_head_dim=64,
    qk_rope_head_dim=32,
    v_head_dim=64,
    vocab_size=4096,
    first_k_dense_replace=1,
    n_shared_experts=1,
)
V4_CONFIG = dict(
    hidden_size=1024,
    moe_intermediate_size=256,
    n_routed_experts=64,
    num_experts_per_tok=6,
    n_shared_experts=1,
    q_lora_rank=256,
    num_attention_heads=8,
    num_key_value_heads=1,
    head_dim=128,
    partial_rotary_factor=0.5,
    vocab_size=4096,
    hc_mult=4,
    hc_sinkhorn_iters=20,
    swiglu_limit=10.0,
    sliding_window=128,
    o_groups=2,
    o_lora_rank=256,
    index_n_heads=8,
    index_head_dim=64,
    index_topk=64,
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    layer_types=[
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "sliding_attention",
    ],
)
# --model -> (factory, its config, the table's title)
MODELS = {
    "deepseek_v3": (models.deepseek_v3, CONFIG, "DeepSeek-V3-style model (4 layers, H=1024, 64 experts top-6)"),
    "deepseek_v4": (
        models.deepseek_v4,
        V4_CONFIG,
        "DeepSeek-V4-style model (4 layers: 1 hash + 3 sqrtsoftplus top-6 of 64, H=1024, mHC x4)",
    ),
}
SHAPES = {"prefill256": (1, 256), "prefill1024": (1, 1024), "decode": (8, 1)}
VARIANTS = (
    "eager",
    "inductor",
    "inductor_freezing",
    "inductor_freezing_cpp",
    "inductor_batched_mm",
    "ascend_eager",
    "ascend_inductor",
    "ascend_inductor_cpp",
)


@dataclass
class Row:
    shape: str
    dtype: str
    variant: str
    median_ms: float
    compile_s: float
    rewrites: str = ""
    # decode, compiled variants: how much of the median is Dynamo's guard evaluation (_guards_ms)
    guards_ms: float | None = None

    @property
    def notes(self) -> str:
        return self.rewrites + (f", guards {self.guards_ms:.2f} ms" if self.guards_ms is not None else "")

    @property
    def unguarded_ms(self) -> float | None:
        return None if self.guards_ms is None else self.median_ms - self.guards_ms


def _compiled(model: torch.nn.Module, variant: str, compiling_calls: int = 1) -> Callable[..., Any]:
    if variant == "eager":
        return model
    if variant in ("inductor", "inductor_batched_mm"):
        return torch.compile(model)
    if variant == "inductor_freezing":
        return torch.compile(model, options={"freezing": True})
    if variant == "inductor_freezing_cpp":  # the C++ wrapper: no Python per op call
        return torch.compile(model, options={"freezing": True, "cpp_wrapper": True})
    if variant == "ascend_inductor_cpp":  # Inductor reads cpp_wrapper from its config when it compiles
        compiled = torch.compile(model, backend="ascend_passes", options={"compiler": "inductor"})
        calls = 0

        def call(*args: Any) -> Any:
            # the config patch only around the calls that compile (it costs ~20 us, which the timed
            # calls of a user's process do not pay: the first one, and with --dynamic the second, at
            # the timed length); a later call that compiled again would do so without the C++
            # wrapper, so it raises instead of timing another program
            nonlocal calls
            if calls < compiling_calls:
                with torch._inductor.config.patch(cpp_wrapper=True):
                    out = compiled(*args)
                calls += 1
                return out
            graphs = counters["stats"]["unique_graphs"]
            out = compiled(*args)
            if counters["stats"]["unique_graphs"] != graphs:
                raise RuntimeError("ascend_inductor_cpp compiled again after its first call (without cpp_wrapper)")
            return out

        return call
    compiler = variant.split("_", 1)[1]
    return torch.compile(model, backend="ascend_passes", options={"compiler": compiler})


def _guards_ms(fn: Callable[[], Any], reps: int, budget_s: float) -> float:
    """How much of a call of ``fn`` is Dynamo's guard evaluation: the median, over alternated pairs, of a call's time
    minus the next call's with the evaluation skipped (``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``,
    what a serving engine that calls the compiled code directly pays). Pairs, not two medians: the host's drift
    over a run is larger than the difference. A decode forward of the bench model evaluates ~1,000 guards, most on
    the Hugging Face modules' attributes and closures, the same for every compiled variant. Safe here: the calls
    are the ones that compiled, with the same inputs."""
    diffs: list[float] = []
    start = time.perf_counter()
    while len(diffs) < reps or (time.perf_counter() - start < budget_s and len(diffs) < 4 * reps):
        t0 = time.perf_counter()
        fn()
        guarded = time.perf_counter() - t0
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            t0 = time.perf_counter()
            fn()
            diffs.append(guarded - (time.perf_counter() - t0))
    return 1e3 * statistics.median(diffs)


def _time(fn: Callable[[], Any], reps: int, budget_s: float) -> float:
    times = []
    start = time.perf_counter()
    while len(times) < reps or (time.perf_counter() - start < budget_s and len(times) < 4 * reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def cold_copies(read_bytes: int) -> int:
    """How many copies of a model to cycle through so that each forward finds its weights out of the
    caches: the bytes the other copies' forwards read in between (``read_bytes`` each) exceed the
    last-level cache.  The bench model's decode reads 175 MB of bf16 weights, which fit a large L3 (480 MB
    on the Xeon of sessions 17-19): forwards timed back to back read part of them from it, unlike a real
    model's decode step (GBs of weights).  Cycling copies leaves the code and the small activations in the
    caches, as between the steps of a real decode; evicting the caches before each forward instead (a 1 GB
    read) also evicted the code and cost ~0.5 ms more per forward than this (bf16 decode 8.6 vs 8.0 ms).
    Dynamo compiles the first copy and reuses that graph for the others (their parameters are its inputs):
    each copy reads its own weights, under freezing too (checked by scaling one copy's weights)."""
    return cold_copy_count(read_bytes, at_least=2, caches=1)


def dense_mm_flops(dtype: torch.dtype, budget_s: float = 0.5) -> float:
    """GFLOP/s of one dense [2048,1024]x[1024,4096] product, best of a few: the faster of torch.mm
    (preallocated output) and ``ascend.linear`` on the same weight stored [N, K] (where the project's
    own GEMM beats torch's BLAS, e.g. fp32 on a CPU where MKL's sgemm is not its tuned one, the
    roofline is that faster rate, so that no variant reads above 100% of it)."""
    a, b = torch.randn(2048, 1024).to(dtype), torch.randn(1024, 4096).to(dtype)
    out = torch.empty(2048, 4096, dtype=dtype)
    best = _best(lambda: torch.mm(a, b, out=out), budget_s)
    w = b.t().contiguous()
    best = min(best, _best(lambda: torch.ops.ascend.linear(a, w), budget_s))
    return 2 * 2048 * 1024 * 4096 / best / 1e9


def copy_bandwidth(budget_s: float = 0.5) -> float:
    """GB/s of a 256 MiB copy, read + write bytes."""
    src = torch.ones(64 * 1024 * 1024)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / _best(lambda: dst.copy_(src), budget_s) / 1e9


def read_bandwidth(budget_s: float = 0.5) -> float:
    """GB/s of reading 256 MiB (a sum over it, both threads): what streaming weights can reach, printed beside
    copy bandwidth (read + write bytes), which a read-only stream may not reach (or may exceed) on a given
    machine."""
    src = torch.ones(64 * 1024 * 1024)
    return src.numel() * 4 / _best(lambda: src.sum(), budget_s) / 1e9


def _best(fn: Callable[[], Any], budget_s: float) -> float:
    fn()
    best, start = float("inf"), time.perf_counter()
    while best == float("inf") or time.perf_counter() - start < budget_s:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def must_read_bytes(model: torch.nn.Module, ids: torch.Tensor) -> float:
    """The bytes a forward must read: all parameters but the experts no token is routed to (seen by a hook
    on each experts module) and the embedding rows not looked up."""
    touched: dict[str, int] = {}
    hooks = []
    for name, mod in model.named_modules():
        if type(mod).__name__.endswith("Experts"):

            def hook(mod, args, name=name):
                touched[name] = int(torch.unique(args[1]).numel())

            hooks.append(mod.register_forward_pre_hook(hook))
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for name, used in touched.items():
        experts = model.get_submodule(name)
        params = list(experts.parameters(recurse=False))
        count = params[0].shape[0]
        per_expert = sum(p.numel() * p.element_size() for p in params) / count
        total -= (count - used) * per_expert
    embed = model.lm.get_input_embeddings().weight
    rows = int(torch.unique(ids).numel())
    total -= (embed.shape[0] - rows) * embed.shape[1] * embed.element_size()
    return float(total)


def matmul_census(model: torch.nn.Module, ids: torch.Tensor) -> list[tuple[float, float]]:
    """(FLOPs, weight bytes) of every matmul of one eager forward of the ``grouped_mm`` model: mm / addmm /
    bmm / attention by FlopCounterMode's formulas, ``_grouped_mm`` one entry per expert that gets rows (2 *
    rows * K * N, its K * N weight); the bytes are those of the operands that are parameters, 0 for
    matmuls of activations only (attention). At prefill an expert gets ~24 rows, so reading its weight takes about as
    long as multiplying it: a FLOP-only roofline leaves that out."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import flop_registry

    aten = torch.ops.aten
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    census: list[tuple[float, float]] = []

    def param_bytes(t: Any) -> int:
        is_param = isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in params
        return t.numel() * t.element_size() if is_param else 0

    class Census(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            packet = func._overloadpacket
            if packet is aten._grouped_mm:  # one entry per expert that gets rows
                x, w = args[0], args[1]
                offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
                rows = [x.shape[0]] if offs is None else torch.diff(offs, prepend=offs.new_zeros(1)).tolist()
                weight = w[0].numel() * w.element_size() if param_bytes(w) else 0
                census.extend((2.0 * r * w.shape[-2] * w.shape[-1], float(weight)) for r in rows if r > 0)
            elif packet in flop_registry:
                flops = flop_registry[packet](*args, **kwargs, out_val=out)
                census.append((float(flops), float(sum(param_bytes(a) for a in args))))
            return out

    with torch.no_grad(), Census():
        model(ids)
    return census


@dataclass
class Facts:
    flops: float
    bytes_read: float
    mm_gflops: float
    copy_gbs: float
    # (FLOPs, weight bytes) per matmul of the forward (matmul_census)
    matmuls: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    read_gbs: float = 0.0  # read_bandwidth(), the best of the cell's measurements (0: not measured)

    def copy_percent(self, ms: float) -> float:
        """The must-read bytes over ``ms`` as a percentage of copy bandwidth (issue 18's decode measure)."""
        return 100 * self.bytes_read / (ms / 1e3) / (self.copy_gbs * 1e9)

    def limits_ms(self) -> tuple[float, float, float]:
        """(FLOPs / mm rate: issue 18's roofline, sum over matmuls of max(FLOPs / mm rate, weight bytes /
        copy BW), sum of both with no overlap) in ms, from this cell's rates."""
        rate, bw = self.mm_gflops * 1e9, self.copy_gbs * 1e9
        flop = sum(f for f, _ in self.matmuls) / rate
        most = sum(max(f / rate, b / bw) for f, b in self.matmuls)
        both = flop + sum(b for _, b in self.matmuls) / bw
        return 1e3 * flop, 1e3 * most, 1e3 * both


def _total_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _batched_mm_bytes(model: torch.nn.Module, tokens: int) -> int:
    """Bytes Hugging Face's ``batched_mm`` experts gather per MoE layer: every routed (token, k)
    pair gets its own copy of its expert's gate_up and down weights (at prefill 1x1024, top-6 of
    64, H=1024: ~19 GB in fp32, which pushes a 24 GiB machine into page-cache thrashing)."""
    cfg = model.config
    per_pair = 3 * cfg.moe_intermediate_size * cfg.hidden_size * next(model.parameters()).element_size()
    return tokens * cfg.num_experts_per_tok * per_pair


def bench(
    shapes: list[str],
    dtypes: list[str],
    variants: list[str],
    reps: int,
    budget_s: float,
    model_name: str = "deepseek_v3",
    on_row: Callable[[Row], None] | None = None,
    cold_cache: bool = False,
    dynamic: bool = False,
) -> tuple[list[Row], dict[tuple[str, str], Facts]]:
    factory, config, _ = MODELS[model_name]
    rows: list[Row] = []
    facts: dict[tuple[str, str], Facts] = {}
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        for shape in shapes:
            batch, tokens = SHAPES[shape]
            model, (ids,) = factory("grouped_mm", num_layers=4, tokens=tokens, batch=batch, dtype=dtype, **config)
            batched, _ = factory("batched_mm", num_layers=4, tokens=tokens, batch=batch, dtype=dtype, **config)
            # the FLOPs: the census's sum (the batched_mm model's FlopCounterMode count, which sessions before
            # 14 used, is the same number but gathers every routed row's expert weight: 18 GiB at fp32 1x1024)
            matmuls = matmul_census(model, ids)
            flops, must_read = sum(f for f, _ in matmuls), must_read_bytes(model, ids)
            # --cold-cache: more instances of the same model (own weights), cycled through by the timing
            n_copies = cold_copies(int(must_read)) if cold_cache else 1
            models = [model] + [
                factory("grouped_mm", num_layers=4, tokens=tokens, batch=batch, dtype=dtype, **config)[0]
                for _ in range(n_copies - 1)
            ]
            batched_models = [batched] + [
                factory("batched_mm", num_layers=4, tokens=tokens, batch=batch, dtype=dtype, **config)[0]
                for _ in range(n_copies - 1 if "inductor_batched_mm" in variants else 0)
            ]
            if cold_cache:
                print(
                    f"  {shape:12s} {dtype_name:9s} {n_copies} copies of the model cycled "
                    f"({must_read / 1e6:.0f} MB read per forward, last-level cache "
                    f"{last_level_cache_bytes() / 1e6:.0f} MB)",
                    flush=True,
                )
            mm_rates, copy_rates, read_rates = [dense_mm_flops(dtype)], [copy_bandwidth()], [read_bandwidth()]
            reference = None
            for variant in variants:
                torch._dynamo.reset()
                gc.collect()  # the previous variant's compiled graph, caches and outputs
                need = _batched_mm_bytes(batched, batch * tokens) if "batched_mm" in variant else 0
                if need > 0.4 * _total_memory():
                    print(
                        f"  {shape:12s} {dtype_name:9s} {variant:20s} skipped: its per-token expert weight "
                        f"gather needs {need / 2**30:.1f} GiB of {_total_memory() / 2**30:.1f} GiB",
                        flush=True,
                    )
                    continue
                instances = batched_models if variant == "inductor_batched_mm" else models
                compiling_calls = 2 if dynamic else 1  # --dynamic: the shorter prompt's compile, then the timed one's
                fn = _compiled(instances[0], variant, compiling_calls)
                # --dynamic: a prompt of another length first, so that the timed length runs the graph Dynamo
                # recompiles with a symbolic token count (automatic dynamic shapes: what a server's prompts of
                # many lengths get); its compile time is then the recompile's
                shorter = ids[:, : max(1, ids.shape[1] // 2)] if dynamic else None
                with torch.no_grad(), ap.capture() as reports:
                    if shorter is not None:
                        fn(shorter)
                    t0 = time.perf_counter()
                    out = fn(ids)
                    compile_s = time.perf_counter() - t0
                    reports[:] = reports[-1:]  # the timed length's graph
                    if reference is None:
                        reference = out
                    err = ((out.float() - reference.float()).abs().max() / reference.float().abs().max()).item()
                fns = [fn] + [_compiled(m, variant, compiling_calls) for m in instances[1:]]
                with torch.no_grad():
                    for other in fns[1:]:
                        if shorter is not None:
                            other(shorter)
                        other(ids)  # compiled (not timed)
                    turn = itertools.count()
                    ms = _time(lambda: fns[next(turn) % len(fns)](ids), reps, budget_s)
                    guards = (
                        _guards_ms(lambda: fns[next(turn) % len(fns)](ids), reps, budget_s)
                        if shape == "decode" and variant != "eager"
                        else None
                    )
                rewrites = f"rel err {err:.1e}"
                if reports:
                    ops = reports[0].rewritten_ops()
                    rewrites = f"{sum(ops.values())} fused ops, rel err {err:.1e}"
                rows.append(
                    Row(shape, dtype_name, variant, ms, compile_s if variant != "eager" else 0.0, rewrites, guards)
                )
                if on_row is not None:
                    on_row(rows[-1])
                print(
                    f"  {shape:12s} {dtype_name:9s} {variant:20s} {ms:9.2f} ms  compile {compile_s:6.1f} s  "
                    f"{rows[-1].notes}",
                    flush=True,
                )
                # the limits between the variants: their best is this cell's limit
                mm_rates.append(dense_mm_flops(dtype, 0.2))
                copy_rates.append(copy_bandwidth(0.2))
                read_rates.append(read_bandwidth(0.2))
                fn = fns = out = reports = None  # freed before the next variant compiles
            facts[(shape, dtype_name)] = Facts(
                flops, must_read, max(mm_rates), max(copy_rates), matmuls, max(read_rates)
            )
            del model, batched, reference, models, batched_models
            torch._dynamo.reset()
            gc.collect()
    return rows, facts


def print_table(rows: list[Row], facts: dict[tuple[str, str], Facts], model_name: str = "deepseek_v3") -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{MODELS[model_name][2]}: median ms per forward")
    for col in ("shape", "dtype", "variant", "ms", "vs eager", "vs best peer", "of limit", "compile s", "notes"):
        table.add_column(
            col, justify="right" if col in ("ms", "vs eager", "vs best peer", "of limit", "compile s") else "left"
        )
    base = {(r.shape, r.dtype, r.variant): r.median_ms for r in rows}

    def best(shape: str, dtype: str, ascend: bool) -> float | None:
        times = [
            r.median_ms
            for r in rows
            if (r.shape, r.dtype) == (shape, dtype) and r.variant.startswith("ascend") == ascend
        ]
        return min(times) if times else None

    def of_limit(r: Row) -> str:
        f = facts.get((r.shape, r.dtype))
        if f is None:  # the cell's process died before it measured the limits
            return "-"
        if r.shape == "decode":  # bytes the forward must read over copy bandwidth
            return f"{f.copy_percent(r.median_ms):.0f}% BW"
        return f"{100 * f.flops / (r.median_ms / 1e3) / (f.mm_gflops * 1e9):.0f}% mm"

    for r in rows:
        eager = base.get((r.shape, r.dtype, "eager"))
        peer = best(r.shape, r.dtype, ascend=False)
        table.add_row(
            r.shape,
            r.dtype,
            r.variant,
            f"{r.median_ms:.2f}",
            f"{eager / r.median_ms:.2f}x" if eager else "-",
            f"{peer / r.median_ms:.2f}x" if peer else "-",
            of_limit(r),
            f"{r.compile_s:.1f}",
            r.notes,
        )
    console = Console(width=180)
    console.print(table)
    console.print(
        "'vs best peer': against the fastest of the non-ascend variants of that shape and dtype; "
        "'of limit': prefill = matmul FLOPs / time / dense mm rate (FLOP-only roofline; the rate: the faster of "
        "torch.mm and ascend.linear on [2048,1024]x[1024,4096]), decode = bytes the "
        "forward must read / time / copy bandwidth; 'guards' (decode, compiled): how much of the median is Dynamo's "
        "guard evaluation (median of paired calls with and without it)"
    )
    for (shape, dtype), f in facts.items():
        console.print(
            f"  {shape} {dtype}: matmul {f.flops / 1e9:.2f} GFLOP, dense mm {f.mm_gflops:.0f} GFLOP/s "
            f"(roofline {1e3 * f.flops / (f.mm_gflops * 1e9):.1f} ms), must read {f.bytes_read / 1e6:.1f} MB, "
            f"copy {f.copy_gbs:.1f} GB/s ({1e3 * f.bytes_read / (f.copy_gbs * 1e9):.2f} ms)"
            + (f", read {f.read_gbs:.1f} GB/s ({1e3 * f.bytes_read / (f.read_gbs * 1e9):.2f} ms)" if f.read_gbs else "")
        )
        ours = best(shape, dtype, True)
        if shape == "decode" and ours and f.read_gbs:
            console.print(
                f"    best ascend {ours:.2f} ms reads the must-read bytes at "
                f"{100 * f.bytes_read / (ours / 1e3) / (f.read_gbs * 1e9):.0f}% of read bandwidth "
                f"({f.copy_percent(ours):.0f}% of copy bandwidth, issue 18's measure)"
            )
            unguarded = [
                r.unguarded_ms
                for r in rows
                if (r.shape, r.dtype) == (shape, dtype)
                and r.variant.startswith("ascend")
                and r.unguarded_ms is not None
            ]
            if unguarded:
                fastest = min(unguarded)
                console.print(
                    f"    with Dynamo's guard evaluation skipped (set_stance skip_guard_eval_unsafe: a serving "
                    f"engine's view) best ascend {fastest:.2f} ms, {f.copy_percent(fastest):.0f}% of copy bandwidth"
                )
        if shape != "decode" and f.matmuls and ours:
            flop, most, both = f.limits_ms()
            weights = sum(b for _, b in f.matmuls)
            console.print(
                f"    limits: FLOP-only roofline {flop:.1f} ms ({100 * flop / ours:.0f}% reached, issue 18's "
                f"fraction); per matmul max(FLOPs / mm rate, weight bytes / copy BW) {most:.1f} ms "
                f"({100 * most / ours:.0f}%); FLOPs + weight reads with no overlap {both:.1f} ms "
                f"({weights / 1e6:.0f} MB of weights); best ascend {ours:.1f} ms"
            )
    for shape in {r.shape for r in rows}:
        ours_bf16, ours_fp32 = best(shape, "bfloat16", True), best(shape, "float32", True)
        peer_bf16 = best(shape, "bfloat16", False)
        parts = []
        if ours_bf16 and ours_fp32:
            parts.append(f"bf16 ascend vs fp32 ascend {ours_fp32 / ours_bf16:.2f}x")
        if ours_bf16 and peer_bf16:
            parts.append(f"bf16 ascend vs best bf16 peer {peer_bf16 / ours_bf16:.2f}x")
        if parts:
            console.print(f"  issue 18, {shape}: " + ", ".join(parts))


def _write_cell(path: Path, rows: list[Row], facts: dict[tuple[str, str], Facts]) -> None:
    """One JSON object per line: each row as it is measured (``on_row``), then the cell's limits."""
    with path.open("a") as f:
        for r in rows:
            f.write(json.dumps({"row": dataclasses.asdict(r)}) + "\n")
        for (shape, dtype), fact in facts.items():
            f.write(json.dumps({"facts": [shape, dtype, dataclasses.asdict(fact)]}) + "\n")


def _read_cell(path: Path) -> tuple[list[Row], dict[tuple[str, str], Facts]]:
    rows: list[Row] = []
    facts: dict[tuple[str, str], Facts] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            item = json.loads(line)
            if "row" in item:
                rows.append(Row(**item["row"]))
            else:
                shape, dtype, fact = item["facts"]
                fact["matmuls"] = [tuple(m) for m in fact.get("matmuls", [])]
                facts[(shape, dtype)] = Facts(**fact)
    return rows, facts


def run_cells(
    shapes: list[str],
    dtypes: list[str],
    variants: list[str],
    reps: int,
    budget_s: float,
    model_name: str,
    allocator: str,
    huge_pages: str,
    cold_cache: bool = False,
    dynamic: bool = False,
) -> tuple[list[Row], dict[tuple[str, str], Facts]]:
    """Each (dtype, shape) in a process of its own: a model, its ``batched_mm`` twin and the compiled
    variants of one cell fit in memory where those of every cell in one process did not (24 GiB: the
    fp32 + bf16 run was OOM-killed). A cell whose process dies keeps the rows it printed before."""
    rows: list[Row] = []
    facts: dict[tuple[str, str], Facts] = {}
    with tempfile.TemporaryDirectory(prefix="bench_model_") as tmp:
        for dtype in dtypes:
            for shape in shapes:
                out = Path(tmp) / f"{shape}_{dtype}.jsonl"
                cmd = [
                    sys.executable,
                    str(Path(__file__).resolve()),
                    f"--model={model_name}",
                    f"--shapes={shape}",
                    f"--dtypes={dtype}",
                    f"--variants={','.join(variants)}",
                    f"--reps={reps}",
                    f"--budget={budget_s}",
                    f"--allocator={allocator}",
                    f"--huge-pages={huge_pages}",
                    f"--cell-output={out}",
                    *(["--cold-cache"] if cold_cache else []),
                    *(["--dynamic"] if dynamic else []),
                ]
                returncode = subprocess.run(cmd, check=False).returncode
                cell_rows, cell_facts = _read_cell(out)
                if returncode != 0:
                    print(
                        f"  {shape:12s} {dtype:9s} the cell's process exited with {returncode} "
                        f"(-9: killed, out of memory?); {len(cell_rows)} of its rows were measured",
                        flush=True,
                    )
                rows += cell_rows
                facts.update(cell_facts)
    return rows, facts


def main() -> None:
    # Hugging Face's grouped_mm check calls an lru_cache'd version test inside the traced forward, and Dynamo warns
    # about it at each variant's compile (20 lines each, about transformers' code, not what is measured)
    warnings.filterwarnings("ignore", message="Dynamo detected a call to a `functools.lru_cache`-wrapped function")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="deepseek_v3")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--budget", type=float, default=3.0, help="seconds of timing per cell")
    parser.add_argument("--quick", action="store_true", help="float32 only, 5 repetitions")
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
    parser.add_argument(
        "--in-process", action="store_true", help="measure every cell in this process (default: one process per cell)"
    )
    parser.add_argument(
        "--cold-cache",
        action="store_true",
        help="time forwards cycling over copies of the model whose weights together exceed the last-level cache: "
        "each forward reads its weights from memory, as a real model's decode does (weights of GBs)",
    )
    parser.add_argument(
        "--dynamic",
        action="store_true",
        help="each variant first runs a prompt of half the length, so that the timed length runs the graph Dynamo "
        "recompiles with a symbolic token count (automatic dynamic shapes: a server's prompts of many lengths)",
    )
    parser.add_argument("--cell-output", default="", help=argparse.SUPPRESS)  # a cell's process: rows go here
    args = parser.parse_args()
    allocator = _allocator.ensure(args.allocator, args.huge_pages)
    dtypes = ["float32"] if args.quick else args.dtypes.split(",")
    reps = 5 if args.quick else args.reps
    shapes, variants = args.shapes.split(","), args.variants.split(",")
    for name, given, known in (("--shapes", shapes, SHAPES), ("--variants", variants, VARIANTS)):
        unknown = [v for v in given if v not in known]
        if unknown:
            parser.error(f"{name}: unknown {', '.join(unknown)} (known: {', '.join(known)})")
    torch.manual_seed(0)
    cell = (shapes, dtypes, variants, reps, args.budget, args.model)
    if args.cell_output:  # one cell, in the process the parent started for it
        out = Path(args.cell_output)
        _, facts = bench(
            *cell, on_row=lambda r: _write_cell(out, [r], {}), cold_cache=args.cold_cache, dynamic=args.dynamic
        )
        _write_cell(out, [], facts)
        return
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, ascend kernels: "
        f"{__import__('ascend_passes.kernels', fromlist=['available']).available()}; {allocator}"
    )
    print(cpu_features_line())
    llc = last_level_cache_bytes()
    print(
        f"last-level cache {llc / 2**20:.0f} MiB; "
        + (
            "weights out of it: forwards cycle over copies of the model whose reads exceed it (--cold-cache)"
            if args.cold_cache
            else "forwards timed back to back (weights that fit in it may be read from it; see --cold-cache)"
        )
    )
    if args.dynamic:
        print(
            "--dynamic: each variant ran a prompt of half the length first; "
            "the timed graphs have a symbolic token count"
        )
    if args.in_process:
        rows, facts = bench(*cell, cold_cache=args.cold_cache, dynamic=args.dynamic)
    else:
        rows, facts = run_cells(*cell, args.allocator, args.huge_pages, args.cold_cache, args.dynamic)
    print_table(rows, facts, args.model)


if __name__ == "__main__":
    main()
