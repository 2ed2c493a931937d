"""The lock that keeps forwards and EPLB re-balancing / expert weight updates apart.

A forward reads, per MoE layer, the EPLB tables (``log2phy``, ``replica_count``) and then the
physical expert weights those tables point at.  ``rebalance()`` (often from a serving engine's
background thread) rewrites both in place.  A forward that reads the tables of one placement and
the weights of another computes with the wrong experts; one that reads a half-copied table reads
``-1`` slots.  So they are kept apart by a process-wide reader-writer lock:

- **readers are forwards.**  ``backend="ascend_passes"`` runs every compiled graph that reads EPLB
  tables inside ``FORWARD_LOCK.reading()``; the eager (uncompiled) attached model takes it inside
  ``ascend.eplb_logical_weight`` for the one gather that reads tables and weights.  Any number of
  forwards run at once; a thread that already reads re-enters without waiting.
- **writers publish.**  ``rebalance()`` / ``apply_placement()`` prepare everything outside the
  lock (new tables, a copy of the weights of each slot that changes) and then, layer by layer,
  take ``writing()`` only for the in-place copies: a forward waits at most for one layer's copy.
  A waiting writer holds back new forwards, so a stream of forwards cannot starve it.
  ``updating()`` serialises whole updates (two re-balancings, or a re-balancing and a weight
  update, never interleave); ``writing()`` includes it.

The lock is process-wide (one for every attached model: a target and its MTP drafter, the eager
op and the compiled graphs find it without knowing their state).  Re-entering ``writing()`` from
a thread that is inside a forward would deadlock, so it raises ``ConfigError`` instead.
Forwards that do not go through ``backend="ascend_passes"`` (a serving engine's own Inductor
graph with ``ascend_passes.inductor_pass``) must take ``reading()`` themselves (``forward_guard``)
or re-balance only between forwards.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ascend_passes.errors import ConfigError

__all__ = ["FORWARD_LOCK", "ForwardLock", "forward_guard", "guarded"]


class ForwardLock:
    """A writer-preferring reader-writer lock; readers re-enter per thread (module docstring)."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._cond = threading.Condition(self._mutex)
        self._readers = 0  # forwards in flight (outermost acquisitions)
        self._writer: int | None = None  # thread ident holding the write side
        self._writer_depth = 0
        self._waiting_writers = 0
        self._update = threading.RLock()
        self._local = threading.local()
        # the thread of the latest forward (expert parallelism re-balances from that thread only)
        self.last_reader: int | None = None

    # ------------------------------------------------------------------------- readers
    def acquire_read(self, forward: bool = True) -> None:
        """``forward=False`` for a reader that is not a forward (a snapshot of the tables)."""
        local = self._local
        depth = getattr(local, "depth", 0)
        me = threading.get_ident()
        if depth or self._writer == me:  # re-entry, or a forward inside this thread's own update
            local.depth = depth + 1
            return
        with self._mutex:  # the fast path: one uncontended mutex
            if self._writer is not None or self._waiting_writers:
                while self._writer is not None or self._waiting_writers:
                    self._cond.wait()
            self._readers += 1
        local.depth = 1
        if forward:
            self.last_reader = me

    def release_read(self) -> None:
        local = self._local
        depth = local.depth - 1
        local.depth = depth
        if depth or self._writer == threading.get_ident():
            return
        with self._mutex:
            self._readers -= 1
            if not self._readers and self._waiting_writers:
                self._cond.notify_all()

    @contextmanager
    def reading(self, forward: bool = True) -> Iterator[None]:
        """Held by a forward: no placement or expert weight changes while it runs."""
        self.acquire_read(forward)
        try:
            yield
        finally:
            self.release_read()

    def reading_here(self) -> bool:
        """True when this thread is inside a forward (holds the read side)."""
        return bool(getattr(self._local, "depth", 0))

    @property
    def forwards_in_flight(self) -> int:
        return self._readers

    # ------------------------------------------------------------------------- writers
    @contextmanager
    def updating(self) -> Iterator[None]:
        """One update at a time (re-entrant); forwards keep running.  Prepare an update here
        (reading the current tables and weights is safe), publish it under ``writing()``."""
        self._check_not_reading("update the EPLB placement or expert weights")
        with self._update:
            yield

    @contextmanager
    def writing(
        self, *, what: str = "update the EPLB placement or expert weights", wait: bool = True
    ) -> Iterator[None]:
        """Exclusive: waits for the forwards in flight, holds back new ones.  ``wait=False``
        raises ``ConfigError`` instead of waiting when forwards are in flight."""
        self._check_not_reading(what)
        me = threading.get_ident()
        with self._update:
            if self._writer == me:
                self._writer_depth += 1
                try:
                    yield
                finally:
                    self._writer_depth -= 1
                return
            with self._cond:
                if not wait and self._readers:
                    raise ConfigError(
                        f"cannot {what} while {self._readers} forward(s) of an EPLB-attached "
                        "model run in other threads; under expert parallelism call it between "
                        "forwards, from the thread that runs them, on every rank"
                    )
                self._waiting_writers += 1
                try:
                    while self._readers or self._writer is not None:
                        self._cond.wait()
                finally:
                    self._waiting_writers -= 1
                self._writer, self._writer_depth = me, 1
            try:
                yield
            finally:
                with self._cond:
                    self._writer, self._writer_depth = None, 0
                    self._cond.notify_all()

    def _check_not_reading(self, what: str) -> None:
        if getattr(self._local, "depth", 0) and self._writer != threading.get_ident():
            raise ConfigError(
                f"cannot {what} from inside a forward of an EPLB-attached model (this thread "
                "holds the forward lock, so waiting for the forwards to finish would wait for "
                "itself); call it between forwards or from another thread"
            )


FORWARD_LOCK = ForwardLock()


def forward_guard():
    """``with forward_guard(): model(x)`` — for forwards that do not run through
    ``backend="ascend_passes"`` (e.g. an engine's own Inductor graph built with
    ``ascend_passes.inductor_pass``), so that ``rebalance()`` in another thread waits for them."""
    return FORWARD_LOCK.reading()


def guarded(compiled: Callable[..., Any]) -> Callable[..., Any]:
    """A boxed compiled graph that runs inside ``FORWARD_LOCK.reading()`` (the backend wraps
    every graph that reads EPLB tables with it)."""
    lock = FORWARD_LOCK

    def call(args: list[Any]) -> Any:
        lock.acquire_read()
        try:
            return compiled(args)
        finally:
            lock.release_read()

    call._boxed_call = True  # type: ignore[attr-defined]
    return call
