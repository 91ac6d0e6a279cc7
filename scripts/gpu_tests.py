"""The GPU-marked tests, each in its own process under its own time limit: a kernel that stops the GPU
(an illegal instruction kills the process's CUDA context, and with it every later test of a shared
pytest run) or a slow compile costs that test alone. Prints a table (test, outcome, seconds) and writes
JSON; stops starting tests when --budget seconds are spent, listing the ones not run. Exit status 0
only if every selected test passed (a skip on the GPU is reported, not counted as a pass).

    python3 scripts/gpu_tests.py -k "compiled and not fused" --per-test 150 --budget 500

Each test runs with JAX_PLATFORMS as this process got it (cuda where unset).
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUTCOME = re.compile(r"\b(\d+) (passed|failed|error|errors|skipped|deselected)\b")


def collect(paths: list[str], keyword: str | None) -> list[str]:
    """The gpu-marked tests under paths (matching -k keyword) as absolute node ids (file path::name),
    which a pytest run from any directory takes. Collected in this process (imports, no runs)."""
    import contextlib
    import io

    import pytest

    class Ids:
        found: list[str] = []

        def pytest_collection_finish(self, session):
            self.found = [f"{item.path}::{item.nodeid.split('::', 1)[1]}" for item in session.items]

    ids = Ids()
    args = ["--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider", *paths] + (["-k", keyword] if keyword else [])
    with contextlib.redirect_stdout(io.StringIO()):
        pytest.main(args, plugins=[ids])
    return ids.found


def outcome(returncode: int | None, output: str) -> str:
    """'passed', 'failed', 'timeout' or 'crashed (rc N)' from one test's pytest run."""
    if returncode is None:
        return "timeout"
    counts = {kind: int(n) for n, kind in OUTCOME.findall(output)}
    if returncode == 0 and counts.get("passed"):
        return "passed"
    if counts.get("failed") or counts.get("error") or counts.get("errors"):
        return "failed"
    if counts.get("skipped"):
        return "skipped"
    return f"crashed (rc {returncode})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("paths", nargs="*", default=["tests"])
    p.add_argument("-k", dest="keyword", default=None, help="pytest -k expression")
    p.add_argument("--per-test", type=float, default=180, help="seconds one test may take")
    p.add_argument("--budget", type=float, default=540, help="no test starts after this many seconds")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    # taken before collecting: collection imports the tests' conftest, which sets JAX_PLATFORMS=cpu where it is
    # unset, and every test would then run (and fail) on the CPU
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cuda"), PYTHONPATH=str(ROOT))
    tests = collect(args.paths, args.keyword)
    if not tests:
        print("no gpu-marked tests selected", file=sys.stderr)
        return 2
    start, rows = time.perf_counter(), []
    for test in tests:
        if time.perf_counter() - start > args.budget:
            rows.append({"test": test, "outcome": "not run", "s": 0.0})
            continue
        t0 = time.perf_counter()
        try:
            r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", test],
                               cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.per_test)
            code, text = r.returncode, r.stdout + r.stderr
        except subprocess.TimeoutExpired as e:
            code, text = None, "".join(o.decode(errors="replace") if isinstance(o, bytes) else o
                                       for o in (e.stdout, e.stderr) if o)
        row = {"test": test, "outcome": outcome(code, text), "s": round(time.perf_counter() - t0, 1)}
        if row["outcome"] != "passed":
            row["tail"] = "\n".join(line for line in text.splitlines()
                                    if line.startswith(("E ", "FAILED", "ERROR")) or "CUDA_ERROR" in line)[-1500:]
        rows.append(row)
        print(f"{row['outcome']:>16}  {row['s']:7.1f} s  {test}", flush=True)
    summary = {kind: sum(r["outcome"] == kind for r in rows) for kind in sorted({r["outcome"] for r in rows})}
    print("summary:", ", ".join(f"{n} {kind}" for kind, n in summary.items()))
    for r in rows:
        if r.get("tail"):
            print(f"--- {r['test']}\n{r['tail']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"tests": rows, "summary": summary}, indent=1))
    return 0 if all(r["outcome"] == "passed" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
