"""Triton dequantization: cache records -> rotated fp32 (or model-dtype) K and V tiles.

Mirrors :func:`kvarn.reference.record.decode_records`: ``(code * scale + zero) * col`` with the
multiply and the add rounded separately (the kernel is compiled without FMA contraction), so the
fp32 output equals the reference bit for bit. Used by the tests and by the multi-query attention
path, which gathers a sequence's tiles into a workspace.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvarn.config import KVarNConfig
from kvarn.kernels._common import bf16_to_f32, store_model

_empty = torch.empty
"""Allocator of outputs (tests swap in one that pre-fills them)."""


@triton.jit
def _dequant_half(
    rec,
    out,
    s_row,
    s_col,
    R: tl.constexpr,
    C: tl.constexpr,
    BITS: tl.constexpr,
    CODE_OFF: tl.constexpr,
    SCALE_OFF: tl.constexpr,
    ZERO_OFF: tl.constexpr,
    COL_OFF: tl.constexpr,
    OUT_MODE: tl.constexpr,
):
    """One tile half ``[R, C]`` of record ``rec`` -> ``out[i * s_row + j * s_col]``."""
    P: tl.constexpr = 8 // BITS
    RP: tl.constexpr = R // P
    rows = tl.arange(0, R)
    cols = tl.arange(0, C)
    byte = tl.load(rec + CODE_OFF + (rows % RP)[:, None] * C + cols[None, :]).to(tl.int32)
    code = (byte >> ((rows // RP) * BITS)[:, None]) & ((1 << BITS) - 1)
    scale = tl.load((rec + SCALE_OFF).to(tl.pointer_type(tl.float16)) + rows).to(tl.float32)
    zero = tl.load((rec + ZERO_OFF).to(tl.pointer_type(tl.float16)) + rows).to(tl.float32)
    col = bf16_to_f32(tl.load((rec + COL_OFF).to(tl.pointer_type(tl.int16)) + cols))
    val = (code.to(tl.float32) * scale[:, None] + zero[:, None]) * col[None, :]
    ptr = out + rows[:, None] * s_row + cols[None, :] * s_col
    if OUT_MODE == 0:
        tl.store(ptr, val)
    else:
        store_model(ptr, val, None, OUT_MODE == 2)


@triton.jit
def _dequant_kernel(
    records,
    rec_idx,
    s_rec,
    k_out,
    v_out,
    s_out,
    HAS_IDX: tl.constexpr,
    D: tl.constexpr,
    G: tl.constexpr,
    K_BITS: tl.constexpr,
    V_BITS: tl.constexpr,
    K_CODES: tl.constexpr,
    V_CODES: tl.constexpr,
    K_SCALE: tl.constexpr,
    K_ZERO: tl.constexpr,
    K_TOK: tl.constexpr,
    V_SCALE: tl.constexpr,
    V_ZERO: tl.constexpr,
    V_CHAN: tl.constexpr,
    OUT_MODE: tl.constexpr,
):
    """Grid ``(N, 2)``: record ``i`` (or ``rec_idx[i]``), K (0) or V (1) -> ``out[i]: [G, D]``."""
    i = tl.program_id(0)
    half = tl.program_id(1)
    if HAS_IDX:
        r = tl.load(rec_idx + i).to(tl.int64)
    else:
        r = i.to(tl.int64)
    rec = records + r * s_rec
    base = i.to(tl.int64) * s_out
    if half == 0:
        _dequant_half(rec, k_out + base, 1, D, D, G, K_BITS, K_CODES, K_SCALE, K_ZERO, K_TOK, OUT_MODE)
    else:
        _dequant_half(rec, v_out + base, D, 1, G, D, V_BITS, V_CODES, V_SCALE, V_ZERO, V_CHAN, OUT_MODE)


def dequantize_into(
    records: torch.Tensor, index: torch.Tensor | None, k_out: torch.Tensor, v_out: torch.Tensor, cfg: KVarNConfig
) -> None:
    """Dequantize ``records.view(-1, record_bytes)[index]`` into ``k_out, v_out: [N, G, D]`` (fp32, fp16 or bf16)."""
    flat = records.reshape(-1, cfg.record_bytes)
    n = k_out.shape[0]
    if n == 0:
        return
    off = cfg.offsets
    mode = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}[k_out.dtype]
    _dequant_kernel[(n, 2)](
        flat,
        index if index is not None else flat,
        flat.stride(0),
        k_out,
        v_out,
        k_out.stride(0),
        HAS_IDX=index is not None,
        D=cfg.head_dim,
        G=cfg.group_size,
        K_BITS=cfg.k_bits,
        V_BITS=cfg.v_bits,
        K_CODES=off["k_codes"],
        V_CODES=off["v_codes"],
        K_SCALE=off["k_scale"],
        K_ZERO=off["k_zero"],
        K_TOK=off["k_tok"],
        V_SCALE=off["v_scale"],
        V_ZERO=off["v_zero"],
        V_CHAN=off["v_chan"],
        OUT_MODE=mode,
        num_warps=4,
        enable_fp_fusion=False,
    )


def decode_records(records: torch.Tensor, cfg: KVarNConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Records ``[..., record_bytes]`` uint8 -> ``(k, v): [..., G, D]`` fp32 in the rotated frame."""
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
    k = _empty(n, cfg.group_size, cfg.head_dim, dtype=torch.float32, device=records.device)
    v = _empty(k.shape, dtype=k.dtype, device=k.device)
    dequantize_into(flat, None, k, v, cfg)
    return k.reshape(*lead, cfg.group_size, cfg.head_dim), v.reshape(*lead, cfg.group_size, cfg.head_dim)
