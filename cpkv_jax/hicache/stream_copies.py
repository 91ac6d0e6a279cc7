"""Side-stream copies (GPU; memmoves on the CPU backend): the host tier's copies planned as byte
blocks for `side_stream`'s copier. The target's pages are copied at the layer boundaries of the
forward that writes them (staged before the step, started by the layer hook, acknowledged by
per-layer events); loads are enqueued at the first boundary and each layer waits for its own. The
draft layer and pages that already existed are copied after the step on the same side stream. A
backup is in flight until `poll` finds every copy acknowledged; the device pages a copy reads are
never freed under it (`reads_any` makes the controller settle first).
"""

from __future__ import annotations

import jax
import numpy as np

from cpkv_jax.hicache.copy_path import FAILED, IN_FLIGHT, SKIPPED
from cpkv_jax.hicache.host_pool import LEAVES, HostPool
from cpkv_jax.hicache.jit_copies import JitCopies
from cpkv_jax.hicache.reservation import Reservation
from cpkv_jax.hicache.side_stream import D2H, Copy, SideStreamCopier, StepCopies, page_runs
from cpkv_jax.kv_pool import KVPool


class SideStreamCopies:
    """The CopyPath over a SideStreamCopier: stages each forward's copies (`take_step` hands them to
    the runner) and reports backups as acknowledged once their events completed."""

    def __init__(self, pool: KVPool, host: HostPool, stats: dict, copier: SideStreamCopier):
        self.pool, self.host, self.stats, self.copier = pool, host, stats, copier
        self.draft_copies = JitCopies(pool, host, stats)   # the draft layer's loads, on the compute stream
        self.fail_at_layer: int | None = None
        self._staged_loads: list[tuple[np.ndarray, np.ndarray]] = []
        self._staged_backups: list[tuple[Reservation, np.ndarray, np.ndarray]] = []  # (res, host, device)
        self._load_steps: list[StepCopies] = []   # forwards carrying loads, until they ran
        self._host_base: dict[tuple, int] = {}      # (draft, leaf, device index) -> host pool shard address

    # ---- addresses and blocks --------------------------------------------------------------------
    def address(self, leaf, i: int) -> int:
        """Buffer address of device `i`'s (host.devices) shard of a pool leaf (device or pinned host)."""
        for shard in leaf.addressable_shards:
            if shard.device == self.host.devices[i]:
                return shard.data.unsafe_buffer_pointer()
        raise AssertionError(f"no shard of the pool on device {self.host.devices[i]}")

    def _device_addresses(self, i: int) -> tuple:
        """The target pool's leaf addresses on device i (what the layer hook sees)."""
        return tuple(self.address(x, i) for x in jax.tree.leaves(self.pool.cache))

    def device_ids(self) -> list[int]:
        """The copier's key of each device holding a pool shard."""
        return [self.copier.rt.device_key(d, i) for i, d in enumerate(self.host.devices)]

    def runs(self, host_pages, dev_pages) -> list[np.ndarray]:
        """Per rank, its pages as copy runs (side_stream.page_runs) of rank-local pages."""
        return [page_runs(d, h) for h, d in self.host.rank_pairs(host_pages, dev_pages)]

    def blocks(self, unit, runs: list[np.ndarray]) -> list[list[Copy]]:
        """Per device, one unit's copies as blocks (leaf index, device byte offset in the leaf's shard,
        host address, bytes), one per leaf and run of its rank's pages: every replica of a rank's
        shard (the devices of its 'ep'/'tp' group) copies between itself and its own host twin."""
        layer, draft = unit
        names, ids = self.host.layer_leaves(layer, draft)
        host_tree, dev_tree = (self.host.draft, self.pool.draft) if draft else (self.host.cache, self.pool.cache)
        present = [k for k in LEAVES if getattr(dev_tree, k) is not None]
        ranks = self.host.ranks
        out = []
        for i, r in enumerate(self.host.device_ranks):
            blocks = []
            for name, lid in zip(names, ids):
                row = self.host.row_bytes(name)
                page = row * self.host.page_size
                dev_base = lid * row * (getattr(dev_tree, name).shape[1] // ranks)
                key = (draft, name, i)
                if key not in self._host_base:     # the host pool never moves on this path
                    self._host_base[key] = self.address(getattr(host_tree, name), i)
                host_base = self._host_base[key] + lid * row * (getattr(host_tree, name).shape[1] // ranks)
                leaf = present.index(name)
                blocks += [Copy(leaf, dev_base + int(d) * page, host_base + int(h) * page, int(n) * page)
                           for d, h, n in runs[r]]
            out.append(blocks)
        return out

    # ---- staging for the next forward ------------------------------------------------------------
    def load(self, host_pages, dev_pages) -> None:
        """The target's layers are staged for the next forward (its layer c waits for layer c's
        loads); the draft layer is a jitted copy on the compute stream."""
        self._staged_loads.append((np.asarray(host_pages), np.asarray(dev_pages)))
        if self.host.draft is not None:
            self.draft_copies.move((0, True), host_pages, dev_pages, to_host=False)

    def stage(self, work) -> None:
        """The reserved pages complete by the step's end get host pages and are staged to be copied
        at that forward's layer boundaries. A rank short of host pages stages nothing (`backup` then
        finds the pages unstaged and skips the backup)."""
        ps = self.host.page_size
        for res, pages, end in work:
            if res is None or res.state != "reserved" or res.sealed:
                continue
            ready = [int(i) for i in res.page_index if int(i) not in res.staged and (i + 1) * ps <= end]
            if not ready:
                continue
            src = np.asarray(pages)[ready]
            host = self.host.take(src)
            if host is None:
                continue
            res.staged.update({i: (int(h), int(d)) for i, h, d in zip(ready, host, src)})
            self._staged_backups.append((res, host, src))

    def take_step(self) -> list[StepCopies]:
        """The staged loads and backups as one StepCopies per device, for the next target forward
        (every forward with layer hooks consumes one per device, empty or not)."""
        steps = [StepCopies(self.host.num_layers + 1, dev, fail_at_layer=self.fail_at_layer)
                 for dev in self.device_ids()]
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
        """Add every target layer's blocks of these pages to each device's backups (or loads)."""
        runs = self.runs(host, dev)
        for layer in range(self.host.num_layers):
            for i, blocks in enumerate(self.blocks((layer, False), runs)):
                if blocks:
                    (steps[i].backups if to_host else steps[i].loads).setdefault(layer, []).extend(blocks)
            self.host.add_bytes(self.stats["d2h_bytes" if to_host else "h2d_bytes"],
                                self.host.layer_leaves(layer, False)[0], len(host))

    # ---- after the step --------------------------------------------------------------------------
    def _copy_after_step(self, units, host_pages, dev_pages) -> list[int]:
        """Device->host copies of pages the pool already holds, on each device's side stream once the
        host has seen the last step end; returns their events."""
        jax.block_until_ready((self.pool.cache, self.pool.draft))
        per_device: list[list] = [[] for _ in self.host.devices]
        runs = self.runs(host_pages, dev_pages)
        for unit in units:
            tree = self.pool.draft if unit[1] else self.pool.cache
            leaves = jax.tree.leaves(tree)
            for i, blocks in enumerate(self.blocks(unit, runs)):
                per_device[i] += [(b.host, self.address(leaves[b.leaf], i) + b.offset, b.nbytes, D2H) for b in blocks]
            self.host.add_bytes(self.stats["d2h_bytes"], self.host.layer_leaves(*unit)[0], len(host_pages))
        return [self.copier.copy_now(dev, copies) for dev, copies in zip(self.device_ids(), per_device) if copies]

    def backup(self, res: Reservation, dev_pages) -> str:
        """Issue the reservation's remaining copies after the step — pages no forward copied (they
        existed before, or the tree replaced them at publish) and the draft layer."""
        current = np.asarray(dev_pages)[res.page_index]
        redo = [j for j, i in enumerate(res.page_index) if res.staged.get(int(i), (0, -1))[1] != current[j]]
        if redo and self.fail_at_layer is not None:     # tests: the copy after the step fails
            return FAILED
        fresh = [j for j in redo if int(res.page_index[j]) not in res.staged]
        host = self.host.take(current[fresh]) if fresh else np.zeros(0, np.int32)
        if host is None:
            return SKIPPED
        for j, h in zip(fresh, host):
            res.staged[int(res.page_index[j])] = (int(h), int(current[j]))
        res.host_pages = np.array([res.staged[int(i)][0] for i in res.page_index], np.int32)
        res.src_pages = current.astype(np.int32)
        for j in redo:
            res.staged[int(res.page_index[j])] = (int(res.host_pages[j]), int(current[j]))
        if redo:
            units = [(layer, False) for layer in range(self.host.num_layers)]
            res.events += self._copy_after_step(units, res.host_pages[redo], current[redo])
        if self.host.draft is not None:
            res.events += self._copy_after_step([(0, True)], res.host_pages, current)
        return IN_FLIGHT

    def _copies_state(self, res: Reservation) -> bool | None:
        """True: every copy of the reservation completed; False: some still in flight; None: one failed,
        never started, or read a pool buffer that has since moved (it may have been reused)."""
        rt = self.copier.rt
        for steps in res.steps:
            for i, step in enumerate(steps):
                if step.failed:
                    return None
                if step.calls < step.boundaries:
                    return False
                for layer in step.backups:
                    done = step.layer_done(layer, rt)
                    if not done:
                        return done
                if rt.asynchronous and step.pool_addresses != {self._device_addresses(i)}:
                    return None     # the source moved under an asynchronous copy
        return all(rt.done(ev) for _, ev in res.events)

    def poll(self, sealed, done) -> None:
        """A failed load raises (what read its pages is wrong); then each sealed reservation's state."""
        for step in self._load_steps:
            moved = self.copier.rt.asynchronous and len(step.pool_addresses) > 1
            if step.failed or moved:     # the pages were never (or not safely) loaded: what read them is wrong
                raise RuntimeError(f"a host-tier load failed in the forward: {step.failed or 'the pool moved'}")
        self._load_steps = [s for s in self._load_steps if s.calls < s.boundaries]
        for res in sealed:
            done(res, self._copies_state(res))
        self.copier.reap()

    def settle(self) -> None:
        jax.block_until_ready((self.pool.cache, self.pool.draft))
        self.copier.drain()
        self.stats["settles"] += 1

    def reads_any(self, dev_pages, reservations) -> bool:
        busy = {d for r in reservations for _, d in r.staged.values()}
        return bool(busy.intersection(np.asarray(dev_pages).tolist()))

    def release(self, res: Reservation) -> None:
        """The forwards and events that carried its copies may be recycled."""
        for steps in res.steps:
            for step in steps:
                step.users -= 1
        if res.events:
            self.copier.retire_events(res.events)
