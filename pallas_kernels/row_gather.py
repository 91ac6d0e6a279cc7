"""Row gather with zero-fill — the data movement of MoE compaction/restore and of the expert-sorted
row order — as a Pallas kernel beside its jnp reference.

    out[i] = x[idx[i]]  (idx[i] >= 0)      out[i] = 0  (idx[i] < 0)

Compaction (valid rows first), its inverse (back to the padded layout, dummies zero) and the
expert-grouped order are all this gather with a different index vector, computed by an integer
scan (`compaction_plan`) and a stable sort (`expert_order`). The kernel uses Pallas's Triton
backend: a row gather is pointer arithmetic per row, which Triton expresses directly (a vector of
row offsets, one 2-D load per block); Mosaic GPU's strength (TMA, wgmma pipelines) is for dense
tiles, not data-dependent rows. Grid: (row groups, column blocks); each program copies `steps`
blocks of block_rows rows x block_cols columns in a loop that Triton pipelines.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.policy import DEFAULT_POLICY, KernelPolicy


def check_gather_args(x, idx):
    if x.ndim != 2 or idx.ndim != 1 or not jnp.issubdtype(idx.dtype, jnp.integer):
        raise ValueError(f"gather_rows takes rows x [N, D] and integer indices idx [M], got x {tuple(x.shape)}, "
                         f"idx {tuple(idx.shape)} {idx.dtype}")


def gather_rows_reference(x, idx):
    check_gather_args(x, idx)
    return jnp.where((idx >= 0)[:, None], x[jnp.maximum(idx, 0)], jnp.zeros((), x.dtype))


def _load_rows(x_ref, idx, cols):
    """Rows idx of x_ref at columns cols, zeros where idx < 0 (row 0 is read there, then masked)."""
    got = x_ref[jnp.maximum(idx, 0)[:, None], cols[None, :]]
    return jnp.where((idx >= 0)[:, None], got, jnp.zeros_like(got))


def _kernel_takes(width: int, policy: KernelPolicy) -> bool:
    """Whether the Triton kernels take rows of this width: on GPU with policy.enabled, the width
    tiling into power-of-two column blocks of up to 512 (Triton blocks must have a power-of-two size:
    other widths, hidden 80 or 96, take the reference)."""
    cols = min(512, width)
    return policy.on_gpu() and width % cols == 0 and cols & (cols - 1) == 0


def _gather_rows_kernel(idx_ref, x_ref, o_ref, *, block_rows: int, block_cols: int, steps: int):
    cols = pl.program_id(1) * block_cols + jnp.arange(block_cols)

    def step(i, _):
        rows = pl.ds(pl.multiple_of(i * block_rows, block_rows), block_rows)
        o_ref[rows, :] = _load_rows(x_ref, idx_ref[rows], cols)
        return 0

    jax.lax.fori_loop(0, steps, step, 0)


def gather_rows_pallas(x, idx, *, block_rows: int = 32, block_cols: int = 512, steps: int = 1,
                       num_stages: int | None = None, interpret: bool = False):
    """steps: row blocks each program copies in a loop (Triton pipelines the loop's loads)."""
    check_gather_args(x, idx)
    N, D = x.shape
    M = idx.shape[0]
    block_cols = min(block_cols, D)
    if D % block_cols:
        raise ValueError(f"row width {D} is not a multiple of the column block {block_cols}")
    rows = block_rows * steps
    pad = -M % rows
    idx_p = jnp.pad(idx.astype(jnp.int32), (0, pad), constant_values=-1)
    params = {} if num_stages is None else {"compiler_params": plt.CompilerParams(num_stages=num_stages)}
    out = pl.pallas_call(
        functools.partial(_gather_rows_kernel, block_rows=block_rows, block_cols=block_cols, steps=steps),
        grid=((M + pad) // rows, D // block_cols),
        in_specs=[pl.BlockSpec((rows,), lambda i, j: (i,)), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec((rows, block_cols), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((M + pad, D), x.dtype),
        interpret=interpret,
        **params,
    )(idx_p, x)
    return out[:M]


@jax.named_call     # profiles name the ops inside by this scope
def gather_rows(x, idx, *, policy: KernelPolicy = DEFAULT_POLICY):
    """The dispatch: the Pallas kernel on GPU with policy.enabled (rows a multiple of its column
    block), the jnp reference elsewhere. Tilings measured on the H200 (docs/perf.md, rows x 6144
    bf16): 32 x 512 per program up to 16k rows; from 64k rows, 8 pipelined blocks of 16 x 1024 (442
    against 485 us at 64k rows; no better at 16k)."""
    check_gather_args(x, idx)
    if _kernel_takes(x.shape[1], policy):
        if idx.shape[0] >= 65536 and x.shape[1] % 1024 == 0:
            return gather_rows_pallas(x, idx, block_rows=16, block_cols=1024, steps=8, num_stages=3)
        return gather_rows_pallas(x, idx)
    return gather_rows_reference(x, idx)


def check_combine_args(y, idx, w):
    if y.ndim != 2 or idx.ndim != 2 or w.shape != idx.shape or not jnp.issubdtype(idx.dtype, jnp.integer):
        raise ValueError(f"combine_rows takes rows y [M, D], integer indices idx [N, k] and weights w [N, k], "
                         f"got y {tuple(y.shape)}, idx {tuple(idx.shape)} {idx.dtype}, w {tuple(w.shape)}")


def combine_rows_reference(y, idx, w):
    """fp32 [N, D]: sum_j y[idx[:, j]] * w[:, j] over each row's k slots in fp32 (y widened, w as
    given, fp32), added in slot order j = 0, 1, ... one at a time; idx < 0 adds nothing. HF's MoE
    weighs its bf16 expert outputs by fp32 weights into an fp32 sum the same way. The kernel adds the
    same terms in the same order; compilers may fuse a product into its sum (FMA), so the two agree
    to a few fp32 roundings, not bit for bit."""
    check_combine_args(y, idx, w)
    w = w.astype(jnp.float32)
    total = None
    for j in range(idx.shape[1]):
        term = gather_rows_reference(y, idx[:, j]).astype(jnp.float32) * w[:, j, None]
        total = term if total is None else total + term
    return total


def _combine_rows_kernel(idx_ref, w_ref, y_ref, o_ref, *, k: int, block_cols: int):
    cols = pl.program_id(1) * block_cols + jnp.arange(block_cols)
    total = None
    for j in range(k):
        term = _load_rows(y_ref, idx_ref[j, :], cols).astype(jnp.float32) * w_ref[j, :][:, None]
        total = term if total is None else total + term
    o_ref[...] = total


def combine_rows_pallas(y, idx, w, *, block_rows: int = 16, block_cols: int = 512, num_warps: int | None = None,
                        interpret: bool = False):
    """combine_rows_reference as one Triton kernel: each program reads its rows' k slot rows of one
    column block and writes their weighted sum, so the [N * k, D] slot rows are never written out."""
    check_combine_args(y, idx, w)
    D = y.shape[1]
    N, k = idx.shape
    block_cols = min(block_cols, D)
    if D % block_cols:
        raise ValueError(f"row width {D} is not a multiple of the column block {block_cols}")
    pad = -N % block_rows
    idx_t = jnp.pad(idx.astype(jnp.int32).T, ((0, 0), (0, pad)), constant_values=-1)
    w_t = jnp.pad(w.astype(jnp.float32).T, ((0, 0), (0, pad)))
    params = {} if num_warps is None else {"compiler_params": plt.CompilerParams(num_warps=num_warps)}
    out = pl.pallas_call(
        functools.partial(_combine_rows_kernel, k=k, block_cols=block_cols),
        grid=((N + pad) // block_rows, D // block_cols),
        in_specs=[pl.BlockSpec((k, block_rows), lambda i, j: (0, i)), pl.BlockSpec((k, block_rows), lambda i, j: (0, i)),
                  pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec((block_rows, block_cols), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((N + pad, D), jnp.float32),
        interpret=interpret,
        **params,
    )(idx_t, w_t, y)
    return out[:N]


@jax.named_call
def combine_rows(y, idx, w, *, policy: KernelPolicy = DEFAULT_POLICY):
    """The dispatch of combine_rows_reference (the MoE's weighted sum of each row's expert outputs,
    read straight from the grouped matmul's padded rows): the Pallas kernel on GPU with
    policy.enabled where the row width tiles into power-of-two column blocks, else the reference."""
    check_combine_args(y, idx, w)
    if _kernel_takes(y.shape[1], policy):
        return combine_rows_pallas(y, idx, w)
    return combine_rows_reference(y, idx, w)


def compaction_plan(valid):
    """(perm, dest, n_valid): perm[j] = source row of compacted row j (valid rows first, in order; -1
    past n_valid), dest[i] = compacted position of padded row i (-1 for dummy rows)."""
    valid = valid.astype(bool)
    n_valid = valid.sum().astype(jnp.int32)
    rank = jnp.cumsum(valid) - 1
    dest = jnp.where(valid, rank, -1).astype(jnp.int32)
    perm = jnp.full(valid.shape, -1, jnp.int32).at[jnp.where(valid, rank, valid.shape[0])].set(
        jnp.arange(valid.shape[0], dtype=jnp.int32), mode="drop")
    return perm, dest, n_valid


def expert_order(expert_ids, num_experts: int):
    """Rows grouped by expert (stable within an expert) for a grouped matmul: (order, group sizes).
    Ids outside [0, num_experts) (dummies) go last and count in no group. A stable sort and a binary
    search of the group bounds: no [rows, experts] one-hot and no cumulative sum along its long axis
    (GLM-5: 8 rows per token x 257 ids), and no atomics on a few shared counters. The search is
    unrolled: jnp's default is a while loop, which the GPU host launches once per iteration."""
    e = jnp.where((expert_ids >= 0) & (expert_ids < num_experts), expert_ids, num_experts)
    order = jnp.argsort(e, stable=True).astype(jnp.int32)
    bounds = jnp.searchsorted(e[order], jnp.arange(num_experts + 1, dtype=e.dtype), side="left",
                              method="scan_unrolled")
    return order, jnp.diff(bounds).astype(jnp.int32)
