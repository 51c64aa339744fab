"""``benchmarks/sass_decode.py``'s reading of a loop's SASS: which global loads a step waits for."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from benchmarks.sass_decode import loads_read_in_step, loop_instructions

LOOP = """
        /*0000*/                   IMAD.MOV.U32 R1, RZ, RZ, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   LDG.E R8, desc[UR4][R2.64+0x3000] ;
        /*0020*/                   LDG.E.64 R10, desc[UR4][R2.64+0x3400] ;
        /*0030*/                   LDG.E R12, desc[UR4][R4.64] ;
        /*0040*/                   LDG.E R14, desc[UR4][R2.64+0x3500] ;
        /*0050*/                   LOP3.LUT R20, R21, 0xf000f, R22, 0xea, !PT ;
        /*0060*/                   FMUL R16, R11, R17 ;
        /*0070*/                   MOV R14, R18 ;
        /*0080*/                   R2UR UR6, R12 ;
        /*0090*/                   FADD R19, R14, R19 ;
        /*00a0*/              @P0  BRA `(.L_x_1) ;
        /*00b0*/                   EXIT ;
"""


def test_a_load_read_in_its_own_step_is_listed():
    body = loop_instructions(LOOP)
    assert len(body) == 10 and body[-1].endswith("BRA `(.L_x_1)")
    waited = loads_read_in_step(body, 0x3000)
    # R11 (the high word of the 64-bit load) is read by the FMUL; R8 is read only in the next step;
    # R14 is overwritten before it is read; the block id (offset 0) is below the scale fields
    assert waited == [("LDG.E.64 R10, desc[UR4][R2.64+0x3400]", "FMUL R16, R11, R17")]
    assert [load for load, _ in loads_read_in_step(body)] == [
        "LDG.E.64 R10, desc[UR4][R2.64+0x3400]",
        "LDG.E R12, desc[UR4][R4.64]",
    ]
