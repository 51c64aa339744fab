"""``benchmarks/ncu_profile.py``'s reading of an Nsight Compute source-page export (no GPU, no ncu)."""

from __future__ import annotations

import csv

import pytest

from benchmarks.ncu_profile import main, opcode, read_source_csv, summarize

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)"]
HEADER += ["Instructions Executed", "stall_long_sb", "stall_wait", "stall_selected", "stall_long_sb (Not Issued)"]


def _write(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerow(["Kernel Name", "_attn_kernel"])
        w.writerow(HEADER)
        for addr, sass, samples, executed, long_sb, wait, selected in rows:
            w.writerow([addr, f"      {sass}", samples, samples, executed, long_sb, wait, selected, 99])


ROWS = [
    ("0x7f00", "LDC R1, c[0x0][0x28]", 30, 8, 0, 30, 0),  # prologue: many samples, run once per program
    ("0x7f10", "LDG.E R4, desc[UR4][R2.64]", 5, 256, 0, 1, 4),  # the loop: 32 steps x 8 programs
    ("0x7f20", "@!P0 HMMA.16816.F32 R8, R12, R16, R8", 20, 256, 0, 15, 5),
    ("0x7f30", "PRMT R20, R4, 0x5410, R5", 40, 256, 38, 0, 2),
    ("0x7f40", "@P1 BRA 0x7f10", 1, 256, 0, 0, 1),
    ("0x7f50", "EXIT", 2, 8, 0, 2, 0),
    ("0x7f60", "NOP", 0, 0, 0, 0, 0),  # never executed
]


def test_summary_of_the_hottest_loop(tmp_path):
    path = tmp_path / "src.csv"
    _write(path, ROWS)
    rows = read_source_csv(path)
    assert [r["executed"] for r in rows] == [8, 256, 256, 256, 256, 8, 0]
    assert rows[3]["reasons"] == {"long_sb": 38, "wait": 0, "selected": 2}  # the not-issued column is left out
    s = summarize(rows, top=2)
    assert s["loop_executed"] == 256 and s["loop_instructions"] == 4 and s["loop_samples"] == 66
    assert s["kernel_samples"] == 98 and s["loop_share"] == pytest.approx(66 / 98)
    assert s["reasons"] == pytest.approx({"long_sb": 38 / 66, "wait": 16 / 66, "selected": 12 / 66})
    assert s["opcodes"]["PRMT"] == {"share": pytest.approx(40 / 66), "count": 1}
    assert s["opcodes"]["HMMA"]["share"] == pytest.approx(20 / 66)
    assert [t["sass"].split()[0] for t in s["top"]] == ["PRMT", "@!P0"]
    assert s["top"][0]["reasons"] == {"long_sb": 38, "selected": 2}


def test_the_loop_is_the_count_with_most_samples_not_most_instructions(tmp_path):
    rows = [("0x10", "FADD R1, R2, R3", 1, 64, 0, 1, 0)] * 3 + [("0x20", "MUFU.EX2 R4, R5", 50, 16, 0, 50, 0)]
    path = tmp_path / "src.csv"
    _write(path, rows)
    s = summarize(read_source_csv(path))
    assert s["loop_executed"] == 16 and s["loop_instructions"] == 1


def test_opcode_and_command_line(tmp_path, capsys):
    assert opcode("@!P0 LDG.E.128 R4, desc[UR4][R2.64]") == "LDG"
    assert opcode("  FFMA R1, R2, R3, R4") == "FFMA"
    path = tmp_path / "src.csv"
    _write(path, ROWS)
    main(["summarize", str(path), "--json", str(tmp_path / "s.json")])
    out = capsys.readouterr().out
    assert "4 instructions executed 256 times each, 67.3% of 98 stall samples" in out
    assert "long_sb 57.6%" in out and (tmp_path / "s.json").exists()


def test_an_export_without_executed_instructions_is_refused(tmp_path):
    path = tmp_path / "src.csv"
    _write(path, [("0x10", "NOP", 0, 0, 0, 0, 0)])
    with pytest.raises(ValueError, match="no executed instructions"):
        summarize(read_source_csv(path))
