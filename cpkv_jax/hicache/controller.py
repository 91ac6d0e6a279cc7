"""The host-tier controller: the reservation -> backup -> commit / rollback protocol over one
RadixCache, passing page ids between the host pool, the copy path and the tree.

Protocol (see DESIGN.md, HiCache):
- admission: match both tiers; host-only prefix pages get device pages and are loaded back
  (`load`), then the request proceeds as on a device hit;
- `reserve_host_slots`: probes the final insertion prefix — pages of the request's final key that
  already have a committed host value or a backup in flight — and reserves host pages only for the
  rest, so repeated prompts never prepare duplicate backups;
- `finish_backup`: the copy path copies each layer of target (and draft) into the reserved slots; a
  layer is acknowledged when its copy completed; `commit` makes the host value visible on the radix
  nodes only when every layer is acknowledged; otherwise (`rollback`, abort, failure) the reserved
  pages return to the allocator and nothing is visible.
The scheduler drives it through three hooks: `on_admit`, `on_prefill_done`, `on_finish`.
"""

from __future__ import annotations

import numpy as np

from cpkv_jax.hicache.copy_path import ACKED, FAILED, IN_FLIGHT, SKIPPED, CopyPath
from cpkv_jax.hicache.host_pool import HostPool
from cpkv_jax.hicache.jit_copies import JitCopies
from cpkv_jax.hicache.policy import POLICIES, WRITE_POLICIES
from cpkv_jax.hicache.reservation import Reservation
from cpkv_jax.hicache.stream_copies import SideStreamCopies
from cpkv_jax.kv_pool import KVPool
from cpkv_jax.radix_cache import RadixCache


class HiCache:
    """Host pool + write policy + copy path + the protocol joining them over one RadixCache."""

    def __init__(self, pool: KVPool, radix: RadixCache, num_pages: int, *, full_layers: tuple[int, ...],
                 policy: str = "write_through", probe_final_prefix: bool = True, mesh=None, copier=None):
        if policy not in WRITE_POLICIES:
            raise ValueError(f"write policy must be one of {WRITE_POLICIES}, got {policy!r}")
        self.pool, self.radix, self.policy = pool, radix, POLICIES[policy]()
        self.page_size = pool.page_size
        self.probe_final_prefix = probe_final_prefix
        self.host = HostPool(pool, num_pages, full_layers=full_layers, mesh=mesh)
        self.allocator = self.host.allocator
        self.open: dict[int, Reservation] = {}        # reservations neither committed nor rolled back
        self.pending: dict[tuple, Reservation] = {}   # key prefix of each page in flight -> its reservation
        self.stats = {"backups": 0, "backup_pages": 0, "commits": 0, "rollbacks": 0, "insert_miss_rollbacks": 0,
                      "skipped_backups": 0, "failed_backups": 0, "host_evicted_pages": 0, "loads": 0, "load_pages": 0,
                      "d2h_bytes": {}, "h2d_bytes": {}, "settles": 0}
        # copier: side_stream.SideStreamCopier (installed by the engine) or None (jitted copies)
        self.copies: CopyPath = (SideStreamCopies(pool, self.host, self.stats, copier) if copier is not None
                                 else JitCopies(pool, self.host, self.stats))
        self.tracer = None   # cpkv_jax.trace.Tracer: told of every backup and load (EngineConfig.kv_trace)

    # ---- scheduler hooks -------------------------------------------------------------------------
    def on_admit(self, req, match) -> None:
        """A request was admitted (req.pages, req.node, req.shared_pages set from `match`)."""
        self.policy.on_admit(self, req, match)

    def on_prefill_done(self, req) -> None:
        """After the step that finished the prompt (and its draft extend): complete the prompt's
        backup."""
        if req.host_res is not None:
            self.finish_backup(req.host_res, req.pages)
            req.host_res = None

    def on_finish(self, req) -> None:
        """A request finished (published to the tree unless aborted)."""
        if req.host_res is not None:  # aborted before its prompt's backup completed
            self.rollback(req.host_res)
            req.host_res = None
        if req.finish_reason != "abort":
            self.policy.on_finish(self, req)

    def host_rank(self, host_pages) -> np.ndarray:
        return self.host.host_rank(host_pages)

    # ---- load ------------------------------------------------------------------------------------
    def load(self, host_pages: np.ndarray, dev_pages: np.ndarray, rid: int | None = None) -> None:
        """Host pages back into freshly allocated device pages, every layer of target and draft, before
        any step reads them (for request `rid`)."""
        if len(host_pages) == 0:
            return
        self.copies.load(host_pages, dev_pages)
        if self.tracer is not None:
            self.tracer.on_load(self, host_pages, dev_pages, rid)
        self.stats["loads"] += 1
        self.stats["load_pages"] += len(host_pages)

    # ---- backup ----------------------------------------------------------------------------------
    def _prefix_keys(self, tokens) -> list[tuple]:
        key = self.radix.key_of(tokens)
        ps = self.page_size
        return [key[:(i + 1) * ps] for i in range(len(key) // ps)]

    def reserve_host_slots(self, rid: int, tokens, pages_wanted: np.ndarray | None = None) -> Reservation | None:
        """Reserve host pages for the pages of key_of(tokens) that will not already have a host value
        once this request is inserted (committed or in flight: the probe), restricted to
        pages_wanted if given. Evicts host LRU leaves if short; returns None (backup skipped) if the
        host pool still cannot hold them, or if nothing is left to back up."""
        prefixes = self._prefix_keys(tokens)
        covered = self.radix.host_covered(tokens) if self.probe_final_prefix else np.zeros(len(prefixes), bool)
        if self.probe_final_prefix:
            covered |= np.array([p in self.pending for p in prefixes], bool)
        want = np.flatnonzero(~covered)
        if pages_wanted is not None:
            want = np.intersect1d(want, pages_wanted)
        if len(want) == 0:
            return None
        short = len(want) - (self.allocator.num_free - self.reserved)
        if short > 0:
            self.stats["host_evicted_pages"] += self.radix.evict_host(short, self.allocator.free)
        if len(want) > self.allocator.num_free - self.reserved:
            self.stats["skipped_backups"] += 1
            return None
        res = Reservation(rid, tuple(int(t) for t in tokens), want.astype(np.int32))
        self.open[id(res)] = res
        for i in want:
            self.pending.setdefault(prefixes[i], res)
        return res

    @property
    def reserved(self) -> int:
        """Host pages promised to open reservations that have not taken them yet."""
        return sum(len(r.page_index) - len(r.staged) for r in self.open.values() if r.host_pages is None)

    def stage_backups(self, work) -> None:
        """Before a target forward: for each (reservation, the request's pages, positions computed
        once the step ends), let the copy path stage what that forward completes."""
        self.copies.stage(work)

    def write_back(self, rid: int, tokens, dev_pages: np.ndarray, pages_wanted: np.ndarray | None = None) -> bool:
        """Reserve, copy every layer, commit — or roll back if a copy fails. Returns whether the
        backup went ahead. A failed backup never affects the request (it only loses the backup)."""
        res = self.reserve_host_slots(rid, tokens, pages_wanted)
        return res is not None and self.finish_backup(res, dev_pages)

    def finish_backup(self, res: Reservation, dev_pages: np.ndarray) -> bool:
        """Back up a reservation and commit it — at once if every layer is acknowledged, else from
        `poll` (sealed); a short host pool or a failed copy rolls it back (counted) and is not raised:
        the request only loses its backup."""
        if res.state != "reserved":
            return False
        outcome = self.copies.backup(res, dev_pages)
        if outcome in (SKIPPED, FAILED):
            self.rollback(res)
            self.stats["skipped_backups" if outcome == SKIPPED else "failed_backups"] += 1
            return False
        self.stats["backups"] += 1
        self.stats["backup_pages"] += len(res.host_pages)
        if self.tracer is not None:
            self.tracer.on_backup(self, res, "jit" if isinstance(self.copies, JitCopies) else "side_stream")
        if outcome == ACKED:
            self.commit(res)
        elif outcome == IN_FLIGHT:
            res.sealed = True
        return True

    def commit(self, res: Reservation) -> None:
        """Make the host value visible: only with every layer of target and draft acknowledged."""
        if res.state != "reserved":
            raise AssertionError(f"commit of a {res.state} reservation")
        units = set(self.host.units())
        if res.acked != units:
            raise AssertionError(f"commit with layers {sorted(units - res.acked)} not acknowledged")
        unused = self.radix.set_host(res.tokens, res.page_index, res.host_pages)
        if len(unused):
            self.allocator.free(unused)
            self.stats["insert_miss_rollbacks"] += 1
        self._release(res, "committed")
        self.stats["commits"] += 1

    def rollback(self, res: Reservation) -> None:
        """Return the reservation's host pages (copies still in flight into them finish first: every
        later copy of that rank is behind them on the same side stream) and drop it."""
        if res.state != "reserved":
            return
        taken = res.taken()
        if len(taken):
            self.allocator.free(taken)
        self._release(res, "rolled_back")
        self.stats["rollbacks"] += 1

    def _release(self, res: Reservation, state: str) -> None:
        self.open.pop(id(res), None)
        self.copies.release(res)
        prefixes = self._prefix_keys(res.tokens)
        for i in res.page_index:
            if self.pending.get(prefixes[i]) is res:
                del self.pending[prefixes[i]]
        res.state = state

    # ---- copies in flight ------------------------------------------------------------------------
    def poll(self) -> None:
        """Commit every sealed reservation whose copies are all acknowledged; roll back the failed."""
        self.copies.poll([r for r in self.open.values() if r.sealed], self._copies_done)

    def _copies_done(self, res: Reservation, state: bool | None) -> None:
        if state is None:
            self.rollback(res)
            self.stats["failed_backups"] += 1
        elif state:
            res.acked = set(self.host.units())
            self.commit(res)

    def settle(self) -> None:
        """Wait for every copy in flight, then commit what is sealed."""
        self.copies.settle()
        self.poll()

    def before_device_free(self, pages) -> None:
        """Device pages are about to return to the allocator: if a copy may still read one, settle."""
        if self.copies.reads_any(pages, self.open.values()):
            self.settle()

    def check(self) -> None:
        """Host pages: tree-held + free + in flight = all, each exactly once."""
        held = np.concatenate([self.radix.all_host_pages()] + [r.taken() for r in self.open.values()])
        free = np.flatnonzero(self.allocator._is_free)
        every = np.concatenate([held, free])
        if len(np.unique(every)) != len(every) or len(every) != self.allocator.capacity:
            raise AssertionError(f"host pages: {len(held)} held + {len(free)} free != {self.allocator.capacity}")
