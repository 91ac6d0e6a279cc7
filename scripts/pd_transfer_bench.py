"""PD page transfer: which of JAX's device-to-device paths moves one request's rows fastest.

Moves the rows of `--pages` pages of every layer (latent + rope key, as the pool stores them) from one
device to another, three ways, each timed as the best of `--repeat` runs after a warm-up:
  device_put  jax.device_put of the source rows onto the destination device (what cpkv_jax.pd uses
              within one process)
  ppermute    a jitted shard_map over a two-device mesh (source, destination) with lax.ppermute 0 -> 1:
              the collective path, the one that also crosses processes (jax.distributed)
  via_host    device -> numpy -> device (the baseline a hand-made transport would start from)
Prints a table and writes JSON (--json PATH).

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python scripts/pd_transfer_bench.py --pages 64
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


def best(fn, repeat: int) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--layers", type=int, default=78)
    ap.add_argument("--width", type=int, default=512 + 64, help="latent + rope key per token (GLM-5: 576)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    src, dst = jax.devices()[0], jax.devices()[1]
    shape = (args.layers, args.pages * args.page_size, args.width)
    rows = jax.device_put(jnp.ones(shape, args.dtype), src)
    nbytes = rows.nbytes

    pair = Mesh(np.array([src, dst]), ("pd",))
    move = jax.jit(jax.shard_map(lambda x: jax.lax.ppermute(x, "pd", [(0, 1)]), mesh=pair,
                                 in_specs=P("pd"), out_specs=P("pd")))
    staging = jax.device_put(jnp.zeros(shape, args.dtype), dst)

    def ppermute():
        both = jax.make_array_from_single_device_arrays((2,) + shape, NamedSharding(pair, P("pd")),
                                                        [rows[None], staging[None]])
        return move(both).addressable_shards[1].data

    paths = {"device_put": lambda: jax.device_put(rows, dst), "ppermute": ppermute,
             "via_host": lambda: jax.device_put(np.asarray(rows), dst)}
    result = {"device": str(src.device_kind), "bytes": nbytes, "shape": shape, "dtype": args.dtype}
    print(f"{nbytes / 2**20:.1f} MiB from {src} to {dst}")
    for name, fn in paths.items():
        t = best(fn, args.repeat)
        result[name] = {"seconds": t, "GBps": nbytes / t / 1e9}
        print(f"{name:>10}: {t * 1e3:8.2f} ms  {nbytes / t / 1e9:7.2f} GB/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
