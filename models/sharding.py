"""Where every array lives on a mesh, decided by one table (as jax-llm-examples' ShardingRules): arrays
name their axes logically (`experts`, `kv_slots`, `batch_rows`, ...) and `ShardingRules` maps each
logical axis to a mesh axis. Parameters, the device KV pool, the host KV pool and a CP step's batch
rows all take their placement from it; a mesh without the named axis replicates that dimension."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

EXPERT_LEAVES = ("experts_gate", "experts_up", "experts_down",
                 "experts_gate_scale_inv", "experts_up_scale_inv", "experts_down_scale_inv")
EP_DISPATCH = ("psum", "all_to_all")
CP, EP, TP = "cp", "ep", "tp"           # the engine's mesh axes
KV_LEAF_AXES = ("layers", "kv_slots")   # every KV pool leaf (device and host) is [layers, slots, ...]


def kept_axes(axis: str | tuple | None, keep) -> str | tuple | None:
    """A table entry (a mesh axis, a tuple of them or None) reduced to the axes `keep` accepts: None,
    one axis, or a tuple (a PartitionSpec entry, and an axis_name for the collectives)."""
    kept = tuple(a for a in ((axis,) if isinstance(axis, str) else tuple(axis or ())) if keep(a))
    return None if not kept else kept[0] if len(kept) == 1 else kept


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Logical axis -> mesh axis, or a tuple of mesh axes (the dimension split over their product, the
    first major), or None (replicated)."""

    experts: str | tuple | None = (EP, TP)   # routed experts' leading [E] axis: over 'ep' and 'tp' alike
    # (tensor-parallel attention leaves every row on every tp rank, as expert parallelism over replicated
    # rows wants: tp = 8 holds 1/8 of the experts per GPU, SGLang's TP attention + EP MoE)
    heads: str | None = "tp"         # attention heads (q_b / kv_b outputs, o_proj input)
    index_heads: str | None = "tp"   # the indexer's heads (wq_b output, weights_proj output)
    mlp: str | None = "tp"           # dense and shared-expert MLP intermediate
    vocab: str | None = "tp"         # embedding rows, lm_head columns
    kv_slots: str | None = "cp"      # the KV pool's token-slot axis: each page lives on one rank
    batch_rows: str | None = "cp"    # a CP step's token rows: rank r holds its lanes of every request
    layers: str | None = None        # stacked layer / repeat axes are never split

    def spec(self, *logical: str | None, mesh: Mesh | None = None) -> P:
        """PartitionSpec of an array whose dimensions have these logical names (None: unnamed, replicated).
        With a mesh, axes the mesh lacks are dropped (replicated)."""
        def mesh_axis(name):
            return kept_axes(getattr(self, name) if name is not None else None,
                             lambda a: mesh is None or a in mesh.axis_names)
        return P(*(mesh_axis(n) for n in logical))

    def sharding(self, mesh: Mesh, *logical: str | None, memory_kind: str | None = None) -> NamedSharding:
        return NamedSharding(mesh, self.spec(*logical, mesh=mesh), memory_kind=memory_kind)


RULES = ShardingRules()


# module -> the logical axes of a 2-D linear's kernel [in, out] (reversed for a kept-fp8 linear's
# fp8_weight [out, in] and its block scales [out/128, in/128]): column-parallel where the output splits
# by heads (or intermediate, or vocabulary), row-parallel where the input does. The low-rank down projections (q_a, kv_a), the indexer's wk, the
# router and MTP's eh_proj stay replicated: they are small, and splitting them would add a collective.
LINEAR_AXES = {
    "q_b_proj": (None, "heads"), "kv_b_proj": (None, "heads"), "o_proj": ("heads", None),
    "wq_b": (None, "index_heads"), "weights_proj": (None, "index_heads"),
    "gate_proj": (None, "mlp"), "up_proj": (None, "mlp"), "down_proj": ("mlp", None),
    "lm_head": (None, "vocab"), "head": (None, "vocab"),
}


def param_logical_axes(path: tuple, ndim: int) -> tuple[str | None, ...]:
    """Logical axes of a parameter, by its path in the unstacked (per-layer) tree: routed-expert
    tensors are [experts, ...] in either layout (plain [E, K, N], fp8 K-major [E, N, K] and its block
    scales [E, N/128, K/128]: pallas_kernels/moe/layout.py), split on E only; the linears of
    LINEAR_AXES split by heads, intermediate or vocabulary (a kernel [in, out], a kept-fp8 weight
    [out, in] and its scales alike); the embeddings by vocabulary rows; everything else (norms, biases,
    small projections) is replicated. Stacked group leaves get a leading `layers` axis
    (models/weights.py:_stacked_sharding)."""
    if path and path[-1] in EXPERT_LEAVES:
        return ("experts",) + (None,) * (ndim - 1)
    if path and path[-1] == "embed_tokens" and ndim == 2:
        return ("vocab", None)
    if len(path) >= 2 and path[-2] in LINEAR_AXES and ndim == 2:
        if path[-1] == "kernel":
            return LINEAR_AXES[path[-2]]
        if path[-1] in ("fp8_weight", "scale_inv"):
            return LINEAR_AXES[path[-2]][::-1]
    return (None,) * ndim


def param_sharding(path: tuple, ndim: int, mesh: Mesh, rules: ShardingRules = RULES) -> NamedSharding:
    return rules.sharding(mesh, *param_logical_axes(path, ndim))


def state_specs(state, mesh: Mesh, rules: ShardingRules = RULES):
    """The PartitionSpec of every leaf of a model's nnx.State (same tree): the table's axes by path;
    stacked group leaves with a leading `layers` axis."""
    def spec(path, x):
        keys = tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))
        stacked = keys[0] == "groups"
        logical = (("layers",) if stacked else ()) + param_logical_axes(keys, x.ndim - stacked)
        return rules.spec(*logical, mesh=mesh)
    return jax.tree_util.tree_map_with_path(spec, state)


def place_state(state, mesh: Mesh, rules: ShardingRules = RULES):
    """The state's arrays on the mesh, each leaf placed by state_specs."""
    return jax.device_put(state, jax.tree.map(lambda s: NamedSharding(mesh, s), state_specs(state, mesh, rules)))


@dataclasses.dataclass(frozen=True)
class MeshAxes:
    """The mesh axes a forward runs split over inside its shard_map (None: not split); static, like
    KVAccess. experts: the routed experts (models.moe.expert_parallel_mlp; an axis or a tuple of axes,
    e.g. ('ep', 'tp'), whose collectives run over their product); tp: attention heads, the
    indexer's heads, the MLP intermediate and the vocabulary (the table's heads / index_heads / mlp /
    vocab axes, which must be one axis). The collectives of tensor parallelism live here.
    ep_dispatch: how the routed experts meet their rows: 'psum' (every rank holds every row, as after
    tensor-parallel attention: each adds its experts' share, one psum) or 'all_to_all' (each rank
    holds its own rows, as after data-parallel attention: rows go to their experts' ranks and back).
    ep_rows_split: with 'all_to_all', whether the rows arrive split over the experts axis (each rank its
    own, data-parallel attention); False (the engine: attention's output is replicated over 'ep'):
    each rank takes its own 1/ep of the rows, dispatches them, and the combined rows are all-gathered
    back over 'ep' (models.moe.over_own_rows)."""

    experts: str | tuple | None = None
    tp: str | None = None
    ep_dispatch: str = "psum"
    ep_rows_split: bool = False

    def __post_init__(self):
        if self.ep_dispatch not in EP_DISPATCH:
            raise ValueError(f"ep_dispatch must be one of {EP_DISPATCH}, got {self.ep_dispatch!r}")

    @classmethod
    def of(cls, mesh: Mesh | None, rules: ShardingRules = RULES, ep_dispatch: str = "psum") -> "MeshAxes":
        """The axes of a forward under shard_map over `mesh` (rows replicated over the experts axes)."""
        def split(axis):
            return kept_axes(axis, lambda a: mesh is not None and a in mesh.axis_names and mesh.shape[a] > 1)
        tp = {split(a) for a in (rules.heads, rules.index_heads, rules.mlp, rules.vocab)}
        if len(tp) > 1:
            raise ValueError(f"heads, index_heads, mlp and vocab must split over one mesh axis, got {tp}")
        return cls(split(rules.experts), tp.pop(), ep_dispatch)

    def psum_tp(self, x):
        """The sum of a row-parallel product's per-rank partials (o_proj, MLP down, embedding rows)."""
        return x if self.tp is None else jax.lax.psum(x, self.tp)

    def gather_vocab(self, logits):
        """Every rank's vocabulary slice of the logits, in order, on every rank."""
        return logits if self.tp is None else jax.lax.all_gather(logits, self.tp, axis=-1, tiled=True)

    def embed(self, table, tokens):
        """Rows of a vocabulary-parallel embedding table: each rank looks up the ids in its slice, zero
        elsewhere, and the ranks' rows are added."""
        if self.tp is None:
            return jnp.take(table, tokens, axis=0)
        local = tokens - jax.lax.axis_index(self.tp) * table.shape[0]
        mine = (local >= 0) & (local < table.shape[0])
        rows = jnp.take(table, jnp.where(mine, local, 0), axis=0)
        return jax.lax.psum(jnp.where(mine[..., None], rows, jnp.zeros((), rows.dtype)), self.tp)


NO_AXES = MeshAxes()
