"""CP prefill scaling on one host: for each cp size, single requests of each prompt length and one
batch of mixed lengths. Correctness first (greedy tokens and the first token's logits against the
cp = 1 run, beside the spread cp = 1 itself shows when only its chunking changes), then time to first
token, prefill tokens/s, scaling efficiency and KV pool bytes per rank; then the collectives of each
prefill step variant (tensor bytes read from the lowered step, the time of each one alone on the same
mesh) against the narrow-collection expectation. Prints tables, writes JSON after every run (so a run
cut short keeps what it measured).

    python scripts/bench_cp.py --cpu-devices 8 --cp 1 2 4 --prompt-lens 512 1024 --mixed 300 200 97 5 --budget 256
    python scripts/bench_cp.py --model random:glm-5 --num-layers 4 --num-experts 16 --cp 1 2 4 \\
        --prompt-lens 8192 32768 131072

Scaling efficiency = tokens/s at cp / (cp x tokens/s at cp = 1). On simulated CPU devices all ranks
share the same cores: the CPU run checks the script, correctness and the memory split, not speed."""

import argparse
import gc
import json
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cpkv_jax.cli import add_model_args  # noqa: E402

COLLECTIVE = re.compile(r'"?stablehlo\.(all_reduce|all_gather|reduce_scatter|all_to_all|collective_permute)"?'
                        r'|stablehlo\.custom_call @(ragged_all_to_all)')
TENSOR = re.compile(r"tensor<([0-9x]*)x?([a-z][a-z0-9A-Z]*)>")
ALONE = ("all_reduce", "all_gather", "reduce_scatter")     # the kinds time_collective reproduces
BYTES = {"f32": 4, "bf16": 2, "f16": 2, "i32": 4, "ui32": 4, "ui8": 1, "i8": 1, "f8E4M3FN": 1, "i1": 1}


def collectives(mlir: str) -> list[dict]:
    """Every all-reduce / all-gather / reduce-scatter / all-to-all / ragged all-to-all / collective
    permute of a lowered step: kind, operand shape and dtype (a ragged all-to-all's: its send buffer, the
    most it moves), result shape, gathered/scattered dimension. The operand type is the first
    `(tensor<...>)` after the op (all-reduce carries its reduction region in between)."""
    found = []
    for m in COLLECTIVE.finditer(mlir):
        sig = mlir.index(": (tensor<", m.end())
        end = mlir.index("\n", sig)
        types = TENSOR.findall(mlir[sig:end])
        shape = tuple(int(d) for d in types[0][0].split("x") if d)
        dim = re.search(r"(?:all_gather_dim|scatter_dimension) = (\d+)", mlir[m.end():sig])
        found.append({"kind": m.group(1) or m.group(2), "shape": shape, "dtype": types[0][1],
                      "result": tuple(int(d) for d in types[-1][0].split("x") if d),
                      "dim": int(dim.group(1)) if dim else None})
    return found


def tensor_bytes(c: dict) -> int:
    n = 1
    for d in c["shape"]:
        n *= d
    return n * BYTES[c["dtype"]]


def time_collective(c: dict, mesh, repeat: int = 10) -> float:
    """Seconds of one such collective alone, under shard_map on the mesh (best of `repeat`)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from cpkv_jax.perf import best_time

    dtype = {"f32": jnp.float32, "bf16": jnp.bfloat16, "i32": jnp.int32, "ui8": jnp.uint8,
             "ui32": jnp.uint32}[c["dtype"]]
    kind, dim = c["kind"], c["dim"]

    def body(x):
        x = x[0]
        if kind == "all_reduce":
            y = jax.lax.psum(x, "cp")
        elif kind == "all_gather":
            y = jax.lax.all_gather(x, "cp", axis=dim, tiled=True)
        else:
            y = jax.lax.psum_scatter(x, "cp", scatter_dimension=dim, tiled=True)
        return y[None]

    cp = mesh.shape["cp"]
    x = jax.device_put(np.zeros((cp,) + c["shape"], dtype), NamedSharding(mesh, P("cp")))
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("cp"), out_specs=P("cp"), check_vma=False))
    return best_time(f, x, repeat=repeat)


def spy_prefill_variants(engine, seen: dict):
    """Wrap the runner's forward to remember one host batch per prefill step variant (lanes, width)."""
    forward = engine.runner.forward

    def spied(batch, last_index=None, **kw):
        B, T = batch.tokens.shape
        if T > 1:
            seen.setdefault((B, T, batch.slot_table.shape[1]), (batch, last_index, dict(kw)))
        return forward(batch, last_index, **kw)
    engine.runner.forward = spied


def analyse_variants(engine, seen: dict, layers: int, bench_mesh: bool) -> list[dict]:
    """For each prefill variant: its attention path, every collective (bytes), and each distinct
    collective's time alone on the mesh."""
    runner, out, timed = engine.runner, [], {}
    for (B, T, S), (batch, last_index, kw) in sorted(seen.items()):
        path = kw.get("attn_path") or runner.attn_path_for(batch)
        lowered = runner.lower(batch, last_index, attn_path=path, last_rank=kw.get("last_rank"),
                               page_aligned=kw.get("page_aligned", True))
        ops = collectives(lowered.as_text())
        for c in ops:
            key = (c["kind"], c["shape"], c["dtype"], c["dim"])
            if bench_mesh and key not in timed and c["kind"] in ALONE:
                timed[key] = time_collective(c, runner.mesh)
            c["bytes"] = tensor_bytes(c)
            c["seconds_alone"] = timed.get(key)
        layer = {(c["kind"], c["shape"], c["dtype"]): c for c in ops if S in c["shape"]}   # per-layer gathers
        tail = [c for c in ops if S not in c["shape"]]
        out.append({"rows": B, "lanes": T, "width": S, "attn_path": path, "layers": layers, "collectives": ops,
                    "per_layer_bytes": sum(c["bytes"] for c in layer.values()),
                    "per_layer_seconds_alone": sum(c["seconds_alone"] or 0.0 for c in layer.values()),
                    "other_bytes": sum(c["bytes"] for c in tail),
                    "other_seconds_alone": sum(c["seconds_alone"] or 0.0 for c in tail)})
    return out


def max_rel(a, b) -> float:
    import numpy as np
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


def compare(tokens, logits, ref_tokens, ref_logits, ref: str = "cp1") -> dict:
    """Greedy tokens and logits [steps, V] per request against the reference run (named `ref` in the
    keys). A token mismatch is reported with the step it happens at and the reference's top-2 margin
    there (relative to its largest |logit|): a margin below the logits' rounding spread is a near-tie,
    not a wrong result."""
    import numpy as np
    out = {f"tokens_equal_{ref}": tokens == ref_tokens,
           f"first_logits_max_rel_vs_{ref}": max(max_rel(a[0], b[0]) for a, b in zip(logits, ref_logits)),
           f"logits_max_rel_vs_{ref}": 0.0, "nan": any(bool(np.isnan(a).any()) for a in logits), "mismatches": []}
    for i, (t, r) in enumerate(zip(tokens, ref_tokens)):
        step = next((j for j, (x, y) in enumerate(zip(t, r)) if x != y), None)
        same_context = len(t) if step is None else step + 1     # logits after a different token differ anyway
        out[f"logits_max_rel_vs_{ref}"] = max(out[f"logits_max_rel_vs_{ref}"],
                                           max_rel(logits[i][:same_context], ref_logits[i][:same_context]))
        if step is not None:
            ref = ref_logits[i][step]
            top2 = np.sort(ref)[-2:]
            out["mismatches"].append({"request": i, "step": step, "token": t[step], "ref_token": r[step],
                                      "ref_top2_margin_rel": float((top2[1] - top2[0]) / np.max(np.abs(ref))),
                                      "logits_rel_at_step": max_rel(logits[i][step], ref)})
    return out


def print_differences(label: str, comparison: dict, ref_label: str) -> None:
    """The token mismatches and NaN that compare() found, one line each."""
    for m in comparison["mismatches"]:
        print(f"{label}: request {m['request']} step {m['step']}: token {m['token']} vs {m['ref_token']}; "
              f"{ref_label} top-2 margin {m['ref_top2_margin_rel']:.1e} of max |logit|, logits rel there "
              f"{m['logits_rel_at_step']:.1e}")
    if comparison["nan"]:
        print(f"{label}: NaN in the logits")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--cpu-devices", type=int, default=None, help="simulate this many CPU devices")
    add_model_args(p)
    p.add_argument("--prompt-lens", type=int, nargs="*", default=[8192, 32768, 131072])
    p.add_argument("--attn-path", choices=("expanded", "absorbed"), default=None, help="force one attention path")
    p.add_argument("--mixed", type=int, nargs="*", default=[2048, 1536, 1024, 1024, 700, 333, 64, 9],
                   help="prompt lengths of the mixed batch (none: no mixed batch). Batches are rectangular "
                        "(rows x the longest chunk's lanes): keep rows x lanes within what one step can hold")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--budget", type=int, default=8192, help="prefill tokens per step (all ranks together)")
    p.add_argument("--new-tokens", type=int, default=4, help="greedy tokens compared against cp = 1")
    p.add_argument("--repeat", type=int, default=2, help="timed prefills per workload (best kept)")
    p.add_argument("--deadline-s", type=float, default=None, help="skip what would start after this many seconds")
    p.add_argument("--json", default="bench_cp.json")
    args = p.parse_args()
    if args.cpu_devices:
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={args.cpu_devices}")
    import jax
    import numpy as np

    from cpkv_jax.cli import bench_model
    from cpkv_jax.engine import Engine, EngineConfig
    from cpkv_jax.sampling import SamplingParams
    from cpkv_jax.kv_pool import pages_for

    t_start = time.perf_counter()
    model = bench_model(args)
    cfg = model.cfg
    rng = np.random.default_rng(0)
    workloads = [(f"single {n}", [n]) for n in args.prompt_lens] + ([("mixed", args.mixed)] if args.mixed else [])
    prompts = {name: [rng.integers(2, cfg.vocab_size, n).tolist() for n in lens] for name, lens in workloads}
    need = max(sum(pages_for(n + args.new_tokens, args.page_size) for n in lens) for _, lens in workloads)
    result = {"model": args.model, "num_layers": cfg.num_hidden_layers, "num_experts": cfg.n_routed_experts,
              "device": str(jax.devices()[0].device_kind), "devices": len(jax.devices()),
              "budget": args.budget, "page_size": args.page_size, "argv": sys.argv[1:],
              "runs": [], "noise": [], "variants": [], "skipped": []}
    ref: dict[str, tuple] = {}

    def save():
        Path(args.json).write_text(json.dumps(result, indent=2, default=list) + "\n")

    def late() -> bool:
        return args.deadline_s is not None and time.perf_counter() - t_start > args.deadline_s

    def engine_for(cp: int, budget: int):
        pages = cp * (-(-(need + 2 * cp) // cp) + 1)
        return Engine(model, EngineConfig(page_size=args.page_size, kv_pages=pages, max_running=max(len(args.mixed), 1),
                                          max_prefill_tokens=budget, prefix_cache=False, cp_size=cp,
                                          attn_path=args.attn_path))

    def first_tokens(engine, name):
        outs = engine.generate(prompts[name], SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True),
                               return_logits=True)
        return [o.token_ids for o in outs], [np.stack(o.logits) for o in outs]

    for cp in args.cp:
        if late():
            result["skipped"].append({"cp": cp, "why": "deadline"})
            continue
        engine = engine_for(cp, args.budget)
        seen: dict = {}
        spy_prefill_variants(engine, seen)
        pool_per_rank = engine.pool.bytes_per_rank()
        for name, lens in workloads:
            if late():
                result["skipped"].append({"cp": cp, "workload": name, "why": "deadline"})
                continue
            t0 = time.perf_counter()
            tokens, logits = first_tokens(engine, name)
            warm_s = time.perf_counter() - t0
            if cp == args.cp[0]:
                ref[name] = (tokens, logits)
            rtok, rlog = ref.get(name, (tokens, logits))
            best = None
            for _ in range(args.repeat):
                for k in engine.metrics:
                    engine.metrics[k] = 0
                t0 = time.perf_counter()
                engine.generate(prompts[name], SamplingParams(max_new_tokens=1, ignore_eos=True))
                dt = time.perf_counter() - t0
                if best is None or dt < best[0]:
                    best = (dt, dict(engine.metrics))
            ttft, metrics = best
            n_tok = sum(lens)
            row = {"cp": cp, "workload": name, "lengths": lens, "tokens": n_tok, "ttft_s": ttft,
                   "prefill_tokens_per_s": n_tok / ttft, "prefill_steps": metrics["prefill_steps"],
                   "padded_lanes": metrics["padded_lanes"], "warmup_s": warm_s, "pool_bytes_per_rank": pool_per_rank,
                   **compare(tokens, logits, rtok, rlog)}
            base = next((r for r in result["runs"] if r["cp"] == args.cp[0] and r["workload"] == name), row)
            row["scaling_efficiency"] = row["prefill_tokens_per_s"] / (cp / base["cp"] * base["prefill_tokens_per_s"])
            result["runs"].append(row)
            print(f"cp {cp} {name}: ttft {ttft * 1e3:.1f} ms, {row['prefill_tokens_per_s']:.0f} tok/s, "
                  f"eff {row['scaling_efficiency']:.2f}, tokens equal {row['tokens_equal_cp1']}, "
                  f"logits rel {row['first_logits_max_rel_vs_cp1']:.2e} (warm-up {warm_s:.1f} s)", flush=True)
            save()
        if not late():
            for v in analyse_variants(engine, seen, cfg.num_hidden_layers, bench_mesh=cp > 1):
                result["variants"].append(dict(v, cp=cp))
            save()
        del engine
        gc.collect()
        jax.clear_caches()

    # the noise floor: cp = 1 at half the prefill budget (other chunk shapes, same math) vs cp = 1
    if args.cp[0] == 1 and not late():
        engine = engine_for(1, args.budget // 2)
        for name, _ in workloads[:1]:
            tokens, logits = first_tokens(engine, name)
            rtok, rlog = ref[name]
            result["noise"].append({"workload": name, "budget": args.budget // 2, **compare(tokens, logits, rtok, rlog)})
        del engine
        save()

    report(result)
    save()
    return 0 if all(r["tokens_equal_cp1"] for r in result["runs"]) else 1


def report(result: dict) -> None:
    from cpkv_jax.perf import print_table

    def table(rows):
        print_table(rows)
        print()

    base_pool = {r["workload"]: r["pool_bytes_per_rank"] for r in result["runs"] if r["cp"] == 1}
    rows = [("cp", "workload", "tokens", "TTFT ms", "tok/s", "eff.", "steps", "pool MiB/rank", "vs cp=1",
             "tokens = cp1", "logits rel (first, all)")]
    for r in result["runs"]:
        rows.append((r["cp"], r["workload"], r["tokens"], f"{r['ttft_s'] * 1e3:.1f}",
                     f"{r['prefill_tokens_per_s']:.0f}", f"{r['scaling_efficiency']:.2f}", r["prefill_steps"],
                     f"{r['pool_bytes_per_rank'] / 2 ** 20:.1f}",
                     f"{r['pool_bytes_per_rank'] / base_pool.get(r['workload'], r['pool_bytes_per_rank']):.3f}",
                     r["tokens_equal_cp1"],
                     f"{r['first_logits_max_rel_vs_cp1']:.1e}, {r['logits_max_rel_vs_cp1']:.1e}"))
    table(rows)
    for r in result["runs"]:
        print_differences(f"cp {r['cp']} {r['workload']}", r, "cp=1")
    for n in result["noise"]:
        print(f"noise floor (cp 1, budget {n['budget']}, {n['workload']}): tokens equal {n['tokens_equal_cp1']}, "
              f"logits rel {n['first_logits_max_rel_vs_cp1']:.1e}")
    rows = [("cp", "rows x lanes x width", "path", "collective", "dtype", "shape", "in module", "MiB each", "us alone")]
    for v in result["variants"]:
        groups: dict = {}
        for c in v["collectives"]:
            key = (c["kind"], c["dtype"], tuple(c["shape"]))
            groups.setdefault(key, [0, c])[0] += 1
        for (kind, dtype, shape), (count, c) in groups.items():
            t = c["seconds_alone"]
            rows.append((v["cp"], f"{v['rows']}x{v['lanes']}x{v['width']}", v["attn_path"], kind, dtype,
                         "x".join(map(str, shape)), count, f"{c['bytes'] / 2 ** 20:.3f}",
                         "-" if t is None else f"{t * 1e6:.0f}"))
    if len(rows) > 1:
        table(rows)
        print("Per variant: one full layer's gathers (every distinct collective over the key width once) and the "
              "rest (tail collection, off-owner writes):")
        for v in result["variants"]:
            print(f"  cp {v['cp']} {v['rows']}x{v['lanes']}x{v['width']} {v['attn_path']}: per layer "
                  f"{v['per_layer_bytes'] / 2 ** 20:.2f} MiB, {v['per_layer_seconds_alone'] * 1e6:.0f} us alone; "
                  f"rest {v['other_bytes'] / 2 ** 10:.1f} KiB, {v['other_seconds_alone'] * 1e6:.0f} us")
    for s in result["skipped"]:
        print("skipped:", s)


if __name__ == "__main__":
    sys.exit(main())
