"""HiCache: a host tier of KV pages under the radix prefix cache.

Host pool. Every leaf of the device pool (MLA latent and rope key per layer; index key and scale per
*full* indexer layer only — shared IndexCache layers have none, so they move none; the MTP layer's
one-layer pool in speculative mode) has a host twin in `pinned_host` memory with the same
[layers, slots, width] layout. A page of one layer is then one contiguous block of page_size rows on
both sides, so every transfer is a list of block copies (dynamic_update_slice into the donated host
pool: the path REFERENCE.md measured at the PCIe rate), never a gather or scatter on host memory.
Host pages come from their own page allocator (page 0 unused, like the device dummy).

Protocol (see DESIGN.md, HiCache):
- admission: match both tiers; host-only prefix pages get device pages and are loaded back
  (`load`), then the request proceeds as on a device hit;
- `reserve_host_slots`: probes the final insertion prefix — pages of the request's final key that
  already have a committed host value or a backup in flight — and reserves host pages only for the
  rest, so repeated prompts never prepare duplicate backups;
- `backup`: copies each layer of target (and draft) into the reserved slots; a layer is
  acknowledged when its copy completed; `commit` makes the host value visible on the radix nodes
  only when every layer is acknowledged; otherwise (`rollback`, abort, failure) the reserved pages
  return to the allocator and nothing is visible.

Transfers here are jitted XLA copies dispatched after the step on the compute stream: correct on
every backend, not yet overlapped with the forward. The layer-boundary overlap (a side-stream copy
ordered by events) is the GPU part still open.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from cpkv_jax.kv_pool import KVPool, OutOfPages, PageAllocator
from cpkv_jax.radix_cache import RadixCache
from models.kv import KVCache

WRITE_POLICIES = ("write_through", "write_through_selective")


def _bucket(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _copy_layer_pages(dst, src, dst_layer, src_layer, dst_pages, src_pages, page_size: int, to_host: bool):
    """dst[dst_layer, page block dst_pages[i]] = src[src_layer, page block src_pages[i]] for every i;
    one dynamic_slice -> memory-space move -> dynamic_update_slice per page."""
    space = jax.memory.Space.Host if to_host else jax.memory.Space.Device
    tail = (0,) * (src.ndim - 2)

    def body(i, d):
        block = jax.lax.dynamic_slice(src, (src_layer, src_pages[i] * page_size) + tail,
                                      (1, page_size) + src.shape[2:])
        return jax.lax.dynamic_update_slice(d, jax.device_put(block, space), (dst_layer, dst_pages[i] * page_size)
                                            + tail)
    return jax.lax.fori_loop(0, dst_pages.shape[0], body, dst)


@functools.partial(jax.jit, static_argnames=("page_size", "to_host", "mesh"), donate_argnums=(0,))
def _copy_pages(dst: tuple, src: tuple, layers, dst_pages, src_pages, *, page_size: int, to_host: bool, mesh):
    """Per leaf pair, one layer's pages (layer id per leaf, traced). Page lists are [ranks, n] of
    rank-local pages: under CP each rank copies between its own shards (shard_map, no collective).
    dst is donated."""
    def local(dst, src, layers, dst_pages, src_pages):
        return tuple(_copy_layer_pages(d, s, layers[j], layers[j], dst_pages[0], src_pages[0], page_size, to_host)
                     for j, (d, s) in enumerate(zip(dst, src)))
    if mesh is None:
        return local(dst, src, layers, dst_pages, src_pages)
    from jax.sharding import PartitionSpec as P
    pools = tuple(P(None, "cp") for _ in dst)
    return jax.shard_map(local, mesh=mesh, in_specs=(pools, pools, P(), P("cp"), P("cp")), out_specs=pools)(
        dst, src, layers, dst_pages, src_pages)


@dataclasses.dataclass
class Reservation:
    """A count of host pages reserved for pages `page_index` of key_of(tokens); the host pages
    themselves are taken at backup from the ranks owning the device pages (under CP those are only
    known once the forward planned them). Per-layer acks."""

    rid: int
    tokens: tuple
    page_index: np.ndarray
    host_pages: np.ndarray | None = None
    acked: set = dataclasses.field(default_factory=set)
    state: str = "reserved"          # reserved -> committed | rolled_back


class HiCache:
    """Host pool + allocator + the backup/load protocol over one RadixCache. Under CP (mesh) the host
    pool is sharded like the device pool: host page h lives on rank h // pages_per_rank, and a device
    page is only ever copied to or from a host page of its own rank."""

    def __init__(self, pool: KVPool, radix: RadixCache, num_pages: int, *, full_layers: tuple[int, ...],
                 policy: str = "write_through", probe_final_prefix: bool = True, mesh=None):
        if policy not in WRITE_POLICIES:
            raise ValueError(f"write policy must be one of {WRITE_POLICIES}, got {policy!r}")
        self.pool, self.radix, self.policy = pool, radix, policy
        self.page_size = pool.page_size
        self.probe_final_prefix = probe_final_prefix
        self.mesh = mesh
        self.ranks = 1 if mesh is None else mesh.shape["cp"]
        self.allocator = PageAllocator(num_pages, self.ranks)
        self.device_pages_per_rank = pool.num_pages // self.ranks
        self.open: dict[int, Reservation] = {}        # reservations neither committed nor rolled back

        if mesh is None:
            where = jax.memory.Space.Host
        else:
            from jax.sharding import NamedSharding, PartitionSpec as P
            where = NamedSharding(mesh, P(None, "cp"), memory_kind="pinned_host")

        def host_twin(cache: KVCache | None):
            # from a host numpy buffer: the pool never passes through device memory; its aval is
            # host-resident inside jit, so block copies into it stay copies
            if cache is None:
                return None
            return jax.tree.map(lambda x: jax.device_put(
                np.zeros((x.shape[0], num_pages * self.page_size) + x.shape[2:], x.dtype), where), cache)
        self.cache, self.draft = host_twin(pool.cache), host_twin(pool.draft)
        self.num_layers = pool.cache.latent.shape[0]
        self.full_index = {layer: i for i, layer in enumerate(full_layers)}
        self.pending: dict[tuple, Reservation] = {}   # key prefix of each page in flight -> its reservation
        self.fail_at_layer: int | None = None         # tests: a copy of this layer raises (never acked)
        self.stats = {"backups": 0, "backup_pages": 0, "commits": 0, "rollbacks": 0, "insert_miss_rollbacks": 0,
                      "skipped_backups": 0, "failed_backups": 0, "host_evicted_pages": 0, "loads": 0, "load_pages": 0,
                      "d2h_bytes": {}, "h2d_bytes": {}}

    # ---- layer plans -----------------------------------------------------------------------------
    def _layer_leaves(self, layer: int, draft: bool):
        """(leaf names, layer id per leaf) of one unit: target layer `layer` (index leaves only on
        full layers) or the draft's single layer."""
        names, ids = ["latent", "k_rope"], [0 if draft else layer] * 2
        full = 0 if draft else self.full_index.get(layer)
        if full is not None:
            names.append("index_k")
            ids.append(full)
            if self.pool.cache.index_fp8:
                names.append("index_scale")
                ids.append(full)
        return names, ids

    def _layers(self):
        """Every (layer, draft) unit a backup or load moves; a backup is committed when all are acked."""
        units = [(layer, False) for layer in range(self.num_layers)]
        return units + ([(0, True)] if self.draft is not None else [])

    def _local_lists(self, host_pages, dev_pages):
        """[ranks, n] rank-local (host, device) page lists; padding copies each rank's device dummy
        page onto its host page 0 (never allocated)."""
        host_pages, dev_pages = np.asarray(host_pages, np.int64), np.asarray(dev_pages, np.int64)
        rank = self.host_rank(host_pages)
        if (self.device_rank(dev_pages) != rank).any():
            raise AssertionError("a host page on another rank than its device page")
        width = _bucket(max(int(np.bincount(rank, minlength=self.ranks).max()), 1))
        hp = np.zeros((self.ranks, width), np.int32)
        dp = np.zeros((self.ranks, width), np.int32)
        for r in range(self.ranks):
            mine = rank == r
            hp[r, :mine.sum()] = host_pages[mine] - r * self.allocator.pages_per_rank
            dp[r, :mine.sum()] = dev_pages[mine] - r * self.device_pages_per_rank
        return hp, dp

    def _move(self, unit, host_pages, dev_pages, to_host: bool) -> None:
        layer, draft = unit
        names, ids = self._layer_leaves(layer, draft)
        host, dev = (self.draft, self.pool.draft) if draft else (self.cache, self.pool.cache)
        n = len(host_pages)
        hp, dp = self._local_lists(host_pages, dev_pages)
        src, dst = (dev, host) if to_host else (host, dev)
        moved = _copy_pages(tuple(getattr(dst, k) for k in names), tuple(getattr(src, k) for k in names),
                            jnp.asarray(ids, jnp.int32), jnp.asarray(hp if to_host else dp),
                            jnp.asarray(dp if to_host else hp), page_size=self.page_size, to_host=to_host,
                            mesh=self.mesh)
        updated = dataclasses.replace(dst, **dict(zip(names, moved)))
        if to_host:
            if draft:
                self.draft = updated
            else:
                self.cache = updated
        elif draft:
            self.pool.draft = updated
        else:
            self.pool.cache = updated
        counter = self.stats["d2h_bytes" if to_host else "h2d_bytes"]
        for k in names:
            leaf = getattr(src, k)
            counter[k] = counter.get(k, 0) + n * self.page_size * leaf.dtype.itemsize * int(
                np.prod(leaf.shape[2:], dtype=np.int64))

    # ---- load ------------------------------------------------------------------------------------
    def load(self, host_pages: np.ndarray, dev_pages: np.ndarray) -> None:
        """Host pages back into freshly allocated device pages, every layer of target and draft. The
        copies update the device pool that the next step consumes, so no layer can read them early."""
        if len(host_pages) == 0:
            return
        for unit in self._layers():
            self._move(unit, host_pages, dev_pages, to_host=False)
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
        """Host pages promised to open reservations that have not taken their pages yet."""
        return sum(len(r.page_index) for r in self.open.values() if r.host_pages is None)

    def device_rank(self, dev_pages) -> np.ndarray:
        return np.asarray(dev_pages, np.int64) // self.device_pages_per_rank

    def host_rank(self, host_pages) -> np.ndarray:
        return self.allocator.owner(host_pages)

    def _take_host_pages(self, res: Reservation, src: np.ndarray) -> bool:
        """The reservation's host pages, each from its device page's rank; False if a rank is short."""
        ranks = self.device_rank(src)
        need = np.bincount(ranks, minlength=self.ranks)
        if (need > self.allocator.free_per_rank()).any():
            return False
        res.host_pages = np.array([int(self.allocator.alloc(1, int(r))[0]) for r in ranks], np.int32)
        return True

    def backup(self, res: Reservation, dev_pages: np.ndarray) -> None:
        """Copy every layer of the reserved pages (device pages `dev_pages` of the request's page
        table, indexed like the key) to host and acknowledge each layer as its copy completes."""
        src = np.asarray(dev_pages)[res.page_index]
        if res.host_pages is None and not self._take_host_pages(res, src):
            raise OutOfPages("a CP rank's host pool is short for this backup")
        for unit in self._layers():
            if self.fail_at_layer is not None and unit == (self.fail_at_layer, False):
                raise RuntimeError(f"injected backup failure at layer {unit[0]}")
            self._move(unit, res.host_pages, src, to_host=True)
            jax.block_until_ready(self.draft if unit[1] else self.cache)
            res.acked.add(unit)
        self.stats["backups"] += 1
        self.stats["backup_pages"] += len(res.host_pages)

    def commit(self, res: Reservation) -> None:
        """Make the host value visible: only with every layer of target and draft acknowledged."""
        if res.state != "reserved":
            raise AssertionError(f"commit of a {res.state} reservation")
        if res.acked != set(self._layers()):
            raise AssertionError(f"commit with layers {sorted(set(self._layers()) - res.acked)} not acknowledged")
        unused = self.radix.set_host(res.tokens, res.page_index, res.host_pages)
        if len(unused):
            self.allocator.free(unused)
            self.stats["insert_miss_rollbacks"] += 1
        self._release(res, "committed")
        self.stats["commits"] += 1

    def rollback(self, res: Reservation) -> None:
        if res.state != "reserved":
            return
        if res.host_pages is not None:
            self.allocator.free(res.host_pages)
        self._release(res, "rolled_back")
        self.stats["rollbacks"] += 1

    def _release(self, res: Reservation, state: str) -> None:
        self.open.pop(id(res), None)
        prefixes = self._prefix_keys(res.tokens)
        for i in res.page_index:
            if self.pending.get(prefixes[i]) is res:
                del self.pending[prefixes[i]]
        res.state = state

    def write_back(self, rid: int, tokens, dev_pages: np.ndarray, pages_wanted: np.ndarray | None = None) -> bool:
        """Reserve, copy every layer, commit — or roll back if a copy fails. Returns whether a host
        value was committed. A failed backup never affects the request (it only loses the backup)."""
        res = self.reserve_host_slots(rid, tokens, pages_wanted)
        return res is not None and self.finish_backup(res, dev_pages)

    def finish_backup(self, res: Reservation, dev_pages: np.ndarray) -> bool:
        """Back up and commit a reservation; a failed copy rolls it back (counted) and is not raised:
        the request only loses its backup."""
        try:
            self.backup(res, dev_pages)
        except OutOfPages:          # a CP rank's host pool is short: skip this backup
            self.rollback(res)
            self.stats["skipped_backups"] += 1
            return False
        except Exception:
            self.rollback(res)
            self.stats["failed_backups"] += 1
            return False
        self.commit(res)
        return True

    def check(self) -> None:
        """Host pages: tree-held + free + in flight = all, each exactly once."""
        in_flight = self.open.values()
        held = np.concatenate([self.radix.all_host_pages()]
                              + [r.host_pages for r in in_flight if r.host_pages is not None])
        free = np.flatnonzero(self.allocator._is_free)
        every = np.concatenate([held, free])
        if len(np.unique(every)) != len(every) or len(every) != self.allocator.capacity:
            raise AssertionError(f"host pages: {len(held)} held + {len(free)} free != {self.allocator.capacity}")
