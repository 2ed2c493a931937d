"""Sequence-parallel benchmark: TP vs TP+SP vs TP+SP+shared-expert-DP on the TP DeepSeek-V3 (issue 6, item 5).

Real ranks (``torch.multiprocessing`` spawn + gloo, one thread each) run
:func:`ascend_passes.models_tp.deepseek_v3_tp` (bundled tiny config, ``--layers`` layers, hidden size
``--hidden``) compiled with ``backend="ascend_passes"`` in four variants:

- ``TP (shared TP)``: the classic baseline, shared expert sharded along I (``shared_expert="tp"``);
- ``TP``: replicated shared expert (``shared_expert="replicated"``), no SP — the baseline of the ratios;
- ``TP+SP``: replicated shared expert, ``sequence_parallel=True``;
- ``TP+SP+DP``: replicated shared expert, ``sequence_parallel=True, shared_expert_dp=True``.

Static per-rank numbers are read off rank 0's final fx graph (``ascend_passes.capture()``), per layer
(``layer_of(node)``; nodes outside any decoder layer — embedding, final norm, LM head — are "outside"):

- norm FLOPs: per ``ascend.rms_norm`` / ``ascend.add_rms_norm`` node, 4 × numel of its first input
  (+1 × numel for the residual add of ``add_rms_norm``). This includes every fused norm (the residual-stream
  norms and, where they are not folded into ``ascend.mla``, attention's latent ``q_a``/``kv_a`` norms, which SP
  does not shard);
- activation bytes: bytes of all tensor outputs of the norm nodes (normed values, new residuals, rstd) plus the
  bytes of the outputs of the collectives (all_reduce / reduce_scatter / all_gather) — i.e. the residual-stream
  tensors the rank materialises around its norms. Not a peak-memory figure;
- collective bytes sent per rank (ring algorithms): ``all_reduce`` 2·(W−1)/W · bytes,
  ``reduce_scatter_tensor`` (W−1)/W · input bytes, ``all_gather_into_tensor`` (W−1)/W · output bytes;
- shared-expert matmul FLOPs: 2·M·N·K of the ``aten.mm`` / ``aten.addmm`` nodes whose module path contains
  ``shared_experts``.

Wall time: median ms per forward over ``--iters`` iterations (after a warm-up call), the variants timed
round-robin (same machine load for all); every iteration starts after a barrier and its time is the maximum
over the ranks. Ratios are "this variant / TP" (below 1 is less
work, bytes or time). gloo on a shared 2-core box: collectives are TCP loopback with a fixed per-call latency,
so at these sizes the wall time says more about collective count than about bytes.

    python tools/bench_sp.py                        # world 2, tokens 256 and 8 (~2 min on 2 cores)
    python tools/bench_sp.py --world-sizes 2,4 --per-layer
    python tools/bench_sp.py --compiler inductor --tokens 256
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from typing import Any

import torch

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "TP (shared TP)": ("tp", {}),
    "TP": ("replicated", {}),
    "TP+SP": ("replicated", {"sequence_parallel": True}),
    "TP+SP+DP": ("replicated", {"sequence_parallel": True, "shared_expert_dp": True}),
}
BASELINE = "TP"
METRICS = ("norm_flops", "act_bytes", "coll_bytes", "shared_flops")
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")
JOIN_TIMEOUT_S = 900.0


# ------------------------------------------------------------------------------------------ graph read-off
def _tensors(val: Any) -> list[torch.Tensor]:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (tuple, list)):
        return [t for v in val for t in _tensors(v)]
    return []


def _nbytes(val: Any) -> int:
    return sum(int(t.numel()) * t.element_size() for t in _tensors(val))


def _val(node: Any) -> Any:
    return node.meta.get("val") if hasattr(node, "meta") else None


def graph_stats(gm: torch.fx.GraphModule, world_size: int) -> dict[str, dict[str, float]]:
    """Per layer (``layer_of``; None → "outside"): the metrics of the module docstring and collective counts."""
    from ascend_passes.passes.layers import layer_of, module_path
    from ascend_passes.report import op_name

    w = world_size
    out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        name = op_name(node.target)
        if name is None:
            continue
        row = out[layer_of(node) or "outside"]
        if name in ("ascend.rms_norm", "ascend.add_rms_norm"):
            numel = int(_val(node.args[0]).numel())
            row["norm_flops"] += 4 * numel + (numel if name == "ascend.add_rms_norm" else 0)
            row["norm_out_bytes"] += _nbytes(_val(node))
            row["norms"] += 1
        elif name == "_c10d_functional.all_reduce":
            b = _nbytes(_val(node))
            row["coll_bytes"] += 2 * (w - 1) / w * b
            row["coll_out_bytes"] += b
            row["all_reduce"] += 1
        elif name == "_c10d_functional.reduce_scatter_tensor":
            row["coll_bytes"] += (w - 1) / w * _nbytes(_val(node.args[0]))
            row["coll_out_bytes"] += _nbytes(_val(node))
            row["reduce_scatter"] += 1
        elif name == "_c10d_functional.all_gather_into_tensor":
            b = _nbytes(_val(node))
            row["coll_bytes"] += (w - 1) / w * b
            row["coll_out_bytes"] += b
            row["all_gather"] += 1
        elif name in ("aten.mm", "aten.addmm") and "shared_experts" in (module_path(node) or ""):
            a, b = (node.args[0], node.args[1]) if name == "aten.mm" else (node.args[1], node.args[2])
            (m, k), (_, n) = _val(a).shape, _val(b).shape
            row["shared_flops"] += 2 * int(m) * int(n) * int(k)
            row["shared_mms"] += 1
    for row in out.values():
        row["act_bytes"] = row["norm_out_bytes"] + row["coll_out_bytes"]
    return {layer: dict(row) for layer, row in out.items()}


def _layer_key(layer: str) -> tuple[int, int, str]:
    if layer == "outside":
        return (2, 0, layer)
    tail = layer.rsplit(".", 1)[-1]
    return (0 if "layers" in layer else 1, int(tail) if tail.isdigit() else 0, layer)


# ------------------------------------------------------------------------------------------ ranks
def _rank(rank: int, world_size: int, args: argparse.Namespace) -> list[dict[str, Any]]:  # a spawned rank
    import torch.distributed as dist

    rows: list[dict[str, Any]] = []
    import ascend_passes as ap
    from ascend_passes import models_tp

    tokens_list = [int(t) for t in args.tokens.split(",")]
    built: dict[str, tuple[torch.nn.Module, torch.Tensor]] = {}
    for shared in sorted({VARIANTS[v][0] for v in args.variants}):
        model, (ids,) = models_tp.deepseek_v3_tp(
            rank,
            world_size,
            shared_expert=shared,
            num_layers=args.layers,
            tokens=max(tokens_list),
            hidden_size=args.hidden,
        )
        built[shared] = (model, ids)
    for tokens in tokens_list:
        # compile every variant first (Dynamo keeps one cache entry per backend), then time them
        # round-robin so that load from other processes hits all variants alike
        torch._dynamo.reset()
        reference = None
        cells: list[dict[str, Any]] = []
        for variant in args.variants:
            shared, extra = VARIANTS[variant]
            model, ids = built[shared]
            ids = ids[:, :tokens].contiguous()
            compiled = torch.compile(
                model,
                backend="ascend_passes",
                fullgraph=True,
                dynamic=False,
                options={"compiler": args.compiler, **extra},
            )
            with torch.no_grad(), ap.capture() as reports:
                dist.barrier()
                t0 = time.perf_counter()
                out = compiled(ids)
                compile_s = time.perf_counter() - t0
                compiled(ids)  # warm-up; must not recompile
            if len(reports) != 1:
                raise RuntimeError(f"{variant}: expected one compiled graph, got {len(reports)}")
            if reference is None:
                reference = out
            err = ((out - reference).abs().max() / reference.abs().max()).item()
            cells.append(
                {
                    "variant": variant,
                    "fn": compiled,
                    "ids": ids,
                    "compile_s": compile_s,
                    "err": err,
                    "report": reports[0],
                    "times": [],
                }
            )
        with torch.no_grad(), ap.capture() as late:
            for _ in range(args.iters):
                for c in cells:
                    dist.barrier()
                    t0 = time.perf_counter()
                    c["fn"](c["ids"])
                    c["times"].append(time.perf_counter() - t0)
        if late:
            raise RuntimeError(f"{len(late)} recompilation(s) while timing")
        for c in cells:
            t = torch.tensor(c["times"], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # an iteration lasts as long as its slowest rank
            ms = statistics.median(t.tolist()) * 1e3
            if rank == 0:
                rows.append(
                    {
                        "world": world_size,
                        "tokens": tokens,
                        "variant": c["variant"],
                        "ms": ms,
                        "compile_s": c["compile_s"],
                        "err": c["err"],
                        "layers": graph_stats(c["report"].graph, world_size),
                    }
                )
                print(
                    f"  W={world_size} T={tokens:4d} {c['variant']:15s} {ms:8.2f} ms  "
                    f"compile {c['compile_s']:5.1f} s  rel err vs first variant {c['err']:.1e}",
                    flush=True,
                )
    return rows


def run_world(world_size: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    from ascend_passes.spawn import run_on_ranks

    return run_on_ranks(_rank, world_size, args, timeout_s=JOIN_TIMEOUT_S)[0]


# ------------------------------------------------------------------------------------------ tables
def _total(row: dict[str, Any], key: str) -> float:
    return sum(layer.get(key, 0.0) for layer in row["layers"].values())


def _cell(value: float, base: float | None, scale: float, fmt: str = "{:.2f}") -> str:
    text = fmt.format(value / scale)
    if base:
        text += f" ({value / base:.2f}x)"
    return text


_CAPTION = (
    "Per rank, read off rank 0's final graph. norm = 4·numel (+1·numel add) per ascend.\\[add_]rms_norm; "
    "act = bytes of all norm outputs + collective outputs; coll = bytes sent, ring (AR 2(W-1)/W, RS/AG "
    "(W-1)/W); shared = 2MNK of shared-expert mm; ms = median per forward, slowest rank, gloo. "
    "(x) = this / " + BASELINE + "."
)


def print_totals(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"TP vs SP vs SP+shared-expert-DP: DeepSeek-V3 TP, {args.layers} layers, H={args.hidden}, "
        f"compiler={args.compiler}",
        caption=_CAPTION,
    )
    cols = ("W", "T", "variant", "AR/RS/AG", "norm MFLOP", "act KiB", "coll KiB", "shared MFLOP", "ms", "compile s")
    for col in cols:
        table.add_column(col, justify="left" if col in ("variant", "AR/RS/AG") else "right")
    by = {(r["world"], r["tokens"], r["variant"]): r for r in rows}
    for r in rows:
        base = by.get((r["world"], r["tokens"], BASELINE))
        tot = {k: _total(r, k) for k in (*METRICS, *COLLECTIVES)}
        btot = {k: _total(base, k) for k in METRICS} if base else {}
        table.add_row(
            str(r["world"]),
            str(r["tokens"]),
            r["variant"],
            "/".join(str(int(tot[c])) for c in COLLECTIVES),
            _cell(tot["norm_flops"], btot.get("norm_flops"), 1e6, "{:.3f}"),
            _cell(tot["act_bytes"], btot.get("act_bytes"), 1024, "{:.0f}"),
            _cell(tot["coll_bytes"], btot.get("coll_bytes"), 1024, "{:.0f}"),
            _cell(tot["shared_flops"], btot.get("shared_flops"), 1e6, "{:.2f}"),
            _cell(r["ms"], base["ms"] if base else None, 1.0),
            f"{r['compile_s']:.1f}",
        )
    Console(width=180).print(table)


def print_per_layer(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=180)
    for world, tokens in sorted({(r["world"], r["tokens"]) for r in rows}):
        table = Table(title=f"Per layer, W={world}, T={tokens} (per rank; (x) = this / {BASELINE}, same layer)")
        for col in (
            "layer",
            "variant",
            "AR/RS/AG",
            "norms",
            "norm MFLOP",
            "norm out KiB",
            "coll out KiB",
            "coll KiB",
            "shared MFLOP",
        ):
            table.add_column(col, justify="left" if col in ("layer", "variant", "AR/RS/AG") else "right")
        cell = [r for r in rows if (r["world"], r["tokens"]) == (world, tokens)]
        base = next((r for r in cell if r["variant"] == BASELINE), None)
        layers = sorted({layer for r in cell for layer in r["layers"]}, key=_layer_key)
        for layer in layers:
            for i, r in enumerate(cell):
                d = r["layers"].get(layer, {})
                b = base["layers"].get(layer, {}) if base else {}
                table.add_row(
                    layer if i == 0 else "",
                    r["variant"],
                    "/".join(str(int(d.get(c, 0))) for c in COLLECTIVES),
                    str(int(d.get("norms", 0))),
                    _cell(d.get("norm_flops", 0.0), b.get("norm_flops"), 1e6, "{:.3f}"),
                    _cell(d.get("norm_out_bytes", 0.0), b.get("norm_out_bytes"), 1024, "{:.0f}"),
                    _cell(d.get("coll_out_bytes", 0.0), b.get("coll_out_bytes"), 1024, "{:.0f}"),
                    _cell(d.get("coll_bytes", 0.0), b.get("coll_bytes"), 1024, "{:.0f}"),
                    _cell(d.get("shared_flops", 0.0), b.get("shared_flops"), 1e6, "{:.2f}"),
                    end_section=i == len(cell) - 1,
                )
        console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", default="2", help="comma-separated TP sizes (2, 4)")
    parser.add_argument("--tokens", default="256,8", help="comma-separated token counts (batch 1)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (layer 0 dense, the rest MoE)")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size (the tiny config's is 64)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--compiler", default="eager", choices=("eager", "inductor"))
    parser.add_argument("--iters", type=int, default=15, help="timed forwards per variant")
    parser.add_argument("--per-layer", action="store_true", help="also print per-layer tables")
    args = parser.parse_args()
    args.variants = [v.strip() for v in args.variants.split(",")]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    print(f"torch {torch.__version__}, gloo, 1 thread per rank, compiler={args.compiler}", flush=True)
    rows: list[dict[str, Any]] = []
    for world in (int(w) for w in args.world_sizes.split(",")):
        rows += run_world(world, args)
    print_totals(rows, args)
    if args.per_layer:
        print_per_layer(rows)


if __name__ == "__main__":
    main()
