"""What a dumped kernel's SASS holds: opcode counts over the whole kernel and over its matrix loop (the
smallest backward-branch loop with a wgmma in it: the K loop a step of which the benchmark times), and the
ptxas resource lines (registers, spills) found beside it; prints a table, writes JSON.

Mosaic GPU with MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_SASS=1 prints each kernel's module with its cubin
(`bin = "..."`) and ptxas' report to the program's output; without nvdisasm on the GPU box the SASS itself
is missing, so --extract keeps the cubins and the ptxas lines of such a log (a few hundred KB of a 60 MB
log), and a later run where nvdisasm exists (the nvidia-cuda-nvdisasm wheel) disassembles them:

    MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_SASS=1 python3 bench.py > run.log 2>&1
    python3 scripts/sass_summary.py --extract run.log --to cubins/
    python3 scripts/sass_summary.py cubins/ --nvdisasm /path/to/nvdisasm --json sass.json
"""

import argparse
import collections
import json
import pathlib
import re
import subprocess

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


def cubins(data: bytes) -> list[bytes]:
    """The ELF cubins embedded in a log's printed modules (`bin = "..."`, MLIR string escapes)."""
    out = []
    for m in re.finditer(rb'bin = "', data):
        i, buf = m.end(), bytearray()
        while data[i] != 0x22:                      # the closing quote
            if data[i] == 0x5C:                     # \\, \", \n, \t or \XX (hex)
                nxt = data[i + 1:i + 2]
                simple = {b"\\": 0x5C, b'"': 0x22, b"n": 10, b"t": 9}.get(nxt)
                if simple is not None:
                    buf.append(simple)
                    i += 2
                else:
                    buf.append(int(data[i + 1:i + 3], 16))
                    i += 3
            else:
                buf.append(data[i])
                i += 1
        if buf[:4] == b"\x7fELF":
            out.append(bytes(buf))
    return out


def extract(log: pathlib.Path, to: pathlib.Path) -> int:
    """Write the log's cubins (k0.cubin, ...) and its ptxas lines (ptxas.txt) under `to`."""
    data = log.read_bytes()
    to.mkdir(parents=True, exist_ok=True)
    found = cubins(data)
    for n, blob in enumerate(found):
        (to / f"k{n}.cubin").write_bytes(blob)
    lines = re.findall(rb"ptxas (?:info|warning)[^\n\\]*|\d+ bytes stack frame[^\n\\]*", data)
    (to / "ptxas.txt").write_text("\n".join(line.decode(errors="replace") for line in lines) + "\n")
    return len(found)


def disassemble(path: pathlib.Path, nvdisasm: str) -> None:
    """Each .cubin under path as SASS text beside it (.sass), where none is there yet."""
    for cubin in ([path] if path.is_file() else sorted(path.rglob("*.cubin"))):
        sass = cubin.with_suffix(".sass")
        if not sass.exists():
            sass.write_text(subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True,
                                           check=True).stdout)


def summarize(path: pathlib.Path) -> list[dict]:
    """One entry per SASS listing under path (a file or a folder), with the resource lines of the folder."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    resources = []
    out = []
    for f in files:
        if f.suffix == ".cubin":
            continue
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
    p.add_argument("paths", nargs="+", help="SASS listings or folders of them (with --nvdisasm: cubins too)")
    p.add_argument("--extract", action="store_true",
                   help="paths are logs: write their cubins and ptxas lines under --to")
    p.add_argument("--to", default="cubins", help="--extract: one folder per log under this one")
    p.add_argument("--nvdisasm", default=None, help="disassemble the cubins found under paths first")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.extract:
        for log in args.paths:
            name = pathlib.Path(log).stem
            print(f"{log}: {extract(pathlib.Path(log), pathlib.Path(args.to) / name)} cubins")
        return
    if args.nvdisasm:
        for path in args.paths:
            disassemble(pathlib.Path(path), args.nvdisasm)
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
