"""A host-tier reservation: the host pages promised to one backup, from reservation to commit or
rollback (the protocol: `controller`)."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class Reservation:
    """A count of host pages reserved for pages `page_index` of key_of(tokens); the host pages
    themselves are taken at backup from the ranks owning the device pages (under CP those are only
    known once the forward planned them). Per-layer acks."""

    rid: int
    tokens: tuple
    page_index: np.ndarray
    host_pages: np.ndarray | None = None
    src_pages: np.ndarray | None = None   # the device pages copied (indexed like page_index)
    acked: set = dataclasses.field(default_factory=set)
    state: str = "reserved"          # reserved -> committed | rolled_back
    # side-stream path: host page per staged page index, the forwards that copy them, events of the
    # copies made after a step, and whether every copy has been issued (then poll may commit)
    staged: dict = dataclasses.field(default_factory=dict)
    steps: list = dataclasses.field(default_factory=list)
    events: list = dataclasses.field(default_factory=list)
    sealed: bool = False

    def taken(self) -> np.ndarray:
        """The host pages this reservation holds so far."""
        if self.host_pages is not None:
            return self.host_pages
        return np.array([h for h, _ in self.staged.values()], np.int32)
