"""Triton attention over the paged KVarN cache: decode and multi-query (causal within the chunk).

This module is the launcher: it checks the arguments, picks the launch shape, the split-K factor,
where the queries are rotated and where the splits are merged, and runs one to three kernels:

1. (only without ``FUSED_Q``, see :func:`fuse_query_rotation`)
   :mod:`~kvarn.kernels.attention_prologue`: rotate the queries and pre-scale them by
   ``softmax_scale * log2(e)`` (tf32 dot with the +-1 Hadamard, exact products);
2. :mod:`~kvarn.kernels.attention_decode`: one program per (query block, KV head, split) (with
   ``FUSED_Q``: rotates and scales its own queries, the same products), then walks its share of the
   tiles (the per-tile math is in :mod:`~kvarn.kernels.attention_tiles`). With ``MERGE`` (the
   default, :func:`merge_counters`) it also finishes the call (:mod:`~kvarn.kernels.attention_merge`):
   the last split of each (query block, KV head) to finish merges the splits, un-rotates and casts;
3. (only without ``MERGE``) :mod:`~kvarn.kernels.attention_epilogue`: merge the splits (log-sum-exp),
   un-rotate (two tf32 dots on a hi/lo split) and cast to the query dtype.

Every kernel gets the record layout as ``LAYOUT`` (:func:`kvarn.kernels._common.record_layout`).
The tuning knobs are keyword arguments of :func:`paged_attention`, defaults as measured in
``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable

import torch

from kvarn.config import KVarNConfig
from kvarn.kernels import _plan
from kvarn.kernels._common import (
    LOG2E,
    cdiv,
    check_cache,
    check_dtype,
    index_list,
    interpreting,
    inv_sqrt,
    next_pow2,
    record_layout,
)
from kvarn.kernels.attention_decode import _attn_kernel
from kvarn.kernels.attention_epilogue import _epilogue_kernel
from kvarn.kernels.attention_prologue import _prologue_kernel
from kvarn.kernels.store import write_tail

MIN_DOT_ROWS = 16
"""``tl.dot`` needs at least 16 rows: blocks of (query, head) rows are padded up to it."""
ATTN_NUM_WARPS = 4
ATTN_NUM_STAGES = 2
"""Launch configuration of the attention kernel (the best of the sweep in ``benchmarks/RESULTS.md``) where
:func:`decode_shape_default` does not pick 1 or 2 warps."""
EDGE_NUM_WARPS = 4
"""Warps of the prologue and epilogue kernels."""
WAVES = 3
"""Split-K aims at this many waves of attention programs over the GPU ..."""
PROGRAMS_PER_SM = 3
"""... at this many resident programs per SM: the count the rules here were tuned with (``WAVES``, the
``tokens_m`` threshold, ``FUSE_MAX_WAVES``); the row path's register use allows about 3 at 4 warps,
the 128-register ``tokens_m`` kernel at ``D = 128`` 4 (``TOKENS_M_PROGRAMS_PER_SM``)."""
MIN_TILES_PER_SPLIT = 4
SHORT_MIN_TILES = 2
"""Tiles per split at least (``SHORT_MIN_TILES`` where ``MIN_TILES_PER_SPLIT`` would leave the launch
under one wave). Measured on the H200 (``benchmarks/RESULTS.md``, 2026-12-01): 8 waves of 2-tile
splits (the rule before) against 3 waves of 4-tile splits: 4K/B8 43.0 -> 37.9 µs, 4K/B64 171 -> 129,
32K/B64 1016 -> 765, 32K/B8 149 -> 143, but 32K/B16 231 -> 237 and 32K/B32 413 -> 434."""
MAX_SPLITS = 64
FUSE_MAX_WAVES = 4
FUSE_MAX_TILES = 8
"""Queries are rotated inside the attention kernel (no prologue launch) when the launch is at most
``FUSE_MAX_WAVES`` waves of ``PROGRAMS_PER_SM`` programs and a split walks at most ``FUSE_MAX_TILES``
tiles: each program then pays the rotation (~half a tile of work) once, against one launch saved.
The splits are merged in the attention launch up to the same number of waves (:func:`merge_in_kernel`)."""
ONE_WARP_PROGRAMS_PER_SM = 8
FUSED_ONE_WARP_PROGRAMS_PER_SM = {2: 8, 4: 8}
"""Resident one-warp decode programs per SM (``D = 128``, 128-token tiles, 4-bit K; 255 registers: 8 by
registers), and with ``FUSED_Q`` by V bits: 8 programs may hold 28,160 bytes of shared memory each of an
SM's 228 KB (1 KB reserved a program). Where the programs that get units (:func:`active_splits`) would
need one wave more fused than with the prologue, :func:`fuse_query_rotation` takes the prologue.
Session 24 measured 7 (2-bit V) and 6 (4-bit V) fused: the in-kernel rotation's operands took the
kernel from 20,480 bytes to 29,440 and 33,536 (triton 3.6), and 4 / 32K k4v2 ran 73.5 us fused, 55.5
with the prologue. Since session 26's merge by butterflies the kernel holds 14,848 (k4v2) and 18,944
(k4v4) bytes, 17,408 fused (triton 3.6 on the H200 and 3.9 offline alike), so 8 either way; session 27
(H200, two rounds each, prologue -> fused): k4v2 4 / 32K 55.5, 55.5 -> 54.8, 54.6 us, 3 / 32K 48.9,
48.8 -> 47.4, 47.3, k4v4 4 / 32K 63.9, 63.9 -> 61.2, 61.3, k4v4 2 / 32K 47.0, 47.1 -> 44.4, 44.3
(``benchmarks/RESULTS.md``)."""
SMS_OFF_CUDA = 4
"""SM count the split choice assumes on a device without SMs (the CPU interpreter)."""
DECODE_MAX_REGS = {(64, 4): 96, (128, 4): 128, (64, 2): 96, (128, 2): 128, (128, 1): 255}
"""Register cap of the decode attention kernel by (head dim, warps): 5 / 4 programs per SM at 4 warps. Without
it, ptxas takes 150-170 registers for some presets once the split merge is in the kernel, for the same main
loop (local sm_90 compiles: same instruction count, no spills in the loop; a few values kept across
the loop go to the stack). At 2 warps (:func:`decode_shape_default`) the same caps allow 10 / 8 programs
per SM; the 2-warp launches were timed with them (session 14). One warp at ``D = 128`` takes the whole 255
(8 programs per SM; a 192 or 168 cap spilled and was slower at every shape timed, session 21); being in the
table, it gets the capped kernel's whole-waves split rule (:func:`default_splits`), as timed. D = 256
(220+ either way) and multi-query launches are left alone."""
TOKENS_M_WAVES = 2
TOKENS_M_PROGRAMS_PER_SM = 4
"""Split count of a ``tokens_m`` launch at ``D = 128`` (:func:`default_splits`): the most splits whose
programs fill at most ``TOKENS_M_WAVES`` whole waves of ``TOKENS_M_PROGRAMS_PER_SM`` programs per SM
(128 registers at 4 warps, ``DECODE_MAX_REGS``), where ``WAVES`` waves of ``PROGRAMS_PER_SM``, rounded
up, could leave a last wave nearly empty (32K/batch 16: 1280 programs are 2.4 waves of 528). Measured
on the H200 (``benchmarks/RESULTS.md``, 2026-12-01, session 9), default splits -> these: 32K/B16
10 -> 8 splits 236.1 -> 212.7 µs, 32K/B32 5 -> 4 431.9 -> 393.2, 32K/B8 19 -> 16 142.6 -> 133.6,
16K/B16 10 -> 8 137.4 -> 124.1, 4K/B32 5 -> 4 86.8 -> 79.5, 4K/B64 3 -> 2 129.0 -> 126.7."""
ONE_TILE_MAX_WAVES = 2
EPILOGUE_MAX_SPLITS = 8
"""See :func:`min_tiles_per_split` and :func:`merge_in_kernel`."""
MERGE_CHUNK = 4096
"""The in-kernel split merge reads this many fp32 partial values a step (32 registers a thread at 4 warps)."""
MIN_COUNTERS = 4096
"""Entries of a device's merge-counter buffer when first allocated (16 KiB)."""

_counters: dict[tuple[str, int], torch.Tensor] = {}
_retired: list[torch.Tensor] = []


def merge_counters(device: torch.device, n: int) -> torch.Tensor | None:
    """The device's int32 counter buffer of the in-kernel split merge, at least ``n`` entries, all zero.

    Each launch leaves the counters it used at zero, so the one buffer serves every launch on the
    device, eager or replayed from a CUDA graph. It is grown (zero-filled) outside graph capture
    only: while a graph is being captured a buffer that is too small gives ``None`` and the
    launcher falls back to the epilogue launch. Outgrown buffers are kept alive, since a captured
    graph may still point at one. Launches that run concurrently on several streams must not
    share counters: pass each its own zeroed ``counters=`` to :func:`paged_attention`.
    """
    buf = _device_buffer(_counters, device, n, lambda size: torch.zeros(size, dtype=torch.int32, device=device))
    return None if buf is None else _plan.persistent(buf)


def _device_buffer(buffers: dict, device: torch.device, n: int, make: Callable) -> torch.Tensor | None:
    """``buffers``' tensor for ``device``, at least ``n`` entries; a new one (``make(size)``, at least
    ``MIN_COUNTERS`` and twice the old) where it is missing or too small, except while a CUDA graph is
    captured (then ``None``). Outgrown tensors are kept alive: a captured graph may still point at one."""
    key = (device.type, device.index or 0)
    buf = buffers.get(key)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        if buf is not None:
            _retired.append(buf)
        buf = buffers[key] = make(max(n, MIN_COUNTERS, 0 if buf is None else 2 * buf.numel()))
    return buf


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def choose_splits(programs: int, max_units: int, device: torch.device, min_tiles: int = MIN_TILES_PER_SPLIT) -> int:
    """Default split-K factor: ``WAVES`` waves of programs, at least ``min_tiles`` tiles per split.

    ``programs`` is the launch's program count without splits, ``max_units`` the most tiles one
    sequence can have. Each program walks its tiles one after another, so short splits also cut
    the latency of small batches; the splits are merged in the kernel or the epilogue.
    """
    sms = _num_sms(device.index or 0) if device.type == "cuda" else SMS_OFF_CUDA
    want = cdiv(WAVES * PROGRAMS_PER_SM * sms, programs)
    return max(1, min(want, max_units // min_tiles, MAX_SPLITS))


def default_splits(
    cfg: KVarNConfig,
    programs: int,
    max_units: int,
    multi_q: bool,
    device: torch.device,
    tokens_m: bool | None = None,
    num_warps: int = ATTN_NUM_WARPS,
) -> int:
    """The split-K factor a launch takes by default: :func:`choose_splits` with :func:`min_tiles_per_split`,
    then, for a launch of the register-capped ``tokens_m`` kernel at ``D = 128`` (``tokens_m`` as the
    launch will take it, 4 or 2 warps (``DECODE_MAX_REGS``), records not smoothed per tile), whole waves
    (``TOKENS_M_WAVES``), and at least ``tokens_m_min_programs // programs + 1`` splits. That floor
    dates from when ``tokens_m`` at ``D = 128`` needed that many programs (it no longer does,
    :func:`tokens_m_default`); it is kept as the rule measured in session 9 and raises the split
    count only for launches of 529-792 programs before splitting on 132 SMs (not re-timed)."""
    min_tiles = min_tiles_per_split(cfg, programs, max_units, device)
    splits = choose_splits(programs, max_units, device, min_tiles)
    capped = _decode_max_regs(cfg, num_warps, multi_q) is not None
    if tokens_m is None:
        tokens_m = tokens_m_default(cfg, multi_q, programs * splits, device)
    if cfg.head_dim != 128 or not capped or not tokens_m or device.type != "cuda":
        return splits
    sms = _num_sms(device.index or 0)
    whole = TOKENS_M_WAVES * TOKENS_M_PROGRAMS_PER_SM * sms // programs
    still_tokens_m = tokens_m_min_programs(device) // programs + 1
    return max(1, min(max(whole, still_tokens_m), max_units // min_tiles, MAX_SPLITS))


def _decode_max_regs(cfg: KVarNConfig, num_warps: int, multi_q: bool) -> int | None:
    """The attention kernel's register cap (``DECODE_MAX_REGS``), ``None`` for uncapped launches (multi-query,
    records smoothed per tile, head dims and warps the table lacks)."""
    if multi_q or (cfg.smooth_keys and not cfg.seq_smooth):
        return None
    return DECODE_MAX_REGS.get((cfg.head_dim, num_warps))


def min_tiles_per_split(cfg: KVarNConfig, programs: int, max_units: int, device: torch.device) -> int:
    """Fewest tiles a split walks: 1, ``SHORT_MIN_TILES`` or ``MIN_TILES_PER_SPLIT``.

    1 for 128-token tiles when even one-tile splits give at most ``ONE_TILE_MAX_WAVES`` programs per
    SM (``benchmarks/RESULTS.md``, issue 9 round 2: batch 1 at 1K, 9 one-tile splits 16.4 us against
    21.5 us with 4; at batch 8 / 1K one-tile splits were slower, 29.2 against 25.1 us), twice that at
    ``D = 64``, whose tiles are half the work (session 22, 4 / 1K: 4 splits 18.8 us, 8 16.4, 16 15.6).
    ``SHORT_MIN_TILES`` when splits of ``MIN_TILES_PER_SPLIT`` tiles would fill less than one wave
    (batch 8 / 1K: 4 splits of 2 tiles 24.9 us, 2 of 4 tiles 28.0 us); else ``MIN_TILES_PER_SPLIT``.
    """
    sms = _num_sms(device.index or 0) if device.type == "cuda" else SMS_OFF_CUDA
    waves = ONE_TILE_MAX_WAVES * max(1, 128 // cfg.head_dim)
    if cfg.group_size >= 128 and programs * max_units <= waves * sms:
        return 1
    if programs * (max_units // MIN_TILES_PER_SPLIT) < PROGRAMS_PER_SM * sms:
        return SHORT_MIN_TILES
    return MIN_TILES_PER_SPLIT


def merge_in_kernel(programs: int, splits: int, device: torch.device) -> bool:
    """Default of ``fuse_merge``: in the attention kernel, except for few splits in a launch of many waves.

    The in-kernel merge costs every program an atomic (with its fences) and the last one the merge;
    it saves the epilogue launch. Measured at batch 64 / 4K (7 splits, ~9 waves) the epilogue was
    2% faster (171.6 against 175.5 us); everywhere else the merge in the kernel was as fast or faster
    (3 splits at batch 64, ~4 waves: 4K 164 -> 129 us, 32K 1005 -> 765 us against the epilogue).
    One split is always finished in the kernel: there is nothing to merge, so the epilogue would
    only add a launch and a round trip of fp32 partials (from batch ~200 at 8 KV heads; not timed).
    """
    sms = _num_sms(device.index or 0) if device.type == "cuda" else SMS_OFF_CUDA
    return splits == 1 or splits > EPILOGUE_MAX_SPLITS or programs * splits <= FUSE_MAX_WAVES * PROGRAMS_PER_SM * sms


def active_splits(max_units: int, splits: int, min_units: int) -> int:
    """Splits of the longest sequence that get units: the kernel gives each ``max(cdiv(units, splits), min_units)``
    (``_split_units``), so ``cdiv(max_units, that)`` of them."""
    return max(cdiv(max_units, max(cdiv(max_units, splits), min_units)), 1)


def fuse_query_rotation(
    cfg: KVarNConfig,
    programs: int,
    tiles_per_split: int,
    device: torch.device,
    num_warps: int = ATTN_NUM_WARPS,
    active: int | None = None,
) -> bool:
    """Whether the attention kernel rotates its own queries (``FUSED_Q``) instead of a prologue launch.

    Always with four K bit fields (2-bit K) or 64-token tiles: reading pre-rotated queries from
    memory there lets the compiler hoist the score operand's layout onto the loop-invariant
    queries (~230 registers instead of 128, half the programs per SM). Otherwise only for short
    launches (see ``FUSE_MAX_WAVES``), where the saved launch outweighs the per-program rotation,
    and for one-warp launches at ``D = 128`` (``num_warps``) not where the rotation's shared memory
    costs the ``active`` programs (those with units; default ``programs``) a wave
    (``FUSED_ONE_WARP_PROGRAMS_PER_SM``).
    """
    if cfg.k_per_byte == 4 or cfg.group_size < 128:
        return True
    sms = _num_sms(device.index or 0) if device.type == "cuda" else SMS_OFF_CUDA
    if num_warps == 1 and cfg.head_dim == 128:
        active = programs if active is None else active
        fused_per_sm = FUSED_ONE_WARP_PROGRAMS_PER_SM.get(cfg.v_bits, ONE_WARP_PROGRAMS_PER_SM)
        if cdiv(active, fused_per_sm * sms) > cdiv(active, ONE_WARP_PROGRAMS_PER_SM * sms):
            return False
    return programs <= FUSE_MAX_WAVES * PROGRAMS_PER_SM * sms and tiles_per_split <= FUSE_MAX_TILES


def pair_tiles_default(cfg: KVarNConfig, tokens_m: bool = False) -> bool:
    """Whether the attention kernel walks two tiles per loop step by default: 64-token tiles at ``D = 128``
    on the row path (``tokens_m`` off).

    One softmax step per 128 tokens and two independent score chains; at ``D = 64`` the pair
    does not fit the register cap (``DECODE_MAX_REGS``: spills in the loop), at ``D = 256`` not tried.
    With ``tokens_m`` (k4v2_g64 decode, session 13) one tile a step was faster: 16 x 32K 392.9 -> 384.3
    us, 8 x 4K 60.0 -> 55.1, 1 x 4K 28.9 -> 26.9.
    """
    return cfg.group_size < 128 and cfg.head_dim == 128 and not tokens_m


TOKENS_M_MIN_ROWS = 8
"""Rows (query heads) of a program with ``tokens_m``: the N of the MMA (``m16n8``), padded up to it."""


TOKENS_M_MIN_WAVES = 2
"""Decode launches of 128-token tiles at ``D != 128`` with more than this many waves of programs default to
``tokens_m`` (at ``D = 128`` every decode launch does)."""
MIN_SPLIT_TILES = 3
SHORT_SPLIT_TILES = 2
MIN_SPLIT_TILES_PROGRAMS = 16
"""See :func:`min_split_tiles_default`."""


def tokens_m_default(cfg: KVarNConfig, multi_q: bool, programs: int, device: torch.device) -> bool:
    """Default of ``tokens_m``: whether a decode launch puts the tokens on the M side of both dots.

    On at ``D = 128`` in every decode launch (64-token tiles too), at ``D = 256`` in every decode
    launch of 128-token tiles, at ``D = 64`` for 128-token tiles in launches of more than
    ``TOKENS_M_MIN_WAVES`` waves. Measured faster on the H200 at every shape timed (k4v2 D=128: 8 x
    4K 47.5 -> 44.1 us, 32 x 4K 112.0 -> 98.1, 64 x 4K 171.3 -> 166.3, 8 x 32K 186.3 -> 156.4, 16 x
    32K 303.0 -> 243.7; k2v2, k4v4, D=64 and D=256 likewise). Batch 1 launches in vLLM's shape (a
    block table 259 blocks wide, so 64 splits; 32 layers in one CUDA graph; session 12) are faster
    with it too: 1K 12.0 -> 11.7 us, 4K 21.1 -> 19.0, 16K 30.5 -> 27.7, 32K 43.1 -> 38.1, and 4K
    18.2 -> 16.7 with an exact-width table. Session 13: 64-token tiles at ``D = 128`` (k4v2_g64,
    4 warps, paired): 16 x 32K 459.6 -> 388.3 us, 4 x 128K 484.5 -> 390.3, 64 x 4K 227.1 -> 216.9,
    8 x 4K 62.1 -> 59.5, 1 x 32K 58.6 -> 56.8, 1 x 4K 29.4 -> 28.7 (session 3 had measured no
    gain, before the merge moved into the kernel), walked one tile a step (:func:`pair_tiles_default`);
    ``D = 256`` at 1 x 4K 36.0 -> 30.0 us (16 x 32K took it already). 64-token tiles at other head
    dims keep the row path (not timed). Off for multi-query launches (not implemented) and off CUDA
    (the interpreter tests pick the variant explicitly). ``benchmarks/RESULTS.md`` has the tables.
    """
    if multi_q or device.type != "cuda":
        return False
    if cfg.head_dim == 128:
        return True
    return cfg.group_size == 128 and (cfg.head_dim == 256 or programs > tokens_m_min_programs(device))


def min_split_tiles_default(cfg: KVarNConfig, tokens_m: bool, programs: int) -> int:
    """Default of ``min_split_tiles``: the fewest tiles a split of a sequence walks, whatever the launch's splits.

    The split count of a CUDA-graph launch is fixed at capture for the longest sequence the block
    table holds (vLLM: ``max_model_len``, 64 splits at batch 1 and 8 KV heads), so short sequences
    got one-tile splits, and the splits past their last tile still ran and were merged. The kernel
    gives each split at least this many units and leaves the splits past a sequence's last one idle
    (they exit, and the merge reads only the others). For ``tokens_m`` decode launches (128-token
    tiles): ``MIN_SPLIT_TILES`` when the launch has at least ``MIN_SPLIT_TILES_PROGRAMS`` programs
    before splitting (sequences x KV heads), else ``SHORT_SPLIT_TILES``; 1 (the plain ``cdiv`` of the
    units over the splits) elsewhere: the row path was slower with 2 at batch 1-2 (below), 64-token
    tiles gained nothing, multi-query launches were not timed. Measured on the H200 (session 12, vLLM's
    shape, per-layer graph replay), ``tokens_m``, min 1 -> 2 -> 3 tiles: batch 1 at 1K 11.7 -> 11.7 ->
    14.6 us, at 4K 19.0 -> 19.1 -> 18.1; batch 2 at 4K 21.1 -> 22.6 -> 19.2; batch 4 at 4K 32.1 ->
    27.9 -> 21.3; 16K and longer, and batch 8 and more, unchanged. The row path, min 1 -> 2: batch 1
    at 1K 12.0 -> 13.0, at 4K 21.1 -> 21.7, batch 2 at 4K 22.5 -> 25.5.
    """
    if not tokens_m or cfg.group_size < 128:
        return 1
    return MIN_SPLIT_TILES if programs >= MIN_SPLIT_TILES_PROGRAMS else SHORT_SPLIT_TILES


def tokens_m_min_programs(device: torch.device) -> int:
    """``TOKENS_M_MIN_WAVES`` waves of programs: ``tokens_m`` is the default at ``D != 128`` above this."""
    return TOKENS_M_MIN_WAVES * PROGRAMS_PER_SM * _num_sms(device.index or 0)


def fold_offsets_default(cfg: KVarNConfig, tokens_m: bool) -> bool:
    """Default of ``fold_offsets``: on for ``tokens_m`` launches at ``D = 128``, off elsewhere.

    Measured on the H200 (``benchmarks/RESULTS.md``, issue 9 round 4; ``tokens_m``, batch 16, 32K),
    when it folded the V codes too: k4v2 247.2 -> 231.5 us, k2v2 254.4 -> 242.1, k4v4 261.6 -> 254.5.
    Scores only since session 26 (folded values were biased), two runs each: k4v2 16 / 32K 159.1, 160.0 us
    (172.9-173.8 unfolded, 151.0, 152.1 with the values folded too), k2v2 150.9, 151.2 (169.2-170.1;
    139.5, 139.7); those unfolded runs shifted each field down. Against session 27's in-place centering
    (``IN_PLACE_MAX_D``; session 28, two rounds, fold -> centered): k4v2 150.2, 151.8 -> 156.4, 156.5 us,
    k2v2 139.8, 140.8 -> 146.3, 146.4, k4v4 173.4, 173.3 -> 182.1, 182.4, k4v2_g64 161.3, 161.1 -> 162.5, 162.0,
    k4v2 1 / 4K 18.2, 17.9 -> 18.9, 18.8. Off where it was not faster:
    ``D = 256`` (226 registers instead of 162, 2 programs per SM instead of 3: 496.6 -> 629.3 us),
    ``D = 64`` (2 spills under the 96-register cap: 186.0 -> 190.7 us) and the row path without
    ``tokens_m`` (k4v4 batch 1 / 32K 59.6 -> 62.1 us; g64 and batch 1-8 at 4K unchanged).
    """
    return tokens_m and cfg.head_dim == 128


def _check_args(query, cache, block_table, seq_lens, tail_k, tail_v, cfg, query_start_loc, kv=(None, None)) -> None:
    check_dtype("query", query)
    check_cache(cache, cfg)
    check_dtype("tail_k", tail_k)
    _, hq, d = query.shape
    hkv = cache.shape[1]
    if d != cfg.head_dim:
        raise ValueError(f"query head_dim {d} does not match the config's {cfg.head_dim}")
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    if (
        tail_k.dim() != 4
        or tail_k.shape[2:] != (hkv, d)
        or not 0 < tail_k.shape[1] <= cfg.group_size
        or tail_v.shape != tail_k.shape
        or tail_v.stride() != tail_k.stride()
        or tail_k.stride(-1) != 1
    ):
        raise ValueError(
            f"tail_k, tail_v must both be [num_slots, {cfg.group_size}, {hkv}, {d}] (or [num_blocks, rows, {hkv}, "
            f"{d}] with [B, N] tail_slots) with equal strides, got {tuple(tail_k.shape)}"
        )
    batch = seq_lens.shape[0]
    if query_start_loc is None and query.shape[0] != batch:
        raise ValueError(
            f"without query_start_loc there is one query per sequence: {query.shape[0]} queries for {batch} sequences"
        )
    if query_start_loc is not None and query_start_loc.shape != (batch + 1,):
        raise ValueError(f"query_start_loc must be [B + 1] = [{batch + 1}], got {tuple(query_start_loc.shape)}")
    if block_table.dim() != 2 or block_table.shape[0] < batch or block_table.stride(-1) != 1:
        raise ValueError(f"block_table must be [B, max_blocks] with unit last stride, got {tuple(block_table.shape)}")
    _check_kv(*kv, query, cache)


def _tail_block_rows(tail_slots, tail_k, cfg: KVarNConfig, batch: int, query_start_loc, sink_slots) -> int:
    """0 for ``tail_slots: [B]`` slots of a pool ``[num_slots, G, Hkv, D]``; for ``[B, N]`` tables of own tiles
    kept as rows of blocks (``tail_k: [num_blocks, R, Hkv, D]``, ``N * R >= G``), ``R`` (decode, no sink)."""
    g, rows = cfg.group_size, tail_k.shape[1]
    if tail_slots.dim() == 1 and tail_slots.shape[0] >= batch and rows == g:
        return 0
    if tail_slots.dim() != 2:
        raise ValueError(
            f"tail_slots must be [B] slots of a [num_slots, {g}, Hkv, D] pool or [B, N] blocks of rows, "
            f"got {tuple(tail_slots.shape)} with a pool of {rows} rows a slot"
        )
    if tail_slots.shape[0] < batch or tail_slots.shape[1] * rows < g:
        raise ValueError(f"tail_slots [B, N] must cover {batch} sequences and N * {rows} >= {g} rows, "
                         f"got {tuple(tail_slots.shape)}")  # fmt: skip
    if query_start_loc is not None or sink_slots is not None:
        raise ValueError("own tiles kept as block rows ([B, N] tail_slots) are read by decode launches without a sink")
    return rows


def _check_kv(key, value, query, cache) -> None:
    """``key, value``: both ``None``, or both ``[Nq, Hkv, D]`` in fp16/bf16."""
    if key is None and value is None:
        return
    if key is None or value is None:
        raise ValueError("key and value come together")
    check_dtype("key", key)
    want = (query.shape[0], cache.shape[1], query.shape[2])
    if key.shape != want or value.shape != want or value.dtype != key.dtype:
        raise ValueError(f"key and value must both be {list(want)} of one dtype, got {tuple(key.shape)}")


def _step_kv(key, value, qsl, seq_lens, tail_k, cfg: KVarNConfig, empty: Callable):
    """Where a launch reads the step's own tokens: ``(key, value)`` in the pool form, or ``None`` (the tail slot).

    Only a multi-query launch (``qsl`` given) reads ``key, value``: :func:`~kvarn.kernels.store.write_tail`
    takes them into a scratch pool of ``tail_k``'s dtype (one more launch), contiguous ``[Nq, Hkv, D]``
    rows. Without them the step's tokens come from the tail slot, which holds them only where each
    sequence's queries lie in one tile: a ``ValueError`` otherwise (a check that reads ``seq_lens``
    back to the host, skipped during graph capture). Decode gives ``None``.
    """
    if qsl is None:
        return None
    if key is None:
        _check_one_tile(seq_lens, qsl, cfg.group_size)
        return None
    nq, hkv, d = key.shape
    g = cfg.group_size
    k = empty(cdiv(nq, g), g, hkv, d, dtype=tail_k.dtype, device=key.device)
    v = empty(cdiv(nq, g), g, hkv, d, dtype=tail_k.dtype, device=key.device)
    write_tail(key, value, k, v, _rows(nq, key.device), cfg)
    return k, v


_aranges: dict[tuple[str, int], torch.Tensor] = {}


def _rows(n: int, device: torch.device) -> torch.Tensor:
    """``arange(n)`` as int32 on ``device`` (the scratch pool's slot mapping): a view of one buffer per
    device, declared persistent to launch plans (its values never change). Outgrown buffers stay alive
    (a captured graph may read one); while a graph is captured a buffer that is too small gives a
    fresh ``arange`` instead."""
    buf = _device_buffer(_aranges, device, n, lambda size: torch.arange(size, dtype=torch.int32, device=device))
    if buf is None:
        return torch.arange(n, dtype=torch.int32, device=device)
    return _plan.persistent(buf[:n])


def _check_one_tile(seq_lens: torch.Tensor, query_start_loc: torch.Tensor, g: int) -> None:
    """Raise where a sequence's queries span tiles (they need the step's ``key, value``); not while capturing."""
    if seq_lens.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return
    n = (query_start_loc[1:] - query_start_loc[:-1]).to(seq_lens.device)
    first, last = (seq_lens - n) // g, (seq_lens - 1) // g
    span = (n > 0) & (first != last)
    if bool(span.any()):
        b = int(span.nonzero()[0, 0])
        raise ValueError(
            f"sequence {b}'s queries span tiles {int(first[b])}..{int(last[b])}: pass the step's key and value"
        )


def _as_int32(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a plain int32 list (:func:`~kvarn.kernels._common.index_list`)."""
    return index_list(t if t.dtype == torch.int32 else t.to(torch.int32))


def _launch_prologue(
    query: torch.Tensor, cfg: KVarNConfig, scale: float, empty: Callable, records=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``query: [Nq, Hq, D]`` -> rotated, scaled fp32 ``[Nq, Hq, D]``, and the same smoothed with each
    sequence's vector for ``seq_smooth`` decode (``records = (cache, block_table, seq_lens)``; else
    the first output again)."""
    nq, hq, d = query.shape
    q = empty(nq, hq, d, dtype=torch.float32, device=query.device)
    q_s, cache, block_table, seq_lens, gq = q, q, q, q, 1
    if records is not None:
        cache, block_table, seq_lens = records
        q_s = empty(nq, hq, d, dtype=torch.float32, device=query.device)
        gq = hq // cache.shape[1]
    _plan.launch(
        _prologue_kernel,
        (nq,),
        query,
        q,
        query.stride(0),
        query.stride(1),
        hq,
        q_s,
        cache,
        block_table,
        seq_lens,
        cache.stride(0),
        cache.stride(1),
        block_table.stride(0),
        BLOCK_H=max(MIN_DOT_ROWS, next_pow2(hq)),
        LAYOUT=record_layout(cfg),
        ROTATE=cfg.rotate,
        IN_BF16=query.dtype == torch.bfloat16,
        FACTOR=_query_factor(cfg, scale),
        GQ=gq,
        SMOOTH=records is not None,
        num_warps=EDGE_NUM_WARPS,
    )
    return q, q_s


def _query_factor(cfg: KVarNConfig, scale: float) -> float:
    """What rotated queries are multiplied by: ``scale * log2(e)``, and ``1 / sqrt(D)`` of the Hadamard."""
    return scale * LOG2E * (inv_sqrt(cfg.head_dim) if cfg.rotate else 1.0)


def _launch_epilogue(part, ws_m, ws_l, splits: int, hq: int, out_dtype, cfg: KVarNConfig, empty: Callable, out=None):
    """Split partials ``part: [splits, Nq, Hq, D]`` -> the output ``[Nq, Hq, D]`` in ``out_dtype`` (into ``out``)."""
    _, nq, _, d = part.shape
    if out is None:
        out = empty(nq, hq, d, dtype=out_dtype, device=part.device)
    _plan.launch(
        _epilogue_kernel,
        (nq,),
        part,
        ws_m,
        ws_l,
        out,
        nq * hq,
        splits,
        hq,
        out.stride(0),
        out.stride(1),
        BLOCK_H=max(MIN_DOT_ROWS, next_pow2(hq)),
        LAYOUT=record_layout(cfg),
        SPLIT=splits > 1,
        ROTATE=cfg.rotate,
        OUT_BF16=out_dtype == torch.bfloat16,
        INV_SQRT_D=inv_sqrt(d),
        num_warps=EDGE_NUM_WARPS,
    )
    return out


def paged_attention(
    query: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    tail_k: torch.Tensor,
    tail_v: torch.Tensor,
    tail_slots: torch.Tensor,
    cfg: KVarNConfig,
    query_start_loc: torch.Tensor | None = None,
    sink_slots: torch.Tensor | None = None,
    scale: float | None = None,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int = ATTN_NUM_STAGES,
    fuse_query: bool | None = None,
    fuse_merge: bool | None = None,
    pair_tiles: bool | None = None,
    tokens_m: bool | None = None,
    fold_offsets: bool | None = None,
    counters: torch.Tensor | None = None,
    min_split_tiles: int | None = None,
    stack_tiles: bool | None = None,
    empty: Callable[..., torch.Tensor] = torch.empty,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``query: [Nq, Hq, D]`` over the paged cache -> ``[Nq, Hq, D]`` in ``query.dtype``.

    Same contract as :func:`kvarn.reference.paged_attention`: ``cache: [num_blocks, Hkv, record_bytes]``,
    ``block_table: [B, max_blocks]``, ``seq_lens: [B]``, ``tail_k, tail_v: [num_slots, G, Hkv, D]``,
    ``tail_slots: [B]`` (or ``[B, N]`` with ``tail_k, tail_v: [num_blocks, R, Hkv, D]``: own tiles kept as
    rows of blocks, decode without a sink), ``query_start_loc: [B + 1]`` or ``None`` (one query per sequence),
    ``sink_slots: [B]`` or ``None``, ``scale`` default ``1 / sqrt(D)``, ``key, value: [Nq, Hkv, D]``
    or ``None``, the own-tile rule. A decode launch (one query per sequence) reads the step's token
    from the tail slot (written there before attention) and ignores ``key, value``; see :func:`_step_kv`.

    Knobs (keyword only): ``num_splits`` forces the split-K factor (default :func:`default_splits`);
    ``num_warps`` (default :func:`decode_shape_default`), ``num_stages`` launch the attention kernel;
    ``fuse_query`` forces where the queries are rotated (default :func:`fuse_query_rotation`);
    ``fuse_merge`` whether the attention launch merges the splits (else the epilogue launch; default
    :func:`merge_in_kernel`);
    ``counters`` (int32 zeros, at least query blocks x Hkv entries; left zero) replaces the
    device's :func:`merge_counters`; ``pair_tiles`` walks two tiles per loop step (default
    :func:`pair_tiles_default`); ``tokens_m`` (decode only) puts the tokens on the M side of the
    score and value dots, the query heads on N (default :func:`tokens_m_default`);
    ``fold_offsets`` unpacks the K codes with one shift per code word and no subtraction
    (:func:`~kvarn.kernels.attention_tiles._unpack_raw`) and takes their offsets out of the zero-point term instead
    (default :func:`fold_offsets_default`; ``False`` centers each code before the dot, as the V codes always are:
    see :mod:`~kvarn.kernels.attention_tiles`); ``min_split_tiles``: the fewest tiles a split of a
    sequence walks (default :func:`min_split_tiles_default`); ``stack_tiles`` (decode with ``tokens_m``, at most 4
    query heads per KV head, padded to a power of two, not with ``pair_tiles``) scores and weighs two tiles a
    loop step in one dot each, stacked on M, the second tile in the query columns the heads leave free
    (default :func:`decode_shape_default`, only at its own warps when ``num_warps`` is forced); a forced
    ``num_warps`` of 1 or 2 takes the register cap too (``DECODE_MAX_REGS``); ``empty`` allocates the output and the
    workspaces (``torch.empty``'s signature; tests pass one that fills with NaN); ``out`` (``[Nq, Hq,
    D]`` in ``query.dtype``, unit last stride, e.g. a view of the caller's buffer) receives the
    result instead of a new tensor and is returned (no copy launch after the kernel).

    A ``smooth_keys`` config with per-tile vectors rotates each record tile's smoothed queries in
    the attention kernel itself: it needs ``fuse_query`` and ``tokens_m`` left at their defaults
    (or ``True`` / ``False``), and its launch is not tuned (no register cap). With one vector per
    sequence (``smooth_scope="sequence"``) the queries are smoothed once per program and every
    variant runs as for an unsmoothed config.

    Eager calls replay a launch plan from the third call of a shape on (:data:`PLANS`,
    :mod:`kvarn.kernels._plan`): decode calls, and multi-query calls given ``key, value``.
    """
    knobs = (num_splits, num_warps, num_stages, fuse_query, fuse_merge, pair_tiles, tokens_m, fold_offsets)
    knobs += (min_split_tiles, stack_tiles)
    inputs = (query, cache, block_table, seq_lens, tail_k, tail_v, tail_slots, query_start_loc, sink_slots, key, value)
    inputs += (counters, out)
    key_of = None
    if empty is torch.empty and (query_start_loc is None or key is not None):  # no check that reads seq_lens
        key_of = lambda: _plan_key(inputs, cfg, scale, knobs)

    def run(alloc: Callable) -> torch.Tensor:
        return _paged_attention(
            query, cache, block_table, seq_lens, tail_k, tail_v, tail_slots, cfg, query_start_loc, sink_slots,
            scale, key, value, *knobs, counters, alloc, out,
        )  # fmt: skip

    return PLANS.call(key_of, inputs, run)


PLANS = _plan.Planner()
"""Launch plans of eager calls (:mod:`kvarn.kernels._plan`): decode calls, and multi-query calls given the
step's ``key, value`` (without them the launcher reads ``seq_lens`` back to check the queries' tiles);
``PLANS.enabled = False`` turns replays off."""


def _plan_key(inputs: tuple, cfg: KVarNConfig, scale, knobs: tuple) -> tuple | None:
    """The launcher's part of a call's plan key: the config, scale and knobs (the planner adds the inputs'
    layouts). ``out`` is checked here too (:func:`_check_out`): a replay skips the launcher's checks,
    and whether ``out`` shares the query's memory is not in the key."""
    _check_out(inputs[-1], inputs[0])
    return cfg, scale, knobs, _TIMELINE[0]


def _paged_attention(
    query, cache, block_table, seq_lens, tail_k, tail_v, tail_slots, cfg, query_start_loc, sink_slots, scale, key,
    value, num_splits, num_warps, num_stages, fuse_query, fuse_merge, pair_tiles, tokens_m, fold_offsets,
    min_split_tiles, stack_tiles, counters, empty, out,
) -> torch.Tensor:  # fmt: skip
    """:func:`paged_attention` itself (the launcher its plans record)."""
    _check_args(query, cache, block_table, seq_lens, tail_k, tail_v, cfg, query_start_loc, (key, value))
    block_rows = _tail_block_rows(tail_slots, tail_k, cfg, seq_lens.shape[0], query_start_loc, sink_slots)
    fuse_query, tokens_m = _per_tile_smooth_knobs(cfg, fuse_query, tokens_m)
    _check_counts(num_splits=num_splits, min_split_tiles=min_split_tiles)
    nq, hq, d = query.shape
    hkv = cache.shape[1]
    batch = seq_lens.shape[0]
    multi_q = query_start_loc is not None
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    out = _check_out(out, query)
    if query.stride(-1) != 1:
        query = query.contiguous()
    seq_lens, query_start_loc = index_list(seq_lens), index_list(query_start_loc)
    if nq == 0:
        return torch.empty_like(query) if out is None else out
    dev = query.device
    gqp = next_pow2(hq // hkv)
    block_q = max(1, MIN_DOT_ROWS // gqp) if multi_q else 1
    n_blocks = cdiv(nq, block_q) + batch if multi_q else batch  # one spare block per sequence
    max_units = block_table.shape[1] + 1
    splits = num_splits or default_splits(cfg, n_blocks * hkv, max_units, multi_q, dev, tokens_m, ATTN_NUM_WARPS)
    if tokens_m is None:
        tokens_m = tokens_m_default(cfg, multi_q, n_blocks * hkv * splits, dev)
    tokens_m = not multi_q and tokens_m
    warps, stack = decode_shape_default(
        cfg, tokens_m, gqp, n_blocks * hkv * splits, cdiv(max_units, splits), dev, block_table.shape[1]
    )
    if num_warps is not None:  # the rule's stacking was timed at its own warps only
        stack, warps = stack and num_warps == warps, num_warps
    pair = pair_tiles_default(cfg, tokens_m) if pair_tiles is None else pair_tiles
    stack = _stack_tiles(stack_tiles, stack, gqp, tokens_m, pair)
    step = _step_kv(key, value, query_start_loc, seq_lens, tail_k, cfg, empty)
    if warps != ATTN_NUM_WARPS and not num_splits:  # the split choice depends on the launch's warps
        splits = default_splits(cfg, n_blocks * hkv, max_units, multi_q, dev, tokens_m, warps)
    if fuse_merge is None:
        fuse_merge = merge_in_kernel(n_blocks * hkv, splits, dev)
    if fuse_merge and splits > 1 and counters is None:
        counters = merge_counters(dev, n_blocks * hkv)
    merge = fuse_merge and (splits == 1 or counters is not None)
    if merge and splits > 1 and (counters.dtype != torch.int32 or counters.numel() < n_blocks * hkv):
        raise ValueError(f"counters must be int32 with at least {n_blocks * hkv} entries")
    part, ws_m, ws_l = _workspaces(merge, splits, query.shape, dev, empty)
    min_units = min_split_tiles or min_split_tiles_default(cfg, tokens_m, n_blocks * hkv)
    fused_q = fuse_query
    if fused_q is None:
        active = n_blocks * hkv * active_splits(max_units, splits, min_units)
        fused_q = fuse_query_rotation(cfg, n_blocks * hkv * splits, cdiv(max_units, splits), dev, warps, active)
    smooth_q = cfg.seq_smooth and not fused_q and not multi_q  # the prologue smooths the queries too
    q = q_s = query
    if not fused_q:
        q, q_s = _launch_prologue(query, cfg, scale, empty, (cache, block_table, seq_lens) if smooth_q else None)
    final = (empty(nq, hq, d, dtype=query.dtype, device=dev) if out is None else out) if merge else part
    grid = (n_blocks, hkv, splits)
    if block_rows:  # the kernel reads cdiv(G, R) blocks a row, rows contiguous
        tail_slots = tail_slots[:, : cdiv(cfg.group_size, block_rows)]
    slots = _as_int32(tail_slots)  # a no-op for int32 lists: no cast launch per call
    pool = (tail_k, tail_v, slots, slots if sink_slots is None else _as_int32(sink_slots), *(step or (tail_k, tail_v)))
    ws = (part, ws_m, ws_l, final, part if counters is None else counters)
    flags = (splits > 1, merge, cfg.rotate, query.dtype == torch.bfloat16, inv_sqrt(d))
    launch = {"num_warps": warps, "num_stages": num_stages, "FUSED_Q": fused_q, "FACTOR": _query_factor(cfg, scale)}
    launch.update(SMOOTH_Q=smooth_q, LATE_Q=smooth_q or (cfg.seq_smooth and fused_q))
    launch.update(HAS_SINK=sink_slots is not None, HAS_KV=step is not None)
    launch["TOKENS_M"] = tokens_m
    launch["PAIR"] = pair
    launch["FOLD"] = fold_offsets_default(cfg, launch["TOKENS_M"]) if fold_offsets is None else fold_offsets
    launch["min_units"] = min_units
    launch["STACK"] = stack
    if block_rows:
        launch["TAIL_ROWS"] = block_rows
    _launch_attention(
        grid, (q, q_s), query, cache, block_table, seq_lens, query_start_loc, pool, ws, cfg, flags, launch
    )
    if merge:
        return final
    return _launch_epilogue(part, ws_m, ws_l, splits, hq, query.dtype, cfg, empty, out)


def _stack_tiles(stack_tiles: bool | None, default: bool, gqp: int, tokens_m: bool, pair: bool) -> bool:
    """``stack_tiles`` as launched (``tokens_m``, ``pair`` as launched): the default, or the caller's choice
    checked against the launch before anything is launched."""
    if stack_tiles is None:
        return default and not pair
    if stack_tiles and (not tokens_m or 2 * gqp > TOKENS_M_MIN_ROWS or pair):
        raise ValueError(
            "stack_tiles=True needs a decode launch that takes tokens_m (one query per sequence, tokens_m=True "
            "or on by default; not for records smoothed per tile), at most "
            f"{TOKENS_M_MIN_ROWS // 2} query heads per KV head (padded to a power of two; got {gqp}) and pair_tiles "
            "not True"
        )
    return stack_tiles


TWO_WARP_D64_MIN_TILES = 8
TWO_WARP_D128_MIN_TILES = 16
STACK_MIN_TILES = 16
ONE_WARP_MIN_TOKENS = 2048
ONE_WARP_MAX_HEADS = 8
"""See :func:`decode_shape_default`."""


def decode_shape_default(
    cfg: KVarNConfig,
    tokens_m: bool,
    gqp: int,
    programs: int,
    tiles_per_split: int,
    device: torch.device,
    table_tiles: int,
) -> tuple[int, bool]:
    """Defaults of ``num_warps`` and ``stack_tiles`` for a launch of ``programs`` programs (splits included)
    whose splits walk up to ``tiles_per_split`` tiles of a block table ``table_tiles`` tiles wide.

    One warp for ``tokens_m`` decode launches on CUDA at ``D = 128`` with at most ``ONE_WARP_MAX_HEADS``
    query heads a KV head (``gqp``, padded) and a block table of ``ONE_WARP_MIN_TOKENS`` or more tokens,
    or 64-token tiles in launches over :func:`tokens_m_min_programs`: 255 registers, 8 programs an SM,
    each program a whole tile a warp, so the scores' max and sums over the tokens, the probabilities'
    move into the value dot and the scales' layouts stay inside the warp (7 ``BAR`` a step in the loop
    instead of 24 at 2 warps; 1,892 SASS a tile against 2 x 1,114, local sm_90 compile, k4v2). Measured
    on the H200 (session 21; the previous default -> 1 warp, k4v2_g128 unless named): 16 / 32K 159.4
    -> 154.0 and 152.5 us, 64 / 32K 564.9 -> 540.9, 8 / 32K 93.4 -> 88.5, 1 / 32K 38.9 -> 33.1, 2 / 32K
    62.5 -> 40.7, 4 / 128K 160.8 -> 150.1, 1 / 4K 23.1 -> 18.9, 32 / 4K 72.4 -> 61.3; k2v2 16 / 32K 148.4
    -> 143.4, k4v4 16 / 32K 203.8 -> 168.4; k4v2_g64 16 / 32K 288.4 -> 159.5, 4 / 128K 295.1 -> 158.2,
    64 / 4K 163.6 -> 93.4, 64 / 1K 62.8 -> 39.4; k4v4_g64 16 / 32K 313.3 -> 174.7. Level (within 3%) at
    4 and 8 / 4K, 64 / 4K and 4 / 32K; slower at 1K contexts of 128-token tiles (1 / 1K 14.7 -> 17.1,
    8 / 1K 20.3 -> 23.3, 64 / 1K 51.5 -> 55.2) and for 64-token tiles at 1 / 1K (16.3 -> 18.0), which
    keep the rules below. 16 heads a KV head spill at 1 warp (840 bytes of stack); ``D = 64`` was
    slower (16 / 32K 118.6 -> 126.5) and ``D = 256`` spills (1,272 bytes).

    Otherwise ``(ATTN_NUM_WARPS, False)`` except for ``tokens_m`` decode launches on CUDA of:

    - ``D = 64``, 128-token tiles, ``TWO_WARP_D64_MIN_TILES`` or more tiles a split: 2 warps (96
      registers, 10 programs per SM). Measured on the H200 (session 14, k4v2, 4 -> 2 warps): batch 16
      / 32K 177.5 -> 143.2 us, 4 / 128K 189.2 -> 150.1, 8 / 32K 110.1 -> 89.4, 64 / 4K 119.3 -> 114.4;
      k2v2 and k4v4 at 16 / 32K 200.5 -> 144.8 and 187.5 -> 149.3. Slower with short splits: 1 / 32K
      (4 tiles a split) 35.3 -> 49.0, 8 / 4K 30.1 -> 45.4.
    - ``D = 128``, 128-token tiles, ``TWO_WARP_D128_MIN_TILES`` or more tiles a split: 2 warps (128
      registers, 8 programs per SM). Once no step waited on a tile's scales (session 20), 4 -> 2 warps
      (k4v2 unless named): 16 / 32K 192.6 -> 159.7 us, 64 / 32K 707.2 -> 575.3, 32 / 32K 365.2 -> 290.3,
      8 / 32K 118.8 -> 94.0, 4 / 128K 201.5 -> 162.7, 16 / 128K 693.1 -> 554.8, 16 / 16K 113.9 -> 92.7,
      64 / 4K 119.9 -> 93.5, k2v2 16 / 32K 183.6 -> 148.7 and 8 / 32K 113.8 -> 87.4, k4v4 16 / 32K
      205.8 -> 204.2. Below 16 tiles mixed: faster at 32 / 4K (8 tiles, 73.4 -> 60.8) and 2 / 32K (4
      tiles, 62.6 -> 47.8), slower at 4 / 32K (8 tiles, 72.5 -> 79.8), level at 8 / 4K and 1 / 32K.
      (Before that change 2 warps had lost 37% at 4 / 32K and won 4-16% elsewhere, session 14.)
    - 64-token tiles at ``D = 128``: with ``STACK_MIN_TILES`` or more tiles a split, 2 warps for 2-bit
      values (4 for 4-bit). Session 14 had stacked tiles at 4 warps there (``stack_tiles``; k4v2_g64:
      16 / 32K 383.9 -> 356.2 us, 4 / 128K 383.9 -> 358.4, 8 / 32K 212.6 -> 202.6, 64 / 4K 211.1 -> 201.8,
      32 / 4K 119.8 -> 117.8; k4v4_g64 at 16 / 32K 378.5 -> 401.0); with the scales read ahead (session
      20) 2 warps unstacked beat them at every such shape timed, stacked -> 2 warps: 16 / 32K 312.5 ->
      288.4, 4 / 128K 317.2 -> 297.7, 8 / 32K 180.2 -> 163.1, 64 / 4K 180.6 -> 164.9, 32 / 4K 104.4 ->
      92.4, 16 / 16K 174.5 -> 154.0 (k4v4_g64 not timed at 2 warps there: it keeps 4, unstacked). With
      shorter splits over :func:`tokens_m_min_programs`, 2 warps (128
      registers, no duplicated unpack: a 64-token tile's 32 token pairs are one 16-row block per warp):
      k4v2_g64 8 / 4K 55.3 -> 42.1, 2 / 32K 94.7 -> 70.6, 16 / 4K 76.1 -> 67.4, k4v4_g64 8 / 4K 55.6 ->
      43.8 (timed with the rounded-up split rule); slower with fewer programs (4 / 4K 31.6 -> 36.4,
      1 / 32K 54.5 -> 62.7) and, in session 14, with long splits (16 / 32K 383.9 -> 515.2). Those
      tables now take 1 warp; below 2048 tokens 2 warps from one wave of ``PROGRAMS_PER_SM`` programs
      an SM (session 22, 4 -> 2 warps: 16 / 1K 26.8 -> 24.8 us, k4v4_g64 27.3 -> 25.4, level at 8 / 1K
      and 4 / 1K, slower at 1 and 2 / 1K: 16.1 -> 17.3, 17.1 -> 17.7).

    The 2-warp rules above were timed at 4 query heads per KV head (32 / 8) only; the 1-warp rule at 4 and 8
    (64 / 8: 16 / 32K 162.1 us against 168.4 at 2 warps and 199.0 at 4). In vLLM the block table is ``max_model_len``
    wide, so short sequences in a long-context engine count as long splits here.
    """
    if not tokens_m or device.type != "cuda":
        return ATTN_NUM_WARPS, False
    if cfg.head_dim == 128 and gqp <= ONE_WARP_MAX_HEADS:
        long_table = table_tiles * cfg.group_size >= ONE_WARP_MIN_TOKENS
        if long_table or (cfg.group_size == 64 and programs > tokens_m_min_programs(device)):
            return 1, False
    if cfg.head_dim == 64 and cfg.group_size == 128 and tiles_per_split >= TWO_WARP_D64_MIN_TILES:
        return 2, False
    if cfg.head_dim == 128 and cfg.group_size == 128 and tiles_per_split >= TWO_WARP_D128_MIN_TILES:
        return 2, False
    if cfg.head_dim == 128 and cfg.group_size == 64:
        if tiles_per_split >= STACK_MIN_TILES:
            return (2, False) if cfg.v_bits == 2 else (ATTN_NUM_WARPS, False)
        if programs >= PROGRAMS_PER_SM * _num_sms(device.index or 0):
            return 2, False
    return ATTN_NUM_WARPS, False


def _check_counts(**counts) -> None:
    """Each keyword's value is ``None`` or a positive int (the knobs of :func:`paged_attention` that count)."""
    for name, value in counts.items():
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive int or None, got {value!r}")


def _per_tile_smooth_knobs(cfg: KVarNConfig, fuse_query, tokens_m) -> tuple:
    """``(fuse_query, tokens_m)`` as launched: per-tile smoothed records take ``(True, False)`` and refuse others."""
    if not cfg.smooth_keys or cfg.seq_smooth:
        return fuse_query, tokens_m
    if fuse_query is False or tokens_m:
        raise ValueError(
            "smooth_keys records need the queries rotated per tile in the attention kernel: "
            f"fuse_query=False and tokens_m=True are not implemented for them (got {fuse_query=}, {tokens_m=})"
        )
    return True, False


def _workspaces(merge: bool, splits: int, shape, dev, empty: Callable) -> tuple[torch.Tensor, ...]:
    """The split partials ``[splits, Nq, Hq, D]`` (none when one split merges in the kernel) and the
    per-split running max and sum ``[splits, Nq, Hq]`` (only with several splits), fp32."""
    nq, hq, d = shape
    part = empty(0 if merge and splits == 1 else splits, nq, hq, d, dtype=torch.float32, device=dev)
    if splits == 1:
        return part, part, part
    ws_m = empty(splits, nq, hq, dtype=torch.float32, device=dev)
    return part, ws_m, empty(splits, nq, hq, dtype=torch.float32, device=dev)


def _check_out(out: torch.Tensor | None, query: torch.Tensor) -> torch.Tensor | None:
    """``out`` of :func:`paged_attention`, checked: the query's shape, dtype and device, unit last stride."""
    if out is None:
        return None
    if out.shape != query.shape or out.dtype != query.dtype or out.device != query.device or out.stride(-1) != 1:
        raise ValueError(
            f"out must be {tuple(query.shape)} {query.dtype} on {query.device} with a unit last stride, "
            f"got {tuple(out.shape)} {out.dtype} on {out.device} with strides {out.stride()}"
        )
    if out.untyped_storage().data_ptr() == query.untyped_storage().data_ptr():
        raise ValueError("out must not share memory with query (programs read queries while others write out)")
    return out


_TIMELINE = [0]
"""The ``TIMELINE`` buffer address of attention launches (0: none), set by :func:`decode_timeline`."""


@contextlib.contextmanager
def decode_timeline(buf: torch.Tensor):
    """Within the block, attention launches stamp per-program times into ``buf`` (a diagnostic, CUDA only).

    ``buf``: int64, contiguous, ``[rows, 8]`` on the GPU the calls run on, with a row for every program of
    the launches (``query blocks x Hkv x splits``; decode: ``batch x Hkv x splits``), row
    ``(block * Hkv + kv_head) * splits + split``. Columns (``%globaltimer``, ns, and the SM id) are
    :data:`~kvarn.kernels.attention_decode.TIMELINE_ENTRY` ..; in a launch that merges in the kernel a program
    without units writes the first two.
    The stamped kernel is a separate compile (the address is one of its constants) and a separate plan
    key; ``benchmarks/timeline_decode.py`` reads the stamps.
    """
    if buf.dtype != torch.int64 or buf.dim() != 2 or buf.shape[1] != 8 or not buf.is_contiguous():
        got = f"{buf.dtype} {tuple(buf.shape)}"
        raise ValueError(f"decode_timeline needs a contiguous int64 [rows, 8] buffer, got {got}")
    if buf.device.type != "cuda":
        raise ValueError("decode_timeline stamps %globaltimer on a CUDA device; the buffer is on " + str(buf.device))
    if _TIMELINE[0]:
        raise RuntimeError("decode_timeline is already active")
    _TIMELINE[0] = buf.data_ptr()
    try:
        yield buf
    finally:
        _TIMELINE[0] = 0


def _launch_attention(grid, qs, query, cache, block_table, seq_lens, qsl, pool, ws, cfg, flags, launch) -> None:
    """Launch the attention kernel; ``qs = (q, q_s)``: ``query`` or the prologue's outputs (``launch["FUSED_Q"]``);
    ``launch`` holds the kernel's keyword arguments and ``min_units`` (1 if absent)."""
    q, q_s = qs
    hkv = grid[1]
    nq, hq, d = query.shape
    gqa = hq // hkv
    gqp = next_pow2(gqa)
    multi_q = qsl is not None
    block_q = max(1, MIN_DOT_ROWS // gqp) if multi_q else 1
    tail_k, tail_v, tail_slots, sinks, key, value = pool
    part, ws_m, ws_l, final, counters = ws
    launch = dict(launch)
    min_units = launch.pop("min_units", 1)
    _plan.launch(
        _attn_kernel,
        grid,
        q,
        q_s,
        cache,
        block_table,
        seq_lens,
        tail_k,
        tail_v,
        tail_slots,
        sinks,
        qsl if multi_q else seq_lens,
        key,
        value,
        part,
        ws_m,
        ws_l,
        final,
        counters,
        seq_lens.shape[0],
        hq,
        q.stride(0),
        q.stride(1),
        final.stride(0) if flags[1] else hq * d,
        final.stride(1) if flags[1] else d,
        cache.stride(0),
        cache.stride(1),
        block_table.stride(0),
        tail_k.stride(0),
        tail_k.stride(1),
        tail_k.stride(2),
        nq * hq,
        grid[2],
        min_units,
        GQ=gqa,
        GQP=gqp,
        BLOCK_Q=block_q,
        BLOCK_M=max(TOKENS_M_MIN_ROWS if launch["TOKENS_M"] else MIN_DOT_ROWS, block_q * gqp),
        LAYOUT=record_layout(cfg),
        MULTI_Q=multi_q,
        POOL_BF16=tail_k.dtype == torch.bfloat16,
        USE_ASM=not interpreting(),
        IN_BF16=query.dtype == torch.bfloat16,
        MERGE_CH=max(1, MERGE_CHUNK // (block_q * gqp * d)),
        FLAGS=flags,
        maxnreg=_decode_max_regs(cfg, launch["num_warps"], multi_q),
        TIMELINE=_TIMELINE[0],
        **launch,
    )
