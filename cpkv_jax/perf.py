"""Counted FLOPs and HBM bytes of the model's math (what the algorithm needs, not what a padded batch
happens to execute), and ceilings measured on the running device, for MFU and bandwidth utilisation
in benchmarks. Attention is counted as the absorbed sparse path: k = min(index_topk, visible) keys per
query, plus the indexer's scoring of every visible key on full-indexer layers."""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig


def _linear_params(cfg: ModelConfig, mlp_kind: str, full: bool) -> tuple[int, int]:
    """(params touched per token, params of the layer) of one decoder layer's matmuls (W_UK/W_UV of
    kv_b_proj are applied per query in the absorbed path, so they count per token)."""
    D, H, C, R = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    attn = (D * cfg.q_lora_rank + cfg.q_lora_rank * H * cfg.qk_head_dim + D * (C + R)
            + C * H * (cfg.qk_nope_head_dim + cfg.v_head_dim) + H * cfg.v_head_dim * D)
    if full:
        attn += cfg.q_lora_rank * cfg.index_n_heads * cfg.index_head_dim + D * cfg.index_head_dim + D * cfg.index_n_heads
    if mlp_kind == "dense":
        return attn + 3 * D * cfg.intermediate_size, attn + 3 * D * cfg.intermediate_size
    expert = 3 * D * cfg.moe_intermediate_size
    router = D * cfg.n_routed_experts
    shared = cfg.n_shared_experts * expert
    return (attn + router + shared + cfg.num_experts_per_tok * expert,
            attn + router + shared + cfg.n_routed_experts * expert)


def _attention_flops(cfg: ModelConfig, visible: np.ndarray, full: bool) -> float:
    """Score + value FLOPs summed over queries that each see `visible` keys."""
    k = np.minimum(cfg.index_topk, visible).astype(np.float64)
    C, R, H = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.num_attention_heads
    f = 2 * H * k * (C + R) + 2 * H * k * C
    if full:
        f = f + 2 * cfg.index_n_heads * visible * (cfg.index_head_dim + 1)
    return float(f.sum())


def forward_flops(cfg: ModelConfig, query_positions: np.ndarray, sampled: int) -> float:
    """FLOPs of one forward over queries at the given absolute positions, with `sampled` rows through
    lm_head."""
    q = np.asarray(query_positions, np.int64).reshape(-1)
    total = 0.0
    for layer in range(cfg.num_hidden_layers):
        mlp_kind, ix = cfg.layer_kind(layer)
        per_tok, _ = _linear_params(cfg, mlp_kind, ix == "full")
        total += 2.0 * per_tok * len(q) + _attention_flops(cfg, q + 1, ix == "full")
    return total + 2.0 * cfg.hidden_size * cfg.vocab_size * sampled


def decode_step_bytes(cfg: ModelConfig, batch: int, context: int, param_bytes: int, kv_bytes: int,
                      index_bytes_per_token: int) -> float:
    """HBM bytes of one decode step of `batch` requests each at `context` visible tokens: every weight a
    step touches once (routed experts: the expected number of distinct experts hit by batch x top-k
    picks), each request's selected KV rows, and the indexer keys of every visible token on full
    layers."""
    total = cfg.hidden_size * cfg.vocab_size * param_bytes  # lm_head
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    for layer in range(cfg.num_hidden_layers):
        mlp_kind, ix = cfg.layer_kind(layer)
        per_tok, full_params = _linear_params(cfg, mlp_kind, ix == "full")
        if mlp_kind == "dense":
            total += full_params * param_bytes
        else:
            expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
            distinct = E * (1 - (1 - k / E) ** batch)
            total += (full_params - E * expert + distinct * expert) * param_bytes
        sel = min(cfg.index_topk, context)
        total += batch * sel * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * kv_bytes
        if ix == "full":
            total += batch * context * index_bytes_per_token
    return float(total)


def print_table(rows) -> None:
    """Rows of cells (the first is the header), right-aligned in columns."""
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(str(c).rjust(w) for c, w in zip(r, widths)))


def report(rows, results, json_path: str | None) -> None:
    """A benchmark's ending: its table printed (print_table) and its results written as JSON."""
    print_table(rows)
    save_results(results, json_path)


def save_results(results, json_path: str | None) -> None:
    """The results so far written as JSON (benchmarks call it as they go, so a run cut short by a
    device call's time limit keeps what it measured)."""
    if json_path:
        with open(json_path, "w") as f:
            json.dump(results, f, indent=1)


def best_time(fn, *args, repeat: int = 5) -> float:
    """Best wall time of fn(*args) over `repeat` runs after one warm-up (blocking on the result)."""
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t)
    return best


def pipelined_time(fn, *args, n: int = 20, repeat: int = 5) -> float:
    """Per-call device time of fn(*args) from n calls dispatched back to back and one block at the
    end, best of `repeat`: each call is its own launch on the same stream (nothing is narrowed or
    overlapped), and host dispatch hides behind the device work as long as it is shorter."""
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        for _ in range(n):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t) / n)
    return best


def fitted_pipelined_time(fn, *args) -> float:
    """Per-call time of back-to-back calls (pipelined_time) with the chain length fitted to the
    kernel: one call compiles, one more is timed alone, then ~50 ms of calls (2 to 20), best of 3
    (2 when one call passes 0.1 s)."""
    jax.block_until_ready(fn(*args))
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    one = time.perf_counter() - t
    n = max(2, min(20, int(0.05 / max(one, 1e-6))))
    return pipelined_time(fn, *args, n=n, repeat=2 if one > 0.1 else 3)


def batched_time(fn, arg_sets) -> float:
    """Per-call device time of fn over len(arg_sets) independent argument tuples called in one
    executable (host dispatch paid once per batch): for kernels shorter than a host dispatch whose
    inputs must differ per call (distinct rows, so the second call does not find the first's in L2)."""
    many = jax.jit(lambda sets: [fn(*a) for a in sets])
    return pipelined_time(many, arg_sets, n=5, repeat=5) / len(arg_sets)


def chained_time(fn, x, *rest, n: int = 10, repeat: int = 5) -> float:
    """Per-call device time of fn(x, *rest) for kernels too short to time one host call each: n calls
    chained in one executable (each call's x depends on the previous result through a negligible
    update, so XLA can neither hoist nor overlap them), minus the same chain of 1, over n - 1. Host
    dispatch and the first call's input copy cancel; launch gaps inside the executable stay in.
    Only for work XLA cannot narrow to the one element the chain reads (Pallas kernels, sorts): an
    XLA gather or elementwise op would be sliced down to it. Time those with pipelined_time."""
    def chain(m):
        def run(x, *rest):
            for _ in range(m):
                leaf = jax.tree.leaves(fn(x, *rest))[0]
                bump = (leaf.ravel()[0] != 0).astype(x.dtype) * jnp.asarray(1e-30, x.dtype)
                x = x.at[(0,) * x.ndim].add(bump)
            return x
        return jax.jit(run)
    return max(best_time(chain(n), x, *rest, repeat=repeat) - best_time(chain(1), x, *rest, repeat=repeat),
               0.0) / (n - 1)


def measure_ceilings(dtype=jnp.bfloat16, matmul_n: int | None = None, copy_mib: int | None = None) -> dict:
    """Matmul FLOP rate (square matmul in `dtype`) and copy bandwidth (read + write of one array),
    measured now on the default device: the denominators of MFU and bandwidth utilisation. Both are
    rates sustained over back-to-back calls (pipelined_time). One blocking call each (the `_one_call`
    entries, the denominators before 2026-11-30) read 16-33% low for the matmul (542-673 against
    786-808 TFLOP/s on the H200) and 2570-3684 against 4124-4178 GB/s for the copy (docs/perf.md)."""
    gpu = jax.default_backend() == "gpu"
    n = matmul_n or (8192 if gpu else 1024)
    mib = copy_mib or (2048 if gpu else 256)
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype)
    mm = jax.jit(lambda x, y: x @ y)
    x = jnp.zeros((mib * 2 ** 20 // 4,), jnp.float32)
    cp = jax.jit(lambda v: v + 1.0)
    flops, moved = 2.0 * n ** 3, 2.0 * x.nbytes
    return {"matmul_flops_per_s": flops / pipelined_time(mm, a, b),
            "matmul_flops_per_s_one_call": flops / best_time(mm, a, b),
            "matmul_n": n, "matmul_dtype": str(jnp.dtype(dtype)),
            "copy_bytes_per_s": moved / pipelined_time(cp, x, n=10),
            "copy_bytes_per_s_one_call": moved / best_time(cp, x),
            "copy_mib": mib, "backend": jax.default_backend(), "device": str(jax.devices()[0].device_kind)}
