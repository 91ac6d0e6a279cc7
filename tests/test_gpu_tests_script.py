"""scripts/gpu_tests.py: each gpu-marked test in its own process, so a crash or a hang costs that test
alone; checked on CPU with synthetic gpu-marked tests that pass, fail, crash the process and hang."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SYNTHETIC = '''
import os, time
import pytest

@pytest.mark.gpu
def test_a_passes():
    assert 1 + 1 == 2

@pytest.mark.gpu
def test_b_fails():
    assert 1 + 1 == 3

@pytest.mark.gpu
def test_c_crashes_the_process():
    os.abort()

@pytest.mark.gpu
def test_d_hangs():
    time.sleep(60)

@pytest.mark.gpu
def test_e_passes_after_the_others():
    assert True

def test_not_gpu_marked():
    assert True'''

# a conftest that sets the platform as tests/conftest.py does (collection in gpu_tests.py's process imports it),
# and a test that records the platform it runs with
RECORDS_PLATFORM = '''
import os
os.environ.setdefault("JAX_PLATFORMS", "cpu")
''', '''
import os
import pytest

@pytest.mark.gpu
def test_records_its_platform():
    with open(os.environ["PLATFORM_RECORD"], "w") as f:
        f.write(os.environ.get("JAX_PLATFORMS", "unset"))
'''


def run(tmp_path, *extra, platforms="cpu", tests=SYNTHETIC, **env_extra):
    (tmp_path / "test_synthetic.py").write_text(tests)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs a GPU\n")
    out = tmp_path / "out.json"
    env = {"PATH": "/usr/bin:/bin", **env_extra} | ({"JAX_PLATFORMS": platforms} if platforms else {})
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_tests.py"), str(tmp_path), "--per-test", "8",
                        "--json", str(out), *extra], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    return r, (json.loads(out.read_text()) if out.exists() else None)


def test_each_test_runs_alone_and_its_outcome_is_named(tmp_path):
    r, got = run(tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    outcomes = {row["test"].split("::")[1]: row["outcome"] for row in got["tests"]}
    assert outcomes == {"test_a_passes": "passed", "test_b_fails": "failed",
                        "test_c_crashes_the_process": outcomes["test_c_crashes_the_process"],
                        "test_d_hangs": "timeout", "test_e_passes_after_the_others": "passed"}
    assert outcomes["test_c_crashes_the_process"].startswith("crashed")
    assert got["summary"]["passed"] == 2 and "summary: " in r.stdout
    assert "assert (1 + 1) == 3" in next(row["tail"] for row in got["tests"] if row["outcome"] == "failed")


def test_selection_and_budget(tmp_path):
    r, got = run(tmp_path, "-k", "passes")
    assert r.returncode == 0 and [row["outcome"] for row in got["tests"]] == ["passed", "passed"]
    r, got = run(tmp_path, "-k", "passes", "--budget", "0")
    assert r.returncode == 1 and [row["outcome"] for row in got["tests"]] == ["not run", "not run"]
    r, _ = run(tmp_path, "-k", "nothing_matches")
    assert r.returncode == 2 and "no gpu-marked tests" in r.stderr


def test_tests_run_on_the_gpu_where_no_platform_is_set(tmp_path):
    """With JAX_PLATFORMS unset each test runs with cuda, though collecting them imported a conftest that sets
    cpu where it is unset (the tests then failed on the CPU: "Only interpret mode is supported"); a platform
    given is kept."""
    conftest, test = RECORDS_PLATFORM
    (tmp_path / "conftest.py").write_text(conftest)
    record = tmp_path / "platform.txt"
    for given, want in ((None, "cuda"), ("cpu", "cpu")):
        record.unlink(missing_ok=True)
        r, _ = run(tmp_path, platforms=given, tests=test, PLATFORM_RECORD=str(record))
        assert r.returncode == 0, r.stdout + r.stderr
        assert record.read_text() == want, given
