"""Run a function on W gloo ranks spawned on this machine (tests, benchmarks and the CLI's tensor-parallel
models use it): each rank gets an initialised default process group, the values the ranks return come back
in rank order, and a rank that fails or hangs fails the whole call instead of hanging the caller."""

from __future__ import annotations

import datetime
import queue
import socket
import traceback
from typing import Any, Callable

from .errors import AscendPassesError

__all__ = ["RankFailed", "free_port", "run_on_ranks"]


class RankFailed(AscendPassesError):
    """A spawned rank raised (its traceback is the message) or did not report in time."""


def free_port() -> int:
    """A free TCP port on the loopback interface (for the gloo rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn: Callable[..., Any], rank: int, world_size: int, port: int, results: Any, args: tuple,
               num_threads: int, timeout_s: float) -> None:  # runs in a spawned process
    import torch
    import torch.distributed as dist

    try:
        torch.set_num_threads(num_threads)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        value = fn(rank, world_size, *args)
        dist.barrier()  # no rank tears its connections down while a peer still finishes a collective
        dist.destroy_process_group()
        results.put((rank, True, value))
    except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
        results.put((rank, False, traceback.format_exc()))


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 240.0,
                 num_threads: int = 1) -> list[Any]:
    """``[fn(rank, world_size, *args) for rank in range(world_size)]``, each call in its own spawned
    process with ``torch.distributed`` initialised (gloo over 127.0.0.1).  ``fn`` must be importable
    (module level) and return a picklable value (no tensors: through the queue they are shared-memory
    handles that die with the process; send ``.tolist()``).  Raises ``RankFailed`` naming the rank (with its
    traceback) when one raises, or when the ranks have not all reported after ``timeout_s`` seconds."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world_size, port, results, args, num_threads, timeout_s),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    values: dict[int, Any] = {}
    try:
        while len(values) < world_size:
            try:
                rank, ok, value = results.get(timeout=timeout_s)
            except queue.Empty:
                missing = sorted(set(range(world_size)) - set(values))
                raise RankFailed(f"ranks {missing} of {world_size} did not report within {timeout_s:.0f} s "
                                 "(a collective that does not match across ranks hangs like this)") from None
            if not ok:
                raise RankFailed(f"rank {rank} of {world_size} failed:\n{value}")
            values[rank] = value
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return [values[r] for r in range(world_size)]
