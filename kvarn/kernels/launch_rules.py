"""Launch rules of the attention kernels: what a launch takes by default, chosen from its shape.

Each function picks one choice of :func:`kvarn.kernels.attention.paged_attention` (split-K factor,
warps, tile stacking, where the queries are rotated, where the splits are merged, ...) from the
launch's shape and the device's SM count; the constants are the thresholds they were tuned with.
The measurements behind them are in the tuning table of ``docs/kernels.md``.
"""

from __future__ import annotations

import functools

import torch

from kvarn.config import KVarNConfig
from kvarn.kernels._common import cdiv

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
    capped = decode_max_regs(cfg, num_warps, multi_q) is not None
    if tokens_m is None:
        tokens_m = tokens_m_default(cfg, multi_q, programs * splits, device)
    if cfg.head_dim != 128 or not capped or not tokens_m or device.type != "cuda":
        return splits
    sms = _num_sms(device.index or 0)
    whole = TOKENS_M_WAVES * TOKENS_M_PROGRAMS_PER_SM * sms // programs
    still_tokens_m = tokens_m_min_programs(device) // programs + 1
    return max(1, min(max(whole, still_tokens_m), max_units // min_tiles, MAX_SPLITS))


def decode_max_regs(cfg: KVarNConfig, num_warps: int, multi_q: bool) -> int | None:
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


ENCODE_SMALL_TILE = 128 * 128
"""Tiles of up to this many elements (``D * G``) run the encoder with 4 warps per program, larger ones
and smoothed K halves with 8 (``benchmarks/RESULTS.md`` has the sweeps)."""


def default_encode_warps(cfg: KVarNConfig) -> int:
    """Warps per program of the encode kernel unless the caller picks them (see ``ENCODE_SMALL_TILE``)."""
    return 4 if cfg.head_dim * cfg.group_size <= ENCODE_SMALL_TILE and not cfg.smooth_keys else 8


RECORD_SMALL_TILE = 64 * 128
"""Tiles of up to this many elements (``G * D``) run the record-page kernel with 4 warps, larger ones with 8
(offline sm_90 compile at G = D = 128: 4 warps spill, 8 do not)."""


def record_pages_warps(cfg: KVarNConfig) -> int:
    """Warps per program of the record-page kernel (see ``RECORD_SMALL_TILE``)."""
    return 4 if cfg.group_size * cfg.head_dim <= RECORD_SMALL_TILE else 8
