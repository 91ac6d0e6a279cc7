"""HiCache transfer benchmark (table + JSON): device->host backup and host->device load bandwidth of
the host tier's copy path, and prefill time with write-through backup on vs off, in one run.

    python scripts/bench_hicache.py --model random:glm-5 --num-layers 4 --pages 512 --prompt-tokens 8192

Bandwidth = bytes moved (every layer of main KV, index-K of full layers) / wall time of a backup or
load of `--pages` pages, blocking on the result; compare with the PCIe ceiling (~50 GB/s on the
H200 host, REFERENCE.md). Prefill: one request of `--prompt-tokens` tokens through the engine with
`hicache_pages` 0 and > 0 (the backup runs when the prompt's pages are published)."""

import argparse
import json
import sys
import time
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:glm-5")
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--num-experts", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--pages", type=int, default=512, help="pages per backup / load")
    p.add_argument("--prompt-tokens", type=int, default=8192)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", default="bench_hicache.json")
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import jax
    import numpy as np

    from cpkv_jax.cli import bench_model
    from cpkv_jax.engine import Engine, EngineConfig
    from cpkv_jax.sampling import SamplingParams

    args.seed = 0
    model = bench_model(args)
    ps = args.page_size
    kv_pages = max(args.pages, -(-args.prompt_tokens // ps)) * 2 + 2
    result = {"device": str(jax.devices()[0].device_kind), "args": vars(args)}

    # transfer bandwidth: back up and load `pages` pages of every layer
    eng = Engine(model, EngineConfig(page_size=ps, kv_pages=kv_pages, hicache_pages=args.pages + 2,
                                     index_dtype="fp8"))
    h = eng.hicache
    dev_pages = eng.allocator.alloc(args.pages, 0)
    host_pages = h.allocator.alloc(args.pages, 0)
    units = h._layers()
    rows = []
    for direction in ("d2h", "h2d"):
        best = float("inf")
        for _ in range(args.repeat + 1):        # the first pass compiles
            before = dict(h.stats[f"{direction}_bytes"])
            t = time.perf_counter()
            for unit in units:
                h._move(unit, host_pages, dev_pages, to_host=direction == "d2h")
            jax.block_until_ready((h.cache, eng.pool.cache))
            dt = time.perf_counter() - t
            moved = sum(h.stats[f"{direction}_bytes"].values()) - sum(before.values())
            best = min(best, dt)
        rows.append({"direction": direction, "pages": args.pages, "bytes": moved, "s": best,
                     "gb_per_s": moved / best / 1e9})
        print(f"{direction}: {args.pages} pages, {moved / 2 ** 20:.1f} MiB in {best * 1e3:.2f} ms = "
              f"{moved / best / 1e9:.1f} GB/s", flush=True)
    result["transfers"] = rows

    # prefill with backup off / on
    prompt = np.random.default_rng(0).integers(2, model.cfg.vocab_size, args.prompt_tokens).tolist()
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    prefill = {}
    for label, host in (("off", 0), ("on", -(-args.prompt_tokens // ps) + 2)):
        cfg = EngineConfig(page_size=ps, kv_pages=kv_pages, hicache_pages=host, index_dtype="fp8",
                           max_prefill_tokens=args.prompt_tokens, prefix_cache=True)
        times = []
        for _ in range(args.repeat + 1):
            e = Engine(model, cfg)
            t = time.perf_counter()
            e.generate([prompt], params)
            jax.block_until_ready(e.pool.cache)
            times.append(time.perf_counter() - t)
        prefill[label] = min(times[1:])
        print(f"prefill {args.prompt_tokens} tokens, backup {label}: {prefill[label] * 1e3:.1f} ms", flush=True)
    prefill["slowdown"] = prefill["on"] / prefill["off"] - 1
    print(f"backup slowdown: {prefill['slowdown']:+.1%}")
    result["prefill"] = prefill
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
