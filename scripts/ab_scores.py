"""Indexer prefill scores, Mosaic GPU kernel tilings against the Triton kernel, in one process on the
GPU (table + JSON); then the whole indexer_topk (scores + selection) with the Mosaic GPU kernel on and
off (KernelPolicy.mgpu_scores), and how many query rows' top-k sets differ between the two.

    python scripts/ab_scores.py --json ab_scores.json [--tokens 32768] [--tilings '[{}, {"block_t": 4}]']

GLM-5 indexer shapes (32 heads x 128, fp8 keys with per-token scale through a shuffled page table,
bf16 queries), causal prefill of T = N = --tokens. Each tiling's visible scores are compared with the
Triton kernel's (max difference over the largest |score|); the rate counts the visible pairs' FLOPs
against the bf16 matmul rate measured in the same run. Timing: `cpkv_jax.perf.chained_time`.
The indexer_topk comparison uses scores_mgpu.DEFAULT_TILING, or the fastest tiling with --use-best."""

import argparse
import json
import sys
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--tilings", default='[{}, {"block_t": 4}, {"stages": 2}]',
                   help="JSON list of scores_mgpu tilings (dicts over DEFAULT_TILING)")
    p.add_argument("--k", type=int, default=2048)
    p.add_argument("--use-best", action="store_true", help="time indexer_topk with the fastest tiling")
    p.add_argument("--json", default="ab_scores.json")
    args = p.parse_args()
    root = Path(__file__).resolve().parent
    sys.path[:0] = [str(root.parent), str(root)]
    import jax
    import jax.numpy as jnp
    import numpy as np

    from bench_kernels import indexer_inputs
    from cpkv_jax.perf import chained_time, measure_ceilings
    from pallas_kernels.indexer import index_scores_pallas, indexer_topk, scores_mgpu
    from pallas_kernels.policy import KernelPolicy

    ceil = measure_ceilings()
    rate = ceil["matmul_flops_per_s"]
    out = {"device": str(jax.devices()[0].device_kind), "ceilings": ceil, "tokens": args.tokens, "scores": {}}
    T = args.tokens
    q, w, ik, sc, table, pos = indexer_inputs(1, T, T, 32, 128, True)
    flops = 2.0 * 32 * 128 * float((np.asarray(pos, np.float64) + 1).sum())
    visible = jnp.arange(T)[None, None, :] <= pos[:, :, None]

    def scores_fn(mgpu):
        return jax.jit(lambda q_: index_scores_pallas(q_, w, ik, sc, 0, table, pos, write_invisible=False, mgpu=mgpu))
    triton = scores_fn(False)(q)
    scale = float(jnp.max(jnp.where(visible, jnp.abs(triton), 0)))
    rows = [("triton", {}, chained_time(scores_fn(False), q, n=5, repeat=3), 0.0)]
    for tiling in json.loads(args.tilings):
        f = scores_fn(tiling or True)
        err = float(jnp.max(jnp.where(visible, jnp.abs(f(q) - triton), 0))) / scale
        rows.append(("mgpu " + json.dumps(tiling), tiling, chained_time(f, q, n=5, repeat=3), err))
    del triton
    print(f"bf16 matmul {rate / 1e12:.0f} TFLOP/s; prefill scores, T = N = {T}:")
    for name, tiling, s, err in rows:
        out["scores"][name] = {"tiling": tiling, "s": s, "flop_util": flops / s / rate, "max_diff_vs_triton": err}
        print(f"  {name:<40} {s * 1e3:7.2f} ms  {flops / s / rate:6.1%}  max diff vs triton {err:.1e}")
    if args.use_best:
        best = min(rows[1:], key=lambda r: r[2])
        scores_mgpu.DEFAULT_TILING.update(best[1])
    sel = {}
    for on in (False, True):
        policy = KernelPolicy(mgpu_scores=on)
        f = jax.jit(lambda q_: indexer_topk(q_, w, ik, sc, 0, table, pos, args.k, policy=policy))
        sel[on] = np.asarray(f(q))
        s = chained_time(f, q, n=3, repeat=3)
        out[f"indexer_topk_mgpu_{'on' if on else 'off'}"] = {"s": s, "flop_util": flops / s / rate}
        print(f"indexer_topk mgpu_scores={on}: {s * 1e3:.2f} ms  {flops / s / rate:.1%}")
    out["indexer_topk_tiling"] = dict(scores_mgpu.DEFAULT_TILING)
    out["rows_with_different_sets"] = int((sel[True] != sel[False]).any(-1).sum())
    print(f"rows whose top-k set differs (on vs off): {out['rows_with_different_sets']} of {T}")
    Path(args.json).write_text(json.dumps(out, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
