"""Where one GPU kernel's time goes, from Nsight Compute's hardware counters: runs a command under
`ncu` (clocks left alone), profiles the launches of the kernels whose names match --kernel, and prints
one row per launch: time, the busiest units (SM, tensor pipe, L2, DRAM, L1) as % of peak, issue
activity, registers and spills, the L2 sectors the SMs read (against the bytes the kernel should
read, where --bytes gives them), and the top stall reasons (warps stalled per issued instruction).
Writes JSON with every metric read.

The sparse MLA kernel's first profile (docs/perf.md, 2026-12-03 seventh session) is what this
reads: L2 at 83% with twice the sectors the rows need was the cue that its copies split sectors.

    python3 scripts/ncu_kernel.py --kernel mosaic --launch-skip 1 --json mla.json -- \\
        python3 scripts/bench_kernels.py --only sparse_mla --mla-prefill 2048 --mla-decode ""

Mosaic GPU kernels are named `anonymous_mosaic_gpu_kernel`, Triton ones by their Python function.
--list prints every launch's name and time instead (one cheap pass), to find the name and skip count.
--source CSV profiles the launch's warp stall samples instruction by instruction instead (ncu's source
page, SASS): writes them as CSV and prints the instructions and opcodes that hold the most samples.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile

STALLS = ("barrier", "long_scoreboard", "short_scoreboard", "mio_throttle", "wait", "gmma", "lg_throttle",
          "math_pipe_throttle", "dispatch_stall", "not_selected", "branch_resolving", "no_instruction",
          "membar", "sleeping", "tex_throttle", "drain", "imc_miss", "misc")
STALL_METRIC = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"

# (column label, metric)
SUMMARY = (
    ("us", "gpu__time_duration.sum"),
    ("SM %", "sm__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("tensor %", "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed"),
    ("L2 %", "lts__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("DRAM %", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed"),
    ("L1 %", "l1tex__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("issue %", "smsp__issue_active.avg.pct_of_peak_sustained_active"),
    ("regs", "launch__registers_per_thread"),
)
L2_READ = "lts__t_sectors_srcunit_tex_op_read.sum"
SPILLS = ("l1tex__t_requests_pipe_lsu_mem_local_op_ld.sum", "l1tex__t_requests_pipe_lsu_mem_local_op_st.sum")
METRICS = tuple(m for _, m in SUMMARY) + (
    L2_READ, "launch__grid_size", "launch__block_size", "sm__warps_active.avg.pct_of_peak_sustained_active",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum") + SPILLS + tuple(STALL_METRIC.format(s) for s in STALLS)
HEADER = '"ID","Process ID"'


def number(text: str) -> float | None:
    """ncu's CSV value ("3,507,466", "83.29", "", "n/a") as a float, None where it is not a number."""
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def parse_raw_csv(text: str) -> list[dict]:
    """`ncu --page raw --csv` output (one header row of metric names, one of units, one row per
    profiled launch; anything before the header, such as the program's own output, skipped) ->
    one dict per launch: 'kernel', 'id', each metric's value (floats where numeric) and its unit
    ('_unit:<metric>', so times convert whatever unit ncu chose)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(HEADER)), None)
    if start is None:
        raise ValueError(f"no ncu raw CSV header ({HEADER},...) in the output: did any kernel match?")
    head, units, *rows = csv.reader(io.StringIO("\n".join(lines[start:])))
    out = []
    for r in (r for r in rows if len(r) == len(head)):
        d = {"kernel": r[head.index("Kernel Name")], "id": r[head.index("ID")]}
        for name, value in zip(head, r):
            v = number(value)
            d[name] = v if v is not None else value
        d.update({"_unit:" + h: u for h, u in zip(head, units) if u})
        out.append(d)
    return out


def summarize(launch: dict, expected_bytes: float | None = None, top: int = 4) -> dict:
    """The row this script prints for one launch: the SUMMARY metrics present, spills (local load +
    store requests), the L2 sectors read (as bytes, and as a multiple of expected_bytes), and the
    `top` stall reasons by warps stalled per issued instruction."""
    row = {"kernel": launch["kernel"]}
    for label, metric in SUMMARY:
        v = launch.get(metric)
        if metric == "gpu__time_duration.sum" and isinstance(v, float):
            v = v * {"ns": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}.get(
                launch.get("_unit:" + metric, "ns"), 1e-3)
        row[label] = v
    parts = [launch.get(m) for m in SPILLS]
    row["spills"] = sum(parts) if all(isinstance(p, float) for p in parts) else None
    sectors = launch.get(L2_READ)
    row["L2 read MB"] = sectors * 32 / 1e6 if isinstance(sectors, float) else None
    row["L2 read / expected"] = (sectors * 32 / expected_bytes
                                 if isinstance(sectors, float) and expected_bytes else None)
    stalls = {s: launch[STALL_METRIC.format(s)] for s in STALLS
              if isinstance(launch.get(STALL_METRIC.format(s)), float)}
    row["stalls"] = sorted(stalls.items(), key=lambda kv: -kv[1])[:top]
    return row


def ncu_command(ncu: str, kernel: str | None, launch_skip: int, launch_count: int, log: str,
                listing: bool, sections: list[str], cmd: list[str]) -> list[str]:
    """The ncu invocation: clocks and caches as the program leaves them (METHOD.md: clock control
    off), raw CSV to `log`. --list: time only, every launch."""
    c = [ncu, "--clock-control", "none", "--csv", "--page", "raw", "--log-file", log]
    if listing:
        return c + ["--metrics", "gpu__time_duration.sum"] + cmd
    if kernel:
        c += ["-k", f"regex:{kernel}"]
    c += ["--launch-skip", str(launch_skip), "--launch-count", str(launch_count), "--metrics", ",".join(METRICS)]
    for s in sections:
        c += ["--section", s]
    return c + cmd


def source_commands(ncu: str, kernel: str | None, launch_skip: int, report: str, cmd: list[str]):
    """(profile, export): ncu collecting one launch's per-instruction stall samples into `report`
    (.ncu-rep), then its source page as CSV with the SASS beside each address."""
    c = [ncu, "--clock-control", "none", "--section", "SourceCounters", "--section", "WarpStateStats",
         "--launch-skip", str(launch_skip), "--launch-count", "1", "-f", "-o", report]
    if kernel:
        c += ["-k", f"regex:{kernel}"]
    return c + cmd, [ncu, "-i", report + ".ncu-rep", "--page", "source", "--csv", "--print-source", "sass"]


def stall_lines(text: str, top: int = 30) -> tuple[list[dict], dict]:
    """ncu's source page CSV -> (the `top` instructions by warp stall samples, each with its share of
    all samples; the samples summed by opcode, largest first)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if '"Source"' in line), None)
    if start is None:
        raise ValueError("no source page header (a \"Source\" column) in ncu's output")
    head, *rows = csv.reader(io.StringIO("\n".join(lines[start:])))
    col = next((i for i, h in enumerate(head) if h.startswith("Warp Stall Sampling (All")), None)
    if col is None:
        raise ValueError(f"no warp stall sampling column among {head}")
    src, addr = head.index("Source"), next((i for i, h in enumerate(head) if "Address" in h), None)
    entries = []
    for r in rows:
        if len(r) != len(head) or number(r[col]) is None:
            continue
        entries.append({"address": r[addr] if addr is not None else "", "sass": r[src].strip(),
                        "samples": number(r[col])})
    total = sum(e["samples"] for e in entries) or 1.0
    by_op: dict[str, float] = {}
    for e in entries:
        e["share"] = e["samples"] / total
        words = [w for w in e["sass"].split() if not w.startswith("@")]
        op = words[0] if words else ""
        by_op[op] = by_op.get(op, 0.0) + e["share"]
    ranked = sorted(entries, key=lambda e: -e["samples"])[:top]
    return ranked, dict(sorted(by_op.items(), key=lambda kv: -kv[1]))


def fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.2f}"
    return "" if v is None else str(v)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kernel", help="regex on the kernel name (default: every kernel)")
    p.add_argument("--launch-skip", type=int, default=0, help="matching launches to skip first (warm-up)")
    p.add_argument("--launch-count", type=int, default=1)
    p.add_argument("--bytes", type=float, help="bytes the kernel should read: L2 reads are shown against it")
    p.add_argument("--section", action="append", default=[],
                   help="extra ncu sections to collect (e.g. MemoryWorkloadAnalysis_Tables: excessive sectors)")
    p.add_argument("--list", action="store_true", help="list every launch's name and time (one cheap pass)")
    p.add_argument("--source", help="write the launch's SASS with its warp stall samples (CSV) here instead")
    p.add_argument("--ncu", default=shutil.which("ncu") or "/usr/local/cuda/bin/ncu")
    p.add_argument("--json")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command to run")
    args = p.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        p.error("give the command to profile after --")
    if args.source:
        return source_main(args, cmd)
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "ncu.csv")
        run = subprocess.run(ncu_command(args.ncu, args.kernel, args.launch_skip, args.launch_count, log,
                                         args.list, args.section, cmd))
        text = open(log).read() if os.path.exists(log) else ""
    if run.returncode != 0:
        print(f"ncu_kernel: the command exited with {run.returncode}", file=sys.stderr)
    launches = parse_raw_csv(text)
    if args.list:
        for d in launches:
            print(f"{d['id']:>5}  {summarize(d)['us']:>10.1f} us  {d['kernel'][:120]}")
    else:
        rows = [summarize(d, args.bytes) for d in launches]
        cols = [label for label, _ in SUMMARY] + ["spills", "L2 read MB", "L2 read / expected"]
        print("  ".join(["kernel"] + cols + ["top stalls (warps per issue)"]))
        for r in rows:
            stalls = ", ".join(f"{s} {v:.2f}" for s, v in r["stalls"])
            print("  ".join([r["kernel"].split("(")[0][:40]] + [fmt(r[c]) for c in cols] + [stalls]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": cmd, "kernel": args.kernel, "launches": launches}, f, indent=1)
    return 0 if launches else 1


def source_main(args, cmd) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        profile, export = source_commands(args.ncu, args.kernel, args.launch_skip, os.path.join(tmp, "rep"), cmd)
        run = subprocess.run(profile)
        if run.returncode != 0:
            print(f"ncu_kernel: the profiled command exited with {run.returncode}", file=sys.stderr)
        out = subprocess.run(export, capture_output=True, text=True)
    with open(args.source, "w") as f:
        f.write(out.stdout)
    if out.returncode != 0:
        print(f"ncu_kernel: the export failed ({out.returncode}): {out.stderr[-2000:]}", file=sys.stderr)
        return 1
    ranked, by_op = stall_lines(out.stdout)
    print("stall samples by opcode: " + ", ".join(f"{op} {share:.1%}" for op, share in list(by_op.items())[:15]))
    for e in ranked:
        print(f"{e['address']:>8}  {e['share']:6.1%}  {e['sass'][:110]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": cmd, "kernel": args.kernel, "top": ranked, "by_opcode": by_op}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
