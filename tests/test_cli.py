"""`cpkv-jax generate | bench | score | convert` from outside: the checked numbers come back through files and stdout."""

import json
import subprocess
import sys

import numpy as np
import pytest

from cpkv_jax.cli import main
from tests.helpers import FIXTURES, reference, rel_err


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "cpkv_jax.cli", *args], capture_output=True, text=True,
                          timeout=300)


def test_convert_then_score_matches_hf(tmp_path, capsys):
    out = tmp_path / "ck"
    assert main(["convert", "--hf", str(FIXTURES / "dsv32_tiny"), "--out", str(out), "--quiet"]) == 0
    ref = reference("dsv32_tiny")
    toks = ref["prefill_tokens"][0]
    npy = tmp_path / "logits.npy"
    capsys.readouterr()
    assert main(["score", "--model", str(out), "--tokens", ",".join(map(str, toks)), "--out", str(npy)]) == 0
    summary = json.loads(capsys.readouterr().out)
    logits = np.load(npy)
    assert logits.shape == (len(toks), 256) and logits.dtype == np.float32
    assert rel_err(logits, ref["prefill_logits"][0]) <= 1e-5
    assert summary["tokens"] == len(toks) and summary["dtype"] == "float32"
    logp = logits - np.logaddexp.reduce(logits, -1, keepdims=True)
    assert summary["mean_nll"] == pytest.approx(-logp[np.arange(len(toks) - 1), toks[1:]].mean(), rel=1e-5)


def test_score_hf_dir_with_dtype_override(tmp_path, capsys):
    npy = tmp_path / "l.npy"
    assert main(["score", "--model", str(FIXTURES / "glm_tiny"), "--tokens", "1,2,3,4", "--out", str(npy),
                 "--dtype", "bfloat16", "--attn-path", "absorbed"]) == 0
    assert json.loads(capsys.readouterr().out)["dtype"] == "bfloat16"
    assert np.isfinite(np.load(npy)).all()


def test_convert_fp8_keeps_fp8_and_matches_hf(tmp_path, capsys):
    out = tmp_path / "ck8"
    assert main(["convert", "--hf", str(FIXTURES / "glm_tiny_fp8"), "--out", str(out), "--quiet"]) == 0
    assert "self_attn.q_b_proj" in json.loads(capsys.readouterr().out)["fp8_linears"]
    ref = reference("glm_tiny_fp8")
    npy = tmp_path / "l.npy"
    toks = ref["prefill_tokens"][1]
    assert main(["score", "--model", str(out), "--tokens", ",".join(map(str, toks)), "--out", str(npy)]) == 0
    assert rel_err(np.load(npy), ref["prefill_logits"][1]) <= 1e-5


@pytest.mark.parametrize("args, message", [
    (["score", "--model", "/nonexistent", "--tokens", "1,2", "--out", "x.npy"], "does not exist"),
    (["score", "--model", "tiny", "--tokens", "1,a", "--out", "x.npy"], "comma-separated integers"),
    (["score", "--model", "tiny", "--tokens", "1,99999", "--out", "x.npy"], "outside the vocabulary"),
    (["convert", "--hf", "/nonexistent", "--out", "x"], "no config.json"),
    (["generate", "--model", "/nonexistent", "--tokens", "1,2"], "does not exist"),
    (["generate", "--tokens", "1,99999"], "outside the vocabulary"),
    (["generate", "--tokens", "1,2", "--max-new-tokens", "0"], "max_new_tokens"),
    (["generate", "--tokens", "1,2", "--temperature", "-1"], "temperature"),
    (["generate", "--tokens", "1,2", "--kv-pages", "1"], "kv_pages"),
    (["generate", "--tokens", "1,2", "--max-new-tokens", "5000"], "exceeds the model's context"),
    (["generate"], "at least one --prompt"),
    (["generate", "--tokens", "1,2", "--hicache-pages", "9", "--cp", "2"], "multiple of cp_size"),
    (["generate", "--tokens", "a,b"], "comma-separated integers >= 0"),
    (["generate", "--tokens", "1.5,2"], "'1.5'"),
    (["generate", "--tokens", ""], "is empty"),
    (["generate", "--tokens", "1,,2"], "an empty entry"),
    (["generate", "--tokens=-3,2"], "'-3'"),
    (["score", "--model", "tiny", "--tokens", "", "--out", "x.npy"], "is empty"),
    (["generate", "--tokens", "1,2", "--index-dtype", "int4"], "invalid choice: 'int4'"),
    (["generate", "--tokens", "1,2", "--n", "0"], "n must be an integer >= 1"),
])
def test_cli_errors_exit_2_with_message(capsys, args, message):
    """Every input error is one message and status 2, argument errors and engine errors alike (in this
    process: main's return or argparse's exit; test_cli_errors_from_a_process runs two as processes)."""
    try:
        code = main(args)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, (code, err)
    assert message in err and "Traceback" not in err, err


@pytest.mark.parametrize("args, message", [
    (["generate", "--tokens", "1,2", "--temperature", "-1"], "temperature"),
    (["generate", "--tokens", "1.5,2"], "'1.5'"),
])
def test_cli_errors_from_a_process(args, message):
    """As a process: exit status 2, the message, no traceback (an engine error and an argument error)."""
    r = run_cli(*args)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr


def test_every_verb_has_help(capsys):
    for verb in ("generate", "bench", "serve", "score", "convert", "trace"):
        with pytest.raises(SystemExit) as e:
            main([verb, "--help"])
        assert e.value.code == 0 and f"usage: cpkv-jax {verb}" in capsys.readouterr().out


def test_generate_json_outputs_in_request_order_equal_the_engine(capsys):
    from cpkv_jax.engine import Engine, EngineConfig
    from cpkv_jax.sampling import SamplingParams

    args = ["generate", "--tokens", "5,6,7,8", "--prompt", "Hello there", "--tokens", "300,2",
            "--max-new-tokens", "5", "--page-size", "16", "--kv-pages", "64", "--json", "--ignore-eos"]
    assert main(args) == 0
    got = json.loads(capsys.readouterr().out)
    eng = Engine("tiny", EngineConfig(page_size=16, kv_pages=64))
    ref = eng.generate([[5, 6, 7, 8], "Hello there", [300, 2]], SamplingParams(max_new_tokens=5, ignore_eos=True))
    assert [o["token_ids"] for o in got["outputs"]] == [o.token_ids for o in ref]
    assert [o["text"] for o in got["outputs"]] == [o.text for o in ref]
    assert all(o["finish_reason"] == "length" for o in got["outputs"])
    assert got["timing"]["output_tokens"] == 15 and got["timing"]["wall_s"] > 0


def test_bench_writes_table_and_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "--batch", "2", "--prompt-len", "40", "--decode-tokens", "4", "--page-size", "16",
                 "--repeat", "1", "--quiet", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "prefill" in table and "decode" in table and "MFU" in table
    r = json.loads(out.read_text())
    assert r["prefill"]["tokens"] == 80 and r["decode"]["tokens"] == 6 and r["decode"]["steps"] == 3
    assert r["prefill"]["tokens_per_s"] > 0 and 0 < r["prefill"]["mfu"] < 1
    assert r["decode"]["bytes"] > 0 and r["ceilings"]["copy_bytes_per_s"] > 0


def test_generate_with_cp_matches_single_device(capsys):
    base = ["generate", "--tokens", ",".join(str(t) for t in range(3, 140)), "--tokens", "9,8,7",
            "--max-new-tokens", "4", "--page-size", "16", "--kv-pages", "64", "--json", "--ignore-eos"]
    assert main(base) == 0
    single = json.loads(capsys.readouterr().out)
    assert main(base + ["--cp", "4"]) == 0
    cp = json.loads(capsys.readouterr().out)
    assert [o["token_ids"] for o in cp["outputs"]] == [o["token_ids"] for o in single["outputs"]]


def test_generate_speculative_matches_plain(capsys):
    base = ["generate", "--tokens", "5,6,7,8,9,10", "--max-new-tokens", "7", "--page-size", "16", "--kv-pages", "64",
            "--json", "--ignore-eos"]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(base + ["--speculative", "nextn", "--num-draft-tokens", "3"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["outputs"][0]["token_ids"] == plain["outputs"][0]["token_ids"]
    assert spec["timing"]["spec_rounds"] > 0 and spec["timing"]["spec_acceptance_length"] >= 1.0


def test_generate_with_host_cache_matches_plain(capsys):
    base = ["generate", "--tokens", ",".join(str(t) for t in range(3, 70)), "--tokens",
            ",".join(str(t) for t in range(3, 60)), "--max-new-tokens", "4", "--page-size", "16", "--kv-pages", "64",
            "--json", "--ignore-eos"]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(base + ["--hicache-pages", "32"]) == 0
    host = json.loads(capsys.readouterr().out)
    assert [o["token_ids"] for o in host["outputs"]] == [o["token_ids"] for o in plain["outputs"]]


# Each EngineConfig field: the flag that sets it and a non-default value (one table: a field added to
# EngineConfig without a flag fails the first test).
ENGINE_FLAGS = {
    "page_size": (["--page-size", "32"], 32), "kv_pages": (["--kv-pages", "96"], 96),
    "max_running": (["--max-running", "4"], 4), "max_prefill_tokens": (["--max-prefill-tokens", "256"], 256),
    "prefix_cache": (["--no-prefix-cache"], False), "overlap": (["--no-overlap"], False),
    "dtype": (["--dtype", "bfloat16"], "bfloat16"),
    "index_dtype": (["--index-dtype", "same"], "same"), "attn_path": (["--attn-path", "absorbed"], "absorbed"),
    "min_prefill_lanes": (["--min-prefill-lanes", "8"], 8), "cp_size": (["--cp", "2"], 2),
    "ep_size": (["--ep", "2"], 2), "tp_size": (["--tp", "2"], 2),
    "ep_dispatch": (["--ep-dispatch", "all_to_all"], "all_to_all"),
    "two_batch_overlap": (["--two-batch-overlap"], True),
    "cp_mode": (["--cp-mode", "round_robin"], "round_robin"),
    "cp_short_policy": (["--cp-short-policy", "token_balanced"], "token_balanced"),
    "speculative": (["--speculative", "nextn"], "nextn"), "num_draft_tokens": (["--num-draft-tokens", "3"], 3),
    "hicache_pages": (["--hicache-pages", "8"], 8),
    "hicache_policy": (["--hicache-policy", "write_through_selective"], "write_through_selective"),
    "hicache_copy": (["--hicache-copy", "jit"], "jit"),
    "kernels": (["--kernels", "moe_kernel=false"], "moe_kernel=false"),
    "pd_prefill_devices": (["--pd-prefill-devices", "2"], 2), "pd_decode_replicas": (["--pd-decode-replicas", "3"], 3),
    "pd_router": (["--pd-router", "prefix"], "prefix"),
    "kv_trace": (["--kv-trace", "2"], 2), "trace_out": (["--trace-out", "run.jsonl"], "run.jsonl"),
}
VERB_ARGS = {"generate": ["--tokens", "1,2"], "bench": [], "serve": []}


def test_every_engine_config_field_has_the_same_flag_on_generate_bench_and_serve():
    """Each flag sets its field (and only it) of the EngineConfig the verbs build (cli.engine_config),
    with the same name on every verb; with no flags generate and serve run EngineConfig's defaults."""
    import dataclasses

    from cpkv_jax.cli import build_parser, engine_config
    from cpkv_jax.config import EngineConfig
    from pallas_kernels.policy import KernelPolicy

    assert set(ENGINE_FLAGS) == {f.name for f in dataclasses.fields(EngineConfig)}
    parser = build_parser()
    for verb, base in VERB_ARGS.items():
        default = engine_config(parser.parse_args([verb, *base]))
        if verb != "bench":            # bench sizes the pool, running set and budget from its workload
            assert default == EngineConfig()
        for field, (flag, value) in ENGINE_FLAGS.items():
            want = KernelPolicy.parse(value) if field == "kernels" else value
            got = engine_config(parser.parse_args([verb, *base, *flag]))
            assert got == dataclasses.replace(default, **{field: want}), (verb, field)


def test_compile_cache_is_kept_under_the_cache_dir_unless_opted_out(monkeypatch):
    """generate, bench and serve point JAX's persistent compilation cache at $CPKV_CACHE_DIR/xla before
    they run; --no-compile-cache leaves it unset, and a directory already set is kept."""
    import jax

    import cpkv_jax.cli as cli
    from models.weights import cache_dir

    seen = []
    for name in ("cmd_generate", "cmd_bench", "cmd_serve"):
        monkeypatch.setattr(cli, name, lambda args: seen.append(jax.config.jax_compilation_cache_dir) or 0)
    before = jax.config.jax_compilation_cache_dir
    try:
        for verb, base in VERB_ARGS.items():
            jax.config.update("jax_compilation_cache_dir", None)
            assert main([verb, *base, "--no-compile-cache"]) == 0
            assert main([verb, *base]) == 0
        jax.config.update("jax_compilation_cache_dir", "/elsewhere")
        assert main(["generate", "--tokens", "1"]) == 0
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
    assert seen == [None, str(cache_dir() / "xla")] * 3 + ["/elsewhere"]


def test_generate_stop_strings_and_n_equal_the_engine(capsys):
    import dataclasses

    from cpkv_jax.engine import Engine, EngineConfig
    from cpkv_jax.sampling import SamplingParams

    eng = Engine("tiny", EngineConfig(page_size=16, kv_pages=64))
    prompt = [11, 42, 7, 300, 5, 19, 64, 128]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True, temperature=0.8, seed=9, n=2)
    full = eng.generate([prompt], params)[0].text
    stop = next(c for c in full[1:] if c != "\ufffd")
    want = eng.generate([prompt, "Hi"], dataclasses.replace(params, stop=(stop, "\x00")))
    assert want[0].finish_reason == "stop" and want[0].text == full[:full.find(stop)]
    args = ["generate", "--tokens", ",".join(map(str, prompt)), "--prompt", "Hi", "--max-new-tokens", "16",
            "--ignore-eos", "--temperature", "0.8", "--seed", "9", "--n", "2", "--stop", stop, "--stop", "\x00",
            "--page-size", "16", "--kv-pages", "64", "--json"]
    assert main(args) == 0
    got = json.loads(capsys.readouterr().out)["outputs"]
    assert [(o["token_ids"], o["text"], o["finish_reason"]) for o in got] == \
        [(o.token_ids, o.text, o.finish_reason) for o in want]
    assert len(got) == 4


def test_generate_index_dtype_same_gives_scores_argmax(tmp_path, capsys):
    """On an HF fixture, greedy generate with unquantized indexer keys emits score's argmax at every
    step with score's log-probabilities; the default fp8 keys do not give score's numbers."""
    model = str(FIXTURES / "glm_tiny")
    prompt = reference("glm_tiny")["prefill_tokens"][0][:40].tolist()
    base = ["generate", "--model", model, "--tokens", ",".join(map(str, prompt)), "--max-new-tokens", "8",
            "--ignore-eos", "--logprobs", "--page-size", "16", "--kv-pages", "64", "--json"]
    assert main(base + ["--index-dtype", "same"]) == 0
    same = json.loads(capsys.readouterr().out)["outputs"][0]
    assert main(base) == 0
    fp8 = json.loads(capsys.readouterr().out)["outputs"][0]
    npy = tmp_path / "l.npy"
    assert main(["score", "--model", model, "--tokens", ",".join(map(str, prompt + same["token_ids"])),
                 "--out", str(npy)]) == 0
    logits = np.load(npy)
    steps = np.arange(len(prompt) - 1, len(prompt) - 1 + 8)
    assert same["token_ids"] == logits[steps].argmax(-1).tolist()
    logp = logits - np.logaddexp.reduce(logits, -1, keepdims=True)
    np.testing.assert_allclose(same["logprobs"], logp[steps, same["token_ids"]], atol=1e-5)
    assert fp8["token_ids"] != same["token_ids"] or np.abs(np.subtract(fp8["logprobs"], same["logprobs"])).max() > 1e-3
