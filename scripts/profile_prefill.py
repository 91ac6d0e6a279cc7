"""Where a prefill's device time goes: run a workload once to compile, then once under the JAX
profiler, and sum the device ops of the trace by name (table + JSON; the raw trace is kept). Each op
is named by the JAX scopes it ran under (read from XLA's dump of the optimized HLO: the model's
`attention` / `mlp`, the kernels' dispatch scopes such as `sparse_mla`, `expert_mlp/gate_up`), and a
second table sums the time by scope. XLA's command buffers are turned off so that the trace shows
the ops inside them (--command-buffers keeps them).

    python scripts/profile_prefill.py --model random:glm-5 --num-layers 4 --num-experts 16 \\
        --lengths 2048 1536 1024 1024 700 333 64 9 --budget 8192"""

import argparse
import gzip
import json
import os
import re
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cpkv_jax.cli import add_model_args, kernel_policy  # noqa: E402
from pallas_kernels.policy import DEFAULT_POLICY  # noqa: E402

_INSTRUCTION = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+) = .*?metadata=\{[^}]*?op_name="([^"]*)"')
_WRAPPERS = re.compile(r"^(?:[pj]?jit\(.*\)|while|body|cond|checkpoint|remat|closed_call|shard_map|core_call|eval_jaxpr)$")


def hlo_scopes(dump_dir: str) -> dict:
    """{(module, instruction): scope} from XLA's dumps of optimized HLO in dump_dir: the instruction's
    metadata op_name without jit / loop wrappers ('attention/sparse_mla/pallas_call'). Modules dumped
    under one name more than once (several compilations) keep every distinct scope, ' | ' between."""
    found: dict = defaultdict(set)
    for path in Path(dump_dir).glob("*after_optimizations.txt"):
        lines = path.read_text().splitlines()
        head = re.match(r"HloModule ([\w.\-]+)", lines[0]) if lines else None
        if head is None:
            continue
        for line in lines[1:]:
            m = _INSTRUCTION.match(line)
            if m:
                scope = "/".join(p for p in m.group(2).split("/") if p and not _WRAPPERS.match(p))
                found[head.group(1), m.group(1)].add(scope)
    return {key: " | ".join(sorted(v)) for key, v in found.items()}


def scope_times(ops: dict, depth: int = 3) -> dict:
    """{scope: [total us, count]} from device_op_times' ops ({(module, op, scope): ...}): each op's
    scope cut to its first `depth` parts after dropping the primitive's own name (ops with none:
    '(unscoped)')."""
    out: dict = defaultdict(lambda: [0.0, 0])
    for (_, _, scope), (t, n) in ops.items():
        parts = scope.split(" | ")[0].split("/")[:-1][:depth] if scope else []
        key = "/".join(parts) or "(unscoped)"
        out[key][0] += t
        out[key][1] += n
    return dict(out)


def device_op_times(trace_dir: str, scopes: dict | None = None) -> tuple[dict, float, list]:
    """{(module, op, scope): [total us, count]} over the device lanes of the newest perfetto trace
    (GPU: the '/device:' processes; CPU: the XLA executor threads), the span they cover, and the lanes
    used. An op is its HLO op name where the trace gives one, else the event name; its scope comes
    from `scopes` (hlo_scopes) by the trace's module and op name ('' where unknown)."""
    path = max(Path(trace_dir).rglob("*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
    events = json.loads(gzip.open(path).read())["traceEvents"]
    meta = [e for e in events if e.get("ph") == "M" and e.get("name") in ("process_name", "thread_name")]
    lanes = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name" and "/device:" in e["args"]["name"]}
    if lanes:
        on_device = lambda e: e.get("pid") in lanes  # noqa: E731
    else:
        lanes = {e["tid"]: e["args"]["name"] for e in meta if e["name"] == "thread_name"
                 and e["args"]["name"].startswith("tf_XLA")}
        on_device = lambda e: e.get("tid") in lanes  # noqa: E731
    ops: dict = defaultdict(lambda: [0.0, 0])
    first, last = float("inf"), 0.0
    for e in events:
        if e.get("ph") == "X" and on_device(e) and not e["name"].startswith("ThunkExecutor::"):   # CPU: wrappers
            args = e.get("args") or {}
            name = args.get("hlo_op") or args.get("long_name") or e["name"]
            module = args.get("hlo_module", "")
            key = (module, name, (scopes or {}).get((module, name), ""))
            ops[key][0] += float(e.get("dur", 0))
            ops[key][1] += 1
            first, last = min(first, float(e["ts"])), max(last, float(e["ts"]) + float(e.get("dur", 0)))
    return dict(ops), (last - first if ops else 0.0), sorted(set(lanes.values()))


COMMAND_BUFFERS_OFF = "--xla_gpu_enable_command_buffer="
"""XLA flag: no command buffers (with them the trace shows the buffers, not the ops inside)."""


def add_xla_flags(*flags: str) -> None:
    """flags appended to XLA_FLAGS (before jax starts its backend)."""
    os.environ["XLA_FLAGS"] = " ".join(f for f in (os.environ.get("XLA_FLAGS", ""), *flags) if f)


def set_profile_flags(dump_dir: str | None = None, command_buffers: bool = False) -> str:
    """XLA_FLAGS for a profile named by scope (before jax starts its backend): the optimized HLO dumped
    to dump_dir (default: a temporary directory, returned) for hlo_scopes, command buffers off unless
    asked for."""
    dump_dir = dump_dir or tempfile.mkdtemp(prefix="cpkv-hlo-")
    add_xla_flags(f"--xla_dump_to={dump_dir}", "--xla_dump_hlo_as_text", *([] if command_buffers else [COMMAND_BUFFERS_OFF]))
    return dump_dir


def print_profile(ops: dict, n: int = 1, top: int = 25) -> tuple[list, list]:
    """Prints the `top` costliest ops (named by scope) and the time by scope, per repetition of n; returns
    both as lists of ((module, op, scope) or scope, [us, count])."""
    total = sum(t for t, _ in ops.values())
    top_ops = sorted(ops.items(), key=lambda kv: -kv[1][0])[:top]
    by_scope = sorted(scope_times(ops).items(), key=lambda kv: -kv[1][0])
    for title, rows in (("op", [(f"{op}  {scope}", v) for (_, op, scope), v in top_ops]), ("scope", by_scope)):
        w = max(len(name[:100]) for name, _ in rows) if rows else 10
        print(f"\n{title:<{w}}  {'us' if n > 1 else 'ms':>9}     share  calls")
        for name, (t, c) in rows:
            value = t / n if n > 1 else t / 1e3
            print(f"{name[:100]:<{w}}  {value:9.2f} {'us' if n > 1 else 'ms'}  {100 * t / max(total, 1e-9):5.1f}%  x{c / n:g}")
    return top_ops, by_scope


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 1536, 1024, 1024, 700, 333, 64, 9])
    p.add_argument("--budget", type=int, default=8192)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--attn-path", choices=("expanded", "absorbed"), default=None)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--kernels", type=kernel_policy, default=DEFAULT_POLICY, metavar="FIELD=VALUE,...",
                   help="kernel choices over the defaults (pallas_kernels.policy.KernelPolicy's fields)")
    p.add_argument("--trace-dir", default=None, help="keep the trace here (default: a temporary directory)")
    p.add_argument("--command-buffers", action="store_true",
                   help="keep XLA's command buffers (the trace then shows them, not the ops inside)")
    p.add_argument("--dump-dir", default=None, help="XLA's HLO dumps go here (default: a temporary directory)")
    p.add_argument("--json", default="profile_prefill.json")
    args = p.parse_args()
    dump_dir = set_profile_flags(args.dump_dir, args.command_buffers)
    import jax
    import numpy as np

    from cpkv_jax.cli import bench_model
    from cpkv_jax.engine import Engine, EngineConfig
    from cpkv_jax.sampling import SamplingParams
    from cpkv_jax.kv_pool import pages_for

    model = bench_model(args)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, model.cfg.vocab_size, n).tolist() for n in args.lengths]
    pages = args.cp * (-(-(sum(pages_for(n + 1, args.page_size) for n in args.lengths) + 2 * args.cp) // args.cp) + 1)
    engine = Engine(model, EngineConfig(page_size=args.page_size, kv_pages=pages, max_running=len(prompts),
                                        max_prefill_tokens=args.budget, prefix_cache=False, cp_size=args.cp,
                                        attn_path=args.attn_path, kernels=args.kernels))
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    engine.generate(prompts, params)                          # compile
    trace_dir = args.trace_dir or tempfile.mkdtemp(prefix="cpkv-profile-")
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        t0 = time.perf_counter()
        engine.generate(prompts, params)
        wall = time.perf_counter() - t0
    ops, span, lanes = device_op_times(trace_dir, hlo_scopes(dump_dir))
    total = sum(t for t, _ in ops.values())
    print(f"wall {wall * 1e3:.1f} ms; device ops {total / 1e3:.1f} ms over a {span / 1e3:.1f} ms span "
          f"({len(ops)} distinct ops on {len(lanes)} lanes: {', '.join(lanes[:4])}); trace in {trace_dir}, "
          f"HLO in {dump_dir}")
    top, by_scope = print_profile(ops, top=args.top)
    Path(args.json).write_text(json.dumps({
        "argv": sys.argv[1:], "wall_s": wall, "device_total_us": total, "span_us": span,
        "device": str(jax.devices()[0].device_kind),
        "top": [{"op": op, "module": mod, "scope": scope, "us": t, "count": n} for (mod, op, scope), (t, n) in top],
        "by_scope": [{"scope": k, "us": t, "count": n} for k, (t, n) in by_scope]}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
