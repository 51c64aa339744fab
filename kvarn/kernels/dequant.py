"""Triton dequantization: cache records -> rotated fp32 K and V tiles.

Mirrors :func:`kvarn.reference.record.decode_records`: ``(code * scale + zero) * col`` with the
multiply and the add rounded separately (the kernel is compiled without FMA contraction), so the
output equals the reference bit for bit. :mod:`kvarn.ops` dispatches ``decode_records`` here for
records on a CUDA device; attention does not use it (it reads the codes itself).

Smoothed records (``smooth_keys``): the K tile leaves the rotated frame, is multiplied by the
stored ``s`` and rotated back (``kvarn.reference.smooth.unsmooth``) with the reference's own
butterflies (:func:`~kvarn.kernels._common.fwht_rows`), so it too is equal bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from kvarn.config import KVarNConfig
from kvarn.kernels._common import bf16_to_f32, fp8e4m3_to_f32, fwht_rows, inv_sqrt, record_layout


@triton.jit
def dequant_block(
    rec,
    R0: tl.constexpr,
    RB: tl.constexpr,
    C0: tl.constexpr,
    CB: tl.constexpr,
    R: tl.constexpr,
    C: tl.constexpr,
    BITS: tl.constexpr,
    CODE_OFF: tl.constexpr,
    SCALE_OFF: tl.constexpr,
    ZERO_OFF: tl.constexpr,
    COL_OFF: tl.constexpr,
):
    """Rows ``R0 .. R0 + RB``, columns ``C0 .. C0 + CB`` of tile half ``[R, C]`` of ``rec`` -> fp32 ``[RB, CB]``.

    ``(code * scale + zero) * col`` with per-row ``scale, zero`` (fp16) and per-column ``col`` (bf16).
    The page kernels read a block of channels of a D > 128 tile with it.
    """
    P: tl.constexpr = 8 // BITS
    RP: tl.constexpr = R // P
    rows = R0 + tl.arange(0, RB)
    cols = C0 + tl.arange(0, CB)
    byte = tl.load(rec + CODE_OFF + (rows % RP)[:, None] * C + cols[None, :]).to(tl.int32)  # [RB, CB]
    code = (byte >> ((rows // RP) * BITS)[:, None]) & ((1 << BITS) - 1)
    scale = tl.load((rec + SCALE_OFF).to(tl.pointer_type(tl.float16)) + rows).to(tl.float32)  # [RB]
    zero = tl.load((rec + ZERO_OFF).to(tl.pointer_type(tl.float16)) + rows).to(tl.float32)
    col = bf16_to_f32(tl.load((rec + COL_OFF).to(tl.pointer_type(tl.int16)) + cols))  # [CB]
    return (code.to(tl.float32) * scale[:, None] + zero[:, None]) * col[None, :]


@triton.jit
def _dequant_values(
    rec,
    R: tl.constexpr,
    C: tl.constexpr,
    BITS: tl.constexpr,
    CODE_OFF: tl.constexpr,
    SCALE_OFF: tl.constexpr,
    ZERO_OFF: tl.constexpr,
    COL_OFF: tl.constexpr,
):
    """One tile half ``[R, C]`` of record ``rec`` -> its fp32 values ``[R, C]``."""
    return dequant_block(rec, 0, R, 0, C, R, C, BITS, CODE_OFF, SCALE_OFF, ZERO_OFF, COL_OFF)


@triton.jit
def _dequant_kernel(records, s_rec, k_out, v_out, s_out, LAYOUT: tl.constexpr, INV_SQRT_D: tl.constexpr):
    """Grid ``(N, 2)``: record ``i``, K (0) or V (1) -> ``out[i]: [G, D]`` fp32."""
    L: tl.constexpr = LAYOUT
    i = tl.program_id(0).to(tl.int64)
    half = tl.program_id(1)
    rec = records + i * s_rec
    base = i * s_out
    tok = tl.arange(0, L.G)
    ch = tl.arange(0, L.D)
    if half == 0:
        k = _dequant_values(rec, L.D, L.G, L.K_BITS, L.K_CODES, L.K_SCALE, L.K_ZERO, L.K_TOK)  # [D, G]
        if L.K_SMOOTH >= 0:
            s = fp8e4m3_to_f32(tl.load(rec + L.K_SMOOTH + ch))  # [D]
            k = fwht_rows(fwht_rows(tl.trans(k), INV_SQRT_D) * s[None, :], INV_SQRT_D)  # [G, D]
            tl.store(k_out + base + tok[:, None] * L.D + ch[None, :], k)
        else:
            tl.store(k_out + base + ch[:, None] + tok[None, :] * L.D, k)
    else:
        v = _dequant_values(rec, L.G, L.D, L.V_BITS, L.V_CODES, L.V_SCALE, L.V_ZERO, L.V_CHAN)  # [G, D]
        tl.store(v_out + base + tok[:, None] * L.D + ch[None, :], v)


def decode_records(
    records: torch.Tensor, cfg: KVarNConfig, *, empty: Callable[..., torch.Tensor] = torch.empty
) -> tuple[torch.Tensor, torch.Tensor]:
    """Records ``[..., record_bytes]`` uint8 -> ``(k, v): [..., G, D]`` fp32 in the rotated frame.

    ``empty`` (keyword only) allocates the outputs (``torch.empty``'s signature).
    """
    if records.dtype != torch.uint8 or records.shape[-1] != cfg.record_bytes:
        raise ValueError(
            f"records must be uint8 [..., {cfg.record_bytes}] for {cfg.name} at head_dim "
            f"{cfg.head_dim}, got {records.dtype} {tuple(records.shape)}"
        )
    lead = records.shape[:-1]
    flat = records.reshape(-1, cfg.record_bytes)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    n = flat.shape[0]
    k = empty(n, cfg.group_size, cfg.head_dim, dtype=torch.float32, device=records.device)
    v = empty(k.shape, dtype=k.dtype, device=k.device)
    if n:
        _dequant_kernel[(n, 2)](
            flat,
            flat.stride(0),
            k,
            v,
            k.stride(0),
            LAYOUT=record_layout(cfg),
            INV_SQRT_D=inv_sqrt(cfg.head_dim),
            num_warps=4,
            enable_fp_fusion=False,
        )
    return k.reshape(*lead, cfg.group_size, cfg.head_dim), v.reshape(*lead, cfg.group_size, cfg.head_dim)
