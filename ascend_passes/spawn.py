"""Run a function on W gloo ranks spawned on this machine (tests, benchmarks and the CLI's tensor-parallel
models use it): each rank gets an initialised default process group, the values the ranks return come back
in rank order, and a rank that fails or hangs fails the whole call instead of hanging the caller."""

from __future__ import annotations

import datetime
import queue
import signal
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

from .errors import AscendPassesError

__all__ = ["RankFailed", "free_port", "run_on_ranks"]

_POLL_S = 0.2  # how often the parent looks for a rank that died without reporting
_DEATH_GRACE_S = 2.0  # after a rank fails: how long a peer's death (the likely cause) may take to be seen


class RankFailed(AscendPassesError):
    """A spawned rank raised (its traceback is the message) or did not report in time."""


def free_port() -> int:
    """A free TCP port on the loopback interface (for the gloo rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _died(procs: list[Any], reported: dict[int, Any], wait_s: float = 0.0) -> dict[int, int]:
    """``{rank: exit code}`` of the ranks that exited without reporting a result (a rank that reports, value or
    traceback, exits with 0).  ``wait_s``: how long to wait for such a rank to be seen dead."""
    end = time.monotonic() + wait_s
    while True:
        dead = {
            r: p.exitcode
            for r, p in enumerate(procs)
            if r not in reported and p.exitcode is not None and p.exitcode != 0
        }
        if dead or time.monotonic() >= end:
            return dead
        time.sleep(0.02)


def _death_message(dead: dict[int, int], world_size: int) -> str:
    parts = []
    for rank, code in sorted(dead.items()):
        if code > 0:
            how = f"exit code {code}"
        else:
            try:
                how = f"signal {signal.Signals(-code).name}"
            except ValueError:
                how = f"signal {-code}"
        parts.append(f"rank {rank} of {world_size} died with {how} before reporting")
    return (
        "; ".join(parts) + " (os._exit, a crash in native code, or a kill such as the OOM killer's; "
        "the other ranks then fail in their next collective)"
    )


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    results: Any,
    args: tuple,
    num_threads: int,
    timeout_s: float,
) -> None:  # runs in a spawned process
    import torch
    import torch.distributed as dist

    try:
        torch.set_num_threads(num_threads)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        value = fn(rank, world_size, *args)
        dist.barrier()  # no rank tears its connections down while a peer still finishes a collective
        dist.destroy_process_group()
        results.put((rank, True, value))
    except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
        results.put((rank, False, traceback.format_exc()))


def run_on_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 240.0, num_threads: int = 1
) -> list[Any]:
    """``[fn(rank, world_size, *args) for rank in range(world_size)]``, each call in its own spawned
        process with ``torch.distributed`` initialised (gloo over 127.0.0.1).  ``fn`` must be importable
        (module level) and return a picklable value (no tensors: through the queue they are shared-memory
        handles that die with the process; send ``.tolist()``).  Raises ``RankFailed`` naming the rank (with its
        traceback) when one raises, naming the rank and its exit code when one dies without reporting (a peer that
    then fails in a collective is named after it), or when the ranks have not all reported after ``timeout_s``
    seconds."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_rank_main, args=(fn, r, world_size, port, results, args, num_threads, timeout_s), daemon=True
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(values) < world_size:
            try:
                rank, ok, value = results.get(timeout=_POLL_S)
            except queue.Empty:
                dead = _died(procs, values)
                if dead and results.empty():  # (a report that raced the poll is read first)
                    raise RankFailed(_death_message(dead, world_size)) from None
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(values))
                    raise RankFailed(
                        f"ranks {missing} of {world_size} did not report within {timeout_s:.0f} s "
                        "(a collective that does not match across ranks hangs like this)"
                    ) from None
                continue
            if not ok:
                # a peer that died (os._exit, a crash, the OOM killer) makes the survivors fail in their next
                # collective: name the rank that died, not the survivor that saw the reset
                dead = _died(procs, values, wait_s=_DEATH_GRACE_S)
                if dead:
                    raise RankFailed(_death_message(dead, world_size) + f"\nrank {rank} then failed:\n{value}")
                raise RankFailed(f"rank {rank} of {world_size} failed:\n{value}")
            values[rank] = value
            deadline = time.monotonic() + timeout_s  # as before: timeout_s between two reports
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return [values[r] for r in range(world_size)]
