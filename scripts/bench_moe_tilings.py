"""The routed experts' grouped matmul kernel, one call at a time, over tilings: one compute warpgroup
vs the warp-specialized two, bf16 and fp8 (block-scaled, K-major experts), the gate_up call (SiLU *
up fused) and the down call apart, at GLM-5's widths (hidden 6144, expert width 2048, top-8, uniform
routing): prefill 8192 tokens over 16 and 256 experts, decode 64 tokens over 256. Prints a table
(ms, TFLOP/s, its share of a dense bf16 matmul's rate measured at the start of the same run, GB/s of
the touched experts' weights, max error against the first tiling of its group) and writes JSON (after
every tiling, so a run cut short keeps what it timed).

    python3 scripts/bench_moe_tilings.py --json moe_tilings.json
"""

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from cpkv_jax.perf import fitted_pipelined_time, measure_ceilings, report, save_results
from pallas_kernels.moe import grouped_matmul, quantize_rows
from pallas_kernels.moe.grouped_matmul import Tiling, can_chain, chained, scale_slices
from pallas_kernels.moe.plan import block_plan


def tilings(bm: int, fp8: bool):
    """(gate_up, down) tilings to compare at row tile bm: the first of each is the reference; `_c2`:
    clusters of two programs sharing their x tiles by multicast; `_gN`: N column blocks walked together
    before the next row tiles (grid_block_n, 8 where unnamed); `_pairs`: two column blocks per tile
    (fp8 down: the gate_up call's two-accumulator shape); `_joint`: a step's two products issued together
    (fp8, a warpgroup's part at most 64 x 64); `_sN`: N stages of the K pipeline (decode fp8: more weight
    bytes in flight per SM); `_il`: each step's 64-row gate and up blocks side by side in shared memory,
    one m64n128 product a step (Tiling.interleaved_gate_up); `_n192` (fp8 down): 192-column tiles promoted
    in 64-column slices with their own block scales (scale_slices); `3wg` (where 128-row tiles are timed):
    192-row tiles in three compute warpgroups, over the rows laid out in 192-row tiles (each output
    compared in slot order); `_rm`: 64-row tiles walked row by row (grid_block_n over all column blocks:
    the padded buffer's unused row tiles last, as the dispatch does) instead of column by column.
    Every warp-specialized tiling whose K steps are a multiple of its stages is also timed as `<name>_ch`
    (Tiling.chained_tiles: a program's tiles as one continued pipeline), and every fp8 one as `<name>_u`
    (Tiling.unscaled_probe: the products accumulated in place without block scales, what the tiling takes
    without the per-step promotion; its err is against the group's first `_u`), and every scaled warp-specialized
    fp8 one as `<name>_nf` (Tiling.fence_row_scales off: no proxy fence after a step's row-scale read) and
    `<name>_st` (Tiling.stagger_warpgroups: the compute warpgroups started in turn at a tile's first step), and
    every interleaved gate_up and plain two-warpgroup down one (`_u` too) as `<name>_k2` (Tiling.step_blocks 2:
    two K blocks a step, the first's product added while the second's runs; half the stages, so the same
    bytes in flight) and `<name>_k2s3` (three stages of two blocks), and every unchained warp-specialized one
    as `<name>_np` (Tiling.programs 0: one program a tile, started in order by the hardware, instead of 132
    persistent)."""
    T = lambda bn, st, w, g=8, c=1, pairs=False, joint=False, il=False, rm=False: Tiling(  # noqa: E731
        block_m=bm, block_n=bn, block_k=128 if fp8 else 64, stages=st, compute_wgs=w,
        grid_block_n=g if bm >= 128 else 64 if rm else 1, cluster_n=c, column_pairs=pairs, joint_products=joint,
        interleaved_gate_up=il)
    if bm == 192:     # three compute warpgroups, 64 rows each (fp8; bf16 keeps 128-row tiles)
        if not fp8:
            return {}, {}
        return ({"3wg_n128_g16_il": T(128, 4, 3, 16, il=True), "3wg_n128_g16_c2_il": T(128, 4, 3, 16, 2, il=True)},
                {"3wg_n128_g16": T(128, 4, 3, 16), "3wg_n128_g16_c2": T(128, 4, 3, 16, 2)})
    if fp8 and bm == 128:
        return ({"1wg_n64": T(64, 3, 1), "2wg_n128_g16": T(128, 4, 2, 16), "2wg_n128_g16_c2": T(128, 4, 2, 16, 2),
                 "2wg_n128_g8_c2": T(128, 4, 2, 8, 2),
                 "2wg_n64_g16_joint": T(64, 4, 2, 16, joint=True),
                 "2wg_n128_g16_il": T(128, 4, 2, 16, il=True), "2wg_n128_g16_c2_il": T(128, 4, 2, 16, 2, il=True),
                 "2wg_n128_g16_il_s5": T(128, 5, 2, 16, il=True), "2wg_n128_g16_c2_il_s6": T(128, 6, 2, 16, 2, il=True)},
                {"1wg_n64": T(64, 4, 1), "2wg_n128_g16": T(128, 4, 2, 16), "2wg_n128_g16_c2": T(128, 4, 2, 16, 2),
                 "2wg_n192_g16": T(192, 4, 2, 16), "2wg_n192_g16_c2": T(192, 4, 2, 16, 2),
                 "2wg_n128_g16_pairs_s3": T(128, 3, 2, 16, 1, True),
                 "2wg_n128_g16_c2_pairs_s3": T(128, 3, 2, 16, 2, True),
                 "2wg_n64_g16_pairs_joint": T(64, 4, 2, 16, 1, True, True)})
    if fp8:
        return ({"1wg_n64": T(64, 3, 1), "2wg_n128": T(128, 4, 2), "2wg_n128_c2": T(128, 4, 2, 1, 2),
                 "2wg_n128_c2_s5": T(128, 5, 2, 1, 2), "2wg_n128_c2_joint": T(128, 4, 2, 1, 2, joint=True),
                 "2wg_n256_il": T(256, 4, 2, il=True), "2wg_n256_c2_il": T(256, 4, 2, 1, 2, il=True),
                 "2wg_n128_c2_rm": T(128, 4, 2, 1, 2, rm=True), "2wg_n256_c2_il_rm": T(256, 4, 2, 1, 2, il=True, rm=True)},
                {"1wg_n64": T(64, 4, 1), "2wg_n128": T(128, 4, 2), "2wg_n128_c2": T(128, 4, 2, 1, 2),
                 "2wg_n128_c2_s5": T(128, 5, 2, 1, 2), "2wg_n128_c2_s6": T(128, 6, 2, 1, 2),
                 "2wg_n256_c2_pairs_joint": T(128, 4, 2, 1, 2, True, True),
                 "2wg_n256_c2_pairs_joint_rm": T(128, 4, 2, 1, 2, True, True, rm=True)})
    if bm == 128:
        return ({"1wg_n64": T(64, 4, 1), "2wg_n128_s3": T(128, 3, 2), "2wg_n128_s3_c2": T(128, 3, 2, 8, 2),
                 "2wg_n128_s4": T(128, 4, 2)},
                {"1wg_n128": T(128, 4, 1), "2wg_n256_s3": T(256, 3, 2), "2wg_n256_s3_c2": T(256, 3, 2, 8, 2)})
    return ({"1wg_n128": T(128, 4, 1), "2wg_n128": T(128, 4, 2), "1wg_n128_rm": T(128, 4, 1, rm=True)},
            {"1wg_n128": T(128, 4, 1), "2wg_n256": T(256, 4, 2), "2wg_n256_c2": T(256, 4, 2, 1, 2),
             "2wg_n256_c2_rm": T(256, 4, 2, 1, 2, rm=True)})


def timed_groups(bm: int, fp8: bool, D: int, I: int) -> dict:
    """{call: {name: tiling}}: tilings(bm, fp8) with the variants of tilings' docstring where they apply."""
    out = {}
    for call, group in zip(("gate_up", "down"), tilings(bm, fp8)):
        K = D if call == "gate_up" else I
        group = {**group, **{f"{n}_ch": chained(t, K) for n, t in group.items() if can_chain(t, K)}}
        if fp8:
            group = {**group, **{f"{n}_u": dataclasses.replace(t, unscaled_probe=True)
                                 for n, t in group.items() if t.compute_wgs >= 2 and not n.endswith("_ch")}}
            group = {**group, **{f"{n}_{tag}": dataclasses.replace(t, step_blocks=blocks, stages=st)
                                 for n, t in group.items() if "_ch" not in n
                                 and scale_slices(t) == 1
                                 and (t.interleaved_gate_up or call == "down" and t.compute_wgs >= 2
                                      and not (t.column_pairs or t.joint_products))
                                 for tag, blocks, st in (("k2", 2, max(1, t.stages // 2)), ("k2s3", 2, 3))}}
            group = {**group, **{f"{n}_nf": dataclasses.replace(t, fence_row_scales=False) for n, t in group.items()
                                 if t.compute_wgs >= 2 and not t.unscaled_probe}}
            group = {**group, **{f"{n}_st": dataclasses.replace(t, stagger_warpgroups=True) for n, t in group.items()
                                 if t.compute_wgs >= 2 and not t.unscaled_probe and not n.endswith("_nf")}}
        group = {**group, **{f"{n}_np": dataclasses.replace(t, programs=0) for n, t in group.items()
                             if t.compute_wgs >= 2 and not t.chained_tiles}}
        out[call] = group
    return out


def tiling_names(D: int, I: int) -> set[str]:
    """Every name --tilings can select, over both row tiles and dtypes."""
    return {n for bm in (64, 128, 192) for fp8 in (False, True) for g in timed_groups(bm, fp8, D, I).values()
            for n in g}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=6144)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--cases", default="8192x16,8192x256,64x256", help="tokens x experts, comma-separated")
    p.add_argument("--tilings", default=None,
                   help="comma-separated tiling names to time (default: all; the first timed is each group's reference)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    keep = set(args.tilings.split(",")) if args.tilings else None
    D, I, k = args.hidden, args.width, args.top_k
    unknown = sorted((keep or set()) - tiling_names(D, I))
    if unknown:
        p.error(f"--tilings: no tiling is named {', '.join(unknown)}")
    ceil = measure_ceilings()
    matmul = ceil["matmul_flops_per_s"]
    print(f"ceiling: bf16 matmul {matmul / 1e12:.0f} TFLOP/s (n {ceil['matmul_n']}, back to back) on {ceil['device']}")
    res, rows = [], [["case", "dtype", "call", "tiling", "ms", "TFLOP/s", "of matmul", "GB/s", "err"]]
    for case in args.cases.split(","):
        tokens, E = map(int, case.split("x"))
        key = jax.random.split(jax.random.key(E + tokens), 8)
        mk = lambda kk, shape: (jax.random.normal(kk, shape, jnp.bfloat16) * 64).astype(jnp.float8_e4m3fn)  # noqa: E731
        g, u, d = mk(key[0], (E, I, D)), mk(key[1], (E, I, D)), mk(key[2], (E, D, I))     # K-major fp8
        sc = lambda kk, shape: jax.random.uniform(kk, shape, jnp.float32, 0.5, 1.5) / 4096  # noqa: E731
        gs, us, ds = sc(key[3], (E, I // 128, D // 128)), sc(key[4], (E, I // 128, D // 128)), sc(key[5], (E, D // 128, I // 128))
        x = jax.random.normal(key[6], (tokens, D), jnp.bfloat16)
        fe = jax.random.randint(key[7], (tokens * k,), 0, E, jnp.int32)
        slots = tokens * k
        flops = {"gate_up": 4.0 * slots * D * I, "down": 2.0 * slots * D * I}
        touched = len(np.unique(np.asarray(fe)))
        weights = {"gate_up": 2.0 * touched * D * I, "down": 1.0 * touched * D * I}   # elements
        h_slot = jax.random.normal(key[6], (slots, I), jnp.bfloat16)    # the down call's input, a row a slot
        refs = {}         # (dtype, call, unscaled): the first timed output in slot order, over the row tiles
        for bm in (64,) if slots < 4 * E else (128, 192):
            if keep is not None and not any(n in keep for fp8 in (False, True)
                                            for grp in timed_groups(bm, fp8, D, I).values() for n in grp):
                continue
            _, row_slot, te = block_plan(fe, E, bm)
            xp = jnp.where((row_slot >= 0)[:, None], x[jnp.maximum(row_slot, 0) // k], 0)
            h = jnp.where((row_slot >= 0)[:, None], h_slot[jnp.maximum(row_slot, 0)], 0)
            rs = np.asarray(row_slot)
            by_slot = np.argsort(np.where(rs >= 0, rs, rs.size + slots))[:slots]   # each slot's row
            for fp8 in (False, True):
                groups = timed_groups(bm, fp8, D, I)
                if keep is not None and not any(n in keep for grp in groups.values() for n in grp):
                    continue
                if fp8:
                    (xq, xs), (hq, hs) = quantize_rows(xp), quantize_rows(h)
                    calls = {"gate_up": (lambda t: lambda a, b, c: grouped_matmul(
                                             a[0], b[0], te, up=c[0], tiling=t, x_scale=a[1], w_scale=b[1],
                                             up_scale=c[1]), ((xq, xs), (g, gs), (u, us))),
                             "down": (lambda t: lambda a, b: grouped_matmul(a[0], b[0], te, tiling=t, x_scale=a[1],
                                                                            w_scale=b[1]), ((hq, hs), (d, ds)))}
                else:
                    gb, ub, db = (jnp.swapaxes(w, 1, 2).astype(jnp.bfloat16) for w in (g, u, d))   # [E, K, N]
                    calls = {"gate_up": (lambda t: lambda a, b, c: grouped_matmul(a, b, te, up=c, tiling=t),
                                         (xp, gb, ub)),
                             "down": (lambda t: lambda a, b: grouped_matmul(a, b, te, tiling=t), (h, db))}
                for call, group in groups.items():
                    make, operands = calls[call]
                    for name, t in group.items():
                        if keep is not None and name not in keep:
                            continue
                        entry = dict(tokens=tokens, experts=E, dtype="fp8" if fp8 else "bf16", call=call, tiling=name,
                                     config=dataclasses.asdict(t))
                        try:
                            f = jax.jit(make(t))
                            s = fitted_pipelined_time(f, *operands)
                            out = np.asarray(f(*operands).astype(jnp.float32))[by_slot]
                            ref = refs.setdefault((entry["dtype"], call, t.unscaled_probe), out)
                            entry.update(s=s, tflops=flops[call] / s / 1e12, matmul_share=flops[call] / s / matmul,
                                         matmul_tflops=matmul / 1e12,
                                         weight_gbps=weights[call] * (1 if fp8 else 2) / s / 1e9,
                                         err=float(np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-30)))
                            rows.append([case, entry["dtype"], call, name, f"{s * 1e3:.3f}", f"{entry['tflops']:.0f}",
                                         f"{entry['matmul_share']:.0%}", f"{entry['weight_gbps']:.0f}", f"{entry['err']:.1e}"])
                        except Exception as e:          # a tiling over the shared memory, say: a row, not a stop
                            entry["error"] = str(e)[:300]
                            rows.append([case, entry["dtype"], call, name, entry["error"][:60], "", "", "", ""])
                        res.append(entry)
                        save_results(res, args.json)
                if not fp8:
                    del gb, ub, db
    report(rows, res, args.json)


if __name__ == "__main__":
    main()
