"""scripts/profile_prefill.py's attribution of device time: trace ops named by the JAX scopes that
XLA's optimized-HLO dump records for them, and time summed by scope."""

import gzip
import importlib.util
import json
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def profile_prefill():
    path = Path(__file__).resolve().parent.parent / "scripts" / "profile_prefill.py"
    spec = importlib.util.spec_from_file_location("profile_prefill", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


HLO = """HloModule jit_run_model, entry_computation_layout={(bf16[8]{0})->bf16[8]{0}}

%body (p: bf16[8]) -> bf16[8] {
  %mpmd_map.9 = bf16[8]{0} custom-call(%p), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(run_model)/jit(main)/while/body/attention/sparse_mla/pallas_call" source_file="x.py" source_line=3}, backend_config={"a":{"b":1}}
  ROOT %mpmd_map.4 = bf16[8]{0} custom-call(%mpmd_map.9), metadata={op_type="x" op_name="jit(run_model)/while/body/mlp/expert_mlp/gate_up/pallas_call"}
}

ENTRY %main (a: bf16[8]) -> bf16[8] {
  %fusion.2 = bf16[8]{0} fusion(%a), kind=kLoop, calls=%f
  ROOT %cublas-lt-matmul.2 = bf16[8]{0} custom-call(%fusion.2), metadata={op_name="jit(run_model)/eval_jaxpr/attention/dot_general"}
}
"""


def write_trace(trace_dir: Path, events):
    trace_dir.mkdir()
    meta = [{"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}}]
    with gzip.open(trace_dir / "x.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": meta + events}, f)


def test_ops_are_named_by_their_scopes_and_summed_by_scope(tmp_path, profile_prefill):
    (tmp_path / "module_0001.jit_run_model.sm_9.0_gpu_after_optimizations.txt").write_text(HLO)
    (tmp_path / "module_0001.jit_run_model.sm_9.0_gpu_after_optimizations-buffer-assignment.txt").write_text(
        "not an HLO module\n%mpmd_map.9 = nonsense")
    scopes = profile_prefill.hlo_scopes(str(tmp_path))
    assert scopes == {("jit_run_model", "mpmd_map.9"): "attention/sparse_mla/pallas_call",
                      ("jit_run_model", "mpmd_map.4"): "mlp/expert_mlp/gate_up/pallas_call",
                      ("jit_run_model", "cublas-lt-matmul.2"): "attention/dot_general"}
    ev = lambda op, ts, dur, pid=7, module="jit_run_model": {  # noqa: E731
        "ph": "X", "pid": pid, "tid": 1, "name": "kernel", "ts": ts, "dur": dur,
        "args": {"hlo_op": op, "hlo_module": module}}
    write_trace(tmp_path / "trace", [ev("mpmd_map.9", 0, 8.0), ev("mpmd_map.9", 10, 8.0), ev("mpmd_map.4", 20, 6.0),
                                     ev("cublas-lt-matmul.2", 30, 1.0), ev("fusion.2", 31, 0.5),
                                     ev("mpmd_map.9", 40, 99.0, pid=1),           # a host lane: not counted
                                     ev("mpmd_map.9", 50, 2.0, module="jit_other")])   # another module: no scope
    ops, span, lanes = profile_prefill.device_op_times(str(tmp_path / "trace"), scopes)
    assert lanes == ["/device:GPU:0"] and span == 52.0
    assert ops == {("jit_run_model", "mpmd_map.9", "attention/sparse_mla/pallas_call"): [16.0, 2],
                   ("jit_run_model", "mpmd_map.4", "mlp/expert_mlp/gate_up/pallas_call"): [6.0, 1],
                   ("jit_run_model", "cublas-lt-matmul.2", "attention/dot_general"): [1.0, 1],
                   ("jit_run_model", "fusion.2", ""): [0.5, 1],
                   ("jit_other", "mpmd_map.9", ""): [2.0, 1]}
    assert profile_prefill.scope_times(ops) == {"attention/sparse_mla": [16.0, 2], "mlp/expert_mlp/gate_up": [6.0, 1],
                                                "attention": [1.0, 1], "(unscoped)": [2.5, 2]}
    assert profile_prefill.scope_times(ops, depth=1)["mlp"] == [6.0, 1]


def test_profile_flags_keep_the_callers_and_turn_command_buffers_off_unless_asked(tmp_path, profile_prefill,
                                                                              monkeypatch):
    """set_profile_flags appends to XLA_FLAGS (a caller's flags stay) the HLO dump and, unless command
    buffers are asked for, the flag that turns them off (bench_kernels --command-buffers-off appends that
    one alone through add_xla_flags)."""
    monkeypatch.setenv("XLA_FLAGS", "--xla_mine=1")
    assert profile_prefill.set_profile_flags(str(tmp_path)) == str(tmp_path)
    flags = profile_prefill.os.environ["XLA_FLAGS"].split()
    assert flags == ["--xla_mine=1", f"--xla_dump_to={tmp_path}", "--xla_dump_hlo_as_text",
                     profile_prefill.COMMAND_BUFFERS_OFF]
    monkeypatch.delenv("XLA_FLAGS")
    profile_prefill.set_profile_flags(str(tmp_path), command_buffers=True)
    assert profile_prefill.COMMAND_BUFFERS_OFF not in profile_prefill.os.environ["XLA_FLAGS"]
    profile_prefill.add_xla_flags(profile_prefill.COMMAND_BUFFERS_OFF)
    assert profile_prefill.os.environ["XLA_FLAGS"].endswith(" " + profile_prefill.COMMAND_BUFFERS_OFF)
