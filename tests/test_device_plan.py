"""scripts/device_plan.sh: every command of every part takes its arguments (each script's own parser,
the commands ncu runs included), names tilings the MoE bench has, and every test selection selects GPU
tests, checked on CPU from the plan's dry run, so a device call is never spent on a misspelled flag."""

import argparse
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PLAN = ROOT / "scripts" / "device_plan.sh"


class Parsed(Exception):
    pass


def dry_run(*parts: str, gpus: int = 8) -> list[list[str]]:
    out = subprocess.run(["bash", str(PLAN), *parts], capture_output=True, text=True, check=True, cwd=ROOT,
                         env={"PATH": "/usr/bin:/bin", "PLAN_DRY_RUN": "1", "PLAN_GPUS": str(gpus)}).stdout
    return [shlex.split(line) for line in out.splitlines() if line.strip()]


def parse_only(script: str, args: list[str], monkeypatch) -> argparse.Namespace:
    """args parsed by the script's own parser (its main() run until parse_args returns)."""
    seen = {}
    original = argparse.ArgumentParser.parse_args

    def parse(self, a=None, namespace=None):
        seen["ns"] = original(self, a, namespace)
        raise Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse)
    monkeypatch.setattr(sys, "argv", [script, *args])
    with pytest.raises(Parsed):
        runpy.run_path(str(ROOT / script), run_name="__main__")
    monkeypatch.undo()
    return seen["ns"]


def or_terms(expr: str) -> list[str]:
    """A pytest -k expression's alternatives: split at its top-level ' or '."""
    terms, depth, start = [], 0, 0
    for i, c in enumerate(expr):
        depth += {"(": 1, ")": -1}.get(c, 0)
        if depth == 0 and expr.startswith(" or ", i):
            terms.append(expr[start:i])
            start = i + 4
    return [*terms, expr[start:]]


def check(cmd: list[str], monkeypatch) -> None:
    if cmd[0] == "timeout":                   # a part's own limit before its command: timeout [-k S] SECONDS
        cmd = cmd[4:] if cmd[1] == "-k" else cmd[2:]
    assert cmd[0] == "python3" and cmd[1].startswith("scripts/"), cmd
    script, args = cmd[1], cmd[2:]
    for path in (ROOT, ROOT / "scripts"):      # the scripts import each other and the packages (PYTHONPATH=.:scripts)
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    if script == "scripts/gpu_tests.py":
        import gpu_tests
        ns = parse_only(script, args, monkeypatch)
        for term in or_terms(ns.keyword):    # each alternative of -k selects some GPU test
            assert gpu_tests.collect([str(ROOT / p) for p in ns.paths], term), (term, cmd)
        return
    ns = parse_only(script, args, monkeypatch)
    if script == "scripts/bench_moe_tilings.py" and ns.tilings:   # names it knows (it refuses others, but later)
        import bench_moe_tilings
        assert set(ns.tilings.split(",")) <= bench_moe_tilings.tiling_names(ns.hidden, ns.width), cmd
    for policies in (getattr(ns, name, None) for name in ("policies", "kernels")):   # KernelPolicy fields it has
        if isinstance(policies, str):
            from cpkv_jax.cli import kernel_policy
            for policy in policies.split(";"):
                if policy != "default":
                    kernel_policy(policy)
    if script == "scripts/ncu_kernel.py":    # the command ncu profiles
        inner = ns.cmd[1:] if ns.cmd[:1] == ["--"] else ns.cmd
        check(inner, monkeypatch)


def documented_parts() -> list[str]:
    """The parts the plan's header lists (`#   name  what it measures`)."""
    import re
    return re.findall(r"^#   ([a-z0-9_]+) ", PLAN.read_text(), re.M)


def test_every_part_is_documented_and_defined():
    import re
    defined = re.findall(r"^part_([a-z0-9_]+)\(\)", PLAN.read_text(), re.M)
    assert sorted(documented_parts()) == sorted(defined)


def test_every_command_of_every_part_parses(monkeypatch):
    parts = documented_parts()
    assert {"tests", "moe", "sass", "k2", "ncu_source", "e2e", "mesh"} <= set(parts)
    commands = dry_run(*parts)
    assert len(commands) >= len(parts)
    for cmd in commands:
        check(cmd, monkeypatch)
    # the GPU count sizes the multi-GPU parts
    assert "ep=8" in " ".join(dry_run("mesh", gpus=8)[0]) and "ep=8" not in " ".join(dry_run("mesh", gpus=2)[0])


def test_a_misspelled_flag_or_an_unknown_part_fails(monkeypatch):
    cmd = dry_run("moe")[0]
    with pytest.raises(SystemExit):
        check([*cmd, "--no-such-flag"], monkeypatch)
    assert subprocess.run(["bash", str(PLAN), "no_such_part"], capture_output=True, cwd=ROOT,
                          env={"PATH": "/usr/bin:/bin", "PLAN_DRY_RUN": "1"}).returncode == 2
