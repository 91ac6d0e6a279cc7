"""Kernel benchmarks on the GPU, side by side with the XLA reference in one run (table + JSON).

    python scripts/bench_kernels.py --json bench_kernels.json

Compaction / restore: rows x 6144 bf16 with ~half the rows valid; bytes moved = rows read + rows
written; bandwidth utilisation against the copy rate measured in the same run."""

import argparse
import json
import sys
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[16384, 65536, 262144])
    p.add_argument("--hidden", type=int, default=6144)
    p.add_argument("--blocks", default="32x512,16x1024,64x256,8x2048")
    p.add_argument("--json", default="bench_kernels.json")
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import jax
    import jax.numpy as jnp

    from cpkv_jax.perf import best_time, measure_ceilings
    from pallas_kernels.row_gather import compaction_plan, gather_rows_pallas, gather_rows_reference

    copy_bw = measure_ceilings()["copy_bytes_per_s"]
    rows_out = []
    for n in args.rows:
        x = jax.random.normal(jax.random.key(0), (n, args.hidden), jnp.bfloat16)
        valid = jax.random.bernoulli(jax.random.key(1), 0.5, (n,))
        perm, dest, n_valid = compaction_plan(valid)
        moved = 2.0 * int(n_valid) * args.hidden * 2 + (n - int(n_valid)) * args.hidden * 2  # read+write valid, write zeros
        ref = jax.jit(gather_rows_reference)
        want = ref(x, perm)
        entry = {"rows": n, "hidden": args.hidden, "valid": int(n_valid), "bytes": moved,
                 "xla_s": best_time(ref, x, perm, repeat=20)}
        entry["xla_util"] = moved / entry["xla_s"] / copy_bw
        for blk in args.blocks.split(","):
            br, bc = map(int, blk.split("x"))
            f = jax.jit(lambda a, i, br=br, bc=bc: gather_rows_pallas(a, i, block_rows=br, block_cols=bc))
            try:
                got = f(x, perm)
                ok = bool((got == want).all())
                s = best_time(f, x, perm, repeat=20)
                entry[f"pallas_{blk}"] = {"s": s, "util": moved / s / copy_bw, "equal": ok}
            except Exception as e:  # a block shape that does not lower is reported, not fatal
                entry[f"pallas_{blk}"] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        rows_out.append(entry)
        cells = [f"{k}: {v['s'] * 1e6:.0f} us ({v['util']:.0%}{'' if v['equal'] else ' WRONG'})" if "s" in v
                 else f"{k}: {v['error'][:60]}" for k, v in entry.items() if k.startswith("pallas_")]
        print(f"rows {n:>7}  xla {entry['xla_s'] * 1e6:8.0f} us ({entry['xla_util']:.0%})  " + "  ".join(cells))
    Path(args.json).write_text(json.dumps({"copy_bytes_per_s": copy_bw, "device": str(jax.devices()[0].device_kind),
                                           "compaction": rows_out}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
