"""CP prefill throughput and KV memory per rank vs cp_size: one `cpkv-jax bench` per cp size in this
process, prefill-dominated (one output token), then a table and a JSON file.

    python scripts/bench_cp.py --cpu-devices 8 --cp 1 2 4 8 --prompt-len 2048 --batch 2   # CPU, simulated devices
    python scripts/bench_cp.py --cp 1 2 4 8 --model random:glm-5 --num-layers 4 --num-experts 16   # 8 GPUs

Scaling efficiency = prefill tokens/s at cp / (cp x tokens/s at cp = 1). On simulated CPU devices all
ranks share the same cores, so expect no speed-up there: the CPU run checks the script and the
memory split; the speed-up is a multi-GPU measurement."""

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--cpu-devices", type=int, default=None, help="simulate this many CPU devices")
    p.add_argument("--model", default="tiny")
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--num-experts", type=int, default=None)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--prefill-budget", type=int, default=None)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--json", default="bench_cp.json")
    args = p.parse_args()
    if args.cpu_devices:
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={args.cpu_devices}")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from cpkv_jax.cli import main as cli

    rows = []
    for cp in args.cp:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            argv = ["bench", "--model", args.model, "--batch", str(args.batch), "--prompt-len", str(args.prompt_len),
                    "--decode-tokens", "1", "--page-size", str(args.page_size), "--cp", str(cp),
                    "--repeat", str(args.repeat), "--quiet", "--json", f.name]
            for flag, v in (("--num-layers", args.num_layers), ("--num-experts", args.num_experts),
                            ("--prefill-budget", args.prefill_budget)):
                if v:
                    argv += [flag, str(v)]
            print(f"== cp {cp}", file=sys.stderr)
            if cli(argv) != 0:
                return 1
            rows.append(json.loads(Path(f.name).read_text()))
    base = next((r for r in rows if r["cp"] == 1), rows[0])
    table = [("cp", "prefill tok/s", "scaling eff.", "prefill s", "pool MiB/rank", "pool vs cp=1")]
    for r in rows:
        tput = r["prefill"]["tokens_per_s"]
        eff = tput / (r["cp"] / base["cp"] * base["prefill"]["tokens_per_s"])
        table.append((r["cp"], f"{tput:.1f}", f"{eff:.2f}", f"{r['prefill']['seconds']:.4f}",
                      f"{r['pool_bytes_per_rank'] / 2 ** 20:.2f}",
                      f"{r['pool_bytes_per_rank'] / base['pool_bytes_per_rank']:.3f}"))
    widths = [max(len(str(row[i])) for row in table) for i in range(len(table[0]))]
    for row in table:
        print("  ".join(str(c).rjust(w) for c, w in zip(row, widths)))
    Path(args.json).write_text(json.dumps({"runs": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
