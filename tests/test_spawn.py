"""ascend_passes.spawn.run_on_ranks: a rank that dies is named with its exit code (issue 14 item 12)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from ascend_passes.spawn import RankFailed, _death_message, run_on_ranks


def _rank1_exits(rank: int, world_size: int, how: str) -> int:  # a spawned rank
    import torch
    import torch.distributed as dist

    if rank == 1:
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)  # rank 1 is gone: this collective sees the connection reset
    dist.all_reduce(torch.ones(4))
    return rank


def test_the_rank_that_died_is_named_not_the_survivor():
    with pytest.raises(RankFailed) as info:
        run_on_ranks(_rank1_exits, 2, "exit", timeout_s=120)
    message = str(info.value)
    assert message.startswith(
        "rank 1 of 2 died with exit code 3 before reporting (os._exit, a crash in "
        "native code, or a kill such as the OOM killer's; the other ranks then "
        "fail in their next collective)"
    ), message
    assert not message.startswith("rank 0")


def test_death_by_signal_is_named_by_the_signal():
    assert _death_message({1: -signal.SIGKILL, 3: 2}, 4).startswith(
        "rank 1 of 4 died with signal SIGKILL before reporting; rank 3 of 4 died with exit code 2 before reporting ("
    )
    assert _death_message({0: -200}, 2).startswith("rank 0 of 2 died with signal 200 before")


def _rank0_raises(rank: int, world_size: int) -> int:  # a spawned rank
    if rank == 0:
        raise ValueError("bad input on rank 0")
    return rank


def test_a_rank_that_raises_is_still_named_with_its_traceback():
    with pytest.raises(RankFailed, match=r"(?s)^rank 0 of 2 failed:\n.*ValueError: bad input on rank 0"):
        run_on_ranks(_rank0_raises, 2, timeout_s=60)
