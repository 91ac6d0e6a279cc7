"""What a dumped kernel's SASS holds: opcode counts over the whole kernel and over its matrix loop (the
smallest backward-branch loop with a wgmma in it: the K loop a step of which the benchmark times), and the
ptxas resource lines (registers, spills) found beside it. Reads the files Mosaic GPU writes under
MOSAIC_GPU_DUMP_TO with MOSAIC_GPU_DUMP_SASS=1 / MOSAIC_GPU_DUMP_PTXAS=1; prints a table, writes JSON.

    python3 scripts/sass_summary.py DUMP_DIR... --json sass.json
"""

import argparse
import collections
import json
import pathlib
import re

INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)([^;]*);")
LABEL = re.compile(r"^\s*(\.L_x_\d+):")
TARGET = re.compile(r"(?:`\((\.L_x_\d+)\)|\b0x([0-9a-f]+)\b)")
RESOURCE = re.compile(r"(Used \d+ registers.*|\d+ bytes spill stores.*|\d+ bytes stack frame.*)")
SHOWN = ("QGMMA", "HGMMA", "WARPGROUP", "FFMA", "FMUL", "FADD", "MOV", "LDS", "LDG", "LDL", "STL", "STS",
         "SYNCS", "BAR", "FENCE", "MEMBAR", "SHFL", "BRA")


def parse(text: str):
    """[(address, opcode, operands)] and {label: address} of one SASS listing."""
    instrs, labels, pending = [], {}, []
    for line in text.splitlines():
        m = LABEL.match(line)
        if m:
            pending.append(m.group(1))
            continue
        m = INSTR.search(line)
        if m:
            addr = int(m.group(1), 16)
            for name in pending:
                labels[name] = addr
            pending = []
            instrs.append((addr, m.group(2), m.group(3)))
    return instrs, labels


def matrix_loop(instrs, labels):
    """The instructions of the smallest loop (a branch back to an earlier address) holding a wgmma."""
    best = None
    for addr, op, rest in instrs:
        if not op.startswith("BRA"):
            continue
        m = TARGET.search(rest)
        if not m:
            continue
        target = labels.get(m.group(1)) if m.group(1) else int(m.group(2), 16)
        if target is None or target >= addr:
            continue
        body = [i for i in instrs if target <= i[0] <= addr]
        if any(o.startswith(("QGMMA", "HGMMA")) for _, o, _ in body) and (best is None or len(body) < len(best)):
            best = body
    return best or []


def counts(instrs) -> dict:
    return dict(collections.Counter(op.split(".")[0] for _, op, _ in instrs).most_common())


def summarize(path: pathlib.Path) -> list[dict]:
    """One entry per SASS listing under path (a file or a folder), with the resource lines of the folder."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    resources = []
    out = []
    for f in files:
        text = f.read_text(errors="replace")
        resources += RESOURCE.findall(text)
        instrs, labels = parse(text)
        if not any(op.startswith(("QGMMA", "HGMMA")) for _, op, _ in instrs):
            continue
        loop = matrix_loop(instrs, labels)
        out.append(dict(file=str(f), instructions=len(instrs), loop_instructions=len(loop),
                        kernel=counts(instrs), loop=counts(loop)))
    for entry in out:
        entry["resources"] = sorted(set(resources))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("paths", nargs="+")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    res = []
    for path in args.paths:
        res += [dict(entry, source=path) for entry in summarize(pathlib.Path(path))]
    print("\t".join(["source", "file", "instrs", "loop", *SHOWN]))
    for e in res:
        print("\t".join([e["source"], pathlib.Path(e["file"]).name, str(e["instructions"]), str(e["loop_instructions"]),
                         *[str(e["loop"].get(op, 0)) for op in SHOWN]]))
        for line in e["resources"]:
            print("   ", line)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
