"""Benchmark the EPLB placement algorithm on Zipf-skewed expert loads at DeepSeek-V3 scale.

Prints, per policy, the time to place every layer and the balance reached (max rank load over
mean rank load, mean and worst over layers) next to a lower bound no placement of that kind can
beat, then the same before/after comparison at the tiny scale the tests use.

    python tools/bench_eplb.py                   # 58 MoE + 1 MTP layers, 256 experts, 32 redundant
    python tools/bench_eplb.py --seed 3 --zipf 1.3
    python tools/bench_eplb.py --gloo 4          # + real EP ranks (gloo processes), ~30 s

Load model: for every layer, expert popularity ``1 / k**s`` (Zipf, k = 1..E) over a random
permutation of the experts (seeded), and token counts drawn as Poisson(tokens * share).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable, Iterator

import torch

from ascend_passes.eplb import (
    balance_ratio,
    default_placement,
    rank_loads,
    rebalance_experts,
    replicate_experts,
)


def zipf_loads(layers: int, experts: int, s: float, tokens: int, seed: int) -> torch.Tensor:
    """``[layers, experts]`` int64 token counts, Zipf(s) popularity, experts shuffled per layer."""
    gen = torch.Generator().manual_seed(seed)
    share = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** s
    share /= share.sum()
    rows = torch.stack([share[torch.randperm(experts, generator=gen)] for _ in range(layers)])
    return torch.poisson(rows * tokens, generator=gen).long()


def min_max_per_replica(load: torch.Tensor, slots: int) -> torch.Tensor:
    """``[B]`` least possible heaviest load per replica with ``slots`` replicas (greedy: exact)."""
    _, _, logcnt = replicate_experts(load, slots)
    return (load.double() / logcnt).max(dim=-1).values


def global_bound(load: torch.Tensor, slots: int, ranks: int) -> torch.Tensor:
    """``[L]`` lower bound on max/mean for any placement: a rank carries at least the mean, and
    at least one replica, which is at least the min-max load per replica."""
    mean = load.double().sum(-1) / ranks
    return torch.maximum(mean, min_max_per_replica(load, slots)) / mean


def equal_partitions(items: tuple[int, ...], size: int) -> Iterator[list[tuple[int, ...]]]:
    """Every way to split ``items`` into unordered blocks of ``size`` (8 groups / 4 nodes: 105)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for others in itertools.combinations(rest, size - 1):
        block = (first, *others)
        remaining = tuple(i for i in rest if i not in others)
        for tail in equal_partitions(remaining, size):
            yield [block, *tail]


def hierarchical_bound(load: torch.Tensor, slots: int, groups: int, nodes: int, ranks: int) -> torch.Tensor:
    """``[L]`` lower bound on max/mean when whole expert groups stay on one node.

    Minimum over every assignment of groups to nodes of the maximum over nodes of
    ``max(node load / ranks per node, min-max load per replica with the node's slots)``: within
    its node a rank carries at least the node's mean and at least one replica.
    """
    layers, experts = load.shape
    group_size = experts // groups
    per_node = groups // nodes
    grouped = load.double().view(layers, groups, group_size)
    blocks = list(itertools.combinations(range(groups), per_node))
    block_bound = torch.stack(
        [
            torch.maximum(
                grouped[:, list(block)].sum((1, 2)) / (ranks // nodes),
                min_max_per_replica(grouped[:, list(block)].reshape(layers, -1), slots // nodes),
            )
            for block in blocks
        ],
        dim=1,
    )  # [L, blocks]
    index = {block: i for i, block in enumerate(blocks)}
    partitions = torch.tensor(
        [[index[b] for b in p] for p in equal_partitions(tuple(range(groups)), per_node)]
    )  # [partitions, nodes]
    best = block_bound[:, partitions].max(dim=-1).values.min(dim=-1).values
    return best / (load.double().sum(-1) / ranks)


def timed(fn: Callable[[], torch.Tensor], repeat: int) -> tuple[torch.Tensor, float, float]:
    """Result of ``fn`` after one warm-up, with the min and median wall time of ``repeat`` runs."""
    result = fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return result, min(times), statistics.median(times)


def print_table(title: str, columns: list[str], rows: list[list[str]]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # plain text
        widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]
        print(f"\n{title}")
        print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
        for row in rows:
            print("  ".join(v.ljust(w) for v, w in zip(row, widths)))
        return
    table = Table(title=title)
    for i, column in enumerate(columns):
        table.add_column(column, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*row)
    Console(width=max(Console().width, 132)).print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--moe-layers", type=int, default=58)
    parser.add_argument("--mtp-layers", type=int, default=1)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--redundant", type=int, default=32)
    parser.add_argument("--ranks", type=int, default=32)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent s")
    parser.add_argument("--tokens", type=int, default=1 << 20, help="routed tokens per layer")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per policy")
    parser.add_argument(
        "--forward",
        action="store_true",
        help="also time the forward pass of the bundled deepseek_v3 with and without the EPLB indirection (R = 0)",
    )
    parser.add_argument(
        "--gloo",
        type=int,
        default=0,
        metavar="W",
        help="also run the bundled deepseek_v3 with expert parallelism over W real "
        "gloo processes, a Zipf-skewed router, and report the per-rank recorded "
        "loads before and after rebalance()",
    )
    args = parser.parse_args()

    layers = args.moe_layers + args.mtp_layers
    slots = args.experts + args.redundant
    load = zipf_loads(layers, args.experts, args.zipf, args.tokens, args.seed)

    def ratios(phy2log: torch.Tensor) -> torch.Tensor:
        return balance_ratio(rank_loads(phy2log, load, args.ranks))

    glob = global_bound(load, slots, args.ranks)
    hier = hierarchical_bound(load, slots, args.groups, args.nodes, args.ranks)

    def place(groups: int, nodes: int, refine: bool) -> Callable[[], torch.Tensor]:
        return lambda: rebalance_experts(load, slots, groups, nodes, args.ranks, refine=refine)[0]

    hierarchy = (args.groups, args.nodes)
    policies = [
        ("default (no rebalance)", lambda: default_placement(layers, args.experts, args.redundant, args.ranks), None),
        ("global, greedy only", place(1, 1, refine=False), glob),
        ("global", place(1, 1, refine=True), glob),
        ("hierarchical, greedy only", place(*hierarchy, refine=False), hier),
        ("hierarchical", place(*hierarchy, refine=True), hier),
    ]
    rows = []
    for name, fn, bound in policies:
        phy2log, fastest, median = timed(fn, args.repeat)
        ratio = ratios(phy2log)
        rows.append(
            [
                name,
                f"{fastest:.3f} / {median:.3f}",
                f"{ratio.mean():.4f}",
                f"{ratio.max():.4f}",
                "" if bound is None else f"{bound.mean():.4f}",
                "" if bound is None else f"{bound.max():.4f}",
                "" if bound is None else f"{(ratio / bound).mean():.4f}",
            ]
        )
    print_table(
        f"EPLB placement, {args.moe_layers}+{args.mtp_layers} layers, {args.experts} experts + "
        f"{args.redundant} redundant on {args.ranks} ranks ({args.nodes} nodes, {args.groups} "
        f"groups), Zipf({args.zipf}), seed {args.seed}, {torch.get_num_threads()} threads",
        ["policy", "time s (min / median)", "max/mean: mean", "worst", "bound: mean", "worst", "achieved / bound"],
        rows,
    )
    print(
        "bound, global: max(mean rank load, min-max load per replica) / mean.\n"
        "bound, hierarchical: min over all assignments of whole groups to nodes "
        f"({sum(1 for _ in equal_partitions(tuple(range(args.groups)), args.groups // args.nodes))}"
        " here) of max over nodes of max(node load / ranks per node, min-max load per replica "
        "with the node's slots), over the mean rank load."
    )

    # tiny scale, as in the tests: 16 experts, 4 redundant, EP 4
    small = zipf_loads(64, 16, args.zipf, 4096, args.seed + 1)
    before = balance_ratio(rank_loads(default_placement(64, 16, 4, 4), small, 4))
    after = balance_ratio(rank_loads(rebalance_experts(small, 20, 1, 1, 4)[0], small, 4))
    bound = global_bound(small, 20, 4)
    print_table(
        f"Tiny scale: 16 experts + 4 redundant on EP 4, Zipf({args.zipf}), 64 random layers",
        ["placement", "max/mean: mean", "worst"],
        [
            ["default (in order, copies of 0..3 appended)", f"{before.mean():.4f}", f"{before.max():.4f}"],
            ["rebalanced (global)", f"{after.mean():.4f}", f"{after.max():.4f}"],
            ["lower bound", f"{bound.mean():.4f}", f"{bound.max():.4f}"],
        ],
    )
    if args.forward:
        forward_cost(repeat=max(args.repeat, 20))
    if args.gloo:
        real_ranks(args.gloo, args.zipf, args.seed)


def _rank_worker(
    rank: int, world: int, redundant: int, tokens: int, zipf: float, seed: int, port: int, results
) -> None:  # a spawned EP rank
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        from ascend_passes import models
        from ascend_passes.eplb.state import attach

        model, inputs = models.deepseek_v3("grouped_mm", tokens=tokens, seed=seed)
        gen = torch.Generator().manual_seed(seed)
        share = 1.0 / torch.arange(1, 17, dtype=torch.float32) ** zipf
        with torch.no_grad():  # a Zipf-skewed router: the selection bias favours popular experts
            for name, buf in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buf.copy_(share[torch.randperm(16, generator=gen)])
            ref = model(*inputs)
        eplb = {"num_redundant_experts": redundant, "ep_size": world}
        state = attach(model, eplb)
        compiled = torch.compile(
            model, backend="ascend_passes", options={"compiler": "eager", "eplb": {"enabled": True, **eplb}}
        )

        def rank_load() -> torch.Tensor:  # [layers] tokens this rank's slots computed
            return state.physical_load().sum(-1)

        with torch.no_grad():
            compiled(*inputs)
        before = rank_load()
        state.rebalance()  # collective: all-reduced load, weights moved between ranks
        with torch.no_grad():
            out = compiled(*inputs)
        err = ((out - ref).abs().max() / ref.abs().max()).item()
        results.put((rank, before.tolist(), rank_load().tolist(), err))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def real_ranks(world: int, zipf: float, seed: int, redundant: int = 4, tokens: int = 256) -> None:
    """Expert parallelism over ``world`` gloo processes: max/mean rank load from the ranks'
    recorded loads, before and after a collective ``rebalance()`` on the same inputs."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_rank_worker, args=(r, world, redundant, tokens, zipf, seed, port, results), daemon=True)
        for r in range(world)
    ]
    start = time.perf_counter()
    for p in procs:
        p.start()
    got = sorted(results.get(timeout=300) for _ in range(world))
    for p in procs:
        p.join(timeout=30)
    before = torch.tensor([g[1] for g in got], dtype=torch.float64)  # [ranks, layers]
    after = torch.tensor([g[2] for g in got], dtype=torch.float64)

    def ratio(load: torch.Tensor) -> torch.Tensor:
        return load.max(0).values / load.mean(0)

    rb, ra = ratio(before), ratio(after)
    print_table(
        f"Real EP ranks: deepseek_v3 tiny (2 MoE layers, 16 experts + {redundant} redundant, "
        f"top-4) over {world} gloo processes, {tokens} tokens, Zipf({zipf})-biased router, "
        f"{time.perf_counter() - start:.0f} s",
        ["placement", "max/mean rank load: mean", "worst", "tokens per rank (layer 1)"],
        [
            ["default", f"{rb.mean():.4f}", f"{rb.max():.4f}", str([int(x) for x in before[:, 0]])],
            ["after rebalance()", f"{ra.mean():.4f}", f"{ra.max():.4f}", str([int(x) for x in after[:, 0]])],
        ],
    )
    print(f"outputs vs the uncompiled single-process model after rebalance: max rel. diff {max(g[3] for g in got):.2e}")


def forward_cost(repeat: int, tokens: int = 16) -> None:
    """Forward time of the bundled deepseek_v3 (2 MoE layers) compiled without EPLB and with the
    EPLB indirection at R = 0 (map + load counting, same placement), eager downstream compiler."""
    import copy

    from ascend_passes import models
    from ascend_passes.eplb.state import attach

    base, inputs = models.deepseek_v3("grouped_mm", tokens=tokens)
    variants = {
        "no EPLB": (base, {}),
        "EPLB R=0, recording": (copy.deepcopy(base), {"eplb": True}),
        "EPLB R=0, recording off": (copy.deepcopy(base), {"eplb": True}),
    }
    rows = []
    for name, (model, extra) in variants.items():
        if extra:
            state = attach(model, {"num_redundant_experts": 0})
            state.set_recording("off" not in name)
        compiled = torch.compile(model, backend="ascend_passes", options={"compiler": "eager", **extra})
        with torch.no_grad():
            _, best, median = timed(lambda: compiled(*inputs), repeat)
        rows.append([name, f"{best * 1e3:.2f}", f"{median * 1e3:.2f}"])
    print_table(
        f"Forward time, deepseek_v3 tiny, {tokens} tokens (eager downstream)", ["variant", "min ms", "median ms"], rows
    )


if __name__ == "__main__":
    main()
