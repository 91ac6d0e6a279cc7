"""The one interface of the host tier's two copy paths (jitted block copies: `jit_copies`; copies on
a CUDA side stream at the forward's layer boundaries: `stream_copies`). The controller hands a path
page ids and reservations and reacts to what `backup` and `poll` report; it never asks which path
runs.
"""

from __future__ import annotations

from typing import Callable, Iterable, Protocol

import numpy as np

from cpkv_jax.hicache.reservation import Reservation

# what `backup` reports
ACKED = "acked"            # every layer copied and acknowledged: commit now
IN_FLIGHT = "in_flight"    # every copy issued; `poll` reports when they are acknowledged
SKIPPED = "skipped"        # a CP rank's host pool is short: no backup
FAILED = "failed"          # a copy failed: no backup


class CopyPath(Protocol):
    fail_at_layer: int | None      # tests: a copy of this target layer fails (never acknowledged)

    def load(self, host_pages: np.ndarray, dev_pages: np.ndarray) -> None:
        """Host pages into device pages, every layer of target and draft, before any step reads them."""

    def stage(self, work: Iterable[tuple[Reservation | None, np.ndarray, int]]) -> None:
        """Before a target forward: (reservation, the request's pages, positions computed once the
        step ends) for each request in it."""

    def backup(self, res: Reservation, dev_pages: np.ndarray) -> str:
        """After the step: issue the copies of every layer of the reservation's pages (`dev_pages`:
        the request's page table, indexed like the key); sets res.host_pages and res.src_pages.
        Returns ACKED, IN_FLIGHT, SKIPPED or FAILED."""

    def poll(self, sealed: list[Reservation], done: Callable[[Reservation, bool | None], None]) -> None:
        """Report each in-flight reservation's copies: done(res, True) all acknowledged, False some
        still in flight, None one failed."""

    def settle(self) -> None:
        """Wait for every copy in flight."""

    def reads_any(self, dev_pages, reservations: Iterable[Reservation]) -> bool:
        """Whether a copy in flight for these reservations may still read one of these device pages."""

    def release(self, res: Reservation) -> None:
        """The reservation is committed or rolled back: drop what the path keeps for it."""
