"""scripts/bench_prefill_vs_hf.py's rounds: policies alternate their order every other round, and the
summary averages each policy's runs."""

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "bench_prefill_vs_hf", Path(__file__).resolve().parent.parent / "scripts" / "bench_prefill_vs_hf.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_each_policy_runs_once_in_each_place_over_two_rounds():
    order = [bench.policy_order(["a", "b", "c"], r) for r in range(4)]
    assert order == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"], ["c", "b", "a"]]


def test_round_means_average_each_policy_and_skip_errors_and_hf():
    res = [{"experts": 16, "prompt_len": 8192, "runner": "hf", "prefill": {"8192": {"seconds": 0.3}}},
           {"experts": 16, "prompt_len": 8192, "runner": "cpkv default", "prefill": {"seconds": 0.064}},
           {"experts": 16, "prompt_len": 8192, "runner": "cpkv x=true", "prefill": {"seconds": 0.062}},
           {"experts": 16, "prompt_len": 8192, "runner": "cpkv x=true", "prefill": {"seconds": 0.066}},
           {"experts": 16, "prompt_len": 8192, "runner": "cpkv default", "error": "boom"},
           {"experts": 256, "prompt_len": 8192, "runner": "cpkv default", "prefill": {"seconds": 0.070}}]
    got = bench.round_means(res)
    assert [(m["experts"], m["runner"]) for m in got] == [
        (16, "cpkv default"), (16, "cpkv x=true"), (256, "cpkv default")]
    assert got[1]["mean_s"] == pytest.approx(0.064) and got[1]["min_s"] == 0.062 and got[1]["runs_s"] == [0.062, 0.066]
    assert got[0]["runs_s"] == [0.064]


def test_main_runs_each_policy_per_round_in_alternating_order(monkeypatch, tmp_path, capsys):
    import json
    import sys
    calls = []

    def fake_run(cmd, timeout):
        policy = cmd[cmd.index("--kernels") + 1] if "--kernels" in cmd else "default"
        calls.append(policy)
        out = Path(cmd[cmd.index("--json") + 1])
        out.write_text(json.dumps({"prefill": {"seconds": 0.05 + 0.01 * len(calls), "mfu": 0.5}}))
        return type("Done", (), {"returncode": 0})()

    monkeypatch.setattr(bench, "run", fake_run)
    monkeypatch.setattr(sys, "argv", ["bench", "--no-hf", "--policies", "default;x=true", "--rounds", "2",
                                      "--json", str(tmp_path / "r.json")])
    bench.main()
    assert calls == ["default", "x=true", "x=true", "default"]
    saved = json.loads((tmp_path / "r.json").read_text())
    summary = [r for r in saved if r.get("summary")]
    assert [r["runner"] for r in summary] == ["cpkv default", "cpkv x=true"]
    assert summary[0]["runs_s"] == pytest.approx([0.06, 0.09]) and summary[1]["runs_s"] == pytest.approx([0.07, 0.08])
    assert "cpkv default, mean of 2" in capsys.readouterr().out


def test_hf_peer_halves_its_chunks_while_out_of_memory(monkeypatch):
    """An HF run out of GPU memory is retried in half the chunk, down to MIN_HF_CHUNK; other errors are not
    retried; a prompt shorter than the chunk starts from its own length."""
    import json
    import types
    chunks = []

    def fake_run(cmd, timeout, oom_above=4096, error=None):
        chunk = int(cmd[cmd.index("--chunk") + 1])
        chunks.append(chunk)
        if error or chunk > oom_above:
            return {"error": error or "Traceback ...\ntorch.OutOfMemoryError: CUDA out of memory."}
        return types.SimpleNamespace(stdout=json.dumps({"prefill": {"32768": {"seconds": 2.0, "chunk": chunk}}}))

    args = types.SimpleNamespace(model="glm-5", num_layers=4, hf_chunk=8192, timeout=10)
    monkeypatch.setattr(bench, "run", fake_run)
    got = bench.hf_peer(args, "16", "32768")
    assert chunks == [8192, 4096] and got["prefill"]["32768"]["chunk"] == 4096
    assert got["out_of_memory_chunks"] == [8192]
    chunks.clear()
    monkeypatch.setattr(bench, "run", lambda cmd, timeout: fake_run(cmd, timeout, oom_above=0))
    got = bench.hf_peer(args, "16", "32768")
    assert chunks == [8192, 4096, 2048] and "OutOfMemoryError" in got["error"]
    assert got["out_of_memory_chunks"] == [8192, 4096]
    chunks.clear()
    monkeypatch.setattr(bench, "run", lambda cmd, timeout: fake_run(cmd, timeout, error="ValueError: bad"))
    assert bench.hf_peer(args, "16", "32768") == {"error": "ValueError: bad"} and chunks == [8192]
    chunks.clear()
    monkeypatch.setattr(bench, "run", fake_run)
    bench.hf_peer(args, "16", "6000")
    assert chunks == [6000, 3000]
