"""Expert and tensor parallelism on one host (issue 34): for each mesh (ep x tp, optionally x cp) with
two-batch overlap off and on, correctness first (greedy tokens and logits against the first mesh's run
without overlap, beside the noise floor that run shows when only its prefill chunking changes), then
prefill and decode tokens/s in total and per device, scaling efficiency (per-device rate against the
first mesh's), weight and KV pool bytes per device, and the exchanges: every collective of the lowered
prefill step (kind, bytes; a ragged all-to-all's send buffer, the most it moves) and, with --profile,
the device time of each collective kind per step and per MoE layer from a trace of one prefill and
the decode steps. Prints tables, writes JSON after every run (a run cut short keeps what it measured).

    python scripts/bench_mesh.py --cpu-devices 4 --meshes "ep=1;ep=2;ep=4;tp=2;ep=2,tp=2" --tbo off on \\
        --model random:tiny --num-experts 16 --prompt-len 64 --batch 2 --decode-batch 4 --decode-tokens 4
    python scripts/bench_mesh.py --model random:glm-5 --num-layers 4 --num-experts 256 --fp8-weights \\
        --meshes "ep=1;ep=2;ep=4;ep=8;tp=2;tp=4;ep=4,tp=2" --tbo off on --prompt-len 8192 --batch 2 \\
        --decode-batch 64 --decode-context 2048 --decode-tokens 32 --profile

On simulated CPU devices every rank shares the same cores: the CPU run checks the script, correctness
and the memory split, not speed; and its trace's lanes are XLA's threads, not devices, so the
profile's per-device division holds on GPUs only (one trace lane per device)."""

import argparse
import gc
import json
import os
import re
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_cp import collectives, compare, print_differences, tensor_bytes  # noqa: E402
from cpkv_jax.cli import add_model_args  # noqa: E402

AXES = ("cp", "ep", "tp")
# device op names of the collectives in a trace (XLA's HLO names: all-to-all.3, ragged-all-to-all.1, ...)
TRACE_COLLECTIVE = re.compile(r"(ragged-all-to-all|all-to-all|all-reduce|all-gather|reduce-scatter|collective-permute)")


def parse_mesh(spec: str) -> dict:
    """'ep=4,tp=2' -> {'cp': 1, 'ep': 4, 'tp': 2}."""
    sizes = dict.fromkeys(AXES, 1)
    for part in filter(None, spec.replace(" ", "").split(",")):
        name, _, n = part.partition("=")
        if name not in AXES or not n.isdigit() or int(n) < 1:
            raise SystemExit(f"--meshes: {part!r} is not AXIS=N with AXIS one of {AXES}")
        sizes[name] = int(n)
    return sizes


def mesh_name(sizes: dict) -> str:
    return ",".join(f"{a}={sizes[a]}" for a in AXES if sizes[a] > 1) or "1 device"


def bytes_per_device(arrays) -> dict:
    """{device: bytes of the arrays' shards it holds}."""
    out: dict = defaultdict(int)
    for x in arrays:
        for s in getattr(x, "addressable_shards", ()):
            out[str(s.device)] += s.data.nbytes
    return dict(out)


def collective_times(trace_dir: str) -> tuple[dict, int]:
    """{collective kind: [device us summed over devices, count]} of a trace's device ops, and the number
    of device lanes (profile_prefill.device_op_times)."""
    from profile_prefill import device_op_times
    ops, _, lanes = device_op_times(trace_dir)
    out: dict = defaultdict(lambda: [0.0, 0])
    for (_, name, _), (t, n) in ops.items():
        m = TRACE_COLLECTIVE.search(name)
        if m:
            out[m.group(1)][0] += t
            out[m.group(1)][1] += n
    return dict(out), max(len(lanes), 1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--meshes", default="ep=1;ep=2;ep=4;ep=8;tp=2;tp=4",
                   help="meshes separated by ';', each AXIS=N,... over cp / ep / tp (the first is the reference)")
    p.add_argument("--tbo", nargs="+", choices=("off", "on"), default=["off", "on"], help="two-batch overlap")
    p.add_argument("--ep-dispatch", default="auto", help="as the engine's --ep-dispatch")
    p.add_argument("--cpu-devices", type=int, default=None, help="simulate this many CPU devices")
    add_model_args(p, "random:tiny")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--budget", type=int, default=8192, help="prefill tokens per step")
    p.add_argument("--prompt-len", type=int, default=8192, help="prefill workload: --batch prompts of this length")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--decode-batch", type=int, default=64, help="decode workload: requests decoding together")
    p.add_argument("--decode-context", type=int, default=2048, help="their prompts' length")
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--check-lens", type=int, nargs="+", default=[300, 97, 5],
                   help="prompt lengths of the correctness check (greedy tokens and logits vs the reference)")
    p.add_argument("--new-tokens", type=int, default=4, help="greedy tokens compared against the reference")
    p.add_argument("--repeat", type=int, default=2, help="timed runs per workload (best kept)")
    p.add_argument("--profile", action="store_true", help="the collectives' device time from a trace")
    p.add_argument("--deadline-s", type=float, default=None, help="skip what would start after this many seconds")
    p.add_argument("--json", default="bench_mesh.json")
    args = p.parse_args()
    if args.cpu_devices:
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={args.cpu_devices}")
    import jax
    import numpy as np

    from cpkv_jax.cli import bench_model
    from cpkv_jax.config import EngineConfigError
    from cpkv_jax.engine import Engine, EngineConfig
    from cpkv_jax.kv_pool import pages_for
    from cpkv_jax.sampling import SamplingParams

    meshes = [parse_mesh(m) for m in args.meshes.split(";") if m.strip()]
    t_start = time.perf_counter()
    model = bench_model(args)
    cfg = model.cfg
    moe_layers = cfg.mlp_layer_types.count("sparse")
    rng = np.random.default_rng(0)
    check = [rng.integers(2, cfg.vocab_size, n).tolist() for n in args.check_lens]
    result = {"model": args.model, "num_layers": cfg.num_hidden_layers, "num_experts": cfg.n_routed_experts,
              "moe_layers": moe_layers, "device": str(jax.devices()[0].device_kind), "devices": len(jax.devices()),
              "argv": sys.argv[1:], "runs": [], "noise": [], "skipped": []}
    need = max(args.batch * pages_for(args.prompt_len + 1, args.page_size),
               args.decode_batch * pages_for(args.decode_context + args.decode_tokens, args.page_size),
               sum(pages_for(n + args.new_tokens, args.page_size) for n in args.check_lens))
    ref: dict = {}

    def save():
        Path(args.json).write_text(json.dumps(result, indent=2, default=list) + "\n")

    def late() -> bool:
        return args.deadline_s is not None and time.perf_counter() - t_start > args.deadline_s

    def engine_for(sizes: dict, tbo: bool, budget: int):
        cp = sizes["cp"]
        return Engine(model, EngineConfig(
            page_size=args.page_size, kv_pages=cp * (-(-(need + 2 * cp) // cp) + 1),
            max_running=max(args.batch, args.decode_batch, len(check)), max_prefill_tokens=budget,
            prefix_cache=False, cp_size=cp, ep_size=sizes["ep"], tp_size=sizes["tp"], two_batch_overlap=tbo,
            ep_dispatch=args.ep_dispatch))

    def greedy(engine):
        outs = engine.generate(check, SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True),
                               return_logits=True)
        return [o.token_ids for o in outs], [np.stack(o.logits) for o in outs]

    def timed(engine, prompts, new_tokens: int, phase: str) -> dict:
        """The best of --repeat runs (after a warm-up that compiles their shapes): seconds and tokens of
        the phase, from the engine's own counters."""
        params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
        engine.generate(prompts(), params)
        best = None
        for _ in range(args.repeat):
            for k in engine.metrics:
                engine.metrics[k] = 0
            engine.generate(prompts(), params)
            m = dict(engine.metrics)
            if best is None or m[f"{phase}_s"] < best[f"{phase}_s"]:
                best = m
        return best

    def profiled(engine, prompts, new_tokens: int) -> dict:
        """Per collective kind: device us per step and per MoE layer (summed over devices, divided by
        the devices), one run under the profiler."""
        trace_dir = tempfile.mkdtemp(prefix="cpkv-mesh-profile-")
        for k in engine.metrics:
            engine.metrics[k] = 0
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            engine.generate(prompts(), SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
        steps = max(engine.metrics["steps"], 1)
        times, lanes = collective_times(trace_dir)
        return {kind: {"us_per_step": t / lanes / steps, "us_per_moe_layer": t / lanes / steps / max(moe_layers, 1),
                       "ops_per_step": n / lanes / steps} for kind, (t, n) in times.items()}

    def seen_prefill(engine) -> dict:
        """Wrap the runner's forward to keep the first prefill batch it runs (for its lowered step)."""
        seen: dict = {}
        forward = engine.runner.forward

        def spied(batch, last_index=None, **kw):
            if batch.tokens.shape[1] > 1 and not seen:
                seen.update(batch=batch, last_index=last_index, kw=dict(kw))
            return forward(batch, last_index, **kw)
        engine.runner.forward = spied
        return seen

    def lowered_collectives(engine, seen: dict) -> dict:
        runner, kw = engine.runner, seen["kw"]
        path = kw.get("attn_path") or runner.attn_path_for(seen["batch"])
        ops = collectives(runner.lower(seen["batch"], seen["last_index"], attn_path=path,
                                       last_rank=kw.get("last_rank"),
                                       page_aligned=kw.get("page_aligned", True)).as_text())
        groups: dict = {}
        for c in ops:
            key = (c["kind"], c["dtype"], "x".join(map(str, c["shape"])))
            groups.setdefault(key, {"kind": c["kind"], "dtype": c["dtype"], "shape": c["shape"], "count": 0,
                                    "bytes_each": tensor_bytes(c)})["count"] += 1
        rows, lanes = seen["batch"].tokens.shape
        return {"step": f"{rows}x{lanes}", "collectives": list(groups.values()),
                "bytes": sum(g["count"] * g["bytes_each"] for g in groups.values())}

    def pre_prompts():
        return [rng.integers(2, cfg.vocab_size, args.prompt_len).tolist() for _ in range(args.batch)]

    def dec_prompts():
        return [rng.integers(2, cfg.vocab_size, args.decode_context).tolist() for _ in range(args.decode_batch)]

    for sizes in meshes:
        n_dev = sizes["cp"] * sizes["ep"] * sizes["tp"]
        for tbo in (t == "on" for t in args.tbo):
            name = mesh_name(sizes)
            if late() or n_dev > len(jax.devices()):
                result["skipped"].append({"mesh": sizes, "tbo": tbo,
                                          "why": "deadline" if late() else f"{n_dev} devices, {len(jax.devices())} here"})
                save()
                continue
            t0 = time.perf_counter()
            try:
                engine = engine_for(sizes, tbo, args.budget)
            except EngineConfigError as e:     # a mesh that does not divide the model: named, the rest goes on
                result["skipped"].append({"mesh": sizes, "tbo": tbo, "why": str(e)})
                print(f"{name} tbo {tbo}: skipped: {e}", flush=True)
                save()
                continue
            seen = seen_prefill(engine)
            tokens, logits = greedy(engine)
            if not ref:
                ref.update(tokens=tokens, logits=logits, sizes=sizes, tbo=tbo)
            row = {"mesh": sizes, "mesh_name": name, "devices": n_dev, "tbo": tbo,
                   **compare(tokens, logits, ref["tokens"], ref["logits"], ref="ref"),
                   "weight_bytes_per_device": bytes_per_device(engine.runner.leaves),
                   "pool_bytes_per_device": engine.pool.bytes_per_rank()}
            row["weight_bytes_max"] = max(row["weight_bytes_per_device"].values())
            pre = timed(engine, pre_prompts, 1, "prefill")
            dec = timed(engine, dec_prompts, args.decode_tokens, "decode")
            row["prefill"] = {"tokens": pre["prefill_tokens"], "seconds": pre["prefill_s"], "steps": pre["prefill_steps"],
                              "tokens_per_s": pre["prefill_tokens"] / pre["prefill_s"]}
            row["decode"] = {"tokens": dec["decode_tokens"], "seconds": dec["decode_s"], "steps": dec["decode_steps"],
                             "tokens_per_s": dec["decode_tokens"] / dec["decode_s"] if dec["decode_s"] else 0.0}
            base = next((r for r in result["runs"] if r["mesh"] == ref["sizes"] and r["tbo"] == ref["tbo"]), row)
            for phase in ("prefill", "decode"):
                row[phase]["tokens_per_s_per_device"] = row[phase]["tokens_per_s"] / n_dev
                row[phase]["scaling_efficiency"] = (row[phase]["tokens_per_s_per_device"]
                                                    / max(base[phase]["tokens_per_s_per_device"], 1e-30))
            if seen:
                row["prefill_step_collectives"] = lowered_collectives(engine, seen)
            if args.profile:
                row["profile"] = {
                    "prefill": profiled(engine, pre_prompts, 1),
                    "decode": profiled(engine, dec_prompts, args.decode_tokens)}
            row["wall_s"] = time.perf_counter() - t0
            result["runs"].append(row)
            print(f"{name} tbo {tbo}: tokens equal {row['tokens_equal_ref']}, logits rel "
                  f"{row['logits_max_rel_vs_ref']:.1e}; prefill {row['prefill']['tokens_per_s']:.0f} tok/s, decode "
                  f"{row['decode']['tokens_per_s']:.0f} tok/s; weights {row['weight_bytes_max'] / 2 ** 20:.1f} "
                  f"MiB/device ({row['wall_s']:.0f} s)", flush=True)
            save()
            del engine
            gc.collect()
            jax.clear_caches()

    # the noise floor: the reference mesh at half the prefill budget (other chunk shapes, same math)
    if ref and not late():
        engine = engine_for(ref["sizes"], ref["tbo"], max(args.budget // 2, 1))
        tokens, logits = greedy(engine)
        result["noise"].append({"mesh": ref["sizes"], "budget": args.budget // 2,
                                **compare(tokens, logits, ref["tokens"], ref["logits"], ref="ref")})
        del engine
    save()
    report(result)
    return 0 if all(r["tokens_equal_ref"] for r in result["runs"]) else 1


def report(result: dict) -> None:
    from cpkv_jax.perf import print_table

    rows = [("mesh", "tbo", "devices", "tokens = ref", "logits rel", "prefill tok/s", "/device", "eff.",
             "decode tok/s", "/device", "eff.", "weights MiB/dev", "pool MiB/dev", "prefill-step exchange MiB")]
    for r in result["runs"]:
        ex = r.get("prefill_step_collectives")
        rows.append((r["mesh_name"], "on" if r["tbo"] else "off", r["devices"], r["tokens_equal_ref"],
                     f"{r['logits_max_rel_vs_ref']:.1e}",
                     f"{r['prefill']['tokens_per_s']:.0f}", f"{r['prefill']['tokens_per_s_per_device']:.0f}",
                     f"{r['prefill']['scaling_efficiency']:.2f}",
                     f"{r['decode']['tokens_per_s']:.0f}", f"{r['decode']['tokens_per_s_per_device']:.0f}",
                     f"{r['decode']['scaling_efficiency']:.2f}",
                     f"{r['weight_bytes_max'] / 2 ** 20:.1f}", f"{r['pool_bytes_per_device'] / 2 ** 20:.1f}",
                     "-" if ex is None else f"{ex['bytes'] / 2 ** 20:.2f}"))
    print_table(rows)
    print()
    rows = [("mesh", "tbo", "step", "collective", "dtype", "shape", "count", "MiB each")]
    for r in result["runs"]:
        ex = r.get("prefill_step_collectives")
        for c in (ex or {}).get("collectives", []):
            rows.append((r["mesh_name"], "on" if r["tbo"] else "off", ex["step"], c["kind"], c["dtype"],
                         "x".join(map(str, c["shape"])), c["count"], f"{c['bytes_each'] / 2 ** 20:.3f}"))
    if len(rows) > 1:
        print_table(rows)
        print()
    rows = [("mesh", "tbo", "phase", "collective", "us / step", "us / MoE layer", "ops / step")]
    for r in result["runs"]:
        for phase, kinds in r.get("profile", {}).items():
            for kind, v in sorted(kinds.items()):
                rows.append((r["mesh_name"], "on" if r["tbo"] else "off", phase, kind, f"{v['us_per_step']:.1f}",
                             f"{v['us_per_moe_layer']:.1f}", f"{v['ops_per_step']:g}"))
    if len(rows) > 1:
        print_table(rows)
        print()
    for r in result["runs"]:
        print_differences(f"{r['mesh_name']} tbo {r['tbo']}", r, "reference")
    for n in result["noise"]:
        print(f"noise floor ({mesh_name(n['mesh'])}, budget {n['budget']}): tokens equal {n['tokens_equal_ref']}, "
              f"logits rel {n['logits_max_rel_vs_ref']:.1e}")
    for s in result["skipped"]:
        print("skipped:", s)


if __name__ == "__main__":
    sys.exit(main())
