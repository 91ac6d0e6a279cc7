"""Write policies: which pages the host tier backs up, and when. The controller's scheduler hooks
(`HiCache.on_admit`, `on_finish`) defer to one policy object, so the scheduler never tests policy
names.
"""

from __future__ import annotations

import numpy as np


class WriteThrough:
    """Every prompt's pages are reserved at admission and backed up as its prefill completes; a
    finished request's pages once they are published."""

    name = "write_through"

    def on_admit(self, hicache, req, match) -> None:
        req.host_res = hicache.reserve_host_slots(req.rid, req.prompt)

    def on_finish(self, hicache, req) -> None:
        hicache.write_back(req.rid, req.tokens()[:req.computed], req.pages)


class WriteThroughSelective:
    """Only prefixes that are reused: the device pages a request matched are backed up when that
    prefix is hit for the second time."""

    name = "write_through_selective"

    def on_admit(self, hicache, req, match) -> None:
        if req.node is not None and match.device_node.hits >= 2 and req.shared_pages:
            hicache.write_back(req.rid, req.prompt[:-1], req.pages, np.arange(req.shared_pages))

    def on_finish(self, hicache, req) -> None:
        """Nothing: a finished request's pages are backed up only once a later request hits them twice."""


POLICIES = {p.name: p for p in (WriteThrough, WriteThroughSelective)}
WRITE_POLICIES = tuple(POLICIES)
