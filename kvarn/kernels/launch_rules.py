"""Launch rules of the kernels: what a launch takes by default, chosen from its shape.

Each function picks one choice of :func:`kvarn.kernels.attention.paged_attention` (split-K factor,
warps, tile stacking, where the queries are rotated, where the splits are merged, ...) from the
launch's shape and the device's SM count, or the warps of the store's encoder and of the record
pages; the constants are the thresholds they were tuned with.
The measurements behind them are in the tuning table of ``docs/internals/kernels.md``.
"""

from __future__ import annotations

import functools

import torch

from kvarn.config import KVarNConfig
from kvarn.kernels._common import cdiv

ATTN_NUM_WARPS = 4
ATTN_NUM_STAGES = 2
"""Launch configuration of the attention kernel where :func:`decode_shape_default` picks no 1 or 2 warps: more
warps or stages were slower."""
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
under one wave): a split's tiles amortize its program's set-up and its share of the merge."""
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
need one wave more fused than with the prologue, :func:`fuse_query_rotation` takes the prologue: a wave
costs more than the launch it saves."""
SMS_OFF_CUDA = 4
"""SM count the split choice assumes on a device without SMs (the CPU interpreter)."""
DECODE_MAX_REGS = {(64, 4): 96, (128, 4): 128, (64, 2): 96, (128, 2): 128, (128, 1): 255}
"""Register cap of the decode attention kernel by (head dim, warps): 5 / 4 programs per SM at 4 warps, 10 / 8
at 2 warps. Without it ptxas spends more registers on the in-kernel split merge than the main loop needs,
and fewer programs fit an SM. One warp at ``D = 128`` takes the whole 255 (8 programs per SM; tighter caps
spill); being in the table, it gets the capped kernel's whole-waves split rule (:func:`default_splits`).
D = 256 (220+ registers either way) and multi-query launches are left alone."""
TOKENS_M_WAVES = 2
TOKENS_M_PROGRAMS_PER_SM = 4
"""Split count of a ``tokens_m`` launch at ``D = 128`` (:func:`default_splits`): the most splits whose
programs fill at most ``TOKENS_M_WAVES`` whole waves of ``TOKENS_M_PROGRAMS_PER_SM`` programs per SM
(128 registers at 4 warps, ``DECODE_MAX_REGS``), where ``WAVES`` waves of ``PROGRAMS_PER_SM``, rounded
up, could leave a last wave nearly empty (32K/batch 16: 1280 programs are 2.4 waves of 528)."""
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
    :func:`tokens_m_default`); it is kept because the rule was timed with it, and raises the split
    count only for launches of 529-792 programs before splitting on 132 SMs."""
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
    SM (a small launch is latency-bound: its programs walk one tile each), twice that at ``D = 64``,
    whose tiles are half the work. ``SHORT_MIN_TILES`` when splits of ``MIN_TILES_PER_SPLIT`` tiles
    would fill less than one wave; else ``MIN_TILES_PER_SPLIT``.
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
    it saves the epilogue launch, which wins only for a few splits over many waves of programs.
    One split is always finished in the kernel: there is nothing to merge, so the epilogue would
    only add a launch and a round trip of fp32 partials.
    """
    sms = _num_sms(device.index or 0) if device.type == "cuda" else SMS_OFF_CUDA
    return splits == 1 or splits > EPILOGUE_MAX_SPLITS or programs * splits <= FUSE_MAX_WAVES * PROGRAMS_PER_SM * sms


def visible_units(max_units: int, group_size: int, window: int | None, block_q: int = 1) -> int:
    """The most units (tiles) one program of a launch walks: ``max_units`` (the block table's width and the own
    tile), or with a sliding ``window`` the tiles the window of ``block_q`` consecutive queries can touch
    (``cdiv(window + block_q - 2, G) + 1``), if fewer. The split rules count these: a window layer's walk is
    short however long the sequence."""
    if window is None:
        return max_units
    return min(max_units, cdiv(window + block_q - 2, group_size) + 1)


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
    queries (nearly twice the registers, half the programs per SM). Otherwise only for short
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
    With ``tokens_m`` one tile a step is faster.
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

    On at ``D = 128`` in every decode launch (64-token tiles too, walked one tile a step,
    :func:`pair_tiles_default`), at ``D = 256`` in every decode launch of 128-token tiles, at
    ``D = 64`` for 128-token tiles in launches of more than ``TOKENS_M_MIN_WAVES`` waves: the
    per-token work then runs on the query heads' N columns, not on 16 padded rows. 64-token tiles at
    other head dims keep the row path (not timed). Off for multi-query launches (not implemented)
    and off CUDA (the interpreter tests pick the variant explicitly).
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
    units over the splits) elsewhere: the row path was slower with 2 at batch 1-2, 64-token tiles
    gained nothing, multi-query launches were not timed.
    """
    if not tokens_m or cfg.group_size < 128:
        return 1
    return MIN_SPLIT_TILES if programs >= MIN_SPLIT_TILES_PROGRAMS else SHORT_SPLIT_TILES


def tokens_m_min_programs(device: torch.device) -> int:
    """``TOKENS_M_MIN_WAVES`` waves of programs: ``tokens_m`` is the default at ``D != 128`` above this."""
    return TOKENS_M_MIN_WAVES * PROGRAMS_PER_SM * _num_sms(device.index or 0)


def fold_offsets_default(cfg: KVarNConfig, tokens_m: bool) -> bool:
    """Default of ``fold_offsets``: on for ``tokens_m`` launches at ``D = 128``, off elsewhere.

    Folding the K codes' offsets into the zero-point term saves the per-code centering, faster there
    than centering in place (``IN_PLACE_MAX_D``). Off where it was not faster: ``D = 256`` (more
    registers, fewer programs per SM), ``D = 64`` (spills under the 96-register cap) and the row path
    without ``tokens_m``.
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
    move into the value dot and the scales' layouts stay inside the warp (no barriers across warps).
    Shorter tables (1K) were slower at one warp and keep the rules below; 16 heads a KV head and
    ``D = 256`` spill at one warp, and ``D = 64`` was slower.

    Otherwise ``(ATTN_NUM_WARPS, False)`` except for ``tokens_m`` decode launches on CUDA of:

    - ``D = 64``, 128-token tiles, ``TWO_WARP_D64_MIN_TILES`` or more tiles a split: 2 warps (96
      registers, 10 programs per SM); slower with short splits.
    - ``D = 128``, 128-token tiles, ``TWO_WARP_D128_MIN_TILES`` or more tiles a split: 2 warps (128
      registers, 8 programs per SM); below that mixed.
    - 64-token tiles at ``D = 128``: with ``STACK_MIN_TILES`` or more tiles a split, 2 warps for 2-bit
      values (4 for 4-bit), unstacked (faster than ``stack_tiles`` at every such shape timed); with
      shorter splits 2 warps from one wave of ``PROGRAMS_PER_SM`` programs an SM (no duplicated unpack:
      a 64-token tile's 32 token pairs are one 16-row block per warp), slower with fewer programs.

    The 2-warp rules above were timed at 4 query heads per KV head (32 / 8) only; the 1-warp rule at 4 and
    8. In vLLM the block table is ``max_model_len`` wide, so short sequences in a long-context engine count
    as long splits here.
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
and smoothed K halves with 8: more threads to hold the tile (a smoothed K half spills at 4)."""


def default_encode_warps(cfg: KVarNConfig) -> int:
    """Warps per program of the encode kernel unless the caller picks them (see ``ENCODE_SMALL_TILE``)."""
    return 4 if cfg.head_dim * cfg.group_size <= ENCODE_SMALL_TILE and not cfg.smooth_keys else 8


RECORD_SMALL_TILE = 64 * 128
"""Tiles of up to this many elements (``G * D``) run the record-page kernel with 4 warps, larger ones with 8:
at ``G = D = 128`` 4 warps spill, 8 do not."""


def record_pages_warps(cfg: KVarNConfig) -> int:
    """Warps per program of the record-page kernel (see ``RECORD_SMALL_TILE``)."""
    return 4 if cfg.group_size * cfg.head_dim <= RECORD_SMALL_TILE else 8
