"""Where each parameter lives on a mesh — decided here and nowhere else. Rules are written for the
unstacked (per-layer) shape; stacked group leaves get a leading unsharded repeat axis
(models/weights.py:_stacked_sharding)."""

from __future__ import annotations

from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

EXPERT_LEAVES = ("experts_gate", "experts_up", "experts_down")


def layer_partition_spec(path: tuple, ndim: int, mesh: Mesh) -> P:
    """Routed-expert tensors [E, ...] are split over the 'ep' axis when the mesh has one; every other
    parameter is replicated (the model is small next to the KV cache at the sizes CP serves)."""
    if path and path[-1] in EXPERT_LEAVES and "ep" in mesh.axis_names:
        return P("ep", *([None] * (ndim - 1)))
    return P(*([None] * ndim))


def param_sharding(path: tuple, ndim: int, mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, layer_partition_spec(path, ndim, mesh))
