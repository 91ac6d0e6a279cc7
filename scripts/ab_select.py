"""Times versions of the selection kernel against each other in one process (GPU): each version is a
copy of pallas_kernels/indexer/select.py, for example from another commit:

    git show main:pallas_kernels/indexer/select.py > /tmp/select_main.py
    python scripts/ab_select.py main=/tmp/select_main.py,new=pallas_kernels/indexer/select.py \
        --cases 2048x32768,64x131072,64x8192 --stages --json ab_select.json

Per case and version: the `select_tiling` in the version's namespace (select.py imports the current
pallas_kernels/indexer/tuning.py's; plus any `--extra` overrides), whether the result equals the
reference, the rows per path, and the time of the whole selection (and with --stages of stages
1, 1-2 and 1-3, `stop_after`), by `cpkv_jax.perf.chained_time`. Versions run in the same process on
the same inputs, so their ratios are comparable; bench_kernels.py gives the XLA baselines."""

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cpkv_jax.perf import chained_time  # noqa: E402
from pallas_kernels.indexer import PATHS, select_topk_reference  # noqa: E402
from scripts.bench_kernels import SELECT_CHAIN  # noqa: E402


def load_version(name: str, path: str):
    spec = importlib.util.spec_from_file_location(f"select_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("versions", help="name=path,name=path,...")
    p.add_argument("--cases", default="2048x32768,64x131072,64x8192", help="rows x width, comma-separated")
    p.add_argument("--k", type=int, default=2048)
    p.add_argument("--stages", action="store_true", help="also time stages 1, 1-2, 1-3")
    p.add_argument("--extra", default="", help="name+label:field=value:...;... a version with its tiling "
                                               "changed, e.g. new+w4:num_warps=4")
    p.add_argument("--json", default="ab_select.json")
    args = p.parse_args()
    versions = {n: load_version(n, path) for n, path in (v.split("=", 1) for v in args.versions.split(","))}
    results = []
    for rows, width in (tuple(map(int, c.split("x"))) for c in args.cases.split(",")):
        x = jax.random.normal(jax.random.key(rows + width), (rows, width), jnp.float32)
        want = np.asarray(jax.jit(lambda s: select_topk_reference(s, args.k))(x))
        runs = [(n, m, m.select_tiling(rows, width, args.k)) for n, m in versions.items()]
        for extra in filter(None, args.extra.split(";")):
            label, *fields = extra.split(":")
            m = versions[label.split("+")[0]]
            tiling = dict(m.select_tiling(rows, width, args.k))
            tiling.update({f.split("=")[0]: int(f.split("=")[1]) for f in fields})
            runs.append((extra, m, tiling))
        entry = {"rows": rows, "width": width, "k": args.k}
        for name, m, tiling in runs:
            t0 = time.time()
            got, path = jax.jit(lambda s: m.select_topk_pallas(s, args.k, return_path=True, **tiling))(x)
            cell = {"tiling": tiling, "equal": bool((np.asarray(got) == want).all()),
                    "rows_by_path": np.bincount(np.asarray(path), minlength=len(PATHS)).tolist()}
            for stage in (1, 2, 3) if args.stages else ():
                cell[f"stages_1_to_{stage}_us"] = 1e6 * chained_time(
                    lambda s: m.select_topk_pallas(s, args.k, stop_after=stage, **tiling), x, **SELECT_CHAIN)
            cell["us"] = 1e6 * chained_time(lambda s: m.select_topk_pallas(s, args.k, **tiling), x, **SELECT_CHAIN)
            entry[name] = cell
            timings = " ".join(f"{key} {v:.1f}" for key, v in cell.items() if key.endswith("us"))
            print(f"{rows}x{width} {name}: equal={cell['equal']} paths={cell['rows_by_path']} {timings} "
                  f"({time.time() - t0:.0f} s)", flush=True)
        results.append(entry)
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
