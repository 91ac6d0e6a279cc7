"""scripts/ncu_kernel.py: reading Nsight Compute's raw CSV into per-launch rows. The fixture is the
sparse MLA prefill kernel's real ncu output on the H200 (2026-12-03, before its copies were made
sector-wise; the columns this script reads, behind two lines of the program's own output), so the
numbers asserted are the ones docs/perf.md quotes. The end-to-end test runs main() with a stand-in
`ncu` that writes the fixture where the real one writes its log."""

import importlib.util
import json
import stat
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "ncu_raw_sparse_mla.csv"


@pytest.fixture(scope="module")
def nk():
    spec = importlib.util.spec_from_file_location("ncu_kernel", ROOT / "scripts" / "ncu_kernel.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_raw_csv_rows_become_one_summary_per_launch(nk):
    launches = nk.parse_raw_csv(FIXTURE.read_text())
    assert len(launches) == 1
    row = nk.summarize(launches[0], expected_bytes=2048 * 2048 * 1152)   # 2048 queries x 2048 rows x 1152 B
    assert row["kernel"] == "anonymous_mosaic_gpu_kernel"
    assert row["us"] == pytest.approx(1957.344)                          # the CSV gives ms
    assert row["L2 %"] == pytest.approx(83.291117)
    assert row["tensor %"] == pytest.approx(47.150666)
    assert row["DRAM %"] == pytest.approx(3.218468)
    assert row["regs"] == 168
    assert row["spills"] == 819200 + 278528                # local loads + stores: ncu's 1,097,728 spill requests
    assert row["L2 read MB"] == pytest.approx(273900248 * 32 / 1e6)
    assert row["L2 read / expected"] == pytest.approx(1.814, abs=1e-3)   # every sector read twice
    assert [s for s, _ in row["stalls"]] == ["long_scoreboard", "short_scoreboard", "barrier", "mio_throttle"]
    assert row["stalls"][0][1] == pytest.approx(4.200147)


def test_times_follow_the_unit_row(nk):
    launch = nk.parse_raw_csv(FIXTURE.read_text())[0]
    launch["_unit:gpu__time_duration.sum"] = "ns"
    launch["gpu__time_duration.sum"] = 1500.0
    assert nk.summarize(launch)["us"] == pytest.approx(1.5)
    assert nk.summarize(launch)["L2 read / expected"] is None         # no expected bytes given


def test_output_without_a_header_is_an_error_naming_it(nk):
    with pytest.raises(ValueError, match="no ncu raw CSV header"):
        nk.parse_raw_csv("==PROF== No kernels were profiled.\n")


def test_ncu_command(nk):
    c = nk.ncu_command("ncu", "mosaic", 1, 2, "/tmp/l.csv", False, ["MemoryWorkloadAnalysis_Tables"],
                       ["python3", "x.py"])
    assert c[:8] == ["ncu", "--clock-control", "none", "--csv", "--page", "raw", "--log-file", "/tmp/l.csv"]
    assert c[c.index("-k") + 1] == "regex:mosaic"
    assert c[c.index("--launch-skip") + 1] == "1" and c[c.index("--launch-count") + 1] == "2"
    metrics = c[c.index("--metrics") + 1].split(",")
    assert "gpu__time_duration.sum" in metrics and nk.STALL_METRIC.format("barrier") in metrics
    assert not any(m.startswith("derived__") for m in metrics)          # not collectable by name
    assert c[c.index("--section") + 1] == "MemoryWorkloadAnalysis_Tables"
    assert c[-2:] == ["python3", "x.py"]
    listing = nk.ncu_command("ncu", "mosaic", 1, 2, "/tmp/l.csv", True, [], ["python3", "x.py"])
    assert "-k" not in listing and listing[listing.index("--metrics") + 1] == "gpu__time_duration.sum"


def test_main_end_to_end_with_a_stand_in_ncu(nk, tmp_path, capsys):
    fake = tmp_path / "ncu"
    fake.write_text("#!/bin/sh\n"
                    "while [ $# -gt 0 ]; do if [ \"$1\" = --log-file ]; then cp '%s' \"$2\"; fi; shift; done\n"
                    % FIXTURE)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "r.json"
    assert nk.main(["--ncu", str(fake), "--kernel", "mosaic", "--bytes", str(2048 * 2048 * 1152),
                    "--json", str(out), "--", "python3", "-c", "pass"]) == 0
    printed = capsys.readouterr().out
    assert "anonymous_mosaic_gpu_kernel" in printed and "1.81" in printed and "long_scoreboard 4.20" in printed
    saved = json.loads(out.read_text())
    assert saved["launches"][0]["lts__throughput.avg.pct_of_peak_sustained_elapsed"] == pytest.approx(83.291117)
    assert nk.main(["--ncu", str(fake), "--list", "--", "python3", "-c", "pass"]) == 0
    assert "1957.3 us" in capsys.readouterr().out


SOURCE_PAGE = '''==PROF== Connected
"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","Instructions Executed"
"0x7f00","WARPGROUP.DEPBAR.LE gsb0, 0x0 ;","600","590","10"
"0x7f10","FFMA R1, R2, R3, R1 ;","150","20","640"
"0x7f20","FFMA R4, R2, R3, R4 ;","150","20","640"
"0x7f30","@!P2 SYNCS.PHASECHK.TRANS64.TRYWAIT P2, [UR8], R24 ;","100","100","10"
'''


def test_source_page_ranks_instructions_and_opcodes_by_stall_samples(nk):
    ranked, by_op = nk.stall_lines(SOURCE_PAGE, top=2)
    assert [e["address"] for e in ranked] == ["0x7f00", "0x7f10"]
    assert ranked[0]["share"] == pytest.approx(0.6)
    assert list(by_op) == ["WARPGROUP.DEPBAR.LE", "FFMA", "SYNCS.PHASECHK.TRANS64.TRYWAIT"]
    assert by_op["FFMA"] == pytest.approx(0.3) and by_op["SYNCS.PHASECHK.TRANS64.TRYWAIT"] == pytest.approx(0.1)


def test_source_commands_profile_one_launch_then_export_its_sass(nk):
    profile, export = nk.source_commands("ncu", "mosaic", 2, "/tmp/r", ["python3", "x.py"])
    assert profile[-2:] == ["python3", "x.py"] and "SourceCounters" in profile
    assert profile[profile.index("--launch-skip") + 1] == "2" and profile[profile.index("-k") + 1] == "regex:mosaic"
    assert export == ["ncu", "-i", "/tmp/r.ncu-rep", "--page", "source", "--csv", "--print-source", "sass"]
