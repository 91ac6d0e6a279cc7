"""Block-scaled fp8 weights, as DeepSeek-V3 / V3.2 and GLM-5 checkpoints store them: e4m3 values and one
fp32 `weight_scale_inv` per 128 x 128 block; the real weight is value * scale. Kept fp8 in memory (half
the bytes of bf16) and dequantized where a linear uses them."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from pallas_kernels.moe.fp8_rows import FP8_MAX, GROUP as BLOCK, dequantize_blocks

dequantize = dequantize_blocks   # one implementation: the MoE dispatch dequantizes with it too


def scale_shape(shape: tuple) -> tuple:
    """Block scales of a [..., rows, cols] weight."""
    *lead, r, c = shape
    return (*lead, -(-r // BLOCK), -(-c // BLOCK))


def quantize(w):
    """A weight [..., r, c] -> (fp8 values, fp32 block scales) with each block's largest magnitude at
    FP8_MAX (numpy; random models and tests)."""
    w = np.asarray(w, np.float32)
    *lead, r, c = w.shape
    R, C = -(-r // BLOCK) * BLOCK, -(-c // BLOCK) * BLOCK
    padded = np.zeros((*lead, R, C), np.float32)
    padded[..., :r, :c] = w
    blocks = padded.reshape(*lead, R // BLOCK, BLOCK, C // BLOCK, BLOCK)
    amax = np.abs(blocks).max(axis=(-3, -1))
    scale = np.where(amax > 0, amax / FP8_MAX, 1.0).astype(np.float32)
    q = (blocks / scale[..., :, None, :, None]).reshape(*lead, R, C)[..., :r, :c]
    return q.astype(jnp.float8_e4m3fn), scale
