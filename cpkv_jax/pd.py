"""Prefill→decode disaggregation (PD): a prefill engine on a 'cp' mesh over the first N devices hands
each request, once its prompt is computed and its first token sampled, to one of M decode engines
(one device each, each its own pool and radix cache) chosen by a router; the request's full logical
pages move between the pools.

What moves, per request: every layer's MLA latent and rope key, the index key (and its fp8 scales) of
full IndexCache layers only (shared layers have none), and the MTP layer's cache in speculative mode
(the draft KV shares the target's page mapping: one page list moves both), for the prompt's pages the
decode replica does not already hold in its radix cache. Each source rank gathers the rows of the
pages it owns (one shard_map over the prefill mesh: no collective, nothing of another rank is
materialized) and its rows go straight to the decode device with `jax.device_put` (within one process;
the measured choice, scripts/pd_transfer_bench.py). They land in staging buffers; a `TransferMeta`
(per layer: layer id, full/shared/draft, each tensor's dtype and width; the page size and the logical
page ids) is checked against the decode pool's own layout before anything is written, and one jitted
write puts the staged rows into the pool (donated) at commit. A mismatch raises PDTransferError; a
transfer that fails part way leaves the decode pool and tree untouched (its reserved pages go back),
and the prefill side frees the request's pages either way. A decode replica without room makes the
request wait (FIFO), its prefill pages held. The model never sees any of this.

Several processes (jax.distributed; cpkv_jax.distributed): the prefill mesh spans every process (each
runs the prefill steps, whose sampled tokens every process sees), each decode replica runs on the
process owning its device and is a `RemoteReplica` on the others. What only the owner knows travels
from it with `broadcast_object`: its routing view, its admission answer (and how many prompt pages its
cache already holds), the outcome of each transfer to it, and the tokens its steps sample; so every
process makes the same decisions. A source rank's rows cross to a decode device of another process as
a two-device `lax.ppermute` (a shard_map over a (source, destination) mesh that both processes run;
cross-process `device_put` is refused), within one process with `device_put`.

    engine = make_engine("tiny", EngineConfig(pd_prefill_devices=2, pd_decode_replicas=2, kv_pages=64))
    outs = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=8))
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from pathlib import Path

import jax
import numpy as np

from cpkv_jax.config import EngineConfig, EngineConfigError
from cpkv_jax.engine import Engine, EngineInputError, _generation_eos, _load_tokenizer
from cpkv_jax.kv_pool import PageAllocator, page_slots, pages_for
from cpkv_jax.scheduler import Request, TokenEvent
from models.kv import KVCache
from models.model import DsaModel
from models.sharding import KV_LEAF_AXES, RULES


class PDTransferError(RuntimeError):
    """A page transfer whose metadata does not match the receiving pool (nothing was written)."""


# ---- metadata ------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TensorMeta:
    name: str               # the KVCache field: latent, k_rope, index_k, index_scale
    dtype: str
    shape: tuple[int, ...]  # per token (beyond the slot axis)


@dataclasses.dataclass(frozen=True)
class LayerMeta:
    layer: int              # the model's layer id (the MTP layer: num_hidden_layers)
    kind: str               # 'full' (has an index key), 'shared' (IndexCache: none) or 'draft'
    tensors: tuple[TensorMeta, ...]


@dataclasses.dataclass(frozen=True)
class TransferMeta:
    page_size: int
    logical_pages: tuple[int, ...]   # positions in the request's page list of the pages carried
    layers: tuple[LayerMeta, ...]


def _tensor_metas(cache: KVCache, has_index: bool) -> tuple[TensorMeta, ...]:
    out = []
    for name in ("latent", "k_rope", "index_k", "index_scale"):
        arr = getattr(cache, name)
        if arr is None or (name.startswith("index") and not has_index):
            continue
        out.append(TensorMeta(name, str(arr.dtype), tuple(arr.shape[2:])))
    return tuple(out)


def pool_layout(cfg, pool) -> tuple[LayerMeta, ...]:
    """Per layer what a pool stores for one token: target layers in order (index key only on full
    layers), then the MTP layer's when the pool has a draft cache."""
    full = set(cfg.full_layers)
    layers = [LayerMeta(layer, "full" if layer in full else "shared", _tensor_metas(pool.cache, layer in full))
              for layer in range(cfg.num_hidden_layers)]
    if pool.draft is not None:
        layers.append(LayerMeta(cfg.num_hidden_layers, "draft", _tensor_metas(pool.draft, True)))
    return tuple(layers)


def check_meta(sent: TransferMeta, expected: TransferMeta) -> None:
    """Raise PDTransferError naming the first difference between a transfer's metadata and what the
    receiving pool expects."""
    if sent.page_size != expected.page_size:
        raise PDTransferError(f"page size: sent {sent.page_size}, the decode pool's is {expected.page_size}")
    if sent.logical_pages != expected.logical_pages:
        raise PDTransferError(f"logical pages: sent {sent.logical_pages}, the decode side allocated "
                              f"{expected.logical_pages}")
    if len(sent.layers) != len(expected.layers):
        raise PDTransferError(f"{len(sent.layers)} layers sent, the decode pool has {len(expected.layers)}")
    for i, (s, e) in enumerate(zip(sent.layers, expected.layers)):
        if s != e:
            raise PDTransferError(f"layer entry {i}: sent (layer {s.layer}, {s.kind}, {s.tensors}), the decode pool "
                                  f"expects (layer {e.layer}, {e.kind}, {e.tensors})")


def _check_rows(meta: TransferMeta, rows, page_size: int) -> None:
    """The staged arrays have the shapes and dtypes their metadata announces (target and draft)."""
    n = len(meta.logical_pages) * page_size
    target = [m for m in meta.layers if m.kind != "draft"]
    for cache, layers in ((rows[0], target), (rows[1], [m for m in meta.layers if m.kind == "draft"])):
        if cache is None:
            if layers:
                raise PDTransferError("draft layer announced but no draft rows staged")
            continue
        for name in ("latent", "k_rope", "index_k", "index_scale"):
            arr = getattr(cache, name)
            carriers = [t for m in layers for t in m.tensors if t.name == name]
            if arr is None and not carriers:
                continue
            if arr is None or arr.shape != (len(carriers), n) + (carriers[0].shape if carriers else ()) \
                    or any(str(arr.dtype) != t.dtype for t in carriers):
                raise PDTransferError(f"staged {name} {None if arr is None else (arr.shape, arr.dtype)} does not "
                                      f"match its metadata ({len(carriers)} layers x {n} tokens)")


# ---- moving pages --------------------------------------------------------------------------------

def _gather_owned(caches, local_slots):
    """Inside a shard_map over the prefill mesh: this rank's rows at its local slots (no collective)."""
    return jax.tree.map(lambda x: x[:, local_slots[0]], caches)


def _gather(mesh, caches, local_slots):
    spec = RULES.spec(*KV_LEAF_AXES, mesh=mesh)
    f = jax.shard_map(_gather_owned, mesh=mesh, in_specs=(jax.tree.map(lambda _: spec, caches), RULES.spec("kv_slots")),
                      out_specs=jax.tree.map(lambda _: spec, caches))
    return f(caches, local_slots)


_gather_jit = jax.jit(_gather, static_argnums=(0,))


def _write(caches, slots, rows):
    """The staged rows into the pool (target and draft) at their slots: the commit."""
    return jax.tree.map(lambda c, r: c.at[:, slots].set(r), caches, rows)


_write_jit = jax.jit(_write, donate_argnums=(0,))


def move_unit(rows, device):
    """One unit of a transfer (a source rank's rows of one cache) onto the decode device."""
    return jax.device_put(rows, device)


def _ppermute_pair(tree):
    return jax.tree.map(lambda x: jax.lax.ppermute(x, "pd", [(0, 1)]), tree)


_PAIR = jax.sharding.PartitionSpec("pd")
_pair_jit = {}


def move_across(rows, like, src_device, device):
    """One unit onto a decode device of another process: a jitted two-device ppermute over the mesh
    (source, destination), which both processes run. `rows` (source process: the rows on `src_device`;
    destination: None) and `like` (their shapes and dtypes, known to both) are KVCache trees. Returns
    the rows on `device` in the destination process, None in the source process."""
    from jax.sharding import Mesh, NamedSharding
    mesh = Mesh(np.array([src_device, device]), ("pd",))
    sharding = NamedSharding(mesh, _PAIR)
    here = src_device if rows is not None else device
    local = rows if rows is not None else jax.tree.map(
        lambda x: jax.device_put(jax.numpy.zeros(x.shape, x.dtype), device), like)
    both = jax.tree.map(lambda x: jax.make_array_from_single_device_arrays((2,) + x.shape, sharding,
                                                                           [jax.device_put(x[None], here)]), local)
    key = (src_device, device)
    if key not in _pair_jit:
        _pair_jit[key] = jax.jit(jax.shard_map(_ppermute_pair, mesh=mesh, in_specs=_PAIR, out_specs=_PAIR))
    out = _pair_jit[key](both)
    if rows is not None:
        return None
    return jax.tree.map(lambda x: x.addressable_shards[0].data[0], out)


@dataclasses.dataclass
class Staged:
    """A transfer received on the decode side and not yet committed: nothing of it is in the pool."""
    meta: TransferMeta
    slots: np.ndarray        # destination token slots, in the rows' order
    rows: tuple | None       # (target KVCache of rows, draft KVCache of rows | None) on the decode device
                             # (None in a process other than the decode replica's owner)
    bytes: dict


def send_pages(src: Engine, pages: np.ndarray, logical_pages, dst: Engine, dst_pages: np.ndarray) -> Staged:
    """Gather `pages` of the prefill pool on their owner ranks and move each rank's rows to the decode
    device, unit by unit, into staging buffers (the decode pool is not touched). The rows of rank r
    are its pages in request order; `dst_pages` are the decode pages they will land in."""
    ps = src.config.page_size
    pages = np.asarray(pages, np.int64)
    alloc = src.allocator
    owners = alloc.owner(pages)
    per_rank = [np.flatnonzero(owners == r) for r in range(alloc.ranks)]
    width = max(len(ix) for ix in per_rank)
    width = 1 << max(0, width - 1).bit_length()            # a power-of-two bucket bounds the compilations
    local = np.zeros((alloc.ranks, width * ps), np.int32)  # padding reads each rank's dummy slot 0
    for r, ix in enumerate(per_rank):
        local[r, :len(ix) * ps] = page_slots(pages[ix] - r * alloc.pages_per_rank, ps)
    mesh = src.mesh
    caches = (src.pool.cache, src.pool.draft)
    gathered = _gather_jit(mesh, caches, jax.device_put(local, RULES.sharding(mesh, "kv_slots")))
    device = replica_device(dst)
    me = jax.process_index()
    receiving = device.process_index == me
    order, parts, sent = [], [], collections.Counter()
    for r, ix in enumerate(per_rank):
        if not len(ix):
            continue
        rank_device = mesh.devices.flat[r]
        n = len(ix) * ps
        unit_rows = []
        for prefix, cache in zip(("", "draft_"), gathered):
            if cache is None:
                unit_rows.append(None)
                continue
            like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.sharding.shard_shape(x.shape), x.dtype), cache)
            if rank_device.process_index == device.process_index:      # within one process: device_put
                moved = (move_unit(jax.tree.map(lambda x: _shard_on(x, rank_device)[:, :n], cache), device)
                         if receiving else None)
            elif receiving or rank_device.process_index == me:           # across two: a ppermute both run
                mine = None if receiving else jax.tree.map(lambda x: _shard_on(x, rank_device), cache)
                moved = move_across(mine, like, rank_device, device)     # the whole bucket: bounded compiles
                moved = None if moved is None else jax.tree.map(lambda x: x[:, :n], moved)
            else:
                moved = None                                              # a third process: nothing to do
            for name in ("latent", "k_rope", "index_k", "index_scale"):
                arr = getattr(like, name)
                if arr is not None:
                    sent[prefix + name] += n * int(np.prod(arr.shape[2:], dtype=np.int64)) * arr.shape[0] \
                        * np.dtype(arr.dtype).itemsize
            unit_rows.append(moved)
        parts.append(unit_rows)
        order.append(ix)
    rows = None
    if receiving:
        rows = tuple(None if parts[0][i] is None else jax.tree.map(
            lambda *xs: jax.numpy.concatenate(xs, axis=1), *[p[i] for p in parts]) for i in range(2))
    slots = page_slots(np.asarray(dst_pages)[np.concatenate(order)], ps) if receiving else None
    meta = TransferMeta(ps, tuple(int(p) for p in logical_pages), pool_layout(src.cfg, src.pool))
    return Staged(meta, slots, rows, dict(sent))


def _shard_on(x, device):
    for s in x.addressable_shards:
        if s.device == device:
            return s.data
    raise PDTransferError(f"no shard of the prefill pool on {device} in this process")


def replica_device(eng) -> "jax.Device":
    """The one device of a decode replica (an Engine or a RemoteReplica)."""
    return eng.device if isinstance(eng, RemoteReplica) else eng.mesh.devices.flat[0]


def _owner(eng) -> int:
    return replica_device(eng).process_index


class RemoteReplica:
    """A decode replica whose device belongs to another process: this process runs nothing of it. Its
    owner tells every process what it decides and samples (PDEngine); here it keeps the requests
    decoding there (so every process knows when it has work, and applies their tokens) and the stats
    its owner last reported."""

    radix = None
    hicache = None

    def __init__(self, config: EngineConfig, cfg, device):
        self.config, self.cfg, self.device = config, cfg, device
        self.allocator = PageAllocator(config.kv_pages, 1)      # its capacity (nothing is allocated here)
        self.max_context = min(cfg.max_position_embeddings, self.allocator.capacity * config.page_size)
        self.requests: dict[int, Request] = {}
        self.reported = {"compilations": 0, "max_compilations": 0, "stats": None}

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def compilations(self) -> int:
        return self.reported["compilations"]

    def max_compilations(self) -> int:
        return self.reported["max_compilations"]

    def stats(self) -> dict:
        if self.reported["stats"] is not None:
            return self.reported["stats"]
        return {"waiting": 0, "running": len(self.requests), "free_pages": self.allocator.capacity,
                "total_pages": self.allocator.capacity, "reserved_pages": 0, "request_pages": 0}

    def apply(self, ev: TokenEvent) -> None:
        """A token the owner's step sampled, onto this process's copy of the request."""
        req = self.requests.get(ev.rid)
        if req is None:
            return
        req.output.append(ev.token_id)
        req.logprobs.append(ev.logprob)
        if req.params.top_logprobs:
            req.top_logprobs.append(ev.top_logprobs)
        if req.text is not None:
            req.text.append(ev.token_id)
            req.text.emit(final=ev.finish_reason is not None)
        if ev.finish_reason is not None:
            _end(req, ev.finish_reason)
            del self.requests[ev.rid]


def _report(eng: Engine) -> dict:
    return {"compilations": eng.compilations(), "max_compilations": eng.max_compilations(), "stats": eng.stats()}


def commit(dst: Engine, staged: Staged, logical_pages) -> None:
    """Check the staged transfer against the decode pool (metadata, then the staged arrays' shapes and
    dtypes) and only then write it, in one jitted step."""
    expected = TransferMeta(dst.config.page_size, tuple(int(p) for p in logical_pages), pool_layout(dst.cfg, dst.pool))
    check_meta(staged.meta, expected)
    _check_rows(staged.meta, staged.rows, dst.config.page_size)
    caches = (dst.pool.cache, dst.pool.draft)    # the runner, spec decoder and host tier share this KVPool
    dst.pool.cache, dst.pool.draft = _write_jit(caches, jax.numpy.asarray(staged.slots), staged.rows)


# ---- the disaggregated engine --------------------------------------------------------------------

def pd_devices(config: EngineConfig, devices=None) -> tuple[list, list]:
    """(prefill devices, one device per decode replica): the first N devices, then the next M."""
    devices = list(jax.devices() if devices is None else devices)
    n, m = config.pd_prefill_devices, config.pd_decode_replicas
    if n + m > len(devices):
        raise EngineConfigError(f"pd_prefill_devices {n} + pd_decode_replicas {m} needs {n + m} devices, "
                                f"{len(devices)} visible")
    processes = {d.process_index for d in devices[:n]}
    if jax.process_count() > 1 and len(processes) < jax.process_count():
        raise EngineConfigError(f"PD over {jax.process_count()} processes: the prefill devices (the first {n}) must "
                                f"include devices of every process (they have those of {sorted(processes)}); raise "
                                f"pd_prefill_devices")
    return devices[:n], [[d] for d in devices[n:n + m]]


@dataclasses.dataclass(eq=False)
class _Handover:
    req: Request          # the user's request (decodes on a replica after the transfer)
    held: Request         # its prefill-side copy, holding the prefill pages until released


class PDEngine(Engine):
    """Engine's request API (generate, stream, add_request, abort, output) over a prefill engine and
    decode replicas. It reuses Engine's front half (validation, queueing, outputs, streams' inboxes)
    and each engine's own step; only `step`, `abort` and the bookkeeping around them are its own, so
    it does not call Engine.__init__ (it has no pool or runner of its own)."""

    def __init__(self, model: str | Path | DsaModel = "tiny", config: EngineConfig | None = None, *,
                 tokenizer=None, devices=None):
        from models.weights import load_model

        self.config = config = (config or EngineConfig(pd_prefill_devices=1)).validate()
        if not config.pd_prefill_devices:
            raise EngineConfigError("PDEngine needs pd_prefill_devices >= 1")
        prefill_devices, decode_devices = pd_devices(config, devices)
        base = dataclasses.replace(config, pd_prefill_devices=0, pd_decode_replicas=1)
        tokenizer = tokenizer if tokenizer is not None else _load_tokenizer(model)
        eos_from_checkpoint = _generation_eos(model)
        prefill_config = dataclasses.replace(base, cp_size=config.pd_prefill_devices)
        if jax.process_count() > 1 and not isinstance(model, DsaModel):
            # a checkpoint restores onto a mesh spanning the processes (the prefill engine's); the decode
            # replicas take this process's copy of its (replicated) parameters
            self.prefill = Engine(model, prefill_config, tokenizer=tokenizer, devices=prefill_devices)
            model = _local_copy(self.prefill.model)
        else:
            model = model if isinstance(model, DsaModel) else load_model(model, dtype=config.dtype)
            self.prefill = Engine(model, prefill_config, tokenizer=tokenizer, devices=prefill_devices)
        decode_config = dataclasses.replace(base, cp_size=1)
        self.decoders = [Engine(model, decode_config, tokenizer=tokenizer, devices=d)
                         if d[0].process_index == jax.process_index() else RemoteReplica(decode_config, model.cfg, d[0])
                         for d in decode_devices]
        self.multi = jax.process_count() > 1     # replicas' decisions and tokens come from their owners
        self.model, self.cfg = model, model.cfg
        self.tokenizer = tokenizer
        self.eos_ids = frozenset(self.cfg.eos_token_id) | eos_from_checkpoint
        self.spec_tokens = self.prefill.spec_tokens
        self.scheduler = self.prefill.scheduler            # new requests queue for prefill
        self.allocator = self.decoders[0].allocator        # a request's whole life must fit a decode pool
        self.max_context = self.decoders[0].max_context
        self.hicache = None
        self.spec_decoder = self.prefill.spec_decoder
        self._rids = itertools.count()
        self._requests: dict[int, Request] = {}
        self._inboxes: dict[int, collections.deque[TokenEvent]] = {}
        self.handovers: collections.deque[_Handover] = collections.deque()   # prefilled, waiting for a replica
        self.metrics = {"steps": 0, "pd_transfers": 0, "pd_pages": 0, "pd_waits": 0, "pd_aborted_transfers": 0,
                        "pd_bytes": collections.Counter()}

    # ---- requests --------------------------------------------------------------------------------
    def validate(self, prompt, params):
        ids, params = super().validate(prompt, params)
        need = pages_for(len(ids) + self.spec_tokens, self.config.page_size)
        if need > self.prefill.allocator.capacity:
            raise EngineInputError(f"prompt ({len(ids)} tokens) needs {need} KV pages on the prefill engine; its "
                                   f"pool has {self.prefill.allocator.capacity} (raise kv_pages)")
        return ids, params

    def _enqueue(self, ids, params, return_logits, stream_text) -> int:
        rid = super()._enqueue(ids, params, return_logits, stream_text)
        self._requests[rid].decode_elsewhere = True
        return rid

    def abort(self, rid: int) -> None:
        req = self._requests.get(rid)
        if req is None or req.finish_reason is not None:
            return
        for h in list(self.handovers):
            if h.req is req:
                self.handovers.remove(h)
                _end(h.held, "abort")
                self.prefill.scheduler.release(h.held, publish=False)
                _end(req, "abort")
                return
        for eng in [self.prefill] + self.decoders:
            if isinstance(eng, RemoteReplica):       # its owner (applying the same abort) releases it
                if eng.requests.pop(rid, None) is not None:
                    _end(req, "abort")
                    return
            elif req in eng.scheduler.running or req in eng.scheduler.waiting:
                eng.abort_request(req)
                return

    def has_unfinished(self) -> bool:
        return bool(self.handovers) or any(e.has_unfinished() for e in [self.prefill] + self.decoders)

    # ---- stepping --------------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        """One prefill step (its first tokens), the hand-over of prompts it completed, their transfers
        to decode replicas with room (in arrival order), and one step of every busy decode replica."""
        events = self.prefill.step() if self.prefill.has_unfinished() else self._poll_host_tier(self.prefill)
        for req in list(self.prefill.scheduler.running):
            if not req.prefilling and req.output and req.finish_reason is None:
                req.decode_elsewhere = False
                self.handovers.append(_Handover(req, self.prefill.scheduler.hand_over(req)))
        events += self._transfer_waiting()
        stepped = {}
        for i, eng in enumerate(self.decoders):
            if not isinstance(eng, RemoteReplica):
                stepped[i] = eng.step() if eng.has_unfinished() else self._poll_host_tier(eng)
        if self.multi:     # every replica's tokens (and stats) from its owner, applied where it is remote
            reports = self._from_owners({i: (ev, _report(self.decoders[i])) for i, ev in stepped.items()})
            for i, eng in enumerate(self.decoders):
                if isinstance(eng, RemoteReplica):
                    stepped[i], eng.reported = reports[i]
                    for ev in stepped[i]:
                        eng.apply(ev)
        for i in range(len(self.decoders)):
            events += stepped[i]
        self.metrics["steps"] += 1
        self._file(events)
        return events

    @staticmethod
    def _poll_host_tier(eng: Engine) -> list[TokenEvent]:
        """An engine that does not step this time still commits its finished host-tier backups."""
        if eng.hicache is not None:
            eng.hicache.poll()
        return []

    def generate(self, prompts, params=None, *, return_logits: bool = False):
        """Engine.generate, then every engine's host-tier backups still in flight become visible."""
        outs = super().generate(prompts, params, return_logits=return_logits)
        for eng in [self.prefill] + self.decoders:
            if eng.hicache is not None:
                eng.hicache.settle()
        return outs

    def route(self, req: Request) -> list[Engine]:
        """Decode replicas in the order to try: least loaded first (running requests, then free pages);
        with pd_router='prefix' the longest prefix already cached on a replica first. Over several
        processes each replica's view comes from its owner."""
        def view(eng):
            s = eng.scheduler
            load = (len(s.running), -(s.allocator.num_free - s.reserved_pages))
            if self.config.pd_router != "prefix":
                return load
            cached = 0 if eng.radix is None else len(eng.radix.match(req.prompt[:-1]).device_pages)
            return (-cached,) + load
        views = {i: view(e) for i, e in enumerate(self.decoders) if not isinstance(e, RemoteReplica)}
        if self.multi:
            views = self._from_owners(views)
        return [self.decoders[i] for i in sorted(range(len(self.decoders)), key=lambda i: views[i])]

    def _from_owners(self, local: dict) -> dict:
        """{replica index: value} of every replica, each value from the process owning the replica
        (`local`: this process's own replicas'); every process calls it at the same point."""
        from cpkv_jax.distributed import broadcast_object
        out = {}
        for p in sorted({_owner(e) for e in self.decoders}):
            out.update(broadcast_object(local if p == jax.process_index() else None, source=p))
        return out

    def _from_owner(self, eng, value):
        """`value` as the process owning replica `eng` has it (every process calls it)."""
        if not self.multi:
            return value
        from cpkv_jax.distributed import broadcast_object
        return broadcast_object(value, source=_owner(eng))

    def _transfer_waiting(self) -> list[TokenEvent]:
        events = []
        while self.handovers:
            h = self.handovers[0]
            target = first = None
            for eng in self.route(h.req):
                first = self._admit(eng, h.req)
                if first is not None:
                    target = eng
                    break
            if target is None:
                self.metrics["pd_waits"] += 1
                break
            self.handovers.popleft()
            events += self.transfer(h, target, first)
        return events

    def _admit(self, eng, req: Request) -> int | None:
        """Admission on replica `eng` (decided by its owner): None (it waits), or how many of the
        prompt's pages the replica's cache already holds."""
        first = None
        if not isinstance(eng, RemoteReplica):
            cached = req.cached_tokens
            if eng.scheduler.admit_prefilled(req):
                first = len(req.pages)
            req.cached_tokens = cached      # what the prompt's prefill took from the prefill engine's cache
        return self._from_owner(eng, first)

    def transfer(self, h: _Handover, dst: Engine, first: int | None = None) -> list[TokenEvent]:
        """Move a handed-over request's prompt pages (those `dst` does not already cache: the first
        `first`, default those the request holds there) and start it decoding there. On any failure
        nothing is visible on the decode side (its pages go back), the prefill side frees its pages,
        the request ends with 'abort'; a metadata mismatch also raises. Over several processes the
        replica's owner writes the pages and tells every process the outcome."""
        req, held, ps = h.req, h.held, self.config.page_size
        local = not isinstance(dst, RemoteReplica)
        first = len(req.pages) if first is None else first
        n_prompt = pages_for(len(req.prompt), ps)
        logical = range(first, n_prompt)
        if local:
            dst.scheduler.allocate(req, [0] * len(logical))
        staged = failure = None
        try:
            if len(logical):
                staged = send_pages(self.prefill, held.pages[first:n_prompt], logical, dst,
                                    req.pages[first:n_prompt] if local else None)
                if local:
                    commit(dst, staged, logical)
            if req.draft_q is not None:
                q, row = req.draft_q
                req.draft_q = (_onto(q[row:row + 1], replica_device(dst)), 0) if local else None
        except Exception as e:
            if not (local or isinstance(e, PDTransferError)):
                raise                      # a process that only sends: the owner's outcome can't follow
            failure = e
        outcome = self._from_owner(dst, None if failure is None else (isinstance(failure, PDTransferError),
                                                                     str(failure)))
        if outcome is not None:
            self.metrics["pd_aborted_transfers"] += 1
            _end(req, "abort")
            _end(held, "abort")
            if local:
                dst.scheduler.release(req, publish=False)
            self.prefill.scheduler.release(held, publish=False)
            if outcome[0]:
                raise failure if failure is not None else PDTransferError(outcome[1])
            return [TokenEvent(req.rid, -1, float("nan"), "abort")]   # no token: the stream ends
        self.prefill.scheduler.release(held)
        if local:
            dst.scheduler.start_decoding(req)
        else:
            dst.requests[req.rid] = req
        self.metrics["pd_transfers"] += 1
        self.metrics["pd_pages"] += len(logical)
        if staged is not None:
            self.metrics["pd_bytes"].update(staged.bytes)
        return []

    # ---- inspection ------------------------------------------------------------------------------
    def max_compilations(self) -> int:
        return sum(e.max_compilations() for e in [self.prefill] + self.decoders)

    def compilations(self) -> int:
        return sum(e.compilations() for e in [self.prefill] + self.decoders)

    def stats(self) -> dict:
        parts = [self.prefill.stats()] + [e.stats() for e in self.decoders]
        s = {k: sum(p[k] for p in parts) for k in ("waiting", "running", "free_pages", "total_pages",
                                                     "reserved_pages", "request_pages")}
        s["waiting"] += len(self.handovers)
        s.update(self.metrics, pd_bytes=dict(self.metrics["pd_bytes"]), prefill=parts[0], decode=parts[1:])
        s["compilations"] = self.compilations()
        return s


def _onto(q, device):
    """A pending draft distribution (computed on the prefill mesh, replicated) onto the decode device:
    this process's copy of it (device_put within the process)."""
    if q.is_fully_addressable:
        return move_unit(q, device)
    if not q.is_fully_replicated:
        raise PDTransferError(f"a draft distribution sharded as {q.sharding} can't move across processes")
    return move_unit(q.addressable_data(0), device)


def _local_copy(model: DsaModel) -> DsaModel:
    """The model with each parameter as this process's copy (parameters replicated over a mesh that
    spans processes), for engines on this process's devices."""
    from flax import nnx

    def local(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            return x
        if not x.is_fully_replicated:
            raise EngineConfigError(f"a parameter sharded as {x.sharding} can't be copied to a decode replica")
        return x.addressable_data(0)
    graph, state = nnx.split(model)
    return nnx.merge(graph, jax.tree.map(local, state))


def _end(req: Request, reason: str) -> None:
    req.finish_reason = reason
    req.t_finish = time.perf_counter()


def make_engine(model, config: EngineConfig, **kw) -> Engine:
    """The engine a configuration asks for: PD (pd_prefill_devices > 0) or colocated."""
    config = config.validate()
    return PDEngine(model, config, **kw) if config.pd_prefill_devices else Engine(model, config, **kw)
