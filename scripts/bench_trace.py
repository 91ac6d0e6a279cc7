"""KV-integrity trace cost (table + JSON): the same workload through the engine at trace levels 0-3 —
prompts with shared prefixes prefilled and decoded, every device copy evicted, the prompts again (their
prefixes reload from the host tier) — best wall time of `--repeat` timed runs after a warm-up run per
level (which compiles), and the ratio to level 0 measured in the same run.

    python scripts/bench_trace.py                                   # tiny model (CPU or GPU)
    python scripts/bench_trace.py --model random:glm-5 --num-layers 4 --num-experts 16 --dtype bfloat16 \\
        --page-size 64 --prompt-len 2048 --batch 4 --decode-tokens 32

Level 0 runs without a tracer (the untraced executables); levels 1-2 add host-side work per backup and
load (records; page hashes in XLA); level 3 adds the per-layer forward hashes and one host callback
per layer, and waits for each forward's callbacks before the next."""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cpkv_jax.cli import add_model_args  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--batch", type=int, default=4, help="prompts per pass (two shared prefixes)")
    p.add_argument("--prompt-len", type=int, default=96)
    p.add_argument("--decode-tokens", type=int, default=8)
    p.add_argument("--hicache-copy", default="auto", choices=("auto", "jit", "side_stream"))
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", default="bench_trace.json")
    args = p.parse_args()
    import jax
    import numpy as np

    from cpkv_jax.cli import bench_model
    from cpkv_jax.engine import Engine, EngineConfig
    from cpkv_jax.kv_pool import pages_for
    from cpkv_jax.perf import print_table
    from cpkv_jax.sampling import SamplingParams

    model = bench_model(args)
    rng = np.random.default_rng(0)
    V, L = model.cfg.vocab_size, args.prompt_len
    prefixes = [rng.integers(2, V, L // 2).tolist() for _ in range(2)]
    prompts = [prefixes[i % 2] + rng.integers(2, V, L - L // 2).tolist() for i in range(args.batch)]
    params = SamplingParams(max_new_tokens=args.decode_tokens, ignore_eos=True)
    pages = args.batch * pages_for(L + args.decode_tokens, args.page_size) + 2
    out_dir = Path(tempfile.mkdtemp(prefix="bench-trace-"))

    def workload(eng):
        t = time.perf_counter()
        eng.generate(prompts, params)
        eng.radix.evict(10 ** 9, eng.allocator.free, eng.scheduler._free_host)
        eng.generate(prompts, params)
        jax.block_until_ready(eng.pool.cache)
        return time.perf_counter() - t

    results = {}
    for level in (0, 1, 2, 3):
        trace = dict(kv_trace=level, trace_out=str(out_dir / f"level{level}.jsonl")) if level else {}
        config = EngineConfig(page_size=args.page_size, kv_pages=2 * pages, max_running=args.batch,
                              max_prefill_tokens=args.batch * L, hicache_pages=2 * pages,
                              hicache_copy=args.hicache_copy, **trace)
        warm = workload(Engine(model, config))
        best = min(workload(Engine(model, config)) for _ in range(args.repeat))
        size = (out_dir / f"level{level}.jsonl").stat().st_size if level else 0
        results[level] = {"seconds": best, "warmup_seconds": warm, "trace_bytes": size}
    base = results[0]["seconds"]
    rows = [("level", "seconds", "vs level 0", "trace bytes", "warm-up s (compiles)")]
    rows += [(lvl, f"{r['seconds']:.4f}", f"{r['seconds'] / base:.2f}x", r["trace_bytes"], f"{r['warmup_seconds']:.1f}")
             for lvl, r in results.items()]
    print_table(rows)
    Path(args.json).write_text(json.dumps({"device": str(jax.devices()[0].device_kind), "args": vars(args),
                                           "levels": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
