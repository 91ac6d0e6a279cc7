"""scripts/sass_summary.py: the matrix loop is the smallest backward-branch loop holding a wgmma, found
through labels or hex targets; the ptxas resource lines come with it."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "sass_summary", Path(__file__).resolve().parent.parent / "scripts" / "sass_summary.py")
sass_summary = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sass_summary)

LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   LDG.E R9, desc[UR4][R2.64] ;
.L_x_2:
        /*0020*/                   LDS R2, [R3] ;
        /*0030*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR4], R24 ;
        /*0040*/                   FFMA R5, R6, R7, R5 ;
        /*0050*/                   FFMA R8, R6, R7, R8 ;
        /*0060*/              @P0   BRA `(.L_x_2) ;
        /*0070*/                   STS [R4], R5 ;
        /*0080*/              @!P1  BRA 0x10 ;
.L_x_3:
        /*0090*/                   FADD R1, R1, R1 ;
        /*00a0*/              @P2   BRA `(.L_x_3) ;
        /*00b0*/                   EXIT ;
ptxas info    : Used 168 registers, 0 bytes spill stores, 0 bytes spill loads
"""


def test_the_matrix_loop_is_the_smallest_loop_with_a_wgmma(tmp_path):
    (tmp_path / "k.sass").write_text(LISTING)
    (tmp_path / "other.txt").write_text("no instructions here")
    [entry] = sass_summary.summarize(tmp_path)
    assert entry["instructions"] == 12
    assert entry["loop_instructions"] == 5            # 0x20..0x60, not the outer 0x10..0x80 nor the FADD loop
    assert entry["loop"] == {"FFMA": 2, "LDS": 1, "QGMMA": 1, "BRA": 1}
    assert entry["kernel"]["BRA"] == 3 and entry["kernel"]["LDG"] == 1
    assert entry["resources"] == ["Used 168 registers, 0 bytes spill stores, 0 bytes spill loads"]


def test_a_hex_branch_target_closes_a_loop_too(tmp_path):
    text = LISTING.replace("BRA `(.L_x_2)", "BRA 0x0")   # the inner loop now 0x0..0x60, one instruction shorter
    (tmp_path / "k.sass").write_text(text)                # than 0x10..0x80 (which holds the STS)
    [entry] = sass_summary.summarize(tmp_path)
    assert entry["loop_instructions"] == 7 and "STS" not in entry["loop"] and entry["loop"]["MOV"] == 1


def test_cubins_come_out_of_a_logged_module_unescaped(tmp_path):
    blob = b"\x7fELF\x02\x01" + bytes(range(256)) + b'\\"end'
    escaped = "".join(chr(b) if 0x20 <= b < 0x7F and b not in (0x22, 0x5C) else f"\\{b:02X}" for b in blob)
    log = tmp_path / "run.log"
    log.write_text(f'junk\n  gpu.binary @k [#gpu.object<#nvvm.target, bin = "{escaped}"> ]\n'
                   f'ptxas info    : Used 168 registers, used 16 barriers\n bin = "notelf" \n')
    assert sass_summary.extract(log, tmp_path / "out") == 1
    assert (tmp_path / "out" / "k0.cubin").read_bytes() == blob
    assert "Used 168 registers" in (tmp_path / "out" / "ptxas.txt").read_text()
