"""The jitted step: one forward of the model over a batch, with the KV pool donated (updated in place,
never copied) and, by default, only each request's last-token hidden turned into logits."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cpkv_jax.kv_pool import KVPool
from cpkv_jax.sampling import is_stochastic, propose_tokens, sample_tokens, verify_tokens
from models.kv import Batch, KVAccess
from models.model import DsaModel, run_draft, run_model
from models.sharding import RULES, place_state
from pallas_kernels.policy import DEFAULT_POLICY, KernelPolicy
from pallas_kernels.sparse_mla import kernel_applies

ABSORBED_MAX_TOKENS = 16  # extends up to this many tokens per request use the absorbed path
# The expanded path materializes fp32 scores [B, heads, T, S] (and the softmax's copy of them): above
# this many elements (16 GiB of scores) long chunks over long contexts take the absorbed path, whose
# transients grow with T·top-k instead of T·S (GLM-5: a 8192-token chunk over 32k keys would need 64 GiB).
EXPANDED_MAX_SCORES = 1 << 32


def choose_attn_path(rows: int, tokens_per_request: int, width: int, heads: int, sparse_kernel: bool = False) -> str:
    """Absorbed attention (over the top-k latents) for decode, short extends, chunks whose dense score
    matrix would not fit, and every chunk when the sparse MLA kernel runs it (its cost grows with
    top-k, the expanded path's with the context: docs/perf.md); expanded (kv_b_proj over every visible
    latent, amortized over many queries) for other long prefill chunks."""
    if (sparse_kernel or tokens_per_request <= ABSORBED_MAX_TOKENS
            or rows * heads * tokens_per_request * width > EXPANDED_MAX_SCORES):
        return "absorbed"
    return "expanded"


class StaticGraph:
    """The model's graph definition and its state's tree structure as one static argument of the jitted
    steps, hashed once: jit hashes its static arguments on every call, and hashing a graph definition
    walks the whole model (with the state's own flattening, milliseconds of host time per step).
    Equal graphs compare equal, so runners of one model share their executables; `of` hands every
    runner of one graph the same object, so the lookups of each step compare by identity."""

    _interned: dict[int, list["StaticGraph"]] = {}

    def __init__(self, graphdef, treedef):
        self.graphdef, self.treedef = graphdef, treedef
        self._hash = hash((graphdef, treedef))

    @classmethod
    def of(cls, graphdef, treedef) -> "StaticGraph":
        new = cls(graphdef, treedef)
        same = cls._interned.setdefault(new._hash, [])
        for g in same:
            if g == new:
                return g
        same.append(new)
        return new

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return self is other or (isinstance(other, StaticGraph) and self._hash == other._hash
                                 and self.graphdef == other.graphdef and self.treedef == other.treedef)


def fill_tokens(tokens, last_tokens):
    """Token ids with each -1 - i replaced by last_tokens[i]."""
    return jnp.where(tokens < 0, last_tokens[jnp.maximum(-1 - tokens, 0)], tokens)


def run_filled(graph: StaticGraph, leaves, batch: Batch, cache, last_tokens, **kw):
    """run_model with the batch's negative tokens read from the device: token -1 - i is `last_tokens[i]`,
    a token sampled by an earlier step and not yet seen by the host (the overlapped decode loop), so a
    decode step is dispatched before the previous step's tokens reach the host. The parameters come as
    the flat list of their leaves."""
    return run_model(graph.graphdef, jax.tree.unflatten(graph.treedef, leaves),
                     dataclasses.replace(batch, tokens=fill_tokens(batch.tokens, last_tokens)), cache, **kw)


def run_draft_leaves(graph: StaticGraph, leaves, hidden, next_tokens, batch: Batch, cache, last_tokens, **kw):
    """run_draft with the parameters as the flat list of their leaves and, as run_filled, negative
    tokens read from the device (the draft chain's proposals)."""
    return run_draft(graph.graphdef, jax.tree.unflatten(graph.treedef, leaves), hidden,
                     fill_tokens(next_tokens, last_tokens),
                     dataclasses.replace(batch, tokens=fill_tokens(batch.tokens, last_tokens)), cache, **kw)


def run_draft_proposed(graph: StaticGraph, leaves, hidden, next_tokens, batch: Batch, cache, last_tokens, first, live,
                       temperature, top_p, top_k, seed, position, *, stochastic: bool = True, **kw):
    """run_draft_leaves and, in the same executable, the draft proposals from its logits (rows not
    `live` zeroed first, their MTP hidden too, as a chain's padding rows are), kept in last_tokens at
    first, first + 1, ...: one dispatch per chain step. `stochastic`: as propose_tokens' (False: no
    distributions, None). Returns ((MTP hidden [B, D], proposals [B], their distributions [B, V],
    last_tokens), cache)."""
    (dlogits, x_last), cache = run_draft_leaves(graph, leaves, hidden, next_tokens, batch, cache, last_tokens, **kw)
    dlogits = jnp.where(live[:, None], dlogits, 0.0)
    x_last = jnp.where(live[:, None], x_last, 0)
    drafts, q = propose_tokens(dlogits, temperature, top_p, top_k, seed, position, stochastic=stochastic)
    return (x_last, drafts, q, jax.lax.dynamic_update_slice(last_tokens, drafts, (first,))), cache


@functools.partial(jax.jit, static_argnames=("top_n", "stochastic"))
def sample_and_keep(last_tokens, first, logits, temperature, top_p, top_k, seed, position, *, top_n: int = 0,
                    stochastic: bool = True):
    """cpkv_jax.sampling.sample_tokens, its tokens [B] also stored at last_tokens[first:first + B] (the
    buffer later steps read them from, run_filled); one executable per sampler variant."""
    out = sample_tokens(logits, temperature, top_p, top_k, seed, position, top_n=top_n, stochastic=stochastic)
    return jax.lax.dynamic_update_slice(last_tokens, out[0], (first,)), out


def run_filled_sampled(graph: StaticGraph, leaves, batch: Batch, cache, last_tokens, first, temperature, top_p,
                       top_k, seed, position, *, stochastic: bool, **kw):
    """run_filled's last-token logits and, in the same executable, sample_and_keep's tokens: one
    dispatch per step instead of two, for a host whose launch work is as long as a decode step's device
    time (docs/perf.md). Returns ((logits, sample_tokens' outputs, last_tokens), cache)."""
    logits, cache = run_filled(graph, leaves, batch, cache, last_tokens, output="last_logits", **kw)
    last_tokens, out = sample_and_keep(last_tokens, first, logits, temperature, top_p, top_k, seed, position,
                                       stochastic=stochastic)
    return (logits, out, last_tokens), cache


def at_start(batch: Batch, start):
    """The batch with row b's lanes at positions start[b], start[b] + 1, ... (one rank, where a round's
    lanes are consecutive) and their write slots read from its slot table (the dummy slot 0 past its
    width): a round whose start the device knows and the host does not yet (the overlapped loop)."""
    valid = batch.positions >= 0
    positions = jnp.where(valid, start[:, None] + jnp.arange(batch.positions.shape[1], dtype=jnp.int32), -1)
    slots = jnp.take_along_axis(batch.slot_table, jnp.maximum(positions, 0), axis=1, mode="fill", fill_value=0)
    return dataclasses.replace(batch, positions=positions, write_slots=jnp.where(valid, slots, 0))


def _chain_batch(table, position, tokens, live):
    """A chain step's one-lane batch: each live row's token at `position`, over the round's slot table."""
    pos = jnp.where(live, position, -1)[:, None]
    slots = jnp.take_along_axis(table, jnp.maximum(pos, 0), axis=1, mode="fill", fill_value=0)
    return Batch(tokens[:, None], pos, jnp.where(pos >= 0, slots, 0), table)


def run_round(graph: StaticGraph, leaves, batch: Batch, caches, last_tokens, start, rank_idx, lane_idx, lane_token,
              drafts, draft_probs, q_rows, temperature, top_p, top_k, seed, live, first, keep, *, top_n: int,
              stochastic: bool, chain: int, placed: bool, stride: int, draft_kw: tuple, **kw):
    """A speculative round in one executable: the target step over each request's last token and its
    drafts with the acceptance (greedy match or rejection sampling), the draft extend over the same
    lanes with the first proposals, and `chain` chain steps (each MTP step takes its own last hidden and
    the token just proposed, one position further), so a round dispatches once and the host reads it
    once. start [B]: the position of each request's first lane, negative: -1 - i, read at
    last_tokens[i] (a round the previous one, still running, placed); `placed`: the lanes' positions
    and write slots come from start (one rank; False: as the host built them, under CP, where the
    chain runs after the read). rank_idx / lane_idx [B, n+1]: where each request's tokens sit;
    lane_token [rows, T]: the token index of each lane (-1: padding); drafts [B, n] (negative: read from
    last_tokens, as run_filled); draft_probs[q_rows] [B, n, V]: their distributions (None when no row
    samples). Proposal k of row b is kept at last_tokens[first + k * stride + b]; the token after each
    row's accepted drafts at keep[0] + b and the position after it at keep[1] + b (the next round's
    start). `draft_kw`: the draft steps' static arguments that differ from the target's (its trace tap).
    Returns ((accepted count [B], the token after them [B], the emitted tokens [B, n+1] (drafts[:a],
    then that token), verify_tokens' log-probabilities and alternatives, the target logits [B, n+1,
    V]), (the extend's MTP hidden [B, D], the round's proposals [B, 1 + chain] and their distributions
    [B, 1 + chain, V] or None), last_tokens), (cache, draft cache)."""
    cache, draft = caches
    start = fill_tokens(start, last_tokens)
    if placed:
        batch = at_start(batch, start)
    (logits, hidden), cache = run_filled(graph, leaves, batch, cache, last_tokens, output="logits_hidden", **kw)
    B = rank_idx.shape[0]
    rows = jnp.arange(B)[:, None]
    target = logits[rows, lane_idx] if logits.ndim == 3 else logits[rank_idx, rows, lane_idx]
    drafts = fill_tokens(drafts, last_tokens)
    q = None if draft_probs is None else jnp.where((q_rows >= 0)[:, None, None], draft_probs[jnp.maximum(q_rows, 0)], 0)
    position = start + 1
    params = (temperature, top_p, top_k, seed)
    a, tok, lps, *top = verify_tokens(target, q, drafts, *params, position, top_n=top_n, stochastic=stochastic)
    emitted = jnp.concatenate([drafts, jnp.zeros((B, 1), drafts.dtype)], axis=1).at[rows[:, 0], a].set(tok)
    last_tokens = jax.lax.dynamic_update_slice(last_tokens, tok, (keep[0],))
    last_tokens = jax.lax.dynamic_update_slice(last_tokens, start + a + 1, (keep[1],))
    lane_row = (jnp.arange(lane_token.shape[0]) % B)[:, None]
    next_tokens = jnp.where(lane_token >= 0, emitted[lane_row, jnp.maximum(lane_token, 0)], 0)
    next_position = position + a + 1       # of the first draft
    dkw = {k: v for k, v in kw.items() if k not in ("boundary", "tap")} | dict(draft_kw)
    dkw.update(last_index=lane_idx[rows[:, 0], a], last_rank=rank_idx[rows[:, 0], a])
    (x, d, dq, last_tokens), draft = run_draft_proposed(
        graph, leaves, hidden, next_tokens, dataclasses.replace(batch, tokens=next_tokens), draft, last_tokens,
        first, live, *params, next_position, stochastic=stochastic, **dkw)
    x_last, proposals, dists = x, [d], [dq]
    dkw.update(attn_path="absorbed", last_index=jnp.zeros(B, jnp.int32), last_rank=jnp.zeros(B, jnp.int32))
    for k in range(1, chain + 1):
        (x, d, dq, last_tokens), draft = run_draft_proposed(
            graph, leaves, x, d[:, None], _chain_batch(batch.slot_table, next_position - 2 + k, d, live), draft,
            last_tokens, first + k * stride, live, *params, next_position + k, stochastic=stochastic, **dkw)
        proposals.append(d)
        dists.append(dq)
    dists = jnp.stack(dists, axis=1) if stochastic else None
    return (((a, tok, emitted, lps, *top, target), (x_last, jnp.stack(proposals, axis=1), dists), last_tokens),
            (cache, draft))


# The step every runner dispatches: the pool (argument 3) is donated; the graph definition and the
# kernel policy are static, so runners over the same model graph, pool shape and policy share compiled
# executables.
_step = jax.jit(run_filled, static_argnums=(0,),
                static_argnames=("attn_path", "output", "access", "kernels", "mesh", "boundary", "tap",
                                 "ep_dispatch", "micro_batches"),
                donate_argnums=(3,))
_step_sampled = jax.jit(run_filled_sampled, static_argnums=(0,),
                        static_argnames=("attn_path", "access", "kernels", "mesh", "boundary", "tap", "ep_dispatch",
                                         "micro_batches", "stochastic"),
                        donate_argnums=(3,))
_round = jax.jit(run_round, static_argnums=(0,),
                 static_argnames=("attn_path", "access", "kernels", "mesh", "boundary", "tap", "ep_dispatch",
                                  "micro_batches", "top_n", "stochastic", "chain", "placed", "stride", "draft_kw"),
                 donate_argnums=(3,))
# The draft step every runner dispatches proposes in the same executable; _draft_step is the bare MTP
# step inside it, for lowering that program on its own (tests/test_trace.py).
_DRAFT_STATIC = ("attn_path", "access", "kernels", "mesh", "tap", "ep_dispatch", "micro_batches")
_draft_step = jax.jit(run_draft_leaves, static_argnums=(0,), static_argnames=_DRAFT_STATIC, donate_argnums=(5,))
_draft_step_proposed = jax.jit(run_draft_proposed, static_argnums=(0,), static_argnames=_DRAFT_STATIC + ("stochastic",),
                               donate_argnums=(5,))


def _index(x):
    """Host indices as int32; indices a step computed on the device stay there: reading them would make
    the host wait for that step."""
    return x if isinstance(x, jax.Array) else np.asarray(x, np.int32)


class ModelRunner:
    """Dispatches the step. With a mesh, the parameters are placed by the sharding table (routed experts
    split over its 'ep' axis, the rest replicated), the pool is sharded over its 'cp' axis and every
    step runs under shard_map (models.model.run_model). With
    `step_copies` (the host tier's side-stream copies: a StepCopies per device for the next forward), a
    target forward that has copies to make carries the layer hook and pushes them first; the others
    run the plain executable (decode steps do not pay the hook). Batches' slot tables are made of the
    pool's pages (paged_slot_table): with pages of a multiple of 64 slots the forward tells the
    indexer so (KVAccess.contiguous_blocks), and its decode scores read the keys by page block.
    `kernels`: which kernels every step runs (a static argument of the jitted steps); `ep_dispatch`
    ('psum' / 'all_to_all', resolved) and `micro_batches` (2: two-batch overlap): run_model's."""

    def __init__(self, model: DsaModel, pool: KVPool, mesh=None, copier=None, step_copies=None,
                 kernels: KernelPolicy = DEFAULT_POLICY, ep_dispatch: str = "psum", micro_batches: int = 1):
        self.model = model
        self.kernels = kernels
        self.ep_dispatch, self.micro_batches = ep_dispatch, micro_batches
        self.copier, self.step_copies = copier, step_copies
        self.graphdef, self.state = nnx.split(model)
        self.pool = pool
        self.mesh, self.axis = mesh, RULES.batch_rows
        self.cp = 1 if mesh is None or self.axis not in mesh.axis_names else mesh.shape[self.axis]
        if mesh is not None:
            self.state = place_state(self.state, mesh)
            self._rows = RULES.sharding(mesh, "batch_rows")
            self._replicated = RULES.sharding(mesh)
        self.leaves, treedef = jax.tree.flatten(self.state)
        self.graph = StaticGraph.of(self.graphdef, treedef)
        cfg = model.cfg
        q_lat = jax.ShapeDtypeStruct((1, cfg.num_attention_heads, cfg.kv_lora_rank), pool.cache.latent.dtype)
        q_rope = jax.ShapeDtypeStruct((1, cfg.num_attention_heads, cfg.qk_rope_head_dim), pool.cache.latent.dtype)
        self.sparse_kernel = kernel_applies(q_lat, q_rope, kernels)
        self.variants: set[tuple] = set()  # (tokens shape, slot table shape, attn path, output, access)
        self.hold_tokens(1)
        self.trace = None   # cpkv_jax.trace.Tracer when the engine traces (EngineConfig.kv_trace)

    def hold_tokens(self, slots: int) -> None:
        """Make the device buffer of sampled tokens that later steps read (run_filled): `slots` entries."""
        where = (self._replicated if self.mesh is not None
                 else next(iter(jax.tree.leaves(self.pool.cache)[0].devices())))
        self.last_tokens = jax.device_put(np.zeros((slots,), np.int32), where)   # committed, as the kept ones are

    def sample(self, first: int, logits, *params, top_n: int = 0):
        """Sample a step's tokens (cpkv_jax.sampling.sample_tokens over `params`) and keep them on the
        device at rows first, first + 1, ... of the buffer the next steps read."""
        self.last_tokens, out = sample_and_keep(self.last_tokens, np.int32(first), logits, *params, top_n=top_n,
                                                stochastic=is_stochastic(params[0]))
        return out

    def place(self, batch: Batch) -> Batch:
        """Put a CP batch on the mesh: token rows split over the axis, the slot table replicated."""
        if self.mesh is None:
            return batch
        rows, rep = self._rows, self._replicated
        return Batch(jax.device_put(batch.tokens, rows), jax.device_put(batch.positions, rows),
                     jax.device_put(batch.write_slots, rows), jax.device_put(batch.slot_table, rep))

    def _common(self, batch, last_index, last_rank, page_aligned):
        B, T = batch.tokens.shape
        if last_index is None:
            last_index = np.full((B,), T - 1, np.int32)
        access = (KVAccess(self.axis, page_aligned) if self.cp > 1
                  else KVAccess(contiguous_blocks=self.pool.page_size % 64 == 0))
        kw = dict(last_index=_index(last_index), access=access, kernels=self.kernels, mesh=self.mesh,
                  ep_dispatch=self.ep_dispatch, micro_batches=self.micro_batches)
        if self.mesh is not None:
            kw["last_rank"] = jax.device_put(_index(last_rank), self._replicated)
            kw["last_index"] = jax.device_put(_index(last_index), self._replicated)
        return self.place(batch), kw

    def attn_path_for(self, batch: Batch) -> str:
        """The attention path of a batch: per rank, B rows (of cp·B under CP) x T lanes over S keys."""
        B, T = batch.tokens.shape
        B //= self.cp
        return choose_attn_path(B, T, batch.slot_table.shape[1], self.model.cfg.num_attention_heads,
                                sparse_kernel=self.sparse_kernel)

    def lower(self, batch: Batch, last_index, *, attn_path: str, all_logits: bool = False, last_rank=None,
              page_aligned: bool = True):
        batch, kw = self._common(batch, last_index, last_rank, page_aligned)
        kw.update(self._trace_kw("target"))
        return _step.lower(self.graph, self.leaves, batch, self.pool.cache, self.last_tokens, attn_path=attn_path,
                           output="logits" if all_logits else "last_logits", **kw)

    def forward(self, batch: Batch, last_index=None, *, attn_path: str | None = None, output: str = "last_logits",
                last_rank=None, page_aligned: bool = True, sample=None):
        """Runs one target step; the pool is consumed and replaced. output (models.model.OUTPUTS):
        "last_logits" fp32 [B, V] at `last_index` (per request lane; under CP on rank `last_rank`),
        "logits" every position ([B, T, V]; under CP [cp, B, T, V]), "*_hidden" also this step's
        hidden rows, kept on device for the draft model. `sample` = (first, (temperature, top_p, top_k,
        seed), position), with output "last_logits": the step also samples, as `sample` does, in the
        same executable, and returns (logits, sample_tokens' outputs)."""
        batch, kw, attn_path = self._target_kw(batch, last_index, last_rank, page_aligned, attn_path)
        if sample is None:
            self.variants.add(("target", batch.tokens.shape, batch.slot_table.shape, attn_path, output,
                               kw["access"], "boundary" in kw))
            out, self.pool.cache = _step(self.graph, self.leaves, batch, self.pool.cache, self.last_tokens,
                                         attn_path=attn_path, output=output, **kw)
            logits = out
        else:
            if output != "last_logits":
                raise ValueError(f"a forward that samples returns last-token logits, not {output!r}")
            first, params, position = sample
            stochastic = is_stochastic(params[0])
            self.variants.add(("target", batch.tokens.shape, batch.slot_table.shape, attn_path,
                               ("sampled", stochastic), kw["access"], "boundary" in kw))
            (logits, tokens, self.last_tokens), self.pool.cache = _step_sampled(
                self.graph, self.leaves, batch, self.pool.cache, self.last_tokens, np.int32(first), *params,
                np.asarray(position, np.int32), attn_path=attn_path, stochastic=stochastic, **kw)
            out = logits, tokens
        if self.trace is not None:
            self.trace.forward_done("target", logits)
        return out

    def _target_kw(self, batch: Batch, last_index, last_rank, page_aligned: bool, attn_path: str | None):
        """A target step's placed batch, static arguments and attention path; pushes the host tier's
        side-stream copies pending for this forward, which then carries their layer hook."""
        batch, kw = self._common(batch, last_index, last_rank, page_aligned)
        attn_path = attn_path or self.attn_path_for(batch)
        if self.copier is not None:
            copies = self.step_copies()
            if any(c.loads or c.backups for c in copies):    # only forwards that copy pay for the hook
                from cpkv_jax.hicache.side_stream import LayerHook
                for c in copies:
                    self.copier.push(c)
                kw["boundary"] = LayerHook(() if self.mesh is None else tuple(self.mesh.axis_names))
        kw.update(self._trace_kw("target"))
        return batch, kw, attn_path

    def round(self, batch: Batch, last_index, start, verify, draft_probs, params, rows: int, first: int,
              keep: tuple[int, int], *, stride: int, chain: int, placed: bool, attn_path: str | None = None,
              last_rank=None, page_aligned: bool = True, top_n: int = 0):
        """A speculative round (run_round) in one dispatch: `verify` = (rank_idx, lane_idx, lane_token,
        drafts) of its `rows` requests, `draft_probs` = (distributions [R, n, V], the row of each request
        there [B]) or None (no row samples: the greedy variant), `params` the per-row (temperature,
        top_p, top_k, seed). Returns run_round's outputs less the buffer and the pools, which it keeps."""
        batch, kw, attn_path = self._target_kw(batch, last_index, last_rank, page_aligned, attn_path)
        stochastic = draft_probs is not None
        probs, q_rows = draft_probs if stochastic else (None, np.zeros(len(params[0]), np.int32))
        self.variants.add(("round", batch.tokens.shape, batch.slot_table.shape, attn_path, top_n, stochastic, chain,
                           placed, kw["access"], "boundary" in kw))
        (verified, drafted, self.last_tokens), (self.pool.cache, self.pool.draft) = _round(
            self.graph, self.leaves, batch, (self.pool.cache, self.pool.draft), self.last_tokens,
            np.asarray(start, np.int32), *verify, probs, np.asarray(q_rows, np.int32), *params,
            np.arange(len(params[0])) < rows, np.int32(first), np.asarray(keep, np.int32),
            draft_kw=tuple(self._trace_kw("draft").items()), attn_path=attn_path, top_n=top_n, stochastic=stochastic,
            chain=chain, placed=placed, stride=stride, **kw)
        if self.trace is not None:
            self.trace.forward_done("target", verified[-1])
            self.trace.forward_done("draft", drafted)
        return verified, drafted

    def draft_forward(self, hidden, next_tokens, batch: Batch, last_index, *, propose, attn_path: str | None = None,
                      last_rank=None, page_aligned: bool = True):
        """One MTP step over the draft pool (same slots as the target's) and the proposals drawn from its
        logits at each request's last lane, in one executable (run_draft_proposed): `propose` = (first,
        live rows [B] bool, (temperature, top_p, top_k, seed), position of the drafted token [B]).
        Returns (MTP hidden [B, D], proposals [B], their distributions [B, V] or None when no row
        samples)."""
        batch, kw = self._common(batch, last_index, last_rank, page_aligned)
        attn_path = attn_path or self.attn_path_for(batch)
        if self.mesh is not None:
            next_tokens = jax.device_put(next_tokens, self._rows)
            if hidden.ndim == 2:
                hidden = jax.device_put(hidden, self._replicated)
        first, live, params, position = propose
        stochastic = is_stochastic(params[0])
        self.variants.add(("draft", batch.tokens.shape, batch.slot_table.shape, hidden.ndim, attn_path,
                           kw["access"], stochastic))
        kw.update(self._trace_kw("draft"))
        (x_last, drafts, q, self.last_tokens), self.pool.draft = _draft_step_proposed(
            self.graph, self.leaves, hidden, jnp.asarray(next_tokens), batch, self.pool.draft, self.last_tokens,
            np.int32(first), np.asarray(live, bool), *params, _index(position), attn_path=attn_path,
            stochastic=stochastic, **kw)
        if self.trace is not None:
            self.trace.forward_done("draft", (x_last, drafts, q))
        return x_last, drafts, q

    @property
    def taps(self) -> bool:
        """Whether steps carry the trace's per-layer probes (one forward per executable, then)."""
        return self.trace is not None and self.trace.per_layer

    def _trace_kw(self, model: str) -> dict:
        """The KV-integrity trace's per-layer probe for a step of `model` ('target' / 'draft'), when the
        engine traces at level 3; nothing otherwise (the step compiles without it)."""
        if self.trace is None:
            return {}
        tap = self.trace.tap(model, () if self.mesh is None else tuple(self.mesh.axis_names))
        return {} if tap is None else {"tap": tap}

    @property
    def compilations(self) -> int:
        """Distinct step variants this runner has dispatched: each is one compiled executable (shared
        with other runners of the same model graph and pool shape)."""
        return len(self.variants)

