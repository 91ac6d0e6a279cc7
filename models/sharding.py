"""Where every array lives on a mesh, decided by one table (as jax-llm-examples' ShardingRules): arrays
name their axes logically (`experts`, `kv_slots`, `batch_rows`, ...) and `ShardingRules` maps each
logical axis to a mesh axis. Parameters, the device KV pool, the host KV pool and a CP step's batch
rows all take their placement from it; a mesh without the named axis replicates that dimension."""

from __future__ import annotations

import dataclasses

from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

EXPERT_LEAVES = ("experts_gate", "experts_up", "experts_down",
                 "experts_gate_scale_inv", "experts_up_scale_inv", "experts_down_scale_inv")
KV_LEAF_AXES = ("layers", "kv_slots")   # every KV pool leaf (device and host) is [layers, slots, ...]


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Logical axis -> mesh axis (None: replicated)."""

    experts: str | None = "ep"       # routed experts' leading [E] axis
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
            axis = getattr(self, name) if name is not None else None
            return None if axis is None or (mesh is not None and axis not in mesh.axis_names) else axis
        return P(*(mesh_axis(n) for n in logical))

    def sharding(self, mesh: Mesh, *logical: str | None, memory_kind: str | None = None) -> NamedSharding:
        return NamedSharding(mesh, self.spec(*logical, mesh=mesh), memory_kind=memory_kind)


RULES = ShardingRules()


# (module, leaf) -> the logical axes of a 2-D linear's kernel [in, out] and of its fp8 block scales
# [in/128, out/128]: column-parallel where the output splits by heads (or intermediate, or vocabulary),
# row-parallel where the input does. The low-rank down projections (q_a, kv_a), the indexer's wk, the
# router and MTP's eh_proj stay replicated: they are small, and splitting them would add a collective.
LINEAR_AXES = {
    "q_b_proj": (None, "heads"), "kv_b_proj": (None, "heads"), "o_proj": ("heads", None),
    "wq_b": (None, "index_heads"), "weights_proj": (None, "index_heads"),
    "gate_proj": (None, "mlp"), "up_proj": (None, "mlp"), "down_proj": ("mlp", None),
    "lm_head": (None, "vocab"), "head": (None, "vocab"),
}


def param_logical_axes(path: tuple, ndim: int) -> tuple[str | None, ...]:
    """Logical axes of a parameter, by its path in the unstacked (per-layer) tree: routed-expert
    tensors are [experts, ...]; the linears of LINEAR_AXES split by heads, intermediate or vocabulary;
    the embeddings by vocabulary rows; everything else (norms, biases, small projections) is
    replicated. Stacked group leaves get a leading `layers` axis (models/weights.py:_stacked_sharding)."""
    if path and path[-1] in EXPERT_LEAVES:
        return ("experts",) + (None,) * (ndim - 1)
    if path and path[-1] == "embed_tokens" and ndim == 2:
        return ("vocab", None)
    if len(path) >= 2 and path[-1] in ("kernel", "scale_inv") and path[-2] in LINEAR_AXES and ndim == 2:
        return LINEAR_AXES[path[-2]]
    return (None,) * ndim


def param_sharding(path: tuple, ndim: int, mesh: Mesh, rules: ShardingRules = RULES) -> NamedSharding:
    return rules.sharding(mesh, *param_logical_axes(path, ndim))
