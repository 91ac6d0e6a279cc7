"""The routed experts' dispatch at decode with its default tilings against the same tilings in single
programs (cluster_n = 1), in one process, round robin, `--repeats` times: fp8 and bf16 weights, GLM-5
widths (hidden 6144, expert width 2048, top-8), 256 experts. Prints a table (ms per call) and writes
JSON. The tilings are swapped by replacing dispatch.fp8_tilings / blocked_tilings, which the dispatch
looks up at every trace (jit caches cleared between variants).

    python3 scripts/ab_expert_clusters.py --tokens 1,8,64 --json ab_clusters.json
"""

import argparse
import dataclasses

import jax
import jax.numpy as jnp

import pallas_kernels.moe.dispatch as dispatch
from bench_kernels import expert_mlp_summed
from cpkv_jax.perf import fitted_pipelined_time, report
from pallas_kernels.moe import expert_shape, fp8_experts_as_plain
from pallas_kernels.policy import KernelPolicy


def single(tilings):
    """The tilings function `tilings` with its clusters of two programs dropped."""
    def without_clusters(slots, E, compute_wgs=2):
        return tuple(dataclasses.replace(t, cluster_n=1) for t in tilings(slots, E, compute_wgs))
    return without_clusters


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="1,8,64")
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--hidden", type=int, default=6144)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    D, I, k, E = args.hidden, args.width, args.top_k, args.experts
    defaults = {"fp8": ("fp8_tilings", dispatch.fp8_tilings), "bf16": ("blocked_tilings", dispatch.blocked_tilings)}
    res, rows = [], [["tokens", "weights", "tilings", "repeat", "ms"]]
    run = jax.jit(expert_mlp_summed, static_argnums=5, static_argnames="policy")
    for T in (int(t) for t in args.tokens.split(",")):
        keys = jax.random.split(jax.random.key(T), 8)
        fp8 = []
        for i, (K, N) in enumerate(((D, I), (D, I), (I, D))):      # K-major [E, N, K], as the model stores them
            q = (jax.random.normal(keys[i], expert_shape(E, K, N, fp8=True), jnp.bfloat16) * 64).astype(jnp.float8_e4m3fn)
            sc = jax.random.uniform(keys[3 + i], (E, N // 128, K // 128), jnp.float32, 0.5, 1.5) * K ** -0.5 / 64
            fp8.append((q, sc))
        scales, q8 = tuple(s for _, s in fp8), tuple(q for q, _ in fp8)
        plain = tuple(fp8_experts_as_plain(q, s, jnp.bfloat16) for q, s in fp8)
        x = jax.random.normal(keys[6], (T, D), jnp.bfloat16)
        fe = jax.random.randint(keys[7], (T * k,), 0, E, jnp.int32)
        calls = {"fp8": lambda: run(x, fe, *q8, k, policy=KernelPolicy(), scales=scales),
                 "bf16": lambda: run(x, fe, *plain, k, policy=KernelPolicy())}
        for rep in range(args.repeats):
            for weights, (name, tilings) in defaults.items():
                try:
                    for variant, fn in (("default", tilings), ("single", single(tilings))):
                        setattr(dispatch, name, fn)
                        jax.clear_caches()
                        s = fitted_pipelined_time(calls[weights])
                        res.append(dict(tokens=T, weights=weights, tilings=variant, repeat=rep, s=s))
                        rows.append([T, weights, variant, rep, f"{s * 1e3:.3f}"])
                finally:
                    setattr(dispatch, name, tilings)
    report(rows, res, args.json)


if __name__ == "__main__":
    main()
