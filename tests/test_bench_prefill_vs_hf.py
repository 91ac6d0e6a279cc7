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
