"""DeepSeek MoE: fp32 sigmoid router with a selection-only correction bias and group-limited top-k,
routed experts through a grouped matmul over expert-sorted rows, plus shared experts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import ModelConfig
from models.layers import Dense, fp8_or_plain_param
from models.sharding import EP_DISPATCH, NO_AXES, MeshAxes
from pallas_kernels.policy import DEFAULT_POLICY, KernelPolicy
from pallas_kernels.moe import expert_mlp, expert_shape, fp8_experts_as_plain
from pallas_kernels.row_gather import combine_rows, compaction_plan, expert_order, gather_rows


class MLP(nnx.Module):
    def __init__(self, dim: int, inter: int, *, dtype, rngs: nnx.Rngs, stack=(), fp8=lambda name: False):
        """fp8(name): whether projection `name` (gate_proj, up_proj, down_proj) is stored fp8."""
        self.gate_proj = Dense(dim, inter, dtype=dtype, rngs=rngs, stack=stack, fp8=fp8("gate_proj"))
        self.up_proj = Dense(dim, inter, dtype=dtype, rngs=rngs, stack=stack, fp8=fp8("up_proj"))
        self.down_proj = Dense(inter, dim, dtype=dtype, rngs=rngs, stack=stack, fp8=fp8("down_proj"))

    def __call__(self, x, axes: MeshAxes = NO_AXES, kernels: KernelPolicy = DEFAULT_POLICY):
        """Under tensor parallelism gate/up are column-parallel and down row-parallel: one psum."""
        h = jax.nn.silu(self.gate_proj(x, kernels)) * self.up_proj(x, kernels)
        return axes.psum_tp(self.down_proj(h, kernels))


def route(cfg: ModelConfig, logits32, bias):
    """Expert ids and weights per row. Selection uses sigmoid scores + correction bias restricted to the
    best `topk_group` groups (group score = sum of its top-2); weights use the unbiased scores."""
    scores = jax.nn.sigmoid(logits32)
    choice = scores + bias
    N, E = choice.shape
    grouped = choice.reshape(N, cfg.n_group, E // cfg.n_group)
    group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)
    _, group_idx = jax.lax.top_k(group_scores, cfg.topk_group)
    keep = jnp.zeros((N, cfg.n_group), bool).at[jnp.arange(N)[:, None], group_idx].set(True)
    choice = jnp.where(jnp.repeat(keep, E // cfg.n_group, axis=1), choice, -jnp.inf)
    _, idx = jax.lax.top_k(choice, cfg.num_experts_per_tok)
    w = jnp.take_along_axis(scores, idx, axis=1)
    if cfg.norm_topk_prob:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    return idx.astype(jnp.int32), w * cfg.routed_scaling_factor


def compact_rows(x, valid, kernels: KernelPolicy = DEFAULT_POLICY):
    """Valid rows first (in order), then zeros: (compacted [N, D], destination of each padded row,
    number valid). Under compute padding valid rows are interleaved with dummy lane slots, so a
    prefix/suffix count is not enough; the dummies' content never reaches what follows."""
    perm, dest, n_valid = compaction_plan(valid)
    return gather_rows(x, perm, policy=kernels), dest, n_valid


def restore_rows(y, dest, kernels: KernelPolicy = DEFAULT_POLICY):
    """Inverse of compact_rows: compacted rows back to their padded positions; dummy rows get zeros."""
    return gather_rows(y, dest, policy=kernels)


def routed_sum(x, idx, w, gate, up, down, n_valid=None, kernels: KernelPolicy = DEFAULT_POLICY, first_expert=0,
               scales=None):
    """fp32 [N, D]: the sum over each row's k experts of w * down(silu(gate x) * up x), through the
    grouped matmuls of pallas_kernels.moe (kernels chooses the kernel or XLA's ragged_dot). `gate`,
    `up`, `down` hold experts [first_expert, first_expert + E): slots routed elsewhere (another rank's
    experts) and rows at or beyond n_valid (compacted dummies) join no expert and add zero. Layouts as
    pallas_kernels/moe/layout.py: plain gate / up [E, D, I], down [E, I, D]; scales given: the experts
    are fp8 blocks, K-major (gate / up [E, I, D], down [E, D, I]) with these (gate, up, down) scales
    (expert_mlp keeps them fp8 or dequantizes them to the plain layout)."""
    N = x.shape[0]
    E = gate.shape[0]
    k = idx.shape[1]
    flat_e = idx.reshape(-1) - first_expert   # outside [0, E): no expert here
    if n_valid is not None:
        flat_e = jnp.where(jnp.repeat(jnp.arange(N) < n_valid, k), flat_e, E)
    # Each row's k slots weighted and summed in slot order in fp32: no scatter-add (on the GPU that
    # is atomics in arbitrary order, not bit-stable run to run).
    return expert_mlp(x, flat_e, gate, up, down, k, policy=kernels, scales=scales).weighted_sum(w, kernels)


def grouped_expert_mlp(x, idx, w, gate, up, down, n_valid=None, kernels: KernelPolicy = DEFAULT_POLICY, scales=None):
    """routed_sum over every expert, in x's dtype."""
    return routed_sum(x, idx, w, gate, up, down, n_valid, kernels, scales=scales).astype(x.dtype)


def expert_parallel_mlp(x, idx, w, gate, up, down, n_valid, kernels: KernelPolicy, axis: str, scales=None):
    """Inside a shard_map over `axis`, with the routed experts split over it (rank r holds experts
    [r E_r, (r + 1) E_r)) and the rows, their routes and weights the same on every rank: each rank runs
    only its own experts' slots and the ranks' fp32 partial sums are added (one psum of [N, D]). Exact
    up to the order of that addition; nothing is padded to a capacity. With the rows already on every
    rank (tensor-parallel attention's output is), the psum moves the same bytes as a dispatch and
    combine all-to-all of a rank's share of the rows at top-8."""
    first = jax.lax.axis_index(axis) * gate.shape[0]
    return jax.lax.psum(routed_sum(x, idx, w, gate, up, down, n_valid, kernels, first, scales), axis).astype(x.dtype)


def dense_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
    """lax.ragged_all_to_all's result where it does not run (XLA:CPU): each rank's chunk for every
    peer padded to the operand's length and exchanged by one dense all_to_all, then written at the
    offsets its sender chose. Exact (rows are moved, not added); pads R x the operand's rows."""
    R, M = send_sizes.shape[0], operand.shape[0]
    i = jnp.arange(M)
    tail = (1,) * (operand.ndim - 1)
    chunks = jnp.take(operand, jnp.minimum(input_offsets[:, None] + i, M - 1), axis=0)
    chunks = jnp.where((i < send_sizes[:, None]).reshape(R, M, *tail), chunks, jnp.zeros((), operand.dtype))
    got = jax.lax.all_to_all(chunks, axis_name, 0, 0)          # got[s]: the chunk rank s sent here
    at = jax.lax.all_to_all(output_offsets, axis_name, 0, 0)    # at[s]: where rank s put it here
    dst = jnp.where(i < recv_sizes[:, None], at[:, None] + i, output.shape[0]).reshape(-1)
    return output.at[dst].set(got.reshape(R * M, *operand.shape[1:]), mode="drop", unique_indices=True)


def dispatch_plan(idx, n_valid, experts_per_rank: int, ranks: int):
    """The send side of an expert-parallel dispatch: (order, sizes): the routed slots (row-major over
    [rows, k]) grouped by the rank holding their expert, and how many go to each rank. Slots of rows at
    or beyond n_valid (compacted dummies) go last and count for no rank: they are never sent."""
    n, k = idx.shape
    live = jnp.repeat(jnp.arange(n) < n_valid, k)
    return expert_order(jnp.where(live, idx.reshape(-1) // experts_per_rank, ranks), ranks)


def dispatched_expert_mlp(x, idx, w, gate, up, down, n_valid, kernels: KernelPolicy, axis: str, scales=None,
                          exchange=None):
    """Inside a shard_map over `axis`, with the routed experts split over it and each rank holding its
    own rows (data-parallel attention): every routed slot's row goes to the rank of its expert, the
    rank runs the rows it received through its experts (one grouped matmul), and the results go back
    to the slots they came from, which are weighted and summed in slot order in fp32 as routed_sum
    does. Exactly the routed slots move, both ways (no capacity: a receive buffer holds R x the
    rank's slots, the most it can get); dummy rows are never sent. exchange: lax.ragged_all_to_all's
    signature; default: it, on every backend but CPU, where it does not run (dense_ragged_all_to_all)."""
    n, D = x.shape
    k = idx.shape[1]
    S, El = n * k, gate.shape[0]
    R = jax.lax.axis_size(axis)
    if exchange is None:
        exchange = jax.lax.ragged_all_to_all if jax.default_backend() != "cpu" else dense_ragged_all_to_all
    order, sizes = dispatch_plan(idx, n_valid, El, R)
    every = jax.lax.all_gather(sizes, axis)                     # every[s, j]: slots rank s sends to rank j
    me = jax.lax.axis_index(axis)
    send_at = jnp.cumsum(sizes) - sizes                          # my chunks in my send buffer
    land_at = (jnp.cumsum(every, axis=0) - every)[me]            # my chunk for rank j at land_at[j] on j
    recv = every[:, me]                                          # what each rank sends me
    recv_at = (jnp.cumsum(every, axis=0) - every)[:, me]         # ... and where it lands here
    home_at = (jnp.cumsum(every, axis=1) - every)[:, me]         # ... and where it sat in its sender's buffer
    rows = exchange(gather_rows(x, order // k, policy=kernels), jnp.zeros((R * S, D), x.dtype), send_at, sizes,
                    land_at, recv, axis_name=axis)
    ids = exchange((idx.reshape(-1) % El)[order], jnp.full((R * S,), El, jnp.int32), send_at, sizes, land_at, recv,
                   axis_name=axis)                               # never-written rows keep El: no expert
    y = expert_mlp(rows, ids, gate, up, down, 1, policy=kernels, scales=scales).slots(kernels)
    back = exchange(y, jnp.zeros((S, D), y.dtype), recv_at, recv, home_at, sizes, axis_name=axis)
    unsort = jnp.zeros_like(order).at[order].set(jnp.arange(S, dtype=jnp.int32), unique_indices=True)
    return combine_rows(back, unsort.reshape(n, k), w, policy=kernels).astype(x.dtype)


EP_DISPATCH_CHOICES = ("auto",) + EP_DISPATCH   # EngineConfig.ep_dispatch: 'auto' resolves to one of EP_DISPATCH


def ep_dispatch_bytes(mode: str, ep: int, k: int, hidden: int, itemsize: int) -> float:
    """Bytes one rank sends per MoE layer and per row of the forward, when every ep rank holds every
    row (the engine's attention output is replicated over 'ep'), with routes spread evenly over the
    ranks (D = hidden):
      'psum'        a ring all-reduce of the fp32 partial sums [N, D]: 2 (ep-1)/ep x 4 D;
      'all_to_all'  each rank dispatches its 1/ep of the rows' k routed slots, (ep-1)/ep of them to
                    other ranks, gets them back (2 x k/ep x (ep-1)/ep x itemsize D, plus an int32
                    expert id per slot one way), then all-gathers the combined rows ((ep-1)/ep x
                    itemsize D).
    all_to_all / psum ~ itemsize (2k/ep + 1) / 8: bf16 GLM-5 / DeepSeek-V3.2 (k=8) 2.25x at ep 2,
    1.25x at ep 4, 0.75x at ep 8; fp32 needs ep > 2k to win."""
    if ep <= 1:
        return 0.0
    remote = (ep - 1) / ep
    if mode == "psum":
        return 2 * remote * 4 * hidden
    if mode == "all_to_all":
        return remote * (2 * k / ep * itemsize * hidden + itemsize * hidden + k / ep * 4)
    raise ValueError(f"mode must be 'psum' or 'all_to_all', got {mode!r}")


def choose_ep_dispatch(choice: str, ep: int, k: int, hidden: int, itemsize: int) -> str:
    """The engine's EP dispatch ('auto' resolved). Both modes are exact (no capacity, no dropped slot,
    dummy rows never computed or sent; 'all_to_all' even adds each row's slots in the one-device
    order, where 'psum' adds the ranks' fp32 partials), so 'auto' takes the one that sends fewer bytes
    per rank (ep_dispatch_bytes; ties: 'psum', one collective instead of four)."""
    if choice not in EP_DISPATCH_CHOICES:
        raise ValueError(f"ep_dispatch must be one of {EP_DISPATCH_CHOICES}, got {choice!r}")
    if choice != "auto":
        return choice
    a2a = ep_dispatch_bytes("all_to_all", ep, k, hidden, itemsize)
    return "all_to_all" if a2a < ep_dispatch_bytes("psum", ep, k, hidden, itemsize) else "psum"


def over_own_rows(x, n_valid, axis: str, fn):
    """Inside a shard_map over `axis`, with the rows x [N, D] (valid ones first, n_valid of them) the
    same on every rank: rank r takes its own strided 1/R of them (rows r, r + R, ...: the valid ones
    spread evenly and still first), runs fn(rows [ceil(N/R), D], n_valid of them) -> [ceil(N/R), D]
    (the dispatch), and the ranks' results are all-gathered back into every rank's [N, D]."""
    N, D = x.shape
    R = jax.lax.axis_size(axis)
    c = -(-N // R)
    r = jax.lax.axis_index(axis)
    padded = jnp.pad(x, ((0, c * R - N), (0, 0))).reshape(c, R, D)
    mine = jax.lax.dynamic_index_in_dim(padded, r, axis=1, keepdims=False)          # rows r + R i
    y = fn(mine, jnp.clip((n_valid - r + R - 1) // R, 0, c))
    return jax.lax.all_gather(y, axis, axis=1).reshape(c * R, D)[:N]              # back in row order


class MoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs, stack=()):
        self.cfg = cfg
        E, D, I = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate = Dense(D, E, dtype=dtype, rngs=rngs, stack=stack)
        self.e_score_correction_bias = nnx.Param(jnp.zeros((*stack, E), jnp.float32))

        def expert(name, K, N):
            """One projection's experts (input width K, output width N) in the layout of
            pallas_kernels/moe/layout.py: plain [*stack, E, K, N]; kept fp8, K-major [*stack, E, N, K]
            (HF's [out, in] per expert, what the fp8 kernel reads) with scales [*stack, E, N/128, K/128]."""
            fp8 = cfg.fp8(f"mlp.experts.{name}")
            return fp8_or_plain_param(rngs, (*stack, *expert_shape(E, K, N, fp8=fp8)), dtype, K ** -0.5, fp8)

        self.experts_gate, self.experts_gate_scale_inv = expert("gate_proj", D, I)
        self.experts_up, self.experts_up_scale_inv = expert("up_proj", D, I)
        self.experts_down, self.experts_down_scale_inv = expert("down_proj", I, D)
        self.shared_experts = (MLP(D, I * cfg.n_shared_experts, dtype=dtype, rngs=rngs, stack=stack,
                                   fp8=lambda name: cfg.fp8(f"mlp.shared_experts.{name}"))
                               if cfg.n_shared_experts else None)

    def __call__(self, x, valid=None, *, kernels: KernelPolicy = DEFAULT_POLICY, axes: MeshAxes = NO_AXES):
        """x [..., D]; valid [...] marks real tokens (padding lanes are False). Valid rows are compacted
        before the router and experts and restored after, so padding never takes part in routing.
        kernels: whether the row gathers run the Pallas kernel (static). axes: inside a shard_map, the
        mesh axes the parameters are split over (routed experts: expert_parallel_mlp over rows every
        rank holds; with ep_dispatch 'all_to_all' dispatched_expert_mlp, over each rank's strided 1/ep
        of the rows every rank holds (over_own_rows: sliced, dispatched, all-gathered back), or over
        each rank's own rows when axes.ep_rows_split (data-parallel attention); the shared experts'
        intermediate: tensor-parallel)."""
        shape = x.shape
        xf = x.reshape(-1, shape[-1])
        valid = jnp.ones(xf.shape[0], bool) if valid is None else valid.reshape(-1)
        xc, dest, n_valid = compact_rows(xf, valid, kernels)
        if axes.experts is not None and axes.ep_dispatch == "all_to_all" and not axes.ep_rows_split:
            # every ep rank holds every row: each routes and dispatches its own 1/ep, all-gathered back
            out = over_own_rows(xc, n_valid, axes.experts, lambda rows, n: self.routed(rows, n, kernels, axes))
        else:
            out = self.routed(xc, n_valid, kernels, axes)
        if self.shared_experts is not None:
            out = out + self.shared_experts(xc, axes, kernels)
        return restore_rows(out, dest, kernels).reshape(shape)

    def routed(self, xc, n_valid, kernels: KernelPolicy, axes: MeshAxes):
        """The routed experts' weighted sum [n, D] over compacted rows (the first n_valid real): the
        router, then one device's grouped matmul, or the expert-parallel psum, or the dispatch of the
        rows to their experts' ranks and back (axes.ep_dispatch)."""
        logits = jnp.dot(xc.astype(jnp.float32), self.gate.weight(jnp.float32))
        idx, w = route(self.cfg, logits, self.e_score_correction_bias[...])
        # fp8 experts (all three kept fp8) go to the dispatch as stored, K-major, with their scales: the
        # fp8 kernel keeps them fp8, any other path dequantizes one layer's experts to [E, K, N] (a
        # transient). A layer with only some projections kept fp8 dequantizes those here.
        stored = tuple(None if s is None else s[...] for s in (self.experts_gate_scale_inv,
                                                                self.experts_up_scale_inv, self.experts_down_scale_inv))
        experts = (self.experts_gate[...], self.experts_up[...], self.experts_down[...])
        if all(s is not None for s in stored):
            scales = stored
        else:
            experts = tuple(e.astype(xc.dtype) if s is None else fp8_experts_as_plain(e, s, xc.dtype)
                            for e, s in zip(experts, stored))
            scales = None
        if axes.experts is None:
            return grouped_expert_mlp(xc, idx, w, *experts, n_valid, kernels, scales=scales)
        if axes.ep_dispatch == "psum":
            return expert_parallel_mlp(xc, idx, w, *experts, n_valid, kernels, axes.experts, scales=scales)
        return dispatched_expert_mlp(xc, idx, w, *experts, n_valid, kernels, axes.experts, scales=scales)
