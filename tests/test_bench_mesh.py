"""scripts/bench_mesh.py's readings (issue 34's run, made on a multi-GPU host): the collectives it reads
from a lowered step (the expert exchange's all-to-all and ragged all-to-all included, with their
bytes), the collectives' device time it reads from a trace, the bytes each device holds, its mesh
specs. The whole script runs on simulated CPU devices in ~7 minutes (too long for the suite; the
command is in its docstring)."""

import gzip
import importlib.util
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


@pytest.fixture(scope="module")
def bench_mesh():
    sys.path.insert(0, str(SCRIPTS))
    try:
        spec = importlib.util.spec_from_file_location("bench_mesh", SCRIPTS / "bench_mesh.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.path.remove(str(SCRIPTS))


def test_collectives_of_a_lowered_step_name_the_expert_exchange(bench_mesh):
    """A shard_map step with a ragged all-to-all (bf16 rows), an all-to-all and an all-reduce over 'ep':
    each is found once with its kind, operand shape and dtype; bytes are the operand's."""
    from bench_cp import collectives, tensor_bytes
    mesh = jax.make_mesh((2,), ("ep",))

    def body(x, sizes):
        y = jax.lax.ragged_all_to_all(x, jnp.zeros_like(x), sizes[0], sizes[0], sizes[0], sizes[0], axis_name="ep")
        z = jax.lax.all_to_all(x.astype(jnp.float32), "ep", 0, 0, tiled=True)
        return y.astype(jnp.float32) + z + jax.lax.psum(z[:1], "ep")

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"), P("ep")), out_specs=P("ep")))
    x = jax.device_put(jnp.zeros((12, 16), jnp.bfloat16), NamedSharding(mesh, P("ep")))
    sizes = jax.device_put(jnp.zeros((2, 2), jnp.int32), NamedSharding(mesh, P("ep")))
    found = collectives(step.lower(x, sizes).as_text())
    by_kind = {c["kind"]: c for c in found}
    assert sorted(by_kind) == ["all_reduce", "all_to_all", "ragged_all_to_all"], found
    assert len(found) == 3
    assert (by_kind["ragged_all_to_all"]["shape"], by_kind["ragged_all_to_all"]["dtype"]) == ((6, 16), "bf16")
    assert tensor_bytes(by_kind["ragged_all_to_all"]) == 6 * 16 * 2
    assert (by_kind["all_to_all"]["shape"], by_kind["all_to_all"]["dtype"]) == ((6, 16), "f32")
    assert tensor_bytes(by_kind["all_reduce"]) == 16 * 4


def test_collective_times_per_kind_from_a_trace(tmp_path, bench_mesh):
    """Device ops of two GPU lanes: the collectives summed per kind (a ragged all-to-all is not counted as
    an all-to-all), other ops and host events left out, the lanes counted."""
    meta = [{"ph": "M", "name": "process_name", "pid": p, "args": {"name": name}}
            for p, name in ((7, "/device:GPU:0"), (8, "/device:GPU:1"), (1, "/host:CPU"))]
    ops = [(7, "all-to-all.3", 10.0), (8, "all-to-all.3", 14.0), (7, "ragged-all-to-all.1", 5.0),
           (8, "ragged-all-to-all.1", 7.0), (7, "all-reduce-start.2", 3.0), (7, "fusion.4", 100.0),
           (1, "all-to-all.3", 1000.0)]
    events = [{"ph": "X", "pid": p, "tid": 1, "ts": i * 200.0, "dur": d, "name": n, "args": {"hlo_op": n}}
              for i, (p, n, d) in enumerate(ops)]
    (tmp_path / "t").mkdir()
    with gzip.open(tmp_path / "t" / "x.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": meta + events}, f)
    times, lanes = bench_mesh.collective_times(str(tmp_path / "t"))
    assert lanes == 2
    assert times == {"all-to-all": [24.0, 2], "ragged-all-to-all": [12.0, 2], "all-reduce": [3.0, 1]}


def test_bytes_per_device_and_mesh_specs(bench_mesh):
    mesh = jax.make_mesh((4,), ("ep",))
    experts = jax.device_put(np.zeros((8, 16), np.float32), NamedSharding(mesh, P("ep")))
    norm = jax.device_put(np.zeros((16,), np.float32), NamedSharding(mesh, P()))
    held = bench_mesh.bytes_per_device([experts, norm])
    assert len(held) == 4 and set(held.values()) == {2 * 16 * 4 + 16 * 4}
    assert bench_mesh.parse_mesh("ep=4,tp=2") == {"cp": 1, "ep": 4, "tp": 2}
    assert bench_mesh.mesh_name(bench_mesh.parse_mesh("")) == "1 device"
    for bad in ("dp=2", "ep=0", "ep=x"):
        with pytest.raises(SystemExit, match="is not AXIS=N"):
            bench_mesh.parse_mesh(bad)
