"""Small building blocks: parameters with an optional leading layer-stack axis, linear layers, norms,
rope. Every Param may carry a leading `stack` shape so a group of identical layers is one module whose
arrays are scanned over (models/model.py)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import RopeConfig, yarn_mscale
from models.fp8 import dequantize, scale_shape
from pallas_kernels.fp8_linear import fp8_linear, fp8_linear_applies
from pallas_kernels.policy import DEFAULT_POLICY, KernelPolicy


def normal_param(rngs: nnx.Rngs, shape, dtype, std: float) -> nnx.Param:
    """Random weights drawn in their own dtype when it is narrower than fp32: a GLM-5 slice's stacked
    expert tensor drawn in fp32 first would need 36 GiB of transients per projection."""
    size = jnp.dtype(dtype).itemsize
    draw = jnp.float32 if size >= 4 else dtype if size == 2 else jnp.bfloat16
    return nnx.Param((jax.random.normal(rngs.params(), shape, draw) * jnp.asarray(std, draw)).astype(dtype))


def const_param(shape, dtype, value: float) -> nnx.Param:
    return nnx.Param(jnp.full(shape, value, dtype))


class Dense(nnx.Module):
    """y = x @ W for a Linear whose HF weight is [out, in]. Plain: `kernel` [*stack, in, out] (that
    weight transposed). Kept fp8: `fp8_weight` [*stack, out, in] e4m3, the checkpoint's own layout
    (K-major, what Hopper's 8-bit wgmma reads), with `scale_inv` [*stack, out/128, in/128] block scales
    (models/fp8.py): fp8 x fp8 on the GPU (pallas_kernels/fp8_linear.py), dequantized elsewhere."""

    def __init__(self, din: int, dout: int, *, dtype, rngs: nnx.Rngs, stack=(), fp8: bool = False):
        shape = (*stack, dout, din) if fp8 else (*stack, din, dout)
        w, self.scale_inv = fp8_or_plain_param(rngs, shape, dtype, din ** -0.5, fp8)
        self.kernel, self.fp8_weight = (None, w) if fp8 else (w, None)

    def weight(self, dtype):
        """The weight [*stack, in, out] in dtype (kept fp8: dequantized and transposed)."""
        if self.fp8_weight is None:
            return self.kernel[...].astype(dtype)
        return jnp.swapaxes(dequantize(self.fp8_weight[...], self.scale_inv[...], dtype), -1, -2)

    def __call__(self, x, kernels: KernelPolicy = DEFAULT_POLICY):
        if self.fp8_weight is not None:
            w, scale = self.fp8_weight[...], self.scale_inv[...]
            if fp8_linear_applies(x, w, scale, kernels):
                return fp8_linear(x, w, scale, split_k=kernels.fp8_linear_split_k, chain=kernels.chained_tiles,
                                  step_blocks=kernels.fp8_step_blocks, wide=kernels.fp8_wide_tiles)
        return jnp.dot(x, self.weight(x.dtype))


def fp8_or_plain_param(rngs: nnx.Rngs, shape, dtype, std: float, fp8: bool):
    """(weight, block scales or None): random N(0, std) weights, as fp8 values N(0, 1) with every block
    scale std when fp8."""
    if not fp8:
        return normal_param(rngs, shape, dtype, std), None
    return normal_param(rngs, shape, jnp.float8_e4m3fn, 1.0), const_param(scale_shape(shape), jnp.float32, std)


class RMSNorm(nnx.Module):
    """HF semantics: normalize in fp32, cast back to the input dtype, then scale by the weight."""

    def __init__(self, dim: int, eps: float, *, dtype, stack=()):
        self.weight = const_param((*stack, dim), dtype, 1.0)
        self.eps = eps

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * x32.astype(x.dtype)


class LayerNorm(nnx.Module):
    """True LayerNorm with bias (the indexer's k_norm)."""

    def __init__(self, dim: int, eps: float, *, dtype, stack=()):
        self.weight = const_param((*stack, dim), dtype, 1.0)
        self.bias = const_param((*stack, dim), dtype, 0.0)
        self.eps = eps

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)


# ---- rope --------------------------------------------------------------------------------------

def rope_inv_freq(rope: RopeConfig, dim: int):
    """Inverse frequencies and the cos/sin attention factor, as HF computes them (default / yarn)."""
    exps = jnp.arange(0, dim, 2, dtype=jnp.float32) / dim
    pos_freqs = rope.theta ** exps
    if rope.type == "default":
        return 1.0 / pos_freqs, 1.0
    factor = rope.factor
    if rope.attention_factor is not None:
        attn_factor = float(rope.attention_factor)
    elif rope.mscale and rope.mscale_all_dim:
        attn_factor = yarn_mscale(factor, rope.mscale) / yarn_mscale(factor, rope.mscale_all_dim)
    else:
        attn_factor = yarn_mscale(factor)

    def correction_dim(rot):
        return (dim * math.log(rope.original_max_position_embeddings / (rot * 2 * math.pi))) / (
            2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, attn_factor


def rope_cos_sin(positions, rope: RopeConfig, dim: int, dtype):
    """cos/sin of shape [..., dim/2] for integer positions (negative = padding, treated as 0)."""
    inv_freq, attn_factor = rope_inv_freq(rope, dim)
    freqs = jnp.maximum(positions, 0).astype(jnp.float32)[..., None] * inv_freq
    return (jnp.cos(freqs) * attn_factor).astype(dtype), (jnp.sin(freqs) * attn_factor).astype(dtype)


def apply_rope_interleaved(x, cos, sin):
    """Rotate pairs (x0,x1),(x2,x3)...; returns the rotated pairs de-interleaved (as HF does; dot products
    between q and k rotated the same way are unchanged). cos/sin [..., dim/2] broadcast over heads."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def apply_rope_half(x, cos, sin):
    """rotate_half rope (DeepSeek-V3.2 indexer)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos2 = jnp.concatenate([cos, cos], axis=-1)
    sin2 = jnp.concatenate([sin, sin], axis=-1)
    return x * cos2 + jnp.concatenate([-x2, x1], axis=-1) * sin2
