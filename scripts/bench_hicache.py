"""HiCache transfer benchmark (table + JSON): device->host backup and host->device load bandwidth of
the host tier's two copy paths (jitted block copies; cudaMemcpyAsync on the side stream), and prefill
time with write-through backup off / on through each path, in one run.

    python scripts/bench_hicache.py --model random:glm-5 --num-layers 4 --pages 512 --prompt-tokens 8192

Bandwidth = bytes moved (every layer of main KV, index-K of full layers) / wall time of a backup or
load of `--pages` pages, blocking on the result; compare with the PCIe ceiling (~50 GB/s on the
H200 host, REFERENCE.md). Prefill: one request of `--prompt-tokens` tokens through the engine with
`hicache_pages` 0 and > 0: time to the first token (the jitted path copies after the step; the side
stream copies at the layer boundaries of the forward) and until every backup is committed."""

import argparse
import functools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cpkv_jax.cli import add_model_args  # noqa: E402


def with_empty_copy(hicache):
    """The next forward's copies plus a zero-byte one at layer 0 on every device."""
    from cpkv_jax.hicache.side_stream import Copy
    steps = hicache.copies.take_step()
    for r, step in enumerate(steps):
        step.backups.setdefault(0, []).append(Copy(0, 0, hicache.copies.address(hicache.host.cache.latent, r), 0))
    return steps


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, "random:glm-5")
    p.set_defaults(num_layers=4, num_experts=16, dtype="bfloat16")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--pages", type=int, default=512, help="pages per backup / load")
    p.add_argument("--prompt-tokens", type=int, default=8192)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", default="bench_hicache.json")
    args = p.parse_args()
    import jax
    import numpy as np

    from cpkv_jax.cli import bench_model
    from cpkv_jax.engine import Engine, EngineConfig
    from cpkv_jax.sampling import SamplingParams
    from cpkv_jax.hicache.side_stream import D2H, H2D

    args.seed = 0
    model = bench_model(args)
    ps = args.page_size
    kv_pages = max(args.pages, -(-args.prompt_tokens // ps)) * 2 + 2
    result = {"device": str(jax.devices()[0].device_kind), "args": vars(args)}

    # transfer bandwidth: back up and load `pages` pages of every layer, through each copy path
    rows = []
    for path in ("jit", "side_stream"):
        eng = Engine(model, EngineConfig(page_size=ps, kv_pages=kv_pages, hicache_pages=args.pages + 2,
                                         index_dtype="fp8", hicache_copy=path))
        h, copier = eng.hicache, eng.runner.copier
        if path == "side_stream" and copier is None:
            continue
        dev_pages = eng.allocator.alloc(args.pages, 0)
        host_pages = h.allocator.alloc(args.pages, 0)
        units = h.host.units()
        for direction in ("d2h", "h2d"):
            to_host = direction == "d2h"
            best, moved = float("inf"), 0
            for _ in range(args.repeat + 1):        # the first pass compiles
                t = time.perf_counter()
                if path == "jit":
                    for unit in units:
                        h.copies.move(unit, host_pages, dev_pages, to_host=to_host)
                    jax.block_until_ready((h.host.cache, h.host.draft, eng.pool.cache, eng.pool.draft))
                else:
                    copies, runs = [], h.copies.runs(host_pages, dev_pages)
                    for unit in units:
                        leaves = jax.tree.leaves(eng.pool.draft if unit[1] else eng.pool.cache)
                        for b in h.copies.blocks(unit, runs)[0]:
                            dev = h.copies.address(leaves[b.leaf], 0) + b.offset
                            copies.append((b.host, dev, b.nbytes, D2H) if to_host else (dev, b.host, b.nbytes, H2D))
                    copier.copy_now(h.copies.device_ids()[0], copies)
                    copier.drain()
                dt = time.perf_counter() - t
                best = min(best, dt)
            moved = args.pages * ps * sum(h.host.row_bytes(k) for u in units for k in h.host.layer_leaves(*u)[0])
            rows.append({"path": path, "direction": direction, "pages": args.pages, "bytes": moved, "s": best,
                         "gb_per_s": moved / best / 1e9})
            print(f"{path:11s} {direction}: {args.pages} pages, {moved / 2 ** 20:.1f} MiB in {best * 1e3:.2f} ms = "
                  f"{moved / best / 1e9:.1f} GB/s", flush=True)
        del eng
    result["transfers"] = rows

    # prefill with backup off / on (per copy path)
    prompt = np.random.default_rng(0).integers(2, model.cfg.vocab_size, args.prompt_tokens).tolist()
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    prefill = {}
    host = -(-args.prompt_tokens // ps) + 2
    # hook_only: the side-stream path's layer hook in the forward but nothing to copy (the selective
    # policy backs up nothing on a first request, and a zero-byte copy at layer 0 makes the runner
    # compile the hook in): separates the hook's cost from the copies'.
    # Configurations are interleaved round by round, so drift on the machine hits them alike.
    configs = {label: EngineConfig(page_size=ps, kv_pages=kv_pages, hicache_pages=pages, index_dtype="fp8",
                                   max_prefill_tokens=args.prompt_tokens, prefix_cache=True, hicache_copy=path,
                                   hicache_policy=policy)
               for label, pages, path, policy in (("off", 0, "jit", "write_through"),
                                                  ("jit", host, "jit", "write_through"),
                                                  ("hook_only", host, "side_stream", "write_through_selective"),
                                                  ("side_stream", host, "side_stream", "write_through"))}
    times = {label: ([], []) for label in configs}
    for _ in range(args.repeat + 1):            # the first round compiles
        for label, cfg in configs.items():
            e = Engine(model, cfg)
            if cfg.hicache_copy == "side_stream" and e.runner.copier is None:
                continue
            if label == "hook_only":
                e.runner.step_copies = functools.partial(with_empty_copy, e.hicache)
            t = time.perf_counter()
            e.add_request(prompt, params)
            while e.has_unfinished():
                e.step()
            jax.block_until_ready(e.pool.cache)
            times[label][0].append(time.perf_counter() - t)
            if e.hicache is not None:
                e.hicache.settle()
                assert e.hicache.stats["commits"] == (cfg.hicache_policy == "write_through"), e.hicache.stats
            times[label][1].append(time.perf_counter() - t)
    for label, (ttft, total) in times.items():
        if len(ttft) < 2:
            continue
        prefill[label] = {"first_token_s": min(ttft[1:]), "committed_s": min(total[1:])}
        print(f"prefill {args.prompt_tokens} tokens, backup {label}: first token {prefill[label]['first_token_s'] * 1e3:.1f} ms, "
              f"backup committed {prefill[label]['committed_s'] * 1e3:.1f} ms", flush=True)
    for label in ("jit", "hook_only", "side_stream"):
        if label in prefill:
            for k in ("first_token_s", "committed_s"):
                prefill[label][k.replace("_s", "_slowdown")] = prefill[label][k] / prefill["off"]["first_token_s"] - 1
            print(f"backup {label}: slowdown to first token {prefill[label]['first_token_slowdown']:+.1%}, "
                  f"to committed {prefill[label]['committed_slowdown']:+.1%}")
    result["prefill"] = prefill
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
