"""HiCache: a host tier of KV pages under the radix prefix cache.

- `host_pool`: the pinned-host twins of the device pool's leaves and their page allocator;
- `controller` (HiCache): the reservation -> backup -> commit / rollback protocol over the radix
  tree, driven by the scheduler's hooks (`on_admit`, `on_prefill_done`, `on_finish`);
- `policy`: the write policies those hooks defer to;
- `copy_path`: the one interface of the two copy paths, `jit_copies` (XLA block copies after the
  step) and `stream_copies` (side-stream copies at the forward's layer boundaries, on `side_stream`).
"""

from cpkv_jax.hicache.controller import HiCache
from cpkv_jax.hicache.policy import WRITE_POLICIES
from cpkv_jax.hicache.reservation import Reservation

__all__ = ["HiCache", "Reservation", "WRITE_POLICIES"]
