"""fp8 for the grouped matmul: activations quantized to e4m3 with one fp32 scale per row per 128
columns (DeepSeek-V3's per-token-per-128 scheme; the largest magnitude of each group maps to 448), and
block-scaled weights dequantized where the kernel does not run."""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.indexer.quant import FP8_MAX

GROUP = 128   # the scale block of DeepSeek/GLM fp8 checkpoints, and of the activations' scales


def quantize_rows(x):
    """x [P, K] (K a multiple of 128) -> (values [P, K] float8_e4m3fn, scales [K / 128, P] fp32), the
    scales laid out per column group so the kernel reads one group's row scales as one TMA block."""
    P, K = x.shape
    if K % GROUP:
        raise ValueError(f"quantize_rows: {K} columns are not a multiple of {GROUP}")
    g = x.astype(jnp.float32).reshape(P, K // GROUP, GROUP)
    amax = jnp.max(jnp.abs(g), axis=-1)                                   # [P, K / 128]
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    q = (g / scale[..., None]).reshape(P, K).astype(jnp.float8_e4m3fn)
    return q, scale.T


def dequantize_rows(q, scale):
    """The inverse of quantize_rows (up to the e4m3 rounding), in fp32."""
    P, K = q.shape
    return (q.astype(jnp.float32).reshape(P, K // GROUP, GROUP) * scale.T[..., None]).reshape(P, K)


def dequantize_blocks(w, scale_inv, dtype):
    """Block-scaled weights w [..., r, c] e4m3 with scale_inv [..., r / 128, c / 128] -> dtype (the
    product in fp32, as the checkpoints define it)."""
    r, c = w.shape[-2:]
    full = jnp.repeat(jnp.repeat(scale_inv, GROUP, axis=-2), GROUP, axis=-1)[..., :r, :c]
    return (w.astype(jnp.float32) * full).astype(dtype)
