"""Dense fp8 x fp8 linears (the attention projections, shared experts, dense MLP and MTP's eh_proj of an
fp8 DeepSeek-V3.2 / GLM-5 checkpoint) as the routed experts' grouped matmul kernel with one expert:

    y = x @ W^T,   W [N, K] e4m3 with one fp32 scale per 128 x 128 block (a Linear's [out, in], as the
                   checkpoints store it: K-major, the B layout Hopper's 8-bit wgmma reads)

The rows are quantized to e4m3 per row per 128 columns (DeepGEMM's scheme, quantize_rows) and padded
to whole row tiles; every tile belongs to expert 0. The products run fp8 x fp8 on the tensor cores
with fp32 sums and both scales applied per 128-deep step, x's dtype out.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from pallas_kernels.moe.fp8_rows import GROUP, dequantize_blocks, dequantize_rows, quantize_rows
from pallas_kernels.moe.grouped_matmul import WIDE_TILE, Tiling, chained, grouped_matmul
from pallas_kernels.moe.grouped_matmul import with_step_blocks
from pallas_kernels.moe.grouped_matmul import shape_error as grouped_shape_error
from pallas_kernels.policy import KernelPolicy


GLM5_LINEARS = {   # (K, N) of GLM-5's kept-fp8 dense linears: the widths the tests and bench_kernels take
    "q_a_proj": (6144, 2048), "q_b_proj": (2048, 64 * 256), "kv_a_proj_with_mqa": (6144, 576),
    "o_proj": (64 * 256, 6144), "indexer.wq_b": (2048, 32 * 128), "indexer.wk": (6144, 128),
    "shared_experts.gate_proj": (6144, 2048), "shared_experts.down_proj": (2048, 6144),
    "mlp.gate_proj": (6144, 12288), "mlp.down_proj": (12288, 6144), "eh_proj": (12288, 6144),
}


def decode_k_splits(tiles: int, k_steps: int, programs: int = 132) -> int:
    """The most K splits (a divisor of k_steps, two steps each at least) that keep tiles x splits
    within one wave of the kernel's programs; 1 where the output tiles fill the wave already."""
    return max((s for s in range(1, k_steps // 2 + 1) if k_steps % s == 0 and tiles * s <= programs), default=1)


def linear_tiling(rows: int, N: int, K: int = GROUP, *, split_k: bool = False, wide: bool = False) -> Tiling:
    """The kernel's tiling for `rows` rows, K inputs and N outputs: 128-row tiles split over two
    compute warpgroups (as the routed experts' prefill tiling), 64-row tiles for decode-sized calls;
    64-wide column blocks where N is not a multiple of 128 (kv_a_proj_with_mqa: 512 + 64). split_k
    (KernelPolicy.fp8_linear_split_k): a decode-sized call's output tiles split K over programs up to
    one wave (decode_k_splits: q_a_proj's 16 tiles run as 128 programs of 6 K steps each). wide
    (KernelPolicy.fp8_wide_tiles): 128-row calls whose N is a multiple of 384 (128 and WIDE_TILE: o_proj,
    the dense MLP's projections, the shared experts' down_proj, eh_proj) take WIDE_TILE-column tiles,
    chained where their K steps allow (fp8_linear)."""
    block_n = 128 if N % 128 == 0 else 64
    if rows > 64 and wide and N % (2 * WIDE_TILE) == 0:
        return Tiling(block_m=128, block_n=WIDE_TILE, block_k=GROUP, stages=4, compute_wgs=2, grid_block_n=16)
    if rows > 64:
        return Tiling(block_m=128, block_n=block_n, block_k=GROUP, stages=4, compute_wgs=2, grid_block_n=16)
    if block_n == 128:
        t = Tiling(block_m=64, block_n=128, block_k=GROUP, stages=4, compute_wgs=2, grid_block_n=1)
    else:
        t = Tiling(block_m=64, block_n=64, block_k=GROUP, stages=4, grid_block_n=1)
    if split_k:
        t = dataclasses.replace(t, k_splits=decode_k_splits(N // block_n, K // GROUP, t.programs))
    return t


def _tile_rows(rows: int, tiling: Tiling) -> int:
    """Rows padded to whole row tiles (one expert: no per-expert padding, unlike moe.plan.padded_rows)."""
    return -(-rows // tiling.block_m) * tiling.block_m


def shape_error(x, w, scale_inv, tiling: Tiling | None = None) -> str | None:
    """Why fp8_linear cannot take these operands (None: it can): x [..., K], w [N, K] e4m3, scale_inv
    [ceil(N / 128), K / 128] fp32."""
    if w.ndim != 2 or x.shape[-1] != w.shape[1]:
        return f"x [..., {x.shape[-1]}] and w {tuple(w.shape)} are not [..., K] and [N, K]"
    N, K = w.shape
    rows = math.prod(x.shape[:-1])
    if rows == 0:
        return "no rows"
    want = (-(-N // GROUP), -(-K // GROUP))
    if tuple(scale_inv.shape) != want or scale_inv.dtype != jnp.float32:
        return f"scale_inv must be fp32 {want}, got {tuple(scale_inv.shape)} {scale_inv.dtype}"
    if K % GROUP:
        return f"K {K} is not a multiple of {GROUP} (the activations' scale groups)"
    t = tiling or linear_tiling(rows, N, K)
    return grouped_shape_error(jax.ShapeDtypeStruct((_tile_rows(rows, t), K), jnp.float8_e4m3fn),
                               jax.ShapeDtypeStruct((1, N, K), w.dtype), t, fp8=True)


def fp8_linear_applies(x, w, scale_inv, policy: KernelPolicy) -> bool:
    """Whether a kept-fp8 linear runs fp8_linear (else it is dequantized at use): on the GPU, with
    policy.fp8_linear_kernel, where its shapes fit."""
    return policy.on_gpu() and policy.fp8_linear_kernel and shape_error(x, w, scale_inv) is None


def fp8_linear_reference(x, w, scale_inv):
    """fp8_linear's arithmetic in XLA: the rows quantized and dequantized as the kernel quantizes them,
    times the dequantized weight, in fp32; x's dtype out."""
    *lead, K = x.shape
    rows = dequantize_rows(*quantize_rows(x.reshape(-1, K)))
    y = jnp.dot(rows, dequantize_blocks(w, scale_inv, jnp.float32).T, precision=jax.lax.Precision.HIGHEST)
    return y.astype(x.dtype).reshape(*lead, w.shape[0])


@jax.named_call     # profiles name the ops inside by this scope
def fp8_linear(x, w, scale_inv, *, tiling: Tiling | None = None, split_k: bool = False, chain: bool = False,
               step_blocks: int = 1, wide: bool = False, interpret=False):
    """x [..., K] @ W^T -> [..., N] in x's dtype, for W = w * scale_inv's blocks (w [N, K] e4m3,
    scale_inv [ceil(N / 128), K / 128] fp32), fp8 x fp8 with the rows quantized per 128 columns.
    split_k: the default tiling splits a decode-sized call's K (linear_tiling; KernelPolicy.fp8_linear_split_k);
    chain: the default tiling `chained` where it fits (KernelPolicy.chained_tiles); step_blocks: the
    default tiling with Tiling.step_blocks where it takes them (KernelPolicy.fp8_step_blocks);
    wide: the default tiling's prefill calls in WIDE_TILE-column tiles where N takes them, chained
    (KernelPolicy.fp8_wide_tiles)."""
    err = shape_error(x, w, scale_inv, tiling)
    if err is not None:
        raise ValueError(f"fp8_linear: {err}")
    *lead, K = x.shape
    N = w.shape[0]
    rows = x.reshape(-1, K)
    t = tiling or linear_tiling(rows.shape[0], N, K, split_k=split_k, wide=wide)   # splits divide K's steps: fits too
    if tiling is None:
        t = with_step_blocks(t, K, step_blocks)
    if (chain or t.block_n == WIDE_TILE) and tiling is None:
        t = chained(t, K)
    P = _tile_rows(rows.shape[0], t)
    xq, xs = quantize_rows(jnp.pad(rows, ((0, P - rows.shape[0]), (0, 0))))   # padding: zeros at scale 1
    y = grouped_matmul(xq, w[None], jnp.zeros(P // t.block_m, jnp.int32), tiling=t, interpret=interpret,
                       x_scale=xs, w_scale=scale_inv[None], out_dtype=x.dtype)
    return y[:rows.shape[0]].reshape(*lead, N)
