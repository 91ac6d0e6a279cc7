"""End-to-end prefill of the engine beside its HF transformers peer, in one device call: for each
(experts, prompt length), `scripts/hf_peer.py` and `cpkv-jax bench` (each kernel policy given) run as
subprocesses one after another on the same GPU; prints a table with tokens/s, MFU and the ratio to HF,
and writes JSON.

    python3 scripts/bench_prefill_vs_hf.py --experts 16,256 --prompt-lens 8192 \
        --policies default,moe_kernel=false --json prefill_vs_hf.json
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(cmd, timeout):
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    if r.returncode:
        return {"error": (r.stderr or r.stdout)[-1500:]}
    return r


MIN_HF_CHUNK = 2048


def hf_peer(args, E: str, L: str) -> dict:
    """HF's prefill of L tokens over E experts (scripts/hf_peer.py's JSON, or {"error": ...}): in chunks of
    --hf-chunk tokens, halved after each run out of GPU memory down to MIN_HF_CHUNK (an H100 cannot hold
    HF's 8192-token chunks at 32768 tokens; docs/perf.md, 2026-12-07 twenty-ninth session). A retry's
    result lists the chunk sizes that ran out of memory first (`out_of_memory_chunks`)."""
    chunk, failed = min(args.hf_chunk, int(L)), []
    while True:
        r = run([sys.executable, "scripts/hf_peer.py", "--model", args.model, "--num-layers", str(args.num_layers),
                 "--num-experts", E, "--prompt-lens", L, "--chunk", str(chunk)], args.timeout)
        out = r if isinstance(r, dict) else json.loads(r.stdout.strip().splitlines()[-1])
        if "OutOfMemoryError" not in out.get("error", "") or chunk // 2 < MIN_HF_CHUNK:
            return dict(out, out_of_memory_chunks=failed) if failed else out
        failed.append(chunk)
        chunk //= 2


def policy_order(policies: list[str], round_: int) -> list[str]:
    """The order the policies run in a round: as given in even rounds, reversed in odd ones, so that
    over two rounds each policy runs once in each place (the process that runs second was up to 2.5%
    faster on the H100, docs/perf.md 2026-12-05 fourteenth session)."""
    return list(reversed(policies)) if round_ % 2 else list(policies)


def round_means(results: list[dict]) -> list[dict]:
    """Per (experts, prompt, runner): prefill seconds over its rounds (mean, min, each) from the cpkv
    results that ran (errors left out), in first-seen order."""
    groups: dict[tuple, list[float]] = {}
    for r in results:
        if r["runner"].startswith("cpkv") and "prefill" in r:
            groups.setdefault((r["experts"], r["prompt_len"], r["runner"]), []).append(r["prefill"]["seconds"])
    return [{"experts": e, "prompt_len": L, "runner": name, "mean_s": sum(v) / len(v), "min_s": min(v), "runs_s": v}
            for (e, L, name), v in groups.items()]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="glm-5")
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--experts", default="16")
    p.add_argument("--prompt-lens", default="8192")
    p.add_argument("--policies", default="default",
                   help="';'-separated kernel policies for `cpkv-jax bench --kernels` ('default': none)")
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--fp8-weights", action="store_true",
                   help="our model keeps its linears fp8 (block scales) as a GLM-5 checkpoint stores them; "
                        "HF stays bf16")
    p.add_argument("--hf-chunk", type=int, default=8192,
                   help="HF prefills longer prompts in chunks of this many tokens through its cache (halved "
                        "while it runs out of GPU memory, down to MIN_HF_CHUNK)")
    p.add_argument("--timeout", type=int, default=400)
    p.add_argument("--rounds", type=int, default=1,
                   help="run the policies this many times, their order reversed every other round; a summary "
                        "gives each policy's mean and fastest prefill")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    results, rows = [], [("experts", "prompt", "runner", "prefill ms", "tok/s", "MFU", "vs HF")]
    for E in args.experts.split(","):
        for L in args.prompt_lens.split(","):
            hf = None
            if not args.no_hf:
                hf = hf_peer(args, E, L)
                results.append({"experts": int(E), "prompt_len": int(L), "runner": "hf", **hf})
                if "error" in hf:
                    rows.append((E, L, "hf", "ERR", hf["error"].splitlines()[-1][:60], "", ""))
                    hf = None
                else:
                    s = hf["prefill"][L]["seconds"]
                    chunk = hf["prefill"][L].get("chunk", int(L))
                    label = "hf transformers" + (f" ({chunk}-token chunks)" if chunk < int(L) else "")
                    rows.append((E, L, label, f"{s * 1e3:.1f}", f"{int(L) / s:.0f}", "", "1.00x"))
            runs = [(r, policy) for r in range(args.rounds) for policy in policy_order(args.policies.split(";"), r)]
            for round_, policy in runs:
                with tempfile.NamedTemporaryFile(suffix=".json") as f:
                    cmd = [sys.executable, "-m", "cpkv_jax.cli", "bench", "--model", f"random:{args.model}",
                           "--num-layers", str(args.num_layers), "--num-experts", E, "--batch", "1",
                           "--prompt-len", L, "--decode-tokens", "2", "--repeat", "2", "--kv-pages",
                           str(int(L) // 64 + 8), "--quiet", "--json", f.name]
                    if args.fp8_weights:
                        cmd.append("--fp8-weights")
                    if policy != "default":
                        cmd += ["--kernels", policy]
                    r = run(cmd, args.timeout)
                    res = r if isinstance(r, dict) else json.loads(Path(f.name).read_text())
                results.append({"experts": int(E), "prompt_len": int(L), "runner": f"cpkv {policy}",
                                "round": round_, "fp8_weights": args.fp8_weights, **res})
                if "error" in res:
                    rows.append((E, L, f"cpkv {policy}", "ERR", res["error"].splitlines()[-1][:60], "", ""))
                    continue
                s = res["prefill"]["seconds"]
                ratio = f"{hf['prefill'][L]['seconds'] / s:.2f}x" if hf else ""
                rows.append((E, L, f"cpkv {policy}", f"{s * 1e3:.1f}", f"{int(L) / s:.0f}",
                             f"{res['prefill']['mfu']:.1%}", ratio))
                print("  ".join(map(str, rows[-1])), flush=True)   # progress, in case a later case runs out of time
                if args.json:
                    Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    summary = round_means(results) if args.rounds > 1 else []
    for m in summary:
        rows.append((m["experts"], m["prompt_len"], f"{m['runner']}, mean of {len(m['runs_s'])}",
                     f"{m['mean_s'] * 1e3:.1f} (min {m['min_s'] * 1e3:.1f})",
                     f"{m['prompt_len'] / m['mean_s']:.0f}", "", ""))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results + [dict(m, summary=True) for m in summary], indent=2) + "\n")


if __name__ == "__main__":
    main()
