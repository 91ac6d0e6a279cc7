"""KV-integrity trace: hashes of what the host tier moves and of what every layer reads and computes,
written as JSONL records, and the analyzer behind `cpkv-jax trace diff RUN_A RUN_B`, which names the
first place two runs of the same workload diverge and what that points at.

Why: main KV can round-trip through the host tier byte-perfect while the outputs are garbage (the
indexer's keys were the unverified part in the system we reimplement). A diff of hashes taken at every
hand-over says which hand-over broke. Levels (EngineConfig.kv_trace, `--kv-trace N --trace-out PATH`):

  0  off: nothing is compiled in (an engine's steps are the executables of an engine without a trace);
  1  transfer metadata, one record per host-tier backup and load: request, page fingerprints, host and
     device pages, CP ranks, layers moved, bytes per leaf;
  2  + page hashes: per page and layer, a hash of the main KV (latent + rope key) and of the index-K
     (+ its scale), target and draft, at backup (the device pages copied) and after reload (the device
     pages loaded into), keyed by the page's fingerprint (a digest of the radix key up to the page's
     end: the same content gets the same fingerprint in every run, whatever its page ids);
  3  + forward hashes: per forward, request and layer, hashes of the attention input, the main KV and
     index-K the request can see (read through its page table after the step's writes), the top-k
     selection, the attention output (pre-residual), the MLP / MoE input and output, with zero and
     non-finite counts; target and draft layer, every CP rank.

Hashes are uint32 sums of mixed element bits (murmur3's finalizer): a request's hash sums over its
positions with the position mixed in, so it does not depend on how lanes or CP ranks split the tokens
(each rank's partial sums add up on the host). XLA computes them; level 3 hands each layer's [stages,
rows] hashes to the host with one jax.debug.callback from `LayerTap`, the probe the forward calls at
every layer (models.model.DecoderLayer's `tap`). One tracing engine per process at a time: the
callbacks land in one module-level queue.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

LEVELS = (0, 1, 2, 3)
FORMAT = 1
STAGES = ("attn_in", "kv_read", "index_read", "topk", "attn_out", "mlp_in", "mlp_out")
COUNTS = ("tokens", "zero", "nonfinite")      # per stage and request: valid tokens (or visible positions), ...

_MASK32 = 0xFFFFFFFF


# ---- hashing (in XLA) ------------------------------------------------------------------------------

def fmix32(x):
    """murmur3's 32-bit finalizer: every input bit flips about half the output bits."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def element_bits(v):
    """Each element's raw bits as uint32 (floats bitcast, not converted: fp8 codes, -0.0 and NaN
    payloads all count)."""
    if v.dtype == jnp.bool_:
        v = v.astype(jnp.uint8)
    return jax.lax.bitcast_convert_type(v, _UINT[jnp.dtype(v.dtype).itemsize]).astype(jnp.uint32)


def vector_hash(*parts):
    """Hash of each vector: the parts' last axes side by side, element w's bits mixed with w."""
    bits = jnp.concatenate([element_bits(p) for p in parts], axis=-1)
    salt = fmix32(jnp.arange(bits.shape[-1], dtype=jnp.uint32) + jnp.uint32(1))
    return jnp.sum(fmix32(bits ^ salt), axis=-1, dtype=jnp.uint32)


def selection_hash(idx):
    """Hash of each token's selected positions as a set (-1 = none): the top-k's order is not part of it."""
    h = fmix32(element_bits(idx) ^ jnp.uint32(0x9E3779B9))
    return jnp.sum(jnp.where(idx >= 0, h, jnp.uint32(0)), axis=-1, dtype=jnp.uint32)


def positional_sum(h, pos, mask):
    """Sum over the last axis of per-position hashes with the position mixed in, where `mask`."""
    mixed = fmix32(h ^ fmix32(pos.astype(jnp.uint32) + jnp.uint32(0x632BE5AB)))
    return jnp.sum(jnp.where(mask, mixed, jnp.uint32(0)), axis=-1, dtype=jnp.uint32)


def _stage(parts, pos, mask, selection: bool = False):
    """(hash [B], counts [B, 3]) of vectors over the positions of each row where `mask`."""
    if selection:
        (idx,) = parts
        tok = selection_hash(idx)
        zero = ~(idx >= 0).any(-1)
        bad = jnp.zeros_like(zero)
    else:
        tok = vector_hash(*parts)
        as32 = [p.astype(jnp.float32) for p in parts]
        zero = jnp.stack([(p == 0).all(-1) for p in as32]).all(0)
        bad = ~jnp.stack([jnp.isfinite(p).all(-1) for p in as32]).all(0)
    counts = jnp.stack([mask.sum(-1), (zero & mask).sum(-1), (bad & mask).sum(-1)], axis=-1).astype(jnp.int32)
    return positional_sum(tok, pos, mask), counts


_received: collections.deque = collections.deque()   # (model, layer, rank, hashes, counts) from the forward


def _receive(model: str, layer, rank, primary, hashes, counts) -> None:
    if bool(primary):
        _received.append((model, int(layer), int(rank), np.asarray(hashes), np.asarray(counts)))


@dataclasses.dataclass(frozen=True)
class LayerTap:
    """The forward's per-layer probe at level 3 (a static argument of the step: an engine without a
    trace passes none, so its executables have no callback). Under CP (`access.axis`, inside the step's
    shard_map) each rank hashes its own tokens and pages and the host sums the ranks' partial hashes;
    over the mesh's other axes (`mesh_axes`) values are replicated and only their rank 0 reports."""
    model: str = "target"
    mesh_axes: tuple[str, ...] = ()

    def __call__(self, layer_id, full_id, batch, cache, access, **values):
        cp_axis = access.axis
        pos, valid = batch.positions, batch.valid
        out = {name: _stage([values[name]], pos, valid) for name in ("attn_in", "attn_out", "mlp_in", "mlp_out")}
        out["topk"] = _stage([values["topk"]], pos, valid, selection=True)

        # what each request can see after this step's writes: positions up to its last token's, read
        # through its page table (under CP each rank hashes the positions whose slots it owns)
        B, S = batch.slot_table.shape
        last = jnp.max(jnp.where(valid, pos, -1), axis=1)
        slots = batch.slot_table
        positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
        rank = jnp.int32(0)
        if cp_axis is not None:
            last = jax.lax.pmax(last, cp_axis)
            rank = jax.lax.axis_index(cp_axis).astype(jnp.int32)
            n_local = cache.latent.shape[1]
            owned = slots // n_local == rank
            slots = jnp.where(owned, slots - rank * n_local, 0)
        visible = positions <= last[:, None]
        if cp_axis is not None:
            visible = visible & owned
        out["kv_read"] = _stage([cache.latent[layer_id][slots], cache.k_rope[layer_id][slots]], positions, visible)
        if full_id is None:
            out["index_read"] = (jnp.zeros((B,), jnp.uint32), jnp.zeros((B, len(COUNTS)), jnp.int32))
        else:
            parts = [cache.index_k[full_id][slots]]
            if cache.index_scale is not None:
                parts.append(cache.index_scale[full_id][slots][..., None])
            out["index_read"] = _stage(parts, positions, visible)

        hashes = jnp.stack([out[s][0] for s in STAGES])       # [stages, B]
        counts = jnp.stack([out[s][1] for s in STAGES])       # [stages, B, 3]
        primary = jnp.bool_(True)
        for axis in self.mesh_axes:
            if axis != cp_axis:
                primary = primary & (jax.lax.axis_index(axis) == 0)
        jax.debug.callback(functools.partial(_receive, self.model), layer_id, rank, primary, hashes, counts)


@functools.partial(jax.jit, static_argnames=("page_size",))
def page_hashes(parts: tuple, slots, *, page_size: int):
    """[layers, pages] hash of each page of every layer of the leaves in `parts` (same layer count;
    rows side by side), pages given as their slots [pages * page_size]."""
    rows = [p[:, slots] for p in parts]
    rows = [r if r.ndim == 3 else r[..., None] for r in rows]
    h = vector_hash(*rows)
    h = h.reshape(h.shape[0], -1, page_size)
    offsets = jnp.broadcast_to(jnp.arange(page_size, dtype=jnp.int32), h.shape)
    return positional_sum(h, offsets, jnp.ones(h.shape, bool))


def _hex(h) -> str:
    return f"{int(h) & _MASK32:08x}"


# ---- recording (host) ------------------------------------------------------------------------------

class Tracer:
    """One engine's trace: the JSONL file, the request of each row of the next forward (from the batch
    builder), and the host tier's page fingerprints. The engine's parts call it: the batch builder
    (`batch_rows`), the runner (`tap`, `forward_done`), the host tier (`on_backup`, `on_load`)."""

    def __init__(self, level: int, path: str | Path, *, num_layers: int, full_layers: tuple[int, ...],
                 page_size: int):
        if level not in LEVELS[1:]:
            raise ValueError(f"trace level must be one of {LEVELS[1:]}, got {level!r}")
        self.level, self.path, self.page_size = level, Path(path), page_size
        self.num_layers, self.full_layers = num_layers, tuple(full_layers)
        self.file = open(self.path, "w")
        self.rows: list[tuple[int, int, int]] = []   # (request, first position, end) per row of the next forward
        self.forwards = 0
        self.host_fingerprint: dict[int, str] = {}   # host page -> fingerprint of the content backed up into it
        self.pending_loads: list = []                # hashed after the next target forward (they land in it)
        _received.clear()
        self._write([{"kind": "meta", "format": FORMAT, "level": level, "layers": num_layers,
                      "full_layers": list(self.full_layers), "page_size": page_size}])

    @classmethod
    def attach(cls, engine) -> "Tracer":
        """A tracer at the engine's configured level, wired into its batch builder, runner and host tier."""
        c = engine.config
        if c.kv_trace >= 3:
            try:
                jax.devices("cpu")
            except RuntimeError:
                from cpkv_jax.config import EngineConfigError
                raise EngineConfigError("kv_trace=3 sends per-layer hashes to the host through jax.debug.callback, "
                                        "which needs JAX's CPU platform: run with JAX_PLATFORMS=cuda,cpu (or unset)")
        tracer = cls(c.kv_trace, c.trace_out, num_layers=engine.cfg.num_hidden_layers,
                     full_layers=engine.cfg.full_layers, page_size=c.page_size)
        engine.batch_builder.trace = tracer
        engine.runner.trace = tracer
        if engine.hicache is not None:
            engine.hicache.tracer = tracer
        return tracer

    def _write(self, records: list[dict]) -> None:
        self.file.write("".join(json.dumps(r) + "\n" for r in records))
        self.file.flush()

    def close(self) -> None:
        self.file.close()

    # ---- forwards ----------------------------------------------------------------------------------
    def batch_rows(self, chunks) -> None:
        """The batch just built is the next forward's: remember which request each row is."""
        self.rows = [(ch.req.rid, ch.start, ch.start + len(ch.tokens)) for ch in chunks]

    @property
    def per_layer(self) -> bool:
        """Whether forwards carry per-layer probes (level 3)."""
        return self.level >= 3

    def tap(self, model: str, mesh_axes: tuple[str, ...]) -> LayerTap | None:
        """The forward's per-layer probe (level 3) for a step of `model` over a mesh of `mesh_axes`, or None."""
        if not self.per_layer:
            return None
        return LayerTap(model, mesh_axes)

    def forward_done(self, model: str, out) -> None:
        """After a forward was dispatched: the reloads it completed (level 2) and its per-layer hashes
        (level 3; waits for the forward and its callbacks)."""
        if model == "target" and self.pending_loads:
            loads, self.pending_loads = self.pending_loads, []
            for hicache, rid, fps, host_pages, dev_pages in loads:
                self._page_hash_records("reload", hicache, rid, fps, host_pages, dev_pages)
        if self.per_layer:
            jax.block_until_ready(out)
            jax.effects_barrier()
            self._write(self._forward_records(model))
        self.forwards += 1

    def _forward_records(self, model: str) -> list[dict]:
        """One record per (layer, request) of the forward just run, each rank's partial hashes summed."""
        hashes: dict[int, np.ndarray] = {}
        counts: dict[int, np.ndarray] = {}
        others = []     # the other model's, of the same executable (a speculative round): for its own call
        while _received:
            m, layer, _, h, c = item = _received.popleft()
            if m != model:
                others.append(item)
                continue
            hashes[layer] = (hashes.get(layer, 0) + h.astype(np.uint64)) & _MASK32
            counts[layer] = counts.get(layer, 0) + c.astype(np.int64)
        _received.extend(others)
        records = []
        for layer in sorted(hashes):
            for b, (rid, start, end) in enumerate(self.rows):
                flags = {}
                for s, stage in enumerate(STAGES):
                    n, zero, bad = (int(x) for x in counts[layer][s, b])
                    f = []
                    if n and zero == n:
                        f.append("all_zero")
                    elif zero:
                        f.append(f"zero={zero}/{n}")
                    if bad:
                        f.append(f"nonfinite={bad}/{n}")
                    if f:
                        flags[stage] = f
                records.append({"kind": "forward", "forward": self.forwards, "model": model, "rid": rid,
                                "start": start, "end": end, "layer": layer,
                                "hashes": {stage: _hex(hashes[layer][s, b]) for s, stage in enumerate(STAGES)},
                                "flags": flags})
        return records

    # ---- host tier ---------------------------------------------------------------------------------
    def _fingerprints(self, hicache, tokens, page_index) -> list[str]:
        """Per page index: a digest of the radix key through the end of that page."""
        key, ps = hicache.radix.key_of(tokens), self.page_size
        digest, out = hashlib.sha1(), []
        for p in range(int(max(page_index)) + 1):
            digest.update(repr(tuple(key[p * ps:(p + 1) * ps])).encode())
            out.append(digest.hexdigest()[:16])
        return [out[int(i)] for i in page_index]

    def _pages(self, hicache, fps, host_pages, dev_pages) -> list[dict]:
        ranks = hicache.host.host_rank(host_pages)
        return [{"fp": fp, "host": int(h), "dev": int(d), "rank": int(r)}
                for fp, h, d, r in zip(fps, host_pages, dev_pages, ranks)]

    def _bytes(self, hicache, n_pages: int) -> dict:
        counter: dict = {}
        for unit in hicache.host.units():
            hicache.host.add_bytes(counter, hicache.host.layer_leaves(*unit)[0], n_pages)
        return counter

    def on_backup(self, hicache, res, path: str) -> None:
        """A backup was issued into res.host_pages from res.src_pages (all its copies enqueued)."""
        fps = self._fingerprints(hicache, res.tokens, res.page_index)
        for h, fp in zip(res.host_pages, fps):
            self.host_fingerprint[int(h)] = fp
        self._write([{"kind": "backup", "rid": res.rid, "path": path, "layers": hicache.host.num_layers,
                      "draft": hicache.host.draft is not None,
                      "pages": self._pages(hicache, fps, res.host_pages, res.src_pages),
                      "bytes": self._bytes(hicache, len(res.host_pages))}])
        if self.level >= 2:
            self._page_hash_records("backup", hicache, res.rid, fps, res.host_pages, res.src_pages)

    def on_load(self, hicache, host_pages, dev_pages, rid: int | None) -> None:
        """Host pages are being loaded into device pages (hashed once the next target forward ran:
        side-stream loads land inside it)."""
        fps = [self.host_fingerprint.get(int(h), "unknown") for h in host_pages]
        self._write([{"kind": "load", "rid": rid, "pages": self._pages(hicache, fps, host_pages, dev_pages),
                      "bytes": self._bytes(hicache, len(host_pages))}])
        if self.level >= 2:
            self.pending_loads.append((hicache, rid, fps, np.asarray(host_pages), np.asarray(dev_pages)))

    def _page_hash_records(self, event: str, hicache, rid, fps, host_pages, dev_pages) -> None:
        """Per page and pool (target, draft): main KV and index-K hashes of every layer."""
        from cpkv_jax.kv_pool import page_slots
        ps = self.page_size
        n = len(dev_pages)
        width = 1 << max(0, n - 1).bit_length()     # bucketed: few compilations
        pages = np.zeros(width, np.int64)
        pages[:n] = dev_pages
        slots = jnp.asarray(page_slots(pages, ps), jnp.int32)
        pages_info = self._pages(hicache, fps, host_pages, dev_pages)
        records = []
        for model, tree in (("target", hicache.pool.cache), ("draft", hicache.pool.draft)):
            if tree is None:
                continue
            main = np.asarray(page_hashes((tree.latent, tree.k_rope), slots, page_size=ps))
            index_parts = (tree.index_k,) if tree.index_scale is None else (tree.index_k, tree.index_scale)
            index = np.asarray(page_hashes(index_parts, slots, page_size=ps))
            layers = self.num_layers if model == "target" else 1
            full = self.full_layers if model == "target" else (0,)
            for j, info in enumerate(pages_info):
                index_k = [None] * layers
                for f, layer in enumerate(full):
                    index_k[layer] = _hex(index[f, j])
                records.append({"kind": "page_hash", "event": event, "model": model, "rid": rid, **info,
                                "main_kv": [_hex(h) for h in main[:, j]], "index_k": index_k})
        self._write(records)


# ---- analysis --------------------------------------------------------------------------------------

class TraceFormatError(ValueError):
    """A file that is not a KV trace of this format."""


def read_trace(path: str | Path) -> list[dict]:
    records = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise TraceFormatError(f"{path}:{i}: not a JSON line ({e.msg})") from None
    if not records or records[0].get("kind") != "meta" or records[0].get("format") != FORMAT:
        raise TraceFormatError(f"{path}: not a KV trace (format {FORMAT}): its first line must be the meta record")
    return records


def _key(rec: dict):
    """What a record is about (None: metadata, not compared)."""
    if rec["kind"] == "forward":
        return ("forward", rec["model"], rec["rid"], rec["start"], rec["end"], rec["layer"])
    if rec["kind"] == "page_hash":
        return ("page_hash", rec["event"], rec["model"], rec["fp"])
    return None


def _value(rec: dict):
    return rec["hashes"] if rec["kind"] == "forward" else (rec["main_kv"], rec["index_k"])


def _numbered(records: list[dict]) -> list[tuple[tuple, dict]]:
    """(key, occurrence) of each compared record, in file order."""
    seen: collections.Counter = collections.Counter()
    out = []
    for rec in records:
        key = _key(rec)
        if key is not None:
            out.append(((key, seen[key]), rec))
            seen[key] += 1
    return out


@dataclasses.dataclass
class Divergence:
    where: str                        # the first (request, positions, layer, stage) or page that differs
    verdict: str                      # what it points at
    details: list[str] = dataclasses.field(default_factory=list)


def _layer_name(rec: dict, layer: int) -> str:
    return "draft layer (MTP)" if rec["model"] == "draft" else f"target layer {layer}"


def _first_page_part(a: dict, b: dict):
    """(layer, part) of the first layer whose main KV or index-K hash differs between two page records."""
    for layer in range(len(a["main_kv"])):
        if a["main_kv"][layer] != b["main_kv"][layer]:
            return layer, "main KV (latent + rope)"
        if a["index_k"][layer] != b["index_k"][layer]:
            return layer, "index-K (+ scale)"
    return None


def _describe_page(rec: dict, layer: int, part: str) -> str:
    return (f"{rec['event']} hash of page {rec['fp']} (request {rec['rid']}, host page {rec['host']}, device page "
            f"{rec['dev']}, CP rank {rec['rank']}), {_layer_name(rec, layer)}, {part}")


def host_tier_mismatches(records: list[dict]) -> list[Divergence]:
    """Within one run: every reload whose hashes differ from its page's backup (the host tier changed
    the bytes between backup and reload)."""
    backup: dict = {}
    found = []
    for rec in records:
        if rec["kind"] != "page_hash":
            continue
        key = (rec["model"], rec["fp"])
        if rec["event"] == "backup":
            backup[key] = rec
        elif key in backup:
            diff = _first_page_part(backup[key], rec)
            if diff is not None:
                layer, part = diff
                found.append(Divergence(
                    _describe_page(rec, layer, part),
                    f"host tier: the {part} of this page changed between backup and reload"
                    + (" (draft layer)" if rec["model"] == "draft" else ""),
                    [f"backup {backup[key]['main_kv' if part.startswith('main') else 'index_k'][layer]} "
                     f"!= reload {rec['main_kv' if part.startswith('main') else 'index_k'][layer]}"]))
    return found


_STAGE_VERDICT = {
    "index_read": "index-K cache: the index keys the request reads differ while its main KV reads agree",
    "topk": "index-K cache: the top-k selection differs",
    "attn_out": "main KV or page mapping: the attention output differs with equal top-k",
    "mlp_in": "residual / MoE: the MoE input differs with equal attention",
    "mlp_out": "residual / MoE: the MoE (MLP) output differs with equal input",
}


def forward_verdict(a: dict, b: dict) -> tuple[str, str]:
    """(first differing stage, verdict) of two forward records of the same request, step and layer."""
    differs = [s for s in STAGES if a["hashes"][s] != b["hashes"][s]]
    stage = differs[0]
    if stage == "attn_in":
        if a["model"] == "draft":
            verdict = "draft input: the target hidden state or the next token fed to the MTP layer differs"
        elif a["layer"] == 0:
            verdict = "the step's input: its tokens (an earlier step sampled differently) or the embedding"
        else:
            verdict = "residual / MoE: the layer's input differs (the previous layer's output)"
    elif stage == "kv_read":
        verdict = ("page mapping: the main KV and the index-K read at the same positions both differ"
                   if "index_read" in differs else
                   "main KV: the latent / rope rows the request reads differ while its index-K reads agree")
    else:
        verdict = _STAGE_VERDICT[stage]
    if a["model"] == "draft":
        verdict += " (draft layer)"
    return stage, verdict


def _describe_forward(rec: dict, stage: str) -> str:
    return (f"request {rec['rid']}, positions [{rec['start']}, {rec['end']}), {_layer_name(rec, rec['layer'])}, "
            f"stage {stage}")


def _first_cross_run(a: list[dict], b: list[dict], kinds=("forward", "page_hash")) -> Divergence | None:
    """The first record of run A (in its order) whose counterpart in run B differs or is missing."""
    theirs = dict(_numbered(b))
    mine = _numbered(a)
    for (key, occurrence), rec in mine:
        if rec["kind"] not in kinds:
            continue
        other = theirs.get((key, occurrence))
        if other is None:
            return Divergence(f"{rec['kind']} record {key} (occurrence {occurrence}) of run A has no counterpart in B",
                              "the runs did not run the same schedule (different requests, steps or pages)")
        if _value(rec) == _value(other):
            continue
        if rec["kind"] == "forward":
            stage, verdict = forward_verdict(rec, other)
            details = [f"A {rec['hashes'][stage]} {rec['flags'].get(stage, [])}",
                       f"B {other['hashes'][stage]} {other['flags'].get(stage, [])}"]
            return Divergence(_describe_forward(rec, stage), verdict, details)
        layer, part = _first_page_part(rec, other)
        verdict = ("host tier: the reloaded bytes differ while the backed-up bytes agree" if rec["event"] == "reload"
                   else "the KV differed before its backup (see the forward records)")
        return Divergence(_describe_page(rec, layer, part), verdict)
    mine_keys = {k for k, _ in mine}
    extra = [k for k, rec in _numbered(b) if k not in mine_keys and rec["kind"] in kinds]
    if extra:
        return Divergence(f"record {extra[0][0]} (occurrence {extra[0][1]}) of run B has no counterpart in A",
                          "the runs did not run the same schedule (different requests, steps or pages)")
    return None


def diff(a: list[dict], b: list[dict]) -> tuple[Divergence | None, Divergence | None]:
    """(first divergence, first forward divergence when the first is a host-tier page). A reload that
    differs from its own backup within either run comes first (the host tier broke, whatever the other
    run did); else the first record of A whose counterpart in B differs."""
    own = host_tier_mismatches(b) or host_tier_mismatches(a)
    first = own[0] if own else _first_cross_run(a, b)
    forward = None
    if first is not None and first.verdict.startswith("host tier"):
        forward = _first_cross_run(a, b, kinds=("forward",))
    return first, forward


def diff_files(path_a, path_b, out) -> int:
    """`cpkv-jax trace diff`: prints what was compared, the first divergence and the verdict (last);
    returns 0 when the runs agree, 1 when they diverge."""
    a, b = read_trace(path_a), read_trace(path_b)
    levels = (a[0]["level"], b[0]["level"])
    n = sum(1 for r in a if _key(r) is not None), sum(1 for r in b if _key(r) is not None)
    print(f"run A: {path_a} (level {levels[0]}, {n[0]} hashed records); run B: {path_b} (level {levels[1]}, "
          f"{n[1]} hashed records)", file=out)
    first, forward = diff(a, b)
    if first is None:
        print("verdict: no divergence: the runs agree", file=out)
        return 0
    print(f"first divergence: {first.where}", file=out)
    for line in first.details:
        print(f"  {line}", file=out)
    if forward is not None:
        print(f"first forward divergence: {forward.where} -> {forward.verdict}", file=out)
    print(f"verdict: {first.verdict}", file=out)
    return 1
