"""Kernel benchmarks on the GPU, side by side with XLA in one run (table + JSON).

    python scripts/bench_kernels.py --json bench_kernels.json [--only compaction,selection,indexer,moe,moe_rows,moe_fp8,sparse_mla,fp8_linear]
    JAX_PLATFORMS=cpu python scripts/bench_kernels.py --only moe --moe-small   # CPU smoke test

compaction: rows x 6144 bf16 with ~half the rows valid; bytes = valid rows read and written plus
  dummy rows written; utilisation against the copy rate measured in the same run, and the time of a
  plain copy of the same bytes (what that size can reach).
selection: top-k (k = 2048) of fp32 score rows: the Pallas select (several tilings, with how many
  rows took each of its paths) vs
  lax.top_k (stable and is_stable=False) and the reference (top_k + position sort); bytes = scores
  read once + positions written once.
indexer: GLM-5 indexer (32 heads x 128, fp8 keys with per-token scale through a table of shuffled 64-slot pages,
  bf16 queries, k = 2048): the scores kernel and the selection, prefill (T = N = 32768, causal) and
  decode (8 requests, T = 1 and 64 tokens each, N = 131072 keys). Prefill rate counts the FLOPs of
  the visible pairs only (2 x H x D per pair) against the bf16 matmul rate; decode counts the fewest
  bytes (keys + scales + page table read once, queries, positions written) against the copy rate.
  The XLA composition (reference scores + selection) is timed on a slice of the queries where its
  [T, H, N] fp32 intermediate fits.
moe: the routed experts' grouped matmuls over expert-sorted rows (top-8 routing with a per-expert
  popularity skew), gate/up [rows, 6144] x [E, 6144, 4096] (gate and up side by side; models/moe.py
  runs them as two N = 2048 calls of the same FLOPs) and down [rows, 2048] x [E, 2048, 6144], bf16 in
  and out: lax.ragged_dot (as models/moe.py calls it), jax's Mosaic GPU ragged_dot_mgpu (tilings),
  tokamax's Mosaic GPU ragged dot (its default config and set ones; needs the tokamax wheel), our
  grouped_matmul kernel on the block plan's padded rows (blocked_*: gate/up fused with SiLU * up, so
  its output has half the columns; plan + row gather timed beside it) and a cuBLAS jnp.dot of the
  same FLOPs. Prefill at 8192 (and 32768) tokens x E in {16, 64, 256}: TFLOP/s and
  share of the dense rate; decode (1, 8, 64 tokens, E = 256): bandwidth over the touched experts'
  weights + rows in and out. Each variant's output is checked against an fp32 per-group product on
  up to 64 rows of three groups (max abs error over max |reference|). Failures (out of memory,
  a tiling that does not lower, GPU-only kernels on the CPU) are rows with an error string. Timed
  by pipelined_time (back-to-back calls of 0.1-600 ms kernels, one compile each).
moe_rows: the MoE's row movement around the grouped matmuls: the tokens gathered into the block
  plan's padded rows, and each token's expert rows combined into its weighted sum (combine_rows
  tilings vs the slot-order gather + sum it replaces); bytes against the copy rate.
moe_fp8: the routed experts' MLP through the dispatch and each token's weighted sum (as the model
  runs it) with bf16 weights, fp8 weights dequantized per
  call, and fp8 weights through the fp8 kernel (DeepGEMM's block scaling); prefill 8192 tokens x
  16 / 256 experts, decode 1-64 tokens x 256 experts.
sparse_mla: GLM-5's absorbed attention over the top-k rows (64 heads, latent 512 + rope 64, k = 2048,
  bf16) read from the pool through their slots: kernel tilings vs the jnp composition (gather +
  einsums) and, at prefill, the expanded path it replaces; prefill TFLOP/s over the selected rows
  against the matmul rate, decode bytes of the selected rows against the copy rate.
fp8_linear: GLM-5's fp8 dense linears at decode row counts (1, 8, 64): the fp8 kernel with one
  program per output tile and with K split over a wave (split_k), XLA's dot on the weight dequantized
  at use and on a bf16 copy; bytes of the weight each reads against the copy rate.
Short kernels are timed by `cpkv_jax.perf.chained_time` (n chained calls in one executable), decode
sparse MLA and fp8_linear by `batched_time` (8 calls over distinct rows / weights in one executable); the row
gather and its same-size copy by `pipelined_time` (back-to-back calls: a chain would let XLA narrow
its gather to the one element the chain reads)."""

import argparse
import functools
import json
import re
import sys
from pathlib import Path


def _try(fn):
    try:
        return fn()
    except Exception as e:  # a tiling that does not lower is reported, not fatal
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}


def bench_compaction(args, ceil):
    import jax
    import jax.numpy as jnp

    from cpkv_jax.perf import pipelined_time
    from pallas_kernels.row_gather import compaction_plan, gather_rows_pallas, gather_rows_reference

    copy_bw = ceil["copy_bytes_per_s"]
    out = []
    for n in args.rows:
        x = jax.random.normal(jax.random.key(0), (n, args.hidden), jnp.bfloat16)
        valid = jax.random.bernoulli(jax.random.key(1), 0.5, (n,))
        perm, dest, n_valid = compaction_plan(valid)
        moved = 2.0 * int(n_valid) * args.hidden * 2 + (n - int(n_valid)) * args.hidden * 2
        ref = jax.jit(gather_rows_reference)
        want = ref(x, perm)
        # a copy of the same bytes (read + write), timed the same way: what this size can reach
        same = jnp.zeros((int(moved) // 8,), jnp.float32)
        entry = {"rows": n, "hidden": args.hidden, "valid": int(n_valid), "bytes": moved,
                 "same_size_copy_s": pipelined_time(jax.jit(lambda v: v + 1.0), same),
                 "xla_s": pipelined_time(ref, x, perm)}
        entry["xla_util"] = moved / entry["xla_s"] / copy_bw
        for blk in args.gather_tilings.split(","):
            br, bc, steps, stages = (list(map(int, blk.split("x"))) + [1, 0])[:4]
            f = jax.jit(lambda a, i, br=br, bc=bc, steps=steps, stages=stages: gather_rows_pallas(
                a, i, block_rows=br, block_cols=bc, steps=steps, num_stages=stages or None))

            def run(f=f):
                ok = bool((f(x, perm) == want).all())
                s = pipelined_time(f, x, perm)
                return {"s": s, "util": moved / s / copy_bw, "vs_same_size_copy": entry["same_size_copy_s"] / s,
                        "equal": ok}
            entry[f"pallas_{blk}"] = _try(run)
        out.append(entry)
        cells = [f"{k}: {v['s'] * 1e6:.0f} us ({v['util']:.0%}{'' if v['equal'] else ' WRONG'})" if "s" in v
                 else f"{k}: {v['error'][:60]}" for k, v in entry.items() if k.startswith("pallas_")]
        print(f"compaction rows {n:>7}  same-size copy {entry['same_size_copy_s'] * 1e6:6.0f} us  "
              f"xla {entry['xla_s'] * 1e6:8.0f} us ({entry['xla_util']:.0%})  "
              + "  ".join(cells), flush=True)
    return out


# Chains for selection timings (tens of µs each): with chains of 10, best of 5, one version timed
# twice read 10 and 33 µs; chains of 50, best of 10, agree within a few µs (docs/perf.md).
SELECT_CHAIN = dict(n=50, repeat=10)
SELECT_CASES = [(64, 8192), (64, 131072), (2048, 32768)]  # rows x width
INDEXER_CASES = [  # (label, requests, queries each, keys each, prefill, queries per request for XLA)
    ("prefill", 1, 32768, 32768, True, 1024), ("decode_t1", 8, 1, 131072, False, 1),
    ("decode_t64", 8, 64, 131072, False, 16)]
SELECT_TILINGS = "dispatch,bracket,resident:1:16,resident:1:8"
SELECT_FIELDS = ("bits", "chunk", "capacity", "sample", "sub", "num_warps", "num_stages", "segments")


def select_variant(tiling: str, rows: int, width: int, lengths=None, return_path=False, stop_after=None):
    """tiling: bits per pass : chunk : candidate capacity : sample : sub : warps : pipeline stages :
    segments per row, 'dispatch' for what `select_tiling` picks for rows x width, 'bracket' for the
    two-call kernel's `bracket_tiling`, or 'resident:bits:warps' for the resident-row kernel."""
    from pallas_kernels.indexer import select
    from pallas_kernels.indexer.tuning import bracket_tiling, select_tiling
    if tiling in ("dispatch", "bracket"):           # (the dispatch's whole tiling, held_cands too)
        kw = (select_tiling if tiling == "dispatch" else bracket_tiling)(rows, width)
    elif tiling.startswith("resident:"):
        bits, warps = map(int, tiling.split(":")[1:])
        kw = {"resident": True, "bits": bits, "num_warps": warps}
    else:
        kw = dict(zip(SELECT_FIELDS, map(int, tiling.split(":"))))
    if kw.get("resident"):
        return (f"pallas_resident_b{kw['bits']}_w{kw['num_warps']}", lambda s, k: select.select_topk_pallas(
            s, k, lengths, return_path=return_path, **kw))
    name = "pallas_b{bits}_c{chunk}_cap{capacity}_s{sample}_u{sub}_w{num_warps}_st{num_stages}_seg{segments}"
    name += "_held{held_cands}".format(**kw) if kw.get("held_cands") else ""
    return (name.format(**kw), lambda s, k: select.select_topk_pallas(s, k, lengths, return_path=return_path,
                                                                       stop_after=stop_after, **kw))


def bench_selection(args, ceil):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from cpkv_jax.perf import chained_time
    from pallas_kernels.indexer import PATHS, select_topk_reference

    copy_bw, k = ceil["copy_bytes_per_s"], args.k
    out = []
    for r, n in (tuple(map(int, c.split("x"))) for c in args.select_cases.split(",")):
        x = jax.random.normal(jax.random.key(r + n), (r, n), jnp.float32)
        want = np.asarray(jax.jit(lambda s: select_topk_reference(s, k))(x))
        moved = x.nbytes + r * k * 4
        entry = {"rows": r, "width": n, "k": k, "bytes": moved}
        for name, f in (("lax_top_k_stable", lambda s: jax.lax.top_k(s, k)),
                        ("lax_top_k_unstable", lambda s: jax.lax.top_k(s, k, is_stable=False)),
                        ("reference", lambda s: select_topk_reference(s, k))):
            entry[name] = _try(lambda f=f: {"s": chained_time(f, x, **SELECT_CHAIN)})
        tilings = args.select_tilings.split(",")
        for stage in (1, 2, 3) if args.select_stages else ():
            name, f = select_variant(tilings[0], r, n, stop_after=stage)
            entry[f"stages_1_to_{stage}_{name}"] = _try(
                lambda f=f: {"s": chained_time(lambda s: f(s, k), x, **SELECT_CHAIN)})
        for tiling in tilings:
            name, f = select_variant(tiling, r, n)
            _, f_path = select_variant(tiling, r, n, return_path=True)

            def run(f=f, f_path=f_path):
                got, path = jax.jit(lambda s: f_path(s, k))(x)
                t = chained_time(lambda s: f(s, k), x, **SELECT_CHAIN)
                paths = np.bincount(np.asarray(path), minlength=len(PATHS))
                return {"s": t, "util": moved / t / copy_bw, "equal": bool((np.asarray(got) == want).all()),
                        "rows_by_path": dict(zip(PATHS, paths.tolist()))}
            entry[name] = _try(run)
        out.append(entry)
        base = entry["lax_top_k_stable"].get("s")
        cells = []
        for key, v in entry.items():
            if isinstance(v, dict) and "s" in v:
                extra = f" x{base / v['s']:.1f}" if base and v["s"] > 0 else ""
                full = v.get("rows_by_path", {}).get("full search")
                extra += f" ({full} rows full search)" if full else ""
                cells.append(f"{key} {v['s'] * 1e6:.0f}us{extra}{'' if v.get('equal', True) else ' WRONG'}")
            elif isinstance(v, dict):
                cells.append(f"{key} ERR {v['error'][:80]}")
        print(f"select {r}x{n} k={k}:\n  " + "\n  ".join(cells), flush=True)
    return out


SCORE_TILINGS = "indexer,mgpu,paged,dispatch,256:128:32:8:3,128:128:8:4:3"
SCORE_FIELDS = ("block_m", "block_n", "steps", "num_warps", "num_stages", "gather_keys")


# The Mosaic GPU scores variants: their tiling fields after the name, and their other arguments.
MGPU_VARIANTS = {"mgpu": (("block_t", "stages"), {}),
                 "paged": (("blocks_per_program", "stages"), {"contiguous_blocks": True})}


def score_variant(tiling: str) -> tuple[str, dict]:
    """tiling: query rows x heads : key block : key blocks per program : warps : pipeline stages
    [: 1/0 keys gathered before the kernel or read through the table], 'dispatch' (the Triton
    kernel's defaults, the whole matrix written) or 'indexer' (the Triton kernel as indexer_topk calls
    it, the key blocks no query sees left unwritten; indexer_topk itself runs the Mosaic GPU kernels
    where use_mgpu_scores says so), or mgpu[:block_t:stages] (the Mosaic GPU kernel on
    the gathered keys, unseen key blocks unwritten as in 'indexer'), or
    paged[:blocks_per_program:stages] (the paged Mosaic GPU kernel: keys read from the pool by TMA
    per 64-key block; calls that do not gather their keys, i.e. decode)."""
    if tiling == "dispatch":
        return "dispatch", {}
    if tiling == "indexer":
        return "indexer", {"write_invisible": False}
    kind, *vals = tiling.split(":")
    if kind in MGPU_VARIANTS:
        fields, extra = MGPU_VARIANTS[kind]
        mgpu = dict(zip(fields, map(int, vals)))
        return tiling.replace(":", "_"), {"mgpu": mgpu or True, "write_invisible": False, **extra}
    vals = [int(v) for v in tiling.split(":")]
    kw = dict(zip(SCORE_FIELDS, vals))
    if "gather_keys" in kw:
        kw["gather_keys"] = bool(kw["gather_keys"])
    return "m{}_n{}_steps{}_w{}_s{}".format(*vals[:5]) + ("" if len(vals) < 6 else f"_g{vals[5]}"), kw


def indexer_inputs(B, T, N, H=32, D=128, prefill=False, page_size=64):
    """GLM-5-shaped indexer operands over a pool of shuffled pages of page_size slots (the engine's
    default 64; 1 shuffles single slots), slot 0 a dummy."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from cpkv_jax.kv_pool import paged_slot_table
    from pallas_kernels.indexer import quantize_index_k

    key = jax.random.key(B * T + N)
    kq, kk, kw = jax.random.split(key, 3)
    q = jax.random.normal(kq, (B, T, H, D), jnp.bfloat16)
    w = jax.random.normal(kw, (B, T, H), jnp.float32) * H ** -0.5
    pages = B * -(-N // page_size)                       # whole pages per request
    slots = page_size * (1 + pages)
    index_k, scale = quantize_index_k(jax.random.normal(kk, (1, slots, D), jnp.float32))
    table = jnp.asarray(paged_slot_table((1 + np.random.default_rng(0).permutation(pages)).reshape(B, -1),
                                         page_size, N))
    start = 0 if prefill else N - T
    pos = jnp.broadcast_to(start + jnp.arange(T, dtype=jnp.int32), (B, T))
    return q, w, index_k, scale, table, pos


def bench_indexer(args, ceil):
    import jax
    import numpy as np

    from cpkv_jax.perf import chained_time
    from pallas_kernels.indexer import (gathers_keys, index_keys_fp32, index_scores_pallas, index_scores_reference,
                                        indexer_topk, indexer_topk_fused, select_topk_reference)

    k, H, D = args.k, 32, 128
    out = []
    for label, B, T, N, prefill, xla_t in (c for c in INDEXER_CASES if c[0] in args.indexer_cases.split(",")):
        q, w, ik, sc, table, pos = indexer_inputs(B, T, N, H, D, prefill)
        pairs = float((np.asarray(pos, np.float64) + 1).sum())
        flops = 2.0 * H * D * pairs
        moved = ik.shape[1] * (D + 4) + table.size * 4 + q.size * 2 + w.size * 4 + B * T * k * 4
        entry = {"case": label, "B": B, "T": T, "N": N, "k": k, "flops_visible": flops, "bytes_min": moved}

        def xla(qs, ws, ps):
            keys = index_keys_fp32(ik, sc, 0, table)
            return select_topk_reference(index_scores_reference(qs, ws, keys, ps, D), k)
        qs, ws, ps = q[:, :xla_t], w[:, :xla_t], pos[:, :xla_t]
        entry["xla_composition"] = _try(lambda: {"s": chained_time(xla, qs, ws, ps), "queries": xla_t * B,
                                                 "note": f"first {xla_t} queries per request only"})
        best = None
        variants = [score_variant(t) for t in args.score_tilings.split(",")]
        # the paged kernel serves calls that read their keys through the table (decode); others gather
        variants = [v for v in variants if not (v[0].startswith("paged") and gathers_keys(T, H))]
        if args.score_breakdown:  # where the dispatch's time goes: leave one part out at a time
            kw = variants[0][1]
            variants += [("keys_through_table", {**kw, "gather_keys": False}),
                         ("no_epilogue", {**kw, "epilogue": False})]
        for name, kw in variants:
            f = lambda q_, kw=kw: index_scores_pallas(q_, w, ik, sc, 0, table, pos, **kw)

            def run(f=f):
                t = chained_time(f, q, n=5 if prefill else 10, repeat=3)
                return {"s": t, "flop_util": flops / t / ceil["matmul_flops_per_s"],
                        "byte_util": moved / t / ceil["copy_bytes_per_s"]}
            r = entry[f"scores_{name}"] = _try(run)
            if "s" in r and kw.get("epilogue", True) and (best is None or r["s"] < best[1]["s"]):
                best = (kw, r)
        if best is not None:
            scores = index_scores_pallas(q, w, ik, sc, 0, table, pos, **{**best[0], "write_invisible": True})
            # correctness of the whole path on the XLA slice: kernel scores vs reference scores
            ref = np.asarray(index_scores_reference(qs, ws, index_keys_fp32(ik, sc, 0, table), ps, D))
            got = np.asarray(scores[:, :xla_t])
            fin = np.isfinite(ref)
            entry["scores_max_rel_err"] = float(np.abs(got[fin] - ref[fin]).max() / np.abs(ref[fin]).max())
            entry["scores_inf_pattern_equal"] = bool((np.isneginf(got) == np.isneginf(ref)).all())
            for tiling in args.select_tilings.split(",")[:3]:
                name, f = select_variant(tiling, B * T, N, lengths=pos + 1)
                entry["select_" + name[len("pallas_"):]] = _try(
                    lambda f=f: {"s": chained_time(lambda s_: f(s_, k), scores, n=5 if prefill else 10, repeat=3)})
            sel_best = min((v["s"] for key, v in entry.items() if key.startswith("select_") and "s" in v),
                           default=None)
            if sel_best is not None:
                total = best[1]["s"] + sel_best
                entry["total_s"] = total
                entry["total_flop_util"] = flops / total / ceil["matmul_flops_per_s"]
                entry["total_flop_util_one_call"] = flops / total / ceil["matmul_flops_per_s_one_call"]
                entry["total_byte_util"] = moved / total / ceil["copy_bytes_per_s"]
        if args.fused:
            def fused(q_):
                return indexer_topk_fused(q_, w, ik, sc, 0, table, pos, k)

            def run_fused():
                got, path = jax.jit(lambda q_: indexer_topk_fused(q_, w, ik, sc, 0, table, pos, k, return_path=True))(q)
                want = jax.jit(lambda q_: indexer_topk(q_, w, ik, sc, 0, table, pos, k))(q)
                t = chained_time(fused, q, n=5 if prefill else 10, repeat=3)
                return {"s": t, "flop_util": flops / t / ceil["matmul_flops_per_s"],
                        "flop_util_one_call": flops / t / ceil["matmul_flops_per_s_one_call"],
                        "byte_util": moved / t / ceil["copy_bytes_per_s"],
                        "equal_to_unfused": bool((got == want).all()),
                        "rows_by_path": np.bincount(np.asarray(path).ravel(), minlength=3).tolist()}
            entry["fused"] = _try(run_fused)
        out.append(entry)
        print(f"indexer {label}: " + json.dumps({kk: v for kk, v in entry.items()}, default=str)[:3000], flush=True)
    return out


# ---- moe: grouped expert matmuls (ragged dot) ----------------------------------------------------
MOE_MGPU_TILINGS = "128x128x64x4x1,128x128x64x4x8,64x256x64x4x8"
MOE_DECODE_MGPU_TILINGS = "64x128x64x4x1"
MOE_TOKAMAX_CONFIGS = "default,128x64x128x4xp"
MOE_BLOCKED_TILINGS = "128x64x4x8,64x128x4x8,128x128x4x8"
MOE_DECODE_BLOCKED_TILINGS = "64x128x4x1,64x64x4x1"


def _blocked_variant(spec: str, E: int, sizes, proj: str):
    """Our grouped_matmul kernel (pallas_kernels/moe) on the block plan's padded layout of rows sorted
    by expert: 'bm x bn x stages x grid_block_n'. gate_up splits the weights' columns into gate and up
    and runs the fused SiLU * up epilogue (out has half the columns). Returns (fn(x, w), slot_row,
    plan+gather fn(x)): fn takes the padded rows and the weights (gate_up: gate and up apart)."""
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.moe import Tiling, block_plan, grouped_matmul
    from pallas_kernels.row_gather import gather_rows
    bm, bn, st, gbn = map(int, spec.split("x"))
    t = Tiling(block_m=bm, block_n=bn, stages=st, grid_block_n=gbn)
    fe = jnp.asarray(np.repeat(np.arange(E), sizes), jnp.int32)
    slot_row, row_slot, tile_expert = block_plan(fe, E, bm)

    def f(xp, *w):  # gate_up: (gate, up), split before the timed calls
        return grouped_matmul(xp, w[0], tile_expert, up=w[1] if len(w) > 1 else None, tiling=t)

    def plan_gather(x):
        _, rs, _ = block_plan(fe, E, bm)
        return gather_rows(x, rs)
    return f, slot_row, row_slot, plan_gather


def moe_group_sizes(tokens: int, experts: int, top_k: int, skew: float, seed: int = 0):
    """Rows per expert of a random top-k routing: per-token logits N(0, 1) plus a per-expert
    popularity N(0, skew) (skew 0: balanced in expectation), top-k of the softmax (= of the logits)."""
    import numpy as np
    rng = np.random.default_rng(seed + tokens * 1000 + experts)
    logits = rng.standard_normal((tokens, experts), np.float32) + skew * rng.standard_normal(experts).astype(np.float32)
    top_k = min(top_k, experts)
    top = np.argpartition(-logits, top_k - 1, axis=1)[:, :top_k]
    return np.bincount(top.ravel(), minlength=experts).astype(np.int32)


def _mgpu_variant(tiling: str):
    """'bm x bn x bk x steps x grid_block_n' [+ 't': rhs stored [E, N, K], transpose_rhs=True]."""
    transpose = tiling.endswith("t")
    bm, bn, bk, steps, gbn = map(int, tiling.rstrip("t").split("x"))

    def f(x, w, s):
        from jax.experimental.pallas.ops.gpu.ragged_dot_mgpu import ragged_dot
        return ragged_dot(x, w, group_sizes=s, block_m=bm, block_n=bn, block_k=bk,
                          max_concurrent_steps=steps, grid_block_n=gbn, transpose_rhs=transpose)
    return f, transpose


def _import_tokamax():
    """tokamax, or ImportError. Its benchmarking module imports xprof (a 22 MB wheel not on the GPU box)
    at import time for a kernel-stats tool this bench never calls: a stub stands in when xprof is
    missing."""
    import importlib.util
    import types
    if importlib.util.find_spec("tokamax") is None:
        raise ImportError("no module named tokamax")
    if "xprof" not in sys.modules and importlib.util.find_spec("xprof") is None:
        stub = types.ModuleType("xprof.cli.tools")
        stub.get_kernel_stats_tool = None
        sys.modules.update({"xprof": types.ModuleType("xprof"), "xprof.cli": types.ModuleType("xprof.cli"),
                            "xprof.cli.tools": stub})
    import tokamax
    return tokamax


def _tokamax_variant(spec: str):
    """'default' (tokamax's autotuning cache, else its heuristics) or 'bm x bn x bk x stages' [x 'p'
    persistent] for the Mosaic GPU ragged dot; returns (fn, op) or raises ImportError."""
    tokamax = _import_tokamax()
    from tokamax._src.ops.ragged_dot import pallas_mosaic_gpu as tkm
    if spec == "default":
        op = tkm.PallasMosaicGpuRaggedDot()
    else:
        parts = spec.split("x")
        bm, bn, bk, st = map(int, parts[:4])
        op = tkm.PallasMosaicGpuRaggedDot(config=tkm.Config(
            block_m=bm, block_n=bn, block_k=bk, num_stages=st, split_k=1, persistent=parts[4:] == ["p"]))
    return (lambda x, w, s: tokamax.ragged_dot(x, w, s, implementation=[op])), op


def moe_check_rows(sizes, rows_each: int = 64):
    """Rows to check against the fp32 reference: up to rows_each of the first non-empty group, the
    largest and the last non-empty one (row ids, their groups)."""
    import numpy as np
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    nz = np.flatnonzero(sizes)
    groups = sorted({int(nz[0]), int(np.argmax(sizes)), int(nz[-1])})
    ids, gids = [], []
    for g in groups:
        n = min(rows_each, int(sizes[g]))
        ids += list(range(int(starts[g]), int(starts[g]) + n))
        gids += [g] * n
    return np.asarray(ids), np.asarray(gids)


def bench_moe_case(args, ceil, label, tokens, E, proj, K, N, mgpu_tilings, tokamax_cfgs, decode=False,
                   blocked_tilings=()):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from cpkv_jax.perf import fitted_pipelined_time

    gpu = jax.default_backend() == "gpu"
    sizes_np = moe_group_sizes(tokens, E, args.moe_top_k, args.moe_skew)
    rows = int(sizes_np.sum())
    flops = 2.0 * rows * K * N
    touched = int((sizes_np > 0).sum())
    kx, kw = jax.random.split(jax.random.key(tokens * 7 + E * 3 + K))
    x = jax.random.normal(kx, (rows, K), jnp.bfloat16)
    w = (jax.random.normal(kw, (E, K, N), jnp.float32) * K ** -0.5).astype(jnp.bfloat16)
    sizes = jnp.asarray(sizes_np)
    wbytes = touched * K * N * 2
    moved = wbytes + rows * K * 2 + rows * N * 2
    entry = {"case": label, "proj": proj, "tokens": tokens, "experts": E, "top_k": args.moe_top_k,
             "rows": rows, "K": K, "N": N, "flops": flops, "touched_experts": touched,
             "touched_weight_bytes": wbytes, "bytes_min": moved,
             "group_max_over_mean": float(sizes_np.max() / sizes_np.mean()), "empty_groups": E - touched}
    ids, gids = moe_check_rows(sizes_np)
    ref = np.concatenate([np.asarray(jnp.dot(x[jnp.asarray(ids[gids == g])].astype(jnp.float32),
                                             w[g].astype(jnp.float32), precision=jax.lax.Precision.HIGHEST))
                          for g in dict.fromkeys(gids.tolist())])  # fp32, one group at a time
    scale = float(np.abs(ref).max())

    def measure(fn, *a, check=True):
        f = jax.jit(fn)
        out = {}
        if check:
            got = np.asarray(f(*a)[jnp.asarray(ids)].astype(jnp.float32))
            out["max_rel_err"] = float(np.abs(got - ref).max() / scale)
        s = fitted_pipelined_time(f, *a)
        out.update({"s": s, "tflops": flops / s / 1e12, "bytes_per_s": moved / s,
                    "matmul_util": flops / s / ceil["matmul_flops_per_s"],
                    "copy_util": moved / s / ceil["copy_bytes_per_s"]})
        return out

    if not decode:  # cuBLAS on the same FLOPs: the rate this shape can reach
        entry["dense_same_flops"] = _try(lambda: measure(lambda a, b: jnp.dot(a, b), x, w[0], check=False))
    if not args.moe_no_lax:
        entry["lax_ragged_dot"] = _try(lambda: measure(lambda a, b, s: jax.lax.ragged_dot(a, b, s), x, w, sizes))
    w_t = None
    for tiling in mgpu_tilings:
        name = "mgpu_" + tiling
        if not gpu:
            entry[name] = {"error": "needs GPU (Mosaic GPU kernel)"}
            continue
        f, transpose = _mgpu_variant(tiling)
        if transpose and w_t is None:
            w_t = jnp.swapaxes(w, 1, 2)
        entry[name] = _try(lambda f=f, b=(w_t if transpose else w): measure(f, x, b, sizes))
    for spec in tokamax_cfgs:
        name = "tokamax_" + spec
        try:
            f, op = _tokamax_variant(spec)
        except ImportError as e:  # a missing dependency of an installed tokamax says which
            entry[name] = {"error": f"tokamax not installed ({e})"}
            continue
        except Exception as e:  # e.g. a config tokamax rejects
            entry[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            continue
        if not gpu:
            entry[name] = {"error": "needs GPU (Mosaic GPU kernel)"}
            continue

        def run(f=f, op=op):
            r = measure(f, x, w, sizes)
            r["config"] = str(_try(lambda: op.bind(x, w, group_sizes=sizes).default_config))
            return r
        entry[name] = _try(run)
    for spec in blocked_tilings:
        name = "blocked_" + spec
        if not gpu:
            entry[name] = {"error": "needs GPU (Mosaic GPU kernel)"}
            continue

        def run_blocked(spec=spec):
            f, slot_row, row_slot, plan_gather = _blocked_variant(spec, E, sizes_np, proj)
            xp = jnp.where((row_slot >= 0)[:, None], x[jnp.maximum(row_slot, 0)], 0)
            ws = (w,) if proj != "gate_up" else (w[:, :, :N // 2], w[:, :, N // 2:])
            r = measure(f, xp, *ws, check=False)
            got = np.asarray(jax.jit(f)(xp, *ws)[slot_row[jnp.asarray(ids)]].astype(jnp.float32))
            want = ref
            if proj == "gate_up":  # the fused epilogue: silu(x @ gate) * (x @ up)
                a, b = ref[:, :N // 2], ref[:, N // 2:]
                want = a / (1 + np.exp(-a)) * b
            r["max_rel_err"] = float(np.abs(got - want).max() / np.abs(want).max())
            r["plan_gather_s"] = fitted_pipelined_time(jax.jit(plan_gather), x)
            return r
        entry[name] = _try(run_blocked)
    dense = entry.get("dense_same_flops", {}).get("s")
    for key, v in entry.items():
        if isinstance(v, dict) and "s" in v and dense and key != "dense_same_flops":
            v["vs_dense"] = dense / v["s"]
    cells = []
    for key, v in entry.items():
        if not isinstance(v, dict):
            continue
        if "s" in v:
            rate = (f"{v['bytes_per_s'] / 1e9:.0f} GB/s ({v['copy_util']:.0%})" if decode
                    else f"{v['tflops']:.0f} TF/s" + (f" ({v['vs_dense']:.0%} dense)" if "vs_dense" in v else ""))
            err = f" err {v['max_rel_err']:.1e}" if "max_rel_err" in v else ""
            cells.append(f"{key} {v['s'] * 1e3:.3f} ms {rate}{err}")
        else:
            cells.append(f"{key} ERR {v['error'][:100]}")
    print(f"moe {label} {proj} T={tokens} E={E} rows={rows} K={K} N={N} touched={touched} "
          f"max/mean={entry['group_max_over_mean']:.2f}:\n  " + "\n  ".join(cells), flush=True)
    return entry


def bench_moe(args, ceil, save=lambda out: None):
    """Prefill cases at the first --moe-tokens, decode, then prefill at the other token counts with
    only the fastest Mosaic GPU tiling and tokamax config of the first (compile time is the budget);
    `save` is called after each case so a run cut short keeps what it measured."""
    H, I = args.moe_hidden, args.moe_width
    projs = {"gate_up": (H, 2 * I), "down": (I, H)}
    out = []
    tokens = [int(t) for t in args.moe_tokens.split(",") if t]
    mgpu = [t for t in args.moe_mgpu_tilings.split(",") if t]
    tkcfg = [t for t in args.moe_tokamax_configs.split(",") if t]
    blocked = [t for t in args.moe_blocked_tilings.split(",") if t]
    best = {}

    def fastest(entry, prefix):
        ok = [(v["s"], k[len(prefix):]) for k, v in entry.items() if k.startswith(prefix) and "s" in v]
        return [min(ok)[1]] if ok else []
    for E in [int(e) for e in args.moe_experts.split(",") if e]:
        for proj, (K, N) in projs.items():
            e = bench_moe_case(args, ceil, "prefill", tokens[0], E, proj, K, N, mgpu, tkcfg,
                               blocked_tilings=blocked)
            best[E, proj] = (fastest(e, "mgpu_") or mgpu[:1], fastest(e, "tokamax_") or tkcfg[:1],
                             fastest(e, "blocked_") or blocked[:1])
            out.append(e)
            save(out)
    for T in [int(t) for t in args.moe_decode_tokens.split(",") if t]:
        for proj, (K, N) in projs.items():
            out.append(bench_moe_case(args, ceil, "decode", T, args.moe_decode_experts, proj, K, N,
                                      [t for t in args.moe_decode_mgpu_tilings.split(",") if t], tkcfg[:1],
                                      decode=True,
                                      blocked_tilings=[t for t in args.moe_decode_blocked_tilings.split(",") if t]))
            save(out)
    for T in tokens[1:]:
        for E in [int(e) for e in args.moe_experts.split(",") if e]:
            for proj, (K, N) in projs.items():
                m, t, b = best.get((E, proj), (mgpu[:1], tkcfg[:1], blocked[:1]))
                out.append(bench_moe_case(args, ceil, "prefill", T, E, proj, K, N,
                                          mgpu if args.moe_all_tilings else m,
                                          tkcfg if args.moe_all_tilings else t,
                                          blocked_tilings=blocked if args.moe_all_tilings else b))
                save(out)
    return out


def sparse_mla_inputs(N: int, K: int, P: int, causal: bool, H: int = 64, C: int = 512, R: int = 64, seed: int = 0):
    """GLM-5's absorbed attention operands, bf16: queries [N, H, C] / [N, H, R], a one-layer pool of P
    slots, and each query's K selected slots (causal: query t selects min(t + 1, K) of slots 0..t,
    the rest -1, as the indexer leaves them; else K distinct slots of the pool). Returns the operands
    and the number of selected rows."""
    import jax
    import jax.numpy as jnp
    kq, kl, kr, ks = jax.random.split(jax.random.key(seed), 4)
    q_lat = (0.05 * jax.random.normal(kq, (N, H, C))).astype(jnp.bfloat16)
    q_rope = (0.05 * jax.random.normal(kr, (N, H, R))).astype(jnp.bfloat16)
    latent = jax.random.normal(kl, (1, P, C), jnp.bfloat16)
    k_rope = jax.random.normal(kr, (1, P, R), jnp.bfloat16)
    if causal:
        t = jnp.arange(N, dtype=jnp.int32)[:, None]
        # K distinct slots of 0..t: a random offset walk that wraps within t + 1 (exact-once when t + 1 <= K)
        start = jax.random.randint(ks, (N, 1), 0, 1 << 20)
        lane = jnp.arange(K, dtype=jnp.int32)[None, :]
        stride = jnp.maximum((t + 1) // K, 1)
        slots = jnp.where(lane <= t, (start + lane * stride) % (t + 1), -1).astype(jnp.int32)
        selected = int(jnp.sum(jnp.minimum(jnp.arange(N) + 1, K)))
    else:
        slots = jax.vmap(lambda k: jax.random.choice(k, P, (K,), replace=False))(jax.random.split(ks, N)).astype(jnp.int32)
        selected = N * K
    return (q_lat, q_rope, latent, k_rope, 0, slots, 0.1), selected


def _expanded_attention(q_nope, q_rope, lat, rope, w_uk, w_uv, scale):
    """The expanded path's math for one request over every visible key (models/attention.py), causal."""
    import jax
    import jax.numpy as jnp
    k_nope = jnp.einsum("sc,chd->shd", lat, w_uk)
    v = jnp.einsum("sc,chd->shd", lat, w_uv)
    s = (jnp.einsum("thd,shd->hts", q_nope, k_nope) + jnp.einsum("thr,sr->hts", q_rope, rope)) * scale
    T = q_nope.shape[0]
    s = jnp.where(jnp.tril(jnp.ones((T, T), bool))[None], s.astype(jnp.float32), jnp.finfo(jnp.float32).min)
    return jnp.einsum("hts,shd->thd", jax.nn.softmax(s, axis=-1).astype(lat.dtype), v)


MGPU_SCORES = {"mgpu": "both", "mgpu_alt": "alternate", "mgpu_split": "split_keys"}   # kernel_mgpu's `scores`


def traced_device_time(fn, arg_sets, reps: int = 5) -> dict:
    """fn over arg_sets in one executable (as batched_time), `reps` runs under the JAX profiler: the
    device's busy time per call (the sum of its ops, without the launch gaps batched_time's wall
    keeps), the mean time of its costliest op, and each kind of op's time per call. With XLA's command
    buffers on, the trace's ops are the buffers that hold the call's ops (--command-buffers-off)."""
    import tempfile

    import jax

    from scripts.profile_prefill import device_op_times
    many = jax.jit(lambda sets: [fn(*a) for a in sets])
    jax.block_until_ready(many(arg_sets))
    trace_dir = tempfile.mkdtemp(prefix="cpkv-kernel-profile-")
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for _ in range(reps):
            out = many(arg_sets)
        jax.block_until_ready(out)
    ops, _, lanes = device_op_times(trace_dir)
    if not ops:
        raise RuntimeError(f"the trace in {trace_dir} holds no device ops")
    calls = reps * len(arg_sets)
    kinds: dict = {}          # the argument sets' copies of one op (fusion.3, fusion.7, ...) as one kind
    for (_, name, _), (t, n) in ops.items():
        kind = kinds.setdefault(re.sub(r"\.\d+$", "", name), [0.0, 0])
        kind[0] += t
        kind[1] += n
    top = sorted(kinds.items(), key=lambda kv: -kv[1][0])[:6]
    (_, top_name, _), (top_t, top_n) = max(ops.items(), key=lambda kv: kv[1][0] / kv[1][1])
    return {"device_s": sum(t for t, _ in ops.values()) / 1e6 / calls,
            "top_op_s": top_t / top_n / 1e6, "top_op": top_name,
            "lanes": lanes,
            "ops": [{"op": name, "us_per_call": t / calls, "events_per_call": n / calls} for name, (t, n) in top]}


def bench_sparse_mla(args, ceil):
    """Prefill (causal, one request of N tokens, k = 2048) and decode (N queries over a 131072-slot
    pool): each kernel tiling, the jnp composition (gather + einsums; prefill on a slice of the
    queries), and at prefill the expanded path it replaces on the same tokens. TFLOP/s counts the
    selected rows only (2 H (C + R) + 2 H C per row); bandwidth counts the selected rows' bytes once."""
    import jax
    import jax.numpy as jnp

    from cpkv_jax.perf import batched_time, fitted_pipelined_time, print_table
    from pallas_kernels.sparse_mla import Tiling, sparse_mla_pallas, sparse_mla_reference
    from pallas_kernels.sparse_mla.dispatch import row_splits_for, tiling_for
    from pallas_kernels.sparse_mla.kernel_mgpu import sparse_mla_mgpu, sparse_mla_mgpu_rows
    H, C, R, K = 64, 512, 64, args.k
    out, rows = [], [["case", "variant", "ms", "TFLOP/s", "GB/s", "share", "err"]]
    cases = [("prefill", int(n)) for n in args.mla_prefill.split(",") if n]
    cases += [("decode", int(n)) for n in args.mla_decode.split(",") if n]
    for kind, N in cases:
        prefill = kind == "prefill"
        ops, selected = sparse_mla_inputs(N, K, N if prefill else 131072, causal=prefill)
        flops = selected * (2 * H * (C + R) + 2 * H * C)
        nbytes = selected * (C + R) * 2
        check = slice(0, min(N, 256))
        want = jax.jit(sparse_mla_reference, static_argnums=(4, 6))(
            ops[0][check], ops[1][check], *ops[2:5], ops[5][check], ops[6]).astype(jnp.float32)
        entry = {"case": kind, "queries": N, "k": K, "flops": flops, "bytes": nbytes}
        variants = {}
        for spec in [t for t in (args.mla_tilings if prefill else args.mla_decode_tilings).split(",") if t]:
            name, *opts = spec.split(":")
            copy_threads = {"row_threads": int(o[1:]) for o in opts if o.startswith("r")}   # ":rT"
            if "p" in opts:                                                                   # ":p"
                copy_threads["l2_prefetch"] = True
            if "k" in opts:                         # ":k" the slots as packed (decode's random slots are)
                copy_threads["packed"] = True
            if name in MGPU_SCORES:                 # the Mosaic GPU prefill kernel (one program per query)
                variants[spec] = jax.jit(functools.partial(sparse_mla_mgpu, scores=MGPU_SCORES[name], **copy_threads),
                                         static_argnums=(4, 6))
                continue
            if name == "mgpu_rows":                 # the same, each query's rows cut in shares over programs
                S = next((int(o) for o in opts if o.isdigit()), row_splits_for(N, K))
                variants[spec] = jax.jit(functools.partial(sparse_mla_mgpu_rows, row_splits=S, **copy_threads),
                                         static_argnums=(4, 6))
                continue
            if spec == "dispatch":
                t = tiling_for(N, H, K)
            else:
                bh, bk, warps, stages, *sp = (int(v) for v in spec.split(":"))
                t = Tiling(block_h=bh, block_k=bk, num_warps=warps, num_stages=stages, splits=sp[0] if sp else 1)
            variants[f"kernel_{spec}"] = jax.jit(lambda *a, t=t: sparse_mla_pallas(*a, tiling=t), static_argnums=(4, 6))
        # decode: 8 calls over distinct queries and rows in one executable (a call is shorter than its
        # host dispatch, and repeating one call's rows would find them in L2)
        arg_sets = [] if prefill else [
            (jax.random.permutation(k, ops[0], axis=1), ops[1], ops[2], ops[3], jax.random.permutation(k, ops[5], axis=1))
            for k in jax.random.split(jax.random.key(7), 8)]
        for name, fn in variants.items():
            def one(fn=fn):
                call = lambda ql, qr, lat, rope, sl, fn=fn: fn(ql, qr, lat, rope, ops[4], sl, ops[6])  # noqa: E731
                sec = fitted_pipelined_time(fn, *ops) if prefill else batched_time(call, arg_sets)
                got = fn(ops[0][check], ops[1][check], *ops[2:5], ops[5][check], ops[6]).astype(jnp.float32)
                err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
                if args.mla_device_time and not prefill:
                    return {"s": sec, "err": err, **traced_device_time(call, arg_sets)}
                return {"s": sec, "err": err}
            entry[name] = _try(one)
        # the jnp composition (the model's path off the GPU kernel), on a slice where its gather fits
        m = min(N, 1024)
        sl = (ops[0][:m], ops[1][:m], *ops[2:5], ops[5][:m], ops[6])
        ref = jax.jit(sparse_mla_reference, static_argnums=(4, 6))
        entry["jnp_composition"] = _try(lambda: {"s": fitted_pipelined_time(ref, *sl) * N / m, "scaled_from": m})
        if prefill and N <= 8192:
            kx = jax.random.split(jax.random.key(1), 2)
            w_uk = (0.05 * jax.random.normal(kx[0], (C, H, 192))).astype(jnp.bfloat16)
            w_uv = (0.05 * jax.random.normal(kx[1], (C, H, 256))).astype(jnp.bfloat16)
            q_nope = (0.05 * jax.random.normal(kx[0], (N, H, 192))).astype(jnp.bfloat16)
            exp_fn = jax.jit(_expanded_attention, static_argnums=(6,))
            entry["expanded_path"] = _try(lambda: {"s": fitted_pipelined_time(exp_fn, q_nope, ops[1], ops[2][0], ops[3][0],
                                                                   w_uk, w_uv, 0.1)})
        out.append(entry)
        for name, v in entry.items():
            if isinstance(v, dict):
                if "s" in v:
                    tf, gb = flops / v["s"] / 1e12, nbytes / v["s"] / 1e9
                    share = (f"{tf * 1e12 / ceil['matmul_flops_per_s']:.0%}" if prefill
                             else f"{gb * 1e9 / ceil['copy_bytes_per_s']:.0%}")
                    rows.append([f"{kind} {N}", name, f"{v['s'] * 1e3:.3f}", f"{tf:.0f}", f"{gb:.0f}", share,
                                 f"{v.get('err', float('nan')):.1e}"])
                    if "device_s" in v:       # the same call by the device's busy time (no launch gaps)
                        busy, top = v["device_s"], v["top_op_s"]
                        rows.append([f"{kind} {N}", f"{name} (device busy; costliest op {v['top_op']} {top * 1e6:.1f} us)",
                                     f"{busy * 1e3:.3f}", f"{flops / busy / 1e12:.0f}", f"{nbytes / busy / 1e9:.0f}",
                                     f"{nbytes / busy / ceil['copy_bytes_per_s']:.0%}", ""])
                else:
                    rows.append([f"{kind} {N}", name, v.get("error", "")[:80], "", "", "", ""])
    print_table(rows)
    for entry in out:          # where a decode call's device time goes, op by op (the trace's device lanes)
        for name, v in entry.items():
            if isinstance(v, dict) and v.get("ops"):
                print(f"{entry['case']} {entry['queries']} {name}: lanes {v['lanes']}; "
                      + "; ".join(f"{o['op']} {o['us_per_call']:.1f} us x{o['events_per_call']:g}" for o in v["ops"]))
    return out


def expert_mlp_summed(x, fe, gate, up, down, k, *, policy, scales=None):
    """What the model runs of the routed experts: expert_mlp, then each token's outputs weighted (fixed
    weights 1/k) and summed (ExpertRows.weighted_sum)."""
    import jax.numpy as jnp

    from pallas_kernels.moe import expert_mlp
    w = jnp.full((x.shape[0], k), 1.0 / k, jnp.float32)
    return expert_mlp(x, fe, gate, up, down, k, policy=policy, scales=scales).weighted_sum(w, policy)


def bench_moe_rows(args, ceil):
    """The MoE's row movement around the grouped matmuls (GLM-5 widths, top-8, uniform routing, the
    block plan's 128-row tiles): the gather of the tokens into the plan's padded rows (bf16, and fp8
    as bytes), and the combine of each token's k expert rows into its weighted fp32 sum: the slot-order
    gather + weighted sum the model ran before vs combine_rows (tilings). Bytes: rows written + read
    (gather), slot rows read + fp32 sums written (combine), against the copy rate."""
    import jax
    import jax.numpy as jnp

    from cpkv_jax.perf import fitted_pipelined_time, print_table
    from pallas_kernels.moe import block_plan
    from pallas_kernels.row_gather import combine_rows, combine_rows_pallas, gather_rows, gather_rows_pallas
    D, k, T = args.moe_hidden, args.moe_top_k, int(args.moe_tokens.split(",")[0])
    out, rows = [], [["case", "variant", "ms", "GB/s", "share", "err"]]
    for E in (16, 256):
        keys = jax.random.split(jax.random.key(E), 4)
        x = jax.random.normal(keys[0], (T, D), jnp.bfloat16)
        fe = jax.random.randint(keys[1], (T * k,), 0, E, jnp.int32)
        w = jax.random.uniform(keys[2], (T, k), jnp.float32)
        slot_row, row_slot, _ = block_plan(fe, E, 128)
        src = jnp.where(row_slot >= 0, row_slot // k, -1)
        P = int(src.shape[0])
        used = int((src >= 0).sum())
        gather_bytes = P * D * 2 + used * D * 2
        entry = {"tokens": T, "experts": E, "padded_rows": P, "used_rows": used}

        def timed(name, fn, nbytes, want=None):
            def one():
                sec = fitted_pipelined_time(fn)
                err = 0.0 if want is None else float(jnp.max(jnp.abs(fn().astype(jnp.float32) - want))
                                                      / jnp.max(jnp.abs(want)))
                return {"s": sec, "err": err, "bytes": nbytes}
            entry[name] = v = _try(one)
            if "s" in v:
                rows.append([f"{T}x{E}", name, f"{v['s'] * 1e3:.3f}", f"{nbytes / v['s'] / 1e9:.0f}",
                             f"{nbytes / v['s'] / ceil['copy_bytes_per_s']:.0%}", f"{v['err']:.1e}"])
            else:
                rows.append([f"{T}x{E}", name, v["error"][:80], "", "", ""])
            print("  ".join(rows[-1]), flush=True)

        want_x = jax.jit(gather_rows)(x, src).astype(jnp.float32)
        timed("gather_dispatch", jax.jit(lambda: gather_rows(x, src)), gather_bytes, want_x)
        x8 = jax.lax.bitcast_convert_type(x.astype(jnp.float8_e4m3fn), jnp.uint8)
        timed("gather_dispatch_fp8", jax.jit(lambda: gather_rows(x8, src)), gather_bytes // 2)
        for spec in args.moe_gather_tilings.split(","):
            br, bc, steps, stages = (list(map(int, spec.split("x"))) + [1, 0])[:4]
            timed(f"gather_{spec}", jax.jit(lambda br=br, bc=bc, steps=steps, stages=stages: gather_rows_pallas(
                x, src, block_rows=br, block_cols=bc, steps=steps, num_stages=stages or None)), gather_bytes, want_x)
        y = jax.random.normal(keys[3], (P, D), jnp.bfloat16)
        idx = slot_row.reshape(T, k)
        combine_bytes = T * k * D * 2 + T * D * 4
        want = jax.jit(combine_rows)(y, idx, w)

        def slot_order_sum():
            ys = gather_rows(y, slot_row).reshape(T, k, D)
            return (ys * w.astype(y.dtype)[..., None]).astype(jnp.float32).sum(axis=1)
        timed("combine_slot_order_sum", jax.jit(slot_order_sum), combine_bytes + 2 * T * k * D * 2, want)
        timed("combine_dispatch", jax.jit(lambda: combine_rows(y, idx, w)), combine_bytes, want)
        for spec in args.moe_combine_tilings.split(","):
            br, bc, warps = (list(map(int, spec.split("x"))) + [0])[:3]
            timed(f"combine_{spec}", jax.jit(lambda br=br, bc=bc, warps=warps: combine_rows_pallas(
                y, idx, w, block_rows=br, block_cols=bc, num_warps=warps or None)), combine_bytes, want)
        out.append(entry)
    print_table(rows)
    return out


def bench_moe_fp8(args, ceil):
    """The routed experts' MLP through the dispatch with GLM-5's widths (hidden 6144, expert width 2048,
    top-8, uniform routing): bf16 weights (the bf16 kernel), fp8 weights dequantized per call (what runs
    when the fp8 kernel does not), fp8 weights through the fp8 kernel; prefill TFLOP/s (6 x slots x
    D x I) against the bf16 matmul rate, decode GB/s over the touched experts' fp8 bytes against the
    copy rate. Weights are random e4m3 values with random block scales, made on the device."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from cpkv_jax.perf import fitted_pipelined_time, print_table
    from pallas_kernels.moe import expert_shape, fp8_experts_as_plain
    from pallas_kernels.policy import KernelPolicy
    D, I, k = args.moe_hidden, args.moe_width, args.moe_top_k
    run = jax.jit(expert_mlp_summed, static_argnums=5, static_argnames="policy")
    out, rows = [], [["case", "variant", "ms", "TFLOP/s", "GB/s", "share", "device ms (share)", "err"]]
    cases = [("prefill", int(t), int(e)) for t in args.moe_tokens.split(",")[:1] if t for e in (16, 256)]
    cases += [("decode", int(t), args.moe_decode_experts) for t in args.moe_decode_tokens.split(",") if t]
    for kind, T, E in cases:
        keys = jax.random.split(jax.random.key(T * 1000 + E), 8)
        fp8 = []
        for i, (K, N) in enumerate(((D, I), (D, I), (I, D))):   # fp8: K-major [E, N, K], as the model stores them
            q = jax.random.normal(keys[i], expert_shape(E, K, N, fp8=True), jnp.bfloat16) * 64
            q = q.astype(jnp.float8_e4m3fn)
            sc = jax.random.uniform(keys[3 + i], (E, N // 128, K // 128), jnp.float32, 0.5, 1.5) * K ** -0.5 / 64
            fp8.append((q, sc))
        scales = tuple(sc for _, sc in fp8)
        q8 = tuple(q for q, _ in fp8)
        bf16 = tuple(fp8_experts_as_plain(q, sc, jnp.bfloat16) for q, sc in fp8)   # [E, K, N]
        x = jax.random.normal(keys[6], (T, D), jnp.bfloat16)
        fe = jax.random.randint(keys[7], (T * k,), 0, E, jnp.int32)
        slots = T * k
        flops = 6.0 * slots * D * I
        touched = int(jnp.unique(fe).shape[0])
        nbytes = touched * 3 * D * I                      # fp8 bytes of the touched experts
        entry = {"case": kind, "tokens": T, "experts": E, "flops": flops, "touched_experts": touched}
        want = run(x, fe, *bf16, k, policy=KernelPolicy()).astype(jnp.float32)
        variants = {   # name: (weights, policy, scales)
            "bf16_weights": (bf16, KernelPolicy(moe_compute_wgs=1), None),
            "bf16_weights_2wg": (bf16, KernelPolicy(moe_compute_wgs=2), None),
            "fp8_dequantized": (q8, KernelPolicy(fp8_moe_kernel=False), scales),
            "fp8_kernel_1wg": (q8, KernelPolicy(fp8_moe_compute_wgs=1), scales),
            "fp8_kernel": (q8, KernelPolicy(fp8_moe_compute_wgs=2), scales),
            "fp8_kernel_pairwise_plan": (q8, KernelPolicy(moe_pairwise_plan_slots=slots), scales),
        }
        chosen = args.moe_fp8_variants.split(",") if args.moe_fp8_variants else list(variants)
        unknown = set(chosen) - set(variants)
        if unknown:
            raise SystemExit(f"--moe-fp8-variants: unknown {sorted(unknown)}; known: {list(variants)}")
        if kind == "prefill":   # the pairwise plan's [S, S] comparisons: decode-sized calls only
            chosen = [name for name in chosen if name != "fp8_kernel_pairwise_plan"]
        variants = {name: variants[name] for name in chosen}
        busy_time = args.moe_device_time and kind == "decode"
        if busy_time:   # 8 calls in one executable on distinct tokens and routings (identical ones could be
            #             merged by XLA); bytes over each call's own touched experts
            routed = [(jax.random.normal(jax.random.key(i), (T, D), jnp.bfloat16),
                       jax.random.randint(jax.random.key(100 + i), (T * k,), 0, E, jnp.int32)) for i in range(8)]
            routed_bytes = np.mean([int(jnp.unique(f).shape[0]) for _, f in routed]) * 3 * D * I

        def measure(weights, policy, sc):
            def call(x, fe, *w):
                return run(x, fe, *w[:3], k, policy=policy, scales=w[3:] or None)
            ws = (*weights, *(sc or ()))
            sec = fitted_pipelined_time(lambda: call(x, fe, *ws))
            got = call(x, fe, *ws).astype(jnp.float32)
            timing = {"s": sec, "err": float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))}
            if busy_time:
                busy = traced_device_time(call, [(xi, fi, *ws) for xi, fi in routed])
                timing.update(busy, device_gbps=routed_bytes / busy["device_s"] / 1e9)
            return timing
        for name, spec in variants.items():
            entry[name] = _try(functools.partial(measure, *spec))
        del fp8, q8, bf16, want, variants   # the next case's weights: 256 experts' two sets fill an H100 otherwise
        out.append(entry)
        for name in chosen:
            v = entry[name]
            if "s" in v:
                tf, gb = flops / v["s"] / 1e12, nbytes / v["s"] / 1e9
                share = (f"{tf * 1e12 / ceil['matmul_flops_per_s']:.0%}" if kind == "prefill"
                         else f"{gb * 1e9 / ceil['copy_bytes_per_s']:.0%}")
                busy = (f"{v['device_s'] * 1e3:.3f} ({v['device_gbps'] * 1e9 / ceil['copy_bytes_per_s']:.0%})"
                        if "device_s" in v else "")
                rows.append([f"{kind} {T}x{E}", name, f"{v['s'] * 1e3:.3f}", f"{tf:.0f}", f"{gb:.0f}", share,
                             busy, f"{v['err']:.1e}"])
            else:
                rows.append([f"{kind} {T}x{E}", name, v["error"][:80], "", "", "", "", ""])
    print_table(rows)
    return out


def bench_fp8_linear(args, ceil):
    """GLM-5's fp8 dense linears (pallas_kernels.fp8_linear.GLM5_LINEARS) at decode row counts: the
    fp8 kernel with one program per output tile and with K split over one wave (split_k), XLA's dot
    on the weight dequantized at use, and XLA's bf16 dot on a bf16 copy of it (a bf16 model's linear).
    GB/s over the weight bytes each variant reads (fp8: N x K, bf16: 2 N x K), against the copy rate;
    error against fp8_linear_reference. A call is shorter than its host dispatch, so each variant is
    timed by batched_time over 8 calls on distinct weights in one executable (a repeated weight of a
    few MB would come from L2)."""
    import functools

    import jax
    import jax.numpy as jnp

    from cpkv_jax.perf import batched_time, print_table
    from models.fp8 import dequantize
    from pallas_kernels.fp8_linear import GLM5_LINEARS, fp8_linear, fp8_linear_reference, linear_tiling
    out, rows = [], [["linear", "rows", "variant", "splits", "us", "GB/s", "share", "err"]]
    names = args.linear_names.split(",") if args.linear_names else list(GLM5_LINEARS)
    if set(names) - set(GLM5_LINEARS):
        raise SystemExit(f"--linear-names: unknown {sorted(set(names) - set(GLM5_LINEARS))}; known: {list(GLM5_LINEARS)}")
    for name in names:
        K, N = GLM5_LINEARS[name]
        weights = []                                       # 8 distinct (w, s, the bf16 model's [K, N] weight)
        for key in jax.random.split(jax.random.key(K + N), 8):
            kw, ks = jax.random.split(key)
            w = (jax.random.normal(kw, (N, K), jnp.bfloat16) * 64).astype(jnp.float8_e4m3fn)
            s = jax.random.uniform(ks, (-(-N // 128), K // 128), jnp.float32, 0.5, 1.5) * K ** -0.5 / 64
            weights.append((w, s, dequantize(w, s, jnp.bfloat16).T))
        for T in map(int, args.linear_rows.split(",")):
            xs = [jax.random.normal(k, (T, K), jnp.bfloat16) for k in jax.random.split(jax.random.key(T), 8)]
            fp8_sets = [(x, w, s) for x, (w, s, _) in zip(xs, weights)]
            want = fp8_linear_reference(*fp8_sets[0]).astype(jnp.float32)
            variants = {
                "kernel": (fp8_linear, fp8_sets, N * K, 1),
                "kernel_split_k": (functools.partial(fp8_linear, split_k=True), fp8_sets, N * K,
                                   linear_tiling(T, N, K, split_k=True).k_splits),
                "xla_dequantized": (lambda x, w, s: jnp.dot(x, dequantize(w, s, x.dtype).T), fp8_sets, N * K, 1),
                "xla_bf16": (jnp.dot, [(x, wb) for x, (_, _, wb) in zip(xs, weights)], 2 * N * K, 1),
            }
            entry = {"linear": name, "K": K, "N": N, "rows": T}
            for variant, (fn, arg_sets, nbytes, splits) in variants.items():
                def one(fn=fn, arg_sets=arg_sets):
                    sec = batched_time(fn, arg_sets)
                    got = jax.jit(fn)(*arg_sets[0]).astype(jnp.float32)
                    err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
                    return {"s": sec, "err": err, "bytes": nbytes, "k_splits": splits}
                entry[variant] = v = _try(one)
                if "s" in v:
                    rows.append([name, str(T), variant, str(splits), f"{v['s'] * 1e6:.1f}",
                                 f"{nbytes / v['s'] / 1e9:.0f}", f"{nbytes / v['s'] / ceil['copy_bytes_per_s']:.0%}",
                                 f"{v['err']:.1e}"])
                else:
                    rows.append([name, str(T), variant, str(splits), v["error"][:80], "", "", ""])
                print("  ".join(rows[-1]), flush=True)
            out.append(entry)
    print_table(rows)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[16384, 65536, 262144])
    p.add_argument("--hidden", type=int, default=6144)
    p.add_argument("--gather-tilings", default="32x512,16x1024x8x3,16x1024,64x256",
                   help="row gather tilings to time: rows x columns per block [x blocks per program "
                        "[x pipeline stages]]")
    p.add_argument("--k", type=int, default=2048)
    p.add_argument("--only", default="compaction,selection,indexer")
    p.add_argument("--select-cases", default=",".join(f"{r}x{n}" for r, n in SELECT_CASES),
                   help="rows x width of the selection cases")
    p.add_argument("--select-tilings", default=SELECT_TILINGS,
                   help="selection tilings, comma-separated bits:chunk:capacity:sample:sub:warps:stages:segments "
                        "or 'dispatch' or resident:bits:warps")
    p.add_argument("--score-tilings", default=SCORE_TILINGS,
                   help="indexer scores tilings, comma-separated block_m:block_n:steps:warps:stages[:gather], "
                        "'dispatch', 'indexer', mgpu[:block_t:stages] or paged[:blocks_per_program:stages]")
    p.add_argument("--indexer-cases", default=",".join(c[0] for c in INDEXER_CASES),
                   help="indexer cases to run, comma-separated labels")
    p.add_argument("--fused", action="store_true",
                   help="also time indexer_topk_fused (no [T, S] scores in HBM) against the unfused path")
    p.add_argument("--score-breakdown", action="store_true",
                   help="also time the first scores tiling with the keys read through the page table in the "
                        "kernel, and without the relu/weight/scale epilogue")
    p.add_argument("--select-stages", action="store_true",
                   help="also time the first tiling stopped after each stage (bracket, filter, threshold)")
    p.add_argument("--moe-tokens", default="8192,32768",
                   help="prefill tokens, comma-separated; all tilings run at the first, only the fastest "
                        "at the others (unless --moe-all-tilings); drop 32768 to save time")
    p.add_argument("--moe-experts", default="16,64,256", help="routed experts of the prefill cases")
    p.add_argument("--moe-top-k", type=int, default=8)
    p.add_argument("--moe-hidden", type=int, default=6144)
    p.add_argument("--moe-width", type=int, default=2048, help="expert width (gate/up: 2 x width columns)")
    p.add_argument("--moe-skew", type=float, default=1.0,
                   help="std of the per-expert popularity added to the routing logits (0: balanced)")
    p.add_argument("--moe-decode-tokens", default="1,8,64")
    p.add_argument("--moe-decode-experts", type=int, default=256)
    p.add_argument("--moe-fp8-variants", default="",
                   help="moe_fp8: comma-separated variants to time (default: all of bf16_weights, bf16_weights_2wg, "
                        "fp8_dequantized, fp8_kernel_1wg, fp8_kernel, and at decode fp8_kernel_pairwise_plan)")
    p.add_argument("--moe-mgpu-tilings", default=MOE_MGPU_TILINGS,
                   help="jax's ragged_dot_mgpu tilings (prefill), block_m x block_n x block_k x "
                        "max_concurrent_steps x grid_block_n, a trailing 't' for weights stored [E, N, K] "
                        "(transpose_rhs)")
    p.add_argument("--moe-decode-mgpu-tilings", default=MOE_DECODE_MGPU_TILINGS)
    p.add_argument("--moe-tokamax-configs", default=MOE_TOKAMAX_CONFIGS,
                   help="tokamax Mosaic GPU ragged dot configs: 'default' (its cache, else heuristics) or "
                        "block_m x block_n x block_k x stages [x p (persistent)]; decode runs the first only")
    p.add_argument("--moe-blocked-tilings", default=MOE_BLOCKED_TILINGS,
                   help="our grouped_matmul kernel's tilings (prefill): block_m x block_n x stages x grid_block_n")
    p.add_argument("--moe-decode-blocked-tilings", default=MOE_DECODE_BLOCKED_TILINGS)
    p.add_argument("--moe-no-lax", action="store_true", help="skip lax.ragged_dot (slow: up to 0.5 s a call)")
    p.add_argument("--moe-all-tilings", action="store_true",
                   help="run every tiling at every prefill token count, not only the fastest of the first")
    p.add_argument("--moe-small", action="store_true",
                   help="tiny shapes and ceilings (CPU smoke test: lax.ragged_dot only)")
    p.add_argument("--moe-gather-tilings", default="16x1024x8x3,32x512,64x512,32x1024x4x3,8x2048x8x3,16x512x8x3",
                   help="moe_rows: row gather tilings (as --gather-tilings)")
    p.add_argument("--moe-combine-tilings", default="16x512,8x512,32x512,16x1024,8x1024,16x512x8,32x512x8,8x1024x8",
                   help="moe_rows: combine_rows tilings, rows x columns [x warps]")
    p.add_argument("--mla-prefill", default="8192,32768", help="sparse_mla prefill queries (one causal request)")
    p.add_argument("--mla-decode", default="1,8,64", help="sparse_mla decode queries")
    p.add_argument("--mla-tilings", default="mgpu,mgpu_alt,mgpu_split,dispatch,64:32:8:2,64:64:8:2,64:32:4:2,64:16:4:3,64:32:8:3",
                   help="sparse MLA prefill variants: Triton tilings block_h:block_k:warps:stages[:splits], 'dispatch' "
                        "(the Triton tiling the dispatch picks), 'mgpu', 'mgpu_alt' or 'mgpu_split' (the Mosaic GPU "
                        "kernel, its scores computed by both warpgroups, by each in turn, or split by rows; "
                        "':rT' after one: T threads a row in the row copies; ':p': the copies' L2::256B prefetch hint; "
                        "':k': the slots taken as packed, selected first, as the model passes them)")
    p.add_argument("--moe-device-time", action="store_true",
                   help="moe_fp8 decode: also each variant's device busy time per call from a profile (8 calls on "
                        "distinct routings in one executable; the ops' sum, without launch gaps) and its share of "
                        "the copy rate over the touched experts' fp8 bytes")
    p.add_argument("--mla-device-time", action="store_true",
                   help="sparse MLA decode: also each variant's device busy time per call from a profile (the ops' "
                        "sum, without the launch gaps of the timed executable) and its costliest op")
    p.add_argument("--command-buffers-off", action="store_true",
                   help="XLA's command buffers off for the whole run, so that --mla-device-time lists a call's ops "
                        "one by one (with them on, the trace shows the buffer); wall times then include every launch")
    p.add_argument("--mla-decode-tilings", default="mgpu_rows,dispatch,mgpu_rows:1,mgpu_rows:4,64:64:8:2:2",
                   help="sparse MLA decode variants: as --mla-tilings ('dispatch': the Triton kernel with the "
                        "dispatch's tiling, taken with mgpu_sparse_mla_rows off), 'mgpu_rows' (the Mosaic GPU "
                        "kernel with each query's rows cut in dispatch.row_splits_for shares, the default path) "
                        "and 'mgpu_rows:S' (S shares), either with ':rT', ':p' and ':k' as there)")
    p.add_argument("--linear-rows", default="1,8,64", help="fp8_linear: rows of each call")
    p.add_argument("--linear-names", default="", help="fp8_linear: GLM-5 linears to time (default: all)")
    p.add_argument("--json", default="bench_kernels.json")
    args = p.parse_args()
    if args.moe_small:
        args.moe_tokens, args.moe_experts, args.moe_hidden, args.moe_width = "32,64", "8,16", 128, 128
        args.moe_decode_tokens, args.moe_decode_experts = "1,4", 16
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    if args.command_buffers_off:   # before jax starts its backend
        from scripts.profile_prefill import COMMAND_BUFFERS_OFF, add_xla_flags
        add_xla_flags(COMMAND_BUFFERS_OFF)
    import jax

    from cpkv_jax.perf import measure_ceilings

    ceil = measure_ceilings(**({"matmul_n": 256, "copy_mib": 16} if args.moe_small else {}))
    print(f"ceilings (back-to-back calls): bf16 matmul {ceil['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s "
          f"(one call {ceil['matmul_flops_per_s_one_call'] / 1e12:.0f}), copy {ceil['copy_bytes_per_s'] / 1e9:.0f} GB/s "
          f"(one call {ceil['copy_bytes_per_s_one_call'] / 1e9:.0f})", flush=True)
    result = {"ceilings": ceil, "device": str(jax.devices()[0].device_kind)}

    def save(name, part):
        result[name] = part
        Path(args.json).write_text(json.dumps(result, indent=2, default=str) + "\n")
    for name, fn in (("compaction", bench_compaction), ("selection", bench_selection), ("indexer", bench_indexer)):
        if name in args.only.split(","):
            save(name, fn(args, ceil))
    if "moe" in args.only.split(","):
        save("moe", bench_moe(args, ceil, save=lambda part: save("moe", part)))
    if "moe_rows" in args.only.split(","):
        save("moe_rows", bench_moe_rows(args, ceil))
    if "moe_fp8" in args.only.split(","):
        save("moe_fp8", bench_moe_fp8(args, ceil))
    if "sparse_mla" in args.only.split(","):
        save("sparse_mla", bench_sparse_mla(args, ceil))
    if "fp8_linear" in args.only.split(","):
        save("fp8_linear", bench_fp8_linear(args, ceil))
    return 0


if __name__ == "__main__":
    sys.exit(main())
