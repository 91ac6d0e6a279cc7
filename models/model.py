"""The DSA causal LM (GLM-5 / DeepSeek-V3.2): embedding, decoder layers scanned in homogeneous groups,
final norm, lm_head, and the MTP/NextN layer.

Layers differ by (mlp kind, indexer kind); IndexCache makes the kinds interleave (F S S S F ...). The
layer list is cut into groups, each a short *unit* of kinds repeated R times; a group's parameters
carry a leading [R] axis and one lax.scan runs the unit R times. GLM-5.2 (78 layers, full layers
0,1,2,6,10,...,74) becomes three groups: 3 x [dense F], 18 x [MoE S S S F] (layers 3-74), 3 x [MoE S]."""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from models.attention import MLA
from models.config import ModelConfig
from models.kv import SINGLE_DEVICE, Batch, KVAccess, KVCache
from models.layers import Dense, RMSNorm, normal_param
from models.moe import MLP, MoE
from models.sharding import KV_LEAF_AXES, NO_AXES, RULES, MeshAxes, state_specs
from pallas_kernels.policy import DEFAULT_POLICY, KernelPolicy

MAX_UNIT = 8


@dataclasses.dataclass(frozen=True)
class LayerGroup:
    unit: tuple[tuple[str, str], ...]   # (mlp kind, indexer kind) per position in the unit
    layer_ids: tuple[tuple[int, ...], ...]  # [R][p] global layer index

    @property
    def repeats(self) -> int:
        return len(self.layer_ids)


def plan_layer_groups(kinds: list[tuple[str, str]]) -> tuple[LayerGroup, ...]:
    """Greedy cover of the layer list by repeated units: at each start take the unit length p <= 8 that
    covers the most layers when repeated (a unit longer than one layer must repeat at least twice;
    ties -> shorter unit)."""
    groups, i, n = [], 0, len(kinds)
    while i < n:
        best_p, best_r = 1, 0
        for p in range(1, min(MAX_UNIT, n - i) + 1):
            unit = kinds[i:i + p]
            r = 1
            while i + (r + 1) * p <= n and kinds[i + r * p:i + (r + 1) * p] == unit:
                r += 1
            if (p == 1 or r >= 2) and r * p > best_r * best_p:
                best_p, best_r = p, r
        ids = tuple(tuple(range(i + r * best_p, i + (r + 1) * best_p)) for r in range(best_r))
        groups.append(LayerGroup(tuple(kinds[i:i + best_p]), ids))
        i += best_p * best_r
    return tuple(groups)


@functools.cache
def layer_places(groups: tuple[LayerGroup, ...]) -> tuple[tuple[int, int, int], ...]:
    """Per global layer: (group, unit position, repeat) — where its parameters sit in the stacked groups."""
    where = {layer: (g, j, r) for g, group in enumerate(groups) for r, row in enumerate(group.layer_ids)
             for j, layer in enumerate(row)}
    return tuple(where[i] for i in range(len(where)))


@dataclasses.dataclass(frozen=True)
class MicroBatches:
    """A forward's rows cut into micro-batches (two-batch overlap): `parts` run each layer one after
    the other, every part with its own hidden state and its own IndexCache top-k carried from layer
    to layer, the KV pool threaded through them in order. Cut along the requests (axis 0) when they
    divide; else along the lanes (axis 1) on one CP rank, where a request's lanes are its positions in
    order, so a later part's attention reads the earlier part's keys from the pool after the earlier
    part wrote them in the same layer (under CP a rank's lanes are not the request's order: not cut
    there); else one part. One part: the plain forward, unchanged."""

    whole: Batch
    parts: tuple[Batch, ...]
    axis: int | None

    @classmethod
    def of(cls, batch: Batch, n: int, access: KVAccess = SINGLE_DEVICE) -> "MicroBatches":
        B, T = batch.tokens.shape
        if n > 1 and B % n == 0:
            axis = 0
        elif n > 1 and access.axis is None and T % n == 0:
            axis = 1
        else:
            return cls(batch, (batch,), None)

        def part(i):
            cut = lambda a: jax.lax.slice_in_dim(a, i * a.shape[axis] // n, (i + 1) * a.shape[axis] // n,  # noqa: E731
                                                 axis=axis)
            return Batch(cut(batch.tokens), cut(batch.positions), cut(batch.write_slots),
                         cut(batch.slot_table) if axis == 0 else batch.slot_table)
        return cls(batch, tuple(part(i) for i in range(n)), axis)

    def split(self, x) -> tuple:
        """Rows [B, T, ...] of the whole batch as the parts' rows."""
        return (x,) if self.axis is None else tuple(jnp.split(x, len(self.parts), axis=self.axis))

    def join(self, xs):
        """The parts' rows as the whole batch's."""
        return xs[0] if self.axis is None else jnp.concatenate(xs, axis=self.axis)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, mlp_kind: str, indexer_kind: str, *, dtype, rngs: nnx.Rngs, stack=()):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, stack=stack)
        self.self_attn = MLA(cfg, has_indexer=indexer_kind == "full", dtype=dtype, rngs=rngs, stack=stack)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, stack=stack)
        self.mlp = (MoE(cfg, dtype=dtype, rngs=rngs, stack=stack) if mlp_kind == "sparse"
                    else MLP(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, rngs=rngs, stack=stack,
                             fp8=lambda name: cfg.fp8(f"mlp.{name}")))

    def __call__(self, x, topk, batch: Batch, cache: KVCache, layer_id, full_id, *, attn_path: str,
                 access: KVAccess = SINGLE_DEVICE, kernels: KernelPolicy = DEFAULT_POLICY,
                 axes: MeshAxes = NO_AXES, tap=None):
        """`tap`, if given (static), sees the layer's intermediate values once its MLP ran (the KV-integrity
        trace's per-layer probe, cpkv_jax.trace.LayerTap); it returns nothing and changes nothing."""
        with jax.named_scope("attention"):      # the op names profiles and the TBO schedule test read
            attn_in = self.input_layernorm(x)
            a, topk, cache = self.self_attn(attn_in, topk, batch, cache, layer_id, full_id,
                                            attn_path=attn_path, access=access, kernels=kernels, axes=axes)
        x = x + a
        h = self.post_attention_layernorm(x)
        with jax.named_scope("mlp"):
            m = (self.mlp(h, batch.valid, kernels=kernels, axes=axes) if isinstance(self.mlp, MoE)
                 else self.mlp(h, axes, kernels))
        if tap is not None:
            tap(layer_id, full_id if self.self_attn.indexer is not None else None, batch, cache, access,
                attn_in=attn_in, topk=topk, attn_out=a, mlp_in=h, mlp_out=m)
        return x + m, topk, cache

    def over(self, xs, topks, micro: MicroBatches, cache: KVCache, layer_id, full_id, *, attn_path: str,
             access: KVAccess = SINGLE_DEVICE, kernels: KernelPolicy = DEFAULT_POLICY, axes: MeshAxes = NO_AXES,
             tap=None):
        """The layer over each micro-batch in turn (hidden rows `xs`, IndexCache top-k `topks`, one per
        part; the pool threaded through them). With two parts a part's MoE (its dispatch and combine
        collectives) depends only on its own attention, so it can overlap the other part's attention
        (and, across the layer boundary, the other part's next attention). `tap` sees the layer once,
        over the whole batch (the parts' values joined)."""
        seen = []
        probe = None if tap is None else (lambda *args, **values: seen.append(values))
        out_x, out_topk = [], []
        for i, (x, topk, part) in enumerate(zip(xs, topks, micro.parts)):
            with jax.named_scope(f"micro_batch{i}") if len(xs) > 1 else contextlib.nullcontext():
                x, topk, cache = self(x, topk, part, cache, layer_id, full_id, attn_path=attn_path, access=access,
                                      kernels=kernels, axes=axes, tap=probe)
            out_x.append(x)
            out_topk.append(topk)
        if tap is not None:
            tap(layer_id, full_id if self.self_attn.indexer is not None else None, micro.whole, cache, access,
                **{name: micro.join([v[name] for v in seen]) for name in seen[0]})
        return tuple(out_x), tuple(out_topk), cache


class LayerStack(nnx.Module):
    """One LayerGroup: a DecoderLayer per unit position, each with parameters stacked over repeats."""

    def __init__(self, cfg: ModelConfig, group: LayerGroup, *, dtype, rngs: nnx.Rngs):
        self.group = group
        self.unit = nnx.List([DecoderLayer(cfg, m, ix, dtype=dtype, rngs=rngs, stack=(group.repeats,))
                              for m, ix in group.unit])

    def __call__(self, xs, topks, micro: MicroBatches, cache, full_index: tuple[int, ...], *, attn_path: str,
                 access: KVAccess = SINGLE_DEVICE, kernels: KernelPolicy = DEFAULT_POLICY, boundary=None,
                 axes: MeshAxes = NO_AXES, tap=None):
        """xs, topks: each micro-batch's hidden rows and IndexCache top-k (DecoderLayer.over)."""
        graphdefs, states = zip(*(nnx.split(layer) for layer in self.unit))
        layer_ids = jnp.asarray(self.group.layer_ids, jnp.int32)
        full_ids = jnp.asarray([[full_index[i] for i in row] for row in self.group.layer_ids], jnp.int32)

        def body(carry, per_repeat):
            xs, topks, cache = carry
            st, lid, fid = per_repeat
            for j, gd in enumerate(graphdefs):
                if boundary is not None:    # the hook sees every part's rows: it follows all of the layer's reads
                    cache, x = boundary(cache, micro.join(xs))
                    xs = micro.split(x)
                xs, topks, cache = nnx.merge(gd, st[j]).over(xs, topks, micro, cache, lid[j], fid[j],
                                                             attn_path=attn_path, access=access, kernels=kernels,
                                                             axes=axes, tap=tap)
            return (xs, topks, cache), None

        unroll = xs[0].shape[1] <= kernels.unroll_layers_max_tokens   # tokens per request (KernelPolicy)
        (xs, topks, cache), _ = jax.lax.scan(body, (xs, topks, cache), (states, layer_ids, full_ids), unroll=unroll)
        return xs, topks, cache


class MTPLayer(nnx.Module):
    """NextN draft layer: h' = eh_proj(cat(enorm(embed(next_token)), hnorm(h))) -> one decoder layer
    (own indexer) -> shared_head.norm -> shared_head.head. `embed_tokens` / `head` fall back to the
    target's when the checkpoint does not carry its own copy."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs, own_embed=True, own_head=True):
        D = cfg.hidden_size
        mlp_kind = "sparse" if "sparse" in cfg.mlp_layer_types else "dense"
        self.embed_tokens = (normal_param(rngs, (cfg.vocab_size, D), dtype, 1.0) if own_embed else None)
        self.enorm = RMSNorm(D, cfg.rms_norm_eps, dtype=dtype)
        self.hnorm = RMSNorm(D, cfg.rms_norm_eps, dtype=dtype)
        self.eh_proj = Dense(2 * D, D, dtype=dtype, rngs=rngs, fp8=cfg.fp8("eh_proj"))
        self.layer = DecoderLayer(cfg, mlp_kind, "full", dtype=dtype, rngs=rngs)
        self.norm = RMSNorm(D, cfg.rms_norm_eps, dtype=dtype)
        self.head = Dense(D, cfg.vocab_size, dtype=dtype, rngs=rngs) if own_head else None


class DsaModel(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype=None, rngs: nnx.Rngs, mtp_own_embed=True, mtp_own_head=True):
        dtype = jnp.dtype(dtype or cfg.dtype)
        self.cfg = cfg
        self.dtype = dtype
        kinds = [cfg.layer_kind(i) for i in range(cfg.num_hidden_layers)]
        self.groups_plan = plan_layer_groups(kinds)
        # per layer: its slot in the index-K cache (0 for shared layers, which never touch it); a tuple
        # so the graph definition stays hashable (it is a static jit argument)
        self.full_index = tuple(cfg.full_layers.index(i) if i in cfg.full_layers else 0
                                for i in range(cfg.num_hidden_layers))
        self.embed_tokens = normal_param(rngs, (cfg.vocab_size, cfg.hidden_size), dtype, 1.0)
        self.groups = nnx.List([LayerStack(cfg, g, dtype=dtype, rngs=rngs) for g in self.groups_plan])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.lm_head = None if cfg.tie_word_embeddings else Dense(cfg.hidden_size, cfg.vocab_size, dtype=dtype,
                                                                   rngs=rngs)
        self.mtp = (MTPLayer(cfg, dtype=dtype, rngs=rngs, own_embed=mtp_own_embed, own_head=mtp_own_head)
                    if cfg.num_nextn_predict_layers else None)

    # ---- pieces ----------------------------------------------------------------------------------
    def topk_width(self, kv_width: int) -> int:
        return min(self.cfg.index_topk, kv_width)

    def embed(self, tokens, axes: MeshAxes = NO_AXES):
        return axes.embed(self.embed_tokens[...], tokens)

    def logits(self, h, axes: MeshAxes = NO_AXES):
        """fp32 logits of final-normed hidden states (all of the vocabulary on every rank)."""
        if self.lm_head is None:
            return axes.gather_vocab(jnp.dot(h, self.embed_tokens[...].T.astype(h.dtype)).astype(jnp.float32))
        return axes.gather_vocab(self.lm_head(h).astype(jnp.float32))

    # ---- forward ---------------------------------------------------------------------------------
    def __call__(self, batch: Batch, cache: KVCache, *, attn_path: str = "expanded",
                 access: KVAccess = SINGLE_DEVICE, kernels: KernelPolicy = DEFAULT_POLICY, boundary=None,
                 axes: MeshAxes = NO_AXES, tap=None, micro_batches: int = 1):
        """Target forward. Returns (final-normed hidden [B, T, D], updated cache). Under CP (inside the
        shard_map, `access.axis` set) the batch holds this rank's tokens and the cache its shard.
        `boundary(cache, x) -> (cache, x)`, if given, runs before every layer and after the last (the
        host tier's copy hook: it sees the pool between layers and must return both unchanged).
        `kernels`: which kernels the layers run (static, like `access`); `axes`: the mesh axes the
        parameters are split over, inside a shard_map over them (models.sharding.MeshAxes); `tap`: the
        per-layer probe of the KV-integrity trace (DecoderLayer), None when tracing is off;
        `micro_batches`: two-batch overlap at 2 (MicroBatches: each part its own hidden rows and
        IndexCache top-k through every layer), static."""
        micro = MicroBatches.of(batch, micro_batches, access)
        width = self.topk_width(batch.slot_table.shape[1])
        xs = tuple(self.embed(part.tokens, axes) for part in micro.parts)
        topks = tuple(jnp.full(part.tokens.shape + (width,), -1, jnp.int32) for part in micro.parts)
        for stack in self.groups:
            xs, topks, cache = stack(xs, topks, micro, cache, self.full_index, attn_path=attn_path, access=access,
                                     kernels=kernels, boundary=boundary, axes=axes, tap=tap)
        x = micro.join(xs)
        if boundary is not None:
            cache, x = boundary(cache, x)
        return self.norm(x), cache

    def mtp_hidden(self, hidden, next_tokens, batch: Batch, cache: KVCache, *, attn_path: str = "expanded",
                   access: KVAccess = SINGLE_DEVICE, kernels: KernelPolicy = DEFAULT_POLICY,
                   axes: MeshAxes = NO_AXES, tap=None, micro_batches: int = 1):
        """MTP layer over target hidden states [B, T, D] (final-normed) and the token that follows each
        position [B, T]; positions/slots come from `batch`; `cache` is the draft's one-layer cache (same
        slots as the target's). Returns (the layer's output hidden before shared_head.norm, cache)."""
        m = self.mtp
        if m is None:
            raise ValueError("this model has no MTP layer (num_nextn_predict_layers == 0)")
        emb = axes.embed((m.embed_tokens if m.embed_tokens is not None else self.embed_tokens)[...], next_tokens)
        x = m.eh_proj(jnp.concatenate([m.enorm(emb), m.hnorm(hidden.astype(emb.dtype))], axis=-1), kernels)
        micro = MicroBatches.of(batch, micro_batches, access)
        width = self.topk_width(batch.slot_table.shape[1])
        topks = tuple(jnp.full(part.tokens.shape + (width,), -1, jnp.int32) for part in micro.parts)
        zero = jnp.int32(0)
        xs, _, cache = m.layer.over(micro.split(x), topks, micro, cache, zero, zero, attn_path=attn_path,
                                    access=access, kernels=kernels, axes=axes, tap=tap)
        return micro.join(xs), cache

    def mtp_logits(self, x, axes: MeshAxes = NO_AXES):
        """fp32 draft logits of MTP output hidden states (shared_head.norm, then its head or lm_head)."""
        h = self.mtp.norm(x)
        if self.mtp.head is None:
            return self.logits(h, axes)
        return axes.gather_vocab(self.mtp.head(h).astype(jnp.float32))

    def mtp_forward(self, hidden, next_tokens, batch: Batch, cache: KVCache, *, attn_path: str = "expanded",
                    kernels: KernelPolicy = DEFAULT_POLICY):
        """Returns (logits [B, T, V] fp32, the layer's output hidden before shared_head.norm, cache)."""
        x, cache = self.mtp_hidden(hidden, next_tokens, batch, cache, attn_path=attn_path, kernels=kernels)
        return self.mtp_logits(x), x, cache


def matmul_precision(dtype) -> str:
    """fp32 models compute in true fp32: GPUs otherwise run fp32 matmuls as TF32, which flips near-tied
    indexer top-k choices (measured on the H200: logits 0.6-0.9 relative error vs HF instead of 3e-6)."""
    return "highest" if jnp.dtype(dtype) == jnp.float32 else "default"


def collect_last_hidden(h, last_rank, last_lane, axis: str):
    """Narrow tail collection under CP: each rank contributes the last-token hidden of the requests
    whose last token it computed (zeros otherwise); only [cp, B, D] crosses ranks, never the tokens."""
    B = h.shape[0]
    mine = last_rank == jax.lax.axis_index(axis)
    local = jnp.where(mine[:, None], h[jnp.arange(B), last_lane], 0)
    every = jax.lax.all_gather(local, axis)          # [cp, B, D]
    return every[last_rank, jnp.arange(B)]


def pick_last(h, last_index, last_rank, access: KVAccess):
    """Each request's last-token row [B, D] (narrow collection under CP)."""
    if access.axis is None:
        return h[jnp.arange(h.shape[0]), last_index]
    return collect_last_hidden(h, last_rank, last_index, access.axis)


OUTPUTS = ("logits", "hidden", "last_logits", "last_logits_hidden", "logits_hidden")


def _specs(access: KVAccess, cache: KVCache, state, mesh):
    """PartitionSpec, the rows' spec, and the cache / batch / parameter specs of a step's shard_map (the
    sharding rules' `batch_rows` and `kv_slots` axes, which must be the axis the KV access collects
    over; the parameters' axes from the table: routed experts split over 'ep')."""
    from jax.sharding import PartitionSpec as P
    if access.axis is not None and access.axis != RULES.kv_slots:
        raise ValueError(f"CP access over {access.axis!r}, but the sharding rules place KV slots on {RULES.kv_slots!r}")
    rows = RULES.spec("batch_rows", mesh=mesh)
    cache_spec = jax.tree.map(lambda _: RULES.spec(*KV_LEAF_AXES, mesh=mesh), cache)
    return P, rows, cache_spec, Batch(rows, rows, rows, P()), state_specs(state, mesh)


def run_model(graphdef, state, batch: Batch, cache: KVCache, *, attn_path: str, output: str = "logits",
              last_index=None, access: KVAccess = SINGLE_DEVICE, kernels: KernelPolicy = DEFAULT_POLICY, mesh=None,
              last_rank=None, boundary=None, tap=None, ep_dispatch: str = "psum", micro_batches: int = 1):
    """The pure function every jitted step wraps: merge the params, run the target forward at the
    model's matmul precision, and return (out, cache). output:
      "logits" [B, T, V] / "hidden" [B, T, D]          every position
      "last_logits" [B, V]                             lane `last_index` of each request only
      "last_logits_hidden", "logits_hidden"            (those logits, this rank's hidden rows) — the
                                                       hidden feeds the draft model without leaving the rank.
    `boundary`: the layer hook (DsaModel.__call__), static; `kernels`: which kernels the layers run,
    static; `tap`: the trace's per-layer probe (DecoderLayer), static, None when tracing is off.

    With a mesh the forward runs under shard_map over it, the parameters placed by the sharding table
    (routed experts split over 'ep', each rank running its own: models.moe.expert_parallel_mlp). With
    `access.axis` set: batch rows [cp*B, T] are split over the axis (rank r gets its own lanes of every
    request), `slot_table` [B, S] is replicated, the cache's slot axis is sharded. Last-token outputs take each request's last token
    from rank `last_rank[b]`, lane `last_index[b]` (narrow collection); every-position outputs gather
    all of them ([cp, B, T, ...]) — the flag for batches that need them.
    `ep_dispatch` (static): how the routed experts meet the rows over 'ep' (models.sharding.MeshAxes:
    'psum', or 'all_to_all': each ep rank dispatches its own 1/ep of the rows and all-gathers them
    back); `micro_batches` (static): 2 for two-batch overlap (DsaModel.__call__)."""
    if output not in OUTPUTS:
        raise ValueError(f"output must be one of {OUTPUTS}, got {output!r}")

    axes = MeshAxes.of(mesh, ep_dispatch=ep_dispatch)

    def forward(state, batch, cache, last_index, last_rank):
        m = nnx.merge(graphdef, state)
        with jax.default_matmul_precision(matmul_precision(m.dtype)):
            h, cache = m(batch, cache, attn_path=attn_path, access=access, kernels=kernels, boundary=boundary,
                         axes=axes, tap=tap, micro_batches=micro_batches)
            if output.startswith("last"):
                out = m.logits(pick_last(h, last_index, last_rank, access), axes)
            else:
                every = h if access.axis is None else jax.lax.all_gather(h, access.axis)
                out = every if output == "hidden" else m.logits(every, axes)
            return ((out, h) if output.endswith("_hidden") else out), cache

    if mesh is None:
        return forward(state, batch, cache, last_index, last_rank)
    P, rows, cache_spec, batch_spec, param_spec = _specs(access, cache, state, mesh)
    out_spec = (P(), rows) if output.endswith("_hidden") else P()
    return jax.shard_map(forward, mesh=mesh, in_specs=(param_spec, batch_spec, cache_spec, P(), P()),
                         out_specs=(out_spec, cache_spec), check_vma=False)(state, batch, cache, last_index, last_rank)


def run_draft(graphdef, state, hidden, next_tokens, batch: Batch, cache: KVCache, *, attn_path: str,
              last_index, access: KVAccess = SINGLE_DEVICE, kernels: KernelPolicy = DEFAULT_POLICY, mesh=None,
              last_rank=None, tap=None, ep_dispatch: str = "psum", micro_batches: int = 1):
    """The draft (MTP) step: hidden is either the target's hidden rows [B(·cp), T, D] of the same
    lanes (draft extend: under CP each rank's local slice, never gathered) or one row per request
    [B, D] (chain steps, broadcast to the lanes). Returns ((draft logits [B, V], the MTP output hidden
    [B, D]) at each request's last lane, draft cache). ep_dispatch, micro_batches: as run_model."""
    axes = MeshAxes.of(mesh, ep_dispatch=ep_dispatch)

    def forward(state, hidden, next_tokens, batch, cache, last_index, last_rank):
        m = nnx.merge(graphdef, state)
        with jax.default_matmul_precision(matmul_precision(m.dtype)):
            if hidden.ndim == 2:
                hidden = jnp.broadcast_to(hidden[:, None, :], next_tokens.shape + hidden.shape[-1:])
            x, cache = m.mtp_hidden(hidden, next_tokens, batch, cache, attn_path=attn_path, access=access,
                                    kernels=kernels, axes=axes, tap=tap, micro_batches=micro_batches)
            x_last = pick_last(x, last_index, last_rank, access)
            return (m.mtp_logits(x_last, axes), x_last), cache

    if mesh is None:
        return forward(state, hidden, next_tokens, batch, cache, last_index, last_rank)
    P, rows, cache_spec, batch_spec, param_spec = _specs(access, cache, state, mesh)
    hidden_spec = rows if hidden.ndim == 3 else P()
    return jax.shard_map(forward, mesh=mesh, in_specs=(param_spec, hidden_spec, rows, batch_spec, cache_spec, P(), P()),
                         out_specs=((P(), P()), cache_spec), check_vma=False)(
        state, hidden, next_tokens, batch, cache, last_index, last_rank)


# One jitted step for every model object of a graph: the graph definition is a static argument, the
# params are traced, so models and engines of the same shapes share compilations.
run_model_jit = jax.jit(run_model, static_argnums=(0,), static_argnames=("attn_path", "output", "access", "kernels",
                                                                         "mesh", "boundary", "tap", "ep_dispatch",
                                                                         "micro_batches"))


def jit_forward(model: DsaModel, *, attn_path: str = "expanded", with_logits: bool = True,
                kernels: KernelPolicy = DEFAULT_POLICY):
    """(batch, cache) -> (logits or hidden, cache) for this model, through the shared jitted step."""
    graphdef, _ = nnx.split(model)
    output = "logits" if with_logits else "hidden"
    return lambda batch, cache: run_model_jit(graphdef, nnx.state(model), batch, cache, attn_path=attn_path,
                                              output=output, kernels=kernels)


def prefill_logits(model: DsaModel, tokens, *, attn_path: str = "expanded", index_dtype: str = "same",
                   kernels: KernelPolicy = DEFAULT_POLICY):
    """Teacher-forced logits [B, T, V] (fp32) of whole sequences from an empty cache."""
    from models.kv import contiguous_batch, empty_kv_cache

    tokens = jnp.asarray(tokens, jnp.int32)
    B, T = tokens.shape
    batch = contiguous_batch(tokens)
    cache = empty_kv_cache(model.cfg, 1 + B * T, model.dtype, index_dtype)
    logits, _ = jit_forward(model, attn_path=attn_path, kernels=kernels)(batch, cache)
    return logits
