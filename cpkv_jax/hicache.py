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

Two copy paths, one protocol:
- side stream (GPU, `cpkv_jax.side_stream`): the target's pages are copied at the layer boundaries
  of the forward that writes them (staged before the step, started by the layer hook, acknowledged by
  per-layer events), loads are enqueued at the first boundary and each layer waits for its own; the
  draft layer and pages that already existed are copied after the step on the same side stream.
  `finish_backup` only seals the reservation; `poll` commits it once every event completed. The
  device pages a copy reads are never freed under it (`before_device_free` settles first).
- jitted copies (every other backend): after the step on the compute stream, acknowledged as each
  layer's copy completes, committed at once.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from cpkv_jax.kv_pool import KVPool, OutOfPages, PageAllocator
from cpkv_jax.radix_cache import RadixCache
from cpkv_jax.side_stream import D2H, Copy, StepCopies, page_runs
from models.kv import KVCache

LEAVES = ("latent", "k_rope", "index_k", "index_scale")   # the pool tree's leaf order

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
    src_pages: np.ndarray | None = None   # the device pages copied (indexed like page_index)
    acked: set = dataclasses.field(default_factory=set)
    state: str = "reserved"          # reserved -> committed | rolled_back
    # side-stream path: host page per staged page index, the forwards that copy them, events of the
    # copies made after a step, and whether every copy has been issued (then poll may commit)
    staged: dict = dataclasses.field(default_factory=dict)
    steps: list = dataclasses.field(default_factory=list)
    events: list = dataclasses.field(default_factory=list)
    sealed: bool = False


class HiCache:
    """Host pool + allocator + the backup/load protocol over one RadixCache. Under CP (mesh) the host
    pool is sharded like the device pool: host page h lives on rank h // pages_per_rank, and a device
    page is only ever copied to or from a host page of its own rank."""

    def __init__(self, pool: KVPool, radix: RadixCache, num_pages: int, *, full_layers: tuple[int, ...],
                 policy: str = "write_through", probe_final_prefix: bool = True, mesh=None, copier=None):
        if policy not in WRITE_POLICIES:
            raise ValueError(f"write policy must be one of {WRITE_POLICIES}, got {policy!r}")
        self.pool, self.radix, self.policy = pool, radix, policy
        self.page_size = pool.page_size
        self.probe_final_prefix = probe_final_prefix
        self.mesh = mesh
        self.copier = copier          # side_stream.SideStreamCopier (GPU) or None (jitted copies)
        self.ranks = 1 if mesh is None else mesh.shape["cp"]
        self.devices = list(jax.devices()[:1]) if mesh is None else list(mesh.devices.flat)
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
                      "d2h_bytes": {}, "h2d_bytes": {}, "settles": 0}
        self._staged_loads: list[tuple[np.ndarray, np.ndarray]] = []
        self._staged_backups: list[tuple[Reservation, np.ndarray, np.ndarray]] = []  # (res, host, device)
        self._load_steps: list[StepCopies] = []   # forwards carrying loads, until they ran
        self._host_base: dict[tuple, int] = {}      # (draft, leaf, rank) -> host pool shard address

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

    def _rank_pairs(self, host_pages, dev_pages) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per rank, its (host, device) pages as rank-local indices."""
        host_pages, dev_pages = np.asarray(host_pages, np.int64), np.asarray(dev_pages, np.int64)
        rank = self.host_rank(host_pages)
        if (self.device_rank(dev_pages) != rank).any():
            raise AssertionError("a host page on another rank than its device page")
        return [(host_pages[rank == r] - r * self.allocator.pages_per_rank,
                 dev_pages[rank == r] - r * self.device_pages_per_rank) for r in range(self.ranks)]

    def _local_lists(self, host_pages, dev_pages):
        """[ranks, n] rank-local (host, device) page lists; padding copies each rank's device dummy
        page onto its host page 0 (never allocated)."""
        pairs = self._rank_pairs(host_pages, dev_pages)
        width = _bucket(max(max(len(h) for h, _ in pairs), 1))
        hp = np.zeros((self.ranks, width), np.int32)
        dp = np.zeros((self.ranks, width), np.int32)
        for r, (h, d) in enumerate(pairs):
            hp[r, :len(h)], dp[r, :len(d)] = h, d
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
        self._count(names, n, to_host)

    def _count(self, names, pages: int, to_host: bool) -> None:
        counter = self.stats["d2h_bytes" if to_host else "h2d_bytes"]
        for k in names:
            counter[k] = counter.get(k, 0) + pages * self.page_size * self._row_bytes(k)

    def _row_bytes(self, name: str) -> int:
        leaf = getattr(self.pool.cache, name)
        return leaf.dtype.itemsize * int(np.prod(leaf.shape[2:], dtype=np.int64))

    # ---- load ------------------------------------------------------------------------------------
    def load(self, host_pages: np.ndarray, dev_pages: np.ndarray) -> None:
        """Host pages back into freshly allocated device pages, every layer of target and draft, before
        any step reads them. Jitted copies update the pool the next step consumes; on the side stream
        the target's layers are staged for the next forward (its layer c waits for layer c's loads)
        and the draft layer is a jitted copy on the compute stream."""
        if len(host_pages) == 0:
            return
        if self.copier is None:
            for unit in self._layers():
                self._move(unit, host_pages, dev_pages, to_host=False)
        else:
            self._staged_loads.append((np.asarray(host_pages), np.asarray(dev_pages)))
            if self.draft is not None:
                self._move((0, True), host_pages, dev_pages, to_host=False)
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

    def device_rank(self, dev_pages) -> np.ndarray:
        return np.asarray(dev_pages, np.int64) // self.device_pages_per_rank

    def host_rank(self, host_pages) -> np.ndarray:
        return self.allocator.owner(host_pages)

    def _take(self, src: np.ndarray) -> np.ndarray | None:
        """A host page for each device page, from the device page's rank; None if a rank is short."""
        ranks = self.device_rank(src)
        need = np.bincount(ranks, minlength=self.ranks)
        if (need > self.allocator.free_per_rank()).any():
            return None
        return np.array([int(self.allocator.alloc(1, int(r))[0]) for r in ranks], np.int32)

    def backup(self, res: Reservation, dev_pages: np.ndarray) -> None:
        """Copy every layer of the reserved pages (device pages `dev_pages` of the request's page
        table, indexed like the key) to host and acknowledge each layer as its copy completes."""
        src = np.asarray(dev_pages)[res.page_index]
        if res.host_pages is None:
            res.host_pages = self._take(src)
            if res.host_pages is None:
                raise OutOfPages("a CP rank's host pool is short for this backup")
        res.src_pages = src
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
        """Return the reservation's host pages (copies still in flight into them finish first: every
        later copy of that rank is behind them on the same side stream) and drop it."""
        if res.state != "reserved":
            return
        taken = self._taken(res)
        if len(taken):
            self.allocator.free(taken)
        self._release(res, "rolled_back")
        self.stats["rollbacks"] += 1

    @staticmethod
    def _taken(res: Reservation) -> np.ndarray:
        if res.host_pages is not None:
            return res.host_pages
        return np.array([h for h, _ in res.staged.values()], np.int32)

    def _release(self, res: Reservation, state: str) -> None:
        self.open.pop(id(res), None)
        for steps in res.steps:
            for step in steps:
                step.users -= 1
        if self.copier is not None and res.events:
            self.copier.retire_events(res.events)
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
        the request only loses its backup. On the side stream: seal it (`poll` commits it)."""
        if self.copier is not None:
            return self._seal(res, dev_pages)
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
        held = np.concatenate([self.radix.all_host_pages()] + [self._taken(r) for r in self.open.values()])
        free = np.flatnonzero(self.allocator._is_free)
        every = np.concatenate([held, free])
        if len(np.unique(every)) != len(every) or len(every) != self.allocator.capacity:
            raise AssertionError(f"host pages: {len(held)} held + {len(free)} free != {self.allocator.capacity}")

    # ---- side-stream path ------------------------------------------------------------------------
    def _address(self, leaf, rank: int) -> int:
        """Buffer address of rank `rank`'s shard of a pool leaf (device or pinned host)."""
        for shard in leaf.addressable_shards:
            if shard.device == self.devices[rank]:
                return shard.data.unsafe_buffer_pointer()
        raise AssertionError(f"no shard of the pool on rank {rank}")

    def _device_addresses(self, rank: int) -> tuple:
        """The target pool's leaf addresses on a rank (what the layer hook sees)."""
        return tuple(self._address(x, rank) for x in jax.tree.leaves(self.pool.cache))

    def _runs(self, host_pages, dev_pages) -> list[np.ndarray]:
        """Per rank, its pages as copy runs (side_stream.page_runs) of rank-local pages."""
        return [page_runs(d, h) for h, d in self._rank_pairs(host_pages, dev_pages)]

    def _blocks(self, unit, runs: list[np.ndarray]) -> list[list[Copy]]:
        """Per rank, one unit's copies as blocks (leaf index, device byte offset in the leaf's shard,
        host address, bytes), one per leaf and run of pages."""
        layer, draft = unit
        names, ids = self._layer_leaves(layer, draft)
        host_tree, dev_tree = (self.draft, self.pool.draft) if draft else (self.cache, self.pool.cache)
        present = [k for k in LEAVES if getattr(dev_tree, k) is not None]
        out = []
        for r, rank_runs in enumerate(runs):
            blocks = []
            for name, lid in zip(names, ids):
                row = self._row_bytes(name)
                page = row * self.page_size
                dev_base = lid * row * (getattr(dev_tree, name).shape[1] // self.ranks)
                key = (draft, name, r)
                if key not in self._host_base:     # the host pool never moves on this path
                    self._host_base[key] = self._address(getattr(host_tree, name), r)
                host_base = self._host_base[key] + lid * row * (getattr(host_tree, name).shape[1] // self.ranks)
                leaf = present.index(name)
                blocks += [Copy(leaf, dev_base + int(d) * page, host_base + int(h) * page, int(n) * page)
                           for d, h, n in rank_runs]
            out.append(blocks)
        return out

    def device_ids(self) -> list[int]:
        """The copier's key of each rank's device."""
        return [self.copier.rt.device_key(d, r) for r, d in enumerate(self.devices)]

    def stage_backups(self, work) -> None:
        """Before a target forward: for each (reservation, the request's pages, positions computed
        once the step ends), the reserved pages complete by then get host pages and are staged to be
        copied at that forward's layer boundaries. A rank short of host pages stages nothing (the
        seal then finds the pages unstaged and skips the backup)."""
        if self.copier is None:
            return
        for res, pages, end in work:
            if res is None or res.state != "reserved" or res.sealed:
                continue
            ready = [int(i) for i in res.page_index if int(i) not in res.staged and (i + 1) * self.page_size <= end]
            if not ready:
                continue
            src = np.asarray(pages)[ready]
            host = self._take(src)
            if host is None:
                continue
            res.staged.update({i: (int(h), int(d)) for i, h, d in zip(ready, host, src)})
            self._staged_backups.append((res, host, src))

    def take_step(self) -> list[StepCopies]:
        """The staged loads and backups as one StepCopies per device, for the next target forward
        (every forward with layer hooks consumes one per device, empty or not)."""
        steps = [StepCopies(self.num_layers + 1, dev, fail_at_layer=self.fail_at_layer) for dev in self.device_ids()]
        if self._staged_loads:
            self._load_steps += steps
        for host, dev in self._staged_loads:
            self._plan_layers(steps, host, dev, to_host=False)
        for res, host, dev in self._staged_backups:
            self._plan_layers(steps, host, dev, to_host=True)
            if not res.steps or res.steps[-1] is not steps:
                res.steps.append(steps)
                for step in steps:
                    step.users += 1
        self._staged_loads, self._staged_backups = [], []
        return steps

    def _plan_layers(self, steps: list[StepCopies], host, dev, to_host: bool) -> None:
        """Add every target layer's blocks of these pages to each rank's backups (or loads)."""
        runs = self._runs(host, dev)
        for layer in range(self.num_layers):
            for r, blocks in enumerate(self._blocks((layer, False), runs)):
                if blocks:
                    (steps[r].backups if to_host else steps[r].loads).setdefault(layer, []).extend(blocks)
            self._count(self._layer_leaves(layer, False)[0], len(host), to_host=to_host)

    def _copy_after_step(self, units, host_pages, dev_pages) -> list[int]:
        """Device->host copies of pages the pool already holds, on each rank's side stream once the
        host has seen the last step end; returns their events."""
        jax.block_until_ready((self.pool.cache, self.pool.draft))
        per_rank: list[list] = [[] for _ in range(self.ranks)]
        runs = self._runs(host_pages, dev_pages)
        for unit in units:
            tree = self.pool.draft if unit[1] else self.pool.cache
            leaves = jax.tree.leaves(tree)
            for r, blocks in enumerate(self._blocks(unit, runs)):
                per_rank[r] += [(b.host, self._address(leaves[b.leaf], r) + b.offset, b.nbytes, D2H) for b in blocks]
            self._count(self._layer_leaves(*unit)[0], len(host_pages), to_host=True)
        return [self.copier.copy_now(dev, copies) for dev, copies in zip(self.device_ids(), per_rank) if copies]

    def _seal(self, res: Reservation, dev_pages: np.ndarray) -> bool:
        """Issue the reservation's remaining copies after the step — pages no forward copied (they
        existed before, or the tree replaced them at publish) and the draft layer — and mark it
        complete; `poll` commits it when every copy is acknowledged."""
        if res.state != "reserved":
            return False
        current = np.asarray(dev_pages)[res.page_index]
        redo = [j for j, i in enumerate(res.page_index) if res.staged.get(int(i), (0, -1))[1] != current[j]]
        if redo and self.fail_at_layer is not None:     # tests: the copy after the step fails
            self.rollback(res)
            self.stats["failed_backups"] += 1
            return False
        fresh = [j for j in redo if int(res.page_index[j]) not in res.staged]
        host = self._take(current[fresh]) if fresh else np.zeros(0, np.int32)
        if host is None:
            self.rollback(res)
            self.stats["skipped_backups"] += 1
            return False
        for j, h in zip(fresh, host):
            res.staged[int(res.page_index[j])] = (int(h), int(current[j]))
        res.host_pages = np.array([res.staged[int(i)][0] for i in res.page_index], np.int32)
        res.src_pages = current.astype(np.int32)
        for j in redo:
            res.staged[int(res.page_index[j])] = (int(res.host_pages[j]), int(current[j]))
        units = [(layer, False) for layer in range(self.num_layers)] if redo else []
        if redo:
            res.events += self._copy_after_step(units, res.host_pages[redo], current[redo])
        if self.draft is not None:
            res.events += self._copy_after_step([(0, True)], res.host_pages, current)
        res.sealed = True
        self.stats["backups"] += 1
        self.stats["backup_pages"] += len(res.host_pages)
        return True

    def _copies_state(self, res: Reservation) -> bool | None:
        """True: every copy of the reservation completed; False: some still in flight; None: one failed,
        never started, or read a pool buffer that has since moved (it may have been reused)."""
        rt = self.copier.rt
        for steps in res.steps:
            for r, step in enumerate(steps):
                if step.failed:
                    return None
                if step.calls < step.boundaries:
                    return False
                for layer in step.backups:
                    done = step.layer_done(layer, rt)
                    if not done:
                        return done
                if rt.asynchronous and step.pool_addresses != {self._device_addresses(r)}:
                    return None     # the source moved under an asynchronous copy
        return all(rt.done(ev) for _, ev in res.events)

    def poll(self) -> None:
        """Commit every sealed reservation whose copies are all acknowledged; roll back the failed."""
        if self.copier is None:
            return
        for step in self._load_steps:
            moved = self.copier.rt.asynchronous and len(step.pool_addresses) > 1
            if step.failed or moved:     # the pages were never (or not safely) loaded: what read them is wrong
                raise RuntimeError(f"a host-tier load failed in the forward: {step.failed or 'the pool moved'}")
        self._load_steps = [s for s in self._load_steps if s.calls < s.boundaries]
        for res in [r for r in self.open.values() if r.sealed]:
            state = self._copies_state(res)
            if state is None:
                self.rollback(res)
                self.stats["failed_backups"] += 1
            elif state:
                res.acked = set(self._layers())
                self.commit(res)
        self.copier.reap()

    def settle(self) -> None:
        """Wait for every copy in flight, then commit what is sealed."""
        if self.copier is None:
            return
        jax.block_until_ready((self.pool.cache, self.pool.draft))
        self.copier.drain()
        self.stats["settles"] += 1
        self.poll()

    def before_device_free(self, pages) -> None:
        """Device pages are about to return to the allocator: if a copy may still read one, settle."""
        if self.copier is None or not self.open:
            return
        busy = {d for r in self.open.values() for _, d in r.staged.values()}
        if busy.intersection(np.asarray(pages).tolist()):
            self.settle()
