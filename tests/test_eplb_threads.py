"""EPLB re-balancing from a background thread while forwards run (issue 14 item 2).

One thread runs the attached model in a loop and compares every output with the *un-attached*
model's output (EPLB only changes which physical replica computes an expert, never the logical
result); another calls ``rebalance()`` with random loads in a loop.  Before the forward lock
(``ascend_passes/eplb/sync.py``) this gave wrong outputs (max diff ~4) and ``index -1 is out of
bounds`` errors; now every output must be exact and nothing may raise.  Each run is bounded
(``SECONDS`` of concurrent work) and checks that both threads really did work.
"""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
from torch import nn

import ascend_passes as ap
from ascend_passes import models
from ascend_passes.eplb.state import attach
from ascend_passes.eplb.sync import FORWARD_LOCK, forward_guard
from ascend_passes.errors import ConfigError

SECONDS = 3.0


class TwoMoeBlocks(nn.Module):
    """The two MoE blocks of a tiny Qwen3-MoE with residual adds (a small graph: fast to compile)."""

    def __init__(self) -> None:
        super().__init__()
        lm, _ = models.qwen3_moe(num_layers=2)
        self.blocks = nn.ModuleList([layer.mlp for layer in lm.lm.model.layers])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            out = block(x)
            x = x + (out[0] if isinstance(out, tuple) else out)
        return x


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    base = TwoMoeBlocks()
    x = torch.randn(1, 16, 64)
    with torch.no_grad():
        expected = base(x)
    return base, x, expected


def _attached(base):
    model = copy.deepcopy(base)
    return model, attach(model, {"num_redundant_experts": 4, "ep_size": 4})


def _hammer(forward, state, expected, seconds=SECONDS):
    """Run ``forward()`` in one thread and ``state.rebalance(random load)`` in another for
    ``seconds``; returns the counts (forwards, wrong outputs, errors, rebalances, slots moved)."""
    stop = threading.Event()
    stats = {"forwards": 0, "wrong": 0, "max_diff": 0.0, "errors": [], "rebalances": 0, "moved": 0}

    def forwards():
        with torch.no_grad():
            while not stop.is_set():
                try:
                    diff = (forward() - expected).abs().max().item()
                except Exception as exc:  # noqa: BLE001  (counted: the test asserts there are none)
                    stats["errors"].append(repr(exc)[:300])
                    continue
                stats["forwards"] += 1
                if diff > 1e-4:
                    stats["wrong"] += 1
                    stats["max_diff"] = max(stats["max_diff"], diff)

    def rebalances():
        gen = torch.Generator().manual_seed(1)
        while not stop.is_set():
            load = (torch.rand(state.num_layers, state.num_logical, generator=gen) ** 4 * 1000).round()
            before = state.phy2log
            try:
                state.rebalance(load)
            except Exception as exc:  # noqa: BLE001
                stats["errors"].append(repr(exc)[:300])
                continue
            stats["rebalances"] += 1
            stats["moved"] += int((state.phy2log != before).sum())

    threads = [threading.Thread(target=forwards, daemon=True), threading.Thread(target=rebalances, daemon=True)]
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread hangs (deadlock between forward and rebalance)"
    return stats


def _assert_clean(stats):
    print(
        f"{stats['forwards']} forwards, {stats['rebalances']} rebalances ({stats['moved']} slots moved), "
        f"{stats['wrong']} wrong, {len(stats['errors'])} errors"
    )
    assert stats["errors"] == [] and stats["wrong"] == 0, (
        f"{stats['wrong']} wrong outputs (max diff {stats['max_diff']:.3g}) and "
        f"{len(stats['errors'])} errors in {stats['forwards']} forwards during "
        f"{stats['rebalances']} rebalances: {stats['errors'][:3]}"
    )
    # both threads really ran concurrently and the placement really changed under the forwards
    assert stats["forwards"] >= 5 and stats["rebalances"] >= 5 and stats["moved"] > 0, stats


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_rebalance_in_background_thread_keeps_compiled_outputs_exact(setup, compiler):
    base, x, expected = setup
    model, state = _attached(base)
    torch._dynamo.reset()
    with torch.no_grad(), ap.capture() as reports:
        compiled = torch.compile(
            model, backend="ascend_passes", options={"compiler": compiler, "strict": True, "eplb": {"enabled": True}}
        )
        assert (compiled(x) - expected).abs().max().item() <= 1e-4
    assert reports[0].count("ascend.eplb_map") == 2  # the graph routes over the physical slots
    stats = _hammer(lambda: compiled(x), state, expected)
    _assert_clean(stats)
    assert FORWARD_LOCK.forwards_in_flight == 0


def test_rebalance_in_background_thread_keeps_eager_attached_model_exact(setup):
    """The uncompiled attached model reads its logical weights through eplb_logical_weight."""
    base, x, expected = setup
    model, state = _attached(base)
    _assert_clean(_hammer(lambda: model(x), state, expected))


def test_rebalance_inside_a_forward_is_refused(setup):
    base, _, _ = setup
    _, state = _attached(base)
    before = state.phy2log
    load = torch.arange(state.num_layers * state.num_logical, dtype=torch.float).view(state.num_layers, -1)
    message = (
        "cannot update the EPLB placement or expert weights from inside a forward of an "
        "EPLB-attached model (this thread holds the forward lock, so waiting for the forwards "
        "to finish would wait for itself); call it between forwards or from another thread"
    )
    with forward_guard(), pytest.raises(ConfigError) as err:
        state.rebalance(load)
    assert str(err.value) == message
    assert torch.equal(state.phy2log, before)  # nothing applied
    assert state.rebalance(load).phy2log.shape == before.shape  # between forwards: fine


def test_expert_parallel_rebalance_from_another_thread_is_refused(setup):
    """Under expert parallelism rebalance() is collective and shares the EP group with the
    forwards' collectives: it must run in the forward thread (checked before any communication)."""
    base, x, _ = setup
    model, state = _attached(base)

    def one_forward():
        with forward_guard():
            pass

    ran = threading.Thread(target=one_forward)
    ran.start()
    ran.join()
    state.group = object()  # as if attached under an initialised EP process group
    try:
        with pytest.raises(ConfigError) as err:
            state.apply_placement(state.phy2log)
    finally:
        state.group = None
    assert str(err.value) == (
        "under expert parallelism rebalance() / apply_placement() are collective: call them on "
        "every rank between forwards, from the thread that runs the forwards (this process's "
        "forwards run in another thread)"
    )


def test_lock_lets_readers_share_and_writers_exclude():
    lock = type(FORWARD_LOCK)()
    inside, release = threading.Event(), threading.Event()

    def reader():
        with lock.reading():
            inside.set()
            release.wait(10)

    t = threading.Thread(target=reader)
    t.start()
    assert inside.wait(10)
    with lock.reading():  # a second forward runs alongside
        assert lock.forwards_in_flight == 2
    with pytest.raises(ConfigError, match=r"^cannot apply an EPLB placement while 1 forward\(s\)"):
        with lock.writing(what="apply an EPLB placement", wait=False):
            pass
    got = []

    def write():
        with lock.writing():
            got.append("writer")

    w = threading.Thread(target=write)
    w.start()
    time.sleep(0.2)
    assert got == []  # waits for the forward in flight
    release.set()
    w.join(10)
    t.join(10)
    assert got == ["writer"] and lock.forwards_in_flight == 0
