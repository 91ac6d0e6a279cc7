"""How the routed experts' weights are laid out, in one place: the model creates and converts them so
(models/moe.py, models/weights.py) and the dispatch reads them so (pallas_kernels/moe/dispatch.py).

For a projection of input width K and output width N (gate / up: K = hidden D, N = expert width I;
down: K = I, N = D):

    plain experts (bf16 / fp32)   [*stack, E, K, N]                      x @ w: lax.ragged_dot's and the
                                                                         bf16 kernel's layout
    fp8 experts (e4m3, kept)      [*stack, E, N, K] ("K-major"), block   HF's own per-expert Linear
                                  scales [*stack, E, N/128, K/128]       [out, in], and the only B
                                                                         layout Hopper's 8-bit wgmma takes

so fp8 gate / up are [E, I, D] and fp8 down [E, D, I]: the fp8 kernel reads them as stored (no per-call
transpose) and conversion copies the checkpoint's bytes as they are. Every other consumer of fp8
experts dequantizes them to the plain layout with `fp8_experts_as_plain` (one layer's transient).
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.moe.fp8_rows import GROUP, dequantize_blocks

FP8_EXPERT_DTYPE = jnp.float8_e4m3fn


def expert_shape(E: int, K: int, N: int, *, fp8: bool) -> tuple[int, int, int]:
    """The stored shape of one projection's experts (input width K, output width N): fp8 K-major
    [E, N, K], plain [E, K, N]."""
    return (E, N, K) if fp8 else (E, K, N)


def expert_scale_shape(E: int, K: int, N: int) -> tuple[int, int, int]:
    """The block scales of fp8 experts [E, N, K]: [E, N / 128, K / 128] (rounded up)."""
    return (E, -(-N // GROUP), -(-K // GROUP))


def fp8_experts_as_plain(w, scale_inv, dtype):
    """fp8 experts [..., E, N, K] e4m3 with block scales [..., E, N/128, K/128] -> the plain layout
    [..., E, K, N] in dtype (dequantized in fp32, then transposed: one transient)."""
    if jnp.dtype(w.dtype) != jnp.dtype(FP8_EXPERT_DTYPE):
        raise ValueError(f"fp8_experts_as_plain: experts are {w.dtype}, not {jnp.dtype(FP8_EXPERT_DTYPE).name}")
    return jnp.swapaxes(dequantize_blocks(w, scale_inv, dtype), -1, -2)


def check_experts(D: int, gate, up, down, scales=None) -> tuple[int, int]:
    """(E, I) of one layer's routed experts for rows of width D, after checking their layout: plain
    (scales None) gate / up [E, D, I] and down [E, I, D]; fp8 (scales = their (gate, up, down) block
    scales) gate / up [E, I, D] and down [E, D, I] e4m3, scales [E, N/128, K/128]. ValueError naming
    the layout otherwise (fp8 experts given as [E, K, N] fail here wherever D != I)."""
    fp8 = scales is not None
    if gate.ndim != 3:
        raise ValueError(f"routed experts must be [E, ., .] (one layer), got gate {gate.shape}")
    E = gate.shape[0]
    I = gate.shape[1] if fp8 else gate.shape[2]
    want = {"gate": expert_shape(E, D, I, fp8=fp8), "up": expert_shape(E, D, I, fp8=fp8),
            "down": expert_shape(E, I, D, fp8=fp8)}
    got = {"gate": gate, "up": up, "down": down}
    layout = ("fp8 experts are K-major [E, N, K] (gate / up [E, I, D], down [E, D, I])" if fp8 else
              "plain experts are [E, K, N] (gate / up [E, D, I], down [E, I, D])")
    for name, w in got.items():
        if tuple(w.shape) != want[name]:
            raise ValueError(f"{layout}; rows have D = {D}: {name} {tuple(w.shape)} should be {want[name]}")
        if fp8 != (jnp.dtype(w.dtype) == jnp.dtype(FP8_EXPERT_DTYPE)):
            raise ValueError(f"{name} is {w.dtype}: scales are given exactly for "
                             f"{jnp.dtype(FP8_EXPERT_DTYPE).name} experts")
    if fp8:
        if len(scales) != 3:
            raise ValueError(f"scales must be (gate, up, down) block scales, got {len(scales)}")
        for name, s, (K, N) in zip(got, scales, ((D, I), (D, I), (I, D))):
            if tuple(s.shape) != expert_scale_shape(E, K, N):
                raise ValueError(f"{layout}; {name}'s block scales {tuple(s.shape)} should be "
                                 f"{expert_scale_shape(E, K, N)} ([E, N/128, K/128])")
    return E, I
