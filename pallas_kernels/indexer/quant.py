"""The indexer keys' fp8 format (DeepSeek's indexer-K cache): e4m3 with one fp32 scale per token,
amax / 448. The pool stores keys so and the kernels read them so; fp8 queries use the same format
per (token, head)."""

from __future__ import annotations

import jax.numpy as jnp

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0


def quantize_index_k(k):
    """Per-token fp8 e4m3 quantization: scale = amax / 448 (DeepSeek's indexer-K cache format)."""
    k32 = k.astype(jnp.float32)
    scale = jnp.maximum(jnp.max(jnp.abs(k32), axis=-1), 1e-12) / FP8_MAX
    return (k32 / scale[..., None]).astype(FP8), scale


def dequantize_index_k(q, scale):
    return q.astype(jnp.float32) * scale[..., None]
