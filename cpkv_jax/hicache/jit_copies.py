"""Jitted copies: the host tier's block copies as XLA programs on the compute stream, after the step
(every backend). Each page of one layer is a dynamic_slice -> memory-space move ->
dynamic_update_slice into the donated destination pool, the path REFERENCE.md measured at the PCIe
rate. A backup is acknowledged layer by layer as each copy completes, so it commits at once.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from cpkv_jax.hicache.copy_path import ACKED, FAILED, SKIPPED
from cpkv_jax.hicache.host_pool import HostPool
from cpkv_jax.hicache.reservation import Reservation
from cpkv_jax.kv_pool import KVPool, OutOfPages
from models.sharding import KV_LEAF_AXES, RULES


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
    pools = tuple(RULES.spec(*KV_LEAF_AXES) for _ in dst)
    per_rank = RULES.spec("kv_slots")   # [ranks, n] page lists: row r is rank r's own pages
    return jax.shard_map(local, mesh=mesh, in_specs=(pools, pools, P(), per_rank, per_rank), out_specs=pools)(
        dst, src, layers, dst_pages, src_pages)


class JitCopies:
    """The CopyPath of jitted block copies: loads and backups complete when issued, nothing is staged
    or left in flight."""

    def __init__(self, pool: KVPool, host: HostPool, stats: dict):
        self.pool, self.host, self.stats = pool, host, stats
        self.fail_at_layer: int | None = None

    def _local_lists(self, host_pages, dev_pages):
        """[ranks, n] rank-local (host, device) page lists; padding copies each rank's device dummy
        page onto its host page 0 (never allocated)."""
        pairs = self.host.rank_pairs(host_pages, dev_pages)
        width = _bucket(max(max(len(h) for h, _ in pairs), 1))
        hp = np.zeros((self.host.ranks, width), np.int32)
        dp = np.zeros((self.host.ranks, width), np.int32)
        for r, (h, d) in enumerate(pairs):
            hp[r, :len(h)], dp[r, :len(d)] = h, d
        return hp, dp

    def move(self, unit, host_pages, dev_pages, to_host: bool) -> None:
        """One (layer, draft) unit's pages between the device pool and the host pool."""
        layer, draft = unit
        names, ids = self.host.layer_leaves(layer, draft)
        host, dev = (self.host.draft, self.pool.draft) if draft else (self.host.cache, self.pool.cache)
        hp, dp = self._local_lists(host_pages, dev_pages)
        src, dst = (dev, host) if to_host else (host, dev)
        moved = _copy_pages(tuple(getattr(dst, k) for k in names), tuple(getattr(src, k) for k in names),
                            jnp.asarray(ids, jnp.int32), jnp.asarray(hp if to_host else dp),
                            jnp.asarray(dp if to_host else hp), page_size=self.host.page_size, to_host=to_host,
                            mesh=self.host.mesh)
        updated = dataclasses.replace(dst, **dict(zip(names, moved)))
        if to_host:
            if draft:
                self.host.draft = updated
            else:
                self.host.cache = updated
        elif draft:
            self.pool.draft = updated
        else:
            self.pool.cache = updated
        self.host.add_bytes(self.stats["d2h_bytes" if to_host else "h2d_bytes"], names, len(host_pages))

    def load(self, host_pages, dev_pages) -> None:
        """Updates the pool the next step consumes."""
        for unit in self.host.units():
            self.move(unit, host_pages, dev_pages, to_host=False)

    def stage(self, work) -> None:
        """Nothing to stage: the copies run after the step."""

    def backup(self, res: Reservation, dev_pages) -> str:
        try:
            self._copy_and_ack(res, dev_pages)
        except OutOfPages:
            return SKIPPED
        except Exception:
            return FAILED
        return ACKED

    def _copy_and_ack(self, res: Reservation, dev_pages) -> None:
        """Copy every layer of the reserved pages to host and acknowledge each layer as its copy
        completes."""
        src = np.asarray(dev_pages)[res.page_index]
        if res.host_pages is None:
            res.host_pages = self.host.take(src)
            if res.host_pages is None:
                raise OutOfPages("a CP rank's host pool is short for this backup")
        res.src_pages = src
        for unit in self.host.units():
            if self.fail_at_layer is not None and unit == (self.fail_at_layer, False):
                raise RuntimeError(f"injected backup failure at layer {unit[0]}")
            self.move(unit, res.host_pages, src, to_host=True)
            jax.block_until_ready(self.host.draft if unit[1] else self.host.cache)
            res.acked.add(unit)

    def poll(self, sealed, done) -> None:
        """Nothing in flight: every backup was acknowledged when issued."""

    def settle(self) -> None:
        """Nothing in flight."""

    def reads_any(self, dev_pages, reservations) -> bool:
        return False

    def release(self, res: Reservation) -> None:
        """Nothing kept per reservation."""
