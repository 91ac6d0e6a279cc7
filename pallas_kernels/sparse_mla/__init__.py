"""Sparse MLA attention: each query's heads over its top-k selected latent rows, read from the paged
pool; the Triton-backend kernel, its jnp reference, and the dispatch."""

from pallas_kernels.sparse_mla.kernel import Tiling, sparse_mla_pallas
from pallas_kernels.sparse_mla.reference import sparse_mla_reference
from pallas_kernels.sparse_mla.dispatch import kernel_applies, kernel_shape_error, sparse_mla

__all__ = ["Tiling", "sparse_mla_pallas", "sparse_mla_reference", "kernel_applies", "kernel_shape_error", "sparse_mla"]
