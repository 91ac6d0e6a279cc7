"""Where a decode step's time goes: the whole engine step (with and without the overlapped loop) vs
the jitted model step alone vs the sampler, on the same shapes, in one run (table + JSON); with
--profile N, the model step's N costliest device ops and its time by JAX scope (command buffers
off for the whole run, so that the trace shows ops rather than buffers). --kernels takes several policies separated by ';': each is
measured on the same weights (built once) and the JSON holds {"runs": [one result per policy]}.

    python scripts/bench_decode_step.py --model tiny --batch 8 --context 512
    python scripts/bench_decode_step.py --model random:glm-5 --num-layers 4 --num-experts 16 --batch 8 --context 2048
    python scripts/bench_decode_step.py --model random:glm-5 --num-layers 4 --fp8-weights --kernels "default;fp8_linear_split_k=true"
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cpkv_jax.cli import add_model_args  # noqa: E402


def host_event_times(trace_dir: str) -> dict:
    """{event name: [total us, count]} of the trace's complete events on the host (not the device lanes)."""
    import gzip
    from collections import defaultdict

    path = max(Path(trace_dir).rglob("*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
    events = json.loads(gzip.open(path).read())["traceEvents"]
    device = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
              and "/device:" in e["args"]["name"]}
    out: dict = defaultdict(lambda: [0.0, 0])
    for e in events:
        if e.get("ph") == "X" and e.get("pid") not in device:
            out[e["name"]][0] += float(e.get("dur", 0))
            out[e["name"]][1] += 1
    return dict(out)


def control_flow_ops(compiled_text: str) -> dict:
    """How many conditional and while instructions a compiled module holds: on the GPU a conditional
    (and a while loop of unknown trip count) reads its predicate on the host, blocking the dispatch."""
    import re
    return {op: len(re.findall(rf"= [^=]*\b{op}\(", compiled_text)) for op in ("conditional", "while")}


def profile_engine(eng, n: int, top: int) -> dict:
    """n overlapped engine steps under the JAX profiler (device busy ms per step vs the wall per step: the
    difference is device idle time, the host's share), then n more under cProfile (the host's own time
    by function)."""
    import cProfile
    import pstats
    import tempfile

    import jax
    from profile_prefill import device_op_times

    trace_dir = tempfile.mkdtemp(prefix="cpkv-engine-profile-")
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        t = time.perf_counter()
        for _ in range(n):
            eng.step()
        jax.block_until_ready(eng.runner.last_tokens)
        wall = time.perf_counter() - t
    ops, span, _ = device_op_times(trace_dir)
    busy = sum(t for t, _ in ops.values())
    host = host_event_times(trace_dir)
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    for _ in range(n):
        eng.step()
    jax.block_until_ready(eng.runner.last_tokens)
    prof.disable()
    wall_cprofile = time.perf_counter() - t
    stats = pstats.Stats(prof)
    rows = sorted(((v[2], v[3], v[1], f"{Path(k[0]).name}:{k[1]}({k[2]})") for k, v in stats.stats.items()),
                  reverse=True)[:top]
    out = {"wall_ms_per_step": 1e3 * wall / n, "device_busy_ms_per_step": busy / n / 1e3,
           "device_span_ms_per_step": span / n / 1e3, "cprofile_wall_ms_per_step": 1e3 * wall_cprofile / n,
           "host_top": [{"fn": f, "own_ms_per_step": 1e3 * tt / n, "cum_ms_per_step": 1e3 * ct / n,
                         "calls_per_step": c / n} for tt, ct, c, f in rows],
           "host_trace_top": [{"event": k, "ms_per_step": t / n / 1e3, "count_per_step": c / n}
                              for k, (t, c) in sorted(host.items(), key=lambda kv: -kv[1][0])[:top]]}
    print(f"engine, overlapped: {out['wall_ms_per_step']:.3f} ms/step wall, device busy "
          f"{out['device_busy_ms_per_step']:.3f} ms/step (span {out['device_span_ms_per_step']:.3f})")
    print("host threads' trace events (inclusive time):")
    for r in out["host_trace_top"]:
        print(f"  {r['event'][:90]:<90} {r['ms_per_step']:7.3f} ms  x{r['count_per_step']:g}")
    print(f"host under cProfile ({out['cprofile_wall_ms_per_step']:.3f} ms/step), by own time:")
    for r in out["host_top"]:
        print(f"  {r['fn'][:90]:<90} own {r['own_ms_per_step']:7.3f}  cum {r['cum_ms_per_step']:7.3f} ms  "
              f"x{r['calls_per_step']:g}")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--profile", type=int, default=0, help="list the model step's N costliest device ops")
    p.add_argument("--engine-profile", type=int, default=0,
                   help="profile N more overlapped engine steps: device busy time per step from a JAX trace, and "
                        "the host's costliest functions (cProfile, by own time)")
    p.add_argument("--kernels", default="default",
                   help="kernel policy, e.g. 'unroll_layers_max_tokens=16' (pallas_kernels.policy.KernelPolicy.parse); "
                        "several separated by ';' are measured one after the other on the same weights")
    p.add_argument("--json", default="bench_decode_step.json")
    args = p.parse_args()
    if args.profile:
        from profile_prefill import set_profile_flags
        args.dump_dir = set_profile_flags()      # ops named by scope; command buffers off
    from cpkv_jax.cli import bench_model
    from pallas_kernels.policy import KernelPolicy

    policies = [k.strip() for k in args.kernels.split(";")]
    for k in policies:
        KernelPolicy.parse(k)            # a typo fails before the weights are built
    model = bench_model(args)
    runs = [measure(model, args, k) for k in policies]
    if len(runs) > 1:
        keys = ("engine_step_no_overlap_ms", "engine_step_ms", "model_step_ms", "sampler_ms")
        print(f"{'kernels':<40}" + "".join(f"{k:>27}" for k in keys))
        for r in runs:
            print(f"{r['kernels'][:40]:<40}" + "".join(f"{r[k]:27.3f}" for k in keys))
    Path(args.json).write_text(json.dumps(runs[0] if len(runs) == 1 else {"runs": runs}, indent=2) + "\n")
    return 0


def measure(model, args, kernels: str) -> dict:
    """The engine step (overlapped and not), the model step alone and the sampler with one kernel policy."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from cpkv_jax.engine import Engine, EngineConfig
    from cpkv_jax.kv_pool import pages_for
    from cpkv_jax.sampling import SamplingParams, is_stochastic, sample_tokens
    from pallas_kernels.policy import KernelPolicy

    print(f"== kernels {kernels}", flush=True)
    B, L, n = args.batch, args.context, args.steps
    pages = B * pages_for(L + 5 * n + 6, args.page_size) + 2
    step_ms = {}
    for overlap in (False, True):
        eng = Engine(model, EngineConfig(page_size=args.page_size, kv_pages=pages, max_running=B, overlap=overlap,
                                         kernels=KernelPolicy.parse(kernels),
                                         max_prefill_tokens=min(B * L, 8192), prefix_cache=False))
        rng = np.random.default_rng(0)
        for _ in range(B):
            eng.add_request(rng.integers(0, model.cfg.vocab_size, L).tolist(),
                            SamplingParams(max_new_tokens=5 * n + 5, ignore_eos=True))
        while any(r.prefilling or not r.output for r in eng.scheduler.running + list(eng.scheduler.waiting)):
            eng.step()
        for _ in range(3):
            eng.step()  # compile the decode variants
        t = time.perf_counter()
        for _ in range(n):
            eng.step()
        jax.block_until_ready(eng.runner.last_tokens)
        step_ms["engine_step_ms" if overlap else "engine_step_no_overlap_ms"] = 1e3 * (time.perf_counter() - t) / n
    engine_profile = profile_engine(eng, n, args.engine_profile) if args.engine_profile else None
    eng._take_in_flight()

    chunks = eng.scheduler.plan_decode()
    step = eng.batch_builder.build(chunks, False)
    batch, lane, rank = step.batch, step.last_lane, step.last_rank
    runner = eng.runner
    flow = control_flow_ops(runner.lower(batch, lane, attn_path="absorbed", last_rank=rank).compile().as_text())
    print(f"control flow in the compiled decode step: {flow}")
    # the model step alone, on the engine's own decode shapes (writes the same slots again)
    jax.block_until_ready(runner.forward(batch, lane, attn_path="absorbed", last_rank=rank))
    t = time.perf_counter()
    for _ in range(n):
        logits = runner.forward(batch, lane, attn_path="absorbed", last_rank=rank)
    jax.block_until_ready(logits)
    forward_s = (time.perf_counter() - t) / n
    args_s = eng.batch_builder.sampling("sample", [c.req for c in chunks], logits.shape[0])
    pos = jnp.zeros(logits.shape[0], jnp.int32)
    greedy = dict(stochastic=is_stochastic(args_s[0]))   # the variant the engine runs
    jax.block_until_ready(sample_tokens(logits, *args_s, pos, **greedy))
    t = time.perf_counter()
    for _ in range(n):
        out = sample_tokens(logits, *args_s, pos, **greedy)
    jax.block_until_ready(out)
    sample_s = (time.perf_counter() - t) / n
    res = {"model": args.model, "fp8_weights": args.fp8_weights, "kernels": kernels, "batch": B, "context": L, "device": str(jax.devices()[0].device_kind), **step_ms,
           "decode_step_control_flow": flow,
           "model_step_ms": 1e3 * forward_s, "sampler_ms": 1e3 * sample_s}
    for overlap in ("", "_no_overlap"):
        res[f"host_and_sync{overlap}_ms"] = res[f"engine_step{overlap}_ms"] - res["model_step_ms"] - res["sampler_ms"]
    for k in ("engine_step_no_overlap_ms", "engine_step_ms", "model_step_ms", "sampler_ms",
              "host_and_sync_no_overlap_ms", "host_and_sync_ms"):
        print(f"{k:>27}  {res[k]:8.3f}")
    if args.profile:
        import tempfile
        from profile_prefill import device_op_times, hlo_scopes, print_profile
        trace_dir = tempfile.mkdtemp(prefix="cpkv-decode-profile-")
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(n):
                logits = runner.forward(batch, lane, attn_path="absorbed", last_rank=rank)
            jax.block_until_ready(logits)
        ops, span, _ = device_op_times(trace_dir, hlo_scopes(args.dump_dir))
        total = sum(t for t, _ in ops.values())
        print(f"model step device ops: {total / n / 1e3:.3f} ms per step over a {span / n / 1e3:.3f} ms span")
        top, by_scope = print_profile(ops, n, args.profile)
        res["profile"] = {"device_ms_per_step": total / n / 1e3, "span_ms_per_step": span / n / 1e3,
                          "top": [{"op": op, "scope": scope, "us_per_step": t / n, "count_per_step": c / n}
                                  for (_, op, scope), (t, c) in top],
                          "by_scope": [{"scope": k, "us_per_step": t / n, "count_per_step": c / n}
                                       for k, (t, c) in by_scope]}
    if engine_profile is not None:
        res["engine_profile"] = engine_profile
    return res


if __name__ == "__main__":
    sys.exit(main())
